"""What a run returns and writes: :class:`EvalResults`, read back from and saved to an output folder.

Each of :data:`OUTPUT_FILES` is written atomically; those an earlier run left that this run does not write are
removed, and no other file is touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import tempfile
from typing import Any

from ..config import read_json
from ..errors import EvalError
from . import report
from .plots import make_plots
from .records import Record, Row, Sweep, SweepRow

OUTPUT_FILES = ("results.json", "results.csv", "acceptance_per_depth.png", "tau_speedup.png", "stage_time.png",
                "batch_sweep.csv", "throughput_vs_batch.png")
FORMAT = "sparkjax.eval/1"


def _check_rows(path, rows, where: str, keys: tuple[tuple[str, type], ...]) -> None:
    """EvalError naming ``path`` unless every row is an object whose ``keys`` have their types."""
    for i, row in enumerate(rows):
        if not (isinstance(row, dict) and all(type(row.get(k)) is t for k, t in keys)):
            names = " and ".join(f"'{k}'" for k, _ in keys)
            raise EvalError(f"{path}: {where}[{i}] is not a {where.split('.')[0]} row (an object with {names})")


@dataclasses.dataclass
class EvalResults:
    """Everything a run measured: ``summary`` (a :class:`Row` per (dataset, method), plus ``all`` rows),
    ``records`` (a :class:`Record` per (batch, method)), ``sweep`` (the batch-size sweep, else None), the
    config, setup and environment, notes, and whether Ctrl-C cut the run short (``interrupted``)."""

    config: dict[str, Any]
    setup: dict[str, Any]
    environment: dict[str, Any]
    summary: list[Row]
    records: list[Record]
    interrupted: bool = False
    notes: list[str] = dataclasses.field(default_factory=list)
    wall_seconds: float = 0.0
    sweep: Sweep | None = None

    @property
    def sweep_rows(self) -> list[SweepRow]:
        """The sweep's rows, one per (batch size, method); [] without a sweep."""
        return list(self.sweep.rows) if self.sweep is not None else []

    def rows(self, dataset: str | None = None) -> list[Row]:
        return [r for r in self.summary if dataset is None or r.dataset == dataset]

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "config": self.config, "setup": self.setup, "environment": self.environment,
                "summary": [r.to_dict() for r in self.summary], "records": [r.to_dict() for r in self.records],
                "interrupted": self.interrupted, "notes": self.notes, "wall_seconds": self.wall_seconds,
                "sweep": None if self.sweep is None else self.sweep.to_dict()}

    @classmethod
    def load(cls, path: str | os.PathLike) -> EvalResults:
        """Reads a ``results.json`` (EvalError naming the file when it is not one)."""
        try:
            d = read_json(path, EvalError, "results file")
        except EvalError:
            raise
        except (RecursionError, ValueError, OSError) as e:
            raise EvalError(f"{path}: cannot read JSON ({type(e).__name__})") from None
        if not isinstance(d.get("summary"), list) or not isinstance(d.get("config"), dict):
            raise EvalError(f"{path}: not a sparkjax.eval results.json (no 'summary' list / 'config' object)")
        _check_rows(path, d["summary"], "summary", (("dataset", str), ("label", str)))
        for key, kind in (("setup", dict), ("environment", dict), ("records", list), ("notes", list)):
            if key in d and not isinstance(d[key], kind):
                raise EvalError(f"{path}: '{key}' must be a JSON {'object' if kind is dict else 'list'}")
        sweep = d.get("sweep")
        if sweep is not None:
            if not isinstance(sweep, dict) or not isinstance(sweep.get("rows", []), list):
                raise EvalError(f"{path}: 'sweep' must be a JSON object with a 'rows' list")
            _check_rows(path, sweep.get("rows", []), "sweep.rows", (("batch_size", int), ("label", str)))
        try:
            return cls(config=d["config"], setup=d.get("setup", {}), environment=d.get("environment", {}),
                       summary=[Row.from_dict(r) for r in d["summary"]],
                       records=[Record.from_dict(r) for r in d.get("records", [])],
                       interrupted=bool(d.get("interrupted", False)), notes=list(d.get("notes", [])),
                       wall_seconds=d.get("wall_seconds", 0.0),
                       sweep=None if sweep is None else Sweep.from_dict(sweep))
        except (TypeError, AttributeError) as e:
            raise EvalError(f"{path}: malformed record or row ({e})") from None

    def table(self) -> str:
        return report.format_table(self)

    def to_dataframe(self):
        """The summary as a pandas DataFrame (one row per dataset and method; needs pandas)."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("EvalResults.to_dataframe() needs pandas, which is not installed (pip install pandas); "
                              "EvalResults.summary holds the same rows") from None
        return pd.DataFrame([report.flat_row(r, self.setup) for r in self.summary])

    def save(self, out: str | os.PathLike, *, plots: bool = True) -> list[str]:
        """Writes results.json, the CSV and (with ``plots``) the PNG plots into ``out``; returns the paths.
        Removes the :data:`OUTPUT_FILES` of an earlier run that this one does not write, nothing else."""
        folder = check_out(out)
        paths: list[pathlib.Path] = []
        try:
            paths.append(report.write_json(self, folder / "results.json"))
            if self.summary or self.sweep is None:  # a sweep run has no per-set summary: batch_sweep.csv instead
                paths.append(report.write_csv(self, folder / "results.csv"))
            if self.sweep is not None:
                paths.append(report.write_sweep_csv(self, folder / "batch_sweep.csv"))
            if plots and (self.summary or self.sweep_rows):
                try:
                    make_plots(self, folder, written=paths)
                except ImportError:
                    self.notes.append("plots skipped: matplotlib is not installed (pip install matplotlib)")
                except OSError:
                    raise
                except Exception as e:  # noqa: BLE001 - a plotting failure must not lose the results
                    self.notes.append(f"plots incomplete: {type(e).__name__}: {e}")
        except OSError as e:
            raise EvalError(f"--out: cannot write to {folder} ({e.strerror or e})") from None
        for name in OUTPUT_FILES:  # an earlier run's outputs this run did not write
            stale = folder / name
            if stale not in paths and stale.is_file() and not stale.is_symlink():
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()
        return [str(p) for p in paths]


def check_out(out: str | os.PathLike) -> pathlib.Path:
    """Creates ``out`` (and its parents) and proves it writable with a probe file, which is removed;
    EvalError naming the folder otherwise. Called before any work, so a bad --out loses nothing."""
    if str(out) == "":
        raise EvalError("--out: empty path")
    folder = pathlib.Path(out)
    if folder.exists() and not folder.is_dir():
        raise EvalError(f"--out: {folder} exists and is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".sparkjax-eval-probe-", dir=folder)
        try:
            os.write(fd, b"probe")
        finally:
            os.close(fd)
            os.remove(probe)
    except OSError as e:
        raise EvalError(f"--out: cannot write to {folder} ({e.strerror or e})") from None
    return folder
