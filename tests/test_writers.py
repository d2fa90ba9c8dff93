"""Writers: the overwrite rule, crash safety (writer subprocesses killed at several points), stale temp
clean-up, clear errors for wrong models / read-only folders / full disks, and verified orbax restores."""

from __future__ import annotations

import errno
import glob
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from sparkjax import load_drafter, load_target, save_drafter, save_target
from sparkjax.errors import ArgumentError, CheckpointError, SparkjaxError
from sparkjax.io import atomic
from sparkjax.io.atomic import atomic_dir, atomic_file
from sparkjax.io.checkpoint import restore_model, save_model
from sparkjax.io.safetensors import write_safetensors

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_dspark_b16"


@pytest.fixture(scope="module")
def target():
    return load_target(FIXTURE / "target")


@pytest.fixture(scope="module")
def drafter(target):
    return load_drafter(FIXTURE / "drafter", target=target)


def _canary(folder: pathlib.Path, text: str = "user data") -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    f = folder / "canary.txt"
    f.write_text(text)
    return f


def _hidden(parent: pathlib.Path) -> list[str]:
    return sorted(e for e in os.listdir(parent) if e.startswith("."))


def _weights(model) -> np.ndarray:
    return np.asarray(model.layers[1].mlp.up_proj.kernel[...]).astype(np.float32)


# ----------------------------------------------------------------------------- the overwrite rule


def _writers(target, drafter):
    def use_atomic_dir(path, overwrite):
        with atomic_dir(path, overwrite=overwrite) as tmp:
            (pathlib.Path(tmp) / "x.txt").write_text("x")

    return {
        "save_target": lambda p, o: save_target(target, p, overwrite=o),
        "save_drafter": lambda p, o: save_drafter(drafter, p, overwrite=o),
        "save_model": lambda p, o: save_model(target, p, overwrite=o),
        "atomic_dir": use_atomic_dir,
    }


PLACES = ["dot", "empty", "root", "home", "cwd", "cwd-parent"]


@pytest.mark.parametrize("place", PLACES)
def test_overwrite_refuses_protected_places(tmp_path, monkeypatch, target, drafter, place):
    work = tmp_path / "parent" / "work"
    home = tmp_path / "home"
    canaries = [_canary(work), _canary(home), _canary(tmp_path / "parent")]
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(home))
    path = {"dot": ".", "empty": "", "root": "/", "home": str(home), "cwd": str(work),
            "cwd-parent": str(tmp_path / "parent")}[place]
    root_before = sorted(os.listdir("/"))
    for name, write in _writers(target, drafter).items():
        for overwrite in (True, False):
            with pytest.raises(ArgumentError) as info:
                write(path, overwrite)
            msg = str(info.value)
            assert (repr(path) in msg or os.path.abspath(path) in msg), (name, msg)
            if overwrite and place != "empty":
                assert "refusing" in msg, (name, msg)
    for c in canaries:
        assert c.read_text() == "user data"
    assert sorted(os.listdir(work)) == ["canary.txt"]
    assert sorted(os.listdir(tmp_path / "parent")) == ["canary.txt", "work"]
    assert sorted(os.listdir("/")) == root_before


def test_overwrite_refuses_foreign_folder_file_and_link(tmp_path, target, drafter):
    foreign = tmp_path / "foreign"
    canary = _canary(foreign)
    afile = tmp_path / "afile"
    afile.write_text("a file")
    link = tmp_path / "link"
    marked = tmp_path / "marked"
    save_target(target, marked)
    link.symlink_to(marked)
    for name, write in _writers(target, drafter).items():
        with pytest.raises(ArgumentError, match=rf"{re.escape(str(foreign))}.*not written by sparkjax.*refusing"):
            write(foreign, True)
        with pytest.raises(ArgumentError, match=rf"{re.escape(str(afile))} exists and is not a folder"):
            write(afile, True)
        with pytest.raises(ArgumentError, match=rf"{re.escape(str(link))} is a symbolic link"):
            write(link, True)
        assert canary.read_text() == "user data", name
        assert sorted(os.listdir(foreign)) == ["canary.txt"]
        assert afile.read_text() == "a file"
        assert link.is_symlink()
    # a folder that only holds a hidden file is not empty either
    (tmp_path / "dotfiles").mkdir()
    (tmp_path / "dotfiles" / ".bashrc").write_text("keep")
    with pytest.raises(ArgumentError, match="not written by sparkjax"):
        save_target(target, tmp_path / "dotfiles", overwrite=True)
    assert (tmp_path / "dotfiles" / ".bashrc").read_text() == "keep"
    assert _hidden(tmp_path) == []  # no temp folder left by the refusals


def test_overwrite_replaces_marked_and_empty_folders(tmp_path, target):
    out = tmp_path / "out"
    out.mkdir()  # empty: may be replaced
    save_target(target, out, overwrite=True)
    assert atomic.is_sparkjax_output(out)
    assert load_target(out).dtype == jnp.float32
    with pytest.raises(ArgumentError, match=rf"{out} already exists \(pass overwrite=True"):
        save_target(target, out)
    save_target(target, out, overwrite=True, dtype="bfloat16")  # marked: may be replaced
    back = load_target(out)
    assert back.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_weights(back), _weights(target).astype(ml_dtypes.bfloat16).astype(np.float32))
    assert sorted(os.listdir(out)) == [atomic.MARKER, "config.json", "model.safetensors"]
    assert os.listdir(tmp_path) == ["out"]  # nothing left beside it
    # a marked orbax folder can be replaced by another writer's output, and vice versa
    save_model(target, out, overwrite=True)
    assert (out / "sparkjax.json").exists() and not (out / "model.safetensors").exists()
    save_target(target, out, overwrite=True)
    assert (out / "model.safetensors").exists() and not (out / "state").exists()


def test_save_drafter_overwrites_its_own_output(tmp_path, target, drafter):
    out = tmp_path / "d"
    save_drafter(drafter, out)
    save_drafter(drafter, out, overwrite=True, dtype="bfloat16")
    assert load_drafter(out, target=target).dtype == jnp.bfloat16
    assert atomic.is_sparkjax_output(out) and os.listdir(tmp_path) == ["d"]
    from sparkjax.io.atomic import _umask

    old = os.umask(0o027)
    try:
        assert _umask() == 0o027  # read without changing it
        assert os.umask(0o027) == 0o027
    finally:
        os.umask(old)


def test_empty_path_refused_without_overwrite_and_bad_argument_types(tmp_path, target):
    for bad in ("", "  "):
        with pytest.raises(ArgumentError, match="empty path"):
            save_target(target, bad)
        with pytest.raises(ArgumentError, match="empty path"):
            write_safetensors(bad, {"a": np.zeros(2, np.float32)})
    with pytest.raises(ArgumentError, match="expected a str or os.PathLike, got NoneType"):
        save_target(target, None)
    with pytest.raises(ArgumentError, match="overwrite: expected True or False"):
        save_target(target, tmp_path / "x", overwrite="yes")
    with pytest.raises(ArgumentError, match="is a folder"):
        write_safetensors(tmp_path, {"a": np.zeros(2, np.float32)})
    with pytest.raises(ArgumentError, match="tensors: expected a dict"):
        write_safetensors(tmp_path / "t.safetensors", [np.zeros(2)])
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- wrong models, I/O failures


def test_writers_refuse_the_wrong_model(tmp_path, target, drafter):
    cases = [
        (lambda p: save_target(None, p), r"save_target: model must be a Qwen3 target.*got NoneType"),
        (lambda p: save_target(drafter, p), r"save_target: .*got Drafter \(use save_drafter"),
        (lambda p: save_drafter(target, p), r"save_drafter: model must be a drafter.*got Qwen3 \(use save_target"),
        (lambda p: save_drafter(None, p), r"save_drafter: .*got NoneType"),
        (lambda p: save_model(drafter, p), r"save_model: model must be a Qwen3 target.*got Drafter"),
        (lambda p: save_model(None, p), r"save_model: .*got NoneType"),
    ]
    for write, pattern in cases:
        with pytest.raises(ArgumentError, match=pattern):
            write(tmp_path / "out")
    assert os.listdir(tmp_path) == []


def test_read_only_folder_is_a_write_error(tmp_path, monkeypatch, target):
    import tempfile

    def denied(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", k.get("dir"))

    monkeypatch.setattr(tempfile, "mkdtemp", denied)
    for write in (lambda p: save_target(target, p), lambda p: save_model(target, p)):
        with pytest.raises(CheckpointError, match=rf"{tmp_path / 'ro'}: cannot write the output \(Permission denied"):
            write(tmp_path / "ro")
    monkeypatch.undo()

    def no_mkdir(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", a[0])

    monkeypatch.setattr(os, "makedirs", no_mkdir)
    with pytest.raises(atomic.WriteError, match=rf"{tmp_path / 'sub' / 'out'}: cannot create the folder"):
        save_target(target, tmp_path / "sub" / "out")
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


class _FullDisk:
    """A file object that fails with ENOSPC once ``room`` bytes are written."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def write(self, b):
        if len(b) > self.room:
            self.f.write(b[: self.room])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(b)
        return self.f.write(b)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_full_disk_leaves_the_old_output(tmp_path, monkeypatch, target):
    import builtins

    out = tmp_path / "out"
    save_target(target, out)
    before = {p: p.read_bytes() for p in out.iterdir()}
    real_open = builtins.open

    def tight_open(file, mode="r", *a, **k):
        f = real_open(file, mode, *a, **k)
        if "w" in mode and ".model.safetensors.tmp-" in str(file):
            return _FullDisk(f, 5000)
        return f

    monkeypatch.setattr(builtins, "open", tight_open)
    for overwrite_target in (out, tmp_path / "new"):
        with pytest.raises(atomic.WriteError, match=rf"{overwrite_target}: cannot write the output \(No space left"):
            save_target(target, overwrite_target, overwrite=True, dtype="bfloat16")
    monkeypatch.undo()
    assert {p: p.read_bytes() for p in out.iterdir()} == before
    assert os.listdir(tmp_path) == ["out"]

    import orbax.checkpoint as ocp

    def enospc(self, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", enospc)
    with pytest.raises(atomic.WriteError, match=rf"{tmp_path / 'ck'}: .*No space left on device"):
        save_model(target, tmp_path / "ck")
    assert os.listdir(tmp_path) == ["out"]


# ----------------------------------------------------------------------------- stale temps, recovery


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("hostname", ["plainhost", "my-host.example-1"])
def test_stale_temps_are_cleaned_only_when_owned_and_dead(tmp_path, monkeypatch, target, hostname):
    import socket

    monkeypatch.setattr(socket, "gethostname", lambda: hostname)
    host = atomic._host()
    dead = _dead_pid()
    out = tmp_path / "out"

    def make(kind, pid, tail, files):
        d = tmp_path / f".out.{kind}-{pid}@{host}-{tail}"
        d.mkdir()
        for name, text in files.items():
            (d / name).write_text(text)
        return d

    save_target(target, out)
    stale_tmp = make("tmp", dead, "aaaaaaaa", {atomic._WRITING: "", "config.json": "{}"})
    stale_old = make("old", dead, "bbbbbbbb", {atomic.MARKER: "", "config.json": "{}"})
    stale_empty = make("tmp", dead, "cccccccc", {})
    foreign = make("tmp", dead, "dddddddd", {"notes.txt": "mine"})  # no ownership file: not sparkjax's
    live = make("tmp", 1, "eeeeeeee", {atomic._WRITING: ""})  # pid 1 is alive
    other_host = tmp_path / f".out.tmp-{dead}@elsewhere-ffffffff"
    other_host.mkdir()
    (other_host / atomic._WRITING).write_text("")
    unrelated = tmp_path / f".other.tmp-{dead}@{host}-gggggggg"  # another destination's temp
    unrelated.mkdir()
    (unrelated / atomic._WRITING).write_text("")
    stale_file = tmp_path / f".out.tmp-{dead}@{host}-hhhhhhhh"
    stale_file.write_text("half a file")
    save_target(target, out, overwrite=True, dtype="bfloat16")
    for gone in (stale_tmp, stale_old, stale_empty, stale_file):
        assert not gone.exists(), gone
    for kept in (foreign, live, other_host, unrelated):
        assert kept.exists(), kept
    assert (foreign / "notes.txt").read_text() == "mine"
    assert load_target(out).dtype == jnp.bfloat16


def test_recover_restores_an_old_output_moved_aside(tmp_path, target):
    out = tmp_path / "out"
    save_target(target, out)
    aside = tmp_path / f".out.old-{_dead_pid()}@{atomic._host()}-abcdefgh"
    os.rename(out, aside)  # what a writer killed between its two renames leaves (no atomic exchange)
    with pytest.raises(ArgumentError, match="already exists"):  # the next writer restores it first ...
        save_target(target, out, dtype="bfloat16")
    assert load_target(out).dtype == jnp.float32  # ... and does not write over it without overwrite
    assert os.listdir(tmp_path) == ["out"]
    np.testing.assert_array_equal(_weights(load_target(out)), _weights(target))


def test_atomic_file_cleans_its_stale_temps_and_is_atomic(tmp_path):
    dead = _dead_pid()
    stale = tmp_path / f".w.safetensors.tmp-{dead}@{atomic._host()}-abcdefgh"
    stale.write_bytes(b"partial")
    path = tmp_path / "w.safetensors"
    write_safetensors(path, {"a": np.arange(4, dtype=np.float32)})
    assert sorted(os.listdir(tmp_path)) == ["w.safetensors"]
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_file(path) as tmp:
            pathlib.Path(tmp).write_text("new")
            raise RuntimeError("boom")
    assert sorted(os.listdir(tmp_path)) == ["w.safetensors"]
    from sparkjax.io.safetensors import SafetensorsFile

    np.testing.assert_array_equal(SafetensorsFile(path).get("a"), np.arange(4, dtype=np.float32))


def test_atomic_exchange_is_used_on_linux(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "1").write_text("a")
    (b / "2").write_text("b")
    if not atomic._exchange(str(a), str(b)):
        pytest.skip("this OS / file system has no renameat2(RENAME_EXCHANGE); the fallback is tested below")
    assert (a / "2").exists() and (b / "1").exists()


def test_without_renameat2_the_fallback_renames_work(tmp_path, monkeypatch, target):
    monkeypatch.setattr(atomic, "_renameat2", lambda: None)  # e.g. macOS, or an old libc
    out = tmp_path / "out"
    save_target(target, out)
    save_target(target, out, overwrite=True, dtype="bfloat16")
    assert load_target(out).dtype == jnp.bfloat16
    assert os.listdir(tmp_path) == ["out"]
    (tmp_path / "foreign").mkdir()
    _canary(tmp_path / "foreign")
    with pytest.raises(ArgumentError, match="not written by sparkjax"):
        save_target(target, tmp_path / "foreign", overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["foreign", "out"]


# ----------------------------------------------------------------------------- writers killed at several points

CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import sparkjax.io.atomic as A
    from sparkjax import load_target, save_target

    spec = os.environ["SPARKJAX_TEST_KILL"]  # "<where>:<n>:<before|after>" (read only by this test script)
    where, n, when = spec.split(":")
    n = int(n)
    if os.environ.get("SPARKJAX_TEST_NO_EXCHANGE") == "1":
        A._exchange = lambda a, b: False  # a system without renameat2
    owner, name = where.split(".")
    module = {"os": os, "A": A}[owner]
    real = getattr(module, name)
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        out = real(*args, **kwargs)
        if calls[0] == n and when == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    target = load_target(sys.argv[1])
    setattr(module, name, wrapped)
    save_target(target, sys.argv[2], overwrite=True, dtype="bfloat16")
    sys.exit(0)
    """
)

# (id, kill spec, no exchange?, destination existed?, what the destination holds right after the kill)
KILLS = [
    ("mid-write", "os.replace:1:before", False, True, "old"),
    ("before-exchange", "A._exchange:1:before", False, True, "old"),
    ("after-exchange", "A._exchange:1:after", False, True, "new"),
    ("removing-old", "os.unlink:2:after", False, True, "new"),
    ("fallback-between-renames", "os.rename:1:after", True, True, "missing"),
    ("fallback-after-renames", "os.rename:2:after", True, True, "new"),
    ("fresh-before-rename", "A._rename_new:1:before", False, False, "none"),
]


@pytest.mark.slow
def test_writer_killed_at_any_point_leaves_old_or_new(tmp_path, target):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    procs = {}
    for name, spec, no_exchange, existed, _ in KILLS:
        parent = tmp_path / name
        parent.mkdir()
        if existed:
            save_target(target, parent / "out")  # the old output: float32
        procs[name] = subprocess.Popen(
            [sys.executable, str(script), str(FIXTURE / "target"), str(parent / "out")],
            env=dict(env, SPARKJAX_TEST_KILL=spec, SPARKJAX_TEST_NO_EXCHANGE="1" if no_exchange else "0"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
    old_w = _weights(target)
    new_w = old_w.astype(ml_dtypes.bfloat16).astype(np.float32)
    for name, _spec, _ne, _existed, holds in KILLS:
        out_text = procs[name].communicate(timeout=240)[0].decode(errors="replace")
        assert procs[name].returncode == -9, (name, out_text[-2000:])
        parent = tmp_path / name
        out = parent / "out"
        leftovers = _hidden(parent)
        assert leftovers, name  # the kill left temp folders behind ...
        assert all(f"-{procs[name].pid}@" in e for e in leftovers), (name, leftovers)
        if holds == "missing":
            assert not out.exists()
            assert atomic.recover(out)  # ... repaired by the next writer (or recover() itself)
            holds = "old"
        if holds == "none":
            assert not out.exists()
        else:
            back = load_target(out)  # complete: every tensor present, the right shapes
            assert atomic.is_sparkjax_output(out)
            assert back.dtype == (jnp.float32 if holds == "old" else jnp.bfloat16), name
            np.testing.assert_array_equal(_weights(back), old_w if holds == "old" else new_w)
        # the next writer to the same destination removes the dead writer's temp folders
        save_target(target, out, overwrite=True)
        assert os.listdir(parent) == ["out"], (name, os.listdir(parent))
        np.testing.assert_array_equal(_weights(load_target(out)), old_w)


# ----------------------------------------------------------------------------- orbax restore verification


def _largest_data_file(folder: pathlib.Path) -> pathlib.Path:
    files = [pathlib.Path(p) for p in glob.glob(str(folder / "state" / "**" / "d" / "*"), recursive=True)]
    return max(files, key=lambda p: p.stat().st_size)


def test_restore_model_detects_corruption_and_non_finite(tmp_path, target):
    ck = tmp_path / "ck"
    save_model(target, ck)
    back = restore_model(ck)
    np.testing.assert_array_equal(_weights(back), _weights(target))
    # flip bytes in the middle of the largest orbax data file
    data = _largest_data_file(ck)
    raw = bytearray(data.read_bytes())
    for off in range(len(raw) // 3, len(raw) // 3 + 64, 4):
        raw[off] ^= 0x5A
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=rf"{ck}: tensor '.*' does not match the checksum"):
        restore_model(ck)

    # non-finite weights are refused even without a checksum mismatch
    bad = tmp_path / "nan"
    kernel = target.layers[0].mlp.up_proj.kernel
    orig = kernel[...]
    kernel.set_value(orig.at[0, 0].set(jnp.nan))
    try:
        save_model(target, bad)
    finally:
        kernel.set_value(orig)
    with pytest.raises(CheckpointError, match=rf"{bad}: tensor 'layers.0.mlp.up_proj.kernel' holds NaN or Inf"):
        restore_model(bad)

    # a folder saved before checksums existed still loads
    old = tmp_path / "old"
    save_model(target, old)
    meta = json.loads((old / "sparkjax.json").read_text())
    del meta["checksums"], meta["checksum_kind"]
    (old / "sparkjax.json").write_text(json.dumps(meta))
    np.testing.assert_array_equal(_weights(restore_model(old)), _weights(target))


# ----------------------------------------------------------------------------- the converter CLI


def test_hf_to_orbax_follows_the_rule(tmp_path, monkeypatch, capsys):
    from convert.hf_to_orbax import cli

    work = tmp_path / "work"
    canary = _canary(work)
    monkeypatch.chdir(work)
    src = str(FIXTURE / "target")
    for dst in (".", "", str(work), str(tmp_path)):
        assert cli([src, dst, "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    assert canary.read_text() == "user data"
    assert cli([src, str(tmp_path / "ck")]) == 0
    assert cli([src, str(tmp_path / "ck")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert cli([src, str(tmp_path / "ck"), "--overwrite", "--dtype", "bfloat16"]) == 0
    assert restore_model(tmp_path / "ck").dtype == jnp.bfloat16
    assert cli([src, str(work), "--overwrite"]) == 2  # a folder of user files
    assert canary.read_text() == "user data"


def test_hf_to_orbax_exits_2_with_one_line(tmp_path):
    work = tmp_path / "work"
    canary = _canary(work)
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "convert.hf_to_orbax", str(FIXTURE / "target"), ".", "--overwrite"],
                       cwd=work, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "current working directory" in r.stderr, r.stderr
    assert canary.read_text() == "user data"
    assert os.listdir(work) == ["canary.txt"]


def test_errors_are_sparkjax_errors():
    assert issubclass(atomic.WriteError, CheckpointError) and issubclass(atomic.WriteError, SparkjaxError)
