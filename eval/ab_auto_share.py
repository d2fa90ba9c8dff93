"""``auto`` at several ``viable_share`` values against ``ar``, per batch size, on the bundled demo pair.

    python eval/ab_auto_share.py [--batches 1,4,16] [--shares 1,0.5] [--new 64] [--reps 3]

Batch size B holds the first prompt of each bundled set in turn (docs, stdlib, math, docs, ...), greedy,
``--new`` new tokens. Each side's decode time is a whole launch minus a prefill-only launch (``max_new_tokens=1``);
after one warm-up of each, ``--reps`` interleaved repetitions (ar, share 1, share 0.5, ar, ...). Prints each
side's median and fastest decode time, its spread (max - min) / median, ar's median over its median, and
whether its tokens equal ar's. Run batch 64 in its own invocation (``--batches 64``): one process compiling
every program of every batch size runs out of code memory for XLA:CPU here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax

from sparkjax import demo
from sparkjax.engine import Auto, generate, launch


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--shares", default="1,0.5")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args(argv)
    pair = demo.load()
    pool = [pair.encode_row(demo.prompts(s)[0]) for s in demo.PROMPT_SETS]
    methods = {"ar": "ar", **{f"share {s}": Auto(viable_share=float(s)) for s in a.shares.split(",")}}
    load = os.getloadavg()[0]
    print(f"demo pair, {a.new} new tokens, greedy, {a.reps} interleaved repetitions; load average {load:.2f}")
    for b in (int(x) for x in a.batches.split(",")):
        prompts = [pool[i % len(pool)] for i in range(b)]

        def decode(m, prompts=prompts) -> float:
            drafter = None if m == "ar" else pair.dspark
            times = []
            for n in (a.new, 1):
                t0 = time.perf_counter()
                jax.block_until_ready(launch(pair.target, drafter, prompts, method=m, max_new_tokens=n))
                times.append(time.perf_counter() - t0)
            return times[0] - times[1]

        for m in methods.values():
            decode(m)  # warm-up (compile, profile the cost table)
        times: dict[str, list[float]] = {k: [] for k in methods}
        for _ in range(a.reps):
            for k, m in methods.items():
                times[k].append(decode(m))
        ref = generate(pair.target, None, prompts, max_new_tokens=a.new).tokens
        ar_med = statistics.median(times["ar"])
        for k, m in methods.items():
            out = ref if k == "ar" else generate(pair.target, pair.dspark, prompts, method=m, max_new_tokens=a.new)
            same = k == "ar" or out.tokens == ref
            med, best = statistics.median(times[k]), min(times[k])
            print(f"batch {b:>3} {k:>10}: decode {med * 1e3:8.1f} ms (best {best * 1e3:8.1f}, spread "
                  f"{(max(times[k]) - best) / med:.0%}); ar / this {ar_med / med:.3f}x; same tokens as ar: {same}")
    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1):
        print(f"warning: load average {load:.2f} is above the {os.cpu_count()} cores: ratios are noisy")


if __name__ == "__main__":
    main()
