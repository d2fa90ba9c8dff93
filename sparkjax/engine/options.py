"""Trace-time settings of a generation as one frozen, hashable value that the static
:class:`~sparkjax.engine.state.Plan` carries (so part of jit's cache key)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from ..errors import ArgumentError
from ..nn.layers import ATTENTION_IMPLS, BLOCK_SLOTS, attend
from .checks import check_int, describe
from .drafting import CHAIN_MODES

GPU_LOOPS = ("command_buffer", "xla_default")


@dataclasses.dataclass(frozen=True)
class Options:
    """The trace-time settings of a generation (the table is in docs/api.md), each checked on construction (an
    :class:`~sparkjax.errors.ArgumentError` naming it): ``attention`` (an ``impl`` of
    :func:`sparkjax.nn.layers.attend` or a hashable callable with its signature), ``chain_mode``,
    ``candidate_chain_passes``, ``union_top_k`` (None: ``top_c // 4``), ``block_slots`` and ``gpu_loop`` (how
    XLA:GPU runs the programs' loops: :func:`~sparkjax.engine.programs.loop_compiler_options`).
    """

    attention: str | Callable = "auto"
    chain_mode: str = "auto"
    candidate_chain_passes: int | None = 1
    union_top_k: int | None = None
    block_slots: int = BLOCK_SLOTS
    gpu_loop: str = "command_buffer"

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
        if not isinstance(self.gpu_loop, str) or self.gpu_loop not in GPU_LOOPS:
            raise ArgumentError(f"gpu_loop: expected one of {', '.join(GPU_LOOPS)}, got {describe(self.gpu_loop)}")
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
