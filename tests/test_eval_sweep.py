"""The batch-size sweep (``--batch-sizes``): prompt cycling, throughput rows on hand-made records, the plot / CSV /
JSON outputs (and old files without a sweep), bad input before any work, and runs on the fake engine."""

from __future__ import annotations

import csv
import json
import math
import pathlib
import re

import pytest

from sparkjax.errors import EvalError
from sparkjax.eval import harness, report, sweep
from sparkjax.eval.config import check_batch_sizes
from sparkjax.eval.records import Record, Sample
from sparkjax.eval.results import EvalResults
from tests.test_eval import PAIR, PNG, bad
from tests.test_eval_robust import FakeEngine, cli, interrupting

TINY = [*PAIR, "--datasets", "mbpp", "--max-samples", "2", "--max-new-tokens", "6", "--methods", "ar,dspark",
        "--repeats", "2"]


def test_check_batch_sizes_sorts_and_refuses_bad_lists():
    assert check_batch_sizes("64, 1,16,4") == (1, 4, 16, 64)
    assert check_batch_sizes([3, 1]) == (1, 3) and check_batch_sizes(2) == (2,)
    for value, needle in (("", "empty entry"), ("1,,4", "empty entry"), ("1,x", "integers"), ("1.5", "integers"),
                          ((), "empty list"), ((0,), "positive"), ((1, -4), "positive"), ((1, 2.0), "positive"),
                          ((True,), "positive"), ((4, 1, 4), "4 is listed twice")):
        with pytest.raises(EvalError, match="--batch-sizes") as e:
            check_batch_sizes(value)
        assert needle in str(e.value), (value, str(e.value))


def test_pool_takes_the_sets_in_turn_and_batches_cycle_it():
    pool = sweep.prompt_pool({"a": [(0, 1, [1]), (1, 2, [2]), (2, 3, [3])], "b": [(5, 6, [9])]})
    assert [(p[0], p[1]) for p in pool] == [("a", 0), ("b", 5), ("a", 1), ("a", 2)]
    assert sweep.fill_batches(pool, 1) == [[p] for p in pool]
    assert sweep.fill_batches(pool, 3) == [[pool[0], pool[1], pool[2]], [pool[3], pool[0], pool[1]]]
    assert sweep.fill_batches(pool, 6) == [[*pool, pool[0], pool[1]]]  # above N: prompts repeated, cycling
    assert sweep.fill_batches([], 4) == []


def _rec(label, size, batch, outs, decode, best, lens=None) -> Record:
    """A sweep record whose decode seconds are ``decode`` (None: not measured) and best case ``best``; ``outs``
    the output ids of each slot (prompt index = the first id)."""
    run = [0.05, 0.05] if decode is None else [best + 0.1, 2 * decode - best + 0.1]
    samples = [Sample(o[0], list(o), lens or [1] * len(o), dataset="d", slot=i) for i, o in enumerate(outs)]
    return Record("all", label, label, None, batch, 0, samples, run, [0.1, 0.1], 3, batch_size=size)


P0, P1 = [0, 5, 6, 7], [1, 8, 9]  # prompt 0 gives 4 tokens, prompt 1 three
HAND = [_rec("ar", 1, 0, [P0], 0.4, 0.2), _rec("ar", 1, 1, [P1], 0.3, 0.3),
        _rec("dspark", 1, 0, [P0], 0.2, 0.1, lens=[2, 2]), _rec("dspark", 1, 1, [P1], None, None, lens=[3]),
        _rec("ar", 2, 0, [P0, P1], 0.35, 0.25),
        _rec("dspark", 2, 0, [P0, [1, 8, 4]], 0.1, 0.05, lens=[2, 2])]  # slot 1 differs from ar and from batch 1


def test_throughput_rows_on_hand_made_records():
    rows = sweep.summarize_sweep(HAND, ["ar", "dspark"], (1, 2), 0.0)
    assert [(r.batch_size, r.label) for r in rows] == [(1, "ar"), (1, "dspark"), (2, "ar"), (2, "dspark")]
    ar1, sp1, ar2, sp2 = rows
    assert ar1.tokens_per_s == pytest.approx(7 / 0.7) and ar1.tokens_per_s_best == pytest.approx(7 / 0.5)
    # dspark's second batch was not measured: left out of tok/s (never a 0 s), counted as unmeasured
    assert sp1.tokens_per_s == pytest.approx(4 / 0.2) and sp1.unmeasured_batches == 1
    assert sp1.speedup == pytest.approx((4 / 0.2) / (7 / 0.7))
    assert sp1.speedup_best == pytest.approx((4 / 0.1) / (7 / 0.5))
    assert ar2.tokens_per_s == pytest.approx(7 / 0.35) and ar2.timing_spread == pytest.approx(HAND[4].run_spread)
    assert sp2.speedup == pytest.approx((7 / 0.1) / (7 / 0.35))
    assert (sp1.same_as_ar, sp2.same_as_ar, ar2.same_as_ar) == (1.0, 0.5, None)
    assert (sp1.same_across_batches, sp2.same_across_batches) == (1.0, 0.5)
    assert sp2.tau_pooled == pytest.approx(2.0)
    sampled = sweep.summarize_sweep(HAND, ["ar", "dspark"], (1, 2), 0.7)  # sampling: no exactness columns
    assert all(r.same_as_ar is None and r.same_across_batches is None for r in sampled)
    notes = sweep.sweep_notes(rows)
    assert any("batch 2/dspark: only 50% of greedy outputs equal ar's" in n for n in notes)
    assert any("batch 1/dspark: decode time not measured for 1 of 2" in n for n in notes)


def _results(recs, sizes=(1, 2)) -> EvalResults:
    block = sweep.sweep_block(recs, ["ar", "dspark"], sizes, [("d", 0, 1, [3, 4]), ("d", 1, 2, [5])], 0.0)
    return EvalResults(
        config={"temperature": 0.0, "max_new_tokens": 4, "batch_size": 1, "batch_sizes": list(sizes),
                "max_samples": 2, "repeats": 2},
        setup={"target": "t", "drafter": "d", "dtype": "float32", "labels": ["ar", "dspark"],
               "depths": {"ar": 0, "dspark": 2}, "timing": {"load_average_max": 9.0, "cpu_count": 2}},
        environment={"backend": "cpu", "device_kind": "cpu", "cpu_count": 2}, summary=[], records=[], sweep=block)


def test_outputs_from_a_hand_made_sweep(tmp_path):
    res = _results(HAND)
    (tmp_path / "results.csv").write_text("dataset\nold\n")  # a per-set run's table left in the folder
    paths = res.save(tmp_path)
    assert {pathlib.Path(p).name for p in paths} == {"results.json", "batch_sweep.csv", "throughput_vs_batch.png"}
    assert not (tmp_path / "results.csv").exists()  # stale: a sweep has no per-set summary
    data = (tmp_path / "throughput_vs_batch.png").read_bytes()
    assert data[:8] == PNG and len(data) > 10_000
    with open(tmp_path / "batch_sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["batch_size"]), r["label"]) for r in rows] == [(1, "ar"), (1, "dspark"), (2, "ar"), (2, "dspark")]
    assert float(rows[1]["tokens_per_s"]) == pytest.approx(4 / 0.2) and rows[2]["same_as_ar"] == ""
    back = EvalResults.load(tmp_path / "results.json")
    assert back.sweep.fill == "cycled" and back.sweep.batch_sizes == [1, 2] and back.sweep.records == HAND
    assert [r.to_dict() for r in back.sweep_rows] == json.loads(json.dumps([r.to_dict() for r in res.sweep_rows]))
    table = back.table()
    assert "batch sizes 1,2 (sweep)" in table and "cycled" in table and "load average reached 9.0" in table
    line = next(ln for ln in table.splitlines() if ln.split()[:2] == ["2", "dspark"])
    assert f"{(7 / 0.1) / (7 / 0.35):.2f}x" in line  # speedup over ar at batch 2
    assert "batch 1/dspark" in next(ln for ln in table.splitlines() if "timing spread above 25%" in ln)
    assert re.search(r"^batch 2\s+dspark\s", report.compare(back, res), re.M)  # two sweeps compare per size


def test_old_results_without_a_sweep_still_load(tmp_path):
    _results(HAND).save(tmp_path, plots=False)
    d = json.loads((tmp_path / "results.json").read_text())
    d.pop("sweep")
    d["config"].pop("batch_sizes")
    d["summary"] = [{"dataset": "x", "label": "ar", "n_samples": 1, "tau_pooled": 1.0, "accept_rate": []}]
    (tmp_path / "old.json").write_text(json.dumps(d))
    old = EvalResults.load(tmp_path / "old.json")
    assert old.sweep is None and old.sweep_rows == [] and "sweep" not in old.table()
    for wrong in ([1], {"rows": [{"label": "ar"}]}, {"rows": "x"}, {"rows": [3]}):
        d["sweep"] = wrong
        (tmp_path / "bad.json").write_text(json.dumps(d))
        with pytest.raises(EvalError, match="sweep"):
            EvalResults.load(tmp_path / "bad.json")


def test_bad_batch_sizes_before_any_work(capsys, no_model, tmp_path):
    for value, needle in (("0", "positive"), ("=-4", "positive"), ("1,-4", "positive"), ("1,x", "integers"),
                          ("4,1,4", "twice"), ("", "empty"), (" , ", "empty")):
        flag = ["--batch-sizes" + value] if value.startswith("=") else ["--batch-sizes", value]
        bad([*PAIR, "--datasets", "mbpp", *flag, "--out", str(tmp_path)], capsys, "--batch-sizes", needle)
    for argv in (["--batch-size", "2", "--batch-sizes", "1,2"], ["--batch-sizes", "1,2", "--batch-size", "1"]):
        line = bad([*PAIR, *argv], capsys, "--batch-sizes", "not allowed")
        assert re.search(r"--batch-size(?!s)", line), line  # both flags named
    with pytest.raises(EvalError, match=r"--batch-size 2 and --batch-sizes 1,2"):
        harness.run(target="t", batch_size=2, batch_sizes=(1, 2))
    assert not list(tmp_path.iterdir())


def test_fake_sweep_rows_cycling_and_exactness(monkeypatch, tmp_path):
    monkeypatch.setattr(harness, "Engine", FakeEngine)
    FakeEngine.LOG = []
    rc, stdout = cli(*TINY, "--batch-sizes", "3,1", "--out", str(tmp_path))
    assert rc == 0, stdout
    assert "batch sizes 1,3 (sweep)" in stdout and "throughput_vs_batch.png" in stdout
    js = json.loads((tmp_path / "results.json").read_text())
    sw, pool = js["sweep"], [tuple(p) for p in js["sweep"]["pool"]]
    assert js["summary"] == [] and sw["batch_sizes"] == [1, 3] and pool == [("mbpp", 0), ("mbpp", 1)]
    assert {p.name for p in tmp_path.iterdir()} == {"results.json", "batch_sweep.csv", "throughput_vs_batch.png"}
    assert [(r["batch_size"], r["label"]) for r in sw["rows"]] == [(1, "ar"), (1, "dspark"), (3, "ar"), (3, "dspark")]
    for row in sw["rows"]:
        size = row["batch_size"]
        mine = sorted((r for r in sw["records"] if (r["batch_size"], r["label"]) == (size, row["label"])),
                      key=lambda r: r["batch"])
        assert [r["batch"] for r in mine] == list(range(math.ceil(2 / size)))
        for r in mine:  # slot i of batch j holds prompt (j * size + i) mod N
            assert [(s["dataset"], s["index"]) for s in r["samples"]] == [pool[(r["batch"] * size + i) % 2]
                                                                           for i in range(size)]
            assert len(r["run_seconds"]) == 2 and r["seed"] == r["batch"]
        assert row["same_across_batches"] == 1.0 and row["same_as_ar"] in (None, 1.0)
        if measured := [r for r in mine if r["decode_seconds"]]:
            rate = sum(r["output_tokens"] for r in measured) / sum(r["decode_seconds"] for r in measured)
            assert row["tokens_per_s"] == pytest.approx(rate)
    # warm-up of each new shape before its timed runs; no stage pass in a sweep
    assert FakeEngine.LOG[:4] == [("ar", 1, "full"), ("ar", 1, "prefill"), ("dspark", 1, "full"),
                                  ("dspark", 1, "prefill")]
    assert ("ar", 3, "full") in FakeEngine.LOG and not any(kind == "stages" for *_, kind in FakeEngine.LOG)


def test_ctrl_c_during_a_sweep_keeps_the_finished_batches(monkeypatch, tmp_path):
    monkeypatch.setattr(harness, "Engine", FakeEngine)
    flaky, calls = interrupting(sweep.time_batch, 3)  # both size-1 batches done; the size-2 batch interrupted
    monkeypatch.setattr(sweep, "time_batch", flaky)
    rc, stdout = cli(*TINY, "--batch-sizes", "1,2,3", "--no-plots", "--out", str(tmp_path))
    js = json.loads((tmp_path / "results.json").read_text())
    assert rc == 130 and len(calls) == 3 and js["interrupted"] and "INTERRUPTED" in stdout
    assert {(r["batch_size"], r["batch"]) for r in js["sweep"]["records"]} == {(1, 0), (1, 1)}
    assert [r["batch_size"] for r in js["sweep"]["rows"]] == [1, 1]
    assert any("interrupted" in n and "size 1 #1" in n for n in js["notes"])
