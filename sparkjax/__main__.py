"""``python -m sparkjax``: a quick demonstration on the bundled tiny pair.

Loads the bundled fixture target (and drafter, when a speculative method is
asked for), generates greedily from a few fixed prompts with each method, checks
that every method emits exactly the target's own greedy tokens, and prints the
acceptance length and wall time of each.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np

from . import decode
from .convert import load_target
from .errors import SparkjaxError

BUNDLED = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tiny_dspark_b16"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparkjax", description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(BUNDLED / "target"), help="Hugging Face Qwen3 folder")
    ap.add_argument("--drafter", default=str(BUNDLED / "drafter"), help="DeepSpec DSpark or z-lab DFlash folder")
    ap.add_argument("--methods", default=",".join(decode.available_methods()),
                    help="comma-separated methods (first one must be ar, the reference)")
    ap.add_argument("--budget", type=int, default=16, help="tree size for tree methods")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--batch", type=int, default=3, help="number of prompts")
    args = ap.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        target = load_target(args.target)
        drafter = None
        if any(m != "ar" for m in methods):
            from .convert import load_drafter

            drafter = load_drafter(args.drafter, target=target)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, 300, n).tolist() for n in (24, 17, 30, 9, 12)[: args.batch]]
        reference = None
        print(f"target {args.target}; {len(prompts)} prompts; {args.max_new_tokens} new tokens; greedy")
        for method in methods:
            kw = {"budget": args.budget} if method in decode.TREE_METHODS else {}
            decode.generate(target, drafter, prompts, method=method, max_new_tokens=args.max_new_tokens, **kw)
            t0 = time.perf_counter()
            out = decode.generate(target, drafter, prompts, method=method, max_new_tokens=args.max_new_tokens, **kw)
            dt = time.perf_counter() - t0
            reference = out.tokens if reference is None else reference
            acc = [a for row in out.acceptance_lengths for a in row]
            tau = sum(acc) / max(len(acc), 1)
            n_tok = sum(len(t) for t in out.tokens)
            print(f"  {method:<20} tau {tau:5.2f}  {n_tok / dt:8.1f} tok/s  "
                  f"same tokens as {methods[0]}: {out.tokens == reference}")
        print("first continuation:", reference[0][:24], "...")
    except SparkjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
