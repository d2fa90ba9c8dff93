"""The bundled demo pair: a small Qwen3 target trained from scratch here and its two block-16 drafters.

``sparkjax/assets/demo/`` holds ``target/`` (a Hugging Face Qwen3 folder with its tokenizer),
``dspark_b16/`` (DeepSpec DSpark drafter with the Markov head), ``dflash_b16/`` (the same drafter
trained identically but without the Markov head), ``prompts/`` (held-out eval prompts) and
``MODEL_CARD.md``. Everything loads through the public loaders, with no network::

    import sparkjax
    demo = sparkjax.demo.load()                     # target, dspark, dflash, tokenizer
    ids = demo.encode_chat("How do I read a file?")
    out = sparkjax.generate(demo.target, demo.dspark, [ids], method="sparklingtree", budget=32,
                            eos_token_ids=demo.eos_token_ids)
    print(demo.tokenizer.decode(out.tokens[0]))
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from .errors import CheckpointError

DEMO_DIR = pathlib.Path(__file__).resolve().parent / "assets" / "demo"
PROMPT_SETS = ("python_docs", "stdlib_code", "synthetic_math")
# Stored in bfloat16, computed in float32 by default: in bf16 two logits can round to the same value and
# a one-token decode step and a multi-token verify may break that tie differently (rounding, not a bug).
COMPUTE_DTYPE = "float32"


def path(part: str = "") -> pathlib.Path:
    """``DEMO_DIR / part``; a clear error when the bundled pair is missing (e.g. a stripped install)."""
    p = DEMO_DIR / part if part else DEMO_DIR
    if not p.exists():
        raise CheckpointError(f"{p}: the bundled demo pair is missing (reinstall sparkjax, or pass your own folders)")
    return p


@dataclasses.dataclass
class DemoPair:
    target: Any
    dspark: Any
    dflash: Any
    tokenizer: Any

    @property
    def eos_token_ids(self) -> list[int]:
        tok = self.tokenizer
        return [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]

    def encode_chat(self, question: str) -> list[int]:
        """A user turn through the chat template, ending with the assistant header."""
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                  add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_text(self, text: str) -> list[int]:
        """A raw completion prompt (no template)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_row(self, row: dict[str, Any]) -> list[int]:
        """A prompt-set row: ``{"turns": [...]}`` (chat) or ``{"text": ...}`` (raw)."""
        return self.encode_text(row["text"]) if "text" in row else self.encode_chat(row["turns"][0])


def load(dtype: Any = COMPUTE_DTYPE) -> DemoPair:
    """Loads the bundled target, both drafters and the tokenizer, cast to ``dtype`` (float32; None keeps the
    files' bfloat16)."""
    from transformers import AutoTokenizer

    from .convert import load_drafter, load_target

    target = load_target(path("target"), dtype=dtype)
    dspark = load_drafter(path("dspark_b16"), target=target, dtype=dtype)
    dflash = load_drafter(path("dflash_b16"), target=target, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(str(path("target")))
    return DemoPair(target, dspark, dflash, tok)


def prompts(name: str) -> list[dict[str, Any]]:
    """The rows of a bundled prompt set (``python_docs``, ``stdlib_code``, ``synthetic_math``)."""
    if name not in PROMPT_SETS:
        raise CheckpointError(f"prompt set {name!r}: not one of {', '.join(PROMPT_SETS)}")
    with open(path(f"prompts/{name}.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
