#!/usr/bin/env bash
# The prepared device check: python -m sparkjax.bench device from this checkout, no install.
#   bash eval/gpu_check.sh                 # on a GPU machine: real shapes, about 8 minutes (docs/benchmarks.md)
#   bash eval/gpu_check.sh --dry-run       # the CPU at tiny shapes
#   OUT=/some/dir bash eval/gpu_check.sh   # where device_check.json / .txt go (default: --out, else $OUT, else .)
# Any other argument goes to the module (python -m sparkjax.bench device --help).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
for arg in "$@"; do
  [ "$arg" = "--dry-run" ] && export JAX_PLATFORMS=cpu
done
cd "$ROOT"
exec "${PYTHON:-python3}" -m sparkjax.bench device "$@"
