"""Which target, drafter, baseline drafter and tokenizer a run uses, and loading them.

Defaults: the bundled demo target; with it and no drafter given, the demo's ``dspark_b16`` and (unless a
baseline drafter is given) ``dflash_b16`` as the baseline. The baseline drafter runs the methods without a
Markov head (:data:`BASELINE_METHODS`: the DFlash / DDTree baseline); without one every method uses the drafter.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

import jax
from flax import nnx

from .. import demo as bundled
from .. import engine as core
from ..engine.methods import Method
from ..engine.names import parse_method
from ..errors import EvalError, TokenizerError
from ..io.hf import load_drafter, load_target
from ..pairing import check_pair, source_of
from ..text import load_tokenizer
from .config import EvalConfig

# auto adapts to its drafter, so it runs with the drafter
BASELINE_METHODS = tuple(m for m in (*core.CHAIN_METHODS, *core.TREE_METHODS) if m not in core.MARKOV_METHODS)

DEMO_NOTE = (
    "The default pair is the bundled demo pair: a small Qwen3 (4 layers, d=256, a 4k byte-level BPE vocabulary) "
    "trained from scratch on Python's stdlib sources, Python docs and synthetic math, with block-16 drafters "
    "trained against it with and without the Markov head; see sparkjax/assets/demo/MODEL_CARD.md. Its CPU timings "
    "say nothing about real models on accelerators."
)
DEMO_PARTS = {"target": "target", "drafter": "dspark_b16", "baseline": "dflash_b16"}


def demo_dir(part: str) -> pathlib.Path:
    """A folder of the bundled demo pair (a key of :data:`DEMO_PARTS`) under :data:`sparkjax.demo.DEMO_DIR`."""
    return bundled.DEMO_DIR / DEMO_PARTS[part]


def uses_baseline(m: Method) -> bool:
    """Whether ``m`` runs with the baseline drafter when there is one."""
    return m.name in BASELINE_METHODS


@dataclasses.dataclass
class Pair:
    """The loaded models of a run and where they came from. ``baseline``: the drafter of
    :data:`BASELINE_METHODS` (None: they use ``drafter``); ``default``: the target is the demo's."""

    target: Any
    drafter: Any
    baseline: Any
    target_dir: str | None
    drafter_dir: str | None
    baseline_dir: str | None
    default: bool
    notes: list[str] = dataclasses.field(default_factory=list)

    def drafter_of(self, m: Method) -> tuple[Any, str | None, str | None]:
        """``m``'s drafter model, its folder and its role (``"drafter"`` / ``"baseline"``; all None for ar)."""
        if not m.speculative:
            return None, None, None
        if self.baseline is not None and uses_baseline(m):
            return self.baseline, self.baseline_dir, "baseline"
        return self.drafter, self.drafter_dir, "drafter"


def _is_path(x) -> bool:
    return isinstance(x, str | os.PathLike)


def _source(model) -> str | None:
    return source_of(model) or getattr(model, "source", None)


def _same_folder(a, b) -> bool:
    return pathlib.Path(a).resolve() == pathlib.Path(b).resolve()


def resolve_pair(cfg: EvalConfig, target=None, drafter=None, baseline_drafter=None,
                 methods: list[Method] | None = None) -> dict[str, Any]:
    """Where the target / drafter / baseline drafter come from, and which of them the methods ``methods`` need
    (nothing is loaded). Raises one EvalError naming every missing demo folder that would be used."""
    methods = list(methods) if methods is not None else [parse_method(name) for name in core.METHODS]
    t_src = target if target is not None else cfg.target
    t_dir = str(t_src) if _is_path(t_src) else (_source(t_src) if t_src is not None else str(demo_dir("target")))
    default = t_dir is not None and _same_folder(t_dir, demo_dir("target"))
    d_src = drafter if drafter is not None else cfg.drafter
    b_src = baseline_drafter if baseline_drafter is not None else cfg.baseline_drafter
    b_given = b_src is not None
    demo_parts = ["target"] if default and (t_src is None or _is_path(t_src)) else []
    if default and d_src is None:
        d_src = str(demo_dir("drafter"))
        demo_parts.append("drafter")
        if b_src is None:
            b_src = str(demo_dir("baseline"))
            demo_parts.append("baseline")
    need_baseline = b_src is not None and any(uses_baseline(m) for m in methods)
    need_drafter = any(m.speculative and not (need_baseline and uses_baseline(m)) for m in methods)
    notes = []
    if b_given and not need_baseline:
        notes.append(f"--baseline-drafter is not used: none of the methods run uses it ({', '.join(BASELINE_METHODS)})")
    needed = {"target": True, "drafter": need_drafter, "baseline": need_baseline}
    missing = [str(demo_dir(p)) for p in demo_parts if needed[p]
               and not ((demo_dir(p) / "config.json").is_file() and any(demo_dir(p).glob("*.safetensors")))]
    if missing:
        raise EvalError(
            f"the bundled demo pair is incomplete: {', '.join(missing)} not found (no config.json + *.safetensors); "
            "pass --target and --drafter to run another pair, e.g. (from a source checkout) --target "
            "tests/fixtures/tiny_dspark_b16/target --drafter tests/fixtures/tiny_dspark_b16/drafter --tokenizer "
            "eval/default_pair/tokenizer")
    return {"t_src": t_src, "t_dir": t_dir, "default": default, "d_src": d_src, "b_src": b_src,
            "need_drafter": need_drafter, "need_baseline": need_baseline, "notes": notes}


def load_pair(cfg: EvalConfig, target=None, drafter=None, baseline_drafter=None,
              methods: list[Method] | None = None) -> Pair:
    """Loads (or takes) the target, the drafter and the baseline drafter the methods ``methods`` need (see
    :func:`resolve_pair`); each drafter is checked against the target, an object as a folder is."""
    r = resolve_pair(cfg, target, drafter, baseline_drafter, methods)
    t_src, t_dir, d_src, b_src = r["t_src"], r["t_dir"], r["d_src"], r["b_src"]
    if r["need_drafter"] and d_src is None:
        raise EvalError("--drafter: the speculative methods need a drafter for this target (or use --methods ar)")
    # The demo pair is stored in bfloat16 but computed in float32 unless --dtype says otherwise: in bf16 two
    # logits can round to the same value, and a one-token step and a verify then break the tie differently.
    dtype = cfg.dtype if cfg.dtype is not None or not r["default"] else bundled.COMPUTE_DTYPE
    target = load_target(t_dir, dtype=dtype) if t_src is None or _is_path(t_src) else t_src

    def take(src, flag: str):
        if _is_path(src):
            return load_drafter(str(src), target=target, dtype=dtype), str(src)
        d_dir = _source(src)
        check_pair(target, src, target_source=str(t_dir or "<target>"), drafter_source=str(d_dir or f"<{flag} object>"))
        return src, d_dir

    drafter_m, d_dir = take(d_src, "drafter") if r["need_drafter"] else (None, None)
    base, b_dir = None, None
    if r["need_baseline"]:
        same = b_src is d_src or (_is_path(b_src) and _is_path(d_src) and _same_folder(b_src, d_src))
        base, b_dir = (drafter_m, d_dir) if r["need_drafter"] and same else take(b_src, "baseline drafter")
    return Pair(target, drafter_m, base, t_dir, d_dir, b_dir, r["default"], r["notes"])


def load_tok(cfg: EvalConfig, tokenizer, t_dir) -> tuple[Any, str]:
    """The run's tokenizer (an object, ``tokenizer`` / ``cfg.tokenizer`` as a folder, else the target folder)
    and where it came from."""
    if tokenizer is not None and not _is_path(tokenizer):
        return tokenizer, getattr(tokenizer, "name_or_path", "<tokenizer object>")
    src = tokenizer or cfg.tokenizer
    if src is not None:
        return load_tokenizer(src), str(src)
    if t_dir is None:
        raise TokenizerError("--tokenizer: required when the target is given as a loaded model")
    try:
        return load_tokenizer(t_dir, what="--target"), str(t_dir)
    except TokenizerError as e:
        raise TokenizerError(f"{e}; pass --tokenizer FOLDER") from None


def param_dtype(model) -> str:
    leaves = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
    return str(leaves[0].dtype) if leaves else "?"
