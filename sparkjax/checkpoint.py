"""Alias of :mod:`sparkjax.io.checkpoint` (orbax: ``save_model``, ``restore_model``, ``TrainCheckpointer``).

``import sparkjax.checkpoint`` gives the very same module object; orbax is imported there only.
"""

import sys

from .io import checkpoint as _checkpoint

sys.modules[__name__] = _checkpoint
