"""Token log-probabilities of the committed tokens, from logits a program already computed (the prefill's last
row, ``ar``'s one-token steps, a round's verify rows, ``auto``'s plain steps).

The number of alternatives is static (``Plan.logprobs``, every method's ``ar`` included): None computes nothing and
leaves the programs as they were (:class:`~sparkjax.engine.state.SpecState` carries no buffer, ``logprobs`` None);
0 records the chosen token's log-probability only; N > 0 also the N likeliest tokens and theirs. The values are
``log_softmax(sampling.process(logits, params))``: the raw logits' log-softmax for greedy rows, the distribution
sampled from (after temperature, top-k and top-p) for sampled rows (-inf for a token top-k / top-p removed).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .. import sampling
from ..errors import ArgumentError
from .checks import describe, is_int

Array = jax.Array

MAX_LOGPROBS = 20  # the most alternatives per position (OpenAI's chat bound)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Logprobs:
    """Per output position (parallel to ``SpecState.out`` ``[B, L]``): ``chosen`` ``[B, L]`` the log-probability
    of the committed token, ``ids`` / ``values`` ``[B, L, N]`` the N likeliest tokens, most likely first, and
    theirs (N may be 0)."""

    chosen: Array
    ids: Array
    values: Array


def empty(batch: int, length: int, top: int) -> Logprobs:
    """A buffer of zeros for ``batch`` sequences of ``length`` positions and ``top`` alternatives."""
    return Logprobs(jnp.zeros((batch, length), jnp.float32), jnp.zeros((batch, length, top), jnp.int32),
                    jnp.zeros((batch, length, top), jnp.float32))


def score(logits: Array, tokens: Array, params, top: int) -> Logprobs:
    """The log-probabilities of ``tokens`` ``[B, R]`` under ``logits`` ``[B, R, V]`` (row r scores token r) and the
    ``top`` likeliest alternatives of each row: ``log_softmax(process(logits, params))`` (``params`` a
    :class:`~sparkjax.sampling.Sampling` or a temperature, scalar or per sequence)."""
    lp = jax.nn.log_softmax(sampling.process(logits.astype(jnp.float32), params), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    if top > 0:
        values, ids = jax.lax.top_k(lp, top)
    else:
        values = jnp.zeros(lp.shape[:-1] + (0,), jnp.float32)
        ids = jnp.zeros(lp.shape[:-1] + (0,), jnp.int32)
    return Logprobs(chosen, ids.astype(jnp.int32), values)


def write(buf: Logprobs | None, cols: Array, new: Logprobs) -> Logprobs | None:
    """``buf`` with row b's scores ``new`` ``[B, R]`` written at columns ``cols`` ``[B, R]`` (a column past the
    buffer is dropped); None stays None."""
    if buf is None:
        return None
    put = jax.vmap(lambda o, c, x: o.at[c].set(x, mode="drop"))
    return Logprobs(put(buf.chosen, cols, new.chosen), put(buf.ids, cols, new.ids), put(buf.values, cols, new.values))


def record(buf: Logprobs | None, logits: Array, tokens: Array, cols: Array, params) -> Logprobs | None:
    """:func:`score` then :func:`write` (nothing computed when ``buf`` is None). ``logits`` ``[B, R, V]`` or
    ``[B, V]`` (with ``tokens`` / ``cols`` ``[B]``)."""
    if buf is None:
        return None
    if logits.ndim == 2:
        logits, tokens, cols = logits[:, None], tokens[:, None], cols[:, None]
    return write(buf, cols, score(logits, tokens, params, buf.ids.shape[-1]))


def check_logprobs(value, name: str = "logprobs", maximum: int = MAX_LOGPROBS) -> int | None:
    """None, or an int in ``[0, maximum]`` (the alternatives per position), else an ArgumentError naming it."""
    if value is None:
        return None
    if not is_int(value) or not 0 <= int(value) <= maximum:
        raise ArgumentError(f"{name}: expected None or an integer in [0, {maximum}] (the top alternatives per "
                            f"token; 0: the chosen token's log-probability only), got {describe(value)}")
    return int(value)
