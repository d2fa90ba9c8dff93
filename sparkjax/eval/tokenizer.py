"""Tokenizer / prompt helpers, and a tiny deterministic tokenizer for the synthetic fixture pair.

The synthetic fixture pair (``tests/fixtures/tiny_dspark_b16``: a 6-layer Qwen3 with a
320-token vocabulary and a block-16 DSpark drafter whose mask token is 300; the harness's
default pair before the bundled demo pair, still usable with ``--target``/``--drafter``/
``--tokenizer``) ships no tokenizer. :func:`build_default_tokenizer` makes one that ``AutoTokenizer.from_pretrained``
loads offline:

* ids 0-255: the 256 bytes (id = byte value, in GPT-2's byte-level alphabet), so any text
  encodes and any id sequence decodes back losslessly;
* ids 256-299: 44 byte-pair merges (listed in :data:`MERGES`, learned once from the bundled
  prompt sets with ``tokenizers``' BPE trainer), which shorten English and code by about 1.4x;
* ids 306-319: ``<|reserved_N|>`` placeholders, so every id the target can emit decodes;
* id 300: ``<|mask|>``, the drafter's mask token (never produced from text);
* ids 301-303: ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (Qwen's special tokens);
* ids 304-305: ``<think>``, ``</think>`` (plain added tokens, as in Qwen3);
* a Qwen3-style chat template that honours ``enable_thinking=False``.

The files are committed under ``eval/default_pair/tokenizer/``; ``python -m
sparkjax.eval.tokenizer DIR`` rebuilds them byte for byte (a test checks that).
The pair is synthetic: its acceptance numbers demonstrate the machinery, not language quality.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

VOCAB_SIZE = 320
# Text pairs (decoded bytes); merge i creates token 256 + i.
MERGES: tuple[tuple[str, str], ...] = (
    (" ", "t"), (" ", "a"), ("i", "n"), ("h", "e"), (" ", "s"), (" ", " "),
    ("t", "e"), ("r", "e"), ("o", "n"), (" a", "n"), (" t", "he"), (" ", "f"),
    (" ", "p"), ("l", "e"), ("a", "s"), ("e", "r"), (" ", "o"), (" ", "w"),
    (" ", "b"), ("a", "l"), (" an", "d"), ("i", "t"), ("o", "u"), ("e", "s"),
    ("i", "s"), (" ", "c"), (" o", "f"), (" s", "te"), (" ste", "p"), (" ", "m"),
    ("a", "n"), (" ", "re"), ("a", "t"), ("\n", "  "), ("e", "d"), ("e", "n"),
    (" ", "$"), (" ", "\\"), ("\n  ", " "), ("u", "t"), (" t", "o"), (" ", "h"),
    (" ", "in"), (" ", "d"),
)
MASK_ID = 300
SPECIAL = {301: "<|endoftext|>", 302: "<|im_start|>", 303: "<|im_end|>", 300: "<|mask|>"}
PLAIN_ADDED = {304: "<think>", 305: "</think>"}

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_TOKENIZER_DIR = ROOT / "eval" / "default_pair" / "tokenizer"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _added_content(i: int) -> str:
    return SPECIAL.get(i) or PLAIN_ADDED.get(i) or f"<|reserved_{i}|>"


def default_tokenizer_files() -> dict[str, str]:
    """The synthetic fixture pair's tokenizer files (name -> text), built deterministically."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    table = _bytes_to_unicode()

    def sym(text: str) -> str:
        return "".join(table[b] for b in text.encode("utf-8"))

    vocab = {table[b]: b for b in range(256)}
    merges = [(sym(a), sym(b)) for a, b in MERGES]
    for i, (a, b) in enumerate(merges):
        assert a in vocab and b in vocab and a + b not in vocab, (a, b)
        vocab[a + b] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # Added tokens take the next free id, in order: 300, 301, ..., 319.
    for i in range(256 + len(MERGES), VOCAB_SIZE):
        special = i not in PLAIN_ADDED
        token = AddedToken(_added_content(i), special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    for i in range(256 + len(MERGES), VOCAB_SIZE):
        assert tok.token_to_id(_added_content(i)) == i, i
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1024,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {"content": _added_content(i), "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": i not in PLAIN_ADDED}
            for i in range(256 + len(MERGES), VOCAB_SIZE)
        },
        "comment": "Synthetic byte-level tokenizer for sparkjax's tiny default pair (built by sparkjax.eval.tokenizer)",
    }
    return {
        "tokenizer.json": json.dumps(json.loads(tok.to_str()), indent=2, ensure_ascii=False, sort_keys=True) + "\n",
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n",
    }


def write_default_tokenizer(folder: str | os.PathLike) -> pathlib.Path:
    """Writes :func:`default_tokenizer_files` into ``folder`` (created if needed)."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in default_tokenizer_files().items():
        tmp = folder / (name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, folder / name)
    return folder


def default_tokenizer_dir() -> pathlib.Path:
    """The committed tokenizer folder, or (when it is missing, e.g. in an installed wheel) a freshly
    built copy in ``$XDG_CACHE_HOME/sparkjax/default_tokenizer``."""
    if (DEFAULT_TOKENIZER_DIR / "tokenizer.json").is_file():
        return DEFAULT_TOKENIZER_DIR
    cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "sparkjax"
    return write_default_tokenizer(cache / "default_tokenizer")


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silences transformers' advisory and info messages for the block (only its tokenizers are used here).

    Its import prints "PyTorch was not found. Models won't be available ..." when torch is not installed,
    which reads like a broken install although no model of transformers is ever used: that message is an
    "advisory warning", dropped while ``TRANSFORMERS_NO_ADVISORY_WARNINGS`` is set (it is set only for the
    block and then restored). Inside the block, transformers' log level is ERROR; the previous level is
    restored after it."""
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


def load_tokenizer(folder: str | os.PathLike, *, what: str = "--tokenizer"):
    """``AutoTokenizer.from_pretrained(folder)`` offline, with a one-line error naming the folder."""
    from .errors import TokenizerError

    folder = str(folder)
    if not os.path.isdir(folder):
        raise TokenizerError(f"{what}: {folder} is not a folder")
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.isfile(os.path.join(folder, f)) for f in files):
        raise TokenizerError(f"{what}: {folder} holds no tokenizer ({', '.join(files)}: none found)")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        with quiet_transformers():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many types here
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TokenizerError(f"{what}: cannot load a tokenizer from {folder} ({msg})") from None


def encode_prompt(tokenizer, text: str, kind: str = "chat") -> list[int]:
    """A prompt as token ids. ``kind="chat"``: a user turn, through the chat template (with the
    generation prompt, ``enable_thinking=False``) when the tokenizer has one, else the raw text.
    ``kind="text"``: a raw completion prompt, encoded as is (no template, no special token added)."""
    if kind == "text":
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if kind != "chat":
        raise ValueError(f"encode_prompt: kind must be 'chat' or 'text', got {kind!r}")
    if getattr(tokenizer, "chat_template", None):
        from .errors import TokenizerError

        try:
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True,
                enable_thinking=False,
            )
        except ImportError as e:  # jinja2 missing
            raise TokenizerError(f"chat template: {e}") from None
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text)["input_ids"])


def eos_ids(tokenizer, target_dir: str | os.PathLike | None) -> list[int]:
    """EOS ids: the target's ``generation_config.json`` ``eos_token_id`` (int or list) plus the tokenizer's."""
    ids: list[int] = []
    if target_dir is not None:
        path = pathlib.Path(target_dir) / "generation_config.json"
        try:
            value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError):
            value = None
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, list):
            ids.extend(int(v) for v in value if isinstance(v, int))
    tid = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tid, int):
        ids.append(tid)
    return sorted(set(ids))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m sparkjax.eval.tokenizer DIR   (writes the synthetic fixture pair's tokenizer files)",
              file=sys.stderr)
        return 2
    print(write_default_tokenizer(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
