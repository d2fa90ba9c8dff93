"""``python -m sparkjax``: a quick demonstration on the bundled demo pair.

Generates greedily with each method from one prompt of each bundled prompt set, checks that every method emits
exactly the target's own greedy tokens, and prints the acceptance length, the wall time and the first
continuation. ``--target`` / ``--drafter`` run another pair on random token prompts instead.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from . import _startup, demo, engine
from .cli import run_cli
from .errors import SparkjaxError
from .io.hf import load_drafter, load_target
from .text import quiet_transformers

EXPLANATION = (
    "note: on a CPU with this tiny target, the drafter and the tree cost as much as the target itself, so the "
    "speculative methods' tok/s is below ar's here (speed-ups need a large target, on a GPU); what this demo shows "
    "is exactness (the same tokens as ar) and tau, the tokens committed per target call."
)
EXPLANATION_OTHER = ("tau = tokens committed per target call; with random prompts and a small target on a CPU, "
                     "tok/s says little about speed-ups on real models")


def main(argv: list[str] | None = None) -> int:
    _startup.check()
    ap = argparse.ArgumentParser(prog="python -m sparkjax", description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="Hugging Face Qwen3 folder (default: the bundled demo target)")
    ap.add_argument("--drafter", help="DeepSpec DSpark or z-lab DFlash folder (default: the demo drafters)")
    ap.add_argument("--methods", default=",".join(engine.METHODS),
                    help="comma-separated methods (first one must be ar, the reference)")
    ap.add_argument("--budget", type=int, default=16, help="tree size for tree methods")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_args(argv)
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    def run() -> None:
        methods = [engine.parse_method(m, budget=args.budget if m in engine.TREE_METHODS else None) for m in names]
        tok = None
        if args.target is None:
            if args.drafter is not None:
                raise SparkjaxError("--drafter: given without --target (the demo drafters fit only the demo target)")
            with quiet_transformers():  # no "PyTorch was not found" advisory: only the tokenizer is used
                pair = demo.load()
            target, drafters, tok = pair.target, {"main": pair.dspark, "baseline": pair.dflash}, pair.tokenizer
            prompts = [pair.encode_row(demo.prompts(name)[0]) for name in demo.PROMPT_SETS]
            eos = pair.eos_token_ids
            print(f"bundled demo pair ({demo.DEMO_DIR}); one prompt per set; {args.max_new_tokens} new tokens; greedy")
        else:
            target = load_target(args.target)
            drafter = load_drafter(args.drafter, target=target) if any(m.speculative for m in methods) else None
            drafters = {"main": drafter, "baseline": drafter}
            rng = np.random.default_rng(0)
            prompts = [rng.integers(0, target.config.vocab_size, n).tolist() for n in (24, 17, 30)]
            eos = None
            print(f"target {args.target}; {len(prompts)} random prompts; {args.max_new_tokens} new tokens; greedy")
        print(EXPLANATION if args.target is None else EXPLANATION_OTHER)
        reference = None
        for method in methods:
            # dflash and ddtree (no Markov head) run with the baseline drafter when there is one
            drafter = drafters["baseline" if method.speculative and not method.needs_markov else "main"]
            run = dict(method=method, max_new_tokens=args.max_new_tokens, eos_token_ids=eos)
            label = method.label
            print(f"  compiling {label} ...", end="", flush=True)
            t0 = time.perf_counter()
            engine.generate(target, drafter, prompts, **run)  # compile (and run once)
            print(f" {time.perf_counter() - t0:.1f} s", flush=True)
            t0 = time.perf_counter()
            out = engine.generate(target, drafter, prompts, **run)
            dt = time.perf_counter() - t0
            reference = out.tokens if reference is None else reference
            acc = [a for row in out.acceptance_lengths for a in row]
            tau = sum(acc) / max(len(acc), 1)
            n_tok = sum(len(t) for t in out.tokens)
            print(f"  {label:<20} tau {tau:5.2f}  {n_tok / dt:8.1f} tok/s  "
                  f"same tokens as {methods[0].label}: {out.tokens == reference}")
        if tok is not None:
            print("first prompt + continuation:\n" + tok.decode(prompts[0] + reference[0]))
        else:
            print("first continuation:", reference[0][:24], "...")

    return run_cli(run)


if __name__ == "__main__":
    sys.exit(main())
