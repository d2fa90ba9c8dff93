"""Convert a Hugging Face Qwen3 folder into a sparkjax orbax checkpoint.

    python -m convert.hf_to_orbax HF_FOLDER OUT_FOLDER [--dtype bfloat16] [--overwrite]

The output is written to a temp folder beside OUT_FOLDER and renamed when complete.
"""

from __future__ import annotations

import argparse
import sys

from sparkjax.checkpoint import save_model
from sparkjax.convert import load_target
from sparkjax.errors import SparkjaxError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", help="Hugging Face Qwen3 folder (config.json + *.safetensors)")
    ap.add_argument("dst", help="output folder (must not exist unless --overwrite)")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    args = ap.parse_args(argv)
    model = load_target(args.src, dtype=args.dtype)
    save_model(model, args.dst, overwrite=args.overwrite)
    print(f"wrote {args.dst}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SparkjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
