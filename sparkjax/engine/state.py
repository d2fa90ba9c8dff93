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
    """The static shape of a generation program (part of jit's cache key): ``method`` with every default
    resolved for this pair, ``depth`` D drafted per round (0 for ``ar``: a round is one target step), ``nodes`` M
    verified per round past the root (D for chains, 0 for ``ar``), ``sampling`` (temperature > 0), ``layer_ids``
    (the target layers the drafter reads), ``options``, ``logprobs`` and ``context`` (whether the generation
    fills the drafter's context: False for ``ar``, and for an ``auto`` whose cost table lets no draft pay)."""

    method: Any
    depth: int
    nodes: int
    sampling: bool = False
    layer_ids: tuple[int, ...] = ()
    options: Options = DEFAULT_OPTIONS
    logprobs: int | None = None  # alternatives recorded per token (None: no log-probabilities computed)
    context: bool = True

    @property
    def drafts(self) -> bool:
        """Whether a round drafts (every method but ``ar``): the program needs the drafter."""
        return self.depth > 0

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
        """Cache rows a round needs past the committed tokens: it may overshoot by D and verifies M + 1 rows
        (none for a one-token step, which writes the row of the token it commits)."""
        return self.depth + self.nodes + 2 if self.drafts else 0


class DeviceArgs(NamedTuple):
    """A run's traced inputs, in the order the jitted programs take them (``*args``)."""

    tokens: Array  # [B, P] int32 right-padded prompts
    lengths: Array  # [B] int32 prompt lengths
    max_new: Array  # int32 scalar: tokens to generate (traced, so it does not recompile)
    eos: Array  # [E] int32 EOS ids (-1: none)
    temperature: Any  # sampling.Sampling of scalars: temperature (0 = greedy), top_p, top_k
    key: Array  # PRNG key


def per_row(**kwargs):
    """A dataclass field holding one entry per sequence along the leading axis of each of its arrays (a 0-d leaf
    is shared, e.g. one PRNG key for the batch): what :func:`take_rows`, :func:`put_rows` and :func:`write_row`
    gather and scatter. A field without the mark is shared by the batch; a field holding a dataclass with marked
    fields (the method's own state, ``SpecState.extra``) is followed into."""
    return dataclasses.field(metadata={"per_row": True}, **kwargs)


def _rows_map(row_fn, shared_fn, first, *rest):
    """``first`` (a dataclass) with each per-row leaf ``row_fn(leaf, *the others' leaves)`` and each shared field
    ``shared_fn(value, *the others' values)``, recursing into nested dataclasses that mark per-row fields."""
    out = {}
    for f in dataclasses.fields(first):
        vals = [getattr(x, f.name) for x in (first, *rest)]
        if dataclasses.is_dataclass(vals[0]) and any(g.metadata.get("per_row") for g in dataclasses.fields(vals[0])):
            out[f.name] = _rows_map(row_fn, shared_fn, *vals)
        elif f.metadata.get("per_row"):
            out[f.name] = jax.tree.map(lambda *xs: row_fn(*xs) if xs[0].ndim else shared_fn(*xs), *vals)
        else:
            out[f.name] = shared_fn(*vals)
    return dataclasses.replace(first, **out)


def take_rows(state, rows: Array):
    """The sequences ``rows`` ``[A]`` (distinct) of ``state`` (a :class:`SpecState`, or any dataclass marking its
    :func:`per_row` fields) as a batch of A; shared fields as they are."""
    return _rows_map(lambda x: x[rows], lambda x: x, state)


def put_rows(pool, sub, rows: Array):
    """``pool`` with its sequences ``rows`` replaced by the batch ``sub`` (:func:`take_rows`' inverse); the shared
    fields are ``sub``'s (what the sub-batch learned holds for the whole batch)."""
    return _rows_map(lambda p, r: p.at[rows].set(r), lambda p, r: r, pool, sub)


def write_row(pool, row, slot: Array):
    """``pool`` with sequence ``slot`` (traced) started over from the batch-1 ``row``; the shared fields stay the
    pool's."""
    return _rows_map(lambda p, r: jax.lax.dynamic_update_slice_in_dim(p, r.astype(p.dtype), slot, axis=0),
                     lambda p, r: p, pool, row)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Request:
    """What each sequence asked for, set at its prefill (or its admission into a serving slot) and read by every
    round: ``max_new`` ``[B]`` int32 (tokens to generate), ``eos`` ``[B, E]`` int32 (its EOS ids, -1 padding) and
    ``sampling`` (a :class:`~sparkjax.sampling.Sampling`: temperature, top-p, top-k, each one per sequence ``[B]``
    or one for the batch, a 0-d value)."""

    max_new: Array = per_row()
    eos: Array = per_row()
    sampling: Any = per_row()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecState:
    """Everything a round reads and writes (fixed shapes: a ``while_loop`` carry), the sequences' ``request``
    values included. The target has processed
    every committed token but the last, ``x_start``, at ``start = cache.lengths``; ``out`` holds ``n``
    tokens, ``accept_lens[b, r]`` the tokens round r committed, ``depth_hits[b, d]`` how many rounds
    accepted depth d + 1."""

    cache: Any = per_row()
    ctx: Any = per_row()
    x_start: Array = per_row()
    out: Array = per_row()
    n: Array = per_row()
    done: Array = per_row()
    key: Array = per_row()  # one key per sequence, or one for the batch (0-d: shared)
    accept_lens: Array = per_row()
    rounds: Array = per_row()
    depth_hits: Array = per_row()
    nonfinite: Array = per_row()  # [B] int32: first round with non-finite target logits (0 = prefill), -1 if none
    request: Request = None  # what each sequence asked for (per-sequence fields: followed by the row functions)
    extra: Any = None  # the method's own carried state (Method.init_state; None for most methods)
    logprobs: Any = per_row(default=None)  # engine.logprobs.Logprobs [B, L(, N)] parallel to out, or None


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
