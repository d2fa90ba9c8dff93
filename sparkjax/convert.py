"""Alias of the checkpoint I/O names that used to live here; they now live in :mod:`sparkjax.io`.

Kept so that ``from sparkjax.convert import load_target`` (tests, scripts, the README) and the
training code keep working: the safetensors reader / writer (:mod:`sparkjax.io.safetensors`), the
key maps (:mod:`sparkjax.io.keymaps`), the HF loaders and savers (:mod:`sparkjax.io.hf`) and the
atomic writers (:mod:`sparkjax.io.atomic`).
"""

from .io.atomic import (  # noqa: F401 - re-exported names
    MARKER,
    WriteError,
    _umask,
    atomic_dir,
    atomic_file,
    check_destination,
    is_sparkjax_output,
    recover,
)
from .io.hf import (  # noqa: F401
    _require_model,
    export_tensors,
    load_drafter,
    load_into,
    load_target,
    resolve_dtype,
    save_drafter,
    save_target,
    source_of,
)
from .io.keymaps import (  # noqa: F401
    DRAFTER_KEYS,
    QWEN3_KEYS,
    Rule,
    _checkpoint_shape,
    _compile_rules,
    _to_checkpoint,
    _to_module,
    param_keys,
)
from .io.safetensors import (  # noqa: F401
    _FLOAT_DTYPES,
    _ST_DTYPES,
    _ST_NAMES,
    SafetensorsFile,
    WeightFiles,
    _all_finite,
    _non_finite_error,
    write_safetensors,
)
