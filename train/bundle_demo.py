"""Copies the trained demo pair into the package (``sparkjax/assets/demo``), in bfloat16, and checks it.

    python train/bundle_demo.py --target runs/demo/target --dspark runs/demo/dspark/best_drafter \
        --dflash runs/demo/dflash/best_drafter --corpus runs/demo/corpus
    python train/bundle_demo.py --drafters-only --dspark runs/demo/ft/dspark_tree/drafter \
        --dflash runs/demo/ft/dflash_tree/drafter --dspark-run runs/demo/ft/dspark_tree \
        --dflash-run runs/demo/ft/dflash_tree

Writes ``target/``, ``dspark_b16/``, ``dflash_b16/`` and ``training.json`` (corpus manifest, tokenizer hash,
run configs and final metrics), each part atomically; refuses a bundle over ``--max-mb``. ``--drafters-only``
replaces just the two drafters and records the fine-tune runs under ``dspark_finetune`` / ``dflash_finetune``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


def last_metrics(run_dir: str, split: str) -> dict | None:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        rows = [r for r in map(json.loads, filter(str.strip, f)) if r.get("split") == split]
    return rows[-1] if rows else None


def run_record(run: str) -> dict:
    cfg = os.path.join(run, "config.json")
    return {"config": read_json(cfg) if os.path.isfile(cfg) else None, "last_train": last_metrics(run, "train"),
            "last_eval": last_metrics(run, "eval")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="HF folder written by train/train_target.py --export (default with "
                   "--drafters-only: the bundled target)")
    p.add_argument("--target-run", default="runs/demo/target_run")
    p.add_argument("--dspark", required=True)
    p.add_argument("--dflash", required=True)
    p.add_argument("--dspark-run", default="runs/demo/dspark")
    p.add_argument("--dflash-run", default="runs/demo/dflash")
    p.add_argument("--corpus", help="the corpus folder (required unless --drafters-only)")
    p.add_argument("--drafters-only", action="store_true",
                   help="replace only the two drafters (a fine-tune); --dspark-run / --dflash-run are its runs")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "sparkjax", "assets", "demo"))
    p.add_argument("--max-mb", type=float, default=25.0)
    a = p.parse_args(argv)
    if not a.drafters_only and (a.target is None or a.corpus is None):
        p.error("--target and --corpus are required (unless --drafters-only)")
    import sparkjax
    from sparkjax.io.atomic import atomic_dir, atomic_file

    runs = {"dspark": a.dspark_run, "dflash": a.dflash_run}
    if a.drafters_only:  # the bundled target and record; the fine-tune runs must have their configs
        info = read_json(os.path.join(a.out, "training.json"))
        for kind, run in runs.items():
            info[f"{kind}_finetune"] = run_record(run)
            if info[f"{kind}_finetune"]["config"] is None:
                print(f"error: {os.path.join(run, 'config.json')}: no run config (pass the fine-tune's output "
                      "folder)", file=sys.stderr)
                return 2
        target = sparkjax.load_target(os.path.join(a.out, "target"))
    else:
        target = sparkjax.load_target(a.target)
        with open(os.path.join(a.target, "tokenizer.json"), "rb") as f:
            tokenizer_sha = hashlib.sha256(f.read()).hexdigest()
        info = {"corpus": read_json(os.path.join(a.corpus, "manifest.json")), "tokenizer_sha256": tokenizer_sha,
                "target_run": {"config": read_json(os.path.join(a.target_run, "config.json")),
                               "last_train": last_metrics(a.target_run, "train")}}
        info.update({f"{kind}_run": run_record(run) for kind, run in runs.items()})
        with atomic_dir(os.path.join(a.out, "target"), overwrite=True) as tmp:
            for name in sorted(os.listdir(a.target)):
                shutil.copy2(os.path.join(a.target, name), os.path.join(tmp, name))
    drafters = {name: sparkjax.load_drafter(src, target=target)
                for name, src in (("dspark_b16", a.dspark), ("dflash_b16", a.dflash))}
    parts = {"target": os.path.join(a.out, "target")}
    for name, drafter in drafters.items():
        parts[name] = sparkjax.save_drafter(drafter, os.path.join(a.out, name), overwrite=True, dtype="bfloat16")
    info["bytes"] = {k: folder_bytes(v) for k, v in parts.items()}
    total = sum(info["bytes"].values())
    with atomic_file(os.path.join(a.out, "training.json")) as tmp, open(tmp, "w") as f:
        json.dump(info, f, indent=2)
    print(json.dumps({"bytes": info["bytes"], "total_mb": round(total / 2**20, 2)}))
    if total > a.max_mb * 2**20:
        print(f"error: the bundle is {total / 2**20:.1f} MiB, over --max-mb {a.max_mb}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
