"""Token choice and lossless acceptance rules (all float32, batch-first, jit-friendly).

* :func:`first_argmax` — the first index attaining the maximum (``jnp.argmax``'s answer, NaN included),
  as a max followed by a min over the matching indices: several times faster than ``jnp.argmax``'s
  value/index pair reduction on XLA:CPU. Every greedy pick and every Gumbel-max draw here uses it.
* :func:`categorical` — ``jax.random.categorical`` (the same Gumbel noise, the same token) through
  :func:`first_argmax`.
* :func:`pick` — greedy (first maximal index) at ``T == 0``, else a draw from ``softmax(logits / T)``.
* :func:`posterior` — the target's token at every verified node: its argmax, or an independent
  sample per node. Walking a tree with sampled posteriors is lossless: every emitted token is a
  draw from the target's conditional given the tokens before it, because the tree was fixed
  before the draws and the draws at different nodes are independent.
* :func:`speculative_chain` — standard speculative sampling for a chain against the draft
  distribution q the chain was drawn from: accept draft k with probability
  ``min(1, p_k(d_k) / q_k(d_k))``, at the first rejection emit a draw from
  ``normalize(max(p_k - q_k, 0))``, and if every draft is accepted emit a bonus from ``p``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def first_argmax(x: Array, axis: int = -1) -> Array:
    """The first index of ``x`` along ``axis`` attaining its maximum (int32): equal to ``jnp.argmax``.

    NaN is handled as ``jnp.argmax`` (and numpy) does: if the slice holds a NaN the answer is the index
    of its first NaN. Computed as ``max`` then the smallest index whose value equals it (or is NaN):
    two plain reductions, which XLA vectorises, instead of ``argmax``'s (value, index) pair reduction.
    """
    x = jnp.asarray(x)
    axis = axis % x.ndim
    n = x.shape[axis]
    top = jnp.max(x, axis=axis, keepdims=True)
    hit = x == top
    if jnp.issubdtype(x.dtype, jnp.inexact):
        hit = hit | jnp.isnan(x)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
    return jnp.min(jnp.where(hit, index, n), axis=axis)


def categorical(key: Array, logits: Array) -> Array:
    """A draw from ``softmax(logits)`` over the last axis (int32): exactly ``jax.random.categorical(key,
    logits, axis=-1)`` (the same Gumbel noise added to the logits, the same first maximum)."""
    return first_argmax(jax.random.gumbel(key, logits.shape, logits.dtype) + logits, axis=-1)


def pick(logits: Array, temperature: Array | float, key: Array | None) -> Array:
    """Greedy argmax when ``key`` is None or ``temperature == 0``, else a sample at that temperature."""
    logits = logits.astype(jnp.float32)
    greedy = first_argmax(logits, axis=-1)
    if key is None:
        return greedy
    t = jnp.asarray(temperature, jnp.float32)
    sampled = categorical(key, logits / jnp.where(t > 0, t, 1.0))
    return jnp.where(t > 0, sampled, greedy)


def posterior(logits: Array, temperature: Array | float, key: Array | None) -> Array:
    """The target's token at each node ``[B, N]`` from logits ``[B, N, V]`` (independent draws per node)."""
    return pick(logits, temperature, key)


def speculative_chain(
    target_logits: Array, draft_logits: Array, drafts: Array, temperature: Array | float, key: Array
) -> tuple[Array, Array]:
    """Speculative sampling of a chain.

    ``target_logits`` ``[B, n + 1, V]``: row k is the target at the node before draft k (row n after
    the last draft); ``draft_logits`` ``[B, n, V]`` the logits whose ``softmax(. / T)`` the drafts
    ``[B, n]`` were drawn from. Returns ``(accepted [B], next_token [B])``: the number of accepted
    drafts and the token that follows them (residual draw or bonus).
    """
    b, n = drafts.shape
    t = jnp.maximum(jnp.asarray(temperature, jnp.float32), 1e-6)
    p = jax.nn.softmax(target_logits.astype(jnp.float32) / t, axis=-1)
    q = jax.nn.softmax(draft_logits.astype(jnp.float32) / t, axis=-1)
    k_accept, k_resid = jax.random.split(key)
    p_d = jnp.take_along_axis(p[:, :n], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(k_accept, (b, n))
    ok = u * q_d < p_d  # u < p/q without dividing; q_d > 0 since the draft was drawn from q
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    rows = jnp.arange(b)
    p_next = p[rows, accepted]  # [B, V]; row n is the bonus distribution
    q_next = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)[rows, accepted]
    resid = jnp.maximum(p_next - q_next, 0.0)
    mass = jnp.sum(resid, axis=-1, keepdims=True)
    dist = jnp.where(mass > 0, resid / jnp.where(mass > 0, mass, 1.0), p_next)
    nxt = categorical(k_resid, jnp.log(dist))
    return accepted.astype(jnp.int32), nxt
