"""Decoding methods as objects: the :class:`Method` protocol and one class per method. A method validates
itself when built, resolves into the static :class:`~sparkjax.engine.state.Plan` of a compiled program and owns
its round and the other hooks of :class:`Method`, through which alone the programs reach it. Each class declares
its names (``KINDS``); :mod:`~sparkjax.engine.names` builds the one table from them and :func:`parse_method` is its
only reader (docs/design.md). ``Auto`` lives in :mod:`~sparkjax.engine.adaptive`, beside its traced round.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from .. import sampling, tree
from ..errors import ArgumentError
from . import drafting
from . import round as stages
from .checks import MAX_SLOTS, check_drafter, check_int, check_int_list, describe
from .options import Options, check_options
from .state import Acceptance, Plan, Proposal, SpecState, Verified

Array = jax.Array

DEFAULT_BUDGET = 64  # tree nodes verified per round when no budget is given
NORMALIZATIONS = ("fast", "exact")  # how the Markov tables are normalized (see sparkjax.tree.markov_tables)
DEFAULT_CANDIDATES = "union"  # sparklingtree's candidates when none is given (docs/eval.md: chosen by measured tau)
TABLE_CANDIDATES = "union"  # the default of the Markov trees built from per-depth tables (beam, pctree, auto's)
SEED_TOP_C = 128  # candidates="seed": the top-C per depth of the seed's published run (its union is D * C + 1 wide)
WIDTH_PROFILES = ("auto", "even")  # named beam profiles: sparkjax.tree.auto_widths, sparkjax.tree.even_widths
DEFAULT_WIDTHS = "auto"  # the beam's profile when none is given


@dataclasses.dataclass(frozen=True)
class Kind:
    """What a method name means to its class: ``markov`` (needs the drafter's Markov head) and, for trees,
    ``beam`` (fixed nodes per depth)."""

    markov: bool = False
    beam: bool = False


def kind_of(cls: type[Method], name: Any, arg: str) -> Kind:
    """The :class:`Kind` of ``name`` among ``cls.KINDS`` (that class's own names); ArgumentError naming ``arg``."""
    kind = cls.KINDS.get(name) if isinstance(name, str) else None
    if kind is None:
        raise ArgumentError(f"{arg}: not a {cls.__name__} kind: {describe(name)}; expected one of "
                            f"{', '.join(cls.KINDS)}")
    return kind


class Method:
    """What every method answers. Subclasses are frozen dataclasses (hashable: a method is part of the
    static plan). The class attributes ``top_c``, ``widths``, ``normalization`` and ``candidates`` describe
    a method's tree (what :class:`~sparkjax.engine.state.Plan` reports)."""

    speculative: ClassVar[bool] = True
    needs_markov: ClassVar[bool] = False  # whether it reads the drafter's Markov head (set per instance by the kinds)
    KINDS: ClassVar[dict[str, Kind]] = {}  # the names of this class (read by parse_method's table and by kind_of)
    top_c: ClassVar[int | None] = None
    widths: ClassVar[tuple[int, ...] | None] = None
    normalization: ClassVar[str] = "fast"
    candidates: ClassVar[str | None] = None

    @property
    def name(self) -> str:
        """The method's name in the table of :func:`parse_method`."""
        raise NotImplementedError

    @property
    def label(self) -> str:
        """The string :func:`parse_method` reads back into this method (defaults aside)."""
        return self.name

    def __str__(self) -> str:
        return self.label

    def labels(self) -> tuple[str, ...]:
        """The names the choices among ``results(...)`` index (``auto``'s candidates); empty for most methods."""
        return ()

    def plan(self, target, drafter, sampling: bool, options: Options | None = None) -> Plan:
        """Checks the method against the pair and returns the static :class:`Plan`;
        ``options``: the trace-time :class:`~sparkjax.engine.options.Options` it carries (None: defaults)."""
        raise NotImplementedError

    def bind(self, plan: Plan, *, target, drafter, batch: int, cache_size: int, pool: Sequence[int] = (),
             memory: Any = None, measure: bool = True) -> tuple[Plan, Any]:
        """``(plan, inputs)`` of a run of ``batch`` sequences over ``cache_size`` slots (``pool``: the batch sizes a
        serving pool's rounds run at): the plan bound to the run (default: ``plan`` itself) and the pytree of arrays
        the program takes as a traced argument (default None). ``memory``: what an earlier generation learned
        (``generate(auto_memory=)``); a method that keeps none refuses it. ``measure=False``: nothing is timed on
        the device (a compile-only device; ``auto`` then runs on equal costs)."""
        if memory is not None:
            raise ArgumentError(f"auto_memory: method {self.name!r} keeps no memory between generations")
        return plan, None

    def init_state(self, plan: Plan, batch: int, buf_len: int, inputs: Any) -> Any:
        """The method's own carried state before the first round (``SpecState.extra``; default None)."""
        return None

    def propose(self, drafter, x_start: Array, blk: drafting.DraftBlock, plan: Plan, temperature, key) -> Proposal:
        """The round's proposal (a chain or a tree of ``plan.nodes`` nodes) from the drafter's block."""
        raise NotImplementedError

    def accept(self, prop: Proposal, ver: Verified, temperature, key, *, plan: Plan) -> Acceptance:
        """The accepted path (default: the tree walk over the target's posterior,
        :func:`~sparkjax.engine.round.walk`, exact under greedy and lossless when sampling)."""
        return stages.walk(prop, ver, temperature, key, plan=plan)

    def round(self, target, drafter, state: SpecState, plan: Plan, call=None) -> SpecState:
        """One round, a pure function of the state, each sequence's request values included (default:
        :func:`~sparkjax.engine.round.run_stages`, whose ``call`` this is)."""
        return stages.run_stages(target, drafter, state, plan, call)

    def results(self, state: SpecState, plan: Plan) -> Any:
        """Extra outputs of a finished generation (``Launch.extra``; default None)."""
        return None


@dataclasses.dataclass(frozen=True)
class AR(Method):
    """The target alone, one token per round (the reference every method must equal at temperature 0): a round
    that drafts nothing, proposes no node, verifies the root alone (the plain one-token step) and accepts the
    target's own token, through the same stages and commit as every method. It needs no drafter."""

    speculative: ClassVar[bool] = False
    KINDS: ClassVar[dict[str, Kind]] = {"ar": Kind()}

    @property
    def name(self) -> str:
        return "ar"

    def plan(self, target, drafter, sampling: bool, options: Options | None = None) -> Plan:
        return Plan(self, 0, 0, bool(sampling), (), check_options(options), context=False)

    def propose(self, drafter, x_start, blk, plan, temperature, key) -> Proposal:
        b = x_start.shape[0]
        none = jnp.zeros((b, 0), jnp.int32)
        return Proposal(none, none, none, jnp.ones((b, 1, 1), bool), None)

    def accept(self, prop, ver, temperature, key, *, plan) -> Acceptance:
        b = ver.tokens.shape[0]
        bonus = sampling.pick(ver.logits[:, 0], temperature, key if plan.sampling else None)
        return Acceptance(jnp.zeros((b, 1), jnp.int32), jnp.ones((b,), jnp.int32), bonus)


@dataclasses.dataclass(frozen=True)
class Chain(Method):
    """One drafted node per depth: ``dflash`` (the drafter's per-position choice) or ``dspark`` (the
    Markov-corrected chain, which needs a Markov head). Sampled chains are accepted by speculative
    sampling (:func:`sparkjax.sampling.speculative_chain`), greedy ones by the tree walk."""

    KINDS: ClassVar[dict[str, Kind]] = {"dflash": Kind(), "dspark": Kind(markov=True)}
    kind: str = "dflash"

    def __post_init__(self):
        object.__setattr__(self, "needs_markov", kind_of(Chain, self.kind, "kind").markov)

    @property
    def name(self) -> str:
        return self.kind

    def nodes(self, drafter) -> int:
        """Nodes verified per round with ``drafter``: one per drafted depth."""
        return drafted_depth(drafter)

    def plan(self, target, drafter, sampling: bool, options: Options | None = None) -> Plan:
        check_drafter(target, drafter, self)
        d = drafted_depth(drafter)
        return Plan(self, d, d, bool(sampling), tuple(drafter.config.target_layer_ids), check_options(options))

    def propose(self, drafter, x_start, blk, plan, temperature, key) -> Proposal:
        b, d = x_start.shape[0], plan.depth
        # the drafts are drawn at the temperature alone (speculative_chain's q); top-p / top-k shape only p
        k, temp = (key, sampling.temperature_of(temperature)) if plan.sampling else (None, 0.0)
        if self.needs_markov:
            chain = drafting.markov_chain(drafter, blk.logits, blk.hidden, x_start, temp, k,
                                          mode=plan.options.chain_mode)
        elif plan.sampling:
            chain = drafting.sample_chain(drafter, blk.logits, temp, k)
        else:
            chain = drafting.argmax_chain(drafter, blk.logits)
        tokens = chain.tokens[:, :d]
        parents = jnp.broadcast_to(jnp.arange(d, dtype=jnp.int32), (b, d))
        depths = jnp.broadcast_to(jnp.arange(1, d + 1, dtype=jnp.int32), (b, d))
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((d + 1, d + 1), bool)), (b, d + 1, d + 1))
        return Proposal(tokens, parents, depths, mask, chain.logits[:, :d])

    def accept(self, prop, ver, temperature, key, *, plan) -> Acceptance:
        if not plan.sampling:
            return super().accept(prop, ver, temperature, key, plan=plan)
        n_acc, nxt = sampling.speculative_chain(ver.logits, prop.draft_logits, prop.tokens, temperature, key)
        j = jnp.arange(plan.depth + 1, dtype=jnp.int32)
        acc = Acceptance(jnp.where(j[None] <= n_acc[:, None], j[None], -1), n_acc + 1, nxt)
        t = jnp.asarray(sampling.temperature_of(temperature))
        if t.ndim == 0:
            return acc
        # a temperature per sequence: the greedy ones take the greedy walk (exactly the target's tokens)
        greedy = super().accept(prop, ver, 0.0, None, plan=dataclasses.replace(plan, sampling=False))
        hot = t > 0
        return Acceptance(jnp.where(hot[:, None], acc.indices, greedy.indices), jnp.where(hot, acc.length,
                          greedy.length), jnp.where(hot, acc.bonus, greedy.bonus))


@dataclasses.dataclass(frozen=True)
class Tree(Method):
    """A draft tree of ``budget`` nodes verified at once: ``ddtree``, ``sparklingtree`` or
    ``sparklingtree-beam`` (its options: docs/api.md, "Methods"; ``widths`` only for the beam, ``candidates``
    other than ``base`` only for the Markov trees)."""

    KINDS: ClassVar[dict[str, Kind]] = {"ddtree": Kind(), "sparklingtree": Kind(markov=True),
                                        "sparklingtree-beam": Kind(markov=True, beam=True)}
    kind: str = "sparklingtree"
    budget: int = DEFAULT_BUDGET
    top_c: int | None = None
    widths: tuple[int, ...] | str | None = None
    normalization: str = "fast"
    candidates: str | None = None  # None: the method's default (DEFAULT_CANDIDATES for Markov trees, base for ddtree)
    max_fanout: int = 0  # candidates="seed": children per parent at most (0: the budget)

    def __post_init__(self):
        entry = kind_of(type(self), self.kind, "kind")
        object.__setattr__(self, "needs_markov", entry.markov)
        beam = entry.beam
        if not isinstance(self.normalization, str) or self.normalization not in NORMALIZATIONS:
            raise ArgumentError(f"normalization: expected 'exact' or 'fast', got {describe(self.normalization)}")
        cand = self.candidates
        if cand is not None and (not isinstance(cand, str) or cand not in tree.TREE_CANDIDATE_MODES):
            raise ArgumentError(f"candidates: expected one of {', '.join(tree.TREE_CANDIDATE_MODES)}, "
                                f"got {describe(cand)}")
        if cand not in (None, "base") and not entry.markov:
            raise ArgumentError(f"candidates: {cand!r} follows the Markov head; {self.kind!r} has none (use 'base')")
        if cand == "seed" and (beam or type(self) is not Tree):
            raise ArgumentError(f"candidates: 'seed' is the seed's best-first tree; {self.kind!r} builds from "
                                f"per-depth tables (use {', '.join(tree.CANDIDATE_MODES)})")
        object.__setattr__(self, "candidates", cand if cand is not None else self.default_candidates)
        if self.max_fanout != 0:
            object.__setattr__(self, "max_fanout", check_int("max_fanout", self.max_fanout,
                                                             unit="of children per parent"))
            if self.candidates != "seed":
                raise ArgumentError(f"max_fanout: only candidates='seed' limits the children per parent, "
                                    f"not {self.candidates!r}")
        if self.budget is not None or type(self) is not PCTree:  # pctree's default depends on the drafter
            budget = check_int("budget", self.budget, unit="number of tree nodes")
            if budget > MAX_SLOTS:
                raise ArgumentError(f"budget: {budget} nodes exceed {MAX_SLOTS} (node indices are int32 on device)")
            object.__setattr__(self, "budget", budget)
        if self.top_c is not None:
            object.__setattr__(self, "top_c", check_int("top_c", self.top_c))
        if self.widths is not None:
            if not beam:
                raise ArgumentError(f"widths: only 'sparklingtree-beam' takes a width profile, not {self.kind!r}")
            if not (isinstance(self.widths, str) and self.widths in WIDTH_PROFILES):
                if isinstance(self.widths, str):
                    raise ArgumentError(f"widths: expected {' or '.join(map(repr, WIDTH_PROFILES))} or a list of "
                                        f"per-depth ints, got {describe(self.widths)}")
                object.__setattr__(self, "widths", check_int_list("widths", self.widths))

    @property
    def name(self) -> str:
        return self.kind

    @property
    def label(self) -> str:
        """``kind@budget``, then ``:candidates`` when not the kind's default and ``:fanout=K`` when set."""
        out = self.kind if self.budget is None else f"{self.kind}@{self.budget}"
        if self.candidates != self.default_candidates:
            out += f":{self.candidates}"
        return out + (f":fanout={self.max_fanout}" if self.max_fanout else "")

    @property
    def beam(self) -> bool:
        """Fixed nodes per depth (a beam) rather than best-first."""
        return self.KINDS[self.kind].beam

    @property
    def default_candidates(self) -> str:
        """The candidates when none is given: ``base`` without a Markov head, :data:`DEFAULT_CANDIDATES` for
        ``sparklingtree``, :data:`TABLE_CANDIDATES` for the trees built from per-depth tables."""
        entry = self.KINDS[self.kind]
        if not entry.markov:
            return "base"
        return TABLE_CANDIDATES if entry.beam or type(self) is not Tree else DEFAULT_CANDIDATES

    def nodes(self, drafter) -> int:
        return self.budget

    def plan(self, target, drafter, sampling: bool, options: Options | None = None) -> Plan:
        check_drafter(target, drafter, self)
        depth = drafted_depth(drafter)
        budget, v = self.budget, target.config.vocab_size
        seed = self.candidates == "seed"
        c = min((SEED_TOP_C if seed else max(budget, 32)) if self.top_c is None else self.top_c, v)
        fanout = tree.seed_fanout(budget, self.max_fanout, min(depth * c + 1, v)) if seed else c
        reachable = sum(fanout**k for k in range(1, depth + 1))
        if budget > reachable:
            raise ArgumentError(
                f"budget: {budget} nodes exceed the reachable tree size {reachable} "
                f"({f'max_fanout={fanout}' if seed else f'top_c={c}'}, depth={depth})"
            )
        w = None
        if self.beam:
            w = DEFAULT_WIDTHS if self.widths is None else self.widths
            if w == "even":
                w = tree.even_widths(budget, depth)
            elif w == "auto":
                w = tree.auto_widths(budget, depth, top_c=c)
            if len(w) != depth or sum(w) != budget:
                raise ArgumentError(f"widths: need {depth} per-depth widths summing to budget={budget}, got {w}")
            if any(x > c ** (i + 1) for i, x in enumerate(w)):
                raise ArgumentError(f"widths: {w} asks for more nodes at some depth than top_c={c} allows")
            first_zero = w.index(0) if 0 in w else depth
            if any(w[first_zero:]):
                raise ArgumentError(f"widths: zeros may only come at the end (deepest depths), got {w}")
        resolved = dataclasses.replace(self, top_c=c, widths=w)
        return Plan(resolved, depth, resolved.nodes(drafter), bool(sampling), tuple(drafter.config.target_layer_ids),
                    check_options(options))

    def propose(self, drafter, x_start, blk, plan, temperature, key) -> Proposal:
        t = self.build(drafter, x_start, blk, plan)
        mask = jax.vmap(tree.visibility, in_axes=(0, None))(t.parents, plan.depth)
        return Proposal(t.tokens, t.parents, t.depths, mask, None)

    def build(self, drafter, x_start, blk, plan) -> tree.Tree:
        """The batched :class:`sparkjax.tree.Tree` of ``plan.nodes`` nodes (with its path scores)."""
        if self.candidates == "seed":  # the seed's union and normaliser; only the rows the walk reaches
            logits = drafting.aligned_logits(drafter, blk.logits).astype(jnp.float32)
            hidden = blk.hidden[:, drafter.config.first_draft_slot :][:, : logits.shape[1]]

            def one(lg, x, h):
                return tree.seed_best_first(lg, x, lambda hd, p: drafting.markov_features(drafter, hd, p), h,
                                            drafting.markov_w2(drafter), budget=plan.nodes, top_c=plan.top_c,
                                            max_fanout=self.max_fanout)

            return jax.vmap(one)(logits, x_start, hidden)
        tables, cand_tokens = self.tables(drafter, x_start, blk, plan)
        if self.beam:
            return jax.vmap(tree.beam, in_axes=(0, 0, None))(tables, cand_tokens, plan.widths)
        return jax.vmap(tree.best_first, in_axes=(0, 0, None))(tables, cand_tokens, plan.nodes)

    def tables(self, drafter, x_start, blk, plan) -> tuple[jax.Array, jax.Array]:
        """The batched log-prob tables float32[B, D, C, C] and their candidates int[B, D, C] (:meth:`build`'s
        input)."""
        b = x_start.shape[0]
        opts = plan.options
        # per-depth base logits [B, D, V] and the block hidden states of the same slots [B, D, Dm]
        logits = drafting.aligned_logits(drafter, blk.logits).astype(jnp.float32)
        hidden = blk.hidden[:, drafter.config.first_draft_slot :]
        if not self.needs_markov:
            cand_tokens, cand_logp = jax.vmap(tree.candidates, in_axes=(0, None))(logits, plan.top_c)
            tables = jax.vmap(tree.ddtree_tables)(cand_logp)
        else:
            if self.candidates == "base":
                corrected = logits  # unused
            else:  # depth d's logits corrected for the DSpark greedy chain's token of depth d - 1
                corrected = drafting.candidate_chain_logits(
                    drafter, blk.logits, blk.hidden, x_start, max_passes=opts.candidate_chain_passes,
                    mode=opts.chain_mode,
                )[:, : logits.shape[1]]
            union_k = None if opts.union_top_k is None else min(opts.union_top_k, min(plan.top_c, logits.shape[-1]))
            cand_tokens = jax.vmap(tree.markov_candidates, in_axes=(0, 0, None, None, None))(
                logits, corrected, plan.top_c, self.candidates, union_k
            )
            c = cand_tokens.shape[-1]
            prev = jnp.concatenate([jnp.broadcast_to(x_start[:, None, None], (b, 1, c)), cand_tokens[:, :-1]], axis=1)
            feats = drafting.markov_features(drafter, hidden, prev)
            w2 = drafting.markov_w2(drafter)
            tables = jax.vmap(tree.markov_tables, in_axes=(0, 0, 0, None, None))(
                logits, cand_tokens, feats, w2, plan.normalization
            )
        return tables, cand_tokens


PCTREE_BUDGET = 32  # pctree's default N: nodes of the selected tree, the root included (at most what the beam keeps)
PCTREE_K = 4  # pctree's default beam width per depth


@dataclasses.dataclass(frozen=True)
class PCTree(Tree):
    """PCTree (arXiv 2608.02123, :func:`sparkjax.tree.layer_beam`): ``sparklingtree``'s candidates and Markov
    tables, a beam of the ``k`` best (parent, child) extensions per depth, then the ``budget`` best kept nodes
    *counting the root* (``pctree@32`` verifies 31 drafted nodes). Verified by the tree walk. ``budget=None``:
    :data:`PCTREE_BUDGET`, or all the beam keeps (``1 + k * depth``) when that is fewer (a block-7 drafter)."""

    KINDS: ClassVar[dict[str, Kind]] = {"pctree": Kind(markov=True)}
    kind: str = "pctree"
    budget: int | None = None
    k: int = PCTREE_K

    def __post_init__(self):
        super().__post_init__()
        if self.budget is not None and self.budget < 2:
            raise ArgumentError(f"budget: pctree's budget counts the root, so it needs at least 2 nodes, "
                                f"got {self.budget}")
        object.__setattr__(self, "k", check_int("k", self.k, unit="of nodes kept per depth"))

    def resolved(self, drafter) -> PCTree:
        """This method with its budget set for ``drafter`` (the default: see the class)."""
        if self.budget is not None:
            return self
        return dataclasses.replace(self, budget=min(PCTREE_BUDGET, 1 + self.k * drafted_depth(drafter)))

    def nodes(self, drafter) -> int:
        return self.resolved(drafter).budget - 1

    def plan(self, target, drafter, sampling: bool, options: Options | None = None) -> Plan:
        check_drafter(target, drafter, self)
        self = self.resolved(drafter)
        plan = super().plan(target, drafter, sampling, options)
        if plan.nodes > self.k * plan.depth:
            raise ArgumentError(f"budget: {self.budget} nodes (the root and {plan.nodes} drafted) exceed the "
                                f"{1 + self.k * plan.depth} the beam keeps (the root and k={self.k} x depth "
                                f"{plan.depth}); leave budget unset for pctree's default")
        return plan

    def build(self, drafter, x_start, blk, plan) -> tree.Tree:
        tables, cand_tokens = self.tables(drafter, x_start, blk, plan)
        return jax.vmap(tree.layer_beam, in_axes=(0, 0, None, None))(tables, cand_tokens, self.k, plan.nodes)


def drafted_depth(drafter) -> int:
    """Drafted depths per round with ``drafter`` (its block past the first draft slot)."""
    return drafter.config.block_size - drafter.config.first_draft_slot
