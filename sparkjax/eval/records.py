"""The eval's typed results: per-sequence :class:`Sample`, per (batch, method) :class:`Record`, the per-set
summary :class:`Row`, and the batch-size sweep's :class:`SweepRow` and :class:`Sweep`; and the summaries.

Every class writes itself with ``to_dict`` (the field names of ``results.json`` and the CSV columns) and reads
itself back with ``from_dict``, which leaves out unknown keys and gives missing ones their default, so that an
older or hand-edited results file still loads. Derived numbers (a record's decode seconds, spread and output
tokens) are properties computed from the raw timings, never stored twice.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import statistics
from typing import Any

from ..bench.timing import Stats
from ..engine.names import parse_method
from ..engine.round import STAGES
from ..errors import ArgumentError
from . import metrics
from .metrics import measured, ratio

_NAN = math.nan


def _from_dict(cls, d: dict[str, Any]):
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})


@functools.cache
def is_reference(label: str) -> bool:
    """Whether ``label`` names the method every speedup and exactness check is measured against: the one that
    drafts nothing (``ar``), as its method object says. A name the engine does not know is not the reference."""
    try:
        return not parse_method(label).speculative
    except ArgumentError:
        return False


@dataclasses.dataclass
class Sample:
    """One sequence of a batch: its prompt (``index`` in its set, 1-based file ``line``), its output ids and
    per-round acceptance lengths (root / bonus included), the rounds reaching each draft depth, and for method
    ``auto`` each round's verified size. ``dataset`` and ``slot`` are set in a batch-size sweep only."""

    index: int
    output_ids: list[int]
    acceptance_lengths: list[int]
    accepted_per_depth: list[int] = dataclasses.field(default_factory=list)
    line: int = 0
    prompt_tokens: int = 0
    size_choices: list[str] | None = None
    dataset: str | None = None
    slot: int | None = None

    @property
    def output_tokens(self) -> int:
        return len(self.output_ids)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in dataclasses.asdict(self).items()
             if not (v is None and k in ("size_choices", "dataset", "slot"))}
        return {**d, "output_tokens": self.output_tokens, "rounds": len(self.acceptance_lengths)}

    from_dict = classmethod(_from_dict)


@dataclasses.dataclass
class Record:
    """One method's timed batch: what ran (``label`` = method and budget), its samples, the ``repeats`` full-run
    and prefill-only seconds, the loop iterations, and the instrumented stage pass (``stage``: seconds per stage,
    rounds; None when not run). ``batch_size`` is set in a batch-size sweep only."""

    dataset: str
    label: str
    method: str
    budget: int | None
    batch: int
    seed: int
    samples: list[Sample]
    run_seconds: list[float]
    prefill_seconds: list[float]
    loop_iterations: int
    stage: dict[str, Any] | None = None
    drafter: str | None = None
    drafter_role: str | None = None
    batch_size: int | None = None

    @property
    def decode_seconds(self) -> float | None:
        return metrics.decode_seconds(self.run_seconds, self.prefill_seconds)

    @property
    def decode_seconds_min(self) -> float | None:
        return metrics.decode_seconds(self.run_seconds, self.prefill_seconds, best=True)

    @property
    def run_spread(self) -> float | None:
        """(max - min) / median of the full runs (None for fewer than two runs)."""
        return Stats.of(self.run_seconds).spread if len(self.run_seconds) > 1 else None

    @property
    def output_tokens(self) -> int:
        return sum(s.output_tokens for s in self.samples)

    @property
    def timed(self) -> bool:
        """The batch had a decode step (a batch whose first token ended it has no decode time to speak of)."""
        return self.loop_iterations > 0

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if d["batch_size"] is None:
            del d["batch_size"]
        d.update(samples=[s.to_dict() for s in self.samples], decode_seconds=self.decode_seconds,
                 decode_seconds_min=self.decode_seconds_min, run_spread=self.run_spread,
                 output_tokens=self.output_tokens)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Record:
        rec = _from_dict(cls, {"budget": None, "seed": 0, "run_seconds": [], "prefill_seconds": [],
                               "loop_iterations": 0, "samples": [], "batch": 0, "method": d.get("label"), **d})
        rec.samples = [s if isinstance(s, Sample) else Sample.from_dict(s) for s in rec.samples]
        return rec


def make_record(dataset: str, batch: int, seed: int, m, chunk, timed, **extra) -> Record:
    """The :class:`Record` of method ``m`` (a :class:`~sparkjax.engine.Method`) on ``chunk`` (``(index, line, ids)``
    per sequence) from the runner's :class:`~sparkjax.eval.runner.Timed`; ``extra``: drafter, drafter_role,
    batch_size."""
    out = timed.output
    sizes = out.size_choices or [None] * len(out.tokens)
    samples = [Sample(index, toks, lens, hits, line, len(ids), sz)
               for (index, line, ids), toks, lens, hits, sz in zip(chunk, out.tokens, out.acceptance_lengths,
                                                                   out.accepted_per_depth, sizes, strict=True)]
    return Record(dataset, m.label, m.name, getattr(m, "budget", None), batch, seed, samples, timed.run_seconds,
                  timed.prefill_seconds, timed.iterations, timed.stage, **extra)


@dataclasses.dataclass
class Row:
    """The summary of one method on one prompt set (``dataset == "all"``: pooled over the sets). Times in ms;
    NaN / None where nothing was measured (see :mod:`sparkjax.eval.runner`)."""

    dataset: str
    label: str
    method: str | None = None
    budget: int | None = None
    drafter: str | None = None
    drafter_role: str | None = None
    n_samples: int = 0
    n_batches: int = 0
    output_tokens: int = 0
    rounds: int = 0
    tau_pooled: float | None = _NAN
    tau_per_response: float | None = _NAN
    accept_rate: list[float] = dataclasses.field(default_factory=list)
    decode_seconds: float | None = 0.0
    prefill_ms: float | None = _NAN
    tpot_ms: float | None = _NAN
    tpot_min_ms: float | None = _NAN
    round_ms: float | None = _NAN
    tokens_per_s: float | None = _NAN
    tokens_per_s_best: float | None = _NAN
    speedup: float | None = _NAN
    speedup_best: float | None = _NAN
    timing_spread: float | None = _NAN
    timing_spread_max: float | None = _NAN
    timed_batches: int | None = None
    unmeasured_batches: int | None = None
    stage_ms_per_round: dict[str, float] | None = None
    stage_samples: int = 0
    same_as_ar: float | None = None
    size_share: dict[str, float] | None = None

    to_dict = dataclasses.asdict
    from_dict = classmethod(_from_dict)


@dataclasses.dataclass
class SweepRow:
    """One method at one batch size of the batch-size sweep (see :func:`summarize_sweep`)."""

    batch_size: int
    label: str
    method: str | None = None
    budget: int | None = None
    drafter: str | None = None
    drafter_role: str | None = None
    n_batches: int = 0
    n_sequences: int = 0
    output_tokens: int = 0
    rounds: int = 0
    tau_pooled: float | None = _NAN
    decode_seconds: float | None = 0.0
    tokens_per_s: float | None = _NAN
    tokens_per_s_best: float | None = _NAN
    speedup: float | None = _NAN
    speedup_best: float | None = _NAN
    timing_spread: float | None = _NAN
    timing_spread_max: float | None = _NAN
    timed_batches: int | None = None
    unmeasured_batches: int | None = None
    same_as_ar: float | None = None
    same_across_batches: float | None = None

    to_dict = dataclasses.asdict
    from_dict = classmethod(_from_dict)


@dataclasses.dataclass
class Sweep:
    """The ``sweep`` object of results.json: the settings, the prompt pool, the rows and the raw records."""

    batch_sizes: list[int]
    rows: list[SweepRow]
    records: list[Record]
    fill: str = "cycled"
    fill_text: str = ""
    prompts: int = 0
    prompts_per_set: dict[str, int] = dataclasses.field(default_factory=dict)
    pool: list[list[Any]] = dataclasses.field(default_factory=list)
    batches: dict[str, int] = dataclasses.field(default_factory=dict)
    throughput: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**d, "rows": [r.to_dict() for r in self.rows], "records": [r.to_dict() for r in self.records]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sweep:
        sw = _from_dict(cls, {"batch_sizes": [], "rows": [], "records": [], **d})
        sw.rows = [SweepRow.from_dict(r) for r in sw.rows]
        sw.records = [Record.from_dict(r) for r in sw.records]
        return sw


def same_share(pairs) -> float | None:
    """The fraction of ``(output, reference)`` pairs that are equal (None without a pair with a reference)."""
    pairs = [(a, b) for a, b in pairs if b is not None]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


def timing(rr: list[Record]) -> tuple[dict[str, Any], list[Record], list[Record]]:
    """What every summary row (:class:`Row`, :class:`SweepRow`) says of the records ``rr`` of one method and
    scope: what ran, the counts, tau, decode seconds and the spread; and the timed records whose median and best
    case decode times were measured."""
    timed = [r for r in rr if r.timed]
    med = [r for r in timed if measured(r.decode_seconds)]
    best = [r for r in timed if measured(r.decode_seconds_min)]
    spreads = [r.run_spread for r in timed if measured(r.run_spread, allow_zero=True)]
    lens = [s.acceptance_lengths for r in rr for s in r.samples]
    r0 = rr[0]
    return dict(label=r0.label, method=r0.method, budget=r0.budget, drafter=r0.drafter, drafter_role=r0.drafter_role,
                n_batches=len(rr), output_tokens=sum(r.output_tokens for r in rr), rounds=sum(map(len, lens)),
                tau_pooled=metrics.tau_pooled(lens), decode_seconds=sum(r.decode_seconds for r in med),
                timing_spread=statistics.median(spreads) if spreads else _NAN,
                timing_spread_max=max(spreads, default=_NAN), timed_batches=len(timed),
                unmeasured_batches=len(timed) - len(med)), med, best


def summarize(records: list[Record], labels: list[str], depths: dict[str, int], dataset_names: list[str],
              temperature: float) -> list[Row]:
    """Summary rows per (dataset, method), then pooled over the datasets (``dataset == "all"``) when there are
    several. TPOT is the mean over timed batches with a measured decode time; speedup = TPOT(ar) / TPOT(method);
    ``same_as_ar`` (greedy only): the share of outputs equal to ar's for the same prompt."""
    ar_outputs = {(r.dataset, s.index): s.output_ids for r in records if is_reference(r.label) for s in r.samples}
    groups = [(name, recs) for name in dataset_names if (recs := [r for r in records if r.dataset == name])]
    if len(groups) > 1:
        groups.append(("all", records))
    rows: list[Row] = []
    for name, recs in groups:
        ar_tpot = ar_best = _NAN
        for label in labels:
            rr = [r for r in recs if r.label == label]
            if not rr:
                continue
            common, med, best = timing(rr)
            samples = [s for r in rr for s in r.samples]
            lens = [s.acceptance_lengths for s in samples]
            tp = metrics.mean_tpot([r.decode_seconds for r in med], [r.output_tokens for r in med])
            tp_best = metrics.mean_tpot([r.decode_seconds_min for r in best], [r.output_tokens for r in best])
            if is_reference(label):
                ar_tpot, ar_best = tp, tp_best
            staged = [r for r in rr if r.stage]
            stage = None
            if staged:
                stage = metrics.stage_ms_per_round([r.stage["seconds"] for r in staged],
                                                   [r.stage["rounds"] for r in staged])
                stage["total"] = sum(stage[k] for k in STAGES if k in stage)
            same = None
            if temperature == 0 and not is_reference(label):
                same = same_share((s.output_ids, ar_outputs.get((r.dataset, s.index))) for r in rr for s in r.samples)
            depth = depths.get(label, 0)
            rounds = [len(a) for a in lens]
            rows.append(Row(
                dataset=name, **common, n_samples=len(samples), tau_per_response=metrics.tau_per_response(lens),
                accept_rate=metrics.accept_rates([s.accepted_per_depth for s in samples], rounds, depth)
                if depth else [],
                prefill_ms=1000 * statistics.mean(statistics.median(r.prefill_seconds) for r in rr)
                if all(r.prefill_seconds for r in rr) else _NAN,
                tpot_ms=1000 * tp, tpot_min_ms=1000 * tp_best,
                round_ms=1000 * ratio(common["decode_seconds"], sum(r.loop_iterations for r in med)),
                tokens_per_s=ratio(1, tp), tokens_per_s_best=ratio(1, tp_best),
                speedup=ratio(ar_tpot, tp), speedup_best=ratio(ar_best, tp_best),
                stage_ms_per_round=stage, stage_samples=sum(len(r.samples) for r in staged),
                same_as_ar=same, size_share=size_share(samples),
            ))
    return rows


def size_share(samples: list[Sample]) -> dict[str, float] | None:
    """Method ``auto``: the share of rounds that verified each candidate size (None for other methods)."""
    chose = [s.size_choices for s in samples if s.size_choices is not None]
    if not chose:
        return None
    counts = collections.Counter(label for row in chose for label in row)
    total = sum(counts.values()) or 1
    return {k: v / total for k, v in counts.items()}


# ----------------------------------------------------------------------------- the batch-size sweep
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


def summarize_sweep(records: list[Record], labels: list[str], sizes: tuple[int, ...],
                    temperature: float) -> list[SweepRow]:
    """One row per (batch size, method), in batch-size then method order. Throughput = output tokens / decode
    seconds summed over the measured batches; greedy runs also report ``same_as_ar`` (against ar at the same slot)
    and ``same_across_batches`` (against the same prompt at the smallest size)."""
    rows: list[SweepRow] = []
    first = {}  # (label, dataset, index) -> output of the first batch that prompt ran in, at the smallest size
    for r in sorted(records, key=lambda r: (r.batch_size, r.batch)):
        for s in r.samples:
            first.setdefault((r.label, s.dataset, s.index), s.output_ids)
    ar_out = {(r.batch_size, r.batch, s.slot): s.output_ids for r in records if is_reference(r.label)
              for s in r.samples}
    for size in sizes:
        ar_rate = ar_best = math.nan
        for label in labels:
            rr = [r for r in records if r.batch_size == size and r.label == label]
            if not rr:
                continue
            common, med, best = timing(rr)
            rate = ratio(sum(r.output_tokens for r in med), common["decode_seconds"])
            rate_best = ratio(sum(r.output_tokens for r in best), sum(r.decode_seconds_min for r in best))
            if is_reference(label):
                ar_rate, ar_best = rate, rate_best
            same_ar = same_batches = None
            if temperature == 0:
                same_batches = same_share((s.output_ids, first[(label, s.dataset, s.index)]) for r in rr
                                          for s in r.samples)
                if not is_reference(label):
                    same_ar = same_share((s.output_ids, ar_out.get((size, r.batch, s.slot))) for r in rr
                                         for s in r.samples)
            rows.append(SweepRow(batch_size=size, **common, n_sequences=sum(len(r.samples) for r in rr),
                                 tokens_per_s=rate, tokens_per_s_best=rate_best, speedup=ratio(rate, ar_rate),
                                 speedup_best=ratio(rate_best, ar_best), same_as_ar=same_ar,
                                 same_across_batches=same_batches))
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
    return Sweep(batch_sizes=list(sizes), rows=summarize_sweep(records, labels, sizes, temperature), records=records,
                 fill="cycled", fill_text=FILL_TEXT, prompts=len(pool),
                 prompts_per_set=dict(collections.Counter(name for name, *_ in pool)),
                 pool=[[name, index] for name, index, _, _ in pool],
                 batches={str(b): math.ceil(len(pool) / b) for b in sizes},
                 throughput="output tokens / decode seconds, summed over the measured batches of a batch size "
                            "(median times; best: min times); speedup = throughput / ar's at the same batch size")
