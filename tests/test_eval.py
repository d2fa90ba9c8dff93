"""The eval: metrics by hand, the one shared end-to-end run on the demo pair (its files against independent
recounts), the prompt sets, bad input (one line, exit code 2)."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import types
from contextlib import redirect_stdout

import pytest

from sparkjax.errors import DatasetError, EvalError
from sparkjax.eval import EvalConfig, EvalResults, harness, metrics, report
from sparkjax.eval import datasets as ds
from sparkjax.eval.cli import main
from sparkjax.eval.config import normalized
from sparkjax.eval.records import Record, Row, Sample, summarize
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
