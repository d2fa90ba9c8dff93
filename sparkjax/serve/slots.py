"""The slot pool's jitted programs: a fixed batch of N sequences on device that requests enter and leave.

The pool is a :class:`~sparkjax.engine.state.SpecState` of batch N, whatever the method (``ar``'s has no drafter
context). A free slot is a finished sequence (``done``): every round masks it, so it grows nothing
and commits nothing. Each program compiles once per shape, the pool donated: :func:`pool_init` (every slot
free), :func:`pool_admit` (one prompt's prefill written into slot ``i``), :func:`pool_fork` (slot ``i`` just
after its admission copied into slot ``j``, its first token drawn again with ``j``'s own key: the choices of one
request share its prompt's prefill) and :func:`pool_visit` (up to
``rounds`` rounds of the slots ``rows``, gathered by :func:`~sparkjax.engine.state.take_rows` and put back by
:func:`~sparkjax.engine.state.put_rows`, in a
``while_loop`` that ends once a running sequence finishes; one program per number of rows). Each slot's request
values (``max_new`` ``[N]``, ``eos`` ``[N, E]``, a :class:`~sparkjax.sampling.Sampling` of ``[N]`` arrays:
temperature, top-p, top-k) live in the pool state (``SpecState.request``), written at admission.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..engine import logprobs as lps
from ..engine.adaptive import AutoState
from ..engine.programs import first_token, merge_pair, program, spec_prefill, spec_prefill_logits
from ..engine.round import hits_eos
from ..engine.state import Plan, SpecState, put_rows, take_rows, write_row
from ..sampling import Sampling

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


_STATIC = ("graphdefs", "plan", "cache_size", "buf_len")


@program(static_argnames=_STATIC + ("slots", "eos_slots"))
def pool_init(graphdefs, states, key, inputs, *, plan, slots, eos_slots, cache_size, buf_len):
    """The pool of ``slots`` free slots (every sequence done, nothing generated), a key per slot, and per slot the
    request values an admission sets: ``max_new``, ``eos_slots`` EOS ids, the sampling parameters."""
    target, drafter = merge_pair(graphdefs, states)
    key = jax.random.split(key, slots)  # a key per slot
    tokens = jnp.zeros((slots, 1), jnp.int32)
    lengths = jnp.ones((slots,), jnp.int32)
    none = jnp.full((slots, eos_slots), -1, jnp.int32)
    per_slot = Sampling.of(jnp.zeros((slots,), jnp.float32), jnp.ones((slots,), jnp.float32),
                           jnp.zeros((slots,), jnp.int32))
    state = spec_prefill(target, drafter, tokens, lengths, jnp.ones((slots,), jnp.int32), none, per_slot, key, inputs,
                         plan, cache_size, buf_len)
    zeros = jnp.zeros((slots,), jnp.int32)
    return dataclasses.replace(state, n=zeros, done=jnp.ones((slots,), bool), rounds=zeros,
                               nonfinite=jnp.full((slots,), -1, jnp.int32))


@program(static_argnames=_STATIC, donate_argnames=("pool",))
def pool_admit(graphdefs, states, pool, slot, tokens, lengths, max_new, eos, temperature, key, inputs, *, plan,
               cache_size, buf_len):
    """The prefill of one prompt (``tokens`` ``[1, P]``, ``lengths`` ``[1]``; ``max_new``, ``eos`` ``[E]``,
    ``temperature`` (a :class:`~sparkjax.sampling.Sampling`) and ``key`` its own, the key as a per-sequence key
    ``[1]``) written into slot ``slot`` of ``pool`` (donated), its request values with it. Returns ``(pool,
    logits)``: the prompt's last logits ``[1, V]`` its first token came from, as float32 (the sampler's own first
    step, so nothing changes the draws), which :func:`pool_fork` takes to draw the first token of a copy of the
    slot."""
    target, drafter = merge_pair(graphdefs, states)
    key = key.reshape(1)  # a per-sequence key: the row's draws depend on its key alone
    temperature = jax.tree.map(lambda x: jnp.reshape(x, (1,)), temperature)  # the slot's own (not the pool's)
    row, logits = spec_prefill_logits(target, drafter, tokens, lengths, max_new, eos, temperature, key, inputs, plan,
                                      cache_size, buf_len)
    return write_row(pool, row, slot), logits.astype(jnp.float32)  # every per-sequence field, the method's own too


@program(static_argnames=("plan",), donate_argnames=("pool",))
def pool_fork(pool, src, dst, logits, key, *, plan):
    """``pool`` (donated) with slot ``dst`` a copy of slot ``src`` as :func:`pool_admit` left it (no round run
    since): every per-row field of the state (:func:`~sparkjax.engine.state.take_rows` /
    :func:`~sparkjax.engine.state.write_row`: the target's KV cache, the drafter's context, the request values,
    the method's own state) but the first token, drawn again from the prompt's ``logits`` ``[1, V]`` (what
    :func:`pool_admit` returned) with ``dst``'s own ``key`` exactly as :func:`spec_prefill` draws it
    (:func:`~sparkjax.engine.programs.first_token`): the slot holds what :func:`pool_admit` of the same prompt
    with that key would have written, without running the target again. Greedy, the copy's first token is the
    source's. ``src`` / ``dst``: traced slot indices; one program for the pool."""
    row = take_rows(pool, jnp.reshape(src, (1,)))
    temperature = row.request.sampling
    key, first = first_token(logits, temperature, key.reshape(1), plan)
    row = dataclasses.replace(
        row, x_start=first, out=row.out.at[:, 0].set(first), key=key,
        done=hits_eos(first, row.request.eos) | (row.n >= row.request.max_new),
        logprobs=lps.record(row.logprobs, logits, first, jnp.zeros_like(row.n), temperature))
    return write_row(pool, row, dst)


def _choice_counts(plan: Plan, state: SpecState, r0: Array) -> Array:
    """``[N, K]``: rounds ``r0[b] ..`` of each slot that verified each of the method's labels."""
    labels = plan.method.labels()
    res = plan.method.results(state, plan)
    choices = getattr(res, "choices", None)
    n = state.n.shape[0]
    if not labels or choices is None:
        return jnp.zeros((n, 0), jnp.int32)
    r = jnp.arange(choices.shape[1], dtype=jnp.int32)[None]
    live = (r >= r0[:, None]) & (r < state.rounds[:, None])
    onehot = choices[..., None] == jnp.arange(len(labels), dtype=jnp.int32)
    return jnp.sum(onehot & live[..., None], axis=1).astype(jnp.int32)


@program(static_argnames=("graphdefs", "plan", "window"), donate_argnames=("pool",))
def pool_visit(graphdefs, states, pool, stop, rounds, rows, seen, *, plan, window):
    """Frees the slots in ``stop`` ``[N]``, then runs up to ``rounds`` rounds (traced) of the slots ``rows``
    ``[A]`` (distinct; every running slot among them, the others free) in one ``while_loop`` that ends early
    once a slot that was running finishes. No slot runs more than ``rounds`` rounds: ``auto``'s bursts of plain
    steps (a round each) stop at what the visit has left (:attr:`AutoState.burst_cap`), so every host visit
    streams new tokens. Returns ``(pool, Visit)``, the window of each slot's tokens starting at ``seen`` ``[N]``
    (the tokens the host has already read). Compiled once per A (``A = N``: no gather)."""
    target, drafter = merge_pair(graphdefs, states)
    pool = dataclasses.replace(pool, done=pool.done | stop)
    n0, r0, hits0 = pool.n, pool.rounds, pool.depth_hits
    packed = rows.shape[0] != pool.n.shape[0]
    if packed:  # every per-slot field, the request values and the method's state included
        full = pool
        pool = take_rows(pool, rows)
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
        s = plan.method.round(target, drafter, with_cap(s, rounds - i), plan)
        return jnp.maximum(i + 1, jnp.max(s.rounds - start)), s

    _, pool = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), with_cap(pool, jnp.zeros((), jnp.int32))))
    pool = with_cap(pool, None)
    if packed:
        pool = put_rows(full, pool, rows)
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


__all__ = ["Visit", "pool_admit", "pool_fork", "pool_init", "pool_visit", "read_tokens", "score_prompt"]
