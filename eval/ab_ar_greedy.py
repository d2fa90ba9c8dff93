"""A / B of the AR baseline at temperature 0: the old program (sampling branch computed and thrown away)
against the greedy-only one (``ar_program(..., sampling=False)``), same prompt and weights, interleaved.

    python eval/ab_ar_greedy.py      # demo pair, batch 1, 64 new tokens, 7 interleaved repetitions
"""

import os
import statistics
import time

import jax
import numpy as np
from flax import nnx

from sparkjax import demo
from sparkjax.engine import api, programs


def main() -> None:
    pair = demo.load(dtype="float32")
    target = pair.target
    prompt = pair.encode_row(demo.prompts(demo.PROMPT_SETS[0])[0])
    run = api.validate(target, None, [prompt], max_new_tokens=64)
    gdef, state = nnx.split(target)
    args = run.device_args()

    def call(sampling: bool):
        res = programs.ar_program(gdef, state, *args, buf_len=run.buf_len, cache_size=run.cache_size,
                                  sampling=sampling)
        return jax.block_until_ready(res)

    old, new = call(True), call(False)  # compile both; the same tokens
    assert np.array_equal(np.asarray(old[0]), np.asarray(new[0]))
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(7):
        for sampling in (True, False):
            t0 = time.perf_counter()
            call(sampling)
            times[sampling].append(time.perf_counter() - t0)
    for sampling, name in ((True, "old (sampling branch at T=0)"), (False, "new (greedy only)")):
        v = times[sampling]
        print(f"{name}: median {statistics.median(v) * 1e3:.1f} ms, min {min(v) * 1e3:.1f} ms, "
              f"spread {(max(v) - min(v)) / statistics.median(v):.2f}")
    print(f"speedup: median {statistics.median(times[True]) / statistics.median(times[False]):.2f}x, "
          f"min {min(times[True]) / min(times[False]):.2f}x")
    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1):
        print(f"warning: load average {load:.1f} is above the {os.cpu_count()} cores: timings are noisy")


if __name__ == "__main__":
    main()
