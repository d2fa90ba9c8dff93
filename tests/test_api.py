"""The generation API refuses bad arguments with a SparkjaxError naming the argument (almost all before anything
compiles; the few runs share two programs: ``ar`` and ``dspark`` on ``P``, 2 new tokens)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sparkjax
from sparkjax.engine import api, bucket, checks, generate, launch, parse_method, programs, stream
from sparkjax.engine.round import flag_nonfinite

P = [[1, 2, 3], [4, 5, 6]]  # the shape of every run in this file
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
