"""``python -m sparkjax.bench gpu-compile``: the GPU HLO checks on hand-made kernels (default suite), and the
deviceless H200 compile itself (slow; needs the ``gpu-aot`` extra, skipped without it)."""

import importlib.util
import json
import subprocess
import sys

import pytest

from sparkjax.bench import gpu, hlo
from sparkjax.bench.__main__ import main
from sparkjax.bench.common import child_env
from sparkjax.errors import GpuCompileError


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
        pytest.skip(f"no CUDA PJRT plugin in this environment: {gpu.GPU_AOT_HINT} (a separate venv)")
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
