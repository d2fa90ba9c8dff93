"""The benchmark harness: metrics on hand-made data, an end-to-end run on the tiny fixture pair, bad input,
Ctrl-C, raw prompts, the baseline drafter (on a random stand-in for the bundled demo pair) and the demo defaults.
No test here needs the real demo weights."""

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
TOKENIZER = ROOT / "eval" / "default_pair" / "tokenizer"  # the synthetic fixture pair's tokenizer (vocab 320)
# The synthetic fixture pair, the harness's default before the bundled demo pair: now given explicitly.
FIXTURE_PAIR = ["--target", str(FIXTURE / "target"), "--drafter", str(FIXTURE / "drafter"), "--tokenizer",
                str(TOKENIZER)]
# Small and shared by the end-to-end and Ctrl-C runs, so the second one hits the jit caches.
SMALL = [*FIXTURE_PAIR, "--methods", "ar,dspark,sparklingtree", "--budgets", "16", "--datasets", "mbpp,mt-bench",
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
    assert metrics.decode_seconds([0.1], [0.3]) is None  # not measured, never a clamped 0
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


@pytest.mark.slow
def test_end_to_end_writes_table_json_csv_pngs(e2e):
    rc, out, stdout = e2e
    assert rc == 0
    assert "speedup" in stdout and "accept_rate@k" in stdout
    assert "bundled demo pair" not in stdout and "baseline drafter" not in stdout  # not the demo; no baseline
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
    assert res["environment"]["versions"]["jax"] and res["setup"]["default_pair"] is False
    assert not res["interrupted"]
    # no --baseline-drafter: every speculative method ran with --drafter
    assert res["setup"]["drafter"] == str(FIXTURE / "drafter") and res["setup"]["baseline_drafter"] is None
    assert res["setup"]["baseline_methods"] == []
    for r in [*res["records"], *res["summary"]]:
        assert r["drafter"] == (None if r["label"] == "ar" else str(FIXTURE / "drafter")), r["label"]
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
            assert r["decode_seconds"] is None or r["decode_seconds"] > 0
        # TPOT: mean over timed units (batches of 1 here) that had a decode step (and a measured decode time)
        timed = [r for r in recs if r["loop_iterations"] > 0 and r["decode_seconds"] is not None]
        ar_recs = [r for r in records if r["label"] == "ar" and row["dataset"] in ("all", r["dataset"])
                   and r["loop_iterations"] > 0 and r["decode_seconds"] is not None]
        if not timed or not ar_recs:  # nothing measured (a very busy machine): no figure rather than a made-up one
            assert row["speedup"] is None and (timed or row["tpot_ms"] is None)
            continue
        tpot = sum(r["decode_seconds"] / r["output_tokens"] for r in timed) / len(timed)
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
    original = harness.time_batch

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # 2 mbpp samples (all methods) done; the first mt-bench call is interrupted
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(harness, "time_batch", flaky)
    rc = main([*SMALL, "--out", str(tmp_path), "--no-plots"])
    assert rc == 130 and len(calls) == 3
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
    pair = FIXTURE_PAIR  # the prompt sets are read before any model is loaded
    missing = tmp_path / "nope.jsonl"
    _bad([*pair, "--datasets", str(missing)], capsys, str(missing), "not found")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"turns": ["caf\xe9"]}\n')
    _bad([*pair, "--datasets", str(binary)], capsys, str(binary), "UTF-8")
    _bad([*pair, "--datasets", str(tmp_path) + os.sep], capsys, str(tmp_path), "folder")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["fine"]}\n\n{"turns": ["broken"\n')
    _bad([*pair, "--datasets", str(bad)], capsys, f"{bad}:3", "malformed JSON")
    no_turns = tmp_path / "noturns.jsonl"
    no_turns.write_text('{"turns": ["fine"]}\n{"prompt": "x"}\n')
    _bad([*pair, "--datasets", str(no_turns)], capsys, f"{no_turns}:2", "'turns'", "'text'")
    _bad([*pair, "--datasets", "gsm9k"], capsys, "gsm9k")


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
    _bad(["--target", str(FIXTURE / "target"), "--drafter", str(drafter), "--tokenizer", str(TOKENIZER)], capsys,
         "num_target_layers", "does not fit")
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
    for flag in ("--target", "--drafter", "--baseline-drafter", "--tokenizer", "--dtype", "--methods", "--budgets",
                 "--top-c", "--temperature", "--datasets", "--max-samples", "--max-new-tokens", "--batch-size",
                 "--seed", "--out", "--compare"):
        assert flag in h.stdout, flag
    text = " ".join(h.stdout.split())  # the defaults the help states are the ones the harness uses
    assert "(default: 16,32,64)" in text and "(default: 4; 0 = all)" in text and "(default: 64)" in text
    assert "python_docs,stdlib_code,synthetic_math, the default" in text


# ----------------------------------------------------------------------------- pieces


def test_default_tokenizer_is_shipped_and_reproducible():
    from fixtures.default_tokenizer import DEFAULT_TOKENIZER_DIR, default_tokenizer_files

    from sparkjax.text import encode_prompt, load_tokenizer

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
    for name in ds.EVAL_SETS:
        s = ds.load(name)
        assert len(s) >= 50 and all(p.strip() for p in s.prompts) and s.kind == "chat"
        row = next(ln for ln in readme.splitlines() if ln.startswith(f"| {name}.jsonl"))
        assert re.search(r"MIT|Apache-2\.0|CC-BY-4\.0", row), row
    assert "NC" not in "".join(ln for ln in readme.splitlines() if ln.startswith("| "))
    # the demo's prompt sets ship inside the package and are the default; stdlib_code is raw code
    assert ds.DEFAULT == ds.DEMO_SETS == ("python_docs", "stdlib_code", "synthetic_math")
    kinds = {name: ds.load(name) for name in ds.DEMO_SETS}
    for name, s in kinds.items():
        assert pathlib.Path(s.path).parent == ROOT / "sparkjax" / "assets" / "demo" / "prompts", s.path
        assert len(s) >= 4 and s.kind == ("text" if name == "stdlib_code" else "chat"), (name, s.kind)


def test_user_jsonl_uses_first_turn_and_skips_blank_lines(tmp_path):
    from sparkjax.eval import datasets as ds

    f = tmp_path / "mine.jsonl"
    f.write_text('{"turns": ["one", "second turn"]}\n\n  \n{"turns": ["two"], "id": 7}\n{"text": "def f(", "id": 8}\n')
    s = ds.load(str(f))
    assert (s.name, s.prompts, s.lines) == ("mine", ("one", "two", "def f("), (1, 4, 5))
    assert s.kinds == ("chat", "chat", "text") and s.kind == "mixed"


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
    # it runs the bundled demo pair, with the baseline drafter for dflash / ddtree, and encodes raw prompts as such
    assert "demo.target_dir()" in src and "baseline" in src and "encode_prompt(tok, text, kind)" in src


# ----------------------------------------------------------------------------- raw prompts


def test_malformed_rows_name_file_and_line(tmp_path, capsys):
    from sparkjax.eval import DatasetError
    from sparkjax.eval import datasets as ds

    cases = {
        '{"text": 5}': "'text' must be a string",
        '{"text": "   "}': "'text' is empty",
        '{"turns": ["q"], "text": "def f("}': "both 'turns' and 'text'",
        '{"prompt": "x"}': "'turns' list of strings (chat) or a 'text' string",
        '["a list"]': "got list",
        '{"turns": "not a list"}': "'turns' must be a non-empty list of strings",
    }
    for i, (row, needle) in enumerate(cases.items()):
        f = tmp_path / f"bad{i}.jsonl"
        f.write_text('{"text": "import os\\n"}\n\n' + row + "\n")
        with pytest.raises(DatasetError) as e:
            ds.load(str(f))
        assert str(e.value).startswith(f"{f}:3: ") and needle in str(e.value), str(e.value)
    # through the CLI: one line, exit code 2
    _bad([*FIXTURE_PAIR, "--datasets", str(tmp_path / "bad2.jsonl")], capsys, f"{tmp_path / 'bad2.jsonl'}:3",
         "both")


def test_raw_text_prompt_is_encoded_as_is():
    from sparkjax.text import encode_prompt, load_tokenizer

    tok = load_tokenizer(TOKENIZER)
    text = "def add(a, b):\n    return a + b\n"
    raw = encode_prompt(tok, text, "text")
    assert raw == tok.encode(text, add_special_tokens=False) and tok.decode(raw) == text
    chat = encode_prompt(tok, text, "chat")
    assert chat[0] == 302 and 302 not in raw and 303 not in raw and len(chat) > len(raw)  # <|im_start|>, <|im_end|>
    with pytest.raises(ValueError, match="kind"):
        encode_prompt(tok, text, "completion")


# ----------------------------------------------------------------------------- the baseline drafter and the demo pair


CODE = ["import os\nimport sys\n\n\ndef main(argv):\n    ", "class Stack:\n    def __init__(self):\n"]
QUESTIONS = ["What is a generator?", "How many pages did Ana read?"]


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    """A random stand-in laid out like the bundled demo pair (sparkjax/assets/demo): a 4-layer Qwen3 target
    with the synthetic fixture tokenizer (vocab 320, committed, so no download), ``dspark_b16`` with a
    Markov head and ``dflash_b16`` without one (block 8 here, to keep the test fast), and two prompt sets."""
    from flax import nnx

    from sparkjax import save_drafter, save_target
    from sparkjax.config import Qwen3Config
    from sparkjax.nn.qwen3 import Qwen3
    from sparkjax.training.models import init_drafter, new_drafter_config

    root = tmp_path_factory.mktemp("demo")
    cfg = Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      rope_theta=10000.0, tie_word_embeddings=True)
    target = Qwen3(cfg, rngs=nnx.Rngs(0))
    # sharpen the random target (as in test_decode) so greedy choices are not near-ties
    target.embed_tokens.embedding.set_value(target.embed_tokens.embedding[...] * 8.0)
    save_target(target, root / "target")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, root / "target" / name)
    (root / "target" / "generation_config.json").write_text(json.dumps({"eos_token_id": 303}))
    common = {"block_size": 8, "num_draft_layers": 1, "target_layer_ids": [1, 2], "mask_token_id": 300,
              "enable_confidence_head": True}
    for name, extra in (("dspark_b16", {"markov_rank": 8, "markov_head_type": "vanilla"}),
                        ("dflash_b16", {"markov_rank": 0, "confidence_head_with_markov": False})):
        dc = new_drafter_config(target.config, {**common, **extra})
        save_drafter(init_drafter(target, dc, seed=1), root / name)
    prompts = root / "prompts"
    prompts.mkdir()
    (prompts / "stdlib_code.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n"
                                                       for i, t in enumerate(CODE)))
    (prompts / "python_docs.jsonl").write_text("".join(json.dumps({"turns": [q], "id": i}) + "\n"
                                                       for i, q in enumerate(QUESTIONS)))
    return root


@pytest.fixture(scope="module")
def baseline_run(standin, tmp_path_factory):
    """One run with --baseline-drafter on the stand-in, recording the prompt ids each method was given."""
    from sparkjax.eval import harness

    out = tmp_path_factory.mktemp("baseline_out")
    batches: list[tuple[str, list[list[int]]]] = []
    original = harness.time_batch

    def spy(units, batch, **kwargs):  # one call per batch, all methods interleaved
        batches.extend((mc.label, [list(ids) for ids in batch]) for _, mc in units)
        return original(units, batch, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(harness, "time_batch", spy)
        res = harness.run(target=str(standin / "target"), drafter=str(standin / "dspark_b16"),
                          baseline_drafter=str(standin / "dflash_b16"),
                          methods=("ar", "dflash", "dspark", "ddtree", "sparklingtree"), budgets=(8,),
                          datasets=(str(standin / "prompts" / "stdlib_code.jsonl"),
                                    str(standin / "prompts" / "python_docs.jsonl")),
                          max_samples=1, max_new_tokens=8, stage_samples=0, plots=False, out=str(out),
                          progress=False)
    return res, json.loads((out / "results.json").read_text()), batches


@pytest.mark.slow
def test_baseline_drafter_runs_dflash_and_ddtree(baseline_run, standin):
    res, js, _ = baseline_run
    main_d, base_d = str(standin / "dspark_b16"), str(standin / "dflash_b16")
    expected = {"ar": (None, None), "dflash": (base_d, "baseline"), "ddtree@8": (base_d, "baseline"),
                "dspark": (main_d, "drafter"), "sparklingtree@8": (main_d, "drafter")}
    setup = js["setup"]
    assert (setup["drafter"], setup["baseline_drafter"]) == (main_d, base_d)
    assert setup["baseline_methods"] == ["dflash", "ddtree@8"] and setup["default_pair"] is False
    assert {m["label"]: (m["drafter"], m["drafter_role"]) for m in setup["methods"]} == expected
    assert js["config"]["baseline_drafter"] is None  # given to run() as an argument, not through the config
    for rows in (js["records"], js["summary"], res.summary):
        assert {r["label"] for r in rows} == set(expected)
        for r in rows:
            assert (r["drafter"], r["drafter_role"]) == expected[r["label"]], r
    assert f"baseline drafter {base_d} for dflash, ddtree@8" in res.table()
    # greedy speculative decoding reproduces ar with either drafter
    assert all(r["same_as_ar"] == 1.0 for r in js["summary"] if r["label"] != "ar")


def test_raw_and_chat_prompts_reach_the_engine_as_encoded(baseline_run):
    from sparkjax.text import load_tokenizer

    _, js, batches = baseline_run
    tok = load_tokenizer(TOKENIZER)
    code_ids = tok.encode(CODE[0], add_special_tokens=False)
    chat_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}], tokenize=False,
                                                  add_generation_prompt=True, enable_thinking=False),
                          add_special_tokens=False)
    assert code_ids != chat_ids[: len(code_ids)] and chat_ids[0] == 302
    seen = {ids[0][0]: ids[0] for _, ids in batches}  # first token -> the prompt (one prompt per batch)
    assert len(batches) == 2 * 5 and all(len(b) == 1 for _, b in batches)
    assert list(seen.values()) == [code_ids, chat_ids]  # stdlib_code first: no template, no special token
    kinds = {d["name"]: d["kind"] for d in js["setup"]["datasets"]}
    assert kinds == {"stdlib_code": "text", "python_docs": "chat"}


def test_baseline_drafter_flags(standin, tmp_path, capsys):
    data = str(standin / "prompts" / "python_docs.jsonl")
    # like --drafter, --baseline-drafter needs --target
    _bad(["--baseline-drafter", str(standin / "dflash_b16")], capsys, "--baseline-drafter", "--target")
    # a baseline drafter that does not fit the target: the error names its file
    _bad(["--target", str(standin / "target"), "--drafter", str(standin / "dspark_b16"), "--baseline-drafter",
          str(FIXTURE / "drafter"), "--datasets", data, "--methods", "ar,dflash"], capsys,
         str(FIXTURE / "drafter"), "does not fit")


def test_demo_defaults_resolve_to_the_bundled_folders(standin, monkeypatch):
    from sparkjax.eval import demo, harness
    from sparkjax.eval.engine import MethodConfig

    assert demo.DEMO_DIR == ROOT / "sparkjax" / "assets" / "demo"  # inside the package
    cfg = harness.EvalConfig()
    assert cfg.datasets == ("python_docs", "stdlib_code", "synthetic_math") and cfg.target is None
    assert (cfg.max_samples, cfg.max_new_tokens, harness.DEFAULT_BUDGETS) == (4, 64, (16, 32, 64))
    monkeypatch.setattr(demo, "DEMO_DIR", standin)
    mcs = [MethodConfig(m) for m in ("ar", "dflash", "dspark")]
    r = harness.resolve_pair(cfg, mcs=mcs)
    assert r["default"] and (r["t_dir"], r["d_src"], r["b_src"]) == (
        str(standin / "target"), str(standin / "dspark_b16"), str(standin / "dflash_b16"))
    # with the demo target and an explicit drafter, every method uses that drafter (no implicit baseline)
    r = harness.resolve_pair(harness.EvalConfig(target=str(standin / "target"), drafter="elsewhere"), mcs=mcs)
    assert r["default"] and (r["d_src"], r["b_src"]) == ("elsewhere", None)
    pair = harness.load_pair(cfg, mcs=mcs)
    assert pair.default and pair.drafter.config.has_markov and not pair.baseline.config.has_markov
    assert pair.target.config.num_hidden_layers == 4 and pair.baseline_dir == str(standin / "dflash_b16")
    # ar + dflash only: the Markov drafter is not needed, so it is neither required nor loaded
    pair = harness.load_pair(cfg, mcs=mcs[:2])
    assert pair.drafter is None and pair.baseline is not None


def test_missing_demo_assets_are_a_clear_error(tmp_path, monkeypatch, capsys, standin):
    from sparkjax.eval import EvalError, demo, run

    monkeypatch.setattr(demo, "DEMO_DIR", tmp_path)
    line = _bad([], capsys, str(tmp_path / "target"), str(tmp_path / "dspark_b16"), str(tmp_path / "dflash_b16"),
                "--target")
    assert "bundled demo pair" in line
    with pytest.raises(EvalError, match=re.escape(str(tmp_path / "target"))):
        run(progress=False, plots=False)
    # only the folders the methods need are asked for: the target alone for ar
    with pytest.raises(EvalError) as e:
        run(methods=("ar",), progress=False, plots=False)
    assert str(tmp_path / "target") in str(e.value) and str(tmp_path / "dspark_b16") not in str(e.value)
    # a demo folder with the target but no drafters names the two drafter folders only
    shutil.copytree(standin / "target", tmp_path / "target")
    with pytest.raises(EvalError) as e:
        run(progress=False, plots=False)
    msg = str(e.value)
    assert str(tmp_path / "dspark_b16") in msg and str(tmp_path / "dflash_b16") in msg
    assert str(tmp_path / "target") not in msg
