"""The one target/drafter compatibility check, run by every entry point before a drafter is used with a target.

Every mismatch raises :class:`~sparkjax.errors.IncompatiblePairError` reading
``drafter SRC does not fit target SRC: FIELD: detail``; :func:`source_of` gives the folder a model was loaded from.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

from .config import DrafterConfig, Qwen3Config
from .errors import ArgumentError, IncompatiblePairError

# The DSpark drafter's own input/output tables, which must have the target's shapes.
IO_TABLES = ("embed_tokens.weight", "lm_head.weight")

# Where each loaded model came from. Kept outside the module: a plain attribute would become part of
# the NNX graphdef, so the same architecture loaded from two folders would compile twice.
_SOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def record_source(model, folder: str) -> None:
    """Remembers that ``model`` was loaded from ``folder`` (the loaders of :mod:`sparkjax.io.hf` call this)."""
    _SOURCES[model] = folder


def source_of(model) -> str | None:
    """The folder a model was loaded from (None for a model built in memory)."""
    return _SOURCES.get(model)


def _split(x: Any, argument: str, kind: type) -> tuple[Any, Any]:
    """``(config, model or None)`` of a model or a bare config of type ``kind``."""
    cfg = getattr(x, "config", None)
    if isinstance(cfg, kind) and not isinstance(x, Qwen3Config):
        model = x
    elif isinstance(x, kind):
        cfg, model = x, None
    else:
        cfg = None
    want = "a drafter (sparkjax.load_drafter) or its DrafterConfig" if kind is DrafterConfig else \
        "a Qwen3 target (sparkjax.load_target) or its Qwen3Config"
    if cfg is None or (kind is Qwen3Config and isinstance(cfg, DrafterConfig)):
        raise ArgumentError(f"{argument}: expected {want}, got {type(x).__name__}")
    return cfg, model


def _source(model, given: str | None, what: str) -> str:
    if given is not None:
        return given
    if model is None:
        return f"<{what} config>"
    src = source_of(model)
    return f"{src}/config.json" if src else f"<{what} model>"


def _table_shapes(model, cfg: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """The target's embedding / LM-head shapes (the tied head reuses the embedding)."""
    if model is None:
        return dict.fromkeys(IO_TABLES, (cfg.vocab_size, cfg.hidden_size))
    embed = tuple(model.embed_tokens.embedding.get_value().shape)
    head = embed if model.lm_head is None else tuple(model.lm_head.weight.get_value().shape)
    return {"embed_tokens.weight": embed, "lm_head.weight": head}


def check_pair(target: Any, drafter: Any, *, target_source: str | None = None, drafter_source: str | None = None,
               drafter_tensors: Mapping[str, tuple[tuple[int, ...], str]] | None = None) -> None:
    """Checks that ``drafter`` fits ``target``; raises IncompatiblePairError naming both and the field.

    ``target``: a Qwen3 or a Qwen3Config; ``drafter``: a Drafter or a DrafterConfig (anything else:
    :class:`~sparkjax.errors.ArgumentError`). Sources default to ``FOLDER/config.json`` of a loaded model.
    Checked, in order: ``hidden_size`` and ``vocab_size``; ``target_layer_ids`` in ``[-1, L - 2]``;
    ``num_target_layers``; ``mask_token_id``; for DSpark, the ``embed_tokens`` / ``lm_head`` shapes of
    ``drafter_tensors`` (``key -> (shape, file)``, a checkpoint about to be loaded) or of the model.
    """
    tc, t_model = _split(target, "target", Qwen3Config)
    dc, d_model = _split(drafter, "drafter", DrafterConfig)
    t_src = _source(t_model, target_source, "target")
    d_src = _source(d_model, drafter_source, "drafter")

    def fail(detail: str):
        raise IncompatiblePairError(f"drafter {d_src} does not fit target {t_src}: {detail}")

    if dc.hidden_size != tc.hidden_size or dc.vocab_size != tc.vocab_size:
        field = "hidden_size" if dc.hidden_size != tc.hidden_size else "vocab_size"
        fail(f"{field}: drafter vs target hidden_size {dc.hidden_size} vs {tc.hidden_size}, "
             f"vocab_size {dc.vocab_size} vs {tc.vocab_size} (both must match)")
    n = tc.num_hidden_layers
    for lid in dc.target_layer_ids:
        if lid == n - 1:
            fail(f"target_layer_ids: entry {lid} is the target's final layer (its hidden state is final-normed)")
        if not -1 <= lid < n - 1:
            fail(f"target_layer_ids: entry {lid} of target_layer_ids {list(dc.target_layer_ids)} is outside "
                 f"[-1, {n - 2}] for a target with {n} layers")
    if dc.num_target_layers is not None and dc.num_target_layers != n:
        fail(f"num_target_layers: drafter expects {dc.num_target_layers} target layers, target has {n}")
    if not 0 <= dc.mask_token_id < tc.vocab_size:
        fail(f"mask_token_id: {dc.mask_token_id} is outside the target vocabulary [0, {tc.vocab_size})")
    if dc.kind != "dspark":
        return
    want = _table_shapes(t_model, tc)
    if drafter_tensors is not None:
        stored = dict(drafter_tensors)
    elif d_model is not None:
        stored = {key: (tuple(mod.get_value().shape), "the drafter model")
                  for key, mod in (("embed_tokens.weight", getattr(d_model.embed_tokens, "embedding", None)),
                                   ("lm_head.weight", getattr(d_model.lm_head, "weight", None)))
                  if mod is not None}
    else:
        stored = {}
    for key in IO_TABLES:
        if key in stored and tuple(stored[key][0]) != want[key]:
            fail(f"tensor '{key}' in {stored[key][1]} has shape {list(stored[key][0])}, "
                 f"the target's is {list(want[key])}")
