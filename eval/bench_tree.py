"""Benchmark of the on-device tree builders (:mod:`sparkjax.tree`) against the NumPy references.

Two parts:

1. **Timing** on this machine after a warm-up (``block_until_ready``), inputs already on device, every
   measurement interleaved with the others (A B A B ...), reported as median, min and spread. Two
   same-work comparisons of the host (NumPy reference) and the device builds:

   (a) *exact*: the naive SparklingTree heap, which runs the exact full-vocabulary Markov head at every
       pop, against the device build over EXACT tables (candidates + exact ``markov_tables`` +
       ``best_first`` + visibility); both give the same tree;
   (b) *same tables*: the host heap over precomputed Markov tables (``reference.table_heap``) against
       device ``best_first`` over the same tables (+ ancestor mask / visibility on each side).

   The DDTree heap against the device DDTree build is also the same work. The naive exact heap against
   the device FAST build (approximate tables) is different work and is printed only for reference.
2. **Agreement**: how often best-first over exact / fast Markov tables gives the same tree (the same set
   of root-to-node token paths) as the naive SparklingTree reference, on the fixture's 41 rounds of real
   DSpark base logits with the fixture drafter's Markov head, and on random Markov heads.

Examples::

    python eval/bench_tree.py                       # full run (a few minutes on 2 cores)
    python eval/bench_tree.py --quick               # small vocabulary and budgets only
    OPENBLAS_NUM_THREADS=1 python eval/bench_tree.py --budgets 16 64 256 --reps 5   # single-threaded host BLAS
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


def interleaved(fns: dict[str, Callable[[], object]], reps: int, max_seconds: float) -> dict[str, list[float]]:
    """Seconds of each call, measured interleaved (A B C A B C ...): ``reps`` rounds, fewer (at least 2) once
    ``max_seconds`` have passed. Device results are blocked on (``block_until_ready``); no warm-up here."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    start = time.perf_counter()
    for r in range(reps):
        if r >= 2 and time.perf_counter() - start > max_seconds:
            break
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    return times


def summary(ts: list[float]) -> tuple[float, float, float]:
    """(median, min, spread = (max - min) / median) of a list of seconds."""
    med = statistics.median(ts)
    return med, min(ts), (max(ts) - min(ts)) / med


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
    }


@functools.partial(jax.jit, static_argnames=("top_c", "normalization"))
def fast_tables(base, x_start, w1, w2, *, top_c: int, normalization: str = "fast"):
    """The candidates and Markov tables the device build computes (its steps before best-first)."""
    cand_tokens, _ = tree.candidates(base, top_c)
    feats = tree.vanilla_parent_feats(w1, x_start, cand_tokens)
    return tree.markov_tables(base, cand_tokens, feats, w2, normalization), cand_tokens


def device_best_first(depth: int, budget: int) -> Callable:
    """Device ``best_first`` + visibility over given tables (the same work as :func:`ref_table_pipeline`)."""

    def build(tables, cand_tokens):
        t = tree.best_first(tables, cand_tokens, budget)
        return t, tree.visibility(t.parents, max_depth=depth)

    return jax.jit(build)


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


def ref_table_pipeline(tables: np.ndarray, cand_tokens: np.ndarray, budget: int) -> np.ndarray:
    """Host heap over precomputed ``[D, C, C]`` tables (reference.table_heap) + brute-force ancestor mask."""
    return ref.ancestor_mask(ref.table_heap(tables, cand_tokens, budget).parents)


def _cell(ts: list[float]) -> str:
    med, lo, spread = summary(ts)
    return f"{med * 1e3:9.2f} {lo * 1e3:9.2f} {100 * spread:4.0f}%"


def run_timing(args: argparse.Namespace, out: Tee) -> None:
    d, c, r = args.depth, args.top_c, args.rank
    out(f"## Timing: D={d}, C={c}, R={r}; ms per build, interleaved (A B A B ...): median, min, spread "
        f"((max - min) / median); up to {args.reps} rounds (>= 2; fewer once {args.max_seconds:g} s pass)")
    out("Same-work comparisons (host / device: > 1 means the device build is faster):")
    out("  (a) EXACT: naive host heap with exact full-vocabulary Markov mat-vecs (reference.naive_sparkling_tree,")
    out("      restricted to the base top-C) vs the device build over EXACT tables (candidates + exact markov_tables")
    out("      + best_first + visibility): the same tree (100% agreement below).")
    out("  (b) SAME TABLES: host heap over precomputed fast tables (reference.table_heap + ancestor_mask) vs device")
    out("      best_first + visibility over the same tables (the tables' cost is in neither).")
    out("  Different work, for reference only: naive exact host heap vs the device FAST build (approximate tables).")
    header = (
        f"{'V':>7} {'M':>4} | {'measurement':<34} | {'median':>9} {'min':>9} {'sprd':>5} | {'n':>2}"
    )
    rng = np.random.default_rng(args.seed)
    summary_rows = []
    for vocab in args.vocab:
        base, x_start, w1, w2 = random_inputs(rng, d, vocab, r)
        dev_args = jax.device_put((base, np.int32(x_start), w1, w2))
        tables_dev = jax.block_until_ready(fast_tables(*dev_args, top_c=c))
        tables_np, cands_np = (np.asarray(x) for x in jax.device_get(tables_dev))
        for budget in args.budgets:
            out("")
            out(header)
            out("-" * len(header))
            builders = device_builders(d, c, budget)
            bf = device_best_first(d, budget)
            fns = {
                "device ddtree build": functools.partial(builders["ddtree"], *dev_args),
                "host DDTree heap": functools.partial(ref_heap_pipeline, base, budget),
                "device bf-exact build  (a)": functools.partial(builders["bf-exact"], *dev_args),
                "host naive exact heap  (a)": functools.partial(ref_naive_pipeline, base, x_start, w1, w2, budget, c),
                "device best_first, tables (b)": functools.partial(bf, *tables_dev),
                "host heap, same tables (b)": functools.partial(ref_table_pipeline, tables_np, cands_np, budget),
                "device bf-fast build": functools.partial(builders["bf-fast"], *dev_args),
                "device beam-fast build": functools.partial(builders["beam-fast"], *dev_args),
            }
            t0 = time.perf_counter()
            for name, fn in fns.items():
                if name.startswith("device"):
                    jax.block_until_ready(fn())  # compile + first run
            compile_s = time.perf_counter() - t0
            times = interleaved(fns, args.reps, args.max_seconds)
            for name, ts in times.items():
                out(f"{vocab:>7} {budget:>4} | {name:<34} | {_cell(ts)} | {len(ts):>2}")

            def ratio(host, dev, times=times):
                return (statistics.median(times[host]) / statistics.median(times[dev]),
                        min(times[host]) / min(times[dev]))

            a = ratio("host naive exact heap  (a)", "device bf-exact build  (a)")
            b = ratio("host heap, same tables (b)", "device best_first, tables (b)")
            dd = ratio("host DDTree heap", "device ddtree build")
            diff = ratio("host naive exact heap  (a)", "device bf-fast build")
            out(f"{vocab:>7} {budget:>4} | host/device (median, min): (a) exact {a[0]:.2f}x {a[1]:.2f}x; "
                f"(b) same tables {b[0]:.2f}x {b[1]:.2f}x; ddtree {dd[0]:.2f}x {dd[1]:.2f}x; "
                f"[different work: naive exact / device fast {diff[0]:.1f}x {diff[1]:.1f}x]; "
                f"compile {compile_s:.1f} s; "
                f"load {load_average()}")
            summary_rows.append((vocab, budget, a, b, dd, diff, times))
    out("")
    out("## Summary (host / device ratios of medians; of mins in brackets)")
    out(f"{'V':>7} {'M':>4} | {'(a) exact':>16} | {'(b) same tables':>16} | {'ddtree':>16} | "
        f"{'different work':>16}")
    for vocab, budget, a, b, dd, diff, _ in summary_rows:
        out(f"{vocab:>7} {budget:>4} | {a[0]:6.2f}x [{a[1]:5.2f}x] | {b[0]:6.2f}x [{b[1]:5.2f}x] | "
            f"{dd[0]:6.2f}x [{dd[1]:5.2f}x] | {diff[0]:6.1f}x [{diff[1]:5.1f}x]")
    if max(os.getloadavg()[0], 0) > (os.cpu_count() or 1):
        out(f"WARNING: load average {load_average()} exceeds the {os.cpu_count()} cores: other processes "
            "competed for the CPU; compare ratios of interleaved runs, not absolute times")


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
    p.add_argument("--reps", type=int, default=7, help="interleaved rounds per configuration")
    p.add_argument("--max-seconds", type=float, default=15.0,
                   help="stop adding interleaved rounds (after the second) once a configuration took this long")
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
        args.vocab, args.budgets, args.reps = [4096], [16, 64], 5
        args.agreement_budgets, args.trials, args.bias_std = [64], 10, [2.0]

    out = Tee(args.out)
    out("$ " + shlex.join(["python", *sys.argv]))
    out(
        f"jax {jax.__version__}, numpy {np.__version__}, {jax.devices()[0].platform} x{jax.device_count()}, "
        f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
        f"python {platform.python_version()}"
    )
    threads = {k: os.environ.get(k, "unset") for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    out(f"host BLAS threads: {threads} (on a loaded machine a multi-threaded OpenBLAS spins and slows the host "
        "heaps several-fold; OPENBLAS_NUM_THREADS=1 is steadier)")
    out(f"load average before: {load_average()} (other processes share these cores; timings are noisy)")
    t0 = time.perf_counter()
    if not args.skip_timing:
        run_timing(args, out)
    if not args.skip_agreement:
        run_agreement(args, out)
    out(f"\ntotal {time.perf_counter() - t0:.0f} s; load average after: {load_average()}")


if __name__ == "__main__":
    main()
