"""Trace-time settings of a generation as one frozen, hashable value (part of the static plan).

Every choice that changes the traced program but not the tokens (which attention implementation the
models run, how the DSpark chain is computed, how far the tree's candidate chain iterates) is a field
of :class:`Options`. The static :class:`~sparkjax.engine.state.Plan` carries it, so it is part of
jit's cache key: two runs with different options compile two programs, and no module-level setting
is read while tracing.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from ..errors import ArgumentError
from ..nn.layers import ATTENTION_IMPLS, BLOCK_SLOTS, attend
from .checks import check_int, describe
from .drafting import CHAIN_MODES


@dataclasses.dataclass(frozen=True)
class Options:
    """The trace-time settings of a generation.

    ``attention``: the models' attention, an ``impl`` of :func:`sparkjax.nn.layers.attend` (``"auto"``,
    the default, resolves by backend when traced: ``"blocked"`` on CPU, ``"einsum"`` elsewhere) or a
    hashable callable with :func:`~sparkjax.nn.layers.attend`'s signature ``fn(q, parts)`` (a benchmark's
    model of a fused kernel). ``chain_mode``: the DSpark chain's formulation (``"auto"``: ``"scan"`` on
    CPU, ``"fixed_point"`` elsewhere; :func:`sparkjax.engine.drafting.chain_mode`).
    ``candidate_chain_passes``: passes of the fixed-point chain behind the Markov trees' ``corrected`` /
    ``union`` candidates off CPU (None: to convergence; see
    :func:`sparkjax.engine.drafting.candidate_chain_logits`). ``union_top_k``: the ``union`` candidates'
    corrected tokens per depth (None: ``top_c // 4``; :func:`sparkjax.tree.markov_candidates`).
    ``block_slots``: the blocked / prefix attention's chunk of cache slots. Each field is checked on
    construction (an :class:`~sparkjax.errors.ArgumentError` naming it).
    """

    attention: str | Callable = "auto"
    chain_mode: str = "auto"
    candidate_chain_passes: int | None = 1
    union_top_k: int | None = None
    block_slots: int = BLOCK_SLOTS

    def __post_init__(self):
        a = self.attention
        if callable(a):
            try:
                hash(a)
            except TypeError:
                raise ArgumentError(f"attention: a callable attention must be hashable, got {describe(a)}") from None
        elif not isinstance(a, str) or a not in ATTENTION_IMPLS:
            raise ArgumentError(f"attention: expected one of {', '.join(ATTENTION_IMPLS)} or a callable, "
                                f"got {describe(a)}")
        if not isinstance(self.chain_mode, str) or self.chain_mode not in CHAIN_MODES:
            raise ArgumentError(f"chain_mode: expected one of {', '.join(CHAIN_MODES)}, "
                                f"got {describe(self.chain_mode)}")
        for name in ("candidate_chain_passes", "union_top_k"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, check_int(name, value, unit="(or None)"))
        object.__setattr__(self, "block_slots", check_int("block_slots", self.block_slots, unit="of cache slots"))

    @property
    def attend(self) -> Callable:
        """The attention the models run (``fn(q, parts)``), for their ``attention=`` argument."""
        if callable(self.attention):
            return self.attention
        return functools.partial(attend, impl=self.attention, block_slots=self.block_slots)


DEFAULT_OPTIONS = Options()


def check_options(options: Any) -> Options:
    """``options`` as an :class:`Options` (None: the defaults); anything else is an ArgumentError."""
    if options is None:
        return DEFAULT_OPTIONS
    if not isinstance(options, Options):
        raise ArgumentError(f"options: expected a sparkjax.Options (or None), got {describe(options)}")
    return options
