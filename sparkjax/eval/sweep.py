"""The batch-size sweep (``python -m sparkjax.eval --batch-sizes 1,4,16,64``): throughput against batch size.

The selected prompts form one pool (the sets taken in turn), cycled to fill ``ceil(N / B)`` batches of exactly
B sequences (:data:`FILL_TEXT`), each timed by :mod:`sparkjax.eval.runner` with no stage pass, batch j with
``seed + j``. Throughput = output tokens / decode seconds summed over the measured batches; greedy runs also
report ``same_as_ar`` and ``same_across_batches`` (against the smallest size).
"""

from __future__ import annotations

import math
import statistics

from tqdm.auto import tqdm

from . import metrics
from .records import Record, Sweep, SweepRow, is_reference, make_record, measured, same_share
from .runner import time_batch

FILL_TEXT = ("prompts cycled to fill each batch: batch size B runs ceil(N / B) batches of B sequences, slot i of "
             "batch j holding prompt (j * B + i) mod N of the pool (the selected prompts, the sets taken in turn)")


def prompt_pool(selected: dict[str, list[tuple[int, int, list[int]]]]) -> list[tuple[str, int, int, list[int]]]:
    """The sweep's prompts, ``(dataset, index, line, ids)``, taking the sets in turn."""
    rows = list(selected.items())
    return [(name, *r[k]) for k in range(max((len(r) for _, r in rows), default=0)) for name, r in rows if k < len(r)]


def fill_batches(pool: list, size: int) -> list[list]:
    """``ceil(N / size)`` batches of exactly ``size`` entries: slot i of batch j is ``pool[(j * size + i) % N]``."""
    n = len(pool)
    return [[pool[(j * size + i) % n] for i in range(size)] for j in range(math.ceil(n / size))] if n else []


def run_sweep(units, sizes: tuple[int, ...], pool: list, *, seed: int, repeats: int, warmed: set, stop,
              roles: dict, records: list[Record], after_batch=None, progress: bool = True) -> None:
    """Times every method at every batch size, appending one record per (batch size, batch, method) to
    ``records`` once every method has run that batch (``roles``: each method's drafter folder and role).
    Raises :class:`~sparkjax.eval.runner.Stopped` / KeyboardInterrupt on Ctrl-C, the finished batches kept."""
    plan = [(b, j, batch) for b in sizes for j, batch in enumerate(fill_batches(pool, b))]
    bar = tqdm(plan, desc="batch-size sweep", unit="batch", disable=not progress)
    try:
        for size, j, entries in bar:
            stop.check()
            bar.set_postfix_str(f"batch size {size}")
            timed = time_batch(units, [e[3] for e in entries], seed=seed + j, repeats=repeats, stages=False,
                               warmed=warmed, stop=stop)
            done = []
            for _, mc in units:
                d_dir, role = roles[mc]
                rec = make_record("all", j, seed + j, mc, [e[1:] for e in entries], timed[mc], drafter=d_dir,
                                  drafter_role=role, batch_size=size)
                for slot, (s, entry) in enumerate(zip(rec.samples, entries, strict=True)):
                    s.dataset, s.slot = entry[0], slot
                done.append(rec)
            records.extend(done)  # a batch counts once every method has run it
            if after_batch is not None:
                after_batch()
    finally:
        bar.close()


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 and tokens > 0 else math.nan


def _ratio(a: float, b: float | None) -> float:
    return a / b if b and measured(b) and measured(a) else math.nan


def summarize_sweep(records: list[Record], labels: list[str], sizes: tuple[int, ...],
                    temperature: float) -> list[SweepRow]:
    """One row per (batch size, method), in batch-size then method order (see the module docstring)."""
    rows: list[SweepRow] = []
    first = {}  # (label, dataset, index) -> output of the first batch that prompt ran in, at the smallest size
    for r in sorted(records, key=lambda r: (r.batch_size, r.batch)):
        for s in r.samples:
            first.setdefault((r.label, s.dataset, s.index), s.output_ids)
    ar_out = {(r.batch_size, r.batch, s.slot): s.output_ids for r in records if is_reference(r.label)
              for s in r.samples}
    for size in sizes:
        ar_rate = ar_best = None
        for label in labels:
            rr = [r for r in records if r.batch_size == size and r.label == label]
            if not rr:
                continue
            timed = [r for r in rr if r.timed]
            med = [r for r in timed if measured(r.decode_seconds)]
            best = [r for r in timed if measured(r.decode_seconds_min)]
            rate = _rate(sum(r.output_tokens for r in med), sum(r.decode_seconds for r in med))
            rate_best = _rate(sum(r.output_tokens for r in best), sum(r.decode_seconds_min for r in best))
            if is_reference(label):
                ar_rate, ar_best = rate, rate_best
            spreads = [r.run_spread for r in timed if measured(r.run_spread, allow_zero=True)]
            samples = [s for r in rr for s in r.samples]
            lens = [s.acceptance_lengths for s in samples]
            same_ar = same_batches = None
            if temperature == 0:
                same_batches = same_share((s.output_ids, first[(label, s.dataset, s.index)]) for s in samples)
                if not is_reference(label):
                    same_ar = same_share((s.output_ids, ar_out.get((size, r.batch, s.slot))) for r in rr
                                         for s in r.samples)
            r0 = rr[0]
            rows.append(SweepRow(
                batch_size=size, label=label, method=r0.method, budget=r0.budget, drafter=r0.drafter,
                drafter_role=r0.drafter_role, n_batches=len(rr), n_sequences=len(samples),
                output_tokens=sum(s.output_tokens for s in samples), rounds=sum(map(len, lens)),
                tau_pooled=metrics.tau_pooled(lens),
                decode_seconds=sum(r.decode_seconds for r in med), tokens_per_s=rate, tokens_per_s_best=rate_best,
                speedup=_ratio(rate, ar_rate), speedup_best=_ratio(rate_best, ar_best),
                timing_spread=statistics.median(spreads) if spreads else math.nan,
                timing_spread_max=max(spreads) if spreads else math.nan,
                timed_batches=len(timed), unmeasured_batches=len(timed) - len(med),
                same_as_ar=same_ar, same_across_batches=same_batches,
            ))
    return rows


def sweep_notes(rows: list[SweepRow]) -> list[str]:
    """Notes for greedy rows whose outputs changed with the batch or differ from ar's, and unmeasured batches."""
    notes = []
    for r in rows:
        tag = f"batch {r.batch_size}/{r.label}"
        if r.same_as_ar is not None and r.same_as_ar < 1:
            notes.append(f"{tag}: only {100 * r.same_as_ar:.0f}% of greedy outputs equal ar's at the same slot "
                         "(greedy speculative decoding should reproduce them exactly)")
        if r.same_across_batches is not None and r.same_across_batches < 1:
            notes.append(f"{tag}: only {100 * r.same_across_batches:.0f}% of greedy outputs equal the same "
                         "prompt's output at the smallest batch size (the batch should change the speed only)")
        if r.unmeasured_batches:
            notes.append(f"{tag}: decode time not measured for {r.unmeasured_batches} of {r.timed_batches} "
                         "batch(es) (the prefill-only runs took as long as the full runs); left out of tok/s")
    return notes


def sweep_block(records: list[Record], labels: list[str], sizes: tuple[int, ...], pool: list,
                temperature: float) -> Sweep:
    """The :class:`~sparkjax.eval.records.Sweep` of a run: settings, rows and raw records."""
    per_set: dict[str, int] = {}
    for name, *_ in pool:
        per_set[name] = per_set.get(name, 0) + 1
    return Sweep(batch_sizes=list(sizes), rows=summarize_sweep(records, labels, sizes, temperature), records=records,
                 fill="cycled", fill_text=FILL_TEXT, prompts=len(pool), prompts_per_set=per_set,
                 pool=[[name, index] for name, index, _, _ in pool],
                 batches={str(b): math.ceil(len(pool) / b) if pool else 0 for b in sizes},
                 throughput="output tokens / decode seconds, summed over the measured batches of a batch size "
                            "(median times; best: min times); speedup = throughput / ar's at the same batch size")
