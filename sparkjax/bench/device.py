"""The prepared device check: attention paths, greedy exactness and round times on this machine's accelerator.

    python -m sparkjax.bench device --out DIR              # a GPU: real shapes, about 8 minutes (docs/benchmarks.md)
    python -m sparkjax.bench device --dry-run --out DIR    # the same on the CPU at tiny shapes
    bash eval/gpu_check.sh [--dry-run]                     # the wrapper: PYTHONPATH=checkout, --out $OUT

Three parts, each written to ``DIR/device_check.json`` and ``.txt`` (atomically) as soon as it is done:
``attention`` (every :func:`sparkjax.nn.layers.attend` path against the float32 ``einsum`` reference in bf16 and
float32: tree masks over a cache, an empty prefix, a fully masked row, the drafter's context-plus-block),
``exactness`` (every method's greedy tokens against ``ar``'s under each attention path, random bf16 weights) and
``timing`` (the AR step and the forced-acceptance round, as ``scale``, per batch and path; ``auto`` under a fixed
cost table; the peak memory). ``--timeout`` stops starting new work. Exit code 0 even when a check fails (the
records say which); 2 for a bad argument.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparkjax.engine.api import generate
from sparkjax.engine.costs import CostTable
from sparkjax.engine.methods import METHODS, Auto, parse_method
from sparkjax.engine.options import Options
from sparkjax.errors import ArgumentError
from sparkjax.nn import layers
from sparkjax.nn.drafter import Drafter
from sparkjax.nn.qwen3 import Qwen3
from sparkjax.reference import random_tree_mask

from . import timing
from .common import at_least, configs, device_name, error_line, ints, log, names, random_pair, write_text
from .scale import ar_case, forced_plan, round_case

ATTENTIONS = "einsum,split"
TIMED = "ar,dspark,sparklingtree@16,sparklingtree@64,auto"
PARTS = ("attention", "exactness", "timing")
# per mode: preset, batches, context, prompt, new tokens of the exactness runs, AR steps, rounds, reps, timeout,
# timed methods, exactness methods, auto's candidate sizes (None: its default)
MODES = {
    "gpu": ("real", "1,8", 1024, 256, 24, 16, 6, 3, 420.0, TIMED, ",".join(METHODS[1:]), None),
    "dry": ("tiny", "1", 128, 12, 10, 4, 2, 1, 120.0, "ar,dspark", "dspark,sparklingtree", (0, "chain")),
}
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}  # |path - float32 reference| <= tol * (1 + |reference|)


def add_arguments(p) -> None:
    p.add_argument("--dry-run", action="store_true", help="the CPU at tiny shapes (under a minute)")
    p.add_argument("--out", metavar="DIR", dest="folder",
                   help="folder for device_check.json / .txt (default $OUT, else .)")
    p.add_argument("--preset", help="model shapes (default real; --dry-run: tiny)")
    p.add_argument("--attentions", default=ATTENTIONS, help=f"attention paths compared (default {ATTENTIONS})")
    p.add_argument("--methods", help=f"timed methods (default {TIMED}; --dry-run {MODES['dry'][9]})")
    p.add_argument("--exact-methods", help=f"methods checked against ar (default every method; --dry-run "
                   f"{MODES['dry'][10]})")
    p.add_argument("--batches", help="timed batch sizes (default 1,8; --dry-run 1)")
    p.add_argument("--exact-layers", type=int, default=2, help="target layers of the exactness pair (default 2)")
    p.add_argument("--accept", type=int, default=6, help="drafts every forced round accepts (default 6)")
    p.add_argument("--timeout", type=float, help="seconds: stop starting new work (default 420; --dry-run 120)")
    p.add_argument("--skip", default="", help="parts to skip: attention, exactness, timing")
    p.add_argument("--seed", type=int, default=0)


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
    return (Qwen3(t, rngs=nnx.Rngs(seed), dtype=jnp.bfloat16),
            Drafter(ds, rngs=nnx.Rngs(seed + 1), dtype=jnp.bfloat16))


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
            row = {"attention": attention, "method": name, **kw}
            t0 = time.perf_counter()
            try:
                out = generate(target, drafter, prompts, method=method, max_new_tokens=new, options=opts, **kw)
            except Exception as e:  # recorded, and the check goes on
                rows.append({**row, "ok": False, "error": error_line(e)})
                log(f"  exactness {name} ({attention}): ERROR {rows[-1]['error']}")
                continue
            first = [next((i for i, (x, y) in enumerate(zip(a, o, strict=False)) if x != y), None)
                     for a, o in zip(ar, out.tokens, strict=True)]
            rows.append({**row, "ok": out.tokens == ar, "first_mismatch": first,
                         "rounds": [len(x) for x in out.acceptance_lengths], "seconds": time.perf_counter() - t0})
            log(f"  exactness {name} ({attention}): {'ok' if out.tokens == ar else 'MISMATCH'}")
    return rows


def peak_memory() -> int | None:
    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)()
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def time_methods(target, drafter, labels, attentions, batches, prompt, steps, rounds, accept, context, reps, seed,
                 deadline, auto_sizes) -> list[dict]:
    rows = []
    for b in batches:
        for attention in attentions:
            opts = Options(attention=attention)
            t0 = time.perf_counter()
            cases = [] if time.perf_counter() > deadline else [ar_case(target, b, prompt, steps, context, seed, opts)]
            for m in labels:
                row = {"label": m, "batch": b, "attention": attention}
                if m == "ar" and cases:
                    continue
                if time.perf_counter() > deadline:
                    rows.append({**row, "error": "not run: --timeout"})
                    continue
                try:
                    plan = (auto_method(drafter, auto_sizes).plan(target, drafter, False, opts) if m == "auto"
                            else forced_plan(target, drafter, m, accept, opts))
                    cases.append(round_case(target, drafter, m, b, prompt, rounds, accept, context, seed, plan))
                except Exception as e:  # recorded, and the check goes on
                    rows.append({**row, "error": error_line(e)})
                    log(f"  [B={b} {attention}] {m}: ERROR {rows[-1]['error']}")
            if not cases:
                continue
            log(f"  [B={b} {attention}] {len(cases)} programs compiled and warmed in {time.perf_counter() - t0:.0f}s")
            # each sample is already a time (the long run less the short one, per step or round)
            stats = timing.interleave({c.label: c.sample for c in cases}, reps, measure=lambda f: f(),
                                      deadline=deadline)
            ar = stats["ar"]
            for c in cases:
                st = stats[c.label]
                rows.append({"label": c.label, "batch": b, "attention": attention, "context": context,
                             "prompt": prompt, "ms": st.median * 1e3, "ms_min": st.min * 1e3, "spread": st.spread,
                             "n": st.n, "forced_accept": None if c.label in ("ar", "auto") else accept,
                             "round_ar_steps": st.median / ar.median if ar.median > 0 else None,
                             "peak_bytes": peak_memory()})
    return rows


def _cell(x, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}{spec}}"


def format_text(result: dict) -> str:
    lines = [f"# {result['command']}", f"# backend {result['backend']}, preset {result['preset']}, "
             f"jax {result['jax']}, {'dry run' if result['dry_run'] else 'full run'}"]
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
        lines += ["", "round times (forced acceptance; auto: its own choices)",
                  f"{'B':>2} {'attention':9} {'method':20} {'ms':>9} {'min':>9} {'xAR':>6} {'peak GiB':>9}"]
        lines += [f"{r['batch']:>2} {r['attention']:9} {r['label']:20} " + (
            f"ERROR {r['error']}" if "error" in r else f"{r['ms']:>9.2f} {r['ms_min']:>9.2f} "
            f"{_cell(r['round_ar_steps'], '.2f', 6)} "
            f"{_cell(None if r['peak_bytes'] is None else r['peak_bytes'] / 2**30, '.2f', 9)}") for r in tm]
    lines += ["", f"# parts done: {', '.join(result['done']) or 'none'}; wall {result['wall_s']:.0f}s"
              + ("; stopped by --timeout" if result.get("timed_out") else "")]
    return "\n".join(lines) + "\n"


def run(a, report) -> int:
    if a.dry_run:
        jax.config.update("jax_platforms", "cpu")  # before the first computation picks a backend
    preset, d_batches, context, prompt, new, steps, rounds, reps, d_timeout, d_timed, d_exact, auto_sizes = MODES[
        "dry" if a.dry_run else "gpu"]
    preset = a.preset or preset
    t_cfg = configs(preset)[0]  # an unknown preset fails before any work
    batches = ints(a.batches or d_batches, "--batches")
    attentions = names(a.attentions)
    for x in attentions:
        Options(attention=x)  # an unknown path is an ArgumentError naming attention
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
    result = {"command": report.command, "backend": device_name(), "jax": jax.__version__, "preset": preset,
              "dry_run": bool(a.dry_run), "done": [], "timed_out": False, "wall_s": 0.0}

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
        return time_methods(target, drafter, labels, attentions, batches, prompt, steps, rounds, a.accept, context,
                            reps, a.seed, deadline, auto_sizes)

    for name, fn in zip(PARTS, (attention, exactness, timed), strict=True):
        if name not in skip and (name == "attention" or time.perf_counter() < deadline):
            result[name] = fn()
            result["done"].append(name)
            save()
    result["timed_out"] = time.perf_counter() > deadline
    save()
    report.table = lambda rows: format_text(result)
    return 0
