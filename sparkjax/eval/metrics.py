"""Metric definitions, as pure functions over plain Python numbers (no JAX).

Acceptance length (tau) = accepted drafts + 1: ``tau_pooled`` (DeepSpec's: over all rounds) and
``tau_per_response`` (DDTree's: mean of per-response means). ``accept_rate@k``: the fraction of rounds that
accepted at least k drafts. TPOT = decode seconds / output tokens; speedup = TPOT(ar) / TPOT(method). A decode
time that is not positive is "not measured" (None), never 0.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence


def tau_pooled(acceptance_lengths: Iterable[Sequence[int]]) -> float:
    """Sum of all acceptance lengths / number of rounds (NaN when there is no round)."""
    flat = [int(a) for row in acceptance_lengths for a in row]
    return sum(flat) / len(flat) if flat else math.nan


def tau_per_response(acceptance_lengths: Iterable[Sequence[int]]) -> float:
    """Mean over responses (with at least one round) of the response's mean acceptance length."""
    means = [sum(row) / len(row) for row in acceptance_lengths if len(row)]
    return sum(means) / len(means) if means else math.nan


def accept_rates(accepted_per_depth: Iterable[Sequence[int]], rounds: Iterable[int], depth: int) -> list[float]:
    """``accept_rate@k`` for k = 1..depth from per-response counts of rounds that accepted depth k."""
    hits = [0] * depth
    total = 0
    for row, r in zip(accepted_per_depth, rounds, strict=True):
        total += int(r)
        for d in range(min(depth, len(row))):
            hits[d] += int(row[d])
    return [h / total if total else math.nan for h in hits]


def tpot(decode_seconds: float | None, output_tokens: int) -> float:
    """Seconds per output token (NaN without tokens or without a measured, positive decode time)."""
    if decode_seconds is None or not (decode_seconds > 0) or output_tokens <= 0:
        return math.nan
    return decode_seconds / output_tokens


def mean_tpot(decode_seconds: Sequence[float], output_tokens: Sequence[int]) -> float:
    """The mean over timed units (responses, or batches when batching) of their TPOT, as upstream averages it."""
    values = [tpot(s, n) for s, n in zip(decode_seconds, output_tokens, strict=True) if n > 0]
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def speedup(tpot_ar: float, tpot_method: float) -> float:
    """TPOT(ar) / TPOT(method): how many times faster than the target alone."""
    if tpot_ar is None or tpot_method is None or not (tpot_method > 0) or not (tpot_ar > 0):
        return math.nan
    return tpot_ar / tpot_method


def decode_seconds(run_seconds: Sequence[float], prefill_seconds: Sequence[float]) -> float | None:
    """Decode time of one timed unit: median full run - median prefill-only run (None when not positive)."""
    if not run_seconds or not prefill_seconds:
        return None
    d = statistics.median(run_seconds) - statistics.median(prefill_seconds)
    return d if d > 0 else None


def decode_seconds_min(run_seconds: Sequence[float], prefill_seconds: Sequence[float]) -> float | None:
    """The best-case decode time: fastest full run - fastest prefill-only run (None when not positive)."""
    if not run_seconds or not prefill_seconds:
        return None
    d = min(run_seconds) - min(prefill_seconds)
    return d if d > 0 else None


def rate(tpot_seconds: float) -> float:
    """Tokens per second = 1 / TPOT (NaN for a TPOT that is not a positive number)."""
    return 1.0 / tpot_seconds if isinstance(tpot_seconds, int | float) and tpot_seconds > 0 else math.nan


def stage_ms_per_round(stage_seconds: Sequence[dict[str, float]], iterations: Sequence[int]) -> dict[str, float]:
    """Per-stage milliseconds per round: summed stage seconds / summed rounds (loop iterations)."""
    n = sum(int(i) for i in iterations)
    names: list[str] = []
    for s in stage_seconds:
        names += [k for k in s if k not in names]
    if not n:
        return {k: math.nan for k in names}
    return {k: 1000.0 * sum(s.get(k, 0.0) for s in stage_seconds) / n for k in names}
