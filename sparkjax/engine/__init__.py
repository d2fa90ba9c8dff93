"""The decoding engine: methods, one speculative round, the jitted programs and the public entry points.

* :mod:`~sparkjax.engine.methods`: the method objects (:class:`AR`, :class:`Chain`, :class:`Tree`),
  the static :class:`Plan` they resolve into and :func:`parse_method`, the one reader of method names;
* :mod:`~sparkjax.engine.drafting`: the drafter's block and chains (the draft stage's pieces);
* :mod:`~sparkjax.engine.auto`: method ``auto`` (a verification size per round, chosen on device) and
  its cost table (:func:`profile_costs`);
* :mod:`~sparkjax.engine.round`: draft -> expand -> verify -> accept -> commit, one function each;
* :mod:`~sparkjax.engine.programs`: the jitted prefill, AR and speculative programs;
* :mod:`~sparkjax.engine.state`: the registered dataclasses passed between them;
* :mod:`~sparkjax.engine.placement`: a run on a device mesh (``mesh=``): checks, placement, sharding constraints;
* :mod:`~sparkjax.engine.api`: validation, :func:`generate`, :func:`launch`, :func:`stream`.
"""

from .api import (
    GenerateOutput,
    NumericalError,
    estimate_memory,
    generate,
    launch,
    raise_if_nonfinite,
    required_cache_size,
    stream,
)
from .auto import AutoMemory, CostTable, load_cost_table, policy, profile_costs
from .checks import bucket
from .methods import (
    AR,
    AR_LABEL,
    CHAIN_METHODS,
    DEFAULT_SIZES,
    MARKOV_METHODS,
    METHODS,
    TREE_METHODS,
    Auto,
    Chain,
    Method,
    Plan,
    Tree,
    available_methods,
    parse_method,
)
from .round import STAGES

__all__ = [
    "AR",
    "DEFAULT_SIZES",
    "Auto",
    "AutoMemory",
    "CostTable",
    "load_cost_table",
    "policy",
    "profile_costs",
    "AR_LABEL",
    "CHAIN_METHODS",
    "MARKOV_METHODS",
    "METHODS",
    "STAGES",
    "TREE_METHODS",
    "Chain",
    "GenerateOutput",
    "Method",
    "NumericalError",
    "Plan",
    "Tree",
    "available_methods",
    "bucket",
    "estimate_memory",
    "generate",
    "launch",
    "parse_method",
    "raise_if_nonfinite",
    "required_cache_size",
    "stream",
]
