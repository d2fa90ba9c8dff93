"""``sparkjax.nn.layers.attend``'s paths ``dpa``, ``blocked`` (online softmax bounded by the live length),
``prefix`` (a power-of-two prefix) and ``split`` (committed prefix and block merged through their log-sum-exps)
against ``einsum``: GQA, tree masks over a cache, two parts, fully masked rows, the tokens of generation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkjax.cache import attention_mask
from sparkjax.engine import Options, generate
from sparkjax.errors import ArgumentError
from sparkjax.nn import layers
from sparkjax.reference import random_tree_mask
from tests.conftest import NEW_LONG, PROMPTS3, jit_call

SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@functools.partial(jax.jit, static_argnames=("impl", "block"))
def _attend(q, parts, impl, block=layers.BLOCK_SLOTS):
    return layers.attend(q, parts, impl=impl, block_slots=block)


# the model's dense mask, one program per shape (the tests build their inputs on the host, not op by op)
_dense_mask = jax.jit(attention_mask, static_argnums=2)
_mask_dense = jax.jit(layers.CacheMask.dense, static_argnums=(1, 2))  # a CacheMask's dense mask, compiled


def _case(seed: int, b: int, t: int, n: int, kh: int, s: int, h: int = 8, dtype=jnp.float32, lengths=None,
          lazy=False):
    """Queries [B, T, N, H], a cache [B, K, S, H] with random live lengths, a tree mask over T new slots (dense,
    or as a CacheMask when ``lazy``), as host arrays."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, n, h)).astype(dtype)
    k = rng.normal(size=(b, kh, s, h)).astype(dtype)
    v = rng.normal(size=(b, kh, s, h)).astype(dtype)
    lengths = np.asarray(rng.integers(0, s - t + 1, b) if lengths is None else lengths, np.int32)
    block = np.stack([random_tree_mask(rng, t) for _ in range(b)])
    mask = layers.CacheMask(lengths, block) if lazy else np.array(_dense_mask(lengths, block, s))
    return q, k, v, mask, lengths


def _close(a, b, tol):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("impl", ["dpa", "blocked", "prefix"])
@pytest.mark.parametrize("n,kh", [(4, 2), (4, 1), (2, 2)])  # GQA, MQA, MHA
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1))
def test_paths_match_reference_on_tree_masks(impl, n, kh, seed):
    q, k, v, mask, _ = _case(seed, b=3, t=5, n=n, kh=kh, s=64)
    ref = _attend(q, [(k, v, mask)], "einsum")
    got = _attend(q, [(k, v, mask)], impl, block=16)
    assert got.shape == ref.shape == q.shape
    _close(got, ref, 1e-5)


def test_fully_masked_rows_are_zero_and_bfloat16_agrees():
    q, k, v, mask, _ = _case(1, b=2, t=4, n=4, kh=2, s=32)
    mask[0, 2] = mask[1] = False  # one query row of sequence 0, all of sequence 1
    ref = _attend(q, [(k, v, mask)], "einsum")
    np.testing.assert_array_equal(np.asarray(ref)[0, 2], 0.0)
    bq, bk, bv, bmask, _ = _case(3, b=2, t=5, n=4, kh=2, s=64, dtype=jnp.bfloat16)
    bref = _attend(bq, [(bk, bv, bmask)], "einsum")
    for impl in ("dpa", "blocked", "prefix"):
        got = _attend(q, [(k, v, mask)], impl, block=8)
        host = np.asarray(got)
        np.testing.assert_array_equal(host[0, 2], 0.0)
        np.testing.assert_array_equal(host[1], 0.0)
        assert np.abs(host[0, 1]).max() > 0  # visible rows are not zeroed
        _close(got, ref, 1e-5)
        got = _attend(bq, [(bk, bv, bmask)], impl, block=16)
        assert got.dtype == bref.dtype == jnp.bfloat16
        _close(got, bref, 2e-2)


@pytest.mark.parametrize("impl", ["dpa", "blocked", "prefix"])
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1))
def test_two_part_context_and_block(impl, seed):
    """The drafter's pattern: context rows visible below each sequence's length, plus a dense block."""
    rng = np.random.default_rng(seed)
    b, g, n, kh, s, h = 2, 4, 4, 2, 48, 8
    q = rng.normal(size=(b, g, n, h)).astype(np.float32)
    ck, cv = (rng.normal(size=(b, kh, s, h)).astype(np.float32) for _ in range(2))
    bk, bv = (rng.normal(size=(b, kh, g, h)).astype(np.float32) for _ in range(2))
    lengths = rng.integers(0, s + 1, b).astype(np.int32)
    ctx_mask = np.broadcast_to((np.arange(s)[None, :] < lengths[:, None])[:, None, :], (b, g, s))
    parts = [(ck, cv, ctx_mask), (bk, bv, np.ones((1, g, g), bool))]
    ref = _attend(q, parts, "einsum")
    _close(_attend(q, parts, impl, block=16), ref, 1e-5)


@pytest.mark.parametrize("impl", ["blocked", "prefix", "split"])
def test_bounded_paths_read_only_live_slots(impl):
    """Slots past the live length (rounded up to a chunk, or a power of two for ``prefix``) are never read: NaN
    there leaves the result intact (and poisons the reference, which reads the whole bucket). ``split`` gets a
    CacheMask, which every other path makes dense."""
    q, k, v, mask, lengths = _case(2, b=2, t=3, n=4, kh=2, s=128, lengths=[20, 37], lazy=impl == "split")
    dense = _dense_mask(mask.lengths, mask.block, 128) if impl == "split" else mask  # what mask.dense(3, 128) is
    last = int(np.max(lengths)) + 3  # slots [0, last) can be visible
    cut = max(16, 1 << (last - 1).bit_length()) if impl == "prefix" else -(-last // 16) * 16
    assert cut < 128, cut
    clean = _attend(q, [(k, v, dense)], "einsum")
    k_bad, v_bad = k.copy(), v.copy()
    k_bad[:, :, cut:] = v_bad[:, :, cut:] = np.nan
    _close(_attend(q, [(k_bad, v_bad, mask)], impl, block=16), clean, 1e-5)
    assert np.isnan(np.asarray(_attend(q, [(k_bad, v_bad, dense)], "einsum"))).any()
    for other in ("einsum", "dpa", "blocked", "prefix") if impl == "split" else ():
        _close(_attend(q, [(k, v, mask)], other, block=16), clean, 1e-5)


# a chunked prefix in float32; one step over a cache that is not whole chunks in bfloat16
@pytest.mark.parametrize("dtype,tol,s", [(jnp.float32, 1e-5, 64), (jnp.bfloat16, 2e-2, 60)])
def test_split_matches_reference_over_a_cache(dtype, tol, s):
    """Tree masks over a cache as a CacheMask (lengths 0 and up to S - T), GQA and MHA, a fully masked row, the
    drafter's context-plus-block pattern; the dense mask of a CacheMask is the model's."""
    for seed, (n, kh) in enumerate([(4, 2), (2, 2)]):
        q, k, v, cm, lengths = _case(seed, b=4, t=5, n=n, kh=kh, s=s, dtype=dtype, lengths=[0, 7, 33, s - 5],
                                     lazy=True)
        dense = _dense_mask(lengths, cm.block, s)
        np.testing.assert_array_equal(np.asarray(_mask_dense(cm, 5, s)), np.asarray(dense))
        block = cm.block.copy()
        block[1, 3] = False
        cm = layers.CacheMask(lengths, block)  # row 3 of sequence 1 sees the prefix only
        block = block.copy()
        block[0, 2] = False
        empty = layers.CacheMask(lengths, block)  # sequence 0 row 2: nothing at all
        for mask in (cm, empty):
            ref = _attend(q, [(k, v, _mask_dense(mask, 5, s))], "einsum")
            got = _attend(q, [(k, v, mask)], "split", block=16)
            assert got.shape == q.shape and got.dtype == ref.dtype == dtype
            _close(got, ref, tol)
        host = np.asarray(got, np.float32)
        np.testing.assert_array_equal(host[0, 2], 0.0)
        assert np.abs(host[0, 1]).max() > 0
        # the drafter's pattern: context slots below each length, then a dense block part
        bk, bv = k[:, :, :5], v[:, :, :5]
        ctx = layers.CacheMask(lengths)
        parts = [(k, v, ctx), (bk, bv, np.ones((1, 5, 5), bool))]
        ref = _attend(q, [(k, v, _mask_dense(ctx, 5, s)), parts[1]], "einsum")
        _close(_attend(q, parts, "split", block=16), ref, tol)


# slow: the default run checks split's numerics (above, and the device dry run's attention cases) and, in the dry
# run, that dspark and sparklingtree over split equal ar over split
@pytest.mark.slow
@pytest.mark.parametrize("method", ["dspark", "sparklingtree"])
def test_split_keeps_the_tokens(random_pair, method):
    """Greedy generation with the split attention equals the target's own greedy tokens (einsum)."""
    target, drafter = random_pair
    ar = generate(target, None, PROMPTS3, max_new_tokens=NEW_LONG, options=Options(attention="einsum")).tokens
    split = Options(attention="split", block_slots=16)
    assert generate(target, None, PROMPTS3, max_new_tokens=NEW_LONG, options=split).tokens == ar
    spec = "sparklingtree@8" if method == "sparklingtree" else method
    assert generate(target, drafter, PROMPTS3, method=spec, max_new_tokens=NEW_LONG, options=split).tokens == ar


@pytest.mark.slow  # over 5 s; CI runs it in its slow step
@pytest.mark.parametrize("impl", ["dpa", "blocked", "prefix", "split"])
def test_target_verify_logits_match_reference(fixture_target, impl):
    """A Qwen3 tree-verification step over a cache: the reference's logits with each path."""
    rng = np.random.default_rng(6)
    prefix = jnp.asarray(rng.integers(0, 300, (2, 40)), jnp.int32)
    tree = jnp.asarray(random_tree_mask(rng, 6))
    nodes = jnp.asarray(rng.integers(0, 300, (2, 6)), jnp.int32)
    pos = 40 + jnp.asarray(tree.sum(-1) - 1)[None].repeat(2, 0)

    def run(attention):
        cache = fixture_target.init_cache(2, 64)
        pre = jit_call(fixture_target, prefix, jnp.broadcast_to(jnp.arange(40), (2, 40)), cache=cache,
                       attention=attention)
        return jit_call(fixture_target, nodes, pos, cache=pre.cache.with_lengths(jnp.array([40, 33])), mask=tree,
                        attention=attention)

    ref = run("einsum")
    got = run(Options(attention=impl, block_slots=16).attend)
    _close(got.logits, ref.logits, 1e-4)
    for a, b in zip(got.cache.k, ref.cache.k, strict=True):
        _close(a, b, 1e-4)


def test_auto_resolves_by_backend(monkeypatch):
    """The default "auto" runs the blocked path on the CPU backend and the split one elsewhere."""
    seen = []
    monkeypatch.setattr(layers, "_attend_blocked", lambda q, parts, block: seen.append("blocked") or q)
    monkeypatch.setattr(layers, "attend_split", lambda q, parts, block_slots: seen.append("split") or q)
    q = np.zeros((1, 1, 2, 4), np.float32)
    k = np.zeros((1, 1, 2 * layers.BLOCK_SLOTS, 4), np.float32)
    layers.attend(q, [(k, k, np.ones((1, 1, k.shape[2]), bool))])  # the default is "auto"
    monkeypatch.setattr(layers.jax, "default_backend", lambda: "gpu")
    layers.attend(q, [(k, k, np.ones((1, 1, k.shape[2]), bool))], impl="auto")
    assert seen == ["blocked", "split"]


def test_models_take_the_attention_as_an_argument(fixture_target):
    """A model call runs the attention it is given (a name or a callable); an unknown name is refused."""
    calls = []

    def spy(q, parts):
        calls.append(q.shape)
        return layers.attend(q, parts, impl="einsum")

    ids = np.asarray([[1, 2, 3]], np.int32)
    pos = np.arange(3, dtype=np.int32)[None]
    got = jit_call(fixture_target, ids, pos, attention=spy).logits  # traced once: the spy sees each layer once
    assert len(calls) == fixture_target.config.num_hidden_layers
    _close(got, jit_call(fixture_target, ids, pos, attention="einsum").logits, 1e-6)
    with pytest.raises(ArgumentError, match="impl='flash'"):
        jit_call(fixture_target, ids, pos, attention="flash")
    q, k, v, mask, _ = _case(4, b=1, t=2, n=2, kh=1, s=16)
    with pytest.raises(ArgumentError, match="impl='flash'"):
        layers.attend(q, [(k, v, mask)], impl="flash")
