"""Token choice and lossless acceptance rules (all float32, batch-first, jit-friendly): walking a tree with
:func:`posterior`'s independent per-node samples is lossless (the tree is fixed before the draws);
:func:`speculative_chain` is standard speculative sampling against the chain's draft distribution.

Keys and temperatures come either as one for the whole batch (a single key, a scalar) or one per sequence (a key
array ``[B]``, a temperature ``[B]``); row b's numbers then come from key b alone, whatever the other rows.

Where a temperature is taken, a :class:`Sampling` (temperature, top-p, top-k: each a scalar or one per sequence) may
be given instead: the target's distribution is then :func:`process`'s, in the order temperature, top-k, top-p (as
vLLM and Hugging Face apply them), and both the plain sampler and speculative acceptance use it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array


def first_argmax(x: Array, axis: int = -1) -> Array:
    """The first index of ``x`` along ``axis`` attaining its maximum (int32): equal to ``jnp.argmax``, NaN
    included (the first NaN wins), as two plain reductions."""
    x = jnp.asarray(x)
    axis = axis % x.ndim
    n = x.shape[axis]
    top = jnp.max(x, axis=axis, keepdims=True)
    hit = x == top
    if jnp.issubdtype(x.dtype, jnp.inexact):
        hit = hit | jnp.isnan(x)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
    return jnp.min(jnp.where(hit, index, n), axis=axis)


def split_keys(key: Array, num: int) -> Array:
    """``jax.random.split(key, num)`` ``[num]``; for per-sequence keys ``[B]``, each split: ``[num, B]``."""
    if key.ndim == 0:
        return jax.random.split(key, num)
    return jnp.swapaxes(jax.vmap(lambda k: jax.random.split(k, num))(key), 0, 1)


def fold_in(key: Array, data: Any) -> Array:
    """``jax.random.fold_in`` of a single key, or of each per-sequence key."""
    if key.ndim == 0:
        return jax.random.fold_in(key, data)
    return jax.vmap(lambda k: jax.random.fold_in(k, data))(key)


def _draw(fn, key: Array, shape: tuple[int, ...], dtype) -> Array:
    if key.ndim == 0:
        return fn(key, shape, dtype)
    return jax.vmap(lambda k: fn(k, shape[1:], dtype))(key)  # shape[0] is the batch: row b from key b


def gumbel(key: Array, shape: tuple[int, ...], dtype=jnp.float32) -> Array:
    """``jax.random.gumbel(key, shape)``; with per-sequence keys ``[B]``, row b (of ``shape[0] == B``) from key b."""
    return _draw(jax.random.gumbel, key, tuple(shape), dtype)


def uniform(key: Array, shape: tuple[int, ...], dtype=jnp.float32) -> Array:
    """``jax.random.uniform(key, shape)``; per-sequence keys as in :func:`gumbel`."""
    return _draw(jax.random.uniform, key, tuple(shape), dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampling:
    """What the target's tokens are drawn from, all traced (a new value does not recompile): ``temperature``
    (float32, 0 = greedy), ``top_p`` (float32 in (0, 1], 1 = off) and ``top_k`` (int32 >= 0, 0 = off), each a
    scalar or one per sequence ``[B]``. Greedy rows ignore top-p and top-k."""

    temperature: Array
    top_p: Array
    top_k: Array

    @classmethod
    def of(cls, temperature=0.0, top_p=1.0, top_k=0) -> Sampling:
        """Device values (float32, float32, int32) of the three."""
        return cls(jnp.asarray(temperature, jnp.float32), jnp.asarray(top_p, jnp.float32),
                   jnp.asarray(top_k, jnp.int32))


def temperature_of(params: Sampling | Array | float) -> Array | float:
    """The temperature of a :class:`Sampling`, or ``params`` itself (a temperature)."""
    return params.temperature if isinstance(params, Sampling) else params


def per_row(value: Array | float, ndim: int) -> Array:
    """A scalar, or a per-sequence ``[B]`` value shaped ``[B, 1, ...]`` to broadcast against ``ndim`` axes."""
    v = jnp.asarray(value, jnp.float32)
    return v if v.ndim == 0 else v.reshape(v.shape + (1,) * (ndim - 1))


def _rows(value: Array | int, ndim: int) -> Array:
    v = jnp.asarray(value, jnp.int32)
    return v if v.ndim == 0 else v.reshape(v.shape + (1,) * (ndim - 1))


def categorical(key: Array, logits: Array) -> Array:
    """A draw from ``softmax(logits)`` over the last axis (int32): exactly ``jax.random.categorical(key,
    logits, axis=-1)`` for a single key (the same Gumbel noise, the same first maximum)."""
    return first_argmax(gumbel(key, logits.shape, logits.dtype) + logits, axis=-1)


def truncate(scaled: Array, top_p: Array | float, top_k: Array | int) -> Array:
    """Top-k, then top-p, of tempered logits ``scaled`` ``[..., V]``: the logits kept, ``-inf`` elsewhere
    (``top_p``, ``top_k`` scalars or per sequence, broadcast as :func:`per_row`). Top-k keeps the k largest
    logits, and every logit equal to the k-th (``top_k`` 0 or >= V: all); top-p then keeps, of the top-k
    distribution renormalised, the smallest set of largest probabilities whose mass reaches ``top_p``, and every
    token tied with the least of them (``top_p`` >= 1: all). The kept set depends on the values only, never on
    how a sort orders ties. One descending sort of the vocabulary per row."""
    v = scaled.shape[-1]
    p = per_row(top_p, scaled.ndim)
    k = _rows(top_k, scaled.ndim)
    srt = -jnp.sort(-scaled, axis=-1)  # descending
    k = jnp.where((k > 0) & (k < v), k, v)
    kth = jnp.take_along_axis(srt, jnp.broadcast_to(k - 1, srt.shape[:-1] + (1,)), axis=-1)  # [..., 1]
    srt = jnp.where(srt >= kth, srt, -jnp.inf)
    probs = jax.nn.softmax(srt, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the larger ones (the first token: 0 < top_p)
    keep = (before < p) | (p >= 1.0)
    cut = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled >= jnp.maximum(kth, cut), scaled, -jnp.inf)


def process(logits: Array, params: Sampling | Array | float) -> Array:
    """The target's sampling logits ``[..., V]`` (float32): ``logits / T`` (greedy rows: ``logits``), then
    :func:`truncate` when ``params`` is a :class:`Sampling`, run only when some sampled row has top-p < 1 or
    top-k > 0 (a ``lax.cond``: top-p and top-k off cost no sort). ``softmax`` of it is the distribution the
    plain sampler draws from and speculative acceptance verifies against."""
    logits = logits.astype(jnp.float32)
    t = per_row(temperature_of(params), logits.ndim)
    scaled = logits / jnp.where(t > 0, t, 1.0)
    if not isinstance(params, Sampling):
        return scaled
    hot = jnp.asarray(params.temperature) > 0  # greedy rows ignore top-p and top-k: scalar or [B]
    top_p = jnp.where(hot, jnp.asarray(params.top_p, jnp.float32), 1.0)
    top_k = jnp.where(hot, jnp.asarray(params.top_k, jnp.int32), 0)
    return jax.lax.cond(jnp.any((top_p < 1.0) | (top_k > 0)), lambda x: truncate(x, top_p, top_k), lambda x: x,
                        scaled)


def pick(logits: Array, temperature: Sampling | Array | float, key: Array | None) -> Array:
    """Greedy argmax when ``key`` is None or ``temperature == 0``, else a sample from ``softmax(process(logits,
    temperature))`` (``temperature`` a scalar or one per sequence ``[B]``, or a :class:`Sampling`; ``key`` one
    key or one per sequence)."""
    logits = logits.astype(jnp.float32)
    greedy = first_argmax(logits, axis=-1)
    if key is None:
        return greedy
    t = per_row(temperature_of(temperature), logits.ndim)
    sampled = categorical(key, process(logits, temperature))
    return jnp.where(t[..., 0] > 0 if t.ndim else t > 0, sampled, greedy)


def posterior(logits: Array, temperature: Sampling | Array | float, key: Array | None) -> Array:
    """The target's token at each node ``[B, N]`` from logits ``[B, N, V]`` (independent draws per node)."""
    return pick(logits, temperature, key)


def speculative_chain(
    target_logits: Array, draft_logits: Array, drafts: Array, temperature: Sampling | Array | float, key: Array
) -> tuple[Array, Array]:
    """Speculative sampling of a chain: accept draft k with probability ``min(1, p_k(d_k) / q_k(d_k))``, at
    the first rejection draw from ``normalize(max(p_k - q_k, 0))``, else a bonus from ``p``.

    ``target_logits`` ``[B, n + 1, V]``: row k is the target at the node before draft k, ``p`` its processed
    distribution ``softmax(process(., temperature))`` (top-p / top-k included: what ``ar`` draws from);
    ``draft_logits`` ``[B, n, V]`` the logits whose ``softmax(. / T)`` the drafts ``[B, n]`` were drawn from
    (``q``: the drafter samples at the temperature alone). Returns ``(accepted [B], next_token [B])``.
    """
    b, n = drafts.shape
    t = jnp.maximum(per_row(temperature_of(temperature), 3), 1e-6)
    clipped = t if t.ndim == 0 else t[:, 0, 0]  # back to a scalar or one per row, as process takes it
    if isinstance(temperature, Sampling):
        temperature = dataclasses.replace(temperature, temperature=clipped)
    else:
        temperature = clipped
    p = jax.nn.softmax(process(target_logits, temperature), axis=-1)
    q = jax.nn.softmax(draft_logits.astype(jnp.float32) / t, axis=-1)
    k_accept, k_resid = split_keys(key, 2)
    p_d = jnp.take_along_axis(p[:, :n], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = uniform(k_accept, (b, n))
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
