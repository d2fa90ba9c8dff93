"""The eval: metrics by hand, the one shared end-to-end run on the demo pair (its files against independent
recounts), the prompt sets, bad input (one line, exit code 2). Then the eval on a fake engine (canned tokens and
timings, nothing compiled): the interleaved protocol, Ctrl-C (whole partial results, the SIGINT handler restored),
reused folders, warnings, --out and memory checked first, the baseline drafter, prompts as encoded; the batch-size
sweep; on a subprocess, SIGINT (slow) and no transformers advisory."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import types
from contextlib import redirect_stdout

import numpy as np
import pytest
from flax import nnx

import sparkjax
from sparkjax import demo, engine
from sparkjax.engine.names import parse_method
from sparkjax.engine.state import Launch
from sparkjax.errors import DatasetError, EvalError
from sparkjax.eval import EvalConfig, EvalResults, config, harness, metrics, pair, plots, records, report, runner
from sparkjax.eval import datasets as ds
from sparkjax.eval.cli import main
from sparkjax.eval.config import normalized
from sparkjax.eval.engine import BatchOutput, PairRunner
from sparkjax.eval.records import Record, Row, Sample, summarize
from sparkjax.nn.drafter import Drafter
from sparkjax.text import encode_prompt, load_tokenizer

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_dspark_b16"
TOKENIZER = ROOT / "eval" / "default_pair" / "tokenizer"  # the fixture pair's tokenizer (vocab 320)
PAIR = ["--target", str(FIXTURE / "target"), "--drafter", str(FIXTURE / "drafter"), "--tokenizer", str(TOKENIZER)]
PNG = b"\x89PNG\r\n\x1a\n"


def bad(argv, capsys, *needles) -> str:
    """Runs the CLI on a mistake: exit code 2, one line on stderr naming every needle, no traceback."""
    rc = main([*argv, "--no-progress", "--no-plots"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_metrics_by_hand():
    lens = [[1, 3, 2], [4], []]
    assert metrics.tau_pooled(lens) == pytest.approx(2.5)  # (1 + 3 + 2 + 4) / 4 rounds
    assert metrics.tau_per_response(lens) == pytest.approx(3.0)  # mean(6 / 3, 4 / 1); the empty one left out
    assert math.isnan(metrics.tau_pooled([[], []])) and math.isnan(metrics.tau_per_response([]))
    assert metrics.accept_rates([[2, 1, 0, 0], [1, 1, 1, 0]], [3, 1], 4) == pytest.approx([0.75, 0.5, 0.25, 0.0])
    assert metrics.decode_seconds([1.0, 1.2, 5.0], [0.2, 0.1, 0.3]) == pytest.approx(1.0)  # median - median
    assert metrics.decode_seconds([1.0, 1.2, 5.0], [0.2, 0.1, 0.3], best=True) == pytest.approx(0.9)
    # not positive: "not measured", never a clamped 0 (and never a division by it)
    assert metrics.decode_seconds([0.1, 0.12], [0.3, 0.2]) is None and metrics.decode_seconds([0.2], [0.2]) is None
    assert math.isnan(metrics.ratio(None, 10)) and math.isnan(metrics.mean_tpot([None, 0.0], [10, 10]))
    assert metrics.mean_tpot([None, 0.2], [10, 10]) == pytest.approx(0.02)
    assert metrics.mean_tpot([1.0, 2.0], [10, 40]) == pytest.approx(0.075)  # the mean over timed units
    assert metrics.ratio(0.02, 0.008) == pytest.approx(2.5) and math.isnan(metrics.ratio(0.02, math.nan))
    st = metrics.stage_ms_per_round([{"draft": 0.01, "verify": 0.02}, {"draft": 0.03, "verify": 0.04}], [2, 2])
    assert st == pytest.approx({"draft": 10.0, "verify": 15.0})


def rec(label, index, out, lens, hits, run, pre, dataset="x", iters=None) -> Record:
    return Record(dataset, label, label.split("@")[0], None, index, 0, [Sample(index, out, lens, hits)], run, pre,
                  len(lens) if iters is None else iters)


def test_summarize_hand_made_records():
    ar = [rec("ar", 0, [1] * 8, [1] * 8, [], [0.9], [0.1]), rec("ar", 1, [2] * 4, [1] * 4, [], [0.9], [0.1]),
          rec("ar", 2, [7], [1], [], [0.4], [0.1], iters=0)]  # EOS first: no decode step, left out of TPOT
    sp = [rec("dspark", 0, [1] * 8, [4, 4], [2, 2, 2], [0.3], [0.1]),
          rec("dspark", 1, [2] * 3 + [9], [1, 3], [1, 1, 0], [0.5], [0.1])]
    unmeasured = rec("dspark", 2, [7], [1], [0, 0, 0], [0.1, 0.1], [0.3, 0.3])  # prefill-only took longer
    r_ar, r_sp = summarize(ar + sp + [unmeasured], ["ar", "dspark"], {"ar": 0, "dspark": 3}, ["x"], 0.0)
    assert r_ar.tpot_ms == pytest.approx(1000 * (0.1 + 0.2) / 2)
    assert r_sp.tpot_ms == pytest.approx(1000 * (0.025 + 0.1) / 2) and r_sp.unmeasured_batches == 1
    assert r_sp.speedup == pytest.approx(0.15 / 0.0625) and r_ar.speedup == pytest.approx(1.0)
    assert r_sp.tau_pooled == pytest.approx(13 / 5) and r_sp.tau_per_response == pytest.approx((4 + 2 + 1) / 3)
    assert r_sp.accept_rate == pytest.approx([3 / 5, 3 / 5, 2 / 5])
    assert r_sp.same_as_ar == pytest.approx(2 / 3)  # the second output differs from ar's
    assert (r_ar.n_samples, r_ar.output_tokens, r_ar.rounds) == (3, 13, 13)
    assert r_sp.timing_spread == pytest.approx(0.0)  # one spread measured: the two-run unmeasured batch's
    back = Record.from_dict(json.loads(json.dumps(unmeasured.to_dict())))
    assert back == unmeasured and back.to_dict()["decode_seconds"] is None and back.run_spread == 0.0
    assert rec("ar", 0, [1], [1], [], [1.0, 1.2, 5.0], [0.1] * 3).run_spread == pytest.approx((5.0 - 1.0) / 1.2)
    ar_unmeasured = [rec("ar", 0, [1] * 8, [1] * 8, [], [0.2] * 3, [0.3] * 3)]  # ar itself not measured
    rows = summarize(ar_unmeasured + sp, ["ar", "dspark"], {"ar": 0, "dspark": 3}, ["x"], 0.0)
    assert math.isnan(rows[0].tpot_ms) and math.isnan(rows[1].speedup) and rows[1].tpot_ms > 0  # no division
    setup = {"target": "t", "drafter": "d", "dtype": "float32", "labels": ["ar", "dspark"], "depths": {"dspark": 3},
             "timing": {"load_average_max": 1.9, "cpu_count": 2}}
    env = {"backend": "cpu", "device_kind": "cpu", "cpu_count": 2}
    table = EvalResults({"temperature": 0.0, "max_new_tokens": 8, "max_samples": 1}, setup, env, rows, []).table()
    assert "WARNING: decode time not measured" in table and "load average" not in table  # 1.9 < 2 cores
    assert "inf" not in table.lower() and "nan" not in table.lower()
    assert next(ln for ln in table.splitlines() if ln.startswith("x ") and " ar " in ln).split()[5] == "-"
    assert report.timing_warnings(EvalResults({}, {}, {}, [], [])) == []  # no timing block, no warning


# ----------------------------------------------------------------------------- the shared end-to-end run


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    """``python -m sparkjax.eval`` on the demo pair (3 sets x 1 prompt, ar, sparklingtree@16), into a folder with a
    stale plot and a user's file."""
    out = tmp_path_factory.mktemp("eval_out")
    (out / "throughput_vs_batch.png").write_bytes(b"an earlier sweep's plot")
    (out / "notes.txt").write_text("keep me")
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(["--methods", "ar,sparklingtree", "--budgets", "16", "--max-samples", "1", "--max-new-tokens", "8",
                   "--repeats", "1", "--stage-samples", "1", "--no-progress", "--out", str(out)])
    return types.SimpleNamespace(rc=rc, out=out, stdout=buf.getvalue(),
                                 js=json.loads((out / "results.json").read_text()))


def test_e2e_table_files_and_csv(e2e):
    assert e2e.rc == 0, e2e.stdout
    assert "bundled demo pair" in e2e.stdout and "accept_rate@k" in e2e.stdout and "as ar" in e2e.stdout
    for label in ("ar", "sparklingtree@16"):
        assert re.search(rf"^all\s+{re.escape(label)}\s", e2e.stdout, re.M), label
    # each method's warm-up: its wall time, the share spent compiling, the programs compiled (none when the
    # persistent cache served them), in results.json and in the printed report
    warm = e2e.js["setup"]["warmup"]
    assert list(warm) == ["ar", "sparklingtree@16"] and "warm-up (compiling and a first run" in e2e.stdout
    wall, each = e2e.js["setup"]["warmup_wall"]["seconds"], [w["seconds"] for w in warm.values()]
    assert max(each) <= wall <= sum(each) + 1.0  # the methods warmed up side by side, each within the whole
    for label, w in warm.items():
        assert w["seconds"] >= w["compile_seconds"] >= sum(p["seconds"] for p in w["programs"]) >= 0
        assert re.search(rf"^  {re.escape(label)}\s+{w['seconds']:.1f} s  compile", e2e.stdout, re.M), label
    plots = {"acceptance_per_depth.png", "tau_speedup.png", "stage_time.png"}
    assert {p.name for p in e2e.out.iterdir()} == {"results.json", "results.csv", "notes.txt", *plots}
    assert (e2e.out / "notes.txt").read_text() == "keep me"  # the stale sweep plot is gone, the user's file kept
    assert all((data := (e2e.out / name).read_bytes())[:8] == PNG and len(data) > 10_000 for name in plots)
    with open(e2e.out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    summary = e2e.js["summary"]
    assert len(rows) == len(summary) == 8  # 3 sets + all, 2 methods
    assert {"dataset", "label", "method", "budget", "drafter", "drafter_role", "n_samples", "tau_pooled",
            "tau_per_response", "tokens_per_s", "tokens_per_s_best", "speedup", "speedup_best", "timing_spread",
            "same_as_ar", "accept_rate@1", "accept_rate@16", "stage_verify_ms_per_round"} <= set(rows[0])
    for row, js in zip(rows, summary, strict=True):
        assert (row["dataset"], row["label"]) == (js["dataset"], js["label"])
        assert float(row["tau_pooled"]) == pytest.approx(js["tau_pooled"])
        assert row["timing_spread"] == ""  # one repetition: no spread, an empty cell
        if js["accept_rate"]:
            assert float(row["accept_rate@1"]) == pytest.approx(js["accept_rate"][0])
            assert float(row["stage_verify_ms_per_round"]) == pytest.approx(js["stage_ms_per_round"]["verify"])


def test_e2e_json_matches_independent_recounts(e2e):
    js = e2e.js
    assert js["format"] == "sparkjax.eval/1" and not js["interrupted"] and js["setup"]["default_pair"]
    assert js["config"]["max_new_tokens"] == 8 and js["environment"]["versions"]["jax"]
    assert js["setup"]["labels"] == ["ar", "sparklingtree@16"] and js["setup"]["baseline_methods"] == []
    assert (drafter := js["setup"]["drafter"]).endswith("dspark_b16")
    records, labels = js["records"], js["setup"]["labels"]
    assert {(r["dataset"], r["label"]) for r in records} == {(d, m) for d in ds.DEMO_SETS for m in labels}
    for r in [*records, *js["summary"]]:
        assert (r["drafter"], r["drafter_role"]) == ((None, None) if r["label"] == "ar" else (drafter, "drafter"))
    outputs = {(r["dataset"], r["label"]): r["samples"][0]["output_ids"] for r in records}
    for (name, _), ids in outputs.items():
        assert ids == outputs[name, "ar"] and 0 < len(ids) <= 8  # greedy: every method emits ar's tokens
    for r in records:
        assert len(r["run_seconds"]) == len(r["prefill_seconds"]) == 1 and r["run_spread"] is None
        for s in r["samples"]:  # each round counts what it committed (ar's one a step; the last cut at 8 tokens)
            assert 1 + sum(s["acceptance_lengths"]) == len(s["output_ids"]) == s["output_tokens"], r["label"]
        assert r["decode_seconds"] == (None if r["run_seconds"][0] <= r["prefill_seconds"][0]
                                       else pytest.approx(r["run_seconds"][0] - r["prefill_seconds"][0]))
    for row in js["summary"]:
        recs = [r for r in records if r["label"] == row["label"] and row["dataset"] in ("all", r["dataset"])]
        lens = [s["acceptance_lengths"] for r in recs for s in r["samples"]]
        n_rounds = sum(map(len, lens))
        assert row["n_samples"] == len(lens) == (3 if row["dataset"] == "all" else 1) and row["rounds"] == n_rounds
        assert row["tau_pooled"] == pytest.approx(sum(map(sum, lens)) / n_rounds)
        assert row["tau_per_response"] == pytest.approx(sum(sum(x) / len(x) for x in lens if x)
                                                        / sum(1 for x in lens if x))
        if row["label"] == "ar":
            assert row["tau_pooled"] == 1.0 and row["accept_rate"] == [] and row["same_as_ar"] is None
            continue
        depth = js["setup"]["depths"][row["label"]]
        rates = [sum(a >= k + 1 for x in lens for a in x) / n_rounds for k in range(1, depth + 1)]
        assert row["accept_rate"] == pytest.approx(rates)  # the engine's per-depth counts == a recount
        assert row["same_as_ar"] == 1.0 and row["stage_samples"] == row["n_samples"]  # --stage-samples 1
        staged = [r for r in recs if r["stage"]]
        verify = sum(r["stage"]["seconds"]["verify"] for r in staged) / sum(r["stage"]["rounds"] for r in staged)
        assert row["stage_ms_per_round"]["verify"] == pytest.approx(1000 * verify) and verify > 0
        timed = [r for r in recs if r["loop_iterations"] > 0 and r["decode_seconds"]]
        if timed:  # TPOT: the mean over timed batches with a measured decode time
            tpot = sum(r["decode_seconds"] / r["output_tokens"] for r in timed) / len(timed)
            assert row["tpot_ms"] == pytest.approx(1000 * tpot) and row["tokens_per_s"] == pytest.approx(1 / tpot)


def test_e2e_reloads_and_compares(e2e, tmp_path, capsys):
    back = EvalResults.load(e2e.out / "results.json")
    assert [r.to_dict() for r in back.records] == e2e.js["records"]
    assert "sparklingtree@16" in back.table()
    edited = json.loads(json.dumps(e2e.js))
    next(r for r in edited["summary"] if (r["dataset"], r["label"]) == ("all", "sparklingtree@16"))["tau_pooled"] += 0.5
    edited["config"]["max_new_tokens"] = 99
    for row in edited["summary"]:  # an older file without the newer columns still compares
        row.pop("tokens_per_s_best")
    (tmp_path / "b.json").write_text(json.dumps(edited))
    assert main(["--compare", str(e2e.out / "results.json"), str(tmp_path / "b.json")]) == 0
    text = capsys.readouterr().out
    assert "(+0.50" in next(ln for ln in text.splitlines() if re.match(r"all\s+sparklingtree@16\s", ln))
    assert "max_new_tokens: 8 -> 99" in text


# ----------------------------------------------------------------------------- prompt sets


def test_bundled_datasets_and_readme():
    readme = (ROOT / "eval" / "datasets" / "README.md").read_text()
    for name in ds.EVAL_SETS:
        s = ds.load(name)
        assert len(s) >= 50 and all(p.strip() for p in s.prompts) and s.kind == "chat"
        row = next(ln for ln in readme.splitlines() if ln.startswith(f"| {name}.jsonl"))
        assert re.search(r"MIT|Apache-2\.0|CC-BY-4\.0", row), row
    assert "NC" not in "".join(ln for ln in readme.splitlines() if ln.startswith("| "))
    assert ds.DEFAULT == ds.DEMO_SETS == ("python_docs", "stdlib_code", "synthetic_math")
    for name in ds.DEMO_SETS:  # shipped inside the package; stdlib_code is raw code
        s = ds.load(name)
        assert pathlib.Path(s.path).parent == ROOT / "sparkjax" / "assets" / "demo" / "prompts", s.path
        assert len(s) >= 4 and s.kind == ("text" if name == "stdlib_code" else "chat"), (name, s.kind)


def test_user_jsonl_rows(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"turns": ["one", "second turn"]}\n\n  \n{"turns": ["two"], "id": 7}\n{"text": "def f(", "id": 8}\n')
    s = ds.load(str(f))
    assert (s.name, s.prompts, s.lines, s.kinds, s.kind) == ("mine", ("one", "two", "def f("), (1, 4, 5),
                                                             ("chat", "chat", "text"), "mixed")
    cases = {'{"text": 5}': "'text' must be a string", '{"text": "   "}': "'text' is empty",
             '{"turns": ["q"], "text": "def f("}': "both 'turns' and 'text'", '["a list"]': "got list",
             '{"prompt": "x"}': "'turns' list of strings (chat) or a 'text' string",
             '{"turns": "not a list"}': "'turns' must be a non-empty list of strings", '{"turns": ["b"': "malformed"}
    for i, (row, needle) in enumerate(cases.items()):
        f = tmp_path / f"bad{i}.jsonl"
        f.write_text('{"text": "import os\\n"}\n\n' + row + "\n")
        with pytest.raises(DatasetError) as e:
            ds.load(str(f))
        assert str(e.value).startswith(f"{f}:3: ") and needle in str(e.value), str(e.value)


def test_quickstart_notebook_code_compiles():
    text = (ROOT / "eval" / "quickstart.md").read_text()
    assert text.startswith("---\njupyter:") and "jupytext" in text
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    src = "\n".join(blocks)
    compile(src, "quickstart.md", "exec")
    assert len(blocks) >= 4 and "sparkjax.eval" in src and "generate(" in src
    # it runs the bundled demo pair, with the baseline drafter for dflash / ddtree, and encodes raw prompts as such
    assert 'demo.path("target")' in src and "baseline" in src and "encode_prompt(tok, text, kind)" in src


def test_default_tokenizer_is_shipped_and_reproducible():
    from fixtures.default_tokenizer import DEFAULT_TOKENIZER_DIR, default_tokenizer_files

    for name, text in default_tokenizer_files().items():
        assert (DEFAULT_TOKENIZER_DIR / name).read_text(encoding="utf-8") == text, name
    tok = load_tokenizer(DEFAULT_TOKENIZER_DIR)
    text, code = "Héllo,wörld!2+2=4\n", "def f(x):\n    return x and the step\n"
    assert tok(text, add_special_tokens=False)["input_ids"] == list(text.encode("utf-8"))  # one token per byte
    ids = tok(code, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == code and len(ids) < len(code.encode()) and max(ids) < 300  # merges: ids 256-299
    chat = encode_prompt(tok, "hi")
    assert chat[0] == 302 and 303 in chat and 300 not in chat and max(chat) < 320
    assert tok.decode(chat) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tok.convert_ids_to_tokens([300, 301, 302, 303]) == ["<|mask|>", "<|endoftext|>", "<|im_start|>",
                                                               "<|im_end|>"]
    assert tok.eos_token_id == 303 and len(tok) == 320
    with pytest.raises(ValueError, match="kind"):
        encode_prompt(tok, text, "completion")


def test_to_dataframe_without_pandas_is_a_clear_error(monkeypatch):
    res = EvalResults(config={}, setup={"depths": {}}, environment={}, summary=[Row("x", "ar")], records=[])
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas -> ImportError
    with pytest.raises(ImportError, match="pip install pandas"):
        res.to_dataframe()


# ----------------------------------------------------------------------------- bad input, before any work


def test_bad_datasets(tmp_path, capsys, no_model):
    missing, binary, both = tmp_path / "nope.jsonl", tmp_path / "binary.jsonl", tmp_path / "both.jsonl"
    binary.write_bytes(b'{"turns": ["caf\xe9"]}\n')
    both.write_text('{"text": "import os"}\n\n{"turns": ["q"], "text": "def f("}\n')
    (tmp_path / "a").mkdir()
    for d in (tmp_path, tmp_path / "a"):
        (d / "same.jsonl").write_text('{"text": "x"}\n')
    for spec, *needles in ((missing, missing, "not found"), (binary, binary, "UTF-8"), (f"{tmp_path}{os.sep}",
                           tmp_path, "folder"), ("gsm9k", "gsm9k"), (both, f"{both}:3", "both"),
                           (f"{tmp_path / 'same.jsonl'},{tmp_path / 'a' / 'same.jsonl'}", "'same'")):
        bad([*PAIR, "--datasets", str(spec)], capsys, *map(str, needles))


BAD_FLAGS = [
    (["--methods", "ar,medusa"], "--methods", "'medusa'", "sparklingtree"),
    (["--methods", "ar,dspark,ar"], "--methods", "twice"),
    (["--methods", "dspark", "--budgets", "8"], "--budgets", "dspark", "tree"),
    (["--methods", "dflash,dspark", "--top-c", "8"], "--top-c"),
    (["--methods", "ddtree", "--budgets", "0"], "--budgets", "positive"),
    (["--methods", "ddtree", "--budgets", "16,16"], "--budgets", "duplicate"),
    (["--budgets", "sixteen"], "--budgets"),
    *[([flag, "0"], flag) for flag in ("--max-new-tokens", "--repeats", "--batch-size")],
    (["--max-samples", "-1"], "--max-samples"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "0"], "--top-p", "(0, 1]"),
    (["--top-p", "1.5"], "--top-p", "(0, 1]"),
    (["--top-k", "-3"], "--top-k", ">= 0"),
    (["--seed", str(2**64)], "--seed", "2**63"),
    (["--seed", "2**64"], "--seed"),
    (["--drafter", str(FIXTURE / "drafter")], "--drafter", "--target"),
    (["--mesh", "2by2"], "--mesh"),
    (["--compare", "missing_a.json", "missing_b.json"], "missing_a.json", "not found"),
    *[(["--batch-sizes" + v] if v.startswith("=") else ["--batch-sizes", v], "--batch-sizes", needle)
      for v, needle in (("0", "positive"), ("=-4", "positive"), ("1,-4", "positive"), ("1,x", "integers"),
                        ("4,1,4", "twice"), ("", "empty entry"), (" , ", "empty entry"), ("1,,4", "empty entry"))],
    (["--batch-size", "2", "--batch-sizes", "1,2"], "--batch-sizes", "not allowed"),
    (["--batch-sizes", "1,2", "--batch-size", "1"], "--batch-sizes", "not allowed"),
]


def test_bad_flags(capsys, no_model, tmp_path):
    for argv, *needles in BAD_FLAGS:
        line = bad([*argv, "--out", str(tmp_path / "out")], capsys, *needles)
        assert "--batch-size " not in " ".join(argv) or re.search(r"--batch-size(?!s)", line), line  # both named
    assert not (tmp_path / "out").exists()
    assert normalized(EvalConfig(batch_sizes="64, 1,16,4")).batch_sizes == (1, 4, 16, 64)
    assert normalized(EvalConfig(batch_sizes=[3, 1])).batch_sizes == (1, 3)
    cfg = normalized(EvalConfig(batch_sizes=2, budgets="16, 8"))
    assert (cfg.batch_sizes, cfg.budgets) == ((2,), (16, 8))  # budgets keep their order
    for value, needle in (((), "empty list"), ((1, 2.0), "positive"), ((True,), "positive"), ("1.5", "integers"),
                          ((4, 1, 4), "4 is listed twice")):
        with pytest.raises(EvalError, match="--batch-sizes") as e:
            normalized(EvalConfig(batch_sizes=value))
        assert needle in str(e.value), (value, str(e.value))
    with pytest.raises(EvalError, match=r"--batch-size 2 and --batch-sizes 1,2"):
        harness.run(target="t", batch_size=2, batch_sizes=(1, 2))


def test_compare_on_partial_or_corrupt_json_is_one_line(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text('{"config": {}, "summary": []}')
    sweeps = [f'{{"config": {{}}, "summary": [], "sweep": {x}}}' for x in ('[1]', '{"rows": [{"label": "ar"}]}',
                                                                            '{"rows": "x"}', '{"rows": [3]}')]
    for content in ('{"format": "sparkjax.eval/1", "config": {}, "summary": [{"dataset": "a", "lab', "[1, 2]",
                    '{"config": {}, "summary": [{"dataset": "all"}]}', '{"config": [], "summary": []}',
                    '{"config": {}, "summary": [], "setup": 3}', '{"config": {}, "summary": [], "records": [{}]}',
                    "[" * 100_000 + "]" * 100_000, "\udcff", *sweeps):  # cut short, wrong shapes, deep nesting, bytes
        bad_file = tmp_path / "bad.json"
        bad_file.write_text(content, errors="surrogateescape")
        bad(["--compare", str(good), str(bad_file)], capsys, str(bad_file), *(["sweep"] if "sweep" in content else []))


def test_mismatched_pair_and_missing_tokenizer(tmp_path, capsys):
    drafter = shutil.copytree(FIXTURE / "drafter", tmp_path / "drafter")
    cfg = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps({**cfg, "num_target_layers": 8}))  # the pair no longer fits
    bad([*PAIR[:2], "--drafter", str(drafter), *PAIR[4:]], capsys, "num_target_layers", "does not fit")
    target = shutil.copytree(FIXTURE / "target", tmp_path / "target")  # no tokenizer in it, and no --tokenizer
    bad(["--target", str(target), "--drafter", str(FIXTURE / "drafter")], capsys, str(target), "--tokenizer")


def test_subprocess_bad_input_and_help(capsys):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-m", "sparkjax.eval", "--methods", "dspark", "--budgets", "8"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.strip().count("\n") == 0
    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # the defaults the help states are the ones the harness uses
    budgets = "(default: each tree's own, 64 nodes; pctree 32 with the root, or what its beam keeps)"
    assert budgets in text and "(default: 4; 0 = all)" in text
    assert "(default: ar,dspark,ddtree,sparklingtree,pctree,auto)" in text and "(default: 64)" in text
    assert "python_docs,stdlib_code,synthetic_math, the default" in text


# ----------------------------------------------------------------------------- on a fake engine (nothing compiled)


TINY = [*PAIR, "--methods", "ar,dspark", "--datasets", "mbpp", "--max-samples", "1", "--max-new-tokens", "8",
        "--ignore-eos"]
SWEEP = [*PAIR, "--datasets", "mbpp", "--max-samples", "2", "--max-new-tokens", "6", "--methods", "ar,dspark",
         "--repeats", "2"]


class FakeRunner(PairRunner):
    """Canned outputs: every method emits a prompt's first id then 1, 2, ... (drafted ones in rounds of 2); ``LOG``
    records each launch (label, batch size, kind), ``PROMPTS`` each batch."""

    LOG: list = []
    PROMPTS: list = []

    def launch(self, mc, batch, seed, *, prefill_only=False, auto_memory=None):
        FakeRunner.LOG.append((mc.label, len(batch), "prefill" if prefill_only else "full"))
        FakeRunner.PROMPTS.append((mc.label, [list(p) for p in batch]))
        time.sleep(0.0002 if prefill_only else 0.002)
        return types.SimpleNamespace(mc=mc, batch=[list(p) for p in batch], extra=None)

    def _canned(self, mc, batch) -> BatchOutput:
        toks = [[p[0]] + list(range(1, self.max_new_tokens)) for p in batch]
        if not mc.speculative:
            return BatchOutput(toks, [[1] * len(t) for t in toks], [[] for _ in toks])
        return BatchOutput(toks, [[2] * (len(t) // 2) for t in toks],
                           [[len(t) // 2, *[0] * (self.depth(mc) - 1)] for t in toks])

    def outputs(self, res, size=None):
        return self._canned(res.mc, res.batch)

    def instrumented(self, mc, batch, seed):
        FakeRunner.LOG.append((mc.label, len(batch), "stages"))
        out = self._canned(mc, batch)
        out.stage_seconds = {"draft": 0.001, "tree": 0.0005, "verify": 0.002, "commit": 0.0001}
        return out


@pytest.fixture
def fake(monkeypatch):  # runs of this test use FakeRunner; its launch log
    monkeypatch.setattr(harness, "PairRunner", FakeRunner)
    FakeRunner.LOG, FakeRunner.PROMPTS = [], []
    return FakeRunner.LOG


def cli(*argv):
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main([*argv, "--no-progress"])
    return rc, buf.getvalue()


def interrupt_at(monkeypatch, at: int) -> list:
    """``harness.time_batch`` raising KeyboardInterrupt on call number ``at``; returns the calls list."""
    calls, original = [], harness.time_batch

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(harness, "time_batch", flaky)
    return calls


def test_fake_run_interleaves_summarizes_and_reuses_the_folder(fake, tmp_path, monkeypatch):
    """A fake run on two sets, into a folder an earlier run and the user left files in, the load faked high."""
    for name in ("tau_speedup.png", "stage_time.png", "batch_sweep.csv"):
        (tmp_path / name).write_bytes(b"old")
    (tmp_path / "my_notes.txt").write_text("keep me")
    monkeypatch.setattr(os, "getloadavg", lambda: (99.0, 1.0, 1.0))
    rc, stdout = cli(*PAIR, "--methods", "dspark,sparklingtree", "--budgets", "16", "--datasets", "mbpp,mt-bench",
                     "--max-samples", "2", "--max-new-tokens", "8", "--repeats", "3", "--stage-samples", "1",
                     "--no-plots", "--out", str(tmp_path))
    js = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0, stdout
    labels = ["ar", "dspark", "sparklingtree@16"]
    assert js["setup"]["labels"] == labels and "ar was added" in " ".join(js["notes"])
    one = [(lab, 1, kind) for lab in labels for kind in ("full", "prefill")]
    stages = [(lab, 1, "stages") for lab in labels[1:]]
    warm = one[:2] + one[2:4] + stages[:1] + one[4:] + stages[1:]  # warm-ups with the stage functions
    # then per batch 3 interleaved repetitions (A B C, A B C); the first batch of each set gets a stage pass
    n = len(warm)  # the warm-ups run WARMUP_THREADS at a time, each method's own steps in order
    assert sorted(fake[:n]) == sorted(warm) and all(
        [e for e in fake[:n] if e[0] == lab] == [e for e in warm if e[0] == lab] for lab in labels)
    assert fake[n:] == (one * 3 + stages + one * 3) * 2
    assert all(len(r["run_seconds"]) == 3 and r["output_tokens"] == 8 for r in js["records"])
    row = next(r for r in js["summary"] if (r["dataset"], r["label"]) == ("all", "dspark"))
    assert row["tau_pooled"] == 2.0 and row["same_as_ar"] == 1.0 and row["n_samples"] == 4
    assert row["accept_rate"][:2] == [1.0, 0.0] and row["stage_ms_per_round"]["verify"] == pytest.approx(0.5)
    assert "WARNING: the load average reached 99.0" in stdout and js["setup"]["timing"]["load_average_max"] == 99.0
    assert {p.name for p in tmp_path.iterdir()} == {"results.json", "results.csv", "my_notes.txt"}
    assert (tmp_path / "my_notes.txt").read_text() == "keep me"
    with open(tmp_path / "results.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == 9  # 2 sets + all, 3 methods


@pytest.mark.parametrize("argv, table, kept, note", [
    # both mbpp batches done; the first mt-bench one interrupted
    ([*PAIR, "--methods", "ar,dspark", "--datasets", "mbpp,mt-bench", "--max-samples", "2"], "results.csv",
     {("mbpp", None, 0), ("mbpp", None, 1)}, "cover the 2 sample(s)"),
    # both size-1 batches done; the size-2 batch interrupted
    ([*SWEEP, "--batch-sizes", "1,2,3"], "batch_sweep.csv", {("all", 1, 0), ("all", 1, 1)}, "size 1 #1"),
], ids=["per-set", "sweep"])
def test_ctrl_c_keeps_whole_batches(fake, tmp_path, monkeypatch, argv, table, kept, note):
    calls = interrupt_at(monkeypatch, 3)
    (tmp_path / "tau_speedup.png").write_bytes(b"old")
    rc, stdout = cli(*argv, "--out", str(tmp_path), "--no-plots")
    assert rc == 130 and len(calls) == 3
    assert "partial results (interrupted) written to" in stdout and "INTERRUPTED" in stdout
    js = json.loads((tmp_path / "results.json").read_text())
    assert js["interrupted"] and any("interrupted (Ctrl-C)" in n and note in n for n in js["notes"])
    records, rows = (js["sweep"]["records"], js["sweep"]["rows"]) if js["sweep"] else (js["records"], js["summary"])
    assert len(records) == 4 and {(r["dataset"], r.get("batch_size"), r["batch"]) for r in records} == kept
    assert {(r.get("dataset", "all"), r.get("batch_size")) for r in rows} == {k[:2] for k in kept} and len(rows) == 2
    with open(tmp_path / table, newline="") as f:
        assert len(list(csv.DictReader(f))) == 2  # 2 methods
    assert {p.name for p in tmp_path.iterdir()} == {"results.json", table}  # no temp file, no stale plot


def test_ctrl_c_flag_stops_before_the_next_unit_of_work_and_restores_the_handler(fixture_target, monkeypatch):
    stub = FakeRunner(fixture_target, None, eos=[], temperature=0.0, max_new_tokens=8, cache_size=64, prompt_width=8)
    FakeRunner.LOG, stop = [], runner.Interrupt()
    stop.requested = True
    with pytest.raises(runner.Stopped):
        runner.time_batch([(stub, parse_method("ar"))], [[5, 6]], seed=0, repeats=3, stages=False, warmed=set(),
                          stop=stop)
    assert FakeRunner.LOG == []
    seen = []

    def spy(*a, **k):
        seen.append(signal.getsignal(signal.SIGINT))
        raise EvalError("stop here")

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        monkeypatch.setattr(harness, "resolve_pair", spy)
        with pytest.raises(EvalError, match="stop here"):
            harness.run(methods=("ar",))
        assert isinstance(getattr(seen[0], "__self__", None), runner.Interrupt)  # the flag, during the run
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # restored after it
    finally:
        signal.signal(signal.SIGINT, previous)


def test_bad_out_fails_before_any_work(tmp_path, capsys, no_model, monkeypatch):
    a_file = tmp_path / "somefile"
    a_file.write_text("not a folder")
    bad([*TINY, "--out", str(a_file / "sub")], capsys, "--out", str(a_file / "sub"))
    bad([*TINY, "--out", str(a_file)], capsys, "--out", "not a folder")
    assert a_file.read_text() == "not a folder"
    ro = tmp_path / "readonly"
    ro.mkdir()

    def denied(*a, **k):  # a read-only folder (the tests may run as root, who may write anywhere)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("tempfile.mkstemp", denied)
    bad([*TINY, "--out", str(ro)], capsys, "--out", "cannot write", str(ro))
    assert list(ro.iterdir()) == []


def test_what_cannot_fit_is_refused_before_compiling(fake, capsys, monkeypatch, tmp_path):
    bad([*PAIR, "--methods", "ar,sparklingtree", "--budgets", "100000", "--datasets", "mbpp", "--max-samples", "1",
         "--out", str(tmp_path)], capsys, "--budgets", "100000")
    monkeypatch.setattr("sparkjax.eval.engine.memory_limit", lambda: 2**30)  # batch 1 fits in 1 GiB, 100000 not
    line = bad([*TINY, "--batch-sizes", "1,100000", "--out", str(tmp_path)], capsys, "--batch-sizes",
               "batch 100000", "smaller batch sizes", "1.0 GiB")
    assert line and fake == [] and list(tmp_path.iterdir()) == []


def test_baseline_drafter_and_prompts_as_encoded(fake, tmp_path):
    """With --baseline-drafter, dflash and ddtree run with it and the others with --drafter; raw (stdlib_code)
    and chat (python_docs) prompts reach the engine as the tokenizer encodes them."""
    base = shutil.copytree(FIXTURE / "drafter", tmp_path / "base")
    demo_prompts = ROOT / "sparkjax" / "assets" / "demo" / "prompts"
    sets = [str(demo_prompts / "stdlib_code.jsonl"), str(demo_prompts / "python_docs.jsonl")]
    res = harness.run(target=str(FIXTURE / "target"), drafter=str(FIXTURE / "drafter"), baseline_drafter=str(base),
                      tokenizer=str(TOKENIZER), methods=("dflash", "dspark", "ddtree"), budgets=(8,),
                      datasets=sets, max_samples=1, max_new_tokens=8, repeats=1, stage_samples=0, progress=False)
    main_d = str(FIXTURE / "drafter")
    roles = {"ar": (None, None), "dflash": (str(base), "baseline"), "ddtree@8": (str(base), "baseline"),
             "dspark": (main_d, "drafter")}
    assert {m["label"]: (m["drafter"], m["drafter_role"]) for m in res.setup["methods"]} == roles
    assert res.setup["baseline_methods"] == ["dflash", "ddtree@8"]
    assert all((r.drafter, r.drafter_role) == roles[r.label] for r in [*res.records, *res.summary])
    assert f"baseline drafter {base} for dflash, ddtree@8" in res.table()
    tok = load_tokenizer(TOKENIZER)
    first = [json.loads(pathlib.Path(s).read_text().splitlines()[0]) for s in sets]
    expected = [encode_prompt(tok, first[0]["text"], "text"), encode_prompt(tok, first[1]["turns"][0], "chat")]
    assert expected[0] == tok.encode(first[0]["text"], add_special_tokens=False) and expected[1][0] == 302
    assert [p for lab, p in FakeRunner.PROMPTS if lab == "dspark"] == [[expected[0]]] * 4 + [[expected[1]]] * 2


def test_demo_defaults_and_missing_demo_assets(tmp_path, monkeypatch, capsys):
    cfg = EvalConfig()
    assert cfg.datasets == ("python_docs", "stdlib_code", "synthetic_math") and cfg.target is None
    assert (cfg.max_samples, cfg.max_new_tokens, cfg.budgets) == (4, 64, None)
    methods = [parse_method(m) for m in ("ar", "dflash", "dspark")]
    r = pair.resolve_pair(cfg, methods=methods)
    assert r["default"] and (r["d_src"], r["b_src"]) == (str(demo.path("dspark_b16")), str(demo.path("dflash_b16")))
    r = pair.resolve_pair(EvalConfig(target=str(demo.path("target")), drafter="elsewhere"), methods=methods)
    assert (r["d_src"], r["b_src"]) == ("elsewhere", None)  # an explicit drafter: no implicit baseline
    loaded = pair.load_pair(cfg, methods=methods[:2])  # ar + dflash: the Markov drafter is neither needed nor loaded
    assert loaded.drafter is None and not loaded.baseline.config.has_markov
    monkeypatch.setattr(demo, "DEMO_DIR", tmp_path)
    bad([], capsys, str(tmp_path / "target"), str(tmp_path / "dspark_b16"), str(tmp_path / "dflash_b16"),
        "bundled demo pair", "--target")
    with pytest.raises(EvalError) as e:  # only the folders the methods need are asked for
        harness.run(methods=("ar",), progress=False)
    assert str(tmp_path / "target") in str(e.value) and str(tmp_path / "dspark_b16") not in str(e.value)
    (tmp_path / "target").mkdir()  # the target present, no drafter: the two drafter folders are named, not it
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "target" / name).write_text("{}")
    with pytest.raises(EvalError, match="dspark_b16, .*dflash_b16 not found") as e:
        harness.run(progress=False)
    assert str(tmp_path / "target") not in str(e.value)


def test_drafter_objects_get_the_one_pair_check(fixture_target):
    cfg = EvalConfig(tokenizer=str(TOKENIZER), methods=("ar", "dspark"), datasets=("mbpp",))
    methods, _ = config.method_configs(cfg)
    good = sparkjax.load_drafter(FIXTURE / "drafter", target=fixture_target)
    assert pair.load_pair(cfg, target=fixture_target, drafter=good, methods=methods).drafter is good
    wrong = Drafter(dataclasses.replace(good.config, vocab_size=256, mask_token_id=255), rngs=nnx.Rngs(0))
    with pytest.raises(sparkjax.IncompatiblePairError, match="<drafter object> does not fit .*vocab_size"):
        pair.load_pair(cfg, target=fixture_target, drafter=wrong, methods=methods)
    with pytest.raises(sparkjax.ArgumentError, match="drafter"):
        pair.load_pair(cfg, target=fixture_target, drafter=fixture_target, methods=methods)


def test_outputs_raise_on_non_finite_logits():
    out, n = np.array([[5, 6, 7, 0]]), np.array([3])
    no_rounds = np.zeros((1, 0), np.int32)  # ar's launch: no per-round buffer, every round commits one token
    ar = PairRunner.outputs(Launch(out, n, no_rounds, np.array([2]), no_rounds, np.array([-1])))
    assert ar.tokens == [[5, 6, 7]] and ar.acceptance_lengths == [[1, 1]]
    with pytest.raises(sparkjax.NumericalError, match="round 2"):
        PairRunner.outputs(Launch(out, n, no_rounds, np.array([2]), no_rounds, np.array([2])))
    res = PairRunner.outputs(Launch(out, n, np.array([[1, 2, 0]]), np.array([2]), np.array([[1, 0]]), np.array([-1]),
                                types.SimpleNamespace(choices=np.array([[0, 2, -1]])), labels=("ar", "dspark", "t@16")))
    assert res.size_choices == [["ar", "t@16"]] and res.acceptance_lengths == [[1, 2]]  # auto's rounds named


def test_default_methods_their_budgets_and_labels():
    """The default run: one budget per tree, pctree at its own; --budgets sweeps every tree; labels and
    name:options entries expand like names; a bad option or a run listed twice is one EvalError."""
    labels = [mc.label for mc in config.method_configs(EvalConfig())[0]]
    assert labels == ["ar", "dspark", "ddtree@64", "sparklingtree@64", "pctree", "auto"]
    cfg = EvalConfig(methods=("sparklingtree", "sparklingtree:seed", "ddtree@8", "pctree"), budgets=(16, 32))
    assert [mc.label for mc in config.method_configs(config.normalized(cfg))[0]] == [
        "ar", "sparklingtree@16", "sparklingtree@32", "sparklingtree@16:seed", "sparklingtree@32:seed", "ddtree@8",
        "pctree@16", "pctree@32"]
    for methods, match in ((("sparklingtree:bogus",), "candidates"), (("dspark@8",), "only the tree methods"),
                           (("sparklingtree@64", "sparklingtree"), "run twice"), (("nope:seed",), "unknown method")):
        with pytest.raises(EvalError, match=f"^--methods: .*{match}"):
            config.method_configs(config.normalized(EvalConfig(methods=methods)))


def test_every_method_has_its_own_stable_style():
    labels = [mc.label for mc in config.method_configs(EvalConfig(methods=engine.METHODS, budgets=(16, 32, 64)))[0]]
    assert len({plots.method_style(lab)["color"] for lab in labels}) == len(labels) >= 12  # distinct colours
    assert plots.method_style("ar")["color"] != plots.method_style("sparklingtree-beam@32")["color"]


# ----------------------------------------------------------------------------- the batch-size sweep


def test_pool_takes_the_sets_in_turn_and_batches_cycle_it():
    pool = records.prompt_pool({"a": [(0, 1, [1]), (1, 2, [2]), (2, 3, [3])], "b": [(5, 6, [9])]})
    assert [(p[0], p[1]) for p in pool] == [("a", 0), ("b", 5), ("a", 1), ("a", 2)]
    assert records.fill_batches(pool, 1) == [[p] for p in pool]
    assert records.fill_batches(pool, 3) == [[pool[0], pool[1], pool[2]], [pool[3], pool[0], pool[1]]]
    assert records.fill_batches(pool, 6) == [[*pool, pool[0], pool[1]]]  # above N: prompts repeated, cycling
    assert records.fill_batches([], 4) == []


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
    rows = records.summarize_sweep(HAND, ["ar", "dspark"], (1, 2), 0.0)
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
    sampled = records.summarize_sweep(HAND, ["ar", "dspark"], (1, 2), 0.7)  # sampling: no exactness columns
    assert all(r.same_as_ar is None and r.same_across_batches is None for r in sampled)
    notes = records.sweep_notes(rows)
    assert any("batch 2/dspark: only 50% of greedy outputs equal ar's" in n for n in notes)
    assert any("batch 1/dspark: decode time not measured for 1 of 2" in n for n in notes)


def _results(recs, sizes=(1, 2)) -> EvalResults:
    block = records.sweep_block(recs, ["ar", "dspark"], sizes, [("d", 0, 1, [3, 4]), ("d", 1, 2, [5])], 0.0)
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
    d = json.loads((tmp_path / "results.json").read_text())
    d.pop("sweep")  # an older file, from before the sweep
    d["config"].pop("batch_sizes")
    d["summary"] = [{"dataset": "x", "label": "ar", "n_samples": 1, "tau_pooled": 1.0, "accept_rate": []}]
    (tmp_path / "old.json").write_text(json.dumps(d))
    old = EvalResults.load(tmp_path / "old.json")
    assert old.sweep is None and old.sweep_rows == [] and "sweep" not in old.table()


def test_fake_sweep_rows_cycling_and_exactness(fake, tmp_path):
    rc, stdout = cli(*SWEEP, "--batch-sizes", "3,1", "--out", str(tmp_path))
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
    # warm-up of each new shape before its timed runs; no stage pass in a sweep
    assert FakeRunner.LOG[:4] == [("ar", 1, "full"), ("ar", 1, "prefill"), ("dspark", 1, "full"),
                                  ("dspark", 1, "prefill")]
    assert ("ar", 3, "full") in FakeRunner.LOG and not any(kind == "stages" for *_, kind in FakeRunner.LOG)


# ----------------------------------------------------------------------------- on a subprocess

ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _interrupt(tmp_path, name, when, cache, extra=()):
    """The tiny real eval in a subprocess, sent SIGINT once ``when`` shows on stderr (None: pending from its first
    instruction, the child starting with SIGINT blocked). Returns (exit code, stderr, stdout, out folder)."""
    out = tmp_path / name
    cmd = [sys.executable, "-m", "sparkjax.eval", *TINY, "--repeats", "3", "--no-plots", "--out", str(out), *extra]
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # the child starts as from a shell
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if when is None else None
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**ENV, "JAX_COMPILATION_CACHE_DIR": cache},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        if previous is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        signal.signal(signal.SIGINT, handler if handler is not None else signal.default_int_handler)
    buf = ""
    while isinstance(when, str) and when not in buf and (ch := proc.stderr.read(1)):
        buf += ch
    proc.send_signal(signal.SIGINT)
    stdout, rest = proc.communicate(timeout=240)
    return proc.returncode, buf + rest, stdout, out


def _check_files(out, rc):
    """Every results file left behind is complete and valid; the exit code matches what it says."""
    if not (out / "results.json").exists():
        assert not (out / "results.csv").exists()
        return None
    res = json.loads((out / "results.json").read_text())
    with open(out / "results.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == len(res["summary"])
    assert rc == (130 if res["interrupted"] else 0)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temp file left
    return res


@pytest.mark.slow
def test_sigint_subprocess_at_several_moments(tmp_path, xla_cache):
    rc, err, _, out = _interrupt(tmp_path, "early", None, xla_cache)  # during start-up: nothing written
    assert rc == 130 and "interrupted during start-up; nothing was written" in err and "Traceback" not in err
    assert _check_files(out, rc) is None and not (out.exists() and list(out.iterdir()))
    rc, err, stdout, out = _interrupt(tmp_path, "warmup", "warm-up", xla_cache)  # while compiling
    res = _check_files(out, rc)
    assert rc == 130 and res is not None and res["interrupted"] and "INTERRUPTED" in stdout
    assert "Ctrl-C: stopping after the current step" in err and "Traceback" not in err
    rc, err, stdout, out = _interrupt(tmp_path, "mid", "mbpp", xla_cache, extra=["--max-samples", "3"])
    res = _check_files(out, rc)
    assert rc in (0, 130) and "Traceback" not in err and res is not None
    if res["interrupted"]:  # the batches every method had finished, each of them whole
        assert all(len(r["run_seconds"]) == 3 for r in res["records"]) and len(res["records"]) in (0, 2, 4)


@pytest.mark.slow
def test_no_pytorch_advisory_where_only_the_tokenizer_is_used():
    """transformers' "PyTorch was not found" advisory never shows where only its tokenizers are used (the eval,
    ``python -m sparkjax``); ``python -m sparkjax`` says one compile line per method and what its numbers mean."""
    block = "import sys, types; sys.modules['torch'] = None\n"
    eval_tok = f"import sparkjax.eval\nsparkjax.text.load_tokenizer({str(TOKENIZER)!r})\n"
    demo_main = ("import sparkjax.__main__ as m\nm.engine.generate = lambda *a, **k: types.SimpleNamespace("
                 "tokens=[[1, 2]] * 3, acceptance_lengths=[[1]] * 3)\n"
                 "sys.exit(m.main(['--methods', 'ar,dspark', '--max-new-tokens', '4']))\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for code in (block + "import transformers\n",
                                                                             block + eval_tok + demo_main)]
    (_, control), (out, err) = (p.communicate(timeout=240) for p in procs)
    assert "PyTorch was not found" in control  # the control proves torch is blocked and the message would show
    assert procs[1].returncode == 0 and "PyTorch was not found" not in out + err, err
    compiling = [ln for ln in out.splitlines() if "compiling" in ln]
    assert len(compiling) == 2 and all(ln.rstrip().endswith(" s") for ln in compiling), out
    assert sum("speed-ups need a large target" in ln for ln in out.splitlines()) == 1
