"""``sparkjax.eval``: the benchmark harness (``python -m sparkjax.eval``) and its Python API.

One command gives the table and the plots speculative decoders are judged by: per prompt set
and method, the acceptance length tau, tokens/s and the speedup over ``ar``; the per-depth
acceptance rates; and the time per round of each stage::

    python -m sparkjax.eval                                   # bundled demo pair, its three prompt sets
    python -m sparkjax.eval --target T --drafter D --baseline-drafter B --budgets 16,64 \\
        --datasets gsm8k,mt-bench --max-samples 80 --max-new-tokens 256 --out runs/x
    python -m sparkjax.eval --compare runs/x/results.json runs/y/results.json

From Python (a notebook)::

    import sparkjax.eval
    res = sparkjax.eval.run(methods=("ar", "dspark", "sparklingtree"), budgets=(16,), max_samples=2)
    print(res.table()); res.summary; res.records; res.to_dataframe()  # the last needs pandas

``run`` takes the CLI flags as keywords (see :class:`EvalConfig`) and folders or loaded objects
for ``target`` / ``drafter`` / ``baseline_drafter`` / ``tokenizer``; it returns :class:`EvalResults`.

**Pair** (:mod:`sparkjax.eval.demo`). The default is the demo pair bundled in the package
(``sparkjax/assets/demo``): a small Qwen3 target with its tokenizer, ``dspark_b16`` (with a
Markov head) for dspark / sparklingtree / sparklingtree-beam and ``dflash_b16`` (the same drafter
trained without one) for dflash / ddtree; see its ``MODEL_CARD.md``. With another target,
``--baseline-drafter`` gives dflash and ddtree their own drafter (default: ``--drafter``); every
row of ``results.json`` records the drafter folder it ran with.

**Prompts** (:mod:`sparkjax.eval.datasets`). JSONL, one object per line: ``{"turns": [...]}`` (the
first user turn, through the tokenizer's chat template) or ``{"text": "..."}`` (a raw completion
prompt, encoded as is, e.g. the demo's ``stdlib_code``).

**Metrics** (:mod:`sparkjax.eval.metrics`). Acceptance length = tokens a round commits =
accepted drafts + 1. ``tau_pooled`` = sum of acceptance lengths / rounds (DeepSpec);
``tau_per_response`` = mean of per-response means (DDTree). ``accept_rate@k`` = fraction of rounds
whose accepted path reached draft depth k (from the engine's per-depth counts / rounds).

**Timing protocol** (:mod:`sparkjax.eval.harness`). Every method is compiled and run once before
anything is timed. Then, per batch (batch size 1 by default), ``--repeats`` (default 3) interleaved
repetitions: repetition r runs every method in turn (A B C, A B C, not A A B B), each the full
generation (the engine's single jitted on-device loop, no host sync) followed by a prefill-only run
of the very same compiled program with ``max_new_tokens = 1`` (prefill, first token, drafter context
of the prompt; no round), each timed from dispatch to ``block_until_ready``. Decode time = median
full - median prefill-only (and the best case, min - min): prefill and the prompt part of the first
draft pass are excluded, round 1's drafter block pass is included. A decode time that is not
positive (a busy machine) is "not measured", never 0, and is left out. TPOT = decode time / output
tokens, averaged over batches (those whose first token ended them have no decode step and are left
out); tok/s = 1 / TPOT; speedup = TPOT(ar) / TPOT(method), ar timed in the same run on the same
prompts, interleaved with the other methods, with the same cache size. The table shows the median
and the best case and the spread (max - min) / median of the full runs, and warns when a spread
exceeds 25 % or the load average exceeded the CPU count during the run. Per-stage times (draft,
tree, verify, commit) come from a separate pass of the engine's instrumented mode, which syncs
after each stage, so they include per-call overhead the fused loop does not pay; the table shows both.

**Ctrl-C** stops a run after the current step and returns (the CLI: writes, exit code 130) the
batches every method had finished, marked ``interrupted``; :func:`run` restores the previous SIGINT
handler when it returns.

**Batch-size sweep** (:mod:`sparkjax.eval.sweep`; ``--batch-sizes 1,4,16,64``, or ``run(batch_sizes=...)``).
Instead of the per-set table, every method runs at every batch size on the pool of selected prompts (the sets
taken in turn), cycled to fill each batch (size B: ``ceil(N / B)`` batches of exactly B sequences, slot i of
batch j holding prompt ``(j * B + i) mod N``). Each batch is timed with the protocol above (no stage pass).
Per (method, batch size): tokens/s = output tokens / decode seconds summed over the batches (median and
best case, with the spread), the speedup over ``ar`` at the same size, and two greedy checks: outputs equal
``ar``'s, and equal the same prompt's output at the smallest size (the batch changes the speed only).
Written to ``results.json`` (its ``sweep`` object: rows and raw records), ``batch_sweep.csv`` and
``throughput_vs_batch.png`` (tokens/s against batch size, log2 axis, one line per method, ``ar``
included; below it the speedup over ``ar``). ``--batch-size`` and ``--batch-sizes`` exclude each other.
Every size is checked against the device's memory before anything is compiled.

**Output** in ``--out``: ``results.json`` (config, package versions, setup, summary rows and every
raw number: per-round acceptance lengths, per-depth counts, output ids, timings),
``results.csv`` (the summary rows, flat), ``acceptance_per_depth.png``, ``tau_speedup.png`` and
``stage_time.png``. ``--out`` is created and tested for writing before any work; each file is written
atomically, and those of an earlier run into the same folder are replaced or removed (only these file
names; nothing else in the folder is touched).

The bundled demo pair is small and trained on a CPU: its CPU timings say nothing about real
models on accelerators. Importing this package loads no model and changes no global setting.
"""

from __future__ import annotations

from ..errors import DatasetError, EvalError, TokenizerError
from .cli import main
from .engine import MethodConfig
from .harness import EvalConfig, EvalResults, run

__all__ = ["DatasetError", "EvalConfig", "EvalError", "EvalResults", "MethodConfig", "TokenizerError", "main", "run"]
