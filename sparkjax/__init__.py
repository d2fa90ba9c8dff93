"""sparkjax: SparklingTree speculative decoding in JAX / Flax NNX.

Public API: :func:`load_target`, :func:`load_drafter`, :func:`generate`, :func:`stream`, the
configs, the error classes and :mod:`sparkjax.demo` (the bundled trained demo pair). Lower-level
pieces live in ``sparkjax.nn``, ``sparkjax.cache``,
``sparkjax.draft``, ``sparkjax.tree``, ``sparkjax.decode`` and ``sparkjax.sampling``.
"""

import os as _os
import signal as _signal
import sys as _sys

if _sys.argv[:1] == ["-m"] and _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
    # ``python -m sparkjax[.eval]`` is starting: Ctrl-C while jax is imported and models load used to be
    # swallowed (a KeyboardInterrupt raised inside a garbage-collection callback is only printed) and the
    # run went on. Nothing has been written yet, so end the process at once; the CLIs install their own
    # handlers (the eval's writes partial results) once they reach their work. Library imports are untouched.
    def _interrupted_at_start(signum, frame):
        _sys.stderr.write("interrupted during start-up; nothing was written\n")
        _os._exit(130)

    _signal.signal(_signal.SIGINT, _interrupted_at_start)

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
