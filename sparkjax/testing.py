"""Random model pairs for tests, benchmarks and demos: :func:`random_pair` builds a Qwen3 target and a DSpark
drafter that fit each other, from small sizes or from given configs, with the same weights for the same arguments.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from .config import DrafterConfig, Qwen3Config
from .nn.drafter import Drafter
from .nn.qwen3 import Qwen3

MARKOV_RANK = 4  # the Markov head's rank unless it is bigram-initialised (then it is the vocabulary size)
EMBED_SCALE = 8.0  # sharpening: the target's embeddings times this (greedy choices far from ties)
MARKOV_SCALE = 30.0  # sharpening: the Markov head's weights times this (its bias decides the drafts)


def random_pair(seed: int = 0, *, configs: tuple[Qwen3Config, DrafterConfig] | None = None, vocab: int = 16,
                hidden: int = 32, heads: int = 4, kv_heads: int = 2, max_positions: int = 256, tied: bool = True,
                block: int = 4, markov: str | None = "vanilla", bigram: bool = False, sharpen: bool = True,
                dtype=jnp.float32, drafter_seed: int | None = None) -> tuple[Qwen3, Drafter]:
    """A random ``(target, drafter)`` pair.

    ``configs``: the target's and the drafter's configs (a benchmark preset's); without them the target has 3 layers
    of ``hidden`` width (``2 * hidden`` MLP), ``heads`` / ``kv_heads`` heads of 8 dimensions, ``vocab`` tokens and
    ``max_positions`` positions, embeddings ``tied`` to the head or not, and the drafter is one DSpark layer reading
    target layers 0 and 1, drafting ``block`` tokens (mask token ``vocab - 1``) with a ``markov`` Markov head
    (``"vanilla"``, ``"gated"``, or None for none) of rank 4, or of rank ``vocab`` set to the target's own bigram
    map when ``bigram`` (each token's greedy successor at weight 30, so drafts are often accepted). ``sharpen``
    scales the target's embeddings by 8 and a random Markov head by 30, so that distributions are far from
    uniform. Weights are drawn from ``nnx.Rngs(seed)`` (target) and ``nnx.Rngs(drafter_seed)`` (drafter; default
    ``seed + 100``) in ``dtype``.
    """
    if configs is None:
        tcfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=3,
                           num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8,
                           max_position_embeddings=max_positions, tie_word_embeddings=tied)
        fields = {f.name: getattr(tcfg, f.name) for f in dataclasses.fields(Qwen3Config)}
        rank = (vocab if bigram else MARKOV_RANK) if markov else 0
        dcfg = DrafterConfig(**{**fields, "num_hidden_layers": 1, "tie_word_embeddings": False}, kind="dspark",
                             block_size=block, target_layer_ids=(0, 1), mask_token_id=vocab - 1, num_target_layers=3,
                             markov_rank=rank, markov_head_type=markov)
    else:
        tcfg, dcfg = configs
    target = Qwen3(tcfg, rngs=nnx.Rngs(seed), dtype=dtype)
    if sharpen:
        nnx.update(target, jax.tree.map(lambda x: x * EMBED_SCALE, nnx.state(target.embed_tokens, nnx.Param)))
    drafter = Drafter(dcfg, rngs=nnx.Rngs(seed + 100 if drafter_seed is None else drafter_seed), dtype=dtype)
    head = drafter.markov_head
    if bigram:
        v = tcfg.vocab_size
        if head is None or dcfg.markov_rank != v:
            raise ValueError(f"bigram: needs a Markov head of rank {v} (the vocabulary size)")
        ids = jnp.arange(v, dtype=jnp.int32)[:, None]
        logits = nnx.jit(lambda model, ids: model(ids, jnp.zeros_like(ids)).logits)(target, ids)
        successor = jnp.argmax(logits[:, 0], axis=-1)  # [V]: prev -> next
        head.markov_w1.weight[...] = jnp.eye(v, dtype=head.markov_w1.weight.dtype)
        head.markov_w2.weight[...] = MARKOV_SCALE * jax.nn.one_hot(successor, v, dtype=head.markov_w2.weight.dtype).T
    elif sharpen and head is not None:
        nnx.update(head, jax.tree.map(lambda x: x * MARKOV_SCALE, nnx.state(head, nnx.Param)))
    return target, drafter
