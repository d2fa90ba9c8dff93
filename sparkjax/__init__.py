"""sparkjax: SparklingTree speculative decoding in JAX / Flax NNX.

Public API: the loaders and savers, :func:`generate`, :func:`stream`, the configs, the error classes,
:class:`Options`, the method objects (read from names by :func:`parse_method`), :func:`profile_costs`,
:func:`required_cache_size` and :mod:`sparkjax.demo` (the bundled trained demo pair). Lower-level pieces live in
``sparkjax.engine``, ``sparkjax.io``, ``sparkjax.nn``, ``sparkjax.cache``, ``sparkjax.tree`` and ``sparkjax.sampling``.
"""

from . import _startup

_startup.install()  # Ctrl-C while a ``python -m sparkjax...`` entry point imports: see _startup

from . import demo
from .config import DrafterConfig, Qwen3Config
from .engine import (
    AR,
    METHODS,
    Auto,
    AutoMemory,
    Chain,
    CostTable,
    GenerateOutput,
    Options,
    PCTree,
    Tree,
    generate,
    load_cost_table,
    parse_method,
    profile_costs,
    required_cache_size,
    stream,
)
from .errors import (
    ArgumentError,
    CheckpointError,
    ConfigError,
    CostTableError,
    IncompatiblePairError,
    NumericalError,
    SparkjaxError,
)
from .io.hf import load_drafter, load_target, save_drafter, save_target

__version__ = "0.1.0"

__all__ = [
    "AR", "METHODS", "ArgumentError", "Auto", "AutoMemory", "Chain", "CheckpointError", "ConfigError", "CostTable",
    "CostTableError", "DrafterConfig", "GenerateOutput", "IncompatiblePairError", "NumericalError", "Options",
    "PCTree", "Qwen3Config", "SparkjaxError", "Tree", "demo", "generate", "load_drafter", "load_cost_table",
    "load_target", "parse_method", "profile_costs", "required_cache_size", "save_drafter", "save_target", "stream",
]

_startup.release()  # a Ctrl-C that came during the imports ends the process here (exit 130)
