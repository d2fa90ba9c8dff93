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


def sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def last_metrics(run_dir: str, split: str) -> dict | None:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return None
    rows = [json.loads(line) for line in open(path) if line.strip()]
    rows = [r for r in rows if r.get("split") == split]
    return rows[-1] if rows else None


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
    from sparkjax.io.atomic import atomic_dir

    if a.drafters_only:
        return bundle_drafters(a)
    target = sparkjax.load_target(a.target)
    parts = {}
    with atomic_dir(os.path.join(a.out, "target"), overwrite=True) as tmp:
        for name in sorted(os.listdir(a.target)):
            shutil.copy2(os.path.join(a.target, name), os.path.join(tmp, name))
    parts["target"] = os.path.join(a.out, "target")
    for name, src in (("dspark_b16", a.dspark), ("dflash_b16", a.dflash)):
        drafter = sparkjax.load_drafter(src, target=target)
        parts[name] = sparkjax.save_drafter(drafter, os.path.join(a.out, name), overwrite=True, dtype="bfloat16")
    total = sum(folder_bytes(x) for x in parts.values())
    info = {
        "corpus": json.load(open(os.path.join(a.corpus, "manifest.json"))),
        "tokenizer_sha256": sha256_file(os.path.join(a.target, "tokenizer.json")),
        "target_run": {"config": json.load(open(os.path.join(a.target_run, "config.json"))),
                       "last_train": last_metrics(a.target_run, "train")},
        "bytes": {k: folder_bytes(v) for k, v in parts.items()},
    }
    for name, run in (("dspark_run", a.dspark_run), ("dflash_run", a.dflash_run)):
        cfg_path = os.path.join(run, "config.json")
        info[name] = {"config": json.load(open(cfg_path)) if os.path.isfile(cfg_path) else None,
                      "last_train": last_metrics(run, "train"), "last_eval": last_metrics(run, "eval")}
    return finish(a, info, total)


def finish(a, info: dict, total: int) -> int:
    """Writes ``training.json`` (atomically), prints the sizes, and refuses a bundle over ``--max-mb``."""
    tmp = os.path.join(a.out, ".training.json.tmp")
    with open(tmp, "w") as f:
        json.dump(info, f, indent=2)
    os.replace(tmp, os.path.join(a.out, "training.json"))
    print(json.dumps({"bytes": info["bytes"], "total_mb": round(total / 2**20, 2)}))
    if total > a.max_mb * 2**20:
        print(f"error: the bundle is {total / 2**20:.1f} MiB, over --max-mb {a.max_mb}", file=sys.stderr)
        return 2
    return 0


def bundle_drafters(a) -> int:
    """``--drafters-only``: both drafters re-saved in bfloat16 against the bundled target, and their fine-tune
    runs added to ``training.json``."""
    import sparkjax

    target = sparkjax.load_target(os.path.join(a.out, "target"))
    info_path = os.path.join(a.out, "training.json")
    with open(info_path) as f:
        info = json.load(f)
    for name, run in (("dspark_finetune", a.dspark_run), ("dflash_finetune", a.dflash_run)):
        cfg_path = os.path.join(run, "config.json")
        if not os.path.isfile(cfg_path):
            print(f"error: {cfg_path}: no run config (pass the fine-tune's output folder)", file=sys.stderr)
            return 2
        info[name] = {"config": json.load(open(cfg_path)), "last_train": last_metrics(run, "train"),
                      "last_eval": last_metrics(run, "eval")}
    drafters = {name: sparkjax.load_drafter(src, target=target)
                for name, src in (("dspark_b16", a.dspark), ("dflash_b16", a.dflash))}
    parts = {"target": os.path.join(a.out, "target")}
    for name, drafter in drafters.items():
        parts[name] = sparkjax.save_drafter(drafter, os.path.join(a.out, name), overwrite=True, dtype="bfloat16")
    info["bytes"] = {k: folder_bytes(v) for k, v in parts.items()}
    return finish(a, info, sum(info["bytes"].values()))


if __name__ == "__main__":
    sys.exit(main())
