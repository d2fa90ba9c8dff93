"""The jitted programs: the target's prefill, the AR program and the speculative program.

Every generation is one jitted ``jax.lax.while_loop`` over fixed-shape state: nothing returns to the
host until it ends. :func:`spec_start` / :func:`spec_step` are the same prefill and round as separate
jitted calls (for ``stream``, one host sync per round by design).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ..sampling import pick
from .auto import init_state as init_auto
from .drafting import append_context
from .methods import Plan
from .round import flag_nonfinite, spec_round
from .state import SpecState


def split_pair(target, drafter):
    """``((graphdef_t, graphdef_d), (state_t, state_d))`` of the pair, for the jitted programs."""
    (g_t, s_t), (g_d, s_d) = nnx.split(target), nnx.split(drafter)
    return (g_t, g_d), (s_t, s_d)


def merge_pair(graphdefs, states):
    """The target and drafter modules back from :func:`split_pair`'s halves (inside a jitted function)."""
    return nnx.merge(graphdefs[0], states[0]), nnx.merge(graphdefs[1], states[1])


def prefill(model, tokens, lengths, cache_size: int, hidden_layers: tuple[int, ...] = ()):
    """Runs the prompt through the target. Returns (cache with committed lengths, last logits [B, V], hidden)."""
    b, p = tokens.shape
    cache = model.init_cache(b, cache_size)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    out = model(tokens, positions, cache=cache, hidden_layers=hidden_layers, logits_at=(lengths - 1)[:, None],
                fresh_cache=True)
    return out.cache.with_lengths(lengths), out.logits[:, 0], out.hidden


@functools.partial(jax.jit, static_argnames=("graphdef", "buf_len", "cache_size", "sampling"))
def ar_program(graphdef, state, tokens, lengths, max_new, eos, temperature, key, *, buf_len, cache_size,
               sampling=True):
    """The target alone: prefill, then one token per ``while_loop`` step. Returns ``(out, n, nonfinite)``.

    ``sampling`` (static) is False for a greedy run (temperature 0): the program is then a plain argmax loop
    with no key splitting and no sampling branch, the baseline every speculative method is measured against."""
    model = nnx.merge(graphdef, state)
    b = tokens.shape[0]
    cache, logits, _ = prefill(model, tokens, lengths, cache_size)
    sub = None
    if sampling:
        key, sub = jax.random.split(key)
    first = pick(logits, temperature, sub)
    out = jnp.zeros((b, buf_len), jnp.int32).at[:, 0].set(first)
    n = jnp.ones((b,), jnp.int32)
    done = jnp.isin(first, eos) | (n >= max_new)
    bad = flag_nonfinite(jnp.full((b,), -1, jnp.int32), logits, jnp.ones((b,), bool), jnp.zeros((b,), jnp.int32))

    def cond(carry):
        return ~jnp.all(carry[3])

    def body(carry):
        cache, out, n, done, key, bad = carry
        cur = jnp.take_along_axis(out, (n - 1)[:, None], axis=1)
        step = model(cur, cache.lengths[:, None], cache=cache)
        cache = step.cache.with_lengths(cache.lengths + (~done).astype(jnp.int32))
        sub = None
        if sampling:
            key, sub = jax.random.split(key)
        nxt = pick(step.logits[:, 0], temperature, sub)
        bad = flag_nonfinite(bad, step.logits, ~done, n)  # step n makes token n + 1
        write = jnp.where(done, buf_len, n)  # out of range -> dropped
        out = out.at[jnp.arange(b), write].set(nxt, mode="drop")
        n = n + (~done).astype(jnp.int32)
        done = done | jnp.isin(nxt, eos) | (n >= max_new)
        return cache, out, n, done, key, bad

    _, out, n, _, _, bad = jax.lax.while_loop(cond, body, (cache, out, n, done, key, bad))
    return out, n, bad


def spec_prefill(target, drafter, tokens, lengths, max_new, eos, temperature, key, plan: Plan,
                 cache_size: int, buf_len: int) -> SpecState:
    """Prefill the target, take the first token, and fill the drafter context with the prompt's features."""
    b = tokens.shape[0]
    cache, logits, hidden = prefill(target, tokens, lengths, cache_size, plan.layer_ids)
    key, sub = jax.random.split(key)
    first = pick(logits, temperature, sub if plan.sampling else None)
    ctx = append_context(drafter, drafter.init_context(b, cache_size), jnp.concatenate(hidden, -1), lengths)
    out = jnp.zeros((b, buf_len), jnp.int32).at[:, 0].set(first)
    n = jnp.ones((b,), jnp.int32)
    done = jnp.isin(first, eos) | (n >= max_new)
    return SpecState(
        cache=cache, ctx=ctx, x_start=first, out=out, n=n, done=done, key=key,
        accept_lens=jnp.zeros((b, buf_len), jnp.int32), rounds=jnp.zeros((b,), jnp.int32),
        depth_hits=jnp.zeros((b, plan.depth), jnp.int32),
        nonfinite=flag_nonfinite(jnp.full((b,), -1, jnp.int32), logits, jnp.ones((b,), bool),
                                 jnp.zeros((b,), jnp.int32)),
        auto=init_auto(plan, b, buf_len) if plan.is_auto else None,
    )


_STATIC = ("graphdefs", "plan", "cache_size", "buf_len")


@functools.partial(jax.jit, static_argnames=_STATIC)
def spec_program(graphdefs, states, tokens, lengths, max_new, eos, temperature, key, *, plan, cache_size, buf_len):
    """Prefill, then speculative rounds in one ``while_loop``. Returns ``(out, n, accept_lens, rounds,
    depth_hits, nonfinite)``; method ``auto`` adds ``choices [B, R]`` before ``nonfinite``."""
    target, drafter = merge_pair(graphdefs, states)
    state = spec_prefill(target, drafter, tokens, lengths, max_new, eos, temperature, key, plan, cache_size, buf_len)
    state = jax.lax.while_loop(
        lambda s: ~jnp.all(s.done),
        lambda s: spec_round(target, drafter, s, plan, max_new, eos, temperature),
        state,
    )
    res = (state.out, state.n, state.accept_lens, state.rounds, state.depth_hits)
    if plan.is_auto:  # method 'auto' also returns each round's chosen candidate [B, R]
        res += (state.auto.choices,)
    return (*res, state.nonfinite)


@functools.partial(jax.jit, static_argnames=_STATIC)
def spec_start(graphdefs, states, tokens, lengths, max_new, eos, temperature, key, *, plan, cache_size, buf_len):
    """:func:`spec_prefill` as its own jitted call: the state before the first round."""
    target, drafter = merge_pair(graphdefs, states)
    return spec_prefill(target, drafter, tokens, lengths, max_new, eos, temperature, key, plan, cache_size, buf_len)


@functools.partial(jax.jit, static_argnames=("graphdefs", "plan"), donate_argnames=("state",))
def spec_step(graphdefs, states, state, max_new, eos, temperature, *, plan):
    """One :func:`~sparkjax.engine.round.spec_round` as its own jitted call."""
    target, drafter = merge_pair(graphdefs, states)
    return spec_round(target, drafter, state, plan, max_new, eos, temperature)


@functools.partial(jax.jit, static_argnames=("graphdefs", "fn", "plan"))
def stage_call(graphdefs, states, args, *, fn, plan):
    """One stage of the round (``fn``, a :mod:`sparkjax.engine.round` stage) as its own jitted call."""
    target, drafter = merge_pair(graphdefs, states)
    return fn(target, drafter, *args, plan=plan)
