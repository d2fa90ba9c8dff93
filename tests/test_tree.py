"""Tests of :mod:`sparkjax.tree`: upstream DDTree fixtures, NumPy references, properties, jit / vmap hygiene.

Jitted pipelines are module-level and fed inputs padded to a few fixed shapes (vocabulary padded with
``-inf`` logits, depths masked with ``-inf`` tables), so hypothesis examples do not recompile.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

from sparkjax import reference as ref
from sparkjax import tree
from sparkjax.errors import ArgumentError, SparkjaxError
from tests.conftest import jit_exact

FIXTURES = Path(__file__).parent / "fixtures" / "tiny_dspark_b16"
TREE_NAMES = ["dspark_aligned", "dspark_full", "dflash_slice", "random", "random_peaked"]
FIXTURE_BUDGETS = [16, 64, 128]

D_PAD = 16  # padded depth of the hypothesis pipelines
V_PAD = 12  # padded vocabulary of the hypothesis pipelines
M_PAD = 256  # budget of the DDTree pipeline (smaller budgets are its prefixes)
M_MARKOV = 64  # budget of the Markov pipeline
C_MARKOV = 6  # top-C of the Markov pipeline (< V_PAD, so candidates are a real restriction)
R = 4  # Markov rank in the hypothesis tests

PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def fixture() -> dict[str, np.ndarray]:
    return load_file(str(FIXTURES / "reference.safetensors"))


@functools.partial(jax.jit, static_argnames=("budget",))
def ddtree_pipeline(logits, budget):
    tokens, logp = tree.candidates(logits, budget)
    t = tree.best_first(tree.ddtree_tables(logp), tokens, budget)
    return t, tree.visibility(t.parents, max_depth=logits.shape[0])


@functools.partial(jax.jit, static_argnames=("budget", "top_c"))
def ddtree_padded(logits, n_depth, budget, top_c):
    tokens, logp = tree.candidates(logits, top_c)
    logp = jnp.where(jnp.arange(logp.shape[0])[:, None] < n_depth, logp, -jnp.inf)
    tables = tree.ddtree_tables(logp)
    t = tree.best_first(tables, tokens, budget)
    return t, tables, tokens, tree.visibility(t.parents, max_depth=logits.shape[0])


@functools.partial(jax.jit, static_argnames=("budget", "top_c", "normalization"))
def sparkling_padded(base, x_start, w1, w2, n_depth, budget, top_c, normalization):
    tokens, _ = tree.candidates(base, top_c)
    feats = tree.vanilla_parent_feats(w1, x_start, tokens)
    tables = tree.markov_tables(base, tokens, feats, w2, normalization)
    tables = jnp.where(jnp.arange(tables.shape[0])[:, None, None] < n_depth, tables, -jnp.inf)
    return tree.best_first(tables, tokens, budget), tables, tokens


best_first_jit = jax.jit(tree.best_first, static_argnames=("budget",))
beam_jit = jax.jit(tree.beam, static_argnames=("widths",))
accept_jit = jax.jit(tree.accept, static_argnames=("max_depth",))

BEAM_PROFILES = [
    tree.even_widths(64, D_PAD),
    (1,) * D_PAD,
    (12, 8, 6, 4, 3, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1),
    (3, 3, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
]


def to_np(x):
    return jax.tree.map(np.asarray, x)


def token_paths(tokens, parents, n: int | None = None) -> list[tuple[int, ...]]:
    """Root-to-node token path of every node (index 0 = root = ()); ``n`` nodes are read."""
    n = len(tokens) if n is None else n
    paths: list[tuple[int, ...]] = [()]
    for i in range(n):
        paths.append(paths[int(parents[i])] + (int(tokens[i]),))
    return paths


def prefix_scores(t, n: int | None = None) -> dict[tuple[int, ...], float]:
    """{token path: score} of the valid nodes among the first ``n``."""
    n = len(t.tokens) if n is None else n
    paths = token_paths(t.tokens, t.parents, n)
    return {paths[i + 1]: float(t.scores[i]) for i in range(n) if t.valid[i]}


def assert_same_prefixes(a: dict, b: dict, rel: float = 1e-4) -> None:
    """Same prefix sets with close scores, except that near-ties at the selection boundary may swap."""
    assert len(a) == len(b), (len(a), len(b))
    for p in a.keys() & b.keys():
        assert abs(a[p] - b[p]) <= rel * (1.0 + abs(a[p])), (p, a[p], b[p])
    for mine, other in ((a, b), (b, a)):
        worst = min(other.values(), default=np.inf)
        for p in mine.keys() - other.keys():
            assert mine[p] <= worst + rel * (1.0 + abs(worst)), f"{p} (score {mine[p]}) beats the other's worst {worst}"


def assert_trees_equal(t, r, n: int | None = None) -> None:
    for field in tree.Tree._fields:
        a, b = np.asarray(getattr(t, field))[:n], np.asarray(getattr(r, field))[:n]
        np.testing.assert_array_equal(a, b, err_msg=field)


def check_valid_tree(t, max_depth: int, tables=None, cand_tokens=None) -> None:
    """Structural invariants of a padded tree, and its scores against the tables if given."""
    tokens, parents, depths, scores, cands, valid = (np.asarray(x) for x in t)
    n = int(valid.sum())
    assert valid[:n].all() and not valid[n:].any(), "padding must come last"
    assert (tokens[n:] == -1).all() and (parents[n:] == 0).all() and (depths[n:] == 1).all()
    assert np.isneginf(scores[n:]).all() and (cands[n:] == -1).all()
    assert np.isfinite(scores[:n]).all()
    assert (np.diff(scores[:n]) <= 0).all(), "scores must be non-increasing"
    for i in range(n):
        p = int(parents[i])
        assert 0 <= p <= i, f"parent {p} of node {i + 1} does not precede it"
        assert depths[i] == (depths[p - 1] if p else 0) + 1
        assert 1 <= depths[i] <= max_depth
    siblings = {(int(parents[i]), int(tokens[i])) for i in range(n)}
    assert len(siblings) == n, "siblings must have distinct tokens"
    assert len(set(token_paths(tokens, parents, n))) == n + 1, "duplicate prefix"
    if tables is not None:
        tables = np.minimum(np.asarray(tables, np.float32), np.float32(0))
        for i in range(n):
            d, p = int(depths[i]) - 1, int(parents[i])
            assert tokens[i] == cand_tokens[d, cands[i]]
            parent_score = scores[p - 1] if p else np.float32(0)
            row = cands[p - 1] if p else 0
            assert scores[i] == np.float32(parent_score + tables[d, row, cands[i]])


def random_head(seed: int, v: int) -> tuple[np.ndarray, np.ndarray]:
    """A random vanilla Markov head ``(w1, w2)`` [V_PAD, R] for a vocabulary of ``v`` (zero rows past it)."""
    rng = np.random.default_rng(seed)
    w1 = np.zeros((V_PAD, R), np.float32)
    w2 = np.zeros((V_PAD, R), np.float32)
    w1[:v] = rng.normal(size=(v, R))
    w2[:v] = rng.normal(size=(v, R)) * rng.uniform(0.1, 2.0)
    return w1, w2


def padded_logits(x: np.ndarray) -> np.ndarray:
    """[D, V] -> [D_PAD, V_PAD]: vocabulary padded with -inf, depth rows with zeros (masked later)."""
    out = np.zeros((D_PAD, V_PAD), np.float32)
    out[:, x.shape[1] :] = -np.inf
    out[: x.shape[0], : x.shape[1]] = x
    return out


@st.composite
def logit_matrices(draw, max_depth: int = D_PAD, max_vocab: int = V_PAD) -> np.ndarray:
    """[D, V] logits: integer valued (many exact ties) or continuous, of varied sharpness."""
    d = draw(st.integers(1, max_depth))
    v = draw(st.integers(1, max_vocab))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if draw(st.booleans()):
        return rng.integers(-3, 4, size=(d, v)).astype(np.float32)
    return (rng.normal(size=(d, v)) * rng.uniform(0.3, 8.0)).astype(np.float32)


def random_tables(rng: np.random.Generator, integer: bool) -> tuple[np.ndarray, np.ndarray]:
    """Parent-dependent [D_PAD, C, C] tables (C = V_PAD) with some impossible (-inf) children.

    ``integer``: unnormalised non-positive integers, so that path scores tie exactly all the time, also
    across parents of different scores and between a parent and its child (entry 0); this exercises the
    tie-break. Otherwise: log-softmax of continuous random logits.
    """
    shape = (D_PAD, V_PAD, V_PAD)
    if integer:
        tables = -rng.integers(0, 4, size=shape).astype(np.float32)
    else:
        tables = ref.log_softmax(rng.normal(size=shape) * 3)
    tables = np.where(rng.random(shape) < 0.1, -np.inf, tables).astype(np.float32)
    tables[..., 0] = np.maximum(tables[..., 0], -10.0)  # every row keeps at least one possible child
    cand_tokens = np.stack([rng.permutation(50)[:V_PAD] for _ in range(D_PAD)]).astype(np.int32)
    return tables, cand_tokens


@pytest.mark.parametrize("budget", FIXTURE_BUDGETS)
@pytest.mark.parametrize("name", TREE_NAMES)
def test_fixture_ddtree_trees(name, budget):
    fx = fixture()
    t, vis = to_np(ddtree_pipeline(fx[f"d.{name}.logits"], budget=budget))
    key = f"d.{name}.b{budget}"
    parents = fx[f"{key}.parents"]
    assert t.valid.all()
    # the same token paths with the same depths and scores ...
    fx_paths = token_paths(fx[f"{key}.node_token_ids"], parents[1:])[1:]
    want = dict(zip(fx_paths, fx[f"{key}.node_logw"].tolist(), strict=True))
    got = prefix_scores(t)
    assert got.keys() == want.keys()
    np.testing.assert_allclose([got[p] for p in want], list(want.values()), atol=1e-5, rtol=0)
    # ... and, since our order is upstream's order, the very same arrays
    np.testing.assert_array_equal(t.tokens, fx[f"{key}.node_token_ids"])
    np.testing.assert_array_equal(t.depths, fx[f"{key}.node_depths"])
    np.testing.assert_array_equal(t.parents, parents[1:])
    assert parents[0] == -1
    np.testing.assert_array_equal(vis, fx[f"{key}.visibility"])
    check_valid_tree(t, fx[f"d.{name}.logits"].shape[0])


def _node_map(fx_tokens, fx_parents, t) -> np.ndarray:
    """perm[fixture node index] = our node index (root 0 -> 0), matched by token path."""
    ours = {p: i for i, p in enumerate(token_paths(t.tokens, t.parents))}
    return np.array([ours[p] for p in token_paths(fx_tokens, fx_parents)])


@pytest.mark.parametrize("case", ["greedy_chain", "reject_at_root", "second_branch", "random"])
def test_fixture_follow(case):
    fx = fixture()
    t, _ = to_np(ddtree_pipeline(fx["d.random.logits"], budget=64))
    perm = _node_map(fx["d.random.b64.node_token_ids"], fx["d.random.b64.parents"][1:], t)
    posterior = np.empty(65, np.int32)
    posterior[perm] = fx[f"d.follow.{case}.posterior"][0]
    acc = to_np(accept_jit(t.parents, t.tokens, posterior, max_depth=15))
    want = fx[f"d.follow.{case}.accepted_indices"]
    assert acc.length == len(want)
    np.testing.assert_array_equal(acc.indices[: acc.length], perm[want])
    assert (acc.indices[acc.length :] == -1).all()
    assert acc.bonus == fx[f"d.follow.{case}.next_token"][0]


def test_fixture_verify():
    fx = fixture()
    t, vis = to_np(ddtree_pipeline(fx["d.dspark_aligned.logits"], budget=64))
    perm = _node_map(fx["d.dspark_aligned.b64.node_token_ids"], fx["d.dspark_aligned.b64.parents"][1:], t)
    inv = np.argsort(perm)  # our node -> fixture node
    ids = fx["d.verify.verify_input_ids"][0]
    np.testing.assert_array_equal(np.concatenate([[ids[0]], t.tokens]), ids[inv])
    pos = fx["d.verify.position_ids"][0]
    np.testing.assert_array_equal(np.asarray(tree.tree_positions(t.depths, int(pos[0]))), pos[inv])
    tree_block = fx["d.verify.attention_mask"][0, 0][:, -65:] == 0
    np.testing.assert_array_equal(vis, tree_block[np.ix_(inv, inv)])
    posterior = fx["d.verify.posterior"][0][inv]
    acc = to_np(accept_jit(t.parents, t.tokens, posterior, max_depth=15))
    np.testing.assert_array_equal(acc.indices[: acc.length], perm[fx["d.verify.accepted_indices"]])
    assert acc.bonus == fx["d.verify.next_token"][0]


@pytest.mark.parametrize(("depth", "vocab", "top_c"), [(3, 5, 8), (2, 1, 4), (4, 7, 3), (1, 6, 6)])
def test_candidates(depth, vocab, top_c):
    rng = np.random.default_rng(depth * 100 + vocab)
    logits = rng.integers(-2, 3, size=(depth, vocab)).astype(np.float32)  # with ties
    tokens, logp = to_np(jax.jit(tree.candidates, static_argnums=1)(logits, top_c))
    c = min(top_c, vocab)
    assert tokens.shape == (depth, c) and logp.shape == (depth, c)
    assert tokens.dtype == np.int32 and logp.dtype == np.float32
    full = ref.log_softmax(logits)
    for d in range(depth):
        np.testing.assert_array_equal(tokens[d], ref.top_k(full[d], c))  # lower token id first on ties
        np.testing.assert_allclose(logp[d], full[d, tokens[d]], atol=1e-6)
    np.testing.assert_allclose(np.exp(full).sum(-1), 1.0, atol=1e-5)


@jax.jit
def markov_cases(base, feats, w1, w2):
    """Exact and fast tables: of given features (C < V); of vanilla features from x_start 2 (C = V); of a zero
    head (C = 4), with DDTree's tables."""
    norms = ("exact", "fast")
    tokens, _ = tree.candidates(base, feats.shape[1])
    given = [tree.markov_tables(base, tokens, feats, w2, n) for n in norms]
    tokens_v, _ = tree.candidates(base, base.shape[1])
    feats_v = tree.vanilla_parent_feats(w1, 2, tokens_v)
    full = [tree.markov_tables(base, tokens_v, feats_v, w2, n) for n in norms]
    tokens4, logp4 = tree.candidates(base, 4)
    feats4 = tree.vanilla_parent_feats(w1, 0, tokens4)
    zero = [tree.markov_tables(base, tokens4, feats4, jnp.zeros_like(w2), n) for n in norms]
    return tokens, given, tokens_v, feats_v, full, zero, tree.ddtree_tables(logp4)


def test_markov_tables():
    rng = np.random.default_rng(0)
    d, v, c, r = 4, 9, 5, 3
    base = rng.normal(size=(d, v)).astype(np.float32) * 2
    w2 = rng.normal(size=(v, r)).astype(np.float32)
    feats = rng.normal(size=(d, c, r)).astype(np.float32)  # not vanilla (e.g. gated)
    w1 = rng.normal(size=(v, r)).astype(np.float32)
    tokens, given, tokens_v, feats_v, (exact, fast), zero, ddtree = to_np(markov_cases(base, feats, w1, w2))
    want = {n: ref.markov_tables(base, tokens, feats, w2, n) for n in ("exact", "fast")}
    for norm, got in zip(want, given, strict=True):  # the entry-by-entry formulas
        np.testing.assert_allclose(got, want[norm], atol=2e-5, err_msg=norm)
        np.testing.assert_array_equal(got[0], np.broadcast_to(got[0, :1], got[0].shape))  # one root row
    assert np.abs(want["exact"][1:] - want["fast"][1:]).max() > 1e-3  # the two really differ when C < V
    np.testing.assert_allclose(want["exact"][0], want["fast"][0], atol=1e-12)  # depth 1 is exact in both
    np.testing.assert_allclose(feats_v[0], np.broadcast_to(w1[2], (v, r)))
    np.testing.assert_allclose(feats_v[1:], w1[tokens_v[:-1]])
    np.testing.assert_allclose(exact, fast, atol=1e-5)  # C = V: the fast normalisation is exact
    for t in zero:  # a zero head gives DDTree's independent marginals, in both normalisations
        np.testing.assert_allclose(t, ddtree, atol=1e-6)


@PROPERTY
@given(logits=logit_matrices(), budget=st.integers(1, M_PAD))
def test_ddtree_properties(logits, budget):
    d, v = logits.shape
    t, tables, tokens, vis = to_np(ddtree_padded(padded_logits(logits), d, budget=M_PAD, top_c=V_PAD))
    check_valid_tree(t, d, tables, tokens)
    assert t.valid.sum() == min(M_PAD, sum(v**k for k in range(1, d + 1)))
    np.testing.assert_array_equal(vis, ref.ancestor_mask(t.parents))
    # bit-exact against the heap on the same tables (same order, ties included)
    assert_trees_equal(t, ref.table_heap(tables, tokens, M_PAD))
    # the first `budget` nodes are upstream DDTree's tree for that budget (C = V >= min(budget, V))
    assert_same_prefixes(prefix_scores(t, budget), prefix_scores(ref.ddtree_heap(logits, budget)))


@PROPERTY
@given(
    base=logit_matrices(max_vocab=V_PAD),
    seed=st.integers(0, 2**32 - 1),
    budget=st.integers(1, M_MARKOV),
    x_frac=st.floats(0, 1, exclude_max=True),
)
def test_sparkling_properties(base, seed, budget, x_frac):
    d, v = base.shape
    w1, w2 = random_head(seed, v)
    x_start = int(x_frac * v)
    args = (padded_logits(base), x_start, w1, w2, d)
    t, tables, tokens = to_np(sparkling_padded(*args, budget=M_MARKOV, top_c=C_MARKOV, normalization="exact"))
    check_valid_tree(t, d, tables, tokens)
    assert_trees_equal(t, ref.table_heap(tables, tokens, M_MARKOV))
    # the tables are the exact Markov log-softmax restricted to the candidates
    c = min(C_MARKOV, v)
    feats = np.concatenate([np.broadcast_to(w1[x_start], (1, c, R)), w1[tokens[: d - 1, :c]]])
    np.testing.assert_allclose(
        tables[:d, :c, :c], ref.markov_tables(base, tokens[:d, :c], feats, w2[:v], "exact"), atol=5e-5
    )
    # ... so best-first over them is the naive SparklingTree restricted to the base top-C candidates
    naive = ref.naive_sparkling_tree(base, x_start, lambda _d, p: w1[p], w2[:v], budget, top_c=C_MARKOV)
    assert_same_prefixes(prefix_scores(t, budget), prefix_scores(naive))
    # the fast tables give a valid tree as well, and agree with their own formula
    tf, tables_f, _ = to_np(sparkling_padded(*args, budget=M_MARKOV, top_c=C_MARKOV, normalization="fast"))
    check_valid_tree(tf, d, tables_f, tokens)
    np.testing.assert_allclose(
        tables_f[:d, :c, :c], ref.markov_tables(base, tokens[:d, :c], feats, w2[:v], "fast"), atol=5e-5
    )


@PROPERTY
@given(
    seed=st.integers(0, 2**32 - 1),
    integer=st.booleans(),
    depth=st.integers(1, D_PAD),
    profile=st.sampled_from(range(len(BEAM_PROFILES))),
)
def test_beam_and_best_first_on_markov_tables(seed, integer, depth, profile):
    rng = np.random.default_rng(seed)
    tables, tokens = random_tables(rng, integer)
    tables[depth:] = -np.inf
    widths = BEAM_PROFILES[profile]
    b = to_np(beam_jit(tables, tokens, widths=widths))
    check_valid_tree(b, depth, tables, tokens)
    assert_trees_equal(b, ref.beam_tree(tables, tokens, widths))
    assert all(np.sum(b.valid & (b.depths == k + 1)) <= w for k, w in enumerate(widths))
    t = to_np(best_first_jit(tables, tokens, budget=M_MARKOV))
    check_valid_tree(t, depth, tables, tokens)
    assert_trees_equal(t, ref.table_heap(tables, tokens, M_MARKOV))


def test_best_first_prefix_property_and_budgets():
    """best_first(b) equals the first b nodes of best_first(M) (different static budgets)."""
    rng = np.random.default_rng(7)
    tables, tokens = random_tables(rng, integer=True)
    big = to_np(best_first_jit(tables, tokens, budget=M_MARKOV))
    for b in (1, 5, 33):
        assert_trees_equal(to_np(best_first_jit(tables, tokens, budget=b)), big, n=b)


def test_even_widths():
    assert tree.even_widths(64, 16) == (4,) * 16
    assert tree.even_widths(10, 4) == (3, 3, 2, 2)
    assert tree.even_widths(3, 5) == (1, 1, 1, 0, 0)
    for b, d in [(1, 1), (7, 3), (256, 16), (5, 16)]:
        assert sum(tree.even_widths(b, d)) == b and len(tree.even_widths(b, d)) == d


def test_build_under_transfer_guard():
    rng = np.random.default_rng(3)
    base = rng.normal(size=(D_PAD, V_PAD)).astype(np.float32)
    w1 = rng.normal(size=(V_PAD, R)).astype(np.float32)
    w2 = rng.normal(size=(V_PAD, R)).astype(np.float32)

    @jax.jit
    def build(base, x_start, w1, w2):
        t = tree.build_sparkling_tree(base, x_start, w1, w2, budget=32, top_c=8, candidates="base",
                                       normalization="fast")
        dd = tree.build_ddtree(base, 16)
        posterior = jnp.concatenate([jnp.maximum(t.tokens, 0), jnp.zeros((1,), jnp.int32)])  # some posterior
        acc = tree.accept(t.parents, t.tokens, posterior, max_depth=D_PAD)
        return t, tree.visibility(t.parents, max_depth=D_PAD), tree.tree_positions(t.depths, x_start), dd, acc

    args = jax.device_put((base, np.int32(3), w1, w2))
    expected = to_np(build(*args))  # compile first
    with jax.transfer_guard("disallow"):
        out = build(*args)
        jax.block_until_ready(out)
        with pytest.raises(Exception, match="[Dd]isallowed"):  # the guard is really active
            build(base, *args[1:])
    assert_trees_equal(to_np(out[0]), expected[0])
    assert_trees_equal(to_np(out[3]), expected[3])
    check_valid_tree(expected[0], D_PAD)
    check_valid_tree(expected[3], D_PAD)
    assert expected[4].length >= 2  # the posterior above follows node 1 at least


def test_vmap_equals_single_calls():
    rng = np.random.default_rng(5)
    base = np.stack([padded_logits(rng.normal(size=(D_PAD, 9)).astype(np.float32) * 3) for _ in range(4)])
    x_start = np.array([0, 3, 8, 3], np.int32)
    w1 = rng.normal(size=(V_PAD, R)).astype(np.float32)
    w2 = rng.normal(size=(V_PAD, R)).astype(np.float32)

    def one(base, x_start):
        t, _, _ = sparkling_padded(base, x_start, w1, w2, D_PAD, budget=M_MARKOV, top_c=C_MARKOV, normalization="fast")
        mask = tree.visibility(t.parents, max_depth=D_PAD)
        posterior = jnp.concatenate([jnp.maximum(t.tokens, 0), jnp.zeros((1,), jnp.int32)])  # follows node 1 at least
        return t, mask, tree.accept(t.parents, t.tokens, posterior, D_PAD, mask=mask)  # as engine/round.py calls it

    batched = to_np(jax.jit(jax.vmap(one))(base, x_start))
    for i in range(4):
        single = to_np(jax.jit(one)(base[i], x_start[i]))
        got = jax.tree.map(lambda x, i=i: x[i], batched)
        # batched matmuls may round the tables differently in the last bit: same tree, scores to 1 ulp
        np.testing.assert_allclose(got[0].scores, single[0].scores, rtol=1e-6)
        assert_trees_equal(got[0]._replace(scores=single[0].scores), single[0])
        np.testing.assert_array_equal(got[1], single[1])
        for field in tree.Accepted._fields:
            np.testing.assert_array_equal(getattr(got[2], field), getattr(single[2], field))
        assert single[2].length >= 2
        check_valid_tree(single[0], D_PAD)
    # on given tables the builder itself is bit-exact under vmap
    tables, tokens = zip(*(random_tables(rng, integer=True) for _ in range(4)), strict=True)
    tables, tokens = np.stack(tables), np.stack(tokens)
    batched = to_np(jax.jit(jax.vmap(lambda t, c: tree.best_first(t, c, M_MARKOV)))(tables, tokens))
    for i in range(4):
        single = to_np(best_first_jit(tables[i], tokens[i], budget=M_MARKOV))
        assert_trees_equal(jax.tree.map(lambda x, i=i: x[i], batched), single)


def _bad_calls():
    t = jnp.zeros((3, 4, 4))
    tok = jnp.zeros((3, 4), jnp.int32)
    base = jnp.zeros((3, 10))
    feats = jnp.zeros((3, 4, 2))
    w2 = jnp.zeros((10, 2))
    return [
        ("budget", lambda: tree.best_first(t, tok, 0)),
        ("budget", lambda: tree.best_first(t, tok, 2.0)),
        ("top_c", lambda: tree.candidates(base, 0)),
        ("logits", lambda: tree.candidates(jnp.zeros(5), 2)),
        ("tables", lambda: tree.best_first(jnp.zeros((3, 4, 5)), tok, 4)),
        ("cand_tokens", lambda: tree.best_first(t, jnp.zeros((2, 4), jnp.int32), 4)),
        ("widths", lambda: tree.beam(t, tok, (2, 2))),
        ("widths", lambda: tree.beam(t, tok, (2, 0, 1))),
        ("widths", lambda: tree.beam(t, tok, (0, 0, 0))),
        ("widths[1]", lambda: tree.beam(t, tok, (2, -1, 0))),
        ("parent_feats", lambda: tree.markov_tables(base, tok, jnp.zeros((3, 5, 2)), w2)),
        ("w2", lambda: tree.markov_tables(base, tok, feats, jnp.zeros((9, 2)))),
        ("cand_tokens", lambda: tree.markov_tables(base, tok[:2], feats, w2)),
        ("normalization", lambda: tree.markov_tables(base, tok, feats, w2, "approx")),
        ("posterior", lambda: tree.accept(jnp.zeros(4, jnp.int32), jnp.zeros(4, jnp.int32), jnp.zeros(4))),
        ("posterior", lambda: tree.accept_walk(jnp.zeros(4, jnp.int32), jnp.zeros(4, jnp.int32), jnp.zeros(4))),
        ("mask", lambda: tree.accept(jnp.zeros(4, jnp.int32), jnp.zeros(4, jnp.int32), jnp.zeros(5, jnp.int32),
                                     mask=jnp.ones((4, 4), bool))),
        ("chunk", lambda: tree.chunked_top_k(base, 4, chunk=3)),
        ("k must be <=", lambda: tree.chunked_top_k(base, 11, chunk=16)),
        ("max_depth", lambda: tree.visibility(jnp.zeros(4, jnp.int32), max_depth=0)),
        ("budget", lambda: tree.even_widths(0, 4)),
        ("depth", lambda: tree.even_widths(4, 0)),
        ("widths", lambda: tree.build_sparkling_tree(base, 0, w2, w2, budget=5, top_c=4, candidates="base",
                                                    widths=(1, 1, 1))),
        ("candidates", lambda: tree.markov_candidates(base, base, 8, "both")),
        ("union_k", lambda: tree.markov_candidates(base, base, 8, "union", union_k=9)),
        ("corrected_logits", lambda: tree.markov_candidates(base, base[:, :5], 8, "union")),
        ("exponent", lambda: tree.auto_widths(8, 4, (0.5,), exponent=0)),
        *(("rates", lambda bad=bad: tree.auto_widths(8, 4, bad)) for bad in ((), (0.5, 1.5), (float("nan"),), "0.5")),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_bad_arguments(index):
    name, call = _bad_calls()[index]
    with pytest.raises(ArgumentError, match=r"\b" + re.escape(name)) as info:
        call()
    assert isinstance(info.value, SparkjaxError)


def test_tail_log_sum_exp_by_comparison_equals_the_scatter():
    """The Markov tables' tail normalizer on an accelerator (candidates found by comparison) equals the CPU's
    (candidates scattered to -inf), bit for bit."""
    rng = np.random.default_rng(0)
    u = (rng.normal(size=(5, 300)) * 4).astype(np.float32)
    cands = np.stack([rng.permutation(300)[:32] for _ in range(5)]).astype(np.int32)
    # both in one program with the suite's XLA options whatever XLA_FLAGS says
    want, got, lse = (np.asarray(x) for x in jit_exact(
        lambda u, c: (tree._tail_lse_scatter(u, c), tree._tail_lse_compare(u, c), jax.nn.logsumexp(u, axis=-1)),
        u, cands))
    np.testing.assert_array_equal(got, want)
    assert np.all(want < lse)


SEED_FIXTURES = Path(__file__).parent / "fixtures" / "seed_trees"
SEED_SETTINGS = ["b64_c128_f64", "b16_c128_f16", "b32_c64_f32", "b64_c512_f0"]  # b{budget}_c{top_c}_f{max_fanout}


@functools.cache
def seed_fixture() -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """The seed's trees and the demo drafter's vanilla Markov head (``w1``, ``w2`` [V, R]) they were built with."""
    from sparkjax import demo
    from sparkjax.io.safetensors import SafetensorsFile

    head = SafetensorsFile(demo.path() / "dspark_b16" / "model.safetensors")
    w1, w2 = (head.get(f"markov_head.markov_{w}.weight").astype(np.float32) for w in ("w1", "w2"))
    return load_file(str(SEED_FIXTURES / "seed_trees.safetensors")), w1, w2


@functools.partial(jax.jit, static_argnames=("budget", "top_c", "max_fanout"))
def seed_trees(base, roots, w1, w2, *, budget, top_c, max_fanout):
    build = functools.partial(tree.build_sparkling_tree, budget=budget, top_c=top_c, max_fanout=max_fanout)
    return jax.vmap(build, in_axes=(0, 0, None, None))(base, roots, w1, w2)


@pytest.mark.parametrize("setting", SEED_SETTINGS)
def test_seed_trees_equal_the_seed_codes_own(setting):
    """Every round of every setting: the same set of root-to-node token paths as the seed's own builder."""
    fx, w1, w2 = seed_fixture()
    budget, top_c, fanout = (int(x[1:]) for x in setting.split("_"))
    base = fx["base_logits"].astype(np.float32)
    t = to_np(seed_trees(base, fx["roots"].astype(np.int32), w1, w2, budget=budget, top_c=top_c,
                         max_fanout=fanout))
    want_tokens, want_parents = fx[f"{setting}.tokens"], fx[f"{setting}.parents"]
    assert want_tokens.shape == (base.shape[0], budget)
    for r in range(base.shape[0]):
        row = tree.Tree(*(x[r] for x in t))
        check_valid_tree(row, base.shape[1])
        n = int((want_tokens[r] >= 0).sum())
        mine = set(token_paths(row.tokens, row.parents, int(row.valid.sum())))
        seed = set(token_paths(want_tokens[r], want_parents[r, 1:], n))
        assert mine == seed, f"round {r}: {len(mine & seed) - 1} of {n} nodes in common"
        # the fanout: no parent has more than k children
        k = tree.seed_fanout(budget, fanout, base.shape[2])
        assert np.bincount(row.parents[row.valid]).max() <= k


SEED_DEPTH, SEED_BUDGET = 5, 24  # the seed-tree property pipeline's depth and budget


@functools.partial(jax.jit, static_argnames=("max_fanout",))
def seed_padded(base, x_start, w1, w2, max_fanout):
    return tree.build_sparkling_tree(base, x_start, w1, w2, budget=SEED_BUDGET, top_c=C_MARKOV, max_fanout=max_fanout)


@PROPERTY
@given(
    base=logit_matrices(max_depth=SEED_DEPTH, max_vocab=V_PAD),
    seed=st.integers(0, 2**32 - 1),
    fanout=st.sampled_from([0, 3]),
    x_frac=st.floats(0, 1, exclude_max=True),
)
def test_seed_tree_properties(base, seed, fanout, x_frac):
    """Random logits (ties included): a valid tree with the NumPy heap's prefixes; its scores are the union's."""
    d, v = base.shape
    w1, w2 = random_head(seed, v)
    x_start = int(x_frac * v)
    padded = np.full((SEED_DEPTH, V_PAD), -np.inf, np.float32)
    padded[:, :v] = np.concatenate([base, np.zeros((SEED_DEPTH - d, v), np.float32)]) if d < SEED_DEPTH else base
    t = to_np(seed_padded(padded, x_start, w1, w2, fanout))
    check_valid_tree(t, SEED_DEPTH)
    want = ref.seed_sparkling_tree(padded[:, :v], x_start, lambda _d, p: w1[p], w2[:v], SEED_BUDGET, C_MARKOV, fanout)
    assert int(t.valid.sum()) == int(want.valid.sum())
    assert_same_prefixes(prefix_scores(t), prefix_scores(want))
    k = min(fanout or SEED_BUDGET, SEED_BUDGET)
    assert np.bincount(t.parents[t.valid]).max(initial=0) <= k
