"""Method ``auto``, host side: its cost table (:class:`CostTable`), measured by :func:`profile`, saved and
loaded as JSON, and kept per process and per machine (:func:`table_for`; docs/auto.md, "Cost tables").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import statistics
import time
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import cachedir
from ..errors import ArgumentError, CostTableError, SparkjaxError
from ..io.atomic import atomic_file
from ..progress import Progress, run_threads
from .checks import bucket, check_int, describe
from .programs import merge_pair, program, spec_start, split_pair
from .state import Plan

log = logging.getLogger("sparkjax.auto")

FORMAT = "sparkjax-cost-table"
PROFILE_ROUNDS = 8  # rounds per timed call of profile_costs (inside one jitted loop, like a generation's)
PROFILE_BURST = 32  # plain steps in the one burst that times the plain step
PROFILE_NEW_TOKENS = 128  # the generation length whose cache profile_costs sizes by default
PROFILE_THREADS = 2  # the most batch sizes pool_table_for compiles at once (see profile_threads)


@dataclasses.dataclass(frozen=True)
class CostTable:
    """Seconds per round of each candidate of an ``auto`` method, measured on one device at one shape:
    ``labels`` (``Auto.labels()``), ``seconds`` (the median round time of each), ``best`` (the fastest) and
    ``key`` (:func:`cost_key`, as ``(name, value)`` pairs)."""

    labels: tuple[str, ...]
    seconds: tuple[float, ...]
    best: tuple[float, ...] = ()
    key: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        if len(self.labels) != len(self.seconds) or not self.labels:
            raise ArgumentError(f"seconds: {len(self.seconds)} times for {len(self.labels)} candidates")
        for lab, s in zip(self.labels, self.seconds, strict=True):
            if not isinstance(s, int | float) or not np.isfinite(s) or s <= 0:
                raise ArgumentError(f"seconds: candidate {lab!r} has a round time {describe(s)}; expected > 0")

    @property
    def key_dict(self) -> dict[str, Any]:
        return dict(self.key)

    def as_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": 1, "key": self.key_dict,
                "candidates": [{"label": lab, "seconds": s, "best": b}
                               for lab, s, b in zip(self.labels, self.seconds, self.best or self.seconds,
                                                    strict=True)]}

    def save(self, path: str | os.PathLike) -> None:
        """Writes the table as JSON (atomically)."""
        with atomic_file(path) as tmp, open(tmp, "w") as f:
            json.dump(self.as_dict(), f, indent=1)

    def __str__(self) -> str:
        rows = [f"{lab:>18s} {1e3 * s:9.3f} ms/round" for lab, s in zip(self.labels, self.seconds, strict=True)]
        return "\n".join(rows)


@dataclasses.dataclass(frozen=True)
class PoolCostTable:
    """An ``auto`` method's round times in a pool of ``slots`` sequences by how many of them are active: a
    :class:`CostTable` profiled at each of ``counts`` (1 and ``slots`` among them, ascending), linearly
    interpolated in between (:attr:`seconds` ``[slots + 1, K]``, row ``a`` for ``a`` active slots; row 0 is
    row 1's). ``sparkjax.serve.Engine`` binds one (:func:`pool_table_for`)."""

    slots: int
    counts: tuple[int, ...]
    tables: tuple[CostTable, ...]

    def __post_init__(self):
        c = tuple(self.counts)
        if not c or c[0] != 1 or c[-1] != self.slots or list(c) != sorted(set(c)) or len(c) != len(self.tables):
            raise ArgumentError(f"counts: {list(c)} for {len(self.tables)} tables; expected ascending counts from 1 "
                                f"to slots={self.slots}, one per table")
        if len({t.labels for t in self.tables}) != 1:
            raise ArgumentError("tables: their candidates differ")

    @property
    def labels(self) -> tuple[str, ...]:
        return self.tables[0].labels

    @property
    def seconds(self) -> np.ndarray:
        known = np.asarray([t.seconds for t in self.tables], np.float64)  # [len(counts), K]
        a = np.arange(self.slots + 1).clip(1)
        return np.stack([np.interp(a, self.counts, known[:, k]) for k in range(known.shape[1])], axis=1)

    def rows(self) -> list[tuple[float, ...]]:
        """The round times at each active count 1..slots."""
        return [tuple(map(float, r)) for r in self.seconds[1:]]

    def __str__(self) -> str:
        return "\n".join(f"{a} active of {self.slots}:\n{t}" for a, t in zip(self.counts, self.tables, strict=True))


def _tuple(v):
    return tuple(_tuple(x) for x in v) if isinstance(v, list | tuple) else v


def cost_key(target, drafter, plan: Plan, batch: int, cache_size: int, active: int | None = None
             ) -> tuple[tuple[str, Any], ...]:
    """What a cost table's times depend on: the JSON key, and the key of the process's and the machine's
    caches (another device kind, platform, jax version, shape or trace-time option profiles again;
    ``active``: only that many of the ``batch`` sequences running, the rest done)."""
    tc, dc, o = target.config, drafter.config, plan.options
    dev = jax.devices()[0]
    m = plan.method  # an Auto (sparkjax.engine.adaptive): its candidates and options
    # the trace-time options as JSON-friendly values (a callable attention by its name)
    attention = o.attention if isinstance(o.attention, str) else getattr(o.attention, "__qualname__",
                                                                         type(o.attention).__name__)
    try:
        dtype = str(np.dtype(target.dtype))
    except (AttributeError, TypeError):
        dtype = "float32"
    return (
        ("device", f"{dev.platform}:{dev.device_kind}"),
        ("jax", jax.__version__),
        ("batch", int(batch)),
        *((("active", int(active)),) if active is not None else ()),
        ("cache_size", int(cache_size)),
        ("target", (tc.vocab_size, tc.hidden_size, tc.intermediate_size, tc.num_hidden_layers,
                    tc.num_attention_heads, tc.num_key_value_heads, tc.head_dim)),
        ("drafter", (dc.kind, dc.hidden_size, dc.num_hidden_layers, dc.block_size, dc.markov_rank)),
        ("dtype", dtype),
        ("sampling", bool(plan.sampling)),
        ("decide", m.decide),
        ("candidates", tuple(m.labels())),
        ("top_c", int(plan.top_c)),
        ("options", (attention, o.chain_mode, o.candidate_chain_passes, o.union_top_k, o.block_slots)
                    + (() if o.gpu_loop == "command_buffer" else (o.gpu_loop,))),  # the default keeps older keys
    )


def read_table(path: str | os.PathLike, key: tuple[tuple[str, Any], ...] | None = None) -> CostTable:
    """The table :meth:`CostTable.save` wrote to ``path``; with ``key``, its key must be that one.
    :class:`~sparkjax.errors.CostTableError` naming the file (and the key) otherwise."""
    name = os.fspath(path)
    try:
        with open(name) as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a sparkjax cost table (no 'format': '{FORMAT}')")
        have = tuple((k, _tuple(v)) for k, v in data["key"].items())
        cands = data["candidates"]
        table = CostTable(tuple(str(c["label"]) for c in cands), tuple(float(c["seconds"]) for c in cands),
                          tuple(float(c.get("best", c["seconds"])) for c in cands), have)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ArgumentError) as e:
        raise CostTableError(f"cost table {name}: unreadable ({type(e).__name__}: {e})") from None
    found = table.key_dict
    for k, v in key or ():
        if k not in found or found[k] != v:
            raise CostTableError(f"cost table {name}: key {k!r} is {found.get(k, '<missing>')!r}, this run "
                                 f"needs {v!r} (profile again with sparkjax.profile_costs)")
    return table


@program(static_argnames=("graphdefs", "plan"))
def forced_rounds(graphdefs, states, start, force, rounds, *, plan):
    """``rounds`` (traced: one program times every count, none included) rounds of candidate ``force`` in a loop,
    each from ``start``'s lengths (the state is carried, so nothing is dead code, but every round verifies at the
    same place in the cache)."""
    target, drafter = merge_pair(graphdefs, states)

    def body(_, s):
        s = dataclasses.replace(s, extra=dataclasses.replace(s.extra, force=force))
        s = plan.method.round(target, drafter, s, plan)
        return dataclasses.replace(
            s, cache=s.cache.with_lengths(start.cache.lengths),
            ctx=dataclasses.replace(s.ctx, lengths=start.ctx.lengths), n=start.n, done=start.done,
            rounds=start.rounds)

    return jax.lax.fori_loop(0, rounds, body, start)


class Profiler:
    """One point of :func:`profile` in stages: :meth:`compile_programs` (threads may compile several points at
    once), then :meth:`warm` (every candidate run once) and :meth:`measure` (the timing), each alone
    (:func:`profile_points`)."""

    def __init__(self, target, drafter, plan: Plan, *, batch_size: int = 1, cache_size: int | None = None,
                 prompt_length: int = 16, temperature: float | None = None, repeats: int = 5, seed: int = 0,
                 active: int | None = None, pair: tuple | None = None):
        batch_size = check_int("batch_size", batch_size)
        prompt_length = check_int("prompt_length", prompt_length)
        self.repeats = check_int("repeats", repeats)
        if active is not None and not 1 <= check_int("active", active) <= batch_size:
            raise ArgumentError(f"active: {active} running sequences of a batch of {batch_size}; expected 1 to "
                                f"{batch_size}")
        spec = dataclasses.replace(plan.method, table=None, viable=None, floor=None)
        plan = dataclasses.replace(plan, method=spec)  # unbound: every size viable, equal costs (each size is forced)
        if temperature is None:
            temperature = 1.0 if plan.sampling else 0.0
        if cache_size is None:
            cache_size = bucket(prompt_length + PROFILE_NEW_TOKENS + plan.scratch)
        cache_size = check_int("cache_size", cache_size)
        if cache_size < prompt_length + plan.scratch + 1:
            raise ArgumentError(f"cache_size: {cache_size} slots cannot hold a {prompt_length}-token prompt and a "
                                f"round's {plan.scratch} scratch rows")
        self.plan, self.seed, self.prompt_length, self.temperature = plan, seed, prompt_length, temperature
        self.batch_size, self.cache_size, self.active = batch_size, cache_size, active
        # ``pair``: split_pair(target, drafter) once for every point (threads share it)
        self.graphdefs, self.states = split_pair(target, drafter) if pair is None else pair
        self.key = cost_key(target, drafter, plan, batch_size, cache_size, active)
        self._target, self._drafter = target, drafter
        self.start = self.burst = None
        self.warm_s = None  # seconds of the warm-up's pass over every candidate (after the compile)
        k = len(spec.sizes)
        self.k = k
        self.plain = spec.sizes.index(0) if 0 in spec.sizes and spec.decide == "previous" else -1

    def _prepare(self) -> None:
        """The start state (after the prefill program) and the burst's."""
        plan, batch_size = self.plan, self.batch_size
        rng = np.random.default_rng(self.seed)
        vocab = self._target.config.vocab_size
        tokens = jnp.asarray(rng.integers(0, vocab, (batch_size, bucket(self.prompt_length))), jnp.int32)
        lengths = jnp.full((batch_size,), self.prompt_length, jnp.int32)
        max_new, eos, temp = jnp.int32(2**20), jnp.asarray([-1], jnp.int32), jnp.float32(self.temperature)
        buf_len = bucket(plan.depth + 2, 1)
        # equal costs, fresh memory: every size is forced in turn
        _, inputs = plan.method.bind(plan, target=self._target, drafter=self._drafter, batch=batch_size,
                                     cache_size=self.cache_size, measure=False)
        start = spec_start(self.graphdefs, self.states, tokens, lengths, max_new, eos, temp,
                           jax.random.key(self.seed), inputs, plan=plan, cache_size=self.cache_size, buf_len=buf_len)
        if self.active is not None:
            start = dataclasses.replace(start, done=start.done | (jnp.arange(batch_size) >= self.active))
        # the steady state: a drafted round that is not a probe, and a plain step inside a burst
        zero = jnp.zeros((), jnp.int32)
        start = dataclasses.replace(start, extra=dataclasses.replace(start.extra, idle=zero,
                                                                     gap=jnp.ones((), jnp.int32)))
        self.start = start
        self.burst = dataclasses.replace(start, extra=dataclasses.replace(start.extra, gap=jnp.int32(PROFILE_BURST)))

    def _call(self, i: int, rounds: int) -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(forced_rounds(self.graphdefs, self.states, self.burst if i == self.plain else self.start,
                                            jnp.int32(i), jnp.int32(rounds), plan=self.plan))
        return time.perf_counter() - t0

    def _once(self, i: int) -> float:
        """Seconds per round (per step of the burst for the plain step), less the call's own overhead (a call
        of no round, timed next to it); a difference that is not positive (a busy machine) keeps the whole."""
        rounds, steps = (1, PROFILE_BURST) if i == self.plain else (PROFILE_ROUNDS, PROFILE_ROUNDS)
        whole = self._call(i, rounds)
        net = whole - self._call(i, 0)
        return (net if net > 0 else whole) / steps

    def compile_programs(self) -> Profiler:
        """Compiles (once per shape in a process) and runs the prefill, and compiles the forced rounds with a
        call of no round: one program for every candidate and count of rounds."""
        cachedir.enable_compilation_cache()
        self._prepare()
        self._call(0, 0)
        return self

    def warm(self) -> Profiler:
        """Runs every candidate once (after :meth:`compile_programs`), as one repetition of :meth:`measure`
        does; :attr:`warm_s` is the seconds that pass took."""
        if self.start is None:
            self.compile_programs()
        t0 = time.perf_counter()
        for i in range(self.k):
            self._once(i)
        self.warm_s = time.perf_counter() - t0
        return self

    def measure(self) -> CostTable:
        """``repeats`` interleaved repetitions of every candidate (after :meth:`warm`): the median and the
        fastest of each."""
        if self.warm_s is None:
            self.warm()
        times: list[list[float]] = [[] for _ in range(self.k)]
        for _ in range(self.repeats):
            for i in range(self.k):
                times[i].append(self._once(i))
        return CostTable(tuple(self.plan.method.labels()), tuple(float(statistics.median(t)) for t in times),
                         tuple(float(min(t)) for t in times), self.key)


def profile(target, drafter, plan: Plan, *, batch_size: int = 1, cache_size: int | None = None,
            prompt_length: int = 16, temperature: float | None = None, repeats: int = 5, seed: int = 0,
            active: int | None = None) -> CostTable:
    """Times one round of each candidate of ``plan``'s ``auto`` method on the current device (public entry point:
    :func:`sparkjax.engine.api.profile_costs`): after a prefill of ``batch_size`` random prompts (the first
    ``active`` running; default ``cache_size``: a :data:`PROFILE_NEW_TOKENS`-token generation's; default
    ``temperature``: 1 for a sampling plan), one program runs :data:`PROFILE_ROUNDS` forced rounds of a candidate
    (the plain step: a burst of :data:`PROFILE_BURST`); ``repeats`` interleaved repetitions after a warm-up, each
    less a call of no round, give the median (and the fastest) per candidate (:class:`Profiler`).
    """
    return Profiler(target, drafter, plan, batch_size=batch_size, cache_size=cache_size, prompt_length=prompt_length,
                    temperature=temperature, repeats=repeats, seed=seed, active=active).warm().measure()


def profile_points(target, drafter, plan: Plan, batches: Sequence[int], cache_size: int, *, workers: int = 1,
                   progress: str = "profiling auto's round costs", **kw) -> list[CostTable]:
    """:func:`profile` at each batch size of ``batches`` (all sequences running; ``kw``: :class:`Profiler`'s other
    options), in two stages logged as ``progress``: every point's programs compiled, ``workers`` points at a time
    (XLA compiles with the GIL released), then each point warmed up and timed in turn, alone (no compile runs
    beside a warm-up or a timing)."""
    batches = list(batches)
    pair = split_pair(target, drafter)
    profilers = [Profiler(target, drafter, plan, batch_size=b, cache_size=cache_size, pair=pair, **kw)
                 for b in batches]
    workers = max(1, min(int(workers), len(profilers)))
    compiling = Progress(log, f"{progress}: compiling", len(profilers), "batch size", workers=workers)

    def build(p: Profiler) -> Profiler:
        token = compiling.begin(f"batch {p.batch_size}, {p.k} candidates", kind=None)
        p.compile_programs()
        compiling.end(token)
        return p

    run_threads(build, [(p,) for p in profilers], workers, "sparkjax-profile")
    timing = Progress(log, f"{progress}: warming up and timing", len(profilers), "batch size")
    tables = []
    for p in profilers:
        t0 = time.perf_counter()
        p.warm()  # one pass over the candidates, alone: each repetition of the timing is one more
        timing.begin(f"batch {p.batch_size}, {p.k} candidates x {p.repeats} repetitions, about "
                     f"{p.repeats * p.warm_s:.0f} s at its warm-up's pace")
        table = p.measure()
        log.info("batch %d warmed up and timed in %.1f s: %s", p.batch_size, time.perf_counter() - t0,
                 ", ".join(f"{lab} {1e3 * t:.2f} ms" for lab, t in zip(table.labels, table.seconds, strict=True)))
        timing.end()  # the phase's total comes after the last size's times
        tables.append(table)
    return tables


_TABLES: dict[tuple, CostTable] = {}  # the process's tables, by cost_key


def _cached(key: tuple) -> CostTable | None:
    """The table of ``key``: the process's, else the one in the machine's cache folder (a damaged file: a warning
    and None), else None."""
    if key in _TABLES:
        return _TABLES[key]
    path = _path(key)
    if path is None or not path.exists():
        return None
    try:
        table = read_table(path, key)
    except CostTableError as e:
        warnings.warn(f"ignoring a damaged cost table cache file, profiling again: {e}", stacklevel=4)
        return None
    _TABLES[key] = table
    return table


def _keep(key: tuple, table: CostTable) -> CostTable:
    """Keeps a profiled ``table`` in the process and in the machine's cache folder (when it can write there)."""
    path = _path(key)
    if path is not None:
        try:
            table.save(path)
        except (OSError, SparkjaxError) as e:  # a read-only cache folder: the process still has the table
            warnings.warn(f"could not write the cost table cache file {path}: {e}", stacklevel=4)
    _TABLES[key] = table
    return table


def _path(key: tuple):
    folder = cachedir.subdir("costs")  # None: caching is off
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return None if folder is None else folder / f"{digest}.json"


def table_for(target, drafter, plan: Plan, batch: int, cache_size: int, active: int | None = None) -> CostTable:
    """The table of an ``auto`` run of ``plan`` at this batch and cache size (``active``: with only that many
    sequences running): the process's, else the one in the machine's cache folder, else profiled now (and kept in
    both)."""
    key = cost_key(target, drafter, plan, batch, cache_size, active)
    table = _cached(key)
    if table is None:
        t0 = time.perf_counter()
        log.info("profiling auto's round costs (batch %d%s, %d candidates)", batch,
                 "" if active is None else f", {active} active", len(plan.method.labels()))
        table = profile(target, drafter, plan, batch_size=batch, cache_size=cache_size, active=active)
        log.info("profiled in %.1f s: %s", time.perf_counter() - t0,
                 ", ".join(f"{lab} {1e3 * t:.2f} ms" for lab, t in zip(table.labels, table.seconds, strict=True)))
        table = _keep(key, table)
    return table


def pool_counts(slots: int) -> tuple[int, ...]:
    """The active counts a pool of ``slots`` profiles at: 1, ``slots`` and, from 4 slots, the midpoint."""
    return tuple(sorted({1, slots} | ({(slots + 1) // 2} if slots >= 4 else set())))


def profile_threads() -> int:
    """The batch sizes :func:`pool_table_for` compiles at once: :data:`PROFILE_THREADS`, at most one per CPU
    core."""
    return max(1, min(PROFILE_THREADS, os.cpu_count() or 1))


def pool_table_for(target, drafter, plan: Plan, slots: int, cache_size: int, counts: tuple[int, ...] | None = None,
                   sizes: tuple[int, ...] | None = None) -> PoolCostTable:
    """The :class:`PoolCostTable` of a pool of ``slots`` sequences whose rounds run at the batch ``sizes``
    (default: ``slots`` only): at each active count ``a`` of ``counts`` (default :func:`pool_counts`), the table
    of the smallest size that holds ``a``, profiled with all of that batch running. A round costs what its batch
    costs, however many of it are running: the free rows compute as the others do (no loop of a round stops
    early while one sequence runs), so one profile per batch size serves every count it holds (docs/auto.md).
    The sizes not in the process or the cache folder are profiled together (:func:`profile_points`)."""
    counts = pool_counts(slots) if counts is None else tuple(counts)
    sizes = tuple(sizes or (slots,))
    batches = [min(s for s in sizes if s >= a) for a in counts]
    keys = {b: cost_key(target, drafter, plan, b, cache_size) for b in sorted(set(batches))}
    found = {b: _cached(k) for b, k in keys.items()}
    missing = [b for b, t in found.items() if t is None]
    if len(missing) < len(found):
        log.info("auto's round costs at batch %s: read from the cache folder",
                 ", ".join(str(b) for b, t in found.items() if t is not None))
    if missing:
        log.info("profiling auto's round costs at batch %s (%d candidates, for active counts %s of %d slots)",
                 ", ".join(map(str, missing)), len(plan.method.labels()), ", ".join(map(str, counts)), slots)
        tables = profile_points(target, drafter, plan, missing, cache_size, workers=profile_threads())
        for b, table in zip(missing, tables, strict=True):
            found[b] = _keep(keys[b], table)
    return PoolCostTable(slots, counts, tuple(found[b] for b in batches))
