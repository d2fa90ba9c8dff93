"""Times one DSpark drafting step (draft_block + Markov chain) in JAX against a plain PyTorch forward.

Both sides load the same DeepSpec-format weights, start from the same context K/V cache
(context length C, block G), and produce base logits + the greedy Markov-corrected chain.
JAX runs one jitted function over ``nnx.split`` state; PyTorch runs eagerly under
``inference_mode``. Reported: medians over repeated calls after warm-up, and the outputs'
agreement. CPU timings only; never extrapolate to accelerators.

    python eval/bench_drafter.py [--repeats 50] [--out eval/results/drafter_bench.txt]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from safetensors.numpy import save_file
from safetensors.torch import load_file as load_torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sparkjax.engine import drafting as draft  # noqa: E402
from sparkjax.io.hf import load_drafter  # noqa: E402

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "tiny_dspark_b16")


# ----------------------------------------------------------------------------- plain PyTorch reference


def rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(positions, head_dim, theta):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = positions.float()[..., None] * inv
    ang = torch.cat([ang, ang], -1)
    return ang.cos(), ang.sin()


def rot(x, cos, sin):  # x [B, heads, T, H], cos/sin [B, T, H]
    half = x.shape[-1] // 2
    r = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos[:, None] + r * sin[:, None]


class TorchDSpark:
    """A from-the-description DSpark drafter forward (context K/V cache, block, Markov chain)."""

    def __init__(self, folder):
        self.cfg = json.load(open(os.path.join(folder, "config.json")))
        self.w = load_torch(os.path.join(folder, "model.safetensors"))
        c = self.cfg
        self.eps, self.hd = c["rms_norm_eps"], c["head_dim"]
        self.nq, self.nk = c["num_attention_heads"], c["num_key_value_heads"]
        self.theta = c["rope_parameters"]["rope_theta"]
        self.layers = c["num_hidden_layers"]

    def _kv(self, i, x, cos, sin):
        w, b, t = self.w, x.shape[0], x.shape[1]
        p = f"layers.{i}.self_attn."
        k = (x @ w[p + "k_proj.weight"].T).view(b, t, self.nk, self.hd)
        k = rms(k, w[p + "k_norm.weight"], self.eps).transpose(1, 2)
        v = (x @ w[p + "v_proj.weight"].T).view(b, t, self.nk, self.hd).transpose(1, 2)
        return rot(k, cos, sin), v

    def context(self, features, positions):
        ctx = rms(features @ self.w["fc.weight"].T, self.w["hidden_norm.weight"], self.eps)
        cos, sin = rope(positions, self.hd, self.theta)
        return [self._kv(i, ctx, cos, sin) for i in range(self.layers)]

    def block(self, cache, x_start, start):
        w, c = self.w, self.cfg
        g = c["block_size"]
        ids = torch.full((x_start.shape[0], g), c["mask_token_id"], dtype=torch.long)
        ids[:, 0] = x_start
        x = w["embed_tokens.weight"][ids]
        cos, sin = rope(start[:, None] + torch.arange(g)[None], self.hd, self.theta)
        b = x.shape[0]
        for i, (ck, cv) in enumerate(cache):
            p = f"layers.{i}."
            h = rms(x, w[p + "input_layernorm.weight"], self.eps)
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(b, g, self.nq, self.hd)
            q = rot(rms(q, w[p + "self_attn.q_norm.weight"], self.eps).transpose(1, 2), cos, sin)
            k, v = self._kv(i, h, cos, sin)
            k, v = torch.cat([ck, k], 2), torch.cat([cv, v], 2)
            rep = self.nq // self.nk
            a = torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), scale=self.hd**-0.5
            )
            x = x + a.transpose(1, 2).reshape(b, g, -1) @ w[p + "self_attn.o_proj.weight"].T
            h = rms(x, w[p + "post_attention_layernorm.weight"], self.eps)
            gate = torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T)
            x = x + (gate * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        hidden = rms(x, w["norm.weight"], self.eps)
        return hidden @ w["lm_head.weight"].T, hidden

    def chain(self, base, x_start):
        w1, w2 = self.w["markov_head.markov_w1.weight"], self.w["markov_head.markov_w2.weight"]
        prev, toks, outs = x_start, [], []
        for i in range(base.shape[1]):
            logits = base[:, i] + w1[prev] @ w2.T
            prev = logits.argmax(-1)
            toks.append(prev)
            outs.append(logits)
        return torch.stack(toks, 1), torch.stack(outs, 1)


# ----------------------------------------------------------------------------- setups


def random_checkpoint(folder, *, d, layers, vocab, heads, kv_heads, ffn, rank, n_ids, block):
    rng = np.random.default_rng(0)
    hd = d // heads
    cfg = {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": d,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": hd, "intermediate_size": ffn, "vocab_size": vocab, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}, "max_position_embeddings": 4096,
        "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
        "block_size": block, "target_layer_ids": list(range(1, 2 * n_ids, 2)), "mask_token_id": vocab - 1,
        "num_target_layers": 2 * n_ids + 2, "markov_rank": rank, "markov_head_type": "vanilla",
        "enable_confidence_head": False, "num_anchors": 512, "dtype": "float32",
    }

    def normal(*shape, std):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    t = {
        "embed_tokens.weight": normal(vocab, d, std=1.0), "lm_head.weight": normal(vocab, d, std=d**-0.5),
        "fc.weight": normal(d, n_ids * d, std=(n_ids * d) ** -0.5), "hidden_norm.weight": np.ones(d, np.float32),
        "norm.weight": np.ones(d, np.float32), "markov_head.markov_w1.weight": normal(vocab, rank, std=1.0),
        "markov_head.markov_w2.weight": normal(vocab, rank, std=rank**-0.5),
    }
    for i in range(layers):
        p = f"layers.{i}."
        t.update({
            p + "self_attn.q_proj.weight": normal(heads * hd, d, std=d**-0.5),
            p + "self_attn.k_proj.weight": normal(kv_heads * hd, d, std=d**-0.5),
            p + "self_attn.v_proj.weight": normal(kv_heads * hd, d, std=d**-0.5),
            p + "self_attn.o_proj.weight": normal(d, heads * hd, std=(heads * hd) ** -0.5),
            p + "self_attn.q_norm.weight": np.ones(hd, np.float32),
            p + "self_attn.k_norm.weight": np.ones(hd, np.float32),
            p + "mlp.gate_proj.weight": normal(ffn, d, std=d**-0.5),
            p + "mlp.up_proj.weight": normal(ffn, d, std=d**-0.5),
            p + "mlp.down_proj.weight": normal(d, ffn, std=ffn**-0.5),
            p + "input_layernorm.weight": np.ones(d, np.float32),
            p + "post_attention_layernorm.weight": np.ones(d, np.float32),
        })
    os.makedirs(folder, exist_ok=True)
    json.dump(cfg, open(os.path.join(folder, "config.json"), "w"))
    save_file(t, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return folder


def paired_median_ms(fa, fb, repeats, chunks=5, warmup=5):
    """Medians (ms) of ``fa`` and ``fb``, measured in alternating chunks so that load changes hit both
    alike; the first call of each chunk is discarded (thread pools of the other library may still spin)."""
    for _ in range(warmup):
        fa()
        fb()
    ta, tb = [], []
    per_chunk = max(1, repeats // chunks)
    for _ in range(chunks):
        for f, ts in ((fa, ta), (fb, tb)):
            f()
            for _ in range(per_chunk):
                t0 = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ta), 1e3 * statistics.median(tb)


def bench(name, folder, context_len, batch, repeats, log):
    drafter = load_drafter(folder)
    cfg = drafter.config
    rng = np.random.default_rng(1)
    feats = rng.standard_normal((batch, context_len, cfg.feature_size)).astype(np.float32)
    x_start = rng.integers(0, cfg.vocab_size - 1, (batch,))
    start = np.full((batch,), context_len)

    ctx = draft.append_context(drafter, drafter.init_context(batch, context_len), jnp.asarray(feats),
                               jnp.asarray(start, jnp.int32))
    graphdef, state = nnx.split(drafter)

    @jax.jit
    def step(state, ctx, x0, start):
        d = nnx.merge(graphdef, state)
        blk = draft.draft_block(d, ctx, x0, start)
        chain = draft.markov_chain(d, blk.logits, blk.hidden, x0)
        return blk.logits, chain.tokens, chain.logits

    x0_j, start_j = jnp.asarray(x_start, jnp.int32), jnp.asarray(start, jnp.int32)
    t0 = time.perf_counter()
    jax.block_until_ready(step(state, ctx, x0_j, start_j))
    compile_s = time.perf_counter() - t0

    ref = TorchDSpark(folder)
    with torch.inference_mode():
        cache = ref.context(torch.from_numpy(feats), torch.arange(context_len)[None].expand(batch, -1))
        x0_t, start_t = torch.from_numpy(x_start), torch.from_numpy(start)

        def torch_step():
            base, hidden = ref.block(cache, x0_t, start_t)
            return base, *ref.chain(base, x0_t)

        jax_ms, torch_ms = paired_median_ms(
            lambda: jax.block_until_ready(step(state, ctx, x0_j, start_j)), torch_step, repeats
        )
        base_t, tok_t, corr_t = torch_step()
    base_j, tok_j, corr_j = step(state, ctx, x0_j, start_j)
    d_base = float(np.abs(np.asarray(base_j) - base_t.numpy()).max())
    d_corr = float(np.abs(np.asarray(corr_j) - corr_t.numpy()).max())
    same = bool(np.array_equal(np.asarray(tok_j), tok_t.numpy()))
    log(f"{name}: d={cfg.hidden_size} layers={cfg.num_hidden_layers} heads={cfg.num_attention_heads}/"
        f"{cfg.num_key_value_heads} V={cfg.vocab_size} R={cfg.markov_rank} block={cfg.block_size} "
        f"context={context_len} batch={batch}")
    log(f"  jax jit  draft_block+markov_chain: {jax_ms:8.3f} ms  (compile {compile_s:.2f} s)")
    log(f"  torch    block+markov chain     : {torch_ms:8.3f} ms")
    log(f"  torch / jax = {torch_ms / jax_ms:.2f}x   max|d base|={d_base:.2e} max|d corrected|={d_corr:.2e} "
        f"same greedy chain={same}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", default=None, help="also write the report here (command line at the top)")
    args = ap.parse_args()
    lines = []

    def log(s=""):
        print(s, flush=True)
        lines.append(s)

    log(f"jax {jax.__version__} ({jax.default_backend()}, {jax.device_count()} device), torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs; float32")
    log(f"medians of {args.repeats} calls per side, in 5 alternating JAX / torch chunks, after warm-up "
        f"(the CPUs may be shared with other jobs; load average at start {os.getloadavg()[0]:.2f})")
    bench("tiny fixture", os.path.join(FIX, "drafter"), context_len=24, batch=1, repeats=args.repeats, log=log)
    with tempfile.TemporaryDirectory() as tmp:
        big = random_checkpoint(os.path.join(tmp, "big"), d=512, layers=2, vocab=8192, heads=8, kv_heads=4,
                                ffn=1536, rank=64, n_ids=3, block=16)
        bench("larger", big, context_len=256, batch=1, repeats=args.repeats, log=log)
        bench("larger", big, context_len=256, batch=4, repeats=args.repeats, log=log)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        cmd = "python " + " ".join(sys.argv)
        with open(args.out, "w") as f:
            f.write(f"$ {cmd}\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
