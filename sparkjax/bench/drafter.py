"""One DSpark drafting step (draft_block + Markov chain) in JAX against a plain PyTorch forward.

    python -m sparkjax.bench drafter [--repeats 50] [--out PATH] [--json PATH]

The same DeepSpec-format weights (the fixture drafter, and a larger random one) and context K/V cache on both
sides; interleaved medians after a warm-up, and the outputs' agreement.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparkjax.config import DrafterConfig
from sparkjax.engine import drafting
from sparkjax.io.hf import load_drafter, save_drafter
from sparkjax.nn.drafter import Drafter

from . import timing
from .common import FIXTURE, add_output, at_least, pct

LARGER = {"hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
          "head_dim": 64, "intermediate_size": 1536, "vocab_size": 8192, "markov_rank": 64, "mask_token_id": 8191,
          "target_layer_ids": [1, 3, 5], "num_target_layers": 8, "enable_confidence_head": False}


def add_arguments(p) -> None:
    p.add_argument("--repeats", type=int, default=50, help="timed calls per side")
    add_output(p)


class TorchDSpark:
    """A from-the-description DSpark drafter forward in PyTorch (context K/V cache, block, Markov chain)."""

    def __init__(self, folder):
        from safetensors.torch import load_file

        with open(os.path.join(folder, "config.json")) as f:
            self.cfg = c = json.load(f)
        self.w = load_file(os.path.join(folder, "model.safetensors"))
        self.eps, self.hd, self.nq, self.nk = (c[k] for k in ("rms_norm_eps", "head_dim", "num_attention_heads",
                                                              "num_key_value_heads"))
        self.theta, self.layers = c["rope_parameters"]["rope_theta"], c["num_hidden_layers"]

    def rms(self, x, w):
        x32 = x.float()
        return w * (x32 * (x32.pow(2).mean(-1, keepdim=True) + self.eps).rsqrt()).to(x.dtype)

    def rope(self, positions):
        import torch

        inv = 1.0 / (self.theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        ang = positions.float()[..., None] * inv
        ang = torch.cat([ang, ang], -1)
        return ang.cos(), ang.sin()

    @staticmethod
    def rot(x, cos, sin):  # x [B, heads, T, H], cos / sin [B, T, H]
        import torch

        half = x.shape[-1] // 2
        return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], -1) * sin[:, None]

    def kv(self, i, x, cos, sin):
        w, b, t, p = self.w, x.shape[0], x.shape[1], f"layers.{i}.self_attn."
        k = self.rms((x @ w[p + "k_proj.weight"].T).view(b, t, self.nk, self.hd), w[p + "k_norm.weight"])
        v = (x @ w[p + "v_proj.weight"].T).view(b, t, self.nk, self.hd).transpose(1, 2)
        return self.rot(k.transpose(1, 2), cos, sin), v

    def context(self, features, positions):
        ctx = self.rms(features @ self.w["fc.weight"].T, self.w["hidden_norm.weight"])
        cos, sin = self.rope(positions)
        return [self.kv(i, ctx, cos, sin) for i in range(self.layers)]

    def block(self, cache, x_start, start):
        import torch

        w, g = self.w, self.cfg["block_size"]
        ids = torch.full((x_start.shape[0], g), self.cfg["mask_token_id"], dtype=torch.long)
        ids[:, 0] = x_start
        x = w["embed_tokens.weight"][ids]
        cos, sin = self.rope(start[:, None] + torch.arange(g)[None])
        b, rep = x.shape[0], self.nq // self.nk
        for i, (ck, cv) in enumerate(cache):
            p = f"layers.{i}."
            h = self.rms(x, w[p + "input_layernorm.weight"])
            q = self.rms((h @ w[p + "self_attn.q_proj.weight"].T).view(b, g, self.nq, self.hd),
                         w[p + "self_attn.q_norm.weight"])
            q = self.rot(q.transpose(1, 2), cos, sin)
            k, v = self.kv(i, h, cos, sin)
            k, v = torch.cat([ck, k], 2).repeat_interleave(rep, 1), torch.cat([cv, v], 2).repeat_interleave(rep, 1)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=self.hd**-0.5)
            x = x + a.transpose(1, 2).reshape(b, g, -1) @ w[p + "self_attn.o_proj.weight"].T
            h = self.rms(x, w[p + "post_attention_layernorm.weight"])
            gate = torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T)
            x = x + (gate * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        return self.rms(x, w["norm.weight"]) @ w["lm_head.weight"].T

    def chain(self, base, x_start):
        import torch

        w1, w2 = self.w["markov_head.markov_w1.weight"], self.w["markov_head.markov_w2.weight"]
        prev, toks, outs = x_start, [], []
        for i in range(base.shape[1]):
            logits = base[:, i] + w1[prev] @ w2.T
            prev = logits.argmax(-1)
            toks.append(prev)
            outs.append(logits)
        return torch.stack(toks, 1), torch.stack(outs, 1)


def random_checkpoint(folder: str) -> str:
    """A DeepSpec DSpark folder of the :data:`LARGER` shapes with random float32 weights."""
    cfg = json.loads((FIXTURE / "drafter" / "config.json").read_text()) | LARGER
    return save_drafter(Drafter(DrafterConfig.from_hf_config(cfg), rngs=nnx.Rngs(0), dtype=jnp.float32), folder)


def bench(name: str, folder: str, context_len: int, batch: int, repeats: int) -> dict:
    import torch

    drafter = load_drafter(folder)
    cfg = drafter.config
    rng = np.random.default_rng(1)
    feats = rng.standard_normal((batch, context_len, cfg.feature_size)).astype(np.float32)
    x_start = rng.integers(0, cfg.vocab_size - 1, (batch,))
    start = np.full((batch,), context_len)
    ctx = drafting.append_context(drafter, drafter.init_context(batch, context_len), jnp.asarray(feats),
                                  jnp.asarray(start, jnp.int32))
    graphdef, state = nnx.split(drafter)

    @jax.jit
    def step(state, ctx, x0, start):
        d = nnx.merge(graphdef, state)
        blk = drafting.draft_block(d, ctx, x0, start)
        chain = drafting.markov_chain(d, blk.logits, blk.hidden, x0)
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
            base = ref.block(cache, x0_t, start_t)
            return base, *ref.chain(base, x0_t)

        runs = {"jax": lambda: step(state, ctx, x0_j, start_j), "torch": torch_step}
        for _ in range(5):  # warm-up: both sides' thread pools
            for f in runs.values():
                f()
        stats = timing.interleave(runs, repeats)
        base_t, tok_t, corr_t = torch_step()
    base_j, tok_j, corr_j = step(state, ctx, x0_j, start_j)
    return {"name": name, "hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers,
            "heads": f"{cfg.num_attention_heads}/{cfg.num_key_value_heads}", "vocab": cfg.vocab_size,
            "rank": cfg.markov_rank, "block": cfg.block_size, "context": context_len, "batch": batch,
            "jax_ms": stats["jax"].median * 1e3, "torch_ms": stats["torch"].median * 1e3,
            "jax_spread": stats["jax"].spread, "torch_spread": stats["torch"].spread,
            "torch_over_jax": stats["torch"].median / stats["jax"].median, "compile_s": compile_s,
            "max_diff_base": float(np.abs(np.asarray(base_j) - base_t.numpy()).max()),
            "max_diff_corrected": float(np.abs(np.asarray(corr_j) - corr_t.numpy()).max()),
            "same_chain": bool(np.array_equal(np.asarray(tok_j), tok_t.numpy()))}


def table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        lines += [f"{r['name']}: d={r['hidden']} layers={r['layers']} heads={r['heads']} V={r['vocab']} R={r['rank']} "
                  f"block={r['block']} context={r['context']} batch={r['batch']}",
                  f"  jax jit  draft_block+markov_chain: {r['jax_ms']:8.3f} ms  (compile {r['compile_s']:.2f} s, "
                  f"spread {pct(r['jax_spread'])})",
                  f"  torch    block+markov chain     : {r['torch_ms']:8.3f} ms  (spread {pct(r['torch_spread'])})",
                  f"  torch / jax = {r['torch_over_jax']:.2f}x   max|d base|={r['max_diff_base']:.2e} "
                  f"max|d corrected|={r['max_diff_corrected']:.2e} same greedy chain={r['same_chain']}"]
    return "\n".join(lines)


def run(args, report) -> None:
    at_least(args.repeats, "--repeats")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch (and its OpenMP runtime) is loaded
    import torch

    report.table = table
    report.header.append(f"# jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__} "
                         f"({torch.get_num_threads()} threads), {os.cpu_count()} CPUs; float32; medians of "
                         f"{args.repeats} interleaved calls per side after a warm-up")
    report.rows.append(bench("tiny fixture", str(FIXTURE / "drafter"), 24, 1, args.repeats))
    with tempfile.TemporaryDirectory() as tmp:
        big = random_checkpoint(os.path.join(tmp, "big"))
        for batch in (1, 4):
            report.rows.append(bench("larger", big, 256, batch, args.repeats))
