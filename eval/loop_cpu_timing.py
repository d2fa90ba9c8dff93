"""The CPU cost of the GPU loop options: ar and sparklingtree@16 on the demo pair, run through the
program as a plain jax.jit, as the engine runs it now (programs.Program: on a CPU the plain
jax.jit, no compiler options) and with the GPU loop options forced onto XLA:CPU; interleaved repetitions in one
process (sparkjax.bench.timing), after checking that the three optimised XLA:CPU programs are the same text.

    python eval/loop_cpu_timing.py [REPS] [NEW_TOKENS]     # eval/results/loop_cpu_timing.txt: 41 128
"""
import sys

import jax

import sparkjax
from sparkjax.bench.timing import interleave, load_warning
from sparkjax.engine import programs

reps = int(sys.argv[1]) if len(sys.argv) > 1 else 9
pair = sparkjax.demo.load()
prompts = [pair.encode_chat(q) for q in ("What is Python?", "Natalia sold clips to 48 of her friends in April, and "
                                         "then she sold half as many clips in May. How many clips did she sell?")]
NEW = int(sys.argv[2]) if len(sys.argv) > 2 else 64
gpu_opts = programs.loop_compiler_options(sparkjax.Options(), backend="gpu")
names = {"ar": "spec_program", "sparklingtree@16": "spec_program"}  # ar is a method like the others
orig = {n: getattr(programs, n) for n in names.values()}
variants_of = {n: {"plain jax.jit": jax.jit(p.__wrapped__, **p._jit_kwargs),
                   "after (Program, CPU: no options)": p,
                   "GPU loop options on XLA:CPU": p.jitted(gpu_opts)} for n, p in orig.items()}
print(f"# python eval/loop_cpu_timing.py {reps} {NEW}: jax {jax.__version__}, backend {jax.default_backend()}, "
      f"{len(prompts)} prompts x {NEW} new tokens, greedy, no EOS, batch {len(prompts)}, "
      f"{reps} interleaved repetitions; GPU options: {gpu_opts}")


def run(method, prog_name, prog):
    def call():
        setattr(programs, prog_name, prog)
        try:
            return sparkjax.generate(pair.target, pair.dspark, prompts, method=method, max_new_tokens=NEW).tokens
        finally:
            setattr(programs, prog_name, orig[prog_name])
    return call


seen = {}


def recording(method, prog):
    def call(*args, **kwargs):
        seen.setdefault(method, (args, kwargs))
        return prog(*args, **kwargs)
    return call


for method, prog_name in names.items():  # the CPU programs of the three variants, from the same arguments
    run(method, prog_name, recording(method, orig[prog_name]))()
    args, kwargs = seen[method]
    texts = {v: p.lower(*args, **kwargs).compile().as_text() for v, p in variants_of[prog_name].items()}
    body = {v: t[t.index("\n"):] for v, t in texts.items()}  # the HloModule line names the module
    print(f"# {method}: optimised XLA:CPU HLO identical in all three variants: {len(set(body.values())) == 1} "
          f"({len(next(iter(body.values())))} characters)")

rows, tokens = [], {}
for method, prog_name in names.items():
    variants = {v: run(method, prog_name, p) for v, p in variants_of[prog_name].items()}
    toks = {v: fn() for v, fn in variants.items()}  # warm-up: compile each
    assert len({str(t) for t in toks.values()}) == 1, "the variants' tokens differ"
    tokens[method] = next(iter(toks.values()))
    n_tok = sum(len(t) for t in tokens[method])
    stats = interleave(variants, reps)
    base = stats["plain jax.jit"].median
    for v, st in stats.items():
        rows.append((method, v, st, n_tok, st.median / base))
assert tokens["sparklingtree@16"] == tokens["ar"], "sparklingtree@16's greedy tokens differ from ar's"
print(f"# every variant gave the same tokens, and sparklingtree@16's equal ar's ({len(tokens['ar'][0])} per prompt)")
print(f"{'method':18} {'variant':34} {'median s':>9} {'min s':>8} {'spread':>7} {'tok/s':>7} {'/ before':>8}")
for method, v, st, n_tok, ratio in rows:
    print(f"{method:18} {v:34} {st.median:9.3f} {st.min:8.3f} {st.spread:7.1%} {n_tok / st.median:7.1f} {ratio:8.3f}")
w = load_warning()
if w:
    print("# " + w)
