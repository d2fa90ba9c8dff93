"""``python -m sparkjax.training``: the trainer's command line (same as ``train/train.py``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
