"""Joint retraining of DSpark drafters with optax, and target pre-training, through one loop (:func:`fit`);
see ``docs/training.md``."""

from ..errors import DataError, TrainingError
from .anchors import Blocks, anchor_candidates, anchors_from_uniforms, build_blocks, sample_anchors
from .config import TrainConfig
from .data import BatchStream, TokenData, load_jsonl, synthetic_data
from .drafter import DrafterTask, export_run, train
from .fit import LoopSettings, RunResult, Task, fit
from .forward import TrainOutputs, batch_loss, drafter_outputs, target_features
from .loss import LossSums, Objective, dspark_loss_sums
from .models import init_drafter, load_drafter_for_training, new_drafter_config
from .optim import OptimConfig, make_optimizer, make_schedule
from .trainer import Trainer, eval_step, loss_and_grads, train_step

__all__ = [
    "BatchStream", "Blocks", "DataError", "DrafterTask", "LoopSettings", "LossSums", "Objective", "OptimConfig",
    "RunResult", "Task", "TokenData", "TrainConfig", "TrainOutputs", "Trainer", "TrainingError",
    "anchor_candidates", "anchors_from_uniforms", "batch_loss", "build_blocks", "drafter_outputs",
    "dspark_loss_sums", "eval_step", "export_run", "fit", "init_drafter", "load_drafter_for_training",
    "load_jsonl", "loss_and_grads", "make_optimizer", "make_schedule", "new_drafter_config", "sample_anchors",
    "synthetic_data", "target_features", "train", "train_step",
]
