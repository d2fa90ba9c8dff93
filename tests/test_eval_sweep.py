"""The eval's batch-size sweep (``python -m sparkjax.eval --batch-sizes 1,4,16,64``): prompt cycling, the
throughput rows on hand-made records, bad input, the per-size memory check, the plot / CSV / JSON outputs
(and old results files without a sweep), and runs on the tiny fixture pair: a row per (method, batch size),
positive throughputs, and greedy tokens that do not depend on the batch a sequence was decoded in."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import pathlib
import re
import statistics
import types

import pytest

from sparkjax.errors import EvalError
from sparkjax.eval import harness, report
from sparkjax.eval.cli import main
from sparkjax.eval.sweep import check_batch_sizes, fill_batches, prompt_pool, summarize_sweep, sweep_block
from tests.test_eval import _bad  # the one-line, exit-code-2 check of a CLI mistake

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_dspark_b16"
TOKENIZER = ROOT / "eval" / "default_pair" / "tokenizer"
PAIR = ["--target", str(FIXTURE / "target"), "--drafter", str(FIXTURE / "drafter"), "--tokenizer", str(TOKENIZER)]
PNG = b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- pieces, on hand-made data


def test_check_batch_sizes_sorts_and_refuses_bad_lists():
    assert check_batch_sizes("64, 1,16,4") == (1, 4, 16, 64)
    assert check_batch_sizes([3, 1]) == (1, 3) and check_batch_sizes(2) == (2,)
    for bad, needle in (("", "empty entry"), ("1,,4", "empty entry"), ("1,", "empty entry"), ("1,x", "integers"),
                        ("1.5", "integers"), ((), "empty list"), ((0,), "positive"), ((1, -4), "positive"),
                        ((1, 2.0), "positive"), ((True,), "positive"), ((4, 1, 4), "4 is listed twice")):
        with pytest.raises(EvalError, match="--batch-sizes") as e:
            check_batch_sizes(bad)
        assert needle in str(e.value), (bad, str(e.value))


def test_pool_takes_the_sets_in_turn_and_batches_cycle_it():
    selected = {"a": [(0, 1, [1]), (1, 2, [2]), (2, 3, [3])], "b": [(5, 6, [9])]}
    pool = prompt_pool(selected)
    assert [(p[0], p[1]) for p in pool] == [("a", 0), ("b", 5), ("a", 1), ("a", 2)]
    assert fill_batches(pool, 1) == [[p] for p in pool]  # every prompt once, alone
    assert fill_batches(pool, 3) == [[pool[0], pool[1], pool[2]], [pool[3], pool[0], pool[1]]]  # full batches
    six = fill_batches(pool, 6)
    assert six == [[pool[0], pool[1], pool[2], pool[3], pool[0], pool[1]]]  # above N: prompts repeated, cycling
    assert fill_batches([], 4) == []


def _rec(label, size, batch, outs, decode, decode_min, *, lens=None, spread=0.1, datasets=None):
    """A raw sweep record: ``outs`` the output ids of each slot (prompt index = the first id)."""
    samples = [{"dataset": (datasets or ["d"] * len(outs))[i], "index": o[0], "slot": i, "output_tokens": len(o),
                "output_ids": list(o), "acceptance_lengths": (lens or [1] * len(o)) if label != "ar" else [1] * len(o),
                "accepted_per_depth": []} for i, o in enumerate(outs)]
    return {"batch_size": size, "batch": batch, "label": label, "method": label, "budget": None, "samples": samples,
            "decode_seconds": decode, "decode_seconds_min": decode_min, "run_spread": spread,
            "output_tokens": sum(len(o) for o in outs), "loop_iterations": 3}


def test_throughput_rows_on_hand_made_records():
    p0, p1 = [0, 5, 6, 7], [1, 8, 9]  # prompt 0 gives 4 tokens, prompt 1 three
    recs = [
        _rec("ar", 1, 0, [p0], 0.4, 0.2), _rec("ar", 1, 1, [p1], 0.3, 0.3),
        _rec("dspark", 1, 0, [p0], 0.2, 0.1, lens=[2, 2]), _rec("dspark", 1, 1, [p1], None, None, lens=[3]),
        _rec("ar", 2, 0, [p0, p1], 0.35, 0.25, spread=0.5),
        _rec("dspark", 2, 0, [p0, [1, 8, 4]], 0.1, 0.05, lens=[2, 2]),  # slot 1 differs from ar and from batch 1
    ]
    rows = summarize_sweep(recs, ["ar", "dspark"], (1, 2), 0.0)
    assert [(r["batch_size"], r["label"]) for r in rows] == [(1, "ar"), (1, "dspark"), (2, "ar"), (2, "dspark")]
    ar1, sp1, ar2, sp2 = rows
    assert ar1["tokens_per_s"] == pytest.approx(7 / 0.7) and ar1["tokens_per_s_best"] == pytest.approx(7 / 0.5)
    # dspark's second batch was not measured: left out of tok/s (never a 0 s), counted as unmeasured
    assert sp1["tokens_per_s"] == pytest.approx(4 / 0.2) and sp1["unmeasured_batches"] == 1
    assert sp1["speedup"] == pytest.approx((4 / 0.2) / (7 / 0.7))
    assert sp1["speedup_best"] == pytest.approx((4 / 0.1) / (7 / 0.5))
    assert ar2["tokens_per_s"] == pytest.approx(7 / 0.35) and ar2["timing_spread"] == pytest.approx(0.5)
    assert sp2["speedup"] == pytest.approx((7 / 0.1) / (7 / 0.35))
    assert (sp1["same_as_ar"], sp2["same_as_ar"]) == (1.0, 0.5)
    assert (sp1["same_across_batches"], sp2["same_across_batches"]) == (1.0, 0.5)
    assert sp2["tau_pooled"] == pytest.approx(2.0) and ar2["same_as_ar"] is None
    # sampling: no exactness columns
    assert all(r["same_as_ar"] is None and r["same_across_batches"] is None
               for r in summarize_sweep(recs, ["ar", "dspark"], (1, 2), 0.7))


def _results(recs, sizes=(1, 2), **config):
    pool = [("d", 0, 1, [3, 4]), ("d", 1, 2, [5])]
    block = sweep_block(recs, ["ar", "dspark"], sizes, pool, 0.0)
    return harness.EvalResults(
        config={"temperature": 0.0, "max_new_tokens": 4, "batch_size": 1, "batch_sizes": list(sizes),
                "max_samples": 2, "repeats": 3, **config},
        setup={"target": "t", "drafter": "d", "dtype": "float32", "labels": ["ar", "dspark"],
               "depths": {"ar": 0, "dspark": 2}, "timing": {"load_average_max": 9.0, "cpu_count": 2}},
        environment={"backend": "cpu", "device_kind": "cpu", "cpu_count": 2}, summary=[], records=[], sweep=block)


HAND = [_rec("ar", 1, 0, [[0, 5]], 0.4, 0.2), _rec("ar", 1, 1, [[1, 8]], 0.3, 0.3),
        _rec("dspark", 1, 0, [[0, 5]], 0.2, 0.1), _rec("dspark", 1, 1, [[1, 8]], 0.25, 0.2, spread=0.6),
        _rec("ar", 2, 0, [[0, 5], [1, 8]], 0.35, 0.25), _rec("dspark", 2, 0, [[0, 5], [1, 8]], 0.1, 0.05)]


def test_outputs_plot_csv_json_and_table_from_hand_made_sweep(tmp_path):
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
    assert float(rows[1]["tokens_per_s"]) == pytest.approx(4 / 0.45)
    back = harness.EvalResults.load(tmp_path / "results.json")
    assert back.sweep["fill"] == "cycled" and back.sweep["batch_sizes"] == [1, 2]
    assert back.sweep_rows == json.loads(json.dumps(res.sweep_rows))
    table = back.table()
    assert "batch sizes 1,2 (sweep)" in table and "cycled" in table
    line = next(ln for ln in table.splitlines() if ln.split()[:2] == ["2", "dspark"])
    assert f"{(4 / 0.1) / (4 / 0.35):.2f}x" in line  # speedup over ar at batch 2
    assert "WARNING: timing spread above 25% (batch 1/dspark 35%)" in table  # median of 0.1 and 0.6
    assert "load average reached 9.0" in table
    # two sweeps compare per (batch size, method)
    assert re.search(r"^batch 2\s+dspark\s", report.compare(back, res), re.M)


def test_old_results_without_a_sweep_still_load(tmp_path):
    res = _results(HAND)
    res.save(tmp_path, plots=False)
    d = json.loads((tmp_path / "results.json").read_text())
    d.pop("sweep")
    d["config"].pop("batch_sizes")
    d["summary"] = [{"dataset": "x", "label": "ar", "n_samples": 1, "tau_pooled": 1.0, "tau_per_response": 1.0,
                     "accept_rate": []}]
    (tmp_path / "old.json").write_text(json.dumps(d))
    old = harness.EvalResults.load(tmp_path / "old.json")
    assert old.sweep is None and old.sweep_rows == []
    assert "sweep" not in old.table()
    for bad in ([1], {"rows": [{"label": "ar"}]}, {"rows": "x"}):
        d["sweep"] = bad
        (tmp_path / "bad.json").write_text(json.dumps(d))
        with pytest.raises(EvalError, match="sweep"):
            harness.EvalResults.load(tmp_path / "bad.json")


# ----------------------------------------------------------------------------- bad input, before any work


@pytest.mark.parametrize("argv, needle", [
    (["--batch-sizes", "0"], "positive"),
    (["--batch-sizes=-4"], "positive"),
    (["--batch-sizes", "1,-4"], "positive"),
    (["--batch-sizes", "-4"], "positive"),
    (["--batch-sizes", "1,x"], "integers"),
    (["--batch-sizes", "1.5"], "integers"),
    (["--batch-sizes", "4,1,4"], "twice"),
    (["--batch-sizes", ""], "empty"),
    (["--batch-sizes", "1,,4"], "empty"),
    (["--batch-sizes", " , "], "empty"),
])
def test_bad_batch_sizes_are_one_line(argv, needle, capsys, no_model, tmp_path):
    _bad([*PAIR, "--datasets", "mbpp", *argv, "--out", str(tmp_path)], capsys, "--batch-sizes", needle)
    assert not list(tmp_path.iterdir())


def test_batch_size_and_batch_sizes_exclude_each_other(capsys, no_model):
    for argv in (["--batch-size", "2", "--batch-sizes", "1,2"], ["--batch-sizes", "1,2", "--batch-size", "1"]):
        line = _bad([*PAIR, *argv], capsys, "--batch-sizes", "not allowed")
        assert re.search(r"--batch-size(?!s)", line), line  # both flags named
    with pytest.raises(EvalError, match=r"--batch-size 2 and --batch-sizes 1,2"):
        harness.run(target=str(FIXTURE / "target"), batch_size=2, batch_sizes=(1, 2))
    with pytest.raises(EvalError, match="--batch-sizes"):
        harness.run(target=str(FIXTURE / "target"), batch_sizes=(0, 2))


def test_a_batch_size_that_cannot_fit_is_refused_before_compiling(capsys, monkeypatch, tmp_path):
    def refuse(*a, **k):
        raise AssertionError("compiled a batch size that cannot fit")

    monkeypatch.setattr(harness, "warm_up", refuse)
    monkeypatch.setattr(harness, "time_batch", refuse)
    monkeypatch.setattr(harness, "_memory_limit", lambda: 2**30)  # 1 GiB: batch 1 fits, batch 100000 does not
    line = _bad([*PAIR, "--methods", "ar,dspark", "--datasets", "mbpp", "--max-samples", "1", "--max-new-tokens", "8",
                 "--batch-sizes", "1,100000", "--out", str(tmp_path)], capsys, "--batch-sizes", "batch 100000",
                "smaller batch sizes")
    assert "1.0 GiB" in line


# ----------------------------------------------------------------------------- runs on the tiny fixture pair


def _sweep(out, *argv, patch=None):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.MonkeyPatch.context() as mp:
        if patch:
            patch(mp)
        rc = main([*PAIR, "--datasets", "mbpp", "--max-samples", "2", "--ignore-eos", "--no-progress", *argv,
                   "--out", str(out)])
    res = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else None
    return types.SimpleNamespace(rc=rc, out=out, stdout=buf.getvalue(), res=res)


def _check_exact_and_cycled(res, labels, sizes):
    """Independent recounts from the raw records: the cycling of the pool, and greedy tokens that depend only on
    the prompt (not on the batch, the slot or the method)."""
    sw = res["sweep"]
    pool = [tuple(p) for p in sw["pool"]]
    assert sw["fill"] == "cycled" and sw["batch_sizes"] == list(sizes) and len(pool) == 2
    recs = sw["records"]
    by_prompt: dict = {}
    for size in sizes:
        n_batches = math.ceil(len(pool) / size)
        for label in labels:
            mine = sorted((r for r in recs if r["batch_size"] == size and r["label"] == label),
                          key=lambda r: r["batch"])
            assert [r["batch"] for r in mine] == list(range(n_batches)), (size, label)
            for r in mine:
                got = [(s["dataset"], s["index"]) for s in r["samples"]]
                assert got == [pool[(r["batch"] * size + i) % len(pool)] for i in range(size)]
                for s in r["samples"]:
                    by_prompt.setdefault((s["dataset"], s["index"]), set()).add(tuple(s["output_ids"]))
                    assert len(s["output_ids"]) == res["config"]["max_new_tokens"]  # --ignore-eos
    assert set(by_prompt) == set(pool)
    for prompt, outs in by_prompt.items():
        assert len(outs) == 1, (prompt, outs)  # one greedy output per prompt, whatever the batch and method


def _check_rows(res, labels, sizes):
    rows = res["sweep"]["rows"]
    assert [(r["batch_size"], r["label"]) for r in rows] == [(b, lab) for b in sizes for lab in labels]
    recs = res["sweep"]["records"]
    ar = {r["batch_size"]: r for r in rows if r["label"] == "ar"}
    for row in rows:
        mine = [r for r in recs if r["batch_size"] == row["batch_size"] and r["label"] == row["label"]]
        measured = [r for r in mine if r["decode_seconds"] is not None]
        assert row["timed_batches"] == len(mine) and row["unmeasured_batches"] == len(mine) - len(measured)
        for r in mine:
            assert len(r["run_seconds"]) == len(r["prefill_seconds"]) == res["config"]["repeats"]
            if r["decode_seconds"] is not None:
                assert r["decode_seconds"] == pytest.approx(
                    statistics.median(r["run_seconds"]) - statistics.median(r["prefill_seconds"]))
        if not measured:  # a very busy machine: "not measured", never a made-up figure
            assert row["tokens_per_s"] is None
            continue
        rate = sum(r["output_tokens"] for r in measured) / sum(r["decode_seconds"] for r in measured)
        assert row["tokens_per_s"] == pytest.approx(rate) and row["tokens_per_s"] > 0
        if ar[row["batch_size"]]["tokens_per_s"]:
            assert row["speedup"] == pytest.approx(rate / ar[row["batch_size"]]["tokens_per_s"])
        assert row["same_across_batches"] == 1.0 and row["same_as_ar"] in (None, 1.0)


def test_ar_sweep_on_the_fixture_pair(tmp_path):
    """ar alone at batch sizes 1 and 3 on 2 prompts (size 3 repeats one): the cheap run of the default suite
    (the speculative methods run in the slow test below)."""
    run = _sweep(tmp_path, "--methods", "ar", "--max-new-tokens", "6", "--repeats", "2", "--batch-sizes", "3,1")
    assert run.rc == 0, run.stdout
    assert "batch sizes 1,3 (sweep)" in run.stdout and "cycled" in run.stdout
    assert "throughput_vs_batch.png" in run.stdout and "batch_sweep.csv" in run.stdout
    _check_rows(run.res, ["ar"], (1, 3))
    _check_exact_and_cycled(run.res, ["ar"], (1, 3))
    assert run.res["summary"] == [] and run.res["config"]["batch_sizes"] == [1, 3]
    data = (tmp_path / "throughput_vs_batch.png").read_bytes()
    assert data[:8] == PNG and len(data) > 10_000


@pytest.fixture(scope="module")
def tree_sweep(tmp_path_factory):
    return _sweep(tmp_path_factory.mktemp("sweep"), "--methods", "ar,dspark,sparklingtree", "--budgets", "16",
                  "--max-new-tokens", "12", "--repeats", "2", "--batch-sizes", "1,2,3")


@pytest.mark.slow
def test_sweep_with_a_tree_at_three_batch_sizes(tree_sweep):
    run = tree_sweep
    assert run.rc == 0, run.stdout
    labels = ["ar", "dspark", "sparklingtree@16"]
    _check_rows(run.res, labels, (1, 2, 3))
    _check_exact_and_cycled(run.res, labels, (1, 2, 3))
    for size in (1, 2, 3):  # the table shows every (batch size, method)
        for label in labels:
            assert any(ln.split()[:2] == [str(size), label] for ln in run.stdout.splitlines()), (size, label)
    names = {p.name for p in run.out.iterdir()}
    assert names == {"results.json", "batch_sweep.csv", "throughput_vs_batch.png"}, names


@pytest.mark.slow
def test_ctrl_c_during_a_sweep_keeps_the_finished_batches(tree_sweep, tmp_path):
    calls = []

    def patch(mp):
        original = harness.time_batch

        def flaky(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:  # both size-1 batches done; the size-2 batch is interrupted
                raise KeyboardInterrupt
            return original(*args, **kwargs)

        mp.setattr(harness, "time_batch", flaky)

    run = _sweep(tmp_path, "--methods", "ar,dspark,sparklingtree", "--budgets", "16", "--max-new-tokens", "12",
                 "--repeats", "2", "--batch-sizes", "1,2,3", "--no-plots", patch=patch)
    assert run.rc == 130 and len(calls) == 3
    assert run.res["interrupted"] is True and "INTERRUPTED" in run.stdout
    assert {(r["batch_size"], r["batch"]) for r in run.res["sweep"]["records"]} == {(1, 0), (1, 1)}
    assert [r["batch_size"] for r in run.res["sweep"]["rows"]] == [1, 1, 1]
    assert any("interrupted" in n and "size 1 #1" in n for n in run.res["notes"])
