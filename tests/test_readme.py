"""README and docs/: Python snippets run as written (placeholder folders -> the demo pair), relative links resolve,
README under 10 KB with a short quickstart, no dated history."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md")), ROOT / "train" / "README.md", ROOT / "eval" / "datasets" / "README.md",
         ROOT / "sparkjax" / "assets" / "demo" / "MODEL_CARD.md"]
RUNNABLE = [README, DOCS / "usage.md", DOCS / "auto.md"]  # every ```python block of these runs
PLACEHOLDERS = {"path/to/Qwen3-4B": "target", "path/to/dspark_b16": "dspark_b16"}  # -> demo.path(...)
MAX_README_BYTES = 10_000
MAX_QUICKSTART_LINES = 15


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def python_blocks(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, code) of every ```python block of a Markdown file."""
    text = path.read_text(encoding="utf-8")
    return [(text[: m.start()].count("\n") + 1, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M)]


SNIPPETS = [(_rel(p), line, code) for p in RUNNABLE for line, code in python_blocks(p)]


def _section(text: str, heading: str) -> str:
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert m, f"README.md has no '## {heading}' section"
    return m.group(1)


def test_readme_size_and_shape():
    text = README.read_text(encoding="utf-8")
    assert len(text.encode("utf-8")) <= MAX_README_BYTES
    setup = re.findall(r"^```bash\n(.*?)^```", _section(text, "Set up"), flags=re.S | re.M)
    commands = [ln for block in setup for ln in block.splitlines() if ln.strip()]
    assert [c.split("#")[0].split() for c in commands] == [
        ["pip", "install", "-e", ".", "&&", "python", "-m", "sparkjax.eval"],
        ["pip", "install", "-e", '".[test]"', "&&", "python", "-m", "pytest", "-q"],
    ]
    quick = python_blocks(README)[0][1]
    assert quick in _section(text, "Quickstart")
    assert len(quick.splitlines()) <= MAX_QUICKSTART_LINES
    for method in ("sparklingtree", "auto"):
        assert f'"{method}"' in quick
    methods = _section(text, "Methods")
    for name in ("ar", "dflash", "dspark", "ddtree", "sparklingtree", "sparklingtree-beam", "pctree", "auto"):
        assert f"| `{name}` |" in methods, name


def test_usage_has_snippets():
    assert len(python_blocks(DOCS / "usage.md")) >= 4
    assert any("sparkjax.stream" in code for _, code in python_blocks(DOCS / "usage.md"))


def test_api_lists_every_public_name():
    import sparkjax

    text = (DOCS / "api.md").read_text(encoding="utf-8")
    missing = [name for name in sparkjax.__all__ if not re.search(rf"`{re.escape(name)}[`(]", text)]
    assert not missing, f"docs/api.md does not list {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # an absolute URL
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading with that anchor)")
    assert not broken, f"{_rel(page)}: broken links: {', '.join(broken)}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_no_dated_history(page):
    text = page.read_text(encoding="utf-8")
    for pattern in (r"\bissues? #?\d+", r"\bsessions?\b", r"\bprevious stop\b"):
        m = re.search(pattern, text, flags=re.I)
        assert m is None, f"{_rel(page)}: {m.group(0)!r} (history belongs in git log)"


@pytest.fixture(scope="module")
def shared_demo():
    """``sparkjax.demo.load`` returning one pair per dtype for the whole module: each snippet loads it again."""
    from sparkjax import demo

    pairs: dict = {}
    real = demo.load

    def load(dtype=demo.COMPUTE_DTYPE):
        if dtype not in pairs:
            pairs[dtype] = real(dtype)
        return pairs[dtype]

    return load


@pytest.mark.slow
@pytest.mark.parametrize("page,line,code", SNIPPETS, ids=[f"{p}:{n}" for p, n, _ in SNIPPETS])
def test_snippet_runs(page, line, code, shared_demo, tmp_path, monkeypatch):
    from sparkjax import demo

    monkeypatch.chdir(tmp_path)  # what a snippet writes (a cost table, a drafter) lands here, not in the checkout
    monkeypatch.setattr(demo, "load", shared_demo)
    for placeholder, part in PLACEHOLDERS.items():
        code = code.replace(placeholder, str(demo.path(part)))
    assert "path/to/" not in code, f"{page}:{line}: a placeholder path this test does not know"
    namespace: dict = {"__name__": "__snippet__"}
    exec(compile(code, f"{page}:{line}", "exec"), namespace)  # noqa: S102 - our own documentation
    out = namespace.get("out")
    if out is not None and hasattr(out, "acceptance_lengths"):
        assert out.tokens and all(len(t) >= 1 for t in out.tokens)
        # every token but the first (from the prefill) is committed by a round
        assert all(sum(lens) >= len(t) - 1 for lens, t in zip(out.acceptance_lengths, out.tokens, strict=True))
