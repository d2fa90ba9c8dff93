"""Saving and restoring models and training states with orbax (the only module that imports orbax).

A saved model is a folder with ``sparkjax.json`` (kind, config, exact per-tensor checksums) and ``state/``
(the orbax checkpoint), written atomically (:mod:`sparkjax.io.atomic`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from ..config import Qwen3Config, read_json
from ..errors import ArgumentError, CheckpointError, WriteError
from ..nn.qwen3 import Qwen3
from .atomic import atomic_dir, check_destination
from .hf import resolve_dtype

PathLike = str | os.PathLike
_META = "sparkjax.json"


def save_model(model: nnx.Module, path: PathLike, *, overwrite: bool = False) -> str:
    """Saves a Qwen3 target with orbax, atomically, with per-tensor checksums in ``sparkjax.json``;
    ``overwrite`` and the errors are those of :func:`sparkjax.io.atomic.atomic_dir`."""
    if not isinstance(model, Qwen3):
        raise ArgumentError(f"save_model: model must be a Qwen3 target (sparkjax.nn.qwen3.Qwen3), "
                            f"got {type(model).__name__}; {path} was not written")
    check_destination(path, overwrite=overwrite)
    state = nnx.state(model, nnx.Param)
    meta = {"kind": "qwen3", "dtype": str(jnp.dtype(model.dtype)), "config": model.config.to_hf_dict(),
            "checksum_kind": _CHECKSUM_KIND, "checksums": _bits_and_finite(state)[0]}
    with atomic_dir(path, overwrite=overwrite) as tmp:
        with open(os.path.join(tmp, _META), "w") as f:
            json.dump(meta, f, indent=2)
        try:
            with ocp.StandardCheckpointer() as ckptr:
                ckptr.save(os.path.join(tmp, "state"), state)
                ckptr.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - orbax / tensorstore raise many types on I/O failures
            reason = str(e).splitlines()[0][:300] if str(e) else ""
            raise WriteError(f"{path}: orbax could not save ({type(e).__name__}: {reason})",
                             f"orbax: {type(e).__name__}: {reason}") from e
    return str(path)


def restore_model(path: PathLike, dtype: Any = None) -> nnx.Module:
    """Restores a model saved by :func:`save_model` (optionally cast to ``dtype``). Every tensor must match its
    stored checksum (when the folder has them) and be finite, else CheckpointError naming the folder and tensor."""
    folder = str(path)
    meta_path = os.path.join(folder, _META)
    meta = read_json(meta_path)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_path}: expected a JSON object")
    if meta.get("kind") != "qwen3":
        raise CheckpointError(f"{meta_path}: unknown model kind {meta.get('kind')!r}")
    cfg = Qwen3Config.from_hf_config(meta.get("config") or {}, source=meta_path)
    saved = resolve_dtype(meta.get("dtype"), None)
    abstract = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0), dtype=saved))
    graphdef, state = nnx.split(abstract)
    state_dir = os.path.join(folder, "state")
    if not os.path.isdir(state_dir):
        raise CheckpointError(f"{state_dir}: missing orbax state folder")
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore(state_dir, target)
    except Exception as e:  # orbax raises many types for damaged folders
        raise CheckpointError(f"{state_dir}: cannot restore orbax checkpoint ({type(e).__name__}: {e})") from None
    verify_state(restored, meta.get("checksums"), folder=folder, meta_path=meta_path,
                 kind=meta.get("checksum_kind"))
    model = nnx.merge(graphdef, restored)
    if dtype is not None:
        dt = resolve_dtype(dtype, None)
        nnx.update(model, jax.tree.map(lambda x: x.astype(dt), nnx.state(model, nnx.Param)))
    return model


_CHECKSUM_KIND = "bits-u32-v1"


@jax.jit
def _device_bits(leaves):
    """Per leaf: (sum of its bit patterns, position-weighted sum), both mod 2**32, and an all-finite flag."""
    out = []
    for x in leaves:
        if x.dtype == jnp.bool_:
            bits = x.astype(jnp.uint32)
        elif x.dtype.itemsize <= 4:
            uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
            bits = jax.lax.bitcast_convert_type(x, uint).astype(jnp.uint32)
        else:  # 64-bit leaves (x64 mode): fold the two halves
            halves = jax.lax.bitcast_convert_type(x, jnp.uint32)
            bits = halves[..., 0] ^ (halves[..., 1] * jnp.uint32(0x9E3779B1))
        flat = bits.reshape(-1)
        pos = jnp.arange(flat.shape[0], dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
        finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.bool_(True)
        out.append((jnp.sum(flat, dtype=jnp.uint32), jnp.sum(flat * pos, dtype=jnp.uint32), finite))
    return out


def _bits_and_finite(state) -> tuple[dict[str, list[int]], dict[str, bool]]:
    """Exact per-leaf checksums (two 32-bit sums of the bit patterns) and finiteness flags, computed on device."""
    named = _named_leaves(state)
    res = jax.device_get(_device_bits(list(named.values())))
    sums = {name: [int(a), int(b)] for name, (a, b, _) in zip(named, res, strict=True)}
    finite = {name: bool(f) for name, (_, _, f) in zip(named, res, strict=True)}
    return sums, finite


def verify_state(state, checksums, *, folder: str, meta_path: str | None = None, kind: str | None = None) -> None:
    """Checks a restored state against ``checksums`` (skipped when None) and that every floating tensor is
    finite; raises CheckpointError naming ``folder`` and the first bad tensor."""
    got, finite = _bits_and_finite(state)
    if checksums is not None:
        where = meta_path or folder
        if kind != _CHECKSUM_KIND:
            raise CheckpointError(f"{where}: unknown checksum kind {kind!r} (expected {_CHECKSUM_KIND!r})")
        if not isinstance(checksums, dict):
            raise CheckpointError(f"{where}: 'checksums' must be a JSON object")
        for name in sorted(set(got) | set(checksums)):
            shown = name.removesuffix(".value")
            if name not in checksums:
                raise CheckpointError(f"{folder}: tensor '{shown}' has no stored checksum in {where}")
            if name not in got:
                raise CheckpointError(f"{folder}: tensor '{shown}' listed in {where} was not restored")
            if list(checksums[name]) != got[name]:
                raise CheckpointError(f"{folder}: tensor '{shown}' does not match the checksum saved with it (saved "
                                      f"{checksums[name]}, read {got[name]}); the checkpoint is corrupted")
    for name, ok in finite.items():
        if not ok:
            raise CheckpointError(f"{folder}: tensor '{name.removesuffix('.value')}' holds NaN or Inf values")


def _leaf_name(path) -> str:
    """Dotted name of a pytree path, as orbax names array leaves (dict keys, indices, attributes)."""
    return ".".join(str(next((getattr(k, a) for a in ("key", "idx", "name") if hasattr(k, a)), k)) for k in path)


def _named_leaves(tree) -> dict[str, Any]:
    return {_leaf_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@jax.jit
def _device_checksums(leaves):
    out = []
    for x in leaves:
        if jnp.issubdtype(x.dtype, jnp.floating):
            x32 = x.astype(jnp.float32)
            out.append(jnp.stack([jnp.sum(x32), jnp.sum(jnp.abs(x32))]))
        else:  # integer leaves (step counters, RNG key data): exact
            xi = x.astype(jnp.uint32).view(jnp.int32) if x.dtype == jnp.uint32 else x.astype(jnp.int32)
            out.append(jnp.stack([jnp.sum(xi % 65521), jnp.sum((xi // 65521) % 65521)]).astype(jnp.float32))
    return out


def state_checksums(state) -> dict[str, list[float]]:
    """Per-leaf ``[sum, sum |x|]`` of a state pytree (computed on device), to detect silent corruption."""
    named = _named_leaves(state)
    sums = jax.device_get(_device_checksums(list(named.values())))
    return {name: [float(v) for v in s] for name, s in zip(named, sums, strict=True)}


class TrainCheckpointer:
    """Resumable training checkpoints with orbax's ``CheckpointManager``.

    Each step folder ``DIR/<step>`` holds ``state`` (the train-state pytree) and ``meta`` (JSON: config, data
    position, metrics, per-leaf checksums); a killed save leaves no step behind. Kept: the last ``keep_last``
    steps plus the ``keep_best`` best by ``metrics[best_metric]`` (``best_mode`` "max" or "min").
    :meth:`restore` moves a damaged step aside to ``DIR/corrupt-<step>-<n>`` and tries the previous one; tensors
    whose shapes do not fit the model raise CheckpointError. The first checkpointer installs a
    ``sys.unraisablehook`` filter that drops only the "Event loop is closed" reports of damaged reads.
    """

    def __init__(self, directory: PathLike, *, keep_last: int = 3, keep_best: int = 1, best_metric: str = "eval_tau",
                 best_mode: str = "max", async_save: bool = False, log=None):
        if keep_last < 1:
            raise CheckpointError(f"{directory}: keep_last must be >= 1, got {keep_last}")
        if best_mode not in ("max", "min"):
            raise CheckpointError(f"{directory}: best_mode must be 'max' or 'min', got {best_mode!r}")
        self.directory = os.path.abspath(str(directory))
        if not isinstance(sys.unraisablehook, _ClosedLoopFilter):
            sys.unraisablehook = _ClosedLoopFilter(sys.unraisablehook)
        self.best_metric = best_metric
        self.best_mode = best_mode
        self._log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        cm = ocp.checkpoint_managers
        policies = [cm.LatestN(n=keep_last)]
        if keep_best > 0:
            sign = 1.0 if best_mode == "max" else -1.0
            policies.append(cm.BestN(get_metric_fn=lambda m: sign * float(m[best_metric]), n=keep_best,
                                     keep_checkpoints_without_metrics=False))
        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=async_save, create=True,
                                               preservation_policy=cm.AnyPreservationPolicy(policies))
        handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        self._mngr = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def read_meta(self, step: int) -> dict[str, Any]:
        try:
            out = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001 - orbax raises many types for damaged folders
            msg = f"unreadable checkpoint metadata ({type(e).__name__}: {e})"
            raise CheckpointError(f"{self.step_dir(step)}: {msg}") from None
        meta = out["meta"]
        if not isinstance(meta, dict):
            raise CheckpointError(f"{self.step_dir(step)}/meta: expected a JSON object")
        return meta

    def best_step(self) -> int | None:
        """The kept step with the best ``metrics[best_metric]`` recorded in its meta (None if none has one)."""
        scored = []
        for step in self.steps():
            try:
                value = (self.read_meta(step).get("metrics") or {}).get(self.best_metric)
            except CheckpointError:
                continue
            if value is not None:
                scored.append((value if self.best_mode == "max" else -value, step))
        return max(scored, key=lambda vs: vs[0])[1] if scored else None

    def save(self, step: int, state, meta: dict[str, Any], metrics: dict[str, float] | None = None) -> str:
        """Saves ``state`` and ``meta`` (+ per-leaf checksums) as step ``step``; returns its folder."""
        meta = dict(meta)
        meta["step"] = int(step)
        meta["checksums"] = state_checksums(state)
        if metrics:
            meta["metrics"] = {k: float(v) for k, v in metrics.items()}
        keep_metrics = meta.get("metrics") if meta.get("metrics", {}).get(self.best_metric) is not None else None
        try:
            self._mngr.save(int(step), metrics=keep_metrics, force=True,
                            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{self.step_dir(step)}: cannot save checkpoint ({type(e).__name__}: {e})") from e
        return self.step_dir(step)

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()

    def _check_shapes(self, step: int, abstract) -> None:
        """Shape check from orbax's metadata; unreadable metadata is left to the restore to judge."""
        try:
            saved = self._mngr.item_metadata(step)["state"]
        except Exception:  # noqa: BLE001
            return
        if saved is None:
            return
        have = {m.name: m for _, m in jax.tree_util.tree_flatten_with_path(saved)[0]
                if getattr(m, "name", None) is not None}
        want = _named_leaves(abstract)
        where = f"{self.step_dir(step)}/state"
        other = "the checkpoint was written for a different model or optimizer (its tensors do not fit this config)"
        for name, x in sorted(want.items(), key=lambda kv: (not kv[0].startswith("params"), kv[0])):
            m = have.get(name)
            shown = name.removesuffix(".value")
            if m is None:
                raise CheckpointError(f"{where}: tensor '{shown}' is missing; {other}")
            if tuple(m.shape) != tuple(x.shape):
                raise CheckpointError(f"{where}: tensor '{shown}' has shape {list(m.shape)}, this config expects "
                                      f"{list(x.shape)} (the checkpoint's tensors do not fit this config)")
        extra = sorted(set(have) - set(want))
        if extra:
            raise CheckpointError(f"{where}: unexpected tensor '{extra[0].removesuffix('.value')}'; {other}")

    def _restore_one(self, step: int, abstract):
        self._check_shapes(step, abstract)
        try:
            out = self._mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                    meta=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001
            raise _Damaged(f"orbax cannot restore it ({type(e).__name__}: {str(e).splitlines()[0][:300]})") from None
        state, meta = out["state"], out["meta"]
        if not isinstance(meta, dict):
            raise _Damaged("meta is not a JSON object")
        want = meta.get("checksums")
        if not isinstance(want, dict):
            raise _Damaged("meta has no checksums")
        got = state_checksums(state)
        for name, ref in want.items():
            val = got.get(name)
            if val is None or not np.allclose(val, ref, rtol=1e-4, atol=1e-3):
                raise _Damaged(f"tensor '{name}' fails its checksum (saved {ref}, read {val})")
        return state, meta

    def _move_aside(self, step: int) -> str:
        src = self.step_dir(step)
        n = 0
        while os.path.exists(dst := os.path.join(self.directory, f"corrupt-{step}-{n}")):
            n += 1
        if os.path.exists(src):
            os.rename(src, dst)
        self._mngr.reload()
        return dst

    def restore(self, abstract_state, step: int | None = None):
        """Restores the newest usable step (or ``step``) into ``abstract_state``'s shapes / shardings:
        ``(step, state, meta)``; raises CheckpointError when no step is usable."""
        steps = self.steps()
        if step is not None:
            if step not in steps:
                raise CheckpointError(f"{self.directory}: no checkpoint for step {step} (have {steps})")
            steps = [s for s in steps if s <= step]
        if not steps:
            raise CheckpointError(f"{self.directory}: no checkpoint to resume from")
        tried = []
        for s in reversed(steps):
            if not _DAMAGED_FOLDERS:
                logging.getLogger("asyncio").addFilter(_drop_damaged_reads)
            _DAMAGED_FOLDERS.add(os.path.join(self.step_dir(s), ""))  # its damage is reported by the warning below
            try:
                state, meta = self._restore_one(s, abstract_state)
            except _Damaged as e:
                moved = self._move_aside(s)
                tried.append(f"step {s}: {e}")
                older = [x for x in steps if x < s]
                nxt = f"falling back to step {older[-1]}" if older else "no older checkpoint left"
                self._log(f"warning: checkpoint {self.step_dir(s)} is corrupted or incomplete ({e}); "
                          f"moved it to {moved}; {nxt}")
                continue
            return s, state, meta
        raise CheckpointError(f"{self.directory}: no usable checkpoint ({'; '.join(tried)})")


class _Damaged(Exception):
    """A step that cannot be read back as written (internal: triggers the fallback)."""


class _ClosedLoopFilter:
    """``sys.unraisablehook`` that drops the reports of a late tensorstore callback hitting a closed asyncio
    loop (``RuntimeError("Event loop is closed")`` from ``base_events._check_closed``, no object) and forwards
    the rest."""

    def __init__(self, previous):
        self.previous = previous
        self.dropped = 0

    def __call__(self, unraisable) -> None:
        exc = getattr(unraisable, "exc_value", None)
        tb, last = getattr(unraisable, "exc_traceback", None), None
        while tb is not None:
            last, tb = tb, tb.tb_next
        if (type(exc) is RuntimeError and str(exc) == "Event loop is closed"
                and getattr(unraisable, "object", None) is None and last is not None
                and last.tb_frame.f_code.co_name == "_check_closed"
                and os.path.basename(last.tb_frame.f_code.co_filename) == "base_events.py"):
            self.dropped += 1
            return
        self.previous(unraisable)


_DAMAGED_FOLDERS: set[str] = set()  # steps being restored: their failed reads' asyncio reports are dropped


def _drop_damaged_reads(record) -> bool:
    """The ``asyncio`` logger's filter: drops "Task / Future exception was never retrieved" reports whose exception
    names a folder of :data:`_DAMAGED_FOLDERS`; anything else passes."""
    msg = record.getMessage()
    if not msg.startswith(("Task exception was never retrieved", "Future exception was never retrieved")):
        return True
    text = f"{msg} {record.exc_info[1] if record.exc_info else None}"
    return not any(folder in text for folder in _DAMAGED_FOLDERS)
