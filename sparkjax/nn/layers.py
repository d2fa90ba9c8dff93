"""Building blocks shared by the Qwen3 target and the drafters.

Weights are NNX ``Param``s whose ``axes`` metadata names their logical axes (:mod:`sparkjax.sharding`),
stored in JAX layout (``[in, ...out]``) with the head axes separate. Axis letters: B batch, T tokens, S key
slots, D model dim, N query heads, K kv heads, H head dim, F ffn dim, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..cache import attention_mask
from ..errors import ArgumentError

Array = jax.Array


def init_normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, std: float = 0.02) -> Array:
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class RMSNorm(nnx.Module):
    """Qwen3 RMSNorm: normalise in float32, cast back, then scale (the transformers order)."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype), axes=(None,))

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * y.astype(x.dtype)


class Linear(nnx.Module):
    """A dense layer ``x @ kernel (+ bias)`` whose kernel is ``[in, *out_shape]``."""

    def __init__(self, in_dim: int, out_shape: tuple[int, ...], axes: tuple[str | None, ...], *, use_bias: bool = False,
                 rngs: nnx.Rngs, dtype=jnp.float32):
        self.kernel = nnx.Param(init_normal(rngs, (in_dim, *out_shape), dtype), axes=axes)
        self.bias = nnx.Param(jnp.zeros(out_shape, dtype), axes=axes[1:]) if use_bias else None

    def __call__(self, x: Array) -> Array:
        y = jnp.tensordot(x, self.kernel[...], axes=((x.ndim - 1,), (0,)))
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class OutProj(nnx.Module):
    """Attention output projection from ``[..., N, H]`` back to ``[..., D]``; kernel ``[N, H, D]``."""

    def __init__(self, heads: int, head_dim: int, out_dim: int, *, use_bias: bool, rngs: nnx.Rngs, dtype):
        self.kernel = nnx.Param(init_normal(rngs, (heads, head_dim, out_dim), dtype), axes=("heads", None, "embed"))
        self.bias = nnx.Param(jnp.zeros((out_dim,), dtype), axes=("embed",)) if use_bias else None

    def __call__(self, x: Array) -> Array:
        y = jnp.einsum("...nh,nhd->...d", x, self.kernel[...])
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class Embed(nnx.Module):
    """A token embedding table ``[V, D]``; ``attend`` reuses it as a tied output head."""

    def __init__(self, vocab: int, dim: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.embedding = nnx.Param(init_normal(rngs, (vocab, dim), dtype), axes=("vocab", "embed"))

    def __call__(self, ids: Array) -> Array:
        return jnp.take(self.embedding[...], ids, axis=0)

    def attend(self, x: Array) -> Array:
        return jnp.einsum("...d,vd->...v", x, self.embedding[...])


class LMHead(nnx.Module):
    """An untied output head, stored like an embedding table ``[V, D]`` (transformers' layout)."""

    def __init__(self, vocab: int, dim: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.weight = nnx.Param(init_normal(rngs, (vocab, dim), dtype), axes=("vocab", "embed"))

    def __call__(self, x: Array) -> Array:
        return jnp.einsum("...d,vd->...v", x, self.weight[...])


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, dim: int, ffn: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.gate_proj = Linear(dim, (ffn,), ("embed", "ffn"), rngs=rngs, dtype=dtype)
        self.up_proj = Linear(dim, (ffn,), ("embed", "ffn"), rngs=rngs, dtype=dtype)
        self.down_proj = Linear(ffn, (dim,), ("ffn", "embed"), rngs=rngs, dtype=dtype)

    def __call__(self, x: Array) -> Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(positions: Array, head_dim: int, theta: float) -> tuple[Array, Array]:
    """Default rotary tables (float32, halves duplicated as in transformers) for integer ``positions``
    ``[...]``: cos, sin of shape ``[..., head_dim]``."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate-half rotary embedding. ``x``: ``[B, T, heads, H]``; ``cos``/``sin``: ``[B, T, H]``."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[..., None, :].astype(x.dtype)
    sin = sin[..., None, :].astype(x.dtype)
    return x * cos + rotated * sin


ATTENTION_IMPLS = ("auto", "einsum", "dpa", "blocked", "prefix", "split")  # the names :func:`attend` takes as ``impl``
BLOCK_SLOTS = 128  # the blocked path's default cache slots per chunk


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheMask:
    """The visibility of a cache part of :func:`attend`, kept in the structure the split path reads.

    Query ``t`` of sequence ``b`` sees every committed slot ``s < lengths[b]`` and, when ``block`` (``[T, T]``
    or ``[B, T, T]``) is given, the slot ``lengths[b] + u`` of the block row ``u`` iff ``block[b, t, u]``.
    :meth:`dense` is that mask as a ``[B, T, S]`` array (``block=None``: the committed slots only).
    """

    lengths: Array
    block: Array | None = None

    def dense(self, queries: int, size: int) -> Array:
        if self.block is not None:
            return attention_mask(self.lengths, self.block, size)
        vis = jnp.arange(size, dtype=jnp.int32)[None, :] < self.lengths[:, None]
        return jnp.broadcast_to(vis[:, None, :], (self.lengths.shape[0], queries, size))


def dense_mask(mask, queries: int, size: int):
    """``mask`` as an array: a :class:`CacheMask` made dense, anything else unchanged."""
    return mask.dense(queries, size) if isinstance(mask, CacheMask) else mask


def _dense_parts_call(fn: Callable, q: Array, parts: list) -> Array:
    return fn(q, [(k, v, dense_mask(m, q.shape[1], k.shape[2])) for k, v, m in parts])


def attention_fn(attention: str | Callable = "auto") -> Callable:
    """The attention a model call runs: :func:`attend` with ``impl=attention`` for a name; :func:`attend`
    itself or a ``functools.partial`` of it as given; any other callable with the signature of
    :func:`attend` (``fn(q, parts)``) as given, called with every mask as a dense array."""
    if not callable(attention):
        return functools.partial(attend, impl=attention)
    if attention is attend or (isinstance(attention, functools.partial) and attention.func is attend):
        return attention
    return functools.partial(_dense_parts_call, attention)


def attend(q: Array, parts: list[tuple[Array, Array, Array | CacheMask]], *, impl: str = "auto",
           block_slots: int = BLOCK_SLOTS) -> Array:
    """Grouped-query attention over one or several key/value sets sharing one softmax.

    ``q`` ``[B, T, N, H]``; each part is ``(k [B, K, S_i, H], v [B, K, S_i, H], mask)``: keys and values
    heads-major as :class:`~sparkjax.cache.KVCache` stores them, the mask a boolean array broadcastable to
    ``[B, T, S_i]`` (True = visible) or a :class:`CacheMask`. Scores and softmax in float32, scale
    ``H ** -0.5``; a fully masked row returns zeros.
    ``impl``: ``"einsum"`` (the reference), ``"dpa"`` (:func:`jax.nn.dot_product_attention`; cuDNN on a GPU
    for bf16 / f16), ``"blocked"`` (the first part in ``block_slots``-slot chunks with an online softmax, up
    to the last visible chunk), ``"prefix"`` (the reference over the shortest power-of-two prefix of the
    first part that holds every visible slot), ``"split"`` (see :func:`attend_split`) or ``"auto"``
    (``blocked`` on CPU, ``split`` elsewhere). Every path but ``split`` makes a :class:`CacheMask` dense.
    """
    if not isinstance(impl, str) or impl not in ATTENTION_IMPLS:
        raise ArgumentError(f"attend: impl={impl!r} is not one of {', '.join(ATTENTION_IMPLS)}")
    if impl == "auto":
        impl = "blocked" if jax.default_backend() == "cpu" else "split"
    if impl == "split":
        return attend_split(q, parts, block_slots=block_slots)
    b, t = q.shape[:2]
    parts = [(k, v, jnp.broadcast_to(dense_mask(m, t, k.shape[2]), (b, t, k.shape[2]))) for k, v, m in parts]
    if impl == "dpa":
        return _attend_dpa(q, parts)
    size = parts[0][0].shape[2]
    if impl == "blocked" and size > block_slots and size % block_slots == 0:
        return _attend_blocked(q, parts, block_slots)
    if impl == "prefix" and size > block_slots:
        return _attend_prefix(q, parts, block_slots)
    return _attend_einsum(q, parts)


def _live_slots(mask: Array) -> Array:
    """One past the last slot any query of ``mask [B, T, S]`` sees (0 if none)."""
    cols = jnp.any(mask, axis=(0, 1))
    return jnp.max(jnp.where(cols, jnp.arange(cols.shape[0], dtype=jnp.int32) + 1, 0))


def _attend_prefix(q: Array, parts: list[tuple[Array, Array, Array]], block_slots: int) -> Array:
    (k0, v0, m0), rest = parts[0], parts[1:]
    size = k0.shape[2]
    sizes = []
    n = size
    while n > block_slots // 2 and (not sizes or n < sizes[-1]):
        sizes.append(n)
        n = n // 2
    sizes = sizes[::-1]  # ascending, ending with the whole first part
    live = _live_slots(m0)
    index = jnp.sum(jnp.asarray(sizes[:-1], jnp.int32) < live)  # the first size that holds ``live``

    def branch(n: int):
        return lambda q, k0, v0, m0, rest: _attend_einsum(q, [(k0[:, :, :n], v0[:, :, :n], m0[..., :n]), *rest])

    return jax.lax.switch(index, [branch(n) for n in sizes], q, k0, v0, m0, rest)


def _ungrouped(out: Array) -> Array:
    """``[B, K, G, T, H] -> [B, T, N, H]``."""
    b, kh, g, t, h = out.shape
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, kh * g, h)


def _attend_einsum(q: Array, parts: list[tuple[Array, Array, Array]]) -> Array:
    b, t, n, h = q.shape
    kh = parts[0][0].shape[1]
    # q stays token-major [B, T, K, G, H] (XLA moves the queries, never the cache)
    qg = q.reshape(b, t, kh, n // kh, h)
    scores = [jnp.einsum("btkgh,bksh->bkgts", qg, k, preferred_element_type=jnp.float32) for k, _, _ in parts]
    scores = (scores[0] if len(scores) == 1 else jnp.concatenate(scores, axis=-1)) * (h**-0.5)
    masks = [m for _, _, m in parts]
    m = (masks[0] if len(masks) == 1 else jnp.concatenate(masks, axis=-1))[:, None, None, :, :]
    scores = jnp.where(m, scores, jnp.finfo(jnp.float32).min)
    probs = jnp.where(m, jax.nn.softmax(scores, axis=-1), 0.0)
    out = None
    offset = 0
    for k, v, _ in parts:
        s = k.shape[2]
        term = jnp.einsum("bkgts,bksh->bkgth", probs[..., offset : offset + s].astype(v.dtype), v)
        out = term if out is None else out + term
        offset += s
    return _ungrouped(out)


def _dpa_implementation(dtype) -> str:
    """cuDNN's fused kernel on a GPU for the half-precision dtypes it takes; XLA's otherwise."""
    if jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return "cudnn"
    return "xla"


def _attend_dpa(q: Array, parts: list[tuple[Array, Array, Array]]) -> Array:
    k = jnp.concatenate([jnp.swapaxes(k, 1, 2) for k, _, _ in parts], axis=1)  # [B, S, K, H]
    v = jnp.concatenate([jnp.swapaxes(v, 1, 2) for _, v, _ in parts], axis=1)
    mask = jnp.concatenate([m for _, _, m in parts], axis=-1)  # [B, T, S]
    out = jax.nn.dot_product_attention(
        q.astype(k.dtype), k, v, mask=mask[:, None], implementation=_dpa_implementation(k.dtype)
    )
    # a fully masked row gets a uniform average of the values there: the reference returns zeros
    return jnp.where(jnp.any(mask, axis=-1)[:, :, None, None], out, jnp.zeros((), out.dtype))


_NEG = float("-inf")


def _online_update(qg: Array, carry, k: Array, v: Array, vis: Array):
    """One online-softmax step of grouped queries ``qg [B, T, K, G, H]`` over keys/values ``[B, K, S, H]``
    visible where ``vis`` (broadcastable to ``[B, K, G, T, S]``); carry ``(max, sum, acc)`` in float32."""
    mx, l, acc = carry
    neg = jnp.float32(_NEG)
    s = jnp.einsum("btkgh,bksh->bkgts", qg, k, preferred_element_type=jnp.float32) * (qg.shape[-1] ** -0.5)
    s = jnp.where(vis, s, neg)
    new = jnp.maximum(mx, jnp.max(s, axis=-1))
    safe = jnp.where(new == neg, 0.0, new)  # rows with nothing visible yet: every term is 0
    p = jnp.exp(s - safe[..., None])
    corr = jnp.exp(mx - safe)
    l = l * corr + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkgts,bksh->bkgth", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return new, l, acc * corr[..., None] + pv


def _online_init(qg: Array):
    b, t, kh, g, h = qg.shape
    return (
        jnp.full((b, kh, g, t), _NEG, jnp.float32),
        jnp.zeros((b, kh, g, t), jnp.float32),
        jnp.zeros((b, kh, g, t, h), jnp.float32),
    )


def _chunked(qg: Array, carry, k0: Array, v0: Array, chunk_vis: Callable, trips: Array, c: int):
    """Online-softmax steps over ``c``-slot chunks ``0 .. trips - 1`` of ``k0``/``v0``; ``chunk_vis(at)``: the
    visibility of the chunk starting at slot ``at``."""

    def body(state):
        i, carry = state
        at = i * c
        k = jax.lax.dynamic_slice_in_dim(k0, at, c, axis=2)
        v = jax.lax.dynamic_slice_in_dim(v0, at, c, axis=2)
        return i + 1, _online_update(qg, carry, k, v, chunk_vis(at))

    return jax.lax.while_loop(lambda st: st[0] < trips, body, (jnp.int32(0), carry))[1]


def _attend_blocked(q: Array, parts: list[tuple[Array, Array, Array]], block_slots: int) -> Array:
    h = q.shape[-1]
    (k0, v0, m0), rest = parts[0], parts[1:]
    b, t, n, _ = q.shape
    kh = k0.shape[1]
    qg = q.reshape(b, t, kh, n // kh, h)
    c = block_slots
    # chunks past the last slot any query sees are skipped: the trip count follows the live length
    trips = (_live_slots(m0) + c - 1) // c

    def vis(at):
        return jax.lax.dynamic_slice_in_dim(m0, at, c, axis=2)[:, None, None, :, :]

    carry = _chunked(qg, _online_init(qg), k0, v0, vis, trips, c)
    for k, v, m in rest:
        carry = _online_update(qg, carry, k, v, m[:, None, None, :, :])
    _, l, acc = carry
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return _ungrouped(out.astype(v0.dtype))


# ----------------------------------------------------------------------------- split attention
# A piece is (out [B, K, G, T, H], lse [B, K, G, T]), both float32: a normalised attention over some keys and
# the log-sum-exp of its scaled scores (-inf and zeros for a row that sees none of them).


def _piece(carry):
    mx, l, acc = carry
    seen = l > 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
    lse = jnp.where(seen, jnp.where(jnp.isfinite(mx), mx, 0.0) + jnp.log(jnp.where(seen, l, 1.0)), _NEG)
    return out, lse


def _merge(pieces):
    """The piece over the union of the pieces' keys, from their outputs and log-sum-exps (exact)."""
    if len(pieces) == 1:
        return pieces[0]
    lses = jnp.stack([lse for _, lse in pieces])
    top = jnp.max(lses, axis=0)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(lses - top)  # 0 for a piece a row does not see
    total = jnp.sum(w, axis=0)
    seen = total > 0
    out = sum(w[i][..., None] * o for i, (o, _) in enumerate(pieces))
    out = jnp.where(seen[..., None], out / jnp.where(seen, total, 1.0)[..., None], 0.0)
    return out, jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), _NEG)


def _prefix_xla(qg: Array, k: Array, v: Array, lengths: Array, block_slots: int):
    """The piece of slots ``[0, lengths[b])``: online softmax in ``block_slots`` chunks up to the longest
    prefix (one step over all slots when they are not a whole number of chunks); no mask array."""
    size, c = k.shape[2], block_slots

    def vis(at, n):
        return ((at + jnp.arange(n, dtype=jnp.int32))[None, :] < lengths[:, None])[:, None, None, None, :]

    if size > c and size % c == 0:
        trips = (jnp.max(lengths) + c - 1) // c
        carry = _chunked(qg, _online_init(qg), k, v, lambda at: vis(at, c), trips, c)
    else:
        carry = _online_update(qg, _online_init(qg), k, v, vis(0, size))
    return _piece(carry)


def _cudnn_usable(dtype, head_dim: int) -> bool:
    """Whether this process can stage out cuDNN's flash attention (its library found) for this dtype."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) or head_dim % 8 or head_dim > 256:
        return False
    try:
        from jax._src.cudnn import fused_attention_stablehlo as cudnn

        cudnn.check_cudnn_version()
    except Exception:  # no CUDA plugin or no cuDNN library on this machine
        return False
    return True


def _cudnn_piece(qg: Array, k: Array, v: Array, lengths: Array, mask: Array | None):
    """The piece of cuDNN's flash attention over slots ``[0, lengths[b])`` of the heads-major cache read in
    place (layout ``BNTH``), with key lengths and, when given, the ``[B, T, S]`` visibility ``mask`` within
    them; it returns the log-sum-exp too."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    b, t, kh, g, h = qg.shape
    qn = jnp.transpose(qg, (0, 2, 3, 1, 4)).reshape(b, kh * g, t, h).astype(k.dtype)  # [B, N, T, H], small
    out, lse = cudnn.dot_product_attention(
        qn, k, v, mask=None if mask is None else mask[:, None], q_seqlen=jnp.full((b,), t, jnp.int32),
        kv_seqlen=lengths.astype(jnp.int32), scale=h**-0.5, mask_type=cudnn.MaskType.PADDING, qkv_layout="BNTH",
        return_residual=True,
    )
    seen = (lengths > 0)[:, None] if mask is None else jnp.any(mask, axis=-1)  # [B, T] (or [B, 1])
    seen = seen[:, None, None, :]
    out = jnp.where(seen[..., None], out.reshape(b, kh, g, t, h).astype(jnp.float32), 0.0)
    lse = jnp.where(seen, lse.reshape(b, kh, g, t).astype(jnp.float32), _NEG)
    return out, lse


def _prefix_piece(qg: Array, k: Array, v: Array, lengths: Array, block_slots: int):
    if not _cudnn_usable(k.dtype, qg.shape[-1]):
        return _prefix_xla(qg, k, v, lengths, block_slots)
    fn = functools.partial(_prefix_xla, block_slots=block_slots)
    cuda = functools.partial(_cudnn_piece, mask=None)
    return jax.lax.platform_dependent(qg, k, v, lengths, cuda=cuda, default=fn)


def _cache_pieces(qg: Array, k: Array, v: Array, lengths: Array, block: Array, block_slots: int):
    """The committed prefix and the block's rows (written at slots ``lengths[b] ..``) as one piece."""
    b, t = qg.shape[:2]
    size, u = k.shape[2], block.shape[-1]

    def split(qg, k, v, lengths, block):
        slots = lengths[:, None] + jnp.arange(u, dtype=jnp.int32)[None, :]  # [B, U]
        # block row u is visible where the mask says and its slot lies inside the cache
        mask = jnp.broadcast_to(block, (b, t, u)) & (slots < size)[:, None, :]
        rows = _masked_piece(qg, _block_rows(k, slots), _block_rows(v, slots), mask)
        return _merge([_prefix_xla(qg, k, v, lengths, block_slots), rows])

    # a block that is all True on the host (a drafter's block) needs no mask: the key lengths bound it
    full = isinstance(block, np.ndarray) and bool(block.all())

    def whole(qg, k, v, lengths, block):  # one fused call: the prefix and the block's rows under a dense mask
        mask = None if full else attention_mask(lengths, block, size)
        return _cudnn_piece(qg, k, v, jnp.minimum(lengths + u, size), mask)

    if not _cudnn_usable(k.dtype, qg.shape[-1]):
        return split(qg, k, v, lengths, block)
    return jax.lax.platform_dependent(qg, k, v, lengths, block, cuda=whole, default=split)


def _masked_piece(qg: Array, k: Array, v: Array, mask: Array):
    return _piece(_online_update(qg, _online_init(qg), k, v, mask[:, None, None, :, :]))


def _block_rows(buf: Array, slots: Array) -> Array:
    """Slots ``slots [B, U]`` (clipped) of a heads-major ``buf [B, K, S, H]`` as ``[B, K, U, H]``."""
    return jax.vmap(lambda x, idx: x.at[:, idx].get(mode="clip"))(buf, slots)


def attend_split(q: Array, parts: list[tuple[Array, Array, Array | CacheMask]], *,
                 block_slots: int = BLOCK_SLOTS) -> Array:
    """:func:`attend` as separate pieces merged exactly through their log-sum-exps.

    A :class:`CacheMask` part reads the heads-major cache in place: its prefix ``[0, lengths[b])`` unmasked (cuDNN
    with key lengths on a GPU for bf16 / f16, else an online softmax in ``block_slots`` chunks) and, with a
    ``block``, the block's rows at slots ``lengths[b] ..`` (on such a GPU one cuDNN call under the dense mask, else
    a masked piece merged with the prefix). Any other part is one masked piece.
    """
    b, t, n, h = q.shape
    kh = parts[0][0].shape[1]
    qg = q.reshape(b, t, kh, n // kh, h)
    pieces = []
    for k, v, m in parts:
        size = k.shape[2]
        if not isinstance(m, CacheMask):
            pieces.append(_masked_piece(qg, k, v, jnp.broadcast_to(m, (b, t, size))))
            continue
        lengths = jnp.broadcast_to(jnp.asarray(m.lengths, jnp.int32), (b,))
        if m.block is None:
            pieces.append(_prefix_piece(qg, k, v, lengths, block_slots))
        else:
            pieces.append(_cache_pieces(qg, k, v, lengths, m.block, block_slots))
    return _ungrouped(_merge(pieces)[0].astype(parts[0][1].dtype))


class AttentionProjections(nnx.Module):
    """The q/k/v/o projections and q/k norms of a Qwen3 attention layer (no attention pattern)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, dtype=jnp.float32):
        d, n, k, h = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(d, (n, h), ("embed", "heads", None), use_bias=bias, rngs=rngs, dtype=dtype)
        self.k_proj = Linear(d, (k, h), ("embed", "kv_heads", None), use_bias=bias, rngs=rngs, dtype=dtype)
        self.v_proj = Linear(d, (k, h), ("embed", "kv_heads", None), use_bias=bias, rngs=rngs, dtype=dtype)
        self.o_proj = OutProj(n, h, d, use_bias=bias, rngs=rngs, dtype=dtype)
        self.q_norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)

    def queries(self, x: Array, cos: Array, sin: Array) -> Array:
        return apply_rope(self.q_norm(self.q_proj(x)), cos, sin)

    def keys_values(self, x: Array, cos: Array, sin: Array) -> tuple[Array, Array]:
        return apply_rope(self.k_norm(self.k_proj(x)), cos, sin), self.v_proj(x)
