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
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from sparkjax import demo, tree
from sparkjax.decode import generate
from sparkjax.engine import drafting
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


def prompts(max_samples: int, tok) -> dict[str, list[list[int]]]:
    out = {}
    for s in datasets.load_all(datasets.DEFAULT):
        rows = [encode_prompt(tok, t, k) for t, k in zip(s.prompts, s.kinds, strict=True)]
        out[s.name] = rows[:max_samples]
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


def diagnostic(pair, sets, max_new: int, eos, top_cs=(32, 64)) -> dict:
    target, drafter = pair.target, pair.dspark
    cfg = drafter.config
    d = cfg.block_size - cfg.first_draft_slot
    out_chain = {c: np.zeros(d) for c in top_cs}
    reach = {(m, c): np.zeros(d) for m in tree.CANDIDATE_MODES for c in top_cs}
    n = 0

    @jax.jit
    def rounds(seq, starts):
        b = starts.shape[0]
        tout = target(seq[None], jnp.arange(seq.shape[0], dtype=jnp.int32)[None], hidden_layers=cfg.target_layer_ids,
                      compute_logits=False)
        feats = jnp.broadcast_to(drafting.features_from_hidden(tout.hidden), (b, seq.shape[0], cfg.feature_size))
        ctx = drafting.append_context(drafter, drafter.init_context(b, seq.shape[0] + cfg.block_size + 1), feats,
                                      starts)
        x0 = seq[starts]
        blk = drafting.draft_block(drafter, ctx, x0, starts)
        chain = drafting.markov_chain(drafter, blk.logits, blk.hidden, x0)
        base = drafting.aligned_logits(drafter, blk.logits)
        cands = {(m, c): jax.vmap(tree.markov_candidates, in_axes=(0, 0, None, None))(base, chain.logits, c, m)
                 for m in tree.CANDIDATE_MODES for c in top_cs}
        return chain.tokens, cands

    for rows in sets.values():
        for p in rows:
            seq = generate(target, None, [p], max_new_tokens=max_new, eos_token_ids=eos).tokens[0]
            full = np.asarray(list(p) + list(seq), np.int32)
            starts = np.arange(len(p) - 1, len(full) - d - 1, dtype=np.int32)  # every full block of the output
            if len(starts) == 0:
                continue
            pad = np.zeros(256 - len(full) % 256 + len(full), np.int32)
            pad[: len(full)] = full
            chain, cands = rounds(jnp.asarray(pad), jnp.asarray(starts))
            chain = np.asarray(chain)
            truth = full[starts[:, None] + 1 + np.arange(d)[None]]  # the target's tokens of depths 1..D
            for c in top_cs:
                base = np.asarray(cands[("base", c)])
                out_chain[c] += [(~(base[:, j] == chain[:, j, None]).any(-1)).sum() for j in range(d)]
                for m in tree.CANDIDATE_MODES:
                    cs = np.asarray(cands[(m, c)])
                    reach[(m, c)] += [(cs[:, j] == truth[:, j, None]).any(-1).sum() for j in range(d)]
            n += len(starts)
    res = {"rounds": n, "chain_outside_base": {c: (out_chain[c] / n).round(3).tolist() for c in top_cs},
           "target_in_candidates": {f"{m}@{c}": (reach[(m, c)] / n).round(3).tolist() for (m, c) in reach}}
    print(f"teacher-forced rounds: {n}")
    for c in top_cs:
        print(f"DSpark greedy token outside base top-{c}, per depth: {res['chain_outside_base'][c]}")
    for k, v in res["target_in_candidates"].items():
        print(f"target token in {k} candidates, per depth: {v}")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="sparklingtree@64:base,sparklingtree@64:union")
    ap.add_argument("--max-samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--union-k", type=int, default=None, help="sparkjax.tree.UNION_TOP_K for this run")
    ap.add_argument("--diagnostic", action="store_true")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.union_k is not None:
        tree.UNION_TOP_K = args.union_k
    pair = demo.load()
    sets = prompts(args.max_samples, pair.tokenizer)
    eos = pair.eos_token_ids
    res = {}
    if args.diagnostic:
        res["diagnostic"] = diagnostic(pair, sets, args.max_new_tokens, eos)
    else:
        res["configs"] = run_configs(pair, sets, [parse_config(c) for c in args.configs.split(",")],
                                     args.max_new_tokens, eos)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
