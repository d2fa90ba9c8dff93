"""Writes the demo pair's eval prompt sets from the corpus's held-out split (never trained on).

* ``python_docs.jsonl``: the held-out Python FAQ questions, as chat turns (``{"turns": [question]}``).
* ``stdlib_code.jsonl``: the opening of each held-out standard-library module (up to ``--code-chars``
  characters, cut at a line end), as raw completion prompts (``{"text": ...}``: no chat template).
* ``synthetic_math.jsonl``: the first ``--math`` held-out synthetic word problems, as chat turns.

    python train/demo_prompts.py --corpus runs/demo/corpus --out sparkjax/assets/demo/prompts
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import os
import re
import sys

USER = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S)


def code_prompt(text: str, max_chars: int) -> str:
    """The whole lines of ``text`` that fit in ``max_chars`` characters."""
    lines = text.splitlines(keepends=True)
    return "".join(lines[: bisect.bisect_right(list(itertools.accumulate(map(len, lines))), max_chars)])


def build(corpus: str, code_chars: int, n_math: int) -> dict[str, list[dict]]:
    with open(os.path.join(corpus, "heldout.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    sets: dict[str, list[dict]] = {"python_docs": [], "stdlib_code": [], "synthetic_math": []}
    for r in sorted(rows, key=lambda r: r["id"]):
        if r["id"].startswith("faq/"):
            sets["python_docs"].append({"turns": [USER.search(r["text"]).group(1)], "id": r["id"]})
        elif r["source"] == "stdlib":
            prompt = code_prompt(r["text"], code_chars)
            if len(prompt) >= 100:
                sets["stdlib_code"].append({"text": prompt, "id": r["id"]})
    maths = [r for r in rows if r["source"] == "math"]
    maths.sort(key=lambda r: int(r["id"].rsplit("/", 1)[1]))
    for r in maths[:n_math]:
        sets["synthetic_math"].append({"turns": [USER.search(r["text"]).group(1)], "id": r["id"]})
    return sets


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--code-chars", type=int, default=600)
    p.add_argument("--math", type=int, default=16)
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    for name, rows in build(a.corpus, a.code_chars, a.math).items():
        with open(os.path.join(a.out, f"{name}.jsonl"), "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"{name}: {len(rows)} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
