"""Slow, obvious NumPy references for the tree code in :mod:`sparkjax.tree` (tests and benchmarks only).

All return the padded layout of :class:`sparkjax.tree.Tree`. Scores are accumulated in float32 in the
device code's order, so fed the same tables the heap reproduces :func:`sparkjax.tree.best_first` bit for
bit. Tie-break everywhere: path score descending, then the path of *keys* ascending (a prefix before its
extensions); a child's key is its candidate index, or its token id for the unrestricted naive
SparklingTree. Children with log-prob ``-inf`` are never added.
"""

from __future__ import annotations

import heapq
from collections import namedtuple
from collections.abc import Callable, Sequence

import numpy as np

# A reference tree in the padded layout of :class:`sparkjax.tree.Tree` (NumPy arrays).
RefTree = namedtuple("RefTree", "tokens parents depths scores cands valid")


# A child list: (log-prob, key, token, candidate index) sorted by (log-prob descending, key ascending).
Child = tuple[np.float32, int, int, int]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """``logits - logsumexp(logits)`` along the last axis, in float32."""
    x = np.asarray(logits, np.float32)
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, np.float32(0))
    with np.errstate(divide="ignore"):
        lse = np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True)) + m
    return (x - lse).astype(np.float32)


def top_k(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest entries of a 1-D array, largest first, lower index first among ties
    (``np.argsort(-values, kind="stable")[:k]``)."""
    neg = -np.asarray(values)
    if k < len(neg):
        kth = np.partition(neg, k - 1)[k - 1]
        idx = np.nonzero(neg <= kth)[0]
        return idx[np.argsort(neg[idx], kind="stable")][:k]
    return np.argsort(neg, kind="stable")[:k]


def _sorted_children(logp: np.ndarray, keys: np.ndarray, tokens: np.ndarray, cands: np.ndarray) -> list[Child]:
    order = sorted(range(len(logp)), key=lambda n: (-float(logp[n]), int(keys[n])))
    return [(np.float32(logp[n]), int(keys[n]), int(tokens[n]), int(cands[n])) for n in order if logp[n] > -np.inf]


def _heap_tree(children_of: Callable[[int, int, int], list[Child]], depth: int, budget: int, root: int) -> RefTree:
    """Best-first search as in DDTree: pop the best prefix, give it the next index, push its next sibling
    and its first child. ``children_of(level, token, cand)`` lists the children of a node at ``level``
    (0 = root) whose token / candidate index are given."""
    tokens, parents, depths, scores, cands = [], [], [], [], []
    node_score = [np.float32(0.0)]
    node_path: list[tuple[int, ...]] = [()]
    children: dict[int, list[Child]] = {0: children_of(0, root, -1)}
    heap: list[tuple[float, tuple[int, ...], int, int]] = []

    def push(parent: int, rank: int) -> None:
        lp, key, _, _ = children[parent][rank]
        score = np.float32(node_score[parent] + lp)
        heapq.heappush(heap, (-float(score), (*node_path[parent], key), parent, rank))

    if children[0]:
        push(0, 0)
    while heap and len(tokens) < budget:
        neg_score, path, parent, rank = heapq.heappop(heap)
        _, _, token, cand = children[parent][rank]
        index = len(tokens) + 1
        tokens.append(token)
        parents.append(parent)
        depths.append(len(path))
        scores.append(np.float32(-neg_score))
        cands.append(cand)
        node_score.append(np.float32(-neg_score))
        node_path.append(path)
        if rank + 1 < len(children[parent]):
            push(parent, rank + 1)
        if len(path) < depth:
            children[index] = children_of(len(path), token, cand)
            if children[index]:
                push(index, 0)
    return _pad(tokens, parents, depths, scores, cands, budget)


def _pad(tokens: list, parents: list, depths: list, scores: list, cands: list, m: int) -> RefTree:
    n = len(tokens)
    pad = m - n
    return RefTree(
        tokens=np.array(tokens + [-1] * pad, np.int32),
        parents=np.array(parents + [0] * pad, np.int32),
        depths=np.array(depths + [1] * pad, np.int32),
        scores=np.array(scores + [-np.inf] * pad, np.float32),
        cands=np.array(cands + [-1] * pad, np.int32),
        valid=np.arange(m) < n,
    )


def table_heap(tables: np.ndarray, cand_tokens: np.ndarray, budget: int) -> RefTree:
    """The DDTree heap over given ``[D, C, C]`` tables (clipped to <= 0): a depth-``d`` node with candidate
    index ``i`` has the children ``tables[d, i, :]`` (row 0 for the root), keyed by candidate index."""
    t = np.minimum(np.asarray(tables, np.float32), np.float32(0))
    cand_tokens = np.asarray(cand_tokens)
    d, c, _ = t.shape
    idx = np.arange(c)

    def children_of(level: int, _token: int, cand: int) -> list[Child]:
        return _sorted_children(t[level, max(cand, 0)], idx, cand_tokens[level], idx)

    return _heap_tree(children_of, d, budget, root=-1)


def ddtree_heap(logits: np.ndarray, budget: int) -> RefTree:
    """Upstream DDTree (``build_ddtree_tree``): per depth the top-``min(budget, V)`` tokens of
    ``log_softmax(logits)`` in float32, independent of the parent, best-first by a heap with ties broken
    by the tuple of ranks along the path."""
    logp = log_softmax(logits)
    d, v = logp.shape
    k = min(budget, v)
    ranked = [top_k(logp[level], k) for level in range(d)]

    def children_of(level: int, _token: int, _cand: int) -> list[Child]:
        tok = ranked[level]
        return _sorted_children(logp[level, tok], np.arange(k), tok, np.arange(k))

    return _heap_tree(children_of, d, budget, root=-1)


def naive_sparkling_tree(base_logits: np.ndarray, x_start: int, parent_feat: Callable[[int, int], np.ndarray],
                         w2: np.ndarray, budget: int, top_c: int | None = None) -> RefTree:
    """Naive SparklingTree: a best-first heap whose node with token ``p`` at level ``d`` (0: the root
    ``x_start``) has the children ``log_softmax(base_logits[d] + w2 @ parent_feat(d, p))`` (float32, full
    vocabulary; ``parent_feat``: ``(d, p) -> f[R]``, vanilla ``lambda d, p: w1[p]``).

    ``top_c``: None for the top-``min(budget, V)`` tokens of each node's own distribution, keyed by token id;
    an int restricts children to the per-depth base top-C candidates, keyed by candidate index (what
    :func:`sparkjax.tree.best_first` over exact :func:`sparkjax.tree.markov_tables` computes).
    """
    base = np.asarray(base_logits, np.float32)
    w2 = np.asarray(w2, np.float32)
    d, v = base.shape
    base_cands = None if top_c is None else [top_k(log_softmax(base[level]), top_c) for level in range(d)]

    def children_of(level: int, token: int, _cand: int) -> list[Child]:
        logp = log_softmax(base[level] + w2 @ np.asarray(parent_feat(level, token), np.float32))
        if base_cands is None:
            tok = top_k(logp, min(budget, v))
            return _sorted_children(logp[tok], tok, tok, np.full(len(tok), -1))
        tok = base_cands[level]
        idx = np.arange(len(tok))
        return _sorted_children(logp[tok], idx, tok, idx)

    return _heap_tree(children_of, d, budget, root=int(x_start))


def seed_sparkling_tree(base_logits: np.ndarray, x_start: int, parent_feat: Callable[[int, int], np.ndarray],
                        w2: np.ndarray, budget: int, top_c: int, max_fanout: int = 0) -> RefTree:
    """The seed's SparklingTree (``tests/fixtures/seed_trees/README.md``): one candidate set ``U`` (the union of
    every depth's top-``top_c`` base tokens and ``x_start``, ascending), a node with token ``p`` at level ``d``
    has the children ``log_softmax_U(base_logits[d, U] + w2[U] @ parent_feat(d, p))``, its best ``k =
    min(max_fanout or budget, budget, |U|)`` of them (the lower token id first among equal log-probs), keyed by
    that rank; best-first by a heap. ``Tree.cands`` is the index into ``U``."""
    base = np.asarray(base_logits, np.float32)
    w2 = np.asarray(w2, np.float32)
    d, v = base.shape
    if top_c >= v:
        union = np.arange(v)
    else:
        union = np.unique(np.concatenate([*(top_k(log_softmax(base[level]), top_c) for level in range(d)),
                                          [int(x_start)]]))
    k = min(max_fanout or budget, budget, len(union))

    def children_of(level: int, token: int, _cand: int) -> list[Child]:
        logp = log_softmax(base[level, union] + w2[union] @ np.asarray(parent_feat(level, token), np.float32))
        order = top_k(logp, k)
        ranked = _sorted_children(logp[order], np.arange(len(order)), union[order], order)
        return [(lp, rank, tok, cand) for rank, (lp, _, tok, cand) in enumerate(ranked)]

    return _heap_tree(children_of, d, budget, root=int(x_start))


def _beam_levels(tables: np.ndarray, widths: Sequence[int]) -> list[tuple[np.float32, tuple[int, ...]]]:
    """Every kept ``(score, candidate-index path)``: at depth ``d + 1`` every extension of every kept depth-``d``
    prefix, sorted by (score descending, path ascending), the first ``widths[d]`` kept."""
    t = np.minimum(np.asarray(tables, np.float32), np.float32(0))
    kept: list[tuple[np.float32, tuple[int, ...]]] = []
    frontier: list[tuple[np.float32, tuple[int, ...]]] = [(np.float32(0), ())]
    for level in range(t.shape[0]):
        ext = []
        for score, path in frontier:
            row = t[level, path[-1] if path else 0]
            ext += [(np.float32(score + row[j]), (*path, j)) for j in range(t.shape[1]) if row[j] > -np.inf]
        ext.sort(key=lambda e: (-float(e[0]), e[1]))
        frontier = ext[: widths[level]]
        kept += frontier
    return kept


def _path_tree(kept: list[tuple[np.float32, tuple[int, ...]]], cand_tokens: np.ndarray, m: int) -> RefTree:
    """The padded tree of ``m`` nodes listing ``kept`` in order (every parent listed before its children)."""
    cand_tokens = np.asarray(cand_tokens)
    index = {path: n + 1 for n, (_, path) in enumerate(kept)}
    return _pad([int(cand_tokens[len(p) - 1, p[-1]]) for _, p in kept],
                [index[p[:-1]] if len(p) > 1 else 0 for _, p in kept],
                [len(p) for _, p in kept], [s for s, _ in kept], [p[-1] for _, p in kept], m)


def beam_tree(tables: np.ndarray, cand_tokens: np.ndarray, widths: Sequence[int]) -> RefTree:
    """Beam reference: keep the best ``widths[d]`` extensions per depth, then list all kept prefixes by
    (score descending, candidate-index path ascending)."""
    kept = _beam_levels(tables, widths)
    kept.sort(key=lambda e: (-float(e[0]), e[1]))
    return _path_tree(kept, cand_tokens, int(sum(widths)))


def pctree(tables: np.ndarray, cand_tokens: np.ndarray, k: int, nodes: int) -> RefTree:
    """PCTree reference (:func:`sparkjax.tree.layer_beam`): keep the best ``k`` extensions per depth, then the
    first ``nodes`` kept nodes by (score descending, depth ascending, path ascending)."""
    kept = _beam_levels(tables, [k] * np.shape(tables)[0])
    kept.sort(key=lambda e: (-float(e[0]), len(e[1]), e[1]))
    return _path_tree(kept[:nodes], cand_tokens, nodes)


def markov_tables(base_logits: np.ndarray, cand_tokens: np.ndarray, parent_feats: np.ndarray, w2: np.ndarray,
                  normalization: str = "exact") -> np.ndarray:
    """Entry-by-entry reference of :func:`sparkjax.tree.markov_tables` (float64 internally)."""
    u = np.asarray(base_logits, np.float64)
    f = np.asarray(parent_feats, np.float64)
    w2 = np.asarray(w2, np.float64)
    d, v = u.shape
    c = cand_tokens.shape[1]
    out = np.empty((d, c, c), np.float64)
    for level in range(d):
        outside = np.setdiff1d(np.arange(v), cand_tokens[level])
        for i in range(c):
            z = u[level] + w2 @ f[level, 0 if level == 0 else i]
            cz = z[cand_tokens[level]]
            if normalization == "exact" or level == 0:
                norm = np.log(np.sum(np.exp(z - z.max()))) + z.max()
            else:
                norm = np.log(np.sum(np.exp(cz)) + np.sum(np.exp(u[level, outside])))
            out[level, i] = cz - norm
    return out


def ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """Brute force: ``mask[q, a]`` iff ``a`` is found walking parent pointers from ``q`` to the root."""
    m = len(parents)
    full = np.concatenate([[0], np.asarray(parents)])
    mask = np.zeros((m + 1, m + 1), bool)
    for q in range(m + 1):
        node = q
        mask[q, node] = True
        while node != 0:
            node = int(full[node])
            mask[q, node] = True
    return mask


def random_tree_mask(rng: np.random.Generator, t: int) -> np.ndarray:
    """The ancestor mask ``[t, t]`` of a random tree of ``t`` nodes: node 0 the root, node ``i``'s parent drawn
    from ``0 .. i - 1`` (parents before children, as the drafted trees order them)."""
    return ancestor_mask(np.asarray([int(rng.integers(0, i)) for i in range(1, t)], np.int64))


def accept_walk(parents: np.ndarray, tokens: np.ndarray, posterior: np.ndarray) -> tuple[list[int], int]:
    """Step by step ``follow_verified_tree``: returns (accepted indices with the root first, bonus token)."""
    child_map: dict[int, dict[int, int]] = {}
    for n, (p, tok) in enumerate(zip(parents, tokens, strict=True)):
        child_map.setdefault(int(p), {}).setdefault(int(tok), n + 1)
    path = [0]
    while True:
        nxt = child_map.get(path[-1], {}).get(int(posterior[path[-1]]))
        if nxt is None:
            return path, int(posterior[path[-1]])
        path.append(nxt)
