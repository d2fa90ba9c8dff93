"""``python -m sparkjax.eval``: see :mod:`sparkjax.eval.cli`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
