"""The eval's typed results: per-sequence :class:`Sample`, per (batch, method) :class:`Record`, the per-set
summary :class:`Row`, and the batch-size sweep's :class:`SweepRow` and :class:`Sweep`.

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
from ..engine.methods import parse_method
from ..engine.round import STAGES
from ..errors import ArgumentError
from . import metrics


def _from_dict(cls, d: dict[str, Any]):
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})


def _drop_none(d: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if not (k in keys and v is None)}


@functools.cache
def is_reference(label: str) -> bool:
    """Whether ``label`` names the method every speedup and exactness check is measured against: the one that
    drafts nothing (``ar``), as its method object says. A name the engine does not know is not the reference."""
    try:
        return not parse_method(label).speculative
    except ArgumentError:
        return False


def measured(x, *, allow_zero: bool = False) -> bool:
    """A measured, usable time (or spread): a finite number > 0 (>= 0 with ``allow_zero``); None is "not measured"."""
    if not isinstance(x, int | float) or isinstance(x, bool) or not math.isfinite(x):
        return False
    return x >= 0 if allow_zero else x > 0


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

    @property
    def rounds(self) -> int:
        return len(self.acceptance_lengths)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(output_tokens=self.output_tokens, rounds=self.rounds)
        return _drop_none(d, ("size_choices", "dataset", "slot"))

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
        return metrics.decode_seconds_min(self.run_seconds, self.prefill_seconds)

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
        d["samples"] = [s.to_dict() for s in self.samples]
        d.update(decode_seconds=self.decode_seconds, decode_seconds_min=self.decode_seconds_min,
                 run_spread=self.run_spread, output_tokens=self.output_tokens)
        return _drop_none(d, ("batch_size",))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Record:
        rec = _from_dict(cls, {"budget": None, "seed": 0, "run_seconds": [], "prefill_seconds": [],
                               "loop_iterations": 0, "samples": [], "batch": 0, "method": d.get("label"), **d})
        rec.samples = [s if isinstance(s, Sample) else Sample.from_dict(s) for s in rec.samples]
        return rec


def make_record(dataset: str, batch: int, seed: int, mc, chunk, timed, **extra) -> Record:
    """The :class:`Record` of method config ``mc`` on ``chunk`` (``(index, line, ids)`` per sequence) from the
    runner's :class:`~sparkjax.eval.runner.Timed`; ``extra``: drafter, drafter_role, batch_size."""
    out = timed.output
    sizes = out.size_choices or [None] * len(out.tokens)
    samples = [Sample(index, toks, lens, hits, line, len(ids), sz)
               for (index, line, ids), toks, lens, hits, sz in zip(chunk, out.tokens, out.acceptance_lengths,
                                                                   out.accepted_per_depth, sizes, strict=True)]
    return Record(dataset, mc.label, mc.method, mc.budget, batch, seed, samples, timed.run_seconds,
                  timed.prefill_seconds, timed.iterations, timed.stage, **extra)

_NAN = math.nan


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
    """One method at one batch size of the batch-size sweep (see :mod:`sparkjax.eval.sweep`)."""

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
        d.update(rows=[r.to_dict() for r in self.rows], records=[r.to_dict() for r in self.records])
        return d

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


def summarize(records: list[Record], labels: list[str], depths: dict[str, int], dataset_names: list[str],
              temperature: float) -> list[Row]:
    """Summary rows per (dataset, method), then pooled over the datasets (``dataset == "all"``) when there are
    several. TPOT is the mean over timed batches with a measured decode time; speedup = TPOT(ar) / TPOT(method);
    ``same_as_ar`` (greedy only): the share of outputs equal to ar's for the same prompt."""
    ar_outputs = {(r.dataset, s.index): s.output_ids for r in records if is_reference(r.label) for s in r.samples}
    groups = [(name, [r for r in records if r.dataset == name]) for name in dataset_names]
    groups = [(name, recs) for name, recs in groups if recs]
    if len(groups) > 1:
        groups.append(("all", records))
    rows: list[Row] = []
    for name, recs in groups:
        ar_tpot = ar_best = None
        for label in labels:
            rr = [r for r in recs if r.label == label]
            if not rr:
                continue
            samples = [s for r in rr for s in r.samples]
            lens = [s.acceptance_lengths for s in samples]
            rounds = [len(a) for a in lens]
            timed = [r for r in rr if r.timed]
            med = [r for r in timed if measured(r.decode_seconds)]
            best = [r for r in timed if measured(r.decode_seconds_min)]
            tp = metrics.mean_tpot([r.decode_seconds for r in med], [r.output_tokens for r in med])
            tp_best = metrics.mean_tpot([r.decode_seconds_min for r in best], [r.output_tokens for r in best])
            if is_reference(label):
                ar_tpot, ar_best = tp, tp_best
            spreads = [r.run_spread for r in timed if measured(r.run_spread, allow_zero=True)]
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
            decode_sum = sum(r.decode_seconds for r in med)
            iterations = sum(r.loop_iterations for r in med)
            r0 = rr[0]
            rows.append(Row(
                dataset=name, label=label, method=r0.method, budget=r0.budget, drafter=r0.drafter,
                drafter_role=r0.drafter_role, n_samples=len(samples), n_batches=len(rr),
                output_tokens=sum(s.output_tokens for s in samples), rounds=sum(rounds),
                tau_pooled=metrics.tau_pooled(lens), tau_per_response=metrics.tau_per_response(lens),
                accept_rate=metrics.accept_rates([s.accepted_per_depth for s in samples], rounds, depth)
                if depth else [],
                decode_seconds=decode_sum,
                prefill_ms=1000 * statistics.mean(statistics.median(r.prefill_seconds) for r in rr)
                if all(r.prefill_seconds for r in rr) else _NAN,
                tpot_ms=1000 * tp, tpot_min_ms=1000 * tp_best,
                round_ms=1000 * decode_sum / iterations if iterations and decode_sum > 0 else _NAN,
                tokens_per_s=metrics.rate(tp), tokens_per_s_best=metrics.rate(tp_best),
                speedup=metrics.speedup(ar_tpot, tp) if ar_tpot is not None else _NAN,
                speedup_best=metrics.speedup(ar_best, tp_best) if ar_best is not None else _NAN,
                timing_spread=statistics.median(spreads) if spreads else _NAN,
                timing_spread_max=max(spreads) if spreads else _NAN,
                timed_batches=len(timed), unmeasured_batches=len(timed) - len(med),
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
