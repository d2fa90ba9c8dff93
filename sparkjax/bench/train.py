"""Training: tiny-recipe throughput on this machine, and the memory of one Qwen3-4B-shaped training step.

    python -m sparkjax.bench train                     # both parts (the 8-device rows run in subprocesses)
    python -m sparkjax.bench train --part throughput --steps 50
    python -m sparkjax.bench train --part memory --devices 8 --precomputed

Throughput: the ``train/recipes/tiny.json`` run, compile apart from the steady-state step time. Memory: the
compiled Qwen3-4B / DSpark-b16 train step's ``memory_analysis()`` from abstract shapes; without ``--devices``
the standard rows run, each in a subprocess.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from sparkjax.config import DrafterConfig, Qwen3Config
from sparkjax.errors import ArgumentError
from sparkjax.nn.drafter import Drafter
from sparkjax.nn.qwen3 import Qwen3
from sparkjax.sharding import batch_sharding, make_mesh
from sparkjax.training import TrainConfig, Trainer
from sparkjax.training.data import BatchStream
from sparkjax.training.drafter import build_data, build_models
from sparkjax.training.loss import Objective
from sparkjax.training.optim import OptimConfig, make_optimizer
from sparkjax.training.trainer import DEFAULT_FREEZE, StepSpec, train_step_fn, trainable_filter

from . import timing
from .common import FIXTURE, RECIPES, SIZE_KEYS, add_output, at_least, child_env, pct, sizes

GIB = 1024**3
MEMORY_ROWS = ((1, 1, False), (1, 1, True), (1, 4, False), (8, 1, False), (8, 1, True))  # devices, per device, pre


def add_arguments(p) -> None:
    p.add_argument("--part", choices=("throughput", "memory", "all"), default="all")
    p.add_argument("--steps", type=int, default=30, help="timed steps for the throughput part")
    p.add_argument("--devices", type=int, default=None, help="memory part: one row on this many devices")
    p.add_argument("--batch-per-device", type=int, default=1)
    p.add_argument("--precomputed", action="store_true",
                   help="memory part: target features come with the batch (no target in the step)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one memory row as JSON on stdout
    add_output(p)


def throughput(steps: int) -> dict:
    cfg = TrainConfig.from_file(str(RECIPES / "tiny.json"), {"eval_size": 0})
    target, drafter = build_models(cfg, log=lambda m: None)
    t0 = time.perf_counter()
    train, _ = build_data(cfg, target, drafter, None, log=lambda m: None)
    gen_s = time.perf_counter() - t0
    tr = Trainer(drafter, target, optim=cfg.optim, num_anchors=cfg.num_anchors, seed=cfg.seed)
    stream = BatchStream(train, cfg.batch_size, cfg.data_seed)
    t0 = time.perf_counter()
    jax.block_until_ready(tr.step(stream.batch(0))[0])
    compile_s = time.perf_counter() - t0
    batches = iter(range(1, steps + 1))
    stats = timing.interleave({"step": lambda: (tr.step(stream.batch(next(batches)))[0], tr.state)}, steps)["step"]
    tokens, slots = cfg.batch_size * cfg.seq_len, cfg.batch_size * cfg.num_anchors * drafter.config.block_size
    return {"part": "throughput", "devices": jax.device_count(), "device": jax.devices()[0].device_kind,
            "target_layers": target.config.num_hidden_layers, "target_hidden": target.config.hidden_size,
            "drafter_layers": drafter.config.num_hidden_layers, "block_size": drafter.config.block_size,
            "batch": cfg.batch_size, "seq_len": cfg.seq_len, "anchors": cfg.num_anchors, "sequences": len(train),
            "data_s": gen_s, "compile_s": compile_s, "steps": steps, "step_ms": stats.median * 1e3,
            "step_ms_min": stats.min * 1e3, "spread": stats.spread, "tokens_s": tokens / stats.median,
            "slots_s": slots / stats.median}


def memory(devices: int, batch_per_device: int, precomputed: bool = False) -> dict:
    if jax.device_count() < devices:
        raise ArgumentError(f"--devices: need {devices} devices, have {jax.device_count()}")
    seq, anchors = 768, 32
    tcfg = Qwen3Config.from_hf_config(FIXTURE / "configs" / "qwen3_4b_target_config.json")
    dcfg = DrafterConfig.from_hf_config({**json.loads((FIXTURE / "configs" / "dspark_qwen3_4b_b16_config.json")
                                                      .read_text()), "num_anchors": anchors})
    target = nnx.eval_shape(lambda: Qwen3(tcfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    drafter = nnx.eval_shape(lambda: Drafter(dcfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    gdef, params, frozen = nnx.split(drafter, trainable_filter(DEFAULT_FREEZE), ...)
    tgdef, tstate = (None, None) if precomputed else nnx.split(target)  # precomputed: no target in the step
    mesh = make_mesh(data=devices) if devices > 1 else None
    optim = OptimConfig(lr=6e-4, steps=600, warmup_steps=24)
    spec = StepSpec(gdef, tgdef, Objective(), optim, anchors, "bfloat16", mesh)
    rep = NamedSharding(mesh, PartitionSpec()) if mesh is not None else None

    def sds(x, dtype=None, sharding=rep):
        return jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=sharding)

    master = jax.tree.map(lambda x: sds(x, jnp.float32), params)
    state = {"params": master, "opt_state": jax.tree.map(sds, jax.eval_shape(make_optimizer(optim).init, master)),
             "step": sds(jax.ShapeDtypeStruct((), jnp.int32)), "rng": sds(jax.ShapeDtypeStruct((2,), jnp.uint32))}
    frozen = jax.tree.map(sds, frozen)
    tstate = None if tstate is None else jax.tree.map(sds, tstate)
    b = devices * batch_per_device
    bs = (lambda nd: batch_sharding(mesh, nd)) if mesh is not None else (lambda nd: None)
    batch = {"input_ids": jax.ShapeDtypeStruct((b, seq), jnp.int32, sharding=bs(2)),
             "loss_mask": jax.ShapeDtypeStruct((b, seq), jnp.float32, sharding=bs(2))}
    if precomputed:
        batch["features"] = jax.ShapeDtypeStruct((b, seq, dcfg.feature_size), jnp.bfloat16, sharding=bs(3))
        batch["last_hidden"] = jax.ShapeDtypeStruct((b, seq, tcfg.hidden_size), jnp.bfloat16, sharding=bs(3))

    def count(tree, nbytes=True):
        return sum(int(np.prod(x.shape)) * (jnp.dtype(x.dtype).itemsize if nbytes else 1)
                   for x in jax.tree.leaves(tree))

    t0 = time.perf_counter()
    compiled = jax.jit(train_step_fn, static_argnames=("spec",), donate_argnames=("state",)).lower(
        state, frozen, tstate, batch, spec=spec).compile()
    m = sizes(compiled.memory_analysis(), (*SIZE_KEYS, "generated_code"))
    return {"part": "memory", "devices": devices, "global_batch": b, "batch_per_device": batch_per_device,
            "compile_s": time.perf_counter() - t0, "precomputed": precomputed,
            "trainable_params": count(params, False), "frozen_params": count(frozen, False),
            "target_params": count(target, False), "state_bytes": count(state), "frozen_bytes": count(frozen),
            "target_bytes": count(tstate), **{f"{k}_bytes": m[k] for k in SIZE_KEYS},
            "code_bytes": m["generated_code"], "peak_bytes": m["peak_bytes"]}


def memory_in_child(devices: int, per: int, pre: bool) -> dict:
    env = child_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}") if devices > 1 else child_env()
    cmd = [sys.executable, "-m", "sparkjax.bench", "train", "--part", "memory", "--devices", str(devices),
           "--batch-per-device", str(per), "--child"] + (["--precomputed"] if pre else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"the memory child {cmd[3:]} failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        if r["part"] == "throughput":
            lines += [f"== throughput: tiny recipe, {r['devices']} x {r['device']} ==",
                      f"target {r['target_layers']} layers / hidden {r['target_hidden']}; drafter {r['drafter_layers']}"
                      f" layers, block {r['block_size']}; batch {r['batch']} x seq {r['seq_len']}, {r['anchors']} "
                      f"anchors/seq; features on the fly",
                      f"synthetic data ({r['sequences']} sequences): {r['data_s']:.1f} s; first step (compile + run):"
                      f" {r['compile_s']:.1f} s",
                      f"steady state over {r['steps']} steps: median {r['step_ms']:.1f} ms/step (min "
                      f"{r['step_ms_min']:.1f}, spread {pct(r['spread'])})",
                      f"throughput: {r['tokens_s']:,.0f} tokens/s ({r['slots_s']:,.0f} drafted slots/s)"]
            continue
        how = "precomputed target features in the batch" if r["precomputed"] else "target features on the fly"
        g = {k: r[k] / GIB for k in r if k.endswith("_bytes")}
        lines += [f"-- memory: {r['devices']} device(s), global batch {r['global_batch']} ({r['batch_per_device']} per "
                  f"device), {how}; compile {r['compile_s']:.0f} s",
                  f"   params: target {r['target_params'] / 1e9:.3f} B (bf16, frozen), drafter trainable "
                  f"{r['trainable_params'] / 1e9:.3f} B + frozen embed/lm_head {r['frozen_params'] / 1e9:.3f} B",
                  f"   inputs per device: train state {g['state_bytes']:.2f} GiB (fp32 master + AdamW mu/nu), frozen "
                  f"drafter {g['frozen_bytes']:.2f} GiB, target weights {g['target_bytes']:.2f} GiB",
                  f"   memory_analysis per device: arguments {g['argument_bytes']:.2f} GiB, outputs "
                  f"{g['output_bytes']:.2f} GiB (aliased {g['alias_bytes']:.2f} GiB), temporaries "
                  f"{g['temp_bytes']:.2f} GiB => peak ~ {g['peak_bytes']:.2f} GiB"]
    return "\n".join(lines)


def run(args, report) -> None:
    at_least(args.steps, "--steps")
    at_least(args.batch_per_device, "--batch-per-device")
    if args.devices is not None:
        at_least(args.devices, "--devices")
    if args.child:
        print(json.dumps(memory(args.devices or 1, args.batch_per_device, args.precomputed)))
        raise SystemExit(0)
    report.table = table
    if args.part in ("throughput", "all"):
        report.rows.append(throughput(args.steps))
    if args.part in ("memory", "all"):
        report.header.append("# memory: Qwen3-4B target + DSpark-b16 drafter configs, seq 768, 32 anchors/seq, bf16 "
                             "weights, abstract evaluation; XLA:CPU buffer assignment, not a GPU one")
        todo = [(args.devices, args.batch_per_device, args.precomputed)] if args.devices else MEMORY_ROWS
        for devices, per, pre in todo:
            report.rows.append(memory(devices, per, pre) if args.devices else memory_in_child(devices, per, pre))
