"""Where a greedy decode step's time goes: sparkjax's step against the bare weight reads.

    python eval/profile_decode_step.py

Builds a random Qwen3 (8 layers, d=512, vocab 8192, float32), measures the steady-state time of
one decode step of ``sparkjax.generate`` (difference of a 192- and a 64-token run over 128
steps), then the same step with attention switched off, and a loop of bare matrix-vector
products that reads exactly the same weights (the memory-bandwidth floor of a step).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import sparkjax.nn.qwen3 as qwen3
from sparkjax.config import Qwen3Config
from sparkjax.engine import generate


def step_ms(model, prompt) -> float:
    times = {}
    for n in (64, 192):
        generate(model, None, prompt, max_new_tokens=n)  # compile
        t0 = time.perf_counter()
        generate(model, None, prompt, max_new_tokens=n)
        times[n] = time.perf_counter() - t0
    return (times[192] - times[64]) / 128 * 1e3


def matvec_floor_ms(cfg: Qwen3Config) -> float:
    d, f, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * cfg.head_dim
    rng = np.random.default_rng(0)
    w_qkv = jnp.asarray(rng.standard_normal((d, d + 2 * kv), np.float32))
    w_o = jnp.asarray(rng.standard_normal((d, d), np.float32))
    w_up = jnp.asarray(rng.standard_normal((d, 2 * f), np.float32))
    w_down = jnp.asarray(rng.standard_normal((f, d), np.float32))
    emb = jnp.asarray(rng.standard_normal((cfg.vocab_size, d), np.float32))

    @jax.jit
    def loop(x):
        def body(_, x):
            for _ in range(cfg.num_hidden_layers):
                x = x + (x @ w_qkv)[:, :d] @ w_o * 1e-3
                h = x @ w_up
                x = x + (h[:, :f] * h[:, f:]) @ w_down * 1e-3
            return x + (x @ emb.T)[:, :d] * 1e-6
        return jax.lax.fori_loop(0, 128, body, x)

    x = jnp.ones((1, d), jnp.float32)
    loop(x).block_until_ready()
    t0 = time.perf_counter()
    loop(x).block_until_ready()
    return (time.perf_counter() - t0) / 128 * 1e3


def main() -> None:
    cfg = Qwen3Config(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    model = qwen3.Qwen3(cfg, rngs=nnx.Rngs(0))
    prompt = [list(range(1, 33))]
    full = step_ms(model, prompt)
    real_attend = qwen3.attend
    qwen3.attend = lambda q, k, v, mask: q  # attention (and the cache read) off; the cache is still written
    try:  # a config that differs in an unused field, so the jit cache cannot serve the first program
        other = qwen3.Qwen3(dataclasses.replace(cfg, max_position_embeddings=4097), rngs=nnx.Rngs(0))
        no_attn = step_ms(other, prompt)
    finally:
        qwen3.attend = real_attend
    print("random Qwen3: 8 layers, d=512, vocab 8192, float32, batch 1, cache 256 slots")
    print(f"sparkjax decode step           : {full:6.2f} ms")
    print(f"  with attention switched off  : {no_attn:6.2f} ms")
    print(f"bare matvecs over the same weights: {matvec_floor_ms(cfg):6.2f} ms")


if __name__ == "__main__":
    main()
