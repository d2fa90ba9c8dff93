"""The training run config (:class:`TrainConfig`): a frozen dataclass read from a JSON recipe, every key validated
up front (errors name the recipe file and the key). Keys that only change how a run is observed (``OPERATIONAL``)
may differ when resuming; any other difference refuses to resume unless forced (:func:`.fit.check_config`)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ..config import read_json
from ..errors import TrainingError
from .loss import Objective
from .optim import OPTIM_KEYS, OptimConfig, compose, is_int, is_number

PATH_KEYS = ("target", "init_drafter", "tokenizer", "data", "eval_data")
OPERATIONAL = frozenset({
    "name", "description", "log_every", "eval_every", "eval_batches", "checkpoint_every", "keep_last", "keep_best",
    "async_checkpoint", "export_dtype", "data_parallel", "tensorboard",
})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run. See ``docs/training.md`` for every key; the defaults are upstream's."""

    name: str = "run"
    description: str = ""
    # models
    target: str | None = None  # Hugging Face Qwen3 folder
    init_drafter: str | None = None  # DeepSpec DSpark folder to continue from (None: a new drafter)
    drafter: dict = dataclasses.field(default_factory=dict)  # config overrides / new-drafter settings
    dtype: str | None = None  # weights of target and drafter (default: the checkpoints')
    compute_dtype: str | None = None  # default: the drafter's dtype; master weights are float32
    freeze: tuple[str, ...] = ("embed_tokens", "lm_head")
    # data
    data: str | None = None  # JSONL: chat conversations and/or token ids
    eval_data: str | None = None
    eval_size: int = 0  # held-out rows taken from `data` (or generated) when eval_data is None
    synthetic: dict | None = None  # {"num_sequences", "prompt_len", "seed", "vocab_high"}: target-greedy data
    tokenizer: str | None = None  # default: the target folder (for chat data)
    assistant_header: str | None = None
    end_of_turn: str | None = None
    seq_len: int = 768
    packing: str = "pad"
    precompute_features: bool = False
    # objective
    num_anchors: int = 32
    loss_decay_gamma: float | None = 4.0
    ce_loss_alpha: float = 0.1
    l1_loss_alpha: float = 0.9
    confidence_alpha: float = 1.0
    tree_loss_alpha: float = 0.0  # sparkjax's tree-aware term (0: upstream's objective); see loss.py
    tree_top_c: int = 0  # candidates per depth of the tree term / metrics (0: off)
    tree_temperature: float = 1.0
    # optimisation: the recipe's flat optimizer keys (lr, steps, schedule, ... see OptimConfig) make
    # `optim`; `warmup_steps` stays the recipe's value (None: warmup_ratio * steps)
    batch_size: int = 4
    optim: OptimConfig = OptimConfig()
    warmup_steps: int | None = None
    warmup_ratio: float = 0.04
    seed: int = 0
    data_seed: int = 0
    # loop
    data_parallel: int | None = None  # devices on the data axis (default: all)
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int | None = None
    checkpoint_every: int = 100
    keep_last: int = 3
    keep_best: int = 1
    async_checkpoint: bool = False
    export_dtype: str | None = None
    tensorboard: bool = True

    @property
    def objective(self) -> Objective:
        return Objective(self.loss_decay_gamma, self.ce_loss_alpha, self.l1_loss_alpha, self.confidence_alpha,
                         self.tree_loss_alpha, self.tree_top_c, self.tree_temperature)

    def __getattr__(self, name: str):  # the optimizer's settings read as the recipe's keys: cfg.lr, cfg.steps
        if name in OPTIM_KEYS:
            return getattr(self.optim, name)
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    def to_dict(self) -> dict[str, Any]:
        """The flat recipe keys (what :meth:`from_dict` reads back)."""
        d = dataclasses.asdict(self)
        optim = d.pop("optim")
        optim.pop("warmup_steps")  # the recipe's own value (maybe None) is kept, not the resolved one
        d.update(optim)
        d["freeze"] = list(self.freeze)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "<config>", base_dir: str | None = None) -> TrainConfig:
        """Builds and validates a config; relative paths resolve against ``base_dir`` (if given)."""
        if not isinstance(data, dict):
            raise TrainingError(f"{source}: expected a JSON object, got {type(data).__name__}")
        names = ({f.name for f in dataclasses.fields(cls)} - {"optim"}) | set(OPTIM_KEYS)
        unknown = sorted(set(data) - names)
        if unknown:
            raise TrainingError(f"{source}: unknown key '{unknown[0]}' (known keys: {', '.join(sorted(names))})")
        values = dict(data)
        if base_dir is not None:
            for key in PATH_KEYS:
                v = values.get(key)
                if isinstance(v, str) and v and not os.path.isabs(v):
                    values[key] = os.path.normpath(os.path.join(base_dir, v))
        if isinstance(values.get("freeze"), list):
            values["freeze"] = tuple(values["freeze"])
        warm, ratio, steps = values.get("warmup_steps"), values.get("warmup_ratio", 0.04), values.get("steps", 600)
        if not (is_number(ratio) and 0 <= ratio < 1):
            raise TrainingError(f"{source}: key 'warmup_ratio' must be in [0, 1), got {ratio!r}")
        if warm is not None and not (is_int(warm) and warm >= 0):
            raise TrainingError(f"{source}: key 'warmup_steps' must be a positive integer or null, got {warm!r}")
        settings = {k: v for k, v in values.items() if k in OPTIM_KEYS}
        if warm is None:  # upstream's warmup_ratio of the run's steps (steps itself is checked by OptimConfig)
            settings["warmup_steps"] = int(ratio * steps) if is_int(steps) else 0
        optim = compose(settings, OptimConfig(), source=source)
        rest = {k: v for k, v in values.items() if k not in OPTIM_KEYS or k == "warmup_steps"}
        cfg = cls(**rest, optim=optim)
        cfg.validate(source)
        return cfg

    @classmethod
    def from_file(cls, path: str, overrides: dict[str, Any] | None = None) -> TrainConfig:
        """Reads a JSON recipe (paths relative to the recipe's folder) and applies ``overrides``
        (``--set`` values; their relative paths resolve against the working directory)."""
        data = read_json(path, TrainingError, "recipe")
        for key, v in (overrides or {}).items():
            if key in PATH_KEYS and isinstance(v, str) and v and not os.path.isabs(v):
                v = os.path.abspath(v)
            if key == "drafter" and isinstance(v, dict):
                v = {**(data.get("drafter") or {}), **v}
            data[key] = v
        return cls.from_dict(data, source=path, base_dir=os.path.dirname(os.path.abspath(path)))

    def validate(self, source: str = "<config>") -> None:
        def check(key, ok, why):
            if not ok:
                raise TrainingError(f"{source}: key '{key}' {why}, got {getattr(self, key)!r}")

        for key in ("seq_len", "num_anchors", "batch_size", "log_every", "eval_every", "checkpoint_every",
                    "keep_last"):
            check(key, is_int(getattr(self, key)) and getattr(self, key) >= 1, "must be a positive integer")
        for key in ("eval_size", "keep_best", "seed", "data_seed"):
            check(key, is_int(getattr(self, key)) and getattr(self, key) >= 0, "must be an integer >= 0")
        for key in ("eval_batches", "data_parallel"):
            v = getattr(self, key)
            check(key, v is None or (is_int(v) and v >= 1), "must be a positive integer or null")
        for key in ("ce_loss_alpha", "l1_loss_alpha", "confidence_alpha", "tree_loss_alpha"):
            check(key, is_number(getattr(self, key)) and getattr(self, key) >= 0, "must be a finite number >= 0")
        top_c = self.tree_top_c
        check("tree_top_c", is_int(top_c) and top_c >= 0, "must be an integer >= 0 (0: no tree term)")
        check("tree_top_c", not (self.tree_loss_alpha > 0 and top_c == 0),
              "must be >= 1 when tree_loss_alpha > 0 (the candidates per depth the term rewards)")
        check("tree_temperature", is_number(self.tree_temperature) and self.tree_temperature > 0,
              "must be a finite number > 0")
        check("loss_decay_gamma", self.loss_decay_gamma is None or is_number(self.loss_decay_gamma),
              "must be a number or null")
        check("packing", self.packing in ("pad", "pack"), "must be 'pad' or 'pack'")
        check("warmup_ratio", is_number(self.warmup_ratio) and 0 <= self.warmup_ratio < 1, "must be in [0, 1)")
        check("optim", isinstance(self.optim, OptimConfig), "must be an OptimConfig")
        check("drafter", isinstance(self.drafter, dict), "must be an object of drafter config keys")
        check("synthetic", self.synthetic is None or isinstance(self.synthetic, dict),
              "must be an object (num_sequences, prompt_len, seed, vocab_high) or null")
        check("target", self.target, "is required (a Hugging Face Qwen3 folder; pass --set target=PATH)")
        check("data", self.data is not None or self.synthetic is not None,
              "is required (a JSONL file) unless 'synthetic' data is configured")
        check("num_anchors", self.num_anchors <= self.seq_len - 1,
              f"does not fit sequences of seq_len={self.seq_len} (at most seq_len - 1)")
        for key in ("dtype", "compute_dtype", "export_dtype"):
            check(key, getattr(self, key) in (None, "float32", "bfloat16", "float16"),
                  "must be 'float32', 'bfloat16', 'float16' or null")
