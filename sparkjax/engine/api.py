"""The public entry points: argument validation, :func:`generate`, :func:`launch` and :func:`stream`.

Every argument is checked before anything is compiled (an :class:`~sparkjax.errors.ArgumentError` naming
it); prompt buffers and cache sizes are bucketed to powers of two (:func:`required_cache_size`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .. import cachedir, sampling
from ..errors import ArgumentError, NumericalError
from .adaptive import Auto
from .checks import (
    MAX_SLOTS,
    bucket,
    check_int,
    check_models,
    check_prompt,
    check_seed,
    check_temperature,
    check_top_k,
    check_top_p,
    describe,
    is_int,
)
from .costs import CostTable, cost_key, profile, read_table
from .logprobs import check_logprobs
from .methods import Method
from .names import parse_method
from .options import Options, check_options
from .placement import check_mesh, place_args, place_state, put, to_host
from .programs import launch_run, spec_start, spec_step, split_pair, stage_call
from .round import STAGES
from .state import DeviceArgs, Launch, Plan

if TYPE_CHECKING:
    from .adaptive import AutoMemory

Array = jax.Array


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
    if width is not None:
        width = check_int("prompt_width", width, maximum=MAX_SLOTS, unit="number of prompt slots (or None)")
    if isinstance(prompt_ids, np.ndarray | jax.Array):
        arr = np.asarray(prompt_ids)
        if arr.ndim == 1:
            arr = arr[None]
        if arr.ndim != 2:
            raise ArgumentError(f"prompt_ids: expected shape [B, P], got {list(arr.shape)}")
        rows = list(arr)
    elif isinstance(prompt_ids, str | bytes) or is_int(prompt_ids) or not hasattr(prompt_ids, "__iter__"):
        raise ArgumentError(f"prompt_ids: expected token ids (an int array [B, P], a list of ids or a list of lists), "
                            f"got {describe(prompt_ids)}")
    else:
        rows = list(prompt_ids)
        if rows and all(is_int(x) for x in rows):
            rows = [rows]
    if not rows:
        raise ArgumentError("prompt_ids: empty batch")
    seqs = [np.asarray(check_prompt(row, vocab_size, name=f"prompt_ids[{b}]"), np.int32) for b, row in enumerate(rows)]
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
    elif is_int(eos_token_ids):
        ids = [int(eos_token_ids)]
    elif isinstance(eos_token_ids, str | bytes):
        raise ArgumentError(f"{name}: expected an int or a sequence of ints, got a string {eos_token_ids!r} "
                            f"(a string is not a list of ids; pass [105], not '105')")
    elif isinstance(eos_token_ids, np.ndarray | jax.Array):
        arr = np.asarray(eos_token_ids)
        if arr.ndim > 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ArgumentError(f"{name}: expected a flat integer array, got shape {list(arr.shape)} of {arr.dtype}")
        ids = [int(i) for i in arr.reshape(-1)]
    else:
        if not hasattr(eos_token_ids, "__iter__"):
            raise ArgumentError(f"{name}: expected an int or a sequence of ints, got {describe(eos_token_ids)}")
        ids = []
        for j, x in enumerate(eos_token_ids):
            if not is_int(x):
                raise ArgumentError(f"{name}[{j}]: expected an integer token id, got {describe(x)}")
            ids.append(int(x))
    for i in ids:
        if not 0 <= i < vocab_size:
            raise ArgumentError(f"{name}: {i} is outside [0, {vocab_size})")
    return np.array(ids or [-1], np.int32)


def required_cache_size(prompt_length: int, max_new_tokens: int, plans: Iterable[Plan] = (), *,
                        prompt_width: int = 0) -> int:
    """The cache slots a run gets by default (``cache_size=None``): the longest prompt + ``max_new_tokens``
    + the largest ``Plan.scratch`` among ``plans`` (0 for ``ar``), rounded up to a power of two, and at
    least ``prompt_width``."""
    extra = max((p.scratch for p in plans), default=0)
    return max(bucket(prompt_length + max_new_tokens + extra), prompt_width)


def check_lengths(prompts: Prompts, max_new_tokens: int, max_positions: int, cache_size: int | None,
                  plan: Plan) -> int:
    """Validates the budget of positions and returns the cache size (:func:`required_cache_size` by default;
    ``plan``'s scratch rows are the room a round needs past the committed tokens)."""
    max_new_tokens = check_int("max_new_tokens", max_new_tokens)
    if cache_size is not None:
        cache_size = check_int("cache_size", cache_size, unit="number of cache slots (or None)")
    longest = int(prompts.lengths.max())
    width = prompts.tokens.shape[1]
    if longest + max_new_tokens > max_positions:
        raise ArgumentError(f"max_new_tokens: prompt length {longest} + max_new_tokens {max_new_tokens} exceeds "
                            f"the target's max_position_embeddings ({max_positions})")
    extra = plan.scratch
    need = longest + max_new_tokens + extra
    if cache_size is None:
        size = required_cache_size(longest, max_new_tokens, [plan], prompt_width=width)
        if size > MAX_SLOTS:
            raise ArgumentError(f"max_new_tokens: a cache of {size} slots is needed, more than {MAX_SLOTS} "
                                "(int32 positions)")
        return size
    if cache_size > MAX_SLOTS:
        raise ArgumentError(f"cache_size: {cache_size} slots exceed {MAX_SLOTS} (positions are int32 on device)")
    if cache_size < longest + 1:
        raise ArgumentError(f"cache_size: the prompt ({longest} tokens) is longer than the cache ({cache_size} slots)")
    if cache_size < width:
        raise ArgumentError(f"cache_size: {cache_size} slots cannot hold the prompt buffer, which is padded to "
                            f"{width} slots (the longest prompt has {longest} tokens); pass prompt_width (at least "
                            f"{longest}) to pad less, or a cache_size of at least {width}")
    if cache_size < need:
        raise ArgumentError(f"cache_size: {cache_size} slots cannot hold prompt {longest} + max_new_tokens "
                            f"{max_new_tokens}" + (f" + {extra} scratch rows" if extra else ""))
    return cache_size


@dataclasses.dataclass
class GenerateOutput:
    """What :func:`generate` returns (the fields are tabled in docs/api.md): per sequence the ``tokens`` (prompt
    excluded, cut after EOS), the tokens each round committed (``1 + sum == len(tokens)``: a round cut by EOS or
    max_new counts what it kept), the rounds that accepted each depth; ``stage_seconds`` when instrumented;
    ``size_choices`` (each round's candidate label, parallel to ``acceptance_lengths``) and ``auto_memory``
    (:class:`~sparkjax.engine.adaptive.AutoMemory`, host arrays) for method ``auto`` only, else None; with
    ``logprobs=N``, ``token_logprobs`` (per sequence, the log-probability of each token in ``tokens``) and
    ``top_logprobs`` (per sequence and token, the N likeliest ``(token id, log-probability)``, most likely first;
    empty lists for N = 0), else None.
    """

    tokens: list[list[int]]
    acceptance_lengths: list[list[int]]
    accepted_per_depth: list[list[int]] = dataclasses.field(default_factory=list)
    stage_seconds: dict[str, float] | None = None
    size_choices: list[list[str]] | None = None
    auto_memory: AutoMemory | None = None
    token_logprobs: list[list[float]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None

    @property
    def rounds(self) -> list[int]:
        return [len(a) for a in self.acceptance_lengths]

    @property
    def size_counts(self) -> dict[str, int] | None:
        """Method ``auto``: how many rounds (summed over the sequences) verified each candidate size."""
        if self.size_choices is None:
            return None
        return dict(Counter(label for row in self.size_choices for label in row))


def raise_if_nonfinite(nonfinite: Any) -> None:
    """Raises :class:`NumericalError` if any of a run's ``nonfinite`` flags (``Launch.nonfinite``) is set."""
    flags = np.asarray(nonfinite).reshape(-1)
    bad = np.flatnonzero(flags >= 0)
    if bad.size == 0:
        return
    b = int(bad[np.argmin(flags[bad])])
    r = int(flags[b])
    where = "the prefill (round 0)" if r == 0 else f"round {r}"
    raise NumericalError(f"generate: the target's logits are not finite (NaN or Inf) in {where} of sequence {b} "
                         f"({bad.size} of {flags.size} sequence(s) affected); the generated tokens are garbage. "
                         "Check the target's weights for NaN/Inf or use a wider dtype (float32)")


def host_logprobs(lp, n) -> tuple[list[list[float]], list[list[list[tuple[int, float]]]]]:
    """``(token_logprobs, top_logprobs)`` of a :class:`~sparkjax.engine.logprobs.Logprobs` (device or host
    arrays), the first ``n[b]`` positions of each sequence."""
    chosen, ids, values = (to_host(x) for x in (lp.chosen, lp.ids, lp.values))
    token = [chosen[b, : n[b]].tolist() for b in range(chosen.shape[0])]
    top = [[list(zip(ids[b, i].tolist(), values[b, i].tolist(), strict=True)) for i in range(n[b])]
           for b in range(chosen.shape[0])]
    return token, top


def _outputs(res: Launch, stage_seconds: dict[str, float] | None = None) -> GenerateOutput:
    """The host-side :class:`GenerateOutput` of a finished :class:`~sparkjax.engine.state.Launch`."""
    out, n = to_host(res.out), to_host(res.n)
    tokens = [out[b, : n[b]].tolist() for b in range(out.shape[0])]
    token_lp = top_lp = None
    if res.logprobs is not None:
        token_lp, top_lp = host_logprobs(res.logprobs, n)
    if res.accept_lens.shape[1] == 0:  # ar: the prefill's token, then one per round, so len(t) - 1 rounds of 1
        return GenerateOutput(tokens, [[1] * (len(t) - 1) for t in tokens], [[] for _ in tokens],
                              token_logprobs=token_lp, top_logprobs=top_lp)
    accept_lens, rounds, depth_hits = to_host(res.accept_lens), to_host(res.rounds), to_host(res.depth_hits)
    lens = [accept_lens[b, : rounds[b]].tolist() for b in range(out.shape[0])]
    choices, memory = getattr(res.extra, "choices", None), getattr(res.extra, "memory", None)
    sizes = None
    if choices is not None:
        choices = to_host(choices)
        sizes = [[res.labels[int(i)] for i in choices[b, : rounds[b]]] for b in range(out.shape[0])]
    if memory is not None:
        memory = jax.tree.map(to_host, memory)
    return GenerateOutput(tokens, lens, depth_hits.tolist(), stage_seconds, sizes, memory, token_lp, top_lp)


def _itemsize(model) -> int:
    try:
        return int(np.dtype(model.dtype).itemsize)
    except (AttributeError, TypeError):
        return 4


def estimate_memory(target, drafter, plan: Plan, batch: int, prompt_width: int, cache_size: int,
                    buf_len: int) -> dict[str, int]:
    """A rough count of the bytes a generation holds on device (weights excluded), by what they grow with:
    ``cache`` (the KV caches), ``verify`` (a round's tree arrays, masks, one layer's attention scores, the MLP
    activations and logits), ``prefill`` (the same for the prompt rows) and ``output`` (the output buffers)."""
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
    if not plan.drafts:  # a one-token step: no drafter cache, no tree
        out["verify"] = forward(1, 0) + b * tc.vocab_size * 4
        return out
    dc = drafter.config
    out["cache"] += dc.num_hidden_layers * 2 * b * s * dc.num_key_value_heads * dc.head_dim * _itemsize(drafter)
    feats = len(plan.layer_ids) * tc.hidden_size
    out["prefill"] += b * p * feats * 4
    t = plan.nodes + 1
    d, c, v = plan.depth, max(plan.top_c, 1), tc.vocab_size
    rows = plan.nodes * min(d * c + 1, v) if plan.candidates == "seed" else c * c  # a depth's table rows x width
    tree_arrays = b * d * v * 4 * 2 + b * d * rows * 4 * 2 + b * t * t + b * t * 16
    out["verify"] = tree_arrays + forward(t, feats) + b * t * v * 4 * 2
    return out


def available_memory() -> tuple[int, str]:
    """Bytes the default device can still allocate, and how that was found."""
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


def check_memory(target, drafter, plan: Plan, prompts: Prompts, size: int, buf_len: int, *,
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
    if part == "verify" and plan.drafts:
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
    raise ArgumentError(f"{head} needs about {_gib(total)} of memory ({detail}); {where}. "
                        "Lower budget, max_new_tokens, cache_size or the batch")


def _buf_len(max_new_tokens: int, capacity: int | None, plan: Plan) -> int:
    """Output-buffer length: room for ``capacity`` tokens plus a drafted round's overshoot, as a power of two."""
    if capacity is not None and capacity < max_new_tokens:
        raise ArgumentError(f"capacity: {capacity!r} is smaller than max_new_tokens ({max_new_tokens})")
    n = max_new_tokens if capacity is None else int(capacity)
    size = bucket(n + (plan.depth + 1 if plan.drafts else 0), 1)
    if size > MAX_SLOTS:
        raise ArgumentError(f"capacity: an output buffer of {size} tokens exceeds {MAX_SLOTS} (int32 positions)")
    return size


@jax.jit
def _seed_key(lo: Array, hi: Array) -> Array:
    key = jax.random.key(lo)
    folded = jax.random.key_data(jax.random.fold_in(key, hi))
    return jax.random.wrap_key_data(jnp.where(hi == 0, jax.random.key_data(key), folded))


def _key(seed: int) -> Array:
    """The PRNG key of a checked seed. Seeds below 2**32 give ``jax.random.key(seed)``; larger ones fold
    in their high 32 bits (``jax.random.key`` alone would wrap them onto small seeds without 64-bit mode).
    One compiled program for every seed (its halves are uint32 inputs), so a server warmed with one seed
    compiles nothing when a request brings another."""
    return _seed_key(np.uint32(seed & 0xFFFFFFFF), np.uint32(seed >> 32))


@dataclasses.dataclass(frozen=True)
class Run:
    """A validated generation (:func:`validate`); ``mesh`` None on one device,
    ``inputs`` the method's traced inputs (the second value of :meth:`~sparkjax.engine.methods.Method.bind`)."""

    method: Method
    prompts: Prompts
    eos: np.ndarray
    temperature: float
    plan: Plan
    cache_size: int
    buf_len: int
    seed: int
    max_new_tokens: int
    mesh: Any = None
    options: Options = Options()
    inputs: Any = None
    top_p: float = 1.0
    top_k: int = 0
    logprobs: int | None = None

    def device_inputs(self) -> Any:
        """:attr:`inputs` on device (replicated over the mesh when there is one)."""
        if self.inputs is None:
            return None
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, self.inputs)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return jax.tree.map(lambda x: x if isinstance(x, jax.Array) and not x.is_fully_addressable  # placed already
                            else put(x, replicated), self.inputs)

    def device_args(self) -> DeviceArgs:
        """The run's traced inputs, on device (placed on the mesh when there is one)."""
        args = DeviceArgs(jnp.asarray(self.prompts.tokens), jnp.asarray(self.prompts.lengths),
                          jnp.int32(self.max_new_tokens), jnp.asarray(self.eos),
                          sampling.Sampling.of(self.temperature, self.top_p, self.top_k), _key(self.seed))
        return place_args(args, self.mesh)

    def split(self, target, drafter=None):
        """``(graphdefs, states)`` of the pair (:func:`split_pair`; the drafter only when the plan drafts), placed
        on the mesh (the modules are not modified)."""
        graphdefs, states = split_pair(target, drafter if self.plan.drafts else None)
        return graphdefs, tuple(None if st is None else place_state(st, self.mesh) for st in states)


def default_method(drafter) -> str:
    """The method :func:`generate`, :func:`stream` and :class:`sparkjax.serve.Engine` run when given none:
    ``auto`` with a drafter (it drafts where drafting pays and takes plain steps where it does not, so it is the
    one method that is never far behind ``ar``: docs/auto.md), ``ar`` without one."""
    return "ar" if drafter is None else "auto"


def validate(target, drafter, prompt_ids, *, method: str | Method | None = None, max_new_tokens=128,
             eos_token_ids=None, temperature=0.0, top_p=1.0, top_k=0, seed=0, cache_size=None, prompt_width=None,
             capacity=None, mesh=None, auto_memory=None, options=None, logprobs=None) -> Run:
    """Validates every argument of :func:`generate` and returns the :class:`Run` (the first call turns on the
    persistent compilation cache)."""
    check_models(target, drafter)
    cachedir.enable_compilation_cache()
    options = check_options(options)
    method = parse_method(default_method(drafter) if method is None else method)
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
    top_p, top_k = check_top_p(top_p), check_top_k(top_k)
    logprobs = check_logprobs(logprobs)
    plan = method.plan(target, drafter, temperature > 0, options)
    if logprobs is not None:
        plan = dataclasses.replace(plan, logprobs=logprobs)
    mesh = check_mesh(mesh, target, drafter if plan.drafts else None, prompts.batch)
    size = check_lengths(prompts, max_new_tokens, cfg.max_position_embeddings, cache_size, plan)
    buf_len = _buf_len(max_new_tokens, capacity, plan)
    check_memory(target, drafter, plan, prompts, size, buf_len, cache_size=cache_size, capacity=capacity,
                 prompt_width=prompt_width)
    kw = dict(target=target, drafter=drafter, batch=prompts.batch, cache_size=size)
    plan, inputs = method.bind(plan, **kw, memory=auto_memory)
    return Run(method, prompts, eos, temperature, plan, size, buf_len, seed, max_new_tokens, mesh, options, inputs,
               top_p, top_k, logprobs)


def generate(target, drafter=None, prompt_ids: Any = None, *, method: str | Method | None = None,
             max_new_tokens: int = 128, eos_token_ids: int | Sequence[int] | None = None, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: int = 0, cache_size: int | None = None,
             prompt_width: int | None = None, capacity: int | None = None, instrument: bool = False, mesh: Any = None,
             auto_memory: AutoMemory | None = None, options: Options | None = None,
             logprobs: int | None = None) -> GenerateOutput:
    """Generates continuations of ``prompt_ids`` with ``method``: a method object, or one label
    (``name[@budget][:candidates][:fanout=K]``, :func:`~sparkjax.engine.methods.parse_method`); None:
    :func:`default_method` (``auto`` with a drafter, ``ar`` without). The arguments are tabled in docs/api.md.

    Greedy at ``temperature == 0`` (exactly the target's greedy tokens for every method; ``top_p`` and ``top_k``
    ignored), else lossless sampling seeded by ``seed`` from the target's distribution at ``temperature``, then
    top-k (``top_k`` > 0), then top-p (``top_p`` < 1) (:func:`sparkjax.sampling.process`): every method's tokens
    follow ``ar``'s distribution. One jitted program with no host sync; ``instrument=True`` instead runs each
    stage of the same round as its own jitted call and times it. Shapes decide recompilation: prompts are padded
    to a power of two (or ``prompt_width``), the cache has ``cache_size`` slots (:func:`required_cache_size`),
    the output buffer ``capacity`` tokens (default ``max_new_tokens``, which is otherwise traced). ``auto``
    without a table profiles once per process and shape (:func:`~sparkjax.engine.profile_costs`).

    Every argument is checked before anything compiles, and so is the estimated memory
    (:func:`estimate_memory`): an :class:`~sparkjax.errors.ArgumentError` naming it (a mismatched pair:
    :class:`~sparkjax.errors.IncompatiblePairError`). Non-finite target logits raise :class:`NumericalError`
    naming the first such round and sequence. ``mesh`` (axes ``("data", "model")``,
    :mod:`sparkjax.engine.placement`), ``auto_memory`` and ``options`` never change the tokens.

    ``logprobs`` (None, or 0..20; static: part of the program) also returns each token's log-probability under the
    target and the ``logprobs`` likeliest alternatives (:mod:`sparkjax.engine.logprobs`), from the logits the
    prefill, the verify pass or the one-token step already computed: the raw logits' log-softmax when greedy, the
    distribution sampled from (after temperature, top-k and top-p) when sampling. The same whichever method.
    """
    if not isinstance(instrument, bool | np.bool_):
        raise ArgumentError(f"instrument: expected True or False, got {describe(instrument)}")
    kw = dict(method=method, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids, temperature=temperature,
              top_p=top_p, top_k=top_k, seed=seed, cache_size=cache_size, prompt_width=prompt_width,
              capacity=capacity, mesh=mesh, auto_memory=auto_memory, options=options, logprobs=logprobs)
    run = validate(target, drafter, prompt_ids, **kw)
    if instrument:
        return _instrumented(target, drafter, run)
    res = launch_run(run, target, drafter)
    raise_if_nonfinite(to_host(res.nonfinite))
    return _outputs(res)


def launch(target, drafter=None, prompt_ids: Any = None, **kwargs) -> Launch:
    """Validates the arguments of :func:`generate` (all but ``instrument``, same defaults and errors) and
    dispatches the jitted program without waiting: a :class:`~sparkjax.engine.state.Launch` of device arrays
    (docs/api.md; with ``mesh``, global arrays sharded over the batch). ``max_new_tokens=1`` stops after the
    prefill, in the same compiled program as a longer run of the same shapes."""
    run = validate(target, drafter, prompt_ids, **kwargs)
    return launch_run(run, target, drafter)


def stream(target, drafter=None, prompt_ids: Any = None, *, method: str | Method | None = None,
           max_new_tokens: int = 128, eos_token_ids: int | Sequence[int] | None = None, temperature: float = 0.0,
           top_p: float = 1.0, top_k: int = 0, seed: int = 0, cache_size: int | None = None, mesh: Any = None,
           auto_memory: AutoMemory | None = None, options: Options | None = None, logprobs: int | None = None):
    """Like :func:`generate`, but yields each round's new tokens: a list per
    sequence (possibly empty); the concatenated yields equal ``generate(...).tokens``. One jitted call and one
    host sync per round. The arguments are validated before the generator is returned; a round whose target
    logits are not finite raises :class:`NumericalError` instead of yielding.

    ``logprobs`` (None, or 0..20, as :func:`generate`'s): each yield is instead a tuple ``(tokens, token_logprobs,
    top_logprobs)`` of the round's new tokens, per sequence, with their log-probabilities and their ``logprobs``
    likeliest alternatives ``(id, log-probability)``; concatenated, they equal ``generate(..., logprobs=N)``'s
    ``token_logprobs`` and ``top_logprobs``."""
    check_models(target, drafter)
    run = validate(target, drafter, prompt_ids, method=method, max_new_tokens=max_new_tokens,
                   eos_token_ids=eos_token_ids, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                   cache_size=cache_size, mesh=mesh, auto_memory=auto_memory, options=options, logprobs=logprobs)
    return _stream_rounds(target, drafter, run)


def _start(target, drafter, run: Run) -> tuple[Any, Any, Any]:
    """The split pair and the state before the first round (the request values in it)."""
    graphdefs, states = run.split(target, drafter)
    args = run.device_args()
    state = spec_start(graphdefs, states, *args, run.device_inputs(), plan=run.plan, cache_size=run.cache_size,
                       buf_len=run.buf_len, mesh=run.mesh)
    return graphdefs, states, state


def _stream_rounds(target, drafter, run: Run):
    graphdefs, states, state = _start(target, drafter, run)
    batch = run.prompts.batch
    seen = np.zeros(batch, np.int64)
    while True:
        n, out, done, bad = (to_host(x) for x in (state.n, state.out, state.done, state.nonfinite))
        raise_if_nonfinite(bad)
        tokens = [out[b, seen[b] : n[b]].tolist() for b in range(batch)]
        if state.logprobs is None:
            yield tokens
        else:  # the same rows of the log-probability buffer
            lp = state.logprobs
            chosen, ids, values = (to_host(x) for x in (lp.chosen, lp.ids, lp.values))
            yield (tokens, [chosen[b, seen[b] : n[b]].tolist() for b in range(batch)],
                   [[list(zip(ids[b, i].tolist(), values[b, i].tolist(), strict=True)) for i in range(seen[b], n[b])]
                    for b in range(batch)])
        seen = n
        if done.all():
            return
        state = spec_step(graphdefs, states, state, plan=run.plan, mesh=run.mesh)


def _instrumented(target, drafter, run: Run) -> GenerateOutput:
    """Runs the method's round (``plan.method.round``) with each stage as its own jitted call, blocking
    after each, and sums the wall time of each stage."""
    graphdefs, states, state = _start(target, drafter, run)
    plan = run.plan
    times = dict.fromkeys(STAGES, 0.0)

    def timed(fn, *stage_args, plan):
        t0 = time.perf_counter()
        res = jax.block_until_ready(stage_call(graphdefs, states, stage_args, fn=fn, plan=plan))
        times[fn.stage] += time.perf_counter() - t0
        return res

    timed.eager = True  # each stage is its own synced call: a method may read its choice on the host
    while not bool(to_host(state.done).all()):
        state = plan.method.round(target, drafter, state, plan, call=timed)
    raise_if_nonfinite(to_host(state.nonfinite))
    res = Launch(state.out, state.n, state.accept_lens, state.rounds, state.depth_hits, state.nonfinite,
                 plan.method.results(state, plan), plan, plan.method.labels(), state.logprobs)
    return _outputs(res, stage_seconds=times)


def round_hlo(target, drafter, prompt_ids, *, mesh: Mesh, **kwargs) -> str:
    """The compiled text of one round (``spec_step``, the body of :func:`stream` and of the
    generation's ``while_loop``) on ``mesh``, for the arguments of :func:`generate`."""
    run = validate(target, drafter, prompt_ids, mesh=mesh, **kwargs)
    graphdefs, states, state = _start(target, drafter, run)
    lowered = spec_step.lower(graphdefs, states, state, plan=run.plan, mesh=mesh)
    return lowered.compile().as_text()


def _as_auto(method: Any, what: str) -> Auto:
    """``method`` (a name or a method object) as an :class:`~sparkjax.engine.adaptive.Auto`; ArgumentError naming
    ``method`` (with ``what``: why only ``auto`` will do) for any other method."""
    spec = parse_method(method)
    if not isinstance(spec, Auto):
        raise ArgumentError(f"method: {what}, got {describe(method)}")
    return spec


def profile_costs(target, drafter, *, method: Any = "auto", batch_size: int = 1, cache_size: int | None = None,
                  prompt_length: int = 16, temperature: float = 0.0, repeats: int = 5, seed: int = 0,
                  options: Options | None = None, active: int | None = None) -> CostTable:
    """Times one round of each candidate size of method ``auto`` (``"auto"`` or an
    :class:`~sparkjax.engine.Auto`, its table ignored) on the current device and returns its
    :class:`~sparkjax.engine.costs.CostTable` (:func:`sparkjax.engine.costs.profile`; ``active``: with only
    that many of the ``batch_size`` sequences running, as in a serving pool with idle slots)."""
    check_models(target, drafter)
    spec = _as_auto(method, "profile_costs times the candidates of method 'auto'")
    temperature = check_temperature(temperature)
    plan = spec.plan(target, drafter, temperature > 0, check_options(options))
    return profile(target, drafter, plan, batch_size=batch_size, cache_size=cache_size, prompt_length=prompt_length,
                   temperature=temperature, repeats=repeats, seed=seed, active=active)


def load_cost_table(path: str | os.PathLike, *, target=None, drafter=None, method: Any = "auto",
                    batch_size: int | None = None, cache_size: int | None = None, temperature: float = 0.0
                    ) -> CostTable:
    """Reads a table :meth:`~sparkjax.engine.costs.CostTable.save` wrote. With ``target``, ``drafter``,
    ``batch_size`` and ``cache_size`` given, its key must match this device and shape
    (:func:`~sparkjax.engine.costs.cost_key`). An unreadable file or a mismatched key raises
    :class:`~sparkjax.errors.CostTableError` naming the file (and the key)."""
    if target is None or drafter is None or batch_size is None or cache_size is None:
        return read_table(path)
    spec = _as_auto(method, "cost tables are for method 'auto'")
    plan = spec.plan(target, drafter, check_temperature(temperature) > 0)
    return read_table(path, cost_key(target, drafter, plan, batch_size, cache_size))
