"""The slot pool's jitted programs: a fixed batch of N sequences on device that requests enter and leave.

The pool is a :class:`~sparkjax.engine.state.SpecState` of batch N (for ``ar`` without a drafter context:
:func:`ar_round`). A free slot is a finished sequence (``done``): every round masks it, so it grows nothing
and commits nothing. Each program compiles once per shape, the pool donated: :func:`pool_init` (every slot
free), :func:`pool_admit` (one prompt's prefill written into slot ``i``) and :func:`pool_visit` (up to
``rounds`` rounds of the slots ``rows``, gathered by :func:`take_rows` and put back by :func:`put_rows`, in a
``while_loop`` that ends once a running sequence finishes; one program per number of rows). Per-slot values
(``max_new`` ``[N]``, ``eos`` ``[N, E]``, ``temperature`` ``[N]`` or a :class:`~sparkjax.sampling.Sampling` of
``[N]`` arrays: temperature, top-p, top-k) are traced inputs.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..cache import ContextCache, KVCache
from ..engine import logprobs as lps
from ..engine.adaptive import AutoState
from ..engine.programs import merge_pair, prefill, program, spec_prefill
from ..engine.round import flag_nonfinite, hits_eos
from ..engine.state import Plan, SpecState
from ..sampling import pick, split_keys

Array = jax.Array


class Visit(NamedTuple):
    """What a host visit copies back: ``tokens`` ``[N, W]`` (slot b's tokens ``seen[b] .. seen[b] + W``; past
    ``n`` is padding), ``n0`` / ``n`` ``[N]`` its token counts before and after the rounds, ``done`` ``[N]``,
    ``rounds`` ``[N]`` rounds each slot ran, ``choices`` ``[N, K]`` how many of them verified each of the
    method's ``labels()`` (``K = 0`` without labels), ``nonfinite`` ``[N]`` and ``hits`` ``[N, D]`` how many of
    the rounds accepted a draft at depth d + 1 (position d: vLLM's accepted tokens per position)."""

    tokens: Array
    n0: Array
    n: Array
    done: Array
    rounds: Array
    choices: Array
    nonfinite: Array
    hits: Array
    logprobs: lps.Logprobs | None = None  # the window's log-probabilities (a pool with logprobs), else None


def _put(pool: Array, row: Array, slot: Array, axis: int = 0) -> Array:
    return jax.lax.dynamic_update_slice_in_dim(pool, row.astype(pool.dtype), slot, axis=axis)


def _put_kv(pool: KVCache | ContextCache | None, row, slot: Array):
    """A KV or context cache with sequence ``slot``'s rows (every layer's) and length replaced by ``row``'s."""
    if pool is None:
        return None
    k = tuple(_put(p, r, slot) for p, r in zip(pool.k, row.k, strict=True))
    v = tuple(_put(p, r, slot) for p, r in zip(pool.v, row.v, strict=True))
    return type(pool)(k, v, _put(pool.lengths, row.lengths, slot))


_PER_ROW = ("x_start", "out", "n", "done", "accept_lens", "rounds", "depth_hits", "nonfinite")
_ROWS = ("cache", "ctx", "key", "logprobs", *_PER_ROW)


def write_slot(pool: SpecState, row: SpecState, slot: Array, plan: Plan | None) -> SpecState:
    """``pool`` with sequence ``slot`` replaced by the batch-1 state ``row`` (its key too, with a key per slot; a
    single key stays the pool's); the method's carried state is merged by its
    :meth:`~sparkjax.engine.methods.Method.admit_state`."""
    per_row = {f: _put(getattr(pool, f), getattr(row, f), slot) for f in _PER_ROW}
    per_row["logprobs"] = jax.tree.map(lambda p, r: _put(p, r, slot), pool.logprobs, row.logprobs)
    key = pool.key if pool.key.ndim == 0 else _put(pool.key, row.key.reshape(1), slot)
    extra = pool.extra if plan is None else plan.method.admit_state(plan, pool.extra, row.extra, slot)
    return dataclasses.replace(pool, cache=_put_kv(pool.cache, row.cache, slot),
                               ctx=_put_kv(pool.ctx, row.ctx, slot), key=key, extra=extra, **per_row)


def take_rows(pool: SpecState, rows: Array, plan: Plan | None) -> SpecState:
    """The sequences ``rows`` ``[A]`` (distinct slots) of ``pool`` as a batch of A; the method's carried state
    by its :meth:`~sparkjax.engine.methods.Method.take_rows`."""
    sub = {f: jax.tree.map(lambda x: x[rows], getattr(pool, f)) for f in _ROWS}
    extra = pool.extra if plan is None else plan.method.take_rows(plan, pool.extra, rows)
    return dataclasses.replace(pool, extra=extra, **sub)


def put_rows(pool: SpecState, sub: SpecState, rows: Array, plan: Plan | None) -> SpecState:
    """``pool`` with its sequences ``rows`` replaced by the batch ``sub`` (:func:`take_rows`' inverse)."""
    new = {f: jax.tree.map(lambda p, r: p.at[rows].set(r), getattr(pool, f), getattr(sub, f)) for f in _ROWS}
    extra = pool.extra if plan is None else plan.method.put_rows(plan, pool.extra, sub.extra, rows)
    return dataclasses.replace(pool, extra=extra, **new)


def ar_start(target, tokens, lengths, max_new, eos, temperature, key, *, cache_size: int, buf_len: int,
             sampling: bool, attention, logprobs: int | None = None) -> SpecState:
    """The ``ar`` prefill of :func:`~sparkjax.engine.programs.ar_program` as a :class:`SpecState` (no drafter
    context, no rounds recorded): the first token is ``x_start`` and ``out[:, 0]``."""
    b = tokens.shape[0]
    cache, logits, _ = prefill(target, tokens, lengths, cache_size, attention=attention)
    sub = None
    if sampling:
        key, sub = split_keys(key, 2)
    first = pick(logits, temperature, sub)
    n = jnp.ones((b,), jnp.int32)
    zeros = jnp.zeros((b,), jnp.int32)
    lp = None if logprobs is None else lps.record(lps.empty(b, buf_len, logprobs), logits, first, zeros, temperature)
    return SpecState(
        cache=cache, ctx=None, x_start=first, out=jnp.zeros((b, buf_len), jnp.int32).at[:, 0].set(first), n=n,
        done=hits_eos(first, eos) | (n >= max_new), key=key, accept_lens=jnp.zeros((b, 1), jnp.int32), rounds=zeros,
        depth_hits=jnp.zeros((b, 0), jnp.int32),
        nonfinite=flag_nonfinite(jnp.full((b,), -1, jnp.int32), logits, jnp.ones((b,), bool), zeros), logprobs=lp)


def ar_round(target, state: SpecState, max_new, eos, temperature, *, sampling: bool, attention) -> SpecState:
    """One target step of every running sequence: the body of
    :func:`~sparkjax.engine.programs.ar_program`'s loop on a :class:`SpecState`."""
    done = state.done
    cache = state.cache
    step = target(state.x_start[:, None], cache.lengths[:, None], cache=cache, attention=attention)
    cache = step.cache.with_lengths(cache.lengths + (~done).astype(jnp.int32))
    key, sub = state.key, None
    if sampling:
        key, sub = split_keys(key, 2)
    nxt = pick(step.logits[:, 0], temperature, sub)
    n = state.n
    bad = flag_nonfinite(state.nonfinite, step.logits, ~done, n)
    write = jnp.where(done, state.out.shape[1], n)
    out = jax.vmap(lambda o, w, x: o.at[w].set(x, mode="drop"))(state.out, write, nxt)
    lp = lps.record(state.logprobs, step.logits[:, 0], nxt, write, temperature)
    n = n + (~done).astype(jnp.int32)
    return dataclasses.replace(state, cache=cache, x_start=jnp.where(done, state.x_start, nxt), out=out, n=n,
                               done=done | hits_eos(nxt, eos) | (n >= max_new), key=key,
                               rounds=state.rounds + (~done).astype(jnp.int32), nonfinite=bad, logprobs=lp)


def _start_row(target, drafter, tokens, lengths, max_new, eos, temperature, key, inputs, *, plan, target_only,
               cache_size, buf_len, sampling, attention, logprobs=None) -> SpecState:
    if target_only:  # ar's pool has no plan: ``logprobs`` is its setting (a speculative pool's is plan.logprobs)
        return ar_start(target, tokens, lengths, max_new, eos, temperature, key, cache_size=cache_size,
                        buf_len=buf_len, sampling=sampling, attention=attention, logprobs=logprobs)
    return spec_prefill(target, drafter, tokens, lengths, max_new, eos, temperature, key, inputs, plan, cache_size,
                        buf_len)


def _models(graphdefs, states, target_only):
    if target_only:
        from flax import nnx

        return nnx.merge(graphdefs, states), None
    return merge_pair(graphdefs, states)


_STATIC = ("graphdefs", "plan", "target_only", "cache_size", "buf_len", "sampling", "options")


@program(static_argnames=_STATIC + ("slots", "logprobs"))
def pool_init(graphdefs, states, key, inputs, *, plan, target_only, slots, cache_size, buf_len, sampling, options,
              logprobs=None):
    """The pool of ``slots`` free slots (every sequence done, nothing generated), a key per slot (``logprobs``:
    ``ar``'s pool's alternatives per token, None: no log-probabilities; a speculative pool's are ``plan``'s)."""
    target, drafter = _models(graphdefs, states, target_only)
    key = jax.random.split(key, slots)  # a key per slot
    tokens = jnp.zeros((slots, 1), jnp.int32)
    lengths = jnp.ones((slots,), jnp.int32)
    state = _start_row(target, drafter, tokens, lengths, jnp.ones((slots,), jnp.int32),
                       jnp.full((slots, 1), -1, jnp.int32), jnp.float32(0.0), key, inputs, plan=plan,
                       target_only=target_only, cache_size=cache_size, buf_len=buf_len, sampling=sampling,
                       attention=options.attend, logprobs=logprobs)
    zeros = jnp.zeros((slots,), jnp.int32)
    return dataclasses.replace(state, n=zeros, done=jnp.ones((slots,), bool), rounds=zeros,
                               nonfinite=jnp.full((slots,), -1, jnp.int32))


@program(static_argnames=_STATIC + ("logprobs",), donate_argnames=("pool",))
def pool_admit(graphdefs, states, pool, slot, tokens, lengths, max_new, eos, temperature, key, inputs, *, plan,
               target_only, cache_size, buf_len, sampling, options, logprobs=None):
    """The prefill of one prompt (``tokens`` ``[1, P]``, ``lengths`` ``[1]``; ``max_new``, ``eos`` ``[E]``,
    ``temperature`` and ``key`` its own, the key as a per-sequence key ``[1]``) written into slot ``slot`` of
    ``pool`` (donated)."""
    target, drafter = _models(graphdefs, states, target_only)
    key = key.reshape(1)  # a per-sequence key: the row's draws depend on its key alone
    row = _start_row(target, drafter, tokens, lengths, max_new, eos, temperature, key, inputs, plan=plan,
                     target_only=target_only, cache_size=cache_size, buf_len=buf_len, sampling=sampling,
                     attention=options.attend, logprobs=logprobs)
    return write_slot(pool, row, slot, plan)


def _choice_counts(plan: Plan | None, state: SpecState, r0: Array) -> Array:
    """``[N, K]``: rounds ``r0[b] ..`` of each slot that verified each of the method's labels."""
    labels = () if plan is None else plan.method.labels()
    res = None if plan is None else plan.method.results(state, plan)
    choices = getattr(res, "choices", None)
    n = state.n.shape[0]
    if not labels or choices is None:
        return jnp.zeros((n, 0), jnp.int32)
    r = jnp.arange(choices.shape[1], dtype=jnp.int32)[None]
    live = (r >= r0[:, None]) & (r < state.rounds[:, None])
    onehot = choices[..., None] == jnp.arange(len(labels), dtype=jnp.int32)
    return jnp.sum(onehot & live[..., None], axis=1).astype(jnp.int32)


@program(static_argnames=("graphdefs", "plan", "target_only", "window", "sampling", "options"),
         donate_argnames=("pool",))
def pool_visit(graphdefs, states, pool, stop, rounds, rows, max_new, eos, temperature, seen, *, plan, target_only,
               window, sampling, options):
    """Frees the slots in ``stop`` ``[N]``, then runs up to ``rounds`` rounds (traced) of the slots ``rows``
    ``[A]`` (distinct; every running slot among them, the others free) in one ``while_loop`` that ends early
    once a slot that was running finishes. No slot runs more than ``rounds`` rounds: ``auto``'s bursts of plain
    steps (a round each) stop at what the visit has left (:attr:`AutoState.burst_cap`), so every host visit
    streams new tokens. Returns ``(pool, Visit)``, the window of each slot's tokens starting at ``seen`` ``[N]``
    (the tokens the host has already read). Compiled once per A (``A = N``: no gather)."""
    target, drafter = _models(graphdefs, states, target_only)
    pool = dataclasses.replace(pool, done=pool.done | stop)
    n0, r0, hits0 = pool.n, pool.rounds, pool.depth_hits
    packed = rows.shape[0] != pool.n.shape[0]
    per_slot = (max_new, eos, temperature)
    if packed:
        full = pool
        pool = take_rows(pool, rows, plan)
        max_new, eos, temperature = (jax.tree.map(lambda x: x if x.ndim == 0 else x[rows], v) for v in per_slot)
    running = ~pool.done
    start = pool.rounds
    capped = isinstance(pool.extra, AutoState)  # auto: a round may be a burst of plain steps

    def with_cap(s, cap):
        return dataclasses.replace(s, extra=dataclasses.replace(s.extra, burst_cap=cap)) if capped else s

    def cond(carry):
        i, s = carry
        return (i < rounds) & ~jnp.any(running & s.done) & jnp.any(~s.done)

    def body(carry):
        i, s = carry  # i: the most rounds a slot has run in this visit
        if target_only:
            s = ar_round(target, s, max_new, eos, temperature, sampling=sampling, attention=options.attend)
        else:
            s = plan.method.round(target, drafter, with_cap(s, rounds - i), plan, max_new, eos, temperature)
        return jnp.maximum(i + 1, jnp.max(s.rounds - start)), s

    _, pool = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), with_cap(pool, jnp.zeros((), jnp.int32))))
    pool = with_cap(pool, None)
    if packed:
        pool = put_rows(full, pool, rows, plan)
    visit = Visit(_window(pool.out, seen, window), n0, pool.n, pool.done, pool.rounds - r0,
                  _choice_counts(plan, pool, r0), pool.nonfinite, pool.depth_hits - hits0,
                  _window(pool.logprobs, seen, window))
    return pool, visit


def _window(out, start: Array, width: int):
    """``out[b, start[b] .. start[b] + width]`` (clipped) of an array ``[N, L, ...]``, or of each array of a
    pytree (None: None)."""

    def one(x):
        cols = jnp.minimum(start[:, None] + jnp.arange(width, dtype=jnp.int32)[None], x.shape[1] - 1)
        return jnp.take_along_axis(x, cols.reshape(cols.shape + (1,) * (x.ndim - 2)), axis=1)

    return jax.tree.map(one, out)


read_tokens = jax.jit(_window, static_argnames=("width",))  # the rest of a visit that outgrew its window


@program(static_argnames=("graphdef", "top", "options"))
def score_prompt(graphdef, state, tokens, *, top, options):
    """The target's scores of a prompt's own tokens (``tokens`` ``[B, W]``, padded at the end): one forward pass
    of the target alone (no cache, no drafter, nothing of the pool), row r scoring token r + 1 under the raw
    logits' log-softmax (greedy semantics: no temperature, top-p or top-k) with the ``top`` likeliest
    alternatives; a :class:`~sparkjax.engine.logprobs.Logprobs` of ``[B, W]`` (the last row, and rows past the
    prompt, score padding: the caller drops them). One program per prompt width and ``top``, shared by every
    request."""
    from flax import nnx

    model = nnx.merge(graphdef, state)
    b, w = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
    logits = model(tokens, positions, attention=options.attend).logits
    following = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)
    return lps.score(logits, following, jnp.float32(0.0), top)


__all__ = ["Visit", "ar_round", "ar_start", "pool_admit", "pool_init", "pool_visit", "put_rows", "read_tokens",
           "score_prompt", "take_rows", "write_slot"]
