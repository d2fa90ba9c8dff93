"""eval/bench_scale.py: forced acceptance, the tiny preset end to end, --from-disk and --memory."""

from __future__ import annotations

import json
import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "eval"))

import bench_scale  # noqa: E402

from sparkjax import tree  # noqa: E402
from sparkjax.engine.state import Proposal, Verified  # noqa: E402


def _proposal(parents, depths, tokens=None):
    parents = jnp.asarray([parents], jnp.int32)
    m = parents.shape[1]
    depths = jnp.asarray([depths], jnp.int32)
    tokens = jnp.arange(1, m + 1, dtype=jnp.int32)[None] if tokens is None else jnp.asarray([tokens], jnp.int32)
    mask = tree.visibility(parents[0], int(depths.max()))[None]
    return Proposal(tokens, parents, depths, mask, None)


def _verified(m, vocab=11, best=None):
    logits = np.zeros((1, m + 1, vocab), np.float32)
    for row, tok in (best or {}).items():
        logits[0, row, tok] = 1.0
    return Verified(jnp.asarray(logits), None, None, None)


def test_forced_acceptance_follows_the_deepest_path():
    # root -> 1 -> 3 -> 5 (depth 3) and root -> 2 -> 4 (depth 2); node 6 is a second depth-3 node under 4
    prop = _proposal(parents=[0, 0, 1, 2, 3, 4], depths=[1, 1, 2, 2, 3, 3])
    ver = _verified(6, best={5: 7, 3: 9})
    acc = bench_scale.forced_acceptance(prop, ver, accept=3, depth=4)
    assert np.asarray(acc.indices).tolist() == [[0, 1, 3, 5, -1]]  # the lowest-index depth-3 node's path
    assert np.asarray(acc.length).tolist() == [4]
    assert np.asarray(acc.bonus).tolist() == [7]  # the target's argmax after row 5
    acc = bench_scale.forced_acceptance(prop, ver, accept=2, depth=4)
    assert np.asarray(acc.indices).tolist() == [[0, 1, 3, -1, -1]]
    assert np.asarray(acc.bonus).tolist() == [9]
    acc = bench_scale.forced_acceptance(prop, ver, accept=0, depth=4)
    assert np.asarray(acc.indices).tolist() == [[0, -1, -1, -1, -1]] and np.asarray(acc.length).tolist() == [1]


def test_forced_acceptance_tops_up_a_shallow_tree():
    # a star: four depth-1 nodes, no path longer than 1; forcing 3 takes node 1, then the others in order
    prop = _proposal(parents=[0, 0, 0, 0], depths=[1, 1, 1, 1])
    acc = bench_scale.forced_acceptance(prop, _verified(4), accept=3, depth=3)
    idx = np.asarray(acc.indices)[0].tolist()
    assert idx == [0, 1, 2, 3] and np.asarray(acc.length).tolist() == [4]
    assert len(set(idx)) == len(idx)


def test_forced_acceptance_on_a_chain():
    d = 5
    prop = _proposal(parents=list(range(d)), depths=list(range(1, d + 1)))
    for k in range(d + 1):
        acc = bench_scale.forced_acceptance(prop, _verified(d), accept=k, depth=d)
        assert np.asarray(acc.indices)[0].tolist() == list(range(k + 1)) + [-1] * (d - k)
        assert int(acc.length[0]) == k + 1


def test_bad_arguments_are_named(capsys):
    assert bench_scale.main(["--preset", "huge"]) == 2
    assert "--preset: unknown preset 'huge'" in capsys.readouterr().err
    assert bench_scale.main(["--preset", "tiny", "--accept", "40"]) == 2
    assert "--accept: 40 drafted tokens per round; the drafter drafts 16" in capsys.readouterr().err
    assert bench_scale.main(["--preset", "tiny", "--methods", "nope"]) == 2
    assert "unknown method" in capsys.readouterr().err


def _check_rows(rows, labels, batches, accept):
    assert [(r["label"], r["batch"]) for r in rows] == [(lab, b) for b in batches for lab in ["ar", *labels]]
    for r in rows:
        assert r["ms"]["n"] >= 1 and r["ms"]["min"] <= r["ms"]["median"]
        # differences of two wall times: finite, never clamped (on a loaded machine a tiny one may come out <= 0)
        assert np.isfinite(r["ms"]["median"]) and np.isfinite(r["ar_step_ms"])
        if r["ms"]["min"] <= 0:
            assert "not clamped" in r["note"]
        if r["label"] == "ar":
            assert r["round_ar_steps"] == 1.0
            continue
        assert r["forced_accept"] == accept
        assert r["accepted"] == accept, r  # every round committed exactly accept + 1 tokens
        if r["round_ar_steps"] is not None:
            assert r["round_ar_steps"] == pytest.approx(r["ms"]["median"] / r["ar_step_ms"])
            assert r["projected_speedup"] == pytest.approx(bench_scale.TAU / r["round_ar_steps"])
        else:  # only when noise beat the work: a median, or the AR step's best repetition, came out <= 0
            assert min(r["ms"]["median"], r["ar_step_ms"], rows[0]["ms"]["min"]) <= 0
        assert r["writeup_speedup"] == 4.29


@pytest.mark.slow
def test_tiny_preset_end_to_end(tmp_path, capsys):
    """The tiny preset: the AR step and a forced round of a chain, JSON written atomically, every field sane."""
    out = tmp_path / "scale.json"
    rc = bench_scale.main(["--preset", "tiny", "--methods", "dflash", "--batches", "2", "--accept", "3",
                           "--steps", "3", "--rounds", "2", "--reps", "2", "--no-stages", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "ar (one step)" in text and "dflash" in text and "4.29x" in text
    res = json.loads(out.read_text())
    assert res["complete"] is True and res["preset"] == "tiny"
    _check_rows(res["rows"], ["dflash"], [2], 3)


@pytest.mark.slow
def test_tiny_preset_from_disk_trees_and_stages(tmp_path, capsys):
    """--from-disk writes the HF / DeepSpec folders once (reused the second time), loads them in a child that
    reports load time and peak RSS; a tree method's forced rounds commit exactly --accept + 1; the stage split
    covers the four stages."""
    disk = tmp_path / "pair"
    out = tmp_path / "scale.json"
    args = ["--preset", "tiny", "--methods", "sparklingtree@16", "--batches", "1", "--accept", "5", "--steps", "3",
            "--rounds", "2", "--reps", "1", "--from-disk", str(disk), "--json", str(out)]
    assert bench_scale.main(args) == 0
    first = capsys.readouterr()
    assert "wrote the random tiny pair" in first.err
    assert (disk / "target" / "model.safetensors").is_file() and (disk / "dspark_b16" / "config.json").is_file()
    res = json.loads(out.read_text())
    load = res["load"]
    assert load["load_s"] > 0 and load["model_bytes"] == load["file_bytes"] > 0
    assert 0 < load["largest_tensor"] < load["model_bytes"] and load["peak_rss_growth"] > 0
    _check_rows(res["rows"], ["sparklingtree@16"], [1], 5)
    row = res["rows"][1]
    assert set(row["stages_ms"]) == {"draft", "tree", "verify", "commit"}
    assert sum(row["stage_share"].values()) == pytest.approx(1.0)
    mtime = (disk / "target" / "model.safetensors").stat().st_mtime_ns
    assert bench_scale.main([*args, "--no-stages"]) == 0
    assert "reusing the pair cached" in capsys.readouterr().err
    assert (disk / "target" / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.slow
def test_memory_mode_reports_the_compiled_program(tmp_path, capsys):
    out = tmp_path / "mem.json"
    assert bench_scale.main(["--preset", "tiny", "--memory", "--methods", "ar", "--batches", "1",
                             "--contexts", "128,256", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["memory"]
    assert [(r["method"], r["context"]) for r in rows] == [("ar", 128), ("ar", 256)]
    for r in rows:
        assert r["compile_s"] > 0 and r["argument"] > 0
        assert r["peak_bytes"] == r["argument"] + r["output"] + r["temp"] - r["alias"]
    # the KV cache (6 layers x K/V x 2 KV heads x 16 dims x float32) grows the temporaries with the context
    assert rows[1]["temp"] - rows[0]["temp"] >= 6 * 2 * 2 * 16 * 4 * 128


def test_scan_probe_computes_the_same_decode_step(fixture_target):
    """The scanned decode step the compile-time probe compares against equals the model's own (unrolled)."""
    import jax
    from flax import nnx

    target = fixture_target
    cfg = target.config
    unrolled, scanned, stack = bench_scale.decode_step_fns(target, 32)
    b, n = 2, cfg.num_hidden_layers
    rng = np.random.default_rng(0)
    shape = (b, cfg.num_key_value_heads, 32, cfg.head_dim)
    ks = [jnp.asarray(rng.standard_normal(shape), target.dtype) for _ in range(n)]
    vs = [jnp.asarray(rng.standard_normal(shape), target.dtype) for _ in range(n)]
    tok = jnp.asarray([[5], [7]], jnp.int32)
    lengths = jnp.asarray([3, 9], jnp.int32)
    state = nnx.state(target)
    a = jax.jit(unrolled)(state, tok, ks, vs, lengths)
    c = jax.jit(scanned)(state, stack(target), tok, jnp.stack(ks), jnp.stack(vs), lengths)
    np.testing.assert_allclose(np.asarray(a[0]), np.asarray(c[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.stack([np.asarray(x) for x in a[1]]), np.asarray(c[1]))
    np.testing.assert_array_equal(np.stack([np.asarray(x) for x in a[2]]), np.asarray(c[2]))
