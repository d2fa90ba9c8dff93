"""On-device draft trees for DDTree and SparklingTree speculative decoding.

Everything here is a pure function of arrays for **one** sequence, with static output shapes, so that it
runs inside ``jax.jit`` with no host round trip and batches with ``jax.vmap``. Scores are float32.

Pipeline of one round (``D`` depths, vocabulary ``V``, ``C`` candidates per depth, ``M`` nodes)::

    cand_tokens, cand_logp = candidates(base_logits, top_c)               # [D, C] int32, [D, C] f32
    tables = ddtree_tables(cand_logp)                                      # DDTree: no Markov head
    tables = markov_tables(base_logits, cand_tokens, feats, w2, "fast")    # SparklingTree: [D, C, C]
    tree = best_first(tables, cand_tokens, budget)                         # or beam(..., widths)
    mask = visibility(tree.parents, max_depth=D)                           # [M + 1, M + 1] bool
    pos = tree_positions(tree.depths, start)                               # [M + 1] int32
    ... verify [x_start] + tree.tokens with the target ...
    acc = accept(tree.parents, tree.tokens, posterior, max_depth=D)

Conventions
-----------
* **Depths.** Row ``d`` (0-based) of every per-depth array describes depth ``d + 1``; the root (``x_start``,
  the last committed token) is depth 0. For a DSpark drafter, depth ``d + 1`` uses block slot ``d``.
* **Node indices.** The root is node 0 and the drafted nodes are 1..M. Per-node arrays of a :class:`Tree`
  have length ``M``: entry ``i`` describes node ``i + 1``. ``parents[i]`` is in ``0..M`` (0 = root).
  ``visibility`` and ``tree_positions`` include the root as row / element 0, so they line up with the
  verify input ``[x_start] + tokens``.
* **Order.** Nodes come in the total order "path score descending, then the tuple of candidate indices
  along the path ascending (lexicographic; a prefix before its extensions)". The candidate index of a
  token is its rank in the per-depth top-C list (``jax.lax.top_k`` order: larger log-prob first, the
  lower token id first among equal ones), so for DDTree tables this is upstream DDTree's tie-break by
  the tuple of ranks along the path. A child never precedes its parent, so parents come before children
  and scores are non-increasing.
* **Padding.** When fewer than ``M`` prefixes are available (tiny vocabularies or depths, entries of
  ``-inf`` in the tables), the last nodes are padding: ``valid`` False, token -1, parent 0 (the root),
  depth 1, score ``-inf``, candidate index -1. Padding nodes are leaves that only see the root and
  themselves, no valid node sees them, and :func:`accept` never walks into them (token -1 matches no
  posterior token); an engine must only clamp their token (e.g. ``jnp.maximum(tokens, 0)``) before an
  embedding lookup.
* **Impossible children.** A table entry of ``-inf`` means "this child does not exist": it is never put
  into the tree. Setting ``tables[d:] = -inf`` therefore limits the tree to depth ``d`` without a
  recompile. Positive table entries are clipped to 0 so that a child can never outscore its parent.
  Likewise a token whose logit is ``-inf`` (e.g. a padded vocabulary row) never enters a tree. NaNs are
  not supported.
* **Candidates.** :func:`candidates` ranks the base logits of every depth. :func:`markov_candidates` instead
  follows the Markov head: depth 1 ranked by its exact corrected row (its parent, ``x_start``, is known),
  deeper depths the corrected top-k for the greedy chain's parent merged with the base top-C
  (:func:`merge_candidates`: distinct tokens, static shapes). :func:`markov_tables` takes the candidate tokens
  as given and the base logits, so any candidate set works.
* **Cost.** ``markov_tables(..., "fast")`` is ``O(D C^2 R + D V)``; ``"exact"`` is ``O(D C V R)``, which
  dominates everything else at a real vocabulary (``python -m sparkjax.bench tree``).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sparkjax.errors import ArgumentError

__all__ = [
    "Accepted",
    "Tree",
    "accept",
    "accept_walk",
    "auto_widths",
    "beam",
    "best_first",
    "build_ddtree",
    "build_sparkling_tree",
    "candidates",
    "chunked_top_k",
    "ddtree_tables",
    "even_widths",
    "layer_beam",
    "markov_candidates",
    "markov_tables",
    "merge_candidates",
    "tree_positions",
    "vanilla_parent_feats",
    "visibility",
]

Normalization = Literal["exact", "fast"]
CandidateMode = Literal["base", "corrected", "union"]
CANDIDATE_MODES: tuple[str, ...] = ("base", "corrected", "union")  # see markov_candidates


class Tree(NamedTuple):
    """A draft tree of ``M`` nodes (the root excluded); entry ``i`` describes node ``i + 1``.

    Attributes:
      tokens: int32[M] token id of each node (-1 for padding).
      parents: int32[M] parent node index in ``0..M``; 0 is the root (padding: 0).
      depths: int32[M] depth in ``1..D`` (padding: 1).
      scores: float32[M] path log-probability, the sum of the table entries along the path (padding: -inf).
      cands: int32[M] candidate index of the node's token in its depth's top-C list (padding: -1).
      valid: bool[M] False for padding nodes.
    """

    tokens: jax.Array
    parents: jax.Array
    depths: jax.Array
    scores: jax.Array
    cands: jax.Array
    valid: jax.Array


class Accepted(NamedTuple):
    """The outcome of walking a verified tree.

    Attributes:
      indices: int32[max_depth + 1] accepted node indices, the root 0 first, padded with -1.
      length: int32 scalar, number of accepted indices including the root (1..max_depth + 1).
      bonus: int32 scalar, the posterior token at the last accepted node (the next committed token).
    """

    indices: jax.Array
    length: jax.Array
    bonus: jax.Array


# ----------------------------------------------------------------------------------------------------------
# argument checks (all run at trace time on static shapes / Python ints)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ArgumentError(f"{name} must be a static Python int, got {type(value).__name__} {value!r}")
    if int(value) < minimum:
        raise ArgumentError(f"{name} must be >= {minimum}, got {int(value)}")
    return int(value)


def _check_ndim(name: str, x: jax.Array, ndim: int, axes: str) -> None:
    if jnp.ndim(x) != ndim:
        raise ArgumentError(f"{name} must have shape [{axes}], got shape {tuple(jnp.shape(x))}")


# ----------------------------------------------------------------------------------------------------------
# candidates and tables


TOPK_CHUNK = 4096  # vocabulary chunk of the two-stage top-k (a larger vocabulary is split on GPU / TPU)


def chunked_top_k(x: jax.Array, k: int, chunk: int = TOPK_CHUNK) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(x, k)`` over the last axis in two stages: the top ``k`` of every ``chunk`` entries,
    then the top ``k`` of those winners. The result is identical to ``jax.lax.top_k``, ties included (equal
    values: the lower index first; the order of ``+-inf`` and NaN is ``top_k``'s own, since both stages use
    it): the winners lie chunk after chunk and, within a chunk, equal values by index, so the flat position
    of equal values follows their index and the second stage's tie-break is the first's.

    XLA:GPU has fast top-k kernels only for small inputs and ``k``; at a 152k vocabulary it may sort the
    whole row. Here every row is only sorted in ``chunk``-sized segments plus one short row of winners.

    Args:
      x: [..., V] values.
      k: static, ``1 <= k <= V``.
      chunk: static chunk length, ``>= k``; the last chunk is padded with ``-inf`` (after every real
        entry in the order, so padding is never picked while ``k <= V``).

    Returns:
      ``(values [..., k], indices int32 [..., k])`` as ``jax.lax.top_k``.
    """
    k = _check_int("k", k, 1)
    chunk = _check_int("chunk", chunk, k)
    v = x.shape[-1]
    if k > v:
        raise ArgumentError(f"k must be <= the last axis ({v}), got {k}")
    n = -(-v // chunk)
    if n == 1:
        return tuple(jax.lax.top_k(x, k))
    lead = x.shape[:-1]
    pad = jnp.full((*lead, n * chunk - v), -jnp.inf, x.dtype)
    val, idx = jax.lax.top_k(jnp.concatenate([x, pad], axis=-1).reshape(*lead, n, chunk), k)
    idx = idx.astype(jnp.int32) + (jnp.arange(n, dtype=jnp.int32) * chunk)[:, None]
    top, pos = jax.lax.top_k(val.reshape(*lead, n * k), k)
    return top, jnp.take_along_axis(idx.reshape(*lead, n * k), pos, axis=-1)


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k`` over the last axis; two-stage (:func:`chunked_top_k`) for a large vocabulary on
    accelerators. XLA:CPU's own top-k is faster at a large vocabulary, so CPU keeps it."""
    if x.shape[-1] <= 2 * TOPK_CHUNK or k > TOPK_CHUNK:
        return jax.lax.top_k(x, k)
    return jax.lax.platform_dependent(
        x, cpu=lambda y: tuple(jax.lax.top_k(y, k)), default=lambda y: tuple(chunked_top_k(y, k))
    )


def candidates(logits: jax.Array, top_c: int) -> tuple[jax.Array, jax.Array]:
    """Top-C candidate tokens per depth and their full-vocabulary log-probabilities.

    Args:
      logits: [D, V] drafter logits; row ``d`` predicts depth ``d + 1``.
      top_c: number of candidates per depth (static). ``C = min(top_c, V)``, so a vocabulary smaller
        than ``top_c`` works.

    Returns:
      ``(cand_tokens int32[D, C], cand_logp float32[D, C])``: per row the C tokens with the largest
      ``log_softmax`` (computed as ``logits - logsumexp(logits)`` in float32), largest first; among equal
      log-probs the lower token id comes first (``jax.lax.top_k``). The position of a token in its row is
      its *candidate index*, used as the tie-break key of the tree builders.
    """
    top_c = _check_int("top_c", top_c, 1)
    _check_ndim("logits", logits, 2, "D, V")
    x = jnp.asarray(logits, jnp.float32)
    logp = x - jax.nn.logsumexp(x, axis=-1, keepdims=True)
    c = min(top_c, x.shape[-1])
    cand_logp, cand_tokens = top_k(logp, c)
    # The barrier keeps XLA from folding later slices of the result into the top-k, which turns it into a
    # full sort of the vocabulary on CPU (far slower at a real vocabulary).
    cand_tokens, cand_logp = jax.lax.optimization_barrier((cand_tokens.astype(jnp.int32), cand_logp))
    return cand_tokens, cand_logp


def merge_candidates(pool: jax.Array, valid: jax.Array, c: int) -> jax.Array:
    """The first ``c`` distinct valid tokens of ``pool``, in pool order (static shapes, no sort).

    Args:
      pool: int[Q] tokens in priority order (duplicates allowed).
      valid: bool[Q] False for entries to skip.
      c: static number of tokens to keep, ``1 <= c <= Q``. The pool must hold at least ``c`` distinct
        valid tokens (e.g. end with a row of :func:`candidates`); otherwise the last slots hold token 0.

    Returns:
      int32[c]: an entry is kept iff it is valid and no earlier valid entry has the same token.
    """
    _check_ndim("pool", pool, 1, "Q")
    _check_ndim("valid", valid, 1, "Q")
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
    slot = jnp.where(keep & (rank < c), rank, c)  # c: dropped
    return jnp.zeros((c,), jnp.int32).at[slot].set(pool, mode="drop")


def markov_candidates(
    base_logits: jax.Array,
    corrected_logits: jax.Array,
    top_c: int,
    mode: CandidateMode = "union",
    union_k: int | None = None,
) -> jax.Array:
    """Per-depth candidates that follow the Markov head (the ``candidates`` option of the SparklingTree methods).

    The tables of :func:`markov_tables` only score the C candidates of each depth, so a child the Markov
    correction ranks high but the *base* logits do not is out of the tree's reach. ``corrected_logits``
    row ``d`` are depth ``d + 1``'s logits corrected for one known parent: for depth 1 the root
    (``x_start``), which makes row 0 exact; deeper, the DSpark greedy chain's token of the depth above
    (:func:`sparkjax.engine.drafting.markov_chain` at temperature 0), the most probable parent.

    * ``"base"``: :func:`candidates` of the base logits (the upstream SparklingTree candidates).
    * ``"corrected"``: the top-C of each corrected row.
    * ``"union"``: depth 1 the top-C of the (exact) corrected row; deeper, the corrected top-``union_k``
      first, then the base top-C, duplicates dropped, the first C kept (so the base top-(C - k) at least).

    Any candidate set is exact for speculative decoding (the target verifies the tree); only the tree's
    reach changes. In every mode a depth's set contains the chain's corrected argmax (``union_k >= 1``).

    Args:
      base_logits: [D, V] drafter base logits.
      corrected_logits: [D, V] Markov-corrected logits as above (ignored for ``"base"``).
      top_c: candidates per depth (static); ``C = min(top_c, V)``.
      mode: ``"base"``, ``"corrected"`` or ``"union"``.
      union_k: static, corrected candidates per depth >= 2 of ``"union"``, ``1 <= k <= C`` (default
        None: ``C // 4``, at least 1).

    Returns:
      int32[D, C] distinct tokens per depth; the order within a row is the tie-break order of the builders.
    """
    if mode not in CANDIDATE_MODES:
        raise ArgumentError(f"candidates must be one of {', '.join(CANDIDATE_MODES)}, got {mode!r}")
    top_c = _check_int("top_c", top_c, 1)
    _check_ndim("base_logits", base_logits, 2, "D, V")
    base_tokens = candidates(base_logits, top_c)[0]
    if mode == "base":
        return base_tokens
    _check_ndim("corrected_logits", corrected_logits, 2, "D, V")
    if tuple(corrected_logits.shape) != tuple(base_logits.shape):
        raise ArgumentError(
            f"corrected_logits must have the shape of base_logits {tuple(base_logits.shape)}, "
            f"got {tuple(corrected_logits.shape)}"
        )
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
    """DDTree tables: independent per-depth marginals broadcast over parents (no Markov head).

    Args:
      cand_logp: float32[D, C] candidate log-probs from :func:`candidates`.

    Returns:
      float32[D, C, C] with ``T[d, i, j] = cand_logp[d, j]`` for every parent ``i``.
    """
    _check_ndim("cand_logp", cand_logp, 2, "D, C")
    lp = jnp.asarray(cand_logp, jnp.float32)
    d, c = lp.shape
    return jnp.broadcast_to(lp[:, None, :], (d, c, c))


def vanilla_parent_feats(w1: jax.Array, x_start: jax.Array | int, cand_tokens: jax.Array) -> jax.Array:
    """Parent features of the vanilla Markov head, ``f(p) = W1[p]``, laid out for :func:`markov_tables`.

    Args:
      w1: [V, R] ``markov_w1`` embedding.
      x_start: int scalar, the root token (may be traced).
      cand_tokens: int[D, C] candidates from :func:`candidates`.

    Returns:
      float32[D, C, R]: row 0 repeats ``W1[x_start]`` for every ``i``; row ``d >= 1`` holds
      ``W1[cand_tokens[d - 1, i]]`` (the parents of depth ``d + 1``).
    """
    _check_ndim("w1", w1, 2, "V, R")
    _check_ndim("cand_tokens", cand_tokens, 2, "D, C")
    w1 = jnp.asarray(w1, jnp.float32)
    d, c = cand_tokens.shape
    root = jnp.broadcast_to(w1[jnp.asarray(x_start, jnp.int32)], (1, c, w1.shape[1]))
    return jnp.concatenate([root, w1[cand_tokens[: d - 1]]], axis=0)


def markov_tables(
    base_logits: jax.Array,
    cand_tokens: jax.Array,
    parent_feats: jax.Array,
    w2: jax.Array,
    normalization: Normalization = "exact",
) -> jax.Array:
    """Top-C Markov tables ``T[d, i, j] = log p(cand j of depth d+1 | parent = cand i of depth d)``.

    The Markov head corrects the base logits ``U_d`` (row ``d`` of ``base_logits``) of a child of parent
    ``p`` to ``U_d + W2 f(p)``, where ``f(p)`` is a rank-R feature vector of the parent: ``W1[p]`` for the
    vanilla head (:func:`vanilla_parent_feats`), ``W1[p] * gate(h_d, W1[p])`` for the gated head. The
    features are an input, so this function does not depend on the head type.

    Depth 1 (``d = 0``) has the single parent ``x_start``; its row is normalised exactly over the full
    vocabulary in both modes, every row ``i`` of ``T[0]`` is the same, and only ``parent_feats[0, 0]``
    is read. For ``d >= 1`` the parent of row ``i`` is ``cand_tokens[d - 1, i]`` with features
    ``parent_feats[d, i]``. Normalisations of ``Z_ij = U_d[c_j] + w2[c_j] . f_i`` (``c = cand_tokens[d]``):

    * ``"exact"``: ``T = Z - logsumexp_v(U_d[v] + w2[v] . f_i)`` over the full vocabulary, i.e. the true
      log-softmax of the corrected logits (costs ``C x V x R`` multiply-adds per depth).
    * ``"fast"``: ``T = Z - log(sum_j exp(Z_ij) + sum_{v not in top-C} exp(U_d[v]))``: the C corrected
      candidates plus the *uncorrected* base mass outside the candidates, i.e. it assumes the bias is
      small off the candidates (costs ``C x C x R`` per depth). It is exact when ``C = V``.

    Args:
      base_logits: [D, V] drafter base logits.
      cand_tokens: int[D, C] candidates from :func:`candidates`.
      parent_feats: [D, C, R] parent features as described above.
      w2: [V, R] ``markov_w2`` weight in the torch Linear layout, ``bias(p) = w2 @ f(p)``.
      normalization: ``"exact"`` or ``"fast"``.

    Returns:
      float32[D, C, C].
    """
    if normalization not in ("exact", "fast"):
        raise ArgumentError(f"normalization must be 'exact' or 'fast', got {normalization!r}")
    _check_ndim("base_logits", base_logits, 2, "D, V")
    _check_ndim("cand_tokens", cand_tokens, 2, "D, C")
    _check_ndim("parent_feats", parent_feats, 3, "D, C, R")
    _check_ndim("w2", w2, 2, "V, R")
    d, v = base_logits.shape
    c = cand_tokens.shape[1]
    r = w2.shape[1]
    if cand_tokens.shape[0] != d:
        raise ArgumentError(f"cand_tokens has {cand_tokens.shape[0]} depths but base_logits has {d}")
    if tuple(parent_feats.shape) != (d, c, r):
        raise ArgumentError(
            f"parent_feats must have shape {(d, c, r)} [D, C, R], got {tuple(parent_feats.shape)}"
        )
    if w2.shape[0] != v:
        raise ArgumentError(f"w2 must have shape [V={v}, R], got {tuple(w2.shape)}")

    u = jnp.asarray(base_logits, jnp.float32)
    w2 = jnp.asarray(w2, jnp.float32)
    feats = jnp.asarray(parent_feats, jnp.float32)
    cand_tokens = jnp.asarray(cand_tokens, jnp.int32)

    # depth 1: one parent (x_start), exact over the vocabulary
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
        rows = jnp.arange(d - 1)[:, None]
        log_tail = jax.nn.logsumexp(u_rest.at[rows, cand_rest].set(-jnp.inf), axis=-1)  # [D-1]
        lse = jnp.logaddexp(jax.nn.logsumexp(z, axis=-1), log_tail[:, None])
        rest = z - lse[..., None]
    return jnp.concatenate([t0, rest], axis=0)


# ----------------------------------------------------------------------------------------------------------
# tree builders


def _check_tables(tables: jax.Array, cand_tokens: jax.Array) -> tuple[int, int]:
    _check_ndim("tables", tables, 3, "D, C, C")
    _check_ndim("cand_tokens", cand_tokens, 2, "D, C")
    d, c, c2 = tables.shape
    if c != c2:
        raise ArgumentError(f"tables must have shape [D, C, C], got {tuple(tables.shape)}")
    if tuple(cand_tokens.shape) != (d, c):
        raise ArgumentError(
            f"cand_tokens must have shape {(d, c)} to match tables {tuple(tables.shape)}, "
            f"got {tuple(cand_tokens.shape)}"
        )
    return d, c


def _expand(
    tables: jax.Array, widths: tuple[int, ...] | jax.Array, k: int | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-depth beams: at depth ``d`` keep the best ``widths[d]`` extensions of the previous beam.

    "Best" is the tree order (score descending, candidate-index path ascending). Each beam is stored in
    lexicographic path order of its kept entries (empty ``-inf`` slots may sit in between, or at the end),
    so the flat index ``b * C + j`` of a child in the ``[K, C]`` matrix of extensions is increasing in its
    path; ``jax.lax.top_k`` prefers lower indices among equal values, so it breaks ties exactly by the
    path. One step per depth: a gather-add, a top-k and a sort of ``K`` keys carrying their scores. Returns
    per depth (stacked, ``K = max(widths)``): scores [D, K] (``-inf`` = empty slot), parent slot [D, K],
    candidate index [D, K]. Every level, empty slots included, is sorted by (parent slot, candidate); a
    slot emptied by a beam width has a parent slot ``>= K`` (so it sorts past every real parent).
    With ``k`` given, ``widths`` may be a traced int[D] (each ``<= k``): one compiled program serves every
    profile of at most ``k`` nodes per depth.
    """
    d, c, _ = tables.shape
    full = k is None and all(w == max(widths) for w in widths)  # best_first: every depth keeps K, no limit
    k = max(widths) if k is None else k
    t = jnp.minimum(jnp.asarray(tables, jnp.float32), 0.0)
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
        # back to lexicographic order; the scores ride along with the keys. An empty (-inf) entry may sit
        # between kept ones: it is never extended (its children are -inf too), and its outputs are masked.
        key, new_scores = jax.lax.sort((idx, top))
        # one output array per step: the scores' bits and the keys
        return (new_scores, key), jnp.stack([jax.lax.bitcast_convert_type(new_scores, jnp.int32), key])

    # Unrolled: the D steps stay sequential (3 kernels each: gather-add, top-k, sort), without the loop's own
    # per-step ops (counter, condition, output writes).
    _, out = jax.lax.scan(step, init, (t, jnp.asarray(widths, jnp.int32)), unroll=True)
    scores, key = jax.lax.bitcast_convert_type(out[:, 0], jnp.float32), out[:, 1]
    return scores, key // c, key % c


def _preorder(parent_slot: jax.Array) -> jax.Array:
    """Depth-first preorder rank of every beam entry in the trie of all entries, in closed form (no loop).

    Comparing preorder ranks is comparing candidate-index paths lexicographically (a prefix first), so the
    global merge needs one integer key instead of D. Every level is sorted by (parent slot, candidate),
    so the descendants at any deeper level of the first ``s`` entries of a level are a prefix of that
    level. For an entry ``x`` at level ``u``, slot ``s``, the entries before it are: at each shallower
    level ``t``, the slots up to its ancestor's (``slot + 1`` of each ancestor); at level ``u``, ``s``
    entries; at each deeper level ``t``, ``lo_t(s)`` entries, the descendants of the first ``s``. With
    ``F_t(r)`` = number of level-``t`` entries whose parent slot is below ``r``, ``lo_t = F_t o ... o
    F_{u+1}``. Both sums come from pointer doubling (``ceil(log2 D)`` vectorised steps each): over the flat
    parent pointers for the first, over the per-level tables ``F`` (composition and running sum) for the
    last. Empty slots are entries too (their ranks are never compared: they sort last by score); a
    parent slot ``>= K`` (beam slots past a depth's width) sorts past every real parent.
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
    node_of = jnp.zeros((n,), jnp.int32).at[sel].set(jnp.arange(1, m + 1, dtype=jnp.int32))
    parent_flat = jnp.maximum(level - 1, 0) * k + parent_slot.reshape(n)[sel]
    parents = jnp.where(level == 0, 0, node_of[parent_flat])
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
    """The ``budget`` most probable prefixes of depth ``1..D`` (DDTree's best-first heap, on device).

    A prefix's score is the sum of ``tables[d, parent_cand, cand]`` along its path (``T[0]`` row 0 for
    depth 1). The result is a per-depth beam of width ``budget`` followed by a global top-``budget``
    merge; this is exact because a child never outscores its parent, so a selected prefix's ancestors
    are selected and no depth holds more than ``budget`` selected prefixes. The first ``b`` nodes of the
    result are the best ``b`` prefixes for every ``b <= budget``.

    With :func:`ddtree_tables` of ``candidates(logits, top_c)`` and ``top_c >= min(budget, V)`` this is
    upstream DDTree's tree (same nodes, order and tie-break). With ``top_c`` smaller, children are
    restricted to the per-depth top-C candidates (the SparklingTree approximation).

    Args:
      tables: float32[D, C, C] log-prob tables (:func:`ddtree_tables` or :func:`markov_tables`).
      cand_tokens: int[D, C] the candidates the tables refer to.
      budget: number of nodes ``M`` (static), >= 1.

    Returns:
      A :class:`Tree` of ``M = budget`` nodes in the module's order (see the module docstring).
    """
    budget = _check_int("budget", budget, 1)
    d, _ = _check_tables(tables, cand_tokens)
    return _merge(_expand(tables, (budget,) * d), jnp.asarray(cand_tokens, jnp.int32), budget)


def layer_beam(tables: jax.Array, cand_tokens: jax.Array, k: int, nodes: int) -> Tree:
    """PCTree's tree (arXiv 2608.02123): a beam of ``k`` nodes per depth, then the global top ``nodes``.

    At depth ``d + 1`` every kept depth-``d`` node's children are scored from its row of the tables (its
    path score plus ``tables[d, parent_cand, :]``) and the ``k`` best of all those (parent, child) pairs are
    kept (ties: the lower candidate-index path). The tree is then the ``nodes`` best kept nodes of all depths
    by path score, ties to the shallower node, then to the lower path within its depth. It is prefix-closed:
    a child never outscores its parent and is deeper, so its parent ranks before it.

    Args:
      tables: float32[D, C, C] log-prob tables (:func:`markov_tables`; entries clipped to <= 0).
      cand_tokens: int[D, C] the candidates the tables refer to.
      k: static beam width per depth, >= 1.
      nodes: static number of nodes ``M`` (the root excluded), ``1 <= M <= k * D``.

    Returns:
      A :class:`Tree` of ``M`` nodes in that order (parents before children; padding at the end when fewer
      than ``M`` kept nodes exist).
    """
    d, _ = _check_tables(tables, cand_tokens)
    k = _check_int("k", k, 1)
    nodes = _check_int("nodes", nodes, 1)
    if nodes > k * d:
        raise ArgumentError(f"nodes must be <= k * D = {k * d} (the nodes the beam keeps), got {nodes}")
    return _merge(_expand(tables, (k,) * d), jnp.asarray(cand_tokens, jnp.int32), nodes, by_depth=True)


def even_widths(budget: int, depth: int) -> tuple[int, ...]:
    """An even beam profile: ``budget`` nodes over ``depth`` depths, the remainder to the shallowest.

    If ``budget < depth``, the first ``budget`` depths get one node each and the rest get 0.
    """
    budget = _check_int("budget", budget, 1)
    depth = _check_int("depth", depth, 1)
    q, r = divmod(budget, depth)
    return tuple(q + 1 if i < r else q for i in range(depth))


# Per-depth conditional acceptance rates of the DSpark greedy chain on the bundled demo pair as pre-trained (depth
# d accepted given depth d - 1 was; docs/benchmarks.md, "Tree options", has the run): the default profile of
# ``widths="auto"`` (see auto_widths).
DEMO_DEPTH_RATES: tuple[float, ...] = (
    0.54, 0.69, 0.79, 0.76, 0.81, 0.71, 0.96, 0.86, 0.88, 0.93, 0.76, 0.86, 0.93, 0.90, 0.97, 0.77,
)


# How a depth's miss rate falls with its width in auto_widths' model, ``miss(w) = miss(1) * w ** -exponent``: fitted on
# the demo pair (docs/benchmarks.md, "Tree options").
DEMO_WIDTH_EXPONENT = 0.6


def auto_widths(
    budget: int,
    depth: int,
    rates: tuple[float, ...] | None = None,
    top_c: int | None = None,
    exponent: float | None = None,
) -> tuple[int, ...]:
    """A beam profile that maximises the expected accepted length for ``budget`` nodes (marginal-gain allocation).

    Model: the kept ``w >= 1`` nodes of depth ``d + 1`` hold the target's token (given the depth above was
    accepted) with probability ``q_d(w) = 1 - (1 - r_d) * w ** -exponent``, where ``r_d`` is the conditional
    acceptance rate of a single node at that depth (``q_d(0) = 0``); the expected accepted length is
    ``sum_d prod_{i <= d} q_i(w_i)``.
    Nodes are added one at a time to the depth with the largest gain of that sum (the shallowest on a tie),
    never to a depth below an empty one and never past ``top_c ** (d + 1)`` nor ``top_c`` children per kept
    node of the depth above. The profile therefore sums to ``budget`` exactly and has no zero before a
    non-zero entry.

    Args:
      budget: nodes (static int >= 1); with ``top_c`` at most the reachable ``sum_k top_c ** k``.
      depth: depths D (static int >= 1).
      rates: per-depth rates in ``[0, 1]``; depth ``d`` uses ``rates[min(d, len(rates) - 1)]`` (longer
        profiles are cut, shorter ones repeat their last rate). Default :data:`DEMO_DEPTH_RATES`.
      top_c: candidates per depth, the per-depth cap (None: no cap).
      exponent: ``> 0``, how fast a depth's miss rate falls with its width (default :data:`DEMO_WIDTH_EXPONENT`).

    Returns:
      A tuple of D non-negative ints summing to ``budget``.
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
    """Static-budget beam: at depth ``d + 1`` keep the best ``widths[d]`` extensions of the kept depth-``d``
    prefixes (in the tree order: score descending, candidate-index path ascending).

    Args:
      tables: float32[D, C, C] log-prob tables.
      cand_tokens: int[D, C] the candidates the tables refer to.
      widths: static tuple of ``D`` non-negative ints with a positive sum; zeros may only appear at the
        end (nothing can hang below an empty depth). :func:`even_widths` gives a default profile.

    Returns:
      A :class:`Tree` of ``M = sum(widths)`` nodes, in the same format and order as :func:`best_first`
      (a depth with fewer than ``widths[d]`` available extensions leaves padding at the end).
    """
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


# ----------------------------------------------------------------------------------------------------------
# mask, positions, acceptance


def visibility(parents: jax.Array, max_depth: int | None = None) -> jax.Array:
    """Ancestor mask of a tree, root included: ``mask[q, a]`` is True iff node ``a`` is ``q`` or one of
    its ancestors (row = query node, column = key node; the root is row / column 0).

    Computed by pointer doubling: ``ceil(log2(max_depth + 1))`` steps of ``mask |= mask[jump]``,
    ``jump = jump[jump]`` over the whole ``[M + 1, M + 1]`` matrix; no loop over nodes.

    Args:
      parents: int[M] parent index (``0..M``) of node ``i + 1``, as in :attr:`Tree.parents`.
      max_depth: static bound on the tree depth (``D``); defaults to ``M``, which is always enough.

    Returns:
      bool[M + 1, M + 1].
    """
    _check_ndim("parents", parents, 1, "M")
    m = parents.shape[0]
    bound = m if max_depth is None else _check_int("max_depth", max_depth, 1)
    jump = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.asarray(parents, jnp.int32)])
    mask = jnp.eye(m + 1, dtype=bool)
    for _ in range(bound.bit_length()):  # after s steps: every ancestor at distance < 2**s
        mask = mask | mask[jump]
        jump = jump[jump]
    return mask


def tree_positions(depths: jax.Array, start: jax.Array | int) -> jax.Array:
    """Absolute positions of ``[root] + nodes``: ``start`` for the root, ``start + depth`` for node i+1.

    Returns int32[M + 1].
    """
    _check_ndim("depths", depths, 1, "M")
    d = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.asarray(depths, jnp.int32)])
    return jnp.asarray(start, jnp.int32) + d


def _check_accept_args(parents, tokens, posterior, max_depth) -> tuple[int, int]:
    _check_ndim("parents", parents, 1, "M")
    _check_ndim("tokens", tokens, 1, "M")
    _check_ndim("posterior", posterior, 1, "M + 1")
    m = parents.shape[0]
    if tokens.shape[0] != m or posterior.shape[0] != m + 1:
        raise ArgumentError(
            f"parents [M], tokens [M] and posterior [M + 1] disagree: shapes {tuple(parents.shape)}, "
            f"{tuple(tokens.shape)}, {tuple(posterior.shape)}"
        )
    steps = m if max_depth is None else _check_int("max_depth", max_depth, 1)
    return m, steps


def accept(
    parents: jax.Array,
    tokens: jax.Array,
    posterior: jax.Array,
    max_depth: int | None = None,
    *,
    mask: jax.Array | None = None,
) -> Accepted:
    """Walk a verified tree (upstream ``follow_verified_tree``), all depths at once.

    The walk starts at the root and, while ``posterior[current]`` equals the token of one of ``current``'s
    children, moves to that child (children have distinct tokens; if not, the lowest-index child wins),
    for at most ``max_depth`` steps. A chain is the tree ``parents = [0, 1, ..., M-1]``.

    No loop: a node is *good* if its token equals the posterior at its parent and no lower-index sibling
    has the same token; the walk reaches a node iff it and all its ancestors are good (read from the
    ancestor mask) and its depth is at most ``max_depth``. The reached nodes form the accepted path, one
    per depth. :func:`accept_walk` is the step-by-step walk, kept as the reference.

    Args:
      parents: int[M] parent of node ``i + 1`` (:attr:`Tree.parents`); parents precede their children.
      tokens: int[M] token of node ``i + 1`` (padding -1 never matches).
      posterior: int[M + 1] target token at each of ``[root] + nodes`` (argmax, or a sample).
      max_depth: static number of walk steps (the tree's depth ``D``); defaults to ``M``.
      mask: optional bool[M + 1, M + 1] ancestor mask of the tree (:func:`visibility`), e.g. the one the
        verify step already used; its rows must be complete for every node of depth ``<= max_depth``, which
        ``visibility(parents, max_depth)`` is when no node is deeper than ``max_depth`` (true for the
        builders' trees and chains of ``max_depth`` nodes). Computed here when None.

    Returns:
      :class:`Accepted` with indices padded to ``max_depth + 1``.
    """
    m, steps = _check_accept_args(parents, tokens, posterior, max_depth)
    parents = jnp.asarray(parents, jnp.int32)
    tokens = jnp.asarray(tokens, jnp.int32)
    posterior = jnp.asarray(posterior, jnp.int32)
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


def accept_walk(
    parents: jax.Array, tokens: jax.Array, posterior: jax.Array, max_depth: int | None = None
) -> Accepted:
    """The step-by-step walk of :func:`accept` (one ``fori_loop`` step per depth); the reference it equals."""
    m, steps = _check_accept_args(parents, tokens, posterior, max_depth)
    parents = jnp.asarray(parents, jnp.int32)
    tokens = jnp.asarray(tokens, jnp.int32)
    posterior = jnp.asarray(posterior, jnp.int32)

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


# ----------------------------------------------------------------------------------------------------------
# convenience pipelines


def build_ddtree(logits: jax.Array, budget: int) -> Tree:
    """Upstream DDTree on device: top-``min(budget, V)`` per depth, independent marginals, best-first."""
    budget = _check_int("budget", budget, 1)
    cand_tokens, cand_logp = candidates(logits, budget)
    return best_first(ddtree_tables(cand_logp), cand_tokens, budget)


def build_sparkling_tree(
    base_logits: jax.Array,
    x_start: jax.Array | int,
    w1: jax.Array,
    w2: jax.Array,
    *,
    budget: int,
    top_c: int,
    normalization: Normalization = "fast",
    widths: tuple[int, ...] | None = None,
) -> Tree:
    """SparklingTree with a vanilla Markov head: candidates, Markov tables, then best-first
    (``widths=None``) or :func:`beam` with the given width profile (which must sum to ``budget``)."""
    budget = _check_int("budget", budget, 1)
    if widths is not None and sum(widths) != budget:
        raise ArgumentError(f"widths must sum to budget={budget}, got {widths!r} (sum {sum(widths)})")
    cand_tokens, _ = candidates(base_logits, top_c)
    feats = vanilla_parent_feats(w1, x_start, cand_tokens)
    tables = markov_tables(base_logits, cand_tokens, feats, w2, normalization)
    if widths is None:
        return best_first(tables, cand_tokens, budget)
    return beam(tables, cand_tokens, widths)
