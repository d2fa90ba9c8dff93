"""The generation API (sparkjax.engine.api: generate, launch, stream, validate) on its arguments and results.

* Bad arguments are SparkjaxErrors naming the argument (almost all before anything compiles; the few runs share
  two programs: ``ar`` and ``dspark`` on ``P``, 2 new tokens), NaN weights name the round and the sequence.
* Fuzzing: any arguments end in a result or a SparkjaxError, never another exception or a hang.
  ``test_any_arguments_*`` mixes valid values with junk and runs the validation only (the programs stubbed with
  their output shapes); ``test_valid_runs_*`` really generates, on the two programs above.
* On the fixture pair: DeepSpec's rounds reproduced (upstream parity), no transfer to the host during a launch,
  seeded sampling, bad arguments and pairs, fixed shapes sharing one program.

Exactness (greedy == ar, lossless sampling) is tests/test_exactness.py."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import sparkjax
from sparkjax.engine import Options, Tree, api, bucket, checks, costs, generate, launch, parse_method, programs, stream
from sparkjax.engine.round import flag_nonfinite
from sparkjax.nn.drafter import Drafter
from tests.conftest import NEW_LONG

P = [[1, 2, 3], [4, 5, 6]]  # the shape of the bad-argument and fuzzed runs
NEW = NEW_LONG  # the fixture pair's runs: the exactness table's programs
RUN = dict(max_new_tokens=2)


def _all_entry_points(target, drafter, method="dspark", prompts=P, **kw):
    """Calls generate, launch, and (unless given prompt_width / capacity, which they do not take) generate with
    instrument=True and stream with the same arguments; returns the errors."""
    errors = []
    calls = [lambda: generate(target, drafter, prompts, method=method, **kw),
             lambda: launch(target, drafter, prompts, method=method, **kw)]
    if not {"prompt_width", "capacity"} & set(kw):
        calls += [lambda: generate(target, drafter, prompts, method=method, instrument=True, **kw),
                  lambda: stream(target, drafter, prompts, method=method, **kw)]
    for call in calls:
        with pytest.raises(sparkjax.SparkjaxError) as info:
            call()
        errors.append(info.value)
    return errors


def _cases(name, values, words=(), **extra):  # the message starts "name:" (or "name[i]" for a list's entry)
    prefix = name if name in ("widths", "eos_token_ids") else name + ":"
    return [pytest.param({name: v, **extra}, prefix, words, id=f"{name}={type(v).__name__}{repr(v)[:14]}")
            for v in values]


TREE8 = dict(method="sparklingtree-beam@8")
TYPE = ("type problem", "expected an integer")  # and not "longer", "smaller", "shorter"
BOOLS = ("max_new_tokens", "top_c", "temperature", "budget", "cache_size", "capacity", "prompt_width")
BAD = [
    *_cases("seed", [2**63, 2**64, 10**30, -1, 1.0, 0.5, None, True, "1", np.float32(3)]),
    *_cases("options", ["einsum", {"attention": "einsum"}, 1, sparkjax.engine.Options]),
    *_cases("widths", ["44", 8.0, [[4, 4]], [8.0] + [0] * 14, [9, -1] + [0] * 13, [True] * 8, {"a": 1},
                       np.array([[8]]), np.array([8.0] + [0.0] * 14)], **TREE8),
    *_cases("eos_token_ids", ["105"], words=("string '105'",)),  # not split into digits
    *_cases("eos_token_ids", [b"105", [None], [1.0], [105, 2.5], [True], np.array([1.5]), np.array([[1, 2]]),
                              7.0, object()]),
    *_cases("budget", [1e30, 1e6, 10**30, 2**31, float("inf"), float("nan")], method="sparklingtree"),
    *_cases("temperature", [1e39, np.float64(1e39), 1e300, float("inf"), float("nan"), -0.5, 1e-45, 2e4, True,
                            "1.0", None, 10**400]),
    *_cases("top_p", [0, 0.0, -0.1, 1.01, float("nan"), float("inf"), True, "0.9", None], temperature=1.0),
    *_cases("top_k", [-1, 2.0, 1.5, True, "4", None], temperature=1.0),
    *_cases("cache_size", ["64", 10.5, 64.0], words=TYPE),
    *_cases("prompt_width", [3.0, "16"], words=TYPE),
    *_cases("capacity", ["x", 4.0], words=TYPE),
    *[case for name in BOOLS for case in _cases(name, [True, np.bool_(True)], method="sparklingtree")],
]


METHOD_OPTIONS = ("widths", "budget", "top_c")  # fields of the method object, not arguments of generate


@pytest.mark.parametrize("kw,name,words", BAD)
def test_bad_values_are_argument_errors_naming_the_argument(pair, kw, name, words):
    kw = {"method": "dspark", **RUN, **kw}
    options = {k: kw.pop(k) for k in METHOD_OPTIONS if k in kw}
    try:  # a method's options are refused when its object is built, else when the entry points plan it
        kw["method"] = parse_method(kw["method"], **options) if options else kw["method"]
        errors = _all_entry_points(*pair, **kw)
    except sparkjax.ArgumentError as e:
        errors = [e]
    for err in errors:
        msg = str(err)
        assert isinstance(err, sparkjax.ArgumentError) and msg.startswith(name), err
        assert all(w in msg for w in words), msg
        assert words != TYPE or not any(w in msg for w in ("longer", "smaller", "shorter")), msg


def test_good_values_of_other_types_are_fine(pair):
    target, drafter = pair
    for seed in (0, np.int64(7), np.uint64(2**40), 2**63 - 1):
        out = generate(target, None, P, temperature=1.0, seed=seed, **RUN)
        assert [len(t) for t in out.tokens] == [2, 2]
    # jax.random.key alone maps 2**32 onto 0 without 64-bit mode; ours keeps them apart
    assert not np.array_equal(jax.random.key_data(api._key(2**32)), jax.random.key_data(api._key(0)))
    assert np.array_equal(jax.random.key_data(api._key(12345)), jax.random.key_data(jax.random.key(12345)))
    hi = jax.random.fold_in(jax.random.key(5), 3)  # 3 * 2**32 + 5: its high half folded into key(5)
    assert np.array_equal(jax.random.key_data(api._key(3 * 2**32 + 5)), jax.random.key_data(hi))
    api._key(0)
    before = api._seed_key._cache_size()
    for seed in (2**31 + 1, 2**32 - 1, 2**40 + 3, 2**63 - 1):  # one program for every seed: a server compiles none
        api._key(seed)
    assert api._seed_key._cache_size() == before
    depth = drafter.config.block_size - drafter.config.first_draft_slot
    w = np.array([4, 4] + [0] * (depth - 2), np.int64)
    plan = parse_method("sparklingtree-beam", budget=8, widths=w).plan(target, drafter, False)
    assert plan.widths == tuple(int(x) for x in w) and all(type(x) is int for x in plan.widths)
    assert api.eos_array(np.array([105, 3], np.int16), 320).tolist() == [105, 3]
    assert api.eos_array(np.int64(9), 320).tolist() == [9]
    eos = generate(target, None, P, **RUN).tokens[0][0]
    assert generate(target, None, P, eos_token_ids=np.array([eos]), **RUN).tokens[0] == [eos]  # stopped at the EOS
    for t in (0, 0.0, checks.MIN_TEMPERATURE, 1, 0.7, np.float32(0.7), checks.MAX_TEMPERATURE):
        assert checks.check_temperature(t) == float(t)
    assert np.isfinite(np.float32(checks.MAX_TEMPERATURE)) and np.float32(checks.MIN_TEMPERATURE) > 0


def test_cache_smaller_than_the_padded_prompt_names_the_padding(pair):
    target, drafter = pair
    width = bucket(3)
    for method in ("ar", "dspark"):
        with pytest.raises(sparkjax.ArgumentError) as info:
            generate(target, drafter, [[1, 2, 3]], method=method, cache_size=7, max_new_tokens=2)
        msg = str(info.value)
        assert msg.startswith("cache_size:")
        assert f"padded to {width}" in msg and "prompt_width" in msg and f"at least {width}" in msg
    # the advice works: with prompt_width=3 the prompt buffer fits (the cache then is too small for the rest)
    with pytest.raises(sparkjax.ArgumentError, match="cache_size: 7 slots cannot hold prompt 3 \\+ max_new_tokens"):
        generate(target, None, [[1, 2, 3]], cache_size=7, prompt_width=3, max_new_tokens=8)


@pytest.mark.parametrize("method", ["sparklingtree", "ddtree"])
def test_a_million_node_budget_is_refused_with_the_figure(pair, method):
    target, drafter = pair
    with pytest.raises(sparkjax.ArgumentError) as info:
        generate(target, drafter, P, method=f"{method}@1000000", **RUN)
    msg = str(info.value)
    assert msg.startswith("budget: a 1000000-node verify")
    plan = parse_method(method, budget=1_000_000).plan(target, drafter, False)
    est = api.estimate_memory(target, drafter, plan, 2, 16, 2**20, 32)
    assert sum(est.values()) > 2 * 10**12  # the [B, M + 1, M + 1] ancestor mask alone is 2 TB
    assert f"{sum(est.values()) / 2**30:,.0f} GiB" in msg
    limit, where = api.available_memory()
    assert where in msg


def test_available_memory_is_the_device_s_or_the_host_s(monkeypatch):
    if not jax.devices()[0].memory_stats():  # CPU: the host memory
        limit, where = api.available_memory()
        assert limit == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") and "host" in where

    class Dev:
        platform = "gpu"

        def memory_stats(self):
            return {"bytes_limit": 2**30, "bytes_in_use": 2**29}

    monkeypatch.setattr(api.jax, "devices", lambda *a: [Dev()])
    assert api.available_memory() == (2**29, "this gpu device has 0.5 GiB free of 1.0 GiB")


@pytest.mark.parametrize("kw,name", [(dict(cache_size=2**28), "cache_size"),
                                     (dict(capacity=2**28), "capacity"),
                                     (dict(prompt_width=2**24), "prompt_width")])
def test_huge_caches_and_buffers_are_refused_before_compiling(pair, kw, name, monkeypatch):
    target, drafter = pair
    monkeypatch.setattr(api, "available_memory", lambda: (2**31, "this test device has 2.0 GiB"))
    for method in ("ar", "dspark"):
        with pytest.raises(sparkjax.ArgumentError) as info:
            launch(target, drafter, P, method=method, **kw, **RUN)
        msg = str(info.value)
        assert msg.startswith(f"{name}:") and "GiB" in msg and "2.0 GiB" in msg


def test_a_big_batch_names_the_prompts_and_scales_with_the_batch(pair, monkeypatch):
    target, drafter = pair
    plan = parse_method("sparklingtree", budget=64).plan(target, drafter, False)
    one = sum(api.estimate_memory(target, drafter, plan, 1, 16, 256, 32).values())
    many = sum(api.estimate_memory(target, drafter, plan, 64, 16, 256, 32).values())
    assert many == 64 * one
    monkeypatch.setattr(api, "available_memory", lambda: (one * 8, "this test device has a little"))
    with pytest.raises(sparkjax.ArgumentError, match="needs about .*this test device has a little"):
        launch(target, drafter, [[1, 2, 3]] * 64, method="sparklingtree@64", **RUN)


def test_swapped_or_missing_models_are_argument_errors(pair):
    target, drafter = pair
    cases = [((target, target), "drafter", "sparkjax.nn.drafter.Drafter"),
             ((drafter, drafter), "target", "sparkjax.nn.qwen3.Qwen3"),
             ((drafter, target), "target", "sparkjax.nn.qwen3.Qwen3"),
             ((None, drafter), "target", "sparkjax.nn.qwen3.Qwen3"),
             (("model", drafter), "target", "sparkjax.nn.qwen3.Qwen3"),
             ((target, "drafter"), "drafter", "sparkjax.nn.drafter.Drafter")]
    for (t, d), name, expected in cases:
        for err in _all_entry_points(t, d, **RUN):
            assert isinstance(err, sparkjax.ArgumentError)
            assert str(err).startswith(f"{name}:") and expected in str(err)
    with pytest.raises(sparkjax.ArgumentError, match="drafter:.*Drafter"):
        generate(target, target, P, method="ar", **RUN)  # even where the drafter is not used


def test_instrument_and_prompt_ids_must_have_their_types(pair):
    target, drafter = pair
    with pytest.raises(sparkjax.ArgumentError, match="^instrument:"):
        generate(target, drafter, P, method="dspark", instrument="yes", **RUN)
    for bad in (5, "abc", [[1, [2]]], [[1.0, 2.0]], [[True, False]], np.zeros((1, 2, 3), np.int32),
                np.ones((1, 3), np.float32), [[1, None]], [[1, 2**70]], [[-1, 2]], [[]], []):
        with pytest.raises(sparkjax.ArgumentError, match="^prompt_ids"):
            generate(target, None, bad, **RUN)


@pytest.mark.parametrize("change,field", [({"target_layer_ids": [1, 5]}, "target_layer_ids"),
                                          ({"num_target_layers": 8}, "num_target_layers")])
def test_generate_runs_the_pair_check_of_load_drafter(pair, fixture_dir, tmp_path, change, field):
    target, _ = pair
    folder = tmp_path / "drafter"
    shutil.copytree(fixture_dir / "drafter", folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(change)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(sparkjax.IncompatiblePairError, match=field):
        sparkjax.load_drafter(folder, target=target)
    loose = sparkjax.load_drafter(folder)  # loaded without target=: nothing checked yet
    for method in ("dspark", "dflash", "sparklingtree"):
        for err in _all_entry_points(target, loose, method=method, **RUN):
            assert isinstance(err, sparkjax.IncompatiblePairError)
            assert f"{field}:" in str(err) and str(folder) in str(err)


def test_an_in_memory_drafter_is_checked_too(pair):
    target, drafter = pair
    cfg = dataclasses.replace(drafter.config, target_layer_ids=(1, 5))
    bad = nnx.clone(drafter)
    bad.config = cfg
    with pytest.raises(sparkjax.IncompatiblePairError, match="<drafter model>.*target_layer_ids: entry 5 is the "
                                                             "target's final layer"):
        generate(target, bad, P, method="dspark", **RUN)


# ----------------------------------------------------------------------------- non-finite logits


def _poisoned(model, value=np.nan):
    """A copy of ``model`` with one entry of its first MLP down projection set to ``value``."""
    copy = nnx.clone(model)
    proj = copy.layers[0].mlp.down_proj
    nnx.update(proj, jax.tree.map(lambda x: x.at[0, 0].set(value) if x.ndim == 2 else x, nnx.state(proj)))
    assert not np.isnan(np.asarray(model.layers[0].mlp.down_proj.kernel.get_value())).any()  # a real copy
    return copy


def test_nan_weights_raise_with_round_and_sequence(pair):
    target, drafter = pair
    good = generate(target, None, P, **RUN).tokens
    for value in (np.nan, np.inf):
        bad = _poisoned(target, value)
        with pytest.raises(sparkjax.NumericalError, match=r"prefill \(round 0\) of sequence 0 \(2 of 2"):
            generate(bad, None, P, **RUN)
        with pytest.raises(sparkjax.NumericalError, match=r"round 0.*sequence 0"):
            generate(bad, drafter, P, method="dspark", **RUN)
    assert issubclass(sparkjax.NumericalError, sparkjax.SparkjaxError)
    assert issubclass(sparkjax.NumericalError, FloatingPointError)
    # the original is untouched and still fine; launch reports the flags without syncing
    assert generate(target, None, P, **RUN).tokens == good
    flags = launch(_poisoned(target), None, P, **RUN).nonfinite
    assert np.asarray(flags).tolist() == [0, 0]
    res = launch(target, None, P, **RUN)
    assert np.asarray(res.nonfinite).tolist() == [-1, -1] and res.plan.method.name == "ar" and not res.plan.drafts
    assert res.accept_lens.shape == (2, 0) and np.asarray(res.rounds).tolist() == [1, 1]  # ar: one token a round
    spec = launch(target, drafter, P, method="dspark", **RUN)
    assert np.asarray(spec.nonfinite).tolist() == [-1, -1] and spec.plan.method.name == "dspark"
    assert spec.extra is None and spec.labels == () and spec.depth_hits.shape == (2, spec.plan.depth)


@pytest.mark.slow  # two more programs; the default run checks generate's raise above
def test_stream_and_instrumented_runs_raise_on_nan_weights_too(pair):
    target, drafter = pair
    for value in (np.nan, np.inf):
        with pytest.raises(sparkjax.NumericalError, match=r"round 0.*sequence 0"):
            list(stream(_poisoned(target, value), drafter, P, method="dspark", **RUN))
    with pytest.raises(sparkjax.NumericalError, match=r"round 0.*sequence 0"):
        generate(_poisoned(target), drafter, P, method="dspark", instrument=True, **RUN)


def test_the_flag_records_the_first_bad_round(pair):
    """A good prefill, then a round with poisoned weights: round 1 (stream()'s start/step functions); the first
    bad round is kept, a finished sequence is not flagged."""
    target, drafter = pair
    run = api.validate(target, drafter, P, method="dspark", max_new_tokens=2)
    plan, args = run.plan, run.device_args()
    g_good, s_good = programs.split_pair(target, drafter)
    _, s_bad = programs.split_pair(_poisoned(target), drafter)
    state = programs.spec_start(g_good, s_good, *args, run.inputs, plan=plan, cache_size=run.cache_size,
                                buf_len=run.buf_len)
    assert np.asarray(state.nonfinite).tolist() == [-1, -1]
    state = programs.spec_step(g_good, s_bad, state, plan=plan)
    assert np.asarray(state.nonfinite).tolist() == [1, 1]
    with pytest.raises(sparkjax.NumericalError, match="round 1 of sequence 0"):
        api.raise_if_nonfinite(state.nonfinite)
    # the flag names the earliest sequence and skips finished ones
    logits = jnp.zeros((3, 2, 5)).at[2, 1, 4].set(jnp.nan).at[0, 0, 0].set(jnp.inf)
    flags = flag_nonfinite(jnp.array([-1, -1, -1]), logits, jnp.array([False, True, True]), jnp.array(4))
    assert np.asarray(flags).tolist() == [-1, -1, 4]  # sequence 0 was done: not flagged
    flags = flag_nonfinite(jnp.array([-1, 2, 4]), logits, jnp.array([True] * 3), jnp.array(7))
    assert np.asarray(flags).tolist() == [7, 2, 4]  # the first bad round is kept
    with pytest.raises(sparkjax.NumericalError, match=r"round 2 of sequence 1 \(3 of 3"):
        api.raise_if_nonfinite(flags)
    api.raise_if_nonfinite(np.array([-1, -1]))  # all finite: nothing raised


# ----------------------------------------------------------------------------- fuzzing


VOCAB = 320  # the fixture pair's
HANG_SECONDS = 120  # a first compile on a loaded 2-core machine takes well under this
# a longer profile outside CI: SPARKJAX_FUZZ_EXAMPLES=5000 pytest tests/test_api.py -k fuzz
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
PARSE_OPTIONS = ("budget", "top_c", "widths", "normalization")  # parse_method's, for the method object

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
        b = tokens.shape[0]  # built on the host and put on the device: no program per shape
        z = np.zeros((b,), np.int32)
        return jax.device_put((np.zeros((b, buf_len), np.int32), z + 1,
                               np.zeros((b, buf_len if plan.drafts else 0), np.int32), z,
                               np.zeros((b, plan.depth), np.int32), z - 1, None, None))

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
    options = {k: kw.pop(k) for k in PARSE_OPTIONS}

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


# ----------------------------------------------------------------------------- upstream parity, no host sync, seeds


def test_dspark_reproduces_upstream_rounds(pair, ref):
    """DeepSpec's loop runs a round while fewer than max_new tokens precede x_start, so its 64-token run
    equals our 65-token run round for round (ours stops as soon as 64 tokens are out)."""
    target, drafter = pair
    prompt = ref["a.prompt_ids"]
    out = generate(target, drafter, prompt, method="dspark", max_new_tokens=65)
    assert out.acceptance_lengths[0] == ref["c.acceptance_lengths"].tolist()
    assert out.tokens[0][:64] == ref["c.spec_output_ids"][0, prompt.shape[1]:].tolist()
    out64 = generate(target, drafter, prompt, method="dspark", max_new_tokens=64)
    assert out64.tokens[0] == ref["c.spec_output_ids"][0, prompt.shape[1]:].tolist()
    assert out64.acceptance_lengths[0] == ref["c.acceptance_lengths"].tolist()[:-1]
    hits = np.zeros(drafter.config.num_drafts, int)
    for a in out64.acceptance_lengths[0]:
        hits[: a - 1] += 1
    assert out64.accepted_per_depth[0] == hits.tolist()


def test_a_generation_transfers_nothing_to_the_host(pair, fixture_prompts):
    target, drafter = pair
    jax.block_until_ready(launch(target, drafter, fixture_prompts, method="sparklingtree@8", max_new_tokens=NEW))
    with jax.transfer_guard_device_to_host("disallow"):  # the generation itself syncs nothing
        res = jax.block_until_ready(launch(target, drafter, fixture_prompts, method="sparklingtree@8",
                                           max_new_tokens=NEW))
    assert int(np.asarray(res.n).min()) == NEW


def test_sampling_is_seeded(random_pair):
    a, b, c = (generate(*random_pair, [[1, 2, 3]] * 4, method="sparklingtree@6", max_new_tokens=12,
                        temperature=1.0, seed=seed).tokens for seed in (5, 5, 6))
    assert a == b and a != c



# ----------------------------------------------------------------------------- bad input, fixed shapes


def test_bad_arguments(pair):
    target, drafter = pair
    for prompts, kw, words in (
        ([[1] * 50], dict(method="dspark", max_new_tokens=8, cache_size=32), "cache_size"),
        (None, dict(method="dspark", max_new_tokens=2000), "max_new_tokens"),
        (None, dict(method="ddtree@64", max_new_tokens=NEW, cache_size=64), "cache_size.*max_new_tokens"),
        (None, dict(method=Tree("sparklingtree", 10**6, top_c=2)), "budget.*reachable"),
        (None, dict(method="ddtree", drafter=None), "drafter"),
        (None, dict(method=Tree("sparklingtree-beam", 8, widths=(4, 4))), "widths"),
    ):
        kw = {"drafter": drafter, **kw}
        with pytest.raises(sparkjax.ArgumentError, match=words):
            generate(target, kw.pop("drafter"), prompts or [[1, 2, 3]], **kw)


def test_markov_methods_refuse_a_drafter_without_markov_head_and_pairs_must_fit(pair, random_pair, fixture_prompts,
                                                                                fixture_ar):
    target, drafter = pair
    with pytest.raises(sparkjax.IncompatiblePairError, match="vocab"):
        generate(target, random_pair[1], [[1, 2, 3]], method="dflash")
    cfg = dataclasses.replace(drafter.config, markov_rank=0, markov_head_type=None, enable_confidence_head=False,
                              confidence_head_with_markov=False)
    plain = Drafter(cfg, rngs=nnx.Rngs(0))
    for method in ("dspark", "sparklingtree", "sparklingtree-beam", "pctree"):
        with pytest.raises(sparkjax.ArgumentError, match="Markov head"):
            generate(target, plain, [[1, 2, 3]], method=method)
    # the non-Markov methods still work with it, and stay exact
    assert generate(target, plain, fixture_prompts, method="ddtree@8", max_new_tokens=NEW).tokens == fixture_ar


def test_fixed_shapes_share_one_program(pair, fixture_prompts, fixture_ar):
    """prompt_width / capacity pin the shapes: a prefill-only run and a full exact run reuse one program."""
    from sparkjax.engine.programs import spec_program as _spec_program

    target, drafter = pair
    kw = dict(method="dspark", cache_size=256, prompt_width=64, capacity=NEW)
    launch(target, drafter, fixture_prompts, max_new_tokens=NEW, **kw)
    before = _spec_program._cache_size()
    first = generate(target, drafter, [p[:5] for p in fixture_prompts], max_new_tokens=1, **kw)
    assert [len(t) for t in first.tokens] == [1, 1, 1] and first.rounds == [0, 0, 0]
    assert generate(target, drafter, fixture_prompts, max_new_tokens=NEW, **kw).tokens == fixture_ar
    assert _spec_program._cache_size() == before
    with pytest.raises(sparkjax.ArgumentError, match="prompt_width"):
        generate(target, drafter, fixture_prompts, max_new_tokens=8, **{**kw, "prompt_width": 8})
    with pytest.raises(sparkjax.ArgumentError, match="capacity"):
        generate(target, drafter, fixture_prompts, max_new_tokens=2 * NEW, **kw)
