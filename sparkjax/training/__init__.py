"""Joint retraining of DSpark drafters with optax (see ``train/README.md``).

Pieces, from the bottom up:

* :mod:`.anchors` -- anchor sampling (from explicit uniforms or a key), block inputs, positions,
  the dense training mask, labels and the eval mask;
* :mod:`.loss` -- the DSpark objective (CE + L1 + confidence BCE, decayed weights) and its metrics;
* :mod:`.forward` -- target features on the fly, the drafter over all blocks, the batch loss;
* :mod:`.optim` -- AdamW + warmup / cosine or linear decay + clipping;
* :mod:`.trainer` -- jitted train / eval steps over ``nnx.split`` state, data parallel on a mesh;
* :mod:`.data` -- JSONL conversations (chat template, assistant loss mask) or token ids, synthetic
  target-greedy data, packing / padding, resumable batch order;
* :mod:`.models` -- continue a DeepSpec drafter (e.g. block 7 -> 16) or build a new one;
* :mod:`.fit` -- the one training loop (:func:`fit`): run lock, resume, orbax checkpoints, metrics,
  eval, stopping (time limit, SIGINT / SIGTERM), exports, for any :class:`Task`;
* :mod:`.loop` -- the drafter's task (:class:`DrafterTask`, :func:`train`); :mod:`.lm` -- the target
  LM's (:class:`~.lm.LMTask`, :func:`~.lm.train_lm`); :mod:`.cli` -- ``train/train.py``.
"""

from ..errors import DataError, TrainingError
from .anchors import Blocks, anchor_candidates, anchors_from_uniforms, build_blocks, sample_anchors
from .config import TrainConfig
from .data import BatchStream, TokenData, load_jsonl, synthetic_data
from .fit import LoopSettings, RunResult, Task, fit
from .forward import TrainOutputs, batch_loss, drafter_outputs, target_features
from .loop import DrafterTask, export_run, train
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
