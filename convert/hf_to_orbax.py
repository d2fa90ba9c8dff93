"""Convert a Hugging Face Qwen3 folder into a sparkjax orbax checkpoint (written atomically).

    python -m convert.hf_to_orbax HF_FOLDER OUT_FOLDER [--dtype bfloat16] [--overwrite]

``--overwrite`` replaces only a folder sparkjax wrote or an empty one. Errors print one line and exit 2.
"""

from __future__ import annotations

import argparse
import sys

from sparkjax.cli import run_cli
from sparkjax.io.atomic import check_destination
from sparkjax.io.checkpoint import save_model
from sparkjax.io.hf import load_target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", help="Hugging Face Qwen3 folder (config.json + *.safetensors)")
    ap.add_argument("dst", help="output folder (must not exist unless --overwrite)")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an existing output folder (only one sparkjax wrote, or an empty one)")
    args = ap.parse_args(argv)
    check_destination(args.dst, overwrite=args.overwrite)  # refuse before the (slow) load
    model = load_target(args.src, dtype=args.dtype)
    save_model(model, args.dst, overwrite=args.overwrite)
    print(f"wrote {args.dst}")
    return 0


def cli(argv: list[str] | None = None) -> int:
    """``main`` with the CLI convention: a SparkjaxError prints one line and returns 2."""
    return run_cli(lambda: main(argv))


if __name__ == "__main__":
    sys.exit(cli())
