"""sparkjax: SparklingTree speculative decoding in JAX / Flax NNX.

Public API: :func:`load_target`, :func:`load_drafter`, :func:`generate`, :func:`stream`, the
configs, the error classes and :mod:`sparkjax.demo` (the bundled trained demo pair). Lower-level
pieces live in ``sparkjax.nn``, ``sparkjax.cache``,
``sparkjax.draft``, ``sparkjax.tree``, ``sparkjax.decode`` and ``sparkjax.sampling``.
"""

from . import _startup

_startup.install()  # Ctrl-C while a ``python -m sparkjax...`` entry point starts: see _startup

from . import demo
from .config import DrafterConfig, Qwen3Config
from .convert import load_drafter, load_target, save_drafter, save_target
from .decode import METHODS, GenerateOutput, NumericalError, generate, stream
from .errors import ArgumentError, CheckpointError, ConfigError, IncompatiblePairError, SparkjaxError

__version__ = "0.1.0"

__all__ = [
    "METHODS",
    "ArgumentError",
    "CheckpointError",
    "ConfigError",
    "DrafterConfig",
    "GenerateOutput",
    "IncompatiblePairError",
    "NumericalError",
    "Qwen3Config",
    "SparkjaxError",
    "demo",
    "generate",
    "load_drafter",
    "load_target",
    "save_drafter",
    "save_target",
    "stream",
]
