"""Writers: the overwrite rule, crash safety (writer subprocesses killed at several points), stale temp
clean-up, clear errors for wrong models / read-only folders / full disks, and verified orbax restores."""

from __future__ import annotations

import builtins
import errno
import glob
import io
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import textwrap

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from sparkjax import load_drafter, load_target, save_drafter, save_target
from sparkjax.errors import ArgumentError, CheckpointError
from sparkjax.io import atomic
from sparkjax.io.atomic import atomic_dir, atomic_file
from sparkjax.io.checkpoint import restore_model, save_model
from sparkjax.io.safetensors import SafetensorsFile, write_safetensors

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_dspark_b16"


@pytest.fixture()
def target(fixture_target):
    return fixture_target


@pytest.fixture()
def drafter(fixture_drafter):
    return fixture_drafter


def _canary(folder: pathlib.Path) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    f = folder / "canary.txt"
    f.write_text("user data")
    return f


def _hidden(parent: pathlib.Path) -> list[str]:
    return sorted(e for e in os.listdir(parent) if e.startswith("."))


def _weights(model) -> np.ndarray:
    return np.asarray(model.layers[1].mlp.up_proj.kernel[...]).astype(np.float32)


def _writers(target, drafter):
    def use_atomic_dir(path, overwrite):
        with atomic_dir(path, overwrite=overwrite) as tmp:
            (pathlib.Path(tmp) / "x.txt").write_text("x")

    return {"save_target": lambda p, o: save_target(target, p, overwrite=o),
            "save_drafter": lambda p, o: save_drafter(drafter, p, overwrite=o),
            "save_model": lambda p, o: save_model(target, p, overwrite=o), "atomic_dir": use_atomic_dir}


# ----------------------------------------------------------------------------- the overwrite rule


@pytest.mark.parametrize("place", ["dot", "empty", "root", "home", "cwd", "cwd-parent"])
def test_overwrite_refuses_protected_places(tmp_path, monkeypatch, target, drafter, place):
    work, home, parent = tmp_path / "parent" / "work", tmp_path / "home", tmp_path / "parent"
    canaries = [_canary(work), _canary(home), _canary(parent)]
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(home))
    path = {"dot": ".", "empty": "", "root": "/", "home": str(home), "cwd": str(work), "cwd-parent": str(parent)}[place]
    root_before = sorted(os.listdir("/"))
    for name, write in _writers(target, drafter).items():
        for overwrite in (True, False):
            with pytest.raises(ArgumentError) as info:
                write(path, overwrite)
            msg = str(info.value)
            assert (repr(path) in msg or os.path.abspath(path) in msg), (name, msg)
            assert "refusing" in msg or not overwrite or place == "empty", (name, msg)
    assert all(c.read_text() == "user data" for c in canaries)
    assert sorted(os.listdir(work)) == ["canary.txt"] and sorted(os.listdir(parent)) == ["canary.txt", "work"]
    assert sorted(os.listdir("/")) == root_before


def test_overwrite_refuses_foreign_folder_file_and_link(tmp_path, target, drafter):
    foreign, afile, link, marked = tmp_path / "foreign", tmp_path / "afile", tmp_path / "link", tmp_path / "marked"
    canary = _canary(foreign)
    afile.write_text("a file")
    save_target(target, marked)
    link.symlink_to(marked)
    for name, write in _writers(target, drafter).items():
        with pytest.raises(ArgumentError, match=rf"{re.escape(str(foreign))}.*not written by sparkjax.*refusing"):
            write(foreign, True)
        with pytest.raises(ArgumentError, match=rf"{re.escape(str(afile))} exists and is not a folder"):
            write(afile, True)
        with pytest.raises(ArgumentError, match=rf"{re.escape(str(link))} is a symbolic link"):
            write(link, True)
        assert canary.read_text() == "user data" and sorted(os.listdir(foreign)) == ["canary.txt"], name
        assert afile.read_text() == "a file" and link.is_symlink()
    (tmp_path / "dotfiles").mkdir()  # a folder that only holds a hidden file is not empty either
    (tmp_path / "dotfiles" / ".bashrc").write_text("keep")
    with pytest.raises(ArgumentError, match="not written by sparkjax"):
        save_target(target, tmp_path / "dotfiles", overwrite=True)
    assert (tmp_path / "dotfiles" / ".bashrc").read_text() == "keep"
    assert _hidden(tmp_path) == []  # no temp folder left by the refusals


def test_overwrite_replaces_marked_and_empty_folders(tmp_path, target, drafter):
    out = tmp_path / "out"
    out.mkdir()  # empty: may be replaced
    save_target(target, out, overwrite=True)
    assert atomic.is_sparkjax_output(out) and load_target(out).dtype == jnp.float32
    with pytest.raises(ArgumentError, match=rf"{out} already exists \(pass overwrite=True"):
        save_target(target, out)
    save_target(target, out, overwrite=True, dtype="bfloat16")  # marked: may be replaced
    back = load_target(out)
    assert back.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_weights(back), _weights(target).astype(ml_dtypes.bfloat16).astype(np.float32))
    assert sorted(os.listdir(out)) == [atomic.MARKER, "config.json", "model.safetensors"]
    # a marked orbax folder can be replaced by another writer's output, and vice versa
    save_model(target, out, overwrite=True)
    assert (out / "sparkjax.json").exists() and not (out / "model.safetensors").exists()
    save_target(target, out, overwrite=True)
    assert (out / "model.safetensors").exists() and not (out / "state").exists()
    d = tmp_path / "d"
    save_drafter(drafter, d)
    save_drafter(drafter, d, overwrite=True, dtype="bfloat16")
    assert load_drafter(d, target=target).dtype == jnp.bfloat16 and atomic.is_sparkjax_output(d)
    assert sorted(os.listdir(tmp_path)) == ["d", "out"]  # nothing left beside them
    old = os.umask(0o027)
    try:
        assert atomic._umask() == 0o027 and os.umask(0o027) == 0o027  # read without changing it
    finally:
        os.umask(old)


def test_empty_path_refused_without_overwrite_and_bad_argument_types(tmp_path, target):
    zeros = {"a": np.zeros(2, np.float32)}
    for bad in ("", "  "):
        with pytest.raises(ArgumentError, match="empty path"):
            save_target(target, bad)
        with pytest.raises(ArgumentError, match="empty path"):
            write_safetensors(bad, zeros)
    for call, pattern in [(lambda: save_target(target, None), "expected a str or os.PathLike, got NoneType"),
                          (lambda: save_target(target, tmp_path / "x", overwrite="yes"), "overwrite: expected True"),
                          (lambda: write_safetensors(tmp_path, zeros), "is a folder"),
                          (lambda: write_safetensors(tmp_path / "t.safetensors", [np.zeros(2)]), "expected a dict")]:
        with pytest.raises(ArgumentError, match=pattern):
            call()
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- wrong models, I/O failures


def test_writers_refuse_the_wrong_model(tmp_path, target, drafter):
    for write, pattern in [
        (lambda p: save_target(None, p), r"save_target: model must be a Qwen3 target.*got NoneType"),
        (lambda p: save_target(drafter, p), r"save_target: .*got Drafter \(use save_drafter"),
        (lambda p: save_drafter(target, p), r"save_drafter: model must be a drafter.*got Qwen3 \(use save_target"),
        (lambda p: save_drafter(None, p), r"save_drafter: .*got NoneType"),
        (lambda p: save_model(drafter, p), r"save_model: model must be a Qwen3 target.*got Drafter"),
        (lambda p: save_model(None, p), r"save_model: .*got NoneType"),
    ]:
        with pytest.raises(ArgumentError, match=pattern):
            write(tmp_path / "out")
    assert os.listdir(tmp_path) == []


def _denied(*a, **k):
    raise PermissionError(errno.EACCES, "Permission denied", k.get("dir", a[0] if a else None))


def test_read_only_folder_is_a_write_error(tmp_path, monkeypatch, target):
    monkeypatch.setattr(tempfile, "mkdtemp", _denied)
    for write in (lambda p: save_target(target, p), lambda p: save_model(target, p)):
        with pytest.raises(CheckpointError, match=rf"{tmp_path / 'ro'}: cannot write the output \(Permission denied"):
            write(tmp_path / "ro")
    monkeypatch.undo()
    monkeypatch.setattr(os, "makedirs", _denied)
    with pytest.raises(atomic.WriteError, match=rf"{tmp_path / 'sub' / 'out'}: cannot create the folder"):
        save_target(target, tmp_path / "sub" / "out")
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


class _FullDisk(io.FileIO):
    """A file that fails with ENOSPC once 5000 bytes are written."""

    def write(self, b):
        if self.tell() + len(b) > 5000:
            super().write(bytes(b)[: 5000 - self.tell()])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(b)


def test_full_disk_leaves_the_old_output(tmp_path, monkeypatch, target):
    import orbax.checkpoint as ocp

    out = tmp_path / "out"
    save_target(target, out)
    before = {p: p.read_bytes() for p in out.iterdir()}
    real_open = builtins.open

    def tight_open(file, mode="r", *a, **k):
        full = "w" in mode and ".model.safetensors.tmp-" in str(file)
        return _FullDisk(file, "w") if full else real_open(file, mode, *a, **k)

    monkeypatch.setattr(builtins, "open", tight_open)
    for dest in (out, tmp_path / "new"):
        with pytest.raises(atomic.WriteError, match=rf"{dest}: cannot write the output \(No space left"):
            save_target(target, dest, overwrite=True, dtype="bfloat16")
    monkeypatch.undo()
    assert {p: p.read_bytes() for p in out.iterdir()} == before and os.listdir(tmp_path) == ["out"]

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
    host, dead, out = atomic._host(), _dead_pid(), tmp_path / "out"

    def make(name, files):
        d = tmp_path / name
        d.mkdir()
        for fname, text in files.items():
            (d / fname).write_text(text)
        return d

    save_target(target, out)
    gone = [make(f".out.tmp-{dead}@{host}-aaaaaaaa", {atomic._WRITING: "", "config.json": "{}"}),
            make(f".out.old-{dead}@{host}-bbbbbbbb", {atomic.MARKER: "", "config.json": "{}"}),
            make(f".out.tmp-{dead}@{host}-cccccccc", {})]
    foreign = make(f".out.tmp-{dead}@{host}-dddddddd", {"notes.txt": "mine"})  # no ownership file: not sparkjax's
    kept = [foreign, make(f".out.tmp-1@{host}-eeeeeeee", {atomic._WRITING: ""}),  # pid 1 is alive
            make(f".out.tmp-{dead}@elsewhere-ffffffff", {atomic._WRITING: ""}),
            make(f".other.tmp-{dead}@{host}-gggggggg", {atomic._WRITING: ""})]  # another destination's temp
    gone.append(tmp_path / f".out.tmp-{dead}@{host}-hhhhhhhh")
    gone[-1].write_text("half a file")
    save_target(target, out, overwrite=True, dtype="bfloat16")
    assert not any(p.exists() for p in gone) and all(p.exists() for p in kept)
    assert (foreign / "notes.txt").read_text() == "mine"
    assert load_target(out).dtype == jnp.bfloat16


def test_recover_restores_an_old_output_moved_aside(tmp_path, target):
    out = tmp_path / "out"
    save_target(target, out)
    os.rename(out, tmp_path / f".out.old-{_dead_pid()}@{atomic._host()}-abcdefgh")  # killed between two renames
    with pytest.raises(ArgumentError, match="already exists"):  # the next writer restores it first ...
        save_target(target, out, dtype="bfloat16")
    back = load_target(out)  # ... and does not write over it without overwrite
    assert back.dtype == jnp.float32 and os.listdir(tmp_path) == ["out"]
    np.testing.assert_array_equal(_weights(back), _weights(target))


def test_atomic_file_cleans_its_stale_temps_and_is_atomic(tmp_path):
    (tmp_path / f".w.safetensors.tmp-{_dead_pid()}@{atomic._host()}-abcdefgh").write_bytes(b"partial")
    path = tmp_path / "w.safetensors"
    write_safetensors(path, {"a": np.arange(4, dtype=np.float32)})
    assert sorted(os.listdir(tmp_path)) == ["w.safetensors"]
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_file(path) as tmp:
            pathlib.Path(tmp).write_text("new")
            raise RuntimeError("boom")
    assert sorted(os.listdir(tmp_path)) == ["w.safetensors"]
    np.testing.assert_array_equal(SafetensorsFile(path).get("a"), np.arange(4, dtype=np.float32))


def test_atomic_exchange_and_the_fallback_without_renameat2(tmp_path, monkeypatch, target):
    a, b = tmp_path / "a", tmp_path / "b"
    _canary(a)
    b.mkdir()
    (b / "2").write_text("b")
    if atomic._exchange(str(a), str(b)):  # Linux: renameat2(RENAME_EXCHANGE)
        assert (a / "2").exists() and (b / "canary.txt").exists()
    monkeypatch.setattr(atomic, "_renameat2", lambda: None)  # e.g. macOS, or an old libc
    out = tmp_path / "out"
    save_target(target, out)
    save_target(target, out, overwrite=True, dtype="bfloat16")
    assert load_target(out).dtype == jnp.bfloat16
    with pytest.raises(ArgumentError, match="not written by sparkjax"):
        save_target(target, a, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "out"]


# ----------------------------------------------------------------------------- writers killed at several points

CHILD = textwrap.dedent("""
    import os, signal, sys
    import sparkjax.io.atomic as A
    from sparkjax import load_target, save_target

    where, n, when = os.environ["SPARKJAX_TEST_KILL"].split(":")  # "<where>:<n>:<before|after>"
    if os.environ.get("SPARKJAX_TEST_NO_EXCHANGE") == "1":
        A._exchange = lambda a, b: False  # a system without renameat2
    owner, name = where.split(".")
    module = {"os": os, "A": A}[owner]
    real = getattr(module, name)
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == int(n) and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        out = real(*args, **kwargs)
        if calls[0] == int(n) and when == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    target = load_target(sys.argv[1])
    setattr(module, name, wrapped)
    save_target(target, sys.argv[2], overwrite=True, dtype="bfloat16")
""")

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
        (tmp_path / name).mkdir()
        if existed:
            save_target(target, tmp_path / name / "out")  # the old output: float32
        procs[name] = subprocess.Popen(
            [sys.executable, str(script), str(FIXTURE / "target"), str(tmp_path / name / "out")],
            env=dict(env, SPARKJAX_TEST_KILL=spec, SPARKJAX_TEST_NO_EXCHANGE="1" if no_exchange else "0"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    old_w = _weights(target)
    new_w = old_w.astype(ml_dtypes.bfloat16).astype(np.float32)
    for name, _spec, _ne, _existed, holds in KILLS:
        out_text = procs[name].communicate(timeout=240)[0].decode(errors="replace")
        assert procs[name].returncode == -9, (name, out_text[-2000:])
        parent, out = tmp_path / name, tmp_path / name / "out"
        leftovers = _hidden(parent)
        assert leftovers and all(f"-{procs[name].pid}@" in e for e in leftovers), (name, leftovers)  # temps left
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
        save_target(target, out, overwrite=True)  # the next writer removes the dead writer's temp folders
        assert os.listdir(parent) == ["out"], (name, os.listdir(parent))
        np.testing.assert_array_equal(_weights(load_target(out)), old_w)


# ----------------------------------------------------------------------------- orbax restores, the converter CLI


def test_restore_model_detects_corruption_and_non_finite(tmp_path, target):
    ck = tmp_path / "ck"
    save_model(target, ck)
    np.testing.assert_array_equal(_weights(restore_model(ck)), _weights(target))
    files = [pathlib.Path(p) for p in glob.glob(str(ck / "state" / "**" / "d" / "*"), recursive=True)]
    data = max(files, key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    for off in range(len(raw) // 3, len(raw) // 3 + 64, 4):  # flip bytes in the largest orbax data file
        raw[off] ^= 0x5A
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=rf"{ck}: tensor '.*' does not match the checksum"):
        restore_model(ck)
    bad = tmp_path / "nan"  # non-finite weights are refused even without a checksum mismatch
    kernel = target.layers[0].mlp.up_proj.kernel
    orig = kernel[...]
    kernel.set_value(orig.at[0, 0].set(jnp.nan))
    try:
        save_model(target, bad)
    finally:
        kernel.set_value(orig)
    with pytest.raises(CheckpointError, match=rf"{bad}: tensor 'layers.0.mlp.up_proj.kernel' holds NaN or Inf"):
        restore_model(bad)
    old = tmp_path / "old"  # a folder saved without checksums still loads
    save_model(target, old)
    meta = json.loads((old / "sparkjax.json").read_text())
    del meta["checksums"], meta["checksum_kind"]
    (old / "sparkjax.json").write_text(json.dumps(meta))
    np.testing.assert_array_equal(_weights(restore_model(old)), _weights(target))


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
        assert dst not in (".", str(work)) or "current working directory" in err, err
    assert cli([src, str(tmp_path / "ck")]) == 0
    assert cli([src, str(tmp_path / "ck")]) == 2 and "already exists" in capsys.readouterr().err
    assert cli([src, str(tmp_path / "ck"), "--overwrite", "--dtype", "bfloat16"]) == 0
    assert restore_model(tmp_path / "ck").dtype == jnp.bfloat16
    assert canary.read_text() == "user data" and os.listdir(work) == ["canary.txt"]
