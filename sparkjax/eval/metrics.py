"""Metric definitions, as pure functions over plain Python numbers (no JAX).

Acceptance length = the tokens a round committed (accepted drafts + 1, fewer in a round cut at EOS or the
token limit); tau is its mean: ``tau_pooled`` (DeepSpec's: over all rounds) and
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


def finite(x) -> bool:
    """A finite number (not a bool, None or NaN)."""
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def measured(x, *, allow_zero: bool = False) -> bool:
    """A measured, usable time, count or spread: a finite number > 0 (>= 0 with ``allow_zero``); None is not."""
    return finite(x) and (x >= 0 if allow_zero else x > 0)


def ratio(a, b) -> float:
    """``a / b`` when both are measured (:func:`measured`), else NaN: TPOT (seconds, tokens), tok/s (tokens,
    seconds), speedup (TPOT(ar), TPOT(method))."""
    return a / b if measured(a) and measured(b) else math.nan


def mean_tpot(decode_seconds: Sequence[float | None], output_tokens: Sequence[int]) -> float:
    """The mean over timed units (responses, or batches when batching) of their TPOT, as upstream averages it."""
    values = [ratio(s, n) for s, n in zip(decode_seconds, output_tokens, strict=True)]
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def decode_seconds(run_seconds: Sequence[float], prefill_seconds: Sequence[float], *,
                   best: bool = False) -> float | None:
    """Decode time of one timed unit: median full run - median prefill-only run (``best``: fastest - fastest);
    None when not positive."""
    if not run_seconds or not prefill_seconds:
        return None
    pick = min if best else statistics.median
    d = pick(run_seconds) - pick(prefill_seconds)
    return d if d > 0 else None


def stage_ms_per_round(stage_seconds: Sequence[dict[str, float]], iterations: Sequence[int]) -> dict[str, float]:
    """Per-stage milliseconds per round: summed stage seconds / summed rounds (loop iterations)."""
    n = sum(int(i) for i in iterations)
    names = list(dict.fromkeys(k for s in stage_seconds for k in s))
    return {k: 1000.0 * sum(s.get(k, 0.0) for s in stage_seconds) / n if n else math.nan for k in names}
