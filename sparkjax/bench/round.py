"""Kernel, byte and FLOP counts of one speculative round and one AR step from the optimised HLO: a GPU projection.

    python -m sparkjax.bench round --preset real,demo --batches 1,8 --budgets 16,64 --out PATH --json PATH
    python -m sparkjax.bench round --quick        # real preset, batch 1: ar, dspark, sparklingtree@64

Abstract bf16 weights, programs compiled for XLA:CPU (nothing runs); one round and one AR step counted by
:mod:`sparkjax.bench.hlo`. Per row: ``kernels``, ``sequential_kernels``, ``bytes``, ``flops`` and
``<device>_ar_steps_at_<N>us`` (round over AR-step roofline time plus N us per sequential kernel);
``round_ar_steps_at_2us`` is the H100's at 2 us.
"""

from __future__ import annotations

from sparkjax.engine.options import Options
from sparkjax.errors import ArgumentError

from . import hlo
from .common import (
    TAU,
    WRITEUP_SPEEDUP,
    add_output,
    configs,
    describe,
    dump_hlo,
    ints,
    label_fields,
    log,
    method_labels,
    names,
)
from .gpu import compile_program

ATTENTION = ("einsum", "dpa", "blocked", "prefix", "fused")


def add_arguments(p) -> None:
    p.add_argument("--preset", default="real,demo", help="comma-separated: real, demo, reduced, tiny")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--budgets", default="16,64")
    p.add_argument("--methods", default="ar,dflash,dspark,ddtree,sparklingtree,sparklingtree-beam",
                   help="names, name@budget, and tree options name[@budget]:base|corrected|union|seed|fanout=K|auto")
    p.add_argument("--context", type=int, default=1024, help="cache slots S (the cache bucket)")
    p.add_argument("--tau", type=float, default=TAU, help="accepted tokens per round for the projected speedup")
    p.add_argument("--quick", action="store_true", help="real preset, batch 1: ar, dspark, sparklingtree@64")
    p.add_argument("--dump-hlo", metavar="DIR", help="also write each compiled program's HLO text into DIR")
    p.add_argument("--chain", default="fixed_point", choices=("fixed_point", "scan"),
                   help="the DSpark chain compiled (default: the GPU's, fixed_point; XLA:CPU's own is scan)")
    p.add_argument("--attention", default="einsum", choices=ATTENTION,
                   help="the attention compiled (default: what accelerators run, einsum); fused: every attention "
                        "call one opaque kernel charged what a fused GPU kernel reads and writes (a projection)")
    add_output(p)


def make_row(label: str, batch: int, preset: str, context: int, tally: hlo.Tally, ar: hlo.Tally, compile_s: float,
             tau: float | None) -> dict:
    """One record; ``tau`` None: the AR step's own row."""
    row = {**label_fields(label), "batch": batch, "preset": preset, "context": context,
           "kernels": tally.total_kernels, "sequential_kernels": tally.sequential_kernels,
           "unknown_loops": tally.unknown_loops, "bytes": tally.bytes, "flops": tally.flops,
           "ar_kernels": ar.total_kernels, "ar_bytes": ar.bytes, "ar_flops": ar.flops,
           "bytes_over_ar": tally.bytes / ar.bytes if ar.bytes else None, "compile_s": round(compile_s, 1),
           "projection": True, "stages": tally.by_stage()}
    for name, (bw, peak) in hlo.DEVICES.items():
        for us in hlo.LAUNCH_US:
            row[f"{name.lower()}_ar_steps_at_{us:g}us"] = (tally.seconds(bw, peak, us * 1e-6)
                                                           / ar.seconds(bw, peak, us * 1e-6))
        if tau is None:
            row[f"{name.lower()}_ar_step_us"] = ar.seconds(bw, peak) * 1e6
    row["round_ar_steps_at_2us"] = row["h100_ar_steps_at_2us"]
    row["round_ar_steps_at_2us_h200"] = row["h200_ar_steps_at_2us"]
    if tau is not None:
        row.update({"tau": tau, "projected_speedup_at_2us": tau / row["round_ar_steps_at_2us"],
                    "writeup_speedup": WRITEUP_SPEEDUP})
    return row


def _label(r: dict) -> str:
    base, _, opts = r["method"].partition(":")
    return base + (f"@{r['budget']}" if r["budget"] else "") + (f":{opts}" if opts else "")


def table(rows: list[dict]) -> str:
    devs = [(d, us) for d in hlo.DEVICES for us in hlo.TABLE_LAUNCH_US]
    head = (f"{'preset':7} {'B':>2} {'method':24} {'kernels':>7} {'seq':>5} {'MB':>9} {'GFLOP':>8} {'xAR MB':>6} | "
            + " ".join(f"{n}@{us:g}us" for n, us in devs) + f" | {'H100@2us':>8} {'spd@2us':>7} {'compile':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        proj = " ".join(f"{r[f'{n.lower()}_ar_steps_at_{us:g}us']:>{len(n) + len(f'{us:g}') + 3}.2f}" for n, us in devs)
        spd = f"{r['projected_speedup_at_2us']:.2f}x" if "projected_speedup_at_2us" in r else "-"
        unk = f" ({r['unknown_loops']} unknown loops counted once)" if r["unknown_loops"] else ""
        lines.append(f"{r['preset']:7} {r['batch']:>2} {_label(r):24} {r['kernels']:>7} {r['sequential_kernels']:>5} "
                     f"{r['bytes'] / 1e6:>9.1f} {r['flops'] / 1e9:>8.2f} {r['bytes_over_ar']:>6.2f} | {proj} | "
                     f"{r['round_ar_steps_at_2us']:>8.2f} {spd:>7} {r['compile_s']:>6.0f}s{unk}")
    stages = (*hlo.STAGES, "other")
    lines += ["", "Per stage (named scopes of the round): kernels / sequential kernels / MB",
              f"{'preset':7} {'B':>2} {'method':24} " + " ".join(f"{n:>20}" for n in stages)]
    for r in rows:
        cells = [f"{d['kernels']:>6}/{d['sequential_kernels']:>4}/{d['bytes'] / 1e6:>8.1f}" if (d := r["stages"].get(n))
                 else f"{'-':>20}" for n in stages]
        lines.append(f"{r['preset']:7} {r['batch']:>2} {_label(r):24} " + " ".join(cells))
    return "\n".join(lines)


def run(args, report) -> None:
    if args.quick:
        presets, batches, labels = ["real"], [1], ["dspark", "sparklingtree@64"]
    else:
        presets, batches = names(args.preset), ints(args.batches, "--batches")
        labels = method_labels(args.methods, ints(args.budgets, "--budgets"))
    for p in presets:
        configs(p)  # unknown presets fail before any compile
    if args.context < 64:
        raise ArgumentError(f"--context: {args.context} cache slots are too few (at least 64)")
    opts = Options(attention=hlo.fused_attention_model if args.attention == "fused" else args.attention,
                   chain_mode=args.chain)
    report.table = table
    report.header += [
        "# PROJECTIONS from the optimised XLA:CPU HLO (abstract bf16 weights; nothing measured on a GPU).",
        f"# DSpark chain compiled as: {args.chain}; attention as: {args.attention}"
        + (" (each call one opaque kernel charged its operands + output: a fused GPU kernel, modelled)"
           if args.attention == "fused" else "") + ".",
        f"# S = {args.context} cache slots. kernels / seq: executed per round (loop trips counted) / inside loops. "
        "MB, GFLOP: own byte model, matmul FLOPs.",
        "# xAR MB: round bytes over AR-step bytes. DEV@Nus: projected round cost in AR steps (per-kernel roofline + "
        "N us per sequential kernel).",
        f"# spd@2us: tau {args.tau} / H100 AR steps at 2 us (the SparklingTree write-up reports {WRITEUP_SPEEDUP}x).",
        *("# " + line for p in presets for line in describe(p).splitlines())]

    for preset in presets:
        for b in batches:
            ar = None
            for m in ["ar", *labels]:
                compiled, lower_s, compile_s, _ = compile_program(preset, m, b, args.context, opts)
                text = compiled.as_text()
                dump_hlo(args.dump_hlo, f"{preset}_b{b}_{m}", text)
                t = hlo.count_hlo(text, loop_body=True)
                ar = ar or t  # the first program is the AR step
                report.rows.append(make_row(m, b, preset, args.context, t, ar, lower_s + compile_s,
                                            None if m == "ar" else args.tau))
                log(f"  [{preset} B={b}] {m} compiled in {lower_s + compile_s:.0f}s: {t.total_kernels} kernels "
                    f"({t.sequential_kernels} sequential), {t.bytes / 1e6:.1f} MB")
