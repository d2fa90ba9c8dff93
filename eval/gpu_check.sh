#!/usr/bin/env bash
# The prepared device check: python -m sparkjax.bench device from this checkout, no install.
#   bash eval/gpu_check.sh                 # on a GPU machine: real shapes, about 8 minutes (an estimate, docs/benchmarks.md)
#   bash eval/gpu_check.sh --quick         # batch 1, ar and sparklingtree@64 timed and traced: about 3 minutes (estimate)
#   bash eval/gpu_check.sh --dry-run       # the CPU at tiny shapes
#   OUT=/some/dir bash eval/gpu_check.sh   # where device_check.json / .txt and traces/ go (default: --out, else $OUT, else .)
# Any other argument goes to the module (python -m sparkjax.bench device --help).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
dry=0
for arg in "$@"; do
  [ "$arg" = "--dry-run" ] && dry=1
done
if [ "$dry" = 1 ]; then
  export JAX_PLATFORMS=cpu
else
  # XLA:GPU runs no command buffer while the profiler traces unless told to: the traces would show the loop
  # run from the host. The flag is an XLA debug option (xla/debug_options_flags.cc).
  case " ${XLA_FLAGS:-} " in
    *" --xla_enable_command_buffers_during_profiling="*) ;;
    *) export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_enable_command_buffers_during_profiling=true" ;;
  esac
fi
cd "$ROOT"
exec "${PYTHON:-python3}" -m sparkjax.bench device "$@"
