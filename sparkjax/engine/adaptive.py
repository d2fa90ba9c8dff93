"""Method ``auto``, traced side: each round picks its verification size on device, from the drafter's own
confidence and a measured cost table (host side: :mod:`sparkjax.engine.costs`), and carries what it learned.
The table's seconds are a traced input; what they decide statically (``Auto.viable``, ``Auto.floor``) sits in
the plan's method, so tables that agree on those share one program.

**Modes.** ``idle``: plain target steps in a row since the last draft; ``gap``: plain steps before the next
probe (it starts at the floor, and ``idle`` starts at ``gap``, so the first round is a probe)::

    state     trigger                          the round                                  next
    --------  -------------------------------  -----------------------------------------  -------------------------
    draft     decide="draft": every round      draft; build the largest tree and the      draft
                                               chain; k = policy(their fresh predictions);
                                               verify k (size 0: a plain step)
    previous  decide="previous", idle < gap    k = policy(the last draft's predictions);  previous; burst if k is 0
                                               k > 0: draft, build only the kind k
                                               verifies, verify k
    burst     previous picked size 0           gap - idle plain target steps in one loop, probe
                                               no draft (no viable drafted size: plain
                                               steps to the end, never a probe)
    probe     idle >= gap                      size 0 barred; draft the chain (and the    previous (gap: the floor
                                               tree; a shadowing method builds it only    if a draft pays next, else
                                               when the fresh chain and the trees' last   x GAP_GROWTH, at most
                                               predictions pick a tree, or none was       MAX_GAP); shadow if k is 0
                                               built yet); shadowing: k re-decided from
                                               the fresh predictions; verify k
    shadow    a shadowing probe re-decides 0   one plain step; its unverified chain is    burst (gap x GAP_GROWTH)
                                               scored later against the committed tokens
                                               (:func:`score_shadow`)

``decide="previous"`` without size 0 is ``previous`` every round. A round's branches run as while loops of 0
or 1 trips (:func:`run_selected`). Predictions (:func:`predictions`), calibration (:class:`AutoState`) and
the policy (:func:`policy`) are described in docs/auto.md. Exactness: every branch verifies and accepts like
the fixed methods, and the choice reads only draft-side quantities and past rounds, never this round's verify.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from .. import sampling, tree
from ..errors import ArgumentError
from . import costs, drafting
from .checks import MAX_SLOTS, check_drafter, check_int, describe, is_int
from .methods import AR, NORMALIZATIONS, TABLE_CANDIDATES, Chain, Kind, Method, Tree, drafted_depth, kind_of
from .options import Options, check_options
from .round import COMMIT, PROPOSE, VERIFY, commit, draft, round_keys, stage, verify, with_draft_context
from .state import Acceptance, Plan, Proposal, SpecState, per_row

Array = jax.Array

CHAIN = "chain"  # the chain entry of an auto candidate set
CALIBRATION_DECAY = 0.8  # weight of the past in the running averages of realised / predicted accepted drafts
CALIBRATION_PRIOR = 0.25  # accepted drafts added to both averages (ratio 1 until rounds are seen)
MAX_RATIO = 2.0  # a calibration ratio is clipped to [0, MAX_RATIO]
MAX_GAP = 128  # decide="previous": at most this many plain steps between two probe drafts
GAP_GROWTH = 4  # a probe draft that still predicts size 0 multiplies the gap by this


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AutoState:
    """What ``auto`` carries from round to round (``SpecState.extra``): ``choices[b, r]`` (round r's candidate
    index, -1 past the last round); the calibration ``real`` / ``pred`` ``[K]`` (running averages of realised and
    predicted accepted drafts); ``last`` ``[B, K]`` (the last draft's raw predictions); ``idle`` and ``gap`` (see
    the module docstring); ``force`` (a candidate every round takes; -1: the policy); ``seconds`` ``[K]`` (the
    table's round times; ``[A + 1, K]`` for a pool, by active count); for :func:`shadowing` methods the chain a
    probe did not verify (``shadow`` ``[B, D]``), its output index, raw prediction and whether it is unscored;
    ``burst_cap`` (set by a serving pool's visit only): the most plain steps a burst may run.
    """

    choices: Array = per_row()
    real: Array
    pred: Array
    last: Array = per_row()
    idle: Array
    force: Array
    gap: Array
    seconds: Array
    shadow: Array | None = per_row(default=None)
    shadow_at: Array | None = per_row(default=None)
    shadow_pred: Array | None = per_row(default=None)
    shadow_live: Array | None = per_row(default=None)
    burst_cap: Array | None = None  # the most plain steps one burst may run (None: no cap; a pool's host visit)


def shadowing(m: Auto) -> bool:
    """Whether a probe may choose the plain step from its own fresh draft and score the chain it did not verify
    against the committed tokens (``decide="previous"`` with size 0 and the chain among the sizes)."""
    return m.decide == "previous" and 0 in m.sizes and CHAIN in m.sizes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AutoMemory:
    """What method ``auto`` knows at the end of a generation, to start the next one from (``auto_memory=``;
    docs/auto.md): the calibration ``real`` / ``pred`` ``[K]``, the last raw predictions averaged over the batch,
    the probe gap, and the ``labels`` of the candidates (a memory only fits a method with the same ones). It
    changes which sizes are verified, never the greedy tokens."""

    real: Array
    pred: Array
    last: Array
    gap: Array
    labels: tuple[str, ...] = dataclasses.field(default=(), metadata=dict(static=True))


def fresh_memory(plan: Plan) -> AutoMemory:
    """The memory of a generation that starts from nothing: no calibration, no predictions, a probe due."""
    m: Auto = plan.method
    k = len(m.sizes)
    return AutoMemory(real=np.zeros((k,), np.float32), pred=np.zeros((k,), np.float32),
                      last=np.zeros((k,), np.float32), gap=np.int32(floor_of(m)), labels=m.labels())


def check_auto_memory(memory: Any, plan: Plan) -> AutoMemory:
    """``memory`` checked against ``plan`` (ArgumentError naming ``auto_memory``): host values finite and >= 0
    (the gap clipped to ``[1, MAX_GAP]``), device arrays by shape and dtype only (no host copy)."""
    m: Auto = plan.method
    if not isinstance(memory, AutoMemory):
        raise ArgumentError(f"auto_memory: expected the auto_memory of an earlier GenerateOutput (an "
                            f"AutoMemory), got {describe(memory)}")
    if tuple(memory.labels) != m.labels():
        raise ArgumentError(f"auto_memory: it was learned over the candidates {list(memory.labels)}, not this "
                            f"method's {list(m.labels())}")
    k = len(m.sizes)
    out = {}
    for name, shape, dtype in (("real", (k,), np.float32), ("pred", (k,), np.float32), ("last", (k,), np.float32),
                               ("gap", (), np.int32)):
        v = getattr(memory, name)
        if isinstance(v, jax.Array):
            if v.shape != shape or v.dtype != dtype:
                raise ArgumentError(f"auto_memory: {name} must be {np.dtype(dtype).name} of shape {shape}, got "
                                    f"{v.dtype} of shape {v.shape}")
            out[name] = v
            continue
        try:
            a = np.asarray(v, np.float64)
        except (TypeError, ValueError):
            raise ArgumentError(f"auto_memory: {name} must be numbers of shape {shape}, got {describe(v)}") from None
        if a.shape != shape or not np.all(np.isfinite(a)) or np.any(a < 0):
            raise ArgumentError(f"auto_memory: {name} must be finite, >= 0, of shape {shape}, got {v!r}")
        out[name] = np.clip(a, 1, MAX_GAP).astype(dtype) if name == "gap" else a.astype(dtype)
    return AutoMemory(**out, labels=m.labels())




@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AutoInputs:
    """The traced inputs of an ``auto`` program: the table's ``seconds`` (as :attr:`AutoState.seconds`) and the
    :class:`AutoMemory` it starts from."""

    seconds: Any
    memory: AutoMemory


def auto_inputs(plan: Plan, memory: Any = None) -> AutoInputs:
    """The inputs of a generation of ``plan`` (equal costs without a table; ``memory`` None: fresh)."""
    m: Auto = plan.method
    seconds = m.table.seconds if m.table is not None else (1.0,) * len(m.sizes)
    mem = fresh_memory(plan) if memory is None else check_auto_memory(memory, plan)
    return AutoInputs(np.asarray(seconds, np.float32), mem)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AutoResults:
    """What an ``auto`` generation returns beside the tokens: ``choices`` (:attr:`AutoState.choices`) and the
    final :class:`AutoMemory`."""

    choices: Array
    memory: AutoMemory


def results(state: SpecState, plan: Plan) -> AutoResults:
    """The choices of a finished generation and the :class:`AutoMemory` its state ends with."""
    st = state.extra
    memory = AutoMemory(real=st.real, pred=st.pred, last=jnp.mean(st.last, axis=0), gap=st.gap,
                        labels=plan.method.labels())
    return AutoResults(st.choices, memory)


def init_state(plan: Plan, batch: int, buf_len: int, inputs: AutoInputs) -> AutoState:
    """The state of a generation's first round, from its :class:`AutoInputs`."""
    m: Auto = plan.method
    mem = inputs.memory
    gap = jnp.asarray(mem.gap, jnp.int32)  # idle = gap: the first round is a probe (a new prompt, fresh predictions)
    shadow = {}
    if shadowing(m):
        shadow = dict(shadow=jnp.zeros((batch, plan.depth), jnp.int32), shadow_at=jnp.zeros((batch,), jnp.int32),
                      shadow_pred=jnp.zeros((batch,), jnp.float32), shadow_live=jnp.zeros((batch,), bool))
    return AutoState(choices=jnp.full((batch, buf_len), -1, jnp.int32),
                     real=jnp.asarray(mem.real, jnp.float32), pred=jnp.asarray(mem.pred, jnp.float32),
                     last=jnp.broadcast_to(jnp.asarray(mem.last, jnp.float32), (batch, len(m.sizes))),
                     idle=gap, force=jnp.full((), -1, jnp.int32), gap=gap,
                     seconds=jnp.asarray(inputs.seconds, jnp.float32), **shadow)


def score_shadow(m: Auto, st: AutoState, state: SpecState, now: Any) -> AutoState:
    """Scores the live shadow chains whose tokens are all committed (or whose sequence is done, or all when
    ``now``): the leading drafts equal to the committed tokens, folded into the chain's calibration."""
    if not shadowing(m):
        return st
    d = st.shadow.shape[1]
    avail = state.n - st.shadow_at  # committed tokens from the chain's first place on
    due = st.shadow_live & ((avail >= d) | state.done | jnp.asarray(now))
    places = jnp.clip(st.shadow_at[:, None] + jnp.arange(d, dtype=jnp.int32)[None], 0, state.out.shape[1] - 1)
    actual = jnp.take_along_axis(state.out, places, axis=1)
    hit = (actual == st.shadow) & (jnp.arange(d)[None] < avail[:, None])
    real = jnp.sum(jnp.cumprod(hit.astype(jnp.int32), axis=1), axis=1).astype(jnp.float32)
    w = due.astype(jnp.float32)
    n = jnp.maximum(w.sum(), 1.0)
    c = m.sizes.index(CHAIN)
    a = CALIBRATION_DECAY
    upd = w.sum() > 0
    real_c = jnp.where(upd, a * st.real[c] + (1 - a) * (real * w).sum() / n, st.real[c])
    pred_c = jnp.where(upd, a * st.pred[c] + (1 - a) * (st.shadow_pred * w).sum() / n, st.pred[c])
    return dataclasses.replace(st, real=st.real.at[c].set(real_c), pred=st.pred.at[c].set(pred_c),
                               shadow_live=st.shadow_live & ~due)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AutoProposal:
    """The round's drafts: the largest ``tree`` (None without tree sizes), the ``chain`` (None without one)
    and the raw predicted accepted drafts ``raw`` ``[B, K]`` of every candidate."""

    tree: Proposal | None
    chain: Proposal | None
    raw: Array
    tree_built: Array  # bool scalar: the tree was built this round (else its predictions are stale; False without one)


# ============================================================================ predictions and the policy


def policy(expected: Any, costs: Any, active: Any = None, allowed: Any = None) -> Array:
    """The candidate index (int32 scalar) with the most expected committed tokens per unit of cost.

    ``expected``: committed tokens ``[K]`` or ``[B, K]`` (summed over the ``active`` sequences, all by
    default); ``costs``: ``[K]`` seconds per round; ``allowed``: optional ``[K]`` bool. Ties go to the first.
    """
    e = jnp.asarray(expected, jnp.float32)
    if e.ndim == 1:
        e = e[None]
    if active is not None:
        e = jnp.where(jnp.asarray(active, bool)[:, None], e, 0.0)
    rate = e.sum(axis=0) / jnp.maximum(jnp.asarray(costs, jnp.float32), 1e-30)
    if allowed is not None:
        rate = jnp.where(jnp.asarray(allowed, bool), rate, -jnp.inf)
    return jnp.argmax(rate).astype(jnp.int32)


def viable(m: Auto, depth: int, seconds: Sequence[float]) -> tuple[bool, ...]:
    """Per candidate, whether it may pay with these round times: a drafted size whose round costs at least
    ``m.viable_share`` x its most committed tokens per round in plain steps is not (every size is without
    the plain step)."""
    if 0 not in m.sizes:
        return (True,) * len(m.sizes)
    plain = seconds[m.sizes.index(0)]
    most = [1 if v == 0 else depth + 1 if v == CHAIN else min(v, depth) + 1 for v in m.sizes]
    share = m.viable_share
    return tuple(v == 0 or share * n * plain > c for v, n, c in zip(m.sizes, most, seconds, strict=True))


def gap_floor(m: Auto, depth: int, seconds: Sequence[float]) -> int:
    """Plain steps between two probe drafts, at least: ``probe``, and as many plain steps as the cheapest
    viable drafted round costs (at most :data:`MAX_GAP`)."""
    if 0 not in m.sizes:
        return m.probe
    plain = seconds[m.sizes.index(0)]
    ok = viable(m, depth, seconds)
    drafted = [c for v, c, good in zip(m.sizes, seconds, ok, strict=True) if v != 0 and good]
    if not drafted:
        return m.probe
    return int(min(MAX_GAP, max(m.probe, math.ceil(min(drafted) / max(plain, 1e-12)))))


def viable_of(m: Auto) -> tuple[bool, ...]:
    """The plan's static viability (every size without a table)."""
    return m.viable if m.viable is not None else (True,) * len(m.sizes)


def floor_of(m: Auto) -> int:
    """The plan's static probe-gap floor (``probe`` without a table)."""
    return m.floor if m.floor is not None else m.probe


def drafts_can_pay(m: Auto, trees: bool = False) -> bool:
    """Whether any drafted size is viable (else a generation is plain steps only, with no probe); with
    ``trees``, any tree size (else no tree is ever built)."""
    return any(good for v, good in zip(m.sizes, viable_of(m), strict=True) if v != 0 and not (trees and v == CHAIN))


def keeps_context(m: Auto) -> bool:
    """Whether an ``auto`` generation needs the drafter's context (``Plan.context``): unless it decides from the
    previous round (``decide="previous"``) and its cost table lets no draft pay (plain steps only)."""
    return m.decide == "draft" or drafts_can_pay(m)


def calibrated(st: AutoState, raw: Array) -> Array:
    """Expected committed tokens ``[B, K]``: 1 (the bonus) + raw predicted drafts x the running ratio."""
    ratio = jnp.clip((st.real + CALIBRATION_PRIOR) / (st.pred + CALIBRATION_PRIOR), 0.0, MAX_RATIO)
    return 1.0 + raw * ratio[None]


def chain_probs(drafter, x_start: Array, blk: drafting.DraftBlock, prop: Proposal, temperature) -> Array:
    """The chain's per-depth acceptance estimate ``[B, D]``: the confidence head's (when the drafter has
    one), else the probability the chain drew each draft with."""
    if drafter.confidence_head is not None and (drafter.markov_head is not None
                                                or not drafter.config.confidence_head_with_markov):
        hidden = blk.hidden[:, drafter.config.first_draft_slot:]
        conf = drafting.confidence(drafter, hidden, drafting.chain_prev(x_start, prop.tokens))
        return jax.nn.sigmoid(conf.astype(jnp.float32))
    t = sampling.per_row(sampling.temperature_of(temperature), prop.draft_logits.ndim)
    logp = jax.nn.log_softmax(prop.draft_logits / jnp.where(t > 0, t, 1.0), axis=-1)
    return jnp.exp(jnp.take_along_axis(logp, prop.tokens[..., None], axis=-1)[..., 0])


def predictions(method: Auto, batch: int, tree_scores: Array | None, chain_p: Array | None) -> Array:
    """Raw predicted accepted drafts ``[B, K]`` per candidate of ``method.sizes``: 0 for size 0, the sum of
    the cumulative product of ``chain_p`` ``[B, D]`` for the chain, the sum of ``exp`` of the first ``b``
    of ``tree_scores`` ``[B, M]`` (path log-probabilities, ``-inf`` padding) for tree size ``b`` (0 when
    ``tree_scores`` is None: no tree was built)."""
    cols = []
    cum = None if tree_scores is None else jnp.cumsum(jnp.exp(tree_scores.astype(jnp.float32)), axis=1)
    for v in method.sizes:
        if v == 0:
            cols.append(jnp.zeros((batch,), jnp.float32))
        elif v == CHAIN:
            cols.append(jnp.sum(jnp.cumprod(chain_p.astype(jnp.float32), axis=1), axis=1))
        else:
            cols.append(jnp.zeros((batch,), jnp.float32) if cum is None else cum[:, v - 1])
    return jnp.stack(cols, axis=1)


# ============================================================================ the round's stages


@stage(PROPOSE)
def auto_propose(target, drafter, state: SpecState, blk: drafting.DraftBlock, key, k=None, *,
                plan: Plan) -> AutoProposal:
    """The largest tree and the chain of the round, and every candidate's raw prediction.

    With the choice ``k`` already made (``decide="previous"``) only the kind it verifies is built; the other
    kind keeps its last predictions. A probe builds both, except that a :func:`shadowing` method's probe builds
    the tree only when the fresh chain and the trees' last predictions pick a tree, or none was built yet."""
    m: Auto = plan.method
    b = state.x_start.shape[0]

    def build_tree():
        tp = m.tree_plan(plan)
        t = tp.method.build(drafter, state.x_start, blk, tp)
        mask = jax.vmap(tree.visibility, in_axes=(0, None))(t.parents, plan.depth)
        return Proposal(t.tokens, t.parents, t.depths, mask, None), t.scores

    def build_chain():
        cp = m.chain_plan(plan)
        prop = cp.method.propose(drafter, state.x_start, blk, cp, state.request.sampling, key)
        return prop, chain_probs(drafter, state.x_start, blk, prop, state.request.sampling)

    both = bool(m.tree_sizes) and CHAIN in m.sizes
    if k is None or not both:
        tree_prop, scores = build_tree() if m.tree_sizes else (None, None)
        chain_prop, chain_p = build_chain() if CHAIN in m.sizes else (None, None)
        return AutoProposal(tree_prop, chain_prop, predictions(m, b, scores, chain_p), jnp.asarray(bool(m.tree_sizes)))

    def empty(fn):
        return lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(fn))

    is_chain = jnp.asarray(k) == m.sizes.index(CHAIN)
    refresh = state.extra.idle > 0  # the first draft and every probe after plain steps (both kinds; see below)
    tree_cols = jnp.asarray([v != 0 and v != CHAIN for v in m.sizes])
    chain_cols = jnp.asarray([v == CHAIN for v in m.sizes])
    chain_prop, chain_p = jax.lax.cond(is_chain | refresh, build_chain, empty(build_chain))
    want_tree = ~is_chain | refresh
    if shadowing(m):
        # the tree only when the policy over the fresh chain and the trees' last predictions picks a tree
        chain_raw = jnp.where(chain_cols[None], predictions(m, b, None, chain_p), state.extra.last)
        pick = _choose(state.extra, chain_raw, plan, ~state.done)
        # no tree built yet (no prediction to compare), and some tree size is viable (else none is ever built)
        never = ~jnp.any(jnp.where(tree_cols[None], state.extra.last, 0.0) > 0)
        unknown = never & drafts_can_pay(m, trees=True)
        picks_tree = (pick != m.sizes.index(0)) & (pick != m.sizes.index(CHAIN))
        want_tree = jnp.where(refresh, picks_tree | unknown, ~is_chain)
    tree_prop, scores = jax.lax.cond(want_tree, build_tree, empty(build_tree))
    raw = predictions(m, b, scores, chain_p)
    chain_built = is_chain | refresh
    stale = (tree_cols & ~want_tree) | (chain_cols & ~chain_built)  # a kind not built keeps its last predictions
    return AutoProposal(tree_prop, chain_prop, jnp.where(stale[None], state.extra.last, raw), want_tree)


def _plain_target_step(target, drafter, state: SpecState, key, plan: Plan, features: bool = True):
    """Size 0: ``ar``'s round on the state (its proposal of no node, the verify of the root alone, its accept and
    the general commit; :meth:`Auto.plain_plan`), reading the drafter's layers when ``features``. Returns
    ``(state, verified, acceptance)``; the drafter's context is extended only when the state carries one."""
    sub = plan.method.plain_plan(plan, features)
    prop = sub.method.propose(drafter, state.x_start, None, sub, state.request.sampling, None)
    ver = verify(target, drafter, state, prop, plan=sub)
    acc = sub.method.accept(prop, ver, state.request.sampling, key, plan=sub)
    return commit(drafter, state, ver, acc, plan=sub), ver, acc


def _plain_step(target, drafter, state: SpecState, key, plan: Plan):
    """Size 0 as one branch of a drafted round: :func:`_plain_target_step`, its acceptance in the round's
    layout."""
    new, _, acc = _plain_target_step(target, drafter, state, key, plan)
    b = acc.bonus.shape[0]
    indices = jnp.concatenate([acc.indices, jnp.full((b, plan.depth), -1, jnp.int32)], axis=1)
    return new, Acceptance(indices, acc.length, acc.bonus)


def _branch(i: int, target, drafter, state: SpecState, aprop: AutoProposal, key, *,
            plan: Plan):
    """Verify, accept and commit candidate ``i`` (one branch of :func:`run_selected`: every one returns the same
    layout)."""
    m: Auto = plan.method
    v = m.sizes[i]
    if v == 0:
        return _plain_step(target, drafter, state, key, plan)
    if v == CHAIN:
        sub, prop = m.chain_plan(plan), aprop.chain
    else:  # the first v nodes of the best-first tree: the best tree of v nodes
        t = aprop.tree
        sub, prop = m.tree_plan(plan), Proposal(t.tokens[:, :v], t.parents[:, :v], t.depths[:, :v],
                                                t.mask[:, : v + 1, : v + 1], None)
    ver = verify(target, drafter, state, prop, plan=sub)
    acc = sub.method.accept(prop, ver, state.request.sampling, key, plan=sub)
    return commit(drafter, state, ver, acc, plan=plan), acc


def _realised(m: Auto, k: Array, acc: Acceptance) -> tuple[Array, Array]:
    """Accepted drafts ``[B, K]`` of this round per candidate, and which candidates that is known for: the
    chosen one, and for a tree every smaller tree (the walk's nodes with index ``<= b``)."""
    idx = acc.indices[:, 1:]
    cols, known = [], []
    chosen_tree = jnp.int32(0)
    for i, v in enumerate(m.sizes):
        if v != CHAIN and v > 0:
            chosen_tree = jnp.where(k == i, v, chosen_tree)
    for i, v in enumerate(m.sizes):
        if v == 0:
            cols.append(jnp.zeros(idx.shape[:1], jnp.float32))
            known.append(jnp.asarray(False))
        elif v == CHAIN:
            cols.append((acc.length - 1).astype(jnp.float32))
            known.append(k == i)
        else:
            cols.append(jnp.sum((idx >= 1) & (idx <= v), axis=1).astype(jnp.float32))
            known.append(chosen_tree >= v)
    return jnp.stack(cols, axis=1), jnp.stack(known)


def _update(m: Auto, st: AutoState, state: SpecState, k: Array, raw: Array, acc: Acceptance, plan: Plan,
            done: Array) -> AutoState:
    """Records the choice, folds this round into the calibration and sets the next probe gap."""
    active = ~state.done
    real, known = _realised(m, k, acc)
    w = active.astype(jnp.float32)
    n = jnp.maximum(w.sum(), 1.0)
    real_obs = (real * w[:, None]).sum(0) / n
    pred_obs = (raw * w[:, None]).sum(0) / n
    a = CALIBRATION_DECAY
    upd = known & (w.sum() > 0)
    b = state.x_start.shape[0]
    r = jnp.where(active, state.rounds, st.choices.shape[1])
    choices = st.choices.at[jnp.arange(b), r].set(jnp.broadcast_to(k, (b,)), mode="drop")
    new = dataclasses.replace(
        st, choices=choices, real=jnp.where(upd, a * st.real + (1 - a) * real_obs, st.real),
        pred=jnp.where(upd, a * st.pred + (1 - a) * pred_obs, st.pred), last=raw, idle=jnp.zeros((), jnp.int32))
    if m.decide == "previous" and 0 in m.sizes:
        plain_next = _choose(new, raw, plan, ~done) == m.sizes.index(0)
        was_probe = st.idle > 0  # this draft came after plain steps
        gap = jnp.where(plain_next, jnp.where(was_probe, jnp.minimum(GAP_GROWTH * st.gap, MAX_GAP), st.gap),
                        floor_of(m))
        new = dataclasses.replace(new, gap=gap.astype(jnp.int32))
    return new


def _choose(st: AutoState, raw: Array, plan: Plan, active: Array, allowed: Any = None) -> Array:
    """The policy's choice (or the forced one) over the viable ``allowed`` sizes, at this round's costs: a pool
    table's row for the number of ``active`` sequences (at least row 1)."""
    ok = jnp.asarray(viable_of(plan.method))
    sec = st.seconds
    if sec.ndim > 1:
        sec = sec[jnp.clip(jnp.sum(active.astype(jnp.int32)), 1, sec.shape[0] - 1)]
    k = policy(calibrated(st, raw), sec, active, ok if allowed is None else ok & allowed)
    return jnp.where(st.force >= 0, st.force, k)


def run_selected(k: Array, branches, state: SpecState, *args):
    """``branches[k](state, *args)`` (each returns ``(state, extra)`` of one layout) as a chain of while loops
    of 0 or 1 trips: unlike a ``lax.switch``, a loop updates the caches in its carry in place."""
    extra = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(branches[0], state, *args)[1])
    for i, branch in enumerate(branches):
        def body(carry, branch=branch):
            return (jnp.asarray(False),) + tuple(branch(carry[1], *args))

        _, state, extra = jax.lax.while_loop(lambda c: c[0], body, (jnp.asarray(k == i), state, extra))
    return state, extra


@stage(VERIFY)
def auto_commit(target, drafter, state: SpecState, aprop: AutoProposal, k_prev, key, *,
                plan: Plan) -> SpecState:
    """Chooses the round's size (``decide="draft"``; else takes ``k_prev``), then verifies, accepts and
    commits it (:func:`run_selected` over the candidates)."""
    m: Auto = plan.method
    st = state.extra
    k = _choose(st, aprop.raw, plan, ~state.done) if m.decide == "draft" else k_prev
    probe = st.idle > 0  # a probe (or the first draft): every candidate's prediction is fresh
    if shadowing(m):  # a probe decides from its own draft; the plain step leaves its chain as a shadow
        built = jnp.asarray([v == 0 or v == CHAIN for v in m.sizes]) | aprop.tree_built  # never an unbuilt tree
        k = jnp.where(probe, _choose(st, aprop.raw, plan, ~state.done, built), k)
    branches = [functools.partial(_branch, i, target, drafter, plan=plan) for i in range(len(m.sizes))]
    args = (aprop, key)
    if len(branches) == 1:
        new, acc = branches[0](state, *args)
    else:
        new, acc = run_selected(k, branches, state, *args)
    upd = _update(m, st, state, k, aprop.raw, acc, plan, new.done)
    if shadowing(m):
        keep = probe & (k == m.sizes.index(0))
        live = keep & ~state.done
        upd = dataclasses.replace(
            upd, shadow=jnp.where(keep, aprop.chain.tokens[:, : upd.shadow.shape[1]], upd.shadow),
            shadow_at=jnp.where(keep, state.n, upd.shadow_at),
            shadow_pred=jnp.where(keep, aprop.raw[:, m.sizes.index(CHAIN)], upd.shadow_pred),
            shadow_live=jnp.where(keep, live, upd.shadow_live))
    return dataclasses.replace(new, extra=upd)


@stage(COMMIT)
def auto_plain(target, drafter, state: SpecState, key, *, plan: Plan,
               run: Any = True) -> SpecState:
    """Size 0 without a draft (``decide="previous"``): plain target steps, one per round, until the next probe
    is due (``gap - idle`` of them, at least one) or every sequence is done, in one ``while_loop``. The
    drafter's context is extended once per chunk of up to ``depth + 1`` steps. Step j samples with
    ``fold_in(key, j)``."""
    st = state.extra
    b = state.x_start.shape[0]
    i0 = plan.method.sizes.index(0)
    steps = jnp.maximum(st.gap - st.idle, 1)
    track = plan.context  # auto_plain runs for decide="previous" only: drafts_can_pay
    if not track:  # no draft can pay: plain steps to the end, without the drafter's context
        steps = jnp.int32(st.choices.shape[1])
    if st.burst_cap is not None:  # a serving pool's visit: no more plain steps than the visit has rounds left
        steps = jnp.minimum(steps, jnp.maximum(st.burst_cap, 1))
    steps = jnp.where(run, steps, 0)  # ``run`` False: no step (the round drafts)
    chunk = plan.depth + 1  # the rows a drafted round's commit appends: the context cache has room for them
    feat_size = drafter.config.feature_size
    dtype = target.dtype  # the target's hidden states, as the per-step path passes them

    def chunk_cond(carry):
        j, s = carry
        return (j < steps) & ~jnp.all(s.done)

    def chunk_body(carry):
        j0, s0 = carry

        def cond(c):
            i, s, _, _ = c
            return (i < chunk) & (j0 + i < steps) & ~jnp.all(s.done)

        def body(c):
            i, s, feats, count = c
            # the context is extended once per chunk below, not by each step
            k = None if key is None else sampling.fold_in(key, j0 + i)
            new, ver, _ = _plain_target_step(target, drafter, dataclasses.replace(s, ctx=None), k, plan,
                                             features=track)
            new = dataclasses.replace(new, ctx=s.ctx)
            f, step = ver.features, (~s.done).astype(jnp.int32)
            r = jnp.where(~s.done, s.rounds, st.choices.shape[1])
            choices = s.extra.choices.at[jnp.arange(b), r].set(i0, mode="drop")
            if track:
                feats = jax.lax.dynamic_update_slice_in_dim(feats, f.astype(feats.dtype), i, axis=1)
            return i + 1, dataclasses.replace(new, extra=dataclasses.replace(s.extra, choices=choices)), feats, \
                count + step

        init = (jnp.zeros((), jnp.int32), s0, jnp.zeros((b, chunk, feat_size), dtype), jnp.zeros((b,), jnp.int32))
        i, s, feats, count = jax.lax.while_loop(cond, body, init)
        if not track:
            return j0 + i, s
        # active steps are a prefix of the chunk for every sequence (done is absorbing): rows past `count` are
        # scratch past the context's new length
        return j0 + i, dataclasses.replace(s, ctx=drafting.append_context(drafter, s.ctx, feats, count))

    j, new = jax.lax.while_loop(chunk_cond, chunk_body, (jnp.zeros((), jnp.int32), state))
    return dataclasses.replace(new, extra=dataclasses.replace(new.extra, idle=st.idle + j))


def auto_round(target, drafter, state: SpecState, plan: Plan, call=None) -> SpecState:
    """One round of ``auto`` (the body of the generation's ``while_loop``; see the module docstring).

    ``call`` as in :func:`~sparkjax.engine.round.run_stages` (the instrumented mode: each stage its own
    jitted call; the choice between a plain step and a drafted round is then made on the host)."""
    eager = getattr(call, "eager", False)  # the instrumented mode's call (a mesh's call stays traced)
    if call is None:
        def call(fn, *args, **kwargs):
            return fn(target, drafter, *args, **kwargs)

    m: Auto = plan.method
    state, k_propose, k_accept = round_keys(state, plan)  # none split on the greedy path

    def drafted(state, k_prev):
        state, blk = with_draft_context(state, call(draft, state, plan=plan))
        aprop = call(auto_propose, state, blk, k_propose, k_prev, plan=plan)
        return call(auto_commit, state, aprop, k_prev, k_accept, plan=plan)

    if m.decide == "draft":
        return drafted(state, None)
    st = state.extra
    if 0 not in m.sizes:
        return drafted(state, _choose(st, st.last, plan, ~state.done))
    i0 = m.sizes.index(0)
    # after `gap` plain steps in a row, draft again (the predictions are stale)
    probe_due = (st.idle >= st.gap) & drafts_can_pay(m)  # never a probe when no draft can pay
    # a shadow chain is scored once its places are committed, and before the next probe can replace it
    st = score_shadow(m, st, state, probe_due)
    state = dataclasses.replace(state, extra=st)
    allowed = jnp.arange(len(m.sizes)) != jnp.where(probe_due, i0, -1)
    k = _choose(st, st.last, plan, ~state.done, allowed)
    if eager:
        if int(k) == i0:
            return call(auto_plain, state, k_accept, plan=plan)
        return drafted(state, k)
    # a plain burst (0 steps unless k is size 0), then a drafted round (0 or 1 trip), as while loops
    plain = k == i0
    state = call(auto_plain, state, k_accept, plan=plan, run=plain)
    return run_selected(jnp.where(plain, 1, 0), [lambda s: (drafted(s, k), ()), lambda s: (s, ())], state)[0]


# ============================================================================ the method


DEFAULT_SIZES: tuple[int | str, ...] = (0, CHAIN, 8, 16, 32, 64)  # Auto's default candidate verification sizes
DECIDE = ("draft", "previous")  # when Auto decides: after this round's draft, or from the previous round's
AUTO_TOP_C = 32  # Auto's default candidates per depth (the tree is built every drafted round, whatever its size)


@dataclasses.dataclass(frozen=True)
class Auto(Method):
    """Picks each round's verification size on device (its round and modes: :mod:`sparkjax.engine.adaptive`;
    the options: docs/auto.md). ``sizes``: out of ``0`` (a plain target step), ``"chain"`` (``chain=``, default
    ``dspark`` with a Markov head, else ``dflash``) and tree budgets ``b >= 1`` (the first ``b`` nodes of one
    best-first tree of the largest budget: ``tree=``, default ``sparklingtree`` with a Markov head, else
    ``ddtree``). ``table``: a :class:`~sparkjax.engine.costs.CostTable` or
    :class:`~sparkjax.engine.costs.PoolCostTable` for these sizes (default: this device's and shape's, see
    :meth:`bind`); its seconds are a traced input, so it is not compared, and its static part (``viable``,
    ``floor``) is set when it is bound: leave those unset.
    """

    KINDS: ClassVar[dict[str, Kind]] = {"auto": Kind()}
    sizes: tuple[int | str, ...] = DEFAULT_SIZES
    budget: int | None = None
    tree: str | None = None
    chain: str | None = None
    top_c: int | None = None
    normalization: str = "fast"
    decide: str = "previous"
    probe: int = 4
    viable_share: float = 0.5
    table: Any = dataclasses.field(default=None, compare=False)  # a sparkjax.engine.costs.CostTable, or None
    viable: tuple[bool, ...] | None = None
    floor: int | None = None

    def __post_init__(self):
        sizes = self.sizes
        if isinstance(sizes, str | bytes) or not isinstance(sizes, list | tuple):
            raise ArgumentError(f"sizes: expected a list of candidate sizes (0, 'chain', tree budgets), "
                                f"got {describe(sizes)}")
        if not sizes:
            raise ArgumentError("sizes: empty candidate set; give at least one of 0, 'chain' or a tree budget")
        out: list[int | str] = []
        for i, x in enumerate(sizes):
            if x == CHAIN and isinstance(x, str):
                v: int | str = CHAIN
            elif is_int(x) and 0 <= int(x) <= MAX_SLOTS:
                v = int(x)
            else:
                raise ArgumentError(f"sizes[{i}]: expected 0, 'chain' or a tree budget >= 1, got {describe(x)}")
            if v in out:
                raise ArgumentError(f"sizes[{i}]: {v!r} is listed twice")
            out.append(v)
        trees = sorted(v for v in out if v != CHAIN and v > 0)
        canon = tuple(([0] if 0 in out else []) + ([CHAIN] if CHAIN in out else []) + trees)
        object.__setattr__(self, "sizes", canon)
        if self.budget is not None:
            budget = check_int("budget", self.budget, unit="number of tree nodes")
            if trees and trees[-1] > budget:
                raise ArgumentError(f"sizes: tree size {trees[-1]} exceeds budget={budget}")
            object.__setattr__(self, "budget", budget)
        if self.tree is not None:
            if kind_of(Tree, self.tree, "tree").beam:
                raise ArgumentError(f"tree: {self.tree!r} is a beam; auto slices best-first trees (ddtree, "
                                    "sparklingtree)")
        if self.chain is not None:
            kind_of(Chain, self.chain, "chain")
        markov = (self.tree is not None and Tree.KINDS[self.tree].markov) or \
            (self.chain is not None and Chain.KINDS[self.chain].markov)
        object.__setattr__(self, "needs_markov", markov)
        if self.top_c is not None:
            object.__setattr__(self, "top_c", check_int("top_c", self.top_c))
        if not isinstance(self.normalization, str) or self.normalization not in NORMALIZATIONS:
            raise ArgumentError(f"normalization: expected 'exact' or 'fast', got {describe(self.normalization)}")
        if not isinstance(self.decide, str) or self.decide not in DECIDE:
            raise ArgumentError(f"decide: expected one of {DECIDE}, got {describe(self.decide)}")
        object.__setattr__(self, "probe", check_int("probe", self.probe))
        share = self.viable_share
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
            raise ArgumentError(f"viable_share: expected a number in (0, 1], got {describe(share)}")
        object.__setattr__(self, "viable_share", float(share))
        if self.table is not None:
            labels = getattr(self.table, "labels", None)
            if labels is None or not hasattr(self.table, "seconds"):
                raise ArgumentError(f"table: expected a sparkjax.engine.costs.CostTable, got {describe(self.table)}")

    @property
    def name(self) -> str:
        return "auto"

    @property
    def widths(self) -> None:
        return None

    @property
    def candidates(self) -> str | None:
        """The candidate sets of the tree it builds (None without a tree size or before :meth:`resolve`)."""
        if not self.tree_sizes or self.tree is None:
            return None
        return self.largest_tree().candidates

    def largest_tree(self) -> Tree:
        """The tree built each round (its smaller sizes are prefixes): per-depth tables, whatever
        ``sparklingtree``'s own default (auto's costs and memory were measured on those)."""
        markov = Tree.KINDS[self.tree].markov
        return Tree(self.tree, self.tree_sizes[-1], self.top_c, None, self.normalization,
                    TABLE_CANDIDATES if markov else None)

    @property
    def tree_sizes(self) -> tuple[int, ...]:
        return tuple(v for v in self.sizes if v != CHAIN and v > 0)

    def labels(self) -> tuple[str, ...]:
        """The candidates' names, in ``sizes`` order (``ar``, the chain's kind, ``tree@b``); resolved kinds."""
        return tuple("ar" if v == 0 else (self.chain or CHAIN) if v == CHAIN else f"{self.tree or 'tree'}@{v}"
                     for v in self.sizes)

    def nodes(self, drafter) -> int:
        trees = self.tree_sizes
        return trees[-1] if trees else drafted_depth(drafter)

    def resolve(self, drafter) -> Auto:
        """The tree and chain kinds for ``drafter`` (Markov head: sparklingtree / dspark, else ddtree / dflash)."""
        markov = drafter is not None and drafter.config.has_markov
        tree_kind = self.tree or ("sparklingtree" if markov else "ddtree")
        chain_kind = self.chain or ("dspark" if markov else "dflash")
        return dataclasses.replace(self, tree=tree_kind, chain=chain_kind)

    def plan(self, target, drafter, sampling: bool, options: Options | None = None) -> Plan:
        if drafter is None:
            raise ArgumentError("drafter: method 'auto' needs a drafter (use method='ar' without one)")
        resolved = self.resolve(drafter)
        check_drafter(target, drafter, resolved)
        depth = drafted_depth(drafter)
        trees = self.tree_sizes
        c = None  # no tree size: no candidates
        if trees:
            top_c = min(AUTO_TOP_C, target.config.vocab_size) if self.top_c is None else self.top_c
            sub = Tree(resolved.tree, trees[-1], top_c, None, self.normalization).plan(target, drafter, sampling,
                                                                                      options)
            c = sub.top_c
        resolved = dataclasses.replace(resolved, top_c=c, table=None, viable=None, floor=None)
        plan = Plan(resolved, depth, resolved.nodes(drafter), bool(sampling), tuple(drafter.config.target_layer_ids),
                    check_options(options), context=keeps_context(resolved))
        return plan if self.table is None else resolved.with_table(plan, self.table)

    def with_table(self, plan: Plan, table: Any) -> Plan:
        """``plan`` bound to the cost ``table``: the method carries it, with its static part (``viable``,
        ``floor``) for ``plan.depth``. ArgumentError naming ``table`` when it is for other candidates."""
        if tuple(table.labels) != self.labels():
            raise ArgumentError(f"table: its candidates {list(table.labels)} are not this method's "
                                f"{list(self.labels())}")
        # a PoolCostTable has a row per active count: a size is viable if it is at some count
        rows = table.rows() if isinstance(table, costs.PoolCostTable) else [tuple(table.seconds)]
        ok = [viable(self, plan.depth, r) for r in rows]
        bound = dataclasses.replace(self, table=table, viable=tuple(map(any, zip(*ok, strict=True))),
                                    floor=min(gap_floor(self, plan.depth, r) for r in rows))
        return dataclasses.replace(plan, method=bound, context=keeps_context(bound))

    def bind(self, plan: Plan, *, target, drafter, batch: int, cache_size: int, pool: Sequence[int] = (),
             memory: Any = None, measure: bool = True) -> tuple[Plan, AutoInputs]:
        """``plan`` with its cost table (the method's own, else this device's, batch's and cache size's:
        :func:`~sparkjax.engine.costs.table_for`; for a ``pool``, :func:`~sparkjax.engine.costs.pool_table_for`),
        and the table's seconds and the memory to start from (:func:`~sparkjax.engine.adaptive.auto_inputs`)."""
        table = plan.method.table
        if isinstance(table, costs.PoolCostTable) and table.slots != batch:
            raise ArgumentError(f"table: a PoolCostTable for {table.slots} slots, but this run has {batch} "
                                f"sequences")
        if table is None and not measure:
            pass  # unbound: every size viable, equal costs
        elif table is None and pool and batch > 1:
            plan = plan.method.with_table(plan, costs.pool_table_for(target, drafter, plan, batch, cache_size,
                                                                     sizes=pool))
        elif table is None:
            plan = plan.method.with_table(plan, costs.table_for(target, drafter, plan, batch, cache_size))
        return plan, auto_inputs(plan, memory)

    # the hooks of a method that carries state: auto's, in sparkjax.engine.adaptive
    # the traced side, below in this module: the carried state, the round, the results
    def init_state(self, plan: Plan, batch: int, buf_len: int, inputs: Any) -> AutoState:
        return init_state(plan, batch, buf_len, inputs)

    def round(self, target, drafter, state: SpecState, plan: Plan, call=None) -> SpecState:
        return auto_round(target, drafter, state, plan, call)

    def results(self, state: SpecState, plan: Plan) -> AutoResults:
        return results(state, plan)

    def tree_plan(self, plan: Plan) -> Plan:
        """The plan of the largest tree (the one built each round)."""
        return Plan(self.largest_tree(), plan.depth,
                    self.tree_sizes[-1], plan.sampling, plan.layer_ids, plan.options, plan.logprobs)

    def plain_plan(self, plan: Plan, features: bool = True) -> Plan:
        """The plan of size 0: ``ar``'s round, reading the drafter's layers when ``features`` (the drafted
        rounds that follow need the plain steps' features in the drafter's context)."""
        return Plan(AR(), 0, 0, plan.sampling, plan.layer_ids if features else (), plan.options, plan.logprobs,
                    context=False)

    def chain_plan(self, plan: Plan) -> Plan:
        return Plan(Chain(self.chain), plan.depth, plan.depth, plan.sampling, plan.layer_ids, plan.options,
                    plan.logprobs)
