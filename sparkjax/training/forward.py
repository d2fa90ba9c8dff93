"""The DSpark training forward (pure functions of modules and arrays, jitted by :mod:`.trainer`): target
features, the drafter over anchor blocks, and the loss."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .. import pairing
from ..engine import drafting
from ..errors import ArgumentError
from .anchors import Blocks, build_blocks
from .loss import LossSums, Objective, dspark_loss_sums

Array = jax.Array

TRAIN_ATTENTION = "einsum"  # reverse mode cannot go through the blocked path's loop (a run-time trip count)


def check_pair(drafter, target) -> None:
    """A DSpark drafter (training needs its own tables and heads) that fits the target, if one is given."""
    if drafter.config.kind != "dspark":
        raise ArgumentError(
            f"drafter: training needs a DSpark drafter (own embedding, LM head and heads), got {drafter.config.kind!r}")
    if target is not None:
        pairing.check_pair(target, drafter)


def target_features(target, input_ids: Array, layer_ids: tuple[int, ...]) -> tuple[Array, Array]:
    """Context features ``[B, S, len(ids) * D]`` (``hidden_states[l + 1]``, concatenated) and the
    final-normed last hidden state ``[B, S, D]`` of a causal target forward, gradient-free."""
    b, s = input_ids.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s))
    last = target.config.num_hidden_layers - 1
    out = target(input_ids.astype(jnp.int32), positions, hidden_layers=(*layer_ids, last), compute_logits=False,
                 attention=TRAIN_ATTENTION)
    feats = drafting.features_from_hidden(out.hidden[:-1])
    return jax.lax.stop_gradient(feats), jax.lax.stop_gradient(out.hidden[-1])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainOutputs:
    """Per-block outputs ``[B, A, G, ...]``: backbone ``hidden`` (``[B, A*G, D]``), ``base_logits`` and
    Markov-corrected ``draft_logits`` ``[B, A, G, V]`` (float32), ``confidence`` logits ``[B, A, G]``
    (None without the head) and the ``target_logits`` at the aligned positions."""

    hidden: Array
    base_logits: Array
    draft_logits: Array
    confidence: Array | None
    target_logits: Array


def drafter_outputs(drafter, blocks: Blocks, features: Array, last_hidden: Array, target=None) -> TrainOutputs:
    """Runs the drafter over every anchor block at once; the target logits are
    ``target.logits(last_hidden[aligned_index])`` (the drafter's own LM head when no target is given)."""
    b, a, g = blocks.target_ids.shape
    out = drafter(features, blocks.context_positions, blocks.tokens, blocks.positions, blocks.mask, target=None,
                  attention=TRAIN_ATTENTION)
    hidden = out.hidden.reshape(b, a, g, -1)
    base = drafter.logits(hidden)
    flat = hidden.reshape(b * a, g, -1)
    prev = blocks.prev_ids.reshape(b * a, g)
    corrected = base
    if drafter.markov_head is not None:
        corrected = base + drafting.markov_bias(drafter, flat, prev).reshape(base.shape)
    conf = None
    if drafter.confidence_head is not None:
        conf = drafting.confidence(drafter, flat, prev).reshape(b, a, g)
    aligned = jnp.take_along_axis(last_hidden, blocks.aligned_index.reshape(b, a * g)[..., None], axis=1)
    aligned = jax.lax.stop_gradient(aligned).reshape(b, a, g, -1)
    if target is not None:
        tlogits = target.logits(aligned.astype(target.dtype)).astype(jnp.float32)
    else:
        tlogits = drafter.logits(aligned.astype(drafter.dtype))
    return TrainOutputs(out.hidden, base, corrected, conf, jax.lax.stop_gradient(tlogits))


def batch_loss(drafter, target, input_ids: Array, loss_mask: Array, anchors: Array, keep: Array, objective: Objective,
               *, features: Array | None = None, last_hidden: Array | None = None,
               ) -> tuple[Array, LossSums, Blocks, TrainOutputs]:
    """The DSpark loss of one batch for given anchors: ``(total, sums, blocks, outputs)``. Target features come
    from ``features``/``last_hidden`` when given, else from a gradient-free forward of ``target``."""
    c = drafter.config
    if features is None or last_hidden is None:
        if target is None:
            raise ArgumentError("features: pass precomputed features and last_hidden, or a target to compute them")
        features, last_hidden = target_features(target, input_ids, tuple(c.target_layer_ids))
    if features.shape[-1] != c.feature_size:
        raise ArgumentError(f"features: last axis is {features.shape[-1]}, the drafter expects {c.feature_size} "
                            f"({len(c.target_layer_ids)} target layers x hidden {c.hidden_size})")
    blocks = build_blocks(input_ids, loss_mask, anchors, keep, block_size=c.block_size, mask_token_id=c.mask_token_id)
    outs = drafter_outputs(drafter, blocks, features, last_hidden, target)
    sums = dspark_loss_sums(outs.draft_logits, outs.target_logits, blocks.target_ids, blocks.eval_mask, blocks.keep,
                            outs.confidence, objective)
    total = sums.losses(objective, outs.confidence is not None)["loss"]
    return total, sums, blocks, outs
