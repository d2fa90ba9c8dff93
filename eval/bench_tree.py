"""Benchmark of the on-device tree builders (:mod:`sparkjax.tree`) against the NumPy references.

Two parts:

1. **Timing** on this machine, medians after a warm-up (``block_until_ready``), inputs already on device:
   the whole jitted build (candidates + Markov tables (fast / exact) + best-first or beam + visibility,
   and on-device DDTree), next to the NumPy reference pipelines (DDTree heap + ancestor mask, naive
   SparklingTree heap that runs the full-vocabulary Markov head at every pop + ancestor mask).
2. **Agreement**: how often best-first over exact / fast Markov tables gives the same tree (the same set
   of root-to-node token paths) as the naive SparklingTree reference, on the fixture's 41 rounds of real
   DSpark base logits with the fixture drafter's Markov head, and on random Markov heads.

Examples::

    python eval/bench_tree.py                       # full run (~10 minutes on 2 cores)
    python eval/bench_tree.py --quick               # small vocabulary and budgets only
    python eval/bench_tree.py --vocab 4096 --budgets 64 --skip-agreement
    python eval/bench_tree.py --out eval/results/tree_bench.txt
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import load_file

from sparkjax import reference as ref
from sparkjax import tree

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tiny_dspark_b16"


class Tee:
    """Print to stdout and, optionally, to a file."""

    def __init__(self, path: str | None) -> None:
        self.file = open(path, "w") if path else None

    def __call__(self, *parts: object) -> None:
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        if self.file:
            self.file.write(line + "\n")
            self.file.flush()


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ----------------------------------------------------------------------------------------------------------
# timing


def time_it(fn: Callable[[], object], reps: int, max_seconds: float, block: bool) -> float:
    """Median seconds of ``reps`` calls (fewer if ``max_seconds`` runs out, at least 1); no warm-up here."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < reps and (not times or time.perf_counter() - start < max_seconds):
        t0 = time.perf_counter()
        out = fn()
        if block:
            jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def device_builders(depth: int, top_c: int, budget: int) -> dict[str, Callable]:
    """The jitted on-device builds, each returning the tree and its visibility mask."""

    def sparkling(normalization: str, beam: bool) -> Callable:
        widths = tree.even_widths(budget, depth) if beam else None

        def build(base, x_start, w1, w2):
            t = tree.build_sparkling_tree(
                base, x_start, w1, w2, budget=budget, top_c=top_c, normalization=normalization, widths=widths
            )
            return t, tree.visibility(t.parents, max_depth=depth)

        return jax.jit(build)

    def ddtree(base, x_start, w1, w2):
        t = tree.build_ddtree(base, budget)
        return t, tree.visibility(t.parents, max_depth=depth)

    return {
        "ddtree": jax.jit(ddtree),
        "bf-fast": sparkling("fast", beam=False),
        "bf-exact": sparkling("exact", beam=False),
        "beam-fast": sparkling("fast", beam=True),
        "beam-exact": sparkling("exact", beam=True),
    }


def random_inputs(rng: np.random.Generator, depth: int, vocab: int, rank: int, bias_std: float = 1.0):
    """Base logits N(0, 2^2), W1 ~ N(0, 1), W2 ~ N(0, bias_std^2 / R): Markov bias of std ~bias_std."""
    base = (rng.normal(size=(depth, vocab)) * 2.0).astype(np.float32)
    w1 = rng.normal(size=(vocab, rank)).astype(np.float32)
    w2 = (rng.normal(size=(vocab, rank)) * (bias_std / np.sqrt(rank))).astype(np.float32)
    x_start = int(rng.integers(vocab))
    return base, x_start, w1, w2


def ref_heap_pipeline(base: np.ndarray, budget: int) -> np.ndarray:
    """DDTree reference: heap tree + brute-force ancestor mask."""
    return ref.ancestor_mask(ref.ddtree_heap(base, budget).parents)


def ref_naive_pipeline(
    base: np.ndarray, x_start: int, w1: np.ndarray, w2: np.ndarray, budget: int, top_c: int
) -> np.ndarray:
    """Naive SparklingTree reference (restricted to the base top-C) + brute-force ancestor mask."""
    t = ref.naive_sparkling_tree(base, x_start, lambda _d, p: w1[p], w2, budget, top_c=top_c)
    return ref.ancestor_mask(t.parents)


def run_timing(args: argparse.Namespace, out: Tee) -> None:
    d, c, r = args.depth, args.top_c, args.rank
    out(f"## Timing: D={d}, C={c}, R={r}; medians in ms (device: up to {args.reps} reps after warm-up)")
    header = (
        f"{'V':>7} {'M':>4} | {'dev ddtree':>10} {'bf-fast':>9} {'bf-exact':>9} {'beam-fast':>9} "
        f"{'beam-exact':>10} | {'ref heap':>9} {'ref naive':>10} | {'naive/bf-fast':>13} "
        f"{'naive/bf-exact':>14} {'naive/beam-fast':>15} {'heap/dev':>8} | {'compile s':>9}"
    )
    out(header)
    out("-" * len(header))
    rng = np.random.default_rng(args.seed)
    for vocab in args.vocab:
        base, x_start, w1, w2 = random_inputs(rng, d, vocab, r)
        dev_args = jax.device_put((base, np.int32(x_start), w1, w2))
        ref_reps = args.ref_reps if vocab <= 16384 else max(1, min(args.ref_reps, 2))
        for budget in args.budgets:
            dev: dict[str, float] = {}
            compile_s = 0.0
            for name, fn in device_builders(d, c, budget).items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*dev_args))  # compile + first run
                compile_s += time.perf_counter() - t0
                dev[name] = time_it(functools.partial(fn, *dev_args), args.reps, args.max_seconds, block=True)
            heap = functools.partial(ref_heap_pipeline, base, budget)
            naive = functools.partial(ref_naive_pipeline, base, x_start, w1, w2, budget, c)
            ref_heap = time_it(heap, ref_reps, args.max_seconds, block=False)
            ref_naive = time_it(naive, ref_reps, args.max_seconds, block=False)
            ms = {k: v * 1e3 for k, v in dev.items()}
            out(
                f"{vocab:>7} {budget:>4} | {ms['ddtree']:>10.2f} {ms['bf-fast']:>9.2f} "
                f"{ms['bf-exact']:>9.2f} {ms['beam-fast']:>9.2f} {ms['beam-exact']:>10.2f} | "
                f"{ref_heap * 1e3:>9.2f} {ref_naive * 1e3:>10.2f} | "
                f"{ref_naive / dev['bf-fast']:>12.1f}x {ref_naive / dev['bf-exact']:>13.1f}x "
                f"{ref_naive / dev['beam-fast']:>14.1f}x {ref_heap / dev['ddtree']:>7.1f}x | "
                f"{compile_s:>9.1f}"
            )
    out(
        "dev ddtree = candidates(top-min(M,V)) + DDTree tables + best_first + visibility; "
        "bf-* = candidates(C) + markov_tables(fast|exact) + best_first + visibility; "
        "beam-* = the same with beam(even_widths(M, D)); ref heap = reference.ddtree_heap + ancestor_mask; "
        "ref naive = reference.naive_sparkling_tree (restricted to the base top-C, the same problem as "
        f"bf-exact) + ancestor_mask; ref reps <= {args.ref_reps} (<= 2 at V > 16384); "
        "compile s = all five device builds."
    )


# ----------------------------------------------------------------------------------------------------------
# agreement


def prefix_set(t, n: int | None = None) -> dict[tuple[int, ...], float]:
    """{root-to-node token path: score} of the valid nodes."""
    tokens, parents, scores, valid = (np.asarray(x) for x in (t.tokens, t.parents, t.scores, t.valid))
    paths: list[tuple[int, ...]] = [()]
    out: dict[tuple[int, ...], float] = {}
    for i in range(len(tokens) if n is None else n):
        paths.append(paths[int(parents[i])] + (int(tokens[i]),))
        if valid[i]:
            out[paths[-1]] = float(scores[i])
    return out


def same_up_to_ties(a: dict, b: dict, rel: float = 1e-5) -> bool:
    """Same prefix set, or a different one only by swaps within ``rel`` of the other tree's worst score."""
    if len(a) != len(b):
        return False
    for mine, other in ((a, b), (b, a)):
        worst = min(other.values(), default=np.inf)
        if any(mine[p] > worst + rel * (1 + abs(worst)) for p in mine.keys() - other.keys()):
            return False
    return True


def batched_builders(depth: int, top_c: int, budget: int) -> dict[str, Callable]:
    def one(normalization: str) -> Callable:
        def build(base, x_start, w1, w2):
            return tree.build_sparkling_tree(
                base, x_start, w1, w2, budget=budget, top_c=top_c, normalization=normalization
            )

        return jax.jit(jax.vmap(build, in_axes=(0, 0, None, None)))

    def ddtree(base, x_start, w1, w2):
        return tree.build_ddtree(base, budget)

    return {
        "exact": one("exact"),
        "fast": one("fast"),
        "ddtree": jax.jit(jax.vmap(ddtree, in_axes=(0, 0, None, None))),
    }


def agreement(
    base: np.ndarray, x_start: np.ndarray, w1: np.ndarray, w2: np.ndarray, budget: int, top_c: int
) -> dict[str, tuple[int, int, int, float]]:
    """Per method and reference: (same trees, same up to near-ties, rounds, summed node overlap fraction)."""
    n, depth, _ = base.shape
    trees = {
        k: jax.device_get(f(base, x_start, w1, w2)) for k, f in batched_builders(depth, top_c, budget).items()
    }
    counts: dict[str, list[float]] = {}
    for i in range(n):
        refs = {
            "naive-C": ref.naive_sparkling_tree(
                base[i], int(x_start[i]), lambda _d, p: w1[p], w2, budget, top_c=top_c
            ),
            "naive-V": ref.naive_sparkling_tree(base[i], int(x_start[i]), lambda _d, p: w1[p], w2, budget),
        }
        ref_sets = {k: prefix_set(v) for k, v in refs.items()}
        for method, t in trees.items():
            mine = prefix_set(jax.tree.map(lambda x, i=i: x[i], t))
            for ref_name, want in ref_sets.items():
                row = counts.setdefault(f"{method} vs {ref_name}", [0, 0, 0, 0.0])
                row[0] += mine.keys() == want.keys()
                row[1] += same_up_to_ties(mine, want)
                row[2] += 1
                row[3] += len(mine.keys() & want.keys()) / max(len(want), 1)
    return {k: (int(v[0]), int(v[1]), int(v[2]), v[3]) for k, v in counts.items()}


def print_agreement(out: Tee, title: str, results: dict[str, tuple[int, int, int, float]]) -> None:
    out(f"{title}")
    for key, (same, ties, total, overlap) in results.items():
        out(
            f"    {key:<22} same tree {same:>4}/{total:<4} = {100 * same / total:6.2f}%   "
            f"same up to near-ties {ties:>4}/{total:<4} = {100 * ties / total:6.2f}%"
            f"   mean node overlap {100 * overlap / total:6.2f}%"
        )


def run_agreement(args: argparse.Namespace, out: Tee) -> None:
    out("")
    out("## Agreement with the naive SparklingTree reference (same set of root-to-node token paths)")
    out(
        "naive-C = naive heap restricted to the per-depth base top-C candidates (what exact tables compute); "
        "naive-V = unrestricted (children = top-min(M,V) of each node's own full-vocabulary corrected "
        "distribution). 'near-ties' also accepts swaps of prefixes within 1e-5 (relative) of the selection "
        "boundary; node overlap = shared prefixes / M. ddtree (no Markov head) is shown as a baseline."
    )
    fx = load_file(str(FIXTURE / "reference.safetensors"))
    drafter = load_file(str(FIXTURE / "drafter" / "model.safetensors"))
    w1 = drafter["markov_head.markov_w1.weight"].astype(np.float32)
    w2 = drafter["markov_head.markov_w2.weight"].astype(np.float32)
    base = fx["c.round_base_logits"].astype(np.float32)  # [41, 16, 320]; depth d uses slot d - 1
    x_start = fx["c.round_draft_input_ids"][:, 0].astype(np.int32)
    top_c = min(args.top_c, base.shape[-1])
    for budget in args.agreement_budgets:
        print_agreement(
            out,
            f"  fixture: {base.shape[0]} rounds, D={base.shape[1]}, V={base.shape[2]}, R={w1.shape[1]}, "
            f"C={top_c}, M={budget}",
            agreement(base, x_start, w1, w2, budget, top_c),
        )
    rng = np.random.default_rng(args.seed + 1)
    v, r, d = args.random_vocab, args.random_rank, args.depth
    for bias_std in args.bias_std:
        inputs = [random_inputs(rng, d, v, r, bias_std) for _ in range(args.trials)]
        # one head per setting (as in a real drafter), fresh base logits and roots per trial
        w1_, w2_ = inputs[0][2], inputs[0][3]
        base_ = np.stack([x[0] for x in inputs])
        xs = np.array([x[1] for x in inputs], np.int32)
        print_agreement(
            out,
            f"  random head: {args.trials} trials, D={d}, V={v}, R={r}, C={args.top_c}, "
            f"M={args.random_budget}, bias std {bias_std}",
            agreement(base_, xs, w1_, w2_, args.random_budget, min(args.top_c, v)),
        )


# ----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[4096, 151936])
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 128, 256])
    p.add_argument("--top-c", type=int, default=128)
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--rank", type=int, default=256, help="Markov rank R (Qwen3-4B DSpark: 256)")
    p.add_argument("--reps", type=int, default=10, help="device repetitions per measurement")
    p.add_argument("--ref-reps", type=int, default=3, help="reference repetitions (<= 2 at V > 16384)")
    p.add_argument("--max-seconds", type=float, default=6.0, help="stop repeating a measurement after this")
    p.add_argument("--agreement-budgets", type=int, nargs="+", default=[16, 64, 128])
    p.add_argument("--trials", type=int, default=40, help="random Markov heads: rounds per setting")
    p.add_argument("--bias-std", type=float, nargs="+", default=[0.5, 2.0, 5.0])
    p.add_argument("--random-vocab", type=int, default=2048)
    p.add_argument("--random-rank", type=int, default=64)
    p.add_argument("--random-budget", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="V=4096, M in {16, 64}, fewer reps and trials")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--skip-agreement", action="store_true")
    p.add_argument("--out", help="also write the output to this file (the command line comes first)")
    args = p.parse_args(argv)
    if args.quick:
        args.vocab, args.budgets, args.reps, args.ref_reps = [4096], [16, 64], 5, 1
        args.agreement_budgets, args.trials, args.bias_std = [64], 10, [2.0]

    out = Tee(args.out)
    out("$ " + shlex.join(["python", *sys.argv]))
    out(
        f"jax {jax.__version__}, numpy {np.__version__}, {jax.devices()[0].platform} x{jax.device_count()}, "
        f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
        f"python {platform.python_version()}"
    )
    out(f"load average before: {load_average()} (other processes share these cores; timings are noisy)")
    t0 = time.perf_counter()
    if not args.skip_timing:
        run_timing(args, out)
    if not args.skip_agreement:
        run_agreement(args, out)
    out(f"\ntotal {time.perf_counter() - t0:.0f} s; load average after: {load_average()}")


if __name__ == "__main__":
    main()
