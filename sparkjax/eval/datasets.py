"""Prompt sets: JSONL files, one object per line, ``{"turns": [...]}`` (the first turn, through the chat
template) or ``{"text": "..."}`` (encoded as is); other keys ignored, blank lines skipped, anything else a
DatasetError naming file and line. :data:`DEMO_SETS` ship in the package; :data:`EVAL_SETS` are looked up in
``$SPARKJAX_EVAL_DATASETS``, else ``./eval/datasets``; a JSONL path always works.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

from .. import demo
from ..errors import DatasetError

ENV_VAR = "SPARKJAX_EVAL_DATASETS"  # a folder holding the EVAL_SETS files (default: ./eval/datasets)
DEMO_SETS = demo.PROMPT_SETS  # in the package: sparkjax/assets/demo/prompts
EVAL_SETS = ("gsm8k", "humaneval", "math500", "mbpp", "mt-bench")  # in the source checkout: eval/datasets
DEFAULT = DEMO_SETS


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """A prompt set: its display ``name``, its file, and its prompts (first turn or raw text) with their line
    numbers and kinds (``"chat"`` / ``"text"``)."""

    name: str
    path: str
    prompts: tuple[str, ...]
    lines: tuple[int, ...]
    kinds: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def kind(self) -> str:
        """``"chat"``, ``"text"`` or ``"mixed"``."""
        kinds = set(self.kinds)
        return kinds.pop() if len(kinds) == 1 else "mixed"


def resolve(spec: str) -> tuple[str, str]:
    """A ``--datasets`` entry (a bundled name or a JSONL path) -> (display name, file path)."""
    spec = spec.strip()
    if not spec:
        raise DatasetError("--datasets: empty entry")
    if spec in DEMO_SETS and not os.path.exists(spec):
        path = demo.DEMO_DIR / "prompts" / f"{spec}.jsonl"
        if not path.is_file():
            raise DatasetError(f"--datasets: bundled demo set {spec!r} not found at {path} (it ships inside the "
                               "package, in sparkjax/assets/demo/prompts/; pass the path of a JSONL file instead)")
        return spec, str(path)
    if spec in EVAL_SETS and not os.path.exists(spec):
        folder = os.environ.get(ENV_VAR, "").strip()
        path = (pathlib.Path(folder).expanduser() if folder else pathlib.Path.cwd() / "eval" / "datasets")
        path = path / f"{spec}.jsonl"
        if not path.is_file():
            how = f"${ENV_VAR}" if folder else "the current folder's eval/datasets"
            raise DatasetError(f"--datasets: {spec!r} not found at {path} ({how}): the public sets "
                               f"{', '.join(EVAL_SETS)} are not installed with the package, they live in a source "
                               f"checkout's eval/datasets/; run from the checkout's root, set {ENV_VAR}=FOLDER, or "
                               "pass the path of a JSONL file")
        return spec, str(path)
    if spec.endswith((".jsonl", ".json")) or os.sep in spec or "/" in spec or os.path.exists(spec):
        return pathlib.Path(spec).stem, spec
    raise DatasetError(f"--datasets: {spec!r} is neither a bundled set ({', '.join(DEMO_SETS + EVAL_SETS)}) nor a "
                       ".jsonl file path")


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
    rows: list[tuple[str, int, str]] = []  # (prompt, line, kind)
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{number}: malformed JSON ({e.msg} at column {e.colno})") from None
        rows.append((*parse_row(row, f"{path}:{number}"), number))
    if not rows:
        raise DatasetError(f"{path}: no prompts (the file is empty)")
    prompts, kinds, lines = zip(*rows, strict=True)
    return PromptSet(name, str(path), prompts, lines, kinds)


def parse_row(row, where: str) -> tuple[str, str]:
    """One decoded JSONL row -> (prompt, kind); DatasetError naming ``where`` (file:line) otherwise."""
    shape = "expected a JSON object with a 'turns' list of strings (chat) or a 'text' string (raw completion)"
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: {shape}, got {type(row).__name__}")
    if "turns" in row and "text" in row:
        raise DatasetError(f"{where}: both 'turns' and 'text' given; {shape}, not both")
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise DatasetError(f"{where}: 'turns' must be a non-empty list of strings")
        if not turns[0].strip():
            raise DatasetError(f"{where}: the first turn is empty")
        return turns[0], "chat"
    if "text" in row:
        text = row["text"]
        if not isinstance(text, str):
            raise DatasetError(f"{where}: 'text' must be a string, got {type(text).__name__}")
        if not text.strip():
            raise DatasetError(f"{where}: 'text' is empty")
        return text, "text"
    raise DatasetError(f"{where}: {shape}; found keys {sorted(row)}")


def load_all(specs: list[str] | tuple[str, ...]) -> list[PromptSet]:
    """Every set of ``specs``; DatasetError when two share a name."""
    sets = [load(s) for s in specs]
    names = [s.name for s in sets]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise DatasetError(f"--datasets: two prompt sets are both named {dupes[0]!r}; rename one of the files")
    return sets
