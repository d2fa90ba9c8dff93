"""Joint (re)training of a DSpark drafter against a Qwen3 target; see train/README.md.

    python train/train.py --recipe tiny --output runs/tiny
    python train/train.py --help
"""

import sys

from sparkjax.training.cli import main

if __name__ == "__main__":
    sys.exit(main())
