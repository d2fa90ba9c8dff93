"""DSpark and DFlash block drafters as Flax NNX modules.

A drafter reads *context features* (the target hidden states ``hidden_states[l + 1]`` for ``l`` in
``target_layer_ids``, concatenated: ``F = len(ids) * D``), projected once (``hidden_norm(fc(features))``) and
keyed per layer at their own positions (the rows the :class:`~sparkjax.cache.ContextCache` keeps), and a block
``[x_start, MASK, ..., MASK]`` whose queries see the context rows its mask allows and the whole block. A DSpark
drafter owns ``embed_tokens`` / ``lm_head`` and may have a Markov head (``W2 . f(prev)`` added to the base
logits, ``f(prev) = W1[prev]`` or gated by ``sigmoid(gate_proj([h ; W1[prev]]))``) and a confidence head
(``Linear([h (; W1[prev])] -> 1)``); a DFlash drafter uses the target's (pass ``target=``). Parameter paths
mirror the DeepSpec checkpoint keys (:data:`sparkjax.io.keymaps.DRAFTER_KEYS`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from ..cache import ContextCache, scatter_rows
from ..config import DrafterConfig
from ..errors import ArgumentError
from .layers import CacheMask, Embed, Linear, LMHead, RMSNorm, apply_rope, attention_fn, init_normal, rope_cos_sin
from .qwen3 import DecoderLayer

Array = jax.Array


class Table(nnx.Module):
    """A ``[V, R]`` table stored like a torch ``nn.Embedding`` / bias-free ``nn.Linear(R -> V)`` weight."""

    def __init__(self, rows: int, dim: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.weight = nnx.Param(init_normal(rngs, (rows, dim), dtype), axes=("vocab", None))


class MarkovHead(nnx.Module):
    """Low-rank first-order Markov correction ``bias(prev) = W2 . f(prev)``: ``markov_w1`` ``[V, R]``,
    ``markov_w2`` ``[V, R]`` (torch ``Linear(R -> V)`` weight), gated: ``gate_proj`` ``Linear(D + R -> R)``."""

    def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        r = cfg.markov_rank
        self.gated = cfg.markov_head_type == "gated"
        self.markov_w1 = Table(cfg.vocab_size, r, rngs=rngs, dtype=dtype)
        self.markov_w2 = Table(cfg.vocab_size, r, rngs=rngs, dtype=dtype)
        self.gate_proj = (
            Linear(cfg.hidden_size + r, (r,), ("embed", None), use_bias=True, rngs=rngs, dtype=dtype)
            if self.gated
            else None
        )

    def prev_embeddings(self, prev: Array) -> Array:
        """``W1[prev]``: ``[...] -> [..., R]``."""
        return jnp.take(self.markov_w1.weight[...], prev, axis=0)

    def features(self, hidden: Array, prev: Array) -> Array:
        """Parent features ``f(prev)`` ``[..., C, R]`` for hidden ``[..., D]`` and prev ids ``[..., C]``."""
        e = self.prev_embeddings(prev)
        if not self.gated:
            return e
        d = hidden.shape[-1]
        kernel = self.gate_proj.kernel[...]
        from_h = jnp.tensordot(hidden, kernel[:d], axes=((hidden.ndim - 1,), (0,)))  # [..., R]
        from_e = jnp.tensordot(e, kernel[d:], axes=((e.ndim - 1,), (0,)))  # [..., C, R]
        gate = jax.nn.sigmoid(from_h[..., None, :] + from_e + self.gate_proj.bias[...])
        return gate.astype(e.dtype) * e

    def bias(self, feats: Array) -> Array:
        """``W2 . f`` accumulated in float32: ``[..., R] -> [..., V]``."""
        return jnp.einsum("...r,vr->...v", feats, self.markov_w2.weight[...], preferred_element_type=jnp.float32)


class ConfidenceHead(nnx.Module):
    """``proj``: ``Linear(D (+ R) -> 1)`` with bias, as DeepSpec's ``confidence_head.proj``."""

    def __init__(self, in_dim: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.proj = Linear(in_dim, (1,), ("embed", None), use_bias=True, rngs=rngs, dtype=dtype)

    def __call__(self, x: Array) -> Array:
        return self.proj(x)[..., 0].astype(jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockOutput:
    """``hidden`` ``[B, Q, D]`` after the final norm; ``layers`` per-layer outputs ``[L, B, Q, D]`` or None;
    ``ctx_k`` / ``ctx_v`` the context buffers with the block's rows written (:meth:`Drafter.run_block` with a
    :class:`~sparkjax.nn.layers.CacheMask` that has a ``block``), else None."""

    hidden: Array
    layers: Array | None = None
    ctx_k: tuple[Array, ...] | None = None
    ctx_v: tuple[Array, ...] | None = None


def _block_in_cache(ctx_mask) -> bool:
    """Whether a drafter block goes into the context buffers: a :class:`CacheMask` with a ``block``."""
    return isinstance(ctx_mask, CacheMask) and ctx_mask.block is not None


class DrafterLayer(DecoderLayer):
    """A Qwen3 decoder layer (same weights and names) whose keys/values are ``[context ; block]``."""

    def context_kv(self, ctx: Array, cos: Array, sin: Array) -> tuple[Array, Array]:
        """Keys/values of projected context rows ``[B, S, D]`` (no input_layernorm), RoPE'd at their positions."""
        return self.self_attn.keys_values(ctx, cos, sin)

    def block(self, x: Array, cos: Array, sin: Array, ctx_k: Array, ctx_v: Array, ctx_mask: Array, block_mask: Array,
              attention: Callable) -> tuple[Array, Array, Array]:
        """The layer over the block; returns ``(x, ctx_k, ctx_v)``. A :class:`CacheMask` ``ctx_mask`` with a
        ``block`` first writes the block's keys/values into the context buffers at ``lengths`` and attends
        them there as one part (``block_mask`` unused); otherwise the block is a second part."""
        h = self.input_layernorm(x)
        q = self.self_attn.queries(h, cos, sin)
        k, v = self.self_attn.keys_values(h, cos, sin)
        if _block_in_cache(ctx_mask):
            ctx_k, ctx_v = (scatter_rows(buf, rows, ctx_mask.lengths) for buf, rows in ((ctx_k, k), (ctx_v, v)))
            parts = [(ctx_k, ctx_v, ctx_mask)]
        else:
            parts = [(ctx_k, ctx_v, ctx_mask), (jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), block_mask)]
        x = x + self.self_attn.o_proj(attention(q, parts))
        return x + self.mlp(self.post_attention_layernorm(x)), ctx_k, ctx_v


class Drafter(nnx.Module):
    """A DSpark (``config.kind == "dspark"``) or DFlash (``"dflash"``) block drafter; a DFlash drafter's
    ``embed_tokens`` / ``lm_head`` / heads are None."""

    def __init__(self, config: DrafterConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.config = config
        c = config
        own_io = c.kind == "dspark"
        self.embed_tokens = Embed(c.vocab_size, c.hidden_size, rngs=rngs, dtype=dtype) if own_io else None
        self.layers = nnx.List([DrafterLayer(c, rngs=rngs, dtype=dtype) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.fc = Linear(c.feature_size, (c.hidden_size,), (None, "embed"), rngs=rngs, dtype=dtype)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.lm_head = LMHead(c.vocab_size, c.hidden_size, rngs=rngs, dtype=dtype) if own_io else None
        self.markov_head = MarkovHead(c, rngs=rngs, dtype=dtype) if c.has_markov else None
        conf_in = c.hidden_size + (c.markov_rank if c.confidence_head_with_markov else 0)
        self.confidence_head = ConfidenceHead(conf_in, rngs=rngs, dtype=dtype) if c.has_confidence else None

    @property
    def dtype(self):
        return self.norm.weight.get_value().dtype

    def _check_target(self, target, what: str):
        if self.config.kind == "dflash" and target is None:
            raise ArgumentError(f"{what}: a DFlash drafter uses the target's embedding and LM head; pass target=")

    def embed(self, tokens: Array, target=None) -> Array:
        """Block input embeddings ``[B, Q, D]`` (the target's table, scaled, for DFlash)."""
        if self.embed_tokens is not None:
            return self.embed_tokens(tokens)
        self._check_target(target, "embed")
        x = target.embed_tokens(tokens).astype(self.dtype)
        scale = self.config.input_embedding_scale
        return x if scale == 1.0 else x * jnp.asarray(scale, x.dtype)

    def logits(self, hidden: Array, target=None) -> Array:
        """Base logits ``[..., V]`` in float32 from block hidden states."""
        if self.lm_head is not None:
            return self.lm_head(hidden).astype(jnp.float32)
        self._check_target(target, "logits")
        out = target.logits(hidden.astype(target.dtype)).astype(jnp.float32)
        c = self.config
        if c.output_multiplier != 1.0:
            out = out * c.output_multiplier
        if c.final_logit_softcapping is not None:
            out = jnp.tanh(out / c.final_logit_softcapping) * c.final_logit_softcapping
        return out

    def project_context(self, features: Array) -> Array:
        """``hidden_norm(fc(features))``: ``[B, S, F] -> [B, S, D]``."""
        return self.hidden_norm(self.fc(features.astype(self.dtype)))

    def context_kv(self, features: Array, positions: Array) -> tuple[Array, Array]:
        """Per-layer context keys/values ``[L, B, S, K, H]`` (token-major rows) of features ``[B, S, F]``
        at ``positions [B, S]``. After :meth:`join_context_projections`, on a GPU, one GEMM over the joined
        kernel."""
        ctx = self.project_context(features)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        if getattr(self, "joined_context_kernel", None) is None:
            return self.context_kv_per_layer(ctx, cos, sin)
        return jax.lax.platform_dependent(ctx, cos, sin, cuda=self.context_kv_joined, default=self.context_kv_per_layer)

    def context_kv_per_layer(self, ctx: Array, cos: Array, sin: Array) -> tuple[Array, Array]:
        """:meth:`context_kv` of projected rows ``ctx [B, S, D]``, one GEMM per layer and projection."""
        kv = [layer.context_kv(ctx, cos, sin) for layer in self.layers]
        return jnp.stack([k for k, _ in kv]), jnp.stack([v for _, v in kv])

    def context_kv_joined(self, ctx: Array, cos: Array, sin: Array) -> tuple[Array, Array]:
        """:meth:`context_kv_per_layer` as one GEMM over the kernel of :meth:`join_context_projections`."""
        y = jnp.tensordot(ctx, self.joined_context_kernel[...], axes=((2,), (0,)))  # [B, S, L, 2, K, H]
        if self.joined_context_bias is not None:
            y = y + self.joined_context_bias[...]
        ks = [apply_rope(layer.self_attn.k_norm(y[:, :, i, 0]), cos, sin) for i, layer in enumerate(self.layers)]
        return jnp.stack(ks), jnp.moveaxis(y[:, :, :, 1], 2, 0)

    def join_context_projections(self) -> None:
        """Joins every layer's context key/value projection into one kernel ``[D, L, 2, K, H]`` (and bias) that
        :meth:`context_kv` reads on a GPU: the join is made here, once, where a program calls it before its
        loop (inside the loop XLA merges the GEMMs by joining their kernels again on every iteration)."""
        attn = [layer.self_attn for layer in self.layers]
        kernel = jnp.stack([jnp.stack([a.k_proj.kernel[...], a.v_proj.kernel[...]], 1) for a in attn], 1)
        bias = None
        if attn[0].k_proj.bias is not None:
            bias = nnx.Variable(jnp.stack([jnp.stack([a.k_proj.bias[...], a.v_proj.bias[...]]) for a in attn]))
        self.joined_context_kernel, self.joined_context_bias = nnx.Variable(kernel), bias

    def init_context(self, batch: int, size: int) -> ContextCache:
        """An empty context cache of ``size`` slots (slot s holds absolute position s)."""
        c = self.config
        return ContextCache.zeros(c.num_hidden_layers, batch, size, c.num_key_value_heads, c.head_dim, self.dtype)

    def run_block(self, x: Array, positions: Array, ctx_k: Array, ctx_v: Array, ctx_mask: Array, block_mask: Array, *,
                  return_layers: bool = False, attention: str | Callable = "auto") -> BlockOutput:
        """The decoder stack over block embeddings ``x [B, Q, D]`` at ``positions [B, Q]``: context rows
        ``ctx_k``/``ctx_v`` per layer ``[B, K, S, H]`` (heads-major; a tuple, or stacked ``[L, B, K, S, H]``),
        ``ctx_mask`` ``[B, Q, S]`` (or a :class:`~sparkjax.nn.layers.CacheMask` of the context lengths) and
        ``block_mask`` ``[B, Q, Q]`` (or broadcastable). ``attention``: as in
        :meth:`sparkjax.nn.qwen3.Qwen3.__call__`. A ``CacheMask`` with a ``block`` (the block's visibility)
        writes the block's keys/values into the context buffers at ``lengths`` and attends them there: the
        buffers need ``Q`` scratch slots past every length, and come back in the output."""
        fn = attention_fn(attention)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        outs, new_k, new_v = [], [], []
        for i, layer in enumerate(self.layers):
            x, k, v = layer.block(x, cos, sin, ctx_k[i], ctx_v[i], ctx_mask, block_mask, fn)
            outs.append(x)
            new_k.append(k)
            new_v.append(v)
        return BlockOutput(self.norm(x), jnp.stack(outs) if return_layers else None,
                           *((tuple(new_k), tuple(new_v)) if _block_in_cache(ctx_mask) else (None, None)))

    def __call__(self, features: Array, feature_positions: Array, tokens: Array, positions: Array, mask: Array, *,
                 target=None, return_layers: bool = False, attention: str | Callable = "auto") -> BlockOutput:
        """Cache-free forward (training): context ``features [B, S, F]`` at ``feature_positions [B, S]``,
        block ``tokens [B, Q]`` at ``positions [B, Q]``, boolean ``mask [B, Q, S + Q]`` (context columns, then
        block slots; True = visible). Returns the final-normed block hidden states ``[B, Q, D]``."""
        s = features.shape[1]
        if mask.shape[-1] != s + tokens.shape[1]:
            raise ArgumentError(f"mask: last axis has {mask.shape[-1]} columns, expected S + Q = {s} + "
                                f"{tokens.shape[1]}")
        k, v = self.context_kv(features, feature_positions)
        k, v = jnp.swapaxes(k, 2, 3), jnp.swapaxes(v, 2, 3)  # heads-major, as run_block takes them
        x = self.embed(tokens, target)
        return self.run_block(x, positions, k, v, mask[..., :s], mask[..., s:], return_layers=return_layers,
                              attention=attention)
