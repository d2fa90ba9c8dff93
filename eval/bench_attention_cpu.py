"""Batched decode attention on this CPU: sparkjax's ``attend`` paths against torch's fused SDPA kernel.

    python eval/bench_attention_cpu.py [--batch 64] [--live 64,96,160] [--bucket 256] [--reps 5] [--out PATH]

One decode step's attention of the random model of ``eval/bench_ar.py`` (8 query / 4 key-value heads of 64,
float32): one query per sequence against ``live`` visible slots. sparkjax keeps a fixed cache bucket of
``--bucket`` slots (heads-major ``[B, K, S, H]``, the live slots first) and runs each
:func:`sparkjax.nn.layers.attend` path (``einsum`` reads the whole bucket; ``blocked`` and ``prefix`` read what
holds the live slots, in 128-slot chunks or the shortest power-of-two prefix); torch (transformers' decode
cache) holds exactly the live slots and runs ``scaled_dot_product_attention(enable_gqa=True)``. Each call
attends over ``--buffers`` distinct key/value buffers (one per layer of a step, 8 by default plus 4 more: about
400 MB at the defaults, so reads come mostly from memory, as in a decode step, not from a warm cache); times are
per buffer. Every path is checked against torch's output (largest absolute difference printed). Repetitions are
interleaved (each path once, then again); torch runs in this process with ``OMP_WAIT_POLICY=PASSIVE`` (set before
it is imported) and 2 threads. Per path: median and fastest time per buffer, the spread (max - min) / median,
and the live K/V bytes over the median time (what a kernel reading only the live slots moves).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch (and its OpenMP runtime) is loaded

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from sparkjax.io.atomic import atomic_file  # noqa: E402
from sparkjax.nn import layers  # noqa: E402

PATHS = ("einsum", "blocked", "prefix")


def bench(batch: int, live: int, bucket: int, buffers: int, reps: int, heads=(8, 4), head_dim=64) -> list[dict]:
    n, kh = heads
    rng = np.random.default_rng(live)
    q = rng.standard_normal((batch, 1, n, head_dim), np.float32)
    ks = [rng.standard_normal((batch, kh, bucket, head_dim), np.float32) for _ in range(buffers)]
    vs = [rng.standard_normal((batch, kh, bucket, head_dim), np.float32) for _ in range(buffers)]
    mask = jnp.broadcast_to(jnp.arange(bucket) < live, (batch, 1, bucket))
    jq, jk, jv = jnp.asarray(q), [jnp.asarray(k) for k in ks], [jnp.asarray(v) for v in vs]

    def jax_path(impl):
        def run(q, ks, vs, m):
            return [layers.attend(q, [(k, v, m)], impl=impl) for k, v in zip(ks, vs, strict=True)]

        fn = jax.jit(run)
        return lambda: jax.block_until_ready(fn(jq, jk, jv, mask))

    tq = torch.from_numpy(q).transpose(1, 2).contiguous()  # [B, N, 1, H]
    tk = [torch.from_numpy(k[:, :, :live]).contiguous() for k in ks]  # the live slots only
    tv = [torch.from_numpy(v[:, :, :live]).contiguous() for v in vs]

    def torch_path():
        with torch.no_grad():
            sdpa = torch.nn.functional.scaled_dot_product_attention
            return [sdpa(tq, k, v, enable_gqa=True) for k, v in zip(tk, tv, strict=True)]

    runs = {p: jax_path(p) for p in PATHS}
    runs["torch sdpa"] = torch_path
    ref = np.stack([o.transpose(1, 2).numpy() for o in torch_path()])
    diff = {p: float(np.max(np.abs(np.stack([np.asarray(o) for o in runs[p]()]) - ref))) for p in PATHS}
    diff["torch sdpa"] = 0.0
    times: dict[str, list[float]] = {p: [] for p in runs}
    for _ in range(reps):
        for p, f in runs.items():
            t0 = time.perf_counter()
            f()
            times[p].append((time.perf_counter() - t0) / buffers)
    live_bytes = 2 * batch * kh * live * head_dim * 4
    rows = []
    for p, ts in times.items():
        med = statistics.median(ts)
        rows.append({"path": p, "live": live, "median_ms": med * 1e3, "min_ms": min(ts) * 1e3,
                     "spread": (max(ts) - min(ts)) / med, "live_gb_s": live_bytes / med / 1e9, "max_abs_diff": diff[p]})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--live", default="64,96,160", help="comma-separated live lengths (at most --bucket)")
    ap.add_argument("--bucket", type=int, default=256)
    ap.add_argument("--buffers", type=int, default=12)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", metavar="PATH", help="also write the table here")
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    try:
        lives = [int(x) for x in a.live.split(",")]
    except ValueError:
        print(f"error: --live: expected comma-separated integers, got {a.live!r}", file=sys.stderr)
        raise SystemExit(2) from None
    bad = next((f"--{k}: expected at least 1, got {v}" for k, v in (("batch", a.batch), ("bucket", a.bucket),
                                                                     ("buffers", a.buffers), ("reps", a.reps))
                if v < 1), None)
    if bad is None and any(not 0 < x <= a.bucket for x in lives):
        bad = f"--live: every length must be in 1..{a.bucket}, got {a.live}"
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        raise SystemExit(2)
    args = " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"# python eval/bench_attention_cpu.py {args}",
             f"# batch {a.batch}, 8/4 heads of 64, float32, bucket {a.bucket} slots, {a.buffers} buffers per call, "
             f"{a.reps} interleaved repetitions; ms per buffer (one layer's attention)",
             f"{'live':>5} {'path':>11} {'median ms':>10} {'min ms':>8} {'spread':>7} {'live GB/s':>10} "
             f"{'max |diff|':>11}"]
    for live in lives:
        for r in bench(a.batch, live, a.bucket, a.buffers, a.reps):
            lines.append(f"{r['live']:>5} {r['path']:>11} {r['median_ms']:10.2f} {r['min_ms']:8.2f} {r['spread']:7.0%} "
                         f"{r['live_gb_s']:10.1f} {r['max_abs_diff']:11.1e}")
    load = os.getloadavg()[0]
    noisy = load > (os.cpu_count() or 1)
    lines.append(f"# load average {load:.2f}" + (" (above the core count: timings are noisy)" if noisy else ""))
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if a.out:
        with atomic_file(a.out) as tmp:
            with open(tmp, "w") as f:
                f.write(text)


if __name__ == "__main__":
    main()
