"""Saving and restoring converted models with orbax (the only module that imports orbax).

A saved model is a folder with ``sparkjax.json`` (what kind of model and its
config) and ``state/`` (the orbax checkpoint of its parameters). Saving writes
to a temp folder beside the destination and renames it when complete, so an
interrupted save never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from .config import Qwen3Config, read_json
from .convert import atomic_dir
from .errors import CheckpointError

PathLike = str | os.PathLike
_META = "sparkjax.json"


def save_model(model: nnx.Module, path: PathLike, *, overwrite: bool = False) -> str:
    """Saves a Qwen3 target with orbax, atomically."""
    from .nn.qwen3 import Qwen3

    if not isinstance(model, Qwen3):
        raise CheckpointError(f"{path}: save_model supports Qwen3 targets, got {type(model).__name__}")
    meta = {"kind": "qwen3", "dtype": str(jnp.dtype(model.dtype)), "config": model.config.to_hf_dict()}
    state = nnx.state(model, nnx.Param)
    with atomic_dir(path, overwrite=overwrite) as tmp:
        with open(os.path.join(tmp, _META), "w") as f:
            json.dump(meta, f, indent=2)
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(os.path.join(tmp, "state"), state)
        ckptr.wait_until_finished()
        ckptr.close()
    return str(path)


def restore_model(path: PathLike, dtype: Any = None) -> nnx.Module:
    """Restores a model saved by :func:`save_model` (optionally cast to ``dtype``)."""
    from .convert import resolve_dtype
    from .nn.qwen3 import Qwen3

    folder = str(path)
    meta_path = os.path.join(folder, _META)
    meta = read_json(meta_path)
    if meta.get("kind") != "qwen3":
        raise CheckpointError(f"{meta_path}: unknown model kind {meta.get('kind')!r}")
    cfg = Qwen3Config.from_hf_config(meta.get("config") or {}, source=meta_path)
    saved = resolve_dtype(meta.get("dtype"), None)
    abstract = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0), dtype=saved))
    graphdef, state = nnx.split(abstract)
    state_dir = os.path.join(folder, "state")
    if not os.path.isdir(state_dir):
        raise CheckpointError(f"{state_dir}: missing orbax state folder")
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore(state_dir, target)
    except Exception as e:  # orbax raises many types for damaged folders
        raise CheckpointError(f"{state_dir}: cannot restore orbax checkpoint ({type(e).__name__}: {e})") from None
    model = nnx.merge(graphdef, restored)
    if dtype is not None:
        dt = resolve_dtype(dtype, None)
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda x: x.astype(dt), params))
    return model
