"""Markov-aware tree candidates (``candidates="base" | "corrected" | "union"``) and ``widths="auto"`` beam profiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkjax import generate, tree
from sparkjax.engine import drafting
from sparkjax.engine.methods import Tree, parse_method
from sparkjax.errors import ArgumentError

# ------------------------------------------------------------------------------------------------ pure functions


def _logits(seed, d=5, v=40):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=(d, v)) * 3, jnp.float32), jnp.asarray(rng.normal(size=(d, v)) * 3, jnp.float32)


def test_merge_candidates_keeps_the_first_distinct_valid_tokens():
    pool = jnp.asarray([5, 3, 5, 9, 3, 1, 7, 2], jnp.int32)
    valid = jnp.asarray([True, True, True, False, True, True, True, True])
    out = np.asarray(tree.merge_candidates(pool, valid, 4))
    # walk the pool by hand: 5 kept, 3 kept, 5 duplicate, 9 invalid, 3 duplicate, 1 kept, 7 kept
    assert out.tolist() == [5, 3, 1, 7]


@pytest.mark.parametrize("mode", tree.CANDIDATE_MODES)
@pytest.mark.parametrize("top_c", [1, 8, 40])
def test_markov_candidates_shapes_and_contents(mode, top_c):
    base, corr = _logits(top_c)
    out = np.asarray(jax.jit(tree.markov_candidates, static_argnums=(2, 3))(base, corr, top_c, mode))
    c = min(top_c, base.shape[1])
    assert out.shape == (base.shape[0], c) and out.dtype == np.int32
    for row in out:
        assert len(set(row.tolist())) == c  # distinct tokens
    base_top = np.argsort(-np.asarray(base), axis=1, kind="stable")[:, :c]
    corr_top = np.argsort(-np.asarray(corr), axis=1, kind="stable")[:, :c]
    if mode == "base":
        np.testing.assert_array_equal(out, base_top)
    elif mode == "corrected":
        np.testing.assert_array_equal(out, corr_top)
    else:
        np.testing.assert_array_equal(out[0], corr_top[0])  # depth 1: the exact corrected row
        k = max(1, c // 4)
        for d in range(1, out.shape[0]):
            want = list(dict.fromkeys(corr_top[d, :k].tolist() + base_top[d].tolist()))[:c]
            assert out[d].tolist() == want
            assert np.argmax(np.asarray(corr[d])) in out[d]  # the corrected argmax is always reachable


def test_markov_candidates_bad_input():
    base, corr = _logits(0)
    with pytest.raises(ArgumentError, match="candidates"):
        tree.markov_candidates(base, corr, 8, "both")
    with pytest.raises(ArgumentError, match="union_k"):
        tree.markov_candidates(base, corr, 8, "union", union_k=9)
    with pytest.raises(ArgumentError, match="corrected_logits"):
        tree.markov_candidates(base, corr[:, :10], 8, "union")
    with pytest.raises(ArgumentError, match="exponent"):
        tree.auto_widths(8, 4, (0.5,), exponent=0)


@settings(max_examples=150, deadline=None)
@given(
    budget=st.integers(1, 300),
    depth=st.integers(1, 12),
    rates=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=14),
    top_c=st.one_of(st.none(), st.integers(1, 40)),
)
def test_auto_widths_sum_to_the_budget_without_gaps(budget, depth, rates, top_c):
    reach = None if top_c is None else sum(top_c**k for k in range(1, depth + 1))
    if reach is not None and budget > reach:
        with pytest.raises(ArgumentError, match="budget"):
            tree.auto_widths(budget, depth, tuple(rates), top_c)
        return
    w = tree.auto_widths(budget, depth, tuple(rates), top_c)
    assert len(w) == depth and sum(w) == budget and all(x >= 0 for x in w)
    first_zero = w.index(0) if 0 in w else depth
    assert not any(w[first_zero:])
    if top_c is not None:
        assert all(x <= top_c ** (i + 1) for i, x in enumerate(w))
        assert all(w[i] <= w[i - 1] * top_c for i in range(1, depth))


def test_auto_widths_follow_the_rates():
    # a sure first depth needs one node; a coin-flip depth gets more; a hopeless tail gets what is left
    w = tree.auto_widths(10, 3, (1.0, 0.5, 0.0))
    assert w[0] == 1 and w[1] > w[2] and sum(w) == 10
    assert tree.auto_widths(4, 8, (1.0,)) == (1, 1, 1, 1, 0, 0, 0, 0)  # a sure chain: one node per depth
    for bad in ((), (0.5, 1.5), (float("nan"),), "0.5"):
        with pytest.raises(ArgumentError, match="rates"):
            tree.auto_widths(8, 4, bad)


def test_demo_depth_rates_are_a_profile():
    r = tree.DEMO_DEPTH_RATES
    assert len(r) >= 1 and all(0.0 <= x <= 1.0 for x in r)


# ------------------------------------------------------------------------------------------------ methods


def test_tree_options_validate():
    assert Tree("sparklingtree", candidates="base").candidates == "base"
    assert Tree("sparklingtree").candidates == "union" and Tree("sparklingtree-beam").candidates == "union"
    assert Tree("ddtree").candidates == "base"
    assert parse_method("sparklingtree@16", candidates="corrected") == Tree("sparklingtree", 16, candidates="corrected")
    assert parse_method("sparklingtree-beam", widths="auto").widths == "auto"
    with pytest.raises(ArgumentError, match="candidates"):
        Tree("sparklingtree", candidates="both")
    with pytest.raises(ArgumentError, match="candidates"):
        Tree("ddtree", candidates="union")  # no Markov head to follow
    with pytest.raises(ArgumentError, match="candidates"):
        parse_method("dspark", candidates="union")
    with pytest.raises(ArgumentError, match="candidates"):
        parse_method(Tree("sparklingtree"), candidates="union")
    with pytest.raises(ArgumentError, match="widths"):
        parse_method("sparklingtree", widths="auto")
    with pytest.raises(ArgumentError, match="widths"):
        parse_method("sparklingtree-beam", widths="uneven")


@pytest.fixture(scope="module")
def pair(fixture_target, fixture_drafter):
    return fixture_target, fixture_drafter


@pytest.fixture(scope="module")
def prompts(ref):  # test_decode's three prompts: the same compiled AR program
    p = ref["a.prompt_ids"][0].tolist()
    return [p, np.random.default_rng(7).integers(0, 300, 13).tolist(), p[:19]]


@pytest.fixture(scope="module")
def ar(pair, prompts):
    return generate(pair[0], None, prompts, max_new_tokens=24).tokens


# sparklingtree's default (union candidates) is test_decode's test_greedy_equals_ar_on_fixture_pair[sparklingtree-8]
@pytest.mark.parametrize("method,kw", [
    pytest.param("sparklingtree", {"candidates": "corrected"}, marks=pytest.mark.slow),
    ("sparklingtree-beam", {"candidates": "union", "widths": "auto"}),
    pytest.param("sparklingtree-beam", {"widths": "auto", "candidates": "base"}, marks=pytest.mark.slow),
])
def test_greedy_equals_ar_with_tree_options(pair, prompts, ar, method, kw):
    target, drafter = pair
    out = generate(target, drafter, prompts, method=method, budget=8, max_new_tokens=24, **kw)
    assert out.tokens == ar
    assert max(max(lens) for lens in out.acceptance_lengths) > 2  # the trained drafter really gets accepted


def test_union_candidates_contain_the_dspark_chain(pair, ref, monkeypatch):
    """On a real round of the fixture pair: every depth's union candidates hold the greedy DSpark chain's token
    (the corrected argmax for the chain's parent), at static shapes."""
    target, drafter = pair
    cfg = drafter.config
    ids = jnp.asarray(ref["a.prompt_ids"][:1], jnp.int32)
    p = ids.shape[1] - 1

    @jax.jit
    def round_candidates(ids):
        tout = target(ids, jnp.arange(ids.shape[1], dtype=jnp.int32)[None], hidden_layers=cfg.target_layer_ids,
                      compute_logits=False)
        feats = drafting.features_from_hidden(tout.hidden)
        ctx = drafting.append_context(drafter, drafter.init_context(1, 64), feats[:, :p], jnp.array([p]))
        x0 = ids[:, p]
        blk = drafting.draft_block(drafter, ctx, x0, jnp.array([p]))
        chain = drafting.markov_chain(drafter, blk.logits, blk.hidden, x0)
        base = drafting.aligned_logits(drafter, blk.logits)[0]
        one = drafting.markov_chain_fixed_point(drafter, blk.logits, blk.hidden, x0, max_passes=1)[0]
        full = drafting.markov_chain_fixed_point(drafter, blk.logits, blk.hidden, x0, max_passes=cfg.block_size)
        return (chain.tokens[0], [tree.markov_candidates(base, chain.logits[0], c, "union") for c in (2, 8)],
                chain, one, full, blk)

    chain, cands, exact, one, (full, passes), blk = round_candidates(ids)
    x0 = ids[:, p]
    for mode, want in (("scan", exact), ("fixed_point", one)):  # what the tree's candidates read, per backend
        # jitted per mode: op by op, the two calls took most of this test's time
        got = jax.jit(lambda lg, h, x, m=mode: drafting.candidate_chain_logits(drafter, lg, h, x, mode=m))(
            blk.logits, blk.hidden, x0)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want.logits), rtol=1e-5, atol=1e-4)
    # the unrolled passes: G passes are the sequential chain; one pass corrects slot 0 exactly (its prev is x_start)
    np.testing.assert_array_equal(np.asarray(full.tokens), np.asarray(exact.tokens))
    assert 1 <= int(passes) <= cfg.block_size
    np.testing.assert_allclose(np.asarray(one.logits[:, 0]), np.asarray(exact.logits[:, 0]), rtol=1e-5, atol=1e-5)
    assert one.logits.shape == exact.logits.shape
    for c, cand in zip((2, 8), cands, strict=True):
        cand = np.asarray(cand)
        assert cand.shape == (cfg.block_size, c)
        for d, tok in enumerate(np.asarray(chain)):
            assert tok in cand[d]
