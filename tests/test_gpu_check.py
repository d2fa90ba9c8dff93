"""``eval/gpu_check.sh --dry-run``: the prepared device check runs on the CPU at tiny shapes and writes its
records (every attention path within tolerance, every checked method equal to ar twice, a round time per loop mode,
a profiler trace per timed program and its summary); and the trace reader on a hand-written trace
(tests/fixtures/trace/README.md documents every number in it)."""

from __future__ import annotations

import gzip
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from sparkjax.bench import trace
from sparkjax.bench.__main__ import main

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "trace" / "two_runs.trace.json"


def test_trace_summary_of_a_hand_written_trace(tmp_path):
    t = trace.load(str(FIXTURE))
    assert t.devices == ["/device:GPU:0"] and len(t.kernels) == 16 and len(t.copies) == 4  # XLA Ops line skipped
    assert [trace.kind_of(e) for e in t.kernels[:4]] == ["gemm", "attention", "tree", "other"]
    s = trace.summarise(t, "short", "long", 2)
    assert s["gpu_kernels"] and s["kernels_per_round"] == {"gemm": 1, "attention": 1, "tree": 1, "other": 1}
    assert s["kernel_us_per_round"] == pytest.approx({"gemm": 10, "attention": 5, "tree": 2, "other": 1})
    assert s["d2h_copies_per_round"] == 1 and s["device_ms_per_round"] == pytest.approx(0.043)
    assert s["idle_us_per_round"] == pytest.approx(24) and s["idle_between_rounds_us"] == pytest.approx(20)
    assert s["idle_between_kernels_us"] == pytest.approx(4) and s["wall_ms_per_round"] == pytest.approx(0.1)
    # the same file gzipped under a profiler's folder layout is found and read alike
    run = tmp_path / "plugins" / "profile" / "run1"
    run.mkdir(parents=True)
    with gzip.open(run / "host.trace.json.gz", "wt") as f:
        f.write(FIXTURE.read_text())
    found = trace.find_trace(str(tmp_path))
    assert found.endswith("host.trace.json.gz")
    assert trace.summarise(trace.load(found), "short", "long", 2) == s
    with pytest.raises(ValueError, match="annotation"):
        trace.summarise(t, "short", "missing", 2)
    # a trace with no device process: the summary says so instead of inventing kernel figures
    host_only = trace.parse([e for e in json.loads(FIXTURE.read_text())["traceEvents"] if e.get("pid") == 1])
    none = trace.summarise(host_only, "short", "long", 2)
    assert not none["gpu_kernels"] and none["kernels_per_round"] is None and "no device kernel" in none["note"]
    # a device whose lines are not named as streams: said so, not read as an idle GPU
    renamed = FIXTURE.read_text().replace("Stream #7(Compute)", "Compute queue 7")
    odd = trace.summarise(trace.parse(json.loads(renamed)["traceEvents"]), "short", "long", 2)
    assert not odd["gpu_kernels"] and "Stream" in odd["note"] and odd["d2h_copies_per_round"] is None


def test_device_check_bad_arguments(capsys):
    for args in (["--gpu-loops", "device"], ["--quick", "--dry-run"], ["--timed-attention", "nope"]):
        assert main(["device", "--skip", "attention,exactness,timing", *args]) == 2, args
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err, args


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
    assert all(r["second_run_equal"] for r in ex if r["method"] != "ar"), ex  # each program ran twice
    # the timing: both loop modes side by side, every method under each
    assert {(r["gpu_loop"], r["label"]) for r in rows} == {
        (g, m) for g in ("command_buffer", "xla_default") for m in ("ar", "dspark")}
    assert all(r["attention"] == "split" for r in rows)
    # a time per AR step or round (the long run less the short one: noise may make a dry run's tiny one negative)
    assert all(math.isfinite(r["ms"]) and r["ms_min"] <= r["ms"] and r["n"] >= 1 for r in rows), rows
    # no projection is recorded for a CPU, and the row says so
    assert all("no recorded projection" in r["projection_note"] for r in rows), rows
    # a trace per timed program, written and summarised: on the CPU no device kernel, said so
    for r in rows:
        t = r["trace"]
        assert "error" not in t, t
        assert (tmp_path / t["trace_file"]).is_file() and t["trace_file"].endswith(".trace.json.gz")
        assert t["gpu_kernels"] is False and "no device kernel" in t["note"] and t["kernels_per_round"] is None
        assert math.isfinite(t["wall_ms_per_round"]) and t["units"] >= 1
    text = (tmp_path / "device_check.txt").read_text()
    assert "greedy exactness" in text and "split" in text and "from the profiler traces" in text
    assert "xla_default" in text and "no device kernel" in text
