"""Where a batched greedy decode step's time goes: attention variants of the same AR loop, side by side.

    python eval/profile_ar_step.py [--batch 64] [--variants blocked:128,blocked:64,einsum,prefix,off] [--reps 3]

The random Qwen3 of ``eval/bench_ar.py`` (8 layers, d=512, 8/4 heads of 64, FFN 1536, vocab 8192, tied,
float32), prompt 32. A step's time is the difference of a 160- and a 32-token ``generate`` over 128 steps
(the cache bucket is 256 slots), fastest of ``--reps``; the variants are interleaved (each switch clears
jax's caches and warms the program up again, so compilation is never timed). ``blocked:N`` is the CPU default
(:func:`sparkjax.nn.layers.attend`, chunks of N slots), ``einsum`` and ``prefix`` the other paths, ``off``
replaces attention by its queries (wrong tokens; the rest of the step alone, cache writes included).
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np
from flax import nnx

import sparkjax.nn.qwen3 as qwen3
from sparkjax.config import Qwen3Config
from sparkjax.engine import generate
from sparkjax.nn import layers

ATTEND = qwen3.attend


def _use(variant: str) -> None:
    jax.clear_caches()
    qwen3.attend = (lambda q, parts, impl=None: q) if variant == "off" else ATTEND
    impl, _, slots = variant.partition(":")
    layers.ATTENTION_IMPL = "auto" if impl in ("off", "blocked") else impl
    layers.BLOCK_SLOTS = int(slots) if slots else 128


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--variants", default="blocked:128,blocked:64,einsum,prefix,off")
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args(argv)
    cfg = Qwen3Config(8192, 512, 1536, 8, 8, 4, 64, max_position_embeddings=4096, tie_word_embeddings=True)
    model = qwen3.Qwen3(cfg, rngs=nnx.Rngs(0))
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (a.batch, 32)).tolist()
    variants = a.variants.split(",")
    times = {v: {32: [], 160: []} for v in variants}
    for _ in range(a.reps):
        for v in variants:
            _use(v)
            for n in (32, 160):
                generate(model, None, prompts, max_new_tokens=n)  # compile and warm up
            for n in (32, 160):
                t0 = time.perf_counter()
                generate(model, None, prompts, max_new_tokens=n)
                times[v][n].append(time.perf_counter() - t0)
    _use("blocked:128")
    print(f"batch {a.batch}, prompt 32, 128 timed steps, fastest of {a.reps} interleaved repetitions; "
          f"load average {os.getloadavg()[0]:.2f}")
    for v in variants:
        step = (min(times[v][160]) - min(times[v][32])) / 128
        print(f"{v:>12}: {step * 1e3:7.2f} ms per step ({a.batch / step:8.1f} tok/s)")


if __name__ == "__main__":
    main()
