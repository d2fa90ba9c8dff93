"""The settings of an eval run (:class:`EvalConfig`, the CLI flags one to one) and their validation, which
needs no model: every mistake is an EvalError naming its flag, raised before any work."""

from __future__ import annotations

import dataclasses

from .. import engine as core
from ..engine.api import check_temperature
from ..engine.checks import check_seed, check_top_k, check_top_p
from ..engine.methods import Method
from ..engine.names import parse_method
from ..errors import ArgumentError, EvalError
from ..sharding import make_mesh
from . import datasets as ds

# The default run: the methods that tell the story, each tree at its own default budget (64 nodes; pctree 32 with
# the root, or what its beam keeps); --budgets sweeps every tree method, --methods picks any (docs/eval.md)
DEFAULT_METHODS = ("ar", "dspark", "ddtree", "sparklingtree", "pctree", "auto")
DEFAULT_MAX_SAMPLES = 4
DEFAULT_MAX_NEW_TOKENS = 64
DEFAULT_REPEATS = 3


@dataclasses.dataclass
class EvalConfig:
    """Every setting of a run, one field per CLI flag (see ``--help``); None means the flag's default
    (``max_samples`` / ``stage_samples`` None: all; ``out`` None: nothing written)."""

    target: str | None = None
    drafter: str | None = None
    baseline_drafter: str | None = None
    tokenizer: str | None = None
    dtype: str | None = None
    methods: tuple[str, ...] = DEFAULT_METHODS
    budgets: tuple[int, ...] | None = None
    top_c: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0  # 1: off
    top_k: int = 0  # 0: off
    datasets: tuple[str, ...] = ds.DEFAULT
    max_samples: int | None = DEFAULT_MAX_SAMPLES
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    batch_size: int = 1
    batch_sizes: tuple[int, ...] | None = None
    seed: int = 0
    repeats: int = DEFAULT_REPEATS
    stage_samples: int | None = 0  # the stage pass compiles each stage of each method apart: asked for, not default
    ignore_eos: bool = False
    out: str | None = None
    plots: bool = True
    mesh: str | None = None
    fresh_auto: bool = False


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _positive(name: str, value, *, allow_none: bool = False, allow_zero: bool = False):
    if value is None and allow_none:
        return
    if not (_is_int(value) and value >= (0 if allow_zero else 1)):
        raise EvalError(f"{name}: expected a {'non-negative' if allow_zero else 'positive'} integer, got {value!r}")


def _items(value) -> tuple | None:
    """A comma-separated string, a single int or a sequence as a tuple, empty entries left out (None stays None)."""
    if isinstance(value, str):
        return tuple(x.strip() for x in value.split(",") if x.strip())
    return (value,) if _is_int(value) else None if value is None else tuple(value)


def _ints(flag: str, value) -> tuple[int, ...] | None:
    """``--budgets`` / ``--batch-sizes``: distinct positive integers (a comma-separated string or a sequence)."""
    if value is None:
        return None
    if isinstance(value, str) and any(not x.strip() for x in value.split(",")):
        raise EvalError(f"{flag}: empty entry in {value!r}; expected comma-separated positive integers")
    items = _items(value)
    try:
        items = tuple(int(x) if isinstance(x, str) else x for x in items)
    except ValueError:
        raise EvalError(f"{flag}: expected comma-separated positive integers, got {value!r}") from None
    if not items:
        raise EvalError(f"{flag}: empty list; expected comma-separated positive integers")
    for x in items:
        if not (_is_int(x) and x >= 1):
            raise EvalError(f"{flag}: expected positive integers, got {x!r} in {list(items)}")
    dupes = sorted({x for x in items if items.count(x) > 1})
    if dupes:
        raise EvalError(f"{flag}: duplicate entry, {dupes[0]} is listed twice in {list(items)}")
    return items


def normalized(cfg: EvalConfig) -> EvalConfig:
    """``cfg`` with the Python API's conveniences resolved: lists and comma-separated strings for methods,
    datasets, budgets and batch sizes, a single budget as an int; batch sizes in ascending order."""
    sizes = _ints("--batch-sizes", cfg.batch_sizes)
    return dataclasses.replace(cfg, methods=_items(cfg.methods), datasets=_items(cfg.datasets),
                               budgets=_ints("--budgets", cfg.budgets), batch_sizes=sizes and tuple(sorted(sizes)))


def method_configs(cfg: EvalConfig) -> tuple[list[Method], list[str]]:
    """Validates the method / top-c combination of a :func:`normalized` config and expands it into benchmark
    columns (method objects: a tree name once per ``--budgets`` entry, each with ``--top-c``), ``ar`` first (added
    when missing: it is the reference of every speedup); returns them and the notes."""
    methods = [m.strip() for m in cfg.methods]
    if not methods or any(not m for m in methods):
        raise EvalError("--methods: empty method name")
    for m in methods:
        name = m.partition("@")[0].partition(":")[0]
        if name not in core.METHODS:  # a name (budgets from --budgets), name:options or a label name@budget[:options]
            raise EvalError(f"--methods: unknown method {m!r}; choose from {', '.join(core.METHODS)} (a tree "
                            "may add its options, as sparklingtree:seed or sparklingtree@64:seed:fanout=16)")
        if methods.count(m) > 1:
            raise EvalError(f"--methods: {m!r} is listed twice")
        if m != name and name not in core.TREE_METHODS:
            raise EvalError(f"--methods: {m!r}: only the tree methods ({', '.join(core.TREE_METHODS)}) take a "
                            "budget or options")
    trees = [m for m in methods if "@" not in m and m.partition(":")[0] in core.TREE_METHODS]
    for flag, value in (("--budgets", cfg.budgets), ("--top-c", cfg.top_c)):
        if value is not None and not trees:
            given = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            raise EvalError(f"{flag}: {given} given, but none of --methods ({','.join(methods)}) builds a tree; "
                            f"{flag} applies only to {', '.join(core.TREE_METHODS)}")
    _positive("--top-c", cfg.top_c, allow_none=True)
    sweep = cfg.budgets or (None,)  # None: the method's own default budget
    out: list[Method] = []
    for m in methods:
        for b in sweep if m in trees else (None,):
            name, colon, options = m.partition(":")
            label = m if b is None else f"{name}@{b}{colon}{options}"  # a swept tree: its label at budget b
            try:  # every option is checked before any work
                out.append(parse_method(label, top_c=cfg.top_c))
            except ArgumentError as e:
                raise EvalError(f"--methods: {m!r}: {e}") from None
    labels = [m.label for m in out]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise EvalError(f"--methods: {dupes[0]} is run twice (a label and a name with --budgets name the same run)")
    notes = []
    if all(m.speculative for m in out):
        out.insert(0, parse_method(core.AR_LABEL))
        notes.append("ar was added to --methods: it is the reference every speedup is measured against")
    out.sort(key=lambda m: m.speculative)  # ar first
    return out, notes


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


def validate(cfg: EvalConfig, *, target_given: bool = False) -> tuple[EvalConfig, list[Method], list[str]]:
    """Checks every setting that needs no model; returns the normalized config, the benchmark columns and
    notes. ``target_given``: a target was passed to :func:`~sparkjax.eval.run` directly, not as a folder."""
    cfg = normalized(cfg)
    methods, notes = method_configs(cfg)
    try:
        check_temperature(cfg.temperature)
    except ArgumentError as e:
        raise EvalError(f"--temperature: {e}") from None
    for flag, check, value in (("--top-p", check_top_p, cfg.top_p), ("--top-k", check_top_k, cfg.top_k)):
        try:
            check(value)
        except ArgumentError as e:
            raise EvalError(f"{flag}: {e}") from None
    _positive("--max-samples", cfg.max_samples, allow_none=True)
    _positive("--max-new-tokens", cfg.max_new_tokens)
    _positive("--batch-size", cfg.batch_size)
    if cfg.batch_sizes is not None and cfg.batch_size != 1:
        raise EvalError(f"--batch-size {cfg.batch_size} and --batch-sizes {','.join(map(str, cfg.batch_sizes))}: "
                        "give one of them (--batch-sizes runs the batch-size sweep; --batch-size batches the "
                        "per-set run)")
    _positive("--repeats", cfg.repeats)
    try:
        check_seed(cfg.seed)
    except ArgumentError as e:
        raise EvalError(f"--seed: {e}") from None
    _positive("--stage-samples", cfg.stage_samples, allow_none=True, allow_zero=True)
    if not cfg.datasets:
        raise EvalError("--datasets: no prompt set given")
    eval_mesh(cfg.mesh)  # a malformed or oversized mesh is said before any work
    if cfg.target is None and not target_given:
        for flag, value in (("--drafter", cfg.drafter), ("--baseline-drafter", cfg.baseline_drafter)):
            if value is not None:
                raise EvalError(f"{flag}: given without --target (the default target is the bundled demo target, "
                                "which runs with its own drafters)")
    return cfg, methods, notes
