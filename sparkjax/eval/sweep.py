"""The batch-size sweep of ``python -m sparkjax.eval --batch-sizes 1,4,16,64``: throughput against batch size.

**Prompts.** The prompts the run selected (``--max-samples`` per set, as in a normal run) form one pool,
taken from the sets in turn (set A's first prompt, set B's first, ..., then every set's second, ...), N
prompts in all. Batch size B runs ``ceil(N / B)`` batches of exactly B sequences, and slot i of batch j
holds prompt ``pool[(j * B + i) mod N]``: the pool is *cycled* to fill every batch, so each prompt runs at
least once at every batch size, a size above N repeats prompts within its batch, and every batch of a
size has the same shape (one compilation per method and size). The prompt width and the cache size are
those of the whole run, the same at every size.

**Timing.** Every (batch size, batch) is timed like a batch of the normal run (:func:`harness.time_batch`):
each method compiled and run once on that shape first, then ``--repeats`` interleaved repetitions (A B C,
A B C), each a full run followed by a prefill-only run of the same program; decode seconds = median(full)
- median(prefill-only), the best case min - min, and a difference that is not positive is "not measured"
(left out, never 0). There is no instrumented stage pass in a sweep.

**Throughput** of a (method, batch size) = output tokens / decode seconds, both summed over its measured
batches (all sequences of a batch, each one's first token included, as TPOT counts them); ``best`` is the
same from the min times; the spread is the median (and max) over batches of (max - min) / median of the
full runs; speedup = throughput / throughput of ``ar`` at the same batch size, in the same run. Greedy
runs also check exactness: ``same_as_ar`` (each sequence equals ``ar``'s at the same slot) and
``same_across_batches`` (each sequence equals the same method's output for that prompt in the first batch it
ran in, at the smallest batch size): the batch changes the speed, never the tokens.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from ..engine.methods import AR_LABEL
from ..errors import EvalError

FILL = "cycled"
FILL_TEXT = ("prompts cycled to fill each batch: batch size B runs ceil(N / B) batches of B sequences, slot i of "
             "batch j holding prompt (j * B + i) mod N of the pool (the selected prompts, the sets taken in turn)")


def check_batch_sizes(sizes) -> tuple[int, ...]:
    """Validates ``--batch-sizes`` (a comma-separated string or a sequence of integers); returns them in
    ascending order. EvalError naming the flag for an empty list or entry, a non-integer, a size below 1 or
    a duplicate."""
    if isinstance(sizes, str):
        items = [x.strip() for x in sizes.split(",")]
        if any(not x for x in items):
            raise EvalError(f"--batch-sizes: empty entry in {sizes!r}; expected comma-separated positive integers")
        try:
            sizes = [int(x) for x in items]
        except ValueError:
            raise EvalError(f"--batch-sizes: expected comma-separated positive integers, got {sizes!r}") from None
    elif isinstance(sizes, int) and not isinstance(sizes, bool):
        sizes = [sizes]
    try:
        sizes = list(sizes)
    except TypeError:
        raise EvalError(f"--batch-sizes: expected a list of positive integers, got {sizes!r}") from None
    if not sizes:
        raise EvalError("--batch-sizes: empty list; expected comma-separated positive integers, e.g. 1,4,16,64")
    for b in sizes:
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise EvalError(f"--batch-sizes: expected positive integers, got {b!r} in {list(sizes)}")
    dupes = sorted({b for b in sizes if sizes.count(b) > 1})
    if dupes:
        raise EvalError(f"--batch-sizes: batch size {dupes[0]} is listed twice in {list(sizes)}")
    return tuple(sorted(sizes))


def prompt_pool(selected: dict[str, list[tuple[int, int, list[int]]]]) -> list[tuple[str, int, int, list[int]]]:
    """The sweep's prompts, ``(dataset, index, line, ids)``, taking the sets in turn."""
    pool = []
    rows = list(selected.items())
    for k in range(max((len(r) for _, r in rows), default=0)):
        pool += [(name, *r[k]) for name, r in rows if k < len(r)]
    return pool


def fill_batches(pool: list, size: int) -> list[list]:
    """``ceil(N / size)`` batches of exactly ``size`` entries: slot i of batch j is ``pool[(j * size + i) % N]``."""
    n = len(pool)
    if not n:
        return []
    return [[pool[(j * size + i) % n] for i in range(size)] for j in range(math.ceil(n / size))]


def run_sweep(units, sizes: tuple[int, ...], pool: list, *, seed: int, repeats: int, warmed: set, stop,
              drafter_of: dict, role_of: dict, records: list, after_batch=None, progress: bool = True) -> None:
    """Times every method at every batch size (see the module docstring), appending one record per
    (batch size, batch, method) to ``records`` once every method has run that batch. Batch j of a size
    runs with ``seed + j``. Raises :class:`harness.Stopped` / KeyboardInterrupt on Ctrl-C, with the finished
    batches already in ``records``."""
    from tqdm.auto import tqdm

    from . import harness

    plan = [(b, j, batch) for b in sizes for j, batch in enumerate(fill_batches(pool, b))]
    bar = tqdm(plan, desc="batch-size sweep", unit="batch", disable=not progress)
    try:
        for size, j, entries in bar:
            stop.check()
            bar.set_postfix_str(f"batch size {size}")
            batch = [ids for _, _, _, ids in entries]
            raws = harness.time_batch(units, batch, seed=seed + j, repeats=repeats, stages=False, warmed=warmed,
                                      stop=stop)
            done = []
            for _, mc in units:
                rec = harness._record("all", j, seed + j, mc, [(i, line, ids) for _, i, line, ids in entries],
                                      raws[mc])
                for slot, (s, (name, *_)) in enumerate(zip(rec["samples"], entries, strict=True)):
                    s["dataset"], s["slot"] = name, slot
                rec.update(batch_size=size, drafter=drafter_of[mc], drafter_role=role_of[mc])
                done.append(rec)
            records.extend(done)  # a batch counts once every method has run it
            if after_batch is not None:
                after_batch()
    finally:
        bar.close()


def _measured(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 and tokens > 0 else math.nan


def summarize_sweep(records: list[dict[str, Any]], labels: list[str], sizes: tuple[int, ...],
                    temperature: float) -> list[dict[str, Any]]:
    """One row per (batch size, method), in batch-size then method order (see the module docstring)."""
    rows: list[dict[str, Any]] = []
    greedy = temperature == 0
    key = {}  # (label, dataset, index) -> output of the first batch that prompt ran in, at the smallest size
    for r in sorted(records, key=lambda r: (r["batch_size"], r["batch"])):
        for s in r["samples"]:
            key.setdefault((r["label"], s.get("dataset"), s["index"]), s["output_ids"])
    ar_out = {(r["batch_size"], r["batch"], s.get("slot")): s["output_ids"] for r in records
              if r["label"] == AR_LABEL for s in r["samples"]}
    for size in sizes:
        ar_rate = ar_best = None
        for label in labels:
            rr = [r for r in records if r["batch_size"] == size and r["label"] == label]
            if not rr:
                continue
            timed = [r for r in rr if r["loop_iterations"] > 0]
            med = [r for r in timed if _measured(r.get("decode_seconds"))]
            best = [r for r in timed if _measured(r.get("decode_seconds_min"))]
            rate = _rate(sum(r["output_tokens"] for r in med), sum(r["decode_seconds"] for r in med))
            rate_best = _rate(sum(r["output_tokens"] for r in best), sum(r["decode_seconds_min"] for r in best))
            if label == AR_LABEL:
                ar_rate, ar_best = rate, rate_best
            spreads = [r["run_spread"] for r in timed if isinstance(r.get("run_spread"), int | float)]
            samples = [s for r in rr for s in r["samples"]]
            lens = [a for s in samples for a in s["acceptance_lengths"]]
            same_ar = same_batches = None
            if greedy:
                same_batches = sum(s["output_ids"] == key[(label, s.get("dataset"), s["index"])]
                                   for s in samples) / len(samples)
                if label != AR_LABEL:
                    pairs = [(s["output_ids"], ar_out.get((size, r["batch"], s.get("slot")))) for r in rr
                             for s in r["samples"]]
                    pairs = [(a, b) for a, b in pairs if b is not None]
                    same_ar = sum(a == b for a, b in pairs) / len(pairs) if pairs else None
            r0 = rr[0]
            rows.append({
                "batch_size": size,
                "label": label,
                "method": r0["method"],
                "budget": r0["budget"],
                "drafter": r0.get("drafter"),
                "drafter_role": r0.get("drafter_role"),
                "n_batches": len(rr),
                "n_sequences": len(samples),
                "output_tokens": sum(s["output_tokens"] for s in samples),
                "rounds": len(lens),
                "tau_pooled": sum(lens) / len(lens) if lens else math.nan,
                "decode_seconds": sum(r["decode_seconds"] for r in med),
                "tokens_per_s": rate,
                "tokens_per_s_best": rate_best,
                "speedup": rate / ar_rate if ar_rate and _measured(ar_rate) and _measured(rate) else math.nan,
                "speedup_best": rate_best / ar_best if ar_best and _measured(ar_best) and _measured(rate_best)
                else math.nan,
                "timing_spread": statistics.median(spreads) if spreads else math.nan,
                "timing_spread_max": max(spreads) if spreads else math.nan,
                "timed_batches": len(timed),
                "unmeasured_batches": len(timed) - len(med),
                "same_as_ar": same_ar,
                "same_across_batches": same_batches,
            })
    return rows


def sweep_notes(rows: list[dict[str, Any]]) -> list[str]:
    """Notes for greedy rows whose outputs changed with the batch or differ from ar's."""
    notes = []
    for r in rows:
        tag = f"batch {r['batch_size']}/{r['label']}"
        if r.get("same_as_ar") is not None and r["same_as_ar"] < 1:
            notes.append(f"{tag}: only {100 * r['same_as_ar']:.0f}% of greedy outputs equal ar's at the same slot "
                         "(greedy speculative decoding should reproduce them exactly)")
        if r.get("same_across_batches") is not None and r["same_across_batches"] < 1:
            notes.append(f"{tag}: only {100 * r['same_across_batches']:.0f}% of greedy outputs equal the same "
                         "prompt's output at the smallest batch size (the batch should change the speed only)")
        if r.get("unmeasured_batches"):
            notes.append(f"{tag}: decode time not measured for {r['unmeasured_batches']} of {r['timed_batches']} "
                         "batch(es) (the prefill-only runs took as long as the full runs); left out of tok/s")
    return notes


def sweep_block(records: list[dict[str, Any]], labels: list[str], sizes: tuple[int, ...], pool: list,
                temperature: float) -> dict[str, Any]:
    """The ``sweep`` object of results.json: settings, the rows (one per batch size and method) and the
    raw records."""
    per_set: dict[str, int] = {}
    for name, *_ in pool:
        per_set[name] = per_set.get(name, 0) + 1
    return {
        "batch_sizes": list(sizes),
        "fill": FILL,
        "fill_text": FILL_TEXT,
        "prompts": len(pool),
        "prompts_per_set": per_set,
        "pool": [[name, index] for name, index, _, _ in pool],
        "batches": {str(b): math.ceil(len(pool) / b) if pool else 0 for b in sizes},
        "throughput": "output tokens / decode seconds, summed over the measured batches of a batch size "
                      "(median times; best: min times); speedup = throughput / ar's at the same batch size",
        "rows": summarize_sweep(records, labels, sizes, temperature),
        "records": records,
    }
