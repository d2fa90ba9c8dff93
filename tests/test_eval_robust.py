"""Robustness of the benchmark harness (issue 12, sections 2, 3, 5 and 7): timing that never divides by a
clamped zero, interleaved repetitions with median / min / spread and warnings, one-line errors for bad CLI
input, --out checked before any work, Ctrl-C through a SIGINT flag (tested on a subprocess), stale outputs
of an earlier run removed (and nothing else), no transformers advisory, distinct plot styles and the
compile progress of ``python -m sparkjax``.

One small in-process run (fixture pair, ar + dspark, 1 prompt, 8 tokens) serves most tests; the
subprocesses reuse its compiled programs through a persistent XLA cache."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import threading
import time
import types
from contextlib import redirect_stdout

import pytest

from sparkjax.errors import EvalError
from sparkjax.eval import harness, metrics, report
from sparkjax.eval.cli import main
from sparkjax.eval.engine import BatchOutput, MethodConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_dspark_b16"
TOKENIZER = ROOT / "eval" / "default_pair" / "tokenizer"
PAIR = ["--target", str(FIXTURE / "target"), "--drafter", str(FIXTURE / "drafter"), "--tokenizer", str(TOKENIZER)]
TINY = [*PAIR, "--methods", "ar,dspark", "--datasets", "mbpp", "--max-samples", "1", "--max-new-tokens", "8",
        "--ignore-eos"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


# ----------------------------------------------------------------------------- timing on hand-made numbers


def test_decode_time_that_is_not_positive_is_not_measured():
    # the busy-machine case of the issue: the prefill-only runs took longer than the full runs
    assert metrics.decode_seconds([0.10, 0.12, 0.11], [0.30, 0.20, 0.25]) is None
    assert metrics.decode_seconds([0.2], [0.2]) is None  # equal: not positive either, never 0
    assert metrics.decode_seconds_min([0.10, 0.5], [0.3, 0.1]) is None  # min 0.10 - min 0.10 = 0
    assert math.isnan(metrics.tpot(None, 10)) and math.isnan(metrics.tpot(0.0, 10))
    assert math.isnan(metrics.mean_tpot([None, 0.0], [10, 10]))
    assert metrics.mean_tpot([None, 0.2], [10, 10]) == pytest.approx(0.02)  # the unmeasured unit is left out
    assert math.isnan(metrics.speedup(None, 0.01)) and math.isnan(metrics.rate(math.nan))


def test_median_min_and_spread_by_hand():
    run, pre = [1.0, 1.2, 5.0], [0.2, 0.1, 0.3]
    assert metrics.decode_seconds(run, pre) == pytest.approx(1.2 - 0.2)
    assert metrics.decode_seconds_min(run, pre) == pytest.approx(1.0 - 0.1)
    assert metrics.spread(run) == pytest.approx((5.0 - 1.0) / 1.2)
    assert metrics.spread([2.0]) is None and metrics.spread([0.0, 0.0]) is None


def _record(label, decode, run, pre, n_out=8, iters=7):
    return {"dataset": "d", "label": label, "method": label, "budget": None, "batch": 0, "seed": 0,
            "samples": [{"index": 0, "output_tokens": n_out, "output_ids": list(range(n_out)),
                         "acceptance_lengths": [1] * iters if label == "ar" else [2] * iters,
                         "accepted_per_depth": [] if label == "ar" else [iters, 0]}],
            "run_seconds": run, "prefill_seconds": pre, "decode_seconds": decode,
            "decode_seconds_min": metrics.decode_seconds_min(run, pre), "run_spread": metrics.spread(run),
            "output_tokens": n_out, "loop_iterations": iters, "stage": None}


def _results(summary, records=(), timing=None):
    setup = {"target": "t", "drafter": "d", "dtype": "float32", "labels": ["ar", "dspark"],
             "depths": {"ar": 0, "dspark": 2}, "timing": timing or {}}
    config = {"temperature": 0.0, "max_new_tokens": 8, "batch_size": 1, "max_samples": 1, "repeats": 3}
    env = {"backend": "cpu", "device_kind": "cpu", "cpu_count": 2}
    return harness.EvalResults(config=config, setup=setup, environment=env, summary=summary, records=list(records))


def test_unmeasured_ar_gives_no_division_and_a_note(tmp_path):
    # ar's prefill-only median (0.3 s) is above its full-run median (0.2 s): not measured, not 0
    ar = _record("ar", metrics.decode_seconds([0.2, 0.2, 0.2], [0.3, 0.3, 0.3]), [0.2, 0.2, 0.2], [0.3, 0.3, 0.3])
    sp = _record("dspark", metrics.decode_seconds([0.5, 0.6, 0.55], [0.1, 0.1, 0.1]), [0.5, 0.6, 0.55],
                 [0.1, 0.1, 0.1])
    assert ar["decode_seconds"] is None
    rows = harness.summarize([ar, sp], ["ar", "dspark"], {"ar": 0, "dspark": 2}, ["d"], 0.0)
    r_ar, r_sp = rows
    assert math.isnan(r_ar["tpot_ms"]) and math.isnan(r_ar["tokens_per_s"]) and math.isnan(r_ar["speedup"])
    assert r_ar["unmeasured_batches"] == 1 and r_ar["decode_seconds"] == 0  # a sum over no measured unit
    assert math.isnan(r_sp["speedup"])  # no ar TPOT: no speedup, and no ZeroDivisionError either
    assert r_sp["tpot_ms"] == pytest.approx(1000 * (0.55 - 0.1) / 8)
    assert r_sp["timing_spread"] == pytest.approx((0.6 - 0.5) / 0.55)
    res = _results(rows, [ar, sp])
    table = res.table()
    line = next(ln for ln in table.splitlines() if ln.startswith("d ") and " ar " in ln)
    assert "-" in line and "inf" not in table.lower() and "nan" not in table.lower()
    assert "WARNING: decode time not measured" in table
    report.write_json(res, tmp_path / "r.json")
    report.write_csv(res, tmp_path / "r.csv")
    back = json.loads((tmp_path / "r.json").read_text())  # strict JSON: NaN became null
    assert back["summary"][0]["speedup"] is None and back["records"][0]["decode_seconds"] is None
    with open(tmp_path / "r.csv", newline="") as f:
        row = next(csv.DictReader(f))
    assert row["speedup"] == "" and row["tokens_per_s"] == ""
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]  # atomic writes leave no temp file


def test_spread_and_load_warnings():
    row = {"dataset": "d", "label": "ar", "timing_spread": 0.40}
    quiet = {"dataset": "d", "label": "dspark", "timing_spread": 0.05}
    warn = report.timing_warnings(_results([row, quiet], timing={"load_average_max": 1.0, "cpu_count": 2}))
    assert any("spread above 25%" in w and "d/ar 40%" in w and "dspark" not in w for w in warn)
    assert not any("load average" in w for w in warn)
    warn = report.timing_warnings(_results([quiet], timing={"load_average_max": 3.5, "cpu_count": 2}))
    assert len([w for w in warn if w]) == 1 and "load average reached 3.5" in warn[-1]
    assert report.timing_warnings(_results([quiet], timing={"load_average_max": 1.9, "cpu_count": 2})) == []
    assert report.timing_warnings(_results([quiet])) == []  # an old results file: no timing block, no warning


class FakeEngine:
    """Records the order of launches; every launch returns 3 tokens (2 rounds of length 1 for speculative)."""

    def __init__(self, log):
        self.log = log

    def shape_key(self, mc, batch):
        return (mc, len(batch))

    def launch(self, mc, batch, seed, *, prefill_only=False, auto_memory=None):
        self.log.append((mc.label, "prefill" if prefill_only else "full"))
        time.sleep(0.001)
        return mc

    def memory(self, mc, batch, chain):
        return None

    def remember(self, mc, batch, chain, res):
        pass

    def outputs(self, res, size=None, labels=()):
        return BatchOutput([[1, 2, 3]], [[1, 1]], [[0, 0]])

    def instrumented(self, mc, batch, seed):
        self.log.append((mc.label, "stages"))
        return BatchOutput([[1, 2, 3]], [[1, 1]], [[0, 0]], {"draft": 0.1})


def test_methods_and_repetitions_are_interleaved():
    log = []
    eng = FakeEngine(log)
    mcs = [MethodConfig("ar"), MethodConfig("dspark"), MethodConfig("sparklingtree", 16)]
    raws = harness.time_batch([(eng, mc) for mc in mcs], [[5, 6]], seed=0, repeats=3, stages=False, warmed=set())
    labels = [mc.label for mc in mcs]
    warm = [(lab, kind) for lab in labels for kind in ("full", "prefill")]
    assert log[:6] == warm  # every warm-up before any timed run
    assert log[6:] == warm * 3  # A B C, A B C, A B C: not A A A B B B
    for mc in mcs:
        assert len(raws[mc]["run_seconds"]) == len(raws[mc]["prefill_seconds"]) == 3
        assert raws[mc]["decode_seconds"] == metrics.decode_seconds(raws[mc]["run_seconds"],
                                                                    raws[mc]["prefill_seconds"])
    # a set Ctrl-C flag stops between two units of work
    log.clear()
    stop = harness.Interrupt()
    stop.requested = True
    with pytest.raises(harness.Stopped):
        harness.time_batch([(eng, mc) for mc in mcs], [[5, 6]], seed=0, repeats=3, stages=False, warmed=set(),
                           stop=stop)
    assert log == []


# ----------------------------------------------------------------------------- one small real run


OLD_FILES = {"tau_speedup.png": b"old plot", "stage_time.png": b"old plot", "acceptance_per_depth.png": b"old",
             "results.csv": "dataset\nold\n"}


@pytest.fixture(scope="module")
def small(tmp_path_factory, xla_cache):
    """The tiny run, into a folder an earlier run (and the user) left files in; the load average is faked
    above the core count and every Engine.launch is recorded."""
    from sparkjax.eval.engine import Engine

    out = tmp_path_factory.mktemp("reused_out")
    for name, data in OLD_FILES.items():
        (out / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    (out / "my_notes.txt").write_text("keep me")
    launches = []
    original = Engine.launch

    def launch(self, mc, batch, seed, *, prefill_only=False, auto_memory=None):
        launches.append((mc.label, "prefill" if prefill_only else "full"))
        return original(self, mc, batch, seed, prefill_only=prefill_only, auto_memory=auto_memory)

    buf = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Engine, "launch", launch)
        mp.setattr(os, "getloadavg", lambda: (99.0, 1.0, 1.0))
        with redirect_stdout(buf):
            rc = main([*TINY, "--repeats", "3", "--no-plots", "--no-progress", "--out", str(out)])
    return types.SimpleNamespace(rc=rc, out=out, stdout=buf.getvalue(), launches=launches,
                                 res=json.loads((out / "results.json").read_text()))


def test_small_run_interleaves_and_reports_median_min_spread(small):
    assert small.rc == 0, small.stdout
    pairs = [("ar", "full"), ("ar", "prefill"), ("dspark", "full"), ("dspark", "prefill")]
    assert small.launches == pairs + pairs * 3  # warm-up, then 3 interleaved repetitions
    res = small.res
    assert res["config"]["repeats"] == 3 and res["setup"]["timing"]["load_average_max"] == 99.0
    for r in res["records"]:
        run, pre = r["run_seconds"], r["prefill_seconds"]
        assert len(run) == len(pre) == 3
        assert r["decode_seconds"] == pytest.approx(metrics.decode_seconds(run, pre))
        assert r["decode_seconds_min"] == pytest.approx(metrics.decode_seconds_min(run, pre))
        assert r["run_spread"] == pytest.approx((max(run) - min(run)) / statistics.median(run))
    for row in res["summary"]:
        recs = [r for r in res["records"] if r["label"] == row["label"] and r["loop_iterations"] > 0]
        assert row["timing_spread"] == pytest.approx(statistics.median(r["run_spread"] for r in recs))
        best = [r for r in recs if r["decode_seconds_min"]]
        if best:
            tp = sum(r["decode_seconds_min"] / r["output_tokens"] for r in best) / len(best)
            assert row["tokens_per_s_best"] == pytest.approx(1 / tp)
    with open(small.out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {"tokens_per_s", "tokens_per_s_best", "timing_spread", "speedup_best", "same_as_ar"} <= set(rows[0])


def test_table_has_same_as_ar_and_warns_about_load(small):
    lines = small.stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("dataset"))
    assert "same" in lines[head] and "as ar" in lines[head + 1]
    dspark = next(ln for ln in lines if ln.startswith("mbpp") and " dspark " in ln)
    assert dspark.split("|")[0].split()[-1] == "1.00"  # greedy: dspark reproduces ar exactly
    assert "WARNING: the load average reached 99.0" in small.stdout


def test_reused_out_drops_stale_outputs_and_keeps_user_files(small):
    names = {p.name for p in small.out.iterdir()}
    assert names == {"results.json", "results.csv", "my_notes.txt"}, names  # the old plots are gone (--no-plots)
    assert (small.out / "my_notes.txt").read_text() == "keep me"
    assert "old" not in (small.out / "results.csv").read_text().splitlines()[1:2]


def test_compare_reads_results_without_the_new_fields(small, tmp_path, capsys):
    old = json.loads(json.dumps(small.res))
    for row in old["summary"]:
        for key in ("tokens_per_s_best", "speedup_best", "timing_spread", "timing_spread_max", "tpot_min_ms",
                    "timed_batches", "unmeasured_batches"):
            row.pop(key)
    old["setup"].pop("timing")
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert main(["--compare", str(tmp_path / "old.json"), str(small.out / "results.json")]) == 0
    out = capsys.readouterr().out
    assert "mbpp" in out and "dspark" in out
    assert harness.EvalResults.load(tmp_path / "old.json").table()  # an old file still prints


# ----------------------------------------------------------------------------- one-line errors, before any work


def _bad(argv, capsys, *needles):
    t0 = time.perf_counter()
    rc = main([*argv, "--no-progress", "--no-plots"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return time.perf_counter() - t0


def test_bad_seeds_are_one_line(capsys, no_model, tmp_path):
    _bad([*TINY, "--seed", str(2**64), "--out", str(tmp_path)], capsys, "--seed", "2**63")
    _bad([*TINY, "--seed", "-1", "--out", str(tmp_path)], capsys, "--seed")
    _bad([*TINY, "--seed", "2**64"], capsys, "--seed")  # not a number at all: argparse, one line too
    with pytest.raises(EvalError, match="--seed"):
        harness.run(target=str(FIXTURE / "target"), seed=2**63)


def test_huge_budget_is_refused_before_compiling(capsys, monkeypatch, tmp_path):
    def refuse(*a, **k):
        raise AssertionError("compiled a budget that cannot fit")

    monkeypatch.setattr(harness, "warm_up", refuse)
    monkeypatch.setattr(harness, "time_batch", refuse)
    _bad([*PAIR, "--methods", "ar,sparklingtree", "--budgets", "100000", "--datasets", "mbpp", "--max-samples", "1",
          "--max-new-tokens", "8", "--out", str(tmp_path)], capsys, "100000")


@pytest.mark.parametrize("content", [
    '{"format": "sparkjax.eval/1", "config": {}, "summary": [{"dataset": "a", "lab',  # cut short by a kill
    "[1, 2]",
    '{"config": {}, "summary": [{"dataset": "all"}]}',  # a row without its label
    '{"config": [], "summary": []}',
    '{"config": {}, "summary": [], "setup": 3}',
    "[" * 100_000 + "]" * 100_000,  # deep nesting (RecursionError in json)
    "\udcff",
], ids=["truncated", "list", "row-without-label", "config-not-object", "setup-not-object", "deep-nesting", "not-utf8"])
def test_compare_on_partial_or_corrupt_json_is_one_line(content, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(content, errors="surrogateescape")
    good = tmp_path / "good.json"
    good.write_text('{"config": {}, "summary": []}')
    _bad(["--compare", str(good), str(bad)], capsys, str(bad))


def test_bad_out_fails_before_any_work(tmp_path, capsys, no_model, monkeypatch):
    a_file = tmp_path / "somefile"
    a_file.write_text("not a folder")
    assert _bad([*TINY, "--out", str(a_file / "sub")], capsys, "--out", str(a_file / "sub")) < 5
    assert _bad([*TINY, "--out", str(a_file)], capsys, "--out", "not a folder") < 5
    assert a_file.read_text() == "not a folder"
    # a read-only folder (the tests run as root, who may write anywhere: the probe write is made to fail)
    ro = tmp_path / "readonly"
    ro.mkdir()
    ro.chmod(0o555)

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")

    if os.geteuid() == 0:
        monkeypatch.setattr(harness.tempfile, "mkstemp", denied)
    assert _bad([*TINY, "--out", str(ro)], capsys, "--out", "cannot write", str(ro)) < 5
    assert list(ro.iterdir()) == []


def test_run_restores_the_previous_sigint_handler(monkeypatch):
    seen = []

    def mine(signum, frame):
        pass

    def spy(*a, **k):
        seen.append(signal.getsignal(signal.SIGINT))
        raise EvalError("stop here")

    previous = signal.signal(signal.SIGINT, mine)
    try:
        monkeypatch.setattr(harness, "resolve_pair", spy)
        with pytest.raises(EvalError, match="stop here"):
            harness.run(methods=("ar",))
        assert isinstance(getattr(seen[0], "__self__", None), harness.Interrupt)  # the flag, during the run
        assert signal.getsignal(signal.SIGINT) is mine  # restored after it
    finally:
        signal.signal(signal.SIGINT, previous)


# ----------------------------------------------------------------------------- Ctrl-C on a subprocess


def _interrupt(tmp_path, name, when, cache, extra=()):
    """Starts the tiny eval in a subprocess and sends it SIGINT at ``when``: seconds, a string to wait for on
    stderr, or None: before the child runs any code (it starts with SIGINT blocked, inherited from this thread,
    so the signal is pending from its first instruction, like a Ctrl-C pressed while Python starts). Returns
    (exit code, stderr, stdout, out folder)."""
    out = tmp_path / name
    cmd = [sys.executable, "-m", "sparkjax.eval", *TINY, "--repeats", "3", "--no-plots", "--out", str(out), *extra]
    # the child must start as from a shell, with SIGINT at its default (an earlier test in this process may
    # have left it ignored, which a child inherits and Python then respects): a Python-level handler here is
    # reset to the default by exec
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if when is None else None
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**ENV, "JAX_COMPILATION_CACHE_DIR": cache},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        if previous is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        signal.signal(signal.SIGINT, handler if handler is not None else signal.default_int_handler)
    _interrupt.handler_before = handler  # reported by the test when the child did not stop
    err: list[str] = []
    seen = threading.Event()

    def pump():
        buf = ""
        while True:
            ch = proc.stderr.read(1)
            if not ch:
                break
            buf += ch
            if isinstance(when, str) and when in buf:
                seen.set()
        err.append(buf)

    out_parts: list[str] = []
    # the pump thread is the only reader of stderr (proc.communicate would read it too and take characters
    # from under it), a second thread drains stdout
    threads = [threading.Thread(target=pump, daemon=True),
               threading.Thread(target=lambda: out_parts.append(proc.stdout.read()), daemon=True)]
    for t in threads:
        t.start()
    if isinstance(when, str):
        assert seen.wait(240), f"{when!r} never appeared"
    elif when is not None:
        time.sleep(when)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    for t in threads:
        t.join(30)
    return proc.returncode, "".join(err), "".join(out_parts), out


def _check_files(out, rc):
    """Every results file left behind is complete and valid; the exit code matches what it says."""
    if not (out / "results.json").exists():
        assert not (out / "results.csv").exists()
        return None
    res = json.loads((out / "results.json").read_text())
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(res["summary"])
    assert rc == (130 if res["interrupted"] else 0)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temp file left
    return res


@pytest.mark.slow
def test_sigint_subprocess_at_several_moments(small, tmp_path, xla_cache):
    assert small.rc == 0  # the cache is warm
    # 1. during start-up: a Ctrl-C pending from the child's first instruction (see _interrupt). sparkjax blocks
    #    SIGINT while its imports run and takes it right after them (_startup): one line, exit 130, nothing
    #    written, no traceback. (Landing inside jaxlib's initialisation it used to crash the process (-11), fail
    #    the import, or be swallowed so that the run completed.)
    rc, err, _, out = _interrupt(tmp_path, "early", None, xla_cache)
    assert rc == 130, (rc, _interrupt.handler_before, err[:3000])
    assert "interrupted during start-up; nothing was written" in err and "Traceback" not in err
    assert _check_files(out, rc) is None and not (out.exists() and list(out.iterdir()))
    # 2. while compiling: stops after the current warm-up; partial (empty) results, exit 130
    rc, err, stdout, out = _interrupt(tmp_path, "warmup", "warm-up", xla_cache)
    assert rc == 130, (rc, err[-2000:])
    res = _check_files(out, rc)
    assert res is not None and res["interrupted"] and "INTERRUPTED" in stdout
    assert "Ctrl-C: stopping after the current step" in err and "Traceback" not in err
    # 3. mid-run, during the timed batches: partial results or (if it was already done) the full ones
    rc, err, stdout, out = _interrupt(tmp_path, "mid", "mbpp", xla_cache, extra=["--max-samples", "3"])
    assert rc in (0, 130) and "Traceback" not in err, (rc, err[-2000:])
    res = _check_files(out, rc)
    assert res is not None
    if res["interrupted"]:  # the batches every method had finished, each of them whole
        assert all(len(r["run_seconds"]) == 3 for r in res["records"])
        assert len(res["records"]) % 2 == 0 and len(res["records"]) < 6


# ----------------------------------------------------------------------------- first-run friction


NO_TORCH = "import sys; sys.modules['torch'] = None\n"


def test_no_pytorch_advisory_where_only_the_tokenizer_is_used():
    control = NO_TORCH + "import transformers\n"
    eval_tok = NO_TORCH + f"from sparkjax.text import load_tokenizer\nload_tokenizer({str(TOKENIZER)!r})\n"
    demo_main = NO_TORCH + (
        "import sparkjax.__main__ as m, types\n"
        "m.engine.generate = lambda *a, **k: types.SimpleNamespace(tokens=[[1, 2]] * 3,"
        " acceptance_lengths=[[1]] * 3)\n"
        "sys.exit(m.main(['--methods', 'ar,dspark', '--max-new-tokens', '4']))\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for code in (control, eval_tok, demo_main)]
    (c_out, c_err), (e_out, e_err), (d_out, d_err) = (p.communicate(timeout=240) for p in procs)
    message = "PyTorch was not found"
    assert message in c_err  # the control proves torch is blocked and the message would show
    assert procs[1].returncode == 0 and message not in e_err, e_err
    assert procs[2].returncode == 0, d_err
    assert message not in d_err and message not in d_out
    # python -m sparkjax: one line of compile progress per method, and one line saying what the numbers mean
    assert "compiling ar ..." in d_out and "compiling dspark ..." in d_out
    compiling = [ln for ln in d_out.splitlines() if "compiling" in ln]
    assert len(compiling) == 2 and all(ln.rstrip().endswith(" s") for ln in compiling)
    assert sum("speed-ups need a large target" in ln for ln in d_out.splitlines()) == 1


def test_every_default_method_has_its_own_stable_style():
    from sparkjax.engine import METHODS
    from sparkjax.eval.plots import method_style

    mcs, _ = harness.method_configs(harness.EvalConfig())
    labels = [mc.label for mc in mcs]
    assert len(labels) == len(set(labels)) >= 12
    styles = [method_style(lab) for lab in labels]
    assert len({s["color"] for s in styles}) == len(labels)  # a distinct colour for each default method
    assert method_style("ar")["color"] != method_style("sparklingtree-beam@32")["color"]  # the clash
    assert len({tuple(sorted(method_style(m).items())) for m in METHODS}) == len(METHODS)


def test_drafter_objects_get_the_one_pair_check(fixture_target):
    """A drafter passed as an object goes through the same pair check as a folder (its tables included);
    something that is not a drafter is an ArgumentError naming the argument."""
    import dataclasses

    from flax import nnx

    import sparkjax
    from sparkjax import load_drafter
    from sparkjax.nn.drafter import Drafter

    cfg = harness.EvalConfig(tokenizer=str(TOKENIZER), methods=("ar", "dspark"), datasets=("mbpp",))
    mcs, _ = harness.method_configs(cfg)
    good = load_drafter(FIXTURE / "drafter", target=fixture_target)
    pair = harness.load_pair(cfg, target=fixture_target, drafter=good, mcs=mcs)
    assert pair.drafter is good
    bad = Drafter(dataclasses.replace(good.config, vocab_size=256, mask_token_id=255), rngs=nnx.Rngs(0))
    with pytest.raises(sparkjax.IncompatiblePairError, match="<drafter object> does not fit .*vocab_size"):
        harness.load_pair(cfg, target=fixture_target, drafter=bad, mcs=mcs)
    with pytest.raises(sparkjax.ArgumentError, match="drafter"):
        harness.load_pair(cfg, target=fixture_target, drafter=fixture_target, mcs=mcs)


def test_eval_reports_non_finite_target_logits():
    """The eval launches with the non-finite flags and raises NumericalError instead of timing garbage."""
    import numpy as np

    import sparkjax
    from sparkjax.eval.engine import Engine

    out = np.array([[5, 6, 7, 0]], np.int32)
    ok = Engine.outputs((out, np.array([3], np.int32), np.array([-1], np.int32)))
    assert ok.tokens == [[5, 6, 7]]
    with pytest.raises(sparkjax.NumericalError, match="round 2"):
        Engine.outputs((out, np.array([3], np.int32), np.array([2], np.int32)))
