"""Building blocks shared by the Qwen3 target and the drafters.

Weights are NNX ``Param``s whose ``axes`` metadata names their logical axes (:mod:`sparkjax.sharding`),
stored in JAX layout (``[in, ...out]``) with the head axes separate. Axis letters: B batch, T tokens, S key
slots, D model dim, N query heads, K kv heads, H head dim, F ffn dim, V vocab.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

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

    def __init__(
        self,
        in_dim: int,
        out_shape: tuple[int, ...],
        axes: tuple[str | None, ...],
        *,
        use_bias: bool = False,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
    ):
        self.kernel = nnx.Param(init_normal(rngs, (in_dim, *out_shape), dtype), axes=axes)
        self.bias = nnx.Param(jnp.zeros(out_shape, dtype), axes=axes[1:]) if use_bias else None

    def __call__(self, x: Array) -> Array:
        kernel = self.kernel[...]
        y = jnp.tensordot(x, kernel, axes=((x.ndim - 1,), (0,)))
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


ATTENTION_IMPLS = ("auto", "einsum", "dpa", "blocked", "prefix")  # the names :func:`attend` takes as ``impl``
BLOCK_SLOTS = 128  # the blocked path's default cache slots per chunk


def attention_fn(attention: str | Callable = "auto") -> Callable:
    """The attention a model call runs: ``attention`` itself when it is a callable with the signature of
    :func:`attend` (``fn(q, parts)``), else :func:`attend` with ``impl=attention``."""
    return attention if callable(attention) else functools.partial(attend, impl=attention)


def attend(q: Array, parts: list[tuple[Array, Array, Array]], *, impl: str = "auto",
           block_slots: int = BLOCK_SLOTS) -> Array:
    """Grouped-query attention over one or several key/value sets sharing one softmax.

    ``q`` ``[B, T, N, H]``; each part is ``(k [B, K, S_i, H], v [B, K, S_i, H], mask [B, T, S_i])``: keys and
    values heads-major as :class:`~sparkjax.cache.KVCache` stores them, the mask broadcastable (True =
    visible). Scores and softmax in float32, scale ``H ** -0.5``; a fully masked row returns zeros.
    ``impl``: ``"einsum"`` (the reference), ``"dpa"`` (:func:`jax.nn.dot_product_attention`; cuDNN on a GPU
    for bf16 / f16), ``"blocked"`` (the first part in ``block_slots``-slot chunks with an online softmax, up
    to the last visible chunk), ``"prefix"`` (the reference over the shortest power-of-two prefix of the
    first part that holds every visible slot) or ``"auto"`` (``blocked`` on CPU, ``einsum`` elsewhere).
    """
    if not isinstance(impl, str) or impl not in ATTENTION_IMPLS:
        raise ArgumentError(f"attend: impl={impl!r} is not one of {', '.join(ATTENTION_IMPLS)}")
    if impl == "auto":
        impl = "blocked" if jax.default_backend() == "cpu" else "einsum"
    b, t = q.shape[:2]
    parts = [(k, v, jnp.broadcast_to(m, (b, t, k.shape[2]))) for k, v, m in parts]
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


def _attend_blocked(q: Array, parts: list[tuple[Array, Array, Array]], block_slots: int) -> Array:
    h = q.shape[-1]
    (k0, v0, m0), rest = parts[0], parts[1:]
    b, t, n, _ = q.shape
    kh = k0.shape[1]
    g = n // kh
    qg = q.reshape(b, t, kh, g, h)
    scale = h**-0.5
    neg = jnp.float32(-jnp.inf)

    def update(carry, k, v, mask):
        mx, l, acc = carry
        s = jnp.einsum("btkgh,bksh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
        vis = mask[:, None, None, :, :]
        s = jnp.where(vis, s, neg)
        new = jnp.maximum(mx, jnp.max(s, axis=-1))
        safe = jnp.where(new == neg, 0.0, new)  # rows with nothing visible yet: every term is 0
        p = jnp.exp(s - safe[..., None])
        corr = jnp.exp(mx - safe)
        l = l * corr + jnp.sum(p, axis=-1)
        pv = jnp.einsum("bkgts,bksh->bkgth", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return new, l, acc * corr[..., None] + pv

    c = block_slots
    # chunks past the last slot any query sees are skipped: the trip count follows the live length
    trips = (_live_slots(m0) + c - 1) // c

    def body(state):
        i, carry = state
        at = i * c
        k = jax.lax.dynamic_slice_in_dim(k0, at, c, axis=2)
        v = jax.lax.dynamic_slice_in_dim(v0, at, c, axis=2)
        m = jax.lax.dynamic_slice_in_dim(m0, at, c, axis=2)
        return i + 1, update(carry, k, v, m)

    init = (
        jnp.full((b, kh, g, t), neg, jnp.float32),
        jnp.zeros((b, kh, g, t), jnp.float32),
        jnp.zeros((b, kh, g, t, h), jnp.float32),
    )
    _, carry = jax.lax.while_loop(lambda st: st[0] < trips, body, (jnp.int32(0), init))
    for k, v, m in rest:
        carry = update(carry, k, v, m)
    _, l, acc = carry
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return _ungrouped(out.astype(v0.dtype))


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
