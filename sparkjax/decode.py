"""Deprecated alias of :mod:`sparkjax.engine` (generation moved to the ``sparkjax.engine`` package).

Every name this module exported still works, with its old signature; new code should use
``sparkjax.engine`` (``generate``, ``launch``, ``stream``, the method objects ``AR`` / ``Chain`` / ``Tree``
and ``parse_method``). Monkeypatching a name here does not reach the engine: patch the engine module
that uses it (``sparkjax.engine.api``).
"""

from __future__ import annotations

import jax  # noqa: F401 - re-exported (tests patch decode.jax.devices)

from .engine import round as _round
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


def make_plan(target, drafter, method: str, budget, top_c, widths, normalization, sampling: bool) -> Plan | None:
    """The static :class:`Plan` of ``method`` (a name) with these options for the pair (None for ``ar``)."""
    spec = parse_method(method, budget=budget, top_c=top_c, widths=widths, normalization=normalization)
    return spec.plan(target, drafter, sampling)


def _validate(target, drafter, prompt_ids, method, max_new_tokens, eos_token_ids, temperature, cache_size,
              budget, top_c, widths, normalization, prompt_width=None, capacity=None, seed=0):
    """The old positional validation: ``(prompts, eos, temperature, plan, size, buf_len, seed)``."""
    run = validate(target, drafter, prompt_ids, method=method, budget=budget, top_c=top_c, widths=widths,
                   normalization=normalization, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids,
                   temperature=temperature, seed=seed, cache_size=cache_size, prompt_width=prompt_width,
                   capacity=capacity)
    return run.prompts, run.eos, run.temperature, run.plan, run.cache_size, run.buf_len, run.seed


def _prepare(target, drafter, prompt_ids, method, max_new_tokens, eos_token_ids, temperature, cache_size,
             budget, top_c, widths, normalization, prompt_width=None):
    """The old positional validation's first five results: ``(prompts, eos, temperature, plan, size)``."""
    return _validate(target, drafter, prompt_ids, method, max_new_tokens, eos_token_ids, temperature, cache_size,
                     budget, top_c, widths, normalization, prompt_width)[:5]


def stage_draft(target, drafter, state):
    return _round.draft(target, drafter, state, plan=None)


def stage_expand(drafter, state, blk, plan, temperature, key):
    return _round.expand(None, drafter, state, blk, temperature, key, plan=plan)


def stage_verify(target, state, prop, plan):
    """The old verify stage: ``(logits, features, cache, tokens)``."""
    ver = _round.verify(target, None, state, prop, plan=plan)
    return ver.logits, ver.features, ver.cache, ver.tokens


def stage_commit(drafter, state, prop, verified, plan, max_new, eos, temperature, key):
    """The old commit stage, taking verify's ``(logits, features, cache, tokens)``."""
    ver = _round.Verified(*verified)
    return _round.accept_and_commit(None, drafter, state, prop, ver, max_new, eos, temperature, key, plan=plan)


