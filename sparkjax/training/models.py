"""Drafters to train: continue a DeepSpec checkpoint (possibly at another block size, :func:`load_drafter_for_training`)
or a new DSpark drafter for any Qwen3 target (:func:`new_drafter_config`, :func:`init_drafter`)."""

from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..config import DrafterConfig, Qwen3Config, read_json
from ..errors import CheckpointError, ConfigError
from ..io.hf import load_into, resolve_dtype
from ..io.keymaps import DRAFTER_KEYS
from ..io.safetensors import WeightFiles
from ..nn.drafter import Drafter
from ..pairing import check_pair

NEW_DRAFTER_DEFAULTS: dict[str, Any] = {"block_size": 16, "num_draft_layers": 5, "markov_rank": 256,
                                        "markov_head_type": "vanilla", "enable_confidence_head": True,
                                        "confidence_head_with_markov": True}


def spread_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """``count`` target layers spread evenly over ``[1, L - 3]`` (``[1, 9, 17, 25, 33]`` for 36 / 5)."""
    hi = max(1, num_target_layers - 3)
    return sorted({int(round(x)) for x in np.linspace(1, hi, count)})


def new_drafter_config(target_config: Qwen3Config, settings: dict[str, Any], *, source: str = "drafter",
                       ) -> DrafterConfig:
    """A DSpark config for ``target_config`` (its backbone sizes, evenly spread ``target_layer_ids``) from
    DeepSpec-style ``settings`` over :data:`NEW_DRAFTER_DEFAULTS` (``mask_token_id`` is required; any Qwen3
    backbone key, e.g. ``intermediate_size``, may be overridden)."""
    s = {**NEW_DRAFTER_DEFAULTS, **settings}
    if s.get("mask_token_id") is None:
        raise ConfigError(f"{source}: key 'mask_token_id' is required for a new drafter (an id the tokenizer "
                          "never produces, e.g. 151669 for Qwen3)")
    d = target_config.to_hf_dict()
    n_layers = s.pop("num_draft_layers")
    count = s.pop("num_target_feature_layers", 5 if target_config.num_hidden_layers >= 8 else 2)
    ids = s.pop("target_layer_ids", None) or spread_layer_ids(target_config.num_hidden_layers, count)
    d.update(
        architectures=["Qwen3DSparkModel"], num_hidden_layers=n_layers, target_layer_ids=list(ids),
        num_target_layers=target_config.num_hidden_layers, tie_word_embeddings=False,
        layer_types=["full_attention"] * int(n_layers) if isinstance(n_layers, int) else None,
    )
    d.update(s)
    return DrafterConfig.from_hf_config(d, source=source)


def init_drafter(target, config: DrafterConfig, *, seed: int = 0, dtype: Any = None):
    """A new drafter with random weights and the target's embedding / LM head (copied)."""
    check_pair(target, config, drafter_source="drafter settings")
    dt = jnp.dtype(dtype) if dtype is not None else jnp.dtype(target.dtype)
    drafter = Drafter(config, rngs=nnx.Rngs(seed), dtype=dt)
    embed = target.embed_tokens.embedding[...]
    head = embed if target.lm_head is None else target.lm_head.weight[...]
    drafter.embed_tokens.embedding.set_value(jnp.asarray(embed, dt))
    drafter.lm_head.weight.set_value(jnp.asarray(head, dt))
    return drafter


def load_drafter_for_training(path: str, target, overrides: dict[str, Any] | None = None, dtype: Any = None):
    """Loads a DeepSpec DSpark folder with ``config.json`` keys replaced by ``overrides``, checked against
    ``target``; tensors that do not fit the config raise CheckpointError naming the file and the key."""
    folder = str(path)
    config_path = os.path.join(folder, "config.json")
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder}: not a folder")
    raw = read_json(config_path, CheckpointError)
    overrides = dict(overrides or {})
    if "num_draft_layers" in overrides:
        overrides["num_hidden_layers"] = overrides.pop("num_draft_layers")
    source = config_path + (f" (with overrides {sorted(overrides)})" if overrides else "")
    cfg = DrafterConfig.from_hf_config({**raw, **overrides}, source=source)
    if cfg.kind != "dspark":
        raise ConfigError(f"{config_path}: training continues DSpark drafters, this is a {cfg.kind} checkpoint")
    check_pair(target, cfg, drafter_source=config_path)
    files = WeightFiles(folder)
    dt = resolve_dtype(dtype, files.dtype())
    try:
        return load_into(lambda: Drafter(cfg, rngs=nnx.Rngs(0), dtype=dt), files, DRAFTER_KEYS, dtype=dt)
    except CheckpointError as e:
        if overrides:
            raise CheckpointError(f"{e} (the overrides {overrides} change parameter shapes)") from None
        raise
