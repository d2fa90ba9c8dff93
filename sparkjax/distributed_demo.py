"""Sharded generation (and data-parallel training) over one global mesh, in one or several processes.

One process with 8 virtual CPU devices::

    python -m sparkjax.distributed_demo --local-devices 8 --mesh 2x4

Two processes of four CPU devices each, one global ``(2, 4)`` mesh over JAX's distributed runtime
(``jax.distributed.initialize``; gloo collectives on CPU), started in two shells::

    python -m sparkjax.distributed_demo --local-devices 4 --mesh 2x4 \\
        --coordinator 127.0.0.1:12355 --num-processes 2 --process-id 0
    python -m sparkjax.distributed_demo --local-devices 4 --mesh 2x4 \\
        --coordinator 127.0.0.1:12355 --num-processes 2 --process-id 1

Both build the same seeded random pair and prompts, generate with every ``--methods`` entry and print
(process 0; ``--out`` writes) one JSON line with the tokens. ``--train-steps N`` also runs N data-parallel
training steps of the drafter and reports their losses.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

import jax
import numpy as np

from . import engine
from .io.atomic import atomic_file
from .sharding import make_mesh
from .testing import random_pair
from .training import OptimConfig, Trainer

DEFAULT_METHODS = ("ar", "dflash", "dspark", "ddtree", "sparklingtree", "sparklingtree-beam", "auto")


# The demo's pair: 8-wide heads (heads and KV heads that divide 8 shard over a model axis of up to 8), its Markov head
# the target's own bigram map, so drafts are often accepted. tiny_pair(seed, heads=..., kv_heads=...) varies the heads.
tiny_pair = functools.partial(random_pair, vocab=32, hidden=64, heads=8, kv_heads=8, max_positions=512, tied=False,
                              bigram=True)


def tiny_prompts(batch: int, vocab: int = 32, seed: int = 1) -> list[list[int]]:
    """``batch`` prompts of different lengths (3 to 10 tokens), the same on every process."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab - 1, 3 + (b * 5) % 8).tolist() for b in range(batch)]


def parse_mesh(text: str) -> tuple[int, int]:
    try:
        data, model = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--mesh: expected DATAxMODEL such as 2x4, got {text!r}") from None
    return data, model


def run(args) -> dict:
    data, model = parse_mesh(args.mesh)
    mesh = make_mesh(data, model) if data * model > 1 else None
    target, drafter = tiny_pair(args.seed)
    prompts = tiny_prompts(args.batch)
    result = {"processes": jax.process_count(), "devices": jax.device_count(),
              "local_devices": jax.local_device_count(), "mesh": [data, model],
              "collectives": jax.config.jax_cpu_collectives_implementation, "tokens": {}}
    for method in args.methods.split(","):
        spec = engine.parse_method(method, budget=8 if method in engine.TREE_METHODS else None)
        if spec.labels():  # a method choosing among candidates gets a fixed cost table: every process makes
            spec = engine.Auto(sizes=(0, "chain", 4, 8))  # the same choices, and none profiles
            labels = spec.resolve(drafter).labels()
            spec = dataclasses.replace(spec, table=engine.CostTable(labels, (1.0, 1.6, 1.5, 1.8)))
        out = engine.generate(target, drafter if spec.speculative else None, prompts, method=spec,
                              max_new_tokens=args.max_new, mesh=mesh)
        result["tokens"][method] = out.tokens
    if args.train_steps:
        train_mesh = make_mesh(data=jax.device_count()) if jax.device_count() > 1 else None
        trainer = Trainer(drafter, target, optim=OptimConfig(lr=1e-3, steps=args.train_steps, warmup_steps=0,
                                                             schedule="constant"),
                          num_anchors=4, seed=0, mesh=train_mesh)
        rng = np.random.default_rng(7)
        batch = {"input_ids": rng.integers(0, 31, (8, 24)).astype(np.int32),
                 "loss_mask": np.ones((8, 24), np.float32)}
        result["train_losses"] = [float(np.asarray(trainer.step(batch)[0].losses(trainer.spec.objective)["loss"]))
                                  for _ in range(args.train_steps)]
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparkjax.distributed_demo", description=__doc__.split("\n")[0])
    p.add_argument("--mesh", default="2x4", help="DATAxMODEL over every process's devices (default 2x4)")
    p.add_argument("--local-devices", type=int, default=None,
                   help="CPU devices of this process (sets --xla_force_host_platform_device_count)")
    p.add_argument("--coordinator", default=None, help="HOST:PORT of process 0 (multi-process runs)")
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-new", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-steps", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON result here (process 0)")
    args = p.parse_args(argv)
    if args.local_devices:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.local_devices}".strip()
    if args.coordinator:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id, initialization_timeout=120)
    result = run(args)
    if jax.process_index() == 0:
        line = json.dumps(result)
        print(line)
        if args.out:
            with atomic_file(args.out) as tmp, open(tmp, "w") as f:
                f.write(line + "\n")
    if args.coordinator:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
