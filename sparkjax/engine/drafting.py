"""The draft stage: DSpark / DFlash drafting as pure, batch-first functions with static shapes (lengths,
starts and counts are traced), taking the drafter module (and, for DFlash, the target) and plain arrays.

Alignment: a round drafts from ``start``, the index of the last committed token ``x_start``; the block
input is ``[x_start, MASK x (G - 1)]`` at positions ``start .. start + G - 1``. DSpark slot ``i`` predicts
``start + i + 1`` (``G`` drafts, depth ``d`` reads slot ``d - 1``); DFlash slot ``i`` predicts ``start + i``
(slot 0 unused, ``G - 1`` drafts, depth ``d`` reads slot ``d``): :func:`aligned_logits`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..cache import ContextCache
from ..errors import ArgumentError
from ..nn.drafter import Drafter
from ..nn.layers import CacheMask
from ..sampling import first_argmax, gumbel, per_row, pick, split_keys
from ..tree import top_k

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftBlock:
    """``logits`` base logits ``[B, G, V]`` (float32), ``hidden`` block hidden states ``[B, G, D]``,
    ``layers`` each layer's (pre-norm) output ``[L, B, G, D]`` when asked for, else None; ``ctx`` the
    context cache with the block's rows in its scratch (``draft_block(in_cache=True)``), else None."""

    logits: Array
    hidden: Array
    layers: Array | None = None
    ctx: ContextCache | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftChain:
    """Drafted ``tokens`` ``[B, n]`` (token j at ``start + j + 1``; DSpark ``n = G``, DFlash ``G - 1``) and
    the ``logits`` ``[B, n, V]`` (float32) whose ``softmax(. / T)`` they were drawn from."""

    tokens: Array
    logits: Array


def features_from_hidden(hidden: Sequence[Array]) -> Array:
    """``target(..., hidden_layers=drafter.config.target_layer_ids).hidden`` concatenated into ``[B, T, F]``."""
    return jnp.concatenate(list(hidden), axis=-1)


def append_context(drafter: Drafter, ctx: ContextCache, features: Array, count: Array) -> ContextCache:
    """Adds newly committed positions to the drafter's context: ``features`` ``[B, A, F]`` of positions
    ``ctx.lengths[b] + j`` are written at those slots; ``lengths`` advances by ``count`` (``[B]`` or a scalar,
    ``<= A``) and rows past it stay invisible scratch."""
    if features.ndim != 3 or features.shape[-1] != drafter.config.feature_size:
        raise ArgumentError(f"features: expected [B, A, {drafter.config.feature_size}] "
                            f"({len(drafter.config.target_layer_ids)} target layers x hidden "
                            f"{drafter.config.hidden_size}), got {tuple(features.shape)}")
    a = features.shape[1]
    positions = ctx.lengths[:, None] + jnp.arange(a, dtype=jnp.int32)[None, :]
    k, v = drafter.context_kv(features, positions)
    return ctx.append(k, v, count)


def block_tokens(drafter: Drafter, x_start: Array) -> Array:
    """The block input ``[x_start, MASK x (G - 1)]`` ``[B, G]``."""
    c = drafter.config
    x_start = jnp.asarray(x_start, jnp.int32)
    masks = jnp.full((x_start.shape[0], c.block_size - 1), c.mask_token_id, jnp.int32)
    return jnp.concatenate([x_start[:, None], masks], axis=1)


def draft_block(drafter: Drafter, ctx: ContextCache, x_start: Array, start: Array, target=None, *,
                return_layers: bool = False, attention="auto", in_cache: bool = False) -> DraftBlock:
    """Runs one block ``[x_start, MASK x (G - 1)]`` at positions ``start .. start + G - 1``; each query sees
    context slots ``< ctx.lengths`` (== ``start``) and the whole block. ``target``: required for DFlash drafters
    (embedding and LM head). ``in_cache``: the block's keys/values are written into the context's ``G`` scratch
    slots past every length and attended there (one attention part), the cache coming back as ``ctx`` with its
    committed slots unchanged; otherwise the context is not written."""
    c = drafter.config
    g = c.block_size
    start = jnp.broadcast_to(jnp.asarray(start, jnp.int32), (x_start.shape[0],))
    tokens = block_tokens(drafter, x_start)
    positions = start[:, None] + jnp.arange(g, dtype=jnp.int32)[None, :]
    x = drafter.embed(tokens, target)
    block_mask = np.ones((1, g, g), bool)  # on the host: the attention knows the whole block is visible
    ctx_mask = CacheMask(ctx.lengths, block_mask) if in_cache else CacheMask(ctx.lengths)
    out = drafter.run_block(x, positions, ctx.k, ctx.v, ctx_mask, block_mask, return_layers=return_layers,
                            attention=attention)
    new_ctx = ContextCache(out.ctx_k, out.ctx_v, ctx.lengths) if in_cache else None
    return DraftBlock(drafter.logits(out.hidden, target), out.hidden, out.layers, new_ctx)


def aligned_logits(drafter: Drafter, base_logits: Array) -> Array:
    """Per-depth logits ``[B, n, V]``: depth ``d = 1..n`` predicts the token at ``start + d``."""
    return base_logits[:, drafter.config.first_draft_slot :]


def _static_greedy(temperature, key, what: str) -> bool:
    if isinstance(temperature, int | float):
        if temperature < 0:
            raise ArgumentError(f"{what}: temperature must be >= 0, got {temperature}")
        if temperature == 0:
            return True
    if key is None:
        raise ArgumentError(f"{what}: a PRNG key is required when temperature may be > 0")
    return False


def argmax_chain(drafter: Drafter, base_logits: Array) -> DraftChain:
    """The chain of per-depth argmaxes of the base logits (no Markov correction)."""
    logits = aligned_logits(drafter, base_logits).astype(jnp.float32)
    return DraftChain(first_argmax(logits, axis=-1), logits)


def sample_chain(drafter: Drafter, base_logits: Array, temperature, key: Array | None = None) -> DraftChain:
    """Like :func:`argmax_chain`, but each position is drawn independently from ``softmax(logits / T)``."""
    if _static_greedy(temperature, key, "sample_chain"):
        return argmax_chain(drafter, base_logits)
    logits = aligned_logits(drafter, base_logits).astype(jnp.float32)
    keys = split_keys(key, logits.shape[1])
    tokens = jax.vmap(lambda lg, k: pick(lg, temperature, k), in_axes=(1, 0), out_axes=1)(logits, keys)
    return DraftChain(tokens, logits)


def _require_markov(drafter: Drafter, what: str):
    if drafter.markov_head is None:
        raise ArgumentError(f"{what}: the drafter has no Markov head (markov_rank is 0 or it is a DFlash drafter)")


def markov_w2(drafter: Drafter) -> Array:
    """The Markov output matrix ``W2`` ``[V, R]`` (torch layout: ``bias = W2 @ f``)."""
    _require_markov(drafter, "markov_w2")
    return drafter.markov_head.markov_w2.weight[...]


def markov_features(drafter: Drafter, block_hidden: Array, prev_tokens: Array) -> Array:
    """Rank-R parent features ``f(prev)`` ``[B, G, C, R]`` for prev ids ``[B, G, C]`` (slot g's possible
    previous tokens): vanilla ``W1[prev]``, gated ``W1[prev] * sigmoid(gate_proj([h_g ; W1[prev]]))``. The
    Markov bias of a candidate is ``f @ markov_w2(drafter).T`` (float32)."""
    _require_markov(drafter, "markov_features")
    return drafter.markov_head.features(block_hidden, prev_tokens)


def markov_bias(drafter: Drafter, block_hidden: Array, prev_tokens: Array) -> Array:
    """Teacher-forced Markov bias ``[B, G, V]`` (float32) for one prev id per slot ``[B, G]``."""
    return drafter.markov_head.bias(markov_features(drafter, block_hidden, prev_tokens[..., None])[..., 0, :])


CHAIN_MODES = ("auto", "fixed_point", "scan")


def chain_mode(mode: str = "auto") -> str:
    """The chain formulation ``mode`` resolves to: ``auto`` is ``scan`` on the CPU backend, ``fixed_point``
    elsewhere (GPU / TPU, where the chain's cost is reading ``W2``)."""
    if mode not in CHAIN_MODES:
        raise ArgumentError(f"mode: expected one of {CHAIN_MODES}, got {mode!r}")
    if mode == "auto":
        return "scan" if jax.default_backend() == "cpu" else "fixed_point"
    return mode


def markov_chain(drafter: Drafter, base_logits: Array, block_hidden: Array, x_start: Array, temperature=0.0,
                 key: Array | None = None, *, mode: str = "auto") -> DraftChain:
    """DSpark's left-to-right Markov-corrected chain: ``G`` tokens and the corrected logits they were chosen
    from. Slot g's logits are ``base[g] + W2 . f(prev_g)`` (``prev_0 = x_start``, ``prev_g`` the token chosen at
    slot g - 1); the token is the first-max argmax at T = 0, else a draw from ``softmax(logits / T)`` with key
    ``split(key, G)[g]`` (a traced ``temperature`` needs ``key``). ``mode`` (static, same tokens): ``"scan"``,
    ``"fixed_point"`` (:func:`markov_chain_fixed_point`) or ``"auto"`` (:func:`chain_mode`)."""
    if chain_mode(mode) == "fixed_point":
        return markov_chain_fixed_point(drafter, base_logits, block_hidden, x_start, temperature, key)[0]
    if drafter.config.kind != "dspark":
        raise ArgumentError("markov_chain: DFlash drafters have no Markov head; use argmax_chain / sample_chain")
    greedy = _static_greedy(temperature, key, "markov_chain")
    base = base_logits.astype(jnp.float32)
    g = base.shape[1]
    keys = split_keys(key, g) if not greedy else jnp.zeros((g,), jnp.uint32)
    head = drafter.markov_head

    def step(prev, inp):
        logits, h, k = inp
        if head is not None:
            logits = logits + head.bias(head.features(h, prev[:, None])[:, 0])
        tok = pick(logits, temperature, None if greedy else k)
        return tok, (tok, logits)

    x0 = jnp.asarray(x_start, jnp.int32)
    _, (tokens, logits) = jax.lax.scan(step, x0, (jnp.swapaxes(base, 0, 1), jnp.swapaxes(block_hidden, 0, 1), keys))
    return DraftChain(jnp.swapaxes(tokens, 0, 1), jnp.swapaxes(logits, 0, 1))


CHAIN_CANDIDATES = 32  # markov_chain_fixed_point's default candidates per slot


def markov_chain_fixed_point(drafter: Drafter, base_logits: Array, block_hidden: Array, x_start: Array,
                             temperature=0.0, key: Array | None = None, *, candidates: int = CHAIN_CANDIDATES,
                             max_passes: int | None = None) -> tuple[DraftChain, Array]:
    """The chain of :func:`markov_chain` by guess-and-verify passes over ``W2`` (docs/design.md), and the number
    of passes (int32, ``1 <= passes <= G``; 0 without a Markov head): the sequential chain's tokens within G
    passes (the logits may differ from the scan's in the last bit). ``candidates = C > 0``: guesses past the
    frontier walk a chain restricted to each slot's C best base tokens; ``C = 0``: plain Jacobi.
    ``max_passes = n`` (static): exactly ``min(n, G)`` unrolled passes, the tokens exact only where they reached.
    """
    if drafter.config.kind != "dspark":
        raise ArgumentError("markov_chain: DFlash drafters have no Markov head; use argmax_chain / sample_chain")
    if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 0:
        raise ArgumentError(f"candidates: expected an int >= 0 (0 = plain Jacobi), got {candidates!r}")
    if max_passes is not None and (isinstance(max_passes, bool) or not isinstance(max_passes, int) or max_passes < 1):
        raise ArgumentError(f"max_passes: expected None or an int >= 1, got {max_passes!r}")
    greedy = _static_greedy(temperature, key, "markov_chain")
    base = base_logits.astype(jnp.float32)
    b, g, v = base.shape
    head = drafter.markov_head
    x0 = jnp.asarray(x_start, jnp.int32)

    if greedy:
        noise = None
        scale = jnp.float32(1.0)

        def choose(logits):
            return first_argmax(logits, axis=-1)

    else:
        keys = split_keys(key, g)
        t = per_row(temperature, 3)  # [B, 1, 1] per sequence (or a scalar)
        scale = jnp.where(t > 0, t, 1.0)
        # slot g's Gumbel noise: exactly what pick(logits[:, g], T, keys[g]) draws (same key, same shape)
        noise = jax.vmap(lambda k: gumbel(k, (b, v), jnp.float32), out_axes=1)(keys)

        def choose(logits):  # == pick(logits[:, g], T, keys[g]) for every slot g
            hot = t[..., 0] > 0 if t.ndim else t > 0
            return jnp.where(hot, first_argmax(noise + logits / scale, axis=-1), first_argmax(logits, axis=-1))

    if head is None:
        return DraftChain(choose(base), base), jnp.zeros((), jnp.int32)

    def after(tokens):  # the prev ids the choices imply: [x0, tokens[:, :-1]]
        return jnp.concatenate([x0[:, None], tokens[:, :-1]], axis=1)

    def corrected(prev):  # [B, G] -> [B, G, V]: one pass over W2 for all G slots
        return base + head.bias(head.features(block_hidden, prev[..., None])[..., 0, :])

    slot = jnp.arange(g, dtype=jnp.int32)
    k = min(candidates, v)
    if k:
        # candidates: each slot's k best tokens on its (noisy) base logits, and the exact Markov scores
        # between the candidates of slot g - 1 (as prev) and those of slot g (as next), built once
        rank = base / scale if noise is None else jnp.where(t > 0, noise + base / scale, base)
        cand = top_k(rank, k)[1].astype(jnp.int32)  # [B, G, k] (two-stage on accelerators)
        cand_rank = jnp.take_along_axis(rank, cand, axis=-1)  # [B, G, k]
        w2_cand = jnp.take(head.markov_w2.weight[...], cand, axis=0)  # [B, G, k, R]
        prev_cand = jnp.concatenate([jnp.broadcast_to(x0[:, None, None], (b, 1, k)), cand[:, :-1]], axis=1)
        f_cand = head.features(block_hidden, prev_cand)  # [B, G, k, R]: slot g's prev among slot g-1's candidates
        scores = cand_rank[:, :, None, :] + jnp.einsum(
            "bgpr,bgnr->bgpn", f_cand, w2_cand, preferred_element_type=jnp.float32) / scale  # [B, G, k, k]

        def guess(prev, frontier):
            """Prev ids: the known ones up to each sequence's frontier, then the restricted chain's walk."""
            f_known = head.features(block_hidden, prev[..., None])  # [B, G, 1, R]
            known = cand_rank[:, :, None, :] + jnp.einsum(
                "bgpr,bgnr->bgpn", f_known, w2_cand, preferred_element_type=jnp.float32) / scale
            step = first_argmax(jnp.concatenate([scores, known], axis=2), axis=-1)  # [B, G, k + 1] -> next idx
            # before the frontier every input maps to the "known prev" entry k; composing the maps left to
            # right gives each slot's chosen candidate index when starting from the frontier's known prev
            step = jnp.where((slot < frontier[:, None])[..., None], k, step)

            def compose(first, then):
                return jnp.take_along_axis(then, first, axis=-1)

            walk = jax.lax.associative_scan(compose, step, axis=1)[..., k]  # [B, G] candidate index per slot
            picked = jnp.take_along_axis(cand, walk[..., None], axis=-1, mode="clip")[..., 0]
            return jnp.where(slot[None] <= frontier[:, None], prev, after(picked))

    else:

        def guess(prev, frontier):
            return prev

    def cond(state):
        _, _, _, passes, done = state
        return jnp.logical_and(jnp.logical_not(done), passes < g)

    def body(state):
        prev, _, _, passes, _ = state
        logits = corrected(prev)
        tokens = choose(logits)
        nxt = after(tokens)
        wrong = nxt != prev
        frontier = jnp.where(jnp.any(wrong, axis=1), first_argmax(wrong, axis=-1), g)
        return guess(nxt, frontier), tokens, logits, passes + 1, jnp.all(~wrong)

    if k:
        first_prev = guess(jnp.broadcast_to(x0[:, None], (b, g)), jnp.zeros((b,), jnp.int32))
    else:
        first_prev = after(choose(base))
    init = (first_prev, jnp.zeros((b, g), jnp.int32), jnp.zeros_like(base), jnp.zeros((), jnp.int32),
            jnp.zeros((), bool))
    if max_passes is not None:
        state = init
        for _ in range(min(max_passes, g)):
            state = body(state)
        _, tokens, logits, passes, _ = state
        return DraftChain(tokens, logits), passes
    _, tokens, logits, passes, _ = jax.lax.while_loop(cond, body, init)
    return DraftChain(tokens, logits), passes


def candidate_chain_logits(drafter: Drafter, base_logits: Array, block_hidden: Array, x_start: Array, *,
                           max_passes: int | None = 1, mode: str = "auto") -> Array:
    """Each slot's logits ``[B, G, V]`` corrected for the greedy DSpark chain's token before it (what the
    ``"corrected"`` / ``"union"`` candidates rank): the scan chain's, or ``max_passes`` fixed-point passes'."""
    if chain_mode(mode) == "scan":
        return markov_chain(drafter, base_logits, block_hidden, x_start, mode="scan").logits
    return markov_chain_fixed_point(drafter, base_logits, block_hidden, x_start, max_passes=max_passes)[0].logits


def chain_prev(x_start: Array, tokens: Array) -> Array:
    """Markov / confidence prev ids of a DSpark chain: ``[x_start, tokens[:, :-1]]`` ``[B, G]``."""
    return jnp.concatenate([jnp.asarray(x_start, tokens.dtype)[:, None], tokens[:, :-1]], axis=1)


def confidence(drafter: Drafter, block_hidden: Array, prev_tokens: Array) -> Array:
    """Confidence logits ``[B, G]`` (float32; read through a sigmoid) for a chain; ``prev_tokens`` ``[B, G]``
    (:func:`chain_prev`) are read only when the head takes the Markov input ``[h ; W1[prev]]``."""
    if drafter.confidence_head is None:
        raise ArgumentError("confidence: the drafter has no confidence head (enable_confidence_head is false)")
    h = block_hidden
    if drafter.config.confidence_head_with_markov:
        e = drafter.markov_head.prev_embeddings(prev_tokens).astype(h.dtype)
        h = jnp.concatenate([h, e], axis=-1)
    return drafter.confidence_head(h)
