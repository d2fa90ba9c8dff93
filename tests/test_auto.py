"""Method ``auto``: the policy, nested best-first prefixes, the switch branches' layouts, exactness, no host sync,
the cost table (profile, save, load) and bad input."""

from __future__ import annotations

import dataclasses
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparkjax
from sparkjax import tree
from sparkjax.engine import Auto, CostTable, generate, launch, load_cost_table, parse_method, policy, profile_costs
from sparkjax.engine import auto as auto_mod
from sparkjax.engine.api import validate
from sparkjax.engine.programs import spec_program, spec_start, split_pair
from sparkjax.errors import ArgumentError, CostTableError, SparkjaxError
from tests.test_decode import _random_pair

PROMPTS3 = [[1, 2, 3, 4, 5], [7, 3], [9, 9, 9, 1, 0, 4, 2, 8]]
SIZES = (0, "chain", 2, 6, 16)


@pytest.fixture(scope="module")
def random_pair():
    return _random_pair()


def _table(pair, sizes=SIZES, seconds=None, **kw) -> CostTable:
    labels = Auto(sizes=sizes, **kw).resolve(pair[1]).labels()
    return CostTable(labels, tuple(seconds or [1.0 + 0.1 * i for i in range(len(labels))]))


# ----------------------------------------------------------------------------- the policy and the predictions


def test_policy_picks_most_tokens_per_cost_on_hand_made_tables():
    costs = np.array([1.0, 1.5, 2.0, 4.0])  # ar, chain, tree@8, tree@64
    # a confident drafter: the big tree commits 9 tokens for 4x the cost of a plain step
    assert int(policy(np.array([1.0, 3.0, 5.0, 9.0]), costs)) == 2  # 2.5 tokens per unit beats 2.25 and 2.0
    assert int(policy(np.array([1.0, 3.0, 5.0, 12.0]), costs)) == 3
    # a hopeless drafter: the plain step wins
    assert int(policy(np.array([1.0, 1.2, 1.5, 2.0]), costs)) == 0
    # per sequence: summed over the active ones only
    per_seq = np.array([[1.0, 4.0, 4.0, 4.0], [1.0, 1.0, 1.0, 1.0]])
    assert int(policy(per_seq, costs)) == 1
    assert int(policy(per_seq, costs, active=np.array([False, True]))) == 0
    # a candidate that is not allowed is never picked; ties go to the first
    assert int(policy(np.array([1.0, 1.2, 1.5, 2.0]), costs, allowed=np.array([False, True, True, True]))) == 1
    assert int(policy(np.array([2.0, 2.0]), np.array([1.0, 1.0]))) == 0
    # jit-able, same answer
    assert int(jax.jit(policy)(np.array([1.0, 3.0, 5.0, 12.0]), costs)) == 3


def test_shadow_chain_is_scored_against_the_committed_tokens():
    """A probe's unverified chain, scored by the leading drafts equal to the tokens committed at their places:
    only once its places are committed (or its sequence is done, or a probe needs the slot), and into the
    chain's calibration only."""
    m = Auto(sizes=(0, "chain", 4))
    c = m.sizes.index("chain")
    out = jnp.asarray([[5, 6, 7, 8, 9, 0, 0, 0], [5, 6, 7, 8, 9, 1, 2, 0], [1, 2, 3, 4, 5, 6, 7, 8]], jnp.int32)
    st = auto_mod.AutoState(
        choices=jnp.zeros((3, 8), jnp.int32), real=jnp.zeros((3,)), pred=jnp.zeros((3,)), last=jnp.zeros((3, 3)),
        idle=jnp.int32(0), force=jnp.int32(-1), gap=jnp.int32(4),
        shadow=jnp.asarray([[6, 7, 0], [6, 7, 9], [9, 9, 9]], jnp.int32), shadow_at=jnp.asarray([1, 1, 2], jnp.int32),
        shadow_pred=jnp.asarray([2.0, 3.0, 1.0]), shadow_live=jnp.asarray([True, True, False]))

    def state(n, done):
        return types.SimpleNamespace(out=out, n=jnp.asarray(n, jnp.int32), done=jnp.asarray(done))

    # row 0: 2 of 3 places committed, not done: waits; row 1: all committed -> 2 leading hits (6, 7; then 9 != 8)
    new = auto_mod.score_shadow(m, st, state([3, 4, 8], [False, False, False]), False)
    np.testing.assert_array_equal(new.shadow_live, [True, False, False])
    a = auto_mod.CALIBRATION_DECAY
    np.testing.assert_allclose(new.real, [0.0, (1 - a) * 2.0, 0.0], rtol=1e-6)
    np.testing.assert_allclose(new.pred, [0.0, (1 - a) * 3.0, 0.0], rtol=1e-6)
    # forced (a probe is due): row 0 scored on what is committed: 6, 7 match, the third place is not committed
    forced = auto_mod.score_shadow(m, new, state([3, 4, 8], [False, False, False]), True)
    assert not bool(forced.shadow_live.any())
    np.testing.assert_allclose(forced.real[c], a * new.real[c] + (1 - a) * 2.0, rtol=1e-6)
    np.testing.assert_allclose(forced.pred[c], a * new.pred[c] + (1 - a) * 2.0, rtol=1e-6)
    # a method without the chain or the plain step keeps no shadow
    assert not auto_mod.shadowing(Auto(sizes=(0, 4))) and not auto_mod.shadowing(Auto(sizes=("chain", 4)))
    assert not auto_mod.shadowing(Auto(sizes=(0, "chain", 4), decide="draft"))


def test_calibration_scales_the_predictions():
    st = auto_mod.AutoState(choices=jnp.zeros((1, 4), jnp.int32), real=jnp.array([0.0, 1.0, 0.0]),
                            pred=jnp.array([0.0, 3.0, 0.0]), last=jnp.zeros((1, 3)), idle=jnp.int32(0),
                            force=jnp.int32(-1), gap=jnp.int32(4))
    raw = jnp.array([[0.0, 2.0, 2.0]])
    exp = np.asarray(auto_mod.calibrated(st, raw))
    p = auto_mod.CALIBRATION_PRIOR
    np.testing.assert_allclose(exp[0], [1.0, 1.0 + 2.0 * (1.0 + p) / (3.0 + p), 3.0], rtol=1e-6)


def test_predictions_from_hand_made_scores_and_chain_probabilities():
    m = Auto(sizes=(0, "chain", 1, 3))
    scores = jnp.log(jnp.array([[0.5, 0.25, 0.1, 0.05]]))
    chain_p = jnp.array([[0.5, 0.5, 1.0]])
    raw = np.asarray(auto_mod.predictions(m, 1, scores, chain_p))
    np.testing.assert_allclose(raw[0], [0.0, 0.5 + 0.25 + 0.25, 0.5, 0.85], rtol=1e-6)
    padded = jnp.array([[np.log(0.5), -np.inf, -np.inf, -np.inf]])  # padding nodes add nothing
    np.testing.assert_allclose(np.asarray(auto_mod.predictions(m, 1, padded, chain_p))[0, 3], 0.5, rtol=1e-6)


def test_best_first_prefixes_are_nested():
    """The first b nodes of a best-first tree are the best-first tree of b nodes (same nodes, parents, depths,
    scores), and the ancestor mask slices with them: auto builds the largest tree once and slices it."""
    rng = np.random.default_rng(0)
    d, c = 4, 8
    logits = jnp.asarray(rng.normal(size=(d, 40)) * 3, jnp.float32)
    toks, logp = tree.candidates(logits, c)
    tables = tree.ddtree_tables(logp)
    best_first = jax.jit(tree.best_first, static_argnums=2)
    big = best_first(tables, toks, 64)
    mask = tree.visibility(big.parents, d)
    for b in (1, 2, 5, 8, 16, 33):
        small = best_first(tables, toks, b)
        for name in ("tokens", "parents", "depths", "scores"):
            np.testing.assert_array_equal(np.asarray(getattr(big, name))[:b], np.asarray(getattr(small, name)),
                                          err_msg=f"{name} at b={b}")
        np.testing.assert_array_equal(np.asarray(mask)[: b + 1, : b + 1], np.asarray(tree.visibility(small.parents, d)))
        assert int(np.asarray(big.parents)[:b].max()) <= b  # every parent of a kept node is kept


# ----------------------------------------------------------------------------- the round


def test_switch_branches_return_identical_state_layouts(random_pair):
    target, drafter = random_pair
    run = validate(target, drafter, PROMPTS3, method=Auto(sizes=SIZES, table=_table(random_pair)),
                   max_new_tokens=20)
    plan = run.plan
    graphdefs, states = split_pair(target, drafter)
    args = run.device_args()
    # shapes only (traced, never run: running the start, draft and expansion op by op took ~15 s)
    state = jax.eval_shape(lambda a: spec_start(graphdefs, states, *a, plan=plan, cache_size=run.cache_size,
                                                buf_len=run.buf_len), args)
    blk = jax.eval_shape(lambda s: auto_mod.draft(target, drafter, s, plan=plan), state)
    aprop = jax.eval_shape(lambda s, b: auto_mod.auto_expand(target, drafter, s, b, args.temperature,
                                                             jax.random.key(1), plan=plan), state, blk)
    assert aprop.raw.shape == (3, len(SIZES))
    layouts = []
    for i in range(len(SIZES)):
        out = jax.eval_shape(
            lambda s, a, i=i: auto_mod._branch(i, target, drafter, s, a, args.temperature, jax.random.key(2),
                                               args.max_new, args.eos, plan=plan), state, aprop)
        layouts.append((jax.tree.structure(out), [(x.shape, x.dtype) for x in jax.tree.leaves(out)]))
    assert all(lay == layouts[0] for lay in layouts[1:])
    # the auto round keeps the state's own layout (the while_loop carry)
    new = jax.eval_shape(lambda s: auto_mod.auto_round(target, drafter, s, plan, args.max_new, args.eos,
                                                       args.temperature), state)
    assert jax.tree.structure(new) == jax.tree.structure(state)
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(new)] == [(x.shape, x.dtype) for x in jax.tree.leaves(state)]


def test_a_probe_builds_the_tree_only_when_a_tree_is_picked_or_never_built(random_pair):
    """decide="previous" probe (idle > 0): the chain is built; the largest tree only when the policy over the fresh
    chain prediction and the trees' last ones picks a tree, or when no tree prediction exists yet and some tree
    size is viable (with no viable tree size no tree is ever built)."""
    target, drafter = random_pair

    graphdefs, states = split_pair(target, drafter)
    cheap = (1.0, 1.1, 1.2, 1.3, 1.4)
    run = validate(target, drafter, PROMPTS3, method=Auto(sizes=SIZES, table=_table(random_pair, seconds=cheap)),
                   max_new_tokens=20)
    args = run.device_args()
    state = spec_start(graphdefs, states, *args, plan=run.plan, cache_size=run.cache_size, buf_len=run.buf_len)
    assert int(state.auto.idle) > 0  # the first round is a probe
    blk = auto_mod.draft(target, drafter, state, plan=run.plan)

    def probe_builds_tree(seconds, last):
        plan = dataclasses.replace(run.plan, method=dataclasses.replace(run.plan.method,
                                                                        table=_table(random_pair, seconds=seconds)))
        st = dataclasses.replace(state, auto=dataclasses.replace(state.auto, last=jnp.asarray(last, jnp.float32)))
        aprop = auto_mod.auto_expand(target, drafter, st, blk, args.temperature, jax.random.key(1),
                                     jnp.int32(SIZES.index("chain")), plan=plan)
        return bool(aprop.tree_built)

    k = len(SIZES)
    assert probe_builds_tree(cheap, np.zeros((3, k)))  # no tree prediction yet: built
    assert probe_builds_tree(cheap, np.tile([0, 0, 50.0, 60.0, 70.0], (3, 1)))  # trees promise far more: a tree
    assert not probe_builds_tree(cheap, np.tile([0, 0, 1e-3, 1e-3, 1e-3], (3, 1)))  # known, hopeless: no tree
    # every tree size costs more plain steps than half its most tokens: not viable, never built, even unknown
    assert not probe_builds_tree((1.0, 1.1, 50.0, 60.0, 70.0), np.zeros((3, k)))


def test_plain_burst_extends_the_drafter_context_like_single_steps(random_pair):
    """A burst of plain steps projects the drafter's context once per chunk of ``depth + 1`` steps; the context
    (and everything else) must equal that of the steps taken one by one, each extending the context."""
    target, drafter = random_pair
    run = validate(target, drafter, PROMPTS3, method=Auto(sizes=(0, 16), table=_table(random_pair, sizes=(0, 16))),
                   max_new_tokens=48)
    plan, args = run.plan, run.device_args()
    graphdefs, states = split_pair(target, drafter)
    state = spec_start(graphdefs, states, *args, plan=plan, cache_size=run.cache_size, buf_len=run.buf_len)
    steps = 2 * (plan.depth + 1) + 3  # two whole chunks and a partial one
    state = dataclasses.replace(state, auto=dataclasses.replace(state.auto, gap=jnp.int32(steps), idle=jnp.int32(0)))
    key = jax.random.key(3)
    burst = jax.jit(lambda s: auto_mod.auto_plain(target, drafter, s, args.max_new, args.eos, args.temperature, key,
                                                  plan=plan))(state)

    @jax.jit
    def one(s, j):
        return auto_mod._plain_step(target, drafter, s, args.temperature, jax.random.fold_in(key, j), args.max_new,
                                    args.eos, plan)[0]

    single = state
    for j in range(steps):
        single = one(single, j)
    assert int(burst.auto.idle) == steps
    np.testing.assert_array_equal(burst.out, single.out)
    np.testing.assert_array_equal(burst.ctx.lengths, single.ctx.lengths)
    np.testing.assert_array_equal(burst.cache.lengths, single.cache.lengths)
    assert int(burst.ctx.lengths.min()) == int(state.ctx.lengths.min()) + steps
    for b, n in enumerate(np.asarray(burst.ctx.lengths)):
        for got, want in ((burst.ctx.k, single.ctx.k), (burst.ctx.v, single.ctx.v)):
            np.testing.assert_allclose(got[:, b, :, :n], want[:, b, :, :n], rtol=1e-5, atol=1e-5)


# both batch sizes and both decide modes in the default run; the other two pairings are slow
@pytest.mark.parametrize(("batch", "decide"), [(1, "draft"), (3, "previous"),
                                               pytest.param(1, "previous", marks=pytest.mark.slow),
                                               pytest.param(3, "draft", marks=pytest.mark.slow)])
def test_greedy_auto_equals_ar(random_pair, decide, batch):
    target, drafter = random_pair
    prompts = PROMPTS3[:batch]
    ar = generate(target, None, prompts, max_new_tokens=30).tokens
    # costs that make every candidate worth choosing sometimes
    table = _table(random_pair, seconds=(1.0, 1.3, 1.4, 1.6, 2.5), decide=decide)
    out = generate(target, drafter, prompts, method=Auto(sizes=SIZES, decide=decide, table=table),
                   max_new_tokens=30)
    assert out.tokens == ar
    assert [len(c) for c in out.size_choices] == out.rounds
    assert sum(out.size_counts.values()) == sum(out.rounds)
    assert set(out.size_counts) <= set(table.labels)
    for lens, sizes in zip(out.acceptance_lengths, out.size_choices, strict=True):
        for n, label in zip(lens, sizes, strict=True):
            assert n == 1 or label != "ar"  # a plain step commits exactly one token


@pytest.mark.slow
@pytest.mark.parametrize("decide", ["draft", "previous"])
def test_every_candidate_alone_is_exact(random_pair, decide):
    """A cost table that makes one candidate far cheaper forces it each round (but the probe drafts of
    decide="previous" when it is the plain step): each branch is exact on its own."""
    target, drafter = random_pair
    ar = generate(target, None, PROMPTS3, max_new_tokens=16).tokens
    labels = Auto(sizes=SIZES).resolve(drafter).labels()
    for i, label in enumerate(labels):
        seconds = tuple(1e-3 if j == i else 1.0 for j in range(len(labels)))
        out = generate(target, drafter, PROMPTS3, max_new_tokens=16,
                       method=Auto(sizes=SIZES, decide=decide, table=CostTable(labels, seconds)))
        assert out.tokens == ar, label
        counts = out.size_counts
        if decide == "draft" or label != "ar":
            assert set(counts) == {label}, (label, counts)
        else:
            assert counts["ar"] > sum(counts.values()) / 2, counts


@pytest.mark.slow
def test_default_auto_profiles_once_and_is_exact(random_pair, monkeypatch):
    target, drafter = random_pair
    monkeypatch.setattr(auto_mod, "_CACHE", {})
    calls = []
    real = auto_mod.profile_costs

    def counting(*a, **k):
        calls.append(k.get("batch_size"))
        return real(*a, **{**k, "repeats": 1})

    monkeypatch.setattr(auto_mod, "profile_costs", counting)
    ar = generate(target, None, PROMPTS3, max_new_tokens=20).tokens
    assert generate(target, drafter, PROMPTS3, method="auto", max_new_tokens=20).tokens == ar
    assert generate(target, drafter, PROMPTS3, method="auto", max_new_tokens=12).tokens == [t[:12] for t in ar]
    assert calls == [3]  # profiled once for this batch and cache size, then cached in the process


@pytest.mark.slow
def test_instrumented_and_stream_auto_match(random_pair):
    target, drafter = random_pair
    table = _table(random_pair)
    m = Auto(sizes=SIZES, table=table)
    ar = generate(target, None, PROMPTS3, max_new_tokens=20).tokens
    inst = generate(target, drafter, PROMPTS3, method=m, max_new_tokens=20, instrument=True)
    assert inst.tokens == ar and inst.size_counts
    chunks = list(sparkjax.stream(target, drafter, PROMPTS3, method=m, max_new_tokens=20))
    assert [sum((c[b] for c in chunks), []) for b in range(3)] == ar


def test_no_host_transfer_during_an_auto_generation(random_pair):
    target, drafter = random_pair
    m = Auto(sizes=SIZES, table=_table(random_pair))
    jax.block_until_ready(launch(target, drafter, PROMPTS3, method=m, max_new_tokens=20))  # compile
    with jax.transfer_guard_device_to_host("disallow"):
        res = launch(target, drafter, PROMPTS3, method=m, max_new_tokens=20)
        jax.block_until_ready(res)
    assert len(res) == 7 and int(np.asarray(res[1]).min()) == 20  # ..., depth_hits, choices, memory
    assert isinstance(res[6], auto_mod.AutoMemory)
    # a launch started from the last one's memory (device arrays): still no transfer to the host, and no new
    # program (a memory is a traced input, fresh or carried, on device or on the host)
    programs = spec_program._cache_size()
    with jax.transfer_guard_device_to_host("disallow"):
        again = jax.block_until_ready(launch(target, drafter, PROMPTS3, method=m, max_new_tokens=20,
                                             auto_memory=res[6]))
    host = generate(target, drafter, PROMPTS3, method=m, max_new_tokens=20, auto_memory=again[6]).auto_memory
    generate(target, drafter, PROMPTS3, method=m, max_new_tokens=20, auto_memory=host)
    assert spec_program._cache_size() == programs
    # the compiled program alone, with its inputs already on device: no transfer of any kind
    run = validate(target, drafter, PROMPTS3, method=m, max_new_tokens=20)
    graphdefs, states = split_pair(target, drafter)
    args = jax.block_until_ready(run.device_args())
    kw = dict(plan=run.plan, cache_size=run.cache_size, buf_len=run.buf_len)
    jax.block_until_ready(spec_program(graphdefs, states, *args, **kw))
    with jax.transfer_guard("disallow"):
        out = jax.block_until_ready(spec_program(graphdefs, states, *args, **kw))
    assert len(out) == 8


# ----------------------------------------------------------------------------- the memory carried across generations


@pytest.mark.slow  # the default run keeps a carried memory's exactness in the first-round and eval-engine tests
@pytest.mark.parametrize("batch", [1, 3])
def test_auto_memory_carries_across_generations_and_stays_exact(random_pair, batch):
    """A chain of generations, each from the last one's memory (host copies, across batch sizes too): the tokens
    are the target's greedy ones; the memory has the method's candidates and sane values."""
    target, drafter = random_pair
    m = Auto(sizes=SIZES, table=_table(random_pair, seconds=(1.0, 1.3, 1.4, 1.6, 2.5)))
    memory = None
    for prompts in (PROMPTS3[:batch], PROMPTS3[::-1][:batch], PROMPTS3[1:2]):
        out = generate(target, drafter, prompts, method=m, max_new_tokens=24, auto_memory=memory)
        assert out.tokens == generate(target, None, prompts, max_new_tokens=24).tokens
        memory = out.auto_memory
        assert memory.labels == m.resolve(drafter).labels()
        assert all(np.asarray(getattr(memory, f)).shape == (len(SIZES),) for f in ("real", "pred", "last"))
        assert np.all(np.isfinite(memory.real)) and np.all(memory.real >= 0) and 1 <= int(memory.gap) <= 128
    assert generate(target, drafter, PROMPTS3[:1], method="dspark", max_new_tokens=8).auto_memory is None


def test_auto_memory_sets_the_first_round_state(random_pair):
    """init_state from a memory: its calibration, predictions and gap, and a probe due at the first round (idle =
    gap); from none, the fresh state. And the memory decides: one that says drafts accept nothing (realised 0 of
    many predicted) makes every round of a generation a plain step, while a fresh start drafts."""
    target, drafter = random_pair
    m = Auto(sizes=SIZES, table=_table(random_pair, seconds=(1.0, 1.3, 1.4, 1.6, 2.5)))
    run = validate(target, drafter, PROMPTS3, method=m, max_new_tokens=20)
    k = len(SIZES)
    mem = auto_mod.AutoMemory(real=np.zeros(k, np.float32), pred=np.full(k, 50.0, np.float32),
                              last=np.arange(k, dtype=np.float32), gap=np.int32(40), labels=run.plan.method.labels())
    st = auto_mod.init_state(run.plan, 3, 20, auto_mod.check_auto_memory(mem, run.plan))
    np.testing.assert_array_equal(st.pred, mem.pred)
    np.testing.assert_array_equal(st.last, np.broadcast_to(mem.last, (3, k)))
    assert int(st.gap) == 40 and int(st.idle) == 40
    fresh = auto_mod.init_state(run.plan, 3, 20)
    floor = auto_mod.gap_floor(run.plan.method, run.plan.depth)
    assert int(fresh.gap) == int(fresh.idle) == floor and not np.asarray(fresh.pred).any()
    ar = generate(target, None, PROMPTS3, max_new_tokens=20).tokens
    hopeless = generate(target, drafter, PROMPTS3, method=m, max_new_tokens=20, auto_memory=mem)
    assert hopeless.tokens == ar and set(hopeless.size_counts) == {"ar"}
    eager = Auto(sizes=SIZES, table=_table(random_pair, seconds=(1.0, 0.01, 0.01, 0.01, 0.01)))
    assert set(generate(target, drafter, PROMPTS3, method=eager, max_new_tokens=20).size_counts) != {"ar"}


def test_bad_auto_memory_names_the_argument(random_pair):
    target, drafter = random_pair
    m = Auto(sizes=SIZES, table=_table(random_pair))
    # a well-formed memory without a generation (memory is checked before anything compiles; a real output's
    # memory is accepted in the memory tests above)
    good = auto_mod.fresh_memory(validate(target, drafter, PROMPTS3[:1], method=m, max_new_tokens=6).plan)
    other = Auto(sizes=(0, "chain", 8), table=_table(random_pair, sizes=(0, "chain", 8)))
    bad = [
        (dict(method="dspark", auto_memory=good), "only method 'auto'"),
        (dict(method=m, auto_memory={"real": [0.0]}), "AutoMemory"),
        (dict(method=other, auto_memory=good), "candidates"),
        (dict(method=m, auto_memory=dataclasses.replace(good, real=np.full(5, np.nan, np.float32))), "real"),
        (dict(method=m, auto_memory=dataclasses.replace(good, pred=np.ones(3, np.float32))), "pred"),
        (dict(method=m, auto_memory=dataclasses.replace(good, gap=-1)), "gap"),
        (dict(method=m, auto_memory=dataclasses.replace(good, last=jnp.ones(5, jnp.int32))), "last"),
        (dict(method=m, auto_memory=dataclasses.replace(good, last="x")), "last"),
    ]
    for kw, words in bad:
        with pytest.raises(ArgumentError, match="auto_memory") as e:
            generate(target, drafter, PROMPTS3[:1], max_new_tokens=6, **kw)
        assert words in str(e.value), (kw, e.value)


def test_eval_engine_carries_auto_memory_per_chain(random_pair, monkeypatch):
    """The eval's engine keeps the memory of each chain (batch size, repetition) of method auto, and none without
    carry_auto or for other methods."""
    from sparkjax.eval.engine import Engine, MethodConfig

    target, drafter = random_pair
    monkeypatch.setattr(auto_mod, "_CACHE", {})  # a hand-made table instead of profiling (the engine's own path)
    monkeypatch.setattr(auto_mod, "profile_costs", lambda t, d, *, method, **kw: _table(
        random_pair, sizes=method.sizes, seconds=[1.0 + 0.1 * i for i in range(len(method.sizes))]))
    kw = dict(eos=[], temperature=0.0, max_new_tokens=6, cache_size=64, prompt_width=8)
    eng = Engine(target, drafter, **kw)
    mc = MethodConfig("auto", 16)
    assert eng.memory(mc, 1, 0) is None
    res = eng.launch(mc, PROMPTS3[:1], 0)
    eng.remember(mc, 1, 0, res)
    assert isinstance(eng.memory(mc, 1, 0), auto_mod.AutoMemory) and eng.memory(mc, 1, 1) is None
    assert eng.outputs(eng.launch(mc, PROMPTS3[:1], 0, auto_memory=eng.memory(mc, 1, 0)), 1).tokens == \
        generate(target, None, PROMPTS3[:1], max_new_tokens=6).tokens
    eng.remember(MethodConfig("dspark"), 1, 0, eng.launch(MethodConfig("dspark"), PROMPTS3[:1], 0))
    assert eng.memory(MethodConfig("dspark"), 1, 0) is None
    fresh = Engine(target, drafter, carry_auto=False, **kw)
    fresh.remember(mc, 1, 0, res)
    assert fresh.memory(mc, 1, 0) is None


# ----------------------------------------------------------------------------- the cost table


def test_profile_costs_times_rounds_net_of_the_call_and_the_plain_step_in_a_burst(random_pair, monkeypatch):
    """The protocol on a fake clock: every candidate's time is its call's less a call of no round; drafted
    candidates run PROFILE_ROUNDS forced rounds, the plain step one burst of PROFILE_BURST steps; a call whose
    net time is not positive keeps its whole time (never 0)."""
    target, drafter = random_pair
    sizes = (0, "chain", 6)
    per_step = {0: 0.5e-3, 1: 3e-3, 2: 4e-3}  # seconds per plain step / per drafted round
    overhead = 7e-3
    clock = [0.0]
    calls = []

    def fake(graphdefs, states, start, force, max_new, eos, temperature, *, plan, rounds):
        i = int(force)
        calls.append((i, rounds, int(start.auto.gap)))
        work = rounds * (int(start.auto.gap) if i == 0 else 1) * per_step[i]
        clock[0] += overhead + work
        return start

    monkeypatch.setattr(auto_mod, "_forced_rounds_fn", lambda: fake)
    monkeypatch.setattr(auto_mod.time, "perf_counter", lambda: clock[0])
    table = profile_costs(target, drafter, method=Auto(sizes=sizes), repeats=3)
    np.testing.assert_allclose(table.seconds, [per_step[0], per_step[1], per_step[2]], rtol=1e-9)
    timed = {(i, r, g) for i, r, g in calls if r > 0}
    assert timed == {(0, 1, auto_mod.PROFILE_BURST), (1, auto_mod.PROFILE_ROUNDS, 1), (2, auto_mod.PROFILE_ROUNDS, 1)}
    assert sum(r == 0 for _, r, _ in calls) == sum(r > 0 for _, r, _ in calls)  # each timed call has its empty twin
    # a busy machine: the empty call took longer than the whole one -> the whole time, not 0 or a negative one
    state = {"n": 0}

    def noisy(graphdefs, states, start, force, max_new, eos, temperature, *, plan, rounds):
        state["n"] += 1
        clock[0] += 1e-3 if rounds else 5e-3
        return start

    monkeypatch.setattr(auto_mod, "_forced_rounds_fn", lambda: noisy)
    busy = profile_costs(target, drafter, method=Auto(sizes=sizes), repeats=1)
    assert busy.seconds[0] == pytest.approx(1e-3 / auto_mod.PROFILE_BURST)
    assert busy.seconds[1] == pytest.approx(1e-3 / auto_mod.PROFILE_ROUNDS) and min(busy.seconds) > 0


def test_profile_costs_save_and_load(random_pair, tmp_path):
    target, drafter = random_pair
    tab = profile_costs(target, drafter, method=Auto(sizes=(0, "chain")), batch_size=2, cache_size=64, repeats=1)
    assert tab.labels == ("ar", "dspark")
    assert all(s > 0 for s in tab.seconds) and all(0 < b <= s for b, s in zip(tab.best, tab.seconds, strict=True))
    key = tab.key_dict
    assert key["batch"] == 2 and key["cache_size"] == 64 and key["device"].startswith(jax.devices()[0].platform)
    path = tmp_path / "costs.json"
    tab.save(path)
    back = load_cost_table(path, target=target, drafter=drafter, method=Auto(sizes=(0, "chain")),
                           batch_size=2, cache_size=64)
    assert back == tab
    m = Auto(sizes=(0, "chain"), table=back)  # a loaded table is used as is
    assert generate(target, drafter, PROMPTS3, method=m, max_new_tokens=8).tokens == \
        generate(target, None, PROMPTS3, max_new_tokens=8).tokens
    with pytest.raises(CostTableError, match=r"costs.json: key 'batch' is 2, this run needs 4"):
        load_cost_table(path, target=target, drafter=drafter, method=Auto(sizes=(0, "chain")),
                        batch_size=4, cache_size=64)
    with pytest.raises(CostTableError, match="key 'candidates'"):
        load_cost_table(path, target=target, drafter=drafter, method=Auto(sizes=(0, 4)), batch_size=2,
                        cache_size=64)


def test_unreadable_cost_tables_name_the_file(tmp_path):
    missing = tmp_path / "none.json"
    with pytest.raises(CostTableError, match="none.json: unreadable"):
        load_cost_table(missing)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(CostTableError, match="bad.json: unreadable"):
        load_cost_table(bad)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CostTableError, match="other.json: unreadable.*not a sparkjax cost table"):
        load_cost_table(other)
    neg = tmp_path / "neg.json"
    neg.write_text(json.dumps({"format": "sparkjax-cost-table", "key": {},
                               "candidates": [{"label": "ar", "seconds": -1.0}]}))
    with pytest.raises(CostTableError, match="neg.json"):
        load_cost_table(neg)
    assert issubclass(CostTableError, SparkjaxError)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("bad,name", [
    (lambda: Auto(sizes=()), "sizes: empty candidate set"),
    (lambda: Auto(sizes=[]), "sizes: empty candidate set"),
    (lambda: Auto(sizes="chain"), "sizes"),
    (lambda: Auto(sizes=(0, "tree")), r"sizes\[1\]"),
    (lambda: Auto(sizes=(0, -3)), r"sizes\[1\]"),
    (lambda: Auto(sizes=(0, True)), r"sizes\[1\]"),
    (lambda: Auto(sizes=(8, 8)), r"sizes\[1\]: 8 is listed twice"),
    (lambda: Auto(sizes=(0, 8, 128), budget=64), "sizes: tree size 128 exceeds budget=64"),
    (lambda: Auto(tree="dspark"), "tree"),
    (lambda: Auto(tree="sparklingtree-beam"), "tree"),
    (lambda: Auto(chain="ddtree"), "chain"),
    (lambda: Auto(decide="later"), "decide"),
    (lambda: Auto(probe=0), "probe"),
    (lambda: Auto(viable_share=0), "viable_share"),
    (lambda: Auto(viable_share=1.5), "viable_share"),
    (lambda: Auto(viable_share="half"), "viable_share"),
    (lambda: Auto(viable_share=float("nan")), "viable_share"),
    (lambda: Auto(table={"ar": 1.0}), "table"),
    (lambda: parse_method("auto", widths=(4, 4)), "widths"),
    (lambda: parse_method("auto@0"), "budget"),
    (lambda: CostTable(("ar", "dspark"), (1.0,)), "seconds"),
    (lambda: CostTable(("ar",), (0.0,)), "seconds"),
])
def test_bad_auto_options_name_the_argument(bad, name):
    with pytest.raises(ArgumentError, match=name):
        bad()


def test_auto_checks_against_the_pair(random_pair):
    target, drafter = random_pair
    with pytest.raises(ArgumentError, match="drafter: method 'auto' needs a drafter"):
        generate(target, None, PROMPTS3, method="auto")
    with pytest.raises(ArgumentError, match="budget"):  # 16 ** 4 + ... reachable, but not with top_c=2
        generate(target, drafter, PROMPTS3, method=Auto(sizes=(0, 64), top_c=2), max_new_tokens=4)
    with pytest.raises(ArgumentError, match="table: its candidates"):
        generate(target, drafter, PROMPTS3, method=Auto(sizes=(0, 8), table=_table(random_pair)), max_new_tokens=4)
    _, plain = _random_pair(markov=False)
    with pytest.raises(ArgumentError, match="method: 'auto' needs a drafter with a Markov head"):
        generate(target, plain, PROMPTS3, method=Auto(tree="sparklingtree"), max_new_tokens=4)


def test_parse_auto():
    assert parse_method("auto") == Auto()
    a = parse_method("auto@32")
    assert a.sizes == (0, "chain", 8, 16, 32) and a.budget == 32
    assert parse_method("auto", budget=12).sizes == (0, "chain", 8, 12)
    assert Auto(sizes=[16, "chain", 0]).sizes == (0, "chain", 16)  # canonical order
    assert dataclasses.replace(Auto(), decide="draft").decide == "draft"
    assert "auto" in sparkjax.METHODS


# ----------------------------------------------------------------------------- the eval's column


def test_eval_reports_the_share_of_rounds_per_size():
    from sparkjax.eval import harness, report
    from sparkjax.eval.engine import Engine

    samples = [{"size_choices": ["ar", "ar", "dspark"]}, {"size_choices": ["sparklingtree@16"]}]
    share = harness._size_share(samples)
    assert share == {"ar": 0.5, "dspark": 0.25, "sparklingtree@16": 0.25}
    assert harness._size_share([{"acceptance_lengths": [1]}]) is None  # other methods: no column
    flat = report.flat_row({"dataset": "all", "label": "auto", "size_share": share, "accept_rate": []})
    assert flat["chosen_ar"] == 0.5 and flat["chosen_sparklingtree@16"] == 0.25 and "size_share" not in flat
    # a finished auto launch: out, n, accept_lens, rounds, depth_hits, choices, nonfinite
    res = (np.array([[5, 6, 7, 0]]), np.array([3]), np.array([[1, 2, 0, 0]]), np.array([2]), np.array([[1, 0]]),
           np.array([[0, 2, -1, -1]]), np.array([-1]))
    out = Engine.outputs(res, labels=("ar", "dspark", "sparklingtree@16"))
    assert out.size_choices == [["ar", "sparklingtree@16"]] and out.acceptance_lengths == [[1, 2]]
    assert "auto" in [mc.label for mc in harness.method_configs(harness.EvalConfig())[0]]
    assert "auto" not in harness.BASELINE_METHODS  # auto runs with --drafter (sparklingtree / dspark)


def test_eval_describes_every_default_method(random_pair):
    """The eval's per-method record (results.json) for every method it runs by default, auto included: the
    tree options resolve (auto reports the candidates of the tree it builds; chains have none)."""
    from sparkjax.eval.engine import Engine, MethodConfig
    from sparkjax.eval.harness import DEFAULT_BUDGETS

    target, drafter = random_pair
    eng = Engine(target, drafter, eos=[], temperature=0.0, max_new_tokens=8, cache_size=256, prompt_width=64)
    seen = {}
    for name in sparkjax.engine.METHODS:
        budget = DEFAULT_BUDGETS[0] if name in sparkjax.engine.TREE_METHODS else None
        seen[name] = eng.describe(MethodConfig(name, budget))
    assert seen["auto"]["candidates"] == "union" and seen["auto"]["nodes"] == max(Auto().sizes[2:])
    assert seen["dspark"]["candidates"] is None and seen["ddtree"]["candidates"] == "base"
    assert seen["sparklingtree"]["candidates"] == "union"


def test_sizes_that_cannot_pay_are_never_chosen_nor_probed(random_pair):
    """With a hand-made table: a drafted size whose round costs at least ``viable_share`` x its depth + 1
    tokens in plain steps is not viable; probes wait as many plain steps as the cheapest viable drafted round
    costs; when no drafted size can pay, a generation is plain steps only (and still the target's greedy
    tokens)."""
    sizes = (0, "chain", 8)
    labels = ("ar", "dspark", "sparklingtree@8")
    m = Auto(sizes=sizes, table=CostTable(labels, (1.0, 30.0, 5.0)), viable_share=1)
    assert auto_mod.viable(m, 16) == (True, False, True)  # chain: 17 tokens < 30 steps; tree@8: 9 > 5
    assert auto_mod.gap_floor(m, 16) == 5  # max(probe=4, ceil(5 / 1))
    # the default share 0.5: tree@8 must pay at 4.5 tokens (not at 5 steps), the chain at 8.5 (at 8 steps)
    half = Auto(sizes=sizes, table=CostTable(labels, (1.0, 8.0, 5.0)))
    assert half.viable_share == 0.5 and auto_mod.viable(half, 16) == (True, True, False)
    assert auto_mod.gap_floor(half, 16) == 8
    assert not auto_mod.drafts_can_pay(Auto(sizes=sizes, table=CostTable(labels, (1.0, 9.0, 5.0))), 16)
    assert auto_mod.drafts_can_pay(Auto(sizes=sizes, table=CostTable(labels, (1.0, 9.0, 5.0)), viable_share=0.6), 16)
    assert auto_mod.gap_floor(Auto(sizes=sizes, table=CostTable(labels, (1.0, 2.0, 3.0))), 16) == 4
    assert auto_mod.gap_floor(Auto(sizes=sizes), 16) == 4  # no table: probe
    target, drafter = random_pair
    hopeless = Auto(sizes=sizes, table=CostTable(Auto(sizes=sizes).resolve(drafter).labels(), (1.0, 100.0, 100.0)))
    out = generate(target, drafter, PROMPTS3, max_new_tokens=12, method=hopeless)
    assert out.tokens == generate(target, None, PROMPTS3, max_new_tokens=12).tokens
    assert set(out.size_counts) == {"ar"}
    # no draft can ever pay: the prompt's features never enter the drafter's context (plain steps only); a
    # drafting auto (decide="draft") still keeps it
    graphdefs, states = split_pair(target, drafter)
    for method, kept in ((hopeless, False), (Auto(sizes=sizes, table=CostTable(hopeless.table.labels, (1.0, 2.0, 3.0))),
                                             True)):
        run = validate(target, drafter, PROMPTS3, method=method, max_new_tokens=12)
        assert auto_mod.keeps_context(run.plan) == kept
        state = spec_start(graphdefs, states, *run.device_args(), plan=run.plan, cache_size=run.cache_size,
                           buf_len=run.buf_len)
        assert bool((np.asarray(state.ctx.lengths) > 0).all()) == kept
        if not kept:  # drafting every round (decide="draft") needs the context whatever the table
            plan = dataclasses.replace(run.plan, method=dataclasses.replace(run.plan.method, decide="draft"))
            assert auto_mod.keeps_context(plan)
