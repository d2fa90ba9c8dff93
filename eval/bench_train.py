"""Training benchmarks: tiny-config throughput on this machine, and the memory of one Qwen3-4B-shaped
training step by abstract evaluation (no weights, nothing allocated).

    python eval/bench_train.py                     # both parts (the 8-device part runs in a subprocess)
    python eval/bench_train.py --part throughput --steps 50
    python eval/bench_train.py --part memory --devices 8

Throughput: the ``train/recipes/tiny.json`` run (the bundled 6-layer target, a new 2-layer block-16
drafter, batch 8 x 64 tokens, 8 anchors per sequence), target features computed on the fly in the
same jitted step; compile time is reported apart from the steady-state step time.

Memory: ``jax.jit(train_step).lower(abstract args).compile().memory_analysis()`` for the
Qwen3-4B target config and the DSpark block-16 drafter config in
``tests/fixtures/tiny_dspark_b16/configs`` (bf16 weights, float32 master copies and AdamW moments of
the trainable drafter parameters, seq 768, 32 anchors per sequence). Data parallel: the batch is
sharded over the devices; the target, the drafter, the master weights and the optimizer state are
replicated on every device (no FSDP / tensor parallelism in the training step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures", "tiny_dspark_b16")
GIB = 1024**3


def throughput(steps: int) -> None:
    import jax
    import numpy as np

    from sparkjax.training import TrainConfig, Trainer
    from sparkjax.training.data import BatchStream
    from sparkjax.training.loop import build_data, build_models

    cfg = TrainConfig.from_file(os.path.join(ROOT, "train", "recipes", "tiny.json"), {"eval_size": 0})
    target, drafter = build_models(cfg, log=lambda m: None)
    t0 = time.perf_counter()
    train, _ = build_data(cfg, target, drafter, None, log=lambda m: None)
    gen_s = time.perf_counter() - t0
    tr = Trainer(drafter, target, optim=cfg.optim, num_anchors=cfg.num_anchors, seed=cfg.seed)
    stream = BatchStream(train, cfg.batch_size, cfg.data_seed)
    t0 = time.perf_counter()
    sums, _ = tr.step(stream.batch(0))
    jax.block_until_ready(sums)
    compile_s = time.perf_counter() - t0
    times = []
    for i in range(1, steps + 1):
        t0 = time.perf_counter()
        sums, _ = tr.step(stream.batch(i))
        jax.block_until_ready((sums, tr.state))
        times.append(time.perf_counter() - t0)
    step_s = float(np.median(times))
    tokens = cfg.batch_size * cfg.seq_len
    slots = cfg.batch_size * cfg.num_anchors * drafter.config.block_size
    print("== throughput: tiny recipe on this CPU ==")
    print(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}, cores visible: {os.cpu_count()}")
    print(f"target {target.config.num_hidden_layers} layers / hidden {target.config.hidden_size}; drafter "
          f"{drafter.config.num_hidden_layers} layers, block {drafter.config.block_size}; batch {cfg.batch_size} x "
          f"seq {cfg.seq_len}, {cfg.num_anchors} anchors/seq ({slots} block slots/step); features on the fly")
    print(f"synthetic data generation ({len(train)} sequences): {gen_s:.1f} s")
    print(f"first step (compile + run): {compile_s:.1f} s")
    print(f"steady state over {steps} steps: median {step_s * 1e3:.1f} ms/step "
          f"(mean {np.mean(times) * 1e3:.1f}, min {np.min(times) * 1e3:.1f})")
    print(f"throughput: {tokens / step_s:,.0f} tokens/s ({slots / step_s:,.0f} drafted slots/s, "
          f"{1 / step_s:.1f} steps/s)")


def memory(devices: int, batch_per_device: int, precomputed: bool = False) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from sparkjax.config import DrafterConfig, Qwen3Config
    from sparkjax.nn.drafter import Drafter
    from sparkjax.nn.qwen3 import Qwen3
    from sparkjax.sharding import batch_sharding, make_mesh
    from sparkjax.training.loss import Objective
    from sparkjax.training.optim import OptimConfig, make_optimizer
    from sparkjax.training.trainer import DEFAULT_FREEZE, StepSpec, train_step_fn, trainable_filter

    if jax.device_count() < devices:
        raise SystemExit(f"need {devices} devices, have {jax.device_count()}")
    seq, anchors = 768, 32
    tcfg = Qwen3Config.from_hf_config(os.path.join(FIX, "configs", "qwen3_4b_target_config.json"))
    dcfg = DrafterConfig.from_hf_config({**json.load(open(os.path.join(FIX, "configs",
                                                                         "dspark_qwen3_4b_b16_config.json"))),
                                         "num_anchors": anchors})
    bf16 = jnp.bfloat16
    target = nnx.eval_shape(lambda: Qwen3(tcfg, rngs=nnx.Rngs(0), dtype=bf16))
    drafter = nnx.eval_shape(lambda: Drafter(dcfg, rngs=nnx.Rngs(0), dtype=bf16))
    gdef, params, frozen = nnx.split(drafter, trainable_filter(DEFAULT_FREEZE), ...)
    tgdef, tstate = nnx.split(target)
    mesh = make_mesh(data=devices) if devices > 1 else None
    optim = OptimConfig(lr=6e-4, steps=600, warmup_steps=24)
    if precomputed:  # features and final hidden states come with the batch: no target in the step
        tgdef, tstate = None, None
    spec = StepSpec(gdef, tgdef, Objective(), optim, anchors, "bfloat16", mesh)
    rep = NamedSharding(mesh, PartitionSpec()) if mesh is not None else None

    def sds(x, dtype=None, sharding=rep):
        return jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=sharding)

    master = jax.tree.map(lambda x: sds(x, jnp.float32), params)
    opt_state = jax.eval_shape(make_optimizer(optim).init, master)
    state = {"params": master, "opt_state": jax.tree.map(sds, opt_state),
             "step": sds(jax.ShapeDtypeStruct((), jnp.int32)), "rng": sds(jax.ShapeDtypeStruct((2,), jnp.uint32))}
    frozen = jax.tree.map(sds, frozen)
    tstate = None if tstate is None else jax.tree.map(sds, tstate)
    b = devices * batch_per_device
    bs = (lambda nd: batch_sharding(mesh, nd)) if mesh is not None else (lambda nd: None)
    batch = {"input_ids": jax.ShapeDtypeStruct((b, seq), jnp.int32, sharding=bs(2)),
             "loss_mask": jax.ShapeDtypeStruct((b, seq), jnp.float32, sharding=bs(2))}
    if precomputed:
        batch["features"] = jax.ShapeDtypeStruct((b, seq, dcfg.feature_size), bf16, sharding=bs(3))
        batch["last_hidden"] = jax.ShapeDtypeStruct((b, seq, tcfg.hidden_size), bf16, sharding=bs(3))

    def nbytes(tree):
        return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))

    t0 = time.perf_counter()
    lowered = jax.jit(train_step_fn, static_argnames=("spec",), donate_argnames=("state",)).lower(
        state, frozen, tstate, batch, spec=spec)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    m = compiled.memory_analysis()
    out = {
        "devices": devices, "global_batch": b, "batch_per_device": batch_per_device, "compile_s": compile_s,
        "precomputed": precomputed,
        "trainable_params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)),
        "frozen_params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(frozen)),
        "target_params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(target)),
        "state_bytes": nbytes(state), "frozen_bytes": nbytes(frozen), "target_bytes": nbytes(tstate),
        "argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
        "alias_bytes": m.alias_size_in_bytes, "temp_bytes": m.temp_size_in_bytes,
        "code_bytes": m.generated_code_size_in_bytes,
    }
    out["peak_bytes"] = out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"]
    return out


def print_memory(r: dict) -> None:
    how = "precomputed target features in the batch" if r["precomputed"] else "target features on the fly"
    print(f"-- {r['devices']} device(s), global batch {r['global_batch']} ({r['batch_per_device']} per device), "
          f"{how}; compile {r['compile_s']:.0f} s (XLA:CPU)")
    print(f"   params: target {r['target_params'] / 1e9:.3f} B (bf16, frozen), drafter trainable "
          f"{r['trainable_params'] / 1e9:.3f} B + frozen embed/lm_head {r['frozen_params'] / 1e9:.3f} B")
    print(f"   inputs per device: train state {r['state_bytes'] / GIB:.2f} GiB (fp32 master + AdamW mu/nu), "
          f"frozen drafter {r['frozen_bytes'] / GIB:.2f} GiB, target weights {r['target_bytes'] / GIB:.2f} GiB")
    print(f"   memory_analysis per device: arguments {r['argument_bytes'] / GIB:.2f} GiB, outputs "
          f"{r['output_bytes'] / GIB:.2f} GiB (aliased/donated {r['alias_bytes'] / GIB:.2f} GiB), temporaries "
          f"{r['temp_bytes'] / GIB:.2f} GiB, code {r['code_bytes'] / 2**20:.1f} MiB")
    print(f"   => peak per device ~ arguments + outputs - aliased + temporaries = {r['peak_bytes'] / GIB:.2f} GiB")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("throughput", "memory", "all"), default="all")
    ap.add_argument("--steps", type=int, default=30, help="timed steps for the throughput part")
    ap.add_argument("--devices", type=int, default=None, help="memory part: one run on this many devices")
    ap.add_argument("--batch-per-device", type=int, default=1)
    ap.add_argument("--precomputed", action="store_true",
                    help="memory part: target features come with the batch (no target in the step)")
    ap.add_argument("--json", action="store_true", help="memory part: print the raw numbers as JSON")
    args = ap.parse_args(argv)
    if args.part in ("throughput", "all"):
        throughput(args.steps)
        print()
    if args.part in ("memory", "all"):
        if args.devices is not None:
            r = memory(args.devices, args.batch_per_device, args.precomputed)
            print(json.dumps(r) if args.json else "", end="\n" if args.json else "")
            if not args.json:
                print_memory(r)
            return 0
        print("== memory: one Qwen3-4B-shaped training step (abstract evaluation) ==")
        print("target qwen3_4b_target_config.json (36 layers, hidden 2560), drafter dspark_qwen3_4b_b16_config.json "
              "(5 layers, block 16, Markov rank 256, confidence head), seq 768, 32 anchors/seq, bf16 weights;")
        print("sharded over the data axis: the batch and every activation; replicated on each device: target, "
              "drafter (frozen embed/lm_head too), fp32 master weights, AdamW moments.")
        runs = []
        for devices, per, pre in ((1, 1, False), (1, 1, True), (1, 4, False), (8, 1, False), (8, 1, True)):
            env = {**os.environ}
            if devices > 1:
                env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
            cmd = [sys.executable, __file__, "--part", "memory", "--devices", str(devices),
                   "--batch-per-device", str(per), "--json"] + (["--precomputed"] if pre else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                return proc.returncode
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            runs.append(r)
            print_memory(r)
        print("note: XLA:CPU buffer assignment, not a GPU/TPU one. XLA:CPU upcasts bf16 dots to f32, so the "
              "on-the-fly target forward's temporaries (f32 weight copies) are far larger here than on an "
              "accelerator; the precomputed-features rows isolate the drafter's step. The 8-device rows come "
              "from 8 virtual CPU devices; per-device memory does not shrink with more devices because only the "
              "batch is sharded.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
