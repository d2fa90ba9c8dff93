"""The loop-free kernels of :mod:`sparkjax.tree` against their step-by-step references (accept, the beam's
preorder, the two-stage top-k), Markov-aware candidates, ``widths="auto"`` profiles and the tree options of the
methods. Jitted functions are module-level with fixed shapes, so hypothesis examples do not recompile."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkjax import reference, tree
from sparkjax.engine import drafting
from sparkjax.engine.methods import Tree
from sparkjax.engine.names import parse_method
from sparkjax.errors import ArgumentError

M = 24  # nodes of the random trees
DEPTHS = (1, 3, 6, M)  # walk lengths (max_depth) tried on every tree

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@jax.jit
def accept_all(parents, tokens, posterior):
    """The visibility (default max_depth = M), then every variant at every walk length: (vectorised, vectorised
    with the verify mask, walk) per depth."""
    full = tree.visibility(parents)
    return full, [(tree.accept(parents, tokens, posterior, max_depth=d),
                   tree.accept(parents, tokens, posterior, max_depth=d, mask=full),
                   tree.accept_walk(parents, tokens, posterior, max_depth=d)) for d in DEPTHS]


def random_tree(rng: np.random.Generator, shape: str) -> tuple[np.ndarray, np.ndarray]:
    """parents (parent index < child index) and tokens over a tiny alphabet with duplicates and -1."""
    if shape == "chain":
        parents = np.arange(M, dtype=np.int32)
    elif shape == "bushy":
        parents = np.array([rng.integers(0, min(i, 3) + 1) for i in range(M)], np.int32)
    else:
        parents = np.array([rng.integers(max(0, i - rng.integers(1, 6)), i + 1) for i in range(M)], np.int32)
    tokens = rng.integers(-1, 4, size=M).astype(np.int32)
    return parents, tokens


def follow(rng, parents, tokens, posterior, p_follow: float) -> None:
    """Make the posterior follow a random root-to-node path, up to a random point (in place)."""
    node = int(rng.integers(1, M + 1))
    path = [node]
    while path[-1]:
        path.append(int(parents[path[-1] - 1]))
    for child, parent in zip(path[:-1], path[1:], strict=True):
        if rng.random() < p_follow and tokens[child - 1] >= 0:
            posterior[parent] = tokens[child - 1]


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), shape=st.sampled_from(["chain", "bushy", "deep"]), p_follow=st.floats(0, 1))
def test_accept_equals_walk(seed, shape, p_follow):
    rng = np.random.default_rng(seed)
    parents, tokens = random_tree(rng, shape)
    posterior = rng.integers(0, 4, size=M + 1).astype(np.int32)
    follow(rng, parents, tokens, posterior, p_follow)
    vis, results = jax.tree.map(np.asarray, accept_all(parents, tokens, posterior))
    np.testing.assert_array_equal(vis, reference.ancestor_mask(parents))
    want_path, want_bonus = reference.accept_walk(parents, tokens, posterior)
    for d, (vec, vec_mask, walk) in zip(DEPTHS, results, strict=True):
        for got in (vec, vec_mask):
            np.testing.assert_array_equal(got.indices, walk.indices, err_msg=f"max_depth={d}")
            assert int(got.length) == int(walk.length) and int(got.bonus) == int(walk.bonus), d
        if d >= len(want_path) - 1:  # the walk was not cut short: the NumPy walk agrees
            assert int(walk.length) == len(want_path) and int(walk.bonus) == want_bonus
            np.testing.assert_array_equal(walk.indices[: len(want_path)], want_path)


def test_accept_duplicate_siblings_lowest_index_wins():
    # root has children 1, 2, 3 with tokens 5, 7, 7; node 2 has child 4, node 3 has child 5 (both token 9)
    parents = np.array([0, 0, 0, 2, 3], np.int32)
    tokens = np.array([5, 7, 7, 9, 9], np.int32)
    posterior = np.array([7, 0, 9, 9, 0, 0], np.int32)
    accept = jax.jit(tree.accept, static_argnames="max_depth")  # one program for both checks
    acc = jax.tree.map(np.asarray, accept(parents, tokens, posterior, max_depth=2))
    np.testing.assert_array_equal(acc.indices, [0, 2, 4])
    assert int(acc.length) == 3 and int(acc.bonus) == posterior[4]
    # padding (-1) never matches a posterior token
    acc = jax.tree.map(np.asarray, accept(parents, np.full(5, -1, np.int32), posterior, max_depth=2))
    np.testing.assert_array_equal(acc.indices, [0, -1, -1])
    assert int(acc.length) == 1 and int(acc.bonus) == posterior[0]


@jax.jit
def beams_and_preorder(tables):
    """The beams of a width profile (slots emptied past a depth's width) and of best_first, and their ranks."""
    out = []
    for widths in ((5, 7, 9, 9, 4, 2, 1), (9,) * 7):
        scores, parent_slot, cand = tree._expand(tables, widths)
        out.append((scores, parent_slot, cand, tree._preorder(parent_slot)))
    return out


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_preorder_ranks_paths_lexicographically(seed):
    """Sorting the kept beam entries by the closed-form preorder rank is sorting their candidate-index
    paths (a prefix first); with full-width beams the ranks are a permutation (empty slots included)."""
    rng = np.random.default_rng(seed)
    tables = -rng.integers(0, 3, size=(7, 4, 4)).astype(np.float32)  # many exact ties
    tables = np.where(rng.random(tables.shape) < 0.3, -np.inf, tables).astype(np.float32)
    tables[..., 0] = np.maximum(tables[..., 0], -2.0)  # every row keeps a possible child: the beams are not empty
    for i, (scores, parent_slot, cand, pre) in enumerate(jax.tree.map(np.asarray, beams_and_preorder(tables))):
        k = scores.shape[1]
        paths = {}
        for lv in range(scores.shape[0]):
            for s in range(k):
                if scores[lv, s] > -np.inf:
                    up = paths[(lv - 1, int(parent_slot[lv, s]))] if lv else ()
                    paths[(lv, s)] = up + (int(cand[lv, s]),)
        kept = list(paths)
        assert sorted(kept, key=lambda e: int(pre[e[0] * k + e[1]])) == sorted(kept, key=lambda e: paths[e])
        assert len({paths[e] for e in kept}) == len(kept) > 1
        if i == 1:
            assert sorted(pre.tolist()) == list(range(pre.size))


TOPK_KS = (1, 5, 8)


@jax.jit
def topk_both(x):
    """(lax.top_k, chunked_top_k with chunk 8) for every k in TOPK_KS, on [3, 37] rows."""
    return [(jax.lax.top_k(x, k), tree.chunked_top_k(x, k, chunk=8)) for k in TOPK_KS]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), nan=st.booleans())
def test_chunked_top_k_equals_lax_top_k(seed, nan):
    rng = np.random.default_rng(seed)
    # a tiny alphabet of values: many exact ties, infinities, and optionally NaN
    alphabet = np.array([-np.inf, -2.0, -1.0, -1.0, 0.0, 0.5, 3.0, np.inf] + ([np.nan] if nan else []), np.float32)
    x = rng.choice(alphabet, size=(3, 37)).astype(np.float32)
    for (want_v, want_i), (got_v, got_i) in topk_both(x):
        np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
        np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))  # NaN == NaN here


def test_chunked_top_k_real_vocabulary():
    """[16, 151936], k = 128 (a DSpark-b16 block over the Qwen3 vocabulary): ties, -inf rows and padding."""
    rng = np.random.default_rng(1)
    x = np.round(rng.normal(size=(16, 151936)) * 4).astype(np.float32)  # ~40 distinct values: ties everywhere
    x[3] = -np.inf  # a row of nothing but -inf: the lowest indices win
    x[5, 1000:] = -np.inf
    x[7, -5:] = 100.0  # the maximum in the last, padded chunk
    want_v, want_i = jax.jit(lambda y: jax.lax.top_k(y, 128))(x)
    assert tree._even_chunk(151936) == 4748  # 32 chunks, no padding (what top_k uses off CPU)
    for chunk in (tree.TOPK_CHUNK, tree._even_chunk(151936)):  # the last chunk padded, then none
        got_v, got_i = jax.jit(lambda y, c=chunk: tree.chunked_top_k(y, 128, c))(x)
        np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
        np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
        np.testing.assert_array_equal(np.asarray(got_i)[3], np.arange(128))
        assert set(np.asarray(got_i)[7, :5].tolist()) == set(range(151936 - 5, 151936))


def test_candidates_stage_out_the_chunked_top_k_for_accelerators():
    """On CPU candidates run lax.top_k (faster there); lowered for GPU they run the two-stage top-k."""
    x = jax.ShapeDtypeStruct((16, 151936), jnp.float32)
    fn = jax.jit(lambda y: tree.candidates(y, 64))
    gpu = fn.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    cpu = fn.trace(x).lower(lowering_platforms=("cpu",)).as_text()
    assert "tensor<16x32x4748xf32>" in gpu and gpu.count("chlo.top_k") == 2
    assert cpu.count("chlo.top_k") == 1 and "32x4748" not in cpu


@pytest.mark.slow  # a compiled program per example
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), widths=st.lists(st.integers(1, 6), min_size=5, max_size=5))
def test_expand_with_traced_widths_keeps_what_static_widths_keep(seed, widths):
    """``_expand(tables, widths, k)`` with the widths as a traced array (one program for every width profile)
    keeps, at every depth, the same entries as the static profile: the same
    scores, parent slots and candidates in its first max(widths) slots, and empty slots after them."""
    rng = np.random.default_rng(seed)
    tables = -rng.integers(0, 3, size=(5, 4, 4)).astype(np.float32)  # exact ties: the tie-break must agree too
    tables[..., 0] = np.maximum(tables[..., 0], -2.0)
    k = 8
    static = [np.asarray(x) for x in tree._expand(tables, tuple(widths))]
    traced = [np.asarray(x) for x in jax.jit(lambda t, w: tree._expand(t, w, k))(tables, np.asarray(widths, np.int32))]
    m = max(widths)
    for depth in range(5):
        kept = static[0][depth] > -np.inf
        np.testing.assert_array_equal(traced[0][depth][:m], static[0][depth])
        for got, want in zip(traced[1:], static[1:], strict=True):
            np.testing.assert_array_equal(got[depth][:m][kept], want[depth][kept])
        assert np.all(traced[0][depth][m:] == -np.inf)


def _logits(seed, d=5, v=40):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(d, v)) * 3).astype(np.float32), (rng.normal(size=(d, v)) * 3).astype(np.float32)


def test_merge_candidates_keeps_the_first_distinct_valid_tokens():
    pool = np.asarray([5, 3, 5, 9, 3, 1, 7, 2], np.int32)
    valid = np.asarray([True, True, True, False, True, True, True, True])
    out = np.asarray(jax.jit(tree.merge_candidates, static_argnums=2)(pool, valid, 4))
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
    assert all(0.0 <= x <= 1.0 for x in tree.DEMO_DEPTH_RATES)  # the default profile
    assert tree.auto_widths(64, 16) == tree.auto_widths(64, 16, tree.DEMO_DEPTH_RATES)


def test_tree_options_validate():
    assert Tree("sparklingtree", candidates="base").candidates == "base"
    assert Tree("sparklingtree").candidates == "union" and Tree("sparklingtree-beam").candidates == "union"
    assert Tree("ddtree").candidates == "base"
    assert parse_method("sparklingtree@16", candidates="corrected") == Tree("sparklingtree", 16, candidates="corrected")
    assert parse_method("sparklingtree-beam", widths="auto").widths == "auto"
    for name, call in [
        ("candidates", lambda: Tree("sparklingtree", candidates="both")),
        ("candidates", lambda: Tree("ddtree", candidates="union")),  # no Markov head to follow
        ("candidates", lambda: parse_method("dspark", candidates="union")),
        ("candidates", lambda: parse_method(Tree("sparklingtree"), candidates="union")),
        ("widths", lambda: parse_method("sparklingtree", widths="auto")),
        ("widths", lambda: parse_method("sparklingtree-beam", widths="uneven")),
    ]:
        with pytest.raises(ArgumentError, match=name):
            call()


@pytest.mark.slow
def test_union_candidates_contain_the_dspark_chain(pair, ref):
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
