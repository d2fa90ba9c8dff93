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

from .errors import ArgumentError, IncompatiblePairError, SparkjaxError
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


# ============================================================================= argument checks

MAX_SEED = 2**63  # seeds are Python / numpy ints in [0, MAX_SEED)
MIN_TEMPERATURE = 1e-6  # a positive temperature below this overflows logits / T in float32
MAX_TEMPERATURE = 1e4  # above this every distribution is uniform to float32 precision
MAX_SLOTS = 2**30  # cache slots, prompt width and output capacity are int32 positions on device


def _is_int(x: Any) -> bool:
    """An int or numpy integer, not a bool (True is not a count)."""
    return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)


def _describe(x: Any) -> str:
    """``type value`` for a short plain value, the type alone for anything else (a model, an array)."""
    if not isinstance(x, int | float | complex | str | bytes | list | tuple | np.generic | type(None)):
        shape = getattr(x, "shape", None)
        return type(x).__name__ + (f" of shape {list(shape)}" if shape is not None else "")
    try:
        r = repr(x)
    except Exception:  # noqa: BLE001 - an object whose repr fails
        return type(x).__name__
    if len(r) > 60:
        r = r[:57] + "..."
    return f"{type(x).__name__} {r}"


def check_int(name: str, value: Any, *, minimum: int = 1, maximum: int | None = None, unit: str = "") -> int:
    """``value`` as an int; ArgumentError naming ``name`` for another type (a bool, a float, a string)
    or a value outside ``[minimum, maximum]``."""
    if not _is_int(value):
        what = f"an integer{' ' + unit if unit else ''}"
        raise ArgumentError(f"{name}: expected {what}, got {_describe(value)} (a type problem, not a size)")
    v = int(value)
    if v < minimum:
        raise ArgumentError(f"{name}: must be >= {minimum}, got {v}")
    if maximum is not None and v > maximum:
        raise ArgumentError(f"{name}: must be <= {maximum}, got {v}")
    return v


def check_seed(seed: Any) -> int:
    """A seed is an int (Python or numpy, not a bool) in ``[0, 2**63)``."""
    if not _is_int(seed):
        raise ArgumentError(f"seed: expected an integer in [0, 2**63), got {_describe(seed)}")
    s = int(seed)
    if not 0 <= s < MAX_SEED:
        raise ArgumentError(f"seed: {s} is outside [0, 2**63)")
    return s


def _key(seed: int) -> Array:
    """The PRNG key of a checked seed. Seeds below 2**32 give ``jax.random.key(seed)``; larger ones fold
    in their high 32 bits (``jax.random.key`` alone would wrap them onto small seeds without 64-bit mode)."""
    lo, hi = seed & 0xFFFFFFFF, seed >> 32
    key = jax.random.key(lo)
    return key if hi == 0 else jax.random.fold_in(key, hi)


def check_models(target: Any, drafter: Any) -> None:
    """``target`` must be a Qwen3 model and ``drafter`` a Drafter (or None)."""
    from .nn.drafter import Drafter
    from .nn.qwen3 import Qwen3

    if not isinstance(target, Qwen3):
        hint = " (the drafter was passed as the target?)" if isinstance(target, Drafter) else ""
        raise ArgumentError(
            f"target: expected a sparkjax.nn.qwen3.Qwen3 model (sparkjax.load_target), got {_describe(target)}{hint}"
        )
    if drafter is not None and not isinstance(drafter, Drafter):
        hint = " (the target was passed as the drafter?)" if isinstance(drafter, Qwen3) else ""
        raise ArgumentError(
            f"drafter: expected a sparkjax.nn.drafter.Drafter (sparkjax.load_drafter) or None, "
            f"got {_describe(drafter)}{hint}"
        )


def prepare_prompts(prompt_ids: Any, vocab_size: int, width: int | None = None) -> Prompts:
    """Validates prompts (an int array ``[B, P]``, one list of ids, or a list of lists) and pads them
    to a power of two, or to ``width`` when given (so that runs of different prompts share a program)."""
    if width is not None:
        width = check_int("prompt_width", width, maximum=MAX_SLOTS, unit="number of prompt slots (or None)")
    if isinstance(prompt_ids, np.ndarray | jax.Array):
        arr = np.asarray(prompt_ids)
        if arr.ndim == 1:
            arr = arr[None]
        if arr.ndim != 2:
            raise ArgumentError(f"prompt_ids: expected shape [B, P], got {list(arr.shape)}")
        rows = list(arr)
    elif isinstance(prompt_ids, str | bytes) or _is_int(prompt_ids) or not hasattr(prompt_ids, "__iter__"):
        raise ArgumentError(
            f"prompt_ids: expected token ids (an int array [B, P], a list of ids or a list of lists), "
            f"got {_describe(prompt_ids)}"
        )
    else:
        rows = list(prompt_ids)
        if rows and all(_is_int(x) for x in rows):
            rows = [rows]
    if not rows:
        raise ArgumentError("prompt_ids: empty batch")
    seqs = []
    for b, row in enumerate(rows):
        if isinstance(row, str | bytes):
            raise ArgumentError(f"prompt_ids[{b}]: expected a flat sequence of integer token ids, got {_describe(row)}")
        try:
            r = np.asarray(row)
        except (TypeError, ValueError, OverflowError):
            raise ArgumentError(f"prompt_ids[{b}]: expected a flat sequence of integer token ids") from None
        if r.size == 0:
            raise ArgumentError(f"prompt_ids[{b}]: empty prompt")
        if r.ndim != 1 or not np.issubdtype(r.dtype, np.integer):
            raise ArgumentError(
                f"prompt_ids[{b}]: expected a flat sequence of integer token ids, got shape {list(r.shape)} "
                f"of {r.dtype}"
            )
        if r.min() < 0 or r.max() >= vocab_size:
            raise ArgumentError(f"prompt_ids[{b}]: token id outside [0, {vocab_size}) (vocab of the target)")
        seqs.append(r.astype(np.int32))
    lengths = np.array([len(s) for s in seqs], np.int32)
    if width is not None and width < lengths.max():
        raise ArgumentError(f"prompt_width: {width} is shorter than the longest prompt ({lengths.max()} tokens)")
    tokens = np.zeros((len(seqs), bucket(lengths.max()) if width is None else width), np.int32)
    for b, s in enumerate(seqs):
        tokens[b, : len(s)] = s
    return Prompts(tokens, lengths)


def eos_array(eos_token_ids: int | Sequence[int] | None, vocab_size: int) -> np.ndarray:
    """EOS ids as an int32 array (``-1`` when there is none, which never matches).

    ``eos_token_ids`` is None, one int, or a flat sequence / integer array of ints (not a string,
    and no None, float or bool entries)."""
    name = "eos_token_ids"
    if eos_token_ids is None:
        ids: list[int] = []
    elif _is_int(eos_token_ids):
        ids = [int(eos_token_ids)]
    elif isinstance(eos_token_ids, str | bytes):
        raise ArgumentError(
            f"{name}: expected an int or a sequence of ints, got a string {eos_token_ids!r} "
            f"(a string is not a list of ids; pass [105], not '105')"
        )
    elif isinstance(eos_token_ids, np.ndarray | jax.Array):
        arr = np.asarray(eos_token_ids)
        if arr.ndim > 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ArgumentError(f"{name}: expected a flat integer array, got shape {list(arr.shape)} of {arr.dtype}")
        ids = [int(i) for i in arr.reshape(-1)]
    else:
        if not hasattr(eos_token_ids, "__iter__"):
            raise ArgumentError(f"{name}: expected an int or a sequence of ints, got {_describe(eos_token_ids)}")
        ids = []
        for j, x in enumerate(eos_token_ids):
            if not _is_int(x):
                raise ArgumentError(f"{name}[{j}]: expected an integer token id, got {_describe(x)}")
            ids.append(int(x))
    for i in ids:
        if not 0 <= i < vocab_size:
            raise ArgumentError(f"{name}: {i} is outside [0, {vocab_size})")
    return np.array(ids or [-1], np.int32)


def check_lengths(
    prompts: Prompts, max_new_tokens: int, max_positions: int, cache_size: int | None, extra: int = 0
) -> int:
    """Validates the budget of positions and returns the (bucketed) cache size.

    ``extra`` is the scratch room a round needs past the committed tokens (a verify window).
    """
    max_new_tokens = check_int("max_new_tokens", max_new_tokens)
    if cache_size is not None:
        cache_size = check_int("cache_size", cache_size, unit="number of cache slots (or None)")
    longest = int(prompts.lengths.max())
    width = prompts.tokens.shape[1]
    if longest + max_new_tokens > max_positions:
        raise ArgumentError(
            f"max_new_tokens: prompt length {longest} + max_new_tokens {max_new_tokens} exceeds the target's "
            f"max_position_embeddings ({max_positions})"
        )
    need = longest + max_new_tokens + extra
    if cache_size is None:
        size = max(bucket(need), width)
        if size > MAX_SLOTS:
            raise ArgumentError(
                f"max_new_tokens: a cache of {size} slots is needed, more than {MAX_SLOTS} (int32 positions)"
            )
        return size
    if cache_size > MAX_SLOTS:
        raise ArgumentError(f"cache_size: {cache_size} slots exceed {MAX_SLOTS} (positions are int32 on device)")
    if cache_size < longest + 1:
        raise ArgumentError(f"cache_size: the prompt ({longest} tokens) is longer than the cache ({cache_size} slots)")
    if cache_size < width:
        raise ArgumentError(
            f"cache_size: {cache_size} slots cannot hold the prompt buffer, which is padded to {width} slots "
            f"(the longest prompt has {longest} tokens); pass prompt_width (at least {longest}) to pad less, "
            f"or a cache_size of at least {width}"
        )
    if cache_size < need:
        raise ArgumentError(
            f"cache_size: {cache_size} slots cannot hold prompt {longest} + max_new_tokens {max_new_tokens}"
            + (f" + {extra} scratch rows" if extra else "")
        )
    return cache_size


def check_temperature(temperature: float) -> float:
    """0 (greedy) or a real number in ``[MIN_TEMPERATURE, MAX_TEMPERATURE]`` (finite in float32)."""
    if isinstance(temperature, bool | np.bool_) or not isinstance(temperature, int | float | np.integer | np.floating):
        raise ArgumentError(f"temperature: expected a real number, got {_describe(temperature)}")
    try:
        t = float(temperature)
    except OverflowError:
        raise ArgumentError(f"temperature: {temperature!r} is not finite in float32") from None
    if not np.isfinite(t) or t < 0:
        raise ArgumentError(f"temperature: must be finite and >= 0, got {temperature!r}")
    if t != 0 and not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
        raise ArgumentError(
            f"temperature: {t!r} is outside [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}] (or 0 for greedy): "
            "logits / temperature would overflow or underflow in float32"
        )
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
    bad = flag_nonfinite(jnp.full((b,), -1, jnp.int32), logits, jnp.ones((b,), bool), jnp.zeros((b,), jnp.int32))

    def cond(carry):
        return ~jnp.all(carry[3])

    def body(carry):
        cache, out, n, done, key, bad = carry
        cur = jnp.take_along_axis(out, (n - 1)[:, None], axis=1)
        step = model(cur, cache.lengths[:, None], cache=cache)
        cache = step.cache.with_lengths(cache.lengths + (~done).astype(jnp.int32))
        key, sub = jax.random.split(key)
        nxt = pick(step.logits[:, 0], temperature, sub)
        bad = flag_nonfinite(bad, step.logits, ~done, n)  # step n makes token n + 1
        write = jnp.where(done, buf_len, n)  # out of range -> dropped
        out = out.at[jnp.arange(b), write].set(nxt, mode="drop")
        n = n + (~done).astype(jnp.int32)
        done = done | jnp.isin(nxt, eos) | (n >= max_new)
        return cache, out, n, done, key, bad

    _, out, n, _, _, bad = jax.lax.while_loop(cond, body, (cache, out, n, done, key, bad))
    return out, n, bad


def flag_nonfinite(flags: Array, logits: Array, active: Array, round_index: Array) -> Array:
    """Records, per sequence, the first round whose target logits hold a NaN or an Inf.

    ``flags`` ``[B]`` int32 is -1 while every logit so far was finite; ``logits`` is ``[B, ..., V]``;
    only ``active`` sequences are checked. One reduction, no host sync.
    """
    finite = jnp.isfinite(logits).reshape(logits.shape[0], -1).all(axis=1)
    return jnp.where((flags < 0) & active & ~finite, round_index, flags)


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
    committed (accepted drafts + 1), ``depth_hits[b, d]`` how many rounds accepted depth d + 1,
    ``nonfinite[b]`` the first round whose target logits were not finite (-1 while all were).
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
    nonfinite: Array  # [B] int32: first round with non-finite target logits (0 = prefill), -1 if none


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
        nonfinite=flag_nonfinite(state.nonfinite, logits, active, state.rounds + 1),
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
        nonfinite=flag_nonfinite(jnp.full((b,), -1, jnp.int32), logits, jnp.ones((b,), bool),
                                 jnp.zeros((b,), jnp.int32)),
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
    return state.out, state.n, state.accept_lens, state.rounds, state.depth_hits, state.nonfinite


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
    """The drafter fits the target (the same pair check as ``load_drafter(target=)``) and the method."""
    from .config import validate_pair
    from .convert import source_of

    if drafter is None:
        raise ArgumentError(f"drafter: method {method!r} needs a drafter (use method='ar' without one)")
    dc, tc = drafter.config, target.config
    d_src, t_src = source_of(drafter), source_of(target)
    d_src = f"{d_src}/config.json" if d_src else "<drafter model>"
    t_src = f"{t_src}/config.json" if t_src else "<target model>"
    if dc.vocab_size != tc.vocab_size or dc.hidden_size != tc.hidden_size:
        raise IncompatiblePairError(
            f"drafter {d_src} does not fit target {t_src}: vocab/hidden {dc.vocab_size}/{dc.hidden_size} do not "
            f"match the target's {tc.vocab_size}/{tc.hidden_size}"
        )
    validate_pair(dc, tc, drafter_source=d_src, target_source=t_src)
    if method in MARKOV_METHODS and not dc.has_markov:
        raise ArgumentError(
            f"method: {method!r} needs a drafter with a Markov head; this {dc.kind} drafter has none "
            "(use 'dflash' or 'ddtree')"
        )


def _check_widths(widths: Any) -> tuple[int, ...]:
    if isinstance(widths, np.ndarray | jax.Array):
        arr = np.asarray(widths)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ArgumentError(f"widths: expected a flat sequence of ints, got shape {list(arr.shape)} of {arr.dtype}")
        items = arr.tolist()
    elif isinstance(widths, list | tuple):
        items = list(widths)
    else:
        raise ArgumentError(f"widths: expected a list or tuple of ints (one per depth), got {_describe(widths)}")
    out = []
    for i, x in enumerate(items):
        if not _is_int(x):
            raise ArgumentError(f"widths[{i}]: expected an integer, got {_describe(x)}")
        if x < 0:
            raise ArgumentError(f"widths[{i}]: must be >= 0, got {int(x)}")
        out.append(int(x))
    return tuple(out)


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
    if not isinstance(normalization, str) or normalization not in ("exact", "fast"):
        raise ArgumentError(f"normalization: expected 'exact' or 'fast', got {_describe(normalization)}")
    budget = 64 if budget is None else check_int("budget", budget, unit="number of tree nodes")
    v = target.config.vocab_size
    top_c = min(v, max(budget, 32)) if top_c is None else check_int("top_c", top_c)
    c = min(top_c, v)
    reachable = sum(c**k for k in range(1, depth + 1))
    if budget > reachable:
        raise ArgumentError(
            f"budget: {budget} nodes exceed the reachable tree size {reachable} (top_c={c}, depth={depth})"
        )
    if budget > MAX_SLOTS:
        raise ArgumentError(f"budget: {budget} nodes exceed {MAX_SLOTS} (node indices are int32 on device)")
    w = None
    if method == "sparklingtree-beam":
        w = tree.even_widths(budget, depth) if widths is None else _check_widths(widths)
        if len(w) != depth or sum(w) != budget:
            raise ArgumentError(f"widths: need {depth} per-depth widths summing to budget={budget}, got {w}")
        if any(x > c ** (i + 1) for i, x in enumerate(w)):
            raise ArgumentError(f"widths: {w} asks for more nodes at some depth than top_c={c} allows")
        first_zero = w.index(0) if 0 in w else depth
        if any(w[first_zero:]):
            raise ArgumentError(f"widths: zeros may only come at the end (deepest depths), got {w}")
    elif widths is not None:
        raise ArgumentError(f"widths: only 'sparklingtree-beam' takes a width profile, not {method!r}")
    return Plan(method, depth, budget, c, w, normalization, sampling, layer_ids)


# ----------------------------------------------------------------------------- memory estimate


def _itemsize(model) -> int:
    try:
        return int(np.dtype(model.dtype).itemsize)
    except (AttributeError, TypeError):
        return 4


def estimate_memory(target, drafter, plan: Plan | None, batch: int, prompt_width: int, cache_size: int,
                    buf_len: int) -> dict[str, int]:
    """A rough count of the bytes a generation holds on device, by what they grow with.

    ``cache``: the target's KV cache ``[layers, 2, B, S, K, H]`` and the drafter's context;
    ``verify``: a round's tree arrays (candidates, tables, the ``[B, M + 1, M + 1]`` ancestor mask),
    the visibility mask ``[B, M + 1, S]``, one layer's attention scores and probabilities
    ``[B, heads, M + 1, S]`` float32, the MLP activations and the logits ``[B, M + 1, V]`` float32;
    ``prefill``: the same for the ``P`` prompt rows; ``output``: the output buffers ``[B, capacity]``.
    The model weights are not counted (they are already resident).
    """
    tc = target.config
    b, s, p = batch, cache_size, prompt_width
    it = _itemsize(target)
    ffn = max(tc.intermediate_size, tc.hidden_size)

    def forward(t: int, hidden_feats: int) -> int:
        mask = b * t * s
        scores = 2 * b * tc.num_attention_heads * t * s * 4
        acts = b * t * (3 * ffn + 4 * tc.hidden_size) * 4
        return mask + scores + acts + b * t * hidden_feats * 4

    cache = tc.num_hidden_layers * 2 * b * s * tc.num_key_value_heads * tc.head_dim * it
    out = {"cache": cache, "output": 2 * b * buf_len * 4, "prefill": forward(p, 0) + b * tc.vocab_size * 4,
           "verify": 0}
    if plan is None:
        out["verify"] = forward(1, 0) + b * tc.vocab_size * 4
        return out
    dc = drafter.config
    out["cache"] += dc.num_hidden_layers * 2 * b * s * dc.num_key_value_heads * dc.head_dim * _itemsize(drafter)
    feats = len(plan.layer_ids) * tc.hidden_size
    out["prefill"] += b * p * feats * 4
    t = plan.nodes + 1
    d, c, v = plan.depth, max(plan.top_c, 1), tc.vocab_size
    tree_arrays = b * d * v * 4 * 2 + b * d * c * c * 4 * 2 + b * t * t + b * t * 16
    out["verify"] = tree_arrays + forward(t, feats) + b * t * v * 4 * 2
    return out


def available_memory() -> tuple[int, str]:
    """Bytes the default device can still allocate, and how that was found."""
    import os

    dev = jax.devices()[0]
    stats = None
    try:
        stats = dev.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory stats
        stats = None
    if stats and stats.get("bytes_limit"):
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        return free, f"this {dev.platform} device has {_gib(free)} free of {_gib(int(stats['bytes_limit']))}"
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0, "unknown"
    return int(total), f"this {dev.platform} host has {_gib(int(total))} of memory"


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n < 2**40 else f"{n / 2**30:,.0f} GiB"


def check_memory(target, drafter, plan: Plan | None, prompts: Prompts, size: int, buf_len: int, *,
                 cache_size: Any, capacity: Any, prompt_width: Any) -> None:
    """Refuses a run whose estimated memory (:func:`estimate_memory`) exceeds what the device has,
    naming the argument that makes it large and the figures."""
    b, p = prompts.tokens.shape
    est = estimate_memory(target, drafter, plan, b, p, size, buf_len)
    total = sum(est.values())
    limit, where = available_memory()
    if limit <= 0 or total <= limit:
        return
    part = max(est, key=est.get)
    if part == "verify" and plan is not None:
        head = f"budget: a {plan.nodes}-node verify of {b} sequence(s) over a {size}-slot cache"
    elif part == "verify":
        head = f"prompt_ids: a decode step of {b} sequences over a {size}-slot cache"
    elif part == "cache":
        arg = "cache_size" if cache_size is not None else "max_new_tokens"
        head = f"{arg}: a KV cache of {b} sequence(s) x {size} slots"
    elif part == "output":
        arg = "capacity" if capacity is not None else "max_new_tokens"
        head = f"{arg}: an output buffer of {b} sequence(s) x {buf_len} tokens"
    else:
        arg = "prompt_width" if prompt_width is not None else "prompt_ids"
        head = f"{arg}: a prefill of {b} sequence(s) x {p} prompt slots"
    detail = ", ".join(f"{k} {_gib(v)}" for k, v in est.items())
    raise ArgumentError(
        f"{head} needs about {_gib(total)} of memory ({detail}); {where}. "
        "Lower budget, max_new_tokens, cache_size or the batch"
    )


def _prepare(target, drafter, prompt_ids, method, max_new_tokens, eos_token_ids, temperature, cache_size,
             budget, top_c, widths, normalization, prompt_width=None):
    """Validates a generation's arguments; returns (prompts, eos, temperature, plan, cache size)."""
    return _validate(target, drafter, prompt_ids, method, max_new_tokens, eos_token_ids, temperature, cache_size,
                     budget, top_c, widths, normalization, prompt_width)[:5]


def _validate(target, drafter, prompt_ids, method, max_new_tokens, eos_token_ids, temperature, cache_size,
              budget, top_c, widths, normalization, prompt_width=None, capacity=None, seed=0):
    """Validates every argument of a generation; returns (prompts, eos, temperature, plan, size, buf_len, seed)."""
    check_models(target, drafter)
    if not isinstance(method, str) or method not in METHODS:
        raise ArgumentError(f"method: unknown method {_describe(method)}; expected one of {', '.join(METHODS)}")
    if prompt_ids is None:
        raise ArgumentError("prompt_ids: required")
    seed = check_seed(seed)
    max_new_tokens = check_int("max_new_tokens", max_new_tokens)
    if capacity is not None:
        capacity = check_int("capacity", capacity, maximum=MAX_SLOTS, unit="number of output tokens (or None)")
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
    buf_len = _buf_len(max_new_tokens, capacity, plan)
    check_memory(target, drafter, plan, prompts, size, buf_len, cache_size=cache_size, capacity=capacity,
                 prompt_width=prompt_width)
    return prompts, eos, temperature, plan, size, buf_len, seed


class NumericalError(SparkjaxError, FloatingPointError):
    """The target produced non-finite logits (NaN or Inf) during a generation: its output is garbage."""


def raise_if_nonfinite(nonfinite: Any) -> None:
    """Raises :class:`NumericalError` if any entry of a run's ``nonfinite`` flags (``[B]`` int32: the first
    round whose target logits were not finite, 0 for the prefill; -1 when all were finite) is set."""
    flags = np.asarray(nonfinite).reshape(-1)
    bad = np.flatnonzero(flags >= 0)
    if bad.size == 0:
        return
    b = int(bad[np.argmin(flags[bad])])
    r = int(flags[b])
    where = "the prefill (round 0)" if r == 0 else f"round {r}"
    raise NumericalError(
        f"generate: the target's logits are not finite (NaN or Inf) in {where} of sequence {b} "
        f"({bad.size} of {flags.size} sequence(s) affected); the generated tokens are garbage. "
        "Check the target's weights for NaN/Inf or use a wider dtype (float32)"
    )


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

    Argument rules: counts (``max_new_tokens``, ``budget``, ``top_c``, ``cache_size``,
    ``prompt_width``, ``capacity``, ``widths`` entries) are ints, never bools or floats; ``seed`` is an
    int in ``[0, 2**63)``; ``temperature`` is 0 or in ``[1e-6, 1e4]``; ``eos_token_ids`` is an int or
    a flat sequence of ints (not a string). A run whose estimated memory (:func:`estimate_memory`)
    exceeds the device's (or, on CPU, the host's) is refused before anything is compiled. Any
    violation raises :class:`~sparkjax.errors.ArgumentError` (a mismatched pair
    :class:`~sparkjax.errors.IncompatiblePairError`). If the target's logits turn non-finite (NaN
    or Inf weights, an overflow), :class:`NumericalError` names the first such round and sequence.
    """
    if not isinstance(instrument, bool | np.bool_):
        raise ArgumentError(f"instrument: expected True or False, got {_describe(instrument)}")
    if instrument:
        prompts, eos, temperature, plan, size, buf_len, seed = _validate(
            target, drafter, prompt_ids, method, max_new_tokens, eos_token_ids, temperature, cache_size,
            budget, top_c, widths, normalization, prompt_width, capacity, seed,
        )
        if plan is None:
            raise ArgumentError("instrument: the instrumented mode times speculative rounds; method 'ar' has none")
        args = _device_args(prompts, max_new_tokens, eos, temperature, seed)
        return _instrumented(target, drafter, args, plan, size, buf_len)
    *res, nonfinite = launch(
        target, drafter, prompt_ids, method=method, budget=budget, top_c=top_c, widths=widths,
        normalization=normalization, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids,
        temperature=temperature, seed=seed, cache_size=cache_size, prompt_width=prompt_width, capacity=capacity,
        report_nonfinite=True,
    )
    raise_if_nonfinite(nonfinite)
    return _outputs(*res)


def _device_args(prompts: Prompts, max_new_tokens: int, eos: np.ndarray, temperature: float, seed: int):
    return (jnp.asarray(prompts.tokens), jnp.asarray(prompts.lengths), jnp.int32(max_new_tokens),
            jnp.asarray(eos), jnp.float32(temperature), _key(seed))


def _buf_len(max_new_tokens: int, capacity: int | None, plan: Plan | None) -> int:
    """Output-buffer length: room for ``capacity`` tokens plus a round's overshoot, as a power of two."""
    if capacity is not None and capacity < max_new_tokens:
        raise ArgumentError(f"capacity: {capacity!r} is smaller than max_new_tokens ({max_new_tokens})")
    n = max_new_tokens if capacity is None else int(capacity)
    size = bucket(n + (plan.depth + 1 if plan is not None else 0), 1)
    if size > MAX_SLOTS:
        raise ArgumentError(f"capacity: an output buffer of {size} tokens exceeds {MAX_SLOTS} (int32 positions)")
    return size


def launch(target, drafter=None, prompt_ids: Any = None, *, method: str = "ar", budget=None, top_c=None,
           widths=None, normalization="fast", max_new_tokens: int = 128, eos_token_ids=None,
           temperature: float = 0.0, seed: int = 0, cache_size: int | None = None, prompt_width: int | None = None,
           capacity: int | None = None, report_nonfinite: bool = False) -> tuple[Array, ...]:
    """Validates the arguments like :func:`generate` and dispatches the jitted program without waiting.

    Returns device arrays: ``(out [B, buf], n [B])`` for ``ar``, plus ``(accept_lens [B, R],
    rounds [B], depth_hits [B, D])`` for speculative methods. Nothing is copied to the host.
    ``max_new_tokens=1`` stops after the prefill and its first token (no round), in the same
    compiled program as a longer run of the same shapes: that is how to time prefill alone.

    ``launch`` never syncs, so it cannot raise on non-finite logits itself: with
    ``report_nonfinite=True`` it appends the ``nonfinite [B]`` int32 flags (the first round whose
    target logits held a NaN or an Inf, 0 for the prefill; -1 when all were finite), which
    :func:`raise_if_nonfinite` checks once the caller syncs.
    """
    if not isinstance(report_nonfinite, bool | np.bool_):
        raise ArgumentError(f"report_nonfinite: expected True or False, got {_describe(report_nonfinite)}")
    prompts, eos, temperature, plan, size, buf_len, seed = _validate(
        target, drafter, prompt_ids, method, max_new_tokens, eos_token_ids, temperature, cache_size,
        budget, top_c, widths, normalization, prompt_width, capacity, seed,
    )
    args = _device_args(prompts, max_new_tokens, eos, temperature, seed)
    if plan is None:
        gdef, state = nnx.split(target)
        res = _ar_program(gdef, state, *args, buf_len=buf_len, cache_size=size)
    else:
        graphdefs, states = _split_pair(target, drafter)
        res = _spec_program(graphdefs, states, *args, plan=plan, cache_size=size, buf_len=buf_len)
    return tuple(res) if report_nonfinite else tuple(res[:-1])


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
    The arguments are validated when ``stream`` is called, before it returns the generator; a round
    whose target logits are not finite raises :class:`NumericalError` instead of yielding.
    """
    check_models(target, drafter)
    if isinstance(method, str) and method == "ar":
        raise ArgumentError("method: stream() runs speculative rounds; use generate(method='ar') for the target alone")
    prompts, eos, temperature, plan, size, buf_len, seed = _validate(
        target, drafter, prompt_ids, method, max_new_tokens, eos_token_ids, temperature, cache_size,
        budget, top_c, widths, normalization, seed=seed,
    )
    return _stream_rounds(target, drafter, prompts, eos, temperature, plan, size, buf_len, seed, max_new_tokens)


def _stream_rounds(target, drafter, prompts, eos, temperature, plan, size, buf_len, seed, max_new_tokens):
    graphdefs, states = _split_pair(target, drafter)
    args = _device_args(prompts, max_new_tokens, eos, temperature, seed)
    state = _spec_start(graphdefs, states, *args, plan=plan, cache_size=size, buf_len=buf_len)
    seen = np.zeros(prompts.batch, np.int64)
    while True:
        n, out, done, bad = (np.asarray(x) for x in (state.n, state.out, state.done, state.nonfinite))
        raise_if_nonfinite(bad)
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
    raise_if_nonfinite(state.nonfinite)
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
