"""The serving engine without HTTP: exactness under continuous batching, cancellation, the queue bound, bad
arguments, no compilation after warm-up, recovery from a fault in the device loop, and the n choices of one request
sharing its prompt's prefill."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparkjax import sampling
from sparkjax.engine import Auto, CostTable, generate, parse_method
from sparkjax.errors import ArgumentError, EngineClosedError, EngineFailure, QueueFullError, SparkjaxError
from sparkjax.serve import Chunk, Engine
from sparkjax.serve import engine as serve_engine
from sparkjax.serve.text import TextStream
from tests.conftest import VisitGate

NEW = 24  # the engines' max_new_tokens (and the reference runs' capacity: one program per method)
SLOTS = 3
PROMPTS = [[1, 2, 3, 4, 5], [7, 3], [9, 9, 9, 1, 0, 4, 2, 8], [3], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 1, 2],
           [2, 2], [11, 4, 6, 1], [8, 1, 8, 1, 8, 1, 8]]
LENGTHS = [24, 8, 17, 5, 20, 1, 12, 24]
AUTO_SIZES = (0, "chain", 6)
AUTO_SECONDS = (1.0, 1.3, 1.6)  # every size viable
SAMPLED = ("sparklingtree@16", "dspark", "ar")  # the engines built with sampling (the others: greedy programs only)


@pytest.fixture(autouse=True)
def no_cache_dir(monkeypatch):
    monkeypatch.setenv("SPARKJAX_CACHE_DIR", "off")


def _method(pair, name):
    if name == "auto":
        labels = Auto(sizes=AUTO_SIZES).resolve(pair[1]).labels()
        return Auto(sizes=AUTO_SIZES, table=CostTable(labels, AUTO_SECONDS))
    return parse_method(name)


@pytest.fixture(scope="module")
def engines(random_pair):
    """One started engine per method (built on first use), closed at the end of the module."""
    built = {}

    def get(name):
        if name not in built:
            target, drafter = random_pair
            eng = Engine(target, None if name == "ar" else drafter, method=_method(random_pair, name), slots=SLOTS,
                         max_prompt_tokens=16, max_new_tokens=NEW, rounds_per_visit=1, queue_limit=8,
                         sampling=name in SAMPLED, visit_sizes=(2, SLOTS))  # one slot runs padded with a free one
            with pytest.MonkeyPatch.context() as mp:  # two programs compile at once, whatever the machine
                mp.setattr(serve_engine, "_compile_threads", lambda: 2)
                eng.start()
            built[name] = eng
        return built[name]

    yield get
    for eng in built.values():
        eng.close(grace_s=0)


@pytest.fixture(scope="module")
def solo(random_pair):
    """``generate``'s tokens for one prompt alone (cached)."""
    target, drafter = random_pair

    @functools.cache
    def tokens(name, prompt, n):
        d = None if name == "ar" else drafter
        return generate(target, d, [list(prompt)], method=_method(random_pair, name), max_new_tokens=n,
                        capacity=NEW).tokens[0]

    return lambda name, prompt, n: tokens(name, tuple(prompt), n)


@pytest.mark.slow  # the default run joins requests at different times over HTTP (tests/test_serve_http.py)
@pytest.mark.parametrize("name", ["sparklingtree@16", "auto", "dspark", "ar"])
def test_greedy_tokens_equal_solo_generate_whenever_a_request_joins(engines, solo, name):
    """A long request runs; another joins after each of its rounds (one round per visit), so requests enter at
    every round offset and share the pool with up to two others; each one's tokens are generate's alone."""
    eng = engines(name)
    first = eng.submit(PROMPTS[0], max_new_tokens=NEW)
    joined = []
    for j, chunk in enumerate(first):
        assert isinstance(chunk, Chunk)
        if 1 + j < len(PROMPTS):
            joined.append((PROMPTS[1 + j], LENGTHS[1 + j], eng.submit(PROMPTS[1 + j], max_new_tokens=LENGTHS[1 + j])))
    assert len(joined) >= 3  # enough rounds that several requests joined while it ran
    res = first.result(timeout=120)
    assert res.finish_reason == "length" and res.token_ids == solo(name, PROMPTS[0], NEW)
    for prompt, n, req in joined:
        out = req.result(timeout=120)
        assert out.token_ids == solo(name, prompt, n), (prompt, n)
        assert out.finish_reason == "length" and out.completion_tokens == n and out.prompt_tokens == len(prompt)
    m = eng.metrics()
    assert m["active_slots"] == 0 and m["queue_length"] == 0 and m["requests"]["failed"] == 0
    assert sum(m["verify_sizes"].values()) == m["rounds"] > 0


@pytest.mark.slow  # a cancelled HTTP stream frees its slot: tests/test_serve_http.py
def test_cancel_frees_the_slot_for_a_waiting_request(engines, solo):
    name = "sparklingtree@16"
    eng = engines(name)
    running = [eng.submit(p, max_new_tokens=NEW) for p in PROMPTS[:SLOTS]]  # every slot taken
    waiting = eng.submit(PROMPTS[4], max_new_tokens=10)
    dropped = eng.submit(PROMPTS[5], max_new_tokens=10)
    dropped.cancel()  # cancelled while it waits
    stream = iter(running[1])
    next(stream)  # running: it has a slot
    running[1].cancel()
    last = list(stream)[-1] if not running[1].done else None
    res = running[1].result(timeout=120)
    assert res.finish_reason == "cancelled" and (last is None or last.finish_reason == "cancelled")
    assert res.completion_tokens < NEW and res.token_ids == solo(name, PROMPTS[1], NEW)[: res.completion_tokens]
    assert dropped.result(timeout=120).finish_reason == "cancelled"
    assert waiting.result(timeout=120).token_ids == solo(name, PROMPTS[4], 10)
    for p, r in zip(PROMPTS[:SLOTS], running, strict=True):
        if r is not running[1]:
            assert r.result(timeout=120).token_ids == solo(name, p, NEW)
    m = eng.metrics()
    assert m["requests"]["cancelled"] >= 2 and m["active_slots"] == 0


@pytest.mark.slow  # the default run checks both over HTTP (tests/test_serve_http.py)
def test_no_compilation_after_start_and_async_streams(engines, solo, caplog):
    """Requests with keys of every kind (the high half zero or not), read together by ``async for``, compile
    nothing and stream generate's tokens."""
    eng = engines("sparklingtree@16")
    refs = [solo("sparklingtree@16", p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]  # compiled before
    seeds = itertools.cycle([None, 7, 2**31 + 1, 2**40 + 3])

    async def collect():
        reqs = [eng.submit(p, max_new_tokens=n, seed=next(seeds)) for p, n in zip(PROMPTS, LENGTHS, strict=True)]

        async def read(r):
            return [c async for c in r]

        return await asyncio.gather(*map(read, reqs))

    x = jnp.ones(3)
    caplog.set_level(logging.WARNING, logger="jax")
    with jax.log_compiles():
        streams = asyncio.run(collect())
        jax.jit(lambda x: x * 5)(x)  # the log works: this one compiles
    for chunks, ref in zip(streams, refs, strict=True):
        assert [t for c in chunks for t in c.token_ids] == ref
        assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling")]
    assert any("jit(<lambda>)" in m for m in logged)
    assert [m for m in logged if "<lambda>" not in m] == []


@pytest.mark.slow  # the default run checks both over HTTP (tests/test_serve_http.py)
def test_a_fault_in_the_device_loop_fails_in_flight_requests_and_the_engine_recovers(engines, solo, monkeypatch):
    eng = engines("sparklingtree@16")
    real = eng._visit_call
    calls = []

    def faulty(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected device fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(eng, "_visit_call", faulty)
    victims = [eng.submit(p, max_new_tokens=NEW) for p in PROMPTS[:2]]
    for r in victims:
        with pytest.raises(EngineFailure, match="RuntimeError: injected device fault"):
            r.result(timeout=120)
        with pytest.raises(EngineFailure):
            list(r)
    assert isinstance(EngineFailure("x"), SparkjaxError)
    ref = solo("sparklingtree@16", PROMPTS[2], NEW)  # then a request is served exactly, up to its own EOS id
    out = eng.submit(PROMPTS[2], max_new_tokens=NEW, eos_token_ids=[ref[5]]).result(timeout=120)
    assert out.finish_reason == "stop" and out.token_ids == ref[: ref.index(ref[5]) + 1]
    m = eng.metrics()
    assert m["faults"] == 1 and m["requests"]["failed"] >= 2


def test_auto_streams_at_every_visit_and_no_visit_runs_more_than_its_rounds(engines, solo):
    """auto's plain steps run in bursts (one round of auto, many plain steps): a pool's visit stops a burst at its
    ``rounds_per_visit`` rounds, so a stream gets new tokens at every host visit (with this table the random
    pair's auto takes plain steps; one round per visit here), and its tokens are still the target's own."""
    eng = engines("auto")
    real, rounds = eng._visit_call, []

    def visit(*args):
        pool, v = real(*args)
        rounds.append(int(v.rounds.max()))
        return pool, v

    eng._visit_call = visit
    try:
        chunks = list(eng.submit(PROMPTS[0], max_new_tokens=NEW, eos_token_ids=[]))
    finally:
        eng._visit_call = real
    sizes = [len(c.token_ids) for c in chunks]
    assert [t for c in chunks for t in c.token_ids] == solo("ar", PROMPTS[0], NEW)
    assert max(rounds) <= eng.rounds_per_visit == 1, rounds
    assert max(sizes) <= eng.rounds_per_visit * (eng.plan.depth + 1) and len(sizes) > NEW // (eng.plan.depth + 1)
    assert eng.metrics()["verify_sizes"]["ar"] > 0  # plain steps, which ran in bursts before


def _idle(eng, timeout: float = 60.0) -> None:
    """Waits until no slot of ``eng`` is taken and nothing waits (a finished request's slot is free already; a
    cancelled one's at the next visit)."""
    deadline = time.monotonic() + timeout
    while (m := eng.metrics())["active_slots"] or m["queue_length"]:
        assert time.monotonic() < deadline, m
        time.sleep(0.01)


def _shared(eng, before: dict) -> tuple[int, int, int]:
    """(prefills, prefill tokens, shared prefills) since the metrics ``before``."""
    m = eng.metrics()
    return tuple(m[k] - before[k] for k in ("prefills", "prefill_tokens", "shared_prefills"))


@pytest.mark.parametrize("name", ["ar", "dspark"])
def test_n_seeded_choices_share_one_prefill_and_each_is_its_own_seeds_request(engines, name, caplog):
    """n sampled choices with a seed, queued together while every slot is free: one prefill and n - 1 copies of
    its slot (``pool_fork``, warmed by the start: nothing compiles), and choice i's tokens are exactly those of a
    request of its own with ``choice_seed(seed, i)`` (each of those prefilled alone): the copy's first token and
    every later draw are what an admission with that key gives."""
    eng = engines(name)
    prompt, seed = PROMPTS[2], 7
    _idle(eng)
    before = eng.metrics()
    x = jnp.ones(3)
    caplog.set_level(logging.WARNING, logger="jax")
    with jax.log_compiles():
        with eng._cond:  # the scheduler admits them in one pass
            reqs = eng.submit_choices(prompt, n=3, max_new_tokens=NEW, temperature=1.0, seed=seed, eos_token_ids=[])
        outs = [r.result(timeout=120) for r in reqs]
        jax.jit(lambda x: x * 5)(x)  # the log works: this one compiles
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling")]
    assert any("jit(<lambda>)" in m for m in logged)
    assert [m for m in logged if "<lambda>" not in m] == []
    assert _shared(eng, before) == (1, len(prompt), 2)
    assert [r.index for r in reqs] == [0, 1, 2]
    assert [r.seed for r in reqs] == [serve_engine.choice_seed(seed, i) for i in range(3)] and reqs[0].seed == seed
    alone = [eng.submit(prompt, max_new_tokens=NEW, temperature=1.0, seed=serve_engine.choice_seed(seed, i),
                        eos_token_ids=[]).result(timeout=120) for i in range(3)]
    assert _shared(eng, before) == (4, 4 * len(prompt), 2)  # each alone: a prefill of its own
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    assert len({tuple(o.token_ids) for o in outs}) == 3  # three seeds, three samples
    assert all(o.finish_reason == "length" and o.completion_tokens == NEW for o in outs)


def _wait(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


@pytest.mark.parametrize("name", ["auto", "ar"])
def test_n_greedy_choices_are_ars_tokens_and_those_past_the_free_slots_prefill_later(engines, solo, name):
    """Five greedy choices on three slots: the first takes a prefill and two copies of its slot; one cancelled
    while it waits ends with nothing and the others go on; once the prefilled choice is cancelled (its copies
    keep running on what it wrote), the last waiting choice takes its slot with a prefill of its own. Every choice
    that runs gets ``ar``'s greedy tokens (the target's own), identical across the choices."""
    eng = engines(name)
    prompt = PROMPTS[0]
    want = solo("ar", prompt, NEW)
    _idle(eng)
    before = eng.metrics()
    with VisitGate(eng) as gate:
        with eng._cond:
            reqs = eng.submit_choices(prompt, n=5, max_new_tokens=NEW, eos_token_ids=[])
            reqs[1].cancel()  # cancelled while it waits
        _wait(lambda: eng.metrics()["active_slots"] == SLOTS, "choices 0, 2 and 3 admitted")
        assert _shared(eng, before) == (1, len(prompt), 2) and eng.metrics()["queue_length"] == 1
        assert reqs[1].result(timeout=60).finish_reason == "cancelled" and reqs[1].result().token_ids == []
        reqs[0].cancel()  # the choice whose slot was copied
        cancelled = reqs[0].result(timeout=60)
        _wait(lambda: eng.metrics()["queue_length"] == 0, "choice 4 admitted")
        assert _shared(eng, before) == (2, 2 * len(prompt), 2)
        gate.open = True
        outs = [reqs[i].result(timeout=120) for i in (2, 3, 4)]
    assert cancelled.finish_reason == "cancelled" and cancelled.token_ids == want[: len(cancelled.token_ids)]
    assert [r.index for r in reqs] == list(range(5))
    for o in outs:
        assert o.token_ids == want and o.finish_reason == "length" and o.prompt_tokens == len(prompt)
    m = eng.metrics()
    assert m["active_slots"] == 0 and m["requests"]["failed"] == 0


def test_n_choices_queue_all_or_none(random_pair, monkeypatch):
    """``submit_choices`` queues its n choices together or not at all: QueueFullError with nothing queued when
    fewer than n places are left; ``n`` over ``queue_limit`` (it could never be queued) and a non-integer ``n``
    are ArgumentErrors naming ``n``; choice i's seed is ``choice_seed(seed, i)``, distinct, choice 0's the seed."""
    target, _ = random_pair
    eng = Engine(target, None, method="ar", slots=SLOTS, max_prompt_tokens=16, max_new_tokens=NEW, queue_limit=4,
                 sampling=False)
    monkeypatch.setattr(eng, "start", lambda: 0.0)  # no scheduler: nothing compiles, nothing leaves the queue
    three = eng.submit_choices([1, 2], n=3, max_new_tokens=4, seed=2**63 - 1)
    assert [r.index for r in three] == [0, 1, 2] and eng.metrics()["queue_length"] == 3
    seeds = [r.seed for r in three]
    assert seeds[0] == 2**63 - 1 and len(set(seeds)) == 3 and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [serve_engine.choice_seed(2**63 - 1, i) for i in range(3)]
    with pytest.raises(QueueFullError, match="3 requests are waiting .*no room for 2 choices"):
        eng.submit_choices([1, 2], n=2, max_new_tokens=4)
    assert eng.metrics()["queue_length"] == 3 and eng.metrics()["submitted"] == 3  # nothing of it queued
    for bad, match in ((5, "n: 5 choices exceed this engine's queue_limit=4"), (0, "n: must be >= 1"),
                       (2.0, "n: expected an integer"), (True, "n: expected an integer")):
        with pytest.raises(ArgumentError, match=match):
            eng.submit_choices([1, 2], n=bad, max_new_tokens=4)
    with pytest.raises(ArgumentError, match="prompt_ids"):  # the request's own checks, before any is queued
        eng.submit_choices([], n=1, max_new_tokens=4)
    last = eng.submit_choices([1, 2], n=1, max_new_tokens=4)  # the last place
    assert len(last) == 1 and eng.metrics()["queue_length"] == 4
    eng.close()  # never started: the waiting requests are cancelled
    assert all(r.result(timeout=10).finish_reason == "cancelled" for r in three + last)


def test_bad_requests_and_a_full_queue(random_pair):
    target, drafter = random_pair
    # requests are checked on submit: this engine is never started and compiles nothing
    eng = Engine(target, drafter, method="sparklingtree@16", slots=SLOTS, max_prompt_tokens=16, max_new_tokens=NEW)
    bad = [
        (dict(prompt_ids=list(range(1, 16)) + [1, 2]), "prompt_ids: 17 tokens exceed .* 16 prompt tokens"),
        (dict(prompt_ids=[]), "prompt_ids: empty"),
        (dict(prompt_ids="hello"), "prompt_ids"),
        (dict(prompt_ids=[1, 99]), r"prompt_ids: token id 99 is outside \[0, 16\)"),
        (dict(prompt_ids=[1, 2.5]), r"prompt_ids\[1\]"),
        (dict(max_new_tokens=0), r"max_new_tokens: 0 is outside \[1, 24\]"),
        (dict(max_new_tokens=25), r"max_new_tokens: 25 is outside \[1, 24\]"),
        (dict(max_new_tokens=2.0), "max_new_tokens: expected an integer"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=1e9), "temperature"),
        (dict(seed=-3), "seed"),
        (dict(eos_token_ids="3"), "eos_token_ids"),
        (dict(eos_token_ids=list(range(8))), "eos_token_ids: 8 ids"),
        (dict(stop=[3]), r"stop\[0\]"),
        (dict(stop=["x"]), "stop: stop strings need the engine's tokenizer"),
    ]
    for kw, match in bad:
        args = {"prompt_ids": [1, 2], "max_new_tokens": 4, **kw}
        with pytest.raises(ArgumentError, match=match):
            eng.submit(args.pop("prompt_ids"), **args)
    eng.close()
    sizes = [(dict(slots=4, visit_sizes=v), "visit_sizes") for v in ([1, 2], [2, 1, 4], "4", [0, 4])]
    cache = (dict(cache_size=32, max_prompt_tokens=30), "cache_size: 32 slots cannot hold")
    for kw, match in [(dict(slots=0), "slots"), *sizes, cache]:
        with pytest.raises(ArgumentError, match=match):
            Engine(target, drafter, method="dspark", **kw)
    none_waiting = Engine(target, drafter, method="dspark", queue_limit=0, max_prompt_tokens=16, max_new_tokens=8)
    with pytest.raises(QueueFullError, match="queue_limit=0"):
        none_waiting.submit([1, 2], max_new_tokens=4)
    none_waiting.close()
    with pytest.raises(EngineClosedError):
        none_waiting.submit([1, 2], max_new_tokens=4)


def test_progress_lines_give_counts_and_the_time_left(caplog):
    """A start's phases (loading, profiling auto's points, compiling) log each step with its count and, from the
    second step, the time left at the pace so far."""
    from sparkjax import progress

    now = [0.0]
    caplog.set_level(logging.INFO, logger="sparkjax.test")
    p = progress.Progress(logging.getLogger("sparkjax.test"), "compiling", 3, "program", clock=lambda: now[0])
    for name in ("a", "b", "c"):
        p.begin(name)
        now[0] += 10.0  # each step takes 10 s
        p.end()
    # steps of a kind: each estimated at its kind's mean once one of them has finished
    p = progress.Progress(logging.getLogger("sparkjax.test"), "profiling", 3, "point", kinds=["x", "y", "y"],
                          clock=lambda: now[0])
    for name, seconds in (("a", 2.0), ("b", 30.0), ("c", 30.0)):
        p.begin(name)
        now[0] += seconds
        p.end()
    lines = [r.getMessage() for r in caplog.records if r.name == "sparkjax.test"]  # not other tests' threads
    assert lines == ["compiling: program 1 of 3 (a); the estimate follows the first",
                     "compiling: program 2 of 3 (b); 10.0 s so far, about 20 s left",
                     "compiling: program 3 of 3 (c); 20.0 s so far, about 10 s left",
                     "compiling: 3 programs in 30.0 s",
                     "profiling: point 1 of 3 (a); the estimate follows the first",
                     "profiling: point 2 of 3 (b); 2.0 s so far, about 4 s left",
                     "profiling: point 3 of 3 (c); 32.0 s so far, about 30 s left",
                     "profiling: 3 points in 62.0 s"]


def test_progress_of_steps_run_two_at_a_time(caplog):
    """Steps that run concurrently (the start's compiles): each begins with its kind and ends by its token, in any
    order; the time left is the work left (the steps not begun, and what the running ones have left) divided by the
    steps run at once."""
    from sparkjax import progress

    now = [0.0]
    caplog.set_level(logging.INFO, logger="sparkjax.test2")
    p = progress.Progress(logging.getLogger("sparkjax.test2"), "compiling", 4, "program", kinds=["p", "v", "v", "a"],
                          clock=lambda: now[0], workers=2)
    t = p.begin("pool", kind="p")
    now[0] += 2.0
    p.end(t)
    first = p.begin("v1", kind="v")  # left: v, v, a at the mean so far (2 s each), two at a time
    now[0] += 1.0
    second = p.begin("v2", kind="v")  # left: v2 and a (2 s each) and v1's last second, two at a time
    now[0] += 9.0
    p.end(second)  # v2 took 9 s, v1 is still running
    now[0] += 1.0
    assert p.left() == pytest.approx(5.5 / 2)  # a at the mean (5.5 s); v1 past its kind's 9 s: nothing left
    p.end(first)  # v1 took 11 s
    p.begin("reader", kind="a")  # nothing of its kind finished: the mean of all three (2, 9, 11)
    now[0] += 1.0
    p.end()
    lines = [r.getMessage() for r in caplog.records if r.name == "sparkjax.test2"]
    assert lines == ["compiling: program 1 of 4 (pool); the estimate follows the first",
                     "compiling: program 2 of 4 (v1); 2.0 s so far, about 3 s left",
                     "compiling: program 3 of 4 (v2); 3.0 s so far, about 2 s left",
                     "compiling: program 4 of 4 (reader); 13.0 s so far, about 4 s left",
                     "compiling: 4 programs in 14.0 s (2 at a time)"]


class _Letters:
    """A tokenizer stand-in: id i decodes to chr(97 + i); id 0 is special (skipped)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i) for i in ids if not (skip_special_tokens and i == 0))


def test_text_stream_holds_back_and_cuts_at_stop_strings():
    s = TextStream(_Letters(), stop=["dc"])
    assert s.push([1, 2]) == "b"  # "c" may start "dc"... held back (one char: len("dc") - 1)
    assert s.push([0, 3]) == "c"
    assert s.push([2, 5]) == "" and s.stopped and s.text == "bc"
    assert s.kept == 1 and s.ids == [1, 2, 0, 3, 2]  # the ids end at the one that completed "dc"
    # the first stop string completed wins, even one that begins later in the text
    s = TextStream(_Letters(), stop=["bcdef", "d"])
    assert s.push([1, 2, 3, 4, 5, 6]) == "bc" and s.kept == 3 and s.ids == [1, 2, 3]
    plain = TextStream(_Letters())
    assert plain.push([1, 2]) + plain.push([3]) + plain.finish() == "bcd"
    assert TextStream(None).push([1]) == ""


def test_per_sequence_keys_draw_each_row_as_alone():
    """A batch with a key and a temperature per row draws row b exactly as the single-key sampler does for row b
    alone (so each row is that lossless sampler, whatever shares the batch)."""

    @jax.jit
    def inputs():  # one program for the random inputs, returned to the host (the keys as their raw data)
        keys = jax.random.split(jax.random.key(3), 4)
        logits = 3 * jax.random.normal(jax.random.key(1), (4, 3, 16))
        drafts = jax.random.randint(jax.random.key(5), (4, 3), 0, 16)
        draft_logits = 3 * jax.random.normal(jax.random.key(2), (4, 3, 16))
        target_logits = 3 * jax.random.normal(jax.random.key(4), (4, 4, 16))
        return jax.random.key_data(keys), logits, drafts, draft_logits, target_logits, sampling.first_argmax(logits[0])

    keys, logits, drafts, draft_logits, target_logits, greedy = (np.asarray(x) for x in inputs())
    t = np.array([0.0, 0.5, 1.0, 2.0], np.float32)
    # one program per shape (the batch, one row), the keys rebuilt from their data inside
    pick = jax.jit(lambda logits, t, keys: sampling.pick(logits, t, jax.random.wrap_key_data(keys)))
    chain = jax.jit(lambda target, draft, drafts, t, keys: sampling.speculative_chain(
        target, draft, drafts, t, jax.random.wrap_key_data(keys)))
    batch = np.asarray(pick(logits, t, keys))
    for b in range(4):
        assert (batch[b] == np.asarray(pick(logits[b : b + 1], t[b], keys[b]))[0]).all()
    assert (batch[0] == greedy).all()  # temperature 0: greedy
    acc, nxt = (np.asarray(x) for x in chain(target_logits, draft_logits, drafts, t + 0.5, keys))
    for b in range(4):
        one = chain(target_logits[b : b + 1], draft_logits[b : b + 1], drafts[b : b + 1], t[b] + 0.5, keys[b])
        assert (int(acc[b]), int(nxt[b])) == tuple(int(np.asarray(x)[0]) for x in one)


@pytest.mark.slow
@pytest.mark.parametrize("name", SAMPLED)
def test_a_seeded_request_gets_the_same_tokens_alone_and_in_a_busy_pool(engines, solo, name):
    eng = engines(name)
    prompt = PROMPTS[0]
    alone = eng.submit(prompt, max_new_tokens=NEW, temperature=1.0, seed=7).result(timeout=120).token_ids
    assert eng.submit(prompt, max_new_tokens=NEW, temperature=1.0, seed=8).result(timeout=120).token_ids != alone
    greedy = eng.submit(PROMPTS[1], max_new_tokens=NEW)  # greedy and sampled requests share the pool
    first = iter(greedy)
    next(first)
    again = eng.submit(prompt, max_new_tokens=NEW, temperature=1.0, seed=7)
    others = [eng.submit(p, max_new_tokens=10, temperature=0.7, seed=s) for s, p in enumerate(PROMPTS[2:5])]
    assert again.result(timeout=120).token_ids == alone
    assert greedy.result(timeout=120).token_ids == solo(name, PROMPTS[1], NEW)
    assert all(r.result(timeout=120).finish_reason == "length" for r in others)


def test_a_pool_profiles_auto_per_active_count_and_interpolates(random_pair, monkeypatch):
    """A pool's auto table: at 1, half and all slots active, the table of the smallest visit size that holds
    them, each visit size profiled once with all of its batch running (a round costs what its batch costs),
    interpolated linearly in between; the seconds the rounds get have a row per active count."""
    from sparkjax.engine import costs

    target, drafter = random_pair
    seen = []

    def fake(t, d, plan, batches, cache_size, **kw):
        seen.append(list(batches))
        return [costs.CostTable(plan.method.labels(), (1.0, 1.0 + b, 1.0 + 2 * b),
                                key=costs.cost_key(t, d, plan, b, cache_size)) for b in batches]

    monkeypatch.setattr(costs, "profile_points", fake)
    eng = Engine(target, drafter, method=Auto(sizes=AUTO_SIZES), slots=5, max_prompt_tokens=16, max_new_tokens=NEW,
                 sampling=False, visit_sizes=(1, 2, 4, 5))
    table = eng.plan.method.table
    assert isinstance(table, costs.PoolCostTable) and table.counts == (1, 3, 5)
    assert seen == [[1, 4, 5]]  # one profile per visit size used, all at once
    assert [(dict(t.key)["batch"], dict(t.key).get("active")) for t in table.tables] == [(1, None), (4, None),
                                                                                          (5, None)]
    s = table.seconds
    assert s.shape == (6, 3)
    assert s[:, 1].tolist() == [2.0, 2.0, 3.5, 5.0, 5.5, 6.0]  # row 0 is row 1's; 2 and 4 interpolated
    assert eng._inputs.seconds.shape == (6, 3)
    with pytest.raises(ArgumentError, match="counts"):
        costs.PoolCostTable(5, (2, 5), table.tables[:2])
    with pytest.raises(ArgumentError, match="table: a PoolCostTable for 5 slots, but this run has 3 sequences"):
        Engine(target, drafter, method=Auto(sizes=AUTO_SIZES, table=table), slots=3, max_prompt_tokens=16,
               max_new_tokens=NEW, sampling=False)


def test_auto_in_a_pool_decides_from_the_active_slots(random_pair, solo):
    """Drafting pays with one active slot and not with all of them (the pool table says so): a request alone
    drafts, four that run together take plain steps only; both get generate's tokens."""
    from sparkjax.engine import costs

    target, drafter = random_pair
    sizes = (0, "chain")
    labels = Auto(sizes=sizes).resolve(drafter).labels()
    cheap, dear = CostTable(labels, (1.0, 1.0)), CostTable(labels, (1.0, 50.0))
    method = Auto(sizes=sizes, decide="draft", table=costs.PoolCostTable(4, (1, 2, 4), (cheap, dear, dear)))
    eng = Engine(target, drafter, method=method, slots=4, max_prompt_tokens=16, max_new_tokens=NEW,
                 rounds_per_visit=4, sampling=False)
    eng.start()
    real, widths = eng._visit_call, []

    def visit(stop, rounds, hot, rows):  # the batch each visit's rounds ran at
        widths.append(len(rows) if rounds else 0)
        return real(stop, rounds, hot, rows)

    eng._visit_call = visit
    try:
        alone = eng.submit(PROMPTS[0], max_new_tokens=NEW, eos_token_ids=[]).result(timeout=120)
        first = eng.metrics()["verify_sizes"]
        assert set(widths) - {0} == {1}  # one active slot: its rounds ran at batch 1, not the pool's 4
        widths.clear()
        assert first[labels[1]] > 0  # drafted rounds
        with eng._cond:  # all four are admitted in the same visit
            reqs = [eng.submit(p, max_new_tokens=8, eos_token_ids=[]) for p in PROMPTS[1:5]]
        outs = [r.result(timeout=120) for r in reqs]
        m = eng.metrics()
        after = m["verify_sizes"]
    finally:
        eng.close(grace_s=0)
    # the rounds count what they committed (the drafted request's last round cut at max_new): each request's
    # tokens are its prefill's one plus its rounds'
    assert m["generated_tokens"] == NEW + 4 * 8 == m["accepted_tokens"] + 5
    assert 4 in widths and set(widths) <= {0, 1, 2, 4}
    assert after[labels[1]] == first[labels[1]]  # four active: plain steps only
    assert after[labels[0]] - first[labels[0]] == 4 * 7  # a plain step per slot per token after the first
    # vLLM's speculation counters: a draft is a drafted round (the chain's: depth tokens); accepted drafts are what
    # the rounds committed past their one bonus token, counted per depth
    spec, depth = m["spec_decode"], eng.plan.depth
    assert spec["num_drafts"] == after[labels[1]] and spec["num_draft_tokens"] == depth * spec["num_drafts"]
    per_pos = [spec["num_accepted_tokens_per_pos"][d] for d in range(depth)]
    assert spec["num_accepted_tokens"] == sum(per_pos) == m["accepted_tokens"] - m["rounds"]
    assert per_pos == sorted(per_pos, reverse=True)
    assert alone.token_ids == solo("ar", PROMPTS[0], NEW)
    for p, o in zip(PROMPTS[1:5], outs, strict=True):
        assert o.token_ids == solo("ar", p, 8)
