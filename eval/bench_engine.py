"""Engine benchmark: every method against ``ar``, side by side in one run, on this CPU.

    python eval/bench_engine.py [--pairs fixture,random] [--new 64] [--budgets 8,16,64] [--reps 3]

For each pair it prints, per method: tokens/s (median over ``--reps`` after a warm-up), the
speedup over ``ar`` measured in the same run, tau (mean committed tokens per round), and the
share of round time per stage from the instrumented mode (a separate, synced pass). It then
compares the fused on-device loop (one jitted ``while_loop``) with a Python loop over the same
jitted round that reads the ``done`` flags back every round, as upstream PyTorch does.

Pairs: ``fixture`` = the bundled tiny DSpark pair (trained: drafts get accepted);
``random`` = a random target (8 layers, d=512, vocab 8192) with a random 2-layer block-16
drafter: nothing is accepted, so it measures pure overhead per round.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import time

import jax
import numpy as np
from flax import nnx

from sparkjax import engine
from sparkjax.config import DrafterConfig, Qwen3Config
from sparkjax.engine import AR, TREE_METHODS, Chain, Tree, api, programs
from sparkjax.io.hf import load_drafter, load_target
from sparkjax.nn.drafter import Drafter
from sparkjax.nn.qwen3 import Qwen3

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_dspark_b16"


def fixture_pair():
    target = load_target(FIXTURE / "target")
    return target, load_drafter(FIXTURE / "drafter", target=target)


def random_pair():
    tcfg = Qwen3Config(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                       tie_word_embeddings=True)
    fields = {f.name: getattr(tcfg, f.name) for f in dataclasses.fields(Qwen3Config)}
    dcfg = DrafterConfig(**{**fields, "num_hidden_layers": 2, "tie_word_embeddings": False}, kind="dspark",
                         block_size=16, target_layer_ids=(1, 4, 6), mask_token_id=8191, num_target_layers=8,
                         markov_rank=64, markov_head_type="vanilla")
    return Qwen3(tcfg, rngs=nnx.Rngs(0)), Drafter(dcfg, rngs=nnx.Rngs(1))


def timed(fn, reps):
    fn()  # warm-up (compile)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def python_loop(target, drafter, prompts, method, max_new):
    """The same jitted round driven from Python, reading the done flags back every round."""
    run = api.validate(target, drafter, prompts, method=method, max_new_tokens=max_new)
    graphdefs, states = programs.split_pair(target, drafter)
    args = api._device_args(run.prompts, max_new, run.eos, run.temperature, run.seed)
    state = programs.spec_start(graphdefs, states, *args, plan=run.plan, cache_size=run.cache_size,
                                buf_len=run.buf_len)
    while not bool(np.asarray(state.done).all()):  # a host sync per round
        state = programs.spec_step(graphdefs, states, state, args[2], args[3], args[4], plan=run.plan)
    return np.asarray(state.out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", default="fixture,random")
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--budgets", default="8,16,64", help="tree budgets")
    ap.add_argument("--prompts", type=int, default=1, help="batch size")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} device(s); "
          f"batch {args.prompts}, {args.new} new tokens, greedy")
    for name in args.pairs.split(","):
        target, drafter = fixture_pair() if name == "fixture" else random_pair()
        bench_pair(name, target, drafter, args, budgets)


def bench_pair(name, target, drafter, args, budgets) -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, min(300, target.config.vocab_size), 24).tolist() for _ in range(args.prompts)]
    runs = [AR(), Chain("dflash"), Chain("dspark")] + [
        Tree(m, budget=b) for m in TREE_METHODS for b in budgets
    ]
    ref = engine.generate(target, None, prompts, max_new_tokens=args.new).tokens
    print(f"\n== pair: {name} (target {target.config.num_hidden_layers} layers d={target.config.hidden_size} "
          f"V={target.config.vocab_size}; drafter block {drafter.config.block_size}) ==")
    print(f"{'method':<22}{'budget':>7}{'tok/s':>9}{'speedup':>9}{'tau':>7}  exact  "
          "stage share (draft/tree/verify/commit)")
    t_ar = None
    for method in runs:
        def run(method=method):
            return engine.generate(target, drafter if method.speculative else None, prompts, method=method,
                                   max_new_tokens=args.new)
        out = run()
        dt = timed(run, args.reps)
        n_tok = sum(len(t) for t in out.tokens)
        t_ar = t_ar if method.speculative else dt
        tau = np.mean([a for lens in out.acceptance_lengths for a in lens])
        share = ""
        if method.speculative:
            inst = engine.generate(target, drafter, prompts, method=method, max_new_tokens=args.new,
                                   instrument=True)
            inst = engine.generate(target, drafter, prompts, method=method, max_new_tokens=args.new,
                                   instrument=True)  # second pass: compiled
            tot = sum(inst.stage_seconds.values())
            share = " / ".join(f"{100 * v / tot:4.1f}%" for v in inst.stage_seconds.values())
        print(f"{method.name:<22}{getattr(method, 'budget', '-')!s:>7}{n_tok / dt:9.1f}{t_ar / dt:8.2f}x{tau:7.2f}  "
              f"{str(out.tokens == ref):<5}  {share}")
    for method in (Chain("dspark"), Tree("sparklingtree", budget=budgets[0])):
        fused = timed(lambda method=method: engine.generate(
            target, drafter, prompts, method=method, max_new_tokens=args.new), args.reps)
        loop = timed(lambda method=method: python_loop(target, drafter, prompts, method, args.new), args.reps)
        print(f"on-device loop vs Python loop over the same round ({method.label}): {fused * 1e3:.1f} ms vs "
              f"{loop * 1e3:.1f} ms -> {loop / fused:.2f}x")

if __name__ == "__main__":
    main()
