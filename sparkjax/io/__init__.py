"""Checkpoint I/O: every file format sparkjax reads or writes, in one package.

:mod:`.atomic` (crash-safe writers and the one overwrite rule), :mod:`.safetensors` (the validating reader, the
atomic writer, sharded folders), :mod:`.keymaps` (checkpoint names <-> NNX paths and layouts), :mod:`.hf`
(:func:`load_target`, :func:`load_drafter`, :func:`save_target`, :func:`save_drafter`) and :mod:`.checkpoint`
(orbax: :func:`save_model`, :func:`restore_model`, :class:`TrainCheckpointer`, imported on first use).
"""

from __future__ import annotations

from ..errors import WriteError
from .atomic import MARKER, atomic_dir, atomic_file, check_destination, is_sparkjax_output, recover
from .hf import (
    export_tensors,
    load_drafter,
    load_into,
    load_target,
    resolve_dtype,
    save_drafter,
    save_target,
)
from .keymaps import DRAFTER_KEYS, QWEN3_KEYS, Rule, param_keys
from .safetensors import SafetensorsFile, WeightFiles, write_safetensors

_ORBAX = ("save_model", "restore_model", "TrainCheckpointer")

__all__ = [
    "DRAFTER_KEYS", "MARKER", "QWEN3_KEYS", "Rule", "SafetensorsFile", "WeightFiles", "WriteError",
    "atomic_dir", "atomic_file", "check_destination", "export_tensors", "is_sparkjax_output", "load_drafter",
    "load_into", "load_target", "param_keys", "recover", "resolve_dtype", "save_drafter", "save_target",
    "write_safetensors", *_ORBAX,
]


def __getattr__(name: str):
    if name in _ORBAX:
        from . import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
