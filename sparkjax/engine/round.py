"""The stages of a round: draft -> propose (the chain or tree) -> verify -> accept -> commit, one function each
(``ar``'s round drafts nothing, proposes no node and verifies the root alone: the plain one-token step).

A stage is a pure function ``(target, drafter, *args, plan=plan)`` of the models and the dataclasses of
:mod:`sparkjax.engine.state`, run under :func:`jax.named_scope` of its name; it reaches the method only
through ``plan.method``. :func:`run_stages` is the generic round, each stage run through a ``call``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from .. import sampling, tree
from . import drafting
from . import logprobs as lps
from .state import Acceptance, Plan, Proposal, SpecState, Verified

Array = jax.Array

# The stage names (timings, tables, profile scopes); "commit" times accept + commit.
DRAFT, PROPOSE, VERIFY, COMMIT = STAGES = ("draft", "propose", "verify", "commit")


def stage(name: str):
    """Marks a function as the round's stage ``name``: it runs under ``jax.named_scope(name)``."""

    def wrap(fn):
        @functools.wraps(fn)
        def scoped(*args, **kwargs):
            with jax.named_scope(name):
                return fn(*args, **kwargs)

        scoped.stage = name
        return scoped

    return wrap


def hits_eos(tokens: Array, eos: Array) -> Array:
    """Whether each token is an EOS id: ``eos`` is ``[E]`` (every sequence's) or ``[B, E]`` (per sequence, for
    ``tokens`` ``[B, ...]``); ``-1`` entries never match."""
    eos = jnp.asarray(eos)
    if eos.ndim < 2:
        return jnp.isin(tokens, eos)
    rows = eos.reshape(eos.shape[:1] + (1,) * (tokens.ndim - 1) + eos.shape[-1:])
    return jnp.any(tokens[..., None] == rows, axis=-1)


def flag_nonfinite(flags: Array, logits: Array, active: Array, round_index: Array) -> Array:
    """Records, per ``active`` sequence, the first round whose target logits ``[B, ..., V]`` hold a NaN or an
    Inf (``flags`` ``[B]`` int32 is -1 while every logit so far was finite)."""
    finite = jnp.isfinite(logits).reshape(logits.shape[0], -1).all(axis=1)
    return jnp.where((flags < 0) & active & ~finite, round_index, flags)


@stage(DRAFT)
def draft(target, drafter, state: SpecState, *, plan: Plan) -> drafting.DraftBlock:
    """The drafter's block from ``x_start`` at the committed length (every stage takes ``plan``), its rows
    attended in the context's scratch (the block comes with that context, see :func:`with_draft_context`)."""
    return drafting.draft_block(drafter, state.ctx, state.x_start, state.cache.lengths, target,
                                attention=plan.options.attend, in_cache=True)


def with_draft_context(state: SpecState, blk: drafting.DraftBlock) -> tuple[SpecState, drafting.DraftBlock]:
    """The state carrying the draft's context (the block's rows sit in its scratch slots, which the commit
    overwrites: the buffers are updated in place, never copied) and the block without it."""
    return dataclasses.replace(state, ctx=blk.ctx), dataclasses.replace(blk, ctx=None)


@stage(PROPOSE)
def propose(target, drafter, state: SpecState, blk: drafting.DraftBlock, key, *, plan: Plan) -> Proposal:
    """Turns the drafter's block into the method's chain or tree of ``plan.nodes`` nodes, on device."""
    return plan.method.propose(drafter, state.x_start, blk, plan, state.request.sampling, key)


@stage(VERIFY)
def verify(target, drafter, state: SpecState, prop: Proposal, *, plan: Plan) -> Verified:
    """The target over ``[x_start] + nodes`` at ``start + depth`` with the tree mask (no nodes: the plain
    one-token step of ``ar``)."""
    start = state.cache.lengths
    tokens = jnp.concatenate([state.x_start[:, None], jnp.maximum(prop.tokens, 0)], axis=1)
    zero = jnp.zeros((prop.depths.shape[0], 1), prop.depths.dtype)
    positions = start[:, None] + jnp.concatenate([zero, prop.depths], axis=1)
    out = target(tokens, positions, cache=state.cache, mask=prop.mask, hidden_layers=plan.layer_ids,
                 attention=plan.options.attend)
    feats = jnp.concatenate(out.hidden, axis=-1) if out.hidden else None  # None: the plan reads no layer
    return Verified(out.logits.astype(jnp.float32), feats, out.cache, tokens)


def walk(prop: Proposal, ver: Verified, temperature, key, *, plan: Plan) -> Acceptance:
    """The tree walk over the target's posterior (its argmax, or a sample at temperature > 0, which is
    lossless for any tree): the accepted path of every tree method."""
    d = plan.depth
    post = sampling.posterior(ver.logits, temperature, key if plan.sampling else None)
    # all depths at once, reusing the verify step's ancestor mask (complete: no node is deeper than D)
    acc = jax.vmap(lambda p, t, q, m: tree.accept(p, t, q, d, mask=m))(prop.parents, prop.tokens, post, prop.mask)
    return Acceptance(acc.indices, acc.length, acc.bonus)


def commit(drafter, state: SpecState, ver: Verified, acc: Acceptance, *, plan: Plan) -> SpecState:
    """Writes the accepted tokens, compacts the target cache and extends the drafter context, each sequence
    within its own request (``state.request``: max_new, EOS ids). With ``plan.logprobs`` set, also each written
    token's log-probabilities (token j of the path is scored on the verify row of path node j, its parent, under
    the sequence's sampling parameters)."""
    d = plan.depth
    max_new, eos, temperature = state.request.max_new, state.request.eos, state.request.sampling
    start = state.cache.lengths
    length, bonus = acc.length, acc.bonus
    idx = jnp.maximum(acc.indices, 0)
    j = jnp.arange(d + 1, dtype=jnp.int32)[None]
    active = ~state.done
    if d == 0:  # one token, the bonus: every running sequence keeps it (running means n < max_new)
        emitted = bonus[:, None]
        keep = active.astype(jnp.int32)
        stop = hits_eos(bonus, eos)
    else:
        path = jnp.take_along_axis(ver.tokens, idx, axis=1)  # [B, D+1]: root, accepted drafts, padding
        emitted = jnp.where(j < length[:, None] - 1, jnp.roll(path, -1, axis=1), bonus[:, None])
        hit_eos = hits_eos(emitted, eos) & (j < length[:, None])
        first_eos = jnp.where(jnp.any(hit_eos, axis=1), jnp.argmax(hit_eos, axis=1), d + 1)
        keep = jnp.minimum(jnp.minimum(length, first_eos + 1), max_new - state.n)
        keep = jnp.where(active, keep, 0)
        stop = first_eos < length
    cols = jnp.where(j < keep[:, None], state.n[:, None] + j, state.out.shape[1])
    # per-sequence writes vmapped over the batch (a batching dimension XLA keeps local to each data shard)
    out = jax.vmap(lambda o, c, e: o.at[c].set(e, mode="drop"))(state.out, cols, emitted)
    lp = state.logprobs
    if lp is not None:
        lp = lps.record(lp, jnp.take_along_axis(ver.logits, idx[..., None], axis=1), emitted, cols, temperature)
    n = state.n + keep
    done = state.done | (active & (stop | (n >= max_new)))
    count = jnp.where(active, length, 0)
    # a one-token step wrote its row in place: nothing to compact
    cache = ver.cache.compact(start, idx, count) if plan.nodes else ver.cache.with_lengths(start + count)
    ctx = state.ctx
    if ctx is not None:  # the generation fills the drafter's context (not ar's, nor an auto burst's inner steps)
        acc_feats = jnp.take_along_axis(ver.features, idx[..., None], axis=1)
        ctx = drafting.append_context(drafter, ctx, acc_feats, count)
    # the round's counts are what it committed (``keep``, not the path's ``length``): a path cut at EOS or at
    # max_new counts no token past the cut (nor the bonus), so 1 (the prefill's token) + sum(accept_lens) == n;
    # depth_hits follow the count (depth k is reached when the round committed more than k tokens). ar keeps no
    # per-round buffer (zero width: every round commits one token)
    accept_lens = state.accept_lens
    if accept_lens.shape[1]:
        r = jnp.where(active, state.rounds, accept_lens.shape[1])
        accept_lens = jax.vmap(lambda a, i, x: a.at[i].set(x, mode="drop"))(accept_lens, r, keep)
    hits = (jnp.arange(state.depth_hits.shape[1])[None] < (keep - 1)[:, None]) & active[:, None]
    rounds = state.rounds + active.astype(jnp.int32)  # a running sequence's round index, 1-based, as flagged
    return SpecState(
        cache=cache, ctx=ctx, x_start=jnp.where(active, bonus, state.x_start), out=out, n=n, done=done,
        key=state.key, accept_lens=accept_lens, rounds=rounds, depth_hits=state.depth_hits + hits.astype(jnp.int32),
        nonfinite=flag_nonfinite(state.nonfinite, ver.logits, active, rounds), request=state.request,
        extra=state.extra, logprobs=lp,
    )


@stage(COMMIT)
def accept_and_commit(target, drafter, state: SpecState, prop: Proposal, ver: Verified, key, *,
                      plan: Plan) -> SpecState:
    """The round's last stage: the method's :meth:`~sparkjax.engine.methods.Method.accept` picks a path,
    then :func:`commit` writes it."""
    acc = plan.method.accept(prop, ver, state.request.sampling, key, plan=plan)
    return commit(drafter, state, ver, acc, plan=plan)


Call = Callable[..., object]


def round_keys(state: SpecState, plan: Plan) -> tuple[SpecState, Array | None, Array | None]:
    """``(state, propose key, accept key)`` of a round: none split on the greedy path (the state's key stays as
    it was); a sampled round splits the state's key in three (two for a round that drafts nothing)."""
    if not plan.sampling:
        return state, None, None
    keys = sampling.split_keys(state.key, 3 if plan.drafts else 2)
    return dataclasses.replace(state, key=keys[0]), keys[1] if plan.drafts else None, keys[-1]


def run_stages(target, drafter, state: SpecState, plan: Plan, call: Call | None = None) -> SpecState:
    """The generic round: draft (unless the plan drafts nothing), propose (``plan.method.propose``), verify, accept
    (``plan.method.accept``) and commit. ``call(stage_fn, *args, plan=plan)`` runs each stage (default:
    directly, with ``target, drafter`` first; a mesh run and the instrumented mode pass their own)."""
    if call is None:
        def call(fn, *args, **kwargs):
            return fn(target, drafter, *args, **kwargs)

    state, k_propose, k_accept = round_keys(state, plan)
    blk = None
    if plan.drafts:
        state, blk = with_draft_context(state, call(draft, state, plan=plan))
    prop = call(propose, state, blk, k_propose, plan=plan)
    ver = call(verify, state, prop, plan=plan)
    return call(accept_and_commit, state, prop, ver, k_accept, plan=plan)
