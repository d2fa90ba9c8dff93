"""Where `auto`'s time goes when no draft pays: `ar` against `auto` and two reduced `auto`s on the demo pair.

    python eval/ab_auto_overhead.py [SET] [NEW_TOKENS]        (default: python_docs 64)

Variants, each a whole `launch` of one prompt at batch 1, greedy, the first 4 prompts of SET:
  ar            the plain one-token step;
  auto          the default candidates (plain step, chain, trees 8..64): a drafter prefill, context tracking,
                one probe draft per request (then probes at a growing gap);
  auto (0)      `Auto(sizes=(0,))`: plain steps only, in `auto`'s bursts: no drafter, no context, no probe;
  auto (0,chain) the plain step and the chain only.
Each request's memory is carried from the previous repetition of the same prompt (as the eval does). Decode time
= median full launch - median one-token launch, per prompt, summed; repetitions interleaved across variants.
Prints each variant's decode time and ar's decode time over it.
"""

import statistics
import sys
import time

import jax

from sparkjax import demo
from sparkjax.engine import api
from sparkjax.engine.adaptive import Auto

REPEATS = 7
pair = demo.load()
setname = sys.argv[1] if len(sys.argv) > 1 else "python_docs"
new = int(sys.argv[2]) if len(sys.argv) > 2 else 64
prompts = [pair.encode_row(r) for r in demo.prompts(setname)[:4]]
variants = {"ar": "ar", "auto": Auto(), "auto (0)": Auto(sizes=(0,)), "auto (0,chain)": Auto(sizes=(0, "chain"))}
memory = {}


def run(name, p, max_new):
    kw = dict(method=variants[name], max_new_tokens=max_new, eos_token_ids=pair.eos_token_ids, cache_size=512,
              prompt_width=256, capacity=64)
    if name != "ar":
        kw["auto_memory"] = memory.get((name, p))
    t0 = time.perf_counter()
    res = api.launch(pair.target, None if name == "ar" else pair.dspark, [prompts[p]], **kw)
    jax.block_until_ready(res.out)
    dt = time.perf_counter() - t0
    if max_new > 1 and name != "ar" and getattr(res.extra, "memory", None) is not None:
        memory[(name, p)] = res.extra.memory
    return dt


for name in variants:  # compile and warm every program
    for p in range(len(prompts)):
        run(name, p, new), run(name, p, 1), run(name, p, new)
full = {n: [[] for _ in prompts] for n in variants}
one = {n: [[] for _ in prompts] for n in variants}
for _ in range(REPEATS):
    for name in variants:
        for p in range(len(prompts)):
            full[name][p].append(run(name, p, new))
            one[name][p].append(run(name, p, 1))
base = None
print(f"{setname}, {len(prompts)} prompts, {new} new tokens, {REPEATS} interleaved repetitions")
for name in variants:
    decode = sum(statistics.median(f) - statistics.median(o) for f, o in zip(full[name], one[name], strict=True))
    base = base or decode
    print(f"{name:16s} decode {1e3 * decode:8.2f} ms  ar / this {base / decode:.3f}")
