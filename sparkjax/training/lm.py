"""Pre-training a Qwen3 target from scratch on a token stream (next-token cross-entropy) through :func:`.fit.fit`.
Batch ``s`` holds ``batch_size`` windows of ``seq_len + 1`` tokens at offsets drawn from
``numpy.random.default_rng([seed, s])``, so a resumed run sees exactly the batches an uninterrupted one would.

    result = train_lm(LMConfig(model={...}, steps=6000), "runs/target", tokens="train.npy", heldout="held.npy")
    export_lm("runs/target", "out/target", tokenizer="runs/tokenizer")
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ..config import Qwen3Config, read_json
from ..errors import CheckpointError, TrainingError
from ..io.atomic import atomic_dir
from ..io.checkpoint import TrainCheckpointer
from ..io.hf import save_target
from ..nn.qwen3 import Qwen3
from .fit import LoopSettings, Task, fit
from .optim import OptimConfig, compose, is_int, make_optimizer, make_schedule
from .outdir import MARKER, check_overwritable, save_into

LM_OPTIM = OptimConfig(lr=3e-3, steps=4000, warmup_steps=100, schedule="cosine", min_lr_ratio=0.1,
                       weight_decay=0.1, b1=0.9, b2=0.95, grad_clip=1.0)
"""The target's optimizer: AdamW (betas 0.9 / 0.95), warmup then cosine decay to 10%, clipping at 1."""
LM_OPTIM_KEYS = ("steps", "lr", "warmup_steps", "min_lr_ratio", "weight_decay", "grad_clip")
"""The optimizer settings an LM recipe may set (flat keys); the others are :data:`LM_OPTIM`'s."""
LOOP_KEYS = ("seq_len", "batch_size", "seed", "eval_every", "eval_batches", "checkpoint_every", "log_every")


@dataclasses.dataclass(frozen=True, init=False)
class LMConfig:
    """A target pre-training run: the Qwen3 ``model`` (config.json keys), the loop's settings and
    ``optim`` (an :class:`OptimConfig` made from the flat keys ``steps``, ``lr``, ``warmup_steps``,
    ``min_lr_ratio``, ``weight_decay``, ``grad_clip`` over :data:`LM_OPTIM`)."""

    model: dict[str, Any]
    seq_len: int = 256
    batch_size: int = 16
    seed: int = 0
    eval_every: int = 250
    eval_batches: int = 8
    checkpoint_every: int = 250
    log_every: int = 25
    optim: OptimConfig = LM_OPTIM

    def __init__(self, model: dict[str, Any], **settings: Any):
        unknown = sorted(set(settings) - set(LOOP_KEYS) - set(LM_OPTIM_KEYS))
        if unknown:
            raise TrainingError(f"LMConfig: unknown key(s) {', '.join(unknown)}")
        object.__setattr__(self, "model", model)
        for f in dataclasses.fields(self):
            if f.name in LOOP_KEYS:
                v, low = settings.pop(f.name, f.default), 0 if f.name == "seed" else 1
                if not is_int(v) or v < low:
                    raise TrainingError(f"{f.name}: must be an integer >= {low}, got {v!r}")
                object.__setattr__(self, f.name, v)
        object.__setattr__(self, "optim", compose(settings, LM_OPTIM, LM_OPTIM_KEYS, source="LMConfig"))
        if not isinstance(model, dict):
            raise TrainingError(f"model: must be a Qwen3 config.json object, got {type(model).__name__}")
        self.qwen3_config()  # validates the model keys

    def __getattr__(self, name: str):  # cfg.lr, cfg.steps, ...: the optimizer's settings
        if name in LM_OPTIM_KEYS:
            return getattr(self.optim, name)
        raise AttributeError(f"LMConfig has no attribute {name!r}")

    def qwen3_config(self) -> Qwen3Config:
        return Qwen3Config.from_hf_config(dict(self.model), source="LMConfig.model")

    def to_dict(self) -> dict[str, Any]:
        """The flat recipe keys (what :meth:`from_dict` reads back)."""
        d = {"model": copy.deepcopy(self.model), **{k: getattr(self, k) for k in LOOP_KEYS}}
        d.update({k: getattr(self.optim, k) for k in LM_OPTIM_KEYS})
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> LMConfig:
        if not isinstance(d, dict):
            raise TrainingError(f"{source}: expected a JSON object, got {type(d).__name__}")
        if "model" not in d:
            raise TrainingError(f"{source}: key 'model' (a Qwen3 config.json object) is required")
        try:
            return cls(**d)
        except TrainingError as e:
            raise TrainingError(f"{source}: {e}") from None


def load_tokens(path: str, vocab: int, seq_len: int) -> np.ndarray:
    try:
        ids = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise TrainingError(f"{path}: cannot read the token stream ({e})") from None
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise TrainingError(f"{path}: expected a 1-D integer token array, got {ids.dtype} {ids.shape}")
    if ids.size < seq_len + 2:
        raise TrainingError(f"{path}: {ids.size} tokens, fewer than one window of seq_len + 1 = {seq_len + 1}")
    hi = int(ids.max())
    if hi >= vocab:
        raise TrainingError(f"{path}: token id {hi} is outside the model's vocabulary ({vocab})")
    return np.asarray(ids, np.int32)


def batch_at(tokens: np.ndarray, seed: int, step: int, batch: int, seq_len: int) -> np.ndarray:
    """``[batch, seq_len + 1]`` windows for step ``step`` (a pure function of seed and step)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, tokens.size - seq_len - 1, size=batch)
    return np.stack([tokens[s:s + seq_len + 1] for s in starts])


def eval_windows(tokens: np.ndarray, batches: int, batch: int, seq_len: int) -> list[np.ndarray]:
    """Fixed, evenly spaced held-out windows (the same every evaluation)."""
    n = batches * batch
    starts = np.linspace(0, tokens.size - seq_len - 2, n).astype(np.int64)
    rows = np.stack([tokens[s:s + seq_len + 1] for s in starts])
    return [rows[i * batch:(i + 1) * batch] for i in range(batches)]


def _loss(graphdef, params, rest, window):
    model = nnx.merge(graphdef, params, rest)
    tokens, labels = window[:, :-1], window[:, 1:]
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    logits = model(tokens, pos).logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2,))
def _train_step(graphdef, optim: OptimConfig, state, rest, window):
    tx = make_optimizer(optim)
    loss, grads = jax.value_and_grad(lambda p: _loss(graphdef, p, rest, window))(state["params"])
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, loss, optax.tree.norm(grads)


_eval_step = jax.jit(_loss, static_argnums=(0,))


@dataclasses.dataclass
class LMResult:
    step: int
    train_loss: float | None
    eval_loss: float | None
    tokens_seen: int
    wall_s: float
    stopped_early: bool


def _new_state(cfg: LMConfig):
    tx = make_optimizer(cfg.optim)
    model = Qwen3(cfg.qwen3_config(), rngs=nnx.Rngs(cfg.seed), dtype=jnp.float32)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    return graphdef, state, rest


class LMTask(Task):
    """Next-token cross-entropy of a Qwen3 trained from scratch on a token stream (``tokens``), with
    the mean loss on fixed windows of ``heldout`` as its evaluation."""

    best = ("eval_loss", "loss", "min")
    eval_inline = True  # "eval_loss" in the train record of the step

    def __init__(self, tokens: str, heldout: str):
        self.tokens, self.heldout = tokens, heldout

    def settings(self, cfg: LMConfig) -> LoopSettings:
        return LoopSettings(steps=cfg.steps, log_every=cfg.log_every, eval_every=cfg.eval_every,
                            checkpoint_every=cfg.checkpoint_every, keep_last=2, keep_best=0,
                            tokens_per_step=cfg.batch_size * cfg.seq_len,
                            operational=frozenset({"log_every", "eval_every", "eval_batches", "checkpoint_every"}),
                            fixed=frozenset({"model", "seq_len", "batch_size"}))

    def build(self, cfg: LMConfig, output_dir: str, log) -> None:
        self.cfg = cfg
        vocab = cfg.qwen3_config().vocab_size
        self.train_ids = load_tokens(self.tokens, vocab, cfg.seq_len)
        held = load_tokens(self.heldout, vocab, cfg.seq_len)
        self.evals = [jnp.asarray(w) for w in eval_windows(held, cfg.eval_batches, cfg.batch_size, cfg.seq_len)]
        self.graphdef, self.state, self.rest = _new_state(cfg)
        self.schedule = make_schedule(cfg.optim)

    def abstract_state(self):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.state)

    def restore(self, step, state, meta, where, force_resume, log) -> str:
        self.state = state
        return f"resumed at step {int(state['step'])}"

    def step(self, index: int):
        cfg = self.cfg
        window = jnp.asarray(batch_at(self.train_ids, cfg.seed, index, cfg.batch_size, cfg.seq_len))
        self.state, loss, gnorm = _train_step(self.graphdef, cfg.optim, self.state, self.rest, window)
        return index, loss, gnorm

    def train_metrics(self, outputs) -> dict[str, Any]:
        index, _, gnorm = outputs[-1]
        return {"loss": float(np.mean([float(loss) for _, loss, _ in outputs])), "grad_norm": float(gnorm),
                "lr": float(self.schedule(index))}

    def evaluate(self) -> dict[str, Any]:
        return {"loss": float(np.mean([float(_eval_step(self.graphdef, self.state["params"], self.rest, w))
                                       for w in self.evals]))}

    def checkpoint(self):
        return self.state, {}


def train_lm(cfg: LMConfig, output_dir: str, *, tokens: str, heldout: str, resume: bool = False,
             force_resume: bool = False, max_minutes: float | None = None, log=print) -> LMResult:
    """Trains (or resumes) a target in ``output_dir`` (``config.json``, ``metrics.jsonl``, ``checkpoints/``)
    through the one training loop (:func:`.fit.fit`: run lock, resume, metrics, eval, stopping)."""
    r = fit(LMTask(tokens, heldout), cfg, output_dir, resume=resume, force_resume=force_resume,
            max_minutes=max_minutes, log=log)
    train = [h for h in r.history if h["split"] == "train"]
    return LMResult(r.step, train[-1]["loss"] if train else None,
                    None if r.last_eval is None else r.last_eval["loss"], r.tokens_seen, r.wall_s, r.stopped_early)


def export_lm(run_dir: str, out: str, *, tokenizer: str | None = None, dtype: str = "bfloat16",
              step: int | None = None, overwrite: bool = False, special_ids: dict[str, int] | None = None) -> str:
    """Writes a run's checkpoint as a Hugging Face Qwen3 folder (+ tokenizer files, generation config);
    ``special_ids`` (``eos_token_id``, ...) go into ``config.json`` and ``generation_config.json``."""
    if overwrite:  # only a folder sparkjax wrote, or an empty one (checked before any work)
        check_overwritable(out, "export folder")
    if tokenizer is not None and not os.path.isdir(tokenizer):
        raise CheckpointError(f"{tokenizer}: tokenizer folder not found")
    cfg = LMConfig.from_dict(read_json(os.path.join(run_dir, "config.json"), TrainingError, "run config"),
                             source=os.path.join(run_dir, "config.json"))
    graphdef, state, rest = _new_state(cfg)
    ckpt = TrainCheckpointer(os.path.join(run_dir, "checkpoints"), keep_last=2, keep_best=0)
    try:
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        _, state, meta = ckpt.restore(abstract, step)
    finally:
        ckpt.close()
    ids = {k: int(v) for k, v in (special_ids or {}).items() if v is not None}
    with atomic_dir(out, overwrite=overwrite) as tmp:
        save_into(tmp, save_target, nnx.merge(graphdef, state["params"], rest), dtype=dtype)
        config = {**read_json(os.path.join(tmp, "config.json"), CheckpointError, "config"), **ids}
        for name, content in (("config.json", config), ("generation_config.json", {**ids, "do_sample": False})):
            with open(os.path.join(tmp, name), "w") as f:
                json.dump(content, f, indent=2)
        if tokenizer is not None:
            for name in sorted(os.listdir(tokenizer)):
                src = os.path.join(tokenizer, name)
                if os.path.isfile(src) and name != MARKER:
                    shutil.copy2(src, os.path.join(tmp, name))
    return out
