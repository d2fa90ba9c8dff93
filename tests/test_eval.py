"""The benchmark harness: metrics on hand-made data, an end-to-end run on the tiny pair, bad input, Ctrl-C."""

from __future__ import annotations

import csv
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from sparkjax.eval import metrics
from sparkjax.eval.cli import main

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_dspark_b16"
# Small and shared by the end-to-end and Ctrl-C runs, so the second one hits the jit caches.
SMALL = ["--methods", "ar,dspark,sparklingtree", "--budgets", "16", "--datasets", "mbpp,mt-bench",
         "--max-samples", "2", "--max-new-tokens", "16", "--repeats", "2", "--no-progress"]


# ----------------------------------------------------------------------------- metrics on hand-made data


def test_tau_both_definitions_by_hand():
    lens = [[1, 3, 2], [4], []]
    # pooled: (1 + 3 + 2 + 4) / 4 rounds; per response: mean(6 / 3, 4 / 1), the empty response left out
    assert metrics.tau_pooled(lens) == pytest.approx(2.5)
    assert metrics.tau_per_response(lens) == pytest.approx(3.0)
    assert math.isnan(metrics.tau_pooled([[], []]))
    assert math.isnan(metrics.tau_per_response([]))


def test_accept_rates_by_hand():
    # rounds with lengths 1, 3, 2, 4 accepted 0, 2, 1, 3 drafts: depth 1 reached by 3 of 4, depth 2 by 2, depth 3 by 1
    assert metrics.accept_rates_from_lengths([[1, 3, 2], [4]], 4) == pytest.approx([0.75, 0.5, 0.25, 0.0])
    # the same from per-depth counts: response 1 (3 rounds) hit depths [2, 1, 0], response 2 (1 round) [1, 1, 1]
    assert metrics.accept_rates([[2, 1, 0, 0], [1, 1, 1, 0]], [3, 1], 4) == pytest.approx([0.75, 0.5, 0.25, 0.0])
    assert all(math.isnan(x) for x in metrics.accept_rates([[0, 0]], [0], 2))


def test_tpot_speedup_and_stage_times_by_hand():
    # full runs 1.0 / 1.2 / 5.0 s (median 1.2), prefill-only 0.2 / 0.1 / 0.3 s (median 0.2): 1.0 s of decode
    assert metrics.decode_seconds([1.0, 1.2, 5.0], [0.2, 0.1, 0.3]) == pytest.approx(1.0)
    assert metrics.decode_seconds([0.1], [0.3]) == 0.0
    assert metrics.tpot(2.0, 50) == pytest.approx(0.04)
    # TPOT is averaged over timed units: (1 / 10 + 2 / 40) / 2
    assert metrics.mean_tpot([1.0, 2.0], [10, 40]) == pytest.approx(0.075)
    assert metrics.speedup(0.02, 0.008) == pytest.approx(2.5)
    assert math.isnan(metrics.speedup(0.02, 0.0))
    st = metrics.stage_ms_per_round([{"draft": 0.01, "verify": 0.02}, {"draft": 0.03, "verify": 0.04}], [2, 2])
    assert st == pytest.approx({"draft": 10.0, "verify": 15.0})


def test_summarize_hand_made_records():
    from sparkjax.eval.harness import summarize

    def rec(ds, label, idx, out_ids, lens, hits, decode_s):
        return {"dataset": ds, "label": label, "method": label.split("@")[0], "budget": None, "batch": idx,
                "seed": 0, "run_seconds": [decode_s + 0.1], "prefill_seconds": [0.1], "decode_seconds": decode_s,
                "output_tokens": len(out_ids), "loop_iterations": len(lens), "stage": None,
                "samples": [{"index": idx, "line": idx + 1, "prompt_tokens": 5, "output_tokens": len(out_ids),
                             "output_ids": out_ids, "rounds": len(lens), "acceptance_lengths": lens,
                             "accepted_per_depth": hits}]}

    ar = [rec("x", "ar", 0, [1] * 8, [1] * 8, [], 0.8), rec("x", "ar", 1, [2] * 4, [1] * 4, [], 0.8),
          rec("x", "ar", 2, [7], [1], [], 0.3)]
    ar[2]["loop_iterations"] = 0  # the first token was EOS: no decode step, left out of TPOT
    sp = [rec("x", "dspark", 0, [1] * 8, [4, 4], [2, 2, 2], 0.2),
          rec("x", "dspark", 1, [2] * 3 + [9], [1, 3], [1, 1, 0], 0.4)]
    rows = summarize(ar + sp, ["ar", "dspark"], {"ar": 0, "dspark": 3}, ["x"], 0.0)
    r_ar, r_sp = rows
    assert r_ar["tpot_ms"] == pytest.approx(1000 * (0.1 + 0.2) / 2)
    assert r_sp["tpot_ms"] == pytest.approx(1000 * (0.025 + 0.1) / 2)
    assert r_sp["speedup"] == pytest.approx(0.15 / 0.0625)
    assert r_sp["tau_pooled"] == pytest.approx(12 / 4)
    assert r_sp["tau_per_response"] == pytest.approx((4 + 2) / 2)
    assert r_sp["accept_rate"] == pytest.approx([3 / 4, 3 / 4, 2 / 4])
    assert r_sp["same_as_ar"] == pytest.approx(0.5)  # the second output differs from ar's
    assert r_ar["speedup"] == pytest.approx(1.0)
    assert (r_ar["n_samples"], r_ar["output_tokens"], r_ar["rounds"]) == (3, 13, 13)


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    import contextlib
    import io

    out = tmp_path_factory.mktemp("eval_out")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main([*SMALL, "--out", str(out)])
    return rc, out, buf.getvalue()


def test_end_to_end_writes_table_json_csv_pngs(e2e):
    rc, out, stdout = e2e
    assert rc == 0
    assert "tiny synthetic pair" in stdout and "speedup" in stdout and "accept_rate@k" in stdout
    for label in ("ar", "dspark", "sparklingtree@16"):
        assert re.search(rf"^all\s+{re.escape(label)}\s", stdout, re.M), label
    for name in ("results.json", "results.csv", "acceptance_per_depth.png", "tau_speedup.png", "stage_time.png"):
        assert (out / name).is_file(), name
    for name in ("acceptance_per_depth.png", "tau_speedup.png", "stage_time.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name


def test_json_matches_an_independent_recount(e2e):
    _, out, _ = e2e
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["max_new_tokens"] == 16 and res["config"]["methods"] == ["ar", "dspark", "sparklingtree"]
    assert res["environment"]["versions"]["jax"] and res["setup"]["default_pair"] is True
    assert not res["interrupted"]
    records = res["records"]
    assert {(r["dataset"], r["label"]) for r in records} == {
        (d, m) for d in ("mbpp", "mt-bench") for m in ("ar", "dspark", "sparklingtree@16")}
    for row in res["summary"]:
        recs = [r for r in records if r["label"] == row["label"] and row["dataset"] in ("all", r["dataset"])]
        samples = [s for r in recs for s in r["samples"]]
        assert row["n_samples"] == len(samples) == (4 if row["dataset"] == "all" else 2)
        lens = [s["acceptance_lengths"] for s in samples]
        n_rounds = sum(len(x) for x in lens)
        assert row["rounds"] == n_rounds
        pooled = sum(sum(x) for x in lens) / n_rounds
        per_resp = sum(sum(x) / len(x) for x in lens if x) / sum(1 for x in lens if x)
        assert row["tau_pooled"] == pytest.approx(pooled)
        assert row["tau_per_response"] == pytest.approx(per_resp)
        if row["label"] == "ar":
            assert pooled == 1.0 and row["accept_rate"] == []
        else:
            # accept_rate@k from the engine's per-depth counts == recount from the per-round lengths
            rates = [sum(a >= k + 1 for x in lens for a in x) / n_rounds for k in range(1, 17)]
            assert row["accept_rate"] == pytest.approx(rates)
            # the stage pass ran on the first sample of each set (--stage-samples defaults to 1)
            assert row["stage_ms_per_round"]["verify"] > 0 and row["stage_samples"] == row["n_samples"] // 2
            staged = [r for r in recs if r["stage"]]
            st = sum(r["stage"]["seconds"]["verify"] for r in staged) / sum(r["stage"]["rounds"] for r in staged)
            assert row["stage_ms_per_round"]["verify"] == pytest.approx(1000 * st)
            assert row["same_as_ar"] == 1.0  # greedy speculative output == the target's own greedy output
        for s in samples:  # every round commits at least one token; tokens stop at max_new_tokens
            assert all(1 <= a <= 17 for a in s["acceptance_lengths"]) and s["output_tokens"] <= 16
        for r in recs:
            assert len(r["run_seconds"]) == len(r["prefill_seconds"]) == 2
            assert r["decode_seconds"] >= 0
        # TPOT: mean over timed units (batches of 1 here) that had a decode step
        timed = [r for r in recs if r["loop_iterations"] > 0]
        tpot = sum(r["decode_seconds"] / r["output_tokens"] for r in timed) / len(timed)
        ar_recs = [r for r in records if r["label"] == "ar" and row["dataset"] in ("all", r["dataset"])
                   and r["loop_iterations"] > 0]
        ar_tpot = sum(r["decode_seconds"] / r["output_tokens"] for r in ar_recs) / len(ar_recs)
        assert row["tpot_ms"] == pytest.approx(1000 * tpot)
        assert row["speedup"] == pytest.approx(ar_tpot / tpot)
        assert row["tokens_per_s"] == pytest.approx(1 / tpot)


def test_csv_has_one_row_per_summary_row(e2e):
    _, out, _ = e2e
    res = json.loads((out / "results.json").read_text())
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(res["summary"]) == 9  # 2 datasets + all, 3 methods
    for row, js in zip(rows, res["summary"], strict=True):
        assert (row["dataset"], row["label"]) == (js["dataset"], js["label"])
        assert float(row["tau_pooled"]) == pytest.approx(js["tau_pooled"])
        if js["accept_rate"]:
            assert float(row["accept_rate@1"]) == pytest.approx(js["accept_rate"][0])
            assert float(row["stage_verify_ms_per_round"]) == pytest.approx(js["stage_ms_per_round"]["verify"])


def test_compare_prints_deltas(e2e, tmp_path, capsys):
    _, out, _ = e2e
    res = json.loads((out / "results.json").read_text())
    row = next(r for r in res["summary"] if r["dataset"] == "all" and r["label"] == "dspark")
    row["tau_pooled"] += 0.5
    res["config"]["max_new_tokens"] = 99
    other = tmp_path / "b.json"
    other.write_text(json.dumps(res))
    assert main(["--compare", str(out / "results.json"), str(other)]) == 0
    text = capsys.readouterr().out
    line = next(ln for ln in text.splitlines() if re.match(r"all\s+dspark\s", ln))
    assert "(+0.50" in line
    assert "max_new_tokens: 16 -> 99" in text


def test_ctrl_c_writes_partial_results(e2e, tmp_path, monkeypatch, capsys):
    from sparkjax.eval import harness

    calls = []
    original = harness.run_batch

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 7:  # 3 methods x 2 mbpp samples done; the first mt-bench call is interrupted
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(harness, "run_batch", flaky)
    rc = main([*SMALL, "--out", str(tmp_path), "--no-plots"])
    assert rc == 130 and len(calls) == 7
    text = capsys.readouterr().out
    assert "partial results (interrupted) written to" in text and "INTERRUPTED" in text
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["interrupted"] is True
    assert {r["dataset"] for r in res["records"]} == {"mbpp"} and len(res["records"]) == 6
    assert {r["dataset"] for r in res["summary"]} == {"mbpp"}
    assert any("interrupted" in n for n in res["notes"])
    assert (tmp_path / "results.csv").read_text().count("\n") == 4  # header + 3 methods


# ----------------------------------------------------------------------------- bad input


def _bad(argv, capsys, *needles):
    rc = main([*argv, "--no-progress", "--no-plots"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_bad_datasets(tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    _bad(["--datasets", str(missing)], capsys, str(missing), "not found")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"turns": ["caf\xe9"]}\n')
    _bad(["--datasets", str(binary)], capsys, str(binary), "UTF-8")
    _bad(["--datasets", str(tmp_path) + os.sep], capsys, str(tmp_path), "folder")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["fine"]}\n\n{"turns": ["broken"\n')
    _bad(["--datasets", str(bad)], capsys, f"{bad}:3", "malformed JSON")
    no_turns = tmp_path / "noturns.jsonl"
    no_turns.write_text('{"turns": ["fine"]}\n{"prompt": "x"}\n')
    _bad(["--datasets", str(no_turns)], capsys, f"{no_turns}:2", "'turns'")
    _bad(["--datasets", "gsm9k"], capsys, "gsm9k")


def test_bad_methods_and_budgets(capsys):
    _bad(["--methods", "ar,medusa"], capsys, "--methods", "'medusa'", "sparklingtree")
    _bad(["--methods", "dspark", "--budgets", "8"], capsys, "--budgets", "dspark", "tree")
    _bad(["--methods", "dflash,dspark", "--top-c", "8"], capsys, "--top-c")
    _bad(["--methods", "ddtree", "--budgets", "0"], capsys, "--budgets")
    _bad(["--max-new-tokens", "0"], capsys, "--max-new-tokens")
    _bad(["--budgets", "sixteen"], capsys, "--budgets")
    _bad(["--compare", "missing_a.json", "missing_b.json"], capsys, "missing_a.json", "not found")


def test_mismatched_pair(tmp_path, capsys):
    drafter = tmp_path / "drafter"
    shutil.copytree(FIXTURE / "drafter", drafter)
    cfg = json.loads((drafter / "config.json").read_text())
    cfg["num_target_layers"] = 8
    (drafter / "config.json").write_text(json.dumps(cfg))
    _bad(["--target", str(FIXTURE / "target"), "--drafter", str(drafter), "--tokenizer",
          str(ROOT / "eval" / "default_pair" / "tokenizer")], capsys, "num_target_layers", "does not fit")
    # a (non-default) target folder without a tokenizer, and no --tokenizer
    target = tmp_path / "target"
    shutil.copytree(FIXTURE / "target", target)
    _bad(["--target", str(target), "--drafter", str(FIXTURE / "drafter")], capsys, str(target), "--tokenizer")


def test_subprocess_bad_input_and_help():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-m", "sparkjax.eval", "--methods", "dspark", "--budgets", "8"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().count("\n") == 0 and "--budgets" in p.stderr
    h = subprocess.run([sys.executable, "-m", "sparkjax.eval", "--help"], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=120)
    assert h.returncode == 0
    for flag in ("--target", "--drafter", "--dtype", "--methods", "--budgets", "--top-c", "--temperature",
                 "--datasets", "--max-samples", "--max-new-tokens", "--batch-size", "--seed", "--out", "--compare"):
        assert flag in h.stdout, flag


# ----------------------------------------------------------------------------- pieces


def test_default_tokenizer_is_shipped_and_reproducible():
    from sparkjax.eval.tokenizer import DEFAULT_TOKENIZER_DIR, default_tokenizer_files, encode_prompt, load_tokenizer

    for name, text in default_tokenizer_files().items():
        assert (DEFAULT_TOKENIZER_DIR / name).read_text(encoding="utf-8") == text, name
    tok = load_tokenizer(DEFAULT_TOKENIZER_DIR)
    text = "Héllo,wörld!2+2=4\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # no merge applies here: one token per UTF-8 byte
    assert tok.decode(ids) == text
    code = "def f(x):\n    return x and the step\n"
    ids = tok(code, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == code and len(ids) < len(code.encode()) and max(ids) < 300  # merges: ids 256-299
    chat = encode_prompt(tok, "hi")
    assert chat[0] == 302 and 303 in chat and 300 not in chat and max(chat) < 320
    assert tok.decode(chat) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tok.convert_ids_to_tokens([300, 301, 302, 303]) == ["<|mask|>", "<|endoftext|>", "<|im_start|>",
                                                               "<|im_end|>"]
    assert tok.eos_token_id == 303 and len(tok) == 320


def test_bundled_datasets_and_readme():
    from sparkjax.eval import datasets as ds

    readme = (ROOT / "eval" / "datasets" / "README.md").read_text()
    for name in ds.BUNDLED:
        s = ds.load(name)
        assert len(s) >= 50 and all(p.strip() for p in s.prompts)
        row = next(ln for ln in readme.splitlines() if ln.startswith(f"| {name}.jsonl"))
        assert re.search(r"MIT|Apache-2\.0|CC-BY-4\.0", row), row
    assert "NC" not in "".join(ln for ln in readme.splitlines() if ln.startswith("| "))


def test_user_jsonl_uses_first_turn_and_skips_blank_lines(tmp_path):
    from sparkjax.eval import datasets as ds

    f = tmp_path / "mine.jsonl"
    f.write_text('{"turns": ["one", "second turn"]}\n\n  \n{"turns": ["two"], "id": 7}\n')
    s = ds.load(str(f))
    assert (s.name, s.prompts, s.lines) == ("mine", ("one", "two"), (1, 4))


def test_to_dataframe_without_pandas_is_a_clear_error(monkeypatch):
    from sparkjax.eval import EvalResults

    res = EvalResults(config={}, setup={"depths": {}}, environment={}, summary=[{"dataset": "x", "label": "ar"}],
                      records=[])
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas -> ImportError
    with pytest.raises(ImportError, match="pip install pandas"):
        res.to_dataframe()


def test_quickstart_notebook_code_compiles():
    text = (ROOT / "eval" / "quickstart.md").read_text()
    assert text.startswith("---\njupyter:") and "jupytext" in text
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 4
    src = "\n".join(blocks)
    compile(src, "quickstart.md", "exec")
    assert "sparkjax.eval" in src and "accept" in src and "generate(" in src
