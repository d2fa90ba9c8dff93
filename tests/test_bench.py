"""python -m sparkjax.bench: timing protocol, command-line errors and interrupts, the HLO counter (``round``),
forced acceptance (``scale``), tiny real runs of both."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparkjax import tree
from sparkjax.bench import attention, hlo, scale, timing
from sparkjax.bench.__main__ import main
from sparkjax.engine.state import Proposal, Verified

# ============================================================================= the timing module


def test_interleave_runs_every_variant_once_per_repetition_in_order():
    calls = []
    stats = timing.interleave({k: (lambda k=k: calls.append(k)) for k in "abc"}, 3, measure=lambda f: f() or 1.0)
    assert calls == list("abc") * 3
    assert {k: s.n for k, s in stats.items()} == {"a": 3, "b": 3, "c": 3}
    # a deadline keeps the minimum repetitions
    assert timing.interleave({"a": lambda: None}, 10, measure=lambda f: 1.0, deadline=0.0, min_reps=2)["a"].n == 2


def test_stats_are_medians_minima_and_spreads_never_clamped_and_the_load_warns(monkeypatch):
    values = {"a": iter([3.0, 1.0, 2.0]), "b": iter([-1.0, 0.5, -2.0])}
    stats = timing.interleave({k: (lambda it=it: next(it)) for k, it in values.items()}, 3, measure=lambda f: f())
    a, b = stats["a"], stats["b"]
    assert (a.median, a.min, a.max, a.samples) == (2.0, 1.0, 3.0, (3.0, 1.0, 2.0))
    assert a.spread == pytest.approx((3.0 - 1.0) / 2.0)
    assert (b.median, b.min, b.samples) == (-1.0, -2.0, (-1.0, 0.5, -2.0))  # a negative difference stays
    assert b.spread is None  # no spread of a median <= 0
    assert any("b: spread undefined" in w for w in timing.warnings(stats))
    assert not any(w.startswith("a:") for w in timing.warnings(stats, max_spread=1.5))
    assert timing.wall(lambda: jnp.ones(3) * 2) >= 0
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (99.0, 0.0, 0.0))
    assert "load average 99.0" in timing.load_warning()
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert timing.load_warning() is None and timing.warnings() == []


def test_interrupt_keeps_what_was_measured():
    n = {"b": 0}

    def b():
        n["b"] += 1
        if n["b"] == 2:
            raise KeyboardInterrupt
        return 5.0

    with pytest.raises(timing.Interrupted) as e:
        timing.interleave({"a": lambda: 1.0, "b": b, "c": lambda: 2.0}, 4, measure=lambda f: f())
    assert isinstance(e.value, KeyboardInterrupt)
    assert {k: s.samples for k, s in e.value.partial.items()} == {"a": (1.0, 1.0), "b": (5.0,), "c": (2.0,)}


# ============================================================================= the command line


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
])
def test_bad_arguments_exit_2_with_one_line(argv, names, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and names in err[0], err


def test_help_of_every_subcommand(capsys):
    for cmd in ("ar", "round", "tree", "drafter", "scale", "train", "attention"):
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


# ============================================================================= round: the HLO counter

# A hand-written optimised-HLO module: the entry runs one fusion, then a while of known trip count 5
# whose body runs three kernels (a fusion, a dot, a sort) and whose condition runs one, inside which a
# nested while of 3 trips runs one kernel (and a one-kernel condition).
HAND_HLO = """HloModule hand, is_scheduled=true

%fused_add (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  ROOT %add.1 = f32[4]{0} add(%param_0, %param_0)
}

%cmp (param_0.1: s32[], param_1.1: s32[]) -> pred[] {
  %param_0.1 = s32[] parameter(0)
  %param_1.1 = s32[] parameter(1)
  ROOT %lt = pred[] compare(%param_0.1, %param_1.1), direction=LT
}

%inner_body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[4]{0} get-tuple-element(%t), index=1
  %y = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_add
  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %y)
}

%inner_cond (t.1: (s32[], f32[4])) -> pred[] {
  %t.1 = (s32[], f32[4]{0}) parameter(0)
  %c3 = s32[] constant(3)
  %i.1 = s32[] get-tuple-element(%t.1), index=0
  ROOT %p = pred[] fusion(%i.1, %c3), kind=kLoop, calls=%cmp
}

%body (s: (s32[], f32[4], f32[4,4])) -> (s32[], f32[4], f32[4,4]) {
  %s = (s32[], f32[4]{0}, f32[4,4]{1,0}) parameter(0)
  %i.2 = s32[] get-tuple-element(%s), index=0
  %v = f32[4]{0} get-tuple-element(%s), index=1
  %m = f32[4,4]{1,0} get-tuple-element(%s), index=2
  %f = f32[4]{0} fusion(%v), kind=kLoop, calls=%fused_add
  %d = f32[4]{0} dot(%m, %f), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %so = f32[4]{0} sort(%d), dimensions={0}, to_apply=%cmp
  %zero = s32[] constant(0)
  %it = (s32[], f32[4]{0}) tuple(%zero, %so)
  %w2 = (s32[], f32[4]{0}) while(%it), condition=%inner_cond, body=%inner_body, backend_config=INNER
  %o = f32[4]{0} get-tuple-element(%w2), index=1
  ROOT %t2 = (s32[], f32[4]{0}, f32[4,4]{1,0}) tuple(%i.2, %o, %m)
}

%cond (s.1: (s32[], f32[4], f32[4,4])) -> pred[] {
  %s.1 = (s32[], f32[4]{0}, f32[4,4]{1,0}) parameter(0)
  %c5 = s32[] constant(5)
  %i.3 = s32[] get-tuple-element(%s.1), index=0
  ROOT %q = pred[] fusion(%i.3, %c5), kind=kLoop, calls=%cmp
}

ENTRY %main (a: f32[4], b: f32[4,4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %b = f32[4,4]{1,0} parameter(1)
  %e = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_add
  %z = s32[] constant(0)
  %init = (s32[], f32[4]{0}, f32[4,4]{1,0}) tuple(%z, %e, %b)
  %w = (s32[], f32[4]{0}, f32[4,4]{1,0}) while(%init), condition=%cond, body=%body, backend_config=OUTER
  ROOT %out = f32[4]{0} get-tuple-element(%w), index=1
}
"""
OUTER = '{"known_init_step":{"init":"0","step":"1"}}'  # the trip count comes from the condition (i < 5)
HAND_HLO = HAND_HLO.replace("INNER", '{"known_trip_count":{"n":"3"}}').replace("OUTER", OUTER)


def test_hand_written_hlo_counts_trip_counts_and_nesting():
    t = hlo.count_hlo(HAND_HLO)
    outer, inner = 5, 3  # the outer trip count is derived from its condition (i < 5, init 0 step 1)
    per_outer = 3 + (inner * 1 + (inner + 1) * 1)  # fusion, dot, sort + the inner loop's body and condition
    assert t.sequential_kernels == outer * per_outer + (outer + 1) * 1
    assert t.total_kernels == t.sequential_kernels + 1  # the entry's one fusion
    assert sorted(trip for _, trip in t.loops) == [inner, outer]  # each loop of the program, once
    assert t.unknown_loops == 0
    dot = [k for k in t.kernels if k.op == "dot"]
    assert len(dot) == 1 and dot[0].count == outer
    assert dot[0].flops == 2 * 4 * 4
    assert dot[0].bytes == (4 * 4 + 4 + 4) * 4
    t = hlo.count_hlo(HAND_HLO.replace(f"backend_config={OUTER}", ""))  # an unknown trip count: once, reported
    assert t.unknown_loops == 1
    assert t.sequential_kernels == 1 * (3 + 3 + 4) + 2 * 1


@pytest.mark.parametrize("length", [4, 9])
def test_scan_sequential_kernels_scale_with_the_trip_count(length):
    m = jnp.ones((8, 8), jnp.float32)

    def f(c):
        def body(c, _):
            return jnp.sort(m @ c), None

        c, _ = jax.lax.scan(body, c, None, length=length)
        return c

    text = jax.jit(f).lower(jnp.ones((8,), jnp.float32)).compile().as_text()
    t = hlo.count_hlo(text)
    sorts = [k for k in t.kernels if k.op == "sort"]
    assert sum(k.count for k in sorts) == length  # one sort per trip, all inside the loop
    assert all(k.sequential for k in sorts)
    assert dict(t.loops).popitem()[1] == length
    dots = sum(k.count * k.flops for k in t.kernels)
    assert dots == length * 2 * 8 * 8  # one [8,8] @ [8] per trip
    # every kernel of the loop body runs `length` times, its condition length + 1 times
    assert all(k.count in (length, length + 1) for k in t.kernels if k.sequential)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_byte_model_of_one_dot(dtype):
    m, k, n = 8, 64, 32
    x, w = jnp.ones((m, k), dtype), jnp.ones((k, n), dtype)
    text = jax.jit(lambda x, w: x @ w).lower(x, w).compile().as_text()
    t = hlo.count_hlo(text)
    size = jnp.dtype(dtype).itemsize
    assert t.bytes == (m * k + k * n + m * n) * size  # XLA:CPU's f32 upcast of bf16 is not charged
    assert t.flops == 2 * m * n * k
    assert t.total_kernels == 1


def test_in_place_update_charges_the_update_not_the_buffer():
    buf = jnp.zeros((1024, 64), jnp.bfloat16)
    row = jnp.ones((1, 64), jnp.bfloat16)
    f = jax.jit(lambda b, r, i: jax.lax.dynamic_update_slice(b, r, (i, 0)), donate_argnums=0)
    t = hlo.count_hlo(f.lower(buf, row, jnp.int32(3)).compile().as_text())
    assert 0 < t.bytes < buf.size * 2 / 16  # the 128 KiB buffer is neither read nor rewritten whole


def test_roofline_and_launch_projection():
    t = hlo.Tally([hlo.Kernel("a", "dot", 2, 1e6, 1e9, False),
                           hlo.Kernel("b", "fusion", 10, 100.0, 0.0, True)])
    bw, peak = 1e12, 1e15
    want = 2 * max(1e6 / bw, 1e9 / peak) + 10 * 100 / bw
    assert t.seconds(bw, peak) == pytest.approx(want)
    assert t.seconds(bw, peak, 2e-6) == pytest.approx(want + 10 * 2e-6)


def test_hoisted_bf16_upcast_of_a_loop_invariant_weight_is_charged_at_bf16():
    n, k = 8, 64
    w = jnp.ones((k, k), jnp.bfloat16)

    def f(x, w):
        return jax.lax.fori_loop(0, 5, lambda i, x: jnp.tanh(x @ w), x)

    text = jax.jit(f).lower(jnp.ones((n, k), jnp.bfloat16), w).compile().as_text()
    t = hlo.count_hlo(text)
    dots = [kk for kk in t.kernels if kk.flops]
    assert dots and all(kk.sequential and kk.count == 5 for kk in dots)
    assert sum(kk.flops for kk in dots) == 2 * n * k * k
    # the weight is read at 2 bytes an element in every trip, though XLA:CPU carries an f32 copy of it
    assert sum(kk.bytes for kk in dots) <= (n * k * 2 + k * k) * 2 + n * k * 4


def test_fused_attention_model_is_one_kernel_charged_its_operands_and_output():
    """--attention fused: each attention call compiles to one opaque kernel whose bytes are its operands read once
    and its output written once (no [B, N, T, S] scores), with 4 B T N H S matrix FLOPs over both parts."""
    b, t, n, kh, h, s1, s2 = 2, 5, 4, 2, 8, 64, 5
    q = jnp.ones((b, t, n, h), jnp.bfloat16)
    parts = [(jnp.ones((b, kh, s, h), jnp.bfloat16), jnp.ones((b, kh, s, h), jnp.bfloat16),
              jnp.ones((b, t, s), bool)) for s in (s1, s2)]
    text = jax.jit(hlo.fused_attention_model).lower(q, parts).compile().as_text()
    t_ = hlo.count_hlo(text)
    assert t_.total_kernels == 1
    kv = sum(2 * b * kh * s * h * 2 + b * t * s for s in (s1, s2))  # bf16 keys and values, a byte per mask entry
    assert t_.bytes == 2 * (b * t * n * h * 2) + kv  # the queries in, the output out
    assert t_.flops == 4 * b * t * n * h * (s1 + s2)


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


# ============================================================================= scale: forced acceptance

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
    acc = scale.forced_acceptance(prop, ver, accept=3, depth=4)
    assert np.asarray(acc.indices).tolist() == [[0, 1, 3, 5, -1]]  # the lowest-index depth-3 node's path
    assert np.asarray(acc.length).tolist() == [4]
    assert np.asarray(acc.bonus).tolist() == [7]  # the target's argmax after row 5
    acc = scale.forced_acceptance(prop, ver, accept=2, depth=4)
    assert np.asarray(acc.indices).tolist() == [[0, 1, 3, -1, -1]]
    assert np.asarray(acc.bonus).tolist() == [9]
    acc = scale.forced_acceptance(prop, ver, accept=0, depth=4)
    assert np.asarray(acc.indices).tolist() == [[0, -1, -1, -1, -1]] and np.asarray(acc.length).tolist() == [1]


def test_forced_acceptance_tops_up_a_shallow_tree_and_follows_a_chain():
    # a star: four depth-1 nodes, no path longer than 1; forcing 3 takes node 1, then the others in order
    acc = scale.forced_acceptance(_proposal(parents=[0, 0, 0, 0], depths=[1, 1, 1, 1]), _verified(4), accept=3,
                                  depth=3)
    assert np.asarray(acc.indices)[0].tolist() == [0, 1, 2, 3] and np.asarray(acc.length).tolist() == [4]
    d = 5
    prop = _proposal(parents=list(range(d)), depths=list(range(1, d + 1)))
    for k in range(d + 1):
        acc = scale.forced_acceptance(prop, _verified(d), accept=k, depth=d)
        assert np.asarray(acc.indices)[0].tolist() == list(range(k + 1)) + [-1] * (d - k)
        assert int(acc.length[0]) == k + 1


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
            assert r["projected_speedup"] == pytest.approx(scale.TAU / r["round_ar_steps"])
        else:  # only when noise beat the work: a median, or the AR step's best repetition, came out <= 0
            assert min(r["ms"]["median"], r["ar_step_ms"], rows[0]["ms"]["min"]) <= 0
        assert r["writeup_speedup"] == 4.29


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
def test_scale_from_disk_trees_and_stages(tmp_path, capsys):
    """--from-disk writes the HF / DeepSpec folders once (reused the second time), loads them in a child that
    reports load time and peak RSS; a tree method's forced rounds commit exactly --accept + 1; the stage split
    covers the four stages."""
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
    assert set(row["stages_ms"]) == {"draft", "tree", "verify", "commit"}
    assert sum(row["stage_share"].values()) == pytest.approx(1.0)
    mtime = (disk / "target" / "model.safetensors").stat().st_mtime_ns
    assert main([*args, "--no-stages"]) == 0
    assert "reusing the pair cached" in capsys.readouterr().err
    assert (disk / "target" / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.slow
def test_scale_memory_reports_the_compiled_program(tmp_path):
    out = tmp_path / "mem.json"
    assert main(["scale", "--preset", "tiny", "--memory", "--methods", "ar", "--batches", "1", "--contexts",
                 "128,256", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["memory"]
    assert [(r["method"], r["context"]) for r in rows] == [("ar", 128), ("ar", 256)]
    for r in rows:
        assert r["compile_s"] > 0 and r["argument"] > 0
        assert r["peak_bytes"] == r["argument"] + r["output"] + r["temp"] - r["alias"]
    # the KV cache (6 layers x K/V x 2 KV heads x 16 dims x float32) grows the temporaries with the context
    assert rows[1]["temp"] - rows[0]["temp"] >= 6 * 2 * 2 * 16 * 4 * 128


# ============================================================================= serve: the report from records


def test_serve_summaries_rates_and_outputs(tmp_path):
    from sparkjax.bench import serve

    def level(method, c, rep, tok_s):
        recs = [{"status": 200, "finish": "length", "tokens": 8, "ttft_s": 0.01 * (i + 1), "tpot_s": None}
                for i in range(3)] + [{"status": 503, "finish": None, "tokens": 0}]
        before = {"sparkjax_rounds_total": 2.0, 'sparkjax_verify_rounds_total{size="ar"}': 2.0}
        after = {"sparkjax_rounds_total": 8.0, "sparkjax_accepted_tokens_total": 12.0,
                 'sparkjax_verify_rounds_total{size="ar"}': 5.0, 'sparkjax_verify_rounds_total{size="dspark"}': 3.0,
                 'sparkjax_http_responses_total{code="503"}': 1.0}
        row = serve.summarize(method, f"c={c}" if c else "poisson@4", c, recs, 24 / tok_s, before, after)
        return {**row, "repeat": rep}

    rows = [level(m, c, rep, tok_s) for rep, k in ((0, 1.0), (1, 3.0), (2, 2.0)) for m, c, tok_s in
            (("ar", 1, 100 * k), ("auto", 1, 50 * k), ("ar", None, 10 * k))]
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
