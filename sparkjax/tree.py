"""On-device draft trees for DDTree and SparklingTree speculative decoding.

Pure functions of arrays for **one** sequence with static output shapes (``jax.jit``, ``jax.vmap``); scores
are float32. A round (``D`` depths, vocabulary ``V``, ``C`` candidates per depth, ``M`` nodes) runs
:func:`candidates` (or :func:`markov_candidates`), :func:`ddtree_tables` or :func:`markov_tables`, a builder
(:func:`best_first`, :func:`beam`, :func:`layer_beam`), :func:`visibility` and :func:`tree_positions` for the
verify, then :func:`accept` on the target's posterior.

Conventions
-----------
* **Depths.** Row ``d`` (0-based) of every per-depth array describes depth ``d + 1``; the root (``x_start``,
  the last committed token) is depth 0.
* **Node indices.** The root is node 0, the drafted nodes 1..M: entry ``i`` of a :class:`Tree` describes node
  ``i + 1``, ``parents[i]`` is in ``0..M``. ``visibility`` and ``tree_positions`` include the root as row /
  element 0, lining up with the verify input ``[x_start] + tokens``.
* **Order.** Nodes come in the total order "path score descending, then the tuple of candidate indices
  along the path ascending (a prefix before its extensions)". A token's candidate index is its rank in the
  per-depth top-C list (larger log-prob first, the lower token id first among equal ones), so for DDTree
  tables this is upstream DDTree's tie-break. Parents come before children and scores are non-increasing.
* **Padding.** When fewer than ``M`` prefixes exist, the last nodes are padding (``valid`` False, token -1,
  parent 0, depth 1, score ``-inf``, candidate index -1): they see only the root and themselves, no valid node
  sees them, :func:`accept` never walks into them; an engine must clamp their token before an embedding lookup.
* **Impossible children.** A table entry (or a logit) of ``-inf`` is never put into the tree, so
  ``tables[d:] = -inf`` limits the tree to depth ``d`` without a recompile. Positive table entries are
  clipped to 0 (a child never outscores its parent). NaNs are not supported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sparkjax.errors import ArgumentError

__all__ = [
    "Accepted", "Tree", "accept", "accept_walk", "auto_widths", "beam", "best_first", "build_ddtree",
    "build_sparkling_tree", "candidates", "chunked_top_k", "ddtree_tables", "even_widths", "layer_beam",
    "markov_candidates", "markov_tables", "merge_candidates", "seed_best_first", "seed_candidates", "seed_fanout",
    "tree_positions", "vanilla_parent_feats", "visibility",
]

Normalization = Literal["exact", "fast"]
CandidateMode = Literal["base", "corrected", "union"]
CANDIDATE_MODES: tuple[str, ...] = ("base", "corrected", "union")  # see markov_candidates
# the SparklingTree candidate modes: the per-depth ones above, or the seed's one union for every depth
# (seed_best_first: its own normaliser and fanout)
TREE_CANDIDATE_MODES: tuple[str, ...] = (*CANDIDATE_MODES, "seed")


class Tree(NamedTuple):
    """A draft tree of ``M`` nodes (the root excluded); entry ``i`` describes node ``i + 1``."""

    tokens: jax.Array  # int32[M] token id of each node (padding: -1)
    parents: jax.Array  # int32[M] parent node index in 0..M, 0 = the root (padding: 0)
    depths: jax.Array  # int32[M] depth in 1..D (padding: 1)
    scores: jax.Array  # float32[M] path log-probability, the sum of the table entries along the path (padding: -inf)
    cands: jax.Array  # int32[M] candidate index of the node's token in its depth's top-C list (padding: -1)
    valid: jax.Array  # bool[M] False for padding nodes


class Accepted(NamedTuple):
    """The outcome of walking a verified tree."""

    indices: jax.Array  # int32[max_depth + 1] accepted node indices, the root 0 first, padded with -1
    length: jax.Array  # int32 scalar: accepted indices including the root (1..max_depth + 1)
    bonus: jax.Array  # int32 scalar: the posterior token at the last accepted node (the next committed token)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ArgumentError(f"{name} must be a static Python int, got {type(value).__name__} {value!r}")
    if int(value) < minimum:
        raise ArgumentError(f"{name} must be >= {minimum}, got {int(value)}")
    return int(value)


def _check_ndim(**arrays: tuple[jax.Array, str]) -> None:
    """``name=(array, "axes")``: each array has one dimension per comma-separated axis name."""
    for name, (x, axes) in arrays.items():
        if jnp.ndim(x) != axes.count(",") + 1:
            raise ArgumentError(f"{name} must have shape [{axes}], got shape {tuple(jnp.shape(x))}")


TOPK_CHUNK = 4096  # vocabulary chunk of the two-stage top-k (a larger vocabulary is split on GPU / TPU)


def chunked_top_k(x: jax.Array, k: int, chunk: int = TOPK_CHUNK) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(x, k)`` over the last axis in two stages (the top ``k`` of every ``chunk`` entries, then
    of those winners), identical to it, ties included (the lower index first). ``k``: static, ``1 <= k <= V``;
    ``chunk``: static, ``>= k`` (the last chunk is padded with ``-inf``). Returns ``(values [..., k], indices
    int32 [..., k])``."""
    k = _check_int("k", k, 1)
    chunk = _check_int("chunk", chunk, k)
    v = x.shape[-1]
    if k > v:
        raise ArgumentError(f"k must be <= the last axis ({v}), got {k}")
    n = -(-v // chunk)
    if n == 1:
        return tuple(jax.lax.top_k(x, k))
    lead = x.shape[:-1]
    if n * chunk > v:
        x = jnp.concatenate([x, jnp.full((*lead, n * chunk - v), -jnp.inf, x.dtype)], axis=-1)
    val, idx = jax.lax.top_k(x.reshape(*lead, n, chunk), k)
    idx = idx.astype(jnp.int32) + (jnp.arange(n, dtype=jnp.int32) * chunk)[:, None]
    top, pos = jax.lax.top_k(val.reshape(*lead, n * k), k)
    return top, jnp.take_along_axis(idx.reshape(*lead, n * k), pos, axis=-1)


def _even_chunk(v: int, chunk: int = TOPK_CHUNK) -> int:
    """The smallest divisor of ``v`` in ``[chunk, 2 chunk)`` (chunks that are a free reshape of the input, no
    padded copy), else ``chunk``."""
    return next((c for c in range(chunk, min(2 * chunk, v + 1)) if v % c == 0), chunk)


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k`` over the last axis; :func:`chunked_top_k` (in chunks of :func:`_even_chunk`) for a large
    vocabulary off CPU."""
    if x.shape[-1] <= 2 * TOPK_CHUNK or k > TOPK_CHUNK:
        return jax.lax.top_k(x, k)
    chunk = _even_chunk(x.shape[-1])
    return jax.lax.platform_dependent(
        x, cpu=lambda y: tuple(jax.lax.top_k(y, k)), default=lambda y: tuple(chunked_top_k(y, k, chunk))
    )


def candidates(logits: jax.Array, top_c: int) -> tuple[jax.Array, jax.Array]:
    """Top-C candidate tokens per depth and their full-vocabulary log-probabilities.

    ``logits``: [D, V], row ``d`` predicts depth ``d + 1``; ``top_c`` (static): ``C = min(top_c, V)``.
    Returns ``(cand_tokens int32[D, C], cand_logp float32[D, C])``: per row the C tokens with the largest
    float32 ``log_softmax``, largest first, the lower token id first among equal ones. A token's position
    in its row is its *candidate index*, the builders' tie-break key.
    """
    top_c = _check_int("top_c", top_c, 1)
    _check_ndim(logits=(logits, "D, V"))
    x = jnp.asarray(logits, jnp.float32)
    logp = x - jax.nn.logsumexp(x, axis=-1, keepdims=True)
    c = min(top_c, x.shape[-1])
    cand_logp, cand_tokens = top_k(logp, c)
    # The barrier keeps XLA from folding later slices of the result into the top-k, which turns it into a
    # full sort of the vocabulary on CPU (far slower at a real vocabulary).
    cand_tokens, cand_logp = jax.lax.optimization_barrier((cand_tokens.astype(jnp.int32), cand_logp))
    return cand_tokens, cand_logp


_candidates = candidates  # for build_sparkling_tree, whose keyword ``candidates`` shadows the function


def _lookup(keys: jax.Array, values: jax.Array, queries: jax.Array) -> jax.Array:
    """``values[..., j]`` for the one ``j`` with ``keys[j] == queries[i]`` (0 where none matches): int32 ``[..., Q]``
    from distinct ``keys [N]``, ``values [..., N]`` and ``queries [Q]``, by comparison (no scatter, no sort)."""
    hit = keys[None, :] == queries[:, None]  # [Q, N]
    return jnp.sum(jnp.where(hit, values[..., None, :], 0), axis=-1, dtype=jnp.int32)


def merge_candidates(pool: jax.Array, valid: jax.Array, c: int) -> jax.Array:
    """The first ``c`` distinct valid tokens of ``pool`` int[Q] (``valid`` bool[Q]), in pool order: int32[c].
    ``c``: static, ``1 <= c <= Q``; with fewer than ``c`` distinct valid tokens the last slots hold token 0."""
    _check_ndim(pool=(pool, "Q"), valid=(valid, "Q"))
    q = pool.shape[0]
    c = _check_int("c", c, 1)
    if c > q or valid.shape[0] != q:
        raise ArgumentError(f"merge_candidates: need c <= Q and valid [Q]; got c={c}, pool {q}, valid {valid.shape}")
    pool = jnp.asarray(pool, jnp.int32)
    valid = jnp.asarray(valid, bool)
    i = jnp.arange(q, dtype=jnp.int32)
    dup = jnp.any((pool[None, :] == pool[:, None]) & (i[None, :] < i[:, None]) & valid[None, :], axis=1)
    keep = valid & ~dup
    rank = jnp.cumsum(keep, dtype=jnp.int32) - 1
    slot = jnp.where(keep & (rank < c), rank, c)  # c: dropped (never looked up)
    return _lookup(slot, pool, jnp.arange(c, dtype=jnp.int32))


def markov_candidates(base_logits: jax.Array, corrected_logits: jax.Array, top_c: int, mode: CandidateMode = "union",
                      union_k: int | None = None) -> jax.Array:
    """Per-depth candidates that follow the Markov head (the ``candidates`` option of the SparklingTree methods).

    ``corrected_logits`` [D, V] row ``d`` are depth ``d + 1``'s logits corrected for one known parent: the
    root for depth 1 (exact), deeper the DSpark greedy chain's token of the depth above. ``mode``: ``"base"``
    (:func:`candidates` of ``base_logits``), ``"corrected"`` (the top-C of each corrected row) or ``"union"``
    (depth 1 the corrected top-C; deeper the corrected top-``union_k``, then the base top-C, duplicates
    dropped, the first C kept). ``top_c`` (static): ``C = min(top_c, V)``; ``union_k``: static, ``1 <= k <=
    C`` (None: ``max(1, C // 4)``). Any set is exact (the target verifies); only the tree's reach changes.

    Returns int32[D, C] distinct tokens per depth, in the builders' tie-break order.
    """
    if mode not in CANDIDATE_MODES:
        raise ArgumentError(f"candidates must be one of {', '.join(CANDIDATE_MODES)}, got {mode!r}")
    top_c = _check_int("top_c", top_c, 1)
    _check_ndim(base_logits=(base_logits, "D, V"))
    base_tokens = candidates(base_logits, top_c)[0]
    if mode == "base":
        return base_tokens
    _check_ndim(corrected_logits=(corrected_logits, "D, V"))
    if tuple(corrected_logits.shape) != tuple(base_logits.shape):
        raise ArgumentError(f"corrected_logits must have the shape of base_logits {tuple(base_logits.shape)}, "
                            f"got {tuple(corrected_logits.shape)}")
    corr_tokens = candidates(corrected_logits, top_c)[0]
    if mode == "corrected" or base_tokens.shape[0] == 1:
        return corr_tokens
    c = corr_tokens.shape[1]
    k = max(1, c // 4) if union_k is None else _check_int("union_k", union_k, 1)
    if k > c:
        raise ArgumentError(f"union_k must be <= top_c = {c}, got {k}")
    pool = jnp.concatenate([corr_tokens[1:, :k], base_tokens[1:]], axis=1)  # [D - 1, k + C]
    rest = jax.vmap(merge_candidates, in_axes=(0, None, None))(pool, jnp.ones(pool.shape[1], bool), c)
    return jnp.concatenate([corr_tokens[:1], rest], axis=0)


def ddtree_tables(cand_logp: jax.Array) -> jax.Array:
    """DDTree tables float32[D, C, C]: ``T[d, i, j] = cand_logp[d, j]`` for every parent ``i``."""
    _check_ndim(cand_logp=(cand_logp, "D, C"))
    lp = jnp.asarray(cand_logp, jnp.float32)
    d, c = lp.shape
    return jnp.broadcast_to(lp[:, None, :], (d, c, c))


def vanilla_parent_feats(w1: jax.Array, x_start: jax.Array | int, cand_tokens: jax.Array) -> jax.Array:
    """Parent features ``f(p) = W1[p]`` of the vanilla Markov head (``w1`` [V, R]) for :func:`markov_tables`:
    float32[D, C, R], row 0 ``W1[x_start]`` for every ``i``, row ``d >= 1`` ``W1[cand_tokens[d - 1, i]]``."""
    _check_ndim(w1=(w1, "V, R"), cand_tokens=(cand_tokens, "D, C"))
    w1 = jnp.asarray(w1, jnp.float32)
    d, c = cand_tokens.shape
    root = jnp.broadcast_to(w1[jnp.asarray(x_start, jnp.int32)], (1, c, w1.shape[1]))
    return jnp.concatenate([root, w1[cand_tokens[: d - 1]]], axis=0)


def markov_tables(base_logits: jax.Array, cand_tokens: jax.Array, parent_feats: jax.Array, w2: jax.Array,
                  normalization: Normalization = "exact") -> jax.Array:
    """Top-C Markov tables float32[D, C, C], ``T[d, i, j] = log p(cand j of depth d+1 | parent cand i of depth d)``.

    A child of parent ``p`` has the corrected logits ``U_d + W2 f(p)`` (``U_d``: row ``d`` of ``base_logits``
    [D, V]; ``w2`` [V, R] in the torch Linear layout; ``parent_feats`` [D, C, R] the parents' rank-R features,
    e.g. :func:`vanilla_parent_feats`). Depth 1 has the single parent ``x_start``: only ``parent_feats[0, 0]``
    is read and its row is normalised exactly in both modes; for ``d >= 1`` row ``i``'s parent is
    ``cand_tokens[d - 1, i]``. With ``Z_ij = U_d[c_j] + w2[c_j] . f_i`` (``c = cand_tokens[d]``):
    ``"exact"``: ``T = Z - logsumexp_v(U_d[v] + w2[v] . f_i)`` (``O(C V R)`` per depth); ``"fast"``:
    ``T = Z - log(sum_j exp(Z_ij) + sum_{v not in top-C} exp(U_d[v]))`` (the base mass off the candidates
    uncorrected; ``O(C^2 R)``; exact when ``C = V``).
    """
    if normalization not in ("exact", "fast"):
        raise ArgumentError(f"normalization must be 'exact' or 'fast', got {normalization!r}")
    _check_ndim(base_logits=(base_logits, "D, V"), cand_tokens=(cand_tokens, "D, C"),
                parent_feats=(parent_feats, "D, C, R"), w2=(w2, "V, R"))
    d, v = base_logits.shape
    c = cand_tokens.shape[1]
    r = w2.shape[1]
    if cand_tokens.shape[0] != d:
        raise ArgumentError(f"cand_tokens has {cand_tokens.shape[0]} depths but base_logits has {d}")
    if tuple(parent_feats.shape) != (d, c, r):
        raise ArgumentError(f"parent_feats must have shape {(d, c, r)} [D, C, R], got {tuple(parent_feats.shape)}")
    if w2.shape[0] != v:
        raise ArgumentError(f"w2 must have shape [V={v}, R], got {tuple(w2.shape)}")
    u = jnp.asarray(base_logits, jnp.float32)
    w2 = jnp.asarray(w2, jnp.float32)
    feats = jnp.asarray(parent_feats, jnp.float32)
    cand_tokens = jnp.asarray(cand_tokens, jnp.int32)
    z0 = u[0] + w2 @ feats[0, 0]
    row0 = (z0 - jax.nn.logsumexp(z0))[cand_tokens[0]]
    t0 = jnp.broadcast_to(row0[None, None, :], (1, c, c))
    if d == 1:
        return t0

    u_rest, cand_rest, f_rest = u[1:], cand_tokens[1:], feats[1:]
    if normalization == "exact":

        def one_depth(args: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
            ud, cd, fd = args
            z = ud[None, :] + fd @ w2.T  # [C, V] corrected logits of every child of every parent
            return jnp.take(z, cd, axis=1) - jax.nn.logsumexp(z, axis=-1, keepdims=True)

        rest = jax.lax.map(one_depth, (u_rest, cand_rest, f_rest))
    else:
        uc = jnp.take_along_axis(u_rest, cand_rest, axis=1)  # [D-1, C]
        z = uc[:, None, :] + jnp.einsum("dir,djr->dij", f_rest, w2[cand_rest])
        log_tail = jax.lax.platform_dependent(u_rest, cand_rest, cpu=_tail_lse_scatter, default=_tail_lse_compare)
        lse = jnp.logaddexp(jax.nn.logsumexp(z, axis=-1), log_tail[:, None])
        rest = z - lse[..., None]
    return jnp.concatenate([t0, rest], axis=0)


def _check_tables(tables: jax.Array, cand_tokens: jax.Array) -> tuple[int, int]:
    _check_ndim(tables=(tables, "D, C, C"), cand_tokens=(cand_tokens, "D, C"))
    d, c, c2 = tables.shape
    if c != c2:
        raise ArgumentError(f"tables must have shape [D, C, C], got {tuple(tables.shape)}")
    if tuple(cand_tokens.shape) != (d, c):
        raise ArgumentError(f"cand_tokens must have shape {(d, c)} to match tables {tuple(tables.shape)}, "
                            f"got {tuple(cand_tokens.shape)}")
    return d, c


def _expand(tables: jax.Array, widths: tuple[int, ...] | jax.Array,
            k: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-depth beams: at depth ``d`` keep the best ``widths[d]`` extensions (tree order) of the previous beam.

    Each beam is kept in lexicographic path order, so the flat index ``b * C + j`` of an extension follows its
    path and ``jax.lax.top_k``'s lower-index tie-break is the path's. Returns, stacked per depth with
    ``K = max(widths)`` (or ``k``): scores [D, K] (``-inf``: empty), parent slot [D, K] (``>= K`` for a slot
    emptied by a width) and candidate index [D, K], each level sorted by (parent slot, candidate). With
    ``k`` given, ``widths`` may be a traced int[D] (each ``<= k``).
    """
    d, c, _ = tables.shape
    full = k is None and all(w == max(widths) for w in widths)  # best_first: every depth keeps K, no limit
    k = max(widths) if k is None else k
    t = jnp.minimum(jnp.asarray(tables, jnp.float32), 0.0)
    t = jnp.where(t == 0, 0.0, t)  # -0.0 as +0.0: jit folds ``0 + x`` to ``x`` and top_k ranks -0.0 below +0.0
    slots = jnp.arange(k, dtype=jnp.int32)
    # carry: scores and flat keys b * C + j of the beam (slot 0 = the root, key 0 = candidate row 0)
    init = (jnp.full((k,), -jnp.inf, jnp.float32).at[0].set(0.0), jnp.zeros((k,), jnp.int32))

    def step(carry, xs):
        scores, key = carry
        table, limit = xs
        child = (scores[:, None] + table[key % c]).reshape(-1)  # [K * C], row-major = lexicographic
        top, idx = jax.lax.top_k(child, k)
        if not full:  # slots past this depth's width become empty (sorted last: keys past every child)
            keep = slots < limit
            idx, top = jnp.where(keep, idx, k * c + slots), jnp.where(keep, top, -jnp.inf)
        # back to lexicographic order (the keys are distinct: entry a goes to slot #{b: key_b < key_a}); an empty
        # (-inf) entry between kept ones is never extended (its children are -inf too) and its outputs are masked
        slot = jnp.sum(idx[None, :] < idx[:, None], axis=1, dtype=jnp.int32)
        packed = jnp.stack([jax.lax.bitcast_convert_type(top, jnp.int32), idx])  # one output array per step
        packed = _lookup(slot, packed, slots)
        return (jax.lax.bitcast_convert_type(packed[0], jnp.float32), packed[1]), packed

    _, out = jax.lax.scan(step, init, (t, jnp.asarray(widths, jnp.int32)), unroll=True)
    scores, key = jax.lax.bitcast_convert_type(out[:, 0], jnp.float32), out[:, 1]
    return scores, key // c, key % c


def _preorder(parent_slot: jax.Array) -> jax.Array:
    """Depth-first preorder rank of every beam entry in the trie of all entries (one integer key that orders
    candidate-index paths lexicographically, a prefix first), in closed form.

    An entry at level ``u``, slot ``s`` is preceded by ``slot + 1`` entries at each ancestor's level, ``s`` at
    its own, and ``F_t o ... o F_{u+1}(s)`` at each deeper level ``t`` (``F_t(r)``: level-``t`` entries whose
    parent slot is below ``r``); both sums come from pointer doubling (``ceil(log2 D)`` steps).
    """
    d, k = parent_slot.shape
    n = d * k
    steps = max(d - 1, 1).bit_length()
    parent_slot = jnp.asarray(parent_slot, jnp.int32)
    level = jnp.repeat(jnp.arange(d, dtype=jnp.int32), k)
    slot = jnp.tile(jnp.arange(k, dtype=jnp.int32), d)
    flat_parent = parent_slot.reshape(n)
    # shallower levels: sum of (slot + 1) over the ancestors; the root (index n) is its own parent, worth 0
    jump = jnp.where(level > 0, (level - 1) * k + jnp.minimum(flat_parent, k - 1), n)
    jump = jnp.concatenate([jump, jnp.full((1,), n, jnp.int32)])
    above = jnp.concatenate([jnp.where(level > 0, flat_parent + 1, 0), jnp.zeros((1,), jnp.int32)])
    for _ in range(steps):
        above = above + above[jump]
        jump = jump[jump]
    # deeper levels: g[u, r] = F_{u+1}(r), then doubling of (composition, sum over the levels covered)
    r = jnp.arange(k + 1, dtype=jnp.int32)
    f = jnp.sum(parent_slot[:, :, None] < r[None, None, :], axis=1, dtype=jnp.int32)  # [D, K + 1]
    g = jnp.concatenate([f[1:], jnp.zeros((1, k + 1), jnp.int32)])  # level u -> u + 1 (none below the last)
    below = g
    for b in range(steps):
        shift = 1 << b
        zeros = jnp.zeros((min(shift, d), k + 1), jnp.int32)
        g_next = jnp.concatenate([g[shift:], zeros])[:d]  # the map from level u + shift on (zero past the end)
        below_next = jnp.concatenate([below[shift:], zeros])[:d]
        below = below + jnp.take_along_axis(below_next, g, axis=1)
        g = jnp.take_along_axis(g_next, g, axis=1)
    return above[:n] + slot + below[level, slot]


def _tail_lse_scatter(u: jax.Array, cands: jax.Array) -> jax.Array:
    """``logsumexp`` of each row of ``u [D, V]`` without its (distinct) candidate tokens ``cands [D, C]``."""
    return jax.nn.logsumexp(u.at[jnp.arange(u.shape[0])[:, None], cands].set(-jnp.inf), axis=-1)


def _tail_lse_compare(u: jax.Array, cands: jax.Array) -> jax.Array:
    """:func:`_tail_lse_scatter` with the candidates found by comparison: on an accelerator this reads ``u`` once,
    where the scatter first copies it."""
    is_cand = jnp.any(jnp.arange(u.shape[1], dtype=jnp.int32)[None, :, None] == cands[:, None, :], axis=-1)
    return jax.nn.logsumexp(jnp.where(is_cand, -jnp.inf, u), axis=-1)


def _merge(beams: tuple[jax.Array, jax.Array, jax.Array], cand_tokens: jax.Array, m: int,
           by_depth: bool = False) -> Tree:
    """Global top-``m`` of all beam entries as a :class:`Tree`: by score, ties in the tree order (the
    candidate-index path), or with ``by_depth`` to the shallower entry, then to the lower beam slot."""
    scores, parent_slot, cand = beams
    d, k = scores.shape
    n = d * k
    s = scores.reshape(n)
    flat = jnp.arange(n, dtype=jnp.int32)  # depth-major: shallower first, then the slot (lexicographic path)
    tie = flat if by_depth else _preorder(parent_slot)
    *_, order = jax.lax.sort((-s, tie, flat), num_keys=2)
    sel = order[:m]
    valid = s[sel] > -jnp.inf
    level = sel // k
    parent_flat = jnp.maximum(level - 1, 0) * k + parent_slot.reshape(n)[sel]
    # the node index of each parent: 1 + its place in ``sel`` (entries are distinct), 0 if it is not selected
    parents = jnp.where(level == 0, 0, _lookup(sel, jnp.arange(1, m + 1, dtype=jnp.int32), parent_flat))
    cands = cand.reshape(n)[sel]
    tokens = cand_tokens[level, cands]
    return Tree(
        tokens=jnp.where(valid, tokens, -1).astype(jnp.int32),
        parents=jnp.where(valid, parents, 0).astype(jnp.int32),
        depths=jnp.where(valid, level + 1, 1).astype(jnp.int32),
        scores=jnp.where(valid, s[sel], -jnp.inf),
        cands=jnp.where(valid, cands, -1).astype(jnp.int32),
        valid=valid,
    )


def best_first(tables: jax.Array, cand_tokens: jax.Array, budget: int) -> Tree:
    """The ``budget`` (static, >= 1) most probable prefixes of depth ``1..D`` (DDTree's best-first heap).

    A prefix's score is the sum of ``tables[d, parent_cand, cand]`` (float32[D, C, C]) along its path; the first
    ``b`` nodes are the best ``b`` prefixes for every ``b <= budget`` (a per-depth beam of width ``budget``, then
    a global merge). With :func:`ddtree_tables` and ``top_c >= min(budget, V)`` this is upstream DDTree's tree,
    tie-break included. Returns a :class:`Tree` of ``budget`` nodes in the module's order.
    """
    budget = _check_int("budget", budget, 1)
    d, _ = _check_tables(tables, cand_tokens)
    return _merge(_expand(tables, (budget,) * d), jnp.asarray(cand_tokens, jnp.int32), budget)


def layer_beam(tables: jax.Array, cand_tokens: jax.Array, k: int, nodes: int) -> Tree:
    """PCTree's tree (arXiv 2608.02123): a beam of ``k`` (static, >= 1) nodes per depth, then the global top
    ``nodes`` (static, the root excluded, ``1 <= nodes <= k * D``).

    At each depth the ``k`` best extensions of the kept nodes by path score are kept (ties: the lower
    candidate-index path); the tree (prefix-closed) is the ``nodes`` best kept nodes by path score, ties to the
    shallower node, then the lower path. Returns a :class:`Tree` in that order, padding at the end.
    """
    d, _ = _check_tables(tables, cand_tokens)
    k = _check_int("k", k, 1)
    nodes = _check_int("nodes", nodes, 1)
    if nodes > k * d:
        raise ArgumentError(f"nodes must be <= k * D = {k * d} (the nodes the beam keeps), got {nodes}")
    return _merge(_expand(tables, (k,) * d), jnp.asarray(cand_tokens, jnp.int32), nodes, by_depth=True)


def even_widths(budget: int, depth: int) -> tuple[int, ...]:
    """An even beam profile: ``budget`` nodes over ``depth`` depths, the remainder to the shallowest."""
    budget = _check_int("budget", budget, 1)
    depth = _check_int("depth", depth, 1)
    q, r = divmod(budget, depth)
    return tuple(q + 1 if i < r else q for i in range(depth))


# Per-depth conditional acceptance rates of the demo pair's DSpark greedy chain: auto_widths' default profile.
DEMO_DEPTH_RATES: tuple[float, ...] = (
    0.54, 0.69, 0.79, 0.76, 0.81, 0.71, 0.96, 0.86, 0.88, 0.93, 0.76, 0.86, 0.93, 0.90, 0.97, 0.77,
)
# auto_widths' model ``miss(w) = miss(1) * w ** -exponent``, fitted on the demo pair (docs/benchmarks.md).
DEMO_WIDTH_EXPONENT = 0.6


def auto_widths(budget: int, depth: int, rates: tuple[float, ...] | None = None, top_c: int | None = None,
                exponent: float | None = None) -> tuple[int, ...]:
    """A beam profile of ``depth`` non-negative ints summing to ``budget`` that maximises the expected accepted
    length ``sum_d prod_{i <= d} q_i(w_i)``, ``q_d(w) = 1 - (1 - r_d) * w ** -exponent`` (``q_d(0) = 0``).

    Nodes are added one at a time to the depth with the largest gain (the shallowest on a tie), never below an
    empty depth, past ``top_c ** (d + 1)`` or past ``top_c`` children per kept node above. ``rates``: per-depth
    conditional acceptance rates in ``[0, 1]``, depth ``d`` uses ``rates[min(d, len(rates) - 1)]`` (default
    :data:`DEMO_DEPTH_RATES`); ``top_c``: None for no cap (else ``budget`` must be reachable); ``exponent``:
    ``> 0`` (default :data:`DEMO_WIDTH_EXPONENT`).
    """
    budget = _check_int("budget", budget, 1)
    depth = _check_int("depth", depth, 1)
    rates = DEMO_DEPTH_RATES if rates is None else rates
    if isinstance(rates, str | bytes) or not hasattr(rates, "__len__") or len(rates) == 0:
        raise ArgumentError(f"rates must be a non-empty sequence of per-depth rates in [0, 1], got {rates!r}")
    try:
        r = np.asarray([float(x) for x in rates], np.float64)
    except (TypeError, ValueError):
        raise ArgumentError(f"rates must be numbers in [0, 1], got {rates!r}") from None
    if not np.all(np.isfinite(r)) or np.any(r < 0) or np.any(r > 1):
        raise ArgumentError(f"rates must be numbers in [0, 1], got {tuple(rates)!r}")
    r = r[np.minimum(np.arange(depth), len(r) - 1)]
    cap = np.full(depth, np.inf)
    if top_c is not None:
        top_c = _check_int("top_c", top_c, 1)
        cap = np.array([float(top_c) ** (d + 1) for d in range(depth)])
        if budget > cap.sum():
            raise ArgumentError(f"budget: {budget} nodes exceed the reachable tree size {int(cap.sum())} "
                                f"(top_c={top_c}, depth={depth})")
    exponent = DEMO_WIDTH_EXPONENT if exponent is None else exponent
    if isinstance(exponent, bool) or not isinstance(exponent, int | float) or not 0 < exponent < np.inf:
        raise ArgumentError(f"exponent must be a positive number, got {exponent!r}")
    w = np.zeros(depth, np.int64)
    eye = np.eye(depth, dtype=np.int64)
    for _ in range(budget):
        trial = w[None, :] + eye  # [D, D]: one more node at depth d (row d)
        q = np.where(trial > 0, 1.0 - (1.0 - r)[None, :] * np.maximum(trial, 1) ** -float(exponent), 0.0)
        gain = np.cumprod(q, axis=1).sum(axis=1)
        above = np.concatenate([[np.inf], w[:-1].astype(np.float64)])
        child_cap = np.inf if top_c is None else above * top_c  # top_c children per kept node above
        allowed = (w < cap) & (w < child_cap) & (above > 0)
        gain = np.where(allowed, gain, -np.inf)
        w[int(np.argmax(gain))] += 1  # the first maximum: the shallowest depth on a tie
    return tuple(int(x) for x in w)


def beam(tables: jax.Array, cand_tokens: jax.Array, widths: tuple[int, ...]) -> Tree:
    """Static-budget beam: at depth ``d + 1`` keep the best ``widths[d]`` extensions (tree order) of the kept
    depth-``d`` prefixes. ``widths``: static, ``D`` non-negative ints, positive sum, zeros only at the end.
    Returns a :class:`Tree` of ``sum(widths)`` nodes in :func:`best_first`'s format and order."""
    d, _ = _check_tables(tables, cand_tokens)
    if not isinstance(widths, tuple | list) or len(widths) != d:
        raise ArgumentError(f"widths must be a tuple of {d} ints (one per depth of tables), got {widths!r}")
    widths = tuple(_check_int(f"widths[{i}]", w, 0) for i, w in enumerate(widths))
    if sum(widths) < 1:
        raise ArgumentError(f"widths must have a positive sum, got {widths!r}")
    first_zero = widths.index(0) if 0 in widths else d
    if any(widths[first_zero:]):
        raise ArgumentError(f"widths may only have zeros at the end (deepest depths), got {widths!r}")
    return _merge(_expand(tables, widths), jnp.asarray(cand_tokens, jnp.int32), sum(widths))


def visibility(parents: jax.Array, max_depth: int | None = None) -> jax.Array:
    """Ancestor mask bool[M + 1, M + 1] of a tree, root included: ``mask[q, a]`` is True iff node ``a`` is
    ``q`` or one of its ancestors (by pointer doubling). ``parents``: int[M] as :attr:`Tree.parents`;
    ``max_depth``: static bound on the tree depth (default ``M``)."""
    _check_ndim(parents=(parents, "M"))
    m = parents.shape[0]
    bound = m if max_depth is None else _check_int("max_depth", max_depth, 1)
    jump = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.asarray(parents, jnp.int32)])
    mask = jnp.eye(m + 1, dtype=bool)
    for _ in range(bound.bit_length()):  # after s steps: every ancestor at distance < 2**s
        mask = mask | mask[jump]
        jump = jump[jump]
    return mask


def tree_positions(depths: jax.Array, start: jax.Array | int) -> jax.Array:
    """Absolute positions int32[M + 1] of ``[root] + nodes``: ``start``, then ``start + depth``."""
    _check_ndim(depths=(depths, "M"))
    d = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.asarray(depths, jnp.int32)])
    return jnp.asarray(start, jnp.int32) + d


def _check_accept_args(parents, tokens, posterior, max_depth) -> tuple[int, int, jax.Array, jax.Array, jax.Array]:
    _check_ndim(parents=(parents, "M"), tokens=(tokens, "M"), posterior=(posterior, "M + 1"))
    m = parents.shape[0]
    if tokens.shape[0] != m or posterior.shape[0] != m + 1:
        raise ArgumentError(f"parents [M], tokens [M] and posterior [M + 1] disagree: shapes {tuple(parents.shape)}, "
                            f"{tuple(tokens.shape)}, {tuple(posterior.shape)}")
    steps = m if max_depth is None else _check_int("max_depth", max_depth, 1)
    return m, steps, *(jnp.asarray(x, jnp.int32) for x in (parents, tokens, posterior))


def accept(parents: jax.Array, tokens: jax.Array, posterior: jax.Array, max_depth: int | None = None, *,
           mask: jax.Array | None = None) -> Accepted:
    """Walk a verified tree (upstream ``follow_verified_tree``), all depths at once, without a loop.

    From the root, while ``posterior[current]`` equals the token of one of ``current``'s children, move to
    that child (the lowest-index one among equal tokens), for at most ``max_depth`` steps (static; default
    ``M``). :func:`accept_walk` is the step-by-step reference. ``parents``, ``tokens``: int[M] as in
    :class:`Tree` (parents precede children); ``posterior``: int[M + 1], the target token at each of
    ``[root] + nodes``; ``mask``: the tree's :func:`visibility` (complete for every node of depth
    ``<= max_depth``), computed when None. Returns :class:`Accepted`, indices padded to ``max_depth + 1``.
    """
    m, steps, parents, tokens, posterior = _check_accept_args(parents, tokens, posterior, max_depth)
    if mask is None:
        # one more level than the walk can reach: a deeper node then has more than max_depth + 1 ancestors
        # in its (truncated) row, so it reads as deeper than max_depth
        mask = visibility(parents, max_depth=steps + 1)
    elif tuple(jnp.shape(mask)) != (m + 1, m + 1):
        raise ArgumentError(f"mask must have shape [M + 1, M + 1] = {(m + 1, m + 1)}, got {tuple(jnp.shape(mask))}")
    mask = jnp.asarray(mask, bool)
    match = tokens == posterior[parents]
    node = jnp.arange(m, dtype=jnp.int32)
    # an earlier sibling with the same token (hence also matching) takes precedence
    shadowed = jnp.any((parents[None, :] == parents[:, None]) & (tokens[None, :] == tokens[:, None])
                       & (node[None, :] < node[:, None]), axis=1)
    bad = jnp.concatenate([jnp.zeros((1,), bool), ~match | shadowed])  # [M + 1]; the root is always reached
    # one reduction per row: (number of ancestors-or-self) + big * (number of bad ones)
    big = max(m, steps) + 2
    count = jnp.sum(jnp.where(mask, jnp.where(bad, big + 1, 1)[None, :], 0), axis=1, dtype=jnp.int32)
    depth1 = jnp.where(count <= steps + 1, count, 0)  # depth + 1 of a reached node (no bad one, shallow enough)
    q = jnp.arange(m + 1, dtype=jnp.int32)
    level1 = jnp.arange(1, steps + 2, dtype=jnp.int32)
    # [max_depth + 1, M + 1]: the reached node of each depth (one per depth < length; path indices increase)
    indices = jnp.max(jnp.where(depth1[None, :] == level1[:, None], q[None, :], -1), axis=1)
    length = jnp.sum(indices >= 0, dtype=jnp.int32)
    return Accepted(indices=indices, length=length, bonus=posterior[indices[length - 1]])


def accept_walk(parents: jax.Array, tokens: jax.Array, posterior: jax.Array, max_depth: int | None = None) -> Accepted:
    """The step-by-step walk of :func:`accept` (one ``fori_loop`` step per depth); the reference it equals."""
    m, steps, parents, tokens, posterior = _check_accept_args(parents, tokens, posterior, max_depth)

    def body(k, carry):
        cur, length, path, done = carry
        match = (parents == cur) & (tokens == posterior[cur])
        found = jnp.any(match) & ~done
        child = (jnp.argmax(match) + 1).astype(jnp.int32)
        cur = jnp.where(found, child, cur)
        path = path.at[k + 1].set(jnp.where(found, child, -1))
        return cur, length + found.astype(jnp.int32), path, done | ~found

    init = (jnp.int32(0), jnp.int32(1), jnp.full((steps + 1,), -1, jnp.int32).at[0].set(0), jnp.bool_(False))
    cur, length, path, _ = jax.lax.fori_loop(0, steps, body, init)
    return Accepted(indices=path, length=length, bonus=posterior[cur])


# ============================================================================= the seed's SparklingTree

def seed_candidates(base_logits: jax.Array, x_start: jax.Array | int, top_c: int) -> tuple[jax.Array, jax.Array]:
    """The seed's one candidate set for every depth: the union of each depth's top-``top_c`` base tokens and
    the root ``x_start``, as ascending token ids with duplicates marked invalid (no compaction, static shape).

    ``base_logits``: [D, V]; ``top_c`` (static): ``C = min(top_c, V)``. Returns ``(tokens int32[U], valid
    bool[U])`` with ``U = min(D C + 1, V)`` (the whole vocabulary, ``valid`` its membership, when the union could
    cover it). Ordering by token id makes a row's lower-index tie-break the lower token id.
    """
    top_c = _check_int("top_c", top_c, 1)
    _check_ndim(base_logits=(base_logits, "D, V"))
    d, v = base_logits.shape
    root = jnp.reshape(jnp.asarray(x_start, jnp.int32), (1,))
    if min(top_c, v) >= v:
        return jnp.arange(v, dtype=jnp.int32), jnp.ones((v,), bool)
    pool = jnp.concatenate([candidates(base_logits, top_c)[0].reshape(-1), root])
    if pool.shape[0] >= v:
        return jnp.arange(v, dtype=jnp.int32), jnp.zeros((v,), bool).at[pool].set(True)
    tokens = jnp.sort(pool)
    return tokens, jnp.concatenate([jnp.ones((1,), bool), tokens[1:] != tokens[:-1]])


def seed_fanout(budget: int, max_fanout: int, union: int) -> int:
    """The seed's children per parent, ``min(max_fanout or budget, budget, U)`` (static; the invalid entries of a
    padded union are ``-inf`` and never picked, which gives the ``|U|`` bound on device)."""
    return min(max_fanout or budget, budget, union)


def seed_best_first(base_logits: jax.Array, x_start: jax.Array | int,
                    feats: Callable[[jax.Array, jax.Array], jax.Array], aux: jax.Array, w2: jax.Array, *,
                    budget: int, top_c: int, max_fanout: int = 0) -> Tree:
    """SparklingTree as the seed's own code builds it (``fixtures/seed_trees/README.md``, docs/design.md).

    One candidate set for all depths (:func:`seed_candidates`); a node with token ``p`` at depth ``d`` has the
    children ``c`` in it scored ``log_softmax_U(base_logits[d, U] + w2[U] . f_d(p))`` (normalised over the union
    only), of which its best ``k`` (:func:`seed_fanout`) may enter; best-first over the path sums picks the
    ``budget`` best prefixes. Only the rows the walk can reach are computed: a per-depth beam of ``budget``
    parents (each row ``U`` wide), then the global merge, as :func:`best_first` (a child never outscores its
    parent, so the beam holds every selected prefix).

    ``feats(aux[d], parents int32[K]) -> float32[K, R]``: the parents' rank-R features at depth ``d + 1``'s row
    (vanilla: ``W1[p]``; gated: the head's gated ``W1[p]``); ``aux``: [D, ...] per-depth inputs of ``feats`` (the
    block's hidden state); ``w2``: [V, R]. Ties: the lower path of row ranks (rank: the place in the parent's row,
    the lower token id first among equal log-probs). ``Tree.cands`` holds the token's index into the union.
    """
    budget = _check_int("budget", budget, 1)
    max_fanout = _check_int("max_fanout", max_fanout, 0)
    _check_ndim(base_logits=(base_logits, "D, V"), w2=(w2, "V, R"))
    d, v = base_logits.shape
    if w2.shape[0] != v:
        raise ArgumentError(f"w2 must have shape [V={v}, R], got {tuple(w2.shape)}")
    if jnp.shape(aux)[:1] != (d,):
        raise ArgumentError(f"aux must have one row per depth ({d}), got shape {tuple(jnp.shape(aux))}")
    union, valid = seed_candidates(base_logits, x_start, top_c)
    u = union.shape[0]
    k = seed_fanout(budget, max_fanout, u)
    w2u = jnp.asarray(w2, jnp.float32)[union]  # [U, R]
    base_u = jnp.where(valid[None, :], jnp.take(jnp.asarray(base_logits, jnp.float32), union, axis=1), -jnp.inf)
    slots = jnp.arange(budget, dtype=jnp.int32)
    init = (jnp.full((budget,), -jnp.inf, jnp.float32).at[0].set(0.0),
            jnp.full((budget,), jnp.asarray(x_start, jnp.int32)))

    def step(carry, xs):
        scores, parents = carry
        base_d, aux_d = xs
        z = base_d[None, :] + jnp.asarray(feats(aux_d, parents), jnp.float32) @ w2u.T  # [K, U]
        logp = jnp.minimum(z - jax.nn.logsumexp(z, axis=-1, keepdims=True), 0.0)
        logp = jnp.where(logp == 0, 0.0, logp)  # -0.0 as +0.0 (see _expand)
        if k < budget:  # each parent's best k children first (its row order), then the best of all
            top, rank_idx = jax.lax.top_k(logp, k)  # [K, k]
        else:  # k == budget: a child ranked k or worse in its row is never in the top budget (k better siblings)
            top, rank_idx = logp, jnp.broadcast_to(jnp.arange(u, dtype=jnp.int32), (budget, u))
        width = top.shape[1]
        child = (scores[:, None] + top).reshape(-1)  # key b * width + r: lexicographic in (slot, rank)
        best, key = jax.lax.top_k(child, budget)
        slot = jnp.sum(key[None, :] < key[:, None], axis=1, dtype=jnp.int32)  # back to lexicographic order
        key = _lookup(slot, key, slots)
        best = jax.lax.bitcast_convert_type(
            _lookup(slot, jax.lax.bitcast_convert_type(best, jnp.int32), slots), jnp.float32)
        uidx = rank_idx.reshape(-1)[key]
        return (best, union[uidx]), (best, key // width, uidx)

    _, (scores, parent_slot, uidx) = jax.lax.scan(step, init, (base_u, aux), unroll=True)  # no device loop
    return _merge((scores, parent_slot, uidx), jnp.broadcast_to(union, (d, u)), budget)


def build_ddtree(logits: jax.Array, budget: int) -> Tree:
    """Upstream DDTree on device: top-``min(budget, V)`` per depth, independent marginals, best-first."""
    budget = _check_int("budget", budget, 1)
    cand_tokens, cand_logp = candidates(logits, budget)
    return best_first(ddtree_tables(cand_logp), cand_tokens, budget)


def build_sparkling_tree(base_logits: jax.Array, x_start: jax.Array | int, w1: jax.Array, w2: jax.Array, *,
                         budget: int, top_c: int, candidates: str = "seed", max_fanout: int = 0,
                         normalization: Normalization = "fast", widths: tuple[int, ...] | None = None) -> Tree:
    """SparklingTree with a vanilla Markov head (``w1``, ``w2``: [V, R]).

    ``candidates="seed"``: the seed's own tree (:func:`seed_best_first`: one union of every depth's top-``top_c``
    base tokens, each row normalised over it, at most ``max_fanout`` children per parent, 0 = ``budget``).
    ``candidates="base"``: sparkjax's per-depth base top-C with full-vocabulary normalisation
    (:func:`markov_tables`, ``normalization``), then best-first (``widths=None``) or :func:`beam` with the given
    width profile (which must sum to ``budget``)."""
    budget = _check_int("budget", budget, 1)
    if candidates not in ("seed", "base"):
        raise ArgumentError(f"candidates must be 'seed' or 'base', got {candidates!r}")
    if candidates == "seed":
        if widths is not None:
            raise ArgumentError("widths: the seed's tree is best-first (candidates='seed' takes no width profile)")
        _check_ndim(w1=(w1, "V, R"))
        w1 = jnp.asarray(w1, jnp.float32)
        d = jnp.shape(base_logits)[0]
        return seed_best_first(base_logits, x_start, lambda _, p: w1[p], jnp.zeros((d, 1)), w2, budget=budget,
                               top_c=top_c, max_fanout=max_fanout)
    if max_fanout:
        raise ArgumentError(f"max_fanout: only candidates='seed' limits the children per parent, got {max_fanout}")
    if widths is not None and sum(widths) != budget:
        raise ArgumentError(f"widths must sum to budget={budget}, got {widths!r} (sum {sum(widths)})")
    cand_tokens, _ = _candidates(base_logits, top_c)
    feats = vanilla_parent_feats(w1, x_start, cand_tokens)
    tables = markov_tables(base_logits, cand_tokens, feats, w2, normalization)
    if widths is None:
        return best_first(tables, cand_tokens, budget)
    return beam(tables, cand_tokens, widths)

