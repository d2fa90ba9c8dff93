"""``eval/gpu_check.sh --dry-run``: the prepared device check runs on the CPU at tiny shapes and writes its
records (every attention path within tolerance, every checked method equal to ar, a round time per path)."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_writes_its_records(tmp_path, xla_cache):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "JAX_COMPILATION_CACHE_DIR": xla_cache}
    res = subprocess.run(["bash", str(ROOT / "eval" / "gpu_check.sh"), "--dry-run", "--timeout", "600"],
                         capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((tmp_path / "device_check.json").read_text())
    assert data["dry_run"] and data["backend"].startswith("cpu") and not data["timed_out"]
    assert data["done"] == ["attention", "exactness", "timing"]
    att, ex, rows = data["attention"], data["exactness"], data["timing"]
    assert {(r["impl"], r["dtype"], r["case"]) for r in att} == {
        (i, d, c) for i in ("einsum", "dpa", "blocked", "prefix", "split") for d in ("float32", "bfloat16")
        for c in ("tree block over a cache", "block in the cache, all visible", "context + dense block")}
    assert all(r["ok"] for r in att) and all(r["masked_rows"] > 0 for r in att if r["case"].startswith("tree")), att
    paths = ("einsum", "split")
    methods = ("ar", "dspark", "sparklingtree")
    assert {(r["attention"], r["method"]) for r in ex} == {(a, m) for a in paths for m in methods}
    assert all(r["ok"] for r in ex), [r for r in ex if not r["ok"]]
    assert {(r["attention"], r["label"]) for r in rows} == {(a, m) for a in paths for m in ("ar", "dspark")}
    # a time per AR step or round (the long run less the short one: noise may make a dry run's tiny one negative)
    assert all(math.isfinite(r["ms"]) and r["ms_min"] <= r["ms"] and r["n"] >= 1 for r in rows), rows
    text = (tmp_path / "device_check.txt").read_text()
    assert "greedy exactness" in text and "split" in text
