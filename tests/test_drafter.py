"""DSpark / DFlash drafters against the upstream reference fixture (float32).

Group b: one DSpark round from the prompt's features. Group c: every round of a full greedy
speculative generation, with the context built incrementally through the context cache.
Group e: the cache-free training forward. Plus a z-lab DFlash checkpoint built from the same
weights, export / reload, the Qwen3-4B-shaped parameter counts, and bad input.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections import defaultdict

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from sparkjax import load_drafter, save_drafter
from sparkjax.config import DrafterConfig
from sparkjax.engine import drafting as draft
from sparkjax.errors import (
    ArgumentError,
    CheckpointError,
    ConfigError,
    IncompatiblePairError,
    SparkjaxError,
)
from sparkjax.io.keymaps import DRAFTER_KEYS, _checkpoint_shape, param_keys
from sparkjax.io.safetensors import SafetensorsFile
from sparkjax.nn.drafter import Drafter, MarkovHead
from sparkjax.nn.layers import rope_cos_sin
from tests.conftest import jit_call

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "tiny_dspark_b16")
DRAFTER_DIR = os.path.join(FIX, "drafter")
TARGET_DIR = os.path.join(FIX, "target")

LOGIT_TOL = dict(rtol=1e-4, atol=1e-4)
PRENORM_TOL = dict(rtol=1e-5, atol=2e-4)


def close(actual, expected, tol=LOGIT_TOL, what=""):
    np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32), err_msg=what, **tol)


def jit_with(fn, *modules):
    """``fn(*modules, *args)`` jitted over the modules' split state (one compile per arg shapes); the modules
    ``fn`` sees are merged inside the trace, so what it changes in them stays there."""
    graphdefs, states = zip(*(nnx.split(m) for m in modules), strict=True)

    @jax.jit
    def run(states, *args):
        return fn(*(nnx.merge(g, s) for g, s in zip(graphdefs, states, strict=True)), *args)

    return lambda *args: run(states, *args)


@pytest.fixture(scope="module")
def target(fixture_target):  # ``ref``, ``fixture_target`` and ``fixture_drafter``: conftest.py
    return fixture_target


@pytest.fixture(scope="module")
def drafter(fixture_drafter):
    return fixture_drafter


@pytest.fixture(scope="module")
def fns(drafter):
    """The jitted drafting pieces of the DSpark fixture drafter."""

    def round_fn(d, ctx, x0, start, prev):
        blk = draft.draft_block(d, ctx, x0, start, return_layers=True)
        chain = draft.markov_chain(d, blk.logits, blk.hidden, x0)
        forced = blk.logits + draft.markov_bias(d, blk.hidden, prev)
        chain_conf = draft.confidence(d, blk.hidden, draft.chain_prev(x0, chain.tokens))
        return blk, chain, forced, draft.confidence(d, blk.hidden, prev), chain_conf

    return dict(append=jit_with(draft.append_context, drafter), round=jit_with(round_fn, drafter))


# Any drafter's pieces, one compiled program per drafter structure and argument shapes (the models of these tests
# run compiled, not op by op: each eager op is a program of its own)
fresh_context = nnx.jit(lambda d, feats, count, size: draft.append_context(d, d.init_context(feats.shape[0], size),
                                                                           feats, count), static_argnums=3)
block_tokens = nnx.jit(draft.block_tokens)
draft_block = nnx.jit(draft.draft_block)


@pytest.fixture(scope="module")
def b0(ref, drafter, fns):
    """Round 0's inputs: the prompt's features, their count, the context cache they fill, the first token."""
    feats = np.asarray(ref["b.context_features"])
    p = feats.shape[1]
    ctx = fresh_context(drafter, feats, np.array([p], np.int32), 64)
    return feats, p, ctx, np.asarray(ref["b.first_token"], np.int32)


def test_round0_matches_reference(ref, drafter, fns, b0):
    cfg = drafter.config
    feats, p, ctx, x0 = b0
    assert ctx.lengths.tolist() == [p]

    prev = np.asarray(ref["b.markov_prev_ids"], np.int32)
    cands = np.random.default_rng(0).integers(0, 320, (1, 16, 5)).astype(np.int32)

    def pieces(d, feats, x0, chain_tokens, hidden, cands):
        # the Markov features and W2 build the bias: f @ W2.T is the bias of every candidate prev token
        f = draft.markov_features(d, hidden, cands)
        w2 = draft.markov_w2(d)
        biases = [draft.markov_bias(d, hidden, cands[..., c]) for c in range(cands.shape[-1])]
        return (d.project_context(feats), draft.block_tokens(d, x0), draft.chain_prev(x0, chain_tokens), f, w2,
                jnp.einsum("bgcr,vr->bgcv", f, w2), biases)

    # cache [L, B, K, S, H] vs DynamicCache [L, B, K, S, H] after crop(start): context only
    close(np.stack(ctx.k)[:, :, :, :p], ref["b.drafter_cache_keys"], what="context keys")
    close(np.stack(ctx.v)[:, :, :, :p], ref["b.drafter_cache_values"], what="context values")
    positions = ref["b.draft_position_ids"][0]
    np.testing.assert_array_equal(positions[p:], p + np.arange(cfg.block_size))

    blk, chain, forced, conf_forced, conf_chain = fns["round"](ctx, x0, np.array([p], np.int32), prev)
    projected, tokens, chain_prev, f, w2, table, biases = jit_with(pieces, drafter)(feats, x0, chain.tokens,
                                                                                    blk.hidden, cands)
    close(projected, ref["b.context_projected"], what="hidden_norm(fc(features))")
    np.testing.assert_array_equal(tokens, ref["b.draft_input_ids"])
    close(blk.layers, ref["b.drafter_layer_outputs"], PRENORM_TOL, "per-layer outputs")
    close(blk.hidden, ref["b.block_hidden"], what="block hidden")
    assert blk.logits.dtype == jnp.float32 and blk.logits.shape == (1, cfg.block_size, cfg.vocab_size)
    close(blk.logits, ref["b.base_logits"], what="base logits")
    close(np.asarray(forced) - np.asarray(blk.logits), ref["b.markov_bias"], what="markov bias")
    close(chain.logits, ref["b.corrected_logits"], what="corrected logits")
    np.testing.assert_array_equal(chain.tokens, ref["b.draft_tokens"])
    np.testing.assert_array_equal(chain_prev, ref["b.markov_prev_ids"])
    close(conf_chain, ref["b.confidence_logits"], what="confidence logits")
    close(conf_forced, ref["b.confidence_logits"], what="confidence logits (given prev ids)")
    verify = np.concatenate([x0[:, None], np.asarray(chain.tokens)], axis=1)
    np.testing.assert_array_equal(verify, ref["b.verify_input_ids"])
    assert f.shape == (1, 16, 5, cfg.markov_rank) and w2.shape == (320, cfg.markov_rank)
    table = np.asarray(table)
    for c in range(5):
        close(table[:, :, c], biases[c], dict(rtol=1e-5, atol=1e-5))
    close(f, np.asarray(drafter.markov_head.markov_w1.weight[...])[cands], dict(rtol=0, atol=0))  # vanilla: W1[prev]


def test_all_rounds_with_incremental_context(ref, target, drafter, fns):
    cfg = drafter.config
    g = cfg.block_size
    out_ids = ref["c.spec_output_ids"]
    n_tok = out_ids.shape[1]
    # the target's features of every committed position, computed causally in one pass
    tout = jit_call(target, np.asarray(out_ids, np.int32), np.arange(n_tok, dtype=np.int32)[None],
                    hidden_layers=cfg.target_layer_ids, compute_logits=False)
    feats = np.asarray(jax.jit(draft.features_from_hidden)(tout.hidden))
    p = ref["b.context_features"].shape[1]
    close(feats[:, :p], ref["b.context_features"], what="target features of the prompt")
    feats = np.pad(feats, ((0, 0), (0, g + 1), (0, 0)))  # room for the last round's A = G + 1 rows

    starts, accs = ref["c.round_start"], ref["c.acceptance_lengths"]
    ctx = fresh_context(drafter, feats[:, :p], np.array([p], np.int32), 128)
    chain_matches = 0
    for r in range(len(starts)):
        start = int(starts[r])
        assert ctx.lengths.tolist() == [start] and start == int(ref["c.round_drafter_cache_len_after"][r])
        x0 = np.asarray(out_ids[:, start], np.int32)
        np.testing.assert_array_equal(block_tokens(drafter, x0), ref["c.round_draft_input_ids"][r:r + 1])
        verify = ref["c.round_verify_input_ids"][r]
        blk, chain, forced, conf, _ = fns["round"](ctx, x0, np.array([start], np.int32),
                                                   np.asarray(verify[None, :g], np.int32))
        blk_logits, chain_tokens, chain_logits = (np.asarray(x) for x in (blk.logits, chain.tokens, chain.logits))
        close(blk_logits[0], ref["c.round_base_logits"][r], what=f"round {r} base logits")
        # the upstream chain's corrected logits, conditioned on its own prev ids
        close(np.asarray(forced)[0], ref["c.round_corrected_logits"][r], what=f"round {r} corrected logits")
        close(np.asarray(conf)[0], ref["c.round_confidence_logits"][r], what=f"round {r} confidence logits")
        # our greedy chain equals upstream's at every decisive slot (accepted drafts + the first rejected)
        n = int(accs[r]) - 1
        decisive = min(n + 1, g)
        np.testing.assert_array_equal(chain_tokens[0, :decisive], verify[1:decisive + 1])
        agree = int(np.cumprod(chain_tokens[0] == verify[1:]).sum())
        close(chain_logits[0, : min(agree + 1, g)], ref["c.round_corrected_logits"][r][: min(agree + 1, g)])
        chain_matches += agree == g
        # commit: the target features of positions start .. start + n join the context
        assert int(ref["c.round_context_len"][r]) == (p if r == 0 else int(accs[r - 1]))
        ctx = fns["append"](ctx, feats[:, start:start + g + 1], np.array([n + 1], np.int32))
    assert chain_matches >= len(starts) - 2  # non-decisive flips are allowed, but should be rare
    assert ctx.lengths.tolist() == [int(starts[-1]) + int(accs[-1])]


def test_context_cache_batching_and_scratch(ref, drafter, fns):
    """Ragged prompts in one batch equal separate runs; scratch rows and overflow stay invisible."""
    feats = np.asarray(ref["b.context_features"])
    p = feats.shape[1]
    short = p - 5
    garbage = feats.copy()
    garbage[:, short:] = 37.0
    batch_feats = np.concatenate([feats, garbage], axis=0)  # row 1: garbage past length
    ctx2 = fresh_context(drafter, batch_feats, np.array([p, short], np.int32), 64)
    assert ctx2.lengths.tolist() == [p, short]
    x0 = np.asarray([int(ref["b.first_token"][0]), 17], np.int32)
    prev = np.zeros((2, drafter.config.block_size), np.int32)
    blk2, chain2, *_ = fns["round"](ctx2, x0, ctx2.lengths, prev)

    ctx_a = fresh_context(drafter, feats, np.array([p], np.int32), 64)
    ctx_b = fresh_context(drafter, feats, np.array([short], np.int32), 64)  # same rows, shorter count
    blk_a, chain_a, *_ = fns["round"](ctx_a, x0[:1], np.array([p], np.int32), prev[:1])
    blk_b, chain_b, *_ = fns["round"](ctx_b, x0[1:], np.array([short], np.int32), prev[:1])
    logits2 = np.asarray(blk2.logits)
    close(logits2[0], np.asarray(blk_a.logits)[0], dict(rtol=1e-5, atol=1e-5))
    close(logits2[1], np.asarray(blk_b.logits)[0], dict(rtol=1e-5, atol=1e-5))
    np.testing.assert_array_equal(chain2.tokens, np.concatenate([chain_a.tokens, chain_b.tokens]))
    assert not np.allclose(logits2[0], logits2[1], atol=1e-2)

    # appending past the end drops the overflow rows without touching committed slots
    small = fresh_context(drafter, feats, np.array([p], np.int32), 30)
    grown = fns["append"](small, feats[:, :17], np.array([3], np.int32))
    assert grown.lengths.tolist() == [p + 3]
    np.testing.assert_array_equal(np.stack(grown.k)[:, :, :, :p], np.stack(small.k)[:, :, :, :p])
    k_ref, _ = jit_with(lambda d, f, pos: d.context_kv(f, pos), drafter)(feats[:, :3], np.arange(p, p + 3)[None])
    k_ref = np.swapaxes(np.asarray(k_ref), 2, 3)  # token-major rows
    close(np.stack(grown.k)[:, :, :, p:p + 3], k_ref, dict(rtol=1e-6, atol=1e-6))


def test_block_in_the_context_scratch_equals_the_block_apart(ref, drafter, b0):
    """draft_block(in_cache=True) (the block's rows written into the context's scratch and attended there, as an
    engine's round drafts) gives the same block; the returned context keeps every committed slot and its
    lengths, and holds the block's keys in the scratch."""
    _, p, ctx, x0 = b0
    apart, cached = jit_with(lambda d, c, x: (draft.draft_block(d, c, x, c.lengths),
                                             draft.draft_block(d, c, x, c.lengths, in_cache=True)), drafter)(ctx, x0)
    assert apart.ctx is None and cached.ctx is not None
    close(cached.logits, apart.logits, dict(rtol=1e-5, atol=1e-5))
    close(cached.hidden, apart.hidden, dict(rtol=1e-5, atol=1e-5))
    assert cached.ctx.lengths.tolist() == ctx.lengths.tolist()
    g = drafter.config.block_size
    for new, old in zip(cached.ctx.k + cached.ctx.v, ctx.k + ctx.v, strict=True):
        new, old = np.asarray(new), np.asarray(old)
        np.testing.assert_array_equal(new[:, :, :p], old[:, :, :p])
        np.testing.assert_array_equal(new[:, :, p + g:], old[:, :, p + g:])
    assert not np.allclose(np.asarray(cached.ctx.k[0])[:, :, p:p + g], np.asarray(ctx.k[0])[:, :, p:p + g])


def test_joined_context_projections_equal_the_per_layer_ones(ref, drafter, random_pair):
    """join_context_projections' one GEMM (what context_kv runs on a GPU) equals the per-layer projections, with
    and without projection biases."""
    plain = random_pair[1]
    cfg = dataclasses.replace(plain.config, attention_bias=True)
    biased = nnx.jit(lambda: Drafter(cfg, rngs=nnx.Rngs(3)))()  # initialised as one program, not op by op

    def both(d, f):  # d: merged inside the trace (jit_with), so the join leaves the shared fixtures as they are
        ctx = d.project_context(f)
        cos, sin = rope_cos_sin(jnp.arange(5)[None] + jnp.array([[0], [7]]), d.config.head_dim, d.config.rope_theta)
        k0, v0 = d.context_kv_per_layer(ctx, cos, sin)
        d.join_context_projections()
        k1, v1 = d.context_kv_joined(ctx, cos, sin)
        return ctx, k0, v0, k1, v1

    for d in (drafter, plain, biased):
        f = np.random.default_rng(0).normal(size=(2, 5, d.config.feature_size)).astype(np.float32)
        ctx, k0, v0, k1, v1 = jit_with(both, d)(f)
        close(k1, k0, dict(rtol=1e-5, atol=1e-5))
        close(v1, v0, dict(rtol=1e-5, atol=1e-5))
        assert k1.shape == (d.config.num_hidden_layers, *ctx.shape[:2], d.config.num_key_value_heads,
                            d.config.head_dim)


@pytest.mark.slow  # the engine's lossless sampling stays in the default run (tests/test_exactness.py)
def test_markov_chain_sampling_draws_from_returned_logits(drafter, fns, b0):
    _, p, ctx, x0 = b0
    blk, greedy, *_ = fns["round"](ctx, x0, jnp.array([p]), jnp.zeros((1, 16), jnp.int32))
    temp = 1.5
    n = 4000

    @jax.jit
    def sample(keys, t):
        def one(k):
            c = draft.markov_chain(drafter, blk.logits, blk.hidden, x0, t, k)
            forced = blk.logits + draft.markov_bias(drafter, blk.hidden, draft.chain_prev(x0, c.tokens))
            return c.tokens[0], c.logits[0], forced[0]

        return jax.vmap(one)(keys)

    tokens, logits, forced = sample(jax.random.split(jax.random.key(0), n), jnp.float32(temp))
    # every position's logits are the Markov correction for the token actually drawn before it
    close(logits, forced, dict(rtol=1e-5, atol=1e-5))
    # the first slot's draws follow q = softmax(logits / T)
    q = np.asarray(jax.nn.softmax(logits[0, 0] / temp))
    freq = np.bincount(np.asarray(tokens[:, 0]), minlength=q.shape[0]) / n
    assert np.all(np.abs(freq - q) <= 5 * np.sqrt(q * (1 - q) / n) + 2e-3)
    assert len(np.unique(np.asarray(tokens[:, 0]))) > 1
    # a traced T = 0 is greedy (as many keys as above: the same compiled program)
    t0, l0, _ = sample(jax.random.split(jax.random.key(1), n), jnp.float32(0.0))
    np.testing.assert_array_equal(t0[0], greedy.tokens[0])
    close(l0[1], greedy.logits[0], dict(rtol=1e-6, atol=1e-6))
    with pytest.raises(ArgumentError, match="key"):
        draft.markov_chain(drafter, blk.logits, blk.hidden, x0, 0.7)


def test_gated_markov_head(ref, drafter):
    """Gated head: f = W1[prev] * sigmoid(gate_proj([h ; W1[prev]])) with DeepSpec's gate_proj."""
    cfg = DrafterConfig.from_hf_config({**json.loads(drafter.config.hf_json), "markov_head_type": "gated"})
    head = nnx.jit(lambda: MarkovHead(cfg, rngs=nnx.Rngs(3)))()  # the head alone, initialised as one program

    @nnx.jit
    def features_and_by_hand(head):
        h = jax.random.normal(jax.random.key(0), (2, 16, cfg.hidden_size))
        prev = jax.random.randint(jax.random.key(1), (2, 16, 3), 0, cfg.vocab_size)
        f = head.features(h, prev)  # what markov_features(drafter, h, prev) returns
        e = head.markov_w1.weight[...][prev]
        gate_in = jnp.concatenate([jnp.broadcast_to(h[:, :, None], (2, 16, 3, cfg.hidden_size)), e], axis=-1)
        return f, e * jax.nn.sigmoid(gate_in @ head.gate_proj.kernel[...] + head.gate_proj.bias[...])

    f, want = features_and_by_hand(head)
    close(f, want, dict(rtol=1e-5, atol=1e-6))
    gated = nnx.eval_shape(lambda: Drafter(cfg, rngs=nnx.Rngs(3)))
    keys = {k for _, k, _ in param_keys(nnx.state(gated, nnx.Param), DRAFTER_KEYS)}
    assert {"markov_head.gate_proj.weight", "markov_head.gate_proj.bias"} <= keys


def test_drafter_without_heads(ref, drafter):
    """markov_rank 0 and no confidence head: the chain is the per-slot choice on the base logits."""
    base_cfg = json.loads(drafter.config.hf_json)
    cfg = DrafterConfig.from_hf_config({**base_cfg, "markov_rank": 0, "enable_confidence_head": False})
    assert not cfg.has_markov and not cfg.has_confidence
    plain = nnx.eval_shape(lambda: Drafter(cfg, rngs=nnx.Rngs(0)))
    assert plain.markov_head is None and plain.confidence_head is None
    base = np.asarray(ref["b.base_logits"])
    x0 = np.asarray(ref["b.first_token"], np.int32)
    # one program (plain is abstract: the chain reads no weight of it)
    chain = jax.jit(lambda b, h, x: draft.markov_chain(plain, b, h, x))(base, np.asarray(ref["b.block_hidden"]), x0)
    np.testing.assert_array_equal(chain.tokens, np.argmax(ref["b.base_logits"], axis=-1))
    np.testing.assert_array_equal(chain.logits, ref["b.base_logits"])
    with pytest.raises(ArgumentError, match="confidence head"):
        draft.confidence(plain, base, chain.tokens)
    with pytest.raises(ArgumentError, match="Markov head"):
        draft.markov_w2(plain)


def test_training_forward_matches_reference(ref, drafter):
    hs = np.asarray(ref["e.target_hidden_states"])
    s = hs.shape[1]
    pos = np.asarray(ref["e.full_position_ids"], np.int32)
    b, a, g = ref["e.target_ids"].shape
    anchor_tok = np.take_along_axis(ref["e.input_ids"], ref["e.anchor_positions"], axis=1)
    prev = np.concatenate([anchor_tok[..., None], ref["e.target_ids"][..., :-1]], axis=-1).astype(np.int32)
    flat = lambda x: x.reshape(b * a, g, *x.shape[3:])  # noqa: E731

    def forward(d, hs, feature_pos, noise, block_pos, mask, prev):
        out = d(hs, feature_pos, noise, block_pos, mask)
        hidden = out.hidden.reshape(b, a, g, -1)
        base = d.logits(hidden)
        corrected = flat(base) + draft.markov_bias(d, flat(hidden), flat(prev))
        return out, base, corrected, draft.confidence(d, flat(hidden), flat(prev))

    fwd = jit_with(forward, drafter)
    noise = np.asarray(ref["e.noise_input_ids"], np.int32)
    out, base, corrected, conf = fwd(hs, pos[:, :s], noise, pos[:, s:], np.asarray(ref["e.attention_mask_dense"]), prev)
    close(out.hidden, ref["e.output_hidden"], what="training backbone output")
    close(base, ref["e.base_draft_logits"], what="training base logits")
    close(corrected, flat(ref["e.draft_logits"]), what="training corrected logits")
    close(conf, flat(ref["e.confidence_pred"]), what="confidence")
    with pytest.raises(ArgumentError, match="mask"):
        fwd(hs, pos[:, :s], noise, pos[:, s:], np.ones((2, 128, 100), bool), prev)


def write_dflash(folder, *, drop_dflash_config=False):
    """A z-lab-format DFlash checkpoint made of the fixture drafter's backbone."""
    os.makedirs(folder)
    src = json.load(open(os.path.join(DRAFTER_DIR, "config.json")))
    cfg = {k: v for k, v in src.items() if k not in (
        "block_size", "target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type",
        "enable_confidence_head", "confidence_head_with_markov", "num_anchors")}
    cfg.update(architectures=["DFlashDraftModel"], block_size=src["block_size"])
    if not drop_dflash_config:
        cfg["dflash_config"] = {"target_layer_ids": src["target_layer_ids"], "mask_token_id": src["mask_token_id"]}
    json.dump(cfg, open(os.path.join(folder, "config.json"), "w"))
    tensors = load_file(os.path.join(DRAFTER_DIR, "model.safetensors"))
    keep = {k: v for k, v in tensors.items()
            if not k.startswith(("embed_tokens", "lm_head", "markov_head", "confidence_head"))}
    save_file(keep, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_dflash_checkpoint_drafts_with_dflash_alignment(ref, tmp_path, target, drafter, b0):
    folder = write_dflash(str(tmp_path / "dflash"))
    dfl = load_drafter(folder, target=target)
    cfg = dfl.config
    assert cfg.kind == "dflash" and dfl.embed_tokens is None and dfl.lm_head is None
    assert cfg.num_drafts == cfg.block_size - 1 and drafter.config.num_drafts == cfg.block_size
    # the DSpark fixture's own embedding / head are the target's (frozen copies), so both paths agree
    np.testing.assert_array_equal(drafter.embed_tokens.embedding[...], target.embed_tokens.embedding[...])
    np.testing.assert_array_equal(drafter.lm_head.weight[...], target.embed_tokens.embedding[...])

    feats, p, _, x0 = b0
    start = np.array([p], np.int32)
    ctx = fresh_context(dfl, feats, start, 64)

    def run(d, t, ds, ctx, x0, start, ds_logits):
        blk = draft.draft_block(d, ctx, x0, start, t)
        return (blk, draft.argmax_chain(d, blk.logits), draft.aligned_logits(d, blk.logits),
                draft.argmax_chain(ds, ds_logits), draft.sample_chain(d, blk.logits, 1.0, jax.random.key(0)))

    blk, chain, aligned, ds_chain, sampled = jit_with(run, dfl, target, drafter)(ctx, x0, start,
                                                                                 ref["b.base_logits"])
    close(blk.logits, ref["b.base_logits"], what="DFlash logits (target embed/head) vs DSpark path")
    assert chain.tokens.shape == (1, cfg.block_size - 1)
    np.testing.assert_array_equal(chain.tokens, np.argmax(ref["b.base_logits"][:, 1:], axis=-1))
    close(aligned, ref["b.base_logits"][:, 1:])
    np.testing.assert_array_equal(ds_chain.tokens, np.argmax(ref["b.base_logits"], axis=-1))
    assert sampled.tokens.shape == (1, cfg.block_size - 1)

    with pytest.raises(ArgumentError, match="target"):
        draft_block(dfl, ctx, x0, start)  # refused while it traces
    with pytest.raises(ArgumentError, match="argmax_chain"):
        draft.markov_chain(dfl, blk.logits, blk.hidden, x0)
    # export keeps the z-lab format and reloads to the same drafter
    out = save_drafter(dfl, str(tmp_path / "dflash_out"))
    again = load_drafter(out, target=target)
    assert again.config == cfg and json.load(open(os.path.join(out, "config.json")))["dflash_config"] == {
        "target_layer_ids": [1, 3], "mask_token_id": 300}
    assert set(SafetensorsFile(os.path.join(out, "model.safetensors")).keys()) == set(
        SafetensorsFile(os.path.join(folder, "model.safetensors")).keys())


def test_export_roundtrip(tmp_path, target, drafter, ref, b0):
    out = save_drafter(drafter, str(tmp_path / "exported"))
    orig = SafetensorsFile(os.path.join(DRAFTER_DIR, "model.safetensors"))
    new = SafetensorsFile(os.path.join(out, "model.safetensors"))
    assert new.keys() == orig.keys()  # same names, same (sorted) order
    for k in orig.keys():
        assert new.entries[k][:2] == orig.entries[k][:2], k  # dtype, shape
        np.testing.assert_array_equal(new.get(k), orig.get(k), err_msg=k)
    assert new.metadata == orig.metadata
    original_config = json.load(open(os.path.join(DRAFTER_DIR, "config.json")))
    assert json.load(open(os.path.join(out, "config.json"))) == original_config

    again = load_drafter(out, target=target)
    assert again.config == drafter.config
    feats, p, _, x0 = b0
    ctx = fresh_context(again, feats, np.array([p], np.int32), 64)
    # one program run on both drafters' weights (their structure is the same), so equal weights give equal bits
    blk, blk_ref = (draft_block(d, ctx, x0, ctx.lengths) for d in (again, drafter))
    np.testing.assert_array_equal(blk.logits, blk_ref.logits)
    close(blk.logits, ref["b.base_logits"])

    with pytest.raises(ArgumentError, match="exists"):
        save_drafter(drafter, out)
    # bfloat16 export: every tensor converted, config dtype updated, loads back as bf16
    out16 = save_drafter(drafter, str(tmp_path / "bf16"), dtype="bfloat16")
    f16 = SafetensorsFile(os.path.join(out16, "model.safetensors"))
    assert {f16.entries[k][0] for k in f16.keys()} == {ml_dtypes.bfloat16}
    assert json.load(open(os.path.join(out16, "config.json")))["dtype"] == "bfloat16"
    d16 = load_drafter(out16, target=target)
    assert d16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(d16.fc.kernel[...]).astype(np.float32),
        np.asarray(drafter.fc.kernel[...]).astype(ml_dtypes.bfloat16).astype(np.float32),
    )


def test_qwen3_4b_b16_parameter_counts():
    cfg = DrafterConfig.from_hf_config(os.path.join(FIX, "configs", "dspark_qwen3_4b_b16_config.json"))
    expect = json.load(open(os.path.join(FIX, "configs", "dspark_qwen3_4b_b16_param_counts.json")))
    abstract = nnx.eval_shape(lambda: Drafter(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    state = nnx.state(abstract, nnx.Param)
    flat = dict(nnx.to_flat_state(state))
    groups: dict[str, int] = defaultdict(int)
    shapes = {}
    for path, key, layout in param_keys(state, DRAFTER_KEYS):
        shape = tuple(flat[path].get_value().shape)
        shapes[key] = list(_checkpoint_shape(layout, shape))
        groups[re.sub(r"^layers\.\d+\.", "layers.*.", key)] += int(np.prod(shape))
    assert dict(groups) == expect["groups"]
    assert shapes == {k: v[0] for k, v in expect["per_tensor"].items()}
    assert sum(groups.values()) == expect["total"]
    # a config built without its original file writes a config.json that parses back to itself
    fresh = dataclasses.replace(cfg, hf_json="")
    assert DrafterConfig.from_hf_config(fresh.to_hf_dict()) == cfg
    dflash = dataclasses.replace(fresh, kind="dflash", markov_rank=0, markov_head_type=None, num_anchors=None,
                                 enable_confidence_head=False, confidence_head_with_markov=False)
    assert DrafterConfig.from_hf_config(dflash.to_hf_dict()) == dflash


@pytest.mark.parametrize(
    "edit_config, edit_tensors, error, pattern",
    [
        # the pair check's other fields: test_io_layout's check_pair cases
        (lambda c: c.update(hidden_size=48), None, IncompatiblePairError, "hidden_size"),
        (lambda c: c.update(target_layer_ids=[-2, 1]), None, ConfigError, "target_layer_ids"),
        (lambda c: c.update(mask_token_id=320), None, ConfigError, "mask_token_id"),
        (lambda c: c.update(markov_head_type="rnn"), None, ConfigError, "markov_head_type.*rnn"),
        (lambda c: c.pop("markov_rank"), None, ConfigError, "markov_rank"),
        (None, lambda t: t.pop("markov_head.markov_w2.weight"), CheckpointError, "markov_head.markov_w2.weight"),
        (None, lambda t: t.update({"embed_tokens.weight": np.zeros((321, 64), np.float32)}),
         IncompatiblePairError, "embed_tokens.weight"),
        (None, lambda t: t.update({"fc.weight": np.zeros((64, 96), np.float32)}), CheckpointError, "fc.weight"),
    ],
)
def test_bad_drafter_raises(tmp_path, target, edit_config, edit_tensors, error, pattern):
    folder = shutil.copytree(DRAFTER_DIR, str(tmp_path / "bad"))
    if edit_config:
        cfg = json.load(open(os.path.join(folder, "config.json")))
        edit_config(cfg)
        json.dump(cfg, open(os.path.join(folder, "config.json"), "w"))
    if edit_tensors:
        tensors = load_file(os.path.join(folder, "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(error, match=pattern) as info:
        load_drafter(folder, target=target)
    assert isinstance(info.value, SparkjaxError)
    msg = str(info.value)
    assert folder in msg  # names the drafter's file
    if error is IncompatiblePairError:
        assert TARGET_DIR in msg  # and the target's


def test_bad_dflash_and_unknown_format(tmp_path, target):
    folder = write_dflash(str(tmp_path / "nocfg"), drop_dflash_config=True)
    with pytest.raises(ConfigError, match="dflash_config") as info:
        load_drafter(folder, target=target)
    assert folder in str(info.value)
    with pytest.raises(ConfigError, match="DFlash 2"):
        DrafterConfig.from_hf_config({"architectures": ["DFlash2DraftModel"], "dflash_config": {}})
    base = json.load(open(os.path.join(DRAFTER_DIR, "config.json")))
    plain = {k: v for k, v in base.items() if k not in ("markov_rank", "enable_confidence_head")}
    plain["architectures"] = ["Qwen3ForCausalLM"]
    with pytest.raises(ConfigError, match="cannot tell the drafter format"):
        DrafterConfig.from_hf_config(plain, source="plain.json")
    with pytest.raises(ConfigError, match="confidence_head_with_markov"):
        DrafterConfig.from_hf_config({**base, "markov_rank": 0})
