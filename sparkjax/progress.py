"""Progress lines for the long phases of a start (loading, profiling ``auto``'s costs, compiling): each step is
logged as it begins, with its count and an estimate of the time the phase has left (the mean of the steps so far
times the steps to go)."""

from __future__ import annotations

import logging
import time


class Progress:
    """Logs a phase of ``total`` steps (``unit``: what one step is) on ``logger`` at INFO::

        p = Progress(log, "compiling", 3, "program")
        for name in names:
            p.begin(name)     # "compiling: program 2 of 3 (name); 4.1 s so far, about 4 s left"
            ...
            p.end()
        # at the last end(): "compiling: 3 programs in 12.3 s"

    ``kinds`` (one per step, in order) groups steps of like cost: a step left is estimated at the mean of the
    finished steps of its kind, or of all finished steps while none of its kind has finished.
    """

    def __init__(self, logger: logging.Logger, phase: str, total: int, unit: str, kinds: list | None = None,
                 clock=time.perf_counter):
        self.clock = clock  # seconds (a test passes its own)
        self.log, self.phase, self.total, self.unit = logger, phase, int(total), unit
        self.kinds = list(kinds) if kinds is not None else [None] * self.total
        self.took: list[float] = []  # seconds of each finished step
        self.t0 = self.started = self.clock()

    @property
    def done(self) -> int:
        return len(self.took)

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def left(self) -> float | None:
        """Seconds the phase has left at the pace so far (None before the first step ends)."""
        if not self.took:
            return None
        mean = sum(self.took) / len(self.took)
        by_kind: dict = {}
        for kind, t in zip(self.kinds, self.took, strict=False):
            by_kind.setdefault(kind, []).append(t)
        return sum(sum(by_kind[k]) / len(by_kind[k]) if k in by_kind else mean for k in self.kinds[self.done:])

    def begin(self, what: str) -> None:
        left = self.left()
        pace = "the estimate follows the first" if left is None else \
            f"{self.elapsed():.1f} s so far, about {left:.0f} s left"
        self.log.info("%s: %s %d of %d (%s); %s", self.phase, self.unit, self.done + 1, self.total, what, pace)
        self.started = self.clock()

    def end(self) -> None:
        self.took.append(self.clock() - self.started)
        if self.done == self.total:
            self.log.info("%s: %d %s%s in %.1f s", self.phase, self.total, self.unit, "s" * (self.total != 1),
                          self.elapsed())
