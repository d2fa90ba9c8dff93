"""The bundled demo pair: a small Qwen3 target trained from scratch here and its two block-16 drafters.

``sparkjax/assets/demo/`` holds ``target/`` (a Hugging Face Qwen3 folder with its tokenizer),
``dspark_b16/`` (DeepSpec DSpark drafter with the Markov head), ``dflash_b16/`` (the same drafter
trained identically but without the Markov head), ``prompts/`` (held-out eval prompts) and
``MODEL_CARD.md``. Everything loads through the public loaders, with no network::

    import sparkjax
    demo = sparkjax.demo.load()                     # target, dspark, dflash, tokenizer
    ids = demo.encode_chat("How do I read a file?")
    out = sparkjax.generate(demo.target, demo.dspark, [ids], method="sparklingtree@32",
                            eos_token_ids=demo.eos_token_ids)
    print(demo.tokenizer.decode(out.tokens[0]))
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from importlib import resources
from typing import Any

from . import text as _text
from .errors import CheckpointError
from .io.hf import load_drafter, load_target

_FOUND = resources.files("sparkjax.assets") / "demo"  # the installed package's, not the source tree's
# the loaders need real files: anything else (a zipped install) becomes a path that path() reports missing
DEMO_DIR = _FOUND if isinstance(_FOUND, pathlib.Path) else pathlib.Path(str(_FOUND))
PROMPT_SETS = ("python_docs", "stdlib_code", "synthetic_math")
# stored in bfloat16, computed in float32: bf16 logit ties could break differently in decode and verify
COMPUTE_DTYPE = "float32"


def path(part: str = "") -> pathlib.Path:
    """``DEMO_DIR / part``; a clear error when the bundled pair is missing (e.g. a stripped install)."""
    p = DEMO_DIR / part if part else DEMO_DIR
    if not p.exists():
        raise CheckpointError(f"{p}: the bundled demo pair is missing (reinstall sparkjax, or pass your own folders)")
    return p


@dataclasses.dataclass
class DemoPair:
    """The loaded demo pair; its encoders are those of :mod:`sparkjax.text` (as ``python -m sparkjax.eval``'s)."""

    target: Any
    dspark: Any
    dflash: Any
    tokenizer: Any
    target_dir: Any = None  # the target folder, for its generation_config.json EOS ids

    @property
    def eos_token_ids(self) -> list[int]:
        """The target's generation_config EOS ids plus the tokenizer's."""
        return _text.eos_ids(self.tokenizer, self.target_dir)

    def encode_chat(self, question: str, *, enable_thinking: bool = False) -> list[int]:
        """A user turn through the chat template, ending with the assistant header."""
        return _text.encode_chat(self.tokenizer, question, enable_thinking=enable_thinking)

    def encode_text(self, text: str) -> list[int]:
        """A raw completion prompt (no template, no special token)."""
        return _text.encode_text(self.tokenizer, text)

    def encode_row(self, row: dict[str, Any]) -> list[int]:
        """A prompt-set row: ``{"turns": [...]}`` (chat) or ``{"text": ...}`` (raw)."""
        return _text.encode_row(self.tokenizer, row)


def load(dtype: Any = COMPUTE_DTYPE) -> DemoPair:
    """Loads the bundled target, both drafters and the tokenizer, cast to ``dtype`` (float32; None keeps the
    files' bfloat16)."""
    target_dir = path("target")
    target = load_target(target_dir, dtype=dtype)
    dspark = load_drafter(path("dspark_b16"), target=target, dtype=dtype)
    dflash = load_drafter(path("dflash_b16"), target=target, dtype=dtype)
    tok = _text.load_tokenizer(target_dir, what="demo target")
    return DemoPair(target, dspark, dflash, tok, target_dir)


def prompts(name: str) -> list[dict[str, Any]]:
    """The rows of a bundled prompt set (``python_docs``, ``stdlib_code``, ``synthetic_math``)."""
    if name not in PROMPT_SETS:
        raise CheckpointError(f"prompt set {name!r}: not one of {', '.join(PROMPT_SETS)}")
    with open(path(f"prompts/{name}.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
