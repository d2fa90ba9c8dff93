"""Real-size round cost, measured: AR steps and forced-acceptance rounds of every method, on this device.

    python -m sparkjax.bench scale --preset reduced                   # CPU, minutes
    python -m sparkjax.bench scale --preset real --timeout 450        # GPU
    python -m sparkjax.bench scale --preset reduced --from-disk /tmp/scale_pair
    python -m sparkjax.bench scale --memory --preset real --batches 1,8,32 --contexts 2048,8192

Random bf16 weights; interleaved timing of the AR step and of each method's round with forced acceptance (every
round commits ``--accept`` drafts + the bonus), plus the per-stage split. ``--from-disk``: loading the pair in a
fresh process; ``--memory``: the memory analysis of programs compiled from abstract shapes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparkjax.engine.api import estimate_memory
from sparkjax.engine.methods import AR
from sparkjax.engine.names import parse_method
from sparkjax.engine.options import DEFAULT_OPTIONS
from sparkjax.engine.programs import spec_program, spec_start, split_pair, stage_call
from sparkjax.engine.round import STAGES
from sparkjax.engine.state import Acceptance
from sparkjax.errors import ArgumentError
from sparkjax.io.hf import load_drafter, load_target, save_drafter, save_target
from sparkjax.io.safetensors import WeightFiles

from . import timing
from .common import (
    SIZE_KEYS,
    TAU,
    WRITEUP_SPEEDUP,
    abstract_models,
    add_output,
    at_least,
    child_env,
    configs,
    describe,
    device_name,
    ints,
    label_fields,
    log,
    lower,
    method_labels,
    names,
    pct,
    random_pair,
    sizes,
    write_text,
)

METHODS = "dflash,dspark,ddtree,sparklingtree,sparklingtree-beam"
PRESET_DEFAULTS = {  # batches, budgets, context, prompt, steps, rounds, reps
    "tiny": ("1,8", "16,64", 256, 16, 8, 4, 3),
    "demo": ("1,8", "16,64", 512, 64, 16, 4, 3),
    "reduced": ("1,8", "16,64", 1024, 128, 16, 4, 3),
    "real": ("1,8", "16,64", 2048, 512, 32, 8, 5),
}


def add_arguments(p) -> None:
    p.add_argument("--preset", default="reduced", help="tiny (tests), demo, reduced (CPU, minutes), real (GPU)")
    p.add_argument("--methods", help=f"names, or name@budget for one tree budget (default {METHODS}; --memory: "
                   "sparklingtree@64)")
    p.add_argument("--budgets", help="tree budgets (default 16,64)")
    p.add_argument("--batches", help="batch sizes (default 1,8)")
    p.add_argument("--context", type=int, help="cache slots (default: reduced 1024, real 2048)")
    p.add_argument("--prompt", type=int, help="prompt tokens per sequence (default: reduced 128, real 512)")
    p.add_argument("--accept", type=int, default=6, help="drafted tokens every forced round accepts (default 6: "
                   "7 committed per round, close to tau 7.34)")
    p.add_argument("--steps", type=int, help="AR steps of the long AR run")
    p.add_argument("--rounds", type=int, help="rounds of the long forced run")
    p.add_argument("--reps", type=int, help="interleaved repetitions")
    p.add_argument("--no-stages", action="store_true", help="skip the per-stage split (saves the stage compiles)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tau", type=float, default=TAU, help="accepted tokens per round for the projected speedup")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds: stop starting new work after this, print what was measured")
    p.add_argument("--from-disk", metavar="DIR", help="write the random pair to DIR once (cached), then load it "
                   "through the converters and report load time and peak host RSS")
    p.add_argument("--memory", action="store_true", help="compile the whole generation program from abstract "
                   "shapes per batch x context and report its memory analysis and compile time (runs nothing)")
    p.add_argument("--contexts", default="2048,8192", help="--memory: cache sizes")
    p.add_argument("--measure-load", metavar="DIR", help=argparse.SUPPRESS)
    add_output(p)


def forced_acceptance(prop, ver, accept: int, depth: int) -> Acceptance:
    """The round's :class:`~sparkjax.engine.state.Acceptance` when exactly ``accept`` drafts are taken: the path
    to the deepest node of depth at most ``accept`` (lowest index among equals), topped up with other nodes in
    index order when shorter; the bonus token is the target's argmax at the last row."""
    b, m = prop.tokens.shape
    rows = jnp.arange(m + 1, dtype=jnp.int32)
    row_depth = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), prop.depths.astype(jnp.int32)], axis=1)
    real = jnp.concatenate([jnp.ones((b, 1), bool), prop.tokens >= 0], axis=1)
    score = jnp.where(real & (row_depth <= accept), row_depth * (m + 2) - rows[None], -1)
    leaf = jnp.argmax(score, axis=1).astype(jnp.int32)  # [B]
    anc = jnp.take_along_axis(prop.mask, leaf[:, None, None], axis=1)[:, 0]  # [B, M + 1] the path's rows
    j = jnp.arange(depth + 1, dtype=jnp.int32)
    on = anc[:, None, :] & (row_depth[:, None, :] == j[None, :, None])  # [B, D + 1, M + 1]
    path = jnp.where(on.any(-1), jnp.argmax(on, axis=-1), -1).astype(jnp.int32)
    reached = jnp.take_along_axis(row_depth, leaf[:, None], axis=1)  # [B, 1] the path's depth
    others = jnp.argsort(jnp.where(anc, m + 1 + rows[None], rows[None]), axis=1).astype(jnp.int32)  # off-path first
    extra = jnp.take_along_axis(others, jnp.clip(j[None] - reached - 1, 0, m), axis=1)
    indices = jnp.where(j[None] <= reached, path, jnp.where(j[None] <= accept, extra, -1))
    last = jnp.take_along_axis(indices, jnp.full((b, 1), accept, jnp.int32), axis=1)[:, 0]
    logits = jnp.take_along_axis(ver.logits, last[:, None, None], axis=1)[:, 0]
    return Acceptance(indices, jnp.full((b,), accept + 1, jnp.int32), jnp.argmax(logits, axis=-1).astype(jnp.int32))


@functools.cache
def _forced_class(cls: type) -> type:
    @dataclasses.dataclass(frozen=True)
    class Forced(cls):
        forced_accept: int = 0

        def __post_init__(self):  # the fields come from a checked method (whose table entry names its own class)
            pass

        def accept(self, prop, ver, temperature, key, *, plan):
            return forced_acceptance(prop, ver, self.forced_accept, plan.depth)

    Forced.__name__ = Forced.__qualname__ = f"Forced{cls.__name__}"
    return Forced


def forced(method, accept: int):
    """``method`` with forced acceptance of ``accept`` drafts per round (bench only)."""
    fields = {f.name: getattr(method, f.name) for f in dataclasses.fields(method) if f.init}
    return _forced_class(type(method))(**fields, forced_accept=accept)


@dataclasses.dataclass
class Case:
    """One row: ``label`` at ``batch``; ``short`` / ``long`` run the program to few / many tokens; ``units`` are
    the AR steps or rounds between them."""

    label: str
    batch: int
    short: object
    long: object
    units: float
    accepted: float | None = None
    plan: object = None

    def sample(self) -> float:
        return (timing.wall(self.long) - timing.wall(self.short)) / self.units


def _prompts(batch: int, prompt: int, vocab: int, seed: int):
    tokens = np.random.default_rng(seed + batch).integers(0, vocab, (batch, prompt)).astype(np.int32)
    return jnp.asarray(tokens), jnp.full((batch,), prompt, jnp.int32)


def ar_case(target, batch: int, prompt: int, steps: int, context: int, seed: int, opts=DEFAULT_OPTIONS) -> Case:
    plan = AR().plan(target, None, False, opts)
    g, s = split_pair(target, None)
    tokens, lengths = _prompts(batch, prompt, target.config.vocab_size, seed)
    none, key = jnp.array([-1], jnp.int32), jax.random.key(seed)
    buf = 1 << max(steps + 2, 2).bit_length()

    def run(n):
        return lambda: spec_program(g, s, tokens, lengths, jnp.int32(n), none, jnp.float32(0.0), key, None,
                                    plan=plan, cache_size=context, buf_len=buf)[1]

    short, long = run(2), run(steps + 1)
    n_short, n_long = int(short()[0]), int(long()[0])  # compile + warm-up, and the check
    if (n_short, n_long) != (2, steps + 1):
        raise RuntimeError(f"ar: ran {n_short} / {n_long} tokens, expected 2 / {steps + 1}")
    return Case("ar", batch, short, long, steps - 1, plan=plan)


def forced_plan(target, drafter, label: str, accept: int, options=DEFAULT_OPTIONS):
    plan = forced(parse_method(label), accept).plan(target, drafter, False, options)
    if not 0 <= accept <= min(plan.depth, plan.nodes):
        raise ArgumentError(f"--accept: {accept} drafts per round; {label} drafts {plan.depth} depths and "
                            f"verifies {plan.nodes} nodes")
    return plan


def round_case(target, drafter, label: str, batch: int, prompt: int, rounds: int, accept: int, context: int,
               seed: int, own=None) -> Case:
    """The rounds of ``label`` forced to accept ``accept`` drafts, or of the plan ``own`` (its own acceptance)."""
    per_round = accept + 1 if own is None else own.depth + 1
    plan = forced_plan(target, drafter, label, accept) if own is None else own
    graphdefs, states = split_pair(target, drafter)
    tokens, lengths = _prompts(batch, prompt, target.config.vocab_size, seed)
    none, key = jnp.array([-1], jnp.int32), jax.random.key(seed)
    plan, inputs = plan.method.bind(plan, target=target, drafter=drafter, batch=batch, cache_size=context)
    buf = 1 << (rounds * (plan.depth + 1) + 2).bit_length()

    def run(n_rounds):
        return lambda: spec_program(graphdefs, states, tokens, lengths, jnp.int32(1 + n_rounds * per_round), none,
                                    jnp.float32(0.0), key, inputs, plan=plan, cache_size=context, buf_len=buf)

    short, long = run(1), run(rounds)
    r_s, (lens_l, r_l) = np.asarray(short()[3]), (np.asarray(x) for x in long()[2:4])
    lens = lens_l[:, : int(r_l.max())]
    units = float(r_l.max() - r_s.max())
    if units < 1:
        raise RuntimeError(f"{label}: the long run made {r_l.max()} rounds, the short one {r_s.max()}")
    return Case(label, batch, lambda: short()[3], lambda: long()[3], units, float(lens[lens > 0].mean()) - 1, plan)


def stage_split(target, drafter, plan, batch: int, prompt: int, accept: int, context: int, seed: int,
                rounds: int = 3) -> dict:
    """Median seconds per stage over ``rounds`` forced rounds (each stage its own jitted, synced call)."""
    graphdefs, states = split_pair(target, drafter)
    tokens, lengths = _prompts(batch, prompt, target.config.vocab_size, seed)
    none = jnp.array([-1], jnp.int32)
    max_new = jnp.int32(1 + (rounds + 2) * (accept + 1))
    buf = 1 << ((rounds + 2) * (plan.depth + 1) + 2).bit_length()
    plan, inputs = plan.method.bind(plan, target=target, drafter=drafter, batch=batch, cache_size=context)
    state = spec_start(graphdefs, states, tokens, lengths, max_new, none, jnp.float32(0.0), jax.random.key(seed),
                       inputs, plan=plan, cache_size=context, buf_len=buf)
    times: dict[str, list[float]] = {s: [] for s in STAGES}
    record = [False]

    def timed(fn, *args, **kwargs):
        t0 = time.perf_counter()
        res = jax.block_until_ready(stage_call(graphdefs, states, args, fn=fn, plan=plan))
        if record[0]:
            times[fn.stage].append(time.perf_counter() - t0)
        return res

    for r in range(rounds + 1):  # the first round compiles
        record[0] = r > 0
        state = plan.method.round(target, drafter, state, plan, call=timed)
    return {s: timing.Stats.of(v).median for s, v in times.items() if v}


def _row(case: Case, stats: timing.Stats, ar: timing.Stats, context: int, prompt: int, accept: int,
         tau: float) -> dict:
    row = {"label": case.label, **label_fields(case.label), "batch": case.batch, "context": context,
           "prompt": prompt, "ms": {"median": stats.median * 1e3, "min": stats.min * 1e3, "spread": stats.spread,
                                    "n": stats.n}, "ar_step_ms": ar.median * 1e3}
    if not case.plan.drafts:
        row["round_ar_steps"] = 1.0
    else:
        ok = ar.median > 0 and ar.min > 0 and stats.median > 0  # else noise beat the work: no ratio
        row.update({"forced_accept": accept, "accepted": case.accepted, "committed_per_round": case.accepted + 1,
                    "round_ar_steps": stats.median / ar.median if ok else None,
                    "round_ar_steps_min": stats.min / ar.min if ok else None, "tau": tau,
                    "projected_speedup": tau / (stats.median / ar.median) if ok else None,
                    "writeup_speedup": WRITEUP_SPEEDUP})
    if stats.min <= 0:
        row["note"] = "a repetition's difference was <= 0 (noise larger than the work): not clamped"
    return row


def bench(target, drafter, a, labels, batches, prompt, steps, rounds, context, reps, deadline, report) -> bool:
    """Appends the rows to ``report.rows``; False when ``deadline`` cut the run short."""
    pending = []
    for b in batches:
        if time.perf_counter() > deadline:
            return False
        t0 = time.perf_counter()
        cases = [ar_case(target, b, prompt, steps, context, a.seed)]
        log(f"  [B={b}] ar compiled and warmed in {time.perf_counter() - t0:.0f}s")
        for m in labels:
            if time.perf_counter() > deadline:
                break
            t0 = time.perf_counter()
            cases.append(round_case(target, drafter, m, b, prompt, rounds, a.accept, context, a.seed))
            log(f"  [B={b}] {m} compiled and warmed in {time.perf_counter() - t0:.0f}s")

        def keep(stats, cases=cases):
            done = [c for c in cases if c.label in stats] if "ar" in stats else []
            rows = [_row(c, stats[c.label], stats["ar"], context, prompt, a.accept, a.tau) for c in done]
            report.rows.extend(rows)
            pending.extend((r, c.plan) for r, c in zip(rows, done, strict=True) if c.plan.drafts)

        try:
            stats = timing.interleave({c.label: c.sample for c in cases}, reps, measure=lambda f: f(),
                                      deadline=deadline)
        except timing.Interrupted as e:  # keep the rows measured so far
            keep(e.partial)
            raise
        keep(stats)
        if len(cases) < len(labels) + 1 or any(s.n < reps for s in stats.values()):
            return False
    for row, plan in pending if not a.no_stages else ():  # last: each compiles four stage programs
        if time.perf_counter() > deadline:
            return False
        split = stage_split(target, drafter, plan, row["batch"], prompt, a.accept, context, a.seed)
        total = sum(split.values())
        row["stages_ms"] = {k: v * 1e3 for k, v in split.items()}
        row["stage_share"] = {k: v / total for k, v in split.items()} if total > 0 else None
        log(f"  [B={row['batch']}] {row['label']} stage split measured")
    return True


def _num(x, width: int) -> str:
    return f"{x:>{width}.2f}" if x is not None else f"{'-':>{width}}"


def format_rows(rows) -> str:
    head = (f"{'B':>2} {'method':22} {'round ms':>9} {'min':>8} {'spread':>6} {'AR ms':>7} {'xAR':>6} "
            f"{'acc':>5} {'spd@tau':>7} {'write-up':>8} | draft / tree / verify / commit")
    lines = [head, "-" * len(head)]
    for r in rows:
        ms = f"{r['ms']['median']:>9.2f} {r['ms']['min']:>8.2f} {pct(r['ms']['spread'], 6)} {r['ar_step_ms']:>7.2f}"
        if "forced_accept" not in r:
            lines.append(f"{r['batch']:>2} {'ar (one step)':22} {ms} {1.0:>6.2f}")
            continue
        share = r.get("stage_share")
        split = " / ".join(f"{share.get(k, 0):.0%}" for k in STAGES) if share else "-"
        lines.append(f"{r['batch']:>2} {r['label']:22} {ms} {_num(r['round_ar_steps'], 6)} {r['accepted']:>5.2f} "
                     f"{_num(r['projected_speedup'], 6)}x {WRITEUP_SPEEDUP:>7.2f}x | {split}")
    return "\n".join(lines)


def _hwm_rss() -> tuple[int, int]:
    """(VmHWM, VmRSS) of this process in bytes (0, 0 where /proc is missing)."""
    vals = {}
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        vals = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f if ln.startswith(("VmHWM:", "VmRSS:"))}
    return vals.get("VmHWM", 0), vals.get("VmRSS", 0)


def write_pair(folder: pathlib.Path, preset: str, seed: int) -> bool:
    """Writes the random pair as ``folder/target`` (HF Qwen3) and ``folder/dspark_b16`` (DeepSpec), unless the
    folder already holds this preset's pair. Returns whether it wrote."""
    t, ds, _, _ = configs(preset)
    stamp = {"preset": preset, "seed": seed, "target": repr(t), "drafter": repr(ds)}
    marker = folder / "bench_pair.json"
    if marker.exists() and (folder / "target").is_dir() and (folder / "dspark_b16").is_dir():
        with contextlib.suppress(OSError, ValueError):
            if json.loads(marker.read_text()) == stamp:
                log(f"  reusing the pair cached in {folder}")
                return False
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    target, drafter = random_pair(preset, seed)
    save_target(target, folder / "target", overwrite=True)
    save_drafter(drafter, folder / "dspark_b16", overwrite=True)
    write_text(str(marker), json.dumps(stamp))
    log(f"  wrote the random {preset} pair to {folder} in {time.perf_counter() - t0:.0f}s")
    return True


def measure_load(folder: str) -> dict:
    """In this (fresh) process: load the pair from ``folder`` and report seconds and peak RSS growth."""
    jnp.ones(3).block_until_ready()
    _, base = _hwm_rss()
    t0 = time.perf_counter()
    target = load_target(os.path.join(folder, "target"))
    jax.block_until_ready(jax.tree.leaves(nnx.state(target)))
    out = {"target_s": time.perf_counter() - t0}
    t1 = time.perf_counter()
    drafter = load_drafter(os.path.join(folder, "dspark_b16"), target=target)
    jax.block_until_ready(jax.tree.leaves(nnx.state(drafter)))
    out.update(drafter_s=time.perf_counter() - t1, load_s=time.perf_counter() - t0)
    hwm, _ = _hwm_rss()
    files = [WeightFiles(os.path.join(folder, sub)) for sub in ("target", "dspark_b16")]
    nbytes = [int(f.file_of(k).dtype(k).itemsize * math.prod(f.file_of(k).shape(k))) for f in files for k in f.keys()]
    device = sum(x.nbytes for m in (target, drafter) for x in jax.tree.leaves(nnx.state(m)))
    out.update({"peak_rss_growth": hwm - base, "model_bytes": device, "file_bytes": sum(nbytes),
                "largest_tensor": max(nbytes), "over_model_in_tensors": (hwm - base - device) / max(nbytes)})
    return out


def load_in_child(folder: str, timeout: float) -> dict:
    res = subprocess.run([sys.executable, "-m", "sparkjax.bench", "scale", "--measure-load", folder],
                         capture_output=True, text=True, env=child_env(), timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"the load child failed: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def memory_rows(preset: str, methods, batches, contexts, prompt: int, deadline: float, report) -> bool:
    """Lowers and compiles the whole generation program from abstract shapes and reads its memory analysis."""
    target, drafter, _ = abstract_models(preset)
    for ctx in contexts:
        for b in batches:
            for m in methods:
                if time.perf_counter() > deadline:
                    return False
                method = parse_method(m)
                spec = method.speculative
                t0 = time.perf_counter()
                lowered, plan = lower(method, target, drafter, b, prompt, ctx, 512)
                t1 = time.perf_counter()
                ma = lowered.compile().memory_analysis()
                t2 = time.perf_counter()
                est = estimate_memory(target, drafter if spec else None, plan, b, prompt, ctx, 512)
                weights = sum(int(x.size) * x.dtype.itemsize
                              for x in jax.tree.leaves(nnx.state((target, drafter) if spec else target)))
                row = {"preset": preset, "method": m, "batch": b, "context": ctx, "prompt": prompt,
                       "lower_s": t1 - t0, "compile_s": t2 - t1, "backend": device_name(), "weights_bytes": weights,
                       "engine_estimate_bytes": weights + sum(est.values()), "kv_cache_bytes": est["cache"]}
                if ma is not None:
                    row.update(sizes(ma, (*SIZE_KEYS, "generated_code")))
                report.rows.append(row)
                log(f"  [{m} B={b} S={ctx}] lowered in {t1 - t0:.0f}s, compiled in {t2 - t1:.0f}s")
    return True


def format_memory(rows) -> str:
    def mib(r, k):
        return f"{r[k] / 2**20:.1f}" if r.get(k) is not None else "-"

    head = (f"{'method':20} {'B':>3} {'context':>7} {'args MiB':>9} {'temp MiB':>9} {'out MiB':>9} {'alias MiB':>9} "
            f"{'peak MiB':>9} | {'weights':>9} {'KV+ctx':>9} {'estimate':>9} | {'lower s':>7} {'compile s':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = " ".join(f"{mib(r, k):>9}" for k in ("argument", "temp", "output", "alias", "peak_bytes"))
        est = " ".join(f"{mib(r, k):>9}" for k in ("weights_bytes", "kv_cache_bytes", "engine_estimate_bytes"))
        lines.append(f"{r['method']:20} {r['batch']:>3} {r['context']:>7} {cells} | {est} | {r['lower_s']:>7.1f} "
                     f"{r['compile_s']:>9.1f}")
    return "\n".join(lines)


def run(a, report) -> None:
    if a.measure_load:
        print(json.dumps(measure_load(a.measure_load)))
        raise SystemExit(0)
    t_cfg, d_cfg, _, _ = configs(a.preset)
    d_batches, d_budgets, d_ctx, d_prompt, d_steps, d_rounds, d_reps = PRESET_DEFAULTS[a.preset]
    batches, budgets = ints(a.batches or d_batches, "--batches"), ints(a.budgets or d_budgets, "--budgets")
    context, prompt = a.context or d_ctx, a.prompt or d_prompt
    steps, rounds, reps = a.steps or d_steps, a.rounds or d_rounds, a.reps or d_reps
    labels = method_labels(a.methods or METHODS, budgets)
    if steps < 2 or rounds < 2 or reps < 1:
        raise ArgumentError(f"--steps {steps} / --rounds {rounds} must be at least 2, --reps {reps} at least 1")
    depth = d_cfg.block_size - d_cfg.first_draft_slot
    if not 0 <= a.accept <= depth:
        raise ArgumentError(f"--accept: {a.accept} drafted tokens per round; the drafter drafts {depth}")
    if a.timeout is not None:
        at_least(a.timeout, "--timeout", 1)
    deadline = report.start + a.timeout if a.timeout else float("inf")
    cpu = device_name().startswith("cpu")
    report.header += ["# " + line for line in describe(a.preset).splitlines()] + [f"# backend: {device_name()}"]
    result = {"preset": a.preset, "backend": device_name(), "command": report.command}
    status = {"complete": False}
    key = "memory" if a.memory else "rows"
    report.payload = lambda rows: {**result, key: rows, "complete": status["complete"],
                                   "wall_s": time.perf_counter() - report.start}
    if a.memory:
        contexts = ints(a.contexts, "--contexts")
        methods = names(a.methods or "sparklingtree@64")
        for m in methods:  # unknown names fail before any compile
            parse_method(m)
        report.header.append(
            f"# the whole generation program compiled from abstract bf16 shapes (prompt {prompt}); peak = args + temp "
            "+ out - alias (compiled.memory_analysis()); weights, KV+ctx (the KV cache and the drafter's context) and "
            "estimate (weights + sparkjax.engine.api.estimate_memory) are counted from the shapes"
            + ("\n# XLA:CPU compile (CPU figures): XLA:CPU keeps f32 copies of the bf16 weights in its temporaries, "
               "which a GPU compile does not" if cpu else ""))
        report.table = format_memory
        status["complete"] = memory_rows(a.preset, methods, batches, contexts, prompt, deadline, report)
    else:
        if a.from_disk:
            folder = pathlib.Path(a.from_disk)
            write_pair(folder, a.preset, a.seed)
            load = load_in_child(str(folder), timeout=max(60.0, deadline - time.perf_counter()) if a.timeout
                                 else 3600.0)
            result["load"] = load
            mib = {k: load[k] / 2**20 for k in ("peak_rss_growth", "model_bytes", "largest_tensor")}
            report.header.append(
                f"# --from-disk {folder}: load (fresh process) {load['load_s']:.1f}s (target {load['target_s']:.1f}s, "
                f"drafter {load['drafter_s']:.1f}s); peak host RSS growth {mib['peak_rss_growth']:.0f} MiB for a "
                f"{mib['model_bytes']:.0f} MiB model: {mib['peak_rss_growth'] - mib['model_bytes']:+.0f} MiB beyond it "
                f"= {load['over_model_in_tensors']:.1f} x its largest tensor ({mib['largest_tensor']:.0f} MiB)")
            target = load_target(folder / "target")
            drafter = load_drafter(folder / "dspark_b16", target=target)
        else:
            target, drafter = random_pair(a.preset, a.seed)
        report.header += [
            f"# forced acceptance: {a.accept} drafts + 1 bonus committed per round; one DSpark-b16 drafter for every "
            f"method; prompt {prompt}, cache {context} slots; {reps} interleaved reps (median, min, spread); AR step = "
            f"(ar to {steps + 1} - ar to 2) / {steps - 1}; round = (run of {rounds} rounds - run of 1) / {rounds - 1}",
            f"# xAR: round cost in AR steps (median/median); spd@tau: tau {a.tau} / xAR, beside the SparklingTree "
            f"write-up's {WRITEUP_SPEEDUP}x; stage split: shares of the stages run as separate jitted calls"
            + (" -- CPU timings, not GPU" if cpu else "")]
        report.table = format_rows
        status["complete"] = bench(target, drafter, a, labels, batches, prompt, steps, rounds, context, reps, deadline,
                                   report)
    if not status["complete"]:
        report.footer.append(f"# stopped early by --timeout {a.timeout:g}s: the rows above are what was measured")
