"""Pre-training a Qwen3 target from scratch on a token stream (next-token cross-entropy).

What the demo pair's target is trained with: optax AdamW (:mod:`.optim`'s schedule and
clipping), orbax checkpoints through :class:`~sparkjax.checkpoint.TrainCheckpointer`, and a data
order that is a pure function of ``(seed, step)``: batch ``s`` holds ``batch_size`` windows of
``seq_len + 1`` tokens at offsets drawn from ``numpy.random.default_rng([seed, s])``. A resumed
run therefore continues with exactly the batches an uninterrupted one would have seen, with no
data cursor to save. Stopping (``max_minutes``, Ctrl-C) saves a checkpoint first.

    cfg = LMConfig(model={...Qwen3 config.json keys...}, steps=6000, ...)
    result = train_lm(cfg, "runs/target", tokens="train.tokens.npy", heldout="heldout.tokens.npy")
    export_lm("runs/target", "out/target", tokenizer="runs/tokenizer")
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ..checkpoint import TrainCheckpointer
from ..config import Qwen3Config, read_json
from ..convert import atomic_file
from ..errors import CheckpointError
from .errors import TrainingError
from .optim import OptimConfig, make_optimizer
from .outdir import MARKER, RunLock, check_overwritable, drop_metrics_after, prepare_output


@dataclasses.dataclass(frozen=True)
class LMConfig:
    model: dict[str, Any]
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 4000
    lr: float = 3e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 250
    eval_batches: int = 8
    checkpoint_every: int = 250
    log_every: int = 25

    def __post_init__(self):
        for name in ("seq_len", "batch_size", "steps", "eval_every", "eval_batches", "checkpoint_every", "log_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise TrainingError(f"{name}: must be a positive integer, got {v!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise TrainingError(f"seed: must be an integer >= 0, got {self.seed!r}")
        if not isinstance(self.model, dict):
            raise TrainingError(f"model: must be a Qwen3 config.json object, got {type(self.model).__name__}")
        self.qwen3_config()  # validates the model keys

    def qwen3_config(self) -> Qwen3Config:
        return Qwen3Config.from_hf_config(dict(self.model), source="LMConfig.model")

    def optim(self) -> OptimConfig:
        return OptimConfig(lr=self.lr, steps=self.steps, warmup_steps=self.warmup_steps, schedule="cosine",
                           min_lr_ratio=self.min_lr_ratio, weight_decay=self.weight_decay, b1=0.9, b2=0.95,
                           grad_clip=self.grad_clip)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> LMConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise TrainingError(f"{source}: unknown key(s) {', '.join(unknown)}")
        if "model" not in d:
            raise TrainingError(f"{source}: key 'model' (a Qwen3 config.json object) is required")
        return cls(**d)


# ----------------------------------------------------------------------------- data
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


# ----------------------------------------------------------------------------- steps
def _loss(graphdef, params, rest, window):
    model = nnx.merge(graphdef, params, rest)
    tokens, labels = window[:, :-1], window[:, 1:]
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    logits = model(tokens, pos).logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2,))
def _train_step(graphdef, tx, state, rest, window):
    loss, grads = jax.value_and_grad(lambda p: _loss(graphdef, p, rest, window))(state["params"])
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, loss, optax.tree.norm(grads)


@functools.partial(jax.jit, static_argnums=(0,))
def _eval_step(graphdef, params, rest, window):
    return _loss(graphdef, params, rest, window)


def _check_lm_config(cfg: LMConfig, meta: dict[str, Any], where: str, force_resume: bool, log) -> None:
    saved = meta.get("config") or {}
    now = json.loads(json.dumps(cfg.to_dict()))
    diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
    if diff and (not force_resume or "model" in diff or "seq_len" in diff or "batch_size" in diff):
        raise TrainingError(f"{where}: the checkpoint was written with another config (differs in "
                            f"{', '.join(diff)}); refusing to resume" + ("" if force_resume else
                            " (force_resume continues with a changed schedule)"))
    if diff:
        log(f"resuming with a changed config: {', '.join(f'{k}: {saved.get(k)} -> {now.get(k)}' for k in diff)}")


def _resume(cfg: LMConfig, ckpt: TrainCheckpointer, state, resume: bool, force_resume: bool, log):
    """``(state, meta)``: the newest usable checkpoint's (a damaged one falls back), or the new state."""
    latest = ckpt.latest_step()
    if latest is None:
        return state, {"wall_s": 0.0}
    if not resume:
        raise TrainingError(f"{ckpt.directory}: holds checkpoints; pass --resume to continue (or use a new folder)")
    try:
        newest = ckpt.read_meta(latest)
    except CheckpointError:
        newest = None  # damaged: the restore moves it aside and falls back; its config is checked below
    if newest is not None:
        _check_lm_config(cfg, newest, ckpt.directory, force_resume, log)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    step, state, meta = ckpt.restore(abstract)
    if newest is None or step != latest:
        _check_lm_config(cfg, meta, ckpt.directory, force_resume, log)
    log(f"resumed at step {int(state['step'])}")
    return state, meta


@dataclasses.dataclass
class LMResult:
    step: int
    train_loss: float | None
    eval_loss: float | None
    tokens_seen: int
    wall_s: float
    stopped_early: bool


def _new_state(cfg: LMConfig, tx):
    from ..nn.qwen3 import Qwen3

    model = Qwen3(cfg.qwen3_config(), rngs=nnx.Rngs(cfg.seed), dtype=jnp.float32)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    return graphdef, state, rest


def train_lm(
    cfg: LMConfig,
    output_dir: str,
    *,
    tokens: str,
    heldout: str,
    resume: bool = False,
    force_resume: bool = False,
    max_minutes: float | None = None,
    log=print,
) -> LMResult:
    """Trains (or resumes) a target in ``output_dir`` (``config.json``, ``metrics.jsonl``, ``checkpoints/``).

    The folder is checked first and locked for the run (a second run into it is refused); a resumed
    run drops the metric lines past the step it restored."""
    output_dir = prepare_output(output_dir)
    with RunLock(output_dir):
        return _train_lm(cfg, output_dir, tokens, heldout, resume, force_resume, max_minutes, log)


def _train_lm(cfg, output_dir, tokens, heldout, resume, force_resume, max_minutes, log) -> LMResult:
    qcfg = cfg.qwen3_config()
    train_ids = load_tokens(tokens, qcfg.vocab_size, cfg.seq_len)
    held_ids = load_tokens(heldout, qcfg.vocab_size, cfg.seq_len)
    ckpt_dir = os.path.join(output_dir, "checkpoints")
    tx = make_optimizer(cfg.optim())
    graphdef, state, rest = _new_state(cfg, tx)
    ckpt = TrainCheckpointer(ckpt_dir, keep_last=2, keep_best=0, best_metric="eval_loss", best_mode="min", log=log)
    try:
        state, meta = _resume(cfg, ckpt, state, resume, force_resume, log)
    except BaseException:
        ckpt.close()
        raise
    with atomic_file(os.path.join(output_dir, "config.json")) as tmp, open(tmp, "w") as f:
        json.dump(cfg.to_dict(), f, indent=2)
    metrics_path = os.path.join(output_dir, "metrics.jsonl")
    # lines past the restored step were written before an interruption; the resumed run writes them again
    drop_metrics_after(metrics_path, int(state["step"]))
    evals = eval_windows(held_ids, cfg.eval_batches, cfg.batch_size, cfg.seq_len)

    def evaluate(st) -> float:
        return float(np.mean([float(_eval_step(graphdef, st["params"], rest, jnp.asarray(w))) for w in evals]))

    metrics_f = open(metrics_path, "a")
    wall0, t0 = float(meta.get("wall_s", 0.0)), time.perf_counter()
    step = int(state["step"])
    train_loss = eval_loss = None
    stopped = False

    def save(st, at: int, extra: dict[str, float]) -> None:
        if at in ckpt.steps():  # a stop right after a scheduled checkpoint: that step is already saved
            return
        m = {"config": cfg.to_dict(), "wall_s": wall0 + time.perf_counter() - t0,
             "tokens_seen": at * cfg.batch_size * cfg.seq_len}
        ckpt.save(at, st, m, metrics=extra or None)

    try:
        losses = []
        while step < cfg.steps:
            window = jnp.asarray(batch_at(train_ids, cfg.seed, step, cfg.batch_size, cfg.seq_len))
            state, loss, gnorm = _train_step(graphdef, tx, state, rest, window)
            step += 1
            losses.append(loss)
            if step % cfg.log_every == 0 or step == cfg.steps:
                train_loss = float(np.mean([float(x) for x in losses]))
                losses = []
                if not math.isfinite(train_loss):
                    raise TrainingError(f"step {step}: the training loss is {train_loss}; lower lr")
                rec = {"step": step, "split": "train", "loss": train_loss, "grad_norm": float(gnorm),
                       "wall_s": round(wall0 + time.perf_counter() - t0, 1)}
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    eval_loss = evaluate(state)
                    rec["eval_loss"] = eval_loss
                metrics_f.write(json.dumps(rec) + "\n")
                metrics_f.flush()
                log(json.dumps(rec))
            if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                save(state, step, {"eval_loss": eval_loss} if eval_loss is not None else {})
            if max_minutes is not None and time.perf_counter() - t0 > 60 * max_minutes and step < cfg.steps:
                save(state, step, {})
                stopped = True
                log(f"stopped after {max_minutes} minutes at step {step}; --resume continues")
                break
    except KeyboardInterrupt:
        save(state, step, {})
        stopped = True
        log(f"interrupted at step {step}; saved; --resume continues")
    finally:
        ckpt.close()
        metrics_f.close()
    return LMResult(step, train_loss, eval_loss, step * cfg.batch_size * cfg.seq_len,
                    wall0 + time.perf_counter() - t0, stopped)


def export_lm(run_dir: str, out: str, *, tokenizer: str | None = None, dtype: str = "bfloat16",
              step: int | None = None, overwrite: bool = False, special_ids: dict[str, int] | None = None) -> str:
    """Writes a run's checkpoint as a Hugging Face Qwen3 folder (+ tokenizer files, generation config).

    ``special_ids`` (``eos_token_id``, ``pad_token_id``, ``bos_token_id``) go into ``config.json``
    and ``generation_config.json``."""
    from ..convert import atomic_dir, save_target

    if overwrite:  # only a folder sparkjax wrote, or an empty one (checked before any work)
        check_overwritable(out, "export folder")
    if tokenizer is not None and not os.path.isdir(tokenizer):
        raise CheckpointError(f"{tokenizer}: tokenizer folder not found")
    cfg = LMConfig.from_dict(read_json(os.path.join(run_dir, "config.json"), TrainingError, "run config"),
                             source=os.path.join(run_dir, "config.json"))
    tx = make_optimizer(cfg.optim())
    graphdef, state, rest = _new_state(cfg, tx)
    ckpt = TrainCheckpointer(os.path.join(run_dir, "checkpoints"), keep_last=2, keep_best=0)
    try:
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        _, state, meta = ckpt.restore(abstract, step)
    finally:
        ckpt.close()
    model = nnx.merge(graphdef, state["params"], rest)
    ids = {k: int(v) for k, v in (special_ids or {}).items() if v is not None}
    with atomic_dir(out, overwrite=overwrite) as tmp:
        save_target(model, os.path.join(tmp, "model"), dtype=dtype)
        for name in os.listdir(os.path.join(tmp, "model")):
            os.replace(os.path.join(tmp, "model", name), os.path.join(tmp, name))
        os.rmdir(os.path.join(tmp, "model"))
        config = read_json(os.path.join(tmp, "config.json"), CheckpointError, "config")
        config.update(ids)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump({**ids, "do_sample": False}, f, indent=2)
        if tokenizer is not None:
            for name in sorted(os.listdir(tokenizer)):
                src = os.path.join(tokenizer, name)
                if os.path.isfile(src) and name != MARKER:
                    shutil.copy2(src, os.path.join(tmp, name))
    return out
