"""What ``auto``'s plain step costs against the target's own decode step, on the bundled demo pair.

    python eval/ab_plain_step.py [--batches 1,16] [--new 128] [--reps 5]

``auto`` with a cost table under which no drafted size can ever pay runs plain target steps only (no draft,
no probe): the same tokens as ``ar``, plus what a plain step adds (the drafter-context update, the choice
bookkeeping). Both run whole launches of the same prompts (the first of each bundled set, cycled to the batch
size), greedy, one warm-up each, then ``--reps`` interleaved repetitions (ar, auto, ar, auto, ...). Prints, per
batch size, each side's median and fastest time and spread (max - min) / median, and auto's time over ar's
(median and fastest). Run it at two commits to compare plain-step implementations.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax

from sparkjax import demo
from sparkjax.engine import Auto, CostTable, generate, launch


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,16")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args(argv)
    pair = demo.load()
    rows = [pair.encode_row(demo.prompts(s)[0]) for s in demo.PROMPT_SETS]
    sizes = (0, "chain", 16)
    labels = Auto(sizes=sizes).resolve(pair.dspark).labels()
    # drafted rounds priced far above depth + 1 plain steps: never viable, so never chosen nor probed
    table = CostTable(labels, tuple(1.0 if i == 0 else 1e6 for i in range(len(labels))))
    method = Auto(sizes=sizes, table=table)
    kw = dict(max_new_tokens=a.new, cache_size=512, prompt_width=256, capacity=a.new)
    load = os.getloadavg()[0]
    print(f"demo pair, {a.new} new tokens, greedy, {a.reps} interleaved repetitions; load average {load:.2f}")
    if load > (os.cpu_count() or 1):
        print("warning: the machine is loaded (load average above the CPU count): ratios are noisy")
    for b in (int(x) for x in a.batches.split(",")):
        prompts = [rows[i % len(rows)] for i in range(b)]

        def run(m, prompts=prompts):
            drafter = None if m == "ar" else pair.dspark
            t0 = time.perf_counter()
            out = jax.block_until_ready(launch(pair.target, drafter, prompts, method=m, **kw))
            return time.perf_counter() - t0, out

        run("ar"), run(method)  # warm-up (compile)
        same = (generate(pair.target, None, prompts, **kw).tokens
                == generate(pair.target, pair.dspark, prompts, method=method, **kw).tokens)
        times: dict[str, list[float]] = {"ar": [], "auto": []}
        for _ in range(a.reps):
            for name, m in (("ar", "ar"), ("auto", method)):
                times[name].append(run(m)[0])
        med = {k: statistics.median(v) for k, v in times.items()}
        best = {k: min(v) for k, v in times.items()}
        spread = {k: (max(v) - min(v)) / med[k] for k, v in times.items()}
        print(f"batch {b:3d}: ar {med['ar'] * 1e3:7.1f} ms (best {best['ar'] * 1e3:.1f}, spread {spread['ar']:.0%}), "
              f"auto plain-only {med['auto'] * 1e3:7.1f} ms (best {best['auto'] * 1e3:.1f}, spread "
              f"{spread['auto']:.0%}); auto / ar {med['auto'] / med['ar']:.3f} (best {best['auto'] / best['ar']:.3f})"
              f"; same tokens: {same}")


if __name__ == "__main__":
    main()
