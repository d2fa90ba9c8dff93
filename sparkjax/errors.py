"""The exceptions sparkjax raises for anything a user can get wrong; each message names the offending file, key,
shape or argument. All derive from :class:`SparkjaxError` and from the closest built-in exception.
"""

from __future__ import annotations


class SparkjaxError(Exception):
    """Base class of every error sparkjax raises on bad input."""


class ConfigError(SparkjaxError, ValueError):
    """A config file or config value is missing, malformed or unsupported."""


class CheckpointError(SparkjaxError, ValueError):
    """A weights file is missing, truncated, or holds missing / unexpected / mis-shaped tensors."""


class IncompatiblePairError(SparkjaxError, ValueError):
    """A drafter does not fit the target it is paired with."""


class ArgumentError(SparkjaxError, ValueError):
    """A function argument is out of range or inconsistent with the others."""


class CostTableError(SparkjaxError, ValueError):
    """A cost table file (``method='auto'``) is unreadable or was measured for another device or shape."""


class NumericalError(SparkjaxError, FloatingPointError):
    """The target produced non-finite logits (NaN or Inf) during a generation: its output is garbage."""


class WriteError(CheckpointError):
    """An output could not be written (read-only folder, full disk, ...); nothing was changed. ``reason`` is the
    underlying cause alone (``strerror`` or the exception's name), without the path."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or message


class EvalError(SparkjaxError, ValueError):
    """A bad evaluation setting: an unknown method, a budget for chain-only methods, an unreadable results file."""


class DatasetError(EvalError):
    """A prompt set that is missing, unreadable, empty or malformed (the message names the file and line)."""


class TokenizerError(EvalError):
    """A tokenizer that cannot be loaded or does not fit the target."""


class TrainingError(SparkjaxError, ValueError):
    """A bad training setting: a learning rate or step count that makes no sense, a resume that does not fit."""


class DataError(TrainingError):
    """Training data that is missing, unreadable or malformed (the message names the file and line)."""


class QueueFullError(SparkjaxError, RuntimeError):
    """A serving engine's waiting queue is at its bound (``queue_limit``): try again later."""


class EngineClosedError(SparkjaxError, RuntimeError):
    """A request was submitted to a serving engine that is closed (or closing)."""


class EngineFailure(SparkjaxError, RuntimeError):
    """A serving engine's device loop raised while the request was in flight (the message names the error);
    the engine starts a fresh pool for the requests after it."""


class GpuCompileError(SparkjaxError, RuntimeError):
    """A deviceless GPU compile cannot start here: this jax has no CUDA PJRT plugin (the message says which
    extra installs it)."""
