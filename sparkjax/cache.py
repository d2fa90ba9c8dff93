"""Fixed-shape KV caches as registered-dataclass pytrees.

A :class:`KVCache` holds, per layer, keys and values ``[B, K, S, H]`` (heads-major, one array per layer) and
the committed lengths ``lengths[B]``: slots ``[0, lengths[b])`` hold sequence ``b``'s committed prefix, the rest
is scratch that masks never expose. Rows ``[B, T, K, H]`` (token-major) are written at traced per-sequence
offsets; rows past the end are dropped, so callers size the cache for the longest window they write.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from .sharding import DEFAULT_RULES, logical_to_spec

Array = jax.Array

# Logical axes of the cache arrays (mapped onto a mesh by the rules of :mod:`sparkjax.sharding`).
KV_AXES: tuple[str | None, ...] = ("batch", "kv_heads", None, None)
LENGTHS_AXES: tuple[str | None, ...] = ("batch",)


def scatter_rows(buf: Array, rows: Array, offsets: Array) -> Array:
    """``buf[b, :, offsets[b] + j] = rows[b, j]`` for buf ``[B, K, S, H]`` and rows ``[B, T, K, H]``; rows past
    the end are dropped. Vmapped over the batch, so a batch-sharded cache's scatter stays local to each shard."""
    t = rows.shape[1]

    def one(buf_b: Array, rows_b: Array, offset: Array) -> Array:  # [K, S, H], [T, K, H], []
        slots = offset + jnp.arange(t, dtype=jnp.int32)
        return buf_b.at[:, slots].set(jnp.swapaxes(rows_b, 0, 1).astype(buf_b.dtype), mode="drop")

    return jax.vmap(one)(buf, rows, offsets)


def _gather_rows(buf: Array, src: Array) -> Array:
    """``buf[b, :, src[b, j]]`` as token-major rows ``[B, A, K, H]`` (indices clipped), vmapped over the batch."""
    return jax.vmap(lambda buf_b, src_b: jnp.swapaxes(buf_b.at[:, src_b].get(mode="clip"), 0, 1))(buf, src)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer keys/values (tuples of ``[B, K, S, H]``, heads-major) and committed lengths ``[B]`` (int32)."""

    k: tuple[Array, ...]
    v: tuple[Array, ...]
    lengths: Array

    @classmethod
    def zeros(cls, layers: int, batch: int, size: int, kv_heads: int, head_dim: int, dtype=jnp.float32) -> KVCache:
        shape = (batch, kv_heads, size, head_dim)
        return cls(
            tuple(jnp.zeros(shape, dtype) for _ in range(layers)),
            tuple(jnp.zeros(shape, dtype) for _ in range(layers)),
            jnp.zeros((batch,), jnp.int32),
        )

    @property
    def size(self) -> int:
        return self.k[0].shape[2]

    def shardings(self, mesh: Mesh, rules: Mapping[str, str | None] = DEFAULT_RULES) -> KVCache:
        """A KVCache of NamedShardings matching this cache (for ``jax.device_put`` / ``out_shardings``)."""
        return kv_cache_shardings(mesh, len(self.k), rules)

    def write_layer(self, layer: int, k: Array, v: Array) -> KVCache:
        """Writes one layer's new rows ``[B, T, K, H]`` at ``lengths`` (lengths unchanged)."""
        new_k = _replace_at(self.k, layer, scatter_rows(self.k[layer], k, self.lengths))
        new_v = _replace_at(self.v, layer, scatter_rows(self.v[layer], v, self.lengths))
        return dataclasses.replace(self, k=new_k, v=new_v)

    def with_lengths(self, lengths: Array) -> KVCache:
        return dataclasses.replace(self, lengths=jnp.asarray(lengths, jnp.int32))

    def compact(self, start: Array, indices: Array, count: Array) -> KVCache:
        """Keeps a subset of a freshly written window: rows ``start[b] + indices[b, j]`` (``indices`` ``[B, A]``)
        for ``j < count[b]`` move to ``start[b] + j``; the committed length becomes ``start[b] + count[b]``."""
        start = jnp.asarray(start, jnp.int32)
        src = start[:, None] + jnp.asarray(indices, jnp.int32)  # [B, A]

        def move(buf: Array) -> Array:
            return scatter_rows(buf, _gather_rows(buf, src), start)

        return KVCache(tuple(map(move, self.k)), tuple(map(move, self.v)), start + jnp.asarray(count, jnp.int32))


def kv_cache_shardings(mesh: Mesh, layers: int, rules: Mapping[str, str | None] = DEFAULT_RULES) -> KVCache:
    """Shardings of a :class:`KVCache` of ``layers`` layers on ``mesh``: keys / values by :data:`KV_AXES`,
    lengths by :data:`LENGTHS_AXES`."""
    kv = NamedSharding(mesh, logical_to_spec(KV_AXES, rules))
    return KVCache((kv,) * layers, (kv,) * layers, NamedSharding(mesh, logical_to_spec(LENGTHS_AXES, rules)))


def _replace_at(items: tuple, index: int, value) -> tuple:
    return items[:index] + (value,) + items[index + 1 :]


def attention_mask(lengths: Array, block_mask: Array, size: int) -> Array:
    """Mask ``[B, T, S]`` for T new tokens written at ``lengths[b]`` in a cache of ``size`` slots: query t sees
    every committed slot ``s < lengths[b]`` and the new slot ``lengths[b] + u`` iff ``block_mask[b, t, u]``
    (``block_mask`` ``[T, T]`` or ``[B, T, T]``: causal for prefill/decode, ancestors for a tree)."""
    t = block_mask.shape[-1]
    block_mask = jnp.broadcast_to(block_mask, (lengths.shape[0], t, t))
    s = jnp.arange(size, dtype=jnp.int32)
    rel = s[None, :] - lengths[:, None]  # [B, S]
    in_block = (rel >= 0) & (rel < t)
    from_block = jnp.take_along_axis(
        block_mask, jnp.broadcast_to(jnp.clip(rel, 0, t - 1)[:, None, :], (lengths.shape[0], t, size)), axis=2
    )
    prefix = (rel < 0)[:, None, :]
    return prefix | (in_block[:, None, :] & from_block)


def causal_block(t: int) -> Array:
    return jnp.tril(jnp.ones((t, t), dtype=bool))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ContextCache:
    """A drafter's per-layer context keys/values (tuples of ``[B, K, S, H]``, as in :class:`KVCache`) and context
    lengths ``[B]`` (int32). Slot ``s`` holds absolute position ``s``: slots ``[0, lengths[b])`` are the committed
    positions whose target features the drafter has seen; the rest is scratch, where a draft writes and attends
    the block's own K/V (:func:`~sparkjax.engine.drafting.draft_block`) until the next append overwrites them."""

    k: tuple[Array, ...]
    v: tuple[Array, ...]
    lengths: Array

    @classmethod
    def zeros(cls, layers: int, batch: int, size: int, kv_heads: int, head_dim: int, dtype=jnp.float32) -> ContextCache:
        shape = (batch, kv_heads, size, head_dim)
        return cls(tuple(jnp.zeros(shape, dtype) for _ in range(layers)),
                   tuple(jnp.zeros(shape, dtype) for _ in range(layers)), jnp.zeros((batch,), jnp.int32))

    @property
    def size(self) -> int:
        return self.k[0].shape[2]

    def append(self, k: Array, v: Array, count: Array) -> ContextCache:
        """Writes token-major rows ``[L, B, A, K, H]`` at slots ``lengths[b] ..`` and advances ``lengths`` by
        ``count[b]`` (``<= A``); rows past the end are dropped."""
        new_k = tuple(scatter_rows(buf, k[i], self.lengths) for i, buf in enumerate(self.k))
        new_v = tuple(scatter_rows(buf, v[i], self.lengths) for i, buf in enumerate(self.v))
        lengths = self.lengths + jnp.broadcast_to(jnp.asarray(count, jnp.int32), self.lengths.shape)
        return ContextCache(new_k, new_v, lengths)

    def visible(self, queries: int) -> Array:
        """Mask ``[B, queries, S]``: slot ``s`` is visible iff ``s < lengths[b]``."""
        s = jnp.arange(self.size, dtype=jnp.int32)
        vis = s[None, :] < self.lengths[:, None]
        return jnp.broadcast_to(vis[:, None, :], (self.lengths.shape[0], queries, self.size))
