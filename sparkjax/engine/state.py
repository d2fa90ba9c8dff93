"""The data a generation carries on device, as registered dataclasses (pytrees with named fields).

:class:`DeviceArgs` are a run's traced inputs, :class:`SpecState` the carry of the speculative
``while_loop``; a round passes :class:`~sparkjax.engine.drafting.DraftBlock` (draft) ->
:class:`Proposal` (tree) -> :class:`Verified` (verify) -> :class:`Acceptance` (accept) -> a new
:class:`SpecState` (commit).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax

Array = jax.Array


class DeviceArgs(NamedTuple):
    """A run's traced inputs, in the order the jitted programs take them (``*args``)."""

    tokens: Array  # [B, P] int32 right-padded prompts
    lengths: Array  # [B] int32 prompt lengths
    max_new: Array  # int32 scalar: tokens to generate (traced, so it does not recompile)
    eos: Array  # [E] int32 EOS ids (-1: none)
    temperature: Array  # float32 scalar, 0 = greedy
    key: Array  # PRNG key


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecState:
    """Everything a round reads and writes; fixed shapes, so it lives in a ``while_loop`` carry.

    The target has processed every committed token but the last one, ``x_start``, which sits at
    index ``start = cache.lengths`` (and the drafter context holds positions ``< start``).
    ``out`` holds the generated tokens (``n`` of them), ``accept_lens[b, r]`` the tokens round r
    committed (accepted drafts + 1), ``depth_hits[b, d]`` how many rounds accepted depth d + 1,
    ``nonfinite[b]`` the first round whose target logits were not finite (-1 while all were).
    """

    cache: Any
    ctx: Any
    x_start: Array
    out: Array
    n: Array
    done: Array
    key: Array
    accept_lens: Array
    rounds: Array
    depth_hits: Array
    nonfinite: Array  # [B] int32: first round with non-finite target logits (0 = prefill), -1 if none
    auto: Any = None  # method 'auto' only: its sparkjax.engine.auto.AutoState (choices, calibration)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Proposal:
    """A round's draft tree: nodes ``[B, M]`` (a chain is a tree with one node per depth)."""

    tokens: Array
    parents: Array
    depths: Array
    mask: Array  # [B, M + 1, M + 1] ancestor visibility, root first
    draft_logits: Array | None  # chains only: the logits the drafts were drawn from [B, D, V]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Verified:
    """The target's pass over ``[x_start] + nodes``: ``logits`` ``[B, M + 1, V]`` float32, the drafter's
    ``features`` of those rows ``[B, M + 1, F]``, the ``cache`` with the rows written past the committed
    length, and the verified ``tokens`` ``[B, M + 1]`` (root first)."""

    logits: Array
    features: Array
    cache: Any
    tokens: Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Acceptance:
    """The accepted path of a round: ``indices`` ``[B, D + 1]`` verify rows (root first, -1 past the path),
    ``length`` ``[B]`` tokens committed (accepted drafts + 1) and the ``bonus`` token ``[B]``."""

    indices: Array
    length: Array
    bonus: Array
