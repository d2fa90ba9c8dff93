"""Greedy decoding speed: sparkjax vs transformers ``generate`` on the same random Qwen3, side by side.

    python eval/bench_ar.py [--layers 8] [--hidden 512] [--vocab 8192] [--new 128] [--batches 1,64]
                            [--reps 3] [--json PATH]

Both run on this CPU in float32, after a warm-up (compilation for sparkjax), on the same prompts (equal
lengths, so no padding), and their outputs are checked to be identical. The repetitions are interleaved
(transformers at each thread count, then sparkjax, then again), and each row reports the median and the
best run with the spread. torch's OpenMP threads are told not to spin (``OMP_WAIT_POLICY=PASSIVE``, set
before torch is imported): spinning threads slow whatever runs next in the same process. ``--json PATH``
writes one record per batch size: ``batch``, ``sparkjax_tok_s``, ``transformers_tok_s``, ``ratio`` (medians)
and the details.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch (and its OpenMP runtime) is loaded

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from sparkjax.engine import generate  # noqa: E402
from sparkjax.io.atomic import atomic_file  # noqa: E402
from sparkjax.io.hf import load_target  # noqa: E402


def _stats(times: list[float], tokens: int) -> dict:
    med = statistics.median(times)
    return {"tok_s": tokens / med, "tok_s_best": tokens / min(times), "spread": (max(times) - min(times)) / med}


def bench_batch(hf, target, prompts: list[list[int]], new: int, reps: int, thread_counts: list[int]) -> dict:
    def run_hf():
        with torch.no_grad():
            out = hf.generate(torch.tensor(prompts), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=0)
        return out[:, len(prompts[0]):].tolist()

    def run_jax():
        return generate(target, None, prompts, max_new_tokens=new).tokens

    same = run_hf() == run_jax()  # also the warm-up of both
    t_hf: dict[int, list[float]] = {n: [] for n in thread_counts}
    t_jax: list[float] = []
    for _ in range(reps):  # interleaved, so machine noise hits both alike
        for n in thread_counts:
            torch.set_num_threads(n)
            t0 = time.perf_counter()
            run_hf()
            t_hf[n].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        run_jax()
        t_jax.append(time.perf_counter() - t0)
    tokens = new * len(prompts)
    hf_rows = {n: _stats(t, tokens) for n, t in t_hf.items()}
    best_threads = max(hf_rows, key=lambda n: hf_rows[n]["tok_s"])
    jax_row = _stats(t_jax, tokens)
    return {"batch": len(prompts), "sparkjax_tok_s": jax_row["tok_s"],
            "transformers_tok_s": hf_rows[best_threads]["tok_s"],
            "ratio": jax_row["tok_s"] / hf_rows[best_threads]["tok_s"],
            "ratio_best": jax_row["tok_s_best"] / hf_rows[best_threads]["tok_s_best"],
            "identical_outputs": same, "sparkjax": jax_row, "transformers_threads": best_threads,
            "transformers": {str(n): r for n, r in hf_rows.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batches", default="1", help="comma-separated batch sizes, e.g. 1,64")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", default="1,2", help="torch thread counts to try; the fastest is the baseline")
    ap.add_argument("--json", metavar="PATH", help="write one record per batch size to PATH (JSON)")
    args = ap.parse_args()
    thread_counts = [int(t) for t in args.threads.split(",")]
    batches = [int(b) for b in args.batches.split(",")]

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
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        target = load_target(tmp)
    rng = np.random.default_rng(0)
    print(f"model: {args.layers} layers, d={args.hidden}, vocab {args.vocab}, prompt {args.prompt}, "
          f"{args.new} new tokens, float32; OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}; "
          f"{args.reps} interleaved repetitions")
    records = []
    for b in batches:
        prompts = rng.integers(0, args.vocab, (b, args.prompt)).tolist()
        r = bench_batch(hf, target, prompts, args.new, args.reps, thread_counts)
        records.append(r)
        hf_best = r["transformers"][str(r["transformers_threads"])]
        print(f"batch {b:>3}: sparkjax {r['sparkjax_tok_s']:9.1f} tok/s (best {r['sparkjax']['tok_s_best']:9.1f}, "
              f"spread {r['sparkjax']['spread']:.0%}) | transformers ({r['transformers_threads']} threads) "
              f"{r['transformers_tok_s']:9.1f} tok/s (best {hf_best['tok_s_best']:9.1f}, spread "
              f"{hf_best['spread']:.0%}) | ratio {r['ratio']:.2f}x median, {r['ratio_best']:.2f}x best | "
              f"identical outputs: {r['identical_outputs']}")
    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1):
        print(f"warning: load average {load:.1f} is above the {os.cpu_count()} cores: timings are noisy")
    if args.json:
        with atomic_file(args.json) as tmp:
            with open(tmp, "w") as f:
                json.dump(records, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
