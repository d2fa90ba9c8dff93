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
        w, num = self.warmup_steps, is_number
        rules = [
            ("steps", is_int(self.steps) and self.steps >= 1, "must be a positive integer"),
            ("lr", num(self.lr) and 0 < self.lr <= 1.0, "must be a finite learning rate in (0, 1]"),
            ("warmup_steps", is_int(w) and w >= 0, "must be an integer >= 0"),
            ("warmup_steps", not (is_int(w) and is_int(self.steps) and 0 < self.steps <= w),
             f"must be smaller than steps ({self.steps})"),
            ("schedule", self.schedule in SCHEDULES, f"must be one of {', '.join(SCHEDULES)}"),
            ("min_lr_ratio", num(self.min_lr_ratio) and 0.0 <= self.min_lr_ratio <= 1.0, "must be in [0, 1]"),
            ("weight_decay", num(self.weight_decay) and self.weight_decay >= 0, "must be >= 0"),
            ("b1", num(self.b1) and 0.0 <= self.b1 < 1.0, "must be in [0, 1)"),
            ("b2", num(self.b2) and 0.0 <= self.b2 < 1.0, "must be in [0, 1)"),
            ("eps", num(self.eps) and self.eps > 0, "must be > 0"),
            ("grad_clip", self.grad_clip is None or (num(self.grad_clip) and self.grad_clip > 0),
             "must be > 0 (or null for no clipping)"),
        ]
        for key, ok, why in rules:
            if not ok:
                raise TrainingError(f"key '{key}' {why}, got {getattr(self, key)!r}")


OPTIM_KEYS = tuple(f.name for f in dataclasses.fields(OptimConfig))


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    """A finite int or float (not a bool)."""
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
