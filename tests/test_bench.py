"""python -m sparkjax.bench: timing protocol, command-line errors and interrupts, the HLO counter (``round``),
forced acceptance (``scale``), tiny real runs of both, the serve report from records."""

from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparkjax import tree
from sparkjax.bench import attention, hlo, scale, serve, timing
from sparkjax.bench.__main__ import main
from sparkjax.engine.state import Proposal, Verified


def test_interleave_order_deadline_stats_never_clamped_and_interrupts(monkeypatch):
    calls = []
    stats = timing.interleave({k: (lambda k=k: calls.append(k)) for k in "abc"}, 3, measure=lambda f: f() or 1.0)
    assert calls == list("abc") * 3 and {k: s.n for k, s in stats.items()} == {"a": 3, "b": 3, "c": 3}
    # a deadline keeps the minimum repetitions
    assert timing.interleave({"a": lambda: None}, 10, measure=lambda f: 1.0, deadline=0.0, min_reps=2)["a"].n == 2
    values = {"a": iter([3.0, 1.0, 2.0]), "b": iter([-1.0, 0.5, -2.0])}
    stats = timing.interleave({k: (lambda it=it: next(it)) for k, it in values.items()}, 3, measure=lambda f: f())
    a, b = stats["a"], stats["b"]
    assert (a.median, a.min, a.max, a.samples, a.spread) == (2.0, 1.0, 3.0, (3.0, 1.0, 2.0), 1.0)
    assert (b.median, b.min, b.samples, b.spread) == (-1.0, -2.0, (-1.0, 0.5, -2.0), None)  # no spread of a median <= 0
    assert timing.wall(lambda: jnp.ones(3) * 2) >= 0
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (99.0, 0.0, 0.0))
    assert "load average 99.0" in timing.load_warning()
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert timing.load_warning() is None
    b = iter([5.0, KeyboardInterrupt])  # Ctrl-C keeps what was measured

    def interrupted():
        x = next(b)
        if x is KeyboardInterrupt:
            raise x
        return x

    with pytest.raises(timing.Interrupted) as e:
        timing.interleave({"a": lambda: 1.0, "b": interrupted, "c": lambda: 2.0}, 4, measure=lambda f: f())
    assert isinstance(e.value, KeyboardInterrupt)
    assert {k: s.samples for k, s in e.value.partial.items()} == {"a": (1.0, 1.0), "b": (5.0,), "c": (2.0,)}


@pytest.mark.parametrize("argv, names", [
    ([], "COMMAND"),
    (["nosuch"], "nosuch"),
    (["round", "--preset", "nope"], "--preset"),
    (["round", "--batches", "0"], "--batches"),
    (["round", "--methods", "ar,nope"], "unknown method"),
    (["round", "--methods", "sparklingtree@16:wide"], "tree option"),
    (["round", "--attention", "flash"], "--attention"),
    (["scale", "--preset", "huge"], "--preset: unknown preset 'huge'"),
    (["scale", "--preset", "tiny", "--accept", "40"], "--accept: 40 drafted tokens per round; the drafter drafts 16"),
    (["scale", "--preset", "tiny", "--steps", "1"], "--steps"),
    (["scale", "--preset", "tiny", "--timeout", "0"], "--timeout"),
    (["attention", "--live", "8,x"], "--live"),
    (["attention", "--live", "300"], "--live"),
    (["attention", "--reps", "0"], "--reps"),
    (["ar", "--batches", "1,-2"], "--batches"),
    (["tree", "--bias-std", "a"], "--bias-std"),
    (["train", "--steps", "0"], "--steps"),
    (["drafter", "--repeats", "0"], "--repeats"),
    (["gpu-compile", "--preset", "tiny", "--cases", "1"], "--cases"),
    (["gpu-compile", "--preset", "tiny", "--cases", "1:32"], "--cases"),
    (["gpu-compile", "--preset", "tiny", "--attention", "flash"], "--attention"),
    (["gpu-compile", "--preset", "tiny", "--methods", "nope"], "nope"),
])
def test_bad_arguments_exit_2_with_one_line(argv, names, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and names in err[0], err


def test_help_of_every_subcommand(capsys):
    for cmd in ("ar", "round", "tree", "drafter", "scale", "train", "attention", "gpu-compile", "device", "serve"):
        assert main([cmd, "--help"]) == 0
        assert f"sparkjax.bench {cmd}" in capsys.readouterr().out


def test_ctrl_c_writes_what_was_measured_and_exits_130(monkeypatch, tmp_path, capsys):
    def interrupted(args, report):
        report.table = lambda rows: f"{len(rows)} rows"
        report.rows.append({"path": "einsum", "live": 8})
        raise timing.Interrupted({})

    monkeypatch.setattr(attention, "run", interrupted)
    out = tmp_path / "att.txt"
    assert main(["attention", "--out", str(out)]) == 130
    text = out.read_text()
    assert text.startswith("# python -m sparkjax.bench attention --out") and "1 rows" in text
    assert "interrupted (Ctrl-C)" in text and "interrupted" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["att.txt"]  # written atomically: no temporary left


_spec = jax.ShapeDtypeStruct  # the programs below are lowered from shapes: no arrays to build


def test_loop_trip_counts_known_derived_or_unknown_and_a_hoisted_bf16_upcast_charged_at_bf16():
    """Nested loops (5 outer trips: a dot of a loop-invariant bf16 weight and a sort; 3 inner): every kernel counted
    per trip (a condition once more), the trip count derived from the condition (i < constant) when XLA states
    none, and a loop of unknown trip count counted once and reported."""
    n, k = 8, 64

    def f(x, w):
        return jax.lax.fori_loop(0, 5, lambda i, v: jax.lax.fori_loop(0, 3, lambda j, u: jnp.tanh(u) * 2,
                                                                      jnp.sort(v @ w)), x)

    text = jax.jit(f).lower(_spec((n, k), jnp.bfloat16), _spec((k, k), jnp.bfloat16)).compile().as_text()
    known = hlo.count_hlo(text)
    derived = hlo.count_hlo(re.sub(r'"known_trip_count":\{"n":"\d+"\},?', "", text))
    unknown = hlo.count_hlo(re.sub(r'"known_(trip_count|init_step)":\{[^{}]*\},?', "", text))
    assert sorted(trip for _, trip in known.loops) == sorted(trip for _, trip in derived.loops) == [3, 5]
    assert (derived.total_kernels, derived.bytes, derived.unknown_loops) == (known.total_kernels, known.bytes, 0)
    assert [trip for _, trip in unknown.loops] == [None, None] and unknown.unknown_loops == 2
    for t, outer, inner in ((known, 5, 3), (unknown, 1, 1)):
        assert {kk.count for kk in t.kernels if kk.sequential} <= {outer, outer + 1, outer * inner,
                                                                   outer * (inner + 1)}
        assert [kk.count for kk in t.kernels if kk.op == "sort"] == [outer]
        dots = [kk for kk in t.kernels if kk.flops]
        assert [(kk.count, kk.flops, kk.sequential) for kk in dots] == [(outer, 2 * n * k * k, True)]
        # the weight is read at 2 bytes an element in every trip, though XLA:CPU carries an f32 copy of it
        assert dots[0].bytes <= (n * k * 2 + k * k) * 2 + n * k * 4


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_byte_model_of_one_dot_and_of_an_in_place_update(dtype):
    m, k, n = 8, 64, 32
    x, w = _spec((m, k), dtype), _spec((k, n), dtype)
    t = hlo.count_hlo(jax.jit(lambda x, w: x @ w).lower(x, w).compile().as_text())
    assert t.bytes == (m * k + k * n + m * n) * jnp.dtype(dtype).itemsize  # XLA:CPU's f32 upcast is not charged
    assert (t.flops, t.total_kernels) == (2 * m * n * k, 1)
    buf, row = _spec((1024, 64), dtype), _spec((1, 64), dtype)
    f = jax.jit(lambda b, r, i: jax.lax.dynamic_update_slice(b, r, (i, 0)), donate_argnums=0)
    t = hlo.count_hlo(f.lower(buf, row, _spec((), jnp.int32)).compile().as_text())
    assert 0 < t.bytes < 1024 * 64 * jnp.dtype(dtype).itemsize / 16  # the buffer is neither read nor rewritten whole


def test_roofline_and_launch_projection():
    t = hlo.Tally([hlo.Kernel("a", "dot", 2, 1e6, 1e9, False), hlo.Kernel("b", "fusion", 10, 100.0, 0.0, True)])
    bw, peak = 1e12, 1e15
    want = 2 * max(1e6 / bw, 1e9 / peak) + 10 * 100 / bw
    assert t.seconds(bw, peak) == pytest.approx(want)
    assert t.seconds(bw, peak, 2e-6) == pytest.approx(want + 10 * 2e-6)  # launches of the sequential kernels
    assert t.seconds(bw, peak, 2e-6, every_kernel=True) == pytest.approx(want + 12 * 2e-6)


def test_fused_attention_model_is_one_kernel_charged_its_operands_and_output():
    """--attention fused: one opaque kernel per attention call, its operands read and its output written once (no
    [B, N, T, S] scores), with 4 B T N H S matrix FLOPs over both parts."""
    b, t, n, kh, h, s1, s2 = 2, 5, 4, 2, 8, 64, 5
    q = _spec((b, t, n, h), jnp.bfloat16)
    parts = [(_spec((b, kh, s, h), jnp.bfloat16), _spec((b, kh, s, h), jnp.bfloat16), _spec((b, t, s), bool))
             for s in (s1, s2)]
    tally = hlo.count_hlo(jax.jit(hlo.fused_attention_model).lower(q, parts).compile().as_text())
    kv = sum(2 * b * kh * s * h * 2 + b * t * s for s in (s1, s2))  # bf16 keys and values, a byte per mask entry
    assert (tally.total_kernels, tally.bytes) == (1, 2 * (b * t * n * h * 2) + kv)  # the queries in, the output out
    assert tally.flops == 4 * b * t * n * h * (s1 + s2)


@pytest.mark.slow
def test_round_on_the_tiny_preset(tmp_path, capsys):
    out, js = tmp_path / "round.txt", tmp_path / "round.json"
    assert main(["round", "--preset", "tiny", "--batches", "1", "--methods", "ar,dspark", "--context", "64",
                 "--out", str(out), "--json", str(js)]) == 0
    rows = json.loads(js.read_text())
    assert [r["method"] for r in rows] == ["ar", "dspark"]
    for field in ("method", "budget", "batch", "preset", "sequential_kernels", "round_ar_steps_at_2us"):
        assert all(field in r for r in rows)
    ar, ds = rows
    assert ar["round_ar_steps_at_2us"] == 1.0 and ds["preset"] == "tiny" and ds["batch"] == 1
    assert ds["sequential_kernels"] > 0  # the dspark chain is a loop over the block's depths
    assert ds["bytes"] > ar["bytes"] and ds["round_ar_steps_at_2us"] > ds["h100_ar_steps_at_0us"]
    assert "PROJECTIONS" in out.read_text() and "dspark" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round.json", "round.txt"]


@pytest.mark.slow
def test_round_fused_attention_is_cheaper_than_einsum(tmp_path):
    """--attention fused passes the opaque model as Options.attention: fewer bytes than the einsum scores."""
    rows = {}
    for attn in ("einsum", "fused"):
        js = tmp_path / f"{attn}.json"
        assert main(["round", "--preset", "tiny", "--batches", "1", "--methods", "sparklingtree@16", "--context",
                     "256", "--attention", attn, "--json", str(js)]) == 0
        rows[attn] = json.loads(js.read_text())[1]
    assert rows["fused"]["bytes"] < rows["einsum"]["bytes"]


CHAIN = (list(range(5)), list(range(1, 6)))
TREE = ([0, 0, 1, 2, 3, 4], [1, 1, 2, 2, 3, 3])  # root -> 1 -> 3 -> 5 and root -> 2 -> 4 -> 6: two of depth 3


@pytest.mark.parametrize("shape, accept, want", [
    (TREE, 3, [0, 1, 3, 5, -1]),  # the lowest-index deepest node's path
    (TREE, 2, [0, 1, 3, -1, -1]),
    (TREE, 0, [0, -1, -1, -1, -1]),
    (([0, 0, 0, 0], [1, 1, 1, 1]), 3, [0, 1, 2, 3]),  # a star: node 1, then the others in index order
    *[(CHAIN, k, list(range(k + 1)) + [-1] * (5 - k)) for k in range(6)],
])
def test_forced_acceptance(shape, accept, want):
    parents, depths = (np.asarray([x], np.int32) for x in shape)
    m = parents.shape[1]
    logits = np.zeros((1, m + 1, 11), np.float32)
    best = {5: 7, 3: 9}  # the target's argmax after a row
    for row, tok in best.items():
        if row <= m:
            logits[0, row, tok] = 1.0
    acc = _forced_acceptance(parents, depths, logits, np.int32(accept), int(depths.max()), len(want) - 1)
    assert np.asarray(acc.indices).tolist() == [want] and np.asarray(acc.length).tolist() == [accept + 1]
    assert np.asarray(acc.bonus).tolist() == [best.get(want[accept], 0)]


@functools.partial(jax.jit, static_argnums=(4, 5))
def _forced_acceptance(parents, depths, logits, accept, max_depth, depth):
    """scale.forced_acceptance of a one-sequence proposal (tokens 1..M) as one program per tree shape."""
    m = parents.shape[1]
    prop = Proposal(jnp.arange(1, m + 1, dtype=jnp.int32)[None], parents, depths,
                    tree.visibility(parents[0], max_depth)[None], None)
    return scale.forced_acceptance(prop, Verified(logits, None, None, None), accept, depth)


def _check_rows(rows, labels, batches, accept):
    assert [(r["label"], r["batch"]) for r in rows] == [(lab, b) for b in batches for lab in ["ar", *labels]]
    for r in rows:
        assert r["ms"]["n"] >= 1 and r["ms"]["min"] <= r["ms"]["median"]
        # differences of two wall times: finite, never clamped (on a loaded machine a tiny one may come out <= 0)
        assert np.isfinite(r["ms"]["median"]) and np.isfinite(r["ar_step_ms"])
        assert r["ms"]["min"] > 0 or "not clamped" in r["note"]
        if r["label"] == "ar":
            assert r["round_ar_steps"] == 1.0
            continue
        assert r["forced_accept"] == accept and r["accepted"] == accept, r  # every round committed accept + 1
        if r["round_ar_steps"] is not None:
            assert r["round_ar_steps"] == pytest.approx(r["ms"]["median"] / r["ar_step_ms"])
            assert r["projected_speedup"] == pytest.approx(scale.TAU / r["round_ar_steps"])
        else:  # only when noise beat the work: a median, or the AR step's best repetition, came out <= 0
            assert min(r["ms"]["median"], r["ar_step_ms"], rows[0]["ms"]["min"]) <= 0
        assert r["writeup_speedup"] == 4.29


@pytest.mark.slow
def test_scale_on_the_tiny_preset(tmp_path, capsys):  # the AR step and a forced chain round, JSON written
    out = tmp_path / "scale.json"
    assert main(["scale", "--preset", "tiny", "--methods", "dflash", "--batches", "2", "--accept", "3",
                 "--steps", "3", "--rounds", "2", "--reps", "1", "--no-stages", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ar (one step)" in text and "dflash" in text and "4.29x" in text
    res = json.loads(out.read_text())
    assert res["complete"] is True and res["preset"] == "tiny" and res["interrupted"] is False
    _check_rows(res["rows"], ["dflash"], [2], 3)


@pytest.mark.slow
def test_scale_from_disk_trees_stages_and_memory(tmp_path, capsys):
    """--from-disk writes the HF / DeepSpec folders once (reused the second time), loads them in a child that
    reports load time and peak RSS; a tree's forced rounds commit exactly --accept + 1; the stage split covers the
    four stages; --memory reports the compiled program's memory analysis."""
    disk, out = tmp_path / "pair", tmp_path / "scale.json"
    args = ["scale", "--preset", "tiny", "--methods", "sparklingtree@16", "--batches", "1", "--accept", "5",
            "--steps", "3", "--rounds", "2", "--reps", "1", "--from-disk", str(disk), "--json", str(out)]
    assert main(args) == 0
    assert "wrote the random tiny pair" in capsys.readouterr().err
    assert (disk / "target" / "model.safetensors").is_file() and (disk / "dspark_b16" / "config.json").is_file()
    res = json.loads(out.read_text())
    load = res["load"]
    assert load["load_s"] > 0 and load["model_bytes"] == load["file_bytes"] > 0
    assert 0 < load["largest_tensor"] < load["model_bytes"] and load["peak_rss_growth"] > 0
    _check_rows(res["rows"], ["sparklingtree@16"], [1], 5)
    row = res["rows"][1]
    assert set(row["stages_ms"]) == {"draft", "propose", "verify", "commit"}
    assert sum(row["stage_share"].values()) == pytest.approx(1.0)
    mtime = (disk / "target" / "model.safetensors").stat().st_mtime_ns
    assert main([*args, "--no-stages"]) == 0
    assert "reusing the pair cached" in capsys.readouterr().err
    assert (disk / "target" / "model.safetensors").stat().st_mtime_ns == mtime
    out = tmp_path / "mem.json"  # --memory: the compiled program's memory analysis
    assert main(["scale", "--preset", "tiny", "--memory", "--methods", "ar", "--batches", "1", "--contexts",
                 "128,256", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["memory"]
    assert [(r["method"], r["context"]) for r in rows] == [("ar", 128), ("ar", 256)]
    for r in rows:
        assert r["compile_s"] > 0 and r["argument"] > 0
        assert r["peak_bytes"] == r["argument"] + r["output"] + r["temp"] - r["alias"]
    # the KV cache (6 layers x K/V x 2 KV heads x 16 dims x float32) grows the temporaries with the context
    assert rows[1]["temp"] - rows[0]["temp"] >= 6 * 2 * 2 * 16 * 4 * 128


def test_serve_summaries_rates_and_outputs(tmp_path):
    recs = [{"status": 200, "finish": "length", "tokens": 8, "ttft_s": 0.01 * (i + 1), "tpot_s": None}
            for i in range(3)] + [{"status": 503, "finish": None, "tokens": 0}]
    before = {"sparkjax_rounds_total": 2.0, 'sparkjax_verify_rounds_total{size="ar"}': 2.0}
    after = {"sparkjax_rounds_total": 8.0, "sparkjax_accepted_tokens_total": 12.0,
             'sparkjax_verify_rounds_total{size="ar"}': 5.0, 'sparkjax_verify_rounds_total{size="dspark"}': 3.0,
             'sparkjax_http_responses_total{code="503"}': 1.0}
    rows = [{**serve.summarize(m, f"c={c}" if c else "poisson@4", c, recs, 24 / tok_s, before, after), "repeat": rep}
            for rep, k in ((0, 1.0), (1, 3.0), (2, 2.0))
            for m, c, tok_s in (("ar", 1, 100 * k), ("auto", 1, 50 * k), ("ar", None, 10 * k))]
    rows[0]["generate_tok_s"] = 123.5  # the interleaved batch-1 baseline of a concurrency-1 level
    r = rows[0]
    assert (r["completed"], r["lost"], r["http_5xx"], r["completion_tokens"], r["tau"]) == (3, 1, 1, 24, 2.0)
    assert (r["ttft_p50_s"], r["ttft_p99_s"], r["tpot_p50_s"]) == (0.02, 0.03, None)
    assert r["verify_share"] == {"ar": 0.5, "dspark": 0.5}
    assert serve._rates(rows, 1) == {"ar": (200.0, 100.0, 300.0, 3), "auto": (100.0, 50.0, 150.0, 3)}
    serve.write_csv(str(tmp_path / "s.csv"), rows)
    lines = (tmp_path / "s.csv").read_text().splitlines()
    assert len(lines) == 1 + len(rows) and lines[0].startswith("level,repeat,method") and ",poisson@4," not in lines[1]
    assert lines[0].endswith(",generate_tok_s") and lines[1].endswith(",123.5") and lines[2].endswith(",")
    serve.write_png(str(tmp_path / "s.png"), rows, "t")  # None latencies plot as gaps, not zeros on a log axis
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "poisson@4" in serve.table(rows) and sorted(p.name for p in tmp_path.iterdir()) == ["s.csv", "s.png"]
