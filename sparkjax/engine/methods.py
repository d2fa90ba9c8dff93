"""Decoding methods as objects: :class:`AR`, :class:`Chain` and :class:`Tree`.

A method validates itself when it is built (an :class:`~sparkjax.errors.ArgumentError` naming the
argument), knows its depth and node count for a drafter, whether it needs a Markov head, resolves
into the static :class:`Plan` of a compiled program, and builds a round's proposal (the draft ->
chain or draft -> tree step). Method *names* (``"sparklingtree"``, ``"sparklingtree@64"``) are read
in exactly one place, :func:`parse_method`, from the one table of names at the end of this module:
a new method is one new class plus one entry there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from .. import tree
from ..errors import ArgumentError
from . import drafting
from .checks import MAX_SLOTS, check_drafter, check_int, check_int_list, describe, is_int
from .state import Proposal

Array = jax.Array

DEFAULT_BUDGET = 64  # tree nodes verified per round when no budget is given
NORMALIZATIONS = ("fast", "exact")  # how the Markov tables are normalized (see sparkjax.tree.markov_tables)
DEFAULT_CANDIDATES = "union"  # the Markov trees' candidates when none is given (see sparkjax.tree.markov_candidates)
# Passes of the fixed-point DSpark chain behind the corrected / union candidates on accelerators (static; None: to
# convergence, the exact greedy chain in a while loop). One pass: every depth corrected for the restricted chain's
# guess of its parent (the chain through the base top-32), one product over W2 and no loop. XLA:CPU runs the exact
# sequential chain instead (drafting.candidate_chain_logits).
CANDIDATE_CHAIN_PASSES: int | None = 1
WIDTH_PROFILES = ("auto", "even")  # named beam profiles: sparkjax.tree.auto_widths, sparkjax.tree.even_widths
DEFAULT_WIDTHS = "auto"  # the beam's profile when none is given


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static shape of a speculative program (anything that changes it recompiles).

    ``method``: the method with every default resolved for this pair (a tree's ``top_c`` and
    ``widths``); ``depth`` D: drafted depths per round; ``nodes`` M: nodes verified per round (D for
    chains); ``sampling``: temperature > 0; ``layer_ids``: the target layers the drafter reads.
    """

    method: Chain | Tree | Auto
    depth: int
    nodes: int
    sampling: bool = False
    layer_ids: tuple[int, ...] = ()

    @property
    def is_chain(self) -> bool:
        return isinstance(self.method, Chain)

    @property
    def is_auto(self) -> bool:
        """The round picks its verification size on device (:class:`Auto`, :mod:`sparkjax.engine.auto`)."""
        return isinstance(self.method, Auto)

    @property
    def top_c(self) -> int:
        """Candidates per depth (trees; 0 for a chain)."""
        return 0 if self.is_chain else self.method.top_c or 0  # an auto without tree sizes has none

    @property
    def widths(self) -> tuple[int, ...] | None:
        """The beam's nodes per depth (sparklingtree-beam), else None."""
        return None if self.is_chain else self.method.widths

    @property
    def normalization(self) -> str:
        return "fast" if self.is_chain else self.method.normalization

    @property
    def candidates(self) -> str | None:
        """The trees' candidate sets (``union`` / ``corrected`` / ``base``; auto: those of the tree it builds;
        None for a chain or an auto without a tree size)."""
        if self.is_chain:
            return None
        if self.is_auto:
            return self.method.tree_plan(self).candidates if self.method.tree_sizes else None
        return self.method.candidates

    @property
    def scratch(self) -> int:
        """Cache rows a round needs past the committed tokens: it may overshoot by D and verifies M + 1 rows."""
        return self.depth + self.nodes + 2


class Method:
    """What every method answers. Subclasses are frozen dataclasses (hashable: a method is part of the
    static plan of a jitted program)."""

    speculative: ClassVar[bool] = True

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

    @property
    def needs_markov(self) -> bool:
        """Whether the method reads the drafter's Markov head."""
        return _entry(self.name).markov

    def depth(self, drafter) -> int:
        """Drafted depths per round with ``drafter`` (0 for ``ar``)."""
        return drafter.config.block_size - drafter.config.first_draft_slot

    def nodes(self, drafter) -> int:
        """Nodes the target verifies per round with ``drafter`` (0 for ``ar``)."""
        raise NotImplementedError

    def plan(self, target, drafter, sampling: bool) -> Plan | None:
        """Checks the method against the pair and returns the static :class:`Plan` (None for ``ar``)."""
        raise NotImplementedError

    def propose(self, drafter, x_start: Array, blk: drafting.DraftBlock, plan: Plan, temperature, key) -> Proposal:
        """The round's proposal (a chain or a tree of ``plan.nodes`` nodes) from the drafter's block."""
        raise NotImplementedError

    @classmethod
    def from_options(cls, name: str, *, budget: Any, top_c: Any, widths: Any, normalization: Any) -> Method:
        """The method named ``name`` (a name of this class in the table) with the keyword options of
        :func:`~sparkjax.engine.generate`; an option the method does not take is an ArgumentError."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class AR(Method):
    """The target alone, one token per step (the reference every method must equal at temperature 0)."""

    speculative: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return "ar"

    def depth(self, drafter) -> int:
        return 0

    def nodes(self, drafter) -> int:
        return 0

    def plan(self, target, drafter, sampling: bool) -> None:
        return None

    @classmethod
    def from_options(cls, name, *, budget, top_c, widths, normalization) -> AR:
        for arg, value in (("budget", budget), ("top_c", top_c), ("widths", widths)):
            if value is not None:
                raise ArgumentError(f"{arg}: does not apply to method {name!r}")
        return cls()


@dataclasses.dataclass(frozen=True)
class Chain(Method):
    """One drafted node per depth: ``dflash`` (the drafter's per-position choice) or ``dspark`` (the
    Markov-corrected chain, which needs a Markov head)."""

    kind: str = "dflash"

    def __post_init__(self):
        _entry(self.kind, Chain, "kind")

    @property
    def name(self) -> str:
        return self.kind

    def nodes(self, drafter) -> int:
        return self.depth(drafter)

    def plan(self, target, drafter, sampling: bool) -> Plan:
        check_drafter(target, drafter, self)
        d = self.depth(drafter)
        return Plan(self, d, d, bool(sampling), tuple(drafter.config.target_layer_ids))

    def propose(self, drafter, x_start, blk, plan, temperature, key) -> Proposal:
        b, d = x_start.shape[0], plan.depth
        k, temp = (key, temperature) if plan.sampling else (None, 0.0)
        if self.needs_markov:
            chain = drafting.markov_chain(drafter, blk.logits, blk.hidden, x_start, temp, k)
        elif plan.sampling:
            chain = drafting.sample_chain(drafter, blk.logits, temp, k)
        else:
            chain = drafting.argmax_chain(drafter, blk.logits)
        tokens = chain.tokens[:, :d]
        parents = jnp.broadcast_to(jnp.arange(d, dtype=jnp.int32), (b, d))
        depths = jnp.broadcast_to(jnp.arange(1, d + 1, dtype=jnp.int32), (b, d))
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((d + 1, d + 1), bool)), (b, d + 1, d + 1))
        return Proposal(tokens, parents, depths, mask, chain.logits[:, :d])

    @classmethod
    def from_options(cls, name, *, budget, top_c, widths, normalization) -> Chain:
        for arg, value in (("budget", budget), ("top_c", top_c), ("widths", widths)):
            if value is not None:
                raise ArgumentError(f"{arg}: chain method {name!r} drafts one node per depth; {arg} does not apply")
        return cls(name)


@dataclasses.dataclass(frozen=True)
class Tree(Method):
    """A draft tree of ``budget`` nodes verified at once: ``ddtree`` (best-first over independent
    marginals), ``sparklingtree`` (best-first over Markov tables) or ``sparklingtree-beam`` (``widths``
    nodes per depth: a list, ``"even"`` (:func:`sparkjax.tree.even_widths`) or ``"auto"``, the default
    (:func:`sparkjax.tree.auto_widths` from the demo pair's measured per-depth acceptance)). ``top_c``:
    candidates per depth (default ``max(budget, 32)``, at most the vocabulary); ``normalization``: the
    Markov tables' (``fast`` or ``exact``); ``candidates``: which tokens each depth's candidates are
    (``base``: the top-C of the base logits; ``corrected`` / ``union`` (the default of the Markov trees):
    following the Markov head, see :func:`sparkjax.tree.markov_candidates`; ddtree only takes ``base``)."""

    kind: str = "sparklingtree"
    budget: int = DEFAULT_BUDGET
    top_c: int | None = None
    widths: tuple[int, ...] | str | None = None
    normalization: str = "fast"
    candidates: str | None = None  # None: the method's default (DEFAULT_CANDIDATES for Markov trees, base for ddtree)

    def __post_init__(self):
        entry = _entry(self.kind, Tree, "kind")
        beam = entry.beam
        if not isinstance(self.normalization, str) or self.normalization not in NORMALIZATIONS:
            raise ArgumentError(f"normalization: expected 'exact' or 'fast', got {describe(self.normalization)}")
        cand = self.candidates
        if cand is not None and (not isinstance(cand, str) or cand not in tree.CANDIDATE_MODES):
            raise ArgumentError(f"candidates: expected one of {', '.join(tree.CANDIDATE_MODES)}, got {describe(cand)}")
        if cand not in (None, "base") and not entry.markov:
            raise ArgumentError(f"candidates: {cand!r} follows the Markov head; {self.kind!r} has none (use 'base')")
        object.__setattr__(self, "candidates", cand if cand is not None else
                           (DEFAULT_CANDIDATES if entry.markov else "base"))
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
        return f"{self.kind}@{self.budget}"

    @property
    def beam(self) -> bool:
        """Fixed nodes per depth (a beam) rather than best-first."""
        return _entry(self.kind).beam

    def nodes(self, drafter) -> int:
        return self.budget

    def plan(self, target, drafter, sampling: bool) -> Plan:
        check_drafter(target, drafter, self)
        depth = self.depth(drafter)
        budget, v = self.budget, target.config.vocab_size
        c = min(min(v, max(budget, 32)) if self.top_c is None else self.top_c, v)
        reachable = sum(c**k for k in range(1, depth + 1))
        if budget > reachable:
            raise ArgumentError(
                f"budget: {budget} nodes exceed the reachable tree size {reachable} (top_c={c}, depth={depth})"
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
        return Plan(resolved, depth, budget, bool(sampling), tuple(drafter.config.target_layer_ids))

    def propose(self, drafter, x_start, blk, plan, temperature, key) -> Proposal:
        t = self.build(drafter, x_start, blk, plan)
        mask = jax.vmap(tree.visibility, in_axes=(0, None))(t.parents, plan.depth)
        return Proposal(t.tokens, t.parents, t.depths, mask, None)

    def build(self, drafter, x_start, blk, plan) -> tree.Tree:
        """The batched :class:`sparkjax.tree.Tree` of ``plan.nodes`` nodes (with its path scores)."""
        tables, cand_tokens = self.tables(drafter, x_start, blk, plan)
        if self.beam:
            return jax.vmap(tree.beam, in_axes=(0, 0, None))(tables, cand_tokens, plan.widths)
        return jax.vmap(tree.best_first, in_axes=(0, 0, None))(tables, cand_tokens, plan.nodes)

    def tables(self, drafter, x_start, blk, plan) -> tuple[jax.Array, jax.Array]:
        """The batched log-prob tables float32[B, D, C, C] and their candidates int[B, D, C] that :meth:`build`
        selects the tree from (the input of :func:`sparkjax.tree.best_first` / :func:`sparkjax.tree.beam`)."""
        b = x_start.shape[0]
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
                    drafter, blk.logits, blk.hidden, x_start, max_passes=CANDIDATE_CHAIN_PASSES
                )[:, : logits.shape[1]]
            cand_tokens = jax.vmap(tree.markov_candidates, in_axes=(0, 0, None, None))(
                logits, corrected, plan.top_c, self.candidates
            )
            c = cand_tokens.shape[-1]
            prev = jnp.concatenate([jnp.broadcast_to(x_start[:, None, None], (b, 1, c)), cand_tokens[:, :-1]], axis=1)
            feats = drafting.markov_features(drafter, hidden, prev)
            w2 = drafting.markov_w2(drafter)
            tables = jax.vmap(tree.markov_tables, in_axes=(0, 0, 0, None, None))(
                logits, cand_tokens, feats, w2, plan.normalization
            )
        return tables, cand_tokens

    @classmethod
    def from_options(cls, name, *, budget, top_c, widths, normalization) -> Tree:
        return cls(name, DEFAULT_BUDGET if budget is None else budget, top_c, widths, normalization)


CHAIN = "chain"  # the chain entry of an :class:`Auto` candidate set
DEFAULT_SIZES: tuple[int | str, ...] = (0, CHAIN, 8, 16, 32, 64)  # Auto's default candidate verification sizes
DECIDE = ("draft", "previous")  # when Auto decides: after this round's draft, or from the previous round's
AUTO_TOP_C = 32  # Auto's default candidates per depth (the tree is built every drafted round, whatever its size)


@dataclasses.dataclass(frozen=True)
class Auto(Method):
    """Picks each round's verification size on device: ``auto`` (:mod:`sparkjax.engine.auto`).

    ``sizes``: the candidate set, out of ``0`` (a plain target step: verify ``[x_start]`` alone and commit
    one token), ``"chain"`` (the drafter's chain: ``dspark`` with a Markov head, else ``dflash``; or
    ``chain=``) and tree budgets ``b >= 1`` (one best-first tree of the largest budget per round,
    ``sparklingtree`` with a Markov head, else ``ddtree``; or ``tree=``; a smaller size verifies its
    first ``b`` nodes, which are the best ``b``). ``budget``: the largest tree allowed (default: the
    largest tree size; a size above it is an ArgumentError). ``decide``: ``"draft"`` picks after this
    round's draft (from its own tree / chain probabilities), ``"previous"`` from the previous round's
    draft and acceptance, so a size-0 round skips the draft pass (then the drafter drafts again after
    ``probe`` plain steps in a row; that gap grows 4x, up to 128, while the probe drafts still predict size 0;
    a probe re-decides from its own draft, and when it takes the plain step its chain is scored later against
    the committed tokens, so the calibration keeps learning without a verify).
    ``viable_share`` (in ``(0, 1]``, default 0.5): a drafted size is viable (ever probed or chosen) only if it
    pays when this share of its most tokens per round (depth + 1) is committed: its round must cost fewer plain
    steps than ``viable_share * (depth + 1)``. At 1 a size is dropped only when it cannot pay at all; the
    default 0.5 also drops sizes that pay only on near-perfect acceptance, whose probes cost more than they find
    (at a large batch the batch-mean acceptance is far from its best sequence's).
    ``table``: a :class:`~sparkjax.engine.auto.CostTable` for these
    sizes (default: profiled once per process and shape by :func:`~sparkjax.engine.auto.profile_costs`).
    ``top_c`` (default 32, at most the vocabulary: the largest tree is built every drafted round, so its
    tables are kept small) and ``normalization``: the tree's, as for :class:`Tree`.
    """

    sizes: tuple[int | str, ...] = DEFAULT_SIZES
    budget: int | None = None
    tree: str | None = None
    chain: str | None = None
    top_c: int | None = None
    normalization: str = "fast"
    decide: str = "previous"
    probe: int = 4
    viable_share: float = 0.5
    table: Any = None  # a sparkjax.engine.auto.CostTable, or None

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
            _entry(self.tree, Tree, "tree")
            if _entry(self.tree).beam:
                raise ArgumentError(f"tree: {self.tree!r} is a beam; auto slices best-first trees (ddtree, "
                                    "sparklingtree)")
        if self.chain is not None:
            _entry(self.chain, Chain, "chain")
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
                raise ArgumentError(f"table: expected a sparkjax.engine.auto.CostTable, got {describe(self.table)}")

    @property
    def name(self) -> str:
        return "auto"

    @property
    def widths(self) -> None:
        return None

    @property
    def tree_sizes(self) -> tuple[int, ...]:
        return tuple(v for v in self.sizes if v != CHAIN and v > 0)

    @property
    def needs_markov(self) -> bool:
        return any(k is not None and _entry(k).markov for k in (self.tree, self.chain))

    def labels(self) -> tuple[str, ...]:
        """The candidates' names, in ``sizes`` order (``ar``, the chain's kind, ``tree@b``); resolved kinds."""
        return tuple("ar" if v == 0 else (self.chain or CHAIN) if v == CHAIN else f"{self.tree or 'tree'}@{v}"
                     for v in self.sizes)

    def nodes(self, drafter) -> int:
        trees = self.tree_sizes
        return trees[-1] if trees else self.depth(drafter)

    def resolve(self, drafter) -> Auto:
        """The tree and chain kinds for ``drafter`` (Markov head: sparklingtree / dspark, else ddtree / dflash)."""
        markov = drafter is not None and drafter.config.has_markov
        tree_kind = self.tree or ("sparklingtree" if markov else "ddtree")
        chain_kind = self.chain or ("dspark" if markov else "dflash")
        return dataclasses.replace(self, tree=tree_kind, chain=chain_kind)

    def plan(self, target, drafter, sampling: bool) -> Plan:
        if drafter is None:
            raise ArgumentError("drafter: method 'auto' needs a drafter (use method='ar' without one)")
        resolved = self.resolve(drafter)
        check_drafter(target, drafter, resolved)
        depth = self.depth(drafter)
        trees = self.tree_sizes
        c = None  # no tree size: no candidates
        if trees:
            top_c = min(AUTO_TOP_C, target.config.vocab_size) if self.top_c is None else self.top_c
            sub = Tree(resolved.tree, trees[-1], top_c, None, self.normalization).plan(target, drafter, sampling)
            c = sub.top_c
        if self.table is not None and tuple(self.table.labels) != resolved.labels():
            raise ArgumentError(f"table: its candidates {list(self.table.labels)} are not this method's "
                                f"{list(resolved.labels())}")
        resolved = dataclasses.replace(resolved, top_c=c)
        return Plan(resolved, depth, resolved.nodes(drafter), bool(sampling), tuple(drafter.config.target_layer_ids))

    def tree_plan(self, plan: Plan) -> Plan:
        """The plan of the largest tree (the one built each round)."""
        return Plan(Tree(self.tree, self.tree_sizes[-1], self.top_c, None, self.normalization), plan.depth,
                    self.tree_sizes[-1], plan.sampling, plan.layer_ids)

    def chain_plan(self, plan: Plan) -> Plan:
        return Plan(Chain(self.chain), plan.depth, plan.depth, plan.sampling, plan.layer_ids)

    @classmethod
    def from_options(cls, name, *, budget, top_c, widths, normalization) -> Auto:
        if widths is not None:
            raise ArgumentError("widths: does not apply to method 'auto' (it slices best-first trees)")
        if budget is None:
            return cls(top_c=top_c, normalization=normalization)
        b = check_int("budget", budget, unit="number of tree nodes")
        sizes = tuple(v for v in DEFAULT_SIZES if v == CHAIN or v <= b)
        if b not in sizes:
            sizes = sizes + (b,)
        return cls(sizes=sizes, budget=b, top_c=top_c, normalization=normalization)


# ============================================================================= the parser: the one table of names


@dataclasses.dataclass(frozen=True)
class _Entry:
    cls: type[Method]
    markov: bool = False  # needs the drafter's Markov head
    beam: bool = False  # trees: fixed nodes per depth


_TABLE: dict[str, _Entry] = {
    "ar": _Entry(AR),
    "dflash": _Entry(Chain),
    "dspark": _Entry(Chain, markov=True),
    "ddtree": _Entry(Tree),
    "sparklingtree": _Entry(Tree, markov=True),
    "sparklingtree-beam": _Entry(Tree, markov=True, beam=True),
    "auto": _Entry(Auto),
}

METHODS: tuple[str, ...] = tuple(_TABLE)
CHAIN_METHODS: tuple[str, ...] = tuple(n for n, e in _TABLE.items() if e.cls is Chain)
TREE_METHODS: tuple[str, ...] = tuple(n for n, e in _TABLE.items() if e.cls is Tree)
MARKOV_METHODS: tuple[str, ...] = tuple(n for n, e in _TABLE.items() if e.markov)
AR_LABEL: str = AR().label  # the reference row of every result table


def available_methods() -> tuple[str, ...]:
    """The method names :func:`parse_method` (and so :func:`~sparkjax.engine.generate`) reads."""
    return METHODS


def _entry(name: Any, cls: type[Method] | None = None, arg: str = "method") -> _Entry:
    """The table entry of a method name (of class ``cls`` when given); ArgumentError naming ``arg`` otherwise."""
    entry = _TABLE.get(name) if isinstance(name, str) else None
    if entry is None or (cls is not None and entry.cls is not cls):
        names = METHODS if cls is None else tuple(n for n, e in _TABLE.items() if e.cls is cls)
        what = "unknown method" if cls is None else f"not a {cls.__name__} kind:"
        raise ArgumentError(f"{arg}: {what} {describe(name)}; expected one of {', '.join(names)}")
    return entry


def parse_method(method: str | Method, *, budget: Any = None, top_c: Any = None,
                 widths: Sequence[int] | str | None = None, normalization: Any = "fast",
                 candidates: Any = None) -> Method:
    """The method object of ``method``: a :class:`Method` (returned as is; then the keyword options must
    be left unset), a name out of :data:`METHODS` (with the keyword options, which only the methods that
    take them accept), or ``"name@budget"`` (a tree and its budget, as the eval labels them)."""
    if isinstance(method, Method):
        for arg, value in (("budget", budget), ("top_c", top_c), ("widths", widths), ("candidates", candidates)):
            if value is not None:
                raise ArgumentError(f"{arg}: given beside the method object {method!r}; set it on the object")
        return method
    name, at, text = method.partition("@") if isinstance(method, str) else (method, "", "")
    entry = _entry(name)
    if at:
        if not (text.isascii() and text.isdigit()):
            raise ArgumentError(f"method: {method!r}: expected 'name@budget' with an integer budget")
        if budget is not None:
            raise ArgumentError(f"budget: given twice, in method={method!r} and as budget={budget!r}")
        budget = int(text)
    out = entry.cls.from_options(name, budget=budget, top_c=top_c, widths=widths, normalization=normalization)
    if candidates is not None:
        if not isinstance(out, Tree):
            raise ArgumentError(f"candidates: only the tree methods take a candidates option, not {name!r}")
        out = dataclasses.replace(out, candidates=candidates)
    return out
