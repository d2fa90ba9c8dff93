"""Whole-launch speed of methods against ``ar`` on the bundled demo pair, per prompt set, interleaved.

    python eval/ab_auto.py stdlib_code,python_docs,synthetic_math ar,auto,dspark

Three prompts per set, 128 new tokens, batch 1, greedy; each launch is timed whole (prefill included, so the
ratios are not the eval's decode-only ones). After one warm-up of every (prompt, method), three repetitions
run every set and method in turn (A B C, A B C); each ratio is ar's median time over the method's
(and the same from the fastest runs), with the method's spread (max - min) / median. Used to
compare ``auto``'s branch structure across commits (run it at each).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import jax
import numpy as np

from sparkjax import demo
from sparkjax.engine import launch


def main(argv: list[str]) -> None:
    sets, methods = argv[0].split(","), argv[1].split(",")
    if "ar" not in methods:
        methods = ["ar", *methods]
    pair = demo.load()
    kw = dict(max_new_tokens=128, cache_size=1024, prompt_width=256, capacity=128)
    prompts = {s: [pair.encode_row(r) for r in demo.prompts(s)[:3]] for s in sets}

    def run(method, prompt):
        drafter = None if method == "ar" else pair.dspark
        return jax.block_until_ready(launch(pair.target, drafter, [prompt], method=method, **kw))

    for s in sets:
        for p in prompts[s]:
            for m in methods:
                run(m, p)
    times: dict[tuple[str, str], list[float]] = {(s, m): [] for s in sets for m in methods}
    for _ in range(3):
        for s in sets:
            for m in methods:
                t0 = time.perf_counter()
                for p in prompts[s]:
                    np.asarray(run(m, p)[1])
                times[(s, m)].append(time.perf_counter() - t0)
    load = os.getloadavg()[0]
    for s in sets:
        ar = statistics.median(times[(s, "ar")])
        best = min(times[(s, "ar")])
        cells = []
        for m in methods:
            t = times[(s, m)]
            spread = (max(t) - min(t)) / statistics.median(t)
            cells.append(f"{m} {ar / statistics.median(t):.2f}x (best {best / min(t):.2f}x, spread {spread:.0%})")
        print(s, "  ".join(cells), f"load {load:.1f}" + ("  WARNING: the machine is loaded" if load > 1.5 else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
