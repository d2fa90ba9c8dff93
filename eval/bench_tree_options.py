"""Tree options on the bundled demo pair: tau of tree methods with different candidate sets / beam profiles on the
same prompts (greedy, batch 1, as ``python -m sparkjax.eval``), and the candidate diagnostic of issue 17.

    python eval/bench_tree_options.py --configs sparklingtree@64:base,sparklingtree@64:union
    python eval/bench_tree_options.py --configs sparklingtree-beam@16:even,sparklingtree-beam@16:auto
    python eval/bench_tree_options.py --diagnostic

A config is ``method@budget[:option...]`` with options ``base`` / ``corrected`` / ``union`` (the ``candidates``
option) and ``even`` / ``auto`` (the beam's ``widths``). Every config runs on the eval's default prompts
(the first ``--max-samples`` of each bundled set) and is checked against ``ar`` token for token. Printed: tau pooled
per set and overall, and the per-depth conditional acceptance rates ``hits[d] / hits[d - 1]`` (the input of
``sparkjax.tree.auto_widths``). ``--diagnostic``: teacher-forced rounds at every position of the ``ar`` outputs: per
depth, how often the greedy DSpark chain's token is outside the base top-C, and how often the target's own token is
in each candidate set (the tree's reach).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from sparkjax import demo, tree
from sparkjax.engine import drafting, generate
from sparkjax.engine.methods import Tree, parse_method
from sparkjax.eval import datasets
from sparkjax.text import encode_prompt


def parse_config(text: str) -> tuple[str, Tree]:
    name, *opts = text.split(":")
    kw = {}
    for o in opts:
        if o in tree.CANDIDATE_MODES:
            kw["candidates"] = o
        elif o == "auto":
            kw["widths"] = "auto"
        elif o != "even":
            raise SystemExit(f"--configs: unknown option {o!r} in {text!r}")
    return text, parse_method(name, **kw)


def prompts(max_samples: int, tok, skip: int = 0) -> dict[str, list[list[int]]]:
    """Prompts ``skip .. skip + max_samples`` of each bundled set (``max_samples`` 0: all after ``skip``)."""
    out = {}
    for s in datasets.load_all(datasets.DEFAULT):
        rows = [encode_prompt(tok, t, k) for t, k in zip(s.prompts, s.kinds, strict=True)][skip:]
        out[s.name] = rows[:max_samples] if max_samples else rows
    return out


def run_configs(pair, sets, configs, max_new: int, eos) -> dict:
    width = 1 << max(len(p) for rows in sets.values() for p in rows).bit_length()
    common = dict(max_new_tokens=max_new, eos_token_ids=eos, prompt_width=width, cache_size=width + max_new + 160,
                  capacity=max_new)
    ar = {s: [generate(pair.target, None, [p], **common).tokens[0] for p in rows] for s, rows in sets.items()}
    results = {}
    for label, method in configs:
        drafter = pair.dspark if method.needs_markov else pair.dflash
        t0 = time.perf_counter()
        lens, hits, same = {}, {}, True
        for s, rows in sets.items():
            lens[s], hits[s] = [], None
            for p, want in zip(rows, ar[s], strict=True):
                out = generate(pair.target, drafter, [p], method=method, **common)
                same &= out.tokens[0] == want
                lens[s] += list(out.acceptance_lengths[0])
                h = np.asarray(out.accepted_per_depth[0], np.int64)
                hits[s] = h if hits[s] is None else hits[s] + h
        all_lens = [x for v in lens.values() for x in v]
        all_hits = sum(hits.values())
        rounds = len(all_lens)
        prev = np.concatenate([[rounds], all_hits[:-1]])
        rates = np.where(prev > 0, all_hits / np.maximum(prev, 1), 0.0)
        results[label] = {
            "tau": {s: float(np.mean(v)) for s, v in lens.items()} | {"overall": float(np.mean(all_lens))},
            "rounds": rounds, "same_as_ar": bool(same), "hits": all_hits.tolist(),
            "rates": [round(float(r), 4) for r in rates], "seconds": time.perf_counter() - t0,
            "plan": str(method.plan(pair.target, drafter, False).method),
        }
        r = results[label]
        print(f"{label:42s} tau " + " ".join(f"{s}={v:.3f}" for s, v in r["tau"].items())
              + f" rounds={rounds} same_as_ar={same} ({r['seconds']:.0f} s)", flush=True)
        print(f"{'':42s} rates {r['rates']}", flush=True)
    return results


def forced_rounds(pair, drafter, sets, max_new: int, eos, fn):
    """Teacher-forced rounds at every position of the ``ar`` outputs: yields ``(fn(x0, blk), truth)`` per prompt,
    ``truth[n, d]`` the target's own token of depth ``d + 1`` in round ``n`` (rounds whose block passes the end of
    the output are left out)."""
    target, cfg = pair.target, drafter.config
    d = cfg.block_size - cfg.first_draft_slot

    @jax.jit
    def rounds(seq, starts):
        b = starts.shape[0]
        tout = target(seq[None], jnp.arange(seq.shape[0], dtype=jnp.int32)[None], hidden_layers=cfg.target_layer_ids,
                      compute_logits=False)
        feats = jnp.broadcast_to(drafting.features_from_hidden(tout.hidden), (b, seq.shape[0], cfg.feature_size))
        ctx = drafting.append_context(drafter, drafter.init_context(b, seq.shape[0] + cfg.block_size + 1), feats,
                                      starts)
        x0 = seq[starts]
        return fn(x0, drafting.draft_block(drafter, ctx, x0, starts))

    for rows in sets.values():
        for p in rows:
            seq = generate(target, None, [p], max_new_tokens=max_new, eos_token_ids=eos).tokens[0]
            full = np.asarray(list(p) + list(seq), np.int32)
            starts = np.arange(len(p) - 1, len(full) - d - 1, dtype=np.int32)  # every full block of the output
            if len(starts) == 0:
                continue
            pad = np.zeros(256 - len(full) % 256 + len(full), np.int32)
            pad[: len(full)] = full
            yield rounds(jnp.asarray(pad), jnp.asarray(starts)), full[starts[:, None] + 1 + np.arange(d)[None]]


def diagnostic(pair, sets, max_new: int, eos, top_cs=(32, 64)) -> dict:
    drafter = pair.dspark
    cfg = drafter.config
    d = cfg.block_size - cfg.first_draft_slot
    out_chain = {c: np.zeros(d) for c in top_cs}
    reach = {(m, c): np.zeros(d) for m in tree.CANDIDATE_MODES for c in top_cs}
    n = 0

    def per_round(x0, blk):
        chain = drafting.markov_chain(drafter, blk.logits, blk.hidden, x0)
        base = drafting.aligned_logits(drafter, blk.logits)
        cands = {(m, c): jax.vmap(tree.markov_candidates, in_axes=(0, 0, None, None))(base, chain.logits, c, m)
                 for m in tree.CANDIDATE_MODES for c in top_cs}
        return chain.tokens, cands

    for (chain, cands), truth in forced_rounds(pair, drafter, sets, max_new, eos, per_round):
        chain = np.asarray(chain)
        for c in top_cs:
            base = np.asarray(cands[("base", c)])
            out_chain[c] += [(~(base[:, j] == chain[:, j, None]).any(-1)).sum() for j in range(d)]
            for m in tree.CANDIDATE_MODES:
                cs = np.asarray(cands[(m, c)])
                reach[(m, c)] += [(cs[:, j] == truth[:, j, None]).any(-1).sum() for j in range(d)]
        n += len(truth)
    res = {"rounds": n, "chain_outside_base": {c: (out_chain[c] / n).round(3).tolist() for c in top_cs},
           "target_in_candidates": {f"{m}@{c}": (reach[(m, c)] / n).round(3).tolist() for (m, c) in reach}}
    print(f"teacher-forced rounds: {n}")
    for c in top_cs:
        print(f"DSpark greedy token outside base top-{c}, per depth: {res['chain_outside_base'][c]}")
    for k, v in res["target_in_candidates"].items():
        print(f"target token in {k} candidates, per depth: {v}")
    return res


def _accepted_tree(t: tree.Tree, truth: jax.Array) -> jax.Array:
    """Greedy accepted length of one tree against the target's tokens ``truth[d]`` of depth ``d + 1``."""
    m, d = t.tokens.shape[0], truth.shape[0]
    match = t.valid & (t.tokens == truth[jnp.clip(t.depths - 1, 0, d - 1)])
    on = jnp.zeros((m + 1,), bool).at[0].set(True)  # index 0 = the root, node i = index i (parents' numbering)
    for _ in range(d):
        on = on.at[1:].set(match & on[t.parents])
    return jnp.max(jnp.where(on[1:], t.depths, 0))


def _accepted_beam(tables, cand_tokens, truth, widths, k: int) -> jax.Array:
    """Greedy accepted length of the beam of (traced) ``widths`` (each ``<= k``): the walk down its kept entries."""
    scores, parent, cand = tree._expand(tables, widths, k)
    tokens = jnp.take_along_axis(cand_tokens, cand, axis=1)

    def step(carry, xs):
        prev, alive, n = carry
        sc, par, tk, tr = xs
        m = (sc > -jnp.inf) & (par == prev) & (tk == tr)
        hit = alive & m.any()
        return (jnp.argmax(m).astype(jnp.int32), hit, n + hit.astype(jnp.int32)), None

    (_, _, n), _ = jax.lax.scan(step, (jnp.int32(0), jnp.bool_(True), jnp.int32(0)), (scores, parent, tokens, truth))
    return n


def _forced_tables(pair, drafter, sets, max_new: int, eos, method, plan):
    """The method's tables [N, D, C, C], candidates [N, D, C] and the target's tokens [N, D] of every teacher-forced
    round (:func:`forced_rounds`), and the number of rounds of each prompt."""
    data = list(forced_rounds(pair, drafter, sets, max_new, eos, lambda x0, blk: method.tables(drafter, x0, blk, plan)))
    return (jnp.concatenate([t for (t, _), _ in data]), jnp.concatenate([ct for (_, ct), _ in data]),
            jnp.asarray(np.concatenate([tr for _, tr in data]), jnp.int32), [len(tr) for _, tr in data])


def _trajectory_tau(acc, lengths) -> float:
    """Pooled tau of the greedy trajectories the per-position accepted lengths ``acc`` give (``lengths``: positions
    per prompt): a round at position ``s`` commits ``acc[s] + 1`` tokens and the next starts there (the eval's tau,
    on these prompts)."""
    acc = np.asarray(acc)
    tokens = rounds = off = 0
    for n_pos in lengths:
        s = 0
        while s < n_pos:
            s += int(acc[off + s]) + 1
            rounds += 1
        tokens += n_pos
        off += n_pos
    return tokens / rounds


@functools.partial(jax.jit, static_argnums=4)
def _best_first_acc(tables, cands, truth, scales, budget: int):
    """Greedy accepted length per round of best-first over the tables with depth ``d``'s log-probs times
    ``scales[d]`` (a per-depth calibration; all ones: the method's own tree)."""
    t = jnp.minimum(tables, 0.0) * scales[None, :, None, None]
    trees = jax.vmap(tree.best_first, in_axes=(0, 0, None))(t, cands, budget)
    return jax.vmap(_accepted_tree)(trees, truth)


def fit_depth_scales(pair, fit_sets, eval_sets, budget: int, max_new: int, eos,
                     grid=(0.5, 0.7, 0.85, 1.0, 1.2, 1.5), sweeps: int = 2) -> dict:
    """Per-depth calibration of sparklingtree's best-first: coordinate search over a scale per depth of the tables'
    log-probs (< 1: that depth's nodes look more probable), by the trajectory tau of teacher-forced rounds of
    ``fit_sets``; reported on ``eval_sets`` too (held out from the fit)."""
    drafter = pair.dspark
    method = parse_method("sparklingtree", budget=budget)
    plan = method.plan(pair.target, drafter, False)
    fit = _forced_tables(pair, drafter, fit_sets, max_new, eos, method, plan)
    held = _forced_tables(pair, drafter, eval_sets, max_new, eos, method, plan)

    def tau(data, scales):
        return _trajectory_tau(_best_first_acc(*data[:3], jnp.asarray(scales, jnp.float32), budget), data[3])

    scales = [1.0] * plan.depth
    res = {"budget": budget, "fit_rounds": int(fit[0].shape[0]), "eval_rounds": int(held[0].shape[0]),
           "best_first_fit": tau(fit, scales), "best_first_eval": tau(held, scales)}
    cur = res["best_first_fit"]
    for _ in range(sweeps):
        for d in range(plan.depth):
            for g in grid:
                trial = scales.copy()
                trial[d] = g
                v = tau(fit, trial)
                if v > cur + 1e-9:
                    cur, scales = v, trial
    res.update(scales=scales, calibrated_fit=cur, calibrated_eval=tau(held, scales))
    print(f"budget {budget}: best-first tau {res['best_first_fit']:.3f} (fit prompts, {res['fit_rounds']} rounds) / "
          f"{res['best_first_eval']:.3f} (eval prompts, {res['eval_rounds']} rounds); per-depth scales {scales}: "
          f"{res['calibrated_fit']:.3f} / {res['calibrated_eval']:.3f}", flush=True)
    return res


def fit_widths(pair, sets, budgets, max_new: int, eos, *, moves: int = 40) -> dict:
    """Learn a beam profile per budget on teacher-forced rounds at every position of the ``ar`` outputs: greedy
    node-by-node allocation by the tau of the greedy trajectories (see ``rounds_tau``), then the best single-node
    move between depths while one improves it; best-first, even widths and the model's ``auto_widths`` on the same
    rounds for comparison."""
    drafter = pair.dspark

    def fit_one(budget: int) -> dict:
        method = parse_method("sparklingtree-beam", budget=budget)
        plan = method.plan(pair.target, drafter, False)
        depth, c = plan.depth, plan.method.top_c
        k = min(budget, c)
        tables, cands, truth, lengths = _forced_tables(pair, drafter, sets, max_new, eos, method, plan)
        n = tables.shape[0]

        def rounds_tau(acc) -> float:
            return _trajectory_tau(acc, lengths)

        @functools.partial(jax.jit, static_argnums=4)
        def beam_acc(tables, cands, truth, widths, k):
            return jax.vmap(_accepted_beam, in_axes=(0, 0, 0, None, None))(tables, cands, truth, widths, k)

        def best_first_acc(tables, cands, truth, budget):
            return _best_first_acc(tables, cands, truth, jnp.ones((depth,), jnp.float32), budget)

        def tau(w):
            return rounds_tau(beam_acc(tables, cands, truth, jnp.asarray(w, jnp.int32), k))

        def ok(w):
            first_zero = w.index(0) if 0 in w else depth
            return (sum(w) == budget and all(0 <= x <= min(k, c ** (i + 1)) for i, x in enumerate(w))
                    and not any(w[first_zero:]) and all(w[i] <= w[i - 1] * c for i in range(1, depth)))

        t0 = time.perf_counter()
        w = [0] * depth
        for _ in range(budget):  # greedy: the node that raises the measured tau most (the shallowest on a tie)
            best = None
            for i in range(depth):
                trial = w.copy()
                trial[i] += 1
                first_zero = trial.index(0) if 0 in trial else depth
                if any(trial[first_zero:]) or trial[i] > k:
                    continue
                v = tau(trial)
                if best is None or v > best[0]:
                    best = (v, trial)
            w = best[1]
        greedy = tuple(w)
        model = tree.auto_widths(budget, depth, top_c=c)

        def climb(w):  # the best single-node move to a neighbouring depth (or the first empty one) while one helps
            w, cur = list(w), tau(w)
            for _ in range(moves):
                best = None
                for i in range(depth):
                    for j in (i - 1, i + 1, *((w.index(0),) if 0 in w else ())):  # to a neighbour or a new depth
                        if not 0 <= j < depth:
                            continue
                        trial = w.copy()
                        trial[i] -= 1
                        trial[j] += 1
                        if i == j or not ok(trial):
                            continue
                        v = tau(trial)
                        if v > cur + 1e-9 and (best is None or v > best[0]):
                            best = (v, trial)
                if best is None:
                    break
                cur, w = best
            return cur, w

        # from three starts (the greedy allocation, the model's profile, even widths): the best local optimum
        cur, w = max((climb(start) for start in (greedy, model, tree.even_widths(budget, depth))),
                     key=lambda r: r[0])
        res = {"rounds": int(n), "best_first": rounds_tau(best_first_acc(tables, cands, truth, budget)),
               "learned": tuple(w), "learned_tau": cur, "greedy": greedy, "greedy_tau": tau(list(greedy)),
               "model": model, "model_tau": tau(list(model)),
               "even": tree.even_widths(budget, depth), "even_tau": tau(list(tree.even_widths(budget, depth))),
               "seconds": time.perf_counter() - t0}
        print(f"budget {budget} ({n} rounds, {res['seconds']:.0f} s): best-first tau {res['best_first']:.3f}; beam "
              f"learned {res['learned_tau']:.3f} {list(res['learned'])}; greedy {res['greedy_tau']:.3f}; "
              f"model {res['model_tau']:.3f} {list(model)}; even {res['even_tau']:.3f}", flush=True)
        return res

    return {budget: fit_one(budget) for budget in budgets}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="sparklingtree@64:base,sparklingtree@64:union")
    ap.add_argument("--max-samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--union-k", type=int, default=None, help="sparkjax.tree.UNION_TOP_K for this run")
    ap.add_argument("--diagnostic", action="store_true")
    ap.add_argument("--fit-widths", default=None, metavar="BUDGETS",
                    help="learn a beam profile per budget (comma-separated) on teacher-forced rounds")
    ap.add_argument("--fit-depth-scales", type=int, default=None, metavar="BUDGET",
                    help="calibrate sparklingtree@BUDGET's per-depth scores on the prompts after --skip-samples and "
                         "report the first --skip-samples prompts of each set too")
    ap.add_argument("--skip-samples", type=int, default=0,
                    help="leave out the first N prompts of each set (e.g. the default eval's, to fit on held-out ones)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.union_k is not None:
        tree.UNION_TOP_K = args.union_k
    pair = demo.load()
    sets = prompts(args.max_samples, pair.tokenizer, args.skip_samples)
    eos = pair.eos_token_ids
    res = {}
    if args.diagnostic:
        res["diagnostic"] = diagnostic(pair, sets, args.max_new_tokens, eos)
    elif args.fit_depth_scales:
        res["fit_depth_scales"] = fit_depth_scales(pair, sets, prompts(args.skip_samples, pair.tokenizer),
                                                   args.fit_depth_scales, args.max_new_tokens, eos)
    elif args.fit_widths:
        res["fit_widths"] = fit_widths(pair, sets, [int(b) for b in args.fit_widths.split(",")], args.max_new_tokens,
                                       eos)
    else:
        res["configs"] = run_configs(pair, sets, [parse_config(c) for c in args.configs.split(",")],
                                     args.max_new_tokens, eos)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
