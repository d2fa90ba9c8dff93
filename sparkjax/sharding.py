"""Mesh helpers and logical-axis rules.

Parameters carry logical axis names in their ``axes`` metadata. :data:`DEFAULT_RULES` maps them onto a 2-D mesh
``("data", "model")``: tensor parallelism over attention heads and the FFN dimension, data parallelism over the
batch; XLA's sharding propagation does the rest.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from .errors import ArgumentError

DEFAULT_RULES: Mapping[str, str | None] = {
    "batch": "data", "heads": "model", "kv_heads": "model", "ffn": "model", "vocab": None, "embed": None,
}


def make_mesh(data: int = 1, model: int = 1, devices=None) -> Mesh:
    """A ``(data, model)`` mesh with Auto axis types (explicit axes break embedding lookups in jax 0.10)."""
    devices = list(jax.devices() if devices is None else devices)
    if data < 1 or model < 1 or data * model > len(devices):
        raise ArgumentError(f"make_mesh: data={data} x model={model} does not fit {len(devices)} devices")
    grid = np.array(devices[: data * model]).reshape(data, model)
    return Mesh(grid, ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


def logical_to_spec(axes: tuple[str | None, ...], rules: Mapping[str, str | None] = DEFAULT_RULES) -> PartitionSpec:
    return PartitionSpec(*(rules.get(a) if a is not None else None for a in axes))


def param_shardings(model: nnx.Module, mesh: Mesh, rules: Mapping[str, str | None] = DEFAULT_RULES):
    """A pytree (matching ``nnx.state(model, nnx.Param)``) of NamedShardings from each Param's ``axes``."""
    state = nnx.state(model, nnx.Param)

    def spec(v):
        axes = v.get_metadata().get("axes")
        if axes is None:
            return NamedSharding(mesh, PartitionSpec())
        return NamedSharding(mesh, logical_to_spec(tuple(axes), rules))

    return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh, rules: Mapping[str, str | None] = DEFAULT_RULES) -> nnx.Module:
    """Places ``model``'s parameters on ``mesh`` according to ``rules`` (in place; returns the model)."""
    nnx.update(model, jax.device_put(nnx.state(model, nnx.Param), param_shardings(model, mesh, rules)))
    return model


def batch_sharding(mesh: Mesh, ndim: int, rules: Mapping[str, str | None] = DEFAULT_RULES) -> NamedSharding:
    """Sharding for a batch-first array of ``ndim`` dimensions."""
    return NamedSharding(mesh, PartitionSpec(rules.get("batch"), *([None] * (ndim - 1))))
