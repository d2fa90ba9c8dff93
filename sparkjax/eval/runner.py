"""The eval's timing protocol: how one batch is timed with every method, and how a run is interrupted.

Timing protocol (per batch of prompts):

1. Warm-up: every method is compiled and run once on a shape (a full run and a prefill-only run) before any
   timed run of it.
2. Timed pass (:func:`sparkjax.bench.timing.interleave`): for repetition r = 1..repeats, every method in turn
   (A B C, A B C) runs (a) the full generation, one jitted loop with no host sync, then (b) a prefill-only run
   of the same compiled program (``max_new_tokens = 1``: prefill, first token, drafter context of the prompt,
   no round), each timed from dispatch to ``jax.block_until_ready``. Method ``auto`` (unless ``fresh_auto``)
   starts repetition r from the memory repetition r of the previous batch of the same size ended with.
3. Decode seconds = median(a) - median(b), the best case min(a) - min(b), the spread (max(a) - min(a)) /
   median(a): prefill, the first token and the prompt part of the first draft pass are excluded, round 1's
   drafter block pass stays in. A difference that is not positive is "not measured" (None), never 0, and is
   left out of TPOT, tok/s and speedup.
4. TPOT = decode seconds / output tokens of the batch (the first included); a method's TPOT is the mean over
   its timed batches; tok/s = 1 / TPOT; speedup = TPOT(ar) / TPOT(method), ar timed in the same run on the
   same batches. The table warns when a spread exceeds 25 % or the load average (sampled between batches)
   exceeds the CPU count.
5. Stage pass (separate, synced, on the first ``stage_samples`` prompts of each set that have a round): the
   engine's instrumented mode, blocking after each stage (draft, tree, verify, commit); warmed up first.

Ctrl-C: under :func:`sigint_flag`, SIGINT only sets a flag, checked before each unit of work (warm-up, timed
run, stage pass): the run stops there and keeps the batches every method had finished. A second Ctrl-C raises
KeyboardInterrupt at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import threading
from typing import Any

import jax

from ..bench.timing import SPREAD_WARNING, interleave
from ..engine.methods import Method
from .engine import BatchOutput, PairRunner


class Stopped(Exception):
    """Raised by :meth:`Interrupt.check` when the Ctrl-C flag is set; the run keeps what it finished."""


class Interrupt:
    """The Ctrl-C flag of a run, set by the SIGINT handler :func:`sigint_flag` installs."""

    requested = False

    def handler(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nCtrl-C: stopping after the current step; the finished batches will be written "
              "(Ctrl-C again to stop at once)", file=sys.stderr, flush=True)

    def check(self) -> None:
        if self.requested:
            raise Stopped


@contextlib.contextmanager
def sigint_flag():
    """Routes SIGINT to an :class:`Interrupt` flag for the block, then restores the previous handler. Reuses
    the flag when one is already installed; outside the main thread Ctrl-C stays a KeyboardInterrupt."""
    current = signal.getsignal(signal.SIGINT)
    if isinstance(getattr(current, "__self__", None), Interrupt):
        yield current.__self__
        return
    flag = Interrupt()
    try:
        signal.signal(signal.SIGINT, flag.handler)
    except ValueError:  # not the main thread
        yield flag
        return
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, current if current is not None else signal.default_int_handler)


class LoadMonitor:
    """Samples the 1-minute load average (where the OS has one) between units of work."""

    def __init__(self) -> None:
        self.samples: list[float] = []

    def sample(self) -> None:
        with contextlib.suppress(AttributeError, OSError):
            self.samples.append(float(os.getloadavg()[0]))

    def block(self, repeats: int) -> dict[str, Any]:
        """The ``setup.timing`` object of results.json."""
        return {"order": "interleaved: per batch, repetition r runs every method in turn (full run, then "
                         "prefill-only)",
                "repeats": repeats,
                "statistics": "median and min over repetitions; spread = (max - min) / median of the full runs",
                "spread_warning": SPREAD_WARNING, "load_average_max": max(self.samples, default=None),
                "load_average_samples": len(self.samples), "cpu_count": os.cpu_count() or 1}


@dataclasses.dataclass
class Timed:
    """One method's timed batch: the outputs, the seconds of each full and prefill-only run, the loop
    iterations of the longest sequence, and the stage pass (None when not run)."""

    output: BatchOutput
    run_seconds: list[float]
    prefill_seconds: list[float]
    iterations: int
    stage: dict[str, Any] | None = None


_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_OPEN = threading.local()  # per thread: its open CompileLogs (JAX reports a compile in the thread that runs it)


def _open_logs() -> list[CompileLog]:
    if not hasattr(_OPEN, "logs"):
        _OPEN.logs = []
    return _OPEN.logs


def _on_event(event: str, seconds: float, **kwargs) -> None:
    if event in _COMPILE_EVENTS:
        for log in _open_logs():
            log.seconds += seconds
            if event == _COMPILE_EVENTS[-1]:
                log.programs.append((str(kwargs.get("fun_name", "?")), float(seconds)))


class CompileLog:
    """What JAX compiled in this thread while it was open (its compile events): ``seconds`` spent tracing,
    lowering and compiling, and ``programs``, the ``(name, backend compile seconds)`` of every XLA program
    compiled (a program the persistent cache served is not compiled, so it is not listed)."""

    _listening = False

    def __init__(self):
        self.seconds = 0.0
        self.programs: list[tuple[str, float]] = []

    def __enter__(self) -> CompileLog:
        if not CompileLog._listening:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            CompileLog._listening = True
        _open_logs().append(self)
        return self

    def __exit__(self, *exc) -> None:
        _open_logs().remove(self)

    def record(self, wall_seconds: float) -> dict[str, Any]:
        """The results.json entry of a warm-up: its wall time, the compile share and the programs, longest first."""
        return {"seconds": wall_seconds, "compile_seconds": self.seconds,
                "programs": [{"name": n, "seconds": s} for n, s in sorted(self.programs, key=lambda p: -p[1])]}


def warm_up(runner: PairRunner, m: Method, batch: list[list[int]], *, seed: int, stages: bool) -> bool:
    """Compiles and runs once everything :func:`time_batch` times for this shape; returns whether the
    instrumented mode got warm too (its stage functions compile only when the batch has a round)."""
    jax.block_until_ready(runner.launch(m, batch, seed))
    jax.block_until_ready(runner.launch(m, batch, seed, prefill_only=True))
    return stages and m.speculative and any(runner.instrumented(m, batch, seed).acceptance_lengths)


def time_batch(units: list[tuple[PairRunner, Method]], batch: list[list[int]], *, seed: int, repeats: int,
               stages: bool, warmed: set, stop: Interrupt) -> dict[Method, Timed]:
    """Times ``batch`` with every ``(runner, method)`` unit by the protocol above. ``warmed`` holds the shapes
    already compiled (updated here). Raises :class:`Stopped` when ``stop`` is set between two units of work
    (the batch is then dropped whole)."""

    def once(key, fn, *args, **kwargs):  # a warm-up of a shape not yet compiled
        if key not in warmed:
            stop.check()
            fn(*args, **kwargs)
            warmed.add(key)

    for runner, m in units:
        once(runner.shape_key(m, batch), warm_up, runner, m, batch, seed=seed, stages=False)
    last: dict[Method, Any] = {}
    reps = {m: 0 for _, m in units}

    def variant(runner, m, kind: str):
        def go():
            stop.check()
            if kind == "prefill":
                return runner.launch(m, batch, seed, prefill_only=True)
            r = reps[m]
            reps[m] += 1
            res = last[m] = runner.launch(m, batch, seed, auto_memory=runner.memory(m, len(batch), r))
            runner.remember(m, len(batch), r, res)
            return res
        return go

    stats = interleave({(m, kind): variant(runner, m, kind) for runner, m in units for kind in ("full", "prefill")},
                       repeats)
    out: dict[Method, Timed] = {}
    for runner, m in units:
        res = runner.outputs(last[m], len(batch))
        if m.speculative:
            iterations = max((len(a) for a in res.acceptance_lengths), default=0)
        else:  # ar: the first token comes from the prefill, then one loop step per token
            iterations = max((len(t) for t in res.tokens), default=1) - 1
        stage = None
        if stages and m.speculative and iterations > 0:  # a batch without a round has no stage to time
            once((runner.shape_key(m, batch), "stages"), runner.instrumented, m, batch, seed)
            stop.check()
            ins = runner.instrumented(m, batch, seed)
            stage = {"seconds": ins.stage_seconds, "rounds": max((len(a) for a in ins.acceptance_lengths), default=0),
                     "acceptance_lengths": ins.acceptance_lengths}
        out[m] = Timed(res, list(stats[m, "full"].samples), list(stats[m, "prefill"].samples), iterations, stage)
    return out


def protocol_text() -> str:
    """The timing protocol above as one paragraph (``setup.protocol`` of results.json)."""
    return " ".join((__doc__ or "").split("Timing protocol", 1)[-1].split("Ctrl-C:", 1)[0].split())
