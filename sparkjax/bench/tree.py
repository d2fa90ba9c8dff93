"""The on-device tree builders (:mod:`sparkjax.tree`) against the NumPy references: timing and agreement.

    python -m sparkjax.bench tree                      # full run
    python -m sparkjax.bench tree --quick              # V=4096, budgets 16 and 64, fewer reps and trials
    OPENBLAS_NUM_THREADS=1 python -m sparkjax.bench tree --budgets 16,64,256 --reps 5 --out PATH

Timing: host reference heaps against the device builds, interleaved. Agreement: how often the device trees
(exact / fast tables, DDTree) equal the naive SparklingTree reference's token paths, on the fixture's rounds and
on random Markov heads ("near-ties": swaps within 1e-5 of the selection boundary allowed).
"""

from __future__ import annotations

import functools
import os
import time

import jax
import numpy as np
from safetensors.numpy import load_file

from sparkjax import reference as ref
from sparkjax import tree
from sparkjax.errors import ArgumentError

from . import timing
from .common import FIXTURE, add_output, at_least, ints, pct


def add_arguments(p) -> None:
    p.add_argument("--vocab", default="4096,151936", help="vocabulary sizes of the timing part")
    p.add_argument("--budgets", default="16,64,128,256")
    p.add_argument("--top-c", type=int, default=128)
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--rank", type=int, default=256, help="Markov rank R (Qwen3-4B DSpark: 256)")
    p.add_argument("--reps", type=int, default=7, help="interleaved repetitions per configuration")
    p.add_argument("--max-seconds", type=float, default=15.0,
                   help="stop adding repetitions (after the second) once a configuration took this long")
    p.add_argument("--agreement-budgets", default="16,64,128")
    p.add_argument("--trials", type=int, default=40, help="random Markov heads: rounds per setting")
    p.add_argument("--bias-std", default="0.5,2.0,5.0", help="random Markov heads' bias scales")
    p.add_argument("--random-vocab", type=int, default=2048)
    p.add_argument("--random-rank", type=int, default=64)
    p.add_argument("--random-budget", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="V=4096, M in {16, 64}, fewer reps and trials")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--skip-agreement", action="store_true")
    add_output(p)


def random_inputs(rng: np.random.Generator, depth: int, vocab: int, rank: int, bias_std: float = 1.0):
    """Base logits N(0, 2^2), W1 ~ N(0, 1), W2 ~ N(0, bias_std^2 / R): a Markov bias of std ~bias_std."""
    base = (rng.normal(size=(depth, vocab)) * 2.0).astype(np.float32)
    w1 = rng.normal(size=(vocab, rank)).astype(np.float32)
    w2 = (rng.normal(size=(vocab, rank)) * (bias_std / np.sqrt(rank))).astype(np.float32)
    return base, int(rng.integers(vocab)), w1, w2


def builders(depth: int, top_c: int, budget: int) -> dict:
    """The device builds of one tree from ``(base, x_start, w1, w2)``: ddtree, exact, fast, beam-fast and seed
    (the seed's union candidates and normaliser)."""
    def sparkling(normalization: str, beam: bool = False):
        widths = tree.even_widths(budget, depth) if beam else None
        return lambda base, x, w1, w2: tree.build_sparkling_tree(
            base, x, w1, w2, budget=budget, top_c=top_c, candidates="base", normalization=normalization, widths=widths)

    return {"ddtree": lambda base, x, w1, w2: tree.build_ddtree(base, budget), "exact": sparkling("exact"),
            "fast": sparkling("fast"), "beam-fast": sparkling("fast", True),
            "seed": lambda base, x, w1, w2: tree.build_sparkling_tree(base, x, w1, w2, budget=budget, top_c=top_c)}


@functools.partial(jax.jit, static_argnames=("top_c",))
def fast_tables(base, x_start, w1, w2, *, top_c: int):
    """The candidates and fast Markov tables the device build computes before best-first."""
    cand_tokens, _ = tree.candidates(base, top_c)
    feats = tree.vanilla_parent_feats(w1, x_start, cand_tokens)
    return tree.markov_tables(base, cand_tokens, feats, w2, "fast"), cand_tokens


def timing_rows(args, vocab: int, budget: int, rng) -> list[dict]:
    d, c = args.depth, args.top_c
    base, x_start, w1, w2 = random_inputs(rng, d, vocab, args.rank)
    dev = jax.device_put((base, np.int32(x_start), w1, w2))
    tables_dev = jax.block_until_ready(fast_tables(*dev, top_c=c))
    tables_np, cands_np = (np.asarray(x) for x in jax.device_get(tables_dev))
    def with_mask(fn):
        return jax.jit(lambda *a: (t := fn(*a), tree.visibility(t.parents, max_depth=d)))

    b = {k: with_mask(f) for k, f in builders(d, c, budget).items()}
    b["best_first"] = with_mask(lambda tables, cands: tree.best_first(tables, cands, budget))
    fns = {
        "device ddtree build": lambda: b["ddtree"](*dev),
        "host DDTree heap": lambda: ref.ancestor_mask(ref.ddtree_heap(base, budget).parents),
        "device bf-exact build  (a)": lambda: b["exact"](*dev),
        "host naive exact heap  (a)": lambda: ref.ancestor_mask(ref.naive_sparkling_tree(
            base, x_start, lambda _d, p: w1[p], w2, budget, top_c=c).parents),
        "device best_first, tables (b)": lambda: b["best_first"](*tables_dev),
        "host heap, same tables (b)": lambda: ref.ancestor_mask(ref.table_heap(tables_np, cands_np, budget).parents),
        "device bf-fast build": lambda: b["fast"](*dev),
        "device beam-fast build": lambda: b["beam-fast"](*dev),
        "device seed build      (c)": lambda: b["seed"](*dev),
        "host seed heap         (c)": lambda: ref.ancestor_mask(ref.seed_sparkling_tree(
            base, x_start, lambda _d, p: w1[p], w2, budget, c).parents),
    }
    t0 = time.perf_counter()
    for name, fn in fns.items():
        if name.startswith("device"):
            jax.block_until_ready(fn())  # compile + first run
    compile_s = time.perf_counter() - t0
    stats = timing.interleave(fns, args.reps, deadline=time.perf_counter() + args.max_seconds, min_reps=2)
    rows = [{"part": "timing", "vocab": vocab, "budget": budget, "measurement": k, "median_ms": s.median * 1e3,
             "min_ms": s.min * 1e3, "spread": s.spread, "n": s.n} for k, s in stats.items()]

    def ratio(host, dev):
        return [stats[host].median / stats[dev].median, stats[host].min / stats[dev].min]

    rows.append({"part": "ratios", "vocab": vocab, "budget": budget, "compile_s": compile_s,
                 "exact": ratio("host naive exact heap  (a)", "device bf-exact build  (a)"),
                 "same_tables": ratio("host heap, same tables (b)", "device best_first, tables (b)"),
                 "ddtree": ratio("host DDTree heap", "device ddtree build"),
                 "seed": ratio("host seed heap         (c)", "device seed build      (c)"),
                 "different_work": ratio("host naive exact heap  (a)", "device bf-fast build")})
    return rows


def prefix_set(t) -> dict[tuple[int, ...], float]:
    """{root-to-node token path: score} of the valid nodes."""
    tokens, parents, scores, valid = (np.asarray(x) for x in (t.tokens, t.parents, t.scores, t.valid))
    paths: list[tuple[int, ...]] = [()]
    out = {}
    for i in range(len(tokens)):
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


def agreement(title: str, base, x_start, w1, w2, budget: int, top_c: int) -> list[dict]:
    """One row per (method, reference): same trees, same up to near-ties, rounds, mean node overlap."""
    fns = builders(base.shape[1], top_c, budget)
    trees = {k: jax.device_get(jax.jit(jax.vmap(fns[k], in_axes=(0, 0, None, None)))(base, x_start, w1, w2))
             for k in ("exact", "fast", "ddtree")}
    counts: dict[str, list[float]] = {}
    for i in range(base.shape[0]):
        refs = {"naive-C": ref.naive_sparkling_tree(base[i], int(x_start[i]), lambda _d, p: w1[p], w2, budget,
                                                    top_c=top_c),
                "naive-V": ref.naive_sparkling_tree(base[i], int(x_start[i]), lambda _d, p: w1[p], w2, budget)}
        want = {k: prefix_set(v) for k, v in refs.items()}
        for method, t in trees.items():
            mine = prefix_set(jax.tree.map(lambda x, i=i: x[i], t))
            for ref_name, w in want.items():
                row = counts.setdefault(f"{method} vs {ref_name}", [0, 0, 0.0])
                row[0] += mine.keys() == w.keys()
                row[1] += same_up_to_ties(mine, w)
                row[2] += len(mine.keys() & w.keys()) / max(len(w), 1)
    n = base.shape[0]
    return [{"part": "agreement", "setting": title, "pair": k, "same": int(v[0]), "near_ties": int(v[1]),
             "rounds": n, "overlap": v[2] / n} for k, v in counts.items()]


def agreement_rows(args):
    fx = load_file(str(FIXTURE / "reference.safetensors"))
    weights = load_file(str(FIXTURE / "drafter" / "model.safetensors"))
    w1 = weights["markov_head.markov_w1.weight"].astype(np.float32)
    w2 = weights["markov_head.markov_w2.weight"].astype(np.float32)
    base = fx["c.round_base_logits"].astype(np.float32)  # [41, 16, 320]; depth d uses slot d - 1
    x_start = fx["c.round_draft_input_ids"][:, 0].astype(np.int32)
    top_c = min(args.top_c, base.shape[-1])
    for m in ints(args.agreement_budgets, "--agreement-budgets"):
        yield from agreement(f"fixture: {base.shape[0]} rounds, D={base.shape[1]}, V={base.shape[2]}, "
                             f"R={w1.shape[1]}, C={top_c}, M={m}", base, x_start, w1, w2, m, top_c)
    rng = np.random.default_rng(args.seed + 1)
    v, r, d = args.random_vocab, args.random_rank, args.depth
    for bias_std in args.bias_std:
        inputs = [random_inputs(rng, d, v, r, bias_std) for _ in range(args.trials)]
        # one head per setting (as in a real drafter), fresh base logits and roots per trial
        yield from agreement(f"random head: {args.trials} trials, D={d}, V={v}, R={r}, C={args.top_c}, "
                             f"M={args.random_budget}, bias std {bias_std}", np.stack([x[0] for x in inputs]),
                             np.array([x[1] for x in inputs], np.int32), inputs[0][2], inputs[0][3],
                             args.random_budget, min(args.top_c, v))


def table(rows: list[dict]) -> str:
    lines, setting = [], None
    for r in rows:
        if r["part"] == "timing":
            if r["measurement"].startswith("device ddtree"):
                lines += ["", f"{'V':>7} {'M':>4} | {'measurement':<34} | {'median':>9} {'min':>9} {'sprd':>5} | n"]
            lines.append(f"{r['vocab']:>7} {r['budget']:>4} | {r['measurement']:<34} | {r['median_ms']:9.2f} "
                         f"{r['min_ms']:9.2f} {pct(r['spread'], 5)} | {r['n']}")
        elif r["part"] == "ratios":
            lines.append(f"{r['vocab']:>7} {r['budget']:>4} | host/device (median, min): (a) exact "
                         f"{r['exact'][0]:.2f}x {r['exact'][1]:.2f}x; (b) same tables {r['same_tables'][0]:.2f}x "
                         f"{r['same_tables'][1]:.2f}x; ddtree {r['ddtree'][0]:.2f}x {r['ddtree'][1]:.2f}x; (c) seed "
                         f"{r['seed'][0]:.2f}x {r['seed'][1]:.2f}x; "
                         f"[different work {r['different_work'][0]:.1f}x {r['different_work'][1]:.1f}x]; compile "
                         f"{r['compile_s']:.1f} s")
        else:
            if r["setting"] != setting:
                setting = r["setting"]
                lines.append(f"  {setting}")
            n = r["rounds"]
            lines.append(f"    {r['pair']:<22} same tree {r['same']:>4}/{n:<4} = {100 * r['same'] / n:6.2f}%   "
                         f"same up to near-ties {r['near_ties']:>4}/{n:<4} = {100 * r['near_ties'] / n:6.2f}%   "
                         f"mean node overlap {100 * r['overlap']:6.2f}%")
    return "\n".join(lines)


def run(args, report) -> None:
    if args.quick:
        args.vocab, args.budgets, args.reps = "4096", "16,64", 5
        args.agreement_budgets, args.trials, args.bias_std = "64", 10, "2.0"
    vocabs, budgets = ints(args.vocab, "--vocab"), ints(args.budgets, "--budgets")
    try:
        args.bias_std = [float(x) for x in args.bias_std.split(",")]
    except ValueError:
        raise ArgumentError(f"--bias-std: expected comma-separated numbers, got {args.bias_std!r}") from None
    for arg in ("top_c", "depth", "rank", "reps", "trials", "random_vocab", "random_rank", "random_budget"):
        at_least(getattr(args, arg), "--" + arg.replace("_", "-"))
    ints(args.agreement_budgets, "--agreement-budgets")
    threads = {k: os.environ.get(k, "unset") for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    report.table = table
    report.header += [f"# jax {jax.__version__}, numpy {np.__version__}, {jax.devices()[0].platform}, "
                      f"{os.cpu_count()} CPU cores; host BLAS threads {threads} (OPENBLAS_NUM_THREADS=1 is steadier "
                      "on a loaded machine)",
                      f"# timing: D={args.depth}, C={args.top_c}, R={args.rank}; ms per build, interleaved; (a) "
                      "exact, (b) same tables and (c) seed are same-work pairs; agreement: see --help"]
    rng = np.random.default_rng(args.seed)
    if not args.skip_timing:
        for vocab in vocabs:
            for budget in budgets:
                report.rows += timing_rows(args, vocab, budget, rng)
    if not args.skip_agreement:
        for row in agreement_rows(args):
            report.rows.append(row)
