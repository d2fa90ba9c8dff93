"""The benchmark loop: load a pair and prompt sets, warm up, time every method, summarise.

Timing protocol (per batch of prompts; see :mod:`sparkjax.eval` for the summary):

1. Warm-up: before anything is timed, every method is compiled and run once on the first
   batch's shapes (and on any later new shape, e.g. a smaller last batch, before that batch's
   first timed run: all of a batch's warm-ups come before any of its timed runs).
2. Timed pass, sync-free, interleaved: for repetition r = 1..``repeats``, every method in turn
   (A B C, A B C, ..., not A A B B C C) runs (a) the full generation (the engine's one jitted
   ``while_loop`` program, ``max_new_tokens`` new tokens) and right after it (b) a prefill-only run
   of the same shapes (``max_new_tokens = 1``: target prefill, first token and the drafter's
   context projection of the prompt features, then no round). Each run is timed on the host from
   dispatch to ``jax.block_until_ready`` of its outputs. Interleaving spreads a slow spell of a
   busy machine over every method instead of charging it to one. Method ``auto`` (unless
   ``--fresh-auto``) starts repetition r of a batch from the memory repetition r of the previous batch
   of the same size ended with (``generate(auto_memory=)``): each repetition is one chain of requests
   through the prompts in order, like a server's, and no run learns from an earlier run of its own prompt.
   ``decode seconds = median(a) - median(b)``: the rounds only, with prefill, the first token and
   the prompt-context part of the first draft pass excluded. (Round 1's drafter block pass stays
   in; in upstream code it is part of the first draft call too, so this is an approximation.)
   Also kept: the best case ``min(a) - min(b)`` and the spread ``(max(a) - min(a)) / median(a)``.
   A difference that is not positive (the prefill-only runs took as long as the full runs, which
   happens on a loaded machine) is "not measured" (None, with a note), never 0: that unit is left
   out of TPOT, tok/s and speedup, and a row with no measured unit shows "-".
3. TPOT = decode seconds / output tokens of the batch (all generated tokens, the first included,
   as upstream counts them); a method's TPOT is the mean over batches (= over responses at batch
   size 1; a batch whose first token already ended it has no decode step and is left out),
   tokens/s = 1 / TPOT and speedup = TPOT(ar) / TPOT(method), ar being timed in the
   same run, on the same batches, with the same cache size, interleaved with the other methods.
   The same from the min times gives ``tokens_per_s_best`` / ``speedup_best``. A row's
   ``timing_spread`` is the median over its batches of the full-run spread; the table warns when it
   exceeds 25 % or when the 1-minute load average (sampled during the run) exceeded the CPU count.
4. Stage pass (separate, synced; on the first ``stage_samples`` prompts of each set that have at
   least one round): the engine's instrumented mode (``instrument=True``) runs the same batch stage
   by stage (draft, tree, verify, commit), blocking after each; per-stage time per round = summed
   stage seconds / rounds (loop iterations) of the instrumented batches. Its stage functions are
   compiled (warmed up) on a batch with a round before one is timed.

Ctrl-C: while :func:`run` runs, SIGINT only sets a flag (the previous handler is restored when it
returns); the flag is checked between units of work (each warm-up, each timed run, each stage
pass), so the run stops at the next one, keeps the batches every method had finished and returns
them with ``interrupted=True`` (saved to ``out`` like a full run). A second Ctrl-C raises
KeyboardInterrupt at once (which ends the run the same way, when it reaches the harness).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pathlib
import platform
import signal
import statistics
import sys
import tempfile
import time
from typing import Any

import jax

from .. import engine as core
from ..config import read_json
from ..engine.api import check_temperature
from ..errors import ArgumentError, EvalError, TokenizerError
from ..pairing import check_pair
from . import datasets as ds
from . import demo, metrics
from .engine import BatchOutput, Engine, MethodConfig

DEFAULT_BUDGETS = (16, 32, 64)
DEFAULT_MAX_SAMPLES = 4
DEFAULT_MAX_NEW_TOKENS = 64
DEFAULT_REPEATS = 3
SPREAD_WARNING = 0.25  # the table warns when a row's timing spread ((max - min) / median) is above this
MAX_SEED = 2**63  # seeds are int64 on the device: [0, 2**63)
# The files EvalResults.save writes; a re-run into the same folder replaces or removes exactly these.
OUTPUT_FILES = ("results.json", "results.csv", "acceptance_per_depth.png", "tau_speedup.png", "stage_time.png",
                "batch_sweep.csv", "throughput_vs_batch.png")
STAGES = core.STAGES
AR_LABEL = core.AR_LABEL
DEFAULT_PAIR_NOTE = demo.NOTE
# The methods that use no Markov head: with a baseline drafter they run with it (the DFlash / DDTree baseline).
# auto adapts to its drafter (sparklingtree / dspark with a Markov head): it runs with --drafter.
BASELINE_METHODS = tuple(m for m in core.METHODS
                         if core.parse_method(m).speculative and not core.parse_method(m).needs_markov
                         and not isinstance(core.parse_method(m), core.Auto))


@dataclasses.dataclass
class EvalConfig:
    """Every setting of a run (the CLI flags, one to one).

    ``target`` / ``drafter`` / ``tokenizer``: folders (None: the bundled demo pair,
    ``sparkjax/assets/demo``; the tokenizer defaults to the target folder). ``baseline_drafter``: the
    drafter of the methods without a Markov head (dflash, ddtree); None: the ``drafter`` (with the
    demo target and no ``drafter`` given: the demo's ``dflash_b16``). ``budgets``: tree sizes for the
    tree methods (None: 16, 32 and 64 when a tree method is asked for). ``max_samples``: prompts per
    set (None: all). ``stage_samples``: prompts per set (the first ones) that also get the
    instrumented stage pass (None: all of them, 0: none). ``out``: where to write results.json,
    results.csv and the plots (None: nowhere). ``batch_sizes``: run the batch-size sweep
    (:mod:`sparkjax.eval.sweep`) at these sizes instead of the per-set batches of ``batch_size``, which must
    then stay 1 (None: no sweep). ``fresh_auto``: method ``auto`` starts each batch from nothing; by default
    repetition r of a batch starts from the memory (:class:`sparkjax.engine.auto.AutoMemory`) repetition r of the
    previous batch of the same size ended with, as a server carries it from request to request.
    """

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
    mesh: str | None = None  # "DATAxMODEL": generation sharded over a device mesh (None: one device)
    fresh_auto: bool = False  # method auto starts every batch from nothing instead of carrying its memory


def _positive(name: str, value, *, allow_none: bool = False, allow_zero: bool = False):
    if value is None and allow_none:
        return
    ok = isinstance(value, int) and not isinstance(value, bool) and (value >= 0 if allow_zero else value >= 1)
    if not ok:
        raise EvalError(f"{name}: expected a {'non-negative' if allow_zero else 'positive'} integer, got {value!r}")


def method_configs(cfg: EvalConfig) -> tuple[list[MethodConfig], list[str]]:
    """Validates the method / budget / top-c combination and expands it into benchmark columns."""
    notes: list[str] = []
    methods = [m.strip() for m in cfg.methods]
    if not methods or any(not m for m in methods):
        raise EvalError("--methods: empty method name")
    specs = {}
    for m in methods:
        try:
            specs[m] = core.parse_method(m)
            if m not in core.METHODS:  # a plain name: budgets come from --budgets
                raise ArgumentError(m)
        except ArgumentError:
            raise EvalError(f"--methods: unknown method {m!r}; choose from {', '.join(core.METHODS)}") from None
    dupes = sorted({m for m in methods if methods.count(m) > 1})
    if dupes:
        raise EvalError(f"--methods: {dupes[0]!r} is listed twice")
    trees = [m for m in methods if isinstance(specs[m], core.Tree)]
    for flag, value in (("--budgets", cfg.budgets), ("--top-c", cfg.top_c)):
        if value is not None and not trees:
            given = ",".join(str(v) for v in value) if isinstance(value, tuple | list) else str(value)
            raise EvalError(
                f"{flag}: {given} given, but none of --methods ({','.join(methods)}) builds a tree; "
                f"{flag} applies only to {', '.join(core.TREE_METHODS)}"
            )
    budgets = tuple(cfg.budgets) if cfg.budgets is not None else DEFAULT_BUDGETS
    if cfg.budgets is not None and not budgets:
        raise EvalError("--budgets: empty list")
    for b in budgets:
        _positive("--budgets", b)
    if len(set(budgets)) != len(budgets):
        raise EvalError(f"--budgets: duplicate budget in {list(budgets)}")
    _positive("--top-c", cfg.top_c, allow_none=True)
    if not any(isinstance(spec, core.AR) for spec in specs.values()):
        methods.insert(0, core.AR().label)
        specs[methods[0]] = core.AR()
        notes.append("ar was added to --methods: it is the reference every speedup is measured against")
    out: list[MethodConfig] = []
    for m in methods:
        if isinstance(specs[m], core.Tree):
            out += [MethodConfig(m, int(b), cfg.top_c) for b in budgets]
        else:
            out.append(MethodConfig(m))
    out.sort(key=lambda mc: mc.speculative)  # ar first
    return out, notes


def validate(cfg: EvalConfig, *, target_given: bool = False) -> tuple[list[MethodConfig], list[str]]:
    """Checks every setting that needs no model; returns the benchmark columns and notes.
    ``target_given``: a target was passed to :func:`run` directly (not through ``cfg.target``)."""
    mcs, notes = method_configs(cfg)
    try:
        check_temperature(cfg.temperature)
    except Exception as e:  # ArgumentError
        raise EvalError(f"--temperature: {e}") from None
    _positive("--max-samples", cfg.max_samples, allow_none=True)
    _positive("--max-new-tokens", cfg.max_new_tokens)
    _positive("--batch-size", cfg.batch_size)
    if cfg.batch_sizes is not None:
        from .sweep import check_batch_sizes

        cfg.batch_sizes = check_batch_sizes(cfg.batch_sizes)
        if cfg.batch_size != 1:
            raise EvalError(f"--batch-size {cfg.batch_size} and --batch-sizes {','.join(map(str, cfg.batch_sizes))}: "
                            "give one of them (--batch-sizes runs the batch-size sweep; --batch-size batches the "
                            "per-set run)")
    _positive("--repeats", cfg.repeats)
    seed = cfg.seed
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < MAX_SEED:
        raise EvalError(f"--seed: expected an integer in [0, 2**63), got {seed!r}")
    _positive("--stage-samples", cfg.stage_samples, allow_none=True, allow_zero=True)
    if not cfg.datasets:
        raise EvalError("--datasets: no prompt set given")
    if cfg.target is None and not target_given:
        for flag, value in (("--drafter", cfg.drafter), ("--baseline-drafter", cfg.baseline_drafter)):
            if value is not None:
                raise EvalError(f"{flag}: given without --target (the default target is the bundled demo target, "
                                "which runs with its own drafters)")
    return mcs, notes


# ============================================================================= results


@dataclasses.dataclass
class EvalResults:
    """Everything a run measured. ``summary``: one row per (dataset, method) plus ``all`` rows;
    ``records``: the raw numbers per (batch, method), per-round acceptance lengths included."""

    config: dict[str, Any]
    setup: dict[str, Any]
    environment: dict[str, Any]
    summary: list[dict[str, Any]]
    records: list[dict[str, Any]]
    interrupted: bool = False
    notes: list[str] = dataclasses.field(default_factory=list)
    wall_seconds: float = 0.0
    sweep: dict[str, Any] | None = None  # the batch-size sweep (--batch-sizes; sparkjax.eval.sweep), else None

    @property
    def sweep_rows(self) -> list[dict[str, Any]]:
        """The sweep's rows, one per (batch size, method); [] without a sweep."""
        return list((self.sweep or {}).get("rows") or [])

    def to_dict(self) -> dict[str, Any]:
        return {"format": "sparkjax.eval/1", **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EvalResults:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def load(cls, path: str | os.PathLike) -> EvalResults:
        """Reads a ``results.json`` (EvalError naming the file when it is not one)."""
        try:
            d = read_json(path, EvalError, "results file")
        except (RecursionError, ValueError, OSError) as e:
            if isinstance(e, EvalError):
                raise
            raise EvalError(f"{path}: cannot read JSON ({type(e).__name__})") from None
        if not isinstance(d.get("summary"), list) or not isinstance(d.get("config"), dict):
            raise EvalError(f"{path}: not a sparkjax.eval results.json (no 'summary' list / 'config' object)")
        for i, row in enumerate(d["summary"]):
            if not (isinstance(row, dict) and isinstance(row.get("dataset"), str)
                    and isinstance(row.get("label"), str)):
                raise EvalError(f"{path}: summary[{i}] is not a summary row (an object with 'dataset' and 'label')")
        for key, kind in (("setup", dict), ("environment", dict), ("records", list), ("notes", list)):
            if key in d and not isinstance(d[key], kind):
                raise EvalError(f"{path}: '{key}' must be a JSON {'object' if kind is dict else 'list'}")
        sweep = d.get("sweep")  # absent in files written before the batch-size sweep existed
        if sweep is not None:
            if not isinstance(sweep, dict) or not isinstance(sweep.get("rows", []), list):
                raise EvalError(f"{path}: 'sweep' must be a JSON object with a 'rows' list")
            for i, row in enumerate(sweep.get("rows", [])):
                if not (isinstance(row, dict) and isinstance(row.get("label"), str)
                        and isinstance(row.get("batch_size"), int) and not isinstance(row.get("batch_size"), bool)):
                    raise EvalError(f"{path}: sweep.rows[{i}] is not a sweep row (an object with 'batch_size' and "
                                    "'label')")
        d.setdefault("setup", {})
        d.setdefault("environment", {})
        d.setdefault("records", [])
        return cls.from_dict(d)

    def rows(self, dataset: str | None = None) -> list[dict[str, Any]]:
        return [r for r in self.summary if dataset is None or r["dataset"] == dataset]

    def table(self) -> str:
        from .report import format_table

        return format_table(self)

    def to_dataframe(self):
        """The summary as a pandas DataFrame (one row per dataset and method; needs pandas)."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError(
                "EvalResults.to_dataframe() needs pandas, which is not installed (pip install pandas); "
                "EvalResults.summary holds the same rows as a list of dicts"
            ) from None
        from .report import flat_row

        return pd.DataFrame([flat_row(r, self.setup) for r in self.summary])

    def save(self, out: str | os.PathLike, *, plots: bool = True) -> list[str]:
        """Writes results.json, results.csv and (with ``plots``) the PNG plots into ``out``; returns the paths.

        Each file is written atomically (a temp file renamed into place). Outputs of an earlier run in the
        same folder that this run does not write (e.g. its plots, with ``plots=False``) are removed: only
        the file names in :data:`OUTPUT_FILES`, never any other file."""
        from .report import write_csv, write_json, write_sweep_csv

        folder = check_out(out)
        paths: list[pathlib.Path] = []
        try:
            paths.append(write_json(self, folder / "results.json"))
            if self.summary or self.sweep is None:  # a sweep run has no per-set summary: batch_sweep.csv instead
                paths.append(write_csv(self, folder / "results.csv"))
            if self.sweep is not None:
                paths.append(write_sweep_csv(self, folder / "batch_sweep.csv"))
            if plots and (self.summary or self.sweep_rows):
                try:
                    import matplotlib  # noqa: F401
                except ImportError:
                    self.notes.append("plots skipped: matplotlib is not installed (pip install matplotlib)")
                else:
                    from .plots import make_plots

                    try:
                        make_plots(self, folder, written=paths)
                    except OSError:
                        raise
                    except Exception as e:  # noqa: BLE001 - a plotting failure must not lose the results
                        self.notes.append(f"plots incomplete: {type(e).__name__}: {e}")
        except OSError as e:
            raise EvalError(f"--out: cannot write to {folder} ({e.strerror or e})") from None
        remove_stale_outputs(folder, keep=[p.name for p in paths])
        return [str(p) for p in paths]


def check_out(out: str | os.PathLike) -> pathlib.Path:
    """Creates ``out`` (and its parents) and proves it writable with a probe file, which is removed;
    EvalError naming the folder otherwise. Called before any work, so a bad --out loses nothing."""
    folder = pathlib.Path(out)
    if str(out) == "":
        raise EvalError("--out: empty path")
    if folder.exists() and not folder.is_dir():
        raise EvalError(f"--out: {folder} exists and is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EvalError(f"--out: cannot create {folder} ({e.strerror or e})") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".sparkjax-eval-probe-", dir=folder)
        try:
            os.write(fd, b"probe")
        finally:
            os.close(fd)
            os.remove(probe)
    except OSError as e:
        raise EvalError(f"--out: cannot write to {folder} ({e.strerror or e})") from None
    return folder


def remove_stale_outputs(folder: str | os.PathLike, keep: list[str]) -> list[str]:
    """Removes the files of :data:`OUTPUT_FILES` in ``folder`` that are not in ``keep`` (left by an earlier
    run); returns their names. Nothing else is touched."""
    removed = []
    for name in OUTPUT_FILES:
        path = pathlib.Path(folder) / name
        if name not in keep and path.is_file() and not path.is_symlink():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(name)
    return removed


def summarize(records: list[dict[str, Any]], labels: list[str], depths: dict[str, int],
              dataset_names: list[str], temperature: float) -> list[dict[str, Any]]:
    """Summary rows per (dataset, method) and pooled over all datasets (``dataset == "all"``)."""
    rows: list[dict[str, Any]] = []
    ar_outputs = {(r["dataset"], s["index"]): s["output_ids"] for r in records if r["label"] == AR_LABEL
                  for s in r["samples"]}
    groups = [(name, [r for r in records if r["dataset"] == name]) for name in dataset_names]
    groups = [(name, recs) for name, recs in groups if recs]
    if len(groups) > 1:
        groups.append(("all", records))
    for name, recs in groups:
        if not recs:
            continue
        ar_tpot = ar_best = None
        for label in labels:
            rr = [r for r in recs if r["label"] == label]
            if not rr:
                continue
            samples = [s for r in rr for s in r["samples"]]
            lens = [s["acceptance_lengths"] for s in samples]
            depth = depths.get(label, 0)
            rounds = [len(a) for a in lens]
            # a unit whose first token already ended it (no decode step) has no decode time to speak of;
            # one whose decode time was not measured (None: prefill-only >= full run) is left out too
            timed = [r for r in rr if r["loop_iterations"] > 0]
            measured = [r for r in timed if _measured(r.get("decode_seconds"))]
            tp = metrics.mean_tpot([r["decode_seconds"] for r in measured], [r["output_tokens"] for r in measured])
            best = [r for r in timed if _measured(r.get("decode_seconds_min"))]
            tp_best = metrics.mean_tpot([r["decode_seconds_min"] for r in best], [r["output_tokens"] for r in best])
            if label == AR_LABEL:
                ar_tpot, ar_best = tp, tp_best
            spreads = [r["run_spread"] for r in timed if _measured(r.get("run_spread"), allow_zero=True)]
            staged = [r for r in rr if r.get("stage")]
            stage = None
            if staged:
                stage = metrics.stage_ms_per_round([r["stage"]["seconds"] for r in staged],
                                                   [r["stage"]["rounds"] for r in staged])
                stage["total"] = sum(stage[k] for k in STAGES if k in stage)
            same = None
            if temperature == 0 and label != AR_LABEL:
                pairs = [(s["output_ids"], ar_outputs.get((r["dataset"], s["index"])))
                         for r in rr for s in r["samples"]]
                pairs = [(a, b) for a, b in pairs if b is not None]
                same = sum(a == b for a, b in pairs) / len(pairs) if pairs else None
            r0 = rr[0]
            decode_sum = sum(r["decode_seconds"] for r in measured)
            rows.append({
                "dataset": name,
                "label": label,
                "method": r0["method"],
                "budget": r0["budget"],
                "drafter": r0.get("drafter"),
                "drafter_role": r0.get("drafter_role"),
                "n_samples": len(samples),
                "n_batches": len(rr),
                "output_tokens": sum(s["output_tokens"] for s in samples),
                "rounds": sum(rounds),
                "tau_pooled": metrics.tau_pooled(lens),
                "tau_per_response": metrics.tau_per_response(lens),
                "accept_rate": metrics.accept_rates([s["accepted_per_depth"] for s in samples], rounds, depth)
                if depth else [],
                "decode_seconds": decode_sum,
                "prefill_ms": 1000 * statistics.mean(statistics.median(r["prefill_seconds"]) for r in rr)
                if all(r["prefill_seconds"] for r in rr) else math.nan,
                "tpot_ms": 1000 * tp,
                "tpot_min_ms": 1000 * tp_best,
                "round_ms": _ratio_ms(decode_sum, sum(r["loop_iterations"] for r in measured)),
                "tokens_per_s": metrics.rate(tp),
                "tokens_per_s_best": metrics.rate(tp_best),
                "speedup": metrics.speedup(ar_tpot, tp) if ar_tpot is not None else math.nan,
                "speedup_best": metrics.speedup(ar_best, tp_best) if ar_best is not None else math.nan,
                "timing_spread": statistics.median(spreads) if spreads else math.nan,
                "timing_spread_max": max(spreads) if spreads else math.nan,
                "timed_batches": len(timed),
                "unmeasured_batches": len(timed) - len(measured),
                "stage_ms_per_round": stage,
                "stage_samples": sum(len(r["samples"]) for r in staged),
                "same_as_ar": same,
                "size_share": _size_share(samples),
            })
    return rows


def _size_share(samples: list[dict[str, Any]]) -> dict[str, float] | None:
    """Method ``auto``: the share of rounds that verified each candidate size (None for other methods)."""
    rows = [s["size_choices"] for s in samples if s.get("size_choices") is not None]
    if not rows:
        return None
    counts: dict[str, int] = {}
    for row in rows:
        for label in row:
            counts[label] = counts.get(label, 0) + 1
    total = sum(counts.values()) or 1
    return {k: v / total for k, v in counts.items()}


def _param_dtype(model) -> str:
    from flax import nnx

    leaves = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
    return str(leaves[0].dtype) if leaves else "?"


def _ratio_ms(seconds: float, count: int) -> float:
    return 1000 * seconds / count if count and seconds > 0 else math.nan


def _measured(x, *, allow_zero: bool = False) -> bool:
    """A measured, usable time (or spread): a finite number > 0 (>= 0 with ``allow_zero``); None is "not measured"."""
    if not isinstance(x, int | float) or isinstance(x, bool) or not math.isfinite(x):
        return False
    return x >= 0 if allow_zero else x > 0


# ============================================================================= the run


def _versions() -> dict[str, Any]:
    from importlib import metadata

    v: dict[str, Any] = {"python": platform.python_version()}
    for pkg in ("sparkjax", "jax", "jaxlib", "flax", "numpy", "transformers", "tokenizers", "safetensors",
                "matplotlib", "tqdm", "ml_dtypes"):
        try:
            v[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            v[pkg] = None
    return v


def _environment() -> dict[str, Any]:
    devices = jax.devices()
    return {
        "versions": _versions(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in devices],
        "device_kind": devices[0].device_kind if devices else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def uses_baseline(mc: MethodConfig) -> bool:
    """Whether ``mc`` runs with the baseline drafter when there is one (dflash, ddtree: no Markov head)."""
    return mc.speculative and not mc.spec.needs_markov and not isinstance(mc.spec, core.Auto)


@dataclasses.dataclass
class Pair:
    """The loaded models of a run and where they came from. ``baseline`` is the drafter of
    :data:`BASELINE_METHODS` (None: they use ``drafter``); ``default``: the target is the demo's."""

    target: Any
    drafter: Any
    baseline: Any
    target_dir: str | None
    drafter_dir: str | None
    baseline_dir: str | None
    default: bool
    notes: list[str] = dataclasses.field(default_factory=list)


def _is_path(x) -> bool:
    return isinstance(x, str | os.PathLike)


def _source(model) -> str | None:
    from ..io.hf import source_of

    return source_of(model) or getattr(model, "source", None)


def _same_folder(a, b) -> bool:
    try:
        return pathlib.Path(a).resolve() == pathlib.Path(b).resolve()
    except TypeError:
        return False


def resolve_pair(cfg: EvalConfig, target=None, drafter=None, baseline_drafter=None,
                 mcs: list[MethodConfig] | None = None) -> dict[str, Any]:
    """Where the target / drafter / baseline drafter come from, and which of them the methods ``mcs`` need
    (nothing is loaded). Raises one EvalError naming every missing demo folder that would be used.

    Defaults: the bundled demo target; with it and no drafter given, the demo's ``dspark_b16`` and (unless
    a baseline drafter is given) ``dflash_b16`` as the baseline. Without a baseline drafter, every method
    uses the drafter."""
    mcs = list(mcs) if mcs is not None else [MethodConfig(m) for m in core.METHODS]
    t_src = target if target is not None else cfg.target
    t_dir = str(t_src) if _is_path(t_src) else (_source(t_src) if t_src is not None else str(demo.target_dir()))
    default = t_dir is not None and demo.is_target(t_dir)
    d_src = drafter if drafter is not None else cfg.drafter
    b_src = baseline_drafter if baseline_drafter is not None else cfg.baseline_drafter
    b_given = b_src is not None
    demo_parts = ["target"] if default and (t_src is None or _is_path(t_src)) else []
    if default and d_src is None:
        d_src = str(demo.drafter_dir())
        demo_parts.append("dspark_b16")
        if b_src is None:
            b_src = str(demo.baseline_dir())
            demo_parts.append("dflash_b16")
    need_baseline = b_src is not None and any(uses_baseline(mc) for mc in mcs)
    need_drafter = any(mc.speculative and not (need_baseline and uses_baseline(mc)) for mc in mcs)
    notes: list[str] = []
    if b_given and not need_baseline:
        notes.append(f"--baseline-drafter is not used: none of the methods run uses it ({', '.join(BASELINE_METHODS)})")
    needed = {"target": True, "dspark_b16": need_drafter, "dflash_b16": need_baseline}
    demo.require(*(p for p in demo_parts if needed[p]))
    return {"t_src": t_src, "t_dir": t_dir, "default": default, "d_src": d_src, "b_src": b_src,
            "need_drafter": need_drafter, "need_baseline": need_baseline, "notes": notes}


def load_pair(cfg: EvalConfig, target=None, drafter=None, baseline_drafter=None,
              mcs: list[MethodConfig] | None = None) -> Pair:
    """Loads (or takes) the target, the drafter and the baseline drafter the methods ``mcs`` need
    (see :func:`resolve_pair` for the defaults); each drafter is checked against the target."""
    from ..io.hf import load_drafter, load_target

    r = resolve_pair(cfg, target, drafter, baseline_drafter, mcs)
    t_src, t_dir, d_src, b_src = r["t_src"], r["t_dir"], r["d_src"], r["b_src"]
    need_drafter, need_baseline = r["need_drafter"], r["need_baseline"]
    if need_drafter and d_src is None:
        raise EvalError("--drafter: the speculative methods need a drafter for this target (or use --methods ar)")
    # The demo pair is stored in bfloat16 but computed in float32 unless --dtype says otherwise: in bf16 two
    # logits can round to the same value, and a one-token decode step and a 17-token verify then break the
    # tie differently (seen on 1 of the 12 default prompts), which is rounding, not a decoding error.
    dtype = cfg.dtype if cfg.dtype is not None or not r["default"] else demo.COMPUTE_DTYPE
    target = load_target(t_dir, dtype=dtype) if t_src is None or _is_path(t_src) else t_src

    def take(src, flag: str):
        if _is_path(src):
            return load_drafter(str(src), target=target, dtype=dtype), str(src)
        d_dir = _source(src)
        check_pair(target, src, target_source=str(t_dir or "<target>"),  # models: their tables are checked too
                   drafter_source=str(d_dir or f"<{flag} object>"))
        return src, d_dir

    drafter_m, d_dir = take(d_src, "drafter") if need_drafter else (None, None)
    base, b_dir = None, None
    if need_baseline:
        if need_drafter and (b_src is d_src or (_is_path(b_src) and _is_path(d_src) and _same_folder(b_src, d_src))):
            base, b_dir = drafter_m, d_dir
        else:
            base, b_dir = take(b_src, "baseline drafter")
    return Pair(target, drafter_m, base, t_dir, d_dir, b_dir, r["default"], r["notes"])


def load_tok(cfg: EvalConfig, tokenizer, t_dir):
    from ..text import load_tokenizer

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


def _short(label: str) -> str:
    name, _, budget = label.partition("@")
    abbr = {"dflash": "dfl", "dspark": "dsp", "ddtree": "dd", "sparklingtree": "st", "sparklingtree-beam": "stb"}
    return abbr.get(name, name) + budget


class Interrupt:
    """The Ctrl-C flag of a run: the SIGINT handler :func:`sigint_flag` installs sets it; the harness checks
    it between units of work. A second Ctrl-C raises KeyboardInterrupt at once."""

    def __init__(self) -> None:
        self.requested = False
        self.count = 0

    def handler(self, signum, frame) -> None:
        self.count += 1
        self.requested = True
        if self.count == 1:
            print("\nCtrl-C: stopping after the current step; the finished batches will be written "
                  "(Ctrl-C again to stop at once)", file=sys.stderr, flush=True)
            return
        raise KeyboardInterrupt

    def check(self) -> None:
        if self.requested:
            raise Stopped


class Stopped(Exception):
    """Raised inside the benchmark loop when the Ctrl-C flag is set; the run keeps what it finished."""


@contextlib.contextmanager
def sigint_flag():
    """Routes SIGINT to an :class:`Interrupt` flag for the duration of the block, then restores the previous
    handler. Reuses the flag when one is already installed (the CLI installs it before :func:`run` does).
    Outside the main thread (no signal handler possible) the flag is never set and Ctrl-C stays a
    KeyboardInterrupt."""
    try:
        current = signal.getsignal(signal.SIGINT)
    except ValueError:  # pragma: no cover - no signal module support
        current = None
    owner = getattr(current, "__self__", None)
    if isinstance(owner, Interrupt):
        yield owner
        return
    flag = Interrupt()
    try:
        signal.signal(signal.SIGINT, flag.handler)
    except ValueError:  # not the main thread
        yield flag
        return
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, current if current is not None else signal.default_int_handler)


def time_batch(units: list[tuple[Engine, MethodConfig]], batch: list[list[int]], *, seed: int, repeats: int,
               stages: bool, warmed: set, stop: Interrupt | None = None) -> dict[MethodConfig, dict[str, Any]]:
    """Times one batch with every method (see the module docstring): warm-up of any new shape first, then
    ``repeats`` interleaved repetitions (repetition r runs every method in turn, full run then prefill-only),
    then the stage passes. Returns the raw record of each method. Raises :class:`Stopped` when ``stop`` is set
    between two units of work (the batch is then dropped whole)."""
    check = stop.check if stop is not None else (lambda: None)
    for eng, mc in units:
        key = eng.shape_key(mc, batch)
        if key not in warmed:
            check()
            warm_up(eng, mc, batch, seed=seed, stages=False)
            warmed.add(key)
    run_s: dict[MethodConfig, list[float]] = {mc: [] for _, mc in units}
    pre_s: dict[MethodConfig, list[float]] = {mc: [] for _, mc in units}
    res: dict[MethodConfig, Any] = {}
    for r in range(repeats):
        for eng, mc in units:
            check()
            memory = eng.memory(mc, len(batch), r)
            t0 = time.perf_counter()
            res[mc] = jax.block_until_ready(eng.launch(mc, batch, seed, auto_memory=memory))
            run_s[mc].append(time.perf_counter() - t0)
            eng.remember(mc, len(batch), r, res[mc])
            check()
            t0 = time.perf_counter()
            jax.block_until_ready(eng.launch(mc, batch, seed, prefill_only=True))
            pre_s[mc].append(time.perf_counter() - t0)
    raws: dict[MethodConfig, dict[str, Any]] = {}
    for eng, mc in units:
        labels = eng.size_labels(mc) if isinstance(mc.spec, core.Auto) else ()  # auto: name each round's size
        out: BatchOutput = eng.outputs(res[mc], len(batch), labels)
        n_out = sum(len(t) for t in out.tokens)
        if mc.speculative:
            iterations = max((len(a) for a in out.acceptance_lengths), default=0)
        else:  # ar: the first token comes from the prefill, then one loop step per token
            iterations = max((len(t) for t in out.tokens), default=1) - 1
        stage = None
        if stages and mc.speculative and iterations > 0:  # a batch without a round has no stage to time
            key = eng.shape_key(mc, batch)
            if (key, "stages") not in warmed:  # the stage functions compile on their first round
                check()
                eng.instrumented(mc, batch, seed)
                warmed.add((key, "stages"))
            check()
            ins = eng.instrumented(mc, batch, seed)
            stage = {"seconds": ins.stage_seconds, "rounds": max((len(a) for a in ins.acceptance_lengths), default=0),
                     "acceptance_lengths": ins.acceptance_lengths}
        raws[mc] = {
            "loop_iterations": iterations,
            "output": out,
            "run_seconds": run_s[mc],
            "prefill_seconds": pre_s[mc],
            "decode_seconds": metrics.decode_seconds(run_s[mc], pre_s[mc]),
            "decode_seconds_min": metrics.decode_seconds_min(run_s[mc], pre_s[mc]),
            "run_spread": metrics.spread(run_s[mc]),
            "output_tokens": n_out,
            "stage": stage,
        }
    return raws


def eval_mesh(text: str | None):
    """The ``--mesh DATAxMODEL`` device mesh (:func:`sparkjax.sharding.make_mesh`), or None for one device."""
    if text is None:
        return None
    from ..errors import ArgumentError
    from ..sharding import make_mesh

    parts = str(text).lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise EvalError(f"--mesh: expected DATAxMODEL with positive sizes (such as 2x4), got {text!r}")
    try:
        return make_mesh(int(parts[0]), int(parts[1]))
    except ArgumentError as e:
        raise EvalError(f"--mesh: {e}") from None


def run_batch(engine: Engine, mc: MethodConfig, batch: list[list[int]], *, seed: int, repeats: int,
              stages: bool, warmed: set) -> dict[str, Any]:
    """Times one batch with one method (:func:`time_batch` with a single method); returns the raw record."""
    return time_batch([(engine, mc)], batch, seed=seed, repeats=repeats, stages=stages, warmed=warmed)[mc]


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


def check_memory(target, mc: MethodConfig, plan, batch_size: int, cache_size: int, *,
                 flag: str = "--budgets") -> None:
    """Refuses, before anything is compiled, a method whose verify step cannot fit in memory: a rough lower
    bound of what one round holds at once (the KV cache, the verify's attention scores over the cache for
    ``budget + 1`` rows (ar: 1), their logits and the tree mask) against the device's memory (the host's RAM
    on a CPU). The EvalError names ``flag`` (``--batch-sizes`` when the batch-size sweep asks for it)."""
    c = target.config
    rows = 1 if plan is None else int(plan.nodes) + 1  # ar: one token per step
    heads = int(getattr(c, "num_attention_heads", 1) or 1)
    kv = int(getattr(c, "num_key_value_heads", heads) or heads)
    hd = int(getattr(c, "head_dim", None) or (c.hidden_size // heads))
    layers = int(getattr(c, "num_hidden_layers", 1) or 1)
    need = 4 * batch_size * (2 * layers * cache_size * kv * hd  # KV cache (float32 upper bound)
                             + heads * rows * cache_size  # attention scores of one layer's verify
                             + rows * int(c.vocab_size)  # verify logits
                             + rows * rows)  # tree mask
    limit = _memory_limit()
    if limit and need > limit:
        hint = "use a smaller budget" if flag == "--budgets" else "use smaller batch sizes (or a smaller budget)"
        raise EvalError(
            f"{flag}: {mc.label} needs about {need / 2**30:.1f} GiB for one verify step (budget {rows - 1}: "
            f"{rows} rows against a {cache_size}-slot cache, batch {batch_size}), more than the "
            f"{limit / 2**30:.1f} GiB this device has; {hint}")


def _memory_limit() -> int | None:
    try:
        dev = jax.devices()[0]
        stats = dev.memory_stats() if dev.platform != "cpu" else None
        if stats and stats.get("bytes_limit"):
            return int(stats["bytes_limit"])
    except Exception:  # noqa: BLE001 - memory_stats is optional and backend-specific
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def warm_up(engine: Engine, mc: MethodConfig, batch: list[list[int]], *, seed: int, stages: bool) -> bool:
    """Compiles (and runs once) everything :func:`run_batch` will time for this shape. Returns whether the
    instrumented mode got warm too: its stage functions only compile when the batch has a round."""
    jax.block_until_ready(engine.launch(mc, batch, seed))
    jax.block_until_ready(engine.launch(mc, batch, seed, prefill_only=True))
    if stages and mc.speculative:
        return any(engine.instrumented(mc, batch, seed).acceptance_lengths)
    return False


def run(config: EvalConfig | None = None, *, target=None, drafter=None, baseline_drafter=None, tokenizer=None,
        progress: bool = True, **overrides) -> EvalResults:
    """Runs the benchmark and returns :class:`EvalResults` (also saved to ``config.out`` when set).

    ``target`` / ``drafter`` / ``baseline_drafter`` / ``tokenizer`` may be folders or already loaded
    objects (a loaded target / drafter / transformers tokenizer), which override the config's paths.
    The baseline drafter runs dflash and ddtree; dspark, sparklingtree and sparklingtree-beam run
    with the drafter (see :class:`EvalConfig` for the defaults). Keyword
    ``overrides`` set :class:`EvalConfig` fields, e.g. ``run(methods=("ar", "dspark"), max_samples=2)``.
    Ctrl-C (SIGINT) stops the run at the next unit of work and returns (and saves) the batches finished so far,
    with ``interrupted=True``; while it runs, SIGINT only sets a flag, and the previous handler is restored
    when it returns. A Ctrl-C before the first timed batch (while loading) raises KeyboardInterrupt.
    """
    with sigint_flag() as stop:
        return _run(config, target=target, drafter=drafter, baseline_drafter=baseline_drafter, tokenizer=tokenizer,
                    progress=progress, stop=stop, **overrides)


def _run(config: EvalConfig | None, *, target, drafter, baseline_drafter, tokenizer, progress: bool,
         stop: Interrupt, **overrides) -> EvalResults:
    t_start = time.perf_counter()
    cfg = dataclasses.replace(config or EvalConfig(), **overrides)
    for name in ("methods", "datasets", "budgets"):
        value = getattr(cfg, name)
        if isinstance(value, str):
            value = tuple(x.strip() for x in value.split(",") if x.strip())
        if isinstance(value, int) and name == "budgets":
            value = (value,)
        if value is not None:
            setattr(cfg, name, tuple(value))
    if isinstance(cfg.batch_sizes, list):
        cfg.batch_sizes = tuple(cfg.batch_sizes)
    if cfg.budgets is not None:
        try:
            cfg.budgets = tuple(int(b) if isinstance(b, str) else b for b in cfg.budgets)
        except ValueError:
            raise EvalError(f"--budgets: expected integers, got {cfg.budgets!r}") from None
    mcs, notes = validate(cfg, target_given=target is not None)
    if cfg.out:
        check_out(cfg.out)  # a bad --out is said before any work, not after the benchmark
    resolve_pair(cfg, target, drafter, baseline_drafter, mcs)  # a missing demo folder: said before anything is read
    sets = ds.load_all(cfg.datasets)

    def early_stop():  # a Ctrl-C before the first timed batch: nothing to keep
        if stop.requested:
            raise KeyboardInterrupt

    early_stop()
    pair = load_pair(cfg, target, drafter, baseline_drafter, mcs)
    early_stop()
    target, t_dir = pair.target, pair.target_dir
    notes += pair.notes
    tok, tok_src = load_tok(cfg, tokenizer, t_dir)
    from ..text import encode_prompt, eos_ids

    default_pair = pair.default
    if default_pair:
        notes.insert(0, DEFAULT_PAIR_NOTE)
    eos = [] if cfg.ignore_eos else eos_ids(tok, t_dir)
    vocab = target.config.vocab_size
    max_pos = target.config.max_position_embeddings

    # ---- prompts: the first max_samples prompts of each set that fit the target's positions
    selected: dict[str, list[tuple[int, int, list[int]]]] = {}
    skipped: list[dict[str, Any]] = []
    for s in sets:
        chosen: list[tuple[int, int, list[int]]] = []
        for i, (text, line, kind) in enumerate(zip(s.prompts, s.lines, s.kinds, strict=True)):
            if cfg.max_samples is not None and len(chosen) >= cfg.max_samples:
                break
            ids = encode_prompt(tok, text, kind)
            if not ids:
                raise TokenizerError(f"{s.path}:{line}: the prompt encodes to no token")
            if max(ids) >= vocab:
                raise TokenizerError(
                    f"{s.path}:{line}: tokenizer {tok_src} produced id {max(ids)}, outside the target's vocabulary "
                    f"[0, {vocab}) (is it the target's tokenizer?)"
                )
            if len(ids) + cfg.max_new_tokens > max_pos:
                skipped.append({"dataset": s.name, "index": i, "line": line, "prompt_tokens": len(ids),
                                "reason": f"prompt + max_new_tokens > max_position_embeddings ({max_pos})"})
                continue
            chosen.append((i, line, ids))
        if not chosen:
            notes.append(f"{s.name}: no prompt fits prompt + {cfg.max_new_tokens} new tokens <= {max_pos} positions; "
                         "set skipped")
        else:
            selected[s.name] = chosen
    if skipped:
        notes.append(f"{len(skipped)} prompt(s) longer than the target's {max_pos} positions allow were skipped "
                     "(listed in results.json setup.skipped)")
    if not selected:
        raise EvalError("--datasets: no prompt fits the target's max_position_embeddings; lower --max-new-tokens")
    n_batches = sum(math.ceil(len(rows) / cfg.batch_size) for rows in selected.values())
    if cfg.batch_sizes:  # the sweep: batch j of every size runs with seed + j
        n_batches = math.ceil(sum(len(rows) for rows in selected.values()) / min(cfg.batch_sizes))
    if cfg.seed + n_batches - 1 >= MAX_SEED:
        raise EvalError(f"--seed: batch i runs with seed + i, and {cfg.seed} + {n_batches - 1} is not below 2**63")

    # ---- shapes: one prompt width and one cache size for the whole run
    longest = max(len(ids) for rows in selected.values() for _, _, ids in rows)
    width = core.bucket(longest)
    # one engine per drafter, sharing the target, the cache size and the prompt width
    mesh = eval_mesh(cfg.mesh)
    engine = Engine(target, pair.drafter, eos=eos, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                    cache_size=1, prompt_width=width, mesh=mesh, carry_auto=not cfg.fresh_auto)
    base_engine = engine
    if pair.baseline is not None and pair.baseline is not pair.drafter:
        base_engine = Engine(target, pair.baseline, eos=eos, temperature=cfg.temperature,
                             max_new_tokens=cfg.max_new_tokens, cache_size=1, prompt_width=width, mesh=mesh,
                             carry_auto=not cfg.fresh_auto)
    use_base = {mc: pair.baseline is not None and uses_baseline(mc) for mc in mcs}
    engines = {mc: base_engine if use_base[mc] else engine for mc in mcs}
    drafter_of = {mc: (pair.baseline_dir if use_base[mc] else pair.drafter_dir) if mc.speculative else None
                  for mc in mcs}
    role_of = {mc: ("baseline" if use_base[mc] else "drafter") if mc.speculative else None for mc in mcs}
    plans = {mc: engines[mc].plan(mc) for mc in mcs}  # validates budget / top_c against the pair (ArgumentError)
    engine.cache_size = base_engine.cache_size = core.required_cache_size(
        longest, cfg.max_new_tokens, plans.values(), prompt_width=width)
    for size in cfg.batch_sizes or (cfg.batch_size,):  # a verify that cannot fit: refused now, before compiling
        for mc in mcs:
            check_memory(target, mc, plans[mc], size, engine.cache_size,
                         flag="--batch-sizes" if cfg.batch_sizes else "--budgets")
    early_stop()
    depths = {mc.label: engines[mc].depth(mc) for mc in mcs}
    labels = [mc.label for mc in mcs]
    setup = {
        "target": t_dir, "drafter": pair.drafter_dir, "baseline_drafter": pair.baseline_dir,
        "baseline_methods": [mc.label for mc in mcs if use_base[mc]],
        "tokenizer": tok_src, "default_pair": default_pair,
        "dtype": _param_dtype(target),
        "methods": [{**engines[mc].describe(mc), "drafter": drafter_of[mc], "drafter_role": role_of[mc]}
                    for mc in mcs],
        "labels": labels, "depths": depths,
        "eos_token_ids": eos, "cache_size": engine.cache_size, "prompt_width": width, "timing_path": engine.path,
        "mesh": None if mesh is None else dict(mesh.shape),
        "auto_memory": "fresh" if cfg.fresh_auto else "carried",
        "datasets": [{"name": s.name, "path": s.path, "kind": s.kind, "prompts_in_file": len(s),
                      "used": [i for i, _, _ in selected.get(s.name, [])]} for s in sets],
        "skipped": skipped,
        "protocol": _protocol_text(),
    }
    records: list[dict[str, Any]] = []
    interrupted = False
    warmed: set = set()
    stage_cap = cfg.stage_samples
    loads: list[float] = []

    def sample_load():
        la = load_average()
        if la is not None:
            loads.append(la)

    from tqdm.auto import tqdm

    units = [(engines[mc], mc) for mc in mcs]
    pool = sweep_records = None
    if cfg.batch_sizes:
        from . import sweep as _sweep

        pool, sweep_records = _sweep.prompt_pool(selected), []
    try:
        sample_load()
        if pool is not None:  # the batch-size sweep replaces the per-set batches (each shape warms up first)
            _sweep.run_sweep(units, cfg.batch_sizes, pool, seed=cfg.seed, repeats=cfg.repeats, warmed=warmed,
                             stop=stop, drafter_of=drafter_of, role_of=role_of, records=sweep_records,
                             after_batch=sample_load, progress=progress)
        first = next(iter(selected.values()))[: cfg.batch_size]
        first_batch = [ids for _, _, ids in first]
        bar = tqdm(mcs if pool is None else [], desc="warm-up (compiling)", unit="method", disable=not progress,
                   leave=False)
        for mc in bar:
            stop.check()
            bar.set_postfix_str(mc.label)
            eng = engines[mc]
            stages_warm = warm_up(eng, mc, first_batch, seed=cfg.seed, stages=stage_cap != 0)
            warmed.add(eng.shape_key(mc, first_batch))
            if stages_warm:
                warmed.add((eng.shape_key(mc, first_batch), "stages"))
        bar.close()
        sample_load()
        batch_no = 0
        for name, rows in selected.items() if pool is None else ():
            bar = tqdm(total=len(rows), desc=f"{name}", unit="sample", disable=not progress)
            staged = 0  # batches of this set that got the stage pass
            try:
                for b0 in range(0, len(rows), cfg.batch_size):
                    stop.check()
                    chunk = rows[b0 : b0 + cfg.batch_size]
                    batch = [ids for _, _, ids in chunk]
                    seed = cfg.seed + batch_no
                    stages = stage_cap is None or staged < stage_cap
                    raws = time_batch(units, batch, seed=seed, repeats=cfg.repeats, stages=stages, warmed=warmed,
                                      stop=stop)
                    done: list[dict[str, Any]] = []
                    for mc in mcs:
                        rec = _record(name, b0 // cfg.batch_size, seed, mc, chunk, raws[mc])
                        rec.update(drafter=drafter_of[mc], drafter_role=role_of[mc])
                        done.append(rec)
                    records.extend(done)  # a batch counts once every method has run it
                    sample_load()
                    staged += any(r["stage"] for r in done)
                    batch_no += 1
                    bar.update(len(chunk))
                    taus = []
                    for mc in mcs:
                        if mc.speculative:
                            lens = [s["acceptance_lengths"] for r in records
                                    if r["dataset"] == name and r["label"] == mc.label for s in r["samples"]]
                            taus.append(f"{_short(mc.label)}={metrics.tau_pooled(lens):.2f}")
                    if taus:
                        bar.set_postfix_str("tau " + " ".join(taus))
            finally:
                bar.close()
    except (Stopped, KeyboardInterrupt):
        interrupted = True
        n = len({(r["dataset"], s["index"]) for r in records for s in r["samples"]})
        if pool is not None:
            done = sorted({(r["batch_size"], r["batch"]) for r in sweep_records})
            notes.append(f"interrupted (Ctrl-C): the sweep covers the {len(done)} batch(es) every method had finished"
                         f" ({', '.join(f'size {b} #{j}' for b, j in done[:8])}{', ...' if len(done) > 8 else ''})")
        else:
            notes.append(f"interrupted (Ctrl-C): the results cover the {n} sample(s) every method had finished")
    cpus = os.cpu_count() or 1
    setup["timing"] = {
        "order": "interleaved: per batch, repetition r runs every method in turn (full run, then prefill-only)",
        "repeats": cfg.repeats,
        "statistics": "median and min over repetitions; spread = (max - min) / median of the full runs",
        "spread_warning": SPREAD_WARNING,
        "load_average_max": max(loads) if loads else None,
        "load_average_samples": len(loads),
        "cpu_count": cpus,
    }
    unmeasured = [f"{r['dataset']}/{r['label']}#{r['batch']}" for r in records
                  if r["loop_iterations"] > 0 and r["decode_seconds"] is None]
    if unmeasured:
        notes.append(f"decode time not measured for {len(unmeasured)} batch(es) ({', '.join(unmeasured[:6])}"
                     f"{', ...' if len(unmeasured) > 6 else ''}): the prefill-only runs took at least as long as the "
                     "full runs (a busy machine?); they are left out of TPOT, tok/s and speedup")
    ended = [(r["dataset"], s["index"]) for r in records if r["label"] == AR_LABEL for s in r["samples"]
             if s["output_tokens"] <= 1]
    if ended:
        notes.append(f"{len(ended)} response(s) ended at their first token ({', '.join(f'{d}#{i}' for d, i in ended)}):"
                     " no round, so they add nothing to tau, and a batch made only of such responses is left out of"
                     " TPOT")
    summary = summarize(records, labels, depths, list(selected), cfg.temperature)
    for row in summary:
        if row["same_as_ar"] is not None and row["same_as_ar"] < 1:
            notes.append(f"{row['dataset']}/{row['label']}: only {100 * row['same_as_ar']:.0f}% of greedy outputs "
                         "equal ar's (greedy speculative decoding should reproduce them exactly)")
    block = None
    if pool is not None:
        block = _sweep.sweep_block(sweep_records, labels, cfg.batch_sizes, pool, cfg.temperature)
        notes += _sweep.sweep_notes(block["rows"])
        setup["timing"]["order"] = ("interleaved: per (batch size, batch), repetition r runs every method in turn "
                                    "(full run, then prefill-only); no stage pass in a batch-size sweep")
    config_dict = dataclasses.asdict(cfg)
    results = EvalResults(config=config_dict, setup=setup, environment=_environment(), summary=summary,
                          records=records, interrupted=interrupted, notes=notes,
                          wall_seconds=time.perf_counter() - t_start, sweep=block)
    if cfg.out:
        results.setup["files"] = results.save(cfg.out, plots=cfg.plots)
    return results


def _record(dataset: str, batch_index: int, seed: int, mc: MethodConfig, chunk, raw) -> dict[str, Any]:
    out: BatchOutput = raw["output"]
    samples = []
    sizes = out.size_choices or [None] * len(out.tokens)
    for (index, line, ids), toks, lens, hits, sz in zip(chunk, out.tokens, out.acceptance_lengths,
                                                        out.accepted_per_depth, sizes, strict=True):
        samples.append({"index": index, "line": line, "prompt_tokens": len(ids), "output_tokens": len(toks),
                        "output_ids": toks, "rounds": len(lens), "acceptance_lengths": lens,
                        "accepted_per_depth": hits, **({"size_choices": sz} if sz is not None else {})})
    return {
        "dataset": dataset, "label": mc.label, "method": mc.method, "budget": mc.budget, "batch": batch_index,
        "seed": seed, "samples": samples, "run_seconds": raw["run_seconds"], "prefill_seconds": raw["prefill_seconds"],
        "decode_seconds": raw["decode_seconds"], "decode_seconds_min": raw.get("decode_seconds_min"),
        "run_spread": raw.get("run_spread"), "output_tokens": raw["output_tokens"],
        "loop_iterations": raw["loop_iterations"], "stage": raw["stage"],
    }


def _protocol_text() -> str:
    doc = __doc__ or ""
    return " ".join(doc.split("Timing protocol", 1)[-1].split())
