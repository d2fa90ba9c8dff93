"""Generation programs compiled for an H200 on this CPU (deviceless ahead-of-time), and what their GPU HLO holds.

    pip install -e ".[gpu-aot]"      # the CUDA PJRT plugin of this jax, cuDNN and ptxas (no GPU needed)
    python -m sparkjax.bench gpu-compile --preset real --batches 1,8 --contexts 1024 \\
        --methods ar,dspark,sparklingtree@16,sparklingtree@64,auto --attention einsum,dpa
    python -m sparkjax.bench gpu-compile --cases 1:1024,8:1024,32:8192 --methods ar,sparklingtree@64

Every program is compiled by XLA:GPU for an H200 (or, ``--target h100``, an H100) target description
(``jax.experimental.topologies`` with :data:`H200` / :data:`H100`) from abstract bf16 weights placed on that
compile-only device, traced as a GPU process traces it (``jax.default_backend()`` reads ``"gpu"``); nothing runs.
Per program: ``memory_analysis()`` (peak = arguments + outputs + temporaries - aliased); where the program's loop
runs (:mod:`sparkjax.bench.loops`): ``loop`` (``command_buffer``, ``known_trip_count`` or ``host``) and
``host_round_trips_per_round``, read from the compiled program, with the engine's per-program loop options
(``--gpu-loop command_buffer``) or XLA's defaults (``--gpu-loop xla_default``); and, for one iteration of the
generation loop (``ar``: one decode step), the kernels, bytes and FLOPs (:mod:`sparkjax.bench.hlo`), how they are
launched (``launches``: replayed from a command buffer or launched one by one, command buffers started; from XLA's
thunk tree) and the projection, a range: the kernels' roofline ``sum of max(bytes / bandwidth, FLOPs / 989.5
TFLOP/s)`` plus each launch and host round trip priced at the low / central / high points of :data:`OVERHEADS`, in
microseconds and in AR steps, beside the outside calibration point (:data:`CALIBRATION`, measured rounds of SGLang
on an H100) with projection / measurement. Also float32 tensors shaped like attention scores ``[B, N, T, S]`` and
kernels that copy, transpose or concatenate a layer's KV cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import time
from unittest import mock

import jax
from flax import nnx

from sparkjax.engine.options import GPU_LOOPS, Options
from sparkjax.errors import ArgumentError, GpuCompileError
from sparkjax.nn.layers import ATTENTION_IMPLS

from . import hlo, loops
from .common import (
    TAU,
    WRITEUP_SPEEDUP,
    abstract_models,
    add_output,
    configs,
    describe,
    dump_hlo,
    error_line,
    ints,
    label_fields,
    log,
    lower,
    lower_visit,
    names,
    parse_label,
    sizes,
    write_text,
)

# An H200 SXM as XLA:GPU's target description (GpuTargetConfigProto text): the numbers of XLA's own spec
# (xla/backends/gpu/target_config/specs/h200.txtpb), sm_90, cuDNN 9.10, CUDA runtime 12.8 and its driver version
# 13.0 (the driver must be given: XLA drops the WHILE / CONDITIONAL command buffers, and the traced CUBLAS / CUDNN /
# CUSTOM_CALL ones, when min(runtime, driver) is below 12.3, and a description without one reads 0).
H200 = {
    "name": "NVIDIA H200 141GB HBM3e", "core_count": 132, "fpus_per_core": 128, "clock_rate_ghz": 1.98,
    "memory_bandwidth": 4_800_000_000_000, "device_memory_size": 151_397_597_184, "l2_cache_size": 52_428_800,
    "shared_memory_per_block": 49152, "shared_memory_per_block_optin": 232448, "shared_memory_per_core": 233472,
    "threads_per_block_limit": 1024, "threads_per_warp": 32, "threads_per_core_limit": 2048,
    "registers_per_core_limit": 65536, "registers_per_block_limit": 65536, "block_dim_limit_x": 2147483647,
    "block_dim_limit_y": 65535, "block_dim_limit_z": 65535, "compute_capability": (9, 0),
    "runtime_version": "12.8.0", "driver_version": "13.0.0", "dnn_version": (9, 10, 0),
    "bf16_flops": 989.5e12,  # dense bf16 tensor-core peak (not part of XLA's description)
}
# An H100 SXM (xla/backends/gpu/target_config/specs/h100_sxm.txtpb): the H200's SM, 80 GB at 3.35 TB/s.
H100 = {**H200, "name": "NVIDIA H100 80GB HBM3", "memory_bandwidth": 3_352_320_000_000,
        "device_memory_size": 84_942_979_072}
TARGETS = {"h200": H200, "h100": H100}

POINTS = ("low", "central", "high")


@dataclasses.dataclass(frozen=True)
class Overhead:
    """One execution overhead of the projection, in microseconds: low / central / high and where they come from."""

    low: float
    central: float
    high: float
    source: str

    def at(self, point: str) -> float:
        return getattr(self, point)


# What the projection charges beyond each kernel's roofline time, per round (docs/benchmarks.md, "What the projection
# charges"). Public figures, none measured by sparkjax: the device check (python -m sparkjax.bench device) measures
# them on the first GPU it runs on.
OVERHEADS = {
    "graph_kernel_us": Overhead(
        0.2, 0.5, 1.0, "per kernel replayed from a CUDA graph (a command buffer): the device-side gap between "
        "back-to-back graph nodes, well under 1 us on Hopper; a whole decode step's graph replay costs a few us "
        "(NVIDIA, 'Getting Started with CUDA Graphs', developer.nvidia.com/blog/cuda-graphs/; 'Constant Time Launch "
        "for Straight-Line CUDA Graphs', developer.nvidia.com/blog/constant-time-launch-for-straight-line-graphs-"
        "and-other-performance-enhancements/)"),
    "graph_launch_us": Overhead(
        2.0, 4.0, 8.0, "per command buffer started in a round: a graph launch by the host (or, for a loop in a "
        "command buffer, the device starting the body's graph again from its conditional node): a few us per "
        "whole step (same sources)"),
    "eager_kernel_us": Overhead(
        2.5, 3.5, 5.0, "per kernel the host launches one by one (a thunk outside every command buffer): 2.5-5 us "
        "per eager launch on Hopper in public measurements (e.g. 4-6 us per launch in susun-blog.com/blog/"
        "pegainfer-3-cuda-graph; NVIDIA's CUDA Graphs post); charged in full, as if no launch overlapped a kernel"),
    "host_round_trip_us": Overhead(
        10.0, 20.0, 50.0, "per device->host round trip in a round (a loop run from the host reads its predicate, "
        "a conditional its branch index: a few-byte copy to the host, a stream synchronisation, the host waking "
        "and enqueuing what follows while the GPU idles; the relaunch itself is a graph_launch_us): an estimate, "
        "no published figure for XLA's while thunk; the device check measures the GPU's idle time between rounds"),
}

# The outside calibration point: measured rounds of the SparklingTree authors' concurrency study
# (github.com/jwlaboratory/diffusion-sparked-tree, commit d343001, concurrency/PREDICTION.md "tree_w65_noov" and
# concurrency/REPORT.md "baseline_noov" mean TPOT): SGLang v0.5.16 (lmsysorg/sglang:v0.5.16-cu129) on one H100,
# Qwen/Qwen3-4B, CUDA graphs and FlashInfer, overlap scheduling off; a width-65 tree round (draft + verify; the
# host-resident tree builder's own time not included) against the plain decode step.
CALIBRATION = {
    "source": "SGLang v0.5.16, one H100, Qwen3-4B, CUDA graphs + FlashInfer (jwlaboratory/diffusion-sparked-tree "
              "@ d343001, concurrency/PREDICTION.md tree_w65_noov / REPORT.md baseline_noov TPOT)",
    "label": "sparklingtree@64", "verify_width": 65, "device": "h100",
    "points": {1: {"round_ms": 8.54, "ar_step_ms": 4.87}, 8: {"round_ms": 20.98, "ar_step_ms": 5.74}},
}
GPU_AOT_HINT = 'pip install -e ".[gpu-aot]" (jax-cuda12-plugin / jax-cuda12-pjrt of this jax, nvidia-cudnn-cu12)'
PROMPT = 16  # prompt width of the compiled programs
BUF_LEN = 64  # output slots of the compiled programs


def target_config(spec: dict) -> str:
    """The ``GpuTargetConfigProto`` text of a target in :data:`TARGETS`."""
    ints_ = ("threads_per_block_limit", "threads_per_warp", "shared_memory_per_block", "shared_memory_per_core",
             "threads_per_core_limit", "core_count", "fpus_per_core", "block_dim_limit_x", "block_dim_limit_y",
             "block_dim_limit_z", "memory_bandwidth", "l2_cache_size", "device_memory_size",
             "shared_memory_per_block_optin", "registers_per_core_limit", "registers_per_block_limit")
    major, minor = spec["compute_capability"]
    dnn = spec["dnn_version"]
    info = [f"  {k}: {spec[k]}" for k in ints_] + [
        f"  clock_rate_ghz: {spec['clock_rate_ghz']}",
        f"  cuda_compute_capability {{ major: {major} minor: {minor} }}",
        f'  name: "{spec["name"]}"', f'  driver_version: "{spec["driver_version"]}"',
        f'  runtime_version: "{spec["runtime_version"]}"',
        f'  dnn_version: "{".".join(map(str, dnn))}"']
    return "\n".join(["gpu_device_info {", *info, "}", 'platform_name: "CUDA"',
                      f"dnn_version_info {{ major: {dnn[0]} minor: {dnn[1]} patch: {dnn[2]} }}",
                      f'device_description_str: "{spec["name"]}"']) + "\n"


@functools.cache
def compile_device(target: str = "h200"):
    """The compile-only CUDA device of ``target`` (``jax.experimental.topologies``, topology 1x1x1); a
    :class:`~sparkjax.errors.GpuCompileError` saying how to install the plugin when this jax has none. Where
    ``JAX_PLATFORMS`` is unset, sets ``jax_platforms`` to ``cpu`` (effective before jax's backends start)."""
    from jax.experimental import topologies

    if target not in TARGETS:
        raise ArgumentError(f"--target: unknown target {target!r}; expected one of {', '.join(TARGETS)}")
    if not os.environ.get("JAX_PLATFORMS"):  # the CUDA plugin only compiles here: no CUDA backend to start
        jax.config.update("jax_platforms", "cpu")
    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=target_config(TARGETS[target]),
                                            topology="1x1x1")
    except Exception as e:  # no CUDA plugin: jax raises RuntimeError / JaxRuntimeError / NotImplementedError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GpuCompileError(f"no deviceless CUDA compile with jax {jax.__version__} ({first[:200]}); "
                              f"install the extra: {GPU_AOT_HINT}") from None
    return topo.devices[0]


def placed(tree, device):
    """Abstract ``ShapeDtypeStruct`` copies of every leaf of ``tree``, on ``device``."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


@contextlib.contextmanager
def traced_as_gpu():
    """While lowering: ``jax.default_backend()`` reads ``"gpu"``, so every backend-dependent choice of the
    engine is the one a GPU process makes."""
    with mock.patch.object(jax, "default_backend", lambda: "gpu"):
        yield


def compile_program(preset: str, label: str, batch: int, context: int, options: Options, device=None,
                    program: str = "generate"):
    """``(compiled, lower seconds, compile seconds, thunks)`` of the greedy generation program of ``label``
    (``ar``: the target alone; prompt :data:`PROMPT`, :data:`BUF_LEN` output slots), or with ``program="visit"``
    of the serving pool's visit of ``batch`` slots, from abstract weights; with ``device`` (a compile-only device)
    the weights are placed on it, the program is traced as a GPU process traces it (its per-program loop options,
    :func:`~sparkjax.engine.programs.loop_compiler_options`, included) and ``thunks`` is XLA's thunk tree
    (:func:`~sparkjax.bench.loops.compile_with_thunks`; None without a device)."""
    target, dspark, dflash = abstract_models(preset)
    method = parse_label(label)
    drafter = dspark if method.needs_markov else dflash
    if device is not None:
        for model in (target, drafter):
            nnx.update(model, placed(nnx.split(model)[1], device))
    t0 = time.perf_counter()
    with traced_as_gpu() if device is not None else contextlib.nullcontext():
        if program == "visit":
            lowered, _ = lower_visit(method, target, drafter, batch, context, BUF_LEN, options)
        else:
            lowered, _ = lower(method, target, drafter, batch, PROMPT, context, BUF_LEN, options)
    t1 = time.perf_counter()
    if device is None:
        compiled, thunks = lowered.compile(), None
    else:
        compiled, thunks = loops.compile_with_thunks(lowered)
    return compiled, t1 - t0, time.perf_counter() - t1, thunks


def kernel_seconds(k: hlo.Kernel, spec: dict) -> float:
    return max(k.bytes / spec["memory_bandwidth"], k.flops / spec["bf16_flops"])


def projection(roofline_us: float, launches: dict, host_round_trips: int, overheads: dict | None = None) -> dict:
    """``{point: round us}`` for low / central / high: the kernels' roofline time plus, at that point of each
    :data:`OVERHEADS` range, every graph-replayed kernel, every eagerly launched one, every command buffer started
    and every device->host round trip of the round (additive: no overhead is assumed hidden behind a kernel)."""
    o = overheads or OVERHEADS
    return {p: roofline_us + launches["graph_kernels"] * o["graph_kernel_us"].at(p)
            + launches["eager_kernels"] * o["eager_kernel_us"].at(p)
            + launches["graph_launches"] * o["graph_launch_us"].at(p)
            + host_round_trips * o["host_round_trip_us"].at(p) for p in POINTS}


def calibration(label: str, batch: int, ar_steps: dict) -> dict | None:
    """The outside calibration point (:data:`CALIBRATION`) for a ``label`` row at ``batch`` with projected
    ``{point: round AR steps}``: the measured AR steps and projection / measurement per point; None for other
    rows."""
    point = CALIBRATION["points"].get(batch)
    if label != CALIBRATION["label"] or point is None:
        return None
    measured = point["round_ms"] / point["ar_step_ms"]
    return {"measured_round_ar_steps": measured, "measured_round_ms": point["round_ms"],
            "measured_ar_step_ms": point["ar_step_ms"], "measured_on": CALIBRATION["device"],
            "source": CALIBRATION["source"], "ratio": {p: ar_steps[p] / measured for p in POINTS}}


def fmt_range(r: dict | None, spec: str = ".2f") -> str:
    """``central (min-max)`` of a ``{point: value}`` range (a ratio of two ranges, as AR steps, need not grow
    from the low point to the high one: its extremes are shown)."""
    if not r:
        return "-"
    lo, hi = min(r[p] for p in POINTS), max(r[p] for p in POINTS)
    return f"{r['central']:{spec}} ({lo:{spec}}-{hi:{spec}})"


def analyse(text: str, preset: str, batch: int, context: int, spec: dict) -> dict:
    """The round's (the loop body's) figures from the optimised GPU HLO ``text``, its kernels' roofline time
    (``roofline_us``) and the tally itself (``_tally``, not recorded)."""
    tc = configs(preset)[0]
    tally = hlo.count_hlo(text, loop_body=True, elide_converts=False)
    layer = batch * tc.num_key_value_heads * context * tc.head_dim  # elements of one layer's K (or V) cache
    copies = [k for k in tally.kernels if k.moves and any(
        math.prod(dims) >= layer and tc.head_dim in dims and tc.num_key_value_heads in dims
        and max(dims) >= context for _, dims in hlo.shape_arrays(k.shape))]
    f32 = hlo.f32_score_tensors(tally, batch, tc.num_attention_heads, tc.num_key_value_heads, context)
    costly = sorted(tally.kernels, key=lambda k: -k.count * kernel_seconds(k, spec))[:8]
    bw, peak = spec["memory_bandwidth"], spec["bf16_flops"]
    return {
        "kernels_per_round": tally.total_kernels, "bytes_per_round": tally.bytes, "flops_per_round": tally.flops,
        "unknown_loops": tally.unknown_loops,
        "roofline_us": tally.seconds(bw, peak) * 1e6, "_tally": tally,
        "f32_scores": bool(f32), "f32_score_shapes": f32,
        "kv_copies": int(round(sum(k.count for k in copies))),
        "kv_copy_shapes": sorted({k.shape.split("{")[0] for k in copies}),
        "stages": tally.by_stage(),
        "costliest_kernels": [{"name": k.name, "stage": k.stage, "shape": k.shape.split("{")[0], "count": k.count,
                               "bytes": k.bytes, "flops": k.flops, "us": kernel_seconds(k, spec) * 1e6}
                              for k in costly],
    }


def add_arguments(p) -> None:
    p.add_argument("--preset", default="real", help="real (Qwen3-4B + DSpark-b16), reduced, demo or tiny")
    p.add_argument("--batches", default="1,8", help="batch sizes (crossed with --contexts)")
    p.add_argument("--contexts", default="1024", help="cache slots S (crossed with --batches)")
    p.add_argument("--cases", help="batch:context pairs instead of the cross product, e.g. 1:1024,8:1024,32:8192")
    p.add_argument("--methods", default="ar,dspark,sparklingtree@16,sparklingtree@64,auto",
                   help="names or name@budget (ar is always compiled: it is the AR step of the projection)")
    p.add_argument("--attention", default="einsum,dpa",
                   help=f"comma-separated attention paths ({', '.join(ATTENTION_IMPLS)}; auto: the GPU default)")
    p.add_argument("--target", default="h200", choices=tuple(TARGETS))
    p.add_argument("--gpu-loop", default="command_buffer",
                   help="comma-separated: command_buffer (the engine's per-program options: loops and conditionals "
                        "in command buffers) and / or xla_default (XLA's default loop handling, for comparison)")
    p.add_argument("--programs", default="generate",
                   help="comma-separated: generate (each method's generation program) and / or visit (the serving "
                        "pool's visit of B slots)")
    p.add_argument("--tau", type=float, default=TAU, help="accepted tokens per round for the projected speedup")
    p.add_argument("--timeout", type=float, help="stop starting compiles after this many seconds")
    p.add_argument("--dump-hlo", metavar="DIR", help="also write each compiled program's HLO text into DIR")
    add_output(p)


def cases(a) -> list[tuple[int, int]]:
    if a.cases:
        out = []
        for part in names(a.cases):
            b, sep, s = part.partition(":")
            if not sep:
                raise ArgumentError(f"--cases: expected batch:context pairs, got {part!r}")
            out.append((ints(b, "--cases")[0], ints(s, "--cases", 64)[0]))
        return out
    return [(b, s) for s in ints(a.contexts, "--contexts", 64) for b in ints(a.batches, "--batches")]


def labels(methods: str) -> list[str]:
    """``ar`` and the other labels of ``--methods``, each checked before any compile."""
    return ["ar", *[m for m in names(methods) if parse_label(m) is not None and m != "ar"]]


def fmt_table(rows: list[dict]) -> str:
    head = (f"{'attention':9} {'loops':14} {'program':8} {'B':>3} {'S':>5} {'method':18} {'kernels':>7} "
            f"{'graph':>5} {'eager':>5} {'GB/round':>8} {'GFLOP':>7} {'roofline':>8} {'round us (range)':>20} "
            f"{'xAR (range)':>17} {'spd@tau':>7} {'f32 scores':>10} {'kv copies':>9} {'peak GiB':>8} {'fits':>4} "
            f"{'loop':16} {'host rt':>7} {'compile':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lead = (f"{r['attention']:9} {r.get('gpu_loop', '-'):14} {r.get('program', 'generate'):8} {r['batch']:>3} "
                f"{r['context']:>5} {r['label']:18}")
        if "error" in r:
            lines.append(f"{lead} failed: {r['error']}")
            continue
        spd = f"{r['projected_speedup']:.2f}x" if r.get("projected_speedup") else "-"
        ln = r["launches"]
        lines.append(
            f"{lead} {r['kernels_per_round']:>7} {ln['graph_kernels']:>5} {ln['eager_kernels']:>5} "
            f"{r['bytes_per_round'] / 1e9:>8.2f} {r['flops_per_round'] / 1e9:>7.0f} {r['roofline_us']:>8.0f} "
            f"{fmt_range(r['round_us_range'], '.0f'):>20} {fmt_range(r.get('round_ar_steps_range')):>17} {spd:>7} "
            f"{str(r['f32_scores']):>10} {r['kv_copies']:>9} {r['peak_bytes'] / 2**30:>8.1f} "
            f"{'yes' if r['fits'] else 'NO':>4} {r.get('loop', '-'):16} {r.get('host_round_trips_per_round', '-'):>7} "
            f"{r['compile_s']:>6.0f}s")
    return "\n".join(lines)


def calibration_lines(rows: list[dict]) -> list[str]:
    """The calibration point beside every row that has one (:func:`calibration`)."""
    out = []
    for r in rows:
        c = r.get("calibration")
        if not c:
            continue
        ratio = c["ratio"]
        out.append(f"# calibration {r['target']} {r['attention']} {r.get('gpu_loop', '-')} B={r['batch']} "
                   f"S={r['context']} {r['label']}: projected {fmt_range(r['round_ar_steps_range'])} AR steps; "
                   f"measured (SGLang, {c['measured_on']}, concurrency {r['batch']}) "
                   f"{c['measured_round_ar_steps']:.2f} "
                   f"({c['measured_round_ms']:g} / {c['measured_ar_step_ms']:g} ms); projection / measurement "
                   f"{fmt_range(ratio)}")
    return out


def choices(text: str, arg: str, allowed: tuple[str, ...]) -> list[str]:
    out = names(text)
    for x in out:
        if x not in allowed:
            raise ArgumentError(f"{arg}: unknown value {x!r}; expected one of {', '.join(allowed)}")
    return out


def run(a, report) -> None:
    configs(a.preset)
    todo, methods = cases(a), labels(a.methods)
    attentions = choices(a.attention, "--attention", ATTENTION_IMPLS)
    gpu_loops = choices(a.gpu_loop, "--gpu-loop", GPU_LOOPS)
    programs = choices(a.programs, "--programs", ("generate", "visit"))
    spec = TARGETS[a.target]
    device = compile_device(a.target)
    deadline = report.start + a.timeout if a.timeout else float("inf")
    report.table = fmt_table
    report.header += [
        f"# compiled by XLA:GPU for {getattr(device, 'device_kind', spec['name'])} (deviceless, jax "
        f"{jax.__version__}); nothing ran. Abstract bf16 weights, greedy programs, prompt {PROMPT}, "
        f"{BUF_LEN} output slots.",
        f"# round = one iteration of the generation loop (ar: one decode step; visit: of the serving visit's loop). "
        f"roofline = sum over kernels of max(bytes / {spec['memory_bandwidth'] / 1e12:g} TB/s, FLOPs / "
        f"{spec['bf16_flops'] / 1e12:g} TFLOP/s). round us = roofline + graph kernels x graph_kernel_us + eager "
        f"kernels x eager_kernel_us + command buffers started x graph_launch_us + host rt x host_round_trip_us, "
        "central (the least-most over the low, central and high points) over these ranges (public figures, not "
        "measured here):",
        *(f"#   {k}: {o.low:g} / {o.central:g} / {o.high:g} us" for k, o in OVERHEADS.items()),
        "#   (sources in the JSON rows' overheads and docs/benchmarks.md). graph / eager: kernel executions per round "
        "inside a command buffer / launched one by one by the host, read from XLA's thunk tree.",
        f"# xAR = round us / the ar step's at the same B, S and point; spd@tau = tau {a.tau} / xAR central (the "
        f"SparklingTree write-up: {WRITEUP_SPEEDUP}x). Outside calibration: {CALIBRATION['source']}: width-65 round "
        + ", ".join(f"{v['round_ms']:g} / {v['ar_step_ms']:g} ms = {v['round_ms'] / v['ar_step_ms']:.2f} AR steps at "
                    f"concurrency {b}" for b, v in CALIBRATION["points"].items()) + ".",
        "# f32 scores: a float32 [B, N, T, S]-shaped kernel result in the round; kv copies: kernels per round that "
        "only copy / transpose / concatenate at least one layer's KV cache. peak = args + out + temp - alias "
        f"(memory_analysis); fits: peak <= {spec['device_memory_size'] / 2**30:.0f} GiB.",
        "# loops: command_buffer = the engine's per-program options (WHILE and CONDITIONAL command buffers), "
        "xla_default = XLA's defaults. loop: where the loop runs, read from XLA's thunk tree and the optimised HLO "
        "(command_buffer: on the device; known_trip_count: enqueued by the host without a wait; host: the host "
        "reads the predicate back every iteration); host rt: device->host round trips per iteration, at least.",
        *("# " + line for line in describe(a.preset).splitlines())]
    complete = True
    for at in attentions:
        for gl in gpu_loops:
            for prog in programs:
                for b, s in todo:
                    if not complete:
                        break
                    complete = _group(a, report, deadline, device, spec, methods, at, gl, prog, b, s)
    report.footer += calibration_lines(report.rows)
    if not complete:
        report.footer.append(f"# stopped early by --timeout {a.timeout:g}s: the rows above are what was compiled")


def _group(a, report, deadline, device, spec, methods, at, gl, prog, b, s) -> bool:
    """The rows of every method at one attention path, loop mode, program and case (ar first: the AR step);
    False when ``--timeout`` stopped it."""
    ar = None
    tag = f"[{at} {gl} {prog} B={b} S={s}]"
    for label in methods:
        if time.perf_counter() > deadline:
            return False
        row = {**label_fields(label), "label": label, "batch": b, "context": s, "target": a.target,
               "attention": at, "gpu_loop": gl, "program": prog, "preset": a.preset, "projection": True}
        try:
            compiled, lower_s, compile_s, thunks = compile_program(
                a.preset, label, b, s, Options(attention=at, chain_mode="auto", gpu_loop=gl), device, prog)
        except (ArgumentError, GpuCompileError):
            raise
        except Exception as e:  # a compile that fails is a result of this command: recorded, not hidden
            row["error"] = error_line(e)
            report.rows.append(row)
            log(f"  {tag} {label} failed: {row['error']}")
            continue
        text = compiled.as_text()
        name = f"{a.target}_{at}_b{b}_s{s}_{label}" + ("" if gl == "command_buffer" else f"_{gl}") + (
            "" if prog == "generate" else f"_{prog}")
        dump_hlo(a.dump_hlo, name, text)
        if a.dump_hlo:  # XLA's thunk tree after its passes, beside the HLO
            write_text(os.path.join(a.dump_hlo, f"{name}.thunks.txt"), thunks.text)
        row.update(sizes(compiled.memory_analysis()))
        row["fits"] = row["peak_bytes"] <= spec["device_memory_size"]
        row.update(analyse(text, a.preset, b, s, spec))
        tally = row.pop("_tally")
        row.update(loops.loop_placement(text, thunks))
        row["launches"] = loops.round_launches(text, thunks, tally.kernels, row["loop"])
        row["overheads"] = {k: dataclasses.asdict(o) for k, o in OVERHEADS.items()}
        rng = projection(row["roofline_us"], row["launches"], row["host_round_trips_per_round"])
        row.update({"round_us_range": rng, "round_us": rng["central"]})
        row.update({"lower_s": round(lower_s, 1), "compile_s": round(compile_s, 1)})
        if label == "ar":
            ar = rng
        if ar:
            steps = {p: rng[p] / ar[p] for p in POINTS}
            row.update({"ar_step_us_range": ar, "ar_step_us": ar["central"], "round_ar_steps_range": steps,
                        "round_ar_steps": steps["central"]})
            if label != "ar":
                row["projected_speedup_range"] = {p: a.tau / steps[p] for p in POINTS}
                row.update({"projected_speedup": row["projected_speedup_range"]["central"], "tau": a.tau,
                            "writeup_speedup": WRITEUP_SPEEDUP})
            if prog == "generate" and (cal := calibration(label, b, steps)):
                row["calibration"] = cal
        report.rows.append(row)
        log(f"  {tag} {label}: compiled in {compile_s:.0f}s, {row['kernels_per_round']} kernels, "
            f"{fmt_range(row['round_us_range'], '.0f')} us ({fmt_range(row.get('round_ar_steps_range'))} AR steps), "
            f"peak "
            f"{row['peak_bytes'] / 2**30:.1f} GiB, f32 scores {row['f32_scores']}, kv copies {row['kv_copies']}, "
            f"loop {row['loop']} ({row['host_round_trips_per_round']} host round trips per round)")
    return True
