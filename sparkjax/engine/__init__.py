"""The decoding engine: the method objects (:mod:`~sparkjax.engine.methods`), their trace-time
:class:`Options`, the drafting and round stages, ``auto``'s round and cost tables, the jitted programs, mesh
placement and the public entry points (:mod:`~sparkjax.engine.api`). The module map is in docs/design.md.
"""

from .adaptive import DEFAULT_SIZES, Auto, AutoMemory, policy
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
from .costs import CostTable, PoolCostTable
from .methods import AR, Chain, Method, PCTree, Tree
from .names import AR_LABEL, CHAIN_METHODS, MARKOV_METHODS, METHODS, TREE_METHODS, available_methods, parse_method
from .options import Options
from .round import STAGES
from .state import Launch, Plan

__all__ = [
    "AR", "DEFAULT_SIZES", "Auto", "AutoMemory", "CostTable", "PoolCostTable", "load_cost_table", "policy",
    "profile_costs", "AR_LABEL", "CHAIN_METHODS", "MARKOV_METHODS", "METHODS", "STAGES", "TREE_METHODS", "Chain",
    "GenerateOutput", "Launch", "Method", "Options", "PCTree", "Plan", "Tree", "available_methods", "bucket",
    "estimate_memory", "generate", "launch", "parse_method", "raise_if_nonfinite", "required_cache_size", "stream"
]
