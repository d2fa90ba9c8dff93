"""``python -m sparkjax.bench gpu-compile``: the GPU HLO checks on hand-made kernels and thunk trees (default
suite), and the deviceless H200 / H100 compiles themselves (slow; they need the ``gpu-aot`` extra and are skipped,
saying so, without it: run them with a venv that has it, ``VENV/bin/python -m pytest -q -n0 -m slow
tests/test_gpu_compile.py``)."""

import importlib.util
import json
import subprocess
import sys

import pytest

from sparkjax.bench import gpu, hlo, loops
from sparkjax.bench.__main__ import main
from sparkjax.bench.common import child_env
from sparkjax.engine import programs
from sparkjax.engine.options import Options
from sparkjax.errors import ArgumentError, GpuCompileError


def _k(shape):
    return hlo.Kernel("k", "fusion", 1.0, hlo.shape_bytes(shape), 0.0, False, shape=shape)


def test_score_tensor_and_cache_copy_checks():
    b, n, kv, s = 2, 32, 8, 1024
    scores = [_k("f32[2,8,4,65,1024]{4,3,2,1,0}"), _k("f32[2,32,65,1040]"), _k("f32[8,1024,260]")]
    tally = hlo.Tally(scores + [_k("bf16[2,8,4,65,1024]"), _k("f32[2,65,151936]"), _k("f32[8,32,2560]")])
    # float32 score-shaped results only: bf16 probabilities, f32 logits and split-K gemm partials are not scores
    assert hlo.f32_score_tensors(tally, b, n, kv, s) == ["f32[2, 8, 4, 65, 1024]", "f32[2, 32, 65, 1040]"]
    assert hlo.f32_score_tensors(hlo.Tally(scores[2:]), 1, n, kv, s) == ["f32[8, 1024, 260]"]  # batch 1 dropped
    assert hlo.f32_score_tensors(hlo.Tally(scores), b, n, kv, 2048) == []  # nothing spans 2048 slots

    c = hlo.HloCounter("ENTRY %e (p: f32[4]) -> f32[4] {\n  ROOT %p = f32[4]{0} parameter(0)\n}\n")
    moving = hlo.Instr("t", "bf16[2,1040,8,128]", "transpose", ["x"], "")
    assert c.only_moves(moving) and not c.only_moves(hlo.Instr("a", "f32[4]", "add", ["x", "y"], ""))
    assert not c.only_moves(hlo.Instr("z", "bf16[4]", "broadcast", ["x"], ""))  # a fill moves nothing

    gemm = hlo.Instr("g", "bf16[65,2560]", "custom-call", ["a", "w"],
                     ', custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{'
                     '"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}')
    assert hlo.library_call_flops(gemm, ["bf16[65,4096]", "bf16[4096,2560]"]) == 2.0 * 65 * 2560 * 4096
    fmha = hlo.Instr("f", "(bf16[1,32,65,128], u8[0])", "custom-call", ["q", "k", "v"],
                     ', custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config":'
                     '{"intermediate_tensor_shape":{"element_type":"BF16","dimensions":["1","32","65","1024"]}}}')
    assert hlo.library_call_flops(fmha, ["bf16[1,65,32,128]", "bf16[1,1024,8,128]"]) == 4.0 * 32 * 65 * 1024 * 128
    assert hlo.library_call_flops(hlo.Instr("c", "f32[1]", "custom-call", [], ', custom_call_target="x"'), []) == 0
    text = gpu.target_config(gpu.H200)
    for field in ("core_count: 132", "memory_bandwidth: 4800000000000", "device_memory_size: 151397597184",
                  "cuda_compute_capability { major: 9 minor: 0 }", 'platform_name: "CUDA"',
                  "dnn_version_info { major: 9 minor: 10 patch: 0 }", 'runtime_version: "12.8.0"'):
        assert field in text


def test_gpu_compile_without_the_plugin_says_how_to_install_it(capsys):
    try:
        gpu.compile_device()
    except GpuCompileError as e:  # this environment has no CUDA plugin: one line that names the extra
        assert main(["gpu-compile", "--preset", "tiny", "--cases", "1:256", "--methods", "ar"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "gpu-aot" in err and str(e) in err


def _plugin() -> bool:
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        return False


NO_PLUGIN = (f"the gpu-aot extra is not installed in {sys.executable} (no CUDA PJRT plugin, jax_plugins.xla_cuda12), "
             f"so nothing can be compiled for a GPU here; install it in a separate venv: {gpu.GPU_AOT_HINT}")


# A generation loop (gen) whose body holds a loop with no known trip count (chain), one with a known trip count
# (fixed) and a conditional (pick); a small loop beside it. Thunk trees as XLA dumps them: with XLA's defaults
# (the loops run from the host; the straight-line parts in command buffers) and with WHILE / CONDITIONAL command
# buffers (the whole program one command buffer).
LOOPS_HLO = """HloModule m, is_scheduled=true

%c (p.0: s32[]) -> pred[] {
  %p.0 = s32[] parameter(0)
  ROOT %lt = pred[] compare(%p.0, %p.0), direction=LT
}

%b (p.1: s32[]) -> s32[] {
  ROOT %p.1 = s32[] parameter(0)
}

%outer (p.2: s32[]) -> s32[] {
  %p.2 = s32[] parameter(0)
  %chain = s32[] while(%p.2), condition=%c, body=%b
  %fixed = s32[] while(%chain), condition=%c, body=%b, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %pick = s32[] conditional(%lt, %fixed, %fixed), true_computation=%b, false_computation=%b
}

ENTRY %main (x: s32[]) -> s32[] {
  %x = s32[] parameter(0)
  %small = s32[] while(%x), condition=%c, body=%b
  ROOT %gen = s32[] while(%small), condition=%c, body=%outer
}
"""
HOST_THUNKS = """000: kCommandBuffer [source       | next=003 (1)]
    001: kCopy [source | sink] kCopy
    002: kWhile [source | sink]
condition:
        020: kKernel [source | sink] wrapped_compare
      body:
        021: kKernel [source | sink] loop_add_fusion
003: kWhile         [prev=000 (1) | sink        ]
condition:
    004: kKernel [source | sink] wrapped_compare
  body:
    005: kWhile [source | next=008 (1)]
condition:
        006: kKernel [source | sink] wrapped_compare
      body:
        007: kKernel [source | sink] loop_add_fusion
    008: kWhile [prev=005 (1) | next=011 (1)]
condition:
        009: kKernel [source | sink] wrapped_compare
      body:
        010: kConditional [source | sink]
    011: kConditional [prev=008 (1) | sink]
"""
DEVICE_THUNKS = "000: kCommandBuffer [source | sink] \n" + "\n".join(
    "    " + line for line in HOST_THUNKS.splitlines()[1:])
LOOPS_META = "".join(
    f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{name}"\n    thunk_id: {i}\n  }}\n'
    f'  thunk_kind: "{kind}"\n}}\n'
    for name, i, kind in (("small", 2, "kWhile"), ("gen", 3, "kWhile"), ("chain", 5, "kWhile"), ("fixed", 8, "kWhile"),
                          ("inner_pick", 10, "kConditional"), ("pick", 11, "kConditional")))


def test_loop_placement_from_the_thunk_tree():
    host = loops.loop_placement(LOOPS_HLO, loops.CompiledThunks(HOST_THUNKS, loops.thunk_names(LOOPS_META), True))
    # the largest top loop is the generation loop; from the host: its own predicate, chain's (at least once), the
    # conditional inside fixed's 4 iterations and pick's; fixed itself is enqueued without a wait
    assert host["loop_name"] == "gen" and host["loop"] == "host" and host["known_trip_count"] is None
    assert host["host_round_trips_per_round"] == 1 + 1 + 4 + 1
    assert host["host_control_flow"] == ["chain", "inner_pick", "pick"] and host["command_buffers"] == 1
    device = loops.loop_placement(LOOPS_HLO, loops.CompiledThunks(DEVICE_THUNKS, loops.thunk_names(LOOPS_META), True))
    assert device["loop"] == "command_buffer" and device["host_round_trips_per_round"] == 0
    assert device["host_control_flow"] == []
    known = LOOPS_HLO.replace("body=%outer", 'body=%outer, backend_config={"known_trip_count":{"n":"9"}}')
    fixed = loops.loop_placement(known, loops.CompiledThunks(HOST_THUNKS, loops.thunk_names(LOOPS_META), True))
    assert fixed["loop"] == "known_trip_count" and fixed["known_trip_count"] == 9
    assert fixed["host_round_trips_per_round"] == 1 + 4 + 1  # no predicate of its own
    with pytest.raises(ValueError, match="gen"):  # a dump without the loop's thunk is an error, not a guess
        loops.loop_placement(LOOPS_HLO, loops.CompiledThunks(HOST_THUNKS, {}, True))


def test_round_launches_and_the_projection_range():
    """Which kernels of a round are replayed from a command buffer and which the host launches one by one (by
    their thunks), and the projection that prices each: a range from the low to the high point of every
    overhead, plus the calibration point for sparklingtree@64 at batch 1 and 8."""
    meta = LOOPS_META + "".join(
        f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{name}"\n    thunk_id: {i}\n  }}\n'
        f'  thunk_kind: "kKernel"\n}}\n' for name, i in (("wrapped_compare", 4), ("loop_add_fusion", 7)))
    kernels = [hlo.Kernel(name, "fusion", n, 0, 0, True)
               for name, n in (("wrapped_compare", 1.0), ("loop_add_fusion", 3.0), ("nowhere", 2.0))]
    host = loops.round_launches(LOOPS_HLO, loops.CompiledThunks(HOST_THUNKS, loops.thunk_names(meta), True),
                                kernels, "host")
    # from the host: every kernel thunk of the loop outside a command buffer; a name with no thunk counts eager
    assert host == {"graph_kernels": 0, "eager_kernels": 6, "unmatched_kernels": 2, "graph_launches": 0}
    device = loops.round_launches(LOOPS_HLO, loops.CompiledThunks(DEVICE_THUNKS, loops.thunk_names(meta), True),
                                  kernels, "command_buffer")
    assert device == {"graph_kernels": 4, "eager_kernels": 2, "unmatched_kernels": 2, "graph_launches": 1}
    o = gpu.OVERHEADS
    rng = gpu.projection(100.0, device, 1)
    for p in gpu.POINTS:
        assert rng[p] == pytest.approx(100 + 4 * o["graph_kernel_us"].at(p) + 2 * o["eager_kernel_us"].at(p)
                                       + o["graph_launch_us"].at(p) + o["host_round_trip_us"].at(p))
    assert rng["low"] < rng["central"] < rng["high"]
    assert all(o[k].low < o[k].central < o[k].high and o[k].source for k in o)
    # a host round trip costs more than replaying the kernel from the graph, at every point
    assert all(gpu.projection(0, device, 1)[p] > gpu.projection(0, device, 0)[p] for p in gpu.POINTS)
    cal = gpu.calibration("sparklingtree@64", 8, {"low": 2.0, "central": 3.0, "high": 4.0})
    measured = 20.98 / 5.74
    assert cal["measured_round_ar_steps"] == pytest.approx(measured) and cal["measured_on"] == "h100"
    assert cal["ratio"] == pytest.approx({"low": 2 / measured, "central": 3 / measured, "high": 4 / measured})
    assert gpu.calibration("sparklingtree@64", 1, dict.fromkeys(gpu.POINTS, 1.0))["measured_round_ar_steps"] == \
        pytest.approx(8.54 / 4.87)
    assert gpu.calibration("sparklingtree@16", 8, dict.fromkeys(gpu.POINTS, 1.0)) is None
    assert gpu.calibration("sparklingtree@64", 32, dict.fromkeys(gpu.POINTS, 1.0)) is None
    assert gpu.fmt_range({"low": 1.5, "central": 1.2, "high": 1.1}) == "1.20 (1.10-1.50)"


def test_loop_compiler_options_only_for_a_gpu():
    cb = programs.loop_compiler_options(Options(), "gpu")
    assert cb == {"xla_gpu_enable_command_buffer":
                  "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"}
    assert programs.loop_compiler_options(Options(), "cpu") is None
    assert programs.loop_compiler_options(Options(gpu_loop="xla_default"), "gpu") is None
    with pytest.raises(ArgumentError, match="gpu_loop"):
        Options(gpu_loop="device")
    # on this CPU every program is the plain jax.jit, with no compiler options
    assert programs.spec_program._pick((), {"plan": None}) is programs.spec_program.jitted(None)


# In one process: the gpu-compile command, then the tiny drafter's block compiled for the H200, its rows attended
# apart from the context and in its scratch.
SCRIPT = """
import json, sys

import jax
import jax.numpy as jnp
from flax import nnx

from sparkjax.bench import gpu, hlo
from sparkjax.bench.__main__ import main
from sparkjax.bench.common import abstract_models
from sparkjax.engine import drafting

assert main(["gpu-compile", "--preset", "tiny", "--cases", "2:256", "--methods", "ar,sparklingtree@16", "--attention",
             "einsum,dpa,split", "--json", sys.argv[1], "--dump-hlo", sys.argv[2]]) == 0
drafter = abstract_models("tiny")[1]
graphdef, state = nnx.split(drafter)
ctx = jax.eval_shape(lambda: drafter.init_context(2, 256))
out = {}
for in_cache in (False, True):
    def block(state, ctx, x0, in_cache=in_cache):
        blk = drafting.draft_block(nnx.merge(graphdef, state), ctx, x0, ctx.lengths, attention="split",
                                   in_cache=in_cache)
        return blk.logits, blk.ctx
    with gpu.traced_as_gpu():
        args = gpu.placed((state, ctx, jax.ShapeDtypeStruct((2,), jnp.int32)), gpu.compile_device())
        tally = hlo.count_hlo(jax.jit(block).lower(*args).compile().as_text(), elide_converts=False)
    out[str(in_cache)] = {"kernels": tally.total_kernels,
                          "cudnn": sum(k.count for k in tally.kernels if "dot_product_attention" in k.name)}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_h200_compile(tmp_path):
    if not _plugin():
        pytest.skip(NO_PLUGIN)
    out, hlo_dir = tmp_path / "rows.json", tmp_path / "hlo"
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(out), str(hlo_dir)], capture_output=True, text=True,
                         timeout=2100, env=child_env(JAX_PLATFORMS="cpu"))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.read_text())
    by = {(r["attention"], r["label"]): r for r in rows}
    assert list(by) == [(a, m) for a in ("einsum", "dpa", "split") for m in ("ar", "sparklingtree@16")]
    for r in rows:
        assert "error" not in r and r["target"] == "h200" and r["batch"] == 2 and r["context"] == 256
        assert r["kernels_per_round"] > 0 and r["bytes_per_round"] > 0 and r["fits"]
        assert r["peak_bytes"] >= r["argument"] > 0
        rng, ln = r["round_us_range"], r["launches"]
        assert r["roofline_us"] < rng["low"] < rng["central"] < rng["high"] and r["round_us"] == rng["central"]
        # with the engine's options the round is one command buffer: every kernel replayed, none launched alone
        assert ln["graph_kernels"] == r["kernels_per_round"] and ln["eager_kernels"] == 0, ln
        assert ln["graph_launches"] == 1 and "calibration" not in r  # the calibration is sparklingtree@64's
    assert by["einsum", "ar"]["round_ar_steps"] == 1.0
    assert by["einsum", "sparklingtree@16"]["round_ar_steps"] > 1.0  # 17 verified rows plus the drafter
    assert by["einsum", "sparklingtree@16"]["f32_scores"]  # the reference path materialises f32 scores
    einsum, dpa, split = ((hlo_dir / f"h200_{name}.hlo.txt").read_text() for name in (
        "einsum_b2_s256_ar", "dpa_b2_s256_ar", "split_b2_s256_sparklingtree@16"))
    assert "__triton" in einsum and "__cudnn$fmha" not in einsum  # XLA:GPU's program, no cuDNN attention
    assert "__cudnn$fmha" in dpa  # traced as on a GPU: dpa is cuDNN's fused attention
    # split: the target's prefix and block rows in one cuDNN call under the tree mask, read in place
    assert "__cudnn$fmhaScaleBiasSoftmax" in split
    assert by["split", "ar"]["kv_copies"] == by["split", "sparklingtree@16"]["kv_copies"] == 0
    # the drafter: one cuDNN call per layer over its context and block (the block in the context's scratch)
    body = hlo.count_hlo(split, loop_body=True, elide_converts=False)
    assert sum(k.count for k in body.kernels if k.stage == "draft" and "dot_product_attention" in k.name) == 2
    # and the block in the context's scratch takes fewer kernels than the block apart, with as many cuDNN calls
    both = json.loads(res.stdout.strip().splitlines()[-1])
    assert both["True"]["cudnn"] == both["False"]["cudnn"] == 2
    assert both["True"]["kernels"] < both["False"]["kernels"], both


# In one process: gpu-compile on the tiny preset for every method's generation program and the serving visit (ar and
# a tree: the visit's loop is the same around every method's round), with the engine's loop options, then a few of
# them with XLA's default loop handling (the programs as they were compiled before the options existed).
LOOP_SCRIPT = """
import sys

from sparkjax.bench.__main__ import main

target, out = sys.argv[1], sys.argv[2]
common = ["gpu-compile", "--preset", "tiny", "--cases", "1:128", "--attention", "auto", "--target", target]
assert main([*common, "--methods", "ar,dflash,dspark,ddtree@16,sparklingtree@16,sparklingtree-beam@16,pctree,auto",
             "--json", out + ".device.json"]) == 0
assert main([*common, "--methods", "ar,sparklingtree@16", "--programs", "visit", "--json", out + ".visit.json"]) == 0
assert main([*common, "--methods", "ar,sparklingtree@16", "--programs", "generate,visit", "--gpu-loop", "xla_default",
             "--json", out + ".xla.json"]) == 0
"""


def _on_device(row: dict) -> bool:
    """The check: the loop runs on the device or with a known trip count, and no round waits for the host."""
    return row["loop"] in ("command_buffer", "known_trip_count") and row["host_round_trips_per_round"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("target", ["h200", "h100"])
def test_every_loop_runs_on_the_device(tmp_path, target):
    """Every method's generation loop and the serving visit's loop, compiled deviceless for an H200 and an H100 with
    the engine's per-program options, run on the device (inside a command buffer) with no host round trip per
    round; the same programs with XLA's default loop handling (what the engine compiled before) fail the check."""
    if not _plugin():
        pytest.skip(NO_PLUGIN)
    out = str(tmp_path / "rows")
    res = subprocess.run([sys.executable, "-c", LOOP_SCRIPT, target, out], capture_output=True, text=True,
                         timeout=1500, env=child_env(JAX_PLATFORMS="cpu"))
    assert res.returncode == 0, res.stderr[-3000:]
    device = json.loads((tmp_path / "rows.device.json").read_text())
    visit = json.loads((tmp_path / "rows.visit.json").read_text())
    xla = json.loads((tmp_path / "rows.xla.json").read_text())
    assert [r["label"] for r in device] == ["ar", "dflash", "dspark", "ddtree@16", "sparklingtree@16",
                                            "sparklingtree-beam@16", "pctree", "auto"]
    assert [(r["program"], r["label"]) for r in visit] == [("visit", "ar"), ("visit", "sparklingtree@16")]
    for r in device + visit:
        assert "error" not in r and r["target"] == target and r["gpu_loop"] == "command_buffer", r
        assert _on_device(r), (r["program"], r["label"], r["loop"], r["host_control_flow"])
        assert r["loop"] == "command_buffer" and r["command_buffers"] >= 1
    assert [(r["program"], r["label"]) for r in xla] == [(p, m) for p in ("generate", "visit")
                                                         for m in ("ar", "sparklingtree@16")]
    for r in xla:  # XLA's defaults: the host reads the loop's predicate back every round
        assert "error" not in r and not _on_device(r), r
        assert r["loop"] == "host" and r["host_round_trips_per_round"] == 1, r
