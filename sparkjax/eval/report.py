"""Text table, CSV and JSON writers, and the comparison of two runs."""

from __future__ import annotations

import csv
import json
import math
import os
import pathlib
from typing import Any

from ..engine.round import STAGES
from ..io.atomic import atomic_file
from .records import is_reference


def _num(x, fmt: str, none: str = "-") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, fmt)


def _ok(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _times(x) -> str:
    return f"{x:.2f}x" if _ok(x) else "-"


def _pct(x) -> str:
    return f"{100 * x:.0f}%" if _ok(x) else "-"


def _same(row) -> str:
    return "-" if is_reference(row.label) else _num(row.same_as_ar, ".2f")


def timing_warnings(results, threshold: float | None = None) -> list[str]:
    """WARNING lines for the table: rows whose timing spread exceeds the threshold (25 %), a load average above
    the CPU count during the run, and rows whose decode time could not be measured."""
    timing = (results.setup or {}).get("timing") or {}
    if threshold is None:
        threshold = timing.get("spread_warning", 0.25)
    out = []
    rows = [*results.summary, *results.sweep_rows]
    noisy = [r for r in rows if _ok(r.timing_spread) and r.timing_spread > threshold]
    if noisy:
        shown = ", ".join(f"{_where(r)}/{r.label} {100 * r.timing_spread:.0f}%" for r in noisy[:6])
        more = f" and {len(noisy) - 6} more" if len(noisy) > 6 else ""
        out.append(f"WARNING: timing spread above {100 * threshold:.0f}% ({shown}{more}): these timings are noisy; "
                   "rerun on a quieter machine or with more --repeats")
    load, cpus = timing.get("load_average_max"), timing.get("cpu_count")
    if _ok(load) and _ok(cpus) and load > cpus:
        out.append(f"WARNING: the load average reached {load:.1f} during the run, above the {cpus} CPU cores: other "
                   "processes competed for the CPU, so tok/s and speedups are unreliable")
    unmeasured = [r for r in rows if r.unmeasured_batches]
    if unmeasured:
        out.append("WARNING: decode time not measured for some batches (prefill-only took as long as the full run): "
                   + ", ".join(f"{_where(r)}/{r.label} {r.unmeasured_batches}/{r.timed_batches}"
                               for r in unmeasured[:6]))
    return ([""] + out) if out else []


def _where(row) -> str:
    """The row's scope in messages: its dataset, or ``batch B`` for a sweep row."""
    return f"batch {row.batch_size}" if hasattr(row, "batch_size") else str(row.dataset)


def _clean(x):
    """JSON-safe copy: NaN / inf -> None."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def write_json(results, path: str | os.PathLike) -> pathlib.Path:
    """Writes ``results.json`` atomically (a temp file beside it, renamed into place when complete)."""
    path = pathlib.Path(path)
    text = json.dumps(_clean(results.to_dict()), indent=1, allow_nan=False, default=str) + "\n"  # objects: text
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def flat_row(row, setup: dict[str, Any] | None = None) -> dict[str, Any]:
    """A summary row as flat columns: accept_rate@k and stage_<name>_ms spread out."""
    out = {k: v for k, v in row.to_dict().items() if k not in ("accept_rate", "stage_ms_per_round", "size_share")}
    for label, share in (row.size_share or {}).items():  # method auto: share of rounds per size
        out[f"chosen_{label}"] = share
    stage = row.stage_ms_per_round or {}
    for name in (*STAGES, "total"):
        out[f"stage_{name}_ms_per_round"] = stage.get(name)
    depth = len(row.accept_rate or [])
    if setup:
        depth = max([depth, *setup.get("depths", {}).values()])
    rates = row.accept_rate or []
    for k in range(1, depth + 1):
        out[f"accept_rate@{k}"] = rates[k - 1] if k <= len(rates) else None
    return out


def _write_rows(path, rows: list[dict[str, Any]], empty: list[str]) -> pathlib.Path:
    """Writes flat rows as CSV atomically (None and non-finite numbers as empty cells)."""
    path = pathlib.Path(path)
    fields: list[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    with atomic_file(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=fields or empty)
        w.writeheader()
        for r in rows:
            w.writerow({k: "" if v is None or (isinstance(v, float) and not math.isfinite(v)) else v
                        for k, v in r.items()})
    return path


def write_csv(results, path: str | os.PathLike) -> pathlib.Path:
    """Writes ``results.csv`` atomically: one flat row (:func:`flat_row`) per summary row."""
    return _write_rows(path, [flat_row(r, results.setup) for r in results.summary], ["dataset"])


def write_sweep_csv(results, path: str | os.PathLike) -> pathlib.Path:
    """Writes ``batch_sweep.csv`` atomically: one row per (batch size, method) of the batch-size sweep."""
    return _write_rows(path, [r.to_dict() for r in results.sweep_rows], ["batch_size", "label"])


def _header(results) -> list[str]:
    c, s, e = results.config, results.setup, results.environment
    temp = "greedy" if not c["temperature"] else f"temperature {c['temperature']}"
    runs = "1 timed run" if c.get("repeats") == 1 else f"median and min of {c.get('repeats')} interleaved timed runs"
    sizes = c.get("batch_sizes")
    batch = f"batch sizes {','.join(str(b) for b in sizes)} (sweep)" if sizes else f"batch {c.get('batch_size', 1)}"
    return [
        f"sparkjax.eval: target {s['target']}  drafter {s['drafter']}  ({s['dtype']})",
        *([f"  baseline drafter {s['baseline_drafter']} for {', '.join(s['baseline_methods'])}"]
          if s.get("baseline_drafter") and s.get("baseline_methods") else []),
        f"  {temp}; {c['max_new_tokens']} new tokens; {batch}; up to {c['max_samples'] or 'all'} prompts per set; "
        f"{runs} per prompt and method; {e['backend']} ({e.get('device_kind')}), {e['cpu_count']} CPU cores",
    ]


def format_table(results) -> str:
    """The summary as text: the main table, per-depth acceptance, definitions and notes."""
    lines = _header(results)
    if results.interrupted:
        lines.append("  INTERRUPTED: partial results (the samples every method had finished)")
    if not results.summary:
        if results.sweep is not None:
            lines += format_sweep(results) + timing_warnings(results)
        else:
            lines.append("\n(no finished sample)")
        return "\n".join(lines + [f"note: {n}" for n in results.notes])
    dw = max(7, *(len(r.dataset) for r in results.summary))
    mw = max(6, *(len(r.label) for r in results.summary))
    head = (f"{'dataset':<{dw}}  {'method':<{mw}}  {'n':>3}  {'tau':>6}  {'tau':>6}  {'tok/s':>8}  {'tok/s':>8}  "
            f"{'spread':>6}  {'speedup':>7}  {'speedup':>7}  {'TPOT':>7}  {'round':>6}  {'same':>5}  "
            f"| {'stage ms per round (instrumented pass)':<38}")
    sub = (f"{'':<{dw}}  {'':<{mw}}  {'':>3}  {'pooled':>6}  {'resp':>6}  {'median':>8}  {'best':>8}  "
           f"{'':>6}  {'vs ar':>7}  {'best':>7}  {'ms':>7}  {'ms':>6}  {'as ar':>5}  | "
           + " ".join(f"{k:>6}" for k in (*STAGES, "total")))
    lines += ["", head, sub, "-" * len(sub)]
    prev = None
    for r in results.summary:
        if prev is not None and r.dataset != prev:
            lines.append("")
        prev = r.dataset
        st = r.stage_ms_per_round or {}
        stages = " ".join(f"{_num(st.get(k), '6.2f'):>6}" for k in (*STAGES, "total"))
        lines.append(
            f"{r.dataset:<{dw}}  {r.label:<{mw}}  {r.n_samples:>3}  {_num(r.tau_pooled, '6.2f'):>6}  "
            f"{_num(r.tau_per_response, '6.2f'):>6}  {_num(r.tokens_per_s, '8.1f'):>8}  "
            f"{_num(r.tokens_per_s_best, '8.1f'):>8}  {_pct(r.timing_spread):>6}  "
            f"{_times(r.speedup):>7}  {_times(r.speedup_best):>7}  "
            f"{_num(r.tpot_ms, '7.3f'):>7}  {_num(r.round_ms, '6.2f'):>6}  {_same(r):>5}  | {stages}"
        )
    lines += timing_warnings(results)
    scope = "all" if any(r.dataset == "all" for r in results.summary) else results.summary[0].dataset
    rows = [r for r in results.rows(scope) if r.accept_rate]
    if rows:
        depth = max(len(r.accept_rate) for r in rows)
        # show the depths up to one past the deepest accepted draft (at least 4); the rest are all zero
        reached = max((k + 1 for r in rows for k, x in enumerate(r.accept_rate) if _ok(x) and x > 0), default=0)
        shown = min(depth, max(4, reached + 1))
        lines += ["", f"accept_rate@k ({scope}): fraction of rounds whose accepted path reached draft depth k"]
        lines.append(f"{'method':<{mw}}  " + " ".join(f"{'@' + str(k):>5}" for k in range(1, shown + 1)))
        for r in rows:
            lines.append(f"{r.label:<{mw}}  " + " ".join(f"{_num(x, '5.2f'):>5}" for x in r.accept_rate[:shown]))
        if shown < depth:
            lines.append(f"(@{shown + 1} to @{depth}: 0.00 for every method)")
    chosen = [r for r in results.summary if r.size_share]
    if chosen:
        lines += ["", "auto: share of rounds that verified each size (ar = a plain target step, no draft)"]
        for r in chosen:
            shares = "  ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(r.size_share.items(), key=lambda kv: -kv[1]))
            lines.append(f"{r.dataset:<{dw}}  {r.label:<{mw}}  {shares}")
    lines += [
        "",
        "tau pooled = sum of acceptance lengths / rounds (DeepSpec); tau resp = mean of per-response means (DDTree);",
        "acceptance length = accepted drafts + 1. TPOT = decode time / output tokens, decode time = full run - "
        "prefill-only run",
        "(median over the repetitions, methods interleaved A B A B; 'best': the same from the fastest runs); tok/s =",
        "1 / TPOT; speedup = TPOT(ar) / TPOT(method), same run; spread = (max - min) / median of the full runs (median",
        "over batches). round ms = decode time / rounds (ar: per token) in the fused loop; stage times come from a",
        "separate, synced pass, so they add overhead. same as ar = fraction of outputs equal to ar's (greedy: 1.00).",
    ]
    lines += [f"note: {n}" for n in results.notes]
    return "\n".join(lines)


def format_sweep(results) -> list[str]:
    """The batch-size sweep's table: one line per (batch size, method)."""
    sweep, rows = results.sweep, results.sweep_rows
    sets = ", ".join(f"{k} {v}" for k, v in sweep.prompts_per_set.items())
    lines = ["", f"batch-size sweep: {sweep.prompts} prompts ({sets}); " + (sweep.fill_text or f"fill: {sweep.fill}")]
    if not rows:
        return [*lines, "(no finished batch)"]
    mw = max(6, *(len(r.label) for r in rows))
    head = (f"{'batch':>5}  {'method':<{mw}}  {'seqs':>4}  {'tau':>6}  {'tok/s':>9}  {'tok/s':>9}  {'spread':>6}  "
            f"{'speedup':>7}  {'speedup':>7}  {'same':>5}  {'same':>7}")
    sub = (f"{'size':>5}  {'':<{mw}}  {'':>4}  {'pooled':>6}  {'median':>9}  {'best':>9}  {'':>6}  "
           f"{'vs ar':>7}  {'best':>7}  {'as ar':>5}  {'batches':>7}")
    lines += [head, sub, "-" * len(sub)]
    prev = None
    for r in rows:
        if prev is not None and r.batch_size != prev:
            lines.append("")
        prev = r.batch_size
        lines.append(
            f"{r.batch_size:>5}  {r.label:<{mw}}  {r.n_sequences:>4}  "
            f"{_num(r.tau_pooled, '6.2f'):>6}  {_num(r.tokens_per_s, '9.1f'):>9}  "
            f"{_num(r.tokens_per_s_best, '9.1f'):>9}  {_pct(r.timing_spread):>6}  {_times(r.speedup):>7}  "
            f"{_times(r.speedup_best):>7}  {_same(r):>5}  {_num(r.same_across_batches, '.2f'):>7}"
        )
    lines += [
        "",
        "tok/s = output tokens / decode seconds, summed over the batches of a size (all sequences; decode = full run -",
        "prefill-only run, median over the interleaved repetitions; 'best': the fastest runs); speedup = tok/s / ar's",
        "tok/s at the same batch size; same as ar: outputs equal to ar's at the same slot; same batches: outputs equal",
        "to the same prompt's output at the smallest batch size (greedy: both 1.00).",
    ]
    return lines


COMPARED = (("tau_pooled", "tau pooled", ".2f"), ("tau_per_response", "tau resp", ".2f"),
            ("tokens_per_s", "tok/s", ".1f"), ("speedup", "speedup", ".2f"))


def compare(a, b, name_a: str = "A", name_b: str = "B") -> str:
    """Per (dataset, method): each metric in run A, in run B, and B - A (with the relative change)."""
    ia = {(r.dataset, r.label): r for r in a.summary}
    ib = {(r.dataset, r.label): r for r in b.summary}
    ia.update({(_where(r), r.label): r for r in a.sweep_rows})  # sweep rows: "batch B" / method
    ib.update({(_where(r), r.label): r for r in b.sweep_rows})
    keys = [k for k in ia if k in ib]
    lines = [f"A = {name_a}", f"B = {name_b}", ""]
    dw = max([7, *(len(k[0]) for k in keys)])
    mw = max([6, *(len(k[1]) for k in keys)])
    head = f"{'dataset':<{dw}}  {'method':<{mw}}  " + "  ".join(f"{title + ' A -> B (delta)':>32}" for _, title, _ in
                                                                   COMPARED)
    lines += [head, "-" * len(head)]
    for k in keys:
        cells = []
        for field, _, fmt in COMPARED:
            x, y = getattr(ia[k], field, None), getattr(ib[k], field, None)
            x = x if _ok(x) else None  # a missing, null, NaN or non-number value (an older or edited file): "-"
            y = y if _ok(y) else None
            if x is None or y is None:
                cells.append(f"{_num(x, fmt)} -> {_num(y, fmt)}")
                continue
            d = y - x
            rel = f" {100 * d / x:+.0f}%" if x else ""
            cells.append(f"{x:{fmt}} -> {y:{fmt}} ({d:+{fmt}}{rel})")
        lines.append(f"{k[0]:<{dw}}  {k[1]:<{mw}}  " + "  ".join(f"{c:>32}" for c in cells))
    only_a = [k for k in ia if k not in ib]
    only_b = [k for k in ib if k not in ia]
    if not keys:
        lines.append("(no (dataset, method) pair in common)")
    if only_a:
        lines.append("only in A: " + ", ".join(f"{d}/{m}" for d, m in only_a))
    if only_b:
        lines.append("only in B: " + ", ".join(f"{d}/{m}" for d, m in only_b))
    diff = {k: (a.config.get(k), b.config.get(k)) for k in sorted(set(a.config) | set(b.config))
            if a.config.get(k) != b.config.get(k) and k != "out"}
    if diff:
        lines.append("settings that differ: " + "; ".join(f"{k}: {x!r} -> {y!r}" for k, (x, y) in diff.items()))
    return "\n".join(lines)
