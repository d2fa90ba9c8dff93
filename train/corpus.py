"""Builds the offline training corpus of the bundled demo pair (deterministic, hashed).

Sources: ``stdlib`` (the running interpreter's standard library ``.py`` sources), ``docs`` (Debian's
``python3.11-doc`` reStructuredText sources, installed with ``--install-docs``; the FAQ pages become chat
turns) and ``math`` (seeded synthetic word problems as chat turns, at most ``--math-share`` of the characters).
Every document is ``{"source", "id", "text"}``; a hash of its id decides the held-out split, so adding or
removing files moves no other document. ``manifest.json`` records the counts and the SHA-256 of both splits.

    python train/corpus.py --out runs/demo/corpus [--install-docs] [--limit-files N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import sysconfig

DOCS_DIR = "/usr/share/doc/python3.11-doc/html/_sources"
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "idlelib", "lib2to3",
             "ensurepip", "turtledemo", "tkinter", "config-3.11-x86_64-linux-gnu"}
MAX_FILE_CHARS = 200_000
FAQ_HELDOUT = 0.12


class CorpusError(Exception):
    pass


def chat(user: str, assistant: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{assistant}<|im_end|>\n"


def read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (UnicodeDecodeError, OSError):
        return None


def walk_sorted(root: str, suffix: str, skip: set[str] = frozenset()):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(suffix):
                yield os.path.join(dirpath, name)


def stdlib_docs(root: str, limit: int | None = None) -> list[dict]:
    docs = []
    for path in walk_sorted(root, ".py", SKIP_DIRS):
        rel = os.path.relpath(path, root)
        if rel.startswith("test_") or "/test_" in rel:
            continue
        text = read_text(path)
        if not text or not text.strip() or len(text) > MAX_FILE_CHARS:
            continue
        docs.append({"source": "stdlib", "id": f"stdlib/{rel}", "text": text})
        if limit and len(docs) >= limit:
            break
    return docs


_ROLE = re.compile(r":(?:[a-z]+:)?[a-z]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")
_LINK = re.compile(r"`([^`<]+?)\s*<[^>]+>`_+")
_LITERAL = re.compile(r"``([^`]+)``")


def clean_rst(text: str) -> str:
    """Light clean-up of reST markup for chat answers: roles, links and literals become plain text."""
    text = _ROLE.sub(r"\1", text)
    text = _LINK.sub(r"\1", text)
    text = _LITERAL.sub(r"\1", text)
    text = re.sub(r"^\.\. .*$", "", text, flags=re.M)  # directives and labels
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def faq_turns(text: str) -> list[tuple[str, str]]:
    """(question, answer) pairs of one FAQ page: each question is a heading underlined with ``-``."""
    lines = text.splitlines()
    heads = [i for i in range(len(lines) - 1)
             if lines[i].strip() and re.fullmatch(r"-{3,}", lines[i + 1].strip())
             and len(lines[i + 1].strip()) >= len(lines[i].strip()) - 1]
    out = []
    for n, i in enumerate(heads):
        end = heads[n + 1] if n + 1 < len(heads) else len(lines)
        body = lines[i + 2:end]
        # a following section heading (underlined with '=') ends the answer
        for j in range(len(body) - 1):
            if body[j].strip() and re.fullmatch(r"={3,}", body[j + 1].strip()):
                body = body[:j]
                break
        answer = clean_rst("\n".join(body))
        question = clean_rst(lines[i])
        if question and answer:
            out.append((question, answer))
    return out


def doc_docs(root: str, limit: int | None = None) -> list[dict]:
    docs = []
    for path in walk_sorted(root, ".rst.txt"):
        rel = os.path.relpath(path, root)
        text = read_text(path)
        if not text or not text.strip():
            continue
        if rel.startswith("faq/"):
            for k, (q, a) in enumerate(faq_turns(text)):
                docs.append({"source": "docs", "id": f"faq/{rel}#{k}", "text": chat(q, a)})
        else:
            docs.append({"source": "docs", "id": f"docs/{rel}", "text": text})
        if limit and len(docs) >= limit:
            break
    return docs


# ----------------------------------------------------------------------------------- synthetic math
NAMES = ["Ada", "Ben", "Chen", "Dana", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jia", "Kofi", "Lena", "Maya",
         "Nils", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara"]
ITEMS = ["apples", "books", "marbles", "pencils", "stickers", "cookies", "coins", "stamps", "shells", "cards"]


def math_problem(rng: random.Random) -> str:
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    kind = rng.randrange(5)
    if kind == 0:
        a, b, c = rng.randint(5, 90), rng.randint(2, 60), rng.randint(1, 40)
        c = min(c, a + b)
        q = (f"{name} has {a} {item}. {other} gives {name} {b} more, and then {name} gives away {c}. "
             f"How many {item} does {name} have now?")
        steps = [f"{name} starts with {a} {item}.", f"After getting {b} more: {a} + {b} = {a + b}.",
                 f"After giving away {c}: {a + b} - {c} = {a + b - c}."]
        ans = a + b - c
    elif kind == 1:
        boxes, per, extra = rng.randint(2, 12), rng.randint(3, 25), rng.randint(0, 30)
        q = (f"{name} packs {boxes} boxes with {per} {item} in each box and has {extra} {item} left over. "
             f"How many {item} did {name} have?")
        steps = [f"The boxes hold {boxes} * {per} = {boxes * per} {item}.",
                 f"Adding the {extra} left over: {boxes * per} + {extra} = {boxes * per + extra}."]
        ans = boxes * per + extra
    elif kind == 2:
        groups, per = rng.randint(2, 12), rng.randint(2, 20)
        total = groups * per
        q = f"{name} shares {total} {item} equally among {groups} friends. How many {item} does each friend get?"
        steps = [f"Each friend gets {total} / {groups} = {per} {item}."]
        ans = per
    elif kind == 3:
        price, count = rng.randint(2, 15), rng.randint(2, 9)
        cost = price * count
        paid = cost + rng.randint(0, 50)
        q = (f"{name} buys {count} {item} at {price} dollars each and pays with {paid} dollars. "
             f"How much change does {name} get?")
        steps = [f"The {item} cost {count} * {price} = {cost} dollars.",
                 f"The change is {paid} - {cost} = {paid - cost} dollars."]
        ans = paid - cost
    else:
        d1, d2, d3 = rng.randint(3, 40), rng.randint(3, 40), rng.randint(3, 40)
        q = (f"{name} reads {d1} pages on Monday, {d2} pages on Tuesday and {d3} pages on Wednesday. "
             f"How many pages did {name} read in total?")
        steps = [f"Monday and Tuesday: {d1} + {d2} = {d1 + d2} pages.",
                 f"Adding Wednesday: {d1 + d2} + {d3} = {d1 + d2 + d3} pages."]
        ans = d1 + d2 + d3
    body = "\n".join(f"Step {i + 1}: {s}" for i, s in enumerate(steps))
    return chat(q, f"{body}\nThe answer is \\boxed{{{ans}}}.")


def math_docs(seed: int, max_chars: int) -> list[dict]:
    rng = random.Random(seed)
    docs, total, k = [], 0, 0
    while True:
        text = math_problem(rng)
        if total + len(text) > max_chars:
            return docs
        docs.append({"source": "math", "id": f"math/{seed}/{k}", "text": text})
        total += len(text)
        k += 1


# ----------------------------------------------------------------------------------- assembly
def is_heldout(doc_id: str, share: float) -> bool:
    h = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big")
    return h / 2**64 < share


def build(*, stdlib_root: str, docs_root: str, seed: int = 0, math_share: float = 0.10, heldout: float = 0.02,
          limit_files: int | None = None) -> tuple[list[dict], list[dict], dict]:
    if not 0.0 <= math_share < 1.0:
        raise CorpusError(f"--math-share must be in [0, 1), got {math_share}")
    if not 0.0 < heldout < 0.5:
        raise CorpusError(f"--heldout must be in (0, 0.5), got {heldout}")
    docs = stdlib_docs(stdlib_root, limit_files) + doc_docs(docs_root, limit_files)
    if not docs:
        raise CorpusError(f"no documents found under {stdlib_root} or {docs_root}")
    real = sum(len(d["text"]) for d in docs)
    docs += math_docs(seed, int(real * math_share / (1.0 - math_share)))
    train, held = [], []
    for d in docs:
        # FAQ questions are few (~180): hold out FAQ_HELDOUT of them, so the eval has doc questions
        share = max(heldout, FAQ_HELDOUT) if d["id"].startswith("faq/") else heldout
        (held if is_heldout(d["id"], share) else train).append(d)
    rng = random.Random(seed)
    rng.shuffle(train)
    chars = {s: sum(len(d["text"]) for d in docs if d["source"] == s) for s in dict.fromkeys(d["source"] for d in docs)}
    manifest = {
        "python": sys.version.split()[0],
        "stdlib_root": stdlib_root,
        "docs_root": docs_root,
        "seed": seed,
        "math_share": math_share,
        "heldout_share": heldout,
        "documents": {"train": len(train), "heldout": len(held)},
        "chars_per_source": chars,
        "math_char_share": round(chars.get("math", 0) / max(1, sum(chars.values())), 4),
        "sha256": {"train": split_hash(train), "heldout": split_hash(held)},
        "licences": {"stdlib": "PSF-2.0 (Python standard library)", "docs": "PSF-2.0 (Python documentation)",
                     "math": "sparkjax (synthetic, Apache-2.0)"},
    }
    return train, held, manifest


def split_hash(docs: list[dict]) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(json.dumps(d, sort_keys=True, ensure_ascii=False).encode())
        h.update(b"\n")
    return h.hexdigest()


def write(out: str, train: list[dict], held: list[dict], manifest: dict) -> None:
    """Writes the three files atomically (each to a temporary name, then renamed)."""
    os.makedirs(out, exist_ok=True)
    jsonl = lambda rows: "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in rows)  # noqa: E731
    for name, text in (("train.jsonl", jsonl(train)), ("heldout.jsonl", jsonl(held)),
                       ("manifest.json", json.dumps(manifest, indent=2))):
        tmp = os.path.join(out, f".{name}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, os.path.join(out, name))


def ensure_docs(root: str, install: bool) -> None:
    if os.path.isdir(root):
        return
    if not install:
        raise CorpusError(f"{root} is missing: install Debian's python3.11-doc (or pass --install-docs, "
                          "or --docs-root with another copy of the reST sources)")
    print("installing python3.11-doc with apt-get ...", file=sys.stderr)
    rc = subprocess.call(["apt-get", "install", "-y", "python3.11-doc"])
    if rc != 0 or not os.path.isdir(root):
        raise CorpusError(f"apt-get install python3.11-doc failed (status {rc}); {root} is still missing")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--stdlib-root", default=sysconfig.get_paths()["stdlib"])
    p.add_argument("--docs-root", default=DOCS_DIR)
    p.add_argument("--install-docs", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--math-share", type=float, default=0.10)
    p.add_argument("--heldout", type=float, default=0.02)
    p.add_argument("--limit-files", type=int, default=None, help="at most N documents per source (a small slice)")
    a = p.parse_args(argv)
    try:
        ensure_docs(a.docs_root, a.install_docs)
        train, held, manifest = build(stdlib_root=a.stdlib_root, docs_root=a.docs_root, seed=a.seed,
                                      math_share=a.math_share, heldout=a.heldout, limit_files=a.limit_files)
        write(a.out, train, held, manifest)
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: manifest[k] for k in ("documents", "chars_per_source", "math_char_share", "sha256")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
