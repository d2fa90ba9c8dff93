"""Ctrl-C while ``python -m sparkjax[.eval|.training]`` starts.

Importing jax and loading models takes seconds, and a Ctrl-C in that window could be swallowed: a
KeyboardInterrupt raised inside a garbage-collection callback is only printed, and the run went on
(and wrote its results). :func:`install` (called by the package's ``__init__`` only when a ``-m`` entry
point is starting and Python's own handler is in place) routes SIGINT to :func:`handler`, which behaves
exactly like Python's (it raises KeyboardInterrupt) but also remembers the signal. Each CLI calls
:func:`check` before its work: a remembered Ctrl-C ends the process with exit code 130 and one line,
before anything is written. Library imports (``import sparkjax``) are untouched.
"""

from __future__ import annotations

import signal
import sys

pending = False


def handler(signum, frame) -> None:
    global pending
    pending = True
    raise KeyboardInterrupt


def install() -> None:
    if sys.argv[:1] == ["-m"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, handler)


def check() -> None:
    """Exits with 130 when a Ctrl-C arrived during start-up (even one a library swallowed)."""
    if pending:
        print("interrupted during start-up; nothing was written", file=sys.stderr, flush=True)
        raise SystemExit(130)
