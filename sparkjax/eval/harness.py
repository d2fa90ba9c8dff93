"""The benchmark loop: load a pair and prompt sets, warm up, time every method, summarise.

Timing protocol (per batch of prompts, per method; see :mod:`sparkjax.eval` for the summary):

1. Warm-up: before anything is timed, every method is compiled and run once on the first
   batch's shapes (and on any later new shape, e.g. a smaller last batch, before it is timed).
2. Timed pass, sync-free: ``repeats`` times, alternately, (a) the full generation (the engine's
   one jitted ``while_loop`` program, ``max_new_tokens`` new tokens) and (b) a prefill-only run
   of the same shapes (``max_new_tokens = 1``: target prefill, first token and the drafter's
   context projection of the prompt features, then no round). Each run is timed on the host from
   dispatch to ``jax.block_until_ready`` of its outputs.
   ``decode seconds = median(a) - median(b)``: the rounds only, with prefill, the first token and
   the prompt-context part of the first draft pass excluded. (Round 1's drafter block pass stays
   in; in upstream code it is part of the first draft call too, so this is an approximation.)
3. TPOT = decode seconds / output tokens of the batch (all generated tokens, the first included,
   as upstream counts them); a method's TPOT is the mean over batches (= over responses at batch
   size 1; a batch whose first token already ended it has no decode step and is left out),
   tokens/s = 1 / TPOT and speedup = TPOT(ar) / TPOT(method), ar being timed in the
   same run, on the same batches, with the same cache size, interleaved with the other methods.
4. Stage pass (separate, synced; on the first ``stage_samples`` prompts of each set that have at
   least one round): the engine's instrumented mode (``instrument=True``) runs the same batch stage
   by stage (draft, tree, verify, commit), blocking after each; per-stage time per round = summed
   stage seconds / rounds (loop iterations) of the instrumented batches. Its stage functions are
   compiled (warmed up) on a batch with a round before one is timed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import platform
import statistics
import time
from typing import Any

import jax

from .. import decode
from ..config import read_json
from . import datasets as ds
from . import metrics
from .engine import BatchOutput, Engine, MethodConfig
from .errors import EvalError, TokenizerError

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_PAIR = ROOT / "tests" / "fixtures" / "tiny_dspark_b16"
DEFAULT_BUDGETS = (16, 64)
STAGES = ("draft", "tree", "verify", "commit")
DEFAULT_PAIR_NOTE = (
    "The default pair is a tiny synthetic pair (a 6-layer, vocab-320 Qwen3 with a block-16 DSpark drafter, "
    "fitted to it on random tokens, and a synthetic byte-level tokenizer): its acceptance numbers demonstrate "
    "the machinery, not language quality, and its CPU timings say nothing about real models on accelerators."
)


@dataclasses.dataclass
class EvalConfig:
    """Every setting of a run (the CLI flags, one to one).

    ``target`` / ``drafter`` / ``tokenizer``: folders (None: the bundled default pair and its tokenizer;
    with another target, the tokenizer defaults to the target folder). ``budgets``: tree sizes for the
    tree methods (None: 16 and 64 when a tree method is asked for). ``max_samples``: prompts per set
    (None: all). ``stage_samples``: prompts per set (the first ones) that also get the instrumented
    stage pass (None: all of them, 0: none). ``out``: where to write results.json, results.csv and
    the plots (None: nowhere).
    """

    target: str | None = None
    drafter: str | None = None
    tokenizer: str | None = None
    dtype: str | None = None
    methods: tuple[str, ...] = decode.METHODS
    budgets: tuple[int, ...] | None = None
    top_c: int | None = None
    temperature: float = 0.0
    datasets: tuple[str, ...] = ds.BUNDLED
    max_samples: int | None = 3
    max_new_tokens: int = 32
    batch_size: int = 1
    seed: int = 0
    repeats: int = 1
    stage_samples: int | None = 1
    ignore_eos: bool = False
    out: str | None = None
    plots: bool = True


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
    for m in methods:
        if m not in decode.METHODS:
            raise EvalError(f"--methods: unknown method {m!r}; choose from {', '.join(decode.METHODS)}")
    dupes = sorted({m for m in methods if methods.count(m) > 1})
    if dupes:
        raise EvalError(f"--methods: {dupes[0]!r} is listed twice")
    trees = [m for m in methods if m in decode.TREE_METHODS]
    for flag, value in (("--budgets", cfg.budgets), ("--top-c", cfg.top_c)):
        if value is not None and not trees:
            given = ",".join(str(v) for v in value) if isinstance(value, tuple | list) else str(value)
            raise EvalError(
                f"{flag}: {given} given, but none of --methods ({','.join(methods)}) builds a tree; "
                f"{flag} applies only to {', '.join(decode.TREE_METHODS)}"
            )
    budgets = tuple(cfg.budgets) if cfg.budgets is not None else DEFAULT_BUDGETS
    if cfg.budgets is not None and not budgets:
        raise EvalError("--budgets: empty list")
    for b in budgets:
        _positive("--budgets", b)
    if len(set(budgets)) != len(budgets):
        raise EvalError(f"--budgets: duplicate budget in {list(budgets)}")
    _positive("--top-c", cfg.top_c, allow_none=True)
    if "ar" not in methods:
        methods.insert(0, "ar")
        notes.append("ar was added to --methods: it is the reference every speedup is measured against")
    out: list[MethodConfig] = []
    for m in methods:
        if m in decode.TREE_METHODS:
            out += [MethodConfig(m, int(b), cfg.top_c) for b in budgets]
        else:
            out.append(MethodConfig(m))
    out.sort(key=lambda mc: mc.method != "ar")  # ar first
    return out, notes


def validate(cfg: EvalConfig) -> tuple[list[MethodConfig], list[str]]:
    """Checks every setting that needs no model; returns the benchmark columns and notes."""
    mcs, notes = method_configs(cfg)
    try:
        decode.check_temperature(cfg.temperature)
    except Exception as e:  # ArgumentError
        raise EvalError(f"--temperature: {e}") from None
    _positive("--max-samples", cfg.max_samples, allow_none=True)
    _positive("--max-new-tokens", cfg.max_new_tokens)
    _positive("--batch-size", cfg.batch_size)
    _positive("--repeats", cfg.repeats)
    _positive("--stage-samples", cfg.stage_samples, allow_none=True, allow_zero=True)
    if not cfg.datasets:
        raise EvalError("--datasets: no prompt set given")
    if cfg.drafter is not None and cfg.target is None:
        raise EvalError("--drafter: given without --target (the bundled default drafter only fits the default target)")
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

    def to_dict(self) -> dict[str, Any]:
        return {"format": "sparkjax.eval/1", **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EvalResults:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def load(cls, path: str | os.PathLike) -> EvalResults:
        """Reads a ``results.json`` (EvalError naming the file when it is not one)."""
        d = read_json(path, EvalError, "results file")
        if not isinstance(d.get("summary"), list) or "config" not in d:
            raise EvalError(f"{path}: not a sparkjax.eval results.json (no 'summary' / 'config')")
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
        """Writes results.json, results.csv and (with ``plots``) the PNG plots into ``out``; returns the paths."""
        from .report import write_csv, write_json

        folder = pathlib.Path(out)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise EvalError(f"--out: cannot create {folder} ({e.strerror or e})") from None
        paths = [write_json(self, folder / "results.json"), write_csv(self, folder / "results.csv")]
        if plots and self.summary:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                self.notes.append("plots skipped: matplotlib is not installed (pip install matplotlib)")
            else:
                from .plots import make_plots

                paths += make_plots(self, folder)
        return [str(p) for p in paths]


def summarize(records: list[dict[str, Any]], labels: list[str], depths: dict[str, int],
              dataset_names: list[str], temperature: float) -> list[dict[str, Any]]:
    """Summary rows per (dataset, method) and pooled over all datasets (``dataset == "all"``)."""
    rows: list[dict[str, Any]] = []
    ar_outputs = {(r["dataset"], s["index"]): s["output_ids"] for r in records if r["label"] == "ar"
                  for s in r["samples"]}
    groups = [(name, [r for r in records if r["dataset"] == name]) for name in dataset_names]
    groups = [(name, recs) for name, recs in groups if recs]
    if len(groups) > 1:
        groups.append(("all", records))
    for name, recs in groups:
        if not recs:
            continue
        ar_tpot = None
        for label in labels:
            rr = [r for r in recs if r["label"] == label]
            if not rr:
                continue
            samples = [s for r in rr for s in r["samples"]]
            lens = [s["acceptance_lengths"] for s in samples]
            depth = depths.get(label, 0)
            rounds = [len(a) for a in lens]
            # a unit whose first token already ended it (no decode step) has no decode time to speak of
            timed = [r for r in rr if r["loop_iterations"] > 0]
            tp = metrics.mean_tpot([r["decode_seconds"] for r in timed], [r["output_tokens"] for r in timed])
            if label == "ar":
                ar_tpot = tp
            staged = [r for r in rr if r.get("stage")]
            stage = None
            if staged:
                stage = metrics.stage_ms_per_round([r["stage"]["seconds"] for r in staged],
                                                   [r["stage"]["rounds"] for r in staged])
                stage["total"] = sum(stage[k] for k in STAGES if k in stage)
            same = None
            if temperature == 0 and label != "ar":
                pairs = [(s["output_ids"], ar_outputs.get((r["dataset"], s["index"])))
                         for r in rr for s in r["samples"]]
                pairs = [(a, b) for a, b in pairs if b is not None]
                same = sum(a == b for a, b in pairs) / len(pairs) if pairs else None
            r0 = rr[0]
            rows.append({
                "dataset": name,
                "label": label,
                "method": r0["method"],
                "budget": r0["budget"],
                "n_samples": len(samples),
                "n_batches": len(rr),
                "output_tokens": sum(s["output_tokens"] for s in samples),
                "rounds": sum(rounds),
                "tau_pooled": metrics.tau_pooled(lens),
                "tau_per_response": metrics.tau_per_response(lens),
                "accept_rate": metrics.accept_rates([s["accepted_per_depth"] for s in samples], rounds, depth)
                if depth else [],
                "decode_seconds": sum(r["decode_seconds"] for r in rr),
                "prefill_ms": 1000 * statistics.mean(statistics.median(r["prefill_seconds"]) for r in rr),
                "tpot_ms": 1000 * tp,
                "round_ms": _ratio_ms(sum(r["decode_seconds"] for r in rr), sum(r["loop_iterations"] for r in rr)),
                "tokens_per_s": 1 / tp if tp > 0 else math.nan,
                "speedup": metrics.speedup(ar_tpot, tp) if ar_tpot is not None else math.nan,
                "stage_ms_per_round": stage,
                "stage_samples": sum(len(r["samples"]) for r in staged),
                "same_as_ar": same,
            })
    return rows


def _param_dtype(model) -> str:
    from flax import nnx

    leaves = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
    return str(leaves[0].dtype) if leaves else "?"


def _ratio_ms(seconds: float, count: int) -> float:
    return 1000 * seconds / count if count else math.nan


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


def _is_default_target(target) -> bool:
    try:
        return pathlib.Path(target).resolve() == (DEFAULT_PAIR / "target").resolve()
    except TypeError:
        return False


def load_pair(cfg: EvalConfig, target=None, drafter=None, need_drafter: bool = True):
    """Loads (or takes) the target and drafter; returns (target, drafter, target_dir, drafter_dir)."""
    from ..convert import load_drafter, load_target

    t_src = target if target is not None else (cfg.target or str(DEFAULT_PAIR / "target"))
    if isinstance(t_src, str | os.PathLike):
        t_dir = str(t_src)
        target = load_target(t_dir, dtype=cfg.dtype)
    else:
        target, t_dir = t_src, getattr(t_src, "source", None)
    d_src = drafter if drafter is not None else cfg.drafter
    if d_src is None and t_dir is not None and _is_default_target(t_dir):
        d_src = str(DEFAULT_PAIR / "drafter")
    if not need_drafter:
        return target, None, t_dir, None
    if d_src is None:
        raise EvalError("--drafter: the speculative methods need a drafter for this target (or use --methods ar)")
    if isinstance(d_src, str | os.PathLike):
        d_dir = str(d_src)
        drafter = load_drafter(d_dir, target=target, dtype=cfg.dtype)
    else:
        from ..config import validate_pair

        drafter, d_dir = d_src, getattr(d_src, "source", None)
        validate_pair(drafter.config, target.config, drafter_source=str(d_dir or "<drafter>"),
                      target_source=str(t_dir or "<target>"))
    return target, drafter, t_dir, d_dir


def load_tok(cfg: EvalConfig, tokenizer, t_dir):
    from .tokenizer import default_tokenizer_dir, load_tokenizer

    if tokenizer is not None and not isinstance(tokenizer, str | os.PathLike):
        return tokenizer, getattr(tokenizer, "name_or_path", "<tokenizer object>")
    src = tokenizer or cfg.tokenizer
    if src is not None:
        return load_tokenizer(src), str(src)
    if t_dir is not None and _is_default_target(t_dir):
        folder = default_tokenizer_dir()
        return load_tokenizer(folder, what="default pair tokenizer"), str(folder)
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


def run_batch(engine: Engine, mc: MethodConfig, batch: list[list[int]], *, seed: int, repeats: int,
              stages: bool, warmed: set) -> dict[str, Any]:
    """Times one batch with one method (see the module docstring); returns the raw record."""
    key = engine.shape_key(mc, batch)
    if key not in warmed:
        warm_up(engine, mc, batch, seed=seed, stages=False)
        warmed.add(key)
    run_s: list[float] = []
    pre_s: list[float] = []
    res = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = jax.block_until_ready(engine.launch(mc, batch, seed))
        run_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        jax.block_until_ready(engine.launch(mc, batch, seed, prefill_only=True))
        pre_s.append(time.perf_counter() - t0)
    out: BatchOutput = engine.outputs(res)
    n_out = sum(len(t) for t in out.tokens)
    if mc.speculative:
        iterations = max((len(a) for a in out.acceptance_lengths), default=0)
    else:  # ar: the first token comes from the prefill, then one loop step per token
        iterations = max((len(t) for t in out.tokens), default=1) - 1
    stage = None
    if stages and mc.speculative and iterations > 0:  # a batch without a round has no stage to time
        if (key, "stages") not in warmed:  # the stage functions compile on their first round
            engine.instrumented(mc, batch, seed)
            warmed.add((key, "stages"))
        ins = engine.instrumented(mc, batch, seed)
        stage = {"seconds": ins.stage_seconds, "rounds": max((len(a) for a in ins.acceptance_lengths), default=0),
                 "acceptance_lengths": ins.acceptance_lengths}
    return {
        "loop_iterations": iterations,
        "output": out,
        "run_seconds": run_s,
        "prefill_seconds": pre_s,
        "decode_seconds": metrics.decode_seconds(run_s, pre_s),
        "output_tokens": n_out,
        "stage": stage,
    }


def warm_up(engine: Engine, mc: MethodConfig, batch: list[list[int]], *, seed: int, stages: bool) -> bool:
    """Compiles (and runs once) everything :func:`run_batch` will time for this shape. Returns whether the
    instrumented mode got warm too: its stage functions only compile when the batch has a round."""
    jax.block_until_ready(engine.launch(mc, batch, seed))
    jax.block_until_ready(engine.launch(mc, batch, seed, prefill_only=True))
    if stages and mc.speculative:
        return any(engine.instrumented(mc, batch, seed).acceptance_lengths)
    return False


def run(config: EvalConfig | None = None, *, target=None, drafter=None, tokenizer=None, progress: bool = True,
        **overrides) -> EvalResults:
    """Runs the benchmark and returns :class:`EvalResults` (also saved to ``config.out`` when set).

    ``target`` / ``drafter`` / ``tokenizer`` may be folders or already loaded objects (a loaded
    target / drafter / transformers tokenizer), which override the config's paths. Keyword
    ``overrides`` set :class:`EvalConfig` fields, e.g. ``run(methods=("ar", "dspark"), max_samples=2)``.
    A KeyboardInterrupt stops the run and returns (and saves) the batches finished so far, with
    ``interrupted=True``.
    """
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
    if cfg.budgets is not None:
        try:
            cfg.budgets = tuple(int(b) if isinstance(b, str) else b for b in cfg.budgets)
        except ValueError:
            raise EvalError(f"--budgets: expected integers, got {cfg.budgets!r}") from None
    mcs, notes = validate(cfg)
    sets = ds.load_all(cfg.datasets)
    need_drafter = any(mc.speculative for mc in mcs)
    target, drafter, t_dir, d_dir = load_pair(cfg, target, drafter, need_drafter)
    tok, tok_src = load_tok(cfg, tokenizer, t_dir)
    from .tokenizer import encode_prompt, eos_ids

    default_pair = t_dir is not None and _is_default_target(t_dir)
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
        for i, (text, line) in enumerate(zip(s.prompts, s.lines, strict=True)):
            if cfg.max_samples is not None and len(chosen) >= cfg.max_samples:
                break
            ids = encode_prompt(tok, text)
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

    # ---- shapes: one prompt width and one cache size for the whole run
    longest = max(len(ids) for rows in selected.values() for _, _, ids in rows)
    width = decode.bucket(longest)
    engine = Engine(target, drafter, eos=eos, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                    cache_size=1, prompt_width=width)
    extra = 0
    for mc in mcs:
        p = engine.plan(mc)  # validates budget / top_c against the pair (ArgumentError)
        if p is not None:
            extra = max(extra, p.depth + p.nodes + 2)
    engine.cache_size = max(width, decode.bucket(longest + cfg.max_new_tokens + extra))
    depths = {mc.label: engine.depth(mc) for mc in mcs}
    labels = [mc.label for mc in mcs]
    setup = {
        "target": t_dir, "drafter": d_dir, "tokenizer": tok_src, "default_pair": default_pair,
        "dtype": _param_dtype(target),
        "methods": [engine.describe(mc) for mc in mcs], "labels": labels, "depths": depths,
        "eos_token_ids": eos, "cache_size": engine.cache_size, "prompt_width": width, "timing_path": engine.path,
        "datasets": [{"name": s.name, "path": s.path, "prompts_in_file": len(s),
                      "used": [i for i, _, _ in selected.get(s.name, [])]} for s in sets],
        "skipped": skipped,
        "protocol": _protocol_text(),
    }
    records: list[dict[str, Any]] = []
    interrupted = False
    warmed: set = set()
    stage_cap = cfg.stage_samples
    from tqdm.auto import tqdm

    try:
        first = next(iter(selected.values()))[: cfg.batch_size]
        first_batch = [ids for _, _, ids in first]
        bar = tqdm(mcs, desc="warm-up (compiling)", unit="method", disable=not progress, leave=False)
        for mc in bar:
            bar.set_postfix_str(mc.label)
            stages_warm = warm_up(engine, mc, first_batch, seed=cfg.seed, stages=stage_cap != 0)
            warmed.add(engine.shape_key(mc, first_batch))
            if stages_warm:
                warmed.add((engine.shape_key(mc, first_batch), "stages"))
        batch_no = 0
        for name, rows in selected.items():
            bar = tqdm(total=len(rows), desc=f"{name}", unit="sample", disable=not progress)
            staged = 0  # batches of this set that got the stage pass
            try:
                for b0 in range(0, len(rows), cfg.batch_size):
                    chunk = rows[b0 : b0 + cfg.batch_size]
                    batch = [ids for _, _, ids in chunk]
                    seed = cfg.seed + batch_no
                    stages = stage_cap is None or staged < stage_cap
                    done: list[dict[str, Any]] = []
                    for mc in mcs:
                        raw = run_batch(engine, mc, batch, seed=seed, repeats=cfg.repeats, stages=stages,
                                        warmed=warmed)
                        done.append(_record(name, b0 // cfg.batch_size, seed, mc, chunk, raw))
                    records.extend(done)  # a batch counts once every method has run it
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
    except KeyboardInterrupt:
        interrupted = True
        n = len({(r["dataset"], s["index"]) for r in records for s in r["samples"]})
        notes.append(f"interrupted (Ctrl-C): the results cover the {n} sample(s) every method had finished")
    ended = [(r["dataset"], s["index"]) for r in records if r["label"] == "ar" for s in r["samples"]
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
    config_dict = dataclasses.asdict(cfg)
    results = EvalResults(config=config_dict, setup=setup, environment=_environment(), summary=summary,
                          records=records, interrupted=interrupted, notes=notes,
                          wall_seconds=time.perf_counter() - t_start)
    if cfg.out:
        results.setup["files"] = results.save(cfg.out, plots=cfg.plots)
    return results


def _record(dataset: str, batch_index: int, seed: int, mc: MethodConfig, chunk, raw) -> dict[str, Any]:
    out: BatchOutput = raw["output"]
    samples = []
    for (index, line, ids), toks, lens, hits in zip(chunk, out.tokens, out.acceptance_lengths,
                                                    out.accepted_per_depth, strict=True):
        samples.append({"index": index, "line": line, "prompt_tokens": len(ids), "output_tokens": len(toks),
                        "output_ids": toks, "rounds": len(lens), "acceptance_lengths": lens,
                        "accepted_per_depth": hits})
    return {
        "dataset": dataset, "label": mc.label, "method": mc.method, "budget": mc.budget, "batch": batch_index,
        "seed": seed, "samples": samples, "run_seconds": raw["run_seconds"], "prefill_seconds": raw["prefill_seconds"],
        "decode_seconds": raw["decode_seconds"], "output_tokens": raw["output_tokens"],
        "loop_iterations": raw["loop_iterations"], "stage": raw["stage"],
    }


def _protocol_text() -> str:
    doc = __doc__ or ""
    return " ".join(doc.split("Timing protocol", 1)[-1].split())
