"""Greedy decoding speed: sparkjax vs transformers ``generate`` on the same random Qwen3, side by side.

    python eval/bench_ar.py [--layers 8] [--hidden 512] [--vocab 8192] [--new 128] [--reps 3]

Both run on this CPU at batch 1 in float32, after a warm-up (compilation for
sparkjax), and their outputs are checked to be identical. Prints tokens/s of
each and the ratio (median over ``--reps`` runs).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from sparkjax.convert import load_target
from sparkjax.engine import generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", default="1,2", help="torch thread counts to try; the fastest is the baseline")
    args = ap.parse_args()
    thread_counts = [int(t) for t in args.threads.split(",")]

    cfg = Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 128,
        head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper than the default init, so greedy outputs are well separated
        for name, p in hf.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1 if "o_proj" not in name else 0.02)
    prompt = np.random.default_rng(0).integers(0, args.vocab, args.prompt).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        target = load_target(tmp)

    def run_hf():
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=args.new, min_new_tokens=args.new,
                              do_sample=False, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    def run_jax():
        return generate(target, None, [prompt], max_new_tokens=args.new).tokens[0]

    same = run_hf() == run_jax()  # also the warm-up of both
    t_hf = {n: [] for n in thread_counts}
    t_jax = []
    for _ in range(args.reps):  # interleaved, so machine noise hits both alike
        for n in thread_counts:
            torch.set_num_threads(n)
            t0 = time.perf_counter()
            run_hf()
            t_hf[n].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        run_jax()
        t_jax.append(time.perf_counter() - t0)
    print(f"model: {args.layers} layers, d={args.hidden}, vocab {args.vocab}, prompt {args.prompt}, "
          f"{args.new} new tokens, batch 1, float32")
    print(f"identical greedy outputs: {same}")
    for n in thread_counts:
        print(f"transformers generate, torch threads {n}: {args.new / statistics.median(t_hf[n]):8.1f} tok/s")
    hf_tps = max(args.new / statistics.median(t) for t in t_hf.values())
    jax_tps = args.new / statistics.median(t_jax)
    print(f"transformers baseline (fastest thread count): {hf_tps:8.1f} tok/s")
    print(f"sparkjax generate    : {jax_tps:8.1f} tok/s (prefill + on-device while_loop, one jitted program)")
    print(f"ratio sparkjax / transformers: {jax_tps / hf_tps:.2f}x")


if __name__ == "__main__":
    main()
