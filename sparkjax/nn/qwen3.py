"""The Qwen3 decoder (the target model) as Flax NNX modules: one forward for prefill, decode, tree
verification and training, returning logits and any requested hidden states with transformers'
``hidden_states[l + 1]`` indexing (``l = -1``: the embedding output; ``l = L - 1``: the final-normed state).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from ..cache import KVCache, causal_block
from ..config import Qwen3Config
from ..errors import ArgumentError
from .layers import MLP, AttentionProjections, CacheMask, Embed, LMHead, RMSNorm, attend, attention_fn, rope_cos_sin

Array = jax.Array


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = AttentionProjections(cfg, rngs=rngs, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, dtype=dtype)

    def __call__(
        self, x: Array, cos: Array, sin: Array, mask: Array | CacheMask, cache: KVCache | None, index: int,
        fresh: bool = False, attention=attend,
    ) -> tuple[Array, KVCache | None]:
        h = self.input_layernorm(x)
        q = self.self_attn.queries(h, cos, sin)
        k, v = self.self_attn.keys_values(h, cos, sin)
        if cache is not None:
            cache = cache.write_layer(index, k, v)
        if cache is not None and not fresh:
            k, v = cache.k[index], cache.v[index]  # heads-major [B, K, S, H]
        else:  # no cache, or a fresh one holding nothing before the block: attend to the block alone
            k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
        x = x + self.self_attn.o_proj(attention(q, [(k, v, mask)]))
        return x + self.mlp(self.post_attention_layernorm(x)), cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Qwen3Output:
    """``logits`` ``[B, T or K, V]`` (None if not asked), ``hidden`` a tuple ``[B, T, D]`` per requested id."""

    logits: Array | None
    hidden: tuple[Array, ...]
    cache: KVCache | None


class Qwen3(nnx.Module):
    """``Qwen3ForCausalLM``: embedding, decoder layers, final norm, tied or untied LM head."""

    def __init__(self, config: Qwen3Config, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.config = config
        self.embed_tokens = Embed(config.vocab_size, config.hidden_size, rngs=rngs, dtype=dtype)
        self.layers = nnx.List([DecoderLayer(config, rngs=rngs, dtype=dtype) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        tied = config.tie_word_embeddings
        self.lm_head = None if tied else LMHead(config.vocab_size, config.hidden_size, rngs=rngs, dtype=dtype)

    @property
    def dtype(self):
        return self.embed_tokens.embedding.get_value().dtype

    def logits(self, h: Array) -> Array:
        """LM-head logits of final-normed hidden states."""
        if self.lm_head is None:
            return self.embed_tokens.attend(h)
        return self.lm_head(h)

    def init_cache(self, batch: int, size: int) -> KVCache:
        c = self.config
        return KVCache.zeros(c.num_hidden_layers, batch, size, c.num_key_value_heads, c.head_dim, self.dtype)

    def __call__(self, tokens: Array, positions: Array, *, cache: KVCache | None = None, mask: Array | None = None,
                 hidden_layers: tuple[int, ...] = (), logits_at: Array | None = None, compute_logits: bool = True,
                 fresh_cache: bool = False, attention: str | Callable = "auto") -> Qwen3Output:
        """Runs the decoder over new tokens ``[B, T]`` at ``positions`` ``[B, T]``.

        With a cache, the new keys/values are written at ``cache.lengths`` (left for the caller to advance)
        and every query also sees the committed prefix. ``mask``: the ``[T, T]`` or ``[B, T, T]`` visibility
        among the new tokens (True = visible, row = query; causal when omitted). ``logits_at`` ``[B, K]``
        restricts logits to K token indices per sequence. ``fresh_cache=True`` promises an empty cache
        (prefill): attention runs over the new tokens only, the keys/values are still written.
        ``attention``: an ``impl`` of :func:`~sparkjax.nn.layers.attend` or a callable with its signature.
        """
        n_layers = self.config.num_hidden_layers
        for lid in hidden_layers:
            if not -1 <= lid < n_layers:
                raise ArgumentError(f"hidden_layers: layer id {lid} is outside [-1, {n_layers - 1}]")
        b, t = tokens.shape
        block = causal_block(t) if mask is None else mask
        if cache is None or fresh_cache:
            full_mask = jnp.broadcast_to(block, (b, t, t))
        else:
            full_mask = CacheMask(cache.lengths, block)  # the committed prefix, then the block's rows
        fn = attention_fn(attention)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        x = self.embed_tokens(tokens)
        states = {-1: x}
        for i, layer in enumerate(self.layers):
            x, cache = layer(x, cos, sin, full_mask, cache, i, fresh_cache, fn)
            states[i] = x
        h = self.norm(x)
        states[n_layers - 1] = h
        logits = None
        if compute_logits:
            if logits_at is not None:
                h = jnp.take_along_axis(h, logits_at[..., None].astype(jnp.int32), axis=1)
            logits = self.logits(h)
        return Qwen3Output(logits, tuple(states[lid] for lid in hidden_layers), cache)
