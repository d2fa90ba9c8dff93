"""Anchor sampling and the training layout of DSpark blocks (pure, jit-able functions).

A sequence ``input_ids [B, S]`` with ``loss_mask [B, S]`` yields ``A`` blocks of ``G`` slots, side by side in one
drafter forward (upstream DeepSpec ``Qwen3DSparkModel.forward``):

* **anchors**: candidates are positions ``p <= S - 2`` with ``loss_mask[p] > 0.5`` and ``loss_mask[p + 1] > 0.5``;
  with uniforms ``u [B, S - 1]`` (invalid candidates get ``u = 2``) the ``A`` smallest win, sorted by position.
  With fewer than ``A`` valid candidates the extra anchors are position 0 with ``keep = False``, after the kept.
* **block input** ``[input_ids[anchor], MASK x (G - 1)]`` at positions ``anchor .. anchor + G - 1`` (a dropped
  block has the mask id in slot 0 too).
* **mask** ``[B, A*G, S + A*G]`` (True = visible): a block query sees context positions ``< anchor`` and every
  slot of its own block; dropped blocks see nothing (all-False rows: zeros from the attention, like FlexAttention).
* **labels**: slot ``k`` predicts ``input_ids[anchor + k + 1]`` (index clamped to ``S - 1``; dropped blocks use
  0); ``eval_mask`` is the cumulative product over ``k`` of ``(anchor + k + 1 < S) & loss_mask[label] & keep``.
* **aligned target index** ``max(label_index - 1, 0)``: the target position whose next-token distribution the
  slot imitates; **Markov / confidence prev ids** ``[input_ids[anchor], labels[:-1]]`` (teacher forcing).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..errors import ArgumentError

Array = jax.Array


def _check_shapes(loss_mask: Array, num_anchors: int, block_size: int | None = None) -> None:
    if loss_mask.ndim != 2:
        raise ArgumentError(f"loss_mask: expected shape [B, S], got {tuple(loss_mask.shape)}")
    s = loss_mask.shape[1]
    if block_size is not None and s < block_size + 1:
        raise ArgumentError(f"sequence length: S={s} is shorter than a block plus its first label "
                            f"(block_size + 1 = {block_size + 1}); use longer sequences or a smaller block")
    if not isinstance(num_anchors, int) or num_anchors < 1:
        raise ArgumentError(f"num_anchors: must be a positive integer, got {num_anchors!r}")
    if num_anchors > s - 1:
        raise ArgumentError(f"num_anchors: {num_anchors} anchors do not fit a sequence of length {s} "
                            f"(at most S - 1 = {s - 1} candidate positions)")


def anchor_candidates(loss_mask: Array) -> Array:
    """Valid anchor positions ``[B, S - 1]``: ``loss_mask[p] > 0.5 and loss_mask[p + 1] > 0.5``."""
    lm = loss_mask.astype(jnp.float32) > 0.5
    return lm[:, :-1] & lm[:, 1:]


def anchors_from_uniforms(loss_mask: Array, uniforms: Array, num_anchors: int) -> tuple[Array, Array]:
    """Anchors ``[B, A]`` (int32, sorted, dummies = 0 at the end) and ``keep [B, A]`` from uniforms ``[B, S - 1]``
    (upstream's rule: invalid candidates get ``u = 2``, the ``A`` smallest win, ties broken by position)."""
    _check_shapes(loss_mask, num_anchors)
    b, s = loss_mask.shape
    if uniforms.shape != (b, s - 1):
        raise ArgumentError(f"uniforms: expected shape [B, S - 1] = {[b, s - 1]}, got {list(uniforms.shape)}")
    valid = anchor_candidates(loss_mask)
    u = jnp.where(valid, uniforms.astype(jnp.float32), 2.0)
    chosen = jnp.argsort(u, axis=1, stable=True)[:, :num_anchors].astype(jnp.int32)
    chosen_valid = jnp.take_along_axis(valid, chosen, axis=1)
    order = jnp.sort(jnp.where(chosen_valid, chosen, s), axis=1)  # kept ones by position, dummies last
    keep = order < s
    return jnp.where(keep, order, 0).astype(jnp.int32), keep


def sample_anchors(key: Array, loss_mask: Array, num_anchors: int) -> tuple[Array, Array]:
    """:func:`anchors_from_uniforms` with ``u ~ U[0, 1)`` drawn from ``key`` (shape ``[B, S - 1]``)."""
    _check_shapes(loss_mask, num_anchors)
    b, s = loss_mask.shape
    return anchors_from_uniforms(loss_mask, jax.random.uniform(key, (b, s - 1), jnp.float32), num_anchors)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Blocks:
    """The training layout of ``A`` blocks of ``G`` slots per sequence: ``anchors``/``keep`` ``[B, A]``; ``tokens``
    and ``positions`` ``[B, A*G]``; ``context_positions`` ``[B, S]``; ``mask`` ``[B, A*G, S + A*G]`` (True =
    visible); ``target_ids``, ``eval_mask``, ``aligned_index``, ``prev_ids`` ``[B, A, G]``."""

    anchors: Array
    keep: Array
    tokens: Array
    positions: Array
    context_positions: Array
    mask: Array
    target_ids: Array
    eval_mask: Array
    aligned_index: Array
    prev_ids: Array

    @property
    def full_positions(self) -> Array:
        """``[B, S + A*G]``: context positions then block positions (upstream ``position_ids``)."""
        return jnp.concatenate([self.context_positions, self.positions], axis=1)


def build_blocks(input_ids: Array, loss_mask: Array, anchors: Array, keep: Array, *, block_size: int,
                 mask_token_id: int) -> Blocks:
    """Block inputs, positions, the dense attention mask, labels and the eval mask (see the module doc)."""
    b, s = input_ids.shape
    if loss_mask.shape != (b, s):
        raise ArgumentError(f"loss_mask: shape {list(loss_mask.shape)} does not match input_ids {[b, s]}")
    _check_shapes(loss_mask, anchors.shape[1], block_size)
    g, a = block_size, anchors.shape[1]
    ids = input_ids.astype(jnp.int32)
    anchors = anchors.astype(jnp.int32)
    k = jnp.arange(g, dtype=jnp.int32)

    anchor_tok = jnp.take_along_axis(ids, anchors, axis=1)  # [B, A]
    first = jnp.where(keep, anchor_tok, mask_token_id)
    tokens = jnp.concatenate([first[..., None], jnp.full((b, a, g - 1), mask_token_id, jnp.int32)], axis=-1)
    positions = anchors[..., None] + k  # [B, A, G]

    raw_label = anchors[..., None] + k + 1
    in_range = raw_label < s
    label_index = jnp.where(keep[..., None], jnp.minimum(raw_label, s - 1), 0)
    target_ids = jnp.take_along_axis(ids, label_index.reshape(b, a * g), axis=1).reshape(b, a, g)
    lm = loss_mask.astype(jnp.float32) > 0.5
    label_ok = jnp.take_along_axis(lm, label_index.reshape(b, a * g), axis=1).reshape(b, a, g)
    eval_mask = jnp.cumprod((in_range & label_ok & keep[..., None]).astype(jnp.int32), axis=-1).astype(bool)
    prev_ids = jnp.concatenate([anchor_tok[..., None], target_ids[..., :-1]], axis=-1)

    # mask: rows = (block, slot), columns = context positions then (block, slot)
    ctx_cols = jnp.arange(s, dtype=jnp.int32)
    ctx_vis = (ctx_cols[None, None, :] < anchors[..., None]) & keep[..., None]  # [B, A, S]
    ctx_vis = jnp.broadcast_to(ctx_vis[:, :, None, :], (b, a, g, s)).reshape(b, a * g, s)
    blk = jnp.arange(a * g, dtype=jnp.int32) // g
    same = blk[:, None] == blk[None, :]  # [A*G, A*G]
    keep_rows = jnp.repeat(keep, g, axis=1)  # [B, A*G]
    blk_vis = same[None] & keep_rows[:, :, None]
    mask = jnp.concatenate([ctx_vis, blk_vis], axis=-1)

    return Blocks(anchors=anchors, keep=keep, tokens=tokens.reshape(b, a * g), positions=positions.reshape(b, a * g),
                  context_positions=jnp.broadcast_to(ctx_cols[None], (b, s)), mask=mask, target_ids=target_ids,
                  eval_mask=eval_mask, aligned_index=jnp.maximum(label_index - 1, 0), prev_ids=prev_ids)
