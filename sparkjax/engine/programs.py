"""The jitted programs: the target's prefill and the generation program of every method (``ar`` included).

Every generation is one jitted ``jax.lax.while_loop`` over fixed-shape state. The programs reach the method
only through ``plan.method``'s hooks and take its ``inputs`` as a traced argument;
:func:`spec_start` / :func:`spec_step` are the same prefill and round as separate jitted calls (``stream``).

Every program here (and the serving pool's and auto's profiling programs) is a :func:`program`: compiled for a
GPU, it gets :func:`loop_compiler_options`, which put its ``while`` loops and conditionals inside XLA:GPU command
buffers (CUDA graphs) so the device runs them without copying a predicate to the host each iteration; on any
other backend it is the plain ``jax.jit``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ..sampling import pick, split_keys
from . import logprobs as lps
from .drafting import append_context
from .options import DEFAULT_OPTIONS, Options
from .placement import constrain, per_sequence
from .round import flag_nonfinite, hits_eos, propose
from .state import Launch, Plan, Request, SpecState

# XLA's default command-buffer types (debug_options_flags.cc) plus WHILE and CONDITIONAL: a loop or conditional
# whose every thunk can be recorded becomes a CUDA-graph conditional node, evaluated on the device. The option takes
# the whole list (a "+WHILE" form is refused by a per-program compile). XLA drops WHILE / CONDITIONAL by itself
# where the CUDA runtime or driver is older than 12.3 (the loop then runs from the host, as with XLA's defaults).
GPU_COMMAND_BUFFER_TYPES = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN", "DYNAMIC_SLICE_FUSION", "WHILE",
                            "CONDITIONAL")


def loop_compiler_options(options: Options = DEFAULT_OPTIONS, backend: str | None = None) -> dict[str, Any] | None:
    """The per-program XLA options of a program compiled for ``backend`` (default: ``jax.default_backend()``):
    on a GPU with ``options.gpu_loop == "command_buffer"`` (the default), ``xla_gpu_enable_command_buffer`` with
    :data:`GPU_COMMAND_BUFFER_TYPES`; None (XLA's defaults) on any other backend or with ``"xla_default"``. Per
    program, through ``jax.jit(compiler_options=...)``: no process-wide flag."""
    if options.gpu_loop != "command_buffer" or (backend or jax.default_backend()) != "gpu":
        return None
    return {"xla_gpu_enable_command_buffer": ",".join(GPU_COMMAND_BUFFER_TYPES)}


def _options_of(kwargs: dict) -> Options:
    """The :class:`Options` of a program call: its ``options`` argument, else its ``plan``'s, else the defaults."""
    options = kwargs.get("options")
    if options is None:
        options = getattr(kwargs.get("plan"), "options", None)
    return DEFAULT_OPTIONS if options is None else options


def _traced(args, kwargs) -> bool:
    """Whether a program is called inside another trace (``jax.jit``, ``eval_shape``): compiler options belong to
    the outermost jit only."""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs)))


class Program:
    """A jitted program (``jax.jit(fn, **jit_kwargs)``) compiled with :func:`loop_compiler_options` of the call's
    options and the default backend (one ``jax.jit`` per distinct set of compiler options; called inside another
    trace, the plain one): calls, ``lower`` and ``_cache_size`` behave as the jitted function's."""

    def __init__(self, fn: Callable, **jit_kwargs):
        self._fn, self._jit_kwargs = fn, jit_kwargs
        self._jits = {None: jax.jit(fn, **jit_kwargs)}  # the plain jit, made here: threads share it
        self._lock = threading.Lock()
        functools.update_wrapper(self, fn)

    def jitted(self, compiler_options: dict[str, Any] | None):
        """The ``jax.jit`` of this program with ``compiler_options`` (None: XLA's defaults); one per set of
        options, shared by every thread."""
        key = None if compiler_options is None else tuple(sorted(compiler_options.items()))
        jitted = self._jits.get(key)
        if jitted is None:
            with self._lock:
                if key not in self._jits:
                    self._jits[key] = jax.jit(self._fn, **self._jit_kwargs, compiler_options=compiler_options)
                jitted = self._jits[key]
        return jitted

    def _pick(self, args: tuple, kwargs: dict):
        options = loop_compiler_options(_options_of(kwargs))
        return self.jitted(None if options is None or _traced(args, kwargs) else options)

    def __call__(self, *args, **kwargs):
        return self._pick(args, kwargs)(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self._pick(args, kwargs).lower(*args, **kwargs)

    def _cache_size(self) -> int:
        return sum(j._cache_size() for j in self._jits.values())


def program(**jit_kwargs) -> Callable[[Callable], Program]:
    """Decorator: ``fn`` as a :class:`Program` (``jit_kwargs`` as ``jax.jit``'s)."""
    return lambda fn: Program(fn, **jit_kwargs)


def split_pair(target, drafter):
    """``((graphdef_t, graphdef_d), (state_t, state_d))`` of the pair, for the jitted programs (a drafter of None,
    for a plan that drafts nothing: its halves are None)."""
    g_t, s_t = nnx.split(target)
    g_d, s_d = (None, None) if drafter is None else nnx.split(drafter)
    return (g_t, g_d), (s_t, s_d)


def merge_pair(graphdefs, states):
    """The target and drafter (None: none was split) modules back from :func:`split_pair`'s halves (inside a
    jitted function, before any loop: the drafter's context projections are joined here, see
    :meth:`~sparkjax.nn.drafter.Drafter.join_context_projections`)."""
    drafter = None
    if graphdefs[1] is not None:
        drafter = nnx.merge(graphdefs[1], states[1])
        drafter.join_context_projections()
    return nnx.merge(graphdefs[0], states[0]), drafter


def prefill(model, tokens, lengths, cache_size: int, hidden_layers: tuple[int, ...] = (), attention="auto"):
    """Runs the prompt through the target. Returns (cache with committed lengths, last logits [B, V], hidden)."""
    b, p = tokens.shape
    cache = model.init_cache(b, cache_size)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    out = model(tokens, positions, cache=cache, hidden_layers=hidden_layers, logits_at=(lengths - 1)[:, None],
                fresh_cache=True, attention=attention)
    return out.cache.with_lengths(lengths), out.logits[:, 0], out.hidden


def first_token(logits, temperature, key, plan: Plan):
    """``(key, first)``: the first token ``[B]`` of a prefill, picked from the prompt's last ``logits`` ``[B, V]``
    (drawn with a key split from ``key`` when the plan samples; the greedy path splits no key), and the key the
    rounds go on with."""
    sub = None
    if plan.sampling:
        key, sub = split_keys(key, 2)
    return key, pick(logits, temperature, sub)


def spec_prefill(target, drafter, tokens, lengths, max_new, eos, temperature, key, inputs, plan: Plan,
                 cache_size: int, buf_len: int) -> SpecState:
    """Prefill the target, take the first token, and fill the drafter context with the prompt's features
    (unless the plan keeps no context; a plan that drafts nothing has none); the method's state comes from its
    ``init_state(..., inputs)``."""
    return spec_prefill_logits(target, drafter, tokens, lengths, max_new, eos, temperature, key, inputs, plan,
                               cache_size, buf_len)[0]


def spec_prefill_logits(target, drafter, tokens, lengths, max_new, eos, temperature, key, inputs, plan: Plan,
                        cache_size: int, buf_len: int) -> tuple[SpecState, jax.Array]:
    """:func:`spec_prefill`'s state and the prompt's last logits ``[B, V]`` (its first token was picked from them:
    :func:`first_token`)."""
    b = tokens.shape[0]
    method = plan.method
    track = plan.context
    cache, logits, hidden = prefill(target, tokens, lengths, cache_size, plan.layer_ids if track else (),
                                    attention=plan.options.attend)
    key, first = first_token(logits, temperature, key, plan)
    ctx = None  # a plan that drafts nothing has no drafter context
    if plan.drafts:
        ctx = drafter.init_context(b, cache_size)
        if track:
            ctx = append_context(drafter, ctx, jnp.concatenate(hidden, -1), lengths)
    out = jnp.zeros((b, buf_len), jnp.int32).at[:, 0].set(first)
    n = jnp.ones((b,), jnp.int32)
    done = hits_eos(first, eos) | (n >= max_new)
    lp = None if plan.logprobs is None else lps.record(lps.empty(b, buf_len, plan.logprobs), logits, first,
                                                       jnp.zeros((b,), jnp.int32), temperature)
    # one value per sequence (max_new, EOS ids); the sampling parameters as given (one for the batch or per sequence)
    request = Request(jnp.broadcast_to(jnp.asarray(max_new, jnp.int32), (b,)),
                      jnp.broadcast_to(jnp.asarray(eos, jnp.int32), (b, jnp.shape(eos)[-1])), temperature)
    state = SpecState(
        cache=cache, ctx=ctx, x_start=first, out=out, n=n, done=done, key=key,
        # per-round counts (none kept for a one-token round: each commits one token)
        accept_lens=jnp.zeros((b, buf_len if plan.drafts else 0), jnp.int32), rounds=jnp.zeros((b,), jnp.int32),
        depth_hits=jnp.zeros((b, plan.depth), jnp.int32),
        nonfinite=flag_nonfinite(jnp.full((b,), -1, jnp.int32), logits, jnp.ones((b,), bool),
                                 jnp.zeros((b,), jnp.int32)),
        request=request, extra=method.init_state(plan, b, buf_len, inputs), logprobs=lp,
    )
    return state, logits


_STATIC = ("graphdefs", "plan", "cache_size", "buf_len", "mesh")


def placed_call(target, drafter, plan: Plan, mesh=None):
    """The ``call`` a round's stages run through (:func:`~sparkjax.engine.round.run_stages`): None without a
    mesh; on ``mesh``, every stage's output pinned to its sharding
    (:func:`~sparkjax.engine.placement.constrain`) and the greedy tree builder run per data shard
    (:func:`~sparkjax.engine.placement.per_sequence`)."""
    if mesh is None:
        return None

    def call(fn, *args, **kwargs):
        if fn is propose and plan.drafts and not plan.sampling:  # the greedy tree builder: per sequence
            return per_sequence(lambda d, *a: fn(target, d, *a, **kwargs), mesh, drafter, *args)
        return constrain(fn(target, drafter, *args, **kwargs), mesh)

    return call


def placed_round(target, drafter, state: SpecState, plan: Plan, mesh=None) -> SpecState:
    """The method's round (``plan.method.round``) through :func:`placed_call`."""
    return plan.method.round(target, drafter, state, plan, call=placed_call(target, drafter, plan, mesh))


def launch_run(run, target, drafter) -> Launch:
    """Dispatches the validated ``run`` (:class:`~sparkjax.engine.api.Run`) to :func:`spec_program` without
    waiting (the drafter only when the plan drafts)."""
    graphdefs, states = run.split(target, drafter if run.plan.drafts else None)
    res = spec_program(graphdefs, states, *run.device_args(), run.device_inputs(), plan=run.plan,
                       cache_size=run.cache_size, buf_len=run.buf_len, mesh=run.mesh)
    return Launch(*res[:7], plan=run.plan, labels=run.plan.method.labels(), logprobs=res[7])


@program(static_argnames=_STATIC)
def spec_program(graphdefs, states, tokens, lengths, max_new, eos, temperature, key, inputs, *, plan, cache_size,
                 buf_len, mesh=None):
    """Prefill, then speculative rounds in one ``while_loop``. Returns ``(out, n, accept_lens, rounds,
    depth_hits, nonfinite, extra, logprobs)`` (``extra``: the method's ``results``; ``logprobs`` None unless
    ``plan.logprobs`` is set); ``mesh``: see :func:`placed_call`."""
    target, drafter = merge_pair(graphdefs, states)
    state = spec_prefill(target, drafter, tokens, lengths, max_new, eos, temperature, key, inputs, plan, cache_size,
                         buf_len)
    state = jax.lax.while_loop(
        lambda s: ~jnp.all(s.done),
        lambda s: placed_round(target, drafter, s, plan, mesh),
        constrain(state, mesh),
    )
    return (state.out, state.n, state.accept_lens, state.rounds, state.depth_hits, state.nonfinite,
            plan.method.results(state, plan), state.logprobs)


@program(static_argnames=_STATIC)
def spec_start(graphdefs, states, tokens, lengths, max_new, eos, temperature, key, inputs, *, plan, cache_size,
               buf_len, mesh=None):
    """:func:`spec_prefill` as its own jitted call: the state before the first round."""
    target, drafter = merge_pair(graphdefs, states)
    state = spec_prefill(target, drafter, tokens, lengths, max_new, eos, temperature, key, inputs, plan, cache_size,
                         buf_len)
    return constrain(state, mesh)


@program(static_argnames=("graphdefs", "plan", "mesh"), donate_argnames=("state",))
def spec_step(graphdefs, states, state, *, plan, mesh=None):
    """One round (``plan.method.round``) as its own jitted call (the state is donated)."""
    target, drafter = merge_pair(graphdefs, states)
    return constrain(placed_round(target, drafter, state, plan, mesh), mesh)


@program(static_argnames=("graphdefs", "fn", "plan"))
def stage_call(graphdefs, states, args, *, fn, plan):
    """One stage of the round (``fn``, a :mod:`sparkjax.engine.round` stage or a method's own) as its own
    jitted call."""
    target, drafter = merge_pair(graphdefs, states)
    return fn(target, drafter, *args, plan=plan)
