"""Alias of :mod:`sparkjax.io.atomic` (the crash-safe writers and the overwrite rule).

``import sparkjax.atomic`` gives the very same module object, so setting an attribute on it (as
tests do to simulate an OS without ``renameat2``) changes what the writers call.
"""

import sys

from .io import atomic as _atomic

sys.modules[__name__] = _atomic
