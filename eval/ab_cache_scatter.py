"""A/B of the KV cache writes on one device: the explicit-batch-index scatter / gather (before issue 16)
against the per-sequence vmapped ones of :mod:`sparkjax.cache` (batch-local on a mesh). Checks that both give
the same cache, then times a write of T rows and a compaction into 8 layers, interleaved (A B A B)::

    python eval/ab_cache_scatter.py
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from sparkjax.cache import _gather_rows, _scatter_block

B, K, S, H, T, L, REPS = 8, 8, 1024, 128, 33, 8, 30


def old_scatter(buf, rows, offsets):
    b, t = rows.shape[:2]
    batch = jnp.arange(b, dtype=jnp.int32)[:, None]
    slots = offsets[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    return buf.at[batch, :, slots].set(rows.astype(buf.dtype), mode="drop")


def old_compact(buf, start, idx):
    src = start[:, None] + idx
    batch = jnp.arange(src.shape[0], dtype=jnp.int32)[:, None]
    return old_scatter(buf, buf.at[batch, :, src].get(mode="clip"), start)


def new_compact(buf, start, idx):
    return _scatter_block(buf, _gather_rows(buf, start[:, None] + idx), start)


def program(scatter, compact):
    def step(bufs, rows, off, idx):
        return [compact(scatter(b, rows, off), off, idx) for b in bufs]

    return jax.jit(step, donate_argnums=0)


def main() -> None:
    rng = np.random.default_rng(0)
    bufs = [jnp.asarray(rng.standard_normal((B, K, S, H)), jnp.float32) for _ in range(L)]
    rows = jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.float32)
    off = jnp.asarray(rng.integers(0, S - T, B), jnp.int32)
    idx = jnp.asarray(np.sort(rng.integers(0, T, (B, 5)), axis=1), jnp.int32)
    fns = {"explicit index": program(old_scatter, old_compact), "vmapped": program(_scatter_block, new_compact)}
    outs = {k: [np.asarray(o) for o in f([b.copy() for b in bufs], rows, off, idx)] for k, f in fns.items()}
    a, b = outs.values()
    print("same cache:", all(np.array_equal(x, y) for x, y in zip(a, b, strict=True)))
    times: dict[str, list[float]] = {k: [] for k in fns}
    state = {k: [x.copy() for x in bufs] for k in fns}
    for _ in range(REPS):
        for k, f in fns.items():
            t0 = time.perf_counter()
            state[k] = jax.block_until_ready(f(state[k], rows, off, idx))
            times[k].append(time.perf_counter() - t0)
    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1):
        print(f"warning: load average {load:.1f} on {os.cpu_count()} cores: timings are noisy")
    for k, v in times.items():
        med = statistics.median(v)
        print(f"{k}: median {1e3 * med:.3f} ms  min {1e3 * min(v):.3f} ms  spread {(max(v) - min(v)) / med:.2f}")


if __name__ == "__main__":
    main()
