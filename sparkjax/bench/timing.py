"""The timing protocol of every benchmark: interleaved repetitions of several variants in one process.

    stats = interleave({"a": run_a, "b": run_b}, reps=5)   # a b a b ... (warm the variants up first)
    stats["a"].median, stats["a"].min, stats["a"].spread

A sample is ``measure(fn)`` (default :func:`wall`), never clamped; ``deadline`` stops starting repetitions once
every variant has ``min_reps`` samples; Ctrl-C raises :class:`Interrupted` holding the :class:`Stats` so far.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax

SPREAD_WARNING = 0.25  # (max - min) / median above this is worth a warning


@dataclasses.dataclass(frozen=True)
class Stats:
    """``median``, ``min``, ``max`` and ``spread = (max - min) / median`` (None when the median is not positive)
    of one variant's ``samples`` (in measured order)."""

    median: float
    min: float
    max: float
    spread: float | None
    samples: tuple[float, ...]

    @classmethod
    def of(cls, samples) -> Stats:
        xs = tuple(float(x) for x in samples)
        if not xs:
            raise ValueError("Stats of no samples")
        med = statistics.median(xs)
        return cls(med, min(xs), max(xs), (max(xs) - min(xs)) / med if med > 0 else None, xs)

    @property
    def n(self) -> int:
        return len(self.samples)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`interleave`; ``partial`` maps each variant measured at least once to its Stats."""

    def __init__(self, partial: dict[str, Stats]):
        super().__init__("interrupted")
        self.partial = partial


def wall(fn: Callable[[], Any]) -> float:
    """Seconds of one call of ``fn``, its result synced with ``jax.block_until_ready``."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def interleave(variants: dict[str, Callable[[], Any]], reps: int, *, measure: Callable[[Callable[[], Any]], float]
               = wall, deadline: float | None = None, min_reps: int = 1) -> dict[str, Stats]:
    """``{name: Stats}`` of ``reps`` interleaved repetitions of every variant (see the module docstring)."""
    if reps < 1 or not variants:
        raise ValueError("interleave needs at least one variant and one repetition")
    samples: dict[str, list[float]] = {k: [] for k in variants}
    try:
        for r in range(reps):
            if deadline is not None and r >= min_reps and time.perf_counter() > deadline:
                break
            for name, fn in variants.items():
                samples[name].append(float(measure(fn)))
    except KeyboardInterrupt:
        raise Interrupted({k: Stats.of(v) for k, v in samples.items() if v}) from None
    return {k: Stats.of(v) for k, v in samples.items()}


def load_warning() -> str | None:
    """One line when the 1-minute load average exceeds this machine's cores, else None."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores:
        return f"load average {load:.1f} on {cores} cores: other processes compete, timings are noisy"
    return None
