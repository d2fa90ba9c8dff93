"""Batched decode attention on this CPU: sparkjax's ``attend`` paths against torch's fused SDPA kernel.

    python -m sparkjax.bench attention [--batch 64] [--live 64,96,160] [--bucket 256] [--buffers 12] [--reps 5]
                                       [--out PATH]

One decode step's attention (float32), one query per sequence against ``live`` slots of a ``--bucket``-slot
cache, per :func:`sparkjax.nn.layers.attend` path and torch's SDPA over the live slots; interleaved, per buffer,
every output checked against torch's.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from sparkjax.errors import ArgumentError
from sparkjax.nn import layers

from . import timing
from .common import add_output, at_least, ints, pct

PATHS = ("einsum", "blocked", "prefix")


def add_arguments(p) -> None:
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--live", default="64,96,160", help="comma-separated live lengths (at most --bucket)")
    p.add_argument("--bucket", type=int, default=256)
    p.add_argument("--buffers", type=int, default=12)
    p.add_argument("--reps", type=int, default=5)
    add_output(p, json_records=False)


def bench(batch: int, live: int, bucket: int, buffers: int, reps: int, heads=(8, 4), head_dim=64) -> list[dict]:
    import torch

    n, kh = heads
    rng = np.random.default_rng(live)
    q = rng.standard_normal((batch, 1, n, head_dim), np.float32)
    ks = [rng.standard_normal((batch, kh, bucket, head_dim), np.float32) for _ in range(buffers)]
    vs = [rng.standard_normal((batch, kh, bucket, head_dim), np.float32) for _ in range(buffers)]
    mask = jnp.broadcast_to(jnp.arange(bucket) < live, (batch, 1, bucket))
    jq, jk, jv = jnp.asarray(q), [jnp.asarray(k) for k in ks], [jnp.asarray(v) for v in vs]

    def jax_path(impl):
        fn = jax.jit(lambda q, ks, vs, m: [layers.attend(q, [(k, v, m)], impl=impl)
                                           for k, v in zip(ks, vs, strict=True)])
        return lambda: fn(jq, jk, jv, mask)

    tq = torch.from_numpy(q).transpose(1, 2).contiguous()  # [B, N, 1, H]
    tk = [torch.from_numpy(k[:, :, :live]).contiguous() for k in ks]  # the live slots only
    tv = [torch.from_numpy(v[:, :, :live]).contiguous() for v in vs]

    def torch_path():
        with torch.no_grad():
            sdpa = torch.nn.functional.scaled_dot_product_attention
            return [sdpa(tq, k, v, enable_gqa=True) for k, v in zip(tk, tv, strict=True)]

    runs = {p: jax_path(p) for p in PATHS} | {"torch sdpa": torch_path}
    ref = np.stack([o.transpose(1, 2).numpy() for o in torch_path()])
    diff = {p: float(np.max(np.abs(np.stack([np.asarray(o) for o in runs[p]()]) - ref))) for p in PATHS}
    stats = timing.interleave(runs, reps)
    live_bytes = 2 * batch * kh * live * head_dim * 4
    return [{"path": p, "live": live, "median_ms": s.median / buffers * 1e3, "min_ms": s.min / buffers * 1e3,
             "spread": s.spread, "live_gb_s": live_bytes / (s.median / buffers) / 1e9,
             "max_abs_diff": diff.get(p, 0.0)} for p, s in stats.items()]


def table(rows: list[dict]) -> str:
    lines = [f"{'live':>5} {'path':>11} {'median ms':>10} {'min ms':>8} {'spread':>7} {'live GB/s':>10} "
             f"{'max |diff|':>11}"]
    lines += [f"{r['live']:>5} {r['path']:>11} {r['median_ms']:10.2f} {r['min_ms']:8.2f} {pct(r['spread'], 7)} "
              f"{r['live_gb_s']:10.1f} {r['max_abs_diff']:11.1e}" for r in rows]
    return "\n".join(lines)


def run(args, report) -> None:
    for arg in ("batch", "bucket", "buffers", "reps"):
        at_least(getattr(args, arg), f"--{arg}")
    lives = ints(args.live, "--live")
    if any(x > args.bucket for x in lives):
        raise ArgumentError(f"--live: every length must be in 1..{args.bucket}, got {args.live}")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch (and its OpenMP runtime) is loaded
    import torch

    torch.set_num_threads(2)
    report.table = table
    report.header.append(f"# batch {args.batch}, 8/4 heads of 64, float32, bucket {args.bucket} slots, "
                         f"{args.buffers} buffers per call, {args.reps} interleaved repetitions; ms per buffer "
                         "(one layer's attention)")
    for live in lives:
        report.rows += bench(args.batch, live, args.bucket, args.buffers, args.reps)
