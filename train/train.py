"""Joint (re)training of a DSpark drafter against a Qwen3 target; see train/README.md.

    python train/train.py --recipe tiny --output runs/tiny      # a recipe of train/recipes/, by name
    python train/train.py --help
"""

import os
import sys

from sparkjax.training.cli import main

RECIPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recipes")

if __name__ == "__main__":
    sys.exit(main(recipes_dir=RECIPES))
