"""Self-distillation data for the demo drafters: the target's own greedy continuations of corpus prompts.

Prompts are drawn (seeded, weighted by ``min(len(text), 4000)``) from the corpus's training split: a chat
document's first user turn, else a window of 32..``--max-prompt`` tokens. Each output row is ``{"input_ids":
prompt + continuation, "loss_mask": 0 on the prompt, 1 on the continuation through its first <|im_end|>}``.

    python train/distill_data.py --target runs/demo/target --corpus runs/demo/corpus \
        --out runs/demo/distill.jsonl --num 8192
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def pick_prompts(corpus: str, tok, num: int, seed: int, max_prompt: int) -> list[list[int]]:
    with open(os.path.join(corpus, "train.jsonl"), encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    weights = np.asarray([min(len(t), 4000) for t in docs], np.float64)
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(docs), size=num, p=weights / weights.sum())
    header = "<|im_start|>assistant\n"
    prompts = []
    for i in picks:
        text = docs[i]
        if text.startswith("<|im_start|>user") and header in text:
            ids = tok.encode(text[: text.index(header) + len(header)], add_special_tokens=False)
            prompts.append(ids[-max_prompt:])
            continue
        ids = tok.encode(text, add_special_tokens=False)
        length = int(rng.integers(32, max_prompt + 1))
        start = int(rng.integers(0, max(1, len(ids) - length)))
        prompts.append(ids[start:start + length])
    return prompts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="HF Qwen3 folder with the tokenizer files")
    p.add_argument("--corpus", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--num", type=int, default=8192)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=128)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    import sparkjax
    from sparkjax.io.atomic import atomic_file
    from sparkjax.text import load_tokenizer

    tok = load_tokenizer(a.target, what="--target")
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    target = sparkjax.load_target(a.target, dtype="float32")
    prompts = pick_prompts(a.corpus, tok, a.num, a.seed, a.max_prompt)
    order = np.argsort([len(x) for x in prompts], kind="stable")
    rows: list[dict | None] = [None] * len(prompts)
    t0 = time.perf_counter()
    for b in range(0, len(order), a.batch):
        idx = order[b:b + a.batch]
        batch = [prompts[i] for i in idx]
        out = sparkjax.generate(target, None, batch, method="ar", max_new_tokens=a.new, prompt_width=a.max_prompt,
                                cache_size=a.max_prompt + a.new, capacity=a.new, eos_token_ids=eos)
        for i, prompt, cont in zip(idx, batch, out.tokens, strict=True):
            rows[i] = {"input_ids": list(prompt) + list(cont), "loss_mask": [0] * len(prompt) + [1] * len(cont)}
        if (b // a.batch) % 10 == 0:
            print(f"{b + len(idx)}/{len(prompts)} sequences, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    with atomic_file(a.out) as tmp, open(tmp, "w") as f:
        f.write("".join(json.dumps(row) + "\n" for row in rows))
    print(json.dumps({"sequences": len(rows), "continuation_tokens": sum(sum(r["loss_mask"]) for r in rows),
                      "seconds": round(time.perf_counter() - t0)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
