"""The data a generation carries, as dataclasses (the device-side ones registered as pytrees): a round
passes ``DraftBlock`` -> :class:`Proposal` -> :class:`Verified` -> :class:`Acceptance` -> a new
:class:`SpecState`."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax

from .options import DEFAULT_OPTIONS, Options

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static shape of a speculative program (part of jit's cache key): ``method`` with every default
    resolved for this pair, ``depth`` D, ``nodes`` M verified per round (D for chains), ``sampling``
    (temperature > 0), ``layer_ids`` (the target layers the drafter reads) and ``options``."""

    method: Any
    depth: int
    nodes: int
    sampling: bool = False
    layer_ids: tuple[int, ...] = ()
    options: Options = DEFAULT_OPTIONS
    logprobs: int | None = None  # alternatives recorded per token (None: no log-probabilities computed)

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
    temperature: Any  # sampling.Sampling of scalars: temperature (0 = greedy), top_p, top_k
    key: Array  # PRNG key


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecState:
    """Everything a round reads and writes (fixed shapes: a ``while_loop`` carry). The target has processed
    every committed token but the last, ``x_start``, at ``start = cache.lengths``; ``out`` holds ``n``
    tokens, ``accept_lens[b, r]`` the tokens round r committed, ``depth_hits[b, d]`` how many rounds
    accepted depth d + 1."""

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
    logprobs: Any = None  # engine.logprobs.Logprobs [B, L(, N)] parallel to out, or None (not asked for)


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
    ``length`` ``[B]`` the path's tokens (accepted drafts + 1; the commit cuts it at EOS or max_new and counts
    what it kept) and the ``bonus`` token ``[B]``."""

    indices: Array
    length: Array
    bonus: Array


@dataclasses.dataclass(frozen=True)
class Launch:
    """What :func:`~sparkjax.engine.launch` returns (its docstring has the fields): device arrays, nothing
    synced (a pytree; ``plan`` and ``labels`` are static)."""

    out: Array
    n: Array
    accept_lens: Array | None
    rounds: Array | None
    depth_hits: Array | None
    nonfinite: Array
    extra: Any = None
    plan: Plan | None = None
    labels: tuple[str, ...] = ()
    logprobs: Any = None


jax.tree_util.register_dataclass(
    Launch, data_fields=["out", "n", "accept_lens", "rounds", "depth_hits", "nonfinite", "extra", "logprobs"],
    meta_fields=["plan", "labels"],
)
