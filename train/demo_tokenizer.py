"""Trains the demo pair's tokenizer and encodes the corpus into token streams.

A byte-level BPE of ``--vocab`` tokens with single-digit numbers, trained on the corpus's training split, with
the special tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (the eos) and ``<|mask|>`` and a ChatML
chat template. Then writes ``train.tokens.npy`` / ``heldout.tokens.npy`` (uint16) into the corpus folder.

    python train/demo_tokenizer.py --corpus runs/demo/corpus --out runs/demo/tokenizer
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from sparkjax.cli import run_cli
from sparkjax.io.atomic import atomic_dir

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def read_texts(path: str):
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def train_tokenizer(corpus: str, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(read_texts(os.path.join(corpus, "train.jsonl")), trainer=trainer)
    return tok


def save_tokenizer(tok, out: str) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|mask|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    with atomic_dir(out, overwrite=True) as tmp:  # replaces only a folder sparkjax wrote (or an empty one)
        fast.save_pretrained(tmp)


def encode(tok, path: str) -> np.ndarray:
    """The documents' ids, each followed by ``<|endoftext|>``."""
    eot = np.asarray([tok.token_to_id("<|endoftext|>")], np.uint16)
    return np.concatenate([x for enc in tok.encode_batch(list(read_texts(path)))
                           for x in (np.asarray(enc.ids, np.uint16), eot)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--vocab", type=int, default=4096)
    a = p.parse_args(argv)
    if not 300 <= a.vocab <= 65536:
        print(f"error: --vocab must be in [300, 65536] (uint16 token streams), got {a.vocab}", file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(a.corpus, "train.jsonl")):
        print(f"error: {a.corpus}/train.jsonl is missing (run train/corpus.py first)", file=sys.stderr)
        return 2
    return run_cli(lambda: _run(a))


def _run(a) -> int:
    tok = train_tokenizer(a.corpus, a.vocab)
    save_tokenizer(tok, a.out)
    stats = {}
    for split in ("train", "heldout"):
        ids = encode(tok, os.path.join(a.corpus, f"{split}.jsonl"))
        np.save(os.path.join(a.corpus, f"{split}.tokens.npy"), ids)
        stats[split] = int(ids.size)
    print(json.dumps({"vocab": tok.get_vocab_size(), "tokens": stats,
                      "mask_token_id": tok.token_to_id("<|mask|>")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
