"""The collectives of one compiled speculative round on a device mesh (static counts in the compiled HLO).

Builds the tiny random pair of :mod:`sparkjax.distributed_demo` (3 target layers, 1 drafter layer, 8 heads,
8 KV heads), compiles one round (``spec_step``) of every speculative method on each mesh, and prints how
many all-reduce / all-gather / reduce-scatter / collective-permute / all-to-all ops it holds. Run with
virtual CPU devices::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python eval/mesh_collectives.py --meshes 2x4,1x8,8x1

The expected count is two all-reduces per layer of the target and of the drafter (attention output and MLP
down projection, tensor parallel over ``model``) and nothing else: no all-gather of weights, of the KV cache
or of the tree arrays (see :mod:`sparkjax.engine.placement`). A mesh without a model axis > 1 needs none.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--meshes", default="2x4,1x8,8x1", help="comma-separated DATAxMODEL meshes")
    p.add_argument("--methods", default="dflash,dspark,ddtree,sparklingtree,sparklingtree-beam")
    p.add_argument("--cache-sizes", default="0,512", help="0 = the default cache size; 512 takes the blocked "
                   "attention path on CPU (more than 128 slots)")
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(argv)

    import jax

    from sparkjax import engine
    from sparkjax.distributed_demo import parse_mesh, tiny_pair, tiny_prompts
    from sparkjax.engine.placement import COLLECTIVES, count_collectives, round_hlo
    from sparkjax.sharding import make_mesh

    target, drafter = tiny_pair(0)
    prompts = tiny_prompts(8)
    layers = target.config.num_hidden_layers + drafter.config.num_hidden_layers
    rows = []
    for mesh_text in args.meshes.split(","):
        data, model = parse_mesh(mesh_text)
        mesh = make_mesh(data, model)
        for method in args.methods.split(","):
            kw = {"budget": args.budget} if method in engine.TREE_METHODS else {}
            for cache in (int(c) for c in args.cache_sizes.split(",")):
                text = round_hlo(target, drafter, prompts, mesh=mesh, method=method, max_new_tokens=12,
                                 cache_size=cache or None, **kw)
                counts = count_collectives(text)
                rows.append({"mesh": mesh_text, "method": method, "cache_size": cache or "default", **counts,
                             "expected_all_reduce": 2 * layers if model > 1 else 0})
    if args.json:
        print(json.dumps({"devices": jax.device_count(), "layers": layers, "rows": rows}))
        return 0
    head = ["mesh", "method", "cache_size", *COLLECTIVES, "expected_all_reduce"]
    print(f"{jax.device_count()} devices; target + drafter layers = {layers}")
    print(" | ".join(head))
    for r in rows:
        print(" | ".join(str(r[h]) for h in head))
    return 0


if __name__ == "__main__":
    sys.exit(main())
