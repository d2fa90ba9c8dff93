"""The serving engine: continuous batching over a fixed pool of slots on device (:mod:`sparkjax.serve.slots`).

One background thread admits waiting requests into free slots (a jitted prefill written into the slot; the
other choices of the same request, :meth:`Engine.submit_choices`, get copies of that slot instead of a prefill),
runs up to ``rounds_per_visit`` rounds of every running slot in one jitted loop that ends early when a
slot finishes, copies only the new tokens to the host, streams them to the requests and frees finished and
cancelled slots. Nothing compiles per request after :meth:`Engine.start`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import copy
import dataclasses
import itertools
import logging
import math
import os
import queue
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import cachedir
from ..engine.api import _key, default_method, eos_array
from ..engine.checks import (
    MAX_SEED,
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
from ..engine.logprobs import check_logprobs
from ..engine.methods import Method
from ..engine.names import parse_method
from ..engine.options import check_options
from ..engine.programs import split_pair
from ..errors import ArgumentError, EngineClosedError, EngineFailure, QueueFullError
from ..progress import Progress, run_threads
from ..sampling import Sampling
from . import slots
from .text import TextStream

log = logging.getLogger("sparkjax.serve")

FINISH_REASONS = ("stop", "length", "cancelled")
DEFAULT_MAX_PROMPT = 256  # prompt tokens a request may have when neither it nor cache_size is given
DEFAULT_MAX_NEW = 256  # generated tokens a request may ask for by default
MIN_EOS_SLOTS = 4  # EOS ids a request may give (at least; more when the pair has more)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # seconds (histogram bounds)
TTFT_SAMPLES = 1024  # the latest times to first token kept for metrics()
MIN_PROMPT_BUCKET = 16  # the smallest prompt buffer (prompt lengths are bucketed to powers of two from here)
_PENDING = object()  # a chunk that may still come
COMPILE_THREADS = 2  # the most programs Engine.start compiles at once (see _compile_threads)
_WARM_ORDER = ("visit", "admit", "fork", "read")  # the start's programs, longest to compile first
SEED_STEP = 0x9E3779B97F4A7C15  # choice i's seed: (seed + i * SEED_STEP) mod 2**63 (choice 0: the request's seed)


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the target and its ``top`` likeliest alternatives ``(id,
    log-probability)``, most likely first (:mod:`sparkjax.engine.logprobs`: the raw logits' log-softmax when
    greedy, the distribution sampled from when sampling)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A piece of a request's stream: new ``token_ids``, the new ``text`` (empty without a tokenizer) and,
    on the last chunk only, its ``finish_reason`` (``stop``, ``length`` or ``cancelled``)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # per token id, when the request asked for logprobs


@dataclasses.dataclass(frozen=True)
class Completion:
    """A finished request (:meth:`Request.result`): every generated id (an EOS id that ended it included, as
    :func:`sparkjax.generate` returns them; with a stop string, up to the id that completed it, none after), the
    text (cut before a stop string), ``finish_reason``,
    ``prompt_tokens``, ``completion_tokens``, ``ttft_s`` (seconds from submit to the first token, None when
    none came), ``latency_s`` (submit to finish) and ``rounds`` (device rounds it ran)."""

    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    latency_s: float
    rounds: int
    logprobs: list[TokenLogprob] | None = None  # parallel to token_ids, when the request asked for logprobs


class Request:
    """A submitted request (:meth:`Engine.submit`): iterate it (``for`` or ``async for``) for its
    :class:`Chunk` s, :meth:`cancel` it, or wait for its :meth:`result`. An engine failure while it is in
    flight raises :class:`~sparkjax.errors.EngineFailure` from the iterator and from :meth:`result`."""

    def __init__(self, engine: Engine, rid: int, prompt: list[int], max_new_tokens: int, temperature: float,
                 seed: int, eos: np.ndarray, stop: tuple[str, ...], top_p: float = 1.0, top_k: int = 0,
                 logprobs: int | None = None, index: int = 0, group: object = None):
        self.id = rid
        self.index = index  # its choice among the n of one submit_choices (0 for submit)
        self._group = group  # shared by the choices of one submit_choices: their prompt's prefill is shared
        self.logprobs = logprobs
        self._logprobs: list[TokenLogprob] = []
        self.prompt_ids = prompt
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p, self.top_k = top_p, top_k
        self.seed = seed
        self.eos = eos
        self._engine = engine
        self._cond = threading.Condition()
        self._chunks: list[Chunk] = []
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._text = TextStream(engine.tokenizer, stop)
        self._tokens: list[int] = []
        self._finish: str | None = None
        self._error: EngineFailure | None = None
        self._cancel = False
        self.rounds = 0
        self.submitted = time.perf_counter()
        self.first_token: float | None = None
        self.finished: float | None = None

    # ------------------------------------------------------------------ the scheduler's side
    def _push(self, chunk: Chunk | None = None, error: EngineFailure | None = None) -> None:
        """Appends ``chunk`` (one with a finish reason ends the request) or fails the request with ``error``,
        and wakes the readers; nothing once the request is done."""
        with self._cond:
            if self.done:
                return
            if chunk is not None:
                self._chunks.append(chunk)
                self._finish = chunk.finish_reason
            self._error = error
            if self.done:
                self.finished = time.perf_counter()
            self._cond.notify_all()
            waiters = list(self._waiters)
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that event loop is closed: its reader is gone
                pass

    def _add_tokens(self, ids: list[int], logprobs: list[TokenLogprob] | None = None) -> bool:
        """Streams new ids (and their ``logprobs`` when the request asked for them); returns whether a stop string
        ended the request (its ids then end at the one that completed the stop string: the ones the device
        generated after it are dropped, never counted)."""
        if not ids or self.done:
            return False
        if self.first_token is None:
            self.first_token = time.perf_counter()
        text = self._text.push(ids)
        if self._text.stopped:
            ids = ids[: self._text.kept]
        lps = None if self.logprobs is None else list(logprobs or [])[: len(ids)]
        self._tokens.extend(ids)
        if lps is not None:
            self._logprobs.extend(lps)
        if self._text.stopped:
            self._end("stop", ids, text, lps)
        else:
            self._push(Chunk(list(ids), text, None, lps))
        return self._text.stopped

    def _end(self, reason: str, ids: Sequence[int] = (), text: str = "", logprobs=None) -> None:
        if not self.done:
            if logprobs is None and self.logprobs is not None:
                logprobs = []
            self._push(Chunk(list(ids), text + self._text.finish(), reason, logprobs))

    # ------------------------------------------------------------------ the caller's side
    @property
    def done(self) -> bool:
        """Whether the request has finished (its last chunk is out) or failed."""
        return self._finish is not None or self._error is not None

    def cancel(self) -> None:
        """Cancels the request: its slot is freed at the scheduler's next visit and its stream ends with
        ``finish_reason`` ``cancelled`` (a request that already finished is unchanged)."""
        if not self.done:
            self._cancel = True
            self._engine._wake()

    def _chunk(self, i: int) -> Chunk | None | object:
        """Chunk ``i``; None when the stream ended before it, :data:`_PENDING` while it may still come; raises
        the failure."""
        with self._cond:
            if i < len(self._chunks):
                return self._chunks[i]
            if self._error is not None:
                raise self._error
            return None if self.done else _PENDING

    def __iter__(self):
        for i in itertools.count():
            with self._cond:
                self._cond.wait_for(lambda: i < len(self._chunks) or self.done)  # noqa: B023 - called at once
            if (chunk := self._chunk(i)) is None:
                return
            yield chunk

    async def __aiter__(self):
        loop, event = asyncio.get_running_loop(), asyncio.Event()
        with self._cond:
            self._waiters.append((loop, event))
        try:
            for i in itertools.count():
                event.clear()
                while (chunk := self._chunk(i)) is _PENDING:
                    await event.wait()
                    event.clear()
                if chunk is None:
                    return
                yield chunk
        finally:
            with self._cond:
                self._waiters.remove((loop, event))

    def result(self, timeout: float | None = None) -> Completion:
        """Waits for the request to finish (TimeoutError after ``timeout`` seconds) and returns its
        :class:`Completion`; raises :class:`~sparkjax.errors.EngineFailure` if it failed."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.done, timeout):
                raise TimeoutError(f"request {self.id}: not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        ttft = None if self.first_token is None else self.first_token - self.submitted
        return Completion(list(self._tokens), self._text.text, self._finish, len(self.prompt_ids),
                          len(self._tokens), ttft, self.finished - self.submitted, self.rounds,
                          None if self.logprobs is None else list(self._logprobs))


class Engine:
    """Continuous batching for one target / drafter pair (``drafter`` None for ``method="ar"``).

    ``slots``: sequences on device at once; ``cache_size``: each slot's KV slots (default: room for
    ``max_prompt_tokens + max_new_tokens`` and a round's scratch rows, rounded up to a power of two);
    ``max_prompt_tokens`` / ``max_new_tokens``: the limits requests are checked against (defaults 256 each,
    or what ``cache_size`` leaves); ``rounds_per_visit``: rounds per device call between host visits;
    ``queue_limit``: waiting requests before :meth:`submit` raises :class:`~sparkjax.errors.QueueFullError`
    (:meth:`submit_choices`: once fewer than its ``n`` places are left);
    ``tokenizer``: for the chunks' text and stop strings (None: empty text); ``eos_token_ids``: the pair's EOS
    ids, used unless a request gives its own; ``options``: :class:`~sparkjax.engine.options.Options`;
    ``sampling``: whether requests may sample (False compiles only the greedy programs); ``visit_sizes``: the
    batch sizes a visit runs the active slots at, padded with free ones (default: 1, the powers of 4 up to
    ``slots / 4``, and ``slots``; a program each); ``max_logprobs``: None (no log-probabilities, the programs
    as without them) or 0..20, the alternatives every slot's programs compute for each token (one static
    setting for the pool: a request asking for fewer is sliced on the host, so no program is added). Greedy
    requests get exactly :func:`sparkjax.generate`'s tokens for their prompt alone, whatever shares the pool; a
    sampled request draws from its own key (its seed), so with a fixed method it gets the same tokens alone and in a
    busy pool.
    """

    def __init__(self, target, drafter=None, *, method: str | Method | None = None, slots: int = 8,
                 cache_size: int | None = None, max_prompt_tokens: int | None = None,
                 max_new_tokens: int | None = None, rounds_per_visit: int = 8, queue_limit: int = 64,
                 tokenizer: Any = None, eos_token_ids: int | Sequence[int] | None = None, options: Any = None,
                 sampling: bool = True, visit_sizes: Sequence[int] | None = None, max_logprobs: int | None = None):
        check_models(target, drafter)
        if not isinstance(sampling, bool):
            raise ArgumentError(f"sampling: expected True or False, got {describe(sampling)}")
        self.sampling = sampling
        self.target, self.drafter = target, drafter
        self.options = check_options(options)
        self.method = parse_method(default_method(drafter) if method is None else method)
        self.slots = check_int("slots", slots, maximum=4096, unit="number of sequences")
        self.rounds_per_visit = check_int("rounds_per_visit", rounds_per_visit, maximum=MAX_SLOTS)
        self.queue_limit = check_int("queue_limit", queue_limit, minimum=0, unit="number of waiting requests")
        self.visit_sizes = _visit_sizes(visit_sizes, self.slots)
        self.tokenizer = tokenizer
        cfg = target.config
        self.vocab_size = cfg.vocab_size
        self.eos = eos_array(eos_token_ids, cfg.vocab_size)
        self.eos_slots = max(MIN_EOS_SLOTS, len(self.eos))
        self.plan = self.method.plan(target, drafter, False, self.options)
        self.max_logprobs = check_logprobs(max_logprobs, "max_logprobs")
        if self.max_logprobs is not None:
            self.plan = dataclasses.replace(self.plan, logprobs=self.max_logprobs)
        depth = self.plan.depth
        # a free slot's row past the longest sequence (a one-token round's plan needs no other scratch)
        self.cache_size, self.max_prompt_tokens, self.max_new_tokens = _limits(
            cache_size, max_prompt_tokens, max_new_tokens, max(1, self.plan.scratch), cfg.max_position_embeddings)
        self.buf_len = bucket(self.max_new_tokens + depth + 1, 1)
        self.window = min(self.buf_len, self.rounds_per_visit * (depth + 1) + 1)
        self.buckets = _buckets(self.max_prompt_tokens, self.cache_size)
        kw = dict(target=target, drafter=drafter, batch=self.slots, cache_size=self.cache_size)
        self.plan, self._inputs = self.method.bind(self.plan, pool=self.visit_sizes, **kw)
        self.labels = tuple(self.plan.method.labels())
        # the sampling programs: the same bound plan (cost table included), sampling
        self.sampling_plan = dataclasses.replace(self.plan, sampling=True)
        # scheduler state (under self._cond)
        self._cond = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        # prompts to score (ids, top, future): run by the scheduler thread between visits
        self._scoring: collections.deque[tuple[list[int], int, concurrent.futures.Future]] = collections.deque()
        self._in_slot: list[Request | None] = [None] * self.slots
        self._seen = np.zeros(self.slots, np.int32)
        self._stop = np.zeros(self.slots, bool)
        self._closing = False
        self._abort = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._pool = None
        self._logits = None  # the last admitted prompt's last logits [1, V] (device), for copies of its slot
        self._compile_s: float | None = None
        self._slot_temp = np.zeros(self.slots, np.float32)  # the host's copy: a visit samples if one slot does
        self._m = _Metrics(self.labels or (self.method.label,), self.plan.depth)
        # draft tokens a round of each label verifies (0: a plain step), for the speculation metrics
        if self.labels:
            sizes = self.plan.method.sizes
            self._draft_nodes = np.asarray([0 if v == 0 else self.plan.depth if isinstance(v, str) else v
                                            for v in sizes], np.int64)
        else:
            self._draft_nodes = self.plan.nodes if self.plan.drafts else None

    # ------------------------------------------------------------------------------------------ start / close
    def start(self) -> float:
        """Compiles and warms up every program the engine runs (the pool, the prefill of each prompt bucket,
        the copy of a slot that the choices of one request share, the visit loop) and starts the scheduler thread;
        returns the seconds that took (0 when already started)."""
        with self._cond:
            if self._thread is not None:
                return 0.0
            if self._closing:
                raise EngineClosedError("engine: closed; build a new Engine")
        t0 = time.perf_counter()
        cachedir.enable_compilation_cache()
        self._graphdefs, self._states = split_pair(self.target, self.drafter if self.plan.drafts else None)
        self._device_inputs = None if self._inputs is None else jax.tree.map(jnp.asarray, self._inputs)
        steps = [("the pool", None)]
        steps += [(f"the prefill of a {w}-token prompt buffer", ("admit", w)) for w in self.buckets]
        steps += [("the copy of a slot (the choices of one request)", ("fork",))]
        steps += [(f"the {'sampling' if hot else 'greedy'} visit loop at {size} slot{'s' * (size > 1)}",
                   ("visit", hot, size)) for hot in ((False, True) if self.sampling else (False,))
                  for size in self.visit_sizes]
        steps += [("the token reader", ("read",))]
        # the pool first; then the other programs, _compile_threads() at a time (XLA compiles with the GIL
        # released), each thread warming up on a pool of its own (the calls donate it): the smallest prefill (so
        # the estimates know a prefill's time early), then the longest first
        first, rest = steps[0], sorted(steps[1:], key=lambda s: (s != steps[1], _WARM_ORDER.index(s[1][0])))
        workers = max(1, min(_compile_threads(), len(rest)))
        progress = Progress(log, "compiling and warming up", len(steps), "program",
                            kinds=["pool" if step is None else step[0] for _, step in steps], workers=workers)
        token = progress.begin(first[0], kind="pool")
        self._pool = self._fresh_pool()
        jax.block_until_ready(self._pool)
        progress.end(token)
        views: queue.SimpleQueue[Engine] = queue.SimpleQueue()
        for j in range(workers):
            view = copy.copy(self)  # shares everything but the pool it warms up on
            view._pool = self._pool if j == 0 else self._fresh_pool()
            views.put(view)

        def warm(what: str, step: tuple) -> None:
            view = views.get()
            try:
                token = progress.begin(what, kind=step[0])
                view._warm_up(step)
                progress.end(token)
            finally:
                views.put(view)

        run_threads(warm, rest, workers, "sparkjax-compile")
        while not views.empty():  # free the threads' pools
            views.get()._pool = None
        self._pool = self._fresh_pool()
        jax.block_until_ready(self._pool)
        self._compile_s = time.perf_counter() - t0
        self._thread = threading.Thread(target=self._loop, name="sparkjax-serve", daemon=True)
        self._thread.start()
        return self._compile_s

    def _warm_up(self, step: tuple) -> None:
        """Runs one program of :meth:`start` on this engine's pool (compiling it at the first call)."""
        if step[0] == "admit":  # admit a dummy prompt of this bucket into slot 0, then free it
            self._pool = self._admit_call(0, np.zeros((1, step[1]), np.int32), 1, 1, self.eos_row(None), 0.0, 0)
            jax.block_until_ready(self._pool)
        elif step[0] == "fork":  # slot 0 copied onto itself (every slot is free)
            self._logits = jnp.zeros((1, self.vocab_size), jnp.float32)
            self._pool = self._fork_call(0, 0, 0)
            jax.block_until_ready(self._pool)
        elif step[0] == "visit":
            self._pool, visit = self._visit_call(np.ones(self.slots, bool), 1, step[1], np.arange(step[2]))
            jax.block_until_ready(visit)
        else:
            jax.block_until_ready(slots.read_tokens(self._pool.out, jnp.zeros((self.slots,), jnp.int32),
                                                       width=self.buf_len))
            if self._pool.logprobs is not None:
                jax.block_until_ready(slots.read_tokens(self._pool.logprobs, jnp.zeros((self.slots,), jnp.int32),
                                                           width=self.buf_len))

    def close(self, grace_s: float = 30.0) -> None:
        """Stops admitting new requests; the submitted ones (running or waiting) may finish within ``grace_s``
        seconds, then the rest are cancelled and the scheduler thread is joined. Idempotent."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is None:
            self._cancel_all()
            return
        thread.join(max(0.0, float(grace_s)))
        if thread.is_alive():
            with self._cond:
                self._abort = True
                self._cond.notify_all()
            thread.join()

    def __enter__(self) -> Engine:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------ requests
    def eos_row(self, eos_token_ids: Any) -> np.ndarray:
        """A request's EOS ids as the fixed-width row the device takes (the pair's when None)."""
        ids = self.eos if eos_token_ids is None else eos_array(eos_token_ids, self.vocab_size)
        ids = ids[ids >= 0]
        if len(ids) > self.eos_slots:
            raise ArgumentError(f"eos_token_ids: {len(ids)} ids; this engine takes at most {self.eos_slots}")
        row = np.full((self.eos_slots,), -1, np.int32)
        row[: len(ids)] = ids
        return row

    def submit(self, prompt_ids: Any, *, max_new_tokens: int, temperature: float = 0.0, seed: int | None = None,
               eos_token_ids: Any = None, stop: Any = None, top_p: float = 1.0, top_k: int = 0,
               logprobs: int | None = None) -> Request:
        """Validates a request and queues it; returns its :class:`Request`. ``top_p`` (1: off) and ``top_k``
        (0: off) apply after the temperature, as in :func:`sparkjax.generate`, and stay lossless; ``seed`` None
        draws a random one. ArgumentError naming the argument for bad input;
        :class:`~sparkjax.errors.QueueFullError` when ``queue_limit`` requests are waiting;
        :class:`~sparkjax.errors.EngineClosedError` after :meth:`close`."""
        return self.submit_choices(prompt_ids, n=1, max_new_tokens=max_new_tokens, temperature=temperature,
                                   seed=seed, eos_token_ids=eos_token_ids, stop=stop, top_p=top_p, top_k=top_k,
                                   logprobs=logprobs)[0]

    def submit_choices(self, prompt_ids: Any, *, n: int, max_new_tokens: int, temperature: float = 0.0,
                       seed: int | None = None, eos_token_ids: Any = None, stop: Any = None, top_p: float = 1.0,
                       top_k: int = 0, logprobs: int | None = None) -> list[Request]:
        """``n`` choices of one prompt (OpenAI's ``n``), as :meth:`submit` takes each: a list of ``n``
        :class:`Request` s, ``index`` 0..n-1, queued together (all or none: QueueFullError when fewer than ``n``
        places are left in the queue; ArgumentError when ``n`` exceeds ``queue_limit``). Choice i samples with
        :func:`choice_seed` ``(seed, i)`` (choice 0 with ``seed`` itself, so its tokens are :meth:`submit`'s; no
        ``seed``: a random one for choice 0), so it gets exactly what :meth:`submit` with that seed gets; greedy,
        the n choices are identical. The choices share the prompt's prefill: one admission prefills it into a slot
        and copies that slot into a free slot per further choice (:func:`~sparkjax.serve.slots.pool_fork`: the
        target's KV cache, the drafter's context, the request values and the method's state; each copy draws its
        own first token from the prompt's logits with its own key). Choices that find no free slot then wait in
        the queue, ahead of later requests, and prefill the prompt again when slots free up (shared again among
        those admitted together): the first choices start at once rather than waiting for ``n`` free slots (which
        ``n`` above ``slots`` never sees)."""
        n = check_int("n", n, unit="number of choices")
        if n > max(1, self.queue_limit):
            raise ArgumentError(f"n: {n} choices exceed this engine's queue_limit={self.queue_limit} (the choices of "
                                f"one request queue together)")
        prompt = self._check_prompt(prompt_ids)
        if not is_int(max_new_tokens):
            raise ArgumentError(f"max_new_tokens: expected an integer, got {describe(max_new_tokens)}")
        if not 1 <= int(max_new_tokens) <= self.max_new_tokens:
            raise ArgumentError(f"max_new_tokens: {int(max_new_tokens)} is outside [1, {self.max_new_tokens}] "
                                f"(this engine's limit)")
        temperature = check_temperature(temperature)
        top_p, top_k = check_top_p(top_p), check_top_k(top_k)
        if logprobs is not None:
            if self.max_logprobs is None:
                raise ArgumentError("logprobs: this engine computes no log-probabilities (built with "
                                    "max_logprobs=None)")
            logprobs = check_logprobs(logprobs, maximum=self.max_logprobs)
        if temperature > 0 and not self.sampling:
            raise ArgumentError("temperature: this engine serves greedy requests only (built with sampling=False)")
        seed = secrets.randbits(63) if seed is None else check_seed(seed)
        eos = self.eos_row(eos_token_ids)
        stops = _check_stop(stop, self.tokenizer)
        group = object() if n > 1 else None
        with self._cond:
            if self._closing:
                raise EngineClosedError("engine: closed, not admitting requests")
            if len(self._waiting) + n > self.queue_limit:
                raise QueueFullError(f"engine: {len(self._waiting)} requests are waiting (queue_limit="
                                     f"{self.queue_limit}){f'; no room for {n} choices' if n > 1 else ''}; try "
                                     f"again later")
            reqs = [Request(self, next(self._ids), prompt, int(max_new_tokens), temperature, choice_seed(seed, i),
                            eos, stops, top_p, top_k, logprobs, index=i, group=group) for i in range(n)]
            self._waiting.extend(reqs)
            self._m.submitted += n
            self._cond.notify_all()
        if self._thread is None:
            self.start()
        return reqs

    def score(self, prompt_ids: Any, logprobs: int = 0) -> concurrent.futures.Future:
        """Scores a prompt's own tokens under the target (prompt log-probabilities, OpenAI's ``echo`` with
        ``logprobs``): a future of a list parallel to the prompt's ids, None for the first id (nothing predicts it),
        then a :class:`TokenLogprob` per id with its ``logprobs`` likeliest alternatives, from the raw logits'
        log-softmax (greedy semantics, whatever a request samples with). One target-only forward pass over the
        prompt, run by the scheduler thread between visits (so device work stays serialised); its program is one
        per prompt bucket, compiled at the first prompt of that bucket and shared by every later one, apart from
        the pool's programs. ArgumentError for a bad prompt or ``logprobs``; EngineClosedError after
        :meth:`close`."""
        prompt = self._check_prompt(prompt_ids)
        if self.max_logprobs is None:
            raise ArgumentError("logprobs: this engine computes no log-probabilities (built with max_logprobs=None)")
        top = check_logprobs(logprobs, maximum=self.max_logprobs)
        top = 0 if top is None else top
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closing:
                raise EngineClosedError("engine: closed, not admitting requests")
            self._scoring.append((prompt, top, future))
            self._cond.notify_all()
        if self._thread is None:
            self.start()
        return future

    def _score_waiting(self) -> None:
        """Runs every queued :meth:`score` (the scheduler thread)."""
        while True:
            with self._cond:
                if not self._scoring:
                    return
                ids, top, future = self._scoring.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                width = next(w for w in self.buckets if w >= len(ids))
                tokens = np.zeros((1, width), np.int32)
                tokens[0, : len(ids)] = ids
                got = jax.device_get(slots.score_prompt(self._graphdefs[0], self._states[0], jnp.asarray(tokens),
                                                           top=self.max_logprobs, options=self.options))
                out: list[TokenLogprob | None] = [None]
                for j in range(len(ids) - 1):  # row j scores token j + 1
                    alts = list(zip(got.ids[0, j, :top].tolist(), got.values[0, j, :top].tolist(), strict=True))
                    out.append(TokenLogprob(ids[j + 1], float(got.chosen[0, j]), alts))
                future.set_result(out)
            except Exception as e:  # noqa: BLE001 - the caller's failure, the pool is untouched
                future.set_exception(EngineFailure(f"engine: scoring the prompt failed ({type(e).__name__}: {e})"))

    def _check_prompt(self, prompt_ids: Any) -> list[int]:
        return check_prompt(prompt_ids, self.vocab_size, max_tokens=self.max_prompt_tokens)

    # ------------------------------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, Any]:
        """Counters since the engine was built: ``requests`` (finished, by finish reason, and ``failed``),
        ``submitted``, ``prompt_tokens``, ``generated_tokens``, ``prefills`` (admissions that ran the target over a
        prompt) and ``prefill_tokens`` (their prompts' tokens), ``shared_prefills`` (choices admitted as a copy of
        another choice's slot, :meth:`submit_choices`: no prefill), ``rounds`` (slot rounds), ``visits``,
        ``accepted_tokens`` (tokens the rounds committed) and ``tau`` (their ratio), ``verify_sizes`` (rounds
        per verification size: the method's label, or ``auto``'s candidates), ``queue_length``,
        ``active_slots``, ``slots``, ``ttft`` (``count``, ``sum``, ``buckets``: cumulative counts per upper
        bound in seconds), ``ttft_samples`` (the latest times to first token) and ``spec_decode`` (None for
        ``ar``; else vLLM's speculation counters: ``num_drafts`` drafted rounds, ``num_draft_tokens`` the draft
        tokens they verified, ``num_accepted_tokens`` the draft tokens they accepted and
        ``num_accepted_tokens_per_pos`` {position: drafted rounds that accepted a draft there})."""
        with self._cond:
            return {**self._m.snapshot(), "queue_length": len(self._waiting),
                    "active_slots": sum(r is not None for r in self._in_slot), "slots": self.slots,
                    "method": self.method.label, "compile_s": self._compile_s}

    # ------------------------------------------------------------------------------------------ the scheduler
    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _fresh_pool(self):
        return slots.pool_init(self._graphdefs, self._states, jax.random.key(0), self._device_inputs,
                                  **self._static(), slots=self.slots, eos_slots=self.eos_slots)

    def _static(self, sampling: bool | None = None, *, sizes: bool = True) -> dict[str, Any]:
        """The programs' static arguments (``sizes``: with the cache and buffer sizes); ``sampling`` None: the
        engine's (the prefill, the pool)."""
        hot = self.sampling if sampling is None else sampling
        out = dict(plan=self.sampling_plan if hot else self.plan)
        return {**out, "cache_size": self.cache_size, "buf_len": self.buf_len} if sizes else out

    def _admit_call(self, slot: int, tokens: np.ndarray, length: int, max_new: int, eos: np.ndarray,
                    temperature: float, seed: int, top_p: float = 1.0, top_k: int = 0):
        """The pool with the prompt prefilled into ``slot``; keeps the prompt's last logits (``_logits``, on
        device) for :meth:`_fork_call`."""
        pool, self._logits = slots.pool_admit(
            self._graphdefs, self._states, self._pool, jnp.int32(slot), jnp.asarray(tokens),
            jnp.asarray([length], jnp.int32), jnp.int32(max_new), jnp.asarray(eos),
            Sampling.of(temperature, top_p, top_k), _key(seed), self._device_inputs, **self._static())
        return pool

    def _fork_call(self, src: int, dst: int, seed: int):
        """The pool with slot ``dst`` a copy of slot ``src`` just admitted (:meth:`_admit_call`'s ``_logits``),
        its first token drawn with ``seed``'s key."""
        return slots.pool_fork(self._pool, jnp.int32(src), jnp.int32(dst), self._logits, _key(seed),
                                  **self._static(sizes=False))

    def _visit_call(self, stop: np.ndarray, rounds: int, sampling: bool, rows: np.ndarray):
        return slots.pool_visit(
            self._graphdefs, self._states, self._pool, jnp.asarray(stop), jnp.int32(rounds),
            jnp.asarray(rows, jnp.int32), jnp.asarray(self._seen),
            window=self.window,
            **self._static(sampling, sizes=False))

    def _finish(self, req: Request, reason: str) -> None:
        req._end(reason)
        with self._cond:
            self._m.finished(req, reason)

    def _loop(self) -> None:
        while self._wait_for_work():
            try:
                self._score_waiting()
                self._admit_waiting()
                self._visit()
            except Exception as e:  # noqa: BLE001 - any failure of the device loop fails the requests in flight
                self._recover(e)
        if self._abort:
            self._cancel_all()

    def _wait_for_work(self) -> bool:
        """Waits for a running slot or a request to admit; False once the scheduler ends (aborted, or closing
        with nothing left)."""
        with self._cond:
            while True:
                self._drop_cancelled_waiting()
                occupied = any(r is not None for r in self._in_slot)
                if self._abort or (self._closing and not occupied and not self._waiting and not self._scoring):
                    return False
                if occupied or self._scoring or (self._waiting and None in self._in_slot):
                    return True
                self._cond.wait()

    def _drop_cancelled_waiting(self) -> None:
        for r in [r for r in self._waiting if r._cancel]:
            self._waiting.remove(r)
            self._finish(r, "cancelled")

    def _cancel_all(self) -> None:
        with self._cond:
            pending = list(self._waiting) + [r for r in self._in_slot if r is not None]
            scoring = list(self._scoring)
            self._scoring.clear()
            self._waiting.clear()
            self._in_slot = [None] * self.slots
        for r in pending:
            self._finish(r, "cancelled")
        for _, _, future in scoring:
            if not future.done():
                future.set_exception(EngineClosedError("engine: closed before the prompt was scored"))

    def _admit_waiting(self) -> None:
        """Admits waiting requests into free slots, first come first served: a prefill for each, except that the
        choices of one :meth:`submit_choices` waiting behind the one admitted take copies of its slot while free
        slots last (:func:`~sparkjax.serve.slots.pool_fork`: no prefill)."""
        while True:
            with self._cond:
                free = [i for i, r in enumerate(self._in_slot) if r is None]
                if not free or not self._waiting or self._abort:
                    return
                req = self._waiting.popleft()
                slot = free[0]
                self._in_slot[slot] = req
                copies = []  # (slot, request): its siblings, next in the queue
                for dst in free[1:]:
                    sibling = self._next_sibling(req)
                    if sibling is None:
                        break
                    self._in_slot[dst] = sibling
                    copies.append((dst, sibling))
                self._m.prefills += 1
                self._m.prefill_tokens += len(req.prompt_ids)
                self._m.shared_prefills += len(copies)
            ids = req.prompt_ids
            width = next(w for w in self.buckets if w >= len(ids))
            tokens = np.zeros((1, width), np.int32)
            tokens[0, : len(ids)] = ids
            self._pool = self._admit_call(slot, tokens, len(ids), req.max_new_tokens, req.eos, req.temperature,
                                          req.seed, req.top_p, req.top_k)
            for dst, sibling in copies:
                self._pool = self._fork_call(slot, dst, sibling.seed)
            for i, r in ((slot, req), *copies):
                self._seen[i] = 0
                self._stop[i] = False
                self._slot_temp[i] = r.temperature

    def _next_sibling(self, req: Request) -> Request | None:
        """Pops the next waiting choice of ``req``'s :meth:`submit_choices` (the choices queue together, so it is
        at the front; cancelled ones on the way end), or None (under ``_cond``)."""
        while req._group is not None and self._waiting and self._waiting[0]._group is req._group:
            sibling = self._waiting.popleft()
            if not sibling._cancel:
                return sibling
            self._finish(sibling, "cancelled")
        return None

    def _visit(self) -> None:
        with self._cond:
            if self._abort:  # the grace period is over: no visit starts after it
                return
            for i, r in enumerate(self._in_slot):  # cancelled requests leave their slots now
                if r is not None and r._cancel:
                    self._release(i, running=True)
                    self._finish(r, "cancelled")
            occupied = [i for i, r in enumerate(self._in_slot) if r is not None]
            stop = self._stop.copy()
            self._stop[:] = False
        if not occupied and not stop.any():
            return
        hot = bool(any(self._slot_temp[i] > 0 for i in occupied))
        size = next(s for s in self.visit_sizes if s >= len(occupied))
        taken = set(occupied)
        free = [i for i in range(self.slots) if i not in taken]
        rows = np.asarray(sorted(occupied + free[: size - len(occupied)]), np.int32)
        self._pool, visit = self._visit_call(stop, self.rounds_per_visit if occupied else 0, hot, rows)
        v = jax.device_get(visit)
        rest = rest_lp = None
        if (v.n - self._seen > self.window).any():  # more new tokens than the window holds: read the rest
            start = jnp.asarray(self._seen + self.window)
            rest = np.asarray(slots.read_tokens(self._pool.out, start, width=self.buf_len))
            if v.logprobs is not None:
                rest_lp = jax.device_get(slots.read_tokens(self._pool.logprobs, start, width=self.buf_len))
        with self._cond:
            self._m.visits += 1
            self._m.rounds += int(v.rounds.sum())
            self._m.accepted += int((v.n - v.n0).clip(0).sum())
            counts = v.choices.sum(axis=0) if self.labels else [v.rounds.sum()]
            for label, count in zip(self._m.sizes, counts, strict=True):
                self._m.sizes[label] += int(count)
            if self._draft_nodes is not None:  # vLLM's speculation counters: a draft is a drafted round
                if self.labels:
                    self._m.drafts += int(counts[self._draft_nodes > 0].sum())
                    self._m.draft_tokens += int((counts * self._draft_nodes).sum())
                else:
                    self._m.drafts += int(v.rounds.sum())
                    self._m.draft_tokens += int(v.rounds.sum()) * self._draft_nodes
                per_pos = v.hits.sum(axis=0)
                self._m.accepted_drafts += int(per_pos.sum())
                self._m.accepted_per_pos += per_pos.astype(np.int64)
        for i in occupied:
            req = self._in_slot[i]
            new = int(v.n[i] - self._seen[i])
            ids = v.tokens[i, : min(new, self.window)].tolist()
            if new > self.window:
                ids += rest[i, : new - self.window].tolist()
            lps = None if req.logprobs is None else _token_logprobs(ids, v.logprobs, rest_lp, i, self.window,
                                                                    req.logprobs)
            self._seen[i] = v.n[i]
            req.rounds += int(v.rounds[i])
            if v.nonfinite[i] >= 0:
                self._release(i, running=not v.done[i])
                self._fail(req, EngineFailure(
                    f"engine: the target's logits are not finite (NaN or Inf) in round {int(v.nonfinite[i])} of "
                    f"request {req.id}; its tokens would be garbage"))
            elif req._add_tokens(ids, lps) or v.done[i]:  # a stop string, an EOS id or the length
                self._release(i, running=not v.done[i])
                eos = req._tokens and req._tokens[-1] in req.eos[req.eos >= 0]
                self._finish(req, "stop" if req._text.stopped or eos else "length")

    def _release(self, slot: int, *, running: bool) -> None:
        with self._cond:
            self._in_slot[slot] = None
            if running:
                self._stop[slot] = True

    def _fail(self, req: Request, error: EngineFailure) -> None:
        req._push(error=error)
        with self._cond:
            self._m.failed += 1

    def _recover(self, error: Exception) -> None:
        """Fails every request in a slot and starts a fresh pool (waiting requests stay queued)."""
        failure = EngineFailure(f"engine: the device loop failed ({type(error).__name__}: {error}); the request "
                                "was lost and the engine restarted its pool")
        with self._cond:
            lost = [r for r in self._in_slot if r is not None]
            self._in_slot = [None] * self.slots
            self._stop[:] = False
            self._seen[:] = 0
            self._m.faults += 1
        for r in lost:
            self._fail(r, failure)
        self._pool = self._fresh_pool()


def choice_seed(seed: int, i: int) -> int:
    """Choice ``i``'s seed of a request with ``seed`` (:meth:`Engine.submit_choices`): ``(seed + i * SEED_STEP)
    mod 2**63``, SEED_STEP the 64-bit golden-ratio constant (an odd step: the n seeds are distinct); choice 0 keeps
    the request's seed, so ``n`` 1 is :meth:`Engine.submit`."""
    return (seed + i * SEED_STEP) % MAX_SEED


def _compile_threads() -> int:
    """The programs :meth:`Engine.start` compiles at once: :data:`COMPILE_THREADS`, at most one per CPU core. XLA's
    compile of one program keeps about 1.5 cores busy, yet two at a time still gained on a 2-core CPU with nothing
    else running (the demo pair's start, costs cached, load average 1-2: 62-66 s, against 73-85 s one at a time);
    while another process takes a core they gain nothing (load average 5: 155 s against 132 s)."""
    return max(1, min(COMPILE_THREADS, os.cpu_count() or 1))


def _token_logprobs(ids: list[int], window, rest, i: int, width: int, top: int) -> list[TokenLogprob]:
    """Slot ``i``'s :class:`TokenLogprob` s of its new ``ids`` from a visit's window (and the rest past it), with
    ``top`` of the pool's alternatives."""
    out = []
    for j, tok in enumerate(ids):
        src, k = (window, j) if j < width else (rest, j - width)
        ids_row, vals_row = src.ids[i, k, :top].tolist(), src.values[i, k, :top].tolist()
        out.append(TokenLogprob(int(tok), float(src.chosen[i, k]), list(zip(ids_row, vals_row, strict=True))))
    return out


class Histogram:
    """Cumulative counts of observations per upper bound in ``bounds``, with their count and sum."""

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(bounds)
        self.counts = [0] * len(self.bounds)
        self.count = 0
        self.sum = 0.0

    def add(self, value: float) -> None:
        self.count += 1
        self.sum += value
        for j, bound in enumerate(self.bounds):
            self.counts[j] += value <= bound

    def snapshot(self) -> dict[str, Any]:
        return {"count": self.count, "sum": self.sum, "buckets": list(zip(self.bounds, self.counts, strict=True))}


class _Metrics:
    """The counters of :meth:`Engine.metrics`."""

    def __init__(self, labels: tuple[str, ...], depth: int):
        self.by_reason = dict.fromkeys(FINISH_REASONS, 0)
        self.failed = self.submitted = self.prompt_tokens = self.generated = 0
        self.prefills = self.prefill_tokens = self.shared_prefills = 0
        self.rounds = self.visits = self.accepted = self.faults = 0
        self.drafts = self.draft_tokens = self.accepted_drafts = 0
        self.accepted_per_pos = np.zeros((depth,), np.int64)
        self.speculates = depth > 0
        self.sizes = dict.fromkeys(labels, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.ttft_samples: collections.deque[float] = collections.deque(maxlen=TTFT_SAMPLES)

    def finished(self, req: Request, reason: str) -> None:
        self.by_reason[reason] += 1
        self.prompt_tokens += len(req.prompt_ids)
        self.generated += len(req._tokens)
        if req.first_token is not None:
            self.ttft.add(req.first_token - req.submitted)
            self.ttft_samples.append(req.first_token - req.submitted)

    def snapshot(self) -> dict[str, Any]:
        return {
            "requests": {**self.by_reason, "failed": self.failed}, "submitted": self.submitted,
            "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated, "prefills": self.prefills,
            "prefill_tokens": self.prefill_tokens, "shared_prefills": self.shared_prefills, "rounds": self.rounds,
            "visits": self.visits, "accepted_tokens": self.accepted,
            "tau": self.accepted / self.rounds if self.rounds else math.nan, "verify_sizes": dict(self.sizes),
            "faults": self.faults, "ttft": self.ttft.snapshot(), "ttft_samples": list(self.ttft_samples),
            "spec_decode": None if not self.speculates else {
                "num_drafts": self.drafts, "num_draft_tokens": self.draft_tokens,
                "num_accepted_tokens": self.accepted_drafts,
                "num_accepted_tokens_per_pos": dict(enumerate(self.accepted_per_pos.tolist()))},
        }


def _limits(cache_size, max_prompt, max_new, scratch: int, max_positions: int) -> tuple[int, int, int]:
    """``(cache_size, max_prompt_tokens, max_new_tokens)`` from the given ones (see :class:`Engine`)."""
    if cache_size is not None:
        cache_size = check_int("cache_size", cache_size, maximum=MAX_SLOTS, unit="number of cache slots (or None)")
    if max_prompt is not None:
        max_prompt = check_int("max_prompt_tokens", max_prompt, maximum=MAX_SLOTS)
    if max_new is not None:
        max_new = check_int("max_new_tokens", max_new, maximum=MAX_SLOTS)
    if cache_size is None:
        max_prompt = DEFAULT_MAX_PROMPT if max_prompt is None else max_prompt
        max_new = DEFAULT_MAX_NEW if max_new is None else max_new
        cache_size = bucket(max_prompt + max_new + scratch)
    else:
        room = cache_size - scratch
        if max_prompt is None and max_new is None:
            max_prompt = room // 2
        if max_prompt is None:
            max_prompt = room - max_new
        if max_new is None:
            max_new = room - max_prompt
        if max_prompt < 1 or max_new < 1 or max_prompt + max_new > room:
            raise ArgumentError(f"cache_size: {cache_size} slots cannot hold max_prompt_tokens {max_prompt} + "
                                f"max_new_tokens {max_new} + {scratch} scratch rows")
    if max_prompt + max_new > max_positions:
        raise ArgumentError(f"max_new_tokens: max_prompt_tokens {max_prompt} + max_new_tokens {max_new} exceed the "
                            f"target's max_position_embeddings ({max_positions})")
    return cache_size, max_prompt, max_new


def _visit_sizes(sizes: Any, slots: int) -> tuple[int, ...]:
    """The visit sizes (see :class:`Engine`), checked: ascending, distinct, from 1 to ``slots``, ending at it."""
    if sizes is None:  # 1, 4, 16, ... up to slots / 4, and slots: each visit size is a program to trace
        return tuple(sorted({4**i for i in range(slots.bit_length()) if 4 * 4**i <= slots} | {1, slots}))
    if isinstance(sizes, str | bytes) or not isinstance(sizes, Sequence) or not sizes:
        raise ArgumentError(f"visit_sizes: expected a list of batch sizes, got {describe(sizes)}")
    out = [check_int(f"visit_sizes[{j}]", v, maximum=slots, unit=f"number of slots (at most slots={slots})")
           for j, v in enumerate(sizes)]
    if out != sorted(set(out)) or out[-1] != slots:
        raise ArgumentError(f"visit_sizes: {out} must be ascending and distinct, and end at slots={slots}")
    return tuple(out)


def _buckets(max_prompt: int, cache_size: int) -> tuple[int, ...]:
    """The prompt buffers admission compiles: powers of two from :data:`MIN_PROMPT_BUCKET` up to the one that
    holds ``max_prompt`` tokens (the last capped at ``cache_size``)."""
    widths = [MIN_PROMPT_BUCKET]
    while widths[-1] < max_prompt:
        widths.append(2 * widths[-1])
    return tuple(dict.fromkeys(min(w, cache_size) for w in widths))


def _check_stop(stop: Any, tokenizer: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if isinstance(items, bytes) or not isinstance(items, Sequence):
        raise ArgumentError(f"stop: expected a string or a list of strings, got {describe(stop)}")
    for j, s in enumerate(items):
        if not isinstance(s, str) or not s:
            raise ArgumentError(f"stop[{j}]: expected a non-empty string, got {describe(s)}")
    if items and tokenizer is None:
        raise ArgumentError("stop: stop strings need the engine's tokenizer (Engine(tokenizer=...))")
    return tuple(items)


__all__ = ["Chunk", "Completion", "Engine", "Request", "choice_seed"]
