"""The one training loop: :func:`fit` runs a :class:`Task` (the drafter's, the target LM's) into a folder.

For every task: the output folder and export destinations are checked before any work and the folder is locked
(:mod:`.outdir`); resume restores the newest good checkpoint after :func:`check_config`; ``config.json`` and
``metrics.jsonl`` (one JSON object per logged step; TensorBoard scalars when asked for) are written; held-out
evaluation every ``eval_every`` steps, checkpoints every ``checkpoint_every`` steps and at the end; ``stop_at``,
``max_minutes``, SIGINT or SIGTERM save a checkpoint after the current step and return (``stopped_early``; a
second signal raises ``KeyboardInterrupt``); a complete run ends with the task's exports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import CheckpointError, TrainingError
from ..io.atomic import atomic_file
from ..io.checkpoint import TrainCheckpointer
from .outdir import RunLock, check_overwritable, drop_metrics_after, prepare_output

FORMAT_VERSION = 1


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """The loop's part of a run config; ``operational`` keys may differ when resuming, ``fixed`` ones may not
    differ even with ``force_resume``."""

    steps: int
    log_every: int = 10
    eval_every: int = 100
    checkpoint_every: int = 100
    keep_last: int = 3
    keep_best: int = 0
    async_checkpoint: bool = False
    tensorboard: bool = False
    tokens_per_step: int = 0
    operational: frozenset[str] = frozenset()
    fixed: frozenset[str] = frozenset()


class Task:
    """What :func:`fit` trains: built empty, :meth:`build` loads models and data.

    ``best``: ``(checkpoint metric, eval metric, "max" | "min")`` the checkpoints record (None: no best);
    ``eval_inline``: eval metrics go into the train record as ``eval_<name>`` (else a record of their own).
    """

    best: tuple[str, str, str] | None = None
    eval_inline: bool = False

    def settings(self, config) -> LoopSettings:
        raise NotImplementedError

    def export_paths(self, config, output_dir: str) -> list[str]:
        """Folders the run exports to at its end (checked before any work)."""
        return []

    def build(self, config, output_dir: str, log: Callable[[str], None]) -> None:
        """Models, data and the initial train state."""
        raise NotImplementedError

    def abstract_state(self):
        """The train state's ``jax.ShapeDtypeStruct`` tree (with shardings) to restore into."""
        raise NotImplementedError

    def restore(self, step: int, state, meta: dict[str, Any], where: str, force_resume: bool, log) -> str:
        """Takes a restored checkpoint; returns the line to log."""
        raise NotImplementedError

    def step(self, index: int) -> Any:
        """Optimizer step number ``index`` (0-based); returns its (device) outputs."""
        raise NotImplementedError

    def train_metrics(self, outputs: list[Any]) -> dict[str, Any]:
        """Host metrics (at least ``loss``) of the steps since the last record."""
        raise NotImplementedError

    def evaluate(self) -> dict[str, Any] | None:
        """Held-out metrics, or None without held-out data."""
        return None

    def checkpoint(self) -> tuple[Any, dict[str, Any]]:
        """``(state, meta)`` for a checkpoint of the current step."""
        raise NotImplementedError

    def export(self, ckpt: TrainCheckpointer, output_dir: str, log: Callable[[str], None]) -> dict[str, str]:
        """The exports of a complete run: ``{name: folder}``."""
        return {}


@dataclasses.dataclass
class RunResult:
    output_dir: str
    step: int
    history: list[dict[str, Any]]
    last_eval: dict[str, Any] | None
    drafter_dir: str | None = None
    best_dir: str | None = None
    resumed_from: int | None = None
    stopped_early: bool = False
    wall_s: float = 0.0
    tokens_seen: int = 0
    exports: dict[str, str] = dataclasses.field(default_factory=dict)


def check_config(saved: dict[str, Any] | None, current: dict[str, Any], where: str, force: bool, log,
                 settings: LoopSettings) -> None:
    """Refuses to resume with a config other than the checkpoint's, unless ``force`` (and then only when none of
    the ``fixed`` keys changed)."""
    saved, current = saved or {}, json.loads(json.dumps(current))
    diff = [f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in sorted(set(saved) | set(current))
            if k not in settings.operational and saved.get(k) != current.get(k)]
    if not diff:
        return
    msg = f"{where}: the checkpoint was written with another config ({'; '.join(diff)})"
    fixed = sorted(k for k in settings.fixed if saved.get(k) != current.get(k))
    if fixed:
        raise TrainingError(msg + f"; {', '.join(fixed)} cannot change in a resumed run (use a new folder)")
    if not force:
        raise TrainingError(msg + "; refusing to resume (pass --force-resume to continue with the new config)")
    log(f"warning: {msg}; continuing because of --force-resume")


class MetricsWriter:
    """Appends JSON lines to ``metrics.jsonl`` (and TensorBoard scalars when available)."""

    def __init__(self, output_dir: str, *, resume_step: int, tensorboard: bool):
        self.path = os.path.join(output_dir, "metrics.jsonl")
        drop_metrics_after(self.path, resume_step)
        self._tb = _tensorboard_writer(os.path.join(output_dir, "tensorboard")) if tensorboard else None

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            prefix = record.get("split", "train")
            for k, v in record.items():
                if isinstance(v, int | float) and k != "step":
                    self._tb.add_scalar(f"{prefix}/{k}", v, record["step"])
                elif isinstance(v, list) and k == "accept_rate":
                    for i, x in enumerate(v):
                        self._tb.add_scalar(f"{prefix}/accept_rate@{i}", x, record["step"])

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def _tensorboard_writer(folder: str):
    try:
        from tensorboardX import SummaryWriter  # type: ignore[import-not-found]
    except ImportError:
        try:
            import tensorboard  # noqa: F401  # type: ignore[import-not-found]
            from torch.utils.tensorboard import SummaryWriter  # type: ignore[import-not-found]
        except ImportError:
            return None
    return SummaryWriter(folder)


def _jsonable(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v.tolist() if isinstance(v, np.ndarray) else v.item() if isinstance(v, np.generic) else v
            for k, v in metrics.items()}


class StopSignals:
    """SIGINT / SIGTERM ask the loop to stop after the current step (it saves a checkpoint); a second signal
    raises ``KeyboardInterrupt`` at once. Installed only in the main thread; the previous handlers come back."""

    def __init__(self, log: Callable[[str], None]):
        self.log = log
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum
        self.log(f"{signal.Signals(signum).name}: stopping after this step (saving a checkpoint); "
                 "send it again to stop at once")

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(ValueError, OSError):
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(sig, handler)
        self._previous.clear()


def fit(task: Task, config, output_dir: str, *, resume: bool = False, force_resume: bool = False,
        max_minutes: float | None = None, stop_at: int | None = None, progress: bool = False,
        log: Callable[[str], None] = _stderr, on_step: Callable[[int, bool], None] | None = None) -> RunResult:
    """Runs (or resumes) ``task`` with ``config`` (which has ``to_dict()``) into ``output_dir``.

    ``on_step(step, saved)`` is called after every step. ``stop_at`` / ``max_minutes`` end the loop at that step
    / after that time, saving a checkpoint and skipping the exports, as SIGINT / SIGTERM do."""
    if max_minutes is not None and (isinstance(max_minutes, bool) or not isinstance(max_minutes, int | float)
                                    or not max_minutes >= 0):
        raise TrainingError(f"max_minutes: expected a number >= 0, got {max_minutes!r}")
    if stop_at is not None and (isinstance(stop_at, bool) or not isinstance(stop_at, int) or stop_at < 0):
        raise TrainingError(f"stop_at: expected a step number >= 0, got {stop_at!r}")
    settings = task.settings(config)
    output_dir = prepare_output(output_dir)
    with RunLock(output_dir):  # one run per folder; released on return, on an error, or by the OS on a kill
        for path in task.export_paths(config, output_dir):  # refused now, not after the whole run
            check_overwritable(path, "export folder")
        best_name, _, best_mode = task.best or ("eval_best", "", "max")
        ckpt = TrainCheckpointer(os.path.join(output_dir, "checkpoints"), keep_last=settings.keep_last,
                                 keep_best=settings.keep_best if task.best else 0, best_metric=best_name,
                                 best_mode=best_mode, async_save=settings.async_checkpoint, log=log)
        try:
            return _Run(task, config, settings, output_dir, ckpt, log).run(
                resume, force_resume, max_minutes, stop_at, progress, on_step)
        finally:
            ckpt.close()


class _Run:
    def __init__(self, task: Task, config, settings: LoopSettings, output_dir: str, ckpt: TrainCheckpointer, log):
        self.task, self.config, self.s, self.output_dir, self.ckpt, self.log = task, config, settings, output_dir, \
            ckpt, log
        self.best: float | None = None
        self.wall0 = 0.0
        self.t0 = time.perf_counter()

    def wall(self) -> float:
        return self.wall0 + time.perf_counter() - self.t0

    def _resume(self, resume: bool, force: bool) -> tuple[int, int | None]:
        ckpt, cfg = self.ckpt, self.config.to_dict()
        existing = ckpt.steps()
        if existing and not resume:
            raise TrainingError(f"{self.output_dir}: holds checkpoints up to step {existing[-1]}; pass --resume to "
                                "continue or choose a new --output")
        newest = None
        if existing:  # refused early, before any model is loaded, when the newest checkpoint's config differs
            try:
                newest = ckpt.read_meta(existing[-1])
            except CheckpointError:
                newest = None  # damaged: the restore moves it aside, falls back, and its config is checked below
            if newest is not None:
                check_config(newest.get("config"), cfg, ckpt.step_dir(existing[-1]), force, self.log, self.s)
        elif resume:
            self.log(f"resume: no checkpoint in {ckpt.directory}; starting from step 0")
        self.task.build(self.config, self.output_dir, self.log)
        if not existing:
            return 0, None
        step, state, meta = ckpt.restore(self.task.abstract_state())
        if newest is None or step != existing[-1]:
            check_config(meta.get("config"), cfg, ckpt.step_dir(step), force, self.log, self.s)
        self.log(self.task.restore(step, state, meta, ckpt.step_dir(step), force, self.log))
        if self.task.best:
            self.best = (meta.get("metrics") or {}).get(f"best_{self.task.best[0]}")
        self.wall0 = float(meta.get("wall_s", 0.0))
        return step, step

    def save(self, step: int, evaluated: dict[str, Any] | None) -> None:
        metrics: dict[str, float] = {}
        if self.task.best:
            name, key, _ = self.task.best
            if self.best is not None:
                metrics[f"best_{name}"] = self.best
            if evaluated is not None and evaluated.get(key) is not None:
                metrics[name] = evaluated[key]
        state, extra = self.task.checkpoint()
        meta = {"format": FORMAT_VERSION, "config": self.config.to_dict(), **extra, "wall_s": self.wall(),
                "tokens_seen": step * self.s.tokens_per_step, "time": time.time()}
        self.ckpt.save(step, state, meta, metrics)
        if not self.s.async_checkpoint:
            self.ckpt.wait()

    def _evaluate(self, step: int, rec: dict | None) -> tuple[dict | None, dict | None]:
        """Held-out metrics of ``step`` (merged into ``rec`` for an ``eval_inline`` task): ``(metrics, eval record
        or None)``; the best metric is updated."""
        task = self.task
        evaluated = task.evaluate()
        if evaluated is None:
            return None, None
        evaluated = _jsonable(evaluated)
        if task.best:
            value = evaluated[task.best[1]]
            if self.best is None or (value > self.best if task.best[2] == "max" else value < self.best):
                self.best = value
        if task.eval_inline and rec is not None:
            rec.update({f"eval_{k}": v for k, v in evaluated.items()})
            return evaluated, None
        return evaluated, {"step": step, "split": "eval", **evaluated}

    def _show(self, rec: dict | None, eval_rec: dict | None, bar) -> None:
        if rec is not None and bar is not None:
            bar.set_postfix({k: f"{rec[k]:.4g}" for k in ("loss", "tau_probabilistic", "lr")
                             if isinstance(rec.get(k), float)})
        elif rec is not None:  # one line of the scalars (the full record is in metrics.jsonl)
            self.log(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in rec.items()
                                 if not isinstance(v, list)}))
        if eval_rec is not None:
            shown = ", ".join(f"{k} {v:.4f}" for k, v in eval_rec.items() if isinstance(v, float))
            best = f" (best {self.task.best[1]} {self.best:.4f})" if self.task.best and self.best is not None else ""
            self.log(f"eval step {eval_rec['step']}: {shown}{best}")

    def run(self, resume, force, max_minutes, stop_at, progress, on_step) -> RunResult:
        s, task = self.s, self.task
        start, resumed_from = self._resume(resume, force)
        with atomic_file(os.path.join(self.output_dir, "config.json")) as tmp, open(tmp, "w") as f:
            json.dump(self.config.to_dict(), f, indent=2)
        writer = MetricsWriter(self.output_dir, resume_step=start, tensorboard=s.tensorboard)
        end = s.steps if stop_at is None else min(s.steps, stop_at)
        history: list[dict[str, Any]] = []
        last_eval = bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=s.steps, initial=start, desc=getattr(self.config, "name", None), dynamic_ncols=True,
                       file=sys.stderr)
        step, stopped, pending = start, False, []
        self.t0 = time.perf_counter()
        t_window, steps_window = self.t0, 0
        try:
            with StopSignals(self.log) as signals:
                while step < end:
                    pending.append(task.step(step))
                    step += 1
                    steps_window += 1
                    stop = step < end and (signals.received is not None or (
                        max_minutes is not None and time.perf_counter() - self.t0 > 60 * max_minutes))
                    eval_due = step % s.eval_every == 0 or step == s.steps
                    rec = evaluated = eval_rec = None
                    if step % s.log_every == 0 or step == end or stop or (task.eval_inline and eval_due):
                        now = time.perf_counter()
                        metrics = task.train_metrics(pending)
                        pending = []
                        if not math.isfinite(metrics["loss"]):
                            raise TrainingError(f"step {step}: the training loss is {metrics['loss']} "
                                                "(lower the learning rate?)")
                        rec = {"step": step, "split": "train", **_jsonable(metrics),
                               "tokens_per_s": steps_window * s.tokens_per_step / max(now - t_window, 1e-9),
                               "wall_s": round(self.wall(), 1)}
                        t_window, steps_window = now, 0
                    if eval_due:
                        evaluated, eval_rec = self._evaluate(step, rec)
                        if evaluated is not None:
                            last_eval = {"step": step, "split": "eval", **evaluated}
                    for r in (rec, eval_rec):
                        if r is not None:
                            writer.write(r)
                            history.append(r)
                    self._show(rec, eval_rec, bar)
                    saved = step % s.checkpoint_every == 0 or step == end or stop
                    if saved:
                        self.save(step, evaluated)
                    if bar is not None:
                        bar.update(1)
                    if on_step is not None:
                        on_step(step, saved)
                    if not stop and step < end and signals.received is not None:  # a signal during on_step
                        if not saved:
                            self.save(step, evaluated)
                        stop = True
                    if stop:
                        stopped = True
                        why = "a signal" if signals.received is not None else f"{max_minutes} minutes"
                        self.log(f"stopped after {why} at step {step} (checkpoint saved); --resume continues")
                        break
        finally:
            if bar is not None:
                bar.close()
            writer.close()
        self.ckpt.wait()
        exports = {}
        if not stopped and end == s.steps:
            exports = task.export(self.ckpt, self.output_dir, self.log)
        elif end < s.steps:
            stopped = True
        return RunResult(self.output_dir, step, history, last_eval, exports.get("drafter"), exports.get("best_drafter"),
                         resumed_from, stopped, self.wall(), step * s.tokens_per_step, exports)
