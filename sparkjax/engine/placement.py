"""Placing a generation on a device mesh (axes ``("data", "model")``, or either alone; docs/design.md,
"Meshes"): checks, input placement and in-program sharding constraints, for the same jitted programs as on one
device. Weights follow :mod:`sparkjax.sharding`'s rules, KV caches go batch over ``data`` and KV heads over
``model``, everything else batch over ``data`` (scalars and keys replicated): a round's only collectives are
tensor parallelism's all-reduces. Several processes assemble inputs from the host values each holds.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ..cache import KV_AXES, ContextCache, KVCache
from ..errors import ArgumentError
from ..sharding import DEFAULT_RULES, logical_to_spec
from .checks import describe
from .drafting import DraftBlock

MESH_AXES = ("data", "model")  # the axis names a generation mesh may have (a subset, in any order)


def rules_for(mesh: Mesh) -> dict[str, str | None]:
    """:data:`~sparkjax.sharding.DEFAULT_RULES` restricted to the axes ``mesh`` has (a missing axis replicates)."""
    return {k: (v if v in mesh.axis_names else None) for k, v in DEFAULT_RULES.items()}


def axis_size(mesh: Mesh, name: str) -> int:
    return int(mesh.shape[name]) if name in mesh.axis_names else 1


def _divides(what: str, size: int, axis: int, label: str) -> None:
    if size % axis:
        raise ArgumentError(f"mesh: the {label} axis of size {axis} does not divide {what} ({size})")


def check_mesh(mesh: Any, target, drafter=None, batch: int | None = None) -> Mesh | None:
    """Validates a generation mesh (axis names among :data:`MESH_AXES`, Auto axis types; ``model`` divides
    the pair's heads, KV heads and FFN width, ``data`` the batch) and returns it (None stays None); each
    violation is an :class:`ArgumentError` naming the sizes."""
    if mesh is None:
        return None
    if not isinstance(mesh, Mesh):
        raise ArgumentError(f"mesh: expected a jax.sharding.Mesh with axes {MESH_AXES} (or None), got "
                            f"{describe(mesh)}")
    names = tuple(mesh.axis_names)
    unknown = [n for n in names if n not in MESH_AXES]
    if unknown or len(set(names)) != len(names):
        raise ArgumentError(f"mesh: axis names {names} (shape {dict(mesh.shape)}) are not among {MESH_AXES}: "
                            f"unknown {tuple(unknown)}; build the mesh with sparkjax.sharding.make_mesh(data, model)")
    explicit = [n for n, t in zip(names, mesh.axis_types, strict=True) if t != AxisType.Auto]
    if explicit:
        raise ArgumentError(f"mesh: axes {tuple(explicit)} are not AxisType.Auto (sparkjax.sharding.make_mesh "
                            "builds Auto axes; Explicit axes are not supported)")
    m = axis_size(mesh, "model")
    for role, model in (("target", target), ("drafter", drafter)):
        if model is None or m == 1:
            continue
        c = model.config
        _divides(f"the {role}'s num_attention_heads", c.num_attention_heads, m, "model")
        _divides(f"the {role}'s num_key_value_heads", c.num_key_value_heads, m, "model")
        _divides(f"the {role}'s intermediate_size", c.intermediate_size, m, "model")
    if batch is not None:
        d = axis_size(mesh, "data")
        if batch % d:
            raise ArgumentError(f"prompt_ids: a batch of {batch} sequence(s) does not divide over the mesh's data "
                                f"axis of size {d} (pad the batch to a multiple of {d})")
    return mesh


# ----------------------------------------------------------------------------- placement (host -> mesh)


def put(x: Any, sharding: NamedSharding) -> jax.Array:
    """``x`` on ``sharding``. One process: :func:`jax.device_put`. Several: the global array assembled from
    the host value each process holds (the same on every process), with no cross-process transfer."""
    if jax.process_count() == 1 or sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(x)
        data = put(jax.random.key_data(x), sharding)
        return jax.random.wrap_key_data(data, impl=impl)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def batch_spec(x: Any, rules: Mapping[str, str | None]) -> PartitionSpec:
    """Batch-first arrays: batch over the data axis; scalars and PRNG keys replicated."""
    if getattr(x, "ndim", 0) == 0:
        return PartitionSpec()
    return PartitionSpec(rules.get("batch"), *([None] * (x.ndim - 1)))


def state_shardings(tree: Any, mesh: Mesh) -> Any:
    """NamedShardings for a pytree of a generation's arrays: KV caches and the drafter context by
    :data:`~sparkjax.cache.KV_AXES`, a drafter block's per-layer outputs ``[L, B, ...]`` over the batch, every
    other array batch-first over ``data`` and replicated over ``model``."""
    rules = rules_for(mesh)

    def named(spec: PartitionSpec) -> NamedSharding:
        return NamedSharding(mesh, spec)

    def leaf(x):
        if isinstance(x, KVCache | ContextCache):  # both: a heads-major buffer per layer
            kv = named(logical_to_spec(KV_AXES, rules))
            return type(x)((kv,) * len(x.k), (kv,) * len(x.v), named(batch_spec(x.lengths, rules)))
        if isinstance(x, DraftBlock):
            layers = None if x.layers is None else named(PartitionSpec(None, rules.get("batch")))
            ctx = None if x.ctx is None else leaf(x.ctx)
            return type(x)(named(batch_spec(x.logits, rules)), named(batch_spec(x.hidden, rules)), layers, ctx)
        return named(batch_spec(x, rules))

    return jax.tree.map(leaf, tree, is_leaf=lambda x: isinstance(x, KVCache | ContextCache | DraftBlock))


def constrain(tree: Any, mesh: Mesh | None) -> Any:
    """Inside a jitted program: pins ``tree`` to :func:`state_shardings` (no-op without a mesh)."""
    if mesh is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, state_shardings(tree, mesh))


def place_args(args: Any, mesh: Mesh | None) -> Any:
    """A run's :class:`~sparkjax.engine.state.DeviceArgs` on the mesh (prompts over ``data``, scalars,
    EOS ids and the key replicated)."""
    if mesh is None:
        return args
    rules = rules_for(mesh)
    fields = []
    for name, x in zip(args._fields, args, strict=True):
        spec = batch_spec(x, rules) if name in ("tokens", "lengths") else PartitionSpec()
        # (the temperature field holds a sampling.Sampling: each of its leaves replicated)
        fields.append(jax.tree.map(lambda leaf, spec=spec: put(leaf, NamedSharding(mesh, spec)), x))
    return type(args)(*fields)


def model_shardings(state: Any, mesh: Mesh) -> Any:
    """NamedShardings for an ``nnx.split`` state: each Variable by its ``axes`` metadata under
    :func:`rules_for` ``(mesh)``, replicated when it has none."""
    rules = rules_for(mesh)

    def spec(v):
        axes = v.get_metadata().get("axes") if isinstance(v, nnx.Variable) else None
        if axes is None:
            return NamedSharding(mesh, PartitionSpec())
        return NamedSharding(mesh, logical_to_spec(tuple(axes), rules))

    return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def place_state(state: Any, mesh: Mesh | None) -> Any:
    """An ``nnx.split`` model state on the mesh (a new state: the module is not modified). Arrays already
    on their sharding are reused as they are, so a model placed once (``sharding.shard_model``) costs nothing."""
    if mesh is None:
        return state
    shardings = model_shardings(state, mesh)

    def move(sharding, variable):
        return jax.tree.map(lambda x: x if isinstance(x, jax.Array) and x.sharding == sharding else put(x, sharding),
                            variable)

    return jax.tree.map(move, shardings, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def place_model(model, mesh: Mesh | None):
    """Places ``model``'s weights on ``mesh`` in place (:func:`place_state`; returns the model), so that later
    generations on that mesh reuse them instead of placing them per call. Multi-process safe."""
    if mesh is not None:
        nnx.update(model, place_state(nnx.state(model), mesh))
    return model


# ----------------------------------------------------------------------------- mesh -> host


def to_host(x: Any) -> np.ndarray:
    """A device array as a numpy array on this process: a global array that spans other processes is
    gathered first (every process gets the whole value)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def per_sequence(fn, mesh: Mesh, module, *args):
    """``fn(module, *args)`` run on each data shard's own sequences (``jax.shard_map`` with
    :func:`state_shardings`; ``fn`` may only use ``module``'s replicated weights): for deterministic
    per-sequence stages that XLA would otherwise all-gather over the batch (the tree builder's ``top_k``)."""
    graphdef, weights = nnx.split(module)

    def local(weights, *a):
        return fn(nnx.merge(graphdef, weights), *a)

    w_specs = _specs(model_shardings(weights, mesh))
    in_specs = (w_specs, *(_specs(state_shardings(a, mesh)) for a in args))
    out_specs = _specs(state_shardings(jax.eval_shape(local, weights, *args), mesh))
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(weights, *args)


def _specs(shardings: Any) -> Any:
    return jax.tree.map(lambda s: s.spec, shardings)


# ----------------------------------------------------------------------------- inspection

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def collective_ops(hlo_text: str) -> list[tuple[str, str]]:
    """``(kind, result type)`` of every collective op (:data:`COLLECTIVES`, async ``-start`` forms included)
    in a compiled module's text, e.g. ``("all-reduce", "f32[4,9,64]{2,1,0}")``, each static occurrence once."""
    pattern = re.compile(r"= (.*?) (" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
    ops = []
    for line in hlo_text.splitlines():
        m = pattern.search(line)
        if m:
            ops.append((m.group(2), m.group(1)))
    return ops

