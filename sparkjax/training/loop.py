"""The training loop: models and data from a :class:`TrainConfig`, steps, metrics, eval, checkpoints.

Output folder layout::

    OUT/config.json           the resolved config of the run
    OUT/metrics.jsonl         one JSON object per logged step ("split": "train") and per eval ("eval")
    OUT/data/                 synthetic data, generated once (train.npz, eval.npz)
    OUT/checkpoints/<step>/   orbax checkpoints (model, optimizer state, step, RNG, data cursor)
    OUT/drafter/              the final drafter, DeepSpec safetensors format (load_drafter reads it)
    OUT/best_drafter/         the drafter with the best held-out probabilistic tau
    OUT/tensorboard/          TensorBoard events (only if tensorboardX or tensorboard is installed)
    OUT/.sparkjax-lock        the run lock (flock): a second run into OUT is refused while one runs

Exports (``drafter/``, ``best_drafter/``, ``--export-to``) go through ``atomic_dir`` and hold the
marker file ``.sparkjax-output``; an export replaces only such a folder or an empty one, and a
destination it may not replace is refused before any work (see :mod:`.outdir`).

A resumed run (``resume=True``) restores the newest good checkpoint (a damaged one is moved
aside and the previous one used), checks that the config and data are the ones it was written
with (``force_resume`` overrides), drops metric lines past the restored step, and continues
with exactly the next batch and RNG state, so the loss curve is the one an uninterrupted run
would have produced.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ..checkpoint import TrainCheckpointer
from ..convert import atomic_file, load_target
from ..errors import ArgumentError, CheckpointError
from ..sharding import make_mesh
from . import data as data_lib
from .config import TrainConfig, config_diff
from .errors import TrainingError
from .models import init_drafter, load_drafter_for_training, new_drafter_config
from .outdir import RunLock, check_overwritable, drop_metrics_after, export_drafter, prepare_output
from .trainer import Trainer, to_host

FORMAT_VERSION = 1


@dataclasses.dataclass
class RunResult:
    output_dir: str
    step: int
    history: list[dict[str, Any]]
    last_eval: dict[str, Any] | None
    drafter_dir: str | None
    best_dir: str | None
    resumed_from: int | None


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- models and data


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


def _load_tokenizer(cfg: TrainConfig):
    folder = cfg.tokenizer or cfg.target
    from ..eval.tokenizer import load_tokenizer

    try:
        return load_tokenizer(folder, what="tokenizer")
    except Exception as e:  # noqa: BLE001 - reported as a DataError naming the folder
        raise data_lib.DataError(f"tokenizer: {e}") from None


def build_data(cfg: TrainConfig, target, drafter, output_dir: str | None,
               log: Callable[[str], None] = _stderr) -> tuple[data_lib.TokenData, data_lib.TokenData | None]:
    """Train and held-out :class:`~sparkjax.training.data.TokenData` for the run."""
    block = drafter.config.block_size
    vocab = target.config.vocab_size
    if cfg.seq_len < block + 1:
        raise TrainingError(
            f"seq_len: {cfg.seq_len} is shorter than a block plus its first label (block_size + 1 = {block + 1})"
        )
    if cfg.synthetic is not None and cfg.data is None:
        s = dict(cfg.synthetic)
        known = {"num_sequences", "prompt_len", "seed", "vocab_high", "batch"}
        bad = sorted(set(s) - known)
        if bad:
            raise TrainingError(f"synthetic: unknown key '{bad[0]}' (known: {', '.join(sorted(known))})")
        cache = None if output_dir is None else os.path.join(output_dir, "data")
        paths = None if cache is None else (os.path.join(cache, "train.npz"), os.path.join(cache, "eval.npz"))
        train = held = None
        if paths and all(os.path.exists(p) for p in paths):
            try:
                train, held = data_lib.TokenData.load(paths[0]), data_lib.TokenData.load(paths[1])
            except data_lib.DataError as e:  # a cache this run wrote, damaged: it is rebuilt from its seed
                log(f"warning: {e}; rebuilding the data cache")
                train = held = None
        if train is None:
            common = dict(seq_len=cfg.seq_len, prompt_len=int(s.get("prompt_len", 16)),
                          vocab_high=s.get("vocab_high"), batch=int(s.get("batch", 64)))
            seed = int(s.get("seed", cfg.data_seed))
            t0 = time.perf_counter()
            train = data_lib.synthetic_data(target, num_sequences=int(s.get("num_sequences", 256)), seed=seed,
                                            **common)
            held = data_lib.synthetic_data(target, num_sequences=cfg.eval_size, seed=seed + 1_000_003, **common) \
                if cfg.eval_size else data_lib.TokenData(train.input_ids[:0], train.loss_mask[:0])
            log(f"data: generated {len(train)} + {len(held)} target-greedy sequences in "
                f"{time.perf_counter() - t0:.1f}s")
            if paths:
                os.makedirs(cache, exist_ok=True)
                train.save(paths[0])
                held.save(paths[1])
        if cfg.eval_size == 0:
            held = None
    else:
        tok = None
        needs_tok = _has_chat_records(cfg.data) or (cfg.eval_data is not None and _has_chat_records(cfg.eval_data))
        if needs_tok:
            tok = _load_tokenizer(cfg)
        kw = dict(block_size=block, vocab_size=vocab, tokenizer=tok, tokenizer_source=cfg.tokenizer or cfg.target,
                  packing=cfg.packing, assistant_header=cfg.assistant_header, end_of_turn=cfg.end_of_turn)
        train = data_lib.load_jsonl(cfg.data, cfg.seq_len, **kw)
        if cfg.eval_data:
            held = data_lib.load_jsonl(cfg.eval_data, cfg.seq_len, **kw)
        elif cfg.eval_size:
            train, held = data_lib.split_eval(train, eval_size=cfg.eval_size, seed=cfg.data_seed)
        else:
            held = None
        log(f"data: {len(train)} train rows ({train.supervised_tokens()} supervised tokens)"
            + (f", {len(held)} held-out rows" if held is not None else "")
            + (f"; skipped {train.info.get('skipped')} lines without assistant tokens" if train.info.get("skipped")
               else ""))
    if cfg.precompute_features:
        ids = tuple(drafter.config.target_layer_ids)
        train = data_lib.precompute_features(target, train, ids)
        held = None if held is None else data_lib.precompute_features(target, held, ids)
    return train, held


def _has_chat_records(path: str) -> bool:
    for _, obj in data_lib.read_jsonl(path):
        if isinstance(obj, dict) and "input_ids" not in obj:
            return True
    return False


def make_run_mesh(cfg: TrainConfig):
    """A data-parallel mesh over ``data_parallel`` devices (all by default), or None for one device."""
    n = cfg.data_parallel or len(jax.devices())
    if n > len(jax.devices()):
        raise TrainingError(f"data_parallel: {n} devices requested, {len(jax.devices())} available")
    if cfg.batch_size % n:
        raise TrainingError(f"batch_size: {cfg.batch_size} is not divisible by the {n} data-parallel devices")
    return make_mesh(data=n, model=1) if n > 1 else None


# ----------------------------------------------------------------------------- metrics output


class MetricsWriter:
    """Appends JSON lines to ``metrics.jsonl`` (and TensorBoard scalars when available)."""

    def __init__(self, output_dir: str, *, resume_step: int | None, tensorboard: bool):
        self.path = os.path.join(output_dir, "metrics.jsonl")
        # a resumed run drops the lines past its checkpoint (written before an interruption); a new run
        # starts the file afresh (step 0)
        drop_metrics_after(self.path, resume_step or 0)
        self._tb = None
        if tensorboard:
            self._tb = _tensorboard_writer(os.path.join(output_dir, "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            prefix = record.get("split", "train")
            for k, v in record.items():
                if isinstance(v, int | float) and k != "step":
                    self._tb.add_scalar(f"{prefix}/{k}", v, record["step"])
                elif isinstance(v, list) and k == "accept_rate":
                    for i, x in enumerate(v):
                        self._tb.add_scalar(f"{prefix}/accept_rate@{i}", x, record["step"])

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def _tensorboard_writer(folder: str):
    try:
        from tensorboardX import SummaryWriter  # type: ignore[import-not-found]
    except ImportError:
        try:
            import tensorboard  # noqa: F401  # type: ignore[import-not-found]
            from torch.utils.tensorboard import SummaryWriter  # type: ignore[import-not-found]
        except ImportError:
            return None
    return SummaryWriter(folder)


def _record(step: int, split: str, metrics: dict[str, Any], **extra) -> dict[str, Any]:
    rec: dict[str, Any] = {"step": step, "split": split}
    for k, v in metrics.items():
        rec[k] = np.asarray(v).tolist() if isinstance(v, np.ndarray) else (float(v) if isinstance(v, float) else v)
    rec.update(extra)
    return rec


# ----------------------------------------------------------------------------- the loop


def _meta(cfg: TrainConfig, trainer: Trainer, train: data_lib.TokenData, cursor: int,
          drafter_cfg: dict[str, Any]) -> dict[str, Any]:
    return {
        "format": FORMAT_VERSION,
        "config": cfg.to_dict(),
        "drafter_config": drafter_cfg,
        "data_cursor": int(cursor),
        "data_fingerprint": train.fingerprint(),
        "data_rows": len(train),
        "time": time.time(),
    }


def train(
    cfg: TrainConfig,
    output_dir: str,
    *,
    resume: bool = False,
    force_resume: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = _stderr,
    on_step: Callable[[int, bool], None] | None = None,
    stop_at: int | None = None,
) -> RunResult:
    """Runs (or resumes) a training run into ``output_dir``; see the module doc for the layout.

    ``on_step(step, saved)`` is called after every step (``saved``: a checkpoint of that step is
    on disk). ``stop_at`` ends the loop early at that step (after its checkpoint), as an
    interruption would, without the final export.
    """
    output_dir = prepare_output(output_dir)
    with RunLock(output_dir):  # one run per folder; released on return, on an error, or by the OS on a kill
        for name in ("drafter", "best_drafter"):  # refused now, not after the whole run
            check_overwritable(os.path.join(output_dir, name), "export folder")
        ckpt = TrainCheckpointer(os.path.join(output_dir, "checkpoints"), keep_last=cfg.keep_last,
                                 keep_best=cfg.keep_best, best_metric="eval_tau", async_save=cfg.async_checkpoint,
                                 log=log)
        try:
            return _train(cfg, output_dir, ckpt, resume, force_resume, progress, log, on_step, stop_at)
        finally:
            ckpt.close()


def _check_config(meta: dict[str, Any], cfg: TrainConfig, where: str, force: bool, log) -> None:
    diff = config_diff(meta.get("config") or {}, cfg.to_dict())
    if diff:
        msg = f"{where}: the checkpoint was written with a different config ({'; '.join(diff)})"
        if not force:
            raise TrainingError(msg + "; pass --force-resume to continue with the new config anyway")
        log(f"warning: {msg}; continuing because of --force-resume")


def _check_resume(cfg: TrainConfig, ckpt: TrainCheckpointer, force: bool, log) -> None:
    """Refuses early (before loading any model) when the newest checkpoint's config differs."""
    step = ckpt.latest_step()
    try:
        meta = ckpt.read_meta(step)
    except CheckpointError:
        return  # damaged: the restore falls back and checks the step it uses
    _check_config(meta, cfg, ckpt.step_dir(step), force, log)


def _train(cfg, output_dir, ckpt, resume, force_resume, progress, log, on_step, stop_at) -> RunResult:
    existing = ckpt.steps()
    if existing and not resume:
        raise TrainingError(
            f"{output_dir}: holds checkpoints up to step {existing[-1]}; pass --resume to continue "
            "or choose a new --output"
        )
    if resume and existing:
        _check_resume(cfg, ckpt, force_resume, log)
    elif resume:
        log(f"resume: no checkpoint in {ckpt.directory}; starting from step 0")

    target, drafter = build_models(cfg, log)
    train_data, held = build_data(cfg, target, drafter, output_dir, log)
    mesh = make_run_mesh(cfg)
    trainer = Trainer(
        drafter, None if cfg.precompute_features else target, optim=cfg.optim, objective=cfg.objective,
        num_anchors=cfg.num_anchors, seed=cfg.seed, compute_dtype=cfg.compute_dtype, freeze=cfg.freeze, mesh=mesh,
    )
    drafter_cfg = drafter.config.to_hf_dict()
    stream = data_lib.BatchStream(train_data, cfg.batch_size, cfg.data_seed)
    eval_batches = _eval_batches(cfg, held, trainer.data_parallel)

    start, cursor, resumed_from = 0, 0, None
    best_tau = None
    if resume and ckpt.steps():
        abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), trainer.state,
                                trainer.state_shardings())
        start, state, meta = ckpt.restore(abstract)
        if start != existing[-1]:
            _check_config(meta, cfg, ckpt.step_dir(start), force_resume, log)
        if meta.get("data_fingerprint") != train_data.fingerprint():
            msg = (f"{ckpt.step_dir(start)}: the training data differ from the data the checkpoint was written with "
                   f"({meta.get('data_rows')} rows then, {len(train_data)} now)")
            if not force_resume:
                raise TrainingError(msg + "; pass --force-resume to continue anyway")
            log(f"warning: {msg}; continuing because of --force-resume")
        trainer.set_state(state)
        cursor = int(meta.get("data_cursor", start))
        resumed_from = start
        best_tau = (meta.get("metrics") or {}).get("best_eval_tau")
        log(f"resume: step {start} from {ckpt.step_dir(start)} (data cursor {cursor})")
    with atomic_file(os.path.join(output_dir, "config.json")) as tmp, open(tmp, "w") as f:
        json.dump(cfg.to_dict(), f, indent=2)

    writer = MetricsWriter(output_dir, resume_step=start if resumed_from is not None else None,
                           tensorboard=cfg.tensorboard)
    history: list[dict[str, Any]] = []
    last_eval = None
    end = cfg.steps if stop_at is None else min(cfg.steps, stop_at)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc=cfg.name, dynamic_ncols=True, file=sys.stderr)
    t_window, steps_window = time.perf_counter(), 0
    try:
        for step in range(start + 1, end + 1):
            sums, info = trainer.step(stream.batch(cursor))
            cursor += 1
            steps_window += 1
            if step % cfg.log_every == 0 or step == cfg.steps or step == end:
                metrics = to_host(sums.metrics(cfg.objective, trainer.has_confidence))
                info_h = to_host(info)
                elapsed = time.perf_counter() - t_window
                rec = _record(step, "train", metrics, lr=info_h["lr"], grad_norm=info_h["grad_norm"],
                              tokens_per_s=steps_window * tokens_per_step / max(elapsed, 1e-9),
                              epoch=cursor / stream.batches_per_epoch)
                if not math.isfinite(rec["loss"]):
                    raise TrainingError(f"step {step}: the loss is {rec['loss']} (lower the learning rate?)")
                writer.write(rec)
                history.append(rec)
                t_window, steps_window = time.perf_counter(), 0
                if bar is not None:
                    bar.set_postfix(loss=f"{rec['loss']:.4f}", tau=f"{rec['tau_probabilistic']:.3f}",
                                    lr=f"{rec['lr']:.2e}")
            eval_metrics = None
            if eval_batches and (step % cfg.eval_every == 0 or step == cfg.steps):
                eval_metrics = trainer.evaluate(eval_batches, seed=cfg.seed + 1)
                last_eval = _record(step, "eval", eval_metrics)
                writer.write(last_eval)
                history.append(last_eval)
                tau = last_eval["tau_probabilistic"]
                best_tau = tau if best_tau is None else max(best_tau, tau)
                log(f"eval step {step}: held-out tau {tau:.4f} (best {best_tau:.4f}), loss {last_eval['loss']:.4f}")
            saved = False
            if step % cfg.checkpoint_every == 0 or step == cfg.steps or step == end:
                metrics = {"best_eval_tau": best_tau} if best_tau is not None else {}
                if eval_metrics is not None:
                    metrics["eval_tau"] = last_eval["tau_probabilistic"]
                ckpt.save(step, trainer.state, _meta(cfg, trainer, train_data, cursor, drafter_cfg), metrics)
                if not cfg.async_checkpoint:
                    ckpt.wait()
                saved = True
            if bar is not None:
                bar.update(1)
            if on_step is not None:
                on_step(step, saved)
    finally:
        if bar is not None:
            bar.close()
        writer.close()
    ckpt.wait()
    final = end
    drafter_dir = best_dir = None
    if end == cfg.steps:
        drafter_dir = os.path.join(output_dir, "drafter")
        export_drafter(trainer.drafter(), drafter_dir, dtype=cfg.export_dtype)
        log(f"exported the final drafter to {drafter_dir}")
        best = ckpt.best_step()
        if best is not None:
            best_dir = os.path.join(output_dir, "best_drafter")
            export_checkpoint(cfg, trainer, ckpt, best, best_dir)
            log(f"exported the best drafter (step {best}, held-out tau "
                f"{ckpt.read_meta(best)['metrics']['eval_tau']:.4f}) to {best_dir}")
    return RunResult(output_dir, final, history, last_eval, drafter_dir, best_dir, resumed_from)


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
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), trainer.state,
                            trainer.state_shardings())
    out_dir = check_overwritable(out_dir)
    current = trainer.state
    _, state, _ = ckpt.restore(abstract, step=step)
    trainer.set_state(state)
    try:
        export_drafter(trainer.drafter(), out_dir, dtype=cfg.export_dtype)
    finally:
        trainer.state = current
    return out_dir


def export_run(cfg: TrainConfig, output_dir: str, which: str, out_dir: str | None = None,
               log: Callable[[str], None] = _stderr) -> str:
    """Exports checkpoint ``which`` (``latest``, ``best`` or a step number) of a run to DeepSpec format.

    ``out_dir`` (default ``OUTPUT/export_stepN``) may only be a new or empty folder or one sparkjax
    wrote; anything else is refused before any work."""
    if out_dir is not None:
        check_overwritable(out_dir, "--export-to")
    if not os.path.isdir(os.path.join(os.path.abspath(output_dir), "checkpoints")):
        raise CheckpointError(f"{os.path.abspath(output_dir)}: no checkpoints folder (not a training run?)")
    ckpt = TrainCheckpointer(os.path.join(os.path.abspath(output_dir), "checkpoints"), keep_last=cfg.keep_last,
                             keep_best=cfg.keep_best, log=log)
    try:
        if which == "latest":
            step = ckpt.latest_step()
        elif which == "best":
            step = ckpt.best_step()
        else:
            try:
                step = int(which)
            except ValueError:
                raise ArgumentError(f"--export: expected 'latest', 'best' or a step number, got {which!r}") from None
        if step is None:
            raise CheckpointError(f"{ckpt.directory}: no {which} checkpoint to export")
        target, drafter = build_models(cfg, log)
        trainer = Trainer(drafter, target, optim=cfg.optim, objective=cfg.objective, num_anchors=cfg.num_anchors,
                          seed=cfg.seed, compute_dtype=cfg.compute_dtype, freeze=cfg.freeze)
        out = out_dir or os.path.join(output_dir, f"export_step{step}")
        check_overwritable(out, "--export-to")
        export_checkpoint(cfg, trainer, ckpt, step, out)
        log(f"exported step {step} to {out}")
        return out
    finally:
        ckpt.close()
