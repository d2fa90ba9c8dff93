"""PNG plots (matplotlib's Agg canvas; pyplot and its global state are not used)."""

from __future__ import annotations

import hashlib
import math
import pathlib

import numpy as np

from ..engine.names import AR_LABEL, METHODS
from ..engine.round import STAGES
from ..io.atomic import atomic_file
from .metrics import finite
from .records import is_reference

STAGE_COLORS = {"draft": "#4c72b0", "propose": "#55a868", "verify": "#c44e52", "commit": "#8172b2"}

# One colour per method family (the engine's table order); a tree budget sets the shade, line, marker and hatch.
_PALETTE = ("#4d4d4d", "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#17becf", "#8c564b", "#e377c2",
            "#bcbd22", "#393b79", "#637939", "#843c39")
_LINESTYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v", "P")
_HATCHES = ("", "//", "..", "xx", "\\\\", "++")


def _hash(text: str) -> int:
    return int(hashlib.md5(text.encode()).hexdigest(), 16)


def method_style(label: str) -> dict:
    """The plot style of a method label (``"ar"``, ``"dspark"``, ``"sparklingtree@32"``, ...): ``color``,
    ``linestyle``, ``marker`` and ``hatch``. Stable: a function of the label only."""
    family, _, budget = label.partition("@")
    # a name the engine does not know (an older results file): a fixed colour picked from the name
    base = _PALETTE[(METHODS.index(family) if family in METHODS else _hash(family)) % len(_PALETTE)]
    if not budget:
        return {"color": base, "linestyle": "-", "marker": "o", "hatch": ""}
    level = max(0, round(math.log2(int(budget))) - 4) if budget.isdigit() else _hash(budget) % 6  # 16 -> 0, 32 -> 1
    shade = (-0.45, 0.0, 0.4, -0.25, 0.2, 0.55)[level % 6]  # < 0: towards white, > 0: towards black
    a, b = ([int(c[i : i + 2], 16) for i in (1, 3, 5)] for c in (base, "#ffffff" if shade < 0 else "#000000"))
    color = "#" + "".join(f"{round(x + (y - x) * abs(shade)):02x}" for x, y in zip(a, b, strict=True))
    return {"color": color, "linestyle": _LINESTYLES[(level + 1) % len(_LINESTYLES)],
            "marker": _MARKERS[(level + 1) % len(_MARKERS)], "hatch": _HATCHES[(level + 1) % len(_HATCHES)]}


def _figure(w: float, h: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _subtitle(results) -> str:
    c, s = results.config, results.setup
    temp = "greedy" if not c["temperature"] else f"T={c['temperature']}"
    pair = f"{pathlib.Path(str(s['target'])).name} + {pathlib.Path(str(s['drafter'])).name}"
    if s.get("baseline_drafter") and s.get("baseline_methods") and s["baseline_drafter"] != s["drafter"]:
        pair += f" (baseline {pathlib.Path(str(s['baseline_drafter'])).name})"
    if s.get("default_pair"):
        pair = f"bundled demo pair: {pair}"
    part = " [INTERRUPTED: partial results]" if results.interrupted else ""
    sizes = c.get("batch_sizes")
    batch = f"batch sizes {','.join(map(str, sizes))}" if sizes else f"batch {c.get('batch_size', 1)}"
    return f"{pair}\n{temp}, {c['max_new_tokens']} new tokens, {batch}{part}"


def _val(x) -> float:
    return float(x) if finite(x) else math.nan


def _row(results, dataset: str, label: str):
    return next((r for r in results.rows(dataset) if r.label == label), None)


def _finish(fig, path, title: str, results) -> pathlib.Path:
    """Titles the figure and writes it atomically (a temp file renamed into place)."""
    fig.suptitle(f"{title}\n{_subtitle(results)}", fontsize=9)
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png")
    return pathlib.Path(path)


def acceptance_plot(results, path) -> pathlib.Path:
    """accept_rate@k against depth k, one line per method, one panel per dataset (+ all)."""
    sets = list(dict.fromkeys(r.dataset for r in results.summary if r.accept_rate))
    cols = min(max(len(sets), 1), 3)
    rows = math.ceil(max(len(sets), 1) / cols)
    fig = _figure(4.6 * cols, 3.4 * rows + 0.6)
    for i, name in enumerate(sets):
        ax = fig.add_subplot(rows, cols, i + 1)
        for label in results.setup["labels"]:
            row = _row(results, name, label)
            if is_reference(label) or not row or not row.accept_rate:
                continue
            st = method_style(label)
            ax.plot(np.arange(1, len(row.accept_rate) + 1), [_val(x) for x in row.accept_rate], marker=st["marker"],
                    ms=3, ls=st["linestyle"], label=label, color=st["color"])
        ax.set(title=name, xlabel="draft depth k", ylabel="accept_rate@k (fraction of rounds)", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=7)
    return _finish(fig, path, "Per-depth acceptance: fraction of rounds whose accepted path reached depth k", results)


def tau_speedup_plot(results, path) -> pathlib.Path:
    """Grouped bars per dataset: tau (pooled) on top, speedup over ar below."""
    sets = list(dict.fromkeys(r.dataset for r in results.summary))
    labels = list(results.setup["labels"])
    fig = _figure(min(14.0, max(7.5, 0.3 * len(sets) * max(1, len(labels)) + 2)), 7.0)
    x = np.arange(len(sets))
    width = 0.8 / max(len(labels), 1)
    for p, (field, title) in enumerate((("tau_pooled", "acceptance length tau (pooled: sum / rounds)"),
                                        ("speedup", "speedup over ar = TPOT(ar) / TPOT(method)"))):
        ax = fig.add_subplot(2, 1, p + 1)
        for j, label in enumerate(labels):
            vals = [_val(getattr(_row(results, name, label), field, None)) for name in sets]
            st = method_style(label)
            ax.bar(x + (j - (len(labels) - 1) / 2) * width, vals, width, label=label, color=st["color"],
                   hatch=st["hatch"] or None, edgecolor="white" if st["hatch"] else None, linewidth=0)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(x, sets)
        ax.set_ylabel(field.replace("_", " "))
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        if p == 0:
            ax.legend(fontsize=7, ncols=min(len(labels), 5))
    return _finish(fig, path, "tau and speedup per dataset", results)


def stage_plot(results, path) -> pathlib.Path:
    """Stacked bars: ms per round per stage for each method (pooled over datasets), with ar's TPOT."""
    scope = "all" if any(r.dataset == "all" for r in results.summary) else results.summary[0].dataset
    rows = [r for r in results.rows(scope) if r.stage_ms_per_round]
    fig = _figure(max(7.5, 0.9 * len(rows) + 4.5), 4.8)
    ax = fig.add_subplot(1, 1, 1)
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for stage in STAGES:
        vals = np.nan_to_num([_val(r.stage_ms_per_round.get(stage)) for r in rows])
        ax.bar(x, vals, 0.6, bottom=bottom, label=stage, color=STAGE_COLORS[stage])
        bottom += vals
    fused = [_val(r.round_ms) for r in rows]
    if not all(np.isnan(fused)):
        ax.plot(x, fused, "kD", ms=5, label="same round in the fused loop (timed pass)")
    ar = next((r for r in results.rows(scope) if is_reference(r.label)), None)
    if ar and not np.isnan(_val(ar.round_ms)):
        ax.axhline(ar.round_ms, color="k", ls="--", lw=1, label=f"ar: ms per token, fused loop ({ar.round_ms:.2f})")
    for xi, r, top in zip(x, rows, bottom, strict=True):
        ax.text(xi, top, f"tau {_val(r.tau_pooled):.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, [r.label for r in rows], rotation=20, ha="right")
    ax.set_ylabel("ms per round")
    ax.set_title("bars: instrumented pass (each stage its own synced call); markers: fused on-device loop", fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    if not rows:
        ax.text(0.5, 0.5, "no instrumented pass in this run", ha="center", va="center", transform=ax.transAxes)
    return _finish(fig, path, f"Time per round by stage ({scope})", results)


def throughput_plot(results, path) -> pathlib.Path:
    """The batch-size sweep: throughput (tokens/s, log scale) against batch size (log2) per method, ar
    included, with a bar from the median to the best case; below, the speedup over ar at each size."""
    rows = results.sweep_rows
    sizes = sorted({int(r.batch_size) for r in rows})
    fig = _figure(8.0, 7.5)
    top = fig.add_subplot(2, 1, 1)
    bottom = fig.add_subplot(2, 1, 2, sharex=top)
    for label in dict.fromkeys(r.label for r in rows):
        mine = sorted((r for r in rows if r.label == label), key=lambda r: r.batch_size)
        xs = np.array([float(r.batch_size) for r in mine])
        med = np.array([_val(r.tokens_per_s) for r in mine])
        best = np.array([_val(r.tokens_per_s_best) for r in mine])
        st = method_style(label)
        kw = dict(color=st["color"], ls=st["linestyle"], marker=st["marker"], ms=5)
        top.plot(xs, med, label=f"{label} (median)", lw=2.2 if is_reference(label) else 1.5, **kw)
        top.vlines(xs, np.fmin(med, best), np.fmax(med, best), color=st["color"], lw=3, alpha=0.35)
        if not is_reference(label):
            bottom.plot(xs, [_val(r.speedup) for r in mine], label=label, **kw)
    top.set_xscale("log", base=2)
    if any(_val(r.tokens_per_s) > 0 for r in rows):  # NaN (not measured) > 0 is False
        top.set_yscale("log")
    top.set_ylabel("throughput (output tokens / s, all sequences)")
    top.set_title("tokens/s against batch size (line: median runs; bar: up to the fastest runs)", fontsize=9)
    top.grid(alpha=0.3, which="both")
    top.legend(fontsize=7)
    bottom.axhline(1.0, color=method_style(AR_LABEL)["color"], lw=1, ls="--", label=AR_LABEL)
    bottom.set(xlabel="batch size (sequences decoded together)", ylabel="speedup over ar (same batch size)")
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize=7)
    if sizes:
        bottom.set_xticks(sizes, [str(b) for b in sizes])
        bottom.set_xlim(sizes[0] / 1.4, sizes[-1] * 1.4)
    return _finish(fig, path, f"Batch-size sweep: throughput per method (prompts {results.sweep.fill} to fill each "
                   "batch)", results)


def make_plots(results, folder, written: list) -> list[pathlib.Path]:
    """Writes the PNGs into ``folder``: the three per-set plots when there is a summary, and
    ``throughput_vs_batch.png`` when there is a batch-size sweep; each path is appended to ``written`` as soon
    as it exists."""
    plots = [(acceptance_plot, "acceptance_per_depth.png"), (tau_speedup_plot, "tau_speedup.png"),
             (stage_plot, "stage_time.png")] if results.summary else []
    if results.sweep_rows:
        plots.append((throughput_plot, "throughput_vs_batch.png"))
    for plot, name in plots:
        written.append(plot(results, pathlib.Path(folder) / name))
    return written
