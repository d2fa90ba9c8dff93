"""The prepared device check: attention paths, greedy exactness, round times and profiler traces on this machine's
accelerator.

    python -m sparkjax.bench device --out DIR              # a GPU: real shapes, about 8 minutes (an estimate)
    python -m sparkjax.bench device --quick --out DIR      # batch 1, ar and sparklingtree@64: about 3 minutes
    python -m sparkjax.bench device --dry-run --out DIR    # the same on the CPU at tiny shapes
    bash eval/gpu_check.sh [--quick|--dry-run]             # the wrapper: PYTHONPATH=checkout, --out $OUT, XLA_FLAGS

Three parts, each written to ``DIR/device_check.json`` and ``.txt`` (atomically) as soon as it is done:
``attention`` (every :func:`sparkjax.nn.layers.attend` path against the float32 ``einsum`` reference in bf16 and
float32: tree masks over a cache, an empty prefix, a fully masked row, the drafter's context-plus-block),
``exactness`` (every method's greedy tokens against ``ar``'s under each attention path, random bf16 weights, each
method run twice) and ``timing`` (the AR step and the forced-acceptance round, as ``scale``, per batch, under the
engine's command-buffer loops and XLA's defaults interleaved; ``auto`` under a fixed cost table; the peak memory;
the recorded deviceless projection beside each, with measured / projected; and a ``jax.profiler`` trace of each
program in ``DIR/traces/``, summarised per round by :mod:`sparkjax.bench.trace`). ``--timeout`` stops starting new
work. Exit code 0 even when a check fails (the records say which); 2 for a bad argument.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from sparkjax import testing
from sparkjax.engine.adaptive import Auto
from sparkjax.engine.api import generate
from sparkjax.engine.costs import CostTable
from sparkjax.engine.names import METHODS, parse_method
from sparkjax.engine.options import Options
from sparkjax.errors import ArgumentError
from sparkjax.nn import layers
from sparkjax.reference import random_tree_mask

from . import timing, trace
from .common import at_least, configs, device_name, error_line, ints, log, names, random_pair, write_text
from .scale import ar_case, forced_plan, round_case

ATTENTIONS = "einsum,split"
TIMED = "ar,dspark,sparklingtree@16,sparklingtree@64,auto"
GPU_LOOPS = "command_buffer,xla_default"  # the engine's loop options against XLA's defaults, interleaved
PARTS = ("attention", "exactness", "timing")
PROFILE_FLAG = "--xla_enable_command_buffers_during_profiling=true"  # else XLA runs no command buffer while tracing
# per mode: preset, batches, context, prompt, new tokens of the exactness runs, AR steps, rounds, reps, timeout,
# timed methods, exactness methods, auto's candidate sizes (None: its default)
MODES = {
    "gpu": ("real", "1,8", 1024, 256, 24, 16, 6, 3, 420.0, TIMED, ",".join(METHODS[1:]), None),
    "quick": ("real", "1", 1024, 256, 16, 8, 4, 3, 150.0, "ar,sparklingtree@64", "dspark,sparklingtree,auto", None),
    "dry": ("tiny", "1", 128, 12, 10, 4, 2, 1, 120.0, "ar,dspark", "dspark,sparklingtree", (0, "chain")),
}
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}  # |path - float32 reference| <= tol * (1 + |reference|)


def add_arguments(p) -> None:
    p.add_argument("--dry-run", action="store_true", help="the CPU at tiny shapes (under a minute)")
    p.add_argument("--quick", action="store_true",
                   help="batch 1, ar and sparklingtree@64 timed and traced, three methods checked (a GPU: about 3 min)")
    p.add_argument("--out", metavar="DIR", dest="folder",
                   help="folder for device_check.json / .txt (default $OUT, else .)")
    p.add_argument("--preset", help="model shapes (default real; --dry-run: tiny)")
    p.add_argument("--attentions", default=ATTENTIONS, help=f"attention paths compared (default {ATTENTIONS})")
    p.add_argument("--methods", help=f"timed methods (default {TIMED}; --dry-run {MODES['dry'][9]})")
    p.add_argument("--exact-methods", help=f"methods checked against ar (default every method; --dry-run "
                   f"{MODES['dry'][10]})")
    p.add_argument("--batches", help="timed batch sizes (default 1,8; --quick, --dry-run 1)")
    p.add_argument("--timed-attention", default="split",
                   help="attention paths of the timing part (default split, the GPU default)")
    p.add_argument("--gpu-loops", default=GPU_LOOPS,
                   help=f"loop modes timed side by side, interleaved (default {GPU_LOOPS}: the engine's command "
                        "buffers against XLA's default loop handling)")
    p.add_argument("--no-trace", action="store_true", help="write no profiler trace")
    p.add_argument("--exact-layers", type=int, default=2, help="target layers of the exactness pair (default 2)")
    p.add_argument("--accept", type=int, default=6, help="drafts every forced round accepts (default 6)")
    p.add_argument("--timeout", type=float, help="seconds: stop starting new work (default 420; --dry-run 120)")
    p.add_argument("--skip", default="", help="parts to skip: attention, exactness, timing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--projections", default="eval/results", metavar="DIR",
                   help="the folder of the recorded gpu_compile_<h100|h200>.json (default eval/results)")


def attention_cases(n: int, kh: int, h: int, s: int, t: int, b: int, seed: int):
    """``(name, q, parts)`` in float32: a tree block over a cache (lengths 0 to ``s - t``; sequence 0 has a row
    that sees nothing, sequence 1 one that sees the prefix only), a block in the cache that sees all of itself
    (the drafter's, its mask on the host) and a context plus a separate block."""
    rng = np.random.default_rng(seed)

    def arr(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    q, k, v = arr(b, t, n, h), arr(b, kh, s, h), arr(b, kh, s, h)
    lengths = jnp.asarray(np.linspace(0, s - t, b).astype(np.int32))
    block = np.stack([random_tree_mask(rng, t) for _ in range(b)])
    block[0, t // 2] = False
    if b > 1:
        block[1, t - 1] = False
    bk, bv = arr(b, kh, t, h), arr(b, kh, t, h)
    return [("tree block over a cache", q, [(k, v, layers.CacheMask(lengths, jnp.asarray(block)))]),
            ("block in the cache, all visible", q, [(k, v, layers.CacheMask(lengths, np.ones((1, t, t), bool)))]),
            ("context + dense block", q, [(k, v, layers.CacheMask(lengths)), (bk, bv, jnp.ones((1, t, t), bool))])]


def check_attention(cfg, impls, seed: int, s: int, t: int, b: int) -> list[dict]:
    """Each path in each dtype against the ``einsum`` reference in float32 over the same (dtype-rounded) inputs;
    it passes when ``|got - ref| <= tol * (1 + |ref|)`` everywhere, its fully masked rows are zeros and nothing
    is NaN."""
    n, kh, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rows = []
    ref_fn = jax.jit(lambda q, parts: layers.attend(q, parts, impl="einsum"))
    for name, q, parts in attention_cases(n, kh, h, s, t, b, seed):
        dense = [jnp.broadcast_to(layers.dense_mask(m, t, k.shape[2]), (b, t, k.shape[2])) for k, _, m in parts]
        empty = ~np.asarray(jnp.concatenate(dense, -1).any(-1))  # [B, T]
        masks = [m for _, _, m in parts]  # closed over: a mask on the host stays static
        for dtype in ("float32", "bfloat16"):
            kv = [(k.astype(dtype), v.astype(dtype)) for k, v, _ in parts]
            qd = q.astype(dtype)
            f32 = jnp.float32
            ref = np.asarray(ref_fn(qd.astype(f32), [(k.astype(f32), v.astype(f32), m)
                                                     for (k, v), m in zip(kv, dense, strict=True)]))
            t0 = time.perf_counter()

            def run(q, kv, masks=masks):
                parts = [(k, v, m) for (k, v), m in zip(kv, masks, strict=True)]
                return [layers.attend(q, parts, impl=i) for i in impls]

            try:  # every path in one program: one compile per case and dtype
                outs = [np.asarray(o, np.float32) for o in jax.jit(run)(qd, kv)]
            except Exception as e:  # recorded, and the check goes on
                rows += [{"case": name, "impl": i, "dtype": dtype, "ok": False, "error": error_line(e)} for i in impls]
                continue
            seconds, tol = time.perf_counter() - t0, TOLERANCE[dtype]
            for impl, got in zip(impls, outs, strict=True):
                err, bound = np.abs(got - ref), tol * (1 + np.abs(ref))
                zero = bool(np.all(got[empty] == 0))
                rows.append({"case": name, "impl": impl, "dtype": dtype, "max_abs_err": float(err.max()),
                             "worst_vs_tolerance": float((err / bound).max()), "tolerance": tol,
                             "masked_rows": int(empty.sum()), "masked_rows_zero": zero,
                             "ok": bool((err <= bound).all() and zero and np.isfinite(got).all()),
                             "shape": {"B": b, "T": t, "N": n, "K": kh, "H": h, "S": s},
                             "seconds_all_paths": seconds})
    return rows


def exact_pair(preset: str, target_layers: int, seed: int):
    """Random bf16 weights at the preset's widths with ``target_layers`` (at least 2) target layers and one
    drafter layer reading target layers ``0 .. min(target_layers - 1, 5) - 1`` (never the final-normed last)."""
    t, ds, _, _ = configs(preset)
    t = dataclasses.replace(t, num_hidden_layers=target_layers)
    ids = tuple(range(min(target_layers - 1, len(ds.target_layer_ids))))
    ds = dataclasses.replace(ds, num_hidden_layers=1, num_target_layers=target_layers, target_layer_ids=ids)
    return testing.random_pair(seed, configs=(t, ds), sharpen=False, dtype=jnp.bfloat16, drafter_seed=seed + 1)


def auto_method(drafter, sizes=None) -> Auto:
    """``auto`` (over ``sizes``; None: its default candidates) under a fixed cost table (round seconds growing
    slowly with the verified size), so no profiling runs and the trees stay viable."""
    a = (Auto() if sizes is None else Auto(sizes=sizes)).resolve(drafter)
    rows = [0 if v == 0 else drafter.config.block_size if isinstance(v, str) else v for v in a.sizes]
    return dataclasses.replace(a, tree=None, chain=None, table=CostTable(a.labels(),
                                                                         tuple(1.0 + 0.004 * x for x in rows)))


def check_exactness(target, drafter, methods, attentions, prompts, new: int, auto_sizes) -> list[dict]:
    rows = []
    for attention in attentions:
        opts = Options(attention=attention)
        t0 = time.perf_counter()
        ar = generate(target, None, prompts, max_new_tokens=new, options=opts).tokens
        rows.append({"attention": attention, "method": "ar", "seconds": time.perf_counter() - t0, "ok": True})
        for name in methods:
            method = auto_method(drafter, auto_sizes) if name == "auto" else name
            kw = {"budget": 16} if name in ("ddtree", "sparklingtree", "sparklingtree-beam", "pctree") else {}
            if kw:
                method = f"{name}@16"
            row = {"attention": attention, "method": name, **kw}
            t0 = time.perf_counter()
            try:  # twice: the second execution of a compiled program (a conditional command buffer's included)
                out = generate(target, drafter, prompts, method=method, max_new_tokens=new, options=opts)
                again = generate(target, drafter, prompts, method=method, max_new_tokens=new, options=opts)
            except Exception as e:  # recorded, and the check goes on
                rows.append({**row, "ok": False, "error": error_line(e)})
                log(f"  exactness {name} ({attention}): ERROR {rows[-1]['error']}")
                continue
            first = [next((i for i, (x, y) in enumerate(zip(a, o, strict=False)) if x != y), None)
                     for a, o in zip(ar, out.tokens, strict=True)]
            ok = out.tokens == ar and again.tokens == ar
            rows.append({**row, "ok": ok, "first_mismatch": first, "second_run_equal": again.tokens == out.tokens,
                         "rounds": [len(x) for x in out.acceptance_lengths], "seconds": time.perf_counter() - t0})
            log(f"  exactness {name} ({attention}): {'ok' if ok else 'MISMATCH'} (run twice)")
    return rows


def peak_memory() -> int | None:
    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)()
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def projection_rows(kind: str, folder: str = "eval/results") -> tuple[str | None, list[dict]]:
    """``(target, rows)`` of the recorded deviceless projection for this device kind (``H100`` / ``H200`` in
    it): ``<folder>/gpu_compile_<target>.json`` (``--projections``; default the checkout's ``eval/results``, from
    the working directory, where eval/gpu_check.sh runs); ``(None, [])`` for another device."""
    target = next((t for t in ("h100", "h200") if t in kind.lower()), None)
    path = pathlib.Path(folder) / f"gpu_compile_{target}.json"
    if target is None or not path.exists():
        return None, []
    return target, json.loads(path.read_text())


def beside_projection(row: dict, projected: list[dict], target: str | None) -> dict:
    """The projection of ``row`` (same method, batch, context, attention, loop mode) with measured / projected;
    a ``projection_note`` instead where none was recorded."""
    match = next((p for p in projected if p.get("label") == row["label"] and p.get("batch") == row["batch"]
                  and p.get("context") == row["context"] and p.get("attention") == row["attention"]
                  and p.get("gpu_loop", "command_buffer") == row["gpu_loop"] and "round_us_range" in p), None)
    if match is None:
        return {"projection_note": f"no recorded projection for this device ({target or 'not an H100 / H200'}), "
                                   f"{row['label']} B={row['batch']} S={row['context']} {row['attention']} "
                                   f"{row['gpu_loop']}"}
    out = {"projection_target": target, "projected_round_us": match["round_us_range"],
           "projected_round_ar_steps": match.get("round_ar_steps_range"),
           "measured_over_projected_us": {p: row["ms"] * 1e3 / v for p, v in match["round_us_range"].items()}}
    if row.get("round_ar_steps") is not None and match.get("round_ar_steps_range"):
        out["measured_over_projected_ar_steps"] = {p: row["round_ar_steps"] / v
                                                   for p, v in match["round_ar_steps_range"].items()}
    return out


def trace_case(case, folder: str) -> dict:
    """A ``jax.profiler`` trace of ``case``'s short and long runs (each inside a host annotation) into
    ``folder``, and its summary (:func:`sparkjax.bench.trace.summarise`)."""
    os.makedirs(folder, exist_ok=True)
    with jax.profiler.trace(folder):
        with jax.profiler.TraceAnnotation("short"):
            jax.block_until_ready(case.short())
        with jax.profiler.TraceAnnotation("long"):
            jax.block_until_ready(case.long())
    path = trace.find_trace(folder)
    if path is None:
        raise RuntimeError(f"jax.profiler wrote no trace-event file under {folder}")
    summary = trace.summarise(trace.load(path), "short", "long", case.units)
    return {"trace_file": os.path.relpath(path, os.path.dirname(os.path.dirname(folder))), **summary}


def time_methods(target, drafter, labels, attentions, batches, prompt, steps, rounds, accept, context, reps, seed,
                 deadline, auto_sizes, gpu_loops=("command_buffer",), trace_dir=None,
                 projections: str = "eval/results") -> list[dict]:
    """Per batch and attention path: every method under every loop mode, timed side by side (interleaved), then
    (with ``trace_dir``) each traced, its trace summarised beside the recorded projection."""
    rows = []
    kind = getattr(jax.devices()[0], "device_kind", "")
    ptarget, projected = projection_rows(kind, projections)
    for b in batches:
        for attention in attentions:
            t0 = time.perf_counter()
            cases = {}
            for gl in gpu_loops:
                opts = Options(attention=attention, gpu_loop=gl)
                if time.perf_counter() < deadline:
                    cases["ar", gl] = ar_case(target, b, prompt, steps, context, seed, opts)
                for m in labels:
                    row = {"label": m, "batch": b, "attention": attention, "gpu_loop": gl}
                    if m == "ar" and ("ar", gl) in cases:
                        continue
                    if time.perf_counter() > deadline:
                        rows.append({**row, "error": "not run: --timeout"})
                        continue
                    try:
                        plan = (auto_method(drafter, auto_sizes).plan(target, drafter, False, opts) if m == "auto"
                                else forced_plan(target, drafter, m, accept, opts))
                        cases[m, gl] = round_case(target, drafter, m, b, prompt, rounds, accept, context, seed, plan)
                    except Exception as e:  # recorded, and the check goes on
                        rows.append({**row, "error": error_line(e)})
                        log(f"  [B={b} {attention} {gl}] {m}: ERROR {rows[-1]['error']}")
            if not cases:
                continue
            log(f"  [B={b} {attention}] {len(cases)} programs compiled and warmed in {time.perf_counter() - t0:.0f}s")
            # each sample is already a time (the long run less the short one, per step or round); every program
            # runs again here (its second and later executions)
            stats = timing.interleave({f"{m} [{gl}]": c.sample for (m, gl), c in cases.items()}, reps,
                                      measure=lambda f: f(), deadline=deadline)
            for (m, gl), c in cases.items():
                st, ar = stats[f"{m} [{gl}]"], stats.get(f"ar [{gl}]")
                row = {"label": m, "batch": b, "attention": attention, "gpu_loop": gl, "context": context,
                       "prompt": prompt, "ms": st.median * 1e3, "ms_min": st.min * 1e3, "spread": st.spread,
                       "n": st.n, "forced_accept": None if m in ("ar", "auto") else accept,
                       "round_ar_steps": st.median / ar.median if ar is not None and ar.median > 0 else None,
                       "peak_bytes": peak_memory()}
                row.update(beside_projection(row, projected, ptarget))
                if trace_dir is not None and time.perf_counter() < deadline:
                    name = f"b{b}_{attention}_{gl}_{m}".replace("@", "_")
                    try:
                        row["trace"] = trace_case(c, os.path.join(trace_dir, name))
                    except Exception as e:  # recorded, and the check goes on
                        row["trace"] = {"error": error_line(e)}
                rows.append(row)
    return rows


def _range(r: dict | None) -> str:
    if not r:
        return "-"
    vals = [r[p] for p in ("low", "central", "high")]
    return f"{r['central']:.2f} ({min(vals):.2f}-{max(vals):.2f})"


def _cell(x, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}{spec}}"


def format_text(result: dict) -> str:
    mode = "dry run" if result["dry_run"] else "quick run" if result.get("quick") else "full run"
    lines = [f"# {result['command']}", f"# backend {result['backend']}, preset {result['preset']}, "
             f"jax {result['jax']}, {mode}; XLA_FLAGS {result.get('xla_flags') or '(unset)'}"
             + ("" if result.get("command_buffers_while_tracing") else
                f" (without {PROFILE_FLAG} XLA runs no command buffer while a trace is taken)")]
    if (att := result.get("attention")) is not None:
        lines += ["", "attention vs the float32 einsum reference",
                  f"{'case':26} {'impl':8} {'dtype':9} {'max err':>10} {'tol':>8} {'zeros':>5} ok"]
        lines += [f"{r['case']:26} {r['impl']:8} {r['dtype']:9} " + (
            f"ERROR {r['error']}" if "error" in r else f"{r['max_abs_err']:>10.2e} {r['tolerance']:>8.0e} "
            f"{str(r['masked_rows_zero']):>5} {r['ok']}") for r in att]
    if (ex := result.get("exactness")) is not None:
        lines += ["", "greedy exactness against ar (random weights)", f"{'attention':9} {'method':20} ok"]
        lines += [f"{r['attention']:9} {r['method']:20} {r['ok']}" + (
            f"  ERROR {r['error']}" if "error" in r else "" if r["ok"]
            else f"  first mismatch per sequence {r.get('first_mismatch')}") for r in ex]
    if (tm := result.get("timing")) is not None:
        lines += ["", "round times (forced acceptance; auto: its own choices), loop modes interleaved; projected: the "
                  "recorded deviceless projection (eval/results/gpu_compile_<device>.json), measured / projected",
                  f"{'B':>2} {'attention':9} {'loops':14} {'method':20} {'ms':>9} {'min':>9} {'xAR':>6} "
                  f"{'projected xAR':>19} {'meas/proj':>9} {'peak GiB':>9}"]
        for r in tm:
            lead = f"{r['batch']:>2} {r['attention']:9} {r.get('gpu_loop', '-'):14} {r['label']:20} "
            if "error" in r:
                lines.append(lead + f"ERROR {r['error']}")
                continue
            proj = r.get("projected_round_ar_steps")
            ratio = (r.get("measured_over_projected_ar_steps") or {}).get("central")
            lines.append(lead + f"{r['ms']:>9.2f} {r['ms_min']:>9.2f} {_cell(r['round_ar_steps'], '.2f', 6)} "
                         f"{_range(proj):>19} {_cell(ratio, '.2f', 9)} "
                         f"{_cell(None if r['peak_bytes'] is None else r['peak_bytes'] / 2**30, '.2f', 9)}")
        traced = [r for r in tm if "trace" in r]
        if traced:
            lines += ["", "from the profiler traces, per round (AR step): the long run less the short one "
                      "(kernels: gemm / attention / tree / other; idle: between rounds + between kernels)",
                      f"{'B':>2} {'loops':14} {'method':20} {'kernels g/a/t/o':>20} {'kernel us g/a/t/o':>27} "
                      f"{'d2h':>5} {'device ms':>9} {'idle us':>17}"]
            for r in traced:
                t = r["trace"]
                lead = f"{r['batch']:>2} {r.get('gpu_loop', '-'):14} {r['label']:20} "
                if "error" in t:
                    lines.append(lead + f"ERROR {t['error']}")
                elif not t["gpu_kernels"]:
                    lines.append(lead + f"wall {t['wall_ms_per_round']:.2f} ms per round; {t['note']}")
                else:
                    kn, ku = t["kernels_per_round"], t["kernel_us_per_round"]
                    idle = (f"{t['idle_us_per_round']:.0f}" if t["idle_between_rounds_us"] is None else
                            f"{t['idle_between_rounds_us']:.0f}+{t['idle_between_kernels_us']:.0f}")
                    lines.append(lead + f"{'/'.join(f'{kn[k]:.0f}' for k in trace.KINDS):>20} "
                                 f"{'/'.join(f'{ku[k]:.0f}' for k in trace.KINDS):>27} "
                                 f"{t['d2h_copies_per_round']:>5.1f} {t['device_ms_per_round']:>9.3f} {idle:>17}")
    lines += ["", f"# parts done: {', '.join(result['done']) or 'none'}; wall {result['wall_s']:.0f}s"
              + ("; stopped by --timeout" if result.get("timed_out") else "")]
    return "\n".join(lines) + "\n"


def run(a, report) -> int:
    if a.dry_run:
        jax.config.update("jax_platforms", "cpu")  # before the first computation picks a backend
    if a.dry_run and a.quick:
        raise ArgumentError("--quick and --dry-run: pick one")
    preset, d_batches, context, prompt, new, steps, rounds, reps, d_timeout, d_timed, d_exact, auto_sizes = MODES[
        "dry" if a.dry_run else "quick" if a.quick else "gpu"]
    preset = a.preset or preset
    t_cfg = configs(preset)[0]  # an unknown preset fails before any work
    batches = ints(a.batches or d_batches, "--batches")
    attentions = names(a.attentions)
    for x in attentions:
        Options(attention=x)  # an unknown path is an ArgumentError naming attention
    timed_attentions = names(a.timed_attention)
    for x in timed_attentions:
        Options(attention=x)
    gpu_loops = names(a.gpu_loops)
    for x in gpu_loops:
        Options(gpu_loop=x)  # an unknown mode is an ArgumentError naming gpu_loop
    labels = names(a.methods or d_timed)
    exact = [m for m in names(a.exact_methods or d_exact) if m != "ar"]
    for m in labels + exact:
        if m != "auto":
            parse_method(m)
    skip = set(names(a.skip))
    if skip - set(PARTS):
        raise ArgumentError(f"--skip: unknown parts {sorted(skip - set(PARTS))}")
    at_least(a.exact_layers, "--exact-layers", 2)
    deadline = report.start + at_least(a.timeout if a.timeout is not None else d_timeout, "--timeout", 1)
    out = a.folder or os.environ.get("OUT") or "."
    os.makedirs(out, exist_ok=True)
    flags = os.environ.get("XLA_FLAGS", "")
    result = {"command": report.command, "backend": device_name(), "jax": jax.__version__, "preset": preset,
              "dry_run": bool(a.dry_run), "quick": bool(a.quick), "done": [], "timed_out": False, "wall_s": 0.0,
              "xla_flags": flags, "command_buffers_while_tracing": PROFILE_FLAG in flags.split(),
              "traces": None if a.no_trace else os.path.join(out, "traces")}

    def save():
        result["wall_s"] = time.perf_counter() - report.start
        write_text(os.path.join(out, "device_check.json"), json.dumps(result, indent=1) + "\n")
        write_text(os.path.join(out, "device_check.txt"), format_text(result))

    def attention():
        impls = [i for i in layers.ATTENTION_IMPLS if i != "auto"]
        rows = check_attention(t_cfg, impls, a.seed, context, min(65, max(5, context // 4)), 2)
        log(f"  attention: {sum(r['ok'] for r in rows)}/{len(rows)} ok")
        return rows

    def exactness():
        target, drafter = exact_pair(preset, a.exact_layers, a.seed)
        rng = np.random.default_rng(a.seed)
        prompts = [rng.integers(0, t_cfg.vocab_size, n).tolist() for n in (prompt, prompt // 2 + 1)]
        return check_exactness(target, drafter, exact, attentions, prompts, new, auto_sizes)

    def timed():
        target, drafter = random_pair(preset, a.seed)
        return time_methods(target, drafter, labels, timed_attentions, batches, prompt, steps, rounds, a.accept,
                            context, reps, a.seed, deadline, auto_sizes, gpu_loops,
                            None if a.no_trace else os.path.join(out, "traces"), a.projections)

    for name, fn in zip(PARTS, (attention, exactness, timed), strict=True):
        if name not in skip and (name == "attention" or time.perf_counter() < deadline):
            result[name] = fn()
            result["done"].append(name)
            save()
    result["timed_out"] = time.perf_counter() > deadline
    save()
    report.table = lambda rows: format_text(result)
    return 0
