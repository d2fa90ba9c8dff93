"""The decoding engine: methods, one speculative round, the jitted programs and the public entry points.

* :mod:`~sparkjax.engine.methods`: the :class:`Method` protocol and the method objects (:class:`AR`,
  :class:`Chain`, :class:`Tree`, :class:`Auto`), each owning its round, and :func:`parse_method`, the one
  reader of method names;
* :mod:`~sparkjax.engine.options`: :class:`Options`, the trace-time settings a plan carries;
* :mod:`~sparkjax.engine.drafting`: the drafter's block and chains (the draft stage's pieces);
* :mod:`~sparkjax.engine.adaptive`: method ``auto``'s round (a verification size per round, chosen on device)
  and its memory; :mod:`~sparkjax.engine.costs`: its cost table (measured by :func:`profile_costs`, kept per
  process and per machine);
* :mod:`~sparkjax.engine.round`: the stages draft -> expand -> verify -> accept -> commit, one function each;
* :mod:`~sparkjax.engine.programs`: the jitted prefill, AR and speculative programs;
* :mod:`~sparkjax.engine.state`: the static :class:`Plan`, the dataclasses passed between the stages and
  :class:`Launch`, what :func:`launch` returns;
* :mod:`~sparkjax.engine.placement`: a run on a device mesh (``mesh=``): checks, placement, sharding constraints;
* :mod:`~sparkjax.engine.api`: validation, :func:`generate`, :func:`launch`, :func:`stream`.
"""

from .adaptive import AutoMemory, policy
from .api import (
    GenerateOutput,
    estimate_memory,
    generate,
    launch,
    load_cost_table,
    profile_costs,
    raise_if_nonfinite,
    required_cache_size,
    stream,
)
from .checks import bucket
from .costs import CostTable
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
    PCTree,
    Tree,
    available_methods,
    parse_method,
)
from .options import Options
from .round import STAGES
from .state import Launch, Plan

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
    "Launch",
    "Method",
    "Options",
    "PCTree",
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
