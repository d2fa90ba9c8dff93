"""sparkjax's benchmarks, one subcommand each (``python -m sparkjax.bench COMMAND --help``)."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence

from sparkjax import _startup
from sparkjax.cli import OneLineParser, run_cli

from . import ar, attention, device, drafter, gpu, round, scale, serve, train, tree
from .common import Report

COMMANDS = {"ar": ar, "round": round, "tree": tree, "drafter": drafter, "scale": scale, "train": train,
            "attention": attention, "gpu-compile": gpu, "device": device, "serve": serve}


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m sparkjax.bench", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, mod in COMMANDS.items():
        mod.add_arguments(sub.add_parser(name, help=mod.__doc__.splitlines()[0], description=mod.__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one subcommand; exit code 0, 2 (a bad argument: one line on stderr) or 130 (Ctrl-C: what was
    measured is still printed and written)."""
    _startup.check()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage mistake (2, one line)
        return int(e.code or 0)
    report = Report("python -m sparkjax.bench " + shlex.join(argv), getattr(args, "out", None),
                    getattr(args, "json", None))

    def work() -> int:
        try:
            rc = COMMANDS[args.command].run(args, report)
        except KeyboardInterrupt:
            report.emit(interrupted=True)
            raise
        report.emit()
        return rc or 0

    return run_cli(work)


if __name__ == "__main__":
    sys.exit(main())
