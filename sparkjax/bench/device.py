"""The prepared device check: attention paths, greedy exactness and round times on this machine's accelerator.

    python -m sparkjax.bench device --out DIR              # a GPU: real shapes, about 8 minutes (docs/benchmarks.md)
    python -m sparkjax.bench device --dry-run --out DIR    # the same on the CPU at tiny shapes
    bash eval/gpu_check.sh [--dry-run]                     # the wrapper: PYTHONPATH=checkout, --out $OUT

Three parts, in this order, each written to ``DIR/device_check.json`` and ``DIR/device_check.txt`` as soon as it
is done (atomically), so a run cut short keeps what it measured:

* ``attention``: every :func:`sparkjax.nn.layers.attend` path against the float32 ``einsum`` reference at the
  preset's head shapes, in bf16 and float32: tree masks over a cache (given as a
  :class:`~sparkjax.nn.layers.CacheMask`), an empty prefix, a fully masked row, the drafter's context-plus-block
  pattern.
* ``exactness``: every method's greedy tokens against ``ar``'s under each attention path, with random bf16
  weights at the preset's widths (``--exact-layers`` target layers), a few rounds each.
* ``timing``: the AR step and the round (forced acceptance, as ``python -m sparkjax.bench scale``; ``auto``
  runs its own choices under a fixed cost table) at the preset's shapes, per batch and attention path, and the
  device's peak memory.

``--timeout`` stops starting new work; the parts finished so far are kept. Exit code 0 even when a check
fails (the records say which); 2 for a bad argument.
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
from sparkjax.engine.programs import spec_program, split_pair
from sparkjax.errors import ArgumentError
from sparkjax.nn import layers
from sparkjax.nn.drafter import Drafter
from sparkjax.nn.qwen3 import Qwen3
from sparkjax.reference import random_tree_mask

from . import timing
from .common import at_least, configs, device_name, ints, log, names, write_text
from .scale import Case, _prompts, ar_case, forced_plan

ATTENTIONS = "einsum,split"
TIMED = "ar,dspark,sparklingtree@16,sparklingtree@64,auto"
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


def _error(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


# ----------------------------------------------------------------------------- attention


def attention_cases(n: int, kh: int, h: int, s: int, t: int, b: int, seed: int):
    """``(name, q, parts)`` in float32: a tree block over a cache (lengths 0, short and up to ``s - t``) with one
    row seeing the prefix only and one row of a sequence with no prefix seeing nothing, a block in the cache that
    sees all of itself (the drafter's, its mask on the host) and a context plus a separate block."""
    rng = np.random.default_rng(seed)

    def arr(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    q, k, v = arr(b, t, n, h), arr(b, kh, s, h), arr(b, kh, s, h)
    lengths = jnp.asarray(np.linspace(0, s - t, b).astype(np.int32))
    block = np.stack([random_tree_mask(rng, t) for _ in range(b)])
    block[0, t // 2] = False  # sequence 0 has no prefix: this row sees nothing
    if b > 1:
        block[1, t - 1] = False  # the prefix only
    cm = layers.CacheMask(lengths, jnp.asarray(block))
    ctx = layers.CacheMask(lengths)
    bk, bv = arr(b, kh, t, h), arr(b, kh, t, h)
    whole = layers.CacheMask(lengths, np.ones((1, t, t), bool))  # on the host: key lengths alone (a drafter's block)
    return [("tree block over a cache", q, [(k, v, cm)]),
            ("block in the cache, all visible", q, [(k, v, whole)]),
            ("context + dense block", q, [(k, v, ctx), (bk, bv, jnp.ones((1, t, t), bool))])]


def check_attention(cfg, impls, seed: int, s: int, t: int, b: int) -> list[dict]:
    """Each path in each dtype against the ``einsum`` reference in float32 over the same (dtype-rounded) inputs;
    a path passes when ``|got - ref| <= tol * (1 + |ref|)`` everywhere, its fully masked rows are zeros and
    nothing is NaN."""
    n, kh, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rows = []
    ref_fn = jax.jit(lambda q, parts: layers.attend(q, parts, impl="einsum"))
    for name, q, parts in attention_cases(n, kh, h, s, t, b, seed):
        dense = [(k, v, jnp.broadcast_to(layers.dense_mask(m, t, k.shape[2]), (b, t, k.shape[2])))
                 for k, v, m in parts]
        empty = ~np.asarray(jnp.concatenate([m for _, _, m in dense], -1).any(-1))  # [B, T]
        for dtype in ("float32", "bfloat16"):
            cast = [(k.astype(dtype), v.astype(dtype), m) for k, v, m in parts]
            qd = q.astype(dtype)
            ref = np.asarray(ref_fn(qd.astype(jnp.float32), [(k.astype(jnp.float32), v.astype(jnp.float32), m)
                                                            for (k, v, _), (_, _, m) in zip(cast, dense, strict=True)]))
            t0 = time.perf_counter()
            masks = [m for _, _, m in cast]  # closed over: a mask on the host stays static

            def run(q, kv, masks=masks):
                parts = [(k, v, m) for (k, v), m in zip(kv, masks, strict=True)]
                return [layers.attend(q, parts, impl=i) for i in impls]

            try:  # every path in one program: one compile per case and dtype
                outs = jax.jit(run)(qd, [(k, v) for k, v, _ in cast])
                outs = [np.asarray(o, np.float32) for o in outs]
            except Exception as e:  # recorded, and the check goes on
                rows += [{"case": name, "impl": i, "dtype": dtype, "ok": False, "error": _error(e)} for i in impls]
                continue
            seconds = time.perf_counter() - t0
            for impl, got in zip(impls, outs, strict=True):
                tol = TOLERANCE[dtype]
                err = np.abs(got - ref)
                zero = bool(np.all(got[empty] == 0))
                rows.append({"case": name, "impl": impl, "dtype": dtype, "max_abs_err": float(err.max()),
                             "worst_vs_tolerance": float((err / (tol * (1 + np.abs(ref)))).max()),
                             "tolerance": tol, "masked_rows": int(empty.sum()), "masked_rows_zero": zero,
                             "ok": bool((err <= tol * (1 + np.abs(ref))).all() and zero and np.isfinite(got).all()),
                             "shape": {"B": b, "T": t, "N": n, "K": kh, "H": h, "S": s},
                             "seconds_all_paths": seconds})
    return rows


# ----------------------------------------------------------------------------- exactness


def exact_pair(preset: str, target_layers: int, seed: int):
    """Random bf16 weights at the preset's widths with ``target_layers`` (at least 2) target layers and one
    drafter layer reading target layers ``0 .. min(target_layers - 1, 5) - 1``."""
    t, ds, _, _ = configs(preset)
    t = dataclasses.replace(t, num_hidden_layers=target_layers)
    ids = tuple(range(min(target_layers - 1, len(ds.target_layer_ids))))  # never the final-normed last layer
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
            t0 = time.perf_counter()
            try:
                out = generate(target, drafter, prompts, method=method, max_new_tokens=new, options=opts, **kw)
            except Exception as e:  # recorded, and the check goes on
                rows.append({"attention": attention, "method": name, **kw, "ok": False, "error": _error(e)})
                log(f"  exactness {name} ({attention}): ERROR {_error(e)}")
                continue
            first = [next((i for i, (x, y) in enumerate(zip(a, o, strict=False)) if x != y), None)
                     for a, o in zip(ar, out.tokens, strict=True)]
            rows.append({"attention": attention, "method": name, **kw, "ok": out.tokens == ar,
                         "first_mismatch": first, "rounds": [len(x) for x in out.acceptance_lengths],
                         "seconds": time.perf_counter() - t0})
            log(f"  exactness {name} ({attention}): {'ok' if out.tokens == ar else 'MISMATCH'}")
    # the paths against each other: ar under every attention gives the same tokens
    return rows


# ----------------------------------------------------------------------------- timing


def round_case(target, drafter, label, batch, prompt, rounds, accept, context, seed, opts, auto_sizes) -> Case:
    if label == "auto":
        plan = auto_method(drafter, auto_sizes).plan(target, drafter, False, opts)
    else:
        plan = dataclasses.replace(forced_plan(target, drafter, label, accept), options=opts)
    graphdefs, states = split_pair(target, drafter)
    tokens, lengths = _prompts(batch, prompt, target.config.vocab_size, seed)
    none, key = jnp.array([-1], jnp.int32), jax.random.key(seed)
    inputs = plan.method.inputs(plan, target=target, drafter=drafter, batch=batch, cache_size=context)
    per_round = plan.depth + 1 if label == "auto" else accept + 1
    buf = 1 << (rounds * (plan.depth + 1) + 2).bit_length()

    def run(n_rounds):
        return lambda: spec_program(graphdefs, states, tokens, lengths, jnp.int32(1 + n_rounds * per_round), none,
                                    jnp.float32(0.0), key, inputs, plan=plan, cache_size=context, buf_len=buf)

    short, long = run(1), run(rounds)
    r_s, r_l = int(np.asarray(short()[3]).max()), int(np.asarray(long()[3]).max())
    if r_l <= r_s:
        raise RuntimeError(f"{label}: the long run made {r_l} rounds, the short one {r_s}")
    return Case(label, batch, lambda: short()[3], lambda: long()[3], float(r_l - r_s), plan=plan)


def peak_memory() -> int | None:
    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)()
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def time_methods(target, drafter, labels, attentions, batches, prompt, steps, rounds, accept, context, reps, seed,
                 deadline, auto_sizes) -> list[dict]:
    rows = []
    for b in batches:
        for attention in attentions:
            if time.perf_counter() > deadline:
                rows += [{"label": m, "batch": b, "attention": attention, "error": "not run: --timeout"}
                         for m in labels]
                continue
            opts = Options(attention=attention)
            t0 = time.perf_counter()
            cases = [ar_case(target, b, prompt, steps, context, seed, opts)]
            for m in labels:
                if m == "ar":
                    continue
                if time.perf_counter() > deadline:
                    rows.append({"label": m, "batch": b, "attention": attention, "error": "not run: --timeout"})
                    continue
                try:
                    cases.append(round_case(target, drafter, m, b, prompt, rounds, accept, context, seed, opts,
                                            auto_sizes))
                except Exception as e:  # recorded, and the check goes on
                    rows.append({"label": m, "batch": b, "attention": attention, "error": _error(e)})
                    log(f"  [B={b} {attention}] {m}: ERROR {_error(e)}")
            log(f"  [B={b} {attention}] {len(cases)} programs compiled and warmed in {time.perf_counter() - t0:.0f}s")
            stats = timing.interleave({c.label: c.sample for c in cases}, reps, deadline=deadline)
            ar = stats["ar"]
            for c in cases:
                st = stats[c.label]
                rows.append({"label": c.label, "batch": b, "attention": attention, "context": context,
                             "prompt": prompt, "ms": st.median * 1e3, "ms_min": st.min * 1e3, "spread": st.spread,
                             "n": st.n, "forced_accept": None if c.label in ("ar", "auto") else accept,
                             "round_ar_steps": st.median / ar.median if ar.median > 0 else None,
                             "peak_bytes": peak_memory()})
    return rows


# ----------------------------------------------------------------------------- output


def format_text(result: dict) -> str:
    lines = [f"# {result['command']}", f"# backend {result['backend']}, preset {result['preset']}, "
             f"jax {result['jax']}, {'dry run' if result['dry_run'] else 'full run'}"]
    att = result.get("attention")
    if att is not None:
        lines += ["", "attention vs the float32 einsum reference",
                  f"{'case':26} {'impl':8} {'dtype':9} {'max err':>10} {'tol':>8} {'zeros':>5} ok"]
        lines += [f"{r['case']:26} {r['impl']:8} {r['dtype']:9} " + (
            f"ERROR {r['error']}" if "error" in r else f"{r['max_abs_err']:>10.2e} {r['tolerance']:>8.0e} "
            f"{str(r['masked_rows_zero']):>5} {r['ok']}") for r in att]
    ex = result.get("exactness")
    if ex is not None:
        lines += ["", "greedy exactness against ar (random weights)", f"{'attention':9} {'method':20} ok"]
        lines += [f"{r['attention']:9} {r['method']:20} {r['ok']}" + (
            f"  ERROR {r['error']}" if "error" in r else "" if r["ok"]
            else f"  first mismatch per sequence {r.get('first_mismatch')}") for r in ex]
    tm = result.get("timing")
    if tm is not None:
        lines += ["", "round times (forced acceptance; auto: its own choices)",
                  f"{'B':>2} {'attention':9} {'method':20} {'ms':>9} {'min':>9} {'xAR':>6} {'peak GiB':>9}"]
        for r in tm:
            if "error" in r:
                lines.append(f"{r['batch']:>2} {r['attention']:9} {r['label']:20} ERROR {r['error']}")
                continue
            peak = f"{r['peak_bytes'] / 2**30:>9.2f}" if r["peak_bytes"] is not None else f"{'-':>9}"
            xar = f"{r['round_ar_steps']:>6.2f}" if r["round_ar_steps"] is not None else f"{'-':>6}"
            lines.append(f"{r['batch']:>2} {r['attention']:9} {r['label']:20} {r['ms']:>9.2f} {r['ms_min']:>9.2f} "
                         f"{xar} {peak}")
    lines += ["", f"# parts done: {', '.join(result['done']) or 'none'}; wall {result['wall_s']:.0f}s"
              + ("; stopped by --timeout" if result.get("timed_out") else "")]
    return "\n".join(lines) + "\n"


def run(a, report) -> int:
    mode = "dry" if a.dry_run else "gpu"
    if a.dry_run:
        jax.config.update("jax_platforms", "cpu")  # before the first computation picks a backend
    preset, d_batches, context, prompt, new, steps, rounds, reps, d_timeout, d_timed, d_exact, auto_sizes = MODES[mode]
    preset = a.preset or preset
    configs(preset)  # an unknown preset fails before any work
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
    if skip - {"attention", "exactness", "timing"}:
        raise ArgumentError(f"--skip: unknown parts {sorted(skip - {'attention', 'exactness', 'timing'})}")
    at_least(a.exact_layers, "--exact-layers", 2)
    timeout = at_least(a.timeout if a.timeout is not None else d_timeout, "--timeout", 1)
    out = a.folder or os.environ.get("OUT") or "."
    os.makedirs(out, exist_ok=True)
    deadline = report.start + timeout
    result = {"command": report.command, "backend": device_name(), "jax": jax.__version__, "preset": preset,
              "dry_run": bool(a.dry_run), "done": [], "timed_out": False, "wall_s": 0.0}

    def save():
        result["wall_s"] = time.perf_counter() - report.start
        write_text(os.path.join(out, "device_check.json"), json.dumps(result, indent=1) + "\n")
        write_text(os.path.join(out, "device_check.txt"), format_text(result))

    t_cfg = configs(preset)[0]
    if "attention" not in skip:
        impls = [i for i in layers.ATTENTION_IMPLS if i != "auto"]
        t = min(65, max(5, context // 4))
        result["attention"] = check_attention(t_cfg, impls, a.seed, context, t, 2)
        result["done"].append("attention")
        log(f"  attention: {sum(r['ok'] for r in result['attention'])}/{len(result['attention'])} ok")
        save()
    if "exactness" not in skip and time.perf_counter() < deadline:
        target, drafter = exact_pair(preset, a.exact_layers, a.seed)
        rng = np.random.default_rng(a.seed)
        prompts = [rng.integers(0, t_cfg.vocab_size, n).tolist() for n in (prompt, prompt // 2 + 1)]
        result["exactness"] = check_exactness(target, drafter, exact, attentions, prompts, new, auto_sizes)
        result["done"].append("exactness")
        save()
        del target, drafter
    if "timing" not in skip and time.perf_counter() < deadline:
        from .common import random_pair

        target, drafter = random_pair(preset, a.seed)
        result["timing"] = time_methods(target, drafter, labels, attentions, batches, prompt, steps, rounds,
                                        a.accept, context, reps, a.seed, deadline, auto_sizes)
        result["done"].append("timing")
    result["timed_out"] = time.perf_counter() > deadline
    save()
    report.table = lambda rows: format_text(result)
    return 0
