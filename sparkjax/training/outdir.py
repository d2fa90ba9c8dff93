"""The training output folder: checks before any work (:func:`prepare_output`), the run lock (:class:`RunLock`),
exports through ``atomic_dir`` under the overwrite rule, and metrics hygiene after a resume."""

from __future__ import annotations

import contextlib
import json
import os

from ..errors import TrainingError
from ..io.atomic import MARKER, atomic_dir, atomic_file, check_destination  # noqa: F401 - MARKER: for the trainers
from ..io.hf import save_drafter

LOCK_NAME = ".sparkjax-lock"


def _why(e: OSError) -> str:
    return e.strerror or type(e).__name__


RUN_FILES = ("config.json", "metrics.jsonl")  # files a run (re)writes at the top of its folder


def prepare_output(path, what: str = "output folder") -> str:
    """Creates ``path`` if needed and checks it is a writable folder; returns its absolute path.

    An existing folder that holds ``config.json`` or ``metrics.jsonl`` but is not a training run
    folder (no run lock file, no ``checkpoints/``) is refused: the run would overwrite those files."""
    if isinstance(path, bool) or not isinstance(path, str | os.PathLike) or not str(os.fspath(path)).strip():
        raise TrainingError(f"{what}: expected a folder path, got {path!r}")
    out = os.path.abspath(os.fspath(path))
    if os.path.lexists(out) and not os.path.isdir(out):
        raise TrainingError(f"{what} {out} exists and is not a folder (a file?); choose another path")
    if os.path.isdir(out) and not any(os.path.lexists(os.path.join(out, n)) for n in (LOCK_NAME, "checkpoints")):
        theirs = [n for n in RUN_FILES if os.path.lexists(os.path.join(out, n))]
        if theirs:
            raise TrainingError(f"{what} {out} is not a training run folder but holds {theirs[0]}, which a run "
                                "would overwrite; choose a new or empty folder")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:  # a parent that is a file, no permission, a read-only file system
        raise TrainingError(f"{what} {out} cannot be created ({_why(e)})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise TrainingError(f"{what} {out} is not writable")
    return out


class RunLock:
    """One run per output folder: an exclusive ``flock`` on ``OUTPUT/.sparkjax-lock``, released by :meth:`release`,
    on exit or by the OS when the process ends; a second run into the folder gets a :class:`TrainingError`."""

    def __init__(self, output_dir: str, what: str = "output folder"):
        import fcntl

        self.output_dir = os.path.abspath(output_dir)
        self.path = os.path.join(self.output_dir, LOCK_NAME)
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise TrainingError(f"{what} {self.output_dir} is not writable ({_why(e)})") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = ""
            with contextlib.suppress(OSError, ValueError):
                pid = int(os.pread(self._fd, 32, 0).decode().strip() or "x")
                holder = f" (process {pid})"
            os.close(self._fd)
            self._fd = None
            raise TrainingError(f"{what} {self.output_dir} is in use by another training run{holder}; wait for it "
                                "to end or choose another --output") from None
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def check_overwritable(path, what: str = "export folder") -> str:
    """Returns ``path`` (absolute) if an export may write there (:func:`sparkjax.io.atomic.check_destination`)."""
    return check_destination(path, overwrite=True, what=what)


def save_into(folder: str, save, model, **kw) -> None:
    """Writes ``model`` with a sparkjax saver (``save_drafter`` / ``save_target``: each writes a new folder
    through ``atomic_dir``) into ``folder``, an export being built inside an ``atomic_dir`` of its own."""
    inner = os.path.join(folder, ".model")
    save(model, inner, **kw)
    for name in os.listdir(inner):
        os.replace(os.path.join(inner, name), os.path.join(folder, name))  # within the export's temp folder
    os.rmdir(inner)


def export_drafter(drafter, out: str, *, dtype=None, what: str = "export folder") -> str:
    """Writes ``drafter`` (DeepSpec format) to ``out`` through ``atomic_dir``, refusing a folder it may not replace."""
    out = check_overwritable(out, what)
    with atomic_dir(out, overwrite=True) as tmp:
        save_into(tmp, save_drafter, drafter, dtype=dtype)
    return out


def drop_metrics_after(path: str, step: int) -> int:
    """Keeps the lines of ``metrics.jsonl`` with ``step <= step`` (and drops lines cut by a kill);
    returns how many lines were dropped. The file is rewritten atomically."""
    if not os.path.exists(path):
        return 0
    keep, dropped = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
                ok = int(rec.get("step", 0)) <= step
            except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
                ok = False  # a line cut by a kill
            if ok:
                keep.append(json.dumps(rec))
            else:
                dropped += 1
    if dropped:
        with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(k + "\n" for k in keep))
    return dropped

