"""Where a speculative round's time goes on the bundled demo pair: each stage timed as its own jitted call.

    python eval/profile_round_stages.py [--methods dspark,sparklingtree@16] [--batch 1] [--reps 40]

Starts a generation of the first prompt of each bundled set (cycled to ``--batch``), runs three rounds, then
times each stage of the next round (draft, tree, verify, accept + commit: :mod:`sparkjax.engine.round`) on
that same state ``--reps`` times, and the target's own one-token decode step (what an ``ar`` step computes)
the same way. Prints the median and fastest time per stage in ms. Each call pays its dispatch (about 0.3-0.4 ms
here), which the fused loop does not, so the stages add up to more than the eval's round time; the ratio
verify / one-token step is the point.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from sparkjax import demo
from sparkjax.engine import api
from sparkjax.engine import round as rnd
from sparkjax.engine.programs import spec_start, stage_call


def _time(fn, reps: int) -> tuple[float, float]:
    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, min(times) * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="dspark,sparklingtree@16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=40)
    a = p.parse_args(argv)
    pair = demo.load()
    pool = [pair.encode_row(demo.prompts(s)[0]) for s in demo.PROMPT_SETS]
    rows = [pool[i % len(pool)] for i in range(a.batch)]
    kw = dict(max_new_tokens=128, cache_size=512, prompt_width=256, capacity=128)
    print(f"demo pair, batch {a.batch}, {a.reps} repetitions per stage; ms median (fastest)")
    for name in a.methods.split(","):
        cells = [f"{k} {med:.2f} ({best:.2f})" for k, (med, best) in _profile(pair, rows, name, kw, a.reps).items()]
        print(f"{name}: " + ", ".join(cells))


def _profile(pair, rows, name: str, kw: dict, reps: int) -> dict[str, tuple[float, float]]:
    run = api.validate(pair.target, pair.dspark, rows, method=name, **kw)
    graphdefs, states = run.split(pair.target, pair.dspark)
    args, plan = run.device_args(), run.plan

    def call(fn, *stage_args, plan):
        return stage_call(graphdefs, states, stage_args, fn=fn, plan=plan)

    state = spec_start(graphdefs, states, *args, plan=plan, cache_size=run.cache_size, buf_len=run.buf_len)
    for _ in range(3):
        state = rnd.spec_round(pair.target, pair.dspark, state, plan, args.max_new, args.eos, args.temperature,
                               call=call)
    key = state.key
    blk = call(rnd.draft, state, plan=plan)
    prop = call(rnd.expand, state, blk, args.temperature, key, plan=plan)
    ver = call(rnd.verify, state, prop, plan=plan)
    gdef, tstate = nnx.split(pair.target)

    @jax.jit
    def one_token(tstate, tokens, cache):
        model = nnx.merge(gdef, tstate)
        out = model(tokens[:, None], cache.lengths[:, None], cache=cache)
        return jnp.argmax(out.logits[:, 0], -1), out.cache.with_lengths(cache.lengths + 1)

    stages = {
        "draft": lambda: call(rnd.draft, state, plan=plan),
        "tree": lambda: call(rnd.expand, state, blk, args.temperature, key, plan=plan),
        "verify": lambda: call(rnd.verify, state, prop, plan=plan),
        "accept + commit": lambda: call(rnd.accept_and_commit, state, prop, ver, args.max_new, args.eos,
                                        args.temperature, key, plan=plan),
        "target one-token step": lambda: one_token(tstate, state.x_start, state.cache),
    }
    return {k: _time(f, reps) for k, f in stages.items()}

if __name__ == "__main__":
    main()
