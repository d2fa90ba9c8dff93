"""Hugging Face checkpoint folders: loading (one tensor at a time; a bad tensor is a CheckpointError naming the file
and the key) and saving (atomically) the Qwen3 target and the drafters.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from ..config import DrafterConfig, Qwen3Config
from ..errors import ArgumentError, CheckpointError
from ..nn.drafter import Drafter
from ..nn.qwen3 import Qwen3
from ..pairing import IO_TABLES, check_pair, record_source
from ..sharding import DEFAULT_RULES, param_shardings
from .atomic import atomic_dir, check_destination
from .keymaps import DRAFTER_KEYS, QWEN3_KEYS, Rule, _checkpoint_shape, _to_checkpoint, _to_module, param_keys
from .safetensors import _FLOAT_DTYPES, _ST_NAMES, WeightFiles, _all_finite, _non_finite_error, write_safetensors

PathLike = str | os.PathLike
_MODEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _require_model(model, cls, func: str, what: str, other: str) -> None:
    """Writers take only the model class they can write back (a wrong one would make an unloadable folder)."""
    if isinstance(model, cls):
        return
    hint = ""
    if type(model).__name__ in ("Qwen3", "Drafter"):
        hint = f" (use {other} for a {type(model).__name__})"
    raise ArgumentError(f"{func}: model must be {what} ({cls.__module__}.{cls.__name__}), "
                        f"got {type(model).__name__}{hint}")


def resolve_dtype(dtype: Any, default: Any, argument: str = "dtype") -> Any:
    """The model dtype: ``dtype`` when given, else ``default``; either must be float32, bfloat16 or float16."""
    if dtype is None:
        dt = jnp.dtype(default)
        if dt not in _MODEL_DTYPES:
            raise ArgumentError(f"{argument}: the checkpoint's dtype {dt} cannot be used for a model; pass {argument}=")
        return dt
    try:
        dt = jnp.dtype(dtype)
    except (TypeError, ValueError):
        raise ArgumentError(f"{argument}: unknown dtype {dtype!r:.80}") from None
    if dt not in _MODEL_DTYPES:
        raise ArgumentError(f"{argument}: expected float32, bfloat16 or float16, got {dt}")
    return dt


def load_into(build: Callable[[], nnx.Module], files: WeightFiles, rules: Sequence[Rule], *, dtype: Any,
              ignore: Sequence[str] = (), shared: dict[tuple, Any] | None = None, check_finite: bool = True,
              mesh: Any = None, sharding_rules: Any = None) -> nnx.Module:
    """Builds ``build()`` abstractly and fills its parameters from ``files`` through ``rules``.

    ``ignore``: checkpoint keys skipped when present (a tied ``lm_head.weight``); ``shared``: values for module
    paths not in the checkpoint. Every tensor must have the parameter's shape and a floating dtype; it is converted
    to ``dtype`` and, with ``check_finite``, must be finite (else CheckpointError naming the file and the key). With
    ``mesh``, each tensor goes straight onto its sharding from ``sharding_rules`` (default ``DEFAULT_RULES``).
    """
    abstract = nnx.eval_shape(build)
    shardings = None
    if mesh is not None:
        try:
            tree = param_shardings(abstract, mesh, DEFAULT_RULES if sharding_rules is None else sharding_rules)
        except (ValueError, KeyError) as e:  # a rule names an axis the mesh does not have
            raise ArgumentError(f"mesh: axes {tuple(mesh.axis_names)} do not fit the sharding rules ({e})") from None
        flat_sh = dict(nnx.to_flat_state(tree))
        shardings = {p: (v.get_value() if isinstance(v, nnx.Variable) else v) for p, v in flat_sh.items()}
        _check_mesh_fits(abstract, shardings, files.folder)
    graphdef, state = nnx.split(abstract)
    shared = shared or {}
    flat = dict(nnx.to_flat_state(state))
    mapping = [(p, k, lay) for p, k, lay in param_keys(state, rules) if p not in shared]
    expected = {k for _, k, _ in mapping}
    available = set(files.keys())

    def more(keys: list) -> str:
        return f"'{keys[0]}'" + (f" (and {len(keys) - 1} more)" if len(keys) > 1 else "")

    if missing := sorted(expected - available):
        raise CheckpointError(f"{files.describe()}: missing tensor {more(missing)}")
    if unexpected := sorted(available - expected - set(ignore)):
        raise CheckpointError(f"{files.folder}/{files.where[unexpected[0]]}: unexpected tensor {more(unexpected)}")
    dt = np.dtype(jnp.dtype(dtype))
    for path, key, layout in mapping:
        var = flat[path]
        shape = tuple(var.get_value().shape)
        want = _checkpoint_shape(layout, shape)
        src = files.file_of(key)
        got = src.shape(key)
        if tuple(got) != want:
            raise CheckpointError(f"{src.path}: tensor '{key}' has shape {list(got)}, expected {list(want)}")
        stored = src.dtype(key)
        if stored not in _FLOAT_DTYPES:
            raise CheckpointError(f"{src.path}: tensor '{key}' is stored as {_ST_NAMES[stored]}; parameters must be "
                                  "floating-point (F32, BF16, F16 or F64)")
        raw = src.read(key)
        with np.errstate(over="ignore", invalid="ignore"):  # reported below, naming the tensor
            host = _to_module(layout, raw, shape).astype(dt, copy=False)
        if check_finite and not _all_finite(host):
            raise _non_finite_error(src.path, key, raw, dt)
        del raw
        var.set_value(_place(host, None if shardings is None else shardings.get(path)))
        del host
    for path, value in shared.items():
        sh = None if shardings is None else shardings.get(path)
        flat[path].set_value(value if sh is None else jax.device_put(value, sh))
    return nnx.merge(graphdef, state)


def _folder(path: PathLike, mesh: Any, func: str) -> str:
    """A loader's checked ``path`` (a folder) and ``mesh`` (a :class:`jax.sharding.Mesh` or None)."""
    if mesh is not None and not isinstance(mesh, Mesh):
        raise ArgumentError(f"{func}: mesh must be a jax.sharding.Mesh (e.g. sparkjax.sharding.make_mesh), "
                            f"got {type(mesh).__name__}")
    if not os.path.isdir(str(path)):
        raise CheckpointError(f"{path}: not a folder")
    return str(path)


def _check_mesh_fits(abstract: nnx.Module, shardings: dict, folder: str) -> None:
    """Every sharded dimension divides by its mesh axes, which exist (else ArgumentError naming the parameter)."""
    flat = dict(nnx.to_flat_state(nnx.state(abstract, nnx.Param)))
    for path, sh in shardings.items():
        shape = tuple(flat[path].get_value().shape)
        name = ".".join(str(p) for p in path)
        for dim, (size, axes) in enumerate(zip(shape, tuple(sh.spec) + (None,) * len(shape), strict=False)):
            if axes is None:
                continue
            names = (axes,) if isinstance(axes, str) else tuple(axes)
            for ax in names:
                if ax not in sh.mesh.shape:
                    raise ArgumentError(f"mesh: has axes {tuple(sh.mesh.axis_names)}, but the sharding rules place "
                                        f"parameter '{name}' on an axis named '{ax}'")
            n = int(np.prod([sh.mesh.shape[a] for a in names]))
            if size % n:
                raise ArgumentError(
                    f"mesh: {folder}: parameter '{name}' has {size} along dimension {dim}, which does not divide "
                    f"over mesh axis {axes!r} of size {n}"
                )


def _place(host: np.ndarray, sharding) -> jax.Array:
    """A host tensor on the default device, or on ``sharding`` (each device gets only its own slice)."""
    if sharding is None:
        return jnp.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def export_tensors(model: nnx.Module, rules: Sequence[Rule], *, skip: Sequence[tuple] = ()) -> dict[str, np.ndarray]:
    """The model's parameters as checkpoint-layout NumPy arrays keyed by checkpoint name."""
    state = nnx.state(model, nnx.Param)
    flat = dict(nnx.to_flat_state(state))
    return {key: np.ascontiguousarray(_to_checkpoint(layout, np.asarray(jax.device_get(flat[path].get_value()))))
            for path, key, layout in param_keys(state, rules) if path not in skip}


# ----------------------------------------------------------------------------- Qwen3 target

def load_target(path: PathLike, dtype: Any = None, *, mesh: Any = None, sharding_rules: Any = None):
    """Loads a Hugging Face Qwen3 folder (``config.json`` + ``model.safetensors`` or shards).

    ``dtype`` (``"float32"``, ``"bfloat16"``, ``"float16"``) defaults to the safetensors header's (float64 or mixed
    float dtypes load as float32). Every failure raises a :class:`~sparkjax.errors.SparkjaxError` naming the file and
    the key. ``mesh`` / ``sharding_rules``: see :func:`load_into`; a sharded dimension that does not divide over its
    mesh axis raises ArgumentError before any tensor is read.
    """
    folder = _folder(path, mesh, "load_target")
    cfg = Qwen3Config.from_hf_config(os.path.join(folder, "config.json"))
    files = WeightFiles(folder)
    dt = resolve_dtype(dtype, files.dtype())
    ignore = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    model = load_into(lambda: Qwen3(cfg, rngs=nnx.Rngs(0), dtype=dt), files, QWEN3_KEYS, dtype=dt, ignore=ignore,
                      mesh=mesh, sharding_rules=sharding_rules)
    record_source(model, folder)  # named in drafter/target compatibility errors
    return model


def save_target(model, path: PathLike, *, overwrite: bool = False, dtype: Any = None) -> str:
    """Writes a Qwen3 model as a Hugging Face folder (``config.json`` + ``model.safetensors``), atomically;
    ``overwrite=True`` replaces only a folder sparkjax wrote or an empty one (see :mod:`sparkjax.io.atomic`)."""
    _require_model(model, Qwen3, "save_target", "a Qwen3 target", "save_drafter")
    check_destination(path, overwrite=overwrite)  # before the export, so a refusal costs nothing
    cfg: Qwen3Config = model.config
    return _write_hf_folder(path, cfg.to_hf_dict(), export_tensors(model, QWEN3_KEYS), dtype, overwrite)


def _write_hf_folder(path: PathLike, config: dict, tensors: dict, dtype: Any, overwrite: bool) -> str:
    """``config.json`` (with the tensors' ``dtype``) and ``model.safetensors`` into ``path``, atomically;
    ``dtype`` (None: as exported) converts the tensors first."""
    if dtype is not None:
        dt = resolve_dtype(dtype, None)
        tensors = {k: v.astype(dt) for k, v in tensors.items()}
    config["dtype"] = str(np.dtype(next(iter(tensors.values())).dtype))
    with atomic_dir(path, overwrite=overwrite) as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        write_safetensors(os.path.join(tmp, "model.safetensors"), tensors, {"format": "pt"})
    return str(path)


# ----------------------------------------------------------------------------- drafters (DSpark / DFlash)

def load_drafter(path: PathLike, target=None, dtype: Any = None, *, mesh: Any = None, sharding_rules: Any = None):
    """Loads a DeepSpec DSpark or z-lab DFlash drafter folder (format detected from ``config.json``).

    With ``target`` (a loaded Qwen3, else ArgumentError) the pair is checked first (:func:`sparkjax.pairing.check_pair`,
    before any tensor is read). ``dtype``, ``mesh``, ``sharding_rules`` and the checks are as in :func:`load_target`.
    """
    folder = _folder(path, mesh, "load_drafter")
    config_path = os.path.join(folder, "config.json")
    if target is not None and not isinstance(target, Qwen3):
        raise ArgumentError(
            f"target: expected a target model from sparkjax.load_target (a Qwen3), got {type(target).__name__}"
        )
    cfg = DrafterConfig.from_hf_config(config_path)
    files = WeightFiles(folder)
    if target is not None:
        stored = {key: (files.file_of(key).shape(key), files.file_of(key).path) for key in IO_TABLES
                  if key in files.where}
        check_pair(target, cfg, drafter_source=config_path, drafter_tensors=stored)
    dt = resolve_dtype(dtype, files.dtype())
    model = load_into(lambda: Drafter(cfg, rngs=nnx.Rngs(0), dtype=dt), files, DRAFTER_KEYS, dtype=dt, mesh=mesh,
                      sharding_rules=sharding_rules)
    record_source(model, folder)
    return model


def save_drafter(drafter, path: PathLike, *, overwrite: bool = False, dtype: Any = None) -> str:
    """Writes a drafter in its own format (DeepSpec DSpark or z-lab DFlash), atomically, with its original
    ``config.json`` updated; ``overwrite`` as in :func:`save_target`."""
    _require_model(drafter, Drafter, "save_drafter", "a drafter", "save_target")
    check_destination(path, overwrite=overwrite)
    tensors = dict(sorted(export_tensors(drafter, DRAFTER_KEYS).items()))
    return _write_hf_folder(path, drafter.config.to_hf_dict(), tensors, dtype, overwrite)
