"""``sparkjax.eval``: the benchmark harness (``python -m sparkjax.eval``) and its Python API.

Per prompt set and method: the acceptance length tau, tokens/s and the speedup over ``ar``, the per-depth
acceptance rates and the time per round of each stage (see docs/eval.md)::

    python -m sparkjax.eval                                   # bundled demo pair, its three prompt sets
    python -m sparkjax.eval --compare runs/x/results.json runs/y/results.json

    import sparkjax.eval
    res = sparkjax.eval.run(methods=("ar", "dspark", "sparklingtree"), budgets=(16,), max_samples=2)
    print(res.table()); res.summary; res.records; res.to_dataframe()  # the last needs pandas

``run`` takes the CLI flags as keywords (see :class:`EvalConfig`) and folders or loaded objects for ``target`` /
``drafter`` / ``baseline_drafter`` / ``tokenizer``; it returns :class:`EvalResults`. Importing this package loads
no model and changes no global setting.
"""

from __future__ import annotations

from .cli import main
from .config import EvalConfig
from .harness import run
from .records import Record, Row, Sample, SweepRow
from .results import EvalResults

__all__ = ["EvalConfig", "EvalResults", "Record", "Row", "Sample", "SweepRow", "main", "run"]
