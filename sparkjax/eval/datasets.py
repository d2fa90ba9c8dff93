"""Prompt sets: the bundled JSONL files in ``eval/datasets/`` and user JSONL files.

A prompt set is a JSONL file with one JSON object per line and a ``turns`` field: a
non-empty list of strings (the user turns of a conversation). The harness uses the
first turn of each line. Blank lines are skipped; anything else that is not such an
object is an error naming the file and the line number.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

from .errors import DatasetError

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUNDLED_DIR = ROOT / "eval" / "datasets"
BUNDLED = ("gsm8k", "humaneval", "math500", "mbpp", "mt-bench")


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """A prompt set: its display ``name``, its file, and its prompts (first turns) with their line numbers."""

    name: str
    path: str
    prompts: tuple[str, ...]
    lines: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.prompts)


def is_path(spec: str) -> bool:
    return spec.endswith((".jsonl", ".json")) or os.sep in spec or "/" in spec or os.path.exists(spec)


def resolve(spec: str) -> tuple[str, str]:
    """A ``--datasets`` entry (a bundled name or a JSONL path) -> (display name, file path)."""
    spec = spec.strip()
    if not spec:
        raise DatasetError("--datasets: empty entry")
    if spec in BUNDLED and not os.path.exists(spec):
        path = BUNDLED_DIR / f"{spec}.jsonl"
        if not path.is_file():
            raise DatasetError(
                f"--datasets: bundled set {spec!r} not found at {path} (the bundled sets live in the source "
                "checkout's eval/datasets/; pass the path of a JSONL file instead)"
            )
        return spec, str(path)
    if is_path(spec):
        return pathlib.Path(spec).stem, spec
    raise DatasetError(
        f"--datasets: {spec!r} is neither a bundled set ({', '.join(BUNDLED)}) nor a .jsonl file path"
    )


def load(spec: str) -> PromptSet:
    """Reads and validates a whole prompt set (every line, even when fewer samples are used)."""
    name, path = resolve(spec)
    if not os.path.exists(path):
        raise DatasetError(f"{path}: dataset file not found")
    if os.path.isdir(path):
        raise DatasetError(f"{path}: is a folder, expected a JSONL file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DatasetError(f"{path}: cannot read ({e.strerror or e})") from None
    prompts: list[str] = []
    lines: list[int] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{number}: malformed JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict) or "turns" not in row:
            raise DatasetError(f"{path}:{number}: expected a JSON object with a 'turns' field (a list of strings)")
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise DatasetError(f"{path}:{number}: 'turns' must be a non-empty list of strings")
        if not turns[0].strip():
            raise DatasetError(f"{path}:{number}: the first turn is empty")
        prompts.append(turns[0])
        lines.append(number)
    if not prompts:
        raise DatasetError(f"{path}: no prompts (the file is empty)")
    return PromptSet(name, str(path), tuple(prompts), tuple(lines))


def load_all(specs: list[str] | tuple[str, ...]) -> list[PromptSet]:
    sets = [load(s) for s in specs]
    names = [s.name for s in sets]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise DatasetError(f"--datasets: two prompt sets are both named {dupes[0]!r}; rename one of the files")
    return sets
