"""Optimizer and learning-rate schedule (optax), validated up front.

The default is upstream DeepSpec's: AdamW (betas 0.9 / 0.999, eps 1e-8, no weight decay) with a
linear warmup ``lr * (step + 1) / warmup`` followed by a cosine decay to ``min_lr_ratio * lr``
(torch ``CosineAnnealingLR`` after a warmup), and global-norm gradient clipping at 1.0.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import optax

from .errors import TrainingError

SCHEDULES = ("cosine", "linear", "constant")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 6e-4
    steps: int = 600
    warmup_steps: int = 0
    schedule: str = "cosine"
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_clip: float | None = 1.0

    def __post_init__(self):
        def bad(field, value, why):
            raise TrainingError(f"{field}: {why}, got {value!r}")

        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            bad("steps", self.steps, "must be a positive integer")
        if not _finite(self.lr) or self.lr <= 0 or self.lr > 1.0:
            bad("lr", self.lr, "must be a finite learning rate in (0, 1]")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            bad("warmup_steps", self.warmup_steps, "must be an integer >= 0")
        if self.warmup_steps and self.warmup_steps >= self.steps:
            bad("warmup_steps", self.warmup_steps, f"must be smaller than steps ({self.steps})")
        if self.schedule not in SCHEDULES:
            bad("schedule", self.schedule, f"must be one of {', '.join(SCHEDULES)}")
        if not _finite(self.min_lr_ratio) or not 0.0 <= self.min_lr_ratio <= 1.0:
            bad("min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        if not _finite(self.weight_decay) or self.weight_decay < 0:
            bad("weight_decay", self.weight_decay, "must be >= 0")
        for name in ("b1", "b2"):
            v = getattr(self, name)
            if not _finite(v) or not 0.0 <= v < 1.0:
                bad(name, v, "must be in [0, 1)")
        if not _finite(self.eps) or self.eps <= 0:
            bad("eps", self.eps, "must be > 0")
        if self.grad_clip is not None and (not _finite(self.grad_clip) or self.grad_clip <= 0):
            bad("grad_clip", self.grad_clip, "must be > 0 (or null for no clipping)")


def _finite(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


HYPER = ("lr", "warmup_steps", "steps", "min_lr_ratio", "weight_decay", "b1", "b2", "eps", "grad_clip")


def hyperparams(cfg: OptimConfig) -> np.ndarray:
    """The numeric settings as a float32 vector (``HYPER`` order): passed to the jitted step as data,
    so a new learning rate, step count or warmup does not recompile it."""
    values = [getattr(cfg, k) for k in HYPER]
    values[-1] = 0.0 if cfg.grad_clip is None else cfg.grad_clip
    return np.asarray(values, np.float32)


@dataclasses.dataclass(frozen=True)
class OptimKind:
    """What shapes the optimizer's program and state: the schedule family and whether to clip."""

    schedule: str = "cosine"
    clip: bool = True


def optim_kind(cfg: OptimConfig) -> OptimKind:
    return OptimKind(cfg.schedule, cfg.grad_clip is not None)


def schedule_fn(kind: OptimKind, hp):
    """The schedule of :func:`make_schedule` for an :class:`OptimKind` and a (traced) ``hp`` vector."""
    h = dict(zip(HYPER, (hp[i] for i in range(len(HYPER))), strict=True))
    peak, w, total = h["lr"], h["warmup_steps"], h["steps"]
    floor = peak * h["min_lr_ratio"]
    span = jnp.maximum(total - w, 1.0)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        t = jnp.clip((step - w) / span, 0.0, 1.0)
        if kind.schedule == "cosine":
            decay = floor + (peak - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * t))
        elif kind.schedule == "linear":
            decay = peak + (floor - peak) * t
        else:
            decay = jnp.zeros_like(t) + peak
        return jnp.where(step < w, peak * (step + 1.0) / jnp.maximum(w, 1.0), decay)

    return schedule


def make_schedule(cfg: OptimConfig, hp=None):
    """``step -> lr`` (jit-able). Warmup ``lr * (step + 1) / W`` for ``step < W``, then the decay over
    the remaining ``steps - W`` steps (cosine / linear to ``min_lr_ratio * lr``, or constant).
    ``hp`` (see :func:`hyperparams`) may be traced; it defaults to ``cfg``'s values."""
    return schedule_fn(optim_kind(cfg), jnp.asarray(hyperparams(cfg) if hp is None else hp))


def make_optimizer(cfg: OptimConfig | OptimKind, hp=None) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with :func:`make_schedule`. With an :class:`OptimKind` and a
    (traced) ``hp`` vector the numbers are data: the same program serves every lr / steps / warmup."""
    if isinstance(cfg, OptimConfig):
        kind, hp = optim_kind(cfg), hyperparams(cfg) if hp is None else hp
    else:
        kind = cfg
        if hp is None:
            raise TrainingError("make_optimizer: an OptimKind needs the hyperparameter vector hp")
    hp = jnp.asarray(hp, jnp.float32)
    h = dict(zip(HYPER, (hp[i] for i in range(len(HYPER))), strict=True))
    adamw = optax.adamw(schedule_fn(kind, hp), b1=h["b1"], b2=h["b2"], eps=h["eps"], weight_decay=h["weight_decay"])
    if not kind.clip:
        return adamw
    return optax.chain(optax.clip_by_global_norm(h["grad_clip"]), adamw)
