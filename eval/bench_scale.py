"""Real-size round cost, measured: AR steps and forced-acceptance rounds of every method, on this device.

One command builds a Qwen3 target and a DSpark-b16 drafter from configs with random bf16 weights on the
device (no download) and, side by side in one process with interleaved repetitions, times:

* the **AR step**: :func:`sparkjax.engine.programs.ar_program` (greedy) run to ``1 + N`` tokens minus the
  same program run to 2 tokens, over ``N - 1`` steps (the prefill cancels out);
* the **round** of each method: the speculative program (prefill + ``while_loop`` of rounds, the same
  :func:`~sparkjax.engine.round.spec_round` stages as :func:`~sparkjax.engine.programs.spec_program`) in
  **forced-acceptance mode**: every round commits exactly ``--accept`` drafted tokens (+ the bonus token),
  following the tree's deepest path of that length (a chain's first ``--accept`` drafts), whatever the
  target says, so the round cost does not depend on how good the random drafter is. Rounds are timed as
  (run of ``R`` rounds - run of 1 round) / ``(R - 1)``;
* the **stage split** (draft / tree / verify / commit) of the forced round, each stage its own jitted call
  (as ``generate(instrument=True)`` does), as shares of their sum.

Forced acceptance is bench-only: it is a ``call`` hook passed to ``spec_round`` by this script (the hook
``generate(instrument=True)`` uses to time stages), which replaces the round's accept step; nothing in
``sparkjax.engine`` changes and no ``generate`` call can reach it. Its outputs are not the target's tokens.

Per row: round time and AR step time (median, min, spread over ``--reps`` interleaved repetitions), the
round cost in AR steps (median round / median step), the stage split, and the **projected speedup at
tau** = ``--tau`` (7.34, the SparklingTree write-up's mean accepted length) over the measured round cost,
beside the write-up's 4.29x. On a CPU these are CPU timings (labelled so); GPU figures come only from a run
on the GPU (``--preset full``).

``--from-disk DIR`` first writes the random pair as a Hugging Face Qwen3 folder (``DIR/target``) and a
DeepSpec DSpark-b16 folder (``DIR/dspark_b16``), once (reused while ``DIR/bench_scale.json`` matches the
preset and seed), then loads them through :func:`sparkjax.load_target` / :func:`sparkjax.load_drafter`:
first in a fresh child process that reports the load time and the peak host RSS growth (beside the model's
bytes and its largest tensor), then in this process for the timings.

``--memory`` instead lowers and compiles the whole generation program from abstract shapes (no weights)
for every batch x context and reports the compiled program's memory analysis (peak = arguments + outputs
+ temporaries - aliased) and the compile time. On a CPU that is XLA:CPU's compile: labelled so.

Usage::

    python eval/bench_scale.py --preset reduced                   # CPU, minutes
    python eval/bench_scale.py --preset full --timeout 450        # GPU, < 8 minutes
    python eval/bench_scale.py --preset reduced --from-disk /tmp/scale_pair
    python eval/bench_scale.py --memory --preset full --batches 1,8,32 --contexts 2048,8192
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT / "eval") not in sys.path:
    sys.path.insert(0, str(ROOT / "eval"))

import bench_round  # noqa: E402 - the preset configs, the projection's constants, the atomic writer
import jax  # noqa: E402

TAU = 7.34
WRITEUP_SPEEDUP = bench_round.WRITEUP_SPEEDUP
ALL_METHODS = ("dflash", "dspark", "ddtree", "sparklingtree", "sparklingtree-beam")
PRESETS = ("tiny", "reduced", "full")

# ============================================================================= presets


def configs(preset: str):
    """(target config, DSpark-b16 drafter config, where they come from) of a preset.

    ``full``: Qwen3-4B + DSpark-b16 for Qwen3-4B (bench_round's ``real`` preset). ``reduced``: the same
    architecture narrowed for a CPU (6 layers of width 512, 4/1 heads of 128, vocabulary 16384; a 1-layer
    drafter reading 5 target layers, Markov rank 256). ``tiny``: the bundled test fixture's configs.
    """
    from sparkjax.errors import ArgumentError

    if preset == "full":
        t, ds, _, src = bench_round._configs("real")
        return t, ds, src.split("; dflash")[0]  # bench_scale runs every method with the DSpark drafter
    if preset == "tiny":
        t, ds, _, src = bench_round._configs("tiny")
        return t, ds, src
    if preset == "reduced":
        t, ds, _, src = bench_round._configs("real")
        width = {"vocab_size": 16384, "hidden_size": 512, "intermediate_size": 1536, "num_attention_heads": 4,
                 "num_key_value_heads": 1, "head_dim": 128}
        t = dataclasses.replace(t, num_hidden_layers=6, **width)
        ds = dataclasses.replace(ds, num_hidden_layers=1, num_target_layers=6, target_layer_ids=(0, 1, 2, 3, 4),
                                 mask_token_id=16383, **width)
        return t, ds, "the full preset narrowed: " + ", ".join(f"{k}={v}" for k, v in width.items()) + \
            ", target 6 layers, drafter 1 layer reading layers 0-4"
    raise ArgumentError(f"--preset: unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")


def describe(t, ds) -> str:
    f = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim")
    return (f"target {', '.join(f'{k}={getattr(t, k)}' for k in f)}; drafter ({ds.kind}) "
            f"layers={ds.num_hidden_layers}, block_size={ds.block_size}, "
            f"target_layer_ids={list(ds.target_layer_ids)}, markov_rank={ds.markov_rank}")


def random_pair(preset: str, seed: int = 0):
    """The preset's pair with random bf16 weights, built on the default device."""
    import jax.numpy as jnp
    from flax import nnx

    from sparkjax.nn.drafter import Drafter
    from sparkjax.nn.qwen3 import Qwen3

    t, ds, _ = configs(preset)
    return (Qwen3(t, rngs=nnx.Rngs(seed), dtype=jnp.bfloat16),
            Drafter(ds, rngs=nnx.Rngs(seed + 1), dtype=jnp.bfloat16))


# ============================================================================= forced acceptance


def forced_acceptance(prop, ver, accept: int, depth: int):
    """The round's :class:`~sparkjax.engine.state.Acceptance` when exactly ``accept`` drafts are taken.

    The path follows the tree deepest-first: it ends at the deepest node of depth at most ``accept`` (the
    lowest index among equals: for a chain node ``accept``; for a tree the first node the builder put at that
    depth) and runs through its ancestors (read from the verify mask). A tree with no path that long (a wide,
    shallow tree from a random drafter) is topped up with its other nodes in index order, so every round
    commits exactly ``accept + 1`` tokens: the round's cost does not depend on which verified rows commit
    gathers, and the tokens committed in this mode mean nothing anyway. The bonus token is the target's
    argmax at the last row.
    """
    import jax.numpy as jnp

    from sparkjax.engine.state import Acceptance

    b, m = prop.tokens.shape
    rows = jnp.arange(m + 1, dtype=jnp.int32)
    row_depth = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), prop.depths.astype(jnp.int32)], axis=1)
    real = jnp.concatenate([jnp.ones((b, 1), bool), prop.tokens >= 0], axis=1)
    valid = real & (row_depth <= accept)
    score = jnp.where(valid, row_depth * (m + 2) - rows[None], -1)
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
def forced_commit(accept: int):
    """The round's last stage with forced acceptance (cached: one function, so one compile, per count)."""
    from sparkjax.engine import round as rnd

    @rnd.stage(rnd.COMMIT)
    def commit_forced(target, drafter, state, prop, ver, max_new, eos, temperature, key, *, plan):
        acc = forced_acceptance(prop, ver, accept, plan.depth)
        return rnd.commit(drafter, state, ver, acc, max_new, eos, plan=plan)

    return commit_forced


def forcing(accept: int, call=None):
    """A ``spec_round`` ``call`` hook that swaps the accept + commit stage for the forced one."""
    from sparkjax.engine import round as rnd

    forced = forced_commit(accept)

    def hook(fn, *args, **kwargs):
        fn = forced if fn is rnd.accept_and_commit else fn
        return call(fn, *args, **kwargs)

    return hook


@functools.partial(jax.jit, static_argnames=("graphdefs", "plan", "cache_size", "buf_len", "accept"))
def forced_program(graphdefs, states, tokens, lengths, max_new, eos, temperature, key, *, plan, cache_size, buf_len,
                   accept):
    """:func:`~sparkjax.engine.programs.spec_program` with forced acceptance (bench only)."""
    import jax
    import jax.numpy as jnp

    from sparkjax.engine.programs import merge_pair, spec_prefill
    from sparkjax.engine.round import spec_round

    target, drafter = merge_pair(graphdefs, states)
    state = spec_prefill(target, drafter, tokens, lengths, max_new, eos, temperature, key, plan, cache_size, buf_len)

    def direct(fn, *args, **kwargs):
        return fn(target, drafter, *args, **kwargs)

    hook = forcing(accept, direct)
    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done),
                               lambda s: spec_round(target, drafter, s, plan, max_new, eos, temperature, call=hook),
                               state)
    return state.out, state.n, state.accept_lens, state.rounds


# ============================================================================= timing


def _stats(xs: Sequence[float]) -> dict:
    med = statistics.median(xs)
    return {"median": med, "min": min(xs), "spread": (max(xs) - min(xs)) / med if med > 0 else None, "n": len(xs)}


def _wall(fn) -> float:
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


@dataclasses.dataclass
class Case:
    """One row: ``label`` ("ar" or a method label) at ``batch``; ``short`` / ``long`` run the program to few /
    many tokens; ``units`` are the AR steps or rounds between them."""

    label: str
    batch: int
    short: object
    long: object
    units: float
    accepted: float | None = None
    times: list = dataclasses.field(default_factory=list)


def _prompts(batch: int, prompt: int, vocab: int, seed: int):
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed + batch)
    tokens = rng.integers(0, vocab, (batch, prompt)).astype(np.int32)
    return jnp.asarray(tokens), jnp.full((batch,), prompt, jnp.int32)


def ar_case(target, batch: int, prompt: int, steps: int, context: int, seed: int) -> Case:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sparkjax.engine.programs import ar_program

    g, s = nnx.split(target)
    tokens, lengths = _prompts(batch, prompt, target.config.vocab_size, seed)
    none = jnp.array([-1], jnp.int32)
    key = jax.random.key(seed)
    buf = 1 << max(steps + 2, 2).bit_length()

    def run(n):
        return lambda: ar_program(g, s, tokens, lengths, jnp.int32(n), none, jnp.float32(0.0), key, buf_len=buf,
                                  cache_size=context, sampling=False)[1]

    short, long = run(2), run(steps + 1)
    n_short, n_long = int(short()[0]), int(long()[0])  # compile + warm-up, and the check
    if (n_short, n_long) != (2, steps + 1):
        raise RuntimeError(f"ar: ran {n_short} / {n_long} tokens, expected 2 / {steps + 1}")
    return Case("ar", batch, short, long, steps - 1)


def round_case(target, drafter, method: str, batch: int, prompt: int, rounds: int, accept: int, context: int,
               seed: int) -> Case:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sparkjax.engine.methods import parse_method
    from sparkjax.engine.programs import split_pair

    plan = parse_method(method).plan(target, drafter, False)
    if not 0 <= accept <= min(plan.depth, plan.nodes):
        from sparkjax.errors import ArgumentError

        raise ArgumentError(f"--accept: {accept} drafts per round; {method} drafts {plan.depth} depths and "
                            f"verifies {plan.nodes} nodes")
    graphdefs, states = split_pair(target, drafter)
    tokens, lengths = _prompts(batch, prompt, target.config.vocab_size, seed)
    none = jnp.array([-1], jnp.int32)
    key = jax.random.key(seed)
    per = accept + 1
    buf = 1 << (rounds * (plan.depth + 1) + 2).bit_length()

    def run(n_rounds):
        return lambda: forced_program(graphdefs, states, tokens, lengths, jnp.int32(1 + n_rounds * per), none,
                                      jnp.float32(0.0), key, plan=plan, cache_size=context, buf_len=buf,
                                      accept=accept)

    short, long = run(1), run(rounds)
    _, _, lens_s, r_s = short()
    _, _, lens_l, r_l = long()
    r_s, r_l = np.asarray(r_s), np.asarray(r_l)
    lens = np.asarray(lens_l)[:, : int(r_l.max())]
    accepted = float(lens[lens > 0].mean()) - 1
    units = float(r_l.max() - r_s.max())
    if units < 1:
        raise RuntimeError(f"{method}: the long run made {r_l.max()} rounds, the short one {r_s.max()}")
    case = Case(method, batch, lambda: short()[3], lambda: long()[3], units, accepted)
    case.plan = plan
    return case


def stage_split(target, drafter, plan, batch: int, prompt: int, accept: int, context: int, seed: int,
                rounds: int = 3) -> dict:
    """Median seconds per stage over ``rounds`` forced rounds (each stage its own jitted, synced call)."""
    import jax
    import jax.numpy as jnp

    from sparkjax.engine.programs import spec_start, split_pair, stage_call
    from sparkjax.engine.round import STAGES, spec_round

    graphdefs, states = split_pair(target, drafter)
    tokens, lengths = _prompts(batch, prompt, target.config.vocab_size, seed)
    none = jnp.array([-1], jnp.int32)
    max_new = jnp.int32(1 + (rounds + 2) * (accept + 1))
    buf = 1 << ((rounds + 2) * (plan.depth + 1) + 2).bit_length()
    state = spec_start(graphdefs, states, tokens, lengths, max_new, none, jnp.float32(0.0), jax.random.key(seed),
                       plan=plan, cache_size=context, buf_len=buf)
    times: dict[str, list[float]] = {s: [] for s in STAGES}
    record = [False]

    def timed(fn, *args, plan):
        t0 = time.perf_counter()
        res = jax.block_until_ready(stage_call(graphdefs, states, args, fn=fn, plan=plan))
        if record[0]:
            times[fn.stage].append(time.perf_counter() - t0)
        return res

    hook = forcing(accept, timed)
    for r in range(rounds + 1):  # the first round compiles
        record[0] = r > 0
        state = spec_round(target, drafter, state, plan, max_new, none, jnp.float32(0.0), call=hook)
    return {s: statistics.median(v) for s, v in times.items()}


# ============================================================================= the benchmark


def method_labels(methods: Sequence[str], budgets: Sequence[int]) -> list[str]:
    return bench_round.method_labels(methods, budgets)


def load_warning() -> str | None:
    load = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    if load > 0.5 * cores:
        return f"load average {load:.1f} on {cores} cores: the machine is busy, timings are noisy"
    return None


def device_name() -> str:
    import jax

    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '?')}"


def bench(target, drafter, *, labels: Sequence[str], batches: Sequence[int], prompt: int, steps: int, rounds: int,
          accept: int, context: int, reps: int, stages: bool, seed: int, deadline: float, log) -> tuple[list, bool]:
    """The rows (see the module docstring); ``False`` as second value when ``deadline`` cut the run short."""
    rows, complete, pending = [], True, []
    for b in batches:
        if time.perf_counter() > deadline:
            complete = False
            break
        cases = []
        t0 = time.perf_counter()
        cases.append(ar_case(target, b, prompt, steps, context, seed))
        log(f"  [B={b}] ar compiled and warmed in {time.perf_counter() - t0:.0f}s")
        for m in labels:
            if time.perf_counter() > deadline:
                complete = False
                break
            t0 = time.perf_counter()
            cases.append(round_case(target, drafter, m, b, prompt, rounds, accept, context, seed))
            log(f"  [B={b}] {m} compiled and warmed in {time.perf_counter() - t0:.0f}s "
                f"(accepted {cases[-1].accepted:.2f} per round)")
        for _ in range(reps):  # interleaved: every case once per repetition
            if time.perf_counter() > deadline and all(c.times for c in cases):
                complete = False
                break
            for c in cases:
                c.times.append((_wall(c.long) - _wall(c.short)) / c.units)
        ar = cases[0]
        ar_med = statistics.median(ar.times)
        for c in cases:
            st = _stats(c.times)
            row = {"label": c.label, "method": c.label.split("@")[0],
                   "budget": int(c.label.split("@")[1]) if "@" in c.label else None, "batch": b,
                   "context": context, "prompt": prompt, "ms": {k: (v * 1e3 if k in ("median", "min") else v)
                                                              for k, v in st.items()},
                   "ar_step_ms": ar_med * 1e3}
            if c.label == "ar":
                row["round_ar_steps"] = 1.0
            else:
                ok = ar_med > 0 and min(ar.times) > 0 and st["median"] > 0  # else noise beat the work: no ratio
                row.update({
                    "forced_accept": accept, "accepted": c.accepted, "committed_per_round": c.accepted + 1,
                    "round_ar_steps": st["median"] / ar_med if ok else None,
                    "round_ar_steps_min": st["min"] / min(ar.times) if ok else None,
                    "tau": TAU, "projected_speedup": TAU / (st["median"] / ar_med) if ok else None,
                    "writeup_speedup": WRITEUP_SPEEDUP,
                })
                pending.append((row, c.plan))
            if any(t <= 0 for t in c.times):
                row["note"] = "a repetition's difference was <= 0 (noise larger than the work): not clamped"
            rows.append(row)
        if not complete:
            break
    # the stage splits last (each compiles four stage programs): --timeout keeps the timed rows first
    for row, plan in pending if stages else ():
        if time.perf_counter() > deadline:
            complete = False
            break
        split = stage_split(target, drafter, plan, row["batch"], prompt, accept, context, seed)
        total = sum(split.values())
        row["stages_ms"] = {k: v * 1e3 for k, v in split.items()}
        row["stage_share"] = {k: v / total for k, v in split.items()} if total > 0 else None
        log(f"  [B={row['batch']}] {row['label']} stage split measured")
    return rows, complete


def _num(x, width: int) -> str:
    return f"{x:>{width}.2f}" if x is not None else f"{'-':>{width}}"


def format_rows(rows: Sequence[dict], device: str) -> str:
    head = (f"{'B':>2} {'method':22} {'round ms':>9} {'min':>8} {'spread':>6} {'AR ms':>7} {'xAR':>6} "
            f"{'acc':>5} {'spd@tau':>7} {'write-up':>8} | draft / tree / verify / commit")
    lines = [head, "-" * len(head)]
    for r in rows:
        spread = f"{r['ms']['spread']:.0%}" if r["ms"]["spread"] is not None else "-"
        if r["label"] == "ar":
            lines.append(f"{r['batch']:>2} {'ar (one step)':22} {r['ms']['median']:>9.2f} {r['ms']['min']:>8.2f} "
                         f"{spread:>6} {r['ar_step_ms']:>7.2f} {1.0:>6.2f}")
            continue
        share = r.get("stage_share")
        split = " / ".join(f"{share[k]:.0%}" for k in ("draft", "tree", "verify", "commit")) if share else "-"
        lines.append(
            f"{r['batch']:>2} {r['label']:22} {r['ms']['median']:>9.2f} {r['ms']['min']:>8.2f} {spread:>6} "
            f"{r['ar_step_ms']:>7.2f} {_num(r['round_ar_steps'], 6)} {r['accepted']:>5.2f} "
            f"{_num(r['projected_speedup'], 6)}x {WRITEUP_SPEEDUP:>7.2f}x | {split}")
    return "\n".join(lines)


# ============================================================================= from disk


def _hwm_rss() -> tuple[int, int]:
    """(VmHWM, VmRSS) of this process in bytes (0, 0 where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            vals = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f if ln.startswith(("VmHWM:", "VmRSS:"))}
        return vals.get("VmHWM", 0), vals.get("VmRSS", 0)
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, 0


def write_pair(folder: pathlib.Path, preset: str, seed: int, log) -> bool:
    """Writes the random pair as ``folder/target`` (HF Qwen3) and ``folder/dspark_b16`` (DeepSpec), unless the
    folder already holds this preset's pair. Returns whether it wrote."""
    from sparkjax.io.hf import save_drafter, save_target

    t, ds, _ = configs(preset)
    stamp = {"preset": preset, "seed": seed, "target": repr(t), "drafter": repr(ds)}
    marker = folder / "bench_scale.json"
    if marker.exists() and (folder / "target").is_dir() and (folder / "dspark_b16").is_dir():
        try:
            if json.loads(marker.read_text()) == stamp:
                log(f"  reusing the pair cached in {folder}")
                return False
        except (OSError, ValueError):
            pass
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    target, drafter = random_pair(preset, seed)
    save_target(target, folder / "target", overwrite=True)
    save_drafter(drafter, folder / "dspark_b16", overwrite=True)
    del target, drafter
    bench_round.write_atomic(str(marker), json.dumps(stamp))
    log(f"  wrote the random {preset} pair to {folder} in {time.perf_counter() - t0:.0f}s")
    return True


def measure_load(folder: str) -> dict:
    """In this (fresh) process: load the pair from ``folder`` and report seconds and peak RSS growth."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sparkjax.io.hf import WeightFiles, load_drafter, load_target

    jnp.ones(3).block_until_ready()
    _, base = _hwm_rss()
    out = {}
    t0 = time.perf_counter()
    target = load_target(os.path.join(folder, "target"))
    jax.block_until_ready(jax.tree.leaves(nnx.state(target)))
    out["target_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    drafter = load_drafter(os.path.join(folder, "dspark_b16"), target=target)
    jax.block_until_ready(jax.tree.leaves(nnx.state(drafter)))
    out["drafter_s"] = time.perf_counter() - t1
    out["load_s"] = time.perf_counter() - t0
    hwm, _ = _hwm_rss()
    largest, total = 0, 0
    for sub in ("target", "dspark_b16"):
        files = WeightFiles(os.path.join(folder, sub))
        for key in files.keys():
            src = files.file_of(key)
            n = int(src.dtype(key).itemsize * (1 if not src.shape(key) else __import__("math").prod(src.shape(key))))
            largest, total = max(largest, n), total + n
    device = sum(x.nbytes for m in (target, drafter) for x in jax.tree.leaves(nnx.state(m)))
    out.update({"peak_rss_growth": hwm - base, "model_bytes": device, "file_bytes": total, "largest_tensor": largest,
                "over_model_in_tensors": (hwm - base - device) / largest if largest else None})
    return out


def load_in_child(folder: str, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, str(pathlib.Path(__file__).resolve()), "--measure-load", folder],
                         capture_output=True, text=True, env=env, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"the load child failed: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# ============================================================================= memory and compile time


def abstract_pair(preset: str):
    import jax.numpy as jnp
    from flax import nnx

    from sparkjax.nn.drafter import Drafter
    from sparkjax.nn.qwen3 import Qwen3

    t, ds, _ = configs(preset)
    mk = lambda cls, c: nnx.eval_shape(lambda: cls(c, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))  # noqa: E731
    return mk(Qwen3, t), mk(Drafter, ds)


def memory_rows(preset: str, methods: Sequence[str], batches: Sequence[int], contexts: Sequence[int], prompt: int,
                deadline: float, log) -> tuple[list, bool]:
    """Lowers and compiles the whole generation program (prefill + loop of rounds; ``ar``: the AR program)
    from abstract shapes and reads ``compiled.memory_analysis()``."""
    from flax import nnx

    from sparkjax.engine.api import estimate_memory
    from sparkjax.engine.methods import parse_method
    from sparkjax.engine.programs import ar_program, spec_program, split_pair

    target, drafter = abstract_pair(preset)
    rows = []
    for ctx in contexts:
        for b in batches:
            for m in methods:
                if time.perf_counter() > deadline:
                    return rows, False
                args = bench_round._args(b, prompt)
                t0 = time.perf_counter()
                if m == "ar":
                    g, s = nnx.split(target)
                    lowered = ar_program.lower(g, s, *args, buf_len=512, cache_size=ctx, sampling=False)
                else:
                    plan = parse_method(m).plan(target, drafter, False)
                    graphdefs, states = split_pair(target, drafter)
                    lowered = spec_program.lower(graphdefs, states, *args, plan=plan, cache_size=ctx, buf_len=512)
                t1 = time.perf_counter()
                compiled = lowered.compile()
                t2 = time.perf_counter()
                ma = compiled.memory_analysis()
                row = {"preset": preset, "method": m, "batch": b, "context": ctx, "prompt": prompt,
                       "lower_s": t1 - t0, "compile_s": t2 - t1, "backend": device_name()}
                plan_ = None if m == "ar" else plan
                est = estimate_memory(target, drafter if plan_ else None, plan_, b, prompt, ctx, 512)
                row["weights_bytes"] = sum(int(x.size) * x.dtype.itemsize for x in
                                           jax.tree.leaves(nnx.state(target if m == "ar" else (target, drafter))))
                row["engine_estimate_bytes"] = row["weights_bytes"] + sum(est.values())
                row["kv_cache_bytes"] = est["cache"]
                if ma is not None:
                    for k in ("argument", "output", "temp", "alias", "generated_code"):
                        row[k] = int(getattr(ma, f"{k}_size_in_bytes", 0) or 0)
                    row["peak_bytes"] = row["argument"] + row["output"] + row["temp"] - row["alias"]
                rows.append(row)
                log(f"  [{m} B={b} S={ctx}] lowered in {t1 - t0:.0f}s, compiled in {t2 - t1:.0f}s, peak "
                    f"{row.get('peak_bytes', 0) / 2**30:.2f} GiB")
    return rows, True


def _mib(row: dict, key: str) -> str:
    return f"{row[key] / 2**20:.1f}" if row.get(key) is not None else "-"


def format_memory(rows: Sequence[dict]) -> str:
    head = (f"{'method':20} {'B':>3} {'context':>7} {'args MiB':>9} {'temp MiB':>9} {'out MiB':>9} {'alias MiB':>9} "
            f"{'peak MiB':>9} | {'weights':>9} {'KV+ctx':>9} {'estimate':>9} | {'lower s':>7} {'compile s':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        g = functools.partial(_mib, r)
        lines.append(f"{r['method']:20} {r['batch']:>3} {r['context']:>7} {g('argument'):>9} {g('temp'):>9} "
                     f"{g('output'):>9} {g('alias'):>9} {g('peak_bytes'):>9} | {g('weights_bytes'):>9} "
                     f"{g('kv_cache_bytes'):>9} {g('engine_estimate_bytes'):>9} | {r['lower_s']:>7.1f} "
                     f"{r['compile_s']:>9.1f}")
    return "\n".join(lines)


def decode_step_fns(target, context: int):
    """``(unrolled, scanned, stack)``: the target's decode step (one token against a ``context``-slot cache) as
    the model runs it, its layers unrolled, and the same step with the layers under one ``jax.lax.scan``
    (``stack(target)`` gives the layers' stacked parameters; the KV caches are stacked ``[L, B, K, S, H]``).
    ``unrolled(state, tok, ks, vs, lengths)`` / ``scanned(state, layers, tok, k, v, lengths)`` return the
    logits and the new caches."""
    import jax.numpy as jnp
    from flax import nnx

    from sparkjax.cache import KVCache, attention_mask, causal_block
    from sparkjax.nn.layers import rope_cos_sin

    cfg = target.config
    g, _ = nnx.split(target)
    g_layer, _ = nnx.split(target.layers[0])

    def unrolled(state, tok, ks, vs, lengths):
        model = nnx.merge(g, state)
        out = model(tok, lengths[:, None], cache=KVCache(tuple(ks), tuple(vs), lengths))
        return out.logits, out.cache.k, out.cache.v

    def scanned(state, layers, tok, ks, vs, lengths):
        model = nnx.merge(g, state)
        cos, sin = rope_cos_sin(lengths[:, None], cfg.head_dim, cfg.rope_theta)
        mask = attention_mask(lengths, causal_block(1), context)

        def body(x, xs):
            layer_state, k, v = xs
            x, cache = nnx.merge(g_layer, layer_state)(x, cos, sin, mask, KVCache((k,), (v,), lengths), 0)
            return x, (cache.k[0], cache.v[0])

        x, (k, v) = jax.lax.scan(body, model.embed_tokens(tok), (layers, ks, vs))
        return model.logits(model.norm(x)), k, v

    def stack(model):
        def cat(*xs):
            if isinstance(xs[0], jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype)
            return jnp.stack(xs)

        return jax.tree.map(cat, *[nnx.state(layer) for layer in model.layers])

    return unrolled, scanned, stack


def scan_probe(preset: str, batch: int, context: int, log) -> list[dict]:
    """Compile time of the target's decode step with its layers unrolled (as the model runs) and under one
    ``lax.scan`` (:func:`decode_step_fns`). A probe for the compile-time question, not a model change:
    scanning in the model would stack the KV cache, which every stage of the round reads per layer."""
    import jax.numpy as jnp
    from flax import nnx

    target, _ = abstract_pair(preset)
    cfg = target.config
    unrolled, scanned, stack = decode_step_fns(target, context)
    s = jax.ShapeDtypeStruct
    kv = s((batch, cfg.num_key_value_heads, context, cfg.head_dim), jnp.bfloat16)
    tok, lengths = s((batch, 1), jnp.int32), s((batch,), jnp.int32)
    n = cfg.num_hidden_layers
    st = nnx.state(target)
    rows = []
    for name, fn, args in (
        ("unrolled", unrolled, (st, tok, [kv] * n, [kv] * n, lengths)),
        ("scan", scanned, (st, stack(target), tok, s((n, *kv.shape), kv.dtype), s((n, *kv.shape), kv.dtype),
                           lengths)),
    ):
        t0 = time.perf_counter()
        lowered = jax.jit(fn).lower(*args)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        ma = compiled.memory_analysis()
        row = {"variant": name, "layers": n, "batch": batch, "context": context, "lower_s": t1 - t0,
               "compile_s": t2 - t1, "temp": int(getattr(ma, "temp_size_in_bytes", 0) or 0) if ma else None,
               "backend": device_name()}
        rows.append(row)
        log(f"  decode step, layers {name}: lowered in {t1 - t0:.1f}s, compiled in {t2 - t1:.1f}s")
    return rows


def format_scan(rows: Sequence[dict]) -> str:
    lines = [f"{'decode step':12} {'layers':>6} {'B':>3} {'context':>7} {'lower s':>7} {'compile s':>9} "
             f"{'temp MiB':>9}"]
    for r in rows:
        lines.append(f"{r['variant']:12} {r['layers']:>6} {r['batch']:>3} {r['context']:>7} {r['lower_s']:>7.1f} "
                     f"{r['compile_s']:>9.1f} {_mib(r, 'temp'):>9}")
    return "\n".join(lines)


# ============================================================================= the command


def _ints(text: str, arg: str) -> list[int]:
    return bench_round._ints(text, arg)


PRESET_DEFAULTS = {  # batches, budgets, context, prompt, steps, rounds, reps
    "tiny": ("1,8", "16,64", 256, 16, 8, 4, 3),
    "reduced": ("1,8", "16,64", 1024, 128, 16, 4, 3),
    "full": ("1,8", "16,64", 2048, 512, 32, 8, 5),
}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="reduced", help="tiny (tests), reduced (CPU, minutes), full (GPU)")
    ap.add_argument("--methods", default=",".join(ALL_METHODS), help="names, or name@budget for one tree budget")
    ap.add_argument("--budgets", help="tree budgets (default 16,64)")
    ap.add_argument("--batches", help="batch sizes (default 1,8)")
    ap.add_argument("--context", type=int, help="cache slots (default: reduced 1024, full 2048)")
    ap.add_argument("--prompt", type=int, help="prompt tokens per sequence (default: reduced 128, full 512)")
    ap.add_argument("--accept", type=int, default=6, help="drafted tokens every forced round accepts (default 6: "
                    "7 committed per round, close to tau 7.34)")
    ap.add_argument("--steps", type=int, help="AR steps of the long AR run")
    ap.add_argument("--rounds", type=int, help="rounds of the long forced run")
    ap.add_argument("--reps", type=int, help="interleaved repetitions")
    ap.add_argument("--no-stages", action="store_true", help="skip the per-stage split (saves the stage compiles)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=None, help="seconds: stop starting new work after this, "
                    "print what was measured")
    ap.add_argument("--from-disk", metavar="DIR", help="write the random pair to DIR once (cached), then load it "
                    "through the converters and report load time and peak host RSS")
    ap.add_argument("--memory", action="store_true", help="compile the whole generation program from abstract "
                    "shapes per batch x context and report its memory analysis and compile time (runs nothing)")
    ap.add_argument("--contexts", default="2048,8192", help="--memory: cache sizes")
    ap.add_argument("--scan-probe", action="store_true", help="with --memory: also compile the target's decode "
                    "step with its layers unrolled and under one lax.scan, and compare the compile times")
    ap.add_argument("--json", help="write the results here (atomically)")
    ap.add_argument("--out", help="also write the printed report here (atomically)")
    ap.add_argument("--measure-load", metavar="DIR", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    from sparkjax.cli import run_cli
    from sparkjax.errors import ArgumentError

    if a.measure_load:
        print(json.dumps(measure_load(a.measure_load)))
        return 0
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    start = time.perf_counter()
    deadline = start + a.timeout if a.timeout else float("inf")

    def run() -> None:
        t_cfg, d_cfg, src = configs(a.preset)
        d_batches, d_budgets, d_ctx, d_prompt, d_steps, d_rounds, d_reps = PRESET_DEFAULTS[a.preset]
        batches = _ints(a.batches or d_batches, "--batches")
        budgets = _ints(a.budgets or d_budgets, "--budgets")
        context = a.context or d_ctx
        prompt = a.prompt or d_prompt
        steps, rounds, reps = a.steps or d_steps, a.rounds or d_rounds, a.reps or d_reps
        names = [m.strip() for m in a.methods.split(",") if m.strip()]
        labels = [m for m in names if "@" in m] + method_labels([m for m in names if "@" not in m], budgets)
        from sparkjax.engine.methods import parse_method

        for m in labels:
            parse_method(m)
        if steps < 2 or rounds < 2 or reps < 1:
            raise ArgumentError(f"--steps {steps} / --rounds {rounds} must be at least 2, --reps {reps} at least 1")
        depth = d_cfg.block_size - d_cfg.first_draft_slot
        if not 0 <= a.accept <= depth:
            raise ArgumentError(f"--accept: {a.accept} drafted tokens per round; the drafter drafts {depth}")
        header = [f"# python eval/bench_scale.py {' '.join(argv if argv is not None else sys.argv[1:])}",
                  f"# preset {a.preset}: {src}", f"# {describe(t_cfg, d_cfg)}", f"# backend: {device_name()}"]
        result: dict = {"preset": a.preset, "backend": device_name(), "command": header[0][2:]}
        if a.memory:
            contexts = _ints(a.contexts, "--contexts")
            methods = [m for m in (a.methods.split(",") if a.methods != ",".join(ALL_METHODS) else
                                   ["sparklingtree@64"]) if m]
            header.append("# the whole generation program compiled from abstract bf16 shapes "
                          f"(prompt {prompt}); memory from compiled.memory_analysis(): peak = args + temp + out - "
                          "alias; weights, KV+ctx (the target's KV cache and the drafter's context) and estimate "
                          "(weights + sparkjax.engine.api.estimate_memory) are counted from the shapes, beside it"
                          + ("\n# XLA:CPU compile (CPU figures): XLA:CPU computes bf16 dots in f32 and keeps f32 "
                             "copies of the weights in its temporaries, which a GPU compile does not"
                             if device_name().startswith("cpu") else ""))
            rows, complete = memory_rows(a.preset, methods, batches, contexts, prompt, deadline, log)
            body = format_memory(rows)
            result["memory"] = rows
            if a.scan_probe and time.perf_counter() < deadline:
                probe = scan_probe(a.preset, batches[0], contexts[0], log)
                body += "\n\n" + format_scan(probe)
                result["scan_probe"] = probe
        else:
            pair_note = []
            if a.from_disk:
                folder = pathlib.Path(a.from_disk)
                write_pair(folder, a.preset, a.seed, log)
                load = load_in_child(str(folder), timeout=max(60.0, deadline - time.perf_counter())
                                     if a.timeout else 3600.0)
                result["load"] = load
                mib = {k: load[k] / 2**20 for k in ("peak_rss_growth", "model_bytes", "largest_tensor")}
                pair_note.append(
                    f"# --from-disk {folder}: load (fresh process) {load['load_s']:.1f}s (target "
                    f"{load['target_s']:.1f}s, drafter {load['drafter_s']:.1f}s); peak host RSS growth "
                    f"{mib['peak_rss_growth']:.0f} MiB for a {mib['model_bytes']:.0f} MiB model: "
                    f"{mib['peak_rss_growth'] - mib['model_bytes']:+.0f} MiB beyond it = "
                    f"{load['over_model_in_tensors']:.1f} x its largest tensor ({mib['largest_tensor']:.0f} MiB)")
                from sparkjax.io.hf import load_drafter, load_target

                target = load_target(folder / "target")
                drafter = load_drafter(folder / "dspark_b16", target=target)
            else:
                target, drafter = random_pair(a.preset, a.seed)
            header += pair_note
            header.append(f"# forced acceptance: {a.accept} drafts + 1 bonus committed per round; one DSpark-b16 "
                          f"drafter for every method; prompt {prompt}, cache {context} slots; {reps} interleaved reps "
                          f"(median, min, spread); AR step = (ar to {steps + 1} - ar to 2) / {steps - 1}; round = "
                          f"(run of {rounds} rounds - run of 1) / {rounds - 1}")
            header.append(f"# xAR: round cost in AR steps (median/median); spd@tau: tau {TAU} / xAR, beside the "
                          f"SparklingTree write-up's {WRITEUP_SPEEDUP}x; stage split: shares of the stages run as "
                          "separate jitted calls" + (" -- CPU timings, not GPU" if device_name().startswith("cpu")
                                                      else ""))
            rows, complete = bench(target, drafter, labels=labels, batches=batches, prompt=prompt, steps=steps,
                                   rounds=rounds, accept=a.accept, context=context, reps=reps, stages=not a.no_stages,
                                   seed=a.seed, deadline=deadline, log=log)
            body = format_rows(rows, device_name())
            result["rows"] = rows
        warn = load_warning()
        footer = []
        if not complete:
            footer.append(f"# stopped early by --timeout {a.timeout:g}s: the rows above are what was measured")
        if warn:
            footer.append(f"# warning: {warn}")
        footer.append(f"# total wall time {time.perf_counter() - start:.0f}s")
        result.update({"complete": complete, "load_warning": warn, "wall_s": time.perf_counter() - start})
        text = "\n".join(header) + "\n" + body + "\n" + "\n".join(footer) + "\n"
        print(text, end="")
        if a.out:
            bench_round.write_atomic(a.out, text)
        if a.json:
            bench_round.write_atomic(a.json, json.dumps(result, indent=1) + "\n")

    return run_cli(run)


if __name__ == "__main__":
    sys.exit(main())
