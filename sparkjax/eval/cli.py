"""``python -m sparkjax.eval``: the benchmark harness's command line (see ``--help``)."""

from __future__ import annotations

import argparse
import os
import sys
import time

from .. import _startup, engine
from ..cli import OneLineParser
from ..errors import EvalError, SparkjaxError
from . import datasets as ds
from .config import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MAX_SAMPLES,
    DEFAULT_METHODS,
    DEFAULT_REPEATS,
    EvalConfig,
)
from .harness import run
from .pair import BASELINE_METHODS
from .report import compare
from .results import EvalResults
from .runner import sigint_flag

_MAIN = [m for m in engine.METHODS if engine.parse_method(m).speculative and m not in BASELINE_METHODS]
DESCRIPTION = f"""\
Benchmark speculative decoding on a target/drafter pair: per prompt set and method, the acceptance length tau
(pooled and per-response mean), tokens/s and speedup over ar (measured in the same run), per-depth acceptance
rates and per-stage time per round. Prints a table and writes results.json, results.csv and PNG plots to --out.

With no argument it runs the demo pair bundled in the package (sparkjax/assets/demo) on its three prompt sets:
a small Qwen3 target; the drafter dspark_b16, with a Markov head, for {', '.join(_MAIN)}; and dflash_b16,
without one, for {', '.join(BASELINE_METHODS)}."""

EPILOG = """\
timing (docs/eval.md): per batch, --repeats interleaved repetitions of every method, each a full run then a
prefill-only run; decode time = median(full) - median(prefill-only). The batch-size sweep (--batch-sizes) runs
every method at every batch size on the selected prompts, cycled to fill each batch, and writes batch_sweep.csv
and throughput_vs_batch.png instead of results.csv and the per-set plots.

examples:
  python -m sparkjax.eval --methods ar,dspark,sparklingtree --budgets 16,64 --datasets stdlib_code,my.jsonl
  python -m sparkjax.eval --target Qwen3-4B --drafter dspark-4b --baseline-drafter dflash-4b --dtype bfloat16 \\
      --datasets gsm8k,mt-bench --max-new-tokens 256 --out runs/q4b
  python -m sparkjax.eval --methods ar,dspark --budgets 16 --batch-sizes 1,4,16,64 --max-samples 2

--out is created and tested for writing before any work; each results file is written atomically; outputs an
earlier run left there are replaced or removed, no other file is touched. Ctrl-C stops after the current step
and writes the batches every method had finished, marked interrupted; a second Ctrl-C stops at once.
exit codes: 0 done, 2 bad input (one line on stderr), 130 interrupted."""


def _count_or_all(text: str):
    if text.strip().lower() == "all":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'all', got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m sparkjax.eval", description=DESCRIPTION, epilog=EPILOG,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("pair")
    g.add_argument("--target", metavar="DIR", help="Hugging Face Qwen3 folder (default: the bundled demo target)")
    g.add_argument("--drafter", metavar="DIR",
                   help="DeepSpec DSpark or z-lab DFlash folder for the speculative methods (default: the demo's "
                        "dspark_b16, with the demo target only; needs --target)")
    g.add_argument("--baseline-drafter", metavar="DIR",
                   help=f"drafter for the methods without a Markov head ({', '.join(BASELINE_METHODS)}) (default: "
                        "--drafter; with the demo target, the demo's dflash_b16; needs --target)")
    g.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder (default: the --target folder)")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="parameter dtype (default: the checkpoint's own; float32 for the bundled demo pair)")
    g = p.add_argument_group("runs")
    g.add_argument("--methods", default=",".join(DEFAULT_METHODS), metavar="LIST",
                   help=f"comma-separated methods out of {','.join(engine.METHODS)} (default: "
                        f"{','.join(DEFAULT_METHODS)}); a tree may carry its budget and options as a label "
                        "(sparklingtree@64:seed:fanout=16) or its options alone (sparklingtree:seed); ar is always "
                        "run, as the speedup reference")
    g.add_argument("--budgets", metavar="LIST",
                   help=f"tree sizes (nodes per round) for {' / '.join(engine.TREE_METHODS)}; each tree method runs "
                        "once per budget (default: each tree's own, 64 nodes; pctree 32 with the root, or what its "
                        "beam keeps); an error with chain-only methods")
    g.add_argument("--top-c", type=int, metavar="C", help="candidates per depth of a tree (default: the engine's)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 = lossless sampling")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="top-p when sampling, in (0, 1] (default 1: off); after top-k, lossless under every method")
    g.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="top-k when sampling, >= 0 (default 0: off); after the temperature, lossless")
    g.add_argument("--datasets", default=ds.DEFAULT, metavar="LIST",
                   help=f"comma-separated bundled sets (the demo's {','.join(ds.DEMO_SETS)}, the default; and, in a "
                        f"source checkout, {','.join(ds.EVAL_SETS)} from ./eval/datasets or ${ds.ENV_VAR}) and/or "
                        "JSONL files of {\"turns\": [...]} (chat) or {\"text\": \"...\"} (raw) objects")
    g.add_argument("--max-samples", type=int, default=DEFAULT_MAX_SAMPLES, metavar="N",
                   help=f"prompts per set, the first N in file order that fit the target (default: "
                        f"{DEFAULT_MAX_SAMPLES}; 0 = all)")
    g.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, metavar="N",
                   help=f"tokens to generate (default: {DEFAULT_MAX_NEW_TOKENS})")
    batch = g.add_mutually_exclusive_group()
    batch.add_argument("--batch-size", type=int, metavar="B", help="prompts decoded together (default: 1)")
    batch.add_argument("--batch-sizes", metavar="LIST", help="run the batch-size sweep at these sizes (e.g. 1,4,16,64)")
    g.add_argument("--seed", type=int, default=0, help="seed of the first batch, in [0, 2**63); batch i uses seed + i")
    g.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, metavar="N",
                   help="timed repetitions per batch and method, interleaved across methods; the table shows the "
                        f"median and the fastest (default: {DEFAULT_REPEATS})")
    g.add_argument("--stage-samples", type=_count_or_all, default=0, metavar="N",
                   help="prompts per set (the first N with at least one round) that also get the separate, "
                        "instrumented per-stage pass, which compiles every stage of every method apart (default: 0, "
                        "none; 'all')")
    g.add_argument("--mesh", metavar="DATAxMODEL", help="shard generation over a device mesh (default: one device)")
    g.add_argument("--fresh-auto", action="store_true", help="auto starts every batch from nothing, not its memory")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the target's EOS ids")
    g = p.add_argument_group("output")
    g.add_argument("--out", metavar="DIR", help="output folder (default: eval/out/<date-time>)")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    g.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                   help="print the differences between two results.json files (nothing is run)")
    return p


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    fields = {k: v for k, v in vars(args).items() if k not in ("no_plots", "no_progress", "compare")}
    if args.max_samples is not None and args.max_samples < 0:
        raise EvalError(f"--max-samples: expected a positive integer or 0 (all), got {args.max_samples}")
    return EvalConfig(**{**fields, "max_samples": args.max_samples or None, "plots": not args.no_plots,
                         "batch_size": 1 if args.batch_size is None else args.batch_size,
                         "out": args.out or os.path.join("eval", "out", time.strftime("%Y%m%d-%H%M%S"))})


def main(argv: list[str] | None = None) -> int:
    """Runs the CLI; returns the exit code (0 ok, 2 bad input, 130 interrupted)."""
    with sigint_flag():  # Ctrl-C sets a flag the run checks between steps (the previous handler comes back after)
        _startup.check()  # a Ctrl-C while jax was imported: exit 130, nothing written
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:  # --help (0) or a malformed flag (2, already reported in one line)
            return int(e.code or 0)
        try:
            if args.compare:
                print(compare(*(EvalResults.load(p) for p in args.compare), *args.compare))
                return 0
            cfg = config_from_args(args)
            t0 = time.perf_counter()
            results = run(cfg, progress=not args.no_progress)
            print(results.table())
            state = "partial results (interrupted) written to" if results.interrupted else "wrote"
            print(f"\n{state} {cfg.out}: " + ", ".join(os.path.basename(f) for f in results.setup.get("files", [])))
            print(f"total time {time.perf_counter() - t0:.1f} s")
            sys.stdout.flush()
            return 130 if results.interrupted else 0
        except SparkjaxError as e:
            print(f"error: {' '.join(str(e).split()) or type(e).__name__}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # before the first batch finished (e.g. while loading): nothing to write
            print("interrupted before any result (nothing written)", file=sys.stderr)
            return 130
