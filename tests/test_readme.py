"""README's Python snippets run as written, with the placeholder model paths swapped for the bundled demo pair."""

from __future__ import annotations

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _placeholders() -> dict[str, str]:
    from sparkjax import demo

    return {
        "path/to/Qwen3-4B": str(demo.path("target")),
        "path/to/dspark_b16": str(demo.path("dspark_b16")),
    }


def python_blocks() -> list[tuple[int, str]]:
    """(line number, code) of every ```python block of README.md."""
    text = README.read_text(encoding="utf-8")
    blocks = []
    for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        blocks.append((text[: m.start()].count("\n") + 1, m.group(1)))
    return blocks


def test_readme_has_python_snippets():
    blocks = python_blocks()
    assert len(blocks) >= 2, "README lost its usage snippets"
    assert any("sparkjax.generate" in code for _, code in blocks)


@pytest.mark.slow
@pytest.mark.parametrize("line,code", python_blocks(), ids=lambda x: f"line{x}" if isinstance(x, int) else "")
def test_readme_snippet_runs(line, code, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what a snippet writes (a cost table, ...) lands here, not in the checkout
    for placeholder, real in _placeholders().items():
        code = code.replace(placeholder, real)
    assert "path/to/" not in code, f"README.md:{line}: a placeholder path this test does not know"
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(code, f"README.md:{line}", "exec"), namespace)  # noqa: S102 - our own README
    if "sparkjax.generate" in code:
        out = namespace["out"]
        assert out.tokens and all(len(t) >= 1 for t in out.tokens)
        # every token but the first (from the prefill) is committed by a round
        assert all(sum(lens) >= len(t) - 1 for lens, t in zip(out.acceptance_lengths, out.tokens, strict=True))
