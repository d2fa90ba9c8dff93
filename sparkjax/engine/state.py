"""The data a generation carries, as dataclasses (the device-side ones registered as pytrees).

:class:`Plan` is the static shape of a speculative program, :class:`DeviceArgs` a run's traced inputs,
:class:`SpecState` the carry of the speculative ``while_loop``; a round passes
:class:`~sparkjax.engine.drafting.DraftBlock` (draft) -> :class:`Proposal` (tree) -> :class:`Verified`
(verify) -> :class:`Acceptance` (accept) -> a new :class:`SpecState` (commit). :class:`Launch` is what
:func:`~sparkjax.engine.launch` returns.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax

from .options import DEFAULT_OPTIONS, Options

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static shape of a speculative program (anything that changes it recompiles: it is hashed into
    jit's cache key).

    ``method``: the :class:`~sparkjax.engine.methods.Method` with every default resolved for this pair
    (a tree's ``top_c`` and ``widths``); ``depth`` D: drafted depths per round; ``nodes`` M: nodes verified
    per round (D for chains); ``sampling``: temperature > 0; ``layer_ids``: the target layers the drafter
    reads; ``options``: the trace-time :class:`~sparkjax.engine.options.Options`.
    """

    method: Any
    depth: int
    nodes: int
    sampling: bool = False
    layer_ids: tuple[int, ...] = ()
    options: Options = DEFAULT_OPTIONS

    @property
    def top_c(self) -> int:
        """Candidates per depth of the method's tree (0 without one)."""
        return self.method.top_c or 0

    @property
    def widths(self) -> tuple[int, ...] | None:
        """The beam's nodes per depth (``sparklingtree-beam``), else None."""
        return self.method.widths

    @property
    def normalization(self) -> str:
        """The Markov tables' normalization (``fast`` or ``exact``)."""
        return self.method.normalization

    @property
    def candidates(self) -> str | None:
        """The tree's candidate sets (``union`` / ``corrected`` / ``base``; None without a tree)."""
        return self.method.candidates

    @property
    def scratch(self) -> int:
        """Cache rows a round needs past the committed tokens: it may overshoot by D and verifies M + 1 rows."""
        return self.depth + self.nodes + 2


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
    extra: Any = None  # the method's own carried state (Method.init_state; None for most methods)


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


@dataclasses.dataclass(frozen=True)
class Launch:
    """What :func:`~sparkjax.engine.launch` returns: device arrays, nothing synced (a pytree, so
    ``jax.block_until_ready`` waits for it; ``plan`` and ``labels`` are static).

    ``out`` ``[B, buf]`` generated tokens (``n`` ``[B]`` of them per sequence); ``accept_lens`` ``[B, R]``,
    ``rounds`` ``[B]``, ``depth_hits`` ``[B, D]`` as in :class:`SpecState` (None for ``ar``); ``nonfinite``
    ``[B]`` int32, the first round whose target logits held a NaN or an Inf (0: the prefill; -1: none;
    :func:`~sparkjax.engine.api.raise_if_nonfinite` checks it); ``extra``: the method's
    :meth:`~sparkjax.engine.methods.Method.results` (None for most; ``auto``: its ``choices`` and
    ``memory``); ``plan``: the static plan (None for ``ar``); ``labels``: the names ``extra``'s choices
    index (``auto``'s candidates; empty otherwise).
    """

    out: Array
    n: Array
    accept_lens: Array | None
    rounds: Array | None
    depth_hits: Array | None
    nonfinite: Array
    extra: Any = None
    plan: Plan | None = None
    labels: tuple[str, ...] = ()


jax.tree_util.register_dataclass(
    Launch, data_fields=["out", "n", "accept_lens", "rounds", "depth_hits", "nonfinite", "extra"],
    meta_fields=["plan", "labels"],
)
