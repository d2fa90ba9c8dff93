"""Pre-trains the demo pair's Qwen3 target from scratch (resumable) and exports it as an HF folder.

    python train/train_target.py --recipe train/recipes/demo_target.json --corpus runs/demo/corpus \
        --output runs/demo/target [--resume] [--max-minutes 80] [--set steps=4000]
    python train/train_target.py --output runs/demo/target --export OUT --tokenizer runs/demo/tokenizer
"""

from __future__ import annotations

import json
import os
import sys

from sparkjax.config import read_json
from sparkjax.errors import TrainingError
from sparkjax.text import load_tokenizer
from sparkjax.training.cli import OneLineParser, parse_set, run_cli
from sparkjax.training.lm import LMConfig, export_lm, train_lm
from sparkjax.training.outdir import check_overwritable


def main(argv=None) -> int:
    p = OneLineParser(prog="train_target.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe")
    p.add_argument("--corpus", help="folder with train.tokens.npy / heldout.tokens.npy (train/demo_tokenizer.py)")
    p.add_argument("--output", required=True)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--force-resume", action="store_true",
                   help="resume even though the schedule (steps, lr, ...) changed; model and data shapes must match")
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--export", metavar="DIR", help="write the latest checkpoint as an HF Qwen3 folder and exit")
    p.add_argument("--tokenizer", help="tokenizer folder copied into the export")
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args(argv)
    return run_cli(lambda: _main(a))


def _main(a) -> int:
    if a.export:
        check_overwritable(a.export, "--export")  # before any work
        special = None
        if a.tokenizer:
            if not os.path.isfile(os.path.join(a.tokenizer, "tokenizer.json")):
                raise TrainingError(f"--tokenizer {a.tokenizer}: no tokenizer.json there")
            tok = load_tokenizer(a.tokenizer, error=TrainingError)
            special = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
        export_lm(a.output, a.export, tokenizer=a.tokenizer, dtype=a.dtype, overwrite=True, special_ids=special)
        print(f"wrote {a.export}")
        return 0
    if not a.recipe or not a.corpus:
        raise TrainingError("--recipe and --corpus are required to train")
    cfg = LMConfig.from_dict({**read_json(a.recipe, TrainingError, "recipe"), **parse_set(a.set)}, source=a.recipe)
    r = train_lm(cfg, a.output, tokens=os.path.join(a.corpus, "train.tokens.npy"),
                 heldout=os.path.join(a.corpus, "heldout.tokens.npy"), resume=a.resume or a.force_resume,
                 force_resume=a.force_resume, max_minutes=a.max_minutes)
    print(json.dumps(r.__dict__))
    return 0


if __name__ == "__main__":
    sys.exit(main())
