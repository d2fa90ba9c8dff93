"""Ctrl-C while ``python -m sparkjax[.eval|.training]`` starts.

For a ``-m`` entry point, :func:`install` (first in the package's ``__init__``) routes SIGINT to :func:`handler`
and blocks it in the main thread, so no signal lands inside an import; :func:`release` (last in ``__init__``)
unblocks it, and a Ctrl-C that came during the imports ends the process with one line and exit code 130. Later,
:func:`handler` raises KeyboardInterrupt but remembers the signal; each CLI calls :func:`check` before its work.
``import sparkjax`` as a library changes nothing.
"""

from __future__ import annotations

import signal
import sys

pending = False
_blocked = False


def handler(signum, frame) -> None:
    global pending
    pending = True
    raise KeyboardInterrupt


def install() -> None:
    global _blocked
    if sys.argv[:1] != ["-m"] or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return
    signal.signal(signal.SIGINT, handler)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        _blocked = True


def release() -> None:
    """Unblocks SIGINT; a Ctrl-C that arrived while it was blocked is handled here (exit 130)."""
    global _blocked
    if not _blocked:
        return
    _blocked = False
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # runs a pending handler before returning
    except KeyboardInterrupt:
        pass
    check()


def check() -> None:
    """Exits with 130 when a Ctrl-C arrived during start-up (even one a library swallowed)."""
    if pending:
        print("interrupted during start-up; nothing was written", file=sys.stderr, flush=True)
        raise SystemExit(130)
