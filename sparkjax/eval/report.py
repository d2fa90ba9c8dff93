"""Text table, CSV and JSON writers, and the comparison of two runs."""

from __future__ import annotations

import csv
import json
import math
import os
import pathlib
import textwrap
from typing import Any

from ..engine.round import STAGES
from ..io.atomic import atomic_file
from .metrics import finite as _ok
from .records import is_reference


def _num(x, fmt: str) -> str:
    return format(x, fmt) if _ok(x) else "-"


def _times(x) -> str:
    return f"{x:.2f}x" if _ok(x) else "-"


def _pct(x) -> str:
    return f"{100 * x:.0f}%" if _ok(x) else "-"


def _prose(text: str) -> list[str]:
    return textwrap.wrap(text, 112, break_on_hyphens=False)


def _where(row) -> str:
    """The row's scope in messages: its dataset, or ``batch B`` for a sweep row."""
    return f"batch {row.batch_size}" if hasattr(row, "batch_size") else str(row.dataset)


def timing_warnings(results) -> list[str]:
    """WARNING lines for the table: rows whose timing spread exceeds ``setup.timing.spread_warning`` (25 %), a
    load average above the CPU count during the run, and rows whose decode time could not be measured."""
    timing = (results.setup or {}).get("timing") or {}
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
    text = json.dumps(_clean(results.to_dict()), indent=1, allow_nan=False, default=str) + "\n"  # objects: text
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    return pathlib.Path(path)


def flat_row(row, setup: dict[str, Any] | None = None) -> dict[str, Any]:
    """A summary row as flat columns: accept_rate@k and stage_<name>_ms spread out."""
    out = {k: v for k, v in row.to_dict().items() if k not in ("accept_rate", "stage_ms_per_round", "size_share")}
    for label, share in (row.size_share or {}).items():  # method auto: share of rounds per size
        out[f"chosen_{label}"] = share
    stage = row.stage_ms_per_round or {}
    for name in (*STAGES, "total"):
        out[f"stage_{name}_ms_per_round"] = stage.get(name)
    rates = row.accept_rate or []
    depth = max([len(rates), *((setup or {}).get("depths") or {}).values()])
    for k in range(1, depth + 1):
        out[f"accept_rate@{k}"] = rates[k - 1] if k <= len(rates) else None
    return out


def _write_rows(path, rows: list[dict[str, Any]], empty: list[str]) -> pathlib.Path:
    """Writes flat rows as CSV atomically (None and non-finite numbers as empty cells)."""
    fields = list(dict.fromkeys(k for r in rows for k in r)) or empty
    with atomic_file(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: "" if v is None or (isinstance(v, float) and not math.isfinite(v)) else v
                        for k, v in r.items()})
    return pathlib.Path(path)


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
    lines = [f"sparkjax.eval: target {s['target']}  drafter {s['drafter']}  ({s['dtype']})"]
    if s.get("baseline_drafter") and s.get("baseline_methods"):
        lines.append(f"  baseline drafter {s['baseline_drafter']} for {', '.join(s['baseline_methods'])}")
    lines.append(f"  {temp}; {c['max_new_tokens']} new tokens; {batch}; up to {c['max_samples'] or 'all'} prompts per "
                 f"set; {runs} per prompt and method; {e['backend']} ({e.get('device_kind')}), {e['cpu_count']} CPU "
                 "cores")
    if results.interrupted:
        lines.append("  INTERRUPTED: partial results (the samples every method had finished)")
    return lines


def _grid(rows, cols, group) -> list[str]:
    """A text table: ``cols`` are (title, subtitle, width, cell of a row), a negative width left-aligns; a blank
    line where ``group`` of the row changes."""

    def line(cells) -> str:
        return "  ".join(f"{t:<{-w}}" if w < 0 else f"{t:>{w}}" for t, (_, _, w, _) in zip(cells, cols, strict=True))

    sub = line([c[1] for c in cols])
    out = [line([c[0] for c in cols]), sub, "-" * len(sub)]
    for i, r in enumerate(rows):
        if i and group(r) != group(rows[i - 1]):
            out.append("")
        out.append(line([str(c[3](r)) for c in cols]))
    return out


def _speed_cols(tok_width: int) -> list:
    """The columns the per-set and the sweep tables share: tau, tok/s, spread, speedups, same as ar."""
    def same(r):
        return "-" if is_reference(r.label) else _num(r.same_as_ar, ".2f")

    return [("tau", "pooled", 6, lambda r: _num(r.tau_pooled, ".2f")),
            ("tok/s", "median", tok_width, lambda r: _num(r.tokens_per_s, ".1f")),
            ("tok/s", "best", tok_width, lambda r: _num(r.tokens_per_s_best, ".1f")),
            ("spread", "", 6, lambda r: _pct(r.timing_spread)), ("speedup", "vs ar", 7, lambda r: _times(r.speedup)),
            ("speedup", "best", 7, lambda r: _times(r.speedup_best)), ("same", "as ar", 5, same)]


def warmup_lines(warmup: dict | None, width: int = 6, shown: float = 0.5, wall: dict | None = None) -> list[str]:
    """The warm-up (before any timed run): its wall time (``wall``: methods compiled several at a time), then per
    method its own wall seconds, the compile share and each program compiled, those under ``shown`` s summed."""
    if not warmup:
        return []
    comp = sum(w["compile_seconds"] for w in warmup.values())
    took = "" if not wall else f"{wall['seconds']:.1f} s wall, {wall['threads']} methods at a time; "
    lines = ["", f"warm-up (compiling and a first run of each method, before any timed run): {took}{comp:.1f} s "
                 "tracing and compiling in all (programs by backend compile seconds; a program the persistent cache "
                 "served is not compiled)"]
    for label, w in warmup.items():
        big = [p for p in w["programs"] if p["seconds"] >= shown]
        small = [p["seconds"] for p in w["programs"] if p["seconds"] < shown]
        progs = ", ".join(f"{p['name']} {p['seconds']:.1f} s" for p in big)
        if small:
            progs += f"{', ' if progs else ''}{len(small)} more {sum(small):.1f} s"
        lines.append(f"  {label:<{width}}  {w['seconds']:6.1f} s  compile {w['compile_seconds']:5.1f} s"
                     f"{': ' + progs if progs else ''}")
    return lines


def format_table(results) -> str:
    """The summary as text: the main table, per-depth acceptance, definitions and notes."""
    lines = _header(results)
    if not results.summary:
        if results.sweep is not None:
            lines += format_sweep(results) + timing_warnings(results)
        else:
            lines.append("\n(no finished sample)")
        return "\n".join(lines + [f"note: {n}" for n in results.notes])
    dw = max(7, *(len(r.dataset) for r in results.summary))
    mw = max(6, *(len(r.label) for r in results.summary))
    names = (*STAGES, "total")
    stage_sub = "| " + " ".join(f"{k:>6}" for k in names)
    speed = _speed_cols(8)
    cols = [("dataset", "", -dw, lambda r: r.dataset), ("method", "", -mw, lambda r: r.label),
            ("n", "", 3, lambda r: r.n_samples), speed[0],
            ("tau", "resp", 6, lambda r: _num(r.tau_per_response, ".2f")),
            *speed[1:-1], ("TPOT", "ms", 7, lambda r: _num(r.tpot_ms, ".3f")),
            ("round", "ms", 6, lambda r: _num(r.round_ms, ".2f")), speed[-1],
            ("| stage ms per round (instrumented pass)", stage_sub, -len(stage_sub),
             lambda r: "| " + " ".join(f"{_num((r.stage_ms_per_round or {}).get(k), '.2f'):>6}" for k in names))]
    lines += ["", *_grid(results.summary, cols, lambda r: r.dataset), *timing_warnings(results)]
    scope = "all" if any(r.dataset == "all" for r in results.summary) else results.summary[0].dataset
    rows = [r for r in results.rows(scope) if r.accept_rate]
    if rows:
        depth = max(len(r.accept_rate) for r in rows)
        # show the depths up to one past the deepest accepted draft (at least 4); the rest are all zero
        reached = max((k + 1 for r in rows for k, x in enumerate(r.accept_rate) if _ok(x) and x > 0), default=0)
        shown = min(depth, max(4, reached + 1))
        lines += ["", f"accept_rate@k ({scope}): fraction of rounds whose accepted path reached draft depth k",
                  f"{'method':<{mw}}  " + " ".join(f"{'@' + str(k):>5}" for k in range(1, shown + 1))]
        lines += [f"{r.label:<{mw}}  " + " ".join(f"{_num(x, '5.2f'):>5}" for x in r.accept_rate[:shown]) for r in rows]
        if shown < depth:
            lines.append(f"(@{shown + 1} to @{depth}: 0.00 for every method)")
    chosen = [r for r in results.summary if r.size_share]
    if chosen:
        lines += ["", "auto: share of rounds that verified each size (ar = a plain target step, no draft)"]
        for r in chosen:
            shares = "  ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(r.size_share.items(), key=lambda kv: -kv[1]))
            lines.append(f"{r.dataset:<{dw}}  {r.label:<{mw}}  {shares}")
    lines += warmup_lines(results.setup.get("warmup"), mw, wall=results.setup.get("warmup_wall"))
    lines += ["", *_prose(
        "tau pooled = sum of acceptance lengths / rounds (DeepSpec); tau resp = mean of per-response means (DDTree); "
        "acceptance length = the tokens a round committed (accepted drafts + 1, fewer in a round cut at EOS or "
        "the token limit). TPOT = decode time / output tokens, decode time = full run - prefill-only run (median "
        "over the repetitions, methods interleaved A B A B; 'best': the same from the fastest runs); tok/s = 1 / "
        "TPOT; speedup = TPOT(ar) / TPOT(method), same run; spread = (max - min) / median "
        "of the full runs (median over batches). round ms = decode time / rounds (ar: per token) in the fused loop; "
        "stage times come from a separate, synced pass, so they add overhead. same as ar = fraction of outputs equal "
        "to ar's (greedy: 1.00)."), *[f"note: {n}" for n in results.notes]]
    return "\n".join(lines)


def format_sweep(results) -> list[str]:
    """The batch-size sweep's table: one line per (batch size, method)."""
    sweep, rows = results.sweep, results.sweep_rows
    sets = ", ".join(f"{k} {v}" for k, v in sweep.prompts_per_set.items())
    lines = ["", f"batch-size sweep: {sweep.prompts} prompts ({sets}); " + (sweep.fill_text or f"fill: {sweep.fill}")]
    if not rows:
        return [*lines, "(no finished batch)"]
    mw = max(6, *(len(r.label) for r in rows))
    cols = [("batch", "size", 5, lambda r: r.batch_size), ("method", "", -mw, lambda r: r.label),
            ("seqs", "", 4, lambda r: r.n_sequences), *_speed_cols(9),
            ("same", "batches", 7, lambda r: _num(r.same_across_batches, ".2f"))]
    return [*lines, *_grid(rows, cols, lambda r: r.batch_size), "", *_prose(
        "tok/s = output tokens / decode seconds, summed over the batches of a size (all sequences; decode = full run "
        "- prefill-only run, median over the interleaved repetitions; 'best': the fastest runs); speedup = tok/s / "
        "ar's tok/s at the same batch size; same as ar: outputs equal to ar's at the same slot; same batches: outputs "
        "equal to the same prompt's output at the smallest batch size (greedy: both 1.00).")]


COMPARED = (("tau_pooled", "tau pooled", ".2f"), ("tau_per_response", "tau resp", ".2f"),
            ("tokens_per_s", "tok/s", ".1f"), ("speedup", "speedup", ".2f"))


def _delta(x, y, fmt: str) -> str:
    """``x -> y (y - x, relative change)``; a missing, null, NaN or non-number value (an older file) is "-"."""
    if not (_ok(x) and _ok(y)):
        return f"{_num(x, fmt)} -> {_num(y, fmt)}"
    rel = f" {100 * (y - x) / x:+.0f}%" if x else ""
    return f"{x:{fmt}} -> {y:{fmt}} ({y - x:+{fmt}}{rel})"


def compare(a, b, name_a: str = "A", name_b: str = "B") -> str:
    """Per (dataset, method): each metric in run A, in run B, and B - A (with the relative change)."""
    ia, ib = ({(_where(r), r.label): r for r in [*x.summary, *x.sweep_rows]} for x in (a, b))
    keys = [k for k in ia if k in ib]
    dw = max([7, *(len(k[0]) for k in keys)])
    mw = max([6, *(len(k[1]) for k in keys)])
    head = f"{'dataset':<{dw}}  {'method':<{mw}}  " + "  ".join(f"{t + ' A -> B (delta)':>32}" for _, t, _ in COMPARED)
    lines = [f"A = {name_a}", f"B = {name_b}", "", head, "-" * len(head)]
    for k in keys:
        cells = [_delta(getattr(ia[k], f, None), getattr(ib[k], f, None), fmt) for f, _, fmt in COMPARED]
        lines.append(f"{k[0]:<{dw}}  {k[1]:<{mw}}  " + "  ".join(f"{c:>32}" for c in cells))
    if not keys:
        lines.append("(no (dataset, method) pair in common)")
    for tag, mine, other in (("A", ia, ib), ("B", ib, ia)):
        if only := [f"{d}/{m}" for d, m in mine if (d, m) not in other]:
            lines.append(f"only in {tag}: " + ", ".join(only))
    diff = {k: (a.config.get(k), b.config.get(k)) for k in sorted(set(a.config) | set(b.config))
            if a.config.get(k) != b.config.get(k) and k != "out"}
    if diff:
        lines.append("settings that differ: " + "; ".join(f"{k}: {x!r} -> {y!r}" for k, (x, y) in diff.items()))
    return "\n".join(lines)
