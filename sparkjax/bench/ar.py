"""Greedy decoding speed: sparkjax against transformers ``generate`` on the same random Qwen3, side by side.

    python -m sparkjax.bench ar [--layers 8] [--hidden 512] [--vocab 8192] [--new 128] [--batches 1,64]
                                [--reps 3] [--threads 1,2] [--json PATH]

Both run on this CPU in float32 after a warm-up, on the same prompts, with identical outputs checked;
repetitions are interleaved. ``--json`` writes one record per batch size: ``batch``, ``sparkjax_tok_s``,
``transformers_tok_s``, ``ratio`` (medians) and the details.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from sparkjax.engine import generate
from sparkjax.io.hf import load_target

from . import timing
from .common import add_output, at_least, ints, pct


def add_arguments(p) -> None:
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512, help="model width (a multiple of 128)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--batches", default="1", help="comma-separated batch sizes, e.g. 1,64")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", default="1,2", help="torch thread counts to try; the fastest is the baseline")
    add_output(p)


def _rates(s: timing.Stats, tokens: int) -> dict:
    return {"tok_s": tokens / s.median, "tok_s_best": tokens / s.min, "spread": s.spread}


def _hf_model(args):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                      num_key_value_heads=args.hidden // 128, head_dim=64, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper than the default init, so greedy outputs are well separated
        for name, p in hf.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1 if "o_proj" not in name else 0.02)
    return hf


def bench_batch(hf, target, prompts: list[list[int]], new: int, reps: int, threads: list[int]) -> dict:
    import torch

    def run_hf(n=None):
        if n is not None:
            torch.set_num_threads(n)
        with torch.no_grad():
            out = hf.generate(torch.tensor(prompts), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=0)
        return out[:, len(prompts[0]):].tolist()

    def run_jax():
        return generate(target, None, prompts, max_new_tokens=new).tokens

    same = run_hf() == run_jax()  # also the warm-up of both
    variants = {f"transformers@{n}": (lambda n=n: run_hf(n)) for n in threads} | {"sparkjax": run_jax}
    stats = timing.interleave(variants, reps)
    tokens = new * len(prompts)
    hf_rows = {n: _rates(stats[f"transformers@{n}"], tokens) for n in threads}
    best = max(hf_rows, key=lambda n: hf_rows[n]["tok_s"])
    jax_row = _rates(stats["sparkjax"], tokens)
    return {"batch": len(prompts), "sparkjax_tok_s": jax_row["tok_s"], "transformers_tok_s": hf_rows[best]["tok_s"],
            "ratio": jax_row["tok_s"] / hf_rows[best]["tok_s"],
            "ratio_best": jax_row["tok_s_best"] / hf_rows[best]["tok_s_best"], "identical_outputs": same,
            "sparkjax": jax_row, "transformers_threads": best, "transformers": {str(n): r for n, r in hf_rows.items()}}


def table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        hf = r["transformers"][str(r["transformers_threads"])]
        lines.append(f"batch {r['batch']:>3}: sparkjax {r['sparkjax_tok_s']:9.1f} tok/s (best "
                     f"{r['sparkjax']['tok_s_best']:9.1f}, spread {pct(r['sparkjax']['spread'])}) | transformers "
                     f"({r['transformers_threads']} threads) {r['transformers_tok_s']:9.1f} tok/s (best "
                     f"{hf['tok_s_best']:9.1f}, spread {pct(hf['spread'])}) | ratio {r['ratio']:.2f}x median, "
                     f"{r['ratio_best']:.2f}x best | identical outputs: {r['identical_outputs']}")
    return "\n".join(lines)


def run(args, report) -> None:
    threads, batches = ints(args.threads, "--threads"), ints(args.batches, "--batches")
    for arg in ("layers", "vocab", "prompt", "new", "reps"):
        at_least(getattr(args, arg), f"--{arg}")
    at_least(args.hidden, "--hidden", 128)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch (and its OpenMP runtime) is loaded
    hf = _hf_model(args)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        target = load_target(tmp)
    report.table = table
    report.header.append(f"# model: {args.layers} layers, d={args.hidden}, vocab {args.vocab}, prompt {args.prompt}, "
                         f"{args.new} new tokens, float32; OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}; "
                         f"{args.reps} interleaved repetitions")
    rng = np.random.default_rng(0)
    for b in batches:
        report.rows.append(bench_batch(hf, target, rng.integers(0, args.vocab, (b, args.prompt)).tolist(), args.new,
                                       args.reps, threads))
