"""The loop-free kernels of :mod:`sparkjax.tree` against their step-by-step references.

* :func:`sparkjax.tree.accept` (all depths at once) equals :func:`sparkjax.tree.accept_walk` (the
  ``fori_loop`` walk) and the NumPy walk of :mod:`sparkjax.reference` on random trees with duplicate
  sibling tokens, padding and truncated walks.

Jitted functions are module-level with fixed shapes, so hypothesis examples do not recompile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkjax import reference as ref
from sparkjax import tree

M = 24  # nodes of the random trees
DEPTHS = (1, 3, 6, M)  # walk lengths (max_depth) tried on every tree

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@jax.jit
def accept_all(parents, tokens, posterior):
    """Every variant at every walk length: (vectorised, vectorised with the verify mask, walk) per depth."""
    out = []
    full = tree.visibility(parents)  # complete rows at any depth
    for d in DEPTHS:
        out.append((
            tree.accept(parents, tokens, posterior, max_depth=d),
            tree.accept(parents, tokens, posterior, max_depth=d, mask=full),
            tree.accept_walk(parents, tokens, posterior, max_depth=d),
        ))
    return out


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
    results = jax.tree.map(np.asarray, accept_all(parents, tokens, posterior))
    want_path, want_bonus = ref.accept_walk(parents, tokens, posterior)
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
    acc = jax.tree.map(np.asarray, tree.accept(parents, tokens, posterior, max_depth=2))
    np.testing.assert_array_equal(acc.indices, [0, 2, 4])
    assert int(acc.length) == 3 and int(acc.bonus) == posterior[4]
    # padding (-1) never matches a posterior token
    acc = jax.tree.map(np.asarray, tree.accept(parents, np.full(5, -1, np.int32), posterior, max_depth=2))
    np.testing.assert_array_equal(acc.indices, [0, -1, -1])
    assert int(acc.length) == 1 and int(acc.bonus) == posterior[0]


def test_accept_batched_like_the_engine():
    """vmap over a batch with the verify mask, as engine/round.py calls it, equals per-sequence walks."""
    rng = np.random.default_rng(0)
    trees = [random_tree(rng, s) for s in ("chain", "bushy", "deep", "bushy")]
    parents = np.stack([p for p, _ in trees])
    tokens = np.stack([t for _, t in trees])
    posterior = rng.integers(0, 4, size=(4, M + 1)).astype(np.int32)
    for b in range(4):
        follow(rng, parents[b], tokens[b], posterior[b], 1.0)

    @jax.jit
    def batched(parents, tokens, posterior):
        masks = jax.vmap(tree.visibility, in_axes=(0, None))(parents, M)
        return jax.vmap(lambda p, t, q, m: tree.accept(p, t, q, M, mask=m))(parents, tokens, posterior, masks)

    got = batched(parents, tokens, posterior)
    lengths = []
    for b in range(4):
        want = tree.accept_walk(parents[b], tokens[b], posterior[b], max_depth=M)
        for field in tree.Accepted._fields:
            np.testing.assert_array_equal(np.asarray(getattr(got, field))[b], np.asarray(getattr(want, field)))
        lengths.append(int(want.length))
    assert max(lengths) > 1  # the posteriors follow paths, so something is accepted


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


# ----------------------------------------------------------------------------------------------------------
# two-stage top-k

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
