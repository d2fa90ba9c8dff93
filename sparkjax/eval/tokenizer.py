"""The eval's tokenizer helpers: the same functions as :mod:`sparkjax.text` (kept under this name for
existing code, e.g. ``from sparkjax.eval.tokenizer import load_tokenizer, encode_prompt, eos_ids``)."""

from __future__ import annotations

from ..text import encode_chat, encode_prompt, encode_text, eos_ids, load_tokenizer, quiet_transformers

__all__ = ["encode_chat", "encode_prompt", "encode_text", "eos_ids", "load_tokenizer", "quiet_transformers"]
