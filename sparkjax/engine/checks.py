"""Argument-check primitives shared by the engine's modules (counts, descriptions, the model types).

Every user mistake raises :class:`~sparkjax.errors.ArgumentError` whose message starts with the
argument's name (a mismatched target / drafter pair: :class:`~sparkjax.errors.IncompatiblePairError`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ..errors import ArgumentError
from ..nn.drafter import Drafter
from ..nn.qwen3 import Qwen3
from ..pairing import check_pair

MAX_SLOTS = 2**30  # cache slots, prompt width and output capacity are int32 positions on device
MIN_TEMPERATURE = 1e-6  # a positive temperature below this overflows logits / T in float32
MAX_TEMPERATURE = 1e4  # above this every distribution is uniform to float32 precision
MAX_SEED = 2**63  # seeds are int64 on the device: Python / numpy ints in [0, MAX_SEED)


def bucket(n: int, minimum: int = 16) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(int(n), minimum)
    return 1 << (n - 1).bit_length()


def is_int(x: Any) -> bool:
    """An int or numpy integer, not a bool (True is not a count)."""
    return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)


def describe(x: Any) -> str:
    """``type value`` for a short plain value, the type alone for anything else (a model, an array)."""
    if not isinstance(x, int | float | complex | str | bytes | list | tuple | np.generic | type(None)):
        shape = getattr(x, "shape", None)
        return type(x).__name__ + (f" of shape {list(shape)}" if shape is not None else "")
    try:
        r = repr(x)
    except Exception:  # noqa: BLE001 - an object whose repr fails
        return type(x).__name__
    if len(r) > 60:
        r = r[:57] + "..."
    return f"{type(x).__name__} {r}"


def check_int(name: str, value: Any, *, minimum: int = 1, maximum: int | None = None, unit: str = "") -> int:
    """``value`` as an int; ArgumentError naming ``name`` for another type (a bool, a float, a string)
    or a value outside ``[minimum, maximum]``."""
    if not is_int(value):
        what = f"an integer{' ' + unit if unit else ''}"
        raise ArgumentError(f"{name}: expected {what}, got {describe(value)} (a type problem, not a size)")
    v = int(value)
    if v < minimum:
        raise ArgumentError(f"{name}: must be >= {minimum}, got {v}")
    if maximum is not None and v > maximum:
        raise ArgumentError(f"{name}: must be <= {maximum}, got {v}")
    return v


def check_seed(seed: Any) -> int:
    """A seed is an int (Python or numpy, not a bool) in ``[0, 2**63)``."""
    if not is_int(seed):
        raise ArgumentError(f"seed: expected an integer in [0, 2**63), got {describe(seed)}")
    s = int(seed)
    if not 0 <= s < MAX_SEED:
        raise ArgumentError(f"seed: {s} is outside [0, 2**63)")
    return s


def check_prompt(ids: Any, vocab_size: int | None, *, name: str = "prompt_ids",
                 max_tokens: int | None = None) -> list[int]:
    """One prompt's token ids as a list of Python ints: a list / tuple of ints or a 1-D integer array, not empty,
    at most ``max_tokens`` long (None: no limit), every id in ``[0, vocab_size)`` (None: unchecked). ArgumentError
    naming ``name`` (``name[j]`` for the id at ``j``) otherwise."""
    if isinstance(ids, np.ndarray | jax.Array) or (hasattr(ids, "__array__") and not isinstance(ids, Sequence)):
        arr = np.asarray(ids)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ArgumentError(f"{name}: expected a flat sequence of integer token ids, got shape "
                                f"{list(arr.shape)} of {arr.dtype}")
        out = arr.tolist()
    elif isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
        raise ArgumentError(f"{name}: expected a list of integer token ids, got {describe(ids)}")
    else:
        for j, x in enumerate(ids):
            if not is_int(x):
                raise ArgumentError(f"{name}[{j}]: expected an integer token id, got {describe(x)}")
        out = [int(x) for x in ids]
    if not out:
        raise ArgumentError(f"{name}: empty prompt")
    if max_tokens is not None and len(out) > max_tokens:
        raise ArgumentError(f"{name}: {len(out)} tokens exceed the limit of {max_tokens} prompt tokens "
                            "(max_prompt_tokens)")
    if vocab_size is not None and not 0 <= min(out) <= max(out) < vocab_size:
        bad = next(x for x in out if not 0 <= x < vocab_size)
        raise ArgumentError(f"{name}: token id {bad} is outside [0, {vocab_size}) (the target's vocabulary)")
    return out


def check_int_list(name: str, values: Any) -> tuple[int, ...]:
    """A flat list / tuple / integer array of non-negative ints as a tuple of Python ints."""
    if isinstance(values, np.ndarray | jax.Array):
        arr = np.asarray(values)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ArgumentError(f"{name}: expected a flat sequence of ints, got shape {list(arr.shape)} of {arr.dtype}")
        items = arr.tolist()
    elif isinstance(values, list | tuple):
        items = list(values)
    else:
        raise ArgumentError(f"{name}: expected a list or tuple of ints (one per depth), got {describe(values)}")
    out = []
    for i, x in enumerate(items):
        if not is_int(x):
            raise ArgumentError(f"{name}[{i}]: expected an integer, got {describe(x)}")
        if x < 0:
            raise ArgumentError(f"{name}[{i}]: must be >= 0, got {int(x)}")
        out.append(int(x))
    return tuple(out)


def check_models(target: Any, drafter: Any) -> None:
    """``target`` must be a Qwen3 model and ``drafter`` a Drafter (or None)."""
    if not isinstance(target, Qwen3):
        hint = " (the drafter was passed as the target?)" if isinstance(target, Drafter) else ""
        raise ArgumentError(f"target: expected a sparkjax.nn.qwen3.Qwen3 model (sparkjax.load_target), got "
                            f"{describe(target)}{hint}")
    if drafter is not None and not isinstance(drafter, Drafter):
        hint = " (the target was passed as the drafter?)" if isinstance(drafter, Qwen3) else ""
        raise ArgumentError(f"drafter: expected a sparkjax.nn.drafter.Drafter (sparkjax.load_drafter) or None, "
                            f"got {describe(drafter)}{hint}")


def check_drafter(target, drafter, method) -> None:
    """The drafter fits the target (the same pair check as ``load_drafter(target=)``) and the method
    (a :class:`~sparkjax.engine.methods.Method`: its ``name`` and whether it needs a Markov head)."""
    if drafter is None:
        raise ArgumentError(f"drafter: method {method.name!r} needs a drafter (use method='ar' without one)")
    check_pair(target, drafter)
    dc = drafter.config
    if method.needs_markov and not dc.has_markov:
        raise ArgumentError(f"method: {method.name!r} needs a drafter with a Markov head; this {dc.kind} drafter "
                            "has none (use 'dflash' or 'ddtree')")


def check_temperature(temperature: float) -> float:
    """0 (greedy) or a real number in ``[MIN_TEMPERATURE, MAX_TEMPERATURE]`` (finite in float32)."""
    if isinstance(temperature, bool | np.bool_) or not isinstance(temperature, int | float | np.integer | np.floating):
        raise ArgumentError(f"temperature: expected a real number, got {describe(temperature)}")
    try:
        t = float(temperature)
    except OverflowError:
        raise ArgumentError(f"temperature: {temperature!r} is not finite in float32") from None
    if not np.isfinite(t) or t < 0:
        raise ArgumentError(f"temperature: must be finite and >= 0, got {temperature!r}")
    if t != 0 and not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
        raise ArgumentError(f"temperature: {t!r} is outside [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}] (or 0 for greedy): "
                            "logits / temperature would overflow or underflow in float32")
    return t


def check_top_p(top_p: float) -> float:
    """A real number in ``(0, 1]`` (1: off): top-p sampling keeps the smallest set of likeliest tokens whose
    probability reaches it."""
    if isinstance(top_p, bool | np.bool_) or not isinstance(top_p, int | float | np.integer | np.floating):
        raise ArgumentError(f"top_p: expected a real number in (0, 1], got {describe(top_p)}")
    try:
        p = float(top_p)
    except OverflowError:
        raise ArgumentError(f"top_p: must be in (0, 1] (1 = off), got {top_p!r}") from None
    if not 0 < p <= 1:  # NaN fails too
        raise ArgumentError(f"top_p: must be in (0, 1] (1 = off), got {top_p!r}")
    return p


def check_top_k(top_k: int) -> int:
    """An int ``>= 0`` (0: off): top-k sampling keeps the k likeliest tokens."""
    if not is_int(top_k) or int(top_k) < 0:
        raise ArgumentError(f"top_k: expected an int >= 0 (0 = off), got {describe(top_k)}")
    return min(int(top_k), 2**31 - 1)
