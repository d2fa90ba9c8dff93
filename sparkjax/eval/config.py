"""The settings of an eval run (:class:`EvalConfig`, the CLI flags one to one) and their validation, which
needs no model: every mistake is an EvalError naming its flag, raised before any work."""

from __future__ import annotations

import dataclasses

from .. import engine as core
from ..engine.api import check_temperature
from ..errors import ArgumentError, EvalError
from ..sharding import make_mesh
from . import datasets as ds
from .engine import MethodConfig

DEFAULT_BUDGETS = (16, 32, 64)
DEFAULT_MAX_SAMPLES = 4
DEFAULT_MAX_NEW_TOKENS = 64
DEFAULT_REPEATS = 3
MAX_SEED = 2**63  # seeds are int64 on the device: [0, 2**63)


@dataclasses.dataclass
class EvalConfig:
    """Every setting of a run, one field per CLI flag (see ``--help``); None means the flag's default
    (``max_samples`` / ``stage_samples`` None: all; ``out`` None: nothing written)."""

    target: str | None = None
    drafter: str | None = None
    baseline_drafter: str | None = None
    tokenizer: str | None = None
    dtype: str | None = None
    methods: tuple[str, ...] = core.METHODS
    budgets: tuple[int, ...] | None = None
    top_c: int | None = None
    temperature: float = 0.0
    datasets: tuple[str, ...] = ds.DEFAULT
    max_samples: int | None = DEFAULT_MAX_SAMPLES
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    batch_size: int = 1
    batch_sizes: tuple[int, ...] | None = None
    seed: int = 0
    repeats: int = DEFAULT_REPEATS
    stage_samples: int | None = 1
    ignore_eos: bool = False
    out: str | None = None
    plots: bool = True
    mesh: str | None = None
    fresh_auto: bool = False


def _positive(name: str, value, *, allow_none: bool = False, allow_zero: bool = False):
    if value is None and allow_none:
        return
    ok = isinstance(value, int) and not isinstance(value, bool) and (value >= 0 if allow_zero else value >= 1)
    if not ok:
        raise EvalError(f"{name}: expected a {'non-negative' if allow_zero else 'positive'} integer, got {value!r}")


def _items(value) -> tuple | None:
    """A comma-separated string or a sequence as a tuple (None stays None)."""
    if isinstance(value, str):
        return tuple(x.strip() for x in value.split(",") if x.strip())
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    return None if value is None else tuple(value)


def normalized(cfg: EvalConfig) -> EvalConfig:
    """``cfg`` with the Python API's conveniences resolved: lists and comma-separated strings for methods,
    datasets and budgets, a single budget as an int, budgets given as strings."""
    budgets = _items(cfg.budgets)
    if budgets is not None:
        try:
            budgets = tuple(int(b) if isinstance(b, str) else b for b in budgets)
        except ValueError:
            raise EvalError(f"--budgets: expected integers, got {cfg.budgets!r}") from None
    sizes = cfg.batch_sizes if isinstance(cfg.batch_sizes, str) else _items(cfg.batch_sizes)
    return dataclasses.replace(cfg, methods=_items(cfg.methods), datasets=_items(cfg.datasets), budgets=budgets,
                               batch_sizes=sizes)


def method_configs(cfg: EvalConfig) -> tuple[list[MethodConfig], list[str]]:
    """Validates the method / budget / top-c combination and expands it into benchmark columns, ``ar`` first
    (added when missing: it is the reference of every speedup); returns them and the notes."""
    notes: list[str] = []
    methods = [m.strip() for m in cfg.methods]
    if not methods or any(not m for m in methods):
        raise EvalError("--methods: empty method name")
    for m in methods:
        if m not in core.METHODS:  # a plain name: budgets come from --budgets
            raise EvalError(f"--methods: unknown method {m!r}; choose from {', '.join(core.METHODS)}")
    dupes = sorted({m for m in methods if methods.count(m) > 1})
    if dupes:
        raise EvalError(f"--methods: {dupes[0]!r} is listed twice")
    trees = [m for m in methods if m in core.TREE_METHODS]
    for flag, value in (("--budgets", cfg.budgets), ("--top-c", cfg.top_c)):
        if value is not None and not trees:
            given = ",".join(str(v) for v in value) if isinstance(value, tuple | list) else str(value)
            raise EvalError(f"{flag}: {given} given, but none of --methods ({','.join(methods)}) builds a tree; "
                            f"{flag} applies only to {', '.join(core.TREE_METHODS)}")
    budgets = tuple(cfg.budgets) if cfg.budgets is not None else DEFAULT_BUDGETS
    if not budgets:
        raise EvalError("--budgets: empty list")
    for b in budgets:
        _positive("--budgets", b)
    if len(set(budgets)) != len(budgets):
        raise EvalError(f"--budgets: duplicate budget in {list(budgets)}")
    _positive("--top-c", cfg.top_c, allow_none=True)
    out: list[MethodConfig] = []
    for m in methods:
        out += [MethodConfig(m, int(b), cfg.top_c) for b in budgets] if m in trees else [MethodConfig(m)]
    if all(mc.speculative for mc in out):
        out.insert(0, MethodConfig(core.AR_LABEL))
        notes.append("ar was added to --methods: it is the reference every speedup is measured against")
    out.sort(key=lambda mc: mc.speculative)  # ar first
    return out, notes


def check_batch_sizes(sizes) -> tuple[int, ...]:
    """Validates ``--batch-sizes`` (a comma-separated string or a sequence of integers); returns them in
    ascending order, else EvalError naming the flag."""
    if isinstance(sizes, str):
        items = [x.strip() for x in sizes.split(",")]
        if any(not x for x in items):
            raise EvalError(f"--batch-sizes: empty entry in {sizes!r}; expected comma-separated positive integers")
        try:
            sizes = [int(x) for x in items]
        except ValueError:
            raise EvalError(f"--batch-sizes: expected comma-separated positive integers, got {sizes!r}") from None
    sizes = [sizes] if isinstance(sizes, int) and not isinstance(sizes, bool) else list(sizes)
    if not sizes:
        raise EvalError("--batch-sizes: empty list; expected comma-separated positive integers, e.g. 1,4,16,64")
    for b in sizes:
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise EvalError(f"--batch-sizes: expected positive integers, got {b!r} in {list(sizes)}")
    dupes = sorted({b for b in sizes if sizes.count(b) > 1})
    if dupes:
        raise EvalError(f"--batch-sizes: batch size {dupes[0]} is listed twice in {list(sizes)}")
    return tuple(sorted(sizes))


def eval_mesh(text: str | None):
    """The ``--mesh DATAxMODEL`` device mesh (:func:`sparkjax.sharding.make_mesh`), or None for one device."""
    if text is None:
        return None
    parts = str(text).lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise EvalError(f"--mesh: expected DATAxMODEL with positive sizes (such as 2x4), got {text!r}")
    try:
        return make_mesh(int(parts[0]), int(parts[1]))
    except ArgumentError as e:
        raise EvalError(f"--mesh: {e}") from None


def validate(cfg: EvalConfig, *, target_given: bool = False) -> tuple[EvalConfig, list[MethodConfig], list[str]]:
    """Checks every setting that needs no model; returns the normalized config, the benchmark columns and
    notes. ``target_given``: a target was passed to :func:`~sparkjax.eval.run` directly, not as a folder."""
    cfg = normalized(cfg)
    mcs, notes = method_configs(cfg)
    try:
        check_temperature(cfg.temperature)
    except ArgumentError as e:
        raise EvalError(f"--temperature: {e}") from None
    _positive("--max-samples", cfg.max_samples, allow_none=True)
    _positive("--max-new-tokens", cfg.max_new_tokens)
    _positive("--batch-size", cfg.batch_size)
    if cfg.batch_sizes is not None:
        cfg.batch_sizes = check_batch_sizes(cfg.batch_sizes)
        if cfg.batch_size != 1:
            raise EvalError(f"--batch-size {cfg.batch_size} and --batch-sizes {','.join(map(str, cfg.batch_sizes))}: "
                            "give one of them (--batch-sizes runs the batch-size sweep; --batch-size batches the "
                            "per-set run)")
    _positive("--repeats", cfg.repeats)
    if not isinstance(cfg.seed, int) or isinstance(cfg.seed, bool) or not 0 <= cfg.seed < MAX_SEED:
        raise EvalError(f"--seed: expected an integer in [0, 2**63), got {cfg.seed!r}")
    _positive("--stage-samples", cfg.stage_samples, allow_none=True, allow_zero=True)
    if not cfg.datasets:
        raise EvalError("--datasets: no prompt set given")
    eval_mesh(cfg.mesh)  # a malformed or oversized mesh is said before any work
    if cfg.target is None and not target_given:
        for flag, value in (("--drafter", cfg.drafter), ("--baseline-drafter", cfg.baseline_drafter)):
            if value is not None:
                raise EvalError(f"{flag}: given without --target (the default target is the bundled demo target, "
                                "which runs with its own drafters)")
    return cfg, mcs, notes
