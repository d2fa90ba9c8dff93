"""Progress lines for the long phases of a start (loading, profiling ``auto``'s costs, compiling): each step is
logged as it begins, with its count and an estimate of the time the phase has left (the mean of the steps so far
times the steps to go); and :func:`run_threads`, which runs a phase's steps a few at a time."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

_NEXT = object()  # begin()'s default kind: the next of ``kinds``


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

    ``workers`` > 1: that many steps run at once, from threads. ``begin(what, kind=)`` then names the step's kind
    (steps may begin in any order) and returns a token for ``end(token)``; the time left is the estimated work of
    the steps not begun, plus what the running ones have left, divided by ``workers``, and each step's time is its
    own wall time (while others ran beside it).
    """

    def __init__(self, logger: logging.Logger, phase: str, total: int, unit: str, kinds: list | None = None,
                 clock=time.perf_counter, workers: int = 1):
        self.clock = clock  # seconds (a test passes its own)
        self.log, self.phase, self.total, self.unit = logger, phase, int(total), unit
        self.kinds = list(kinds) if kinds is not None else [None] * self.total
        self.workers = max(1, int(workers))
        self.took: list[float] = []  # seconds of each finished step
        self._took_kinds: list = []  # the kind of each finished step
        self._begun: list = []  # the kind of each step begun
        self._running: dict[int, tuple[Any, float]] = {}  # token: (kind, start) of the steps running
        self._lock = threading.Lock()
        self.t0 = self.started = self.clock()

    @property
    def done(self) -> int:
        return len(self.took)

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def left(self) -> float | None:
        """Seconds the phase has left at the pace so far (None before the first step ends)."""
        with self._lock:
            return self._left()

    def _left(self) -> float | None:
        if not self.took:
            return None
        mean = sum(self.took) / len(self.took)
        by_kind: dict = {}
        for kind, t in zip(self._took_kinds, self.took, strict=True):
            by_kind.setdefault(kind, []).append(t)

        def estimate(kind) -> float:
            return sum(by_kind[kind]) / len(by_kind[kind]) if kind in by_kind else mean

        pending = list(self.kinds)  # the steps not begun yet
        for kind in self._begun:
            if kind in pending:
                pending.remove(kind)
        now = self.clock()
        work = sum(map(estimate, pending)) + sum(max(0.0, estimate(k) - (now - t)) for k, t in self._running.values())
        return work / self.workers

    def begin(self, what: str, kind: Any = _NEXT) -> int:
        """Logs the step ``what`` as it begins (``kind``: its kind, default the next one of ``kinds``); returns
        the token of :meth:`end`."""
        with self._lock:
            left = self._left()
            pace = "the estimate follows the first" if left is None else \
                f"{self.elapsed():.1f} s so far, about {left:.0f} s left"
            number = len(self._begun) + 1
            self.log.info("%s: %s %d of %d (%s); %s", self.phase, self.unit, number, self.total, what, pace)
            if kind is _NEXT:
                kind = self.kinds[len(self._begun)] if len(self._begun) < len(self.kinds) else None
            self._begun.append(kind)
            self.started = self.clock()
            self._running[number] = (kind, self.started)
        return number

    def end(self, token: int | None = None) -> None:
        """Ends the step of ``token`` (default: the last one begun)."""
        with self._lock:
            kind, started = self._running.pop(max(self._running) if token is None else token)
            self.took.append(self.clock() - started)
            self._took_kinds.append(kind)
            if self.done == self.total:
                at_once = f" ({self.workers} at a time)" if self.workers > 1 else ""
                self.log.info("%s: %d %s%s in %.1f s%s", self.phase, self.total, self.unit, "s" * (self.total != 1),
                              self.elapsed(), at_once)


def run_threads(fn: Callable[..., Any], items: Iterable[Any], workers: int, name: str) -> None:
    """``fn(*item)`` for every tuple of ``items``, ``workers`` at a time on threads named ``name`` (XLA compiles
    with the GIL released); the first exception is raised once the steps already running end, and the steps not
    yet begun are dropped."""
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=name) as ex:
        futures = [ex.submit(fn, *item) for item in items]
        try:
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            raise
