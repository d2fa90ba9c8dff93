"""Token log-probabilities against transformers, every method, on the demo pair.

    python eval/logprobs_check.py [float32|bfloat16]          (default: float32)

Greedy `generate(..., logprobs=5)` of 4 demo math prompts (chat template), 48 new tokens each, under `ar`,
`dspark`, `sparklingtree`, `ddtree` and `auto`, with the pair loaded in the given dtype; the reference is
transformers' float32 Qwen3 on the same checkpoint, log_softmax in float64. Prints, per method, whether the
tokens equal `ar`'s and the largest |difference| for the chosen tokens and for the top-5 alternatives.
"""

import json
import pathlib
import sys

import jax.numpy as jnp
import torch
from transformers import AutoTokenizer, Qwen3ForCausalLM

import sparkjax
from sparkjax import load_drafter, load_target
from sparkjax.engine import generate

dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[sys.argv[1] if len(sys.argv) > 1 else "float32"]
demo = pathlib.Path(sparkjax.__file__).parent / "assets" / "demo"
target = load_target(demo / "target", dtype=dtype)
drafter = load_drafter(demo / "dspark_b16", target=target, dtype=dtype)
hf = Qwen3ForCausalLM.from_pretrained(str(demo / "target"), torch_dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(str(demo / "target"))
rows = [json.loads(line) for line in open(demo / "prompts" / "synthetic_math.jsonl")][:4]
prompts = []
for row in rows:
    ids = tok.apply_chat_template([{"role": "user", "content": row["turns"][0]}], add_generation_prompt=True,
                                  tokenize=True)
    prompts.append(list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids))
reference = None
print(f"{dtype.__name__}, {len(prompts)} prompts, 48 new tokens, top 5")
for method in ("ar", "dspark", "sparklingtree", "ddtree", "auto"):
    out = generate(target, drafter, prompts, method=method, max_new_tokens=48, logprobs=5)
    chosen = alternatives = 0.0
    for b, prompt in enumerate(prompts):
        toks = out.tokens[b]
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([prompt + toks])).logits[0].double(), -1).numpy()
        lp = lp[len(prompt) - 1: len(prompt) - 1 + len(toks)]
        for i, t in enumerate(toks):
            chosen = max(chosen, abs(out.token_logprobs[b][i] - lp[i, t]))
            alternatives = max(alternatives, max(abs(v - lp[i, j]) for j, v in out.top_logprobs[b][i]))
    same = reference is None or out.tokens == reference
    reference = reference or out.tokens
    print(f"{method:14s} tokens equal ar's: {same}  max |diff| chosen {chosen:.2e}  top-5 {alternatives:.2e}")
