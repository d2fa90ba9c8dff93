"""Training data: JSONL conversations or token ids -> fixed-length ``input_ids`` / ``loss_mask``.

A JSONL line is ``{"messages": [{"role", "content"}, ...]}``, ``{"turns": [user, assistant, ...]}`` (strings,
alternating from the user, or role/content objects) or ``{"input_ids": [...], "loss_mask": [...]}`` (the mask
defaults to all ones). Conversations go through the tokenizer's chat template; the loss mask covers the tokens
after each ``assistant_header`` through the next ``end_of_turn`` (ChatML by default); lines without an assistant
turn are skipped and counted. Rows are padded / truncated to ``seq_len`` or packed (``packing="pack"``).
:class:`BatchStream` addresses batches by a *cursor* (batches consumed), so a resumed run gets the next batch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import zipfile
import zlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..engine import generate
from ..errors import DataError
from ..io.atomic import atomic_file
from .forward import target_features

CHATML_HEADER = "<|im_start|>assistant\n"
CHATML_END = "<|im_end|>"


@dataclasses.dataclass
class TokenData:
    """``input_ids`` ``[N, S]`` int32 and ``loss_mask`` ``[N, S]`` float32, optionally with precomputed
    target ``features`` ``[N, S, F]`` and final-normed ``last_hidden`` ``[N, S, D]``."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    features: np.ndarray | None = None
    last_hidden: np.ndarray | None = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def take(self, idx) -> TokenData:
        idx = np.asarray(idx)
        return TokenData(self.input_ids[idx], self.loss_mask[idx], *(None if x is None else x[idx] for x in (
            self.features, self.last_hidden)), dict(self.info))

    def fingerprint(self) -> str:
        """sha256 of the token ids and loss mask (what a resumed run must see again)."""
        h = hashlib.sha256()
        h.update(np.ascontiguousarray(self.input_ids, np.int32).tobytes())
        h.update(np.ascontiguousarray(self.loss_mask, np.float32).tobytes())
        return h.hexdigest()

    def supervised_tokens(self) -> int:
        return int((self.loss_mask > 0.5).sum())

    def save(self, path: str) -> None:
        """Writes the ids and mask to an ``.npz`` atomically."""
        with atomic_file(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, input_ids=self.input_ids, loss_mask=self.loss_mask)
            f.flush()
            os.fsync(f.fileno())

    @classmethod
    def load(cls, path: str) -> TokenData:
        """Reads what :meth:`save` wrote; anything unreadable (truncated, not an npz, wrong arrays)
        is a :class:`DataError` naming ``path``."""
        try:
            with np.load(path) as z:
                ids, mask = z["input_ids"], z["loss_mask"]
        except (OSError, KeyError, ValueError, TypeError, AttributeError, EOFError, zipfile.BadZipFile,
                zlib.error) as e:
            raise DataError(f"{path}: cannot read token data ({type(e).__name__}: {e})") from None
        if ids.ndim != 2 or mask.shape != ids.shape or ids.dtype.kind not in "iu":
            raise DataError(f"{path}: malformed token data (input_ids {ids.dtype} {list(ids.shape)}, "
                            f"loss_mask {list(mask.shape)})")
        return cls(ids.astype(np.int32), mask.astype(np.float32))


def read_jsonl(path: str) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed object)`` for every non-blank line; DataError names the file and line."""
    try:
        f = open(path, encoding="utf-8")  # noqa: SIM115
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except OSError as e:
        raise DataError(f"{path}: cannot open ({e})") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None


_FORMAT_HINT = (
    "expected a conversation {\"messages\": [{\"role\": ..., \"content\": ...}, ...]} or "
    "{\"turns\": [...]}, or token ids {\"input_ids\": [...], \"loss_mask\": [...]}"
)


def _message(m: Any, where: str, i: int) -> dict[str, str]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
        raise DataError(f"{where}: message {i} is not an object with string 'role' and 'content'; {_FORMAT_HINT}")
    return {"role": m["role"], "content": m["content"]}


def parse_record(obj: Any, where: str) -> tuple[str, Any]:
    """``("chat", messages)`` or ``("ids", (ids, mask))`` for one JSONL object; DataError otherwise."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: got a JSON {type(obj).__name__}, not an object; {_FORMAT_HINT}")
    if "input_ids" in obj:
        ids = obj["input_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(x, int) and not isinstance(x, bool)
                                                           for x in ids):
            raise DataError(f"{where}: 'input_ids' must be a non-empty list of integers")
        mask = obj.get("loss_mask", [1] * len(ids))
        if not isinstance(mask, list) or len(mask) != len(ids) or not all(
                isinstance(x, int | float) and not isinstance(x, bool) for x in mask):
            raise DataError(f"{where}: 'loss_mask' must be a list of {len(ids)} numbers (one per input id)")
        return "ids", (np.asarray(ids, np.int64), np.asarray(mask, np.float32))
    for key in ("messages", "turns"):
        if key not in obj:
            continue
        msgs = obj[key]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: '{key}' must be a non-empty list; {_FORMAT_HINT}")
        if key == "turns" and all(isinstance(t, str) for t in msgs):
            return "chat", [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(msgs)]
        return "chat", [_message(m, where, i) for i, m in enumerate(msgs)]
    raise DataError(f"{where}: no 'messages', 'turns' or 'input_ids' key (keys: {sorted(obj)[:6]}); {_FORMAT_HINT}")


class ChatEncoder:
    """Renders conversations with a tokenizer's chat template and marks the assistant tokens."""

    def __init__(self, tokenizer, *, assistant_header: str | None = None, end_of_turn: str | None = None,
                 source: str = "tokenizer"):
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(f"{source}: the tokenizer has no chat template; conversations cannot be rendered")
        self.tokenizer, self.header, self.end = tokenizer, assistant_header, end_of_turn
        if self.header is None:
            probe = tokenizer.apply_chat_template(
                [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], tokenize=False)
            if CHATML_HEADER not in probe:
                raise DataError(f"{source}: cannot find the assistant turns in this chat template (not ChatML); "
                                "set assistant_header and end_of_turn")
            self.header, self.end = CHATML_HEADER, CHATML_END if end_of_turn is None else end_of_turn
        if not self.end:
            raise DataError(f"{source}: end_of_turn must be a non-empty string")

    def encode(self, messages: list[dict[str, str]]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and the assistant loss mask of one conversation."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        spans = []
        pos = text.find(self.header)
        while pos >= 0:
            start = pos + len(self.header)
            stop = text.find(self.end, start)
            stop = len(text) if stop < 0 else stop + len(self.end)
            spans.append((start, stop))
            pos = text.find(self.header, stop)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = [any(s <= a < e for s, e in spans) for a, _ in enc["offset_mapping"]]
        return np.asarray(enc["input_ids"], np.int64), np.asarray(mask, np.float32)


def fixed_length(seqs: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int, packing: str) -> TokenData:
    """Pads / truncates each sequence to ``seq_len`` (``"pad"``) or packs them into rows (``"pack"``)."""
    if packing not in ("pad", "pack"):
        raise DataError(f"packing: expected 'pad' or 'pack', got {packing!r}")
    if packing == "pack":  # one stream, cut into rows (the last one padded)
        ids, mask = (np.concatenate(x) for x in zip(*seqs, strict=True))
        seqs = [(ids[i : i + seq_len], mask[i : i + seq_len]) for i in range(0, len(ids), seq_len)]
    out_ids = np.full((len(seqs), seq_len), pad_id, np.int32)
    out_mask = np.zeros((len(seqs), seq_len), np.float32)
    for i, (ids, mask) in enumerate(seqs):
        n = min(len(ids), seq_len)
        out_ids[i, :n] = ids[:n]
        out_mask[i, :n] = mask[:n]
    return TokenData(out_ids, out_mask)


def load_jsonl(path: str, seq_len: int, *, block_size: int, vocab_size: int, tokenizer=None,
               tokenizer_source: str = "tokenizer", packing: str = "pad", assistant_header: str | None = None,
               end_of_turn: str | None = None) -> TokenData:
    """Reads a JSONL file of conversations and/or token-id records into fixed-length rows; a record shorter than
    ``block_size + 1``, an id outside ``[0, vocab_size)`` or a malformed line raises DataError naming the line."""
    encoder = None
    seqs: list[tuple[np.ndarray, np.ndarray]] = []
    skipped = lines = 0
    for lineno, obj in read_jsonl(path):
        where = f"{path}:{lineno}"
        lines += 1
        kind, payload = parse_record(obj, where)
        if kind == "ids":
            ids, mask = payload
            if len(ids) < block_size + 1:
                raise DataError(f"{where}: sequence of {len(ids)} tokens is shorter than a block plus its first label "
                                f"(block_size + 1 = {block_size + 1})")
        else:
            if tokenizer is None:
                raise DataError(f"{where}: a chat conversation needs a tokenizer (set 'tokenizer' to a local folder)")
            if encoder is None:
                encoder = ChatEncoder(tokenizer, assistant_header=assistant_header, end_of_turn=end_of_turn,
                                      source=tokenizer_source)
            ids, mask = encoder.encode(payload)
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise DataError(f"{where}: token id {int(ids.max())} outside the target vocabulary [0, {vocab_size})")
        if mask[: seq_len].sum() < 2 and packing == "pad":
            skipped += 1
            continue
        seqs.append((ids, mask))
    if not seqs:
        raise DataError(f"{path}: no usable training sequence ({lines} lines; {skipped} without at least 2 "
                        "supervised (assistant) tokens within seq_len)")
    specials = () if tokenizer is None else (tokenizer.pad_token_id, tokenizer.eos_token_id)
    data = fixed_length(seqs, seq_len, next((t for t in specials if isinstance(t, int)), 0), packing)
    data.info = {"source": os.path.abspath(path), "lines": lines, "sequences": len(seqs), "skipped": skipped,
                 "packing": packing}
    return data


def synthetic_data(target, *, num_sequences: int, seq_len: int, prompt_len: int, seed: int = 0,
                   vocab_high: int | None = None, batch: int = 64) -> TokenData:
    """Target-greedy continuations of random prompts: ``prompt_len`` ids uniform in ``[0, vocab_high)``
    then ``seq_len - prompt_len`` tokens of :func:`sparkjax.generate` (method ``ar``,
    temperature 0), ``batch`` prompts per call. The loss mask is 0 on the prompt and 1 on the continuation."""
    if not 0 < prompt_len < seq_len:
        raise DataError(f"synthetic.prompt_len: must be in [1, seq_len) = [1, {seq_len}), got {prompt_len}")
    if num_sequences < 1:
        raise DataError(f"synthetic.num_sequences: must be >= 1, got {num_sequences}")
    vocab = target.config.vocab_size
    high = vocab if vocab_high is None else int(vocab_high)
    if not 0 < high <= vocab:
        raise DataError(f"synthetic.vocab_high: must be in [1, {vocab}], got {vocab_high}")
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, high, (num_sequences, prompt_len)).astype(np.int32)
    new = seq_len - prompt_len
    rows = []  # every call generates a full `batch` of prompts (padding rows dropped): one compiled program
    for i in range(0, num_sequences, batch):
        chunk = prompts[i : i + batch]
        padded = np.concatenate([chunk, np.zeros((batch - len(chunk), prompt_len), np.int32)])  # one shape
        out = generate(target, None, padded, method="ar", max_new_tokens=new)
        rows.extend(out.tokens[: len(chunk)])
    ids = np.concatenate([prompts, np.asarray(rows, np.int32)], axis=1)
    mask = np.broadcast_to(np.arange(ids.shape[1]) >= prompt_len, ids.shape).astype(np.float32)
    return TokenData(ids, mask, info={"source": "synthetic", "seed": seed, "prompt_len": prompt_len})


def precompute_features(target, data: TokenData, layer_ids: tuple[int, ...], batch: int = 8) -> TokenData:
    """Adds the target's features and final-normed hidden states to ``data`` (small runs only: the
    features take ``N * S * len(ids) * D`` floats)."""
    gdef, state = nnx.split(target)

    @jax.jit
    def run(state, ids):
        return target_features(nnx.merge(gdef, state), ids, layer_ids)

    outs = [run(state, jnp.asarray(data.input_ids[i : i + batch])) for i in range(0, len(data), batch)]
    return dataclasses.replace(data, features=np.concatenate([np.asarray(f) for f, _ in outs]),
                               last_hidden=np.concatenate([np.asarray(h) for _, h in outs]))


def split_eval(data: TokenData, *, eval_size: int, seed: int) -> tuple[TokenData, TokenData]:
    """A seeded held-out split: ``eval_size`` rows for evaluation, the rest for training."""
    if eval_size <= 0:
        return data, data.take(np.arange(0))
    if eval_size >= len(data):
        raise DataError(f"eval split: {eval_size} held-out rows leave nothing to train on ({len(data)} rows)")
    perm = np.random.default_rng([seed, 7]).permutation(len(data))
    return data.take(np.sort(perm[eval_size:])), data.take(np.sort(perm[:eval_size]))


class BatchStream:
    """Seeded, resumable batches: batch ``cursor`` is rows ``[j * B, (j + 1) * B)`` of epoch ``e``'s
    permutation (``cursor = e * batches_per_epoch + j``); the last partial batch of an epoch is dropped."""

    def __init__(self, data: TokenData, batch_size: int, seed: int = 0):
        if batch_size < 1:
            raise DataError(f"batch_size: must be >= 1, got {batch_size}")
        if len(data) < batch_size:
            raise DataError(f"batch_size: {batch_size} is larger than the {len(data)} training rows")
        self.data, self.batch_size, self.seed = data, batch_size, seed
        self.batches_per_epoch = len(data) // batch_size
        self._epoch, self._perm = -1, None

    def batch(self, cursor: int) -> dict[str, np.ndarray]:
        epoch, j = divmod(int(cursor), self.batches_per_epoch)
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.data))
        return as_batch(self.data.take(np.sort(self._perm[j * self.batch_size : (j + 1) * self.batch_size])))


def as_batch(data: TokenData) -> dict[str, np.ndarray]:
    out = {"input_ids": data.input_ids, "loss_mask": data.loss_mask}
    if data.features is not None:
        out["features"] = data.features
        out["last_hidden"] = data.last_hidden
    return out


def fixed_batches(data: TokenData, batch_size: int, limit: int | None = None) -> list[dict[str, np.ndarray]]:
    """Consecutive batches of ``data`` (the last one partial is dropped unless it is the only one)."""
    n = len(data)
    count = max(1, n // batch_size)
    if limit is not None:
        count = min(count, limit)
    return [as_batch(data.take(np.arange(i * batch_size, min((i + 1) * batch_size, n)))) for i in range(count)]
