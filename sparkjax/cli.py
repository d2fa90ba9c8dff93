"""Shared helpers of sparkjax's command lines: a mistake is one line on stderr and exit code 2.

    def main(argv=None) -> int:
        args = OneLineParser(prog="tool.py").parse_args(argv)
        return run_cli(lambda: _main(args))
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from .errors import SparkjaxError

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr and exit code 2 (no usage block)."""

    def error(self, message: str):
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def run_cli(main: Callable[[], int | None], *, interrupted: str = "interrupted (Ctrl-C)") -> int:
    """Runs ``main()`` and returns its exit code (None counts as 0).

    A :class:`~sparkjax.errors.SparkjaxError` or an OS error (disk full, no permission) is one line
    ``error: ...`` on stderr and exit code 2; Ctrl-C (:class:`KeyboardInterrupt`) is the one line
    ``interrupted`` and exit code 130. Anything else is a bug and keeps its traceback."""
    try:
        rc = main()
    except SparkjaxError as e:
        print(f"error: {e}", file=sys.stderr)
    except OSError as e:
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        print(f"error: {where}{e.strerror or e}", file=sys.stderr)
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return EXIT_INTERRUPTED
    else:
        return 0 if rc is None else int(rc)
    return EXIT_USAGE
