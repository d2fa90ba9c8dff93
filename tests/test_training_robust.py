"""Robustness of the trainers: exports never replace user files, one run per output folder,
output and data-cache problems are one clear error, a damaged checkpoint's fallback is one line, a
resumed run keeps each metric step once, and the CLIs answer every mistake with one line and exit 2.

Tiny settings throughout (the fixture target, a 2-layer drafter, a few steps; a 2-layer 32-wide LM).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import types
import zipfile

import numpy as np
import pytest

from sparkjax.errors import ArgumentError, SparkjaxError
from sparkjax.training import DataError, TrainingError, export_run, train
from sparkjax.training import cli as train_cli
from sparkjax.training.data import TokenData
from sparkjax.training.fit import fit
from sparkjax.training.lm import LMConfig, LMTask, export_lm, train_lm
from sparkjax.training.outdir import LOCK_NAME, MARKER, RunLock, check_overwritable, drop_metrics_after
from tests.conftest import TINY_RECIPE as RECIPE
from tests.conftest import TINY_RUN
from tests.conftest import tiny_run_config as cfg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LM_MODEL = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 64, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 16, "rope_theta": 10000.0, "tie_word_embeddings": True, "max_position_embeddings": 128,
}
QUIET = dict(progress=False, log=lambda m: None)
_spec = importlib.util.spec_from_file_location("train_target_cli", os.path.join(ROOT, "train", "train_target.py"))
train_target = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_target)


def cli_sets(**kw) -> list[str]:
    return [a for k, v in {**TINY_RUN, **kw}.items() for a in ("--set", f"{k}={json.dumps(v)}")]


def lm_cfg(**kw) -> LMConfig:
    return LMConfig(**{**dict(model=LM_MODEL, seq_len=16, batch_size=4, steps=4, lr=1e-2, warmup_steps=1,
                              eval_every=2, eval_batches=1, checkpoint_every=2, log_every=1), **kw})


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "Traceback" not in err
    return lines[0]


def user_folder(path) -> str:
    os.makedirs(path)
    with open(os.path.join(path, "thesis.tex"), "w") as f:
        f.write("years of work")
    return str(path)


def survives(folder: str) -> bool:
    with open(os.path.join(folder, "thesis.tex")) as f:
        return f.read() == "years of work"


def steps_of(path: str) -> list[int]:
    with open(path) as f:
        return [json.loads(line)["step"] for line in f]


@pytest.fixture(scope="module")
def run(tiny_run):  # the shared short drafter run: checkpoints at steps 2 and 4
    assert os.path.isfile(os.path.join(tiny_run, "drafter", MARKER))
    return tiny_run


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_tokens")
    stream = np.tile(np.arange(1, 33, dtype=np.uint16), 40)
    np.save(root / "train.tokens.npy", stream)
    np.save(root / "heldout.tokens.npy", stream[:400])
    return dict(tokens=str(root / "train.tokens.npy"), heldout=str(root / "heldout.tokens.npy"))


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory, tokens):
    out = str(tmp_path_factory.mktemp("lm"))
    assert train_lm(lm_cfg(), out, log=lambda *_: None, **tokens).step == 4
    return out


# ----------------------------------------------------------------------------- 1. exports


def test_drafter_export_refuses_a_folder_of_user_files(tmp_path, run, capsys):
    dest = user_folder(tmp_path / "mine")
    rc = train_cli.main(["--recipe", RECIPE, "--output", run, *cli_sets(), "--export", "latest",
                         "--export-to", dest, "--no-progress"])
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and dest in line and MARKER in line
    assert survives(dest) and sorted(os.listdir(dest)) == ["thesis.tex"]
    with pytest.raises(ArgumentError, match="not a folder"):  # a regular file is not replaced by a folder
        export_run(cfg(), run, "latest", os.path.join(dest, "thesis.tex"), log=lambda m: None)
    assert survives(dest)
    for place in (".", "", os.getcwd(), os.path.dirname(os.getcwd()), "/"):
        with pytest.raises(ArgumentError):
            check_overwritable(place)
    # an empty folder, then the folder sparkjax wrote (it holds the marker), may be replaced
    empty = tmp_path / "empty"
    empty.mkdir()
    export_run(cfg(), run, "2", str(empty), log=lambda m: None)
    assert os.path.isfile(empty / MARKER) and os.path.isfile(empty / "model.safetensors")
    export_run(cfg(), run, "latest", str(empty), log=lambda m: None)
    assert os.path.isfile(empty / MARKER)
    # a run refuses user files where it will export before it trains (a missing target would fail later)
    dest = user_folder(tmp_path / "out" / "drafter")
    with pytest.raises(ArgumentError, match="drafter.*not empty and was not written by sparkjax"):
        train(cfg(target=str(tmp_path / "no_target")), str(tmp_path / "out"), **QUIET)
    assert survives(dest)


def test_lm_export_refuses_a_folder_of_user_files(tmp_path, lm_run, capsys):
    dest = user_folder(tmp_path / "mine")
    rc = train_target.main(["--output", lm_run, "--export", dest, "--dtype", "float32"])
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and dest in line
    assert survives(dest) and sorted(os.listdir(dest)) == ["thesis.tex"]
    with pytest.raises(ArgumentError, match="not empty and was not written by sparkjax"):
        export_lm(lm_run, dest, dtype="float32", overwrite=True)
    assert survives(dest)
    # its own export may be replaced by the next one
    ours = str(tmp_path / "ours")
    assert train_target.main(["--output", lm_run, "--export", ours, "--dtype", "float32"]) == 0
    assert os.path.isfile(os.path.join(ours, MARKER))
    assert train_target.main(["--output", lm_run, "--export", ours, "--dtype", "float32"]) == 0
    assert os.path.isfile(os.path.join(ours, "model.safetensors"))


# ----------------------------------------------------------------------------- 2. one run per output folder

HOLD_LOCK = textwrap.dedent("""
    import sys, time
    from sparkjax.training.outdir import RunLock
    lock = RunLock(sys.argv[1])
    print("LOCKED", flush=True)
    time.sleep(600)
""")


def test_a_second_run_into_the_same_output_is_refused(tmp_path, tokens, run, lm_run, capsys):
    out = str(tmp_path / "busy")
    os.makedirs(out)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, out], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
    try:
        assert holder.stdout.readline().strip() == "LOCKED"
        with pytest.raises(TrainingError, match=f"{out} is in use by another training run \\(process {holder.pid}\\)"):
            train(cfg(), out, **QUIET)
        with pytest.raises(TrainingError, match="in use by another training run"):
            train_lm(lm_cfg(), out, log=lambda *_: None, **tokens)
        rc = train_cli.main(["--recipe", RECIPE, "--output", out, *cli_sets(), "--no-progress"])
        line = one_error_line(capsys.readouterr().err)
        assert rc == 2 and out in line and "another training run" in line
        assert not os.path.exists(os.path.join(out, "metrics.jsonl"))  # nothing of the refused runs
        assert not os.path.exists(os.path.join(out, "checkpoints"))
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # a crashed run: the OS releases its lock
        holder.wait()
    # a run that ended (or was killed) has released its lock; in one process a held lock refuses too (flock is
    # per open file description) and a released one does not
    for folder in (out, run, lm_run):
        RunLock(folder).release()
    with RunLock(out):
        with pytest.raises(TrainingError, match="in use"):
            RunLock(out)
    RunLock(out).release()


# ----------------------------------------------------------------------------- 3. output folder and data cache


def test_bad_output_folders_are_refused_before_any_work(tmp_path, monkeypatch, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    bogus = cfg(target=str(tmp_path / "no_such_target"))  # any work would fail on the target instead

    def refused(out, msg, cli=True):
        with pytest.raises(TrainingError, match=msg):
            train(bogus, out, **QUIET)
        with pytest.raises(TrainingError, match=msg):
            train_lm(lm_cfg(), out, log=lambda *_: None, tokens="missing.npy", heldout="missing.npy")
        if cli:
            rc = train_cli.main(["--recipe", RECIPE, "--output", out, *cli_sets(), "--no-progress"])
            line = one_error_line(capsys.readouterr().err)
            assert rc == 2 and out in line and msg in line

    refused(str(a_file), "is not a folder")
    refused(str(a_file / "sub"), "cannot be created")
    assert a_file.read_text() == "keep me"
    # a folder of other files with a config.json / metrics.jsonl of its own: a run would overwrite them
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.json").write_text('{"mine": true}')
    refused(str(project), f"{project} is not a training run folder but holds config.json", cli=False)
    assert os.listdir(project) == ["config.json"] and (project / "config.json").read_text() == '{"mine": true}'
    # read-only: tests run as root, so the permission check is simulated
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if os.fspath(p) == str(ro) else real(p, mode, **kw))
    refused(str(ro), f"{ro} is not writable", cli=False)
    assert os.listdir(ro) == []


def test_truncated_data_cache_raises_a_data_error_naming_it(tmp_path, run):
    src = os.path.join(run, "data", "train.npz")
    bad = tmp_path / "train.npz"
    with open(src, "rb") as f:
        bad.write_bytes(f.read()[: os.path.getsize(src) // 2])
    with pytest.raises(zipfile.BadZipFile):  # what numpy raises for it
        np.load(bad)["input_ids"]
    with pytest.raises(DataError, match=f"{bad}: cannot read token data"):
        TokenData.load(str(bad))
    assert issubclass(DataError, TrainingError) and issubclass(TrainingError, SparkjaxError)
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04junk")
    with pytest.raises(DataError, match="junk.npz"):
        TokenData.load(str(tmp_path / "junk.npz"))
    # the cache write is atomic: no temp file is left beside it, and it reads back
    data = TokenData.load(src)
    data.save(str(tmp_path / "again.npz"))
    assert sorted(os.listdir(tmp_path)) == ["again.npz", "junk.npz", "train.npz"]
    np.testing.assert_array_equal(TokenData.load(str(tmp_path / "again.npz")).input_ids, data.input_ids)


def test_resume_with_a_truncated_data_cache_rebuilds_it(tmp_path, run):
    out = str(tmp_path / "copy")
    shutil.copytree(run, out)
    cache = os.path.join(out, "data", "train.npz")
    os.truncate(cache, os.path.getsize(cache) // 3)
    messages = []
    result = train(cfg(), out, resume=True, progress=False, log=messages.append)
    notes = [m for m in messages if "rebuilding the data cache" in m]
    assert len(notes) == 1 and cache in notes[0], messages
    assert result.resumed_from == 4  # the rebuilt data match the checkpoint's fingerprint
    np.testing.assert_array_equal(TokenData.load(cache).input_ids,
                                  TokenData.load(os.path.join(run, "data", "train.npz")).input_ids)


# ----------------------------------------------------------------------------- 4. one line for a damaged checkpoint

RESUME = textwrap.dedent("""
    import sys
    from sparkjax.training.cli import main
    rc = main(sys.argv[1:])
    print("DROPPED", getattr(sys.unraisablehook, "dropped", None), flush=True)
    sys.exit(rc)
""")


@pytest.mark.slow
def test_damaged_checkpoint_fallback_prints_one_line(tmp_path, run, xla_cache):
    out = str(tmp_path / "damaged")
    shutil.copytree(run, out)
    zeroed = 0
    for root, _, files in os.walk(os.path.join(out, "checkpoints", "4", "state")):
        for name in files if os.path.basename(root) == "d" else ():  # the array data and b-tree nodes
            path = os.path.join(root, name)
            with open(path, "r+b") as f:
                f.write(b"\0" * os.path.getsize(path))
            zeroed += 1
    assert zeroed > 0
    proc = subprocess.run(
        [sys.executable, "-c", RESUME, "--recipe", RECIPE, "--output", out, *cli_sets(), "--resume", "--no-progress"],
        capture_output=True, text=True, cwd=ROOT, timeout=400,
        env={**os.environ, "JAX_COMPILATION_CACHE_DIR": xla_cache,
             "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[0])["resumed_from"] == 2
    warn = [line for line in proc.stderr.splitlines() if "corrupted or incomplete" in line]
    assert len(warn) == 1 and "falling back to step 2" in warn[0]
    noise = [line for line in proc.stderr.splitlines()
             if "Exception ignored" in line or "Event loop is closed" in line or "Traceback" in line]
    assert len(noise) < 5, proc.stderr[-3000:]
    print(proc.stdout.splitlines()[-1])  # DROPPED n: how many reports the filter took out
    assert len(proc.stderr.splitlines()) < 12, proc.stderr[-3000:]
    assert os.path.isdir(os.path.join(out, "checkpoints", "corrupt-4-0"))


def _late_tensorstore_read() -> None:
    """What a failed orbax restore leaves: a tensorstore read awaited on an event loop that is closed
    (the restore failed on another read) before this read completes."""
    import tensorstore as ts

    promise, future = ts.Promise.new()

    async def read():
        return await future

    async def restore():
        pending = asyncio.ensure_future(read())
        await asyncio.sleep(0)
        assert not pending.done()
        raise ValueError("another read failed")

    loop = asyncio.new_event_loop()
    with pytest.raises(ValueError):
        loop.run_until_complete(restore())
    loop.close()
    promise.set_result(1)  # the read completes: tensorstore calls loop.call_soon_threadsafe on the closed loop


def test_closed_loop_filter_drops_only_that_report(tmp_path, monkeypatch):
    from sparkjax.io.checkpoint import TrainCheckpointer, _ClosedLoopFilter

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    _late_tensorstore_read()
    assert len(seen) == 1 and str(seen[0].exc_value) == "Event loop is closed"  # the noise, without the filter
    TrainCheckpointer(str(tmp_path / "ck"), keep_last=1, keep_best=0).close()  # installs the filter
    hook = sys.unraisablehook
    assert isinstance(hook, _ClosedLoopFilter) and hook.previous == seen.append
    _late_tensorstore_read()
    assert len(seen) == 1 and hook.dropped == 1
    TrainCheckpointer(str(tmp_path / "ck2"), keep_last=1, keep_best=0).close()
    assert sys.unraisablehook is hook  # installed once
    noise = seen[0]
    report = dict(exc_type=RuntimeError, exc_value=noise.exc_value, exc_traceback=noise.exc_traceback, err_msg=None,
                  object=None)
    others = [types.SimpleNamespace(**{**report, **change}) for change in (
        {"exc_value": RuntimeError("something else")}, {"object": object()}, {"exc_traceback": None})]
    for other in others:  # another error, one tied to an object, one raised elsewhere
        hook(other)
    assert seen[1:] == others and hook.dropped == 1


# ----------------------------------------------------------------------------- 5. metrics after a resume


@pytest.mark.parametrize("how", ["killed", "damaged"])
def test_lm_resume_drops_the_metric_lines_past_its_checkpoint(tmp_path, lm_run, tokens, how):
    out = str(tmp_path / "lm")
    shutil.copytree(lm_run, out)
    metrics = os.path.join(out, "metrics.jsonl")
    assert steps_of(metrics) == [1, 2, 3, 4]
    step4 = os.path.join(out, "checkpoints", "4")
    if how == "killed":  # as a kill between the checkpoints of steps 2 and 4 leaves it: lines 3-4, no step 4
        shutil.rmtree(step4)
        with open(metrics, "a") as f:
            f.write('{"step": 5, "split": "tr')  # a line cut by the kill
    else:  # step 4's metadata unreadable: the resume falls back to step 2
        with open(os.path.join(step4, "meta", "metadata"), "w") as f:
            f.write("{garbage")
    messages = []
    r = train_lm(lm_cfg(), out, resume=True, log=messages.append, **tokens)
    assert r.step == 4 and "resumed at step 2" in messages
    assert steps_of(metrics) == [1, 2, 3, 4]
    if how == "damaged":
        assert os.path.isdir(os.path.join(out, "checkpoints", "corrupt-4-0"))
        assert sum("falling back to step 2" in m for m in messages) == 1


def test_lm_run_without_a_checkpoint_starts_its_metrics_afresh(tmp_path, lm_run, tokens):
    # a run folder killed before its first checkpoint: some metric lines and its lock file, no checkpoints
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with open(os.path.join(lm_run, "metrics.jsonl")) as f:
        (fresh / "metrics.jsonl").write_text("".join(f.readlines()[:3]))
    shutil.copy(os.path.join(lm_run, LOCK_NAME), fresh / LOCK_NAME)
    train_lm(lm_cfg(), str(fresh), log=lambda *_: None, **tokens)  # lm_run's settings: its compiled programs
    assert steps_of(str(fresh / "metrics.jsonl")) == [1, 2, 3, 4]


def test_drop_metrics_after(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    assert drop_metrics_after(path, 3) == 0 and not os.path.exists(path)
    lines = [{"step": 1, "split": "train"}, {"step": 2, "split": "eval"}, {"step": 3}, {"step": 2, "split": "train"}]
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in lines) + "[1, 2]\n" + '{"step": 4, "lo')
    assert drop_metrics_after(path, 2) == 3
    assert steps_of(path) == [1, 2, 2]


# ----------------------------------------------------------------------------- 6. one line, exit 2


@pytest.mark.parametrize("argv", [
    ["--output", "x"],  # --recipe missing (argparse)
    ["--recipe", RECIPE, "--output", "x", "--steps", "many"],
    ["--recipe", RECIPE, "--output", "x", "--set", "steps"],
    ["--recipe", RECIPE, "--output", "x", "--set", "=3"],
    ["--recipe", "no_such_recipe", "--output", "x"],
    ["--recipe", RECIPE, "--output", "x", "--export-to", "y"],
])
def test_train_cli_mistakes_are_one_line(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        sys.exit(train_cli.main(argv))
    assert info.value.code == 2
    one_error_line(capsys.readouterr().err)
    assert not os.path.exists(tmp_path / "x")


@pytest.mark.parametrize("argv", [
    [],  # --output missing (argparse)
    ["--output", "x"],  # --recipe / --corpus missing
    ["--output", "x", "--recipe", "nope.json", "--corpus", "c"],
    ["--output", "x", "--export", "y", "--tokenizer", "no_tokenizer"],
    ["--output", "x", "--export", "y"],  # not a run
    ["--output", "x", "--recipe", "r.json", "--corpus", "c", "--set", "seq_len"],
    ["--output", "x", "--max-minutes", "soon"],
    ["--output", "x", "--recipe", "r.json", "--corpus", "c", "--set", "model=3"],
    ["--output", "x", "--recipe", "r.json", "--corpus", "c", "--set", 'seed="a"'],
])
def test_train_target_cli_mistakes_are_one_line(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with open("r.json", "w") as f:
        json.dump({"model": LM_MODEL}, f)
    with pytest.raises(SystemExit) as info:
        sys.exit(train_target.main(argv))
    assert info.value.code == 2
    one_error_line(capsys.readouterr().err)
    assert not os.path.exists(tmp_path / "y")


# ----------------------------------------------------------------------------- 7. one loop: SIGTERM / Ctrl-C stop


def test_sigterm_saves_a_checkpoint_and_stops_and_resume_continues(tmp_path, lm_run, tokens):
    out = str(tmp_path / "term")
    before = signal.getsignal(signal.SIGTERM)
    messages = []

    def hook(step, saved):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # handled at once: the loop stops after this step

    r = fit(LMTask(**tokens), lm_cfg(), out, log=messages.append, on_step=hook)
    assert r.stopped_early and r.step == 1, messages
    assert signal.getsignal(signal.SIGTERM) is before  # the previous handler is back
    assert sorted(int(s) for s in os.listdir(os.path.join(out, "checkpoints")) if s.isdigit()) == [1]
    assert any("SIGTERM" in m for m in messages)
    with pytest.raises(KeyboardInterrupt):  # a second signal stops at once
        fit(LMTask(**tokens), lm_cfg(), out, resume=True, log=lambda m: None,
            on_step=lambda step, saved: [os.kill(os.getpid(), signal.SIGINT) for _ in range(2)])
    assert signal.getsignal(signal.SIGTERM) is before
    r = train_lm(lm_cfg(), out, resume=True, log=lambda *_: None, **tokens)
    assert r.step == 4 and not r.stopped_early
    assert steps_of(os.path.join(out, "metrics.jsonl")) == [1, 2, 3, 4]
