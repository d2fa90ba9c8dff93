"""A wheel built from this tree, installed into a fresh venv (with the system site's jax, transformers, ...), runs
``python -m sparkjax.eval`` and ``python -m sparkjax`` from an unrelated folder on the bundled demo pair; no other
install shadows it (``PYTHONPATH`` is unset and ``sparkjax.__file__`` is checked)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(args, cwd, env, timeout=600):
    p = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{args} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.mark.slow
def test_wheel_runs_outside_the_checkout(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    # build from a copy, so the build leaves nothing in the checkout (build/, *.egg-info)
    src = tmp_path / "src"
    shutil.copytree(ROOT / "sparkjax", src / "sparkjax", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w",
          str(dist), str(src)], tmp_path, env)
    (wheel,) = dist.glob("sparkjax-*.whl")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], tmp_path, env)
    py = str(venv / "bin" / "python")
    # the system's pip, run by the venv's python, installs into the venv and leaves any other sparkjax install alone
    _run([py, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q", str(wheel)], tmp_path, env)
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    pkg = site / "sparkjax"

    work = tmp_path / "elsewhere"
    work.mkdir()
    p = _run([py, "-c", "import sparkjax, sparkjax.text, sparkjax.demo as d; print(sparkjax.__file__); "
                        "print(d.DEMO_DIR)"], work, env)
    file, demo_dir = p.stdout.split()
    assert pathlib.Path(file) == pkg / "__init__.py" and pathlib.Path(demo_dir) == pkg / "assets" / "demo"
    assert not (pkg / "eval" / "default_tokenizer.py").exists()  # the fixture builder is a test helper now

    out = tmp_path / "out"
    p = _run([py, "-m", "sparkjax.eval", "--max-samples", "1", "--out", str(out), "--methods", "ar,sparklingtree",
              "--budgets", "16", "--max-new-tokens", "8", "--repeats", "1", "--stage-samples", "0", "--no-plots",
              "--no-progress"], work, env)
    res = json.loads((out / "results.json").read_text())
    setup = res["setup"]
    assert setup["default_pair"] and setup["target"] == str(pkg / "assets" / "demo" / "target")
    assert setup["tokenizer"] == setup["target"]
    assert [(d["name"], pathlib.Path(d["path"]).parent, d["used"]) for d in setup["datasets"]] == [
        (name, pkg / "assets" / "demo" / "prompts", [0]) for name in ("python_docs", "stdlib_code", "synthetic_math")]
    rows = {(r["dataset"], r["label"]): r for r in res["summary"]}
    assert set(rows) >= {("all", "ar"), ("all", "sparklingtree@16")}
    assert rows["all", "sparklingtree@16"]["same_as_ar"] == 1.0 and rows["all", "sparklingtree@16"]["tau_pooled"] > 1
    assert "wrote" in p.stdout and not (work / "eval").exists()

    p = _run([py, "-m", "sparkjax", "--methods", "ar,sparklingtree", "--max-new-tokens", "8"], work, env)
    assert f"bundled demo pair ({pkg / 'assets' / 'demo'})" in p.stdout
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("  ") and " tau " in ln]  # one row per method
    assert len(lines) == 2 and all(ln.endswith("same tokens as ar: True") for ln in lines), p.stdout
    assert "first prompt + continuation:\n<|im_start|>user\n" in p.stdout
    assert "PyTorch was not found" not in p.stdout + p.stderr
