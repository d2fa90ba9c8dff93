"""Fuzzing the generation API: any arguments end in a result or a SparkjaxError, never another exception or a hang.
``test_any_arguments_*`` mixes valid values with junk and runs the validation only (the programs stubbed with their
output shapes); ``test_valid_runs_*`` really generates, on test_api_robust.py's two programs."""

from __future__ import annotations

import contextlib
import os
import signal

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import sparkjax
from sparkjax.engine import Options, api, checks, costs, programs
from sparkjax.engine.methods import parse_method

VOCAB = 320  # the fixture pair's
HANG_SECONDS = 120  # a first compile on a loaded 2-core machine takes well under this
# a longer profile outside CI: SPARKJAX_FUZZ_EXAMPLES=5000 pytest tests/test_fuzz_generate.py
EXAMPLES = int(os.environ.get("SPARKJAX_FUZZ_EXAMPLES", "300"))


class Hang(Exception):
    pass


def outcome(call):
    """``("ok", result)`` or ``("error", the SparkjaxError)``; anything else, or no answer within HANG_SECONDS,
    fails the test."""
    def alarm(signum, frame):
        raise Hang(f"no answer after {HANG_SECONDS} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(HANG_SECONDS)
    try:
        return "ok", call()
    except sparkjax.SparkjaxError as e:
        assert str(e), "an error must say something"
        return "error", e
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# ----------------------------------------------------------------------------- strategies

junk = st.one_of(
    st.none(), st.booleans(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**70), 2**70),
    st.text(max_size=4), st.binary(max_size=3), st.lists(st.integers(-5, 400), max_size=3),
    st.just(object()), st.just(np.float32(1.5)), st.just(np.bool_(True)), st.just(np.array([[1]])),
    st.just(np.array([2.0])), st.just({"a": 1}), st.just(b"\x00"), st.just(1 + 2j),
)


def np_ints(strategy):
    return st.one_of(strategy, strategy.map(np.int64), strategy.map(np.uint32))


good_prompts = st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6), min_size=1, max_size=3)

# coherent, mostly valid arguments (some combinations still fail, e.g. a cache too small for a big tree)
VALID = {
    "method": st.sampled_from(sparkjax.METHODS),
    "max_new_tokens": np_ints(st.integers(1, 8)),
    "seed": np_ints(st.integers(0, 2**32 - 1)) | st.integers(0, 2**63 - 1),
    "temperature": st.sampled_from([0.0, 0, 0.7, 1]) | st.floats(checks.MIN_TEMPERATURE, checks.MAX_TEMPERATURE),
    "eos_token_ids": st.one_of(st.none(), np_ints(st.integers(0, VOCAB - 1)),
                               st.lists(st.integers(0, VOCAB - 1), max_size=3),
                               hnp.arrays(st.sampled_from([np.int32, np.int64, np.uint16]), st.integers(0, 3),
                                          elements=st.integers(0, VOCAB - 1))),
    "cache_size": st.none() | np_ints(st.integers(64, 512)),
    "prompt_width": st.none() | np_ints(st.integers(6, 64)),
    "capacity": st.none() | np_ints(st.integers(8, 64)),
    "normalization": st.sampled_from(["fast", "exact"]),
    "budget": st.none() | np_ints(st.integers(1, 64)),
    "top_c": st.none() | np_ints(st.integers(8, 64)),
    "widths": st.none(),
    "options": st.none() | st.just(Options(attention="einsum", chain_mode="fixed_point")),
}
TREE_ONLY = ("budget", "top_c", "widths")
METHOD_OPTIONS = ("budget", "top_c", "widths", "normalization")  # parse_method's, for the method object

# what replaces an argument when it is mutated: junk and edge values of the right type
WILD = {
    "method": junk | st.sampled_from(["AR", "tree", ""]),
    "max_new_tokens": junk | st.integers(-2, 0) | st.integers(10**3, 10**20),
    "seed": junk | st.integers(-(2**70), -1) | st.integers(2**63, 2**70),
    "temperature": junk | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([1e39, 1e-45, 1e5, -1.0, 1e4, 1e-6, 10**400]),
    "eos_token_ids": junk | st.lists(st.one_of(st.integers(-2, VOCAB + 2), junk), max_size=3)
    | hnp.arrays(st.sampled_from([np.float64, np.bool_, np.int8]), hnp.array_shapes(min_dims=0, max_dims=2)),
    "cache_size": junk | st.integers(-1, 70) | st.integers(2**20, 2**40),
    "prompt_width": junk | st.integers(-1, 6) | st.integers(2**20, 2**40),
    "capacity": junk | st.integers(-1, 8) | st.integers(2**20, 2**40),
    "normalization": junk,
    "options": junk | st.just(Options),
    "budget": junk | st.integers(-1, 0) | st.integers(10**5, 10**40),
    "top_c": junk | st.integers(-1, 2) | st.integers(10**5, 10**40),
    "widths": junk | st.lists(st.integers(-2, 70), max_size=17).map(tuple)
    | hnp.arrays(st.sampled_from([np.int64, np.float32]), st.integers(0, 17), elements=st.integers(-1, 5)),
    "prompt_ids": junk | st.lists(st.lists(st.integers(-3, VOCAB + 3), max_size=6), max_size=3)
    | st.lists(st.integers(0, VOCAB - 1), max_size=5)
    | hnp.arrays(st.sampled_from([np.int8, np.int32, np.int64, np.uint64, np.float32, np.bool_]),
                 hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)),
}


@st.composite
def arguments(draw):
    """Valid arguments for a random method, then 0 to 3 of them (or the prompts) replaced by wild values."""
    kw = {name: draw(strategy) for name, strategy in VALID.items()}
    if kw["method"] not in sparkjax.engine.TREE_METHODS:
        for name in TREE_ONLY:
            kw[name] = None
    prompt_ids = draw(good_prompts)
    for name in draw(st.lists(st.sampled_from(sorted(WILD)), max_size=3, unique=True)):
        if name == "prompt_ids":
            prompt_ids = draw(WILD[name])
        else:
            kw[name] = draw(WILD[name])
    return kw, prompt_ids


# ----------------------------------------------------------------------------- validation fuzz (stubbed programs)


@contextlib.contextmanager
def stubbed_programs():
    def spec(graphdefs, states, tokens, lengths, max_new, eos, temperature, key, inputs, *, plan, cache_size,
             buf_len, mesh=None):
        b = tokens.shape[0]
        z = jnp.zeros((b,), jnp.int32)
        return (jnp.zeros((b, buf_len), jnp.int32), z + 1, jnp.zeros((b, buf_len if plan.drafts else 0), jnp.int32),
                z, jnp.zeros((b, plan.depth), jnp.int32), z - 1, None, None)

    def table(target, drafter, plan, batch, cache_size):  # auto: no profiling
        labels = plan.method.labels()
        return costs.CostTable(labels, tuple(1.0 + 0.1 * i for i in range(len(labels))))

    def instrumented(target, drafter, run):
        return api.GenerateOutput([[0]] * run.prompts.batch, [[1]] * run.prompts.batch)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(programs, "spec_program", spec)
        mp.setattr(api, "_instrumented", instrumented)
        mp.setattr(costs, "table_for", table)
        yield


MODELS = st.sampled_from(["pair"] * 12 + ["no-drafter", "swapped", "target-twice", "none"])


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(args=arguments(), which=MODELS, entry=st.sampled_from(["generate", "instrument", "launch", "stream"]))
def test_any_arguments_give_a_result_or_a_sparkjax_error(pair, args, which, entry):
    kw, prompt_ids = args
    t, d = pair
    target, drafter = {"pair": (t, d), "no-drafter": (t, None), "swapped": (d, t), "target-twice": (t, t),
                       "none": (None, d)}[which]
    if entry == "stream":
        kw = {k: v for k, v in kw.items() if k not in ("prompt_width", "capacity")}
    options = {k: kw.pop(k) for k in METHOD_OPTIONS}

    def run(fn, **extra):  # the method object of the name and its options, then the entry point (both may refuse)
        method = kw["method"]
        if any(v is not None for v in options.values()) or options["normalization"] != "fast":
            method = parse_method(method, **options)
        return fn(target, drafter, prompt_ids, **{**kw, "method": method}, **extra)

    calls = {
        "generate": lambda: run(api.generate),
        "instrument": lambda: run(api.generate, instrument=True),
        "launch": lambda: run(api.launch),
        "stream": lambda: run(api.stream),
    }
    with stubbed_programs():
        kind, value = outcome(calls[entry])
    event(kind if kind == "ok" else str(value).split(":")[0].split("[")[0])
    if kind == "ok" and entry != "stream":
        # what passed validation is sane: the arguments the programs would have received
        assert isinstance(kw["max_new_tokens"], int | np.integer) and not isinstance(kw["max_new_tokens"], bool)
        assert 1 <= kw["max_new_tokens"] <= target.config.max_position_embeddings
        assert isinstance(kw["seed"], int | np.integer) and 0 <= kw["seed"] < 2**63
        t = float(kw["temperature"])
        assert t == 0 or checks.MIN_TEMPERATURE <= t <= checks.MAX_TEMPERATURE
        assert not isinstance(kw["eos_token_ids"], str | bytes)


def test_the_validation_fuzz_reaches_both_outcomes(pair):  # valid draws pass validation, junk does not
    target, drafter = pair
    with stubbed_programs():
        assert outcome(lambda: api.generate(target, drafter, [[1, 2]], method="sparklingtree@8",
                                               max_new_tokens=3, eos_token_ids=np.array([5]), seed=np.int64(3),
                                               temperature=0.5))[0] == "ok"
        assert outcome(lambda: api.generate(target, drafter, [[1, 2]], method="dspark", seed=1.5))[0] == "error"


# ----------------------------------------------------------------------------- real runs on pinned shapes


def _row(n):
    return st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n)


@pytest.fixture(scope="module")
def ar_reference(pair):
    cache: dict = {}

    def greedy(prompt_ids, max_new, eos):
        key = (str(prompt_ids), max_new, str(eos))
        if key not in cache:
            cache[key] = api.generate(pair[0], None, prompt_ids, max_new_tokens=max_new, eos_token_ids=eos,
                                         prompt_width=16, capacity=2).tokens
        return cache[key]

    return greedy


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.tuples(st.integers(1, 14), st.integers(1, 14)),
    data=st.data(),
    method=st.sampled_from(["ar", "dspark"]),
    max_new=np_ints(st.integers(1, 2)),
    eos=st.one_of(st.none(), st.integers(0, VOCAB - 1), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=1)),
    temperature=st.one_of(st.just(0.0), st.floats(0.1, 2.0)),
    seed=st.integers(0, 2**63 - 1) | st.integers(0, 2**63 - 1).map(np.uint64),
)
def test_valid_runs_return_sane_tokens(pair, ar_reference, lengths, data, method, max_new, eos, temperature, seed):
    """Two prompts of up to 14 tokens, up to 2 new tokens, one EOS at most; greedy runs equal the target's greedy
    tokens (sampling only for ``ar``: a sampling speculative plan would compile another program)."""
    target, drafter = pair
    if method != "ar":
        temperature = 0.0
    prompt_ids = [data.draw(_row(n)) for n in lengths]
    as_array = data.draw(st.booleans()) and lengths[0] == lengths[1]
    if as_array:
        prompt_ids = np.array(prompt_ids, data.draw(st.sampled_from([np.int32, np.int64, np.uint16])))
    kind, out = outcome(lambda: api.generate(
        target, drafter, prompt_ids, method=method, max_new_tokens=max_new, eos_token_ids=eos,
        temperature=temperature, seed=seed, prompt_width=16, capacity=2))
    assert kind == "ok", out
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    max_new = int(max_new)
    for toks, lens in zip(out.tokens, out.acceptance_lengths, strict=True):
        assert 1 <= len(toks) <= max_new and all(0 <= t < VOCAB for t in toks)
        assert all(t not in eos_ids for t in toks[:-1])  # cut right after an EOS
        assert 1 + sum(lens) == len(toks)  # the rounds count what they committed (cut at EOS or max_new)
    if temperature == 0:
        rows = [list(map(int, r)) for r in prompt_ids]
        assert out.tokens == ar_reference(rows, max_new, eos)
