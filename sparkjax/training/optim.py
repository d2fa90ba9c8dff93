"""The optimizer settings (:class:`OptimConfig`) and their optax transformation, validated up front.

:class:`OptimConfig` is held by :class:`~sparkjax.training.config.TrainConfig` and
:class:`~sparkjax.training.lm.LMConfig` (read from the flat keys of their recipes with :func:`compose`). The
default is upstream DeepSpec's: AdamW (betas 0.9 / 0.999, eps 1e-8, no weight decay), a linear warmup
``lr * (step + 1) / warmup`` then a cosine decay to ``min_lr_ratio * lr``, and global-norm clipping at 1.0.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import optax

from ..errors import TrainingError

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
            raise TrainingError(f"key '{field}' {why}, got {value!r}")

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


OPTIM_KEYS = tuple(f.name for f in dataclasses.fields(OptimConfig))


def _finite(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def compose(values: dict[str, Any], base: OptimConfig, keys=OPTIM_KEYS, source: str = "config") -> OptimConfig:
    """``base`` with the settings of ``values`` whose names are in ``keys`` (popped from ``values``):
    how a run config builds its :class:`OptimConfig` from the flat keys of its recipe. A bad value
    raises :class:`TrainingError` naming ``source`` and the key."""
    picked = {k: values.pop(k) for k in keys if k in values}
    try:
        return dataclasses.replace(base, **picked)
    except TrainingError as e:
        raise TrainingError(f"{source}: {e}") from None


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
    """``step -> lr``. Warmup ``lr * (step + 1) / W`` for ``step < W`` (upstream's), then the decay
    over the remaining ``steps - W`` steps: cosine / linear to ``min_lr_ratio * lr``, or constant."""
    peak, w = float(cfg.lr), int(cfg.warmup_steps)
    floor = peak * cfg.min_lr_ratio
    span = max(cfg.steps - w, 1)
    if cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, span, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        decay = optax.linear_schedule(peak, floor, span)
    else:
        decay = optax.constant_schedule(peak)
    if w == 0:
        return decay
    # step 0 -> lr / W, ..., step W - 1 -> lr (a linear ramp over W - 1 transitions), then the decay
    warmup = optax.linear_schedule(peak / w, peak, w - 1) if w > 1 else optax.constant_schedule(peak)
    return optax.join_schedules([warmup, decay], [w])


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """Global-norm clipping (unless ``grad_clip`` is None), then AdamW with :func:`make_schedule`."""
    adamw = optax.adamw(make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.grad_clip is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
