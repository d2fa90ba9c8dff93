"""Deprecated alias of :mod:`sparkjax.engine.drafting` (the drafting functions moved there).

Every name this module exported still works; new code should import from ``sparkjax.engine.drafting``.
"""

from .engine.drafting import (  # noqa: F401 - re-exported names (private ones too)
    Array,
    DraftBlock,
    DraftChain,
    _require_markov,
    _static_greedy,
    aligned_logits,
    append_context,
    argmax_chain,
    block_tokens,
    chain_prev,
    confidence,
    draft_block,
    features_from_hidden,
    markov_bias,
    markov_chain,
    markov_features,
    markov_w2,
    sample_chain,
)

Chain = DraftChain  # the drafted chain's old name (sparkjax.engine.Chain is now the chain *method*)


def init_context(drafter, batch: int, size: int):
    """An empty context cache with ``size`` slots per sequence (``drafter.init_context(batch, size)``)."""
    return drafter.init_context(batch, size)
