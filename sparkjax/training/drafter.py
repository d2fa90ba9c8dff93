"""The drafter's training task (:class:`DrafterTask`: models and data from a :class:`TrainConfig`, steps, eval,
exports) and :func:`train`, which runs it through :func:`.fit.fit` into a run folder (``config.json``,
``metrics.jsonl``, ``data/``, ``checkpoints/<step>/``, ``drafter/``, ``best_drafter/``, ``tensorboard/``; see
``docs/training.md``). A resumed run checks that its config and data are the checkpoint's (``force_resume``
overrides) and continues with exactly the next batch and RNG state.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import jax

from ..errors import ArgumentError, CheckpointError, DataError, TrainingError
from ..io.checkpoint import TrainCheckpointer
from ..io.hf import load_target
from ..sharding import make_mesh
from ..text import load_tokenizer
from . import data as data_lib
from .config import OPERATIONAL, TrainConfig
from .fit import LoopSettings, RunResult, Task, _stderr, fit
from .models import init_drafter, load_drafter_for_training, new_drafter_config
from .outdir import check_overwritable, export_drafter
from .trainer import Trainer, to_host

__all__ = ["DrafterTask", "RunResult", "build_data", "build_models", "export_run", "make_run_mesh", "train"]


def build_models(cfg: TrainConfig, log: Callable[[str], None] = _stderr):
    """``(target, drafter)`` for the run: the drafter continues ``init_drafter`` (with the
    ``drafter`` overrides and ``num_anchors``) or is a new one (``drafter`` settings)."""
    target = load_target(cfg.target, dtype=cfg.dtype)
    if cfg.init_drafter:
        overrides = {**cfg.drafter, "num_anchors": cfg.num_anchors}
        drafter = load_drafter_for_training(cfg.init_drafter, target, overrides, dtype=cfg.dtype)
        log(f"drafter: {cfg.init_drafter} (block {drafter.config.block_size})")
    else:
        settings = {"num_anchors": cfg.num_anchors, **cfg.drafter}
        dcfg = new_drafter_config(target.config, settings, source=f"recipe key 'drafter' ({cfg.name})")
        drafter = init_drafter(target, dcfg, seed=cfg.seed, dtype=cfg.dtype)
        log(f"drafter: new, {dcfg.num_hidden_layers} layers, block {dcfg.block_size}, "
            f"target layers {list(dcfg.target_layer_ids)}")
    return target, drafter


def build_data(cfg: TrainConfig, target, drafter, output_dir: str | None,
               log: Callable[[str], None] = _stderr) -> tuple[data_lib.TokenData, data_lib.TokenData | None]:
    """Train and held-out :class:`~sparkjax.training.data.TokenData` for the run."""
    block = drafter.config.block_size
    if cfg.seq_len < block + 1:
        raise TrainingError(
            f"seq_len: {cfg.seq_len} is shorter than a block plus its first label (block_size + 1 = {block + 1})")
    if cfg.synthetic is not None and cfg.data is None:
        train, held = _synthetic(cfg, target, output_dir, log)
    else:
        chat = _has_chat_records(cfg.data) or (cfg.eval_data is not None and _has_chat_records(cfg.eval_data))
        source = cfg.tokenizer or cfg.target
        tok = load_tokenizer(source, what="tokenizer", error=DataError) if chat else None
        kw = dict(block_size=block, vocab_size=target.config.vocab_size, tokenizer=tok, tokenizer_source=source,
                  packing=cfg.packing, assistant_header=cfg.assistant_header, end_of_turn=cfg.end_of_turn)
        train = data_lib.load_jsonl(cfg.data, cfg.seq_len, **kw)
        held = None
        if cfg.eval_data:
            held = data_lib.load_jsonl(cfg.eval_data, cfg.seq_len, **kw)
        elif cfg.eval_size:
            train, held = data_lib.split_eval(train, eval_size=cfg.eval_size, seed=cfg.data_seed)
        log(f"data: {len(train)} train rows ({train.supervised_tokens()} supervised tokens)"
            + (f", {len(held)} held-out rows" if held is not None else "")
            + (f"; skipped {train.info.get('skipped')} lines without assistant tokens" if train.info.get("skipped")
               else ""))
    if cfg.precompute_features:
        ids = tuple(drafter.config.target_layer_ids)
        train = data_lib.precompute_features(target, train, ids)
        held = None if held is None else data_lib.precompute_features(target, held, ids)
    return train, held


def _synthetic(cfg: TrainConfig, target, output_dir: str | None, log):
    """Target-greedy train / held-out data (None without ``eval_size``), cached in ``OUT/data`` once generated."""
    s = dict(cfg.synthetic)
    known = {"num_sequences", "prompt_len", "seed", "vocab_high", "batch"}
    bad = sorted(set(s) - known)
    if bad:
        raise TrainingError(f"synthetic: unknown key '{bad[0]}' (known: {', '.join(sorted(known))})")
    cache = None if output_dir is None else os.path.join(output_dir, "data")
    paths = () if cache is None else (os.path.join(cache, "train.npz"), os.path.join(cache, "eval.npz"))
    if paths and all(os.path.exists(p) for p in paths):
        try:
            train, held = data_lib.TokenData.load(paths[0]), data_lib.TokenData.load(paths[1])
            return train, held if cfg.eval_size else None
        except data_lib.DataError as e:  # a cache this run wrote, damaged: it is rebuilt from its seed
            log(f"warning: {e}; rebuilding the data cache")
    common = dict(seq_len=cfg.seq_len, prompt_len=int(s.get("prompt_len", 16)), vocab_high=s.get("vocab_high"),
                  batch=int(s.get("batch", 64)))
    seed = int(s.get("seed", cfg.data_seed))
    t0 = time.perf_counter()
    train = data_lib.synthetic_data(target, num_sequences=int(s.get("num_sequences", 256)), seed=seed, **common)
    held = data_lib.synthetic_data(target, num_sequences=cfg.eval_size, seed=seed + 1_000_003, **common) \
        if cfg.eval_size else data_lib.TokenData(train.input_ids[:0], train.loss_mask[:0])
    log(f"data: generated {len(train)} + {len(held)} target-greedy sequences in {time.perf_counter() - t0:.1f}s")
    if paths:
        os.makedirs(cache, exist_ok=True)
        train.save(paths[0])
        held.save(paths[1])
    return train, held if cfg.eval_size else None


def _has_chat_records(path: str) -> bool:
    return any(isinstance(obj, dict) and "input_ids" not in obj for _, obj in data_lib.read_jsonl(path))


def make_run_mesh(cfg: TrainConfig):
    """A data-parallel mesh over ``data_parallel`` devices (all by default), or None for one device."""
    n = cfg.data_parallel or len(jax.devices())
    if n > len(jax.devices()):
        raise TrainingError(f"data_parallel: {n} devices requested, {len(jax.devices())} available")
    if cfg.batch_size % n:
        raise TrainingError(f"batch_size: {cfg.batch_size} is not divisible by the {n} data-parallel devices")
    return make_mesh(data=n, model=1) if n > 1 else None


def _trainer(cfg: TrainConfig, drafter, target, mesh=None) -> Trainer:
    return Trainer(drafter, target, optim=cfg.optim, objective=cfg.objective, num_anchors=cfg.num_anchors,
                   seed=cfg.seed, compute_dtype=cfg.compute_dtype, freeze=cfg.freeze, mesh=mesh)


class DrafterTask(Task):
    """A DSpark drafter trained against its (frozen) Qwen3 target with the DSpark objective."""

    best = ("eval_tau", "tau_probabilistic", "max")  # best_drafter/ is the checkpoint of the best held-out tau

    def settings(self, cfg: TrainConfig) -> LoopSettings:
        return LoopSettings(steps=cfg.steps, log_every=cfg.log_every, eval_every=cfg.eval_every,
                            checkpoint_every=cfg.checkpoint_every, keep_last=cfg.keep_last, keep_best=cfg.keep_best,
                            async_checkpoint=cfg.async_checkpoint, tensorboard=cfg.tensorboard,
                            tokens_per_step=cfg.batch_size * cfg.seq_len, operational=OPERATIONAL)

    def export_paths(self, cfg: TrainConfig, output_dir: str) -> list[str]:
        return [os.path.join(output_dir, "drafter"), os.path.join(output_dir, "best_drafter")]

    def build(self, cfg: TrainConfig, output_dir: str, log) -> None:
        self.cfg = cfg
        target, drafter = build_models(cfg, log)
        self.train_data, held = build_data(cfg, target, drafter, output_dir, log)
        self.trainer = _trainer(cfg, drafter, None if cfg.precompute_features else target, make_run_mesh(cfg))
        self.drafter_cfg = drafter.config.to_hf_dict()
        self.stream = data_lib.BatchStream(self.train_data, cfg.batch_size, cfg.data_seed)
        self.eval_batches = _eval_batches(cfg, held, self.trainer.data_parallel)
        self.cursor = 0

    def abstract_state(self):
        return self.trainer.abstract_state()

    def restore(self, step, state, meta, where, force_resume, log) -> str:
        if meta.get("data_fingerprint") != self.train_data.fingerprint():
            msg = (f"{where}: the training data differ from the data the checkpoint was written with "
                   f"({meta.get('data_rows')} rows then, {len(self.train_data)} now)")
            if not force_resume:
                raise TrainingError(msg + "; pass --force-resume to continue anyway")
            log(f"warning: {msg}; continuing because of --force-resume")
        self.trainer.set_state(state)
        self.cursor = int(meta.get("data_cursor", step))
        return f"resume: step {step} from {where} (data cursor {self.cursor})"

    def step(self, index: int):
        self.cursor += 1
        return self.trainer.step(self.stream.batch(self.cursor - 1))

    def train_metrics(self, outputs) -> dict[str, Any]:
        sums, info = outputs[-1]  # the logged step's own metrics
        info = to_host(info)
        return {**to_host(sums.metrics(self.cfg.objective, self.trainer.has_confidence)), "lr": info["lr"],
                "grad_norm": info["grad_norm"], "epoch": self.cursor / self.stream.batches_per_epoch}

    def evaluate(self):
        return self.trainer.evaluate(self.eval_batches, seed=self.cfg.seed + 1) if self.eval_batches else None

    def checkpoint(self):
        return self.trainer.state, {"drafter_config": self.drafter_cfg, "data_cursor": int(self.cursor),
                                    "data_fingerprint": self.train_data.fingerprint(),
                                    "data_rows": len(self.train_data)}

    def export(self, ckpt, output_dir, log) -> dict[str, str]:
        out = {"drafter": os.path.join(output_dir, "drafter")}
        export_drafter(self.trainer.drafter(), out["drafter"], dtype=self.cfg.export_dtype)
        log(f"exported the final drafter to {out['drafter']}")
        best = ckpt.best_step()
        if best is not None:
            out["best_drafter"] = os.path.join(output_dir, "best_drafter")
            export_checkpoint(self.cfg, self.trainer, ckpt, best, out["best_drafter"])
            log(f"exported the best drafter (step {best}, held-out tau "
                f"{ckpt.read_meta(best)['metrics']['eval_tau']:.4f}) to {out['best_drafter']}")
        return out


def train(cfg: TrainConfig, output_dir: str, *, resume: bool = False, force_resume: bool = False,
          progress: bool = True, log: Callable[[str], None] = _stderr,
          on_step: Callable[[int, bool], None] | None = None, stop_at: int | None = None,
          max_minutes: float | None = None) -> RunResult:
    """Runs (or resumes) a drafter training run into ``output_dir``; see the module doc for the layout
    and :func:`.fit.fit` for ``on_step``, ``stop_at`` and ``max_minutes``."""
    return fit(DrafterTask(), cfg, output_dir, resume=resume, force_resume=force_resume, max_minutes=max_minutes,
               stop_at=stop_at, progress=progress, log=log, on_step=on_step)


def _eval_batches(cfg: TrainConfig, held, dp: int):
    if held is None or len(held) == 0:
        return []
    bs = min(cfg.batch_size, len(held))
    bs -= bs % dp
    if bs < 1:
        raise TrainingError(f"eval_size: {len(held)} held-out rows cannot be split over {dp} data-parallel devices")
    return data_lib.fixed_batches(held, bs, cfg.eval_batches)


def export_checkpoint(cfg: TrainConfig, trainer: Trainer, ckpt: TrainCheckpointer, step: int, out_dir: str) -> str:
    """Writes the drafter of checkpoint ``step`` to ``out_dir`` (DeepSpec format), leaving ``trainer`` as it was."""
    out_dir = check_overwritable(out_dir)
    current = trainer.state
    _, state, _ = ckpt.restore(trainer.abstract_state(), step=step)
    trainer.set_state(state)
    try:
        export_drafter(trainer.drafter(), out_dir, dtype=cfg.export_dtype)
    finally:
        trainer.state = current
    return out_dir


def export_run(cfg: TrainConfig, output_dir: str, which: str, out_dir: str | None = None,
               log: Callable[[str], None] = _stderr) -> str:
    """Exports checkpoint ``which`` (``latest``, ``best`` or a step number) of a run to DeepSpec format, into
    ``out_dir`` (default ``OUTPUT/export_stepN``: checked by the overwrite rule before any work)."""
    if out_dir is not None:
        check_overwritable(out_dir, "--export-to")
    folder = os.path.join(os.path.abspath(output_dir), "checkpoints")
    if not os.path.isdir(folder):
        raise CheckpointError(f"{os.path.abspath(output_dir)}: no checkpoints folder (not a training run?)")
    ckpt = TrainCheckpointer(folder, keep_last=cfg.keep_last, keep_best=cfg.keep_best, log=log)
    try:
        if which in ("latest", "best"):
            step = ckpt.latest_step() if which == "latest" else ckpt.best_step()
        elif not str(which).isdigit():
            raise ArgumentError(f"--export: expected 'latest', 'best' or a step number, got {which!r}")
        else:
            step = int(which)
        if step is None:
            raise CheckpointError(f"{ckpt.directory}: no {which} checkpoint to export")
        target, drafter = build_models(cfg, log)
        out = out_dir or os.path.join(output_dir, f"export_step{step}")
        check_overwritable(out, "--export-to")
        export_checkpoint(cfg, _trainer(cfg, drafter, target), ckpt, step, out)
        log(f"exported step {step} to {out}")
        return out
    finally:
        ckpt.close()
