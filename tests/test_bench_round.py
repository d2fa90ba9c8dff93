"""eval/bench_round.py: the HLO parser, the kernel counter and the byte model, and a smoke run."""

from __future__ import annotations

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "eval"))
import bench_round  # noqa: E402

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
    t = bench_round.count_hlo(HAND_HLO)
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


def test_unknown_trip_count_is_counted_once_and_reported():
    text = HAND_HLO.replace(f"backend_config={OUTER}", "")
    t = bench_round.count_hlo(text)
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
    t = bench_round.count_hlo(text)
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
    t = bench_round.count_hlo(text)
    size = jnp.dtype(dtype).itemsize
    assert t.bytes == (m * k + k * n + m * n) * size  # XLA:CPU's f32 upcast of bf16 is not charged
    assert t.flops == 2 * m * n * k
    assert t.total_kernels == 1


def test_in_place_update_charges_the_update_not_the_buffer():
    buf = jnp.zeros((1024, 64), jnp.bfloat16)
    row = jnp.ones((1, 64), jnp.bfloat16)
    f = jax.jit(lambda b, r, i: jax.lax.dynamic_update_slice(b, r, (i, 0)), donate_argnums=0)
    t = bench_round.count_hlo(f.lower(buf, row, jnp.int32(3)).compile().as_text())
    assert 0 < t.bytes < buf.size * 2 / 16  # the 128 KiB buffer is neither read nor rewritten whole


def test_roofline_and_launch_projection():
    t = bench_round.Tally([bench_round.Kernel("a", "dot", 2, 1e6, 1e9, False),
                           bench_round.Kernel("b", "fusion", 10, 100.0, 0.0, True)])
    bw, peak = 1e12, 1e15
    want = 2 * max(1e6 / bw, 1e9 / peak) + 10 * 100 / bw
    assert t.seconds(bw, peak) == pytest.approx(want)
    assert t.seconds(bw, peak, 2e-6) == pytest.approx(want + 10 * 2e-6)


@pytest.mark.slow  # over 5 s; CI runs it in its slow step
def test_smoke_run_on_the_tiny_preset(tmp_path, capsys):
    out, js = tmp_path / "round.txt", tmp_path / "round.json"
    rc = bench_round.main(["--preset", "tiny", "--batches", "1", "--methods", "ar,dspark", "--context", "64",
                           "--out", str(out), "--json", str(js)])
    assert rc == 0
    rows = json.loads(js.read_text())
    assert [r["method"] for r in rows] == ["ar", "dspark"]
    for field in ("method", "budget", "batch", "preset", "sequential_kernels", "round_ar_steps_at_2us"):
        assert all(field in r for r in rows)
    ar, ds = rows
    assert ar["round_ar_steps_at_2us"] == 1.0 and ds["preset"] == "tiny" and ds["batch"] == 1
    assert ds["sequential_kernels"] > 0  # the dspark chain is a loop over the block's depths
    assert ds["bytes"] > ar["bytes"] and ds["round_ar_steps_at_2us"] > ds["h100_ar_steps_at_0us"]
    assert "PROJECTIONS" in out.read_text() and "dspark" in capsys.readouterr().out
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_bad_arguments_exit_2_with_one_line(capsys):
    assert bench_round.main(["--preset", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--preset" in err[0]
    assert bench_round.main(["--batches", "0"]) == 2
    assert "--batches" in capsys.readouterr().err


def test_hoisted_bf16_upcast_of_a_loop_invariant_weight_is_charged_at_bf16():
    n, k = 8, 64
    w = jnp.ones((k, k), jnp.bfloat16)

    def f(x, w):
        return jax.lax.fori_loop(0, 5, lambda i, x: jnp.tanh(x @ w), x)

    text = jax.jit(f).lower(jnp.ones((n, k), jnp.bfloat16), w).compile().as_text()
    t = bench_round.count_hlo(text)
    dots = [kk for kk in t.kernels if kk.flops]
    assert dots and all(kk.sequential and kk.count == 5 for kk in dots)
    assert sum(kk.flops for kk in dots) == 2 * n * k * k
    # the weight is read at 2 bytes an element in every trip, though XLA:CPU carries an f32 copy of it
    assert sum(kk.bytes for kk in dots) <= (n * k * 2 + k * k) * 2 + n * k * 4


def test_main_restores_the_engine_settings(tmp_path):
    """bench_round compiles with the accelerator's choices but leaves the process's defaults as they were."""
    from sparkjax.engine import drafting
    from sparkjax.nn import drafter, layers, qwen3

    before = drafting.AUTO_CHAIN_MODE, layers.ATTENTION_IMPL, qwen3.attend, drafter.attend
    for attention in ("einsum", "fused"):  # fails after the settings were switched
        assert bench_round.main(["--preset", "nosuch", "--attention", attention]) == 2
        assert (drafting.AUTO_CHAIN_MODE, layers.ATTENTION_IMPL, qwen3.attend, drafter.attend) == before


def test_fused_attention_model_is_one_kernel_charged_its_operands_and_output():
    """--attention fused: each attention call compiles to one opaque kernel whose bytes are its operands read once
    and its output written once (no [B, N, T, S] scores), with 4 B T N H S matrix FLOPs over both parts."""
    b, t, n, kh, h, s1, s2 = 2, 5, 4, 2, 8, 64, 5
    q = jnp.ones((b, t, n, h), jnp.bfloat16)
    parts = [(jnp.ones((b, kh, s, h), jnp.bfloat16), jnp.ones((b, kh, s, h), jnp.bfloat16),
              jnp.ones((b, t, s), bool)) for s in (s1, s2)]
    text = jax.jit(bench_round.fused_attention_model).lower(q, parts).compile().as_text()
    t_ = bench_round.count_hlo(text)
    assert t_.total_kernels == 1
    kv = sum(2 * b * kh * s * h * 2 + b * t * s for s in (s1, s2))  # bf16 keys and values, a byte per mask entry
    assert t_.bytes == 2 * (b * t * n * h * 2) + kv  # the queries in, the output out
    assert t_.flops == 4 * b * t * n * h * (s1 + s2)
