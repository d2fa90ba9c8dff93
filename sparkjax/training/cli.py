"""Command line of the trainer (``python train/train.py`` or ``python -m sparkjax.training``).

    python train/train.py --recipe tiny --output runs/tiny       # a recipe of train/recipes by name
    python -m sparkjax.training --recipe train/recipes/tiny.json --output runs/tiny
    python train/train.py --recipe ... --output runs/b16 --resume          # continue where it stopped
    python train/train.py --recipe ... --output runs/b16 --export best     # write a checkpoint as DeepSpec
"""

from __future__ import annotations

import argparse
import json
import os

from .. import _startup
from ..cli import OneLineParser
from ..cli import run_cli as _run_cli
from ..errors import ArgumentError
from .config import TrainConfig
from .drafter import export_run, train


def run_cli(body) -> int:
    """:func:`sparkjax.cli.run_cli` with the trainers' Ctrl-C line."""
    return _run_cli(body, interrupted="interrupted (Ctrl-C); --resume continues from the last saved checkpoint")


def parse_set(items: list[str]) -> dict:
    """``--set KEY=VALUE`` items: VALUE as JSON, else a string; ``HEAD.SUB=VALUE`` sets ``{HEAD: {SUB: VALUE}}``."""
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq:
            raise ArgumentError(f"--set: expected KEY=VALUE, got {item!r}")
        if not key or (("." in key) and not all(key.split(".", 1))):
            raise ArgumentError(f"--set: empty key in {item!r}")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        head, dot, sub = key.partition(".")
        if dot:
            out.setdefault(head, {})[sub] = parsed
        else:
            out[key] = parsed
    return out


def _recipe_path(name: str, recipes_dir: str | None) -> str:
    """``name`` as a path, else ``recipes_dir/name[.json]``."""
    if os.path.exists(name) or recipes_dir is None:
        return name
    candidate = os.path.join(recipes_dir, name if name.endswith(".json") else name + ".json")
    return candidate if os.path.exists(candidate) else name


def parser(recipes_dir: str | None = None) -> argparse.ArgumentParser:
    named = sorted(f[:-5] for f in os.listdir(recipes_dir) if f.endswith(".json")) \
        if recipes_dir and os.path.isdir(recipes_dir) else []
    ap = OneLineParser(prog="train.py", formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Joint (re)training of a DSpark drafter (Markov + confidence heads) against a "
                       "Qwen3 target.", epilog=("Recipes: " + ", ".join(named)) if named else None)
    ap.add_argument("--recipe", required=True,
                    help="a JSON recipe file (its relative paths are relative to the file)"
                    + (f", or the name of one in {recipes_dir}" if recipes_dir else ""))
    ap.add_argument("--output", required=True, help="run folder (checkpoints, metrics.jsonl, exported drafters)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a recipe key (JSON value, else a string); drafter.KEY=VALUE for drafter settings")
    ap.add_argument("--steps", type=int, help="shorthand for --set steps=N")
    ap.add_argument("--resume", action="store_true", help="continue from the newest good checkpoint in --output")
    ap.add_argument("--force-resume", action="store_true",
                    help="resume even if the config or the data differ from the checkpoint's")
    ap.add_argument("--stop-at", type=int, metavar="STEP",
                    help="stop after this step (and its checkpoint), as an interruption would; resume later")
    ap.add_argument("--max-minutes", type=float, metavar="M",
                    help="stop (with a checkpoint) after M minutes of training; resume later")
    ap.add_argument("--export", metavar="WHICH",
                    help="do not train: export checkpoint 'latest', 'best' or a step number to DeepSpec format")
    ap.add_argument("--export-to", metavar="DIR", help="folder for --export (default: OUTPUT/export_stepN)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return ap


def main(argv: list[str] | None = None, *, recipes_dir: str | None = None) -> int:
    """The command line; ``recipes_dir``: where ``--recipe NAME`` looks (``train/train.py`` passes its ``recipes/``)."""
    _startup.check()  # a Ctrl-C while jax was imported: exit 130, nothing written
    args = parser(recipes_dir).parse_args(argv)
    return run_cli(lambda: _main(args, recipes_dir))


def _main(args, recipes_dir: str | None = None) -> int:
    if args.export_to is not None and not args.export:
        raise ArgumentError("--export-to: only used with --export WHICH")
    overrides = parse_set(args.set)
    if args.steps is not None:
        overrides["steps"] = args.steps
    cfg = TrainConfig.from_file(_recipe_path(args.recipe, recipes_dir), overrides)
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    if args.export:
        export_run(cfg, args.output, args.export, args.export_to)
        return 0
    result = train(cfg, args.output, resume=args.resume or args.force_resume, force_resume=args.force_resume,
                   progress=not args.no_progress, stop_at=args.stop_at, max_minutes=args.max_minutes)
    summary = {"output": result.output_dir, "step": result.step, "resumed_from": result.resumed_from,
               "drafter": result.drafter_dir, "best_drafter": result.best_dir, "stopped_early": result.stopped_early}
    if result.last_eval is not None:
        summary["eval_tau"] = result.last_eval["tau_probabilistic"]
    print(json.dumps(summary))
    return 0
