"""PCTree (sparkjax.tree.layer_beam, method ``pctree``): the jitted tree against the NumPy reference, a valid
prefix-closed tree and its argument errors (greedy pctree == ar: test_exactness.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkjax import reference, tree
from sparkjax.engine import PCTree, generate, parse_method
from sparkjax.errors import ArgumentError

layer_beam = jax.jit(tree.layer_beam, static_argnums=(2, 3))


def _tables(rng: np.random.Generator, d: int, c: int, ties: bool) -> np.ndarray:
    t = rng.normal(size=(d, c, c)) - 0.5
    if ties:  # a few levels only: equal path scores everywhere, exact in float32
        t = np.round(t * 2) / 2
    return np.where(rng.random((d, c, c)) < 0.15, -np.inf, t).astype(np.float32)


def _check_prefix_closed(t) -> None:
    """Every valid node's parent is the root or an earlier valid node one depth above; siblings differ."""
    parents, depths, valid = (np.asarray(x) for x in (t.parents, t.depths, t.valid))
    tokens = np.asarray(t.tokens)
    n = int(valid.sum())
    assert valid[:n].all() and not valid[n:].any()  # padding at the end only
    for i in range(n):
        p = parents[i]
        assert 0 <= p <= i
        assert depths[i] == (1 if p == 0 else depths[p - 1] + 1)
        if p:
            assert valid[p - 1]
    pairs = [(parents[i], tokens[i]) for i in range(n)]
    assert len(set(pairs)) == n


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), d=st.integers(1, 5), c=st.integers(1, 6), k=st.integers(1, 5),
       ties=st.booleans(), data=st.data())
def test_layer_beam_equals_the_reference(seed, d, c, k, ties, data):
    m = data.draw(st.integers(1, k * d), label="nodes")
    rng = np.random.default_rng(seed)
    tables = _tables(rng, d, c, ties)
    cand = np.stack([rng.permutation(64)[:c] for _ in range(d)]).astype(np.int32)
    got = layer_beam(tables, cand, k, m)
    want = reference.pctree(tables, cand, k, m)  # raises KeyError if a selected node's parent is not selected
    for name in want._fields:
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), getattr(want, name), err_msg=name)
    _check_prefix_closed(got)
    scores = np.asarray(got.scores)[np.asarray(got.valid)]
    assert np.all(np.diff(scores) <= 0)  # best first


def test_layer_beam_ties_go_to_shallower_nodes():
    """All-zero tables: every path scores 0, so the tree is the k nodes of depth 1, then depth 2, ..."""
    d, c, k = 3, 4, 3
    t = layer_beam(np.zeros((d, c, c), np.float32), np.arange(d * c, dtype=np.int32).reshape(d, c), k, 7)
    np.testing.assert_array_equal(np.asarray(t.depths), [1, 1, 1, 2, 2, 2, 3])
    np.testing.assert_array_equal(np.asarray(t.parents), [0, 0, 0, 1, 1, 1, 4])  # the lowest path first
    np.testing.assert_array_equal(np.asarray(t.tokens), [0, 1, 2, 4, 5, 6, 8])


def test_pctree_plan_and_errors(random_pair):
    target, drafter = random_pair
    plan = parse_method("pctree@8").plan(target, drafter, False)
    assert plan.nodes == 7 and plan.depth == 4 and plan.method.k == 4 and plan.candidates == "union"
    # the default keeps what the beam holds: 1 + k x depth (17 here) when that is under 32
    plan = parse_method("pctree").plan(target, drafter, False)
    assert plan.nodes == 16 and plan.method.label == "pctree@17"
    assert PCTree(k=2).nodes(drafter) == 8 and PCTree(k=16).nodes(drafter) == 31
    with pytest.raises(ArgumentError, match=r"^budget: 10 nodes .* exceed the 9 the beam keeps .*k=2"):
        generate(target, drafter, [[1, 2]], method=PCTree(budget=10, k=2), max_new_tokens=4)
    z, cand = np.zeros((2, 3, 3), np.float32), np.zeros((2, 3), np.int32)
    with pytest.raises(ArgumentError, match="nodes"):
        tree.layer_beam(z, cand, 2, 5)
    with pytest.raises(ArgumentError, match="k must"):
        tree.layer_beam(z, cand, 0, 1)
