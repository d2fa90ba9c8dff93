"""The jitted train / eval steps over ``nnx.split`` state, and :class:`Trainer` that owns the state.

The state (what the orbax checkpoint holds) is ``{"params"`` (trainable drafter Params, float32 master copies),
``"opt_state"`` (their optax state), ``"step"`` (int32), ``"rng"`` (uint32[2] key data of the next anchors)``}``.
Frozen parameters (by default ``embed_tokens`` and ``lm_head``) and the target are separate arguments, never
differentiated, updated or checkpointed; parameters are cast to the compute dtype inside the step. With a mesh
the batch is sharded over ``data`` and the loss is the global ``sum(term * w) / sum(w)``, so one device and many
give the same loss and gradients.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..errors import ArgumentError
from ..sharding import batch_sharding
from .anchors import sample_anchors
from .forward import batch_loss, check_pair
from .loss import LossSums, Objective
from .optim import OptimConfig, is_int, make_optimizer, make_schedule

Array = jax.Array

DEFAULT_FREEZE = ("embed_tokens", "lm_head")


def trainable_filter(freeze: Sequence[str] = DEFAULT_FREEZE):
    """Params whose path contains none of the ``freeze`` names."""
    if not freeze:
        return nnx.Param
    return nnx.All(nnx.Param, nnx.Not(nnx.Any(*(nnx.PathContains(n) for n in freeze))))


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Everything static about a step (hashable: it is the jit cache key)."""

    graphdef: Any
    target_graphdef: Any
    objective: Objective
    optim: OptimConfig  # its settings are constants of the compiled step
    num_anchors: int
    compute_dtype: str
    mesh: Mesh | None = None


def _cast(tree, dtype):
    dt = jnp.dtype(dtype)
    return jax.tree.map(lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _batch_loss(spec: StepSpec, params, frozen, target_state, batch, key):
    drafter = nnx.merge(spec.graphdef, _cast(params, spec.compute_dtype), _cast(frozen, spec.compute_dtype))
    target = None if spec.target_graphdef is None else nnx.merge(spec.target_graphdef, target_state)
    anchors, keep = sample_anchors(key, batch["loss_mask"], spec.num_anchors)
    total, sums, _, _ = batch_loss(drafter, target, batch["input_ids"], batch["loss_mask"], anchors, keep,
                                   spec.objective, features=batch.get("features"), last_hidden=batch.get("last_hidden"))
    return total, sums


def _replicate(spec: StepSpec, tree):
    if spec.mesh is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, NamedSharding(spec.mesh, PartitionSpec()))


def _loss_and_grads(params, frozen, target_state, batch, key, spec: StepSpec):
    """``(loss, sums, grads)`` of one batch with anchors from ``key`` (jitted: :func:`loss_and_grads`)."""
    (loss, sums), grads = jax.value_and_grad(functools.partial(_batch_loss, spec), has_aux=True)(
        params, frozen, target_state, batch, key)
    return loss, sums, grads


loss_and_grads = jax.jit(_loss_and_grads, static_argnames=("spec",))


def train_step_fn(state, frozen, target_state, batch, spec: StepSpec):
    """One optimizer step (pure). Returns ``(new_state, sums, {"grad_norm", "lr"})``."""
    rng, key = jax.random.split(jax.random.wrap_key_data(state["rng"]))
    _, sums, grads = _loss_and_grads(state["params"], frozen, target_state, batch, key, spec)
    tx = make_optimizer(spec.optim)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    new_state = {"params": params, "opt_state": opt_state, "step": state["step"] + 1,
                 "rng": jax.random.key_data(rng)}
    info = {"grad_norm": optax.tree.norm(grads), "lr": make_schedule(spec.optim)(state["step"])}
    return _replicate(spec, new_state), _replicate(spec, sums), info


train_step = jax.jit(train_step_fn, static_argnames=("spec",), donate_argnames=("state",))


@functools.partial(jax.jit, static_argnames=("spec",))
def eval_step(params, frozen, target_state, batch, key, spec: StepSpec) -> LossSums:
    """Loss sums of one batch with anchors from ``key`` (no gradient)."""
    return _batch_loss(spec, params, frozen, target_state, batch, key)[1]


def to_host(tree) -> Any:
    """Device arrays -> NumPy (python floats for scalars)."""
    return jax.tree.map(lambda x: x.item() if np.ndim(x) == 0 else np.asarray(x), jax.device_get(tree))


class Trainer:
    """Owns the train state of a DSpark drafter (trainable float32 master params; ``freeze`` names the frozen
    ones) and runs jitted steps on it. ``target`` computes the features on the fly, or is None when every batch
    carries ``features`` and ``last_hidden``; ``mesh``: data parallel over its ``data`` axis."""

    def __init__(self, drafter, target=None, *, optim: OptimConfig, objective: Objective | None = None,
                 num_anchors: int = 32, seed: int = 0, compute_dtype: Any = None,
                 freeze: Sequence[str] = DEFAULT_FREEZE, mesh: Mesh | None = None):
        check_pair(drafter, target)
        if not is_int(num_anchors) or num_anchors < 1:
            raise ArgumentError(f"num_anchors: must be a positive integer, got {num_anchors!r}")
        self.drafter_dtype = jnp.dtype(drafter.dtype)
        self.has_confidence = drafter.confidence_head is not None
        compute = jnp.dtype(compute_dtype if compute_dtype is not None else self.drafter_dtype)
        graphdef, params, frozen = nnx.split(drafter, trainable_filter(freeze), ...)
        if not jax.tree.leaves(params):
            raise ArgumentError(f"freeze: {list(freeze)} leaves no trainable parameter")
        target_graphdef, target_state = (None, None) if target is None else nnx.split(target)
        self.mesh, self.optim = mesh, optim
        self.spec = StepSpec(graphdef, target_graphdef, objective or Objective(), optim, num_anchors, compute.name,
                             mesh)
        # float32 master copies, never aliasing the module's arrays (the step donates its state)
        params = jax.tree.map(lambda x: jnp.array(x, dtype=jnp.float32, copy=True), params)
        self.state = self._place({"params": params, "opt_state": make_optimizer(optim).init(params),
                                  "step": jnp.zeros((), jnp.int32), "rng": jax.random.key_data(jax.random.key(seed))})
        self.frozen = self._place(frozen)
        self.target_state = self._place(target_state)

    @property
    def data_parallel(self) -> int:
        return 1 if self.mesh is None else int(self.mesh.shape["data"])

    def _place(self, tree):
        if tree is None:
            return None
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, tree)
        return jax.device_put(tree, NamedSharding(self.mesh, PartitionSpec()))

    def abstract_state(self):
        """The state's ``jax.ShapeDtypeStruct`` tree with its shardings (replicated on the mesh), to restore into."""
        rep = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep or x.sharding), self.state)

    def put_batch(self, batch: dict[str, Any]) -> dict[str, Array]:
        """Moves a host batch to the devices, sharded over the mesh's data axis."""
        out = {}
        for name, x in batch.items():
            x = np.asarray(x, {"input_ids": np.int32, "loss_mask": np.float32}.get(name))
            if self.mesh is None:
                out[name] = jnp.asarray(x)
            elif x.shape[0] % self.data_parallel:
                raise ArgumentError(f"batch: {name} has {x.shape[0]} rows, not divisible by the "
                                    f"{self.data_parallel} data-parallel devices")
            else:
                out[name] = jax.device_put(x, batch_sharding(self.mesh, x.ndim))
        return out

    @property
    def step_count(self) -> int:
        return int(jax.device_get(self.state["step"]))

    def step(self, batch: dict[str, Any]) -> tuple[LossSums, dict[str, Array]]:
        """One optimizer step on a host or device batch; returns device-side ``(sums, info)``."""
        self.state, sums, info = train_step(self.state, self.frozen, self.target_state, self.put_batch(batch),
                                            spec=self.spec)
        return sums, info

    def loss_and_grads(self, batch: dict[str, Any], key: Array):
        return loss_and_grads(self.state["params"], self.frozen, self.target_state, self.put_batch(batch), key,
                              spec=self.spec)

    def evaluate(self, batches: Iterable[dict[str, Any]], seed: int = 0) -> dict[str, Any]:
        """Metrics summed over ``batches`` (anchors from a fixed key per batch index, so every
        evaluation of the same data uses the same anchors)."""
        total = None
        base = jax.random.key(seed)
        for i, batch in enumerate(batches):
            sums = eval_step(self.state["params"], self.frozen, self.target_state, self.put_batch(batch),
                             jax.random.fold_in(base, i), spec=self.spec)
            total = sums if total is None else total + sums
        if total is None:
            raise ArgumentError("evaluate: no batches")
        return to_host(total.metrics(self.spec.objective, self.has_confidence))

    def drafter(self, dtype: Any = None):
        """A fresh Drafter module with the current weights, in ``dtype`` (default: the input drafter's)."""
        dt = jnp.dtype(dtype) if dtype is not None else self.drafter_dtype

        def copy(tree):  # new arrays: later steps donate (delete) the state's buffers
            return jax.tree.map(
                lambda x: jnp.array(x, dtype=dt if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype, copy=True),
                tree)

        return nnx.merge(self.spec.graphdef, copy(self.state["params"]), copy(self.frozen))

    def set_state(self, state) -> None:
        self.state = self._place(state)
