"""Deprecated alias of :mod:`sparkjax.engine` (generation moved to the ``sparkjax.engine`` package).

Its public names still work with their old signatures (the old per-stage wrappers and positional
validators are gone: use ``sparkjax.engine.round`` and ``sparkjax.engine.api.validate``); new code should use
``sparkjax.engine`` (``generate``, ``launch``, ``stream``, the method objects ``AR`` / ``Chain`` / ``Tree``
and ``parse_method``). Monkeypatching a name here does not reach the engine: patch the engine module
that uses it (``sparkjax.engine.api``).
"""

from __future__ import annotations

import jax  # noqa: F401 - re-exported (tests patch decode.jax.devices)

from .engine.api import (  # noqa: F401 - re-exported names
    MAX_SEED,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    GenerateOutput,
    NumericalError,
    Prompts,
    _buf_len,
    _device_args,
    _gib,
    _instrumented,
    _itemsize,
    _key,
    _outputs,
    available_memory,
    check_lengths,
    check_memory,
    check_seed,
    check_temperature,
    eos_array,
    estimate_memory,
    generate,
    launch,
    prepare_prompts,
    raise_if_nonfinite,
    required_cache_size,
    stream,
    validate,
)
from .engine.checks import MAX_SLOTS, bucket, check_int, check_models  # noqa: F401 - re-exported names
from .engine.checks import describe as _describe  # noqa: F401
from .engine.checks import is_int as _is_int  # noqa: F401
from .engine.methods import (  # noqa: F401 - re-exported names
    CHAIN_METHODS,
    MARKOV_METHODS,
    METHODS,
    TREE_METHODS,
    Plan,
    available_methods,
    parse_method,
)
from .engine.programs import ar_program as _ar_program  # noqa: F401
from .engine.programs import prefill, spec_prefill  # noqa: F401 - re-exported names
from .engine.programs import spec_program as _spec_program  # noqa: F401
from .engine.programs import spec_start as _spec_start  # noqa: F401
from .engine.programs import spec_step as _spec_step  # noqa: F401
from .engine.programs import split_pair as _split_pair  # noqa: F401
from .engine.round import flag_nonfinite, spec_round  # noqa: F401 - re-exported names
from .engine.state import Proposal, SpecState  # noqa: F401 - re-exported names

