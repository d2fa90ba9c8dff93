"""Generation: prompt preparation, prefill and on-device decoding loops.

Every loop is a single jitted program (``jax.lax.while_loop``) over fixed-shape
state: nothing returns to the host until the generation ends. Prompt buffers
and cache sizes are bucketed to powers of two so that a new prompt length
rarely recompiles.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .errors import ArgumentError, IncompatiblePairError
from .sampling import pick

Array = jax.Array

METHODS = ("ar", "dflash", "dspark", "ddtree", "sparklingtree", "sparklingtree-beam")
TREE_METHODS = ("ddtree", "sparklingtree", "sparklingtree-beam")


def available_methods() -> tuple[str, ...]:
    """The methods :func:`generate` runs."""
    return METHODS


def bucket(n: int, minimum: int = 16) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(int(n), minimum)
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Prompts:
    """Right-padded prompt tokens ``[B, P_bucket]`` (int32) and their lengths ``[B]``."""

    tokens: np.ndarray
    lengths: np.ndarray

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]


def prepare_prompts(prompt_ids: Any, vocab_size: int, width: int | None = None) -> Prompts:
    """Validates prompts (an int array ``[B, P]``, one list of ids, or a list of lists) and pads them
    to a power of two, or to ``width`` when given (so that runs of different prompts share a program)."""
    if isinstance(prompt_ids, np.ndarray | jax.Array):
        arr = np.asarray(prompt_ids)
        if arr.ndim == 1:
            arr = arr[None]
        if arr.ndim != 2:
            raise ArgumentError(f"prompt_ids: expected shape [B, P], got {list(arr.shape)}")
        rows = list(arr)
    else:
        rows = list(prompt_ids)
        if rows and all(isinstance(x, int | np.integer) for x in rows):
            rows = [rows]
    if not rows:
        raise ArgumentError("prompt_ids: empty batch")
    seqs = []
    for b, row in enumerate(rows):
        r = np.asarray(row)
        if r.size == 0:
            raise ArgumentError(f"prompt_ids[{b}]: empty prompt")
        if r.ndim != 1 or not np.issubdtype(r.dtype, np.integer):
            raise ArgumentError(f"prompt_ids[{b}]: expected a flat sequence of integer token ids")
        if r.min() < 0 or r.max() >= vocab_size:
            raise ArgumentError(f"prompt_ids[{b}]: token id outside [0, {vocab_size}) (vocab of the target)")
        seqs.append(r.astype(np.int32))
    lengths = np.array([len(s) for s in seqs], np.int32)
    if width is not None and (not isinstance(width, int | np.integer) or width < lengths.max()):
        raise ArgumentError(f"prompt_width: {width!r} is shorter than the longest prompt ({lengths.max()} tokens)")
    tokens = np.zeros((len(seqs), bucket(lengths.max()) if width is None else int(width)), np.int32)
    for b, s in enumerate(seqs):
        tokens[b, : len(s)] = s
    return Prompts(tokens, lengths)


def eos_array(eos_token_ids: int | Sequence[int] | None, vocab_size: int) -> np.ndarray:
    """EOS ids as an int32 array (``-1`` when there is none, which never matches)."""
    if eos_token_ids is None:
        ids: list[int] = []
    elif isinstance(eos_token_ids, int | np.integer):
        ids = [int(eos_token_ids)]
    else:
        ids = [int(i) for i in eos_token_ids]
    for i in ids:
        if not 0 <= i < vocab_size:
            raise ArgumentError(f"eos_token_ids: {i} is outside [0, {vocab_size})")
    return np.array(ids or [-1], np.int32)


def check_lengths(
    prompts: Prompts, max_new_tokens: int, max_positions: int, cache_size: int | None, extra: int = 0
) -> int:
    """Validates the budget of positions and returns the (bucketed) cache size.

    ``extra`` is the scratch room a round needs past the committed tokens (a verify window).
    """
    if not isinstance(max_new_tokens, int | np.integer) or max_new_tokens < 1:
        raise ArgumentError(f"max_new_tokens: must be a positive integer, got {max_new_tokens!r}")
    longest = int(prompts.lengths.max())
    if longest + max_new_tokens > max_positions:
        raise ArgumentError(
            f"max_new_tokens: prompt length {longest} + max_new_tokens {max_new_tokens} exceeds the target's "
            f"max_position_embeddings ({max_positions})"
        )
    need = longest + max_new_tokens + extra
    if cache_size is None:
        return max(bucket(need), prompts.tokens.shape[1])
    if cache_size < prompts.tokens.shape[1] or cache_size < longest + 1:
        raise ArgumentError(f"cache_size: the prompt ({longest} tokens) is longer than the cache ({cache_size} slots)")
    if cache_size < need:
        raise ArgumentError(
            f"cache_size: {cache_size} slots cannot hold prompt {longest} + max_new_tokens {max_new_tokens}"
            + (f" + {extra} scratch rows" if extra else "")
        )
    return int(cache_size)


def check_temperature(temperature: float) -> float:
    try:
        t = float(temperature)
    except (TypeError, ValueError):
        raise ArgumentError(f"temperature: expected a number, got {temperature!r}") from None
    if not np.isfinite(t) or t < 0:
        raise ArgumentError(f"temperature: must be finite and >= 0, got {temperature!r}")
    return t


def prefill(model, tokens: Array, lengths: Array, cache_size: int, hidden_layers: tuple[int, ...] = ()):
    """Runs the prompt through the target. Returns (cache with committed lengths, last logits [B, V], hidden)."""
    b, p = tokens.shape
    cache = model.init_cache(b, cache_size)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    out = model(tokens, positions, cache=cache, hidden_layers=hidden_layers, logits_at=(lengths - 1)[:, None],
                fresh_cache=True)
    return out.cache.with_lengths(lengths), out.logits[:, 0], out.hidden


@functools.partial(jax.jit, static_argnames=("graphdef", "buf_len", "cache_size"))
def _ar_program(graphdef, state, tokens, lengths, max_new, eos, temperature, key, *, buf_len, cache_size):
    model = nnx.merge(graphdef, state)
    b = tokens.shape[0]
    cache, logits, _ = prefill(model, tokens, lengths, cache_size)
    key, sub = jax.random.split(key)
    first = pick(logits, temperature, sub)
    out = jnp.zeros((b, buf_len), jnp.int32).at[:, 0].set(first)
    n = jnp.ones((b,), jnp.int32)
    done = jnp.isin(first, eos) | (n >= max_new)

    def cond(carry):
        return ~jnp.all(carry[3])

    def body(carry):
        cache, out, n, done, key = carry
        cur = jnp.take_along_axis(out, (n - 1)[:, None], axis=1)
        step = model(cur, cache.lengths[:, None], cache=cache)
        cache = step.cache.with_lengths(cache.lengths + (~done).astype(jnp.int32))
        key, sub = jax.random.split(key)
        nxt = pick(step.logits[:, 0], temperature, sub)
        write = jnp.where(done, buf_len, n)  # out of range -> dropped
        out = out.at[jnp.arange(b), write].set(nxt, mode="drop")
        n = n + (~done).astype(jnp.int32)
        done = done | jnp.isin(nxt, eos) | (n >= max_new)
        return cache, out, n, done, key

    _, out, n, _, _ = jax.lax.while_loop(cond, body, (cache, out, n, done, key))
    return out, n


# ============================================================================= speculative decoding

CHAIN_METHODS = ("dflash", "dspark")
MARKOV_METHODS = ("dspark", "sparklingtree", "sparklingtree-beam")


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static shape of a speculative program (anything that changes it recompiles).

    ``depth`` D: drafted depths per round; ``nodes`` M: nodes verified per round (D for chains);
    ``top_c``: candidates per depth for trees; ``widths``: the beam profile (sparklingtree-beam);
    ``sampling``: temperature > 0; ``layer_ids``: the target layers the drafter reads.
    """

    method: str
    depth: int
    nodes: int
    top_c: int = 0
    widths: tuple[int, ...] | None = None
    normalization: str = "fast"
    sampling: bool = False
    layer_ids: tuple[int, ...] = ()

    @property
    def is_chain(self) -> bool:
        return self.method in CHAIN_METHODS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecState:
    """Everything a round reads and writes; fixed shapes, so it lives in a ``while_loop`` carry.

    The target has processed every committed token but the last one, ``x_start``, which sits at
    index ``start = cache.lengths`` (and the drafter context holds positions ``< start``).
    ``out`` holds the generated tokens (``n`` of them), ``accept_lens[b, r]`` the tokens round r
    committed (accepted drafts + 1), ``depth_hits[b, d]`` how many rounds accepted depth d + 1.
    """

    cache: Any
    ctx: Any
    x_start: Array
    out: Array
    n: Array
    done: Array
    key: Array
    accept_lens: Array
    rounds: Array
    depth_hits: Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Proposal:
    """A round's draft tree: nodes ``[B, M]`` (a chain is a tree with one node per depth)."""

    tokens: Array
    parents: Array
    depths: Array
    mask: Array  # [B, M + 1, M + 1] ancestor visibility, root first
    draft_logits: Array | None  # chains only: the logits the drafts were drawn from [B, D, V]


def _depth_inputs(drafter, blk):
    """Per-depth base logits [B, D, V] and the block hidden states of the same slots [B, D, Dm]."""
    from .draft import aligned_logits

    logits = aligned_logits(drafter, blk.logits).astype(jnp.float32)
    first = drafter.config.first_draft_slot
    return logits, blk.hidden[:, first:]


def stage_draft(target, drafter, state: SpecState):
    from .draft import draft_block

    return draft_block(drafter, state.ctx, state.x_start, state.cache.lengths, target)


def stage_expand(drafter, state: SpecState, blk, plan: Plan, temperature, key) -> Proposal:
    """Turns the drafter's block into a tree of ``plan.nodes`` nodes, on device, per method."""
    from . import draft, tree

    b = state.x_start.shape[0]
    d = plan.depth
    if plan.is_chain:
        k, temp = (key, temperature) if plan.sampling else (None, 0.0)
        if plan.method == "dspark":
            chain = draft.markov_chain(drafter, blk.logits, blk.hidden, state.x_start, temp, k)
        elif plan.sampling:
            chain = draft.sample_chain(drafter, blk.logits, temp, k)
        else:
            chain = draft.argmax_chain(drafter, blk.logits)
        tokens = chain.tokens[:, :d]
        parents = jnp.broadcast_to(jnp.arange(d, dtype=jnp.int32), (b, d))
        depths = jnp.broadcast_to(jnp.arange(1, d + 1, dtype=jnp.int32), (b, d))
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((d + 1, d + 1), bool)), (b, d + 1, d + 1))
        return Proposal(tokens, parents, depths, mask, chain.logits[:, :d])
    logits, hidden = _depth_inputs(drafter, blk)
    cand_tokens, cand_logp = jax.vmap(tree.candidates, in_axes=(0, None))(logits, plan.top_c)
    if plan.method == "ddtree":
        tables = jax.vmap(tree.ddtree_tables)(cand_logp)
    else:
        c = cand_tokens.shape[-1]
        prev = jnp.concatenate(
            [jnp.broadcast_to(state.x_start[:, None, None], (b, 1, c)), cand_tokens[:, :-1]], axis=1
        )
        feats = draft.markov_features(drafter, hidden, prev)
        w2 = draft.markov_w2(drafter)
        tables = jax.vmap(tree.markov_tables, in_axes=(0, 0, 0, None, None))(
            logits, cand_tokens, feats, w2, plan.normalization
        )
    if plan.method == "sparklingtree-beam":
        t = jax.vmap(tree.beam, in_axes=(0, 0, None))(tables, cand_tokens, plan.widths)
    else:
        t = jax.vmap(tree.best_first, in_axes=(0, 0, None))(tables, cand_tokens, plan.nodes)
    mask = jax.vmap(tree.visibility, in_axes=(0, None))(t.parents, d)
    return Proposal(t.tokens, t.parents, t.depths, mask, None)


def stage_verify(target, state: SpecState, prop: Proposal, plan: Plan):
    """The target over ``[x_start] + nodes`` at ``start + depth`` with the tree mask."""
    start = state.cache.lengths
    tokens = jnp.concatenate([state.x_start[:, None], jnp.maximum(prop.tokens, 0)], axis=1)
    zero = jnp.zeros_like(prop.depths[:, :1])
    positions = start[:, None] + jnp.concatenate([zero, prop.depths], axis=1)
    out = target(tokens, positions, cache=state.cache, mask=prop.mask, hidden_layers=plan.layer_ids)
    feats = jnp.concatenate(out.hidden, axis=-1)
    return out.logits.astype(jnp.float32), feats, out.cache, tokens


def stage_commit(drafter, state: SpecState, prop: Proposal, verified, plan: Plan, max_new, eos, temperature, key):
    """Accepts a path, writes its tokens, compacts the target cache and extends the drafter context."""
    from . import draft, sampling, tree

    logits, feats, cache, vtokens = verified
    b = vtokens.shape[0]
    d = plan.depth
    start = state.cache.lengths
    if plan.sampling and plan.is_chain:
        n_acc, nxt = sampling.speculative_chain(logits, prop.draft_logits, prop.tokens, temperature, key)
        j = jnp.arange(d + 1, dtype=jnp.int32)
        indices = jnp.where(j[None] <= n_acc[:, None], j[None], -1)
        length, bonus = n_acc + 1, nxt
    else:
        post = sampling.posterior(logits, temperature, key if plan.sampling else None)
        acc = jax.vmap(tree.accept, in_axes=(0, 0, 0, None))(prop.parents, prop.tokens, post, d)
        indices, length, bonus = acc.indices, acc.length, acc.bonus
    idx = jnp.maximum(indices, 0)
    path = jnp.take_along_axis(vtokens, idx, axis=1)  # [B, D+1]: root, accepted drafts, padding
    j = jnp.arange(d + 1, dtype=jnp.int32)[None]
    emitted = jnp.where(j < length[:, None] - 1, jnp.roll(path, -1, axis=1), bonus[:, None])
    live = j < length[:, None]
    hit_eos = jnp.isin(emitted, eos) & live
    first_eos = jnp.where(jnp.any(hit_eos, axis=1), jnp.argmax(hit_eos, axis=1), d + 1)
    active = ~state.done
    keep = jnp.minimum(jnp.minimum(length, first_eos + 1), max_new - state.n)
    keep = jnp.where(active, keep, 0)
    cols = jnp.where(j < keep[:, None], state.n[:, None] + j, state.out.shape[1])
    out = state.out.at[jnp.arange(b)[:, None], cols].set(emitted, mode="drop")
    n = state.n + keep
    done = state.done | (active & ((first_eos < length) | (n >= max_new)))
    count = jnp.where(active, length, 0)
    cache = cache.compact(start, idx, count)
    acc_feats = jnp.take_along_axis(feats, idx[..., None], axis=1)
    ctx = draft.append_context(drafter, state.ctx, acc_feats, count)
    r = jnp.where(active, state.rounds, state.accept_lens.shape[1])
    accept_lens = state.accept_lens.at[jnp.arange(b), r].set(length, mode="drop")
    hits = (jnp.arange(d)[None] < (length - 1)[:, None]) & active[:, None]
    return SpecState(
        cache=cache, ctx=ctx, x_start=jnp.where(active, bonus, state.x_start), out=out, n=n, done=done,
        key=state.key, accept_lens=accept_lens, rounds=state.rounds + active.astype(jnp.int32),
        depth_hits=state.depth_hits + hits.astype(jnp.int32),
    )


def spec_round(target, drafter, state: SpecState, plan: Plan, max_new, eos, temperature) -> SpecState:
    """One round: draft, expand, verify, accept and commit. A pure function of the state."""
    key, k_expand, k_accept = jax.random.split(state.key, 3)
    state = dataclasses.replace(state, key=key)
    blk = stage_draft(target, drafter, state)
    prop = stage_expand(drafter, state, blk, plan, temperature, k_expand)
    verified = stage_verify(target, state, prop, plan)
    return stage_commit(drafter, state, prop, verified, plan, max_new, eos, temperature, k_accept)


def spec_prefill(target, drafter, tokens, lengths, max_new, eos, temperature, key, plan: Plan,
                 cache_size: int, buf_len: int) -> SpecState:
    """Prefill the target, take the first token, and fill the drafter context with the prompt's features."""
    from .draft import append_context

    b = tokens.shape[0]
    cache, logits, hidden = prefill(target, tokens, lengths, cache_size, plan.layer_ids)
    key, sub = jax.random.split(key)
    first = pick(logits, temperature, sub if plan.sampling else None)
    ctx = append_context(drafter, drafter.init_context(b, cache_size), jnp.concatenate(hidden, -1), lengths)
    out = jnp.zeros((b, buf_len), jnp.int32).at[:, 0].set(first)
    n = jnp.ones((b,), jnp.int32)
    done = jnp.isin(first, eos) | (n >= max_new)
    return SpecState(
        cache=cache, ctx=ctx, x_start=first, out=out, n=n, done=done, key=key,
        accept_lens=jnp.zeros((b, buf_len), jnp.int32), rounds=jnp.zeros((b,), jnp.int32),
        depth_hits=jnp.zeros((b, plan.depth), jnp.int32),
    )


_STATIC = ("graphdefs", "plan", "cache_size", "buf_len")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _spec_program(graphdefs, states, tokens, lengths, max_new, eos, temperature, key, *, plan, cache_size, buf_len):
    target, drafter = nnx.merge(graphdefs[0], states[0]), nnx.merge(graphdefs[1], states[1])
    state = spec_prefill(target, drafter, tokens, lengths, max_new, eos, temperature, key, plan, cache_size, buf_len)
    state = jax.lax.while_loop(
        lambda s: ~jnp.all(s.done),
        lambda s: spec_round(target, drafter, s, plan, max_new, eos, temperature),
        state,
    )
    return state.out, state.n, state.accept_lens, state.rounds, state.depth_hits


@functools.partial(jax.jit, static_argnames=_STATIC)
def _spec_start(graphdefs, states, tokens, lengths, max_new, eos, temperature, key, *, plan, cache_size, buf_len):
    target, drafter = nnx.merge(graphdefs[0], states[0]), nnx.merge(graphdefs[1], states[1])
    return spec_prefill(target, drafter, tokens, lengths, max_new, eos, temperature, key, plan, cache_size, buf_len)


@functools.partial(jax.jit, static_argnames=("graphdefs", "plan"), donate_argnames=("state",))
def _spec_step(graphdefs, states, state, max_new, eos, temperature, *, plan):
    target, drafter = nnx.merge(graphdefs[0], states[0]), nnx.merge(graphdefs[1], states[1])
    return spec_round(target, drafter, state, plan, max_new, eos, temperature)


# ============================================================================= public API


@dataclasses.dataclass
class GenerateOutput:
    """What :func:`generate` returns.

    ``tokens``: generated ids per sequence (prompt excluded, cut after EOS).
    ``acceptance_lengths``: per sequence, the tokens each round committed (accepted drafts + 1,
    the bonus / correction token included); tau = their mean. For ``ar`` every entry is 1.
    ``accepted_per_depth``: per sequence, how many rounds accepted a draft at depth d + 1.
    ``stage_seconds``: per-stage wall time summed over rounds (instrumented mode only).
    """

    tokens: list[list[int]]
    acceptance_lengths: list[list[int]]
    accepted_per_depth: list[list[int]] = dataclasses.field(default_factory=list)
    stage_seconds: dict[str, float] | None = None

    @property
    def rounds(self) -> list[int]:
        return [len(a) for a in self.acceptance_lengths]


def _check_drafter(target, drafter, method: str):
    if drafter is None:
        raise ArgumentError(f"drafter: method {method!r} needs a drafter (use method='ar' without one)")
    dc, tc = drafter.config, target.config
    if dc.vocab_size != tc.vocab_size or dc.hidden_size != tc.hidden_size:
        raise IncompatiblePairError(
            f"drafter: vocab/hidden {dc.vocab_size}/{dc.hidden_size} do not match the target's "
            f"{tc.vocab_size}/{tc.hidden_size}"
        )
    if method in MARKOV_METHODS and not dc.has_markov:
        raise ArgumentError(
            f"method: {method!r} needs a drafter with a Markov head; this {dc.kind} drafter has none "
            "(use 'dflash' or 'ddtree')"
        )


def make_plan(target, drafter, method: str, budget: int | None, top_c: int | None,
              widths: Sequence[int] | None, normalization: str, sampling: bool) -> Plan:
    """Validates the method's arguments against the pair and returns the static :class:`Plan`."""
    from . import tree

    _check_drafter(target, drafter, method)
    dc = drafter.config
    depth = dc.block_size - dc.first_draft_slot
    layer_ids = tuple(dc.target_layer_ids)
    if method in CHAIN_METHODS:
        for name, value in (("budget", budget), ("top_c", top_c), ("widths", widths)):
            if value is not None:
                raise ArgumentError(f"{name}: chain method {method!r} drafts one node per depth; {name} does not apply")
        return Plan(method, depth, depth, sampling=sampling, layer_ids=layer_ids)
    if normalization not in ("exact", "fast"):
        raise ArgumentError(f"normalization: expected 'exact' or 'fast', got {normalization!r}")
    budget = 64 if budget is None else budget
    if not isinstance(budget, int | np.integer) or isinstance(budget, bool) or budget < 1:
        raise ArgumentError(f"budget: must be a positive integer, got {budget!r}")
    v = target.config.vocab_size
    top_c = min(v, max(int(budget), 32)) if top_c is None else top_c
    if not isinstance(top_c, int | np.integer) or top_c < 1:
        raise ArgumentError(f"top_c: must be a positive integer, got {top_c!r}")
    c = min(int(top_c), v)
    reachable = sum(c**k for k in range(1, depth + 1))
    if budget > reachable:
        raise ArgumentError(
            f"budget: {budget} nodes exceed the reachable tree size {reachable} (top_c={c}, depth={depth})"
        )
    w = None
    if method == "sparklingtree-beam":
        w = tree.even_widths(int(budget), depth) if widths is None else tuple(int(x) for x in widths)
        if len(w) != depth or sum(w) != budget:
            raise ArgumentError(f"widths: need {depth} per-depth widths summing to budget={budget}, got {w}")
        if any(x > c ** (i + 1) for i, x in enumerate(w)):
            raise ArgumentError(f"widths: {w} asks for more nodes at some depth than top_c={c} allows")
    elif widths is not None:
        raise ArgumentError(f"widths: only 'sparklingtree-beam' takes a width profile, not {method!r}")
    return Plan(method, depth, int(budget), c, w, normalization, sampling, layer_ids)


def _prepare(target, drafter, prompt_ids, method, max_new_tokens, eos_token_ids, temperature, cache_size,
             budget, top_c, widths, normalization, prompt_width=None):
    if method not in METHODS:
        raise ArgumentError(f"method: unknown method {method!r}; expected one of {', '.join(METHODS)}")
    if prompt_ids is None:
        raise ArgumentError("prompt_ids: required")
    cfg = target.config
    prompts = prepare_prompts(prompt_ids, cfg.vocab_size, prompt_width)
    eos = eos_array(eos_token_ids, cfg.vocab_size)
    temperature = check_temperature(temperature)
    plan = None
    extra = 0
    if method == "ar":
        for name, value in (("budget", budget), ("top_c", top_c), ("widths", widths)):
            if value is not None:
                raise ArgumentError(f"{name}: does not apply to method 'ar'")
    else:
        plan = make_plan(target, drafter, method, budget, top_c, widths, normalization, temperature > 0)
        extra = plan.depth + plan.nodes + 2  # a round may overshoot by D and verifies M + 1 rows
    size = check_lengths(prompts, max_new_tokens, cfg.max_position_embeddings, cache_size, extra)
    return prompts, eos, temperature, plan, size


def _outputs(out, n, accept_lens=None, rounds=None, depth_hits=None, stage_seconds=None) -> GenerateOutput:
    out, n = np.asarray(out), np.asarray(n)
    tokens = [out[b, : n[b]].tolist() for b in range(out.shape[0])]
    if accept_lens is None:
        return GenerateOutput(tokens, [[1] * len(t) for t in tokens], [[] for _ in tokens])
    accept_lens, rounds, depth_hits = np.asarray(accept_lens), np.asarray(rounds), np.asarray(depth_hits)
    lens = [accept_lens[b, : rounds[b]].tolist() for b in range(out.shape[0])]
    return GenerateOutput(tokens, lens, depth_hits.tolist(), stage_seconds)


def generate(
    target,
    drafter=None,
    prompt_ids: Any = None,
    *,
    method: str = "ar",
    budget: int | None = None,
    top_c: int | None = None,
    widths: Sequence[int] | None = None,
    normalization: str = "fast",
    max_new_tokens: int = 128,
    eos_token_ids: int | Sequence[int] | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    cache_size: int | None = None,
    prompt_width: int | None = None,
    capacity: int | None = None,
    instrument: bool = False,
) -> GenerateOutput:
    """Generates continuations of ``prompt_ids`` (``[B, P]`` ints or a list of lists).

    ``method``: ``ar`` (target alone), ``dflash`` (argmax chain), ``dspark`` (Markov chain),
    ``ddtree`` (best-first over independent marginals), ``sparklingtree`` (best-first over Markov
    tables), ``sparklingtree-beam`` (fixed nodes per depth). ``budget`` is the tree size M (trees
    only, default 64), ``top_c`` the candidates per depth (default ``max(budget, 32)``), ``widths``
    the beam profile (default even), ``normalization`` the Markov tables' (``fast`` or ``exact``).
    Greedy at ``temperature == 0`` (exactly the target's greedy tokens for every method), else
    lossless sampling seeded by ``seed``. The whole generation is one jitted program with no host
    sync; ``instrument=True`` instead runs each stage as its own jitted call and times it.

    Shapes (what decides recompilation): prompts are padded to a power of two, or to
    ``prompt_width``; the cache has ``cache_size`` slots (default: a power of two that fits); the
    output buffer holds ``capacity`` tokens (default ``max_new_tokens``, which is otherwise a traced
    value: runs that differ only in ``max_new_tokens <= capacity`` share one compiled program).
    """
    shape = dict(cache_size=cache_size, prompt_width=prompt_width, capacity=capacity)
    if instrument:
        prompts, eos, temperature, plan, size = _prepare(
            target, drafter, prompt_ids, method, max_new_tokens, eos_token_ids, temperature, cache_size,
            budget, top_c, widths, normalization, prompt_width,
        )
        if plan is None:
            raise ArgumentError("instrument: the instrumented mode times speculative rounds; method 'ar' has none")
        args = _device_args(prompts, max_new_tokens, eos, temperature, seed)
        return _instrumented(target, drafter, args, plan, size, _buf_len(max_new_tokens, capacity, plan))
    res = launch(target, drafter, prompt_ids, method=method, budget=budget, top_c=top_c, widths=widths,
                 normalization=normalization, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids,
                 temperature=temperature, seed=seed, **shape)
    return _outputs(*res)


def _device_args(prompts: Prompts, max_new_tokens: int, eos: np.ndarray, temperature: float, seed: int):
    return (jnp.asarray(prompts.tokens), jnp.asarray(prompts.lengths), jnp.int32(max_new_tokens),
            jnp.asarray(eos), jnp.float32(temperature), jax.random.key(seed))


def _buf_len(max_new_tokens: int, capacity: int | None, plan: Plan | None) -> int:
    """Output-buffer length: room for ``capacity`` tokens plus a round's overshoot, as a power of two."""
    if capacity is not None and (not isinstance(capacity, int | np.integer) or capacity < max_new_tokens):
        raise ArgumentError(f"capacity: {capacity!r} is smaller than max_new_tokens ({max_new_tokens})")
    n = max_new_tokens if capacity is None else int(capacity)
    return bucket(n + (plan.depth + 1 if plan is not None else 0), 1)


def launch(target, drafter=None, prompt_ids: Any = None, *, method: str = "ar", budget=None, top_c=None,
           widths=None, normalization="fast", max_new_tokens: int = 128, eos_token_ids=None,
           temperature: float = 0.0, seed: int = 0, cache_size: int | None = None, prompt_width: int | None = None,
           capacity: int | None = None) -> tuple[Array, ...]:
    """Validates the arguments like :func:`generate` and dispatches the jitted program without waiting.

    Returns device arrays: ``(out [B, buf], n [B])`` for ``ar``, plus ``(accept_lens [B, R],
    rounds [B], depth_hits [B, D])`` for speculative methods. Nothing is copied to the host.
    ``max_new_tokens=1`` stops after the prefill and its first token (no round), in the same
    compiled program as a longer run of the same shapes: that is how to time prefill alone.
    """
    prompts, eos, temperature, plan, size = _prepare(
        target, drafter, prompt_ids, method, max_new_tokens, eos_token_ids, temperature, cache_size,
        budget, top_c, widths, normalization, prompt_width,
    )
    args = _device_args(prompts, max_new_tokens, eos, temperature, seed)
    buf_len = _buf_len(max_new_tokens, capacity, plan)
    if plan is None:
        gdef, state = nnx.split(target)
        return _ar_program(gdef, state, *args, buf_len=buf_len, cache_size=size)
    graphdefs, states = _split_pair(target, drafter)
    return _spec_program(graphdefs, states, *args, plan=plan, cache_size=size, buf_len=buf_len)


def _split_pair(target, drafter):
    (g_t, s_t), (g_d, s_d) = nnx.split(target), nnx.split(drafter)
    return (g_t, g_d), (s_t, s_d)


def stream(
    target,
    drafter=None,
    prompt_ids: Any = None,
    *,
    method: str = "sparklingtree",
    budget: int | None = None,
    top_c: int | None = None,
    widths: Sequence[int] | None = None,
    normalization: str = "fast",
    max_new_tokens: int = 128,
    eos_token_ids: int | Sequence[int] | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    cache_size: int | None = None,
):
    """Like :func:`generate`, but yields each round's new tokens: a list per sequence (possibly empty).

    Runs the same jitted round as :func:`generate`, one call per round, so it syncs with the host
    once per round by design (for notebooks). The concatenated yields equal ``generate(...).tokens``.
    """
    if method == "ar":
        raise ArgumentError("method: stream() runs speculative rounds; use generate(method='ar') for the target alone")
    prompts, eos, temperature, plan, size = _prepare(
        target, drafter, prompt_ids, method, max_new_tokens, eos_token_ids, temperature, cache_size,
        budget, top_c, widths, normalization,
    )
    buf_len = _buf_len(max_new_tokens, None, plan)
    graphdefs, states = _split_pair(target, drafter)
    args = _device_args(prompts, max_new_tokens, eos, temperature, seed)
    state = _spec_start(graphdefs, states, *args, plan=plan, cache_size=size, buf_len=buf_len)
    seen = np.zeros(prompts.batch, np.int64)
    while True:
        n, out, done = (np.asarray(x) for x in (state.n, state.out, state.done))
        yield [out[b, seen[b] : n[b]].tolist() for b in range(prompts.batch)]
        seen = n
        if done.all():
            return
        state = _spec_step(graphdefs, states, state, args[2], args[3], args[4], plan=plan)


def _instrumented(target, drafter, args, plan: Plan, size: int, buf_len: int) -> GenerateOutput:
    """Runs rounds stage by stage, blocking after each, and sums the wall time of each stage."""
    import time

    graphdefs, states = _split_pair(target, drafter)
    max_new, eos, temperature = args[2], args[3], args[4]
    state = _spec_start(graphdefs, states, *args, plan=plan, cache_size=size, buf_len=buf_len)
    stages = _stage_fns(plan)
    times = dict.fromkeys(("draft", "tree", "verify", "commit"), 0.0)
    while not bool(np.asarray(state.done).all()):
        key, k_expand, k_accept = jax.random.split(state.key, 3)
        state = dataclasses.replace(state, key=key)
        t0 = time.perf_counter()
        blk = jax.block_until_ready(stages["draft"](graphdefs, states, state))
        t1 = time.perf_counter()
        prop = jax.block_until_ready(stages["tree"](graphdefs, states, state, blk, temperature, k_expand))
        t2 = time.perf_counter()
        ver = jax.block_until_ready(stages["verify"](graphdefs, states, state, prop))
        t3 = time.perf_counter()
        state = jax.block_until_ready(
            stages["commit"](graphdefs, states, state, prop, ver, max_new, eos, temperature, k_accept)
        )
        t4 = time.perf_counter()
        for name, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            times[name] += dt
    return _outputs(state.out, state.n, state.accept_lens, state.rounds, state.depth_hits, times)


@functools.lru_cache(maxsize=32)
def _stage_fns(plan: Plan):
    def merged(graphdefs, states):
        return nnx.merge(graphdefs[0], states[0]), nnx.merge(graphdefs[1], states[1])

    def draft_fn(graphdefs, states, state):
        t, d = merged(graphdefs, states)
        return stage_draft(t, d, state)

    def tree_fn(graphdefs, states, state, blk, temperature, key):
        _, d = merged(graphdefs, states)
        return stage_expand(d, state, blk, plan, temperature, key)

    def verify_fn(graphdefs, states, state, prop):
        t, _ = merged(graphdefs, states)
        return stage_verify(t, state, prop, plan)

    def commit_fn(graphdefs, states, state, prop, ver, max_new, eos, temperature, key):
        _, d = merged(graphdefs, states)
        return stage_commit(d, state, prop, ver, plan, max_new, eos, temperature, key)

    static = ("graphdefs",)
    return {
        "draft": jax.jit(draft_fn, static_argnames=static),
        "tree": jax.jit(tree_fn, static_argnames=static),
        "verify": jax.jit(verify_fn, static_argnames=static),
        "commit": jax.jit(commit_fn, static_argnames=static),
    }
