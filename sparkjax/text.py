"""Text in and out of the models, in one place for ``python -m sparkjax``, :mod:`sparkjax.demo` and the eval.

A tokenizer that cannot be loaded or rendered raises :class:`sparkjax.errors.TokenizerError`; a bad ``kind``
raises :class:`sparkjax.ArgumentError`.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
from collections.abc import Iterator, Mapping
from typing import Any

from .errors import ArgumentError, SparkjaxError, TokenizerError

KINDS = ("chat", "text")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silences transformers' advisory warnings ("PyTorch was not found ...") and info messages for the block."""
    key = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
    previous = os.environ.get(key)
    os.environ[key] = "1"
    verbosity = None
    try:
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
    except Exception:  # noqa: BLE001 - no transformers: nothing to silence; the caller reports the import error
        hf_logging = None
    try:
        yield
    finally:
        if hf_logging is not None and verbosity is not None:
            hf_logging.set_verbosity(verbosity)
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous


def load_tokenizer(folder: str | os.PathLike, *, what: str = "--tokenizer",
                   error: type[SparkjaxError] = TokenizerError):
    """``AutoTokenizer.from_pretrained(folder)`` offline; ``what`` names the argument in the one-line ``error``."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise error(f"{what}: {folder} is not a folder")
    if not any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES):
        raise error(f"{what}: {folder} holds no tokenizer ({', '.join(TOKENIZER_FILES)}: none found)")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        with quiet_transformers():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many types here
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise error(f"{what}: cannot load a tokenizer from {folder} ({msg})") from None


def encode_text(tokenizer, text: str) -> list[int]:
    """A raw completion prompt as token ids: no template, no special token added."""
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def render_chat(tokenizer, question: str, *, enable_thinking: bool = False) -> str:
    """The chat-template text of one user turn followed by the assistant header (see :func:`encode_chat`)."""
    try:
        return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=enable_thinking)
    except ImportError as e:  # jinja2 missing
        raise TokenizerError(f"chat template: {e}") from None
    except Exception as e:  # noqa: BLE001 - a template that does not render (jinja2's TemplateError, ...)
        name = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
        raise TokenizerError(f"{name}: its chat template does not render ({type(e).__name__}: {e})") from None


def encode_chat(tokenizer, question: str, *, enable_thinking: bool = False) -> list[int]:
    """A user turn as token ids, through the chat template with the generation prompt (and ``enable_thinking``);
    a tokenizer without a chat template encodes the question as plain text."""
    if not getattr(tokenizer, "chat_template", None):
        return [int(i) for i in tokenizer(question)["input_ids"]]
    return encode_text(tokenizer, render_chat(tokenizer, question, enable_thinking=enable_thinking))


def encode_prompt(tokenizer, text: str, kind: str = "chat") -> list[int]:
    """``kind="chat"``: :func:`encode_chat`; ``kind="text"``: :func:`encode_text`."""
    if kind == "text":
        return encode_text(tokenizer, text)
    if kind != "chat":
        raise ArgumentError(f"encode_prompt: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return encode_chat(tokenizer, text)


def encode_row(tokenizer, row: Mapping[str, Any]) -> list[int]:
    """A prompt-set row: ``{"text": ...}`` raw, ``{"turns": [...]}`` its first turn as chat."""
    if "text" in row:
        return encode_text(tokenizer, row["text"])
    return encode_chat(tokenizer, row["turns"][0])


def eos_ids(tokenizer, target_dir: str | os.PathLike | None = None) -> list[int]:
    """The ids that end a generation, sorted: the target folder's ``generation_config.json`` ``eos_token_id``
    (an int or a list; the file is optional) plus the tokenizer's ``eos_token_id``."""
    value = None
    if target_dir is not None:
        path = pathlib.Path(target_dir) / "generation_config.json"
        try:
            value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            pass
    found = [*(value if isinstance(value, list) else [value]), getattr(tokenizer, "eos_token_id", None)]
    return sorted({int(v) for v in found if isinstance(v, int) and not isinstance(v, bool)})
