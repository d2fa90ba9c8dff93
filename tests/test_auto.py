"""Method ``auto``: policy, nested best-first prefixes, branch layouts, no host sync, memory, the cost table (a
traced input; profile, save, load, the per-machine cache) and bad input, each run also checked exact (auto's rows
of the greedy and sampled tables: test_exactness.py). Most generations share one program (conftest.auto_method):
``AUTO_SIZES``, decide="previous", PROMPTS3, NEW_LONG, tables whose every size is viable with probe floor 4."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparkjax
from sparkjax import testing, tree
from sparkjax.engine import Auto, CostTable, adaptive, costs, generate, launch, load_cost_table, policy, profile_costs
from sparkjax.engine.api import validate
from sparkjax.engine.programs import spec_program, spec_start, split_pair
from sparkjax.errors import ArgumentError, CostTableError, SparkjaxError
from tests.conftest import AUTO_SECONDS, AUTO_SIZES, NEW_LONG, PROMPTS3, auto_method

SIZES = AUTO_SIZES
NEW = NEW_LONG
BASE = AUTO_SECONDS  # every size viable (each pays at half its depth + 1 tokens), probe floor 4
OTHER = (1.0, 1.1, 1.2, 1.5, 1.8)  # other seconds, the same static part


@pytest.fixture(autouse=True)
def no_cache_dir(monkeypatch):
    """No test here reads or writes the user's cache folder unless it sets its own."""
    monkeypatch.setenv("SPARKJAX_CACHE_DIR", "off")
    monkeypatch.setattr(costs, "_TABLES", {})


@pytest.fixture(scope="module")
def ar_tokens(random_pair):
    """The target's greedy NEW tokens of a list of prompts (cached)."""
    greedy = functools.lru_cache(lambda prompts: generate(random_pair[0], None, [list(p) for p in prompts],
                                                          max_new_tokens=NEW).tokens)
    return lambda prompts: greedy(tuple(map(tuple, prompts)))


def _table(pair, sizes=SIZES, seconds=BASE) -> CostTable:
    return CostTable(Auto(sizes=sizes).resolve(pair[1]).labels(), tuple(seconds))


def _auto(pair, seconds=BASE, sizes=SIZES, **kw) -> Auto:
    return auto_method(pair[1], seconds, sizes, **kw)


def _start(pair, method=None):
    """(run, device args, the first round's state) of a generation of PROMPTS3 with ``method`` (default _auto)."""
    target, drafter = pair
    run = validate(target, drafter, PROMPTS3, method=method or _auto(pair), max_new_tokens=NEW)
    args = run.device_args()
    state = spec_start(*split_pair(target, drafter), *args, run.device_inputs(), plan=run.plan,
                       cache_size=run.cache_size, buf_len=run.buf_len)
    return run, args, state


def _state(**kw) -> adaptive.AutoState:
    k = len(kw["real"])
    base = dict(choices=jnp.zeros((1, 4), jnp.int32), last=jnp.zeros((1, k)), idle=jnp.int32(0),
                force=jnp.int32(-1), gap=jnp.int32(4), seconds=jnp.ones((k,)))
    return adaptive.AutoState(**{**base, **kw})


# ----------------------------------------------------------------------------- the policy and the predictions


def test_policy_viability_and_probe_floor_on_hand_made_tables():
    _policy = jax.jit(policy)  # one program per set of shapes
    costs_ = np.array([1.0, 1.5, 2.0, 4.0])  # ar, chain, tree@8, tree@64
    # a confident drafter: the big tree commits 9 tokens for 4x the cost of a plain step
    assert int(_policy(np.array([1.0, 3.0, 5.0, 9.0]), costs_)) == 2  # 2.5 tokens per unit beats 2.25 and 2.0
    assert int(_policy(np.array([1.0, 3.0, 5.0, 12.0]), costs_)) == 3
    # a hopeless drafter: the plain step wins
    assert int(_policy(np.array([1.0, 1.2, 1.5, 2.0]), costs_)) == 0
    # per sequence: summed over the active ones only
    per_seq = np.array([[1.0, 4.0, 4.0, 4.0], [1.0, 1.0, 1.0, 1.0]])
    assert int(_policy(per_seq, costs_)) == 1
    assert int(_policy(per_seq, costs_, active=np.array([False, True]))) == 0
    # a candidate that is not allowed is never picked; ties go to the first
    assert int(_policy(np.array([1.0, 1.2, 1.5, 2.0]), costs_, allowed=np.array([False, True, True, True]))) == 1
    assert int(_policy(np.array([2.0, 2.0]), np.array([1.0, 1.0]))) == 0
    # jit-able, same answer
    assert int(jax.jit(policy)(np.array([1.0, 3.0, 5.0, 12.0]), costs_)) == 3
    # viability: a drafted size whose round costs at least viable_share x its depth + 1 tokens in plain steps is
    # not viable; probes wait as many plain steps as the cheapest viable drafted round costs (at least ``probe``)
    m = Auto(sizes=(0, "chain", 8), viable_share=1)
    assert adaptive.viable(m, 16, (1.0, 30.0, 5.0)) == (True, False, True)  # chain: 17 tokens < 30 steps
    assert adaptive.gap_floor(m, 16, (1.0, 30.0, 5.0)) == 5  # max(probe=4, ceil(5 / 1))
    half = Auto(sizes=(0, "chain", 8))  # the default share 0.5: tree@8 must pay at 4.5 tokens, the chain at 8.5
    assert half.viable_share == 0.5 and adaptive.viable(half, 16, (1.0, 8.0, 5.0)) == (True, True, False)
    assert adaptive.gap_floor(half, 16, (1.0, 8.0, 5.0)) == 8
    assert adaptive.gap_floor(half, 16, (1.0, 2.0, 3.0)) == 4
    assert adaptive.viable(Auto(sizes=("chain", 8)), 16, (50.0, 90.0)) == (True, True)  # no plain step to beat
    assert adaptive.viable_of(half) == (True,) * 3 and adaptive.floor_of(half) == 4  # unbound: every size, probe


def test_shadow_chain_is_scored_against_the_committed_tokens():
    """A probe's unverified chain scores its leading drafts equal to the committed tokens, once its places are
    committed (or it is done, or a probe needs the slot), into the chain's calibration only."""
    m = Auto(sizes=(0, "chain", 4))
    c = m.sizes.index("chain")
    out = np.asarray([[5, 6, 7, 8, 9, 0, 0, 0], [5, 6, 7, 8, 9, 1, 2, 0], [1, 2, 3, 4, 5, 6, 7, 8]], np.int32)
    st = _state(choices=np.zeros((3, 8), np.int32), real=np.zeros((3,), np.float32), pred=np.zeros((3,), np.float32),
                last=np.zeros((3, 3), np.float32), shadow=np.asarray([[6, 7, 0], [6, 7, 9], [9, 9, 9]], np.int32),
                shadow_at=np.asarray([1, 1, 2], np.int32), shadow_pred=np.asarray([2.0, 3.0, 1.0], np.float32),
                shadow_live=np.asarray([True, True, False]))

    @functools.partial(jax.jit, static_argnums=3)  # one program per ``forced``, the results back on the host
    def score_shadow(st, n, done, forced):
        gen = types.SimpleNamespace(out=out, n=n, done=done)
        return adaptive.score_shadow(m, st, gen, forced)

    def score(st, n, done, forced):
        return jax.tree.map(np.asarray, score_shadow(st, np.asarray(n, np.int32), np.asarray(done), forced))

    # row 0: 2 of 3 places committed, not done: waits; row 1: all committed -> 2 leading hits (6, 7; then 9 != 8)
    new = score(st, [3, 4, 8], [False, False, False], False)
    np.testing.assert_array_equal(new.shadow_live, [True, False, False])
    a = adaptive.CALIBRATION_DECAY
    np.testing.assert_allclose(new.real, [0.0, (1 - a) * 2.0, 0.0], rtol=1e-6)
    np.testing.assert_allclose(new.pred, [0.0, (1 - a) * 3.0, 0.0], rtol=1e-6)
    # forced (a probe is due): row 0 scored on what is committed: 6, 7 match, the third place is not committed
    forced = score(new, [3, 4, 8], [False, False, False], True)
    assert not bool(forced.shadow_live.any())
    np.testing.assert_allclose(forced.real[c], a * new.real[c] + (1 - a) * 2.0, rtol=1e-6)
    np.testing.assert_allclose(forced.pred[c], a * new.pred[c] + (1 - a) * 2.0, rtol=1e-6)
    # a method without the chain or the plain step keeps no shadow
    assert not adaptive.shadowing(Auto(sizes=(0, 4))) and not adaptive.shadowing(Auto(sizes=("chain", 4)))
    assert not adaptive.shadowing(Auto(sizes=(0, "chain", 4), decide="draft"))


def test_predictions_from_hand_made_scores_and_their_calibration():
    st = _state(real=np.array([0.0, 1.0, 0.0], np.float32), pred=np.array([0.0, 3.0, 0.0], np.float32))
    exp = np.asarray(jax.jit(adaptive.calibrated)(st, np.array([[0.0, 2.0, 2.0]], np.float32)))
    p = adaptive.CALIBRATION_PRIOR
    np.testing.assert_allclose(exp[0], [1.0, 1.0 + 2.0 * (1.0 + p) / (3.0 + p), 3.0], rtol=1e-6)
    m = Auto(sizes=(0, "chain", 1, 3))
    predictions = jax.jit(lambda scores, chain_p: adaptive.predictions(m, 1, scores, chain_p))  # one program
    scores = np.log(np.array([[0.5, 0.25, 0.1, 0.05]])).astype(np.float32)
    chain_p = np.array([[0.5, 0.5, 1.0]], np.float32)
    raw = np.asarray(predictions(scores, chain_p))
    np.testing.assert_allclose(raw[0], [0.0, 0.5 + 0.25 + 0.25, 0.5, 0.85], rtol=1e-6)
    padded = np.array([[np.log(0.5), -np.inf, -np.inf, -np.inf]], np.float32)  # padding nodes add nothing
    np.testing.assert_allclose(np.asarray(predictions(padded, chain_p))[0, 3], 0.5, rtol=1e-6)


def test_best_first_prefix_masks_slice_with_the_tree():
    """auto builds the largest best-first tree once and slices it (the prefix property: test_tree.py): the
    ancestor mask of the first b nodes is the first b + 1 rows and columns of the whole tree's."""
    rng = np.random.default_rng(0)
    d = 4
    toks, tables = jax.jit(lambda x: (lambda t, lp: (t, tree.ddtree_tables(lp)))(*tree.candidates(x, 8)))(
        (rng.normal(size=(d, 40)) * 3).astype(np.float32))
    best_first = jax.jit(tree.best_first, static_argnums=2)
    visibility = jax.jit(tree.visibility, static_argnums=1)
    big = best_first(tables, toks, 64)
    mask = np.asarray(visibility(big.parents, d))
    for b in (1, 2, 5, 8, 16, 33):
        small = best_first(tables, toks, b)
        np.testing.assert_array_equal(np.asarray(big.parents)[:b], np.asarray(small.parents))
        np.testing.assert_array_equal(mask[: b + 1, : b + 1], np.asarray(visibility(small.parents, d)))


# ----------------------------------------------------------------------------- the cost table is a traced input


def test_tables_and_memories_are_traced_inputs_with_no_host_transfer(random_pair, ar_tokens, caplog):
    """Tables of other seconds (same static part) and memories (fresh or carried, on device or on the host) are
    traced inputs: equal plans, one compiled program (the jit cache and JAX's compile log), greedy tokens, each
    table's own seconds read, and no transfer to the host during a launch."""
    target, drafter = random_pair
    m = _auto(random_pair)
    runs = [validate(target, drafter, PROMPTS3, method=_auto(random_pair, s), max_new_tokens=NEW)
            for s in (BASE, OTHER)]
    assert runs[0].plan == runs[1].plan and hash(runs[0].plan) == hash(runs[1].plan)
    np.testing.assert_allclose(runs[1].inputs.seconds, OTHER)
    jax.block_until_ready(launch(target, drafter, PROMPTS3, method=m, max_new_tokens=NEW))  # compile
    with jax.transfer_guard_device_to_host("disallow"):
        res = jax.block_until_ready(launch(target, drafter, PROMPTS3, method=m, max_new_tokens=NEW))
    assert int(np.asarray(res.n).min()) == NEW and isinstance(res.extra.memory, adaptive.AutoMemory)
    assert res.extra.choices.shape[0] == 3 and res.labels == m.resolve(drafter).labels()
    ar = ar_tokens(PROMPTS3)  # ar's program too is a spec_program: compiled before the count
    programs = spec_program._cache_size()
    caplog.set_level(logging.WARNING, logger="jax")
    with jax.log_compiles():
        other = generate(target, drafter, PROMPTS3, method=_auto(random_pair, OTHER), max_new_tokens=NEW)
        with jax.transfer_guard_device_to_host("disallow"):
            again = jax.block_until_ready(launch(target, drafter, PROMPTS3, method=m, max_new_tokens=NEW,
                                                 auto_memory=res.extra.memory))
        host = generate(target, drafter, PROMPTS3, method=m, max_new_tokens=NEW, auto_memory=again.extra.memory)
        generate(target, drafter, PROMPTS3, method=m, max_new_tokens=NEW, auto_memory=host.auto_memory)
        jax.jit(lambda x: x * 3)(jnp.ones(7))  # the log works: this one compiles
    assert other.tokens == host.tokens == ar
    assert spec_program._cache_size() == programs
    logged = [r.getMessage() for r in caplog.records]
    assert any(msg.startswith("Compiling jit(<lambda>)") for msg in logged)
    assert not [msg for msg in logged if "jit(spec_program)" in msg]
    # a table with another static part is another program
    hopeless = validate(target, drafter, PROMPTS3, method=_auto(random_pair, (1.0, 9.0, 9.0, 9.0, 9.0)),
                        max_new_tokens=NEW)
    assert hopeless.plan != runs[0].plan and hopeless.plan.method.viable == (True, False, False, False, False)
    # the compiled program alone, with its inputs already on device: no transfer of any kind
    args, inputs = jax.block_until_ready((runs[0].device_args(), runs[0].device_inputs()))
    with jax.transfer_guard("disallow"):
        jax.block_until_ready(spec_program(*split_pair(target, drafter), *args, inputs, plan=runs[0].plan,
                                           cache_size=runs[0].cache_size, buf_len=runs[0].buf_len))


# ----------------------------------------------------------------------------- the round


def test_branches_return_identical_state_layouts(random_pair):
    target, drafter = random_pair
    run = validate(target, drafter, PROMPTS3, method=_auto(random_pair), max_new_tokens=NEW)
    plan, args = run.plan, run.device_args()
    state = jax.eval_shape(lambda a, i: spec_start(*split_pair(target, drafter), *a, i, plan=plan,  # shapes only
                                                   cache_size=run.cache_size, buf_len=run.buf_len),
                           args, run.device_inputs())
    blk = jax.eval_shape(lambda s: adaptive.draft(target, drafter, s, plan=plan), state)
    aprop = jax.eval_shape(lambda s, b: adaptive.auto_propose(target, drafter, s, b, jax.random.key(1), plan=plan),
                           state, blk)
    assert aprop.raw.shape == (3, len(SIZES))
    layouts = []
    for i in range(len(SIZES)):
        out = jax.eval_shape(
            lambda s, a, i=i: adaptive._branch(i, target, drafter, s, a, jax.random.key(2), plan=plan), state, aprop)
        layouts.append((jax.tree.structure(out), [(x.shape, x.dtype) for x in jax.tree.leaves(out)]))
    assert all(lay == layouts[0] for lay in layouts[1:])
    # the auto round keeps the state's own layout (the while_loop carry)
    new = jax.eval_shape(lambda s: adaptive.auto_round(target, drafter, s, plan), state)
    assert jax.tree.structure(new) == jax.tree.structure(state)
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(new)] == [(x.shape, x.dtype) for x in jax.tree.leaves(state)]


def test_a_probe_builds_the_tree_only_when_a_tree_is_picked_or_never_built(random_pair):
    """A probe (idle > 0) builds the chain, and the largest tree only if the policy picks a tree or no tree
    prediction exists yet and some tree size is viable."""
    target, drafter = random_pair
    run, args, state = _start(random_pair)
    assert int(state.extra.idle) > 0  # the first round is a probe
    blk = jax.jit(lambda st: adaptive.draft(target, drafter, st, plan=run.plan))(state)  # one program, not op by op

    @functools.partial(jax.jit, static_argnames="plan")
    def builds_tree(st, *, plan):
        return adaptive.auto_propose(target, drafter, st, blk, jax.random.key(1), jnp.int32(SIZES.index("chain")),
                                    plan=plan).tree_built

    def probe_builds_tree(last, plan=run.plan):
        st = dataclasses.replace(state, extra=dataclasses.replace(state.extra, last=jnp.asarray(last, jnp.float32)))
        return bool(builds_tree(st, plan=plan))

    k = len(SIZES)
    assert probe_builds_tree(np.zeros((3, k)))  # no tree prediction yet: built
    assert probe_builds_tree(np.tile([0, 0, 50.0, 60.0, 70.0], (3, 1)))  # trees promise far more: a tree
    assert not probe_builds_tree(np.tile([0, 0, 1e-3, 1e-3, 1e-3], (3, 1)))  # known, hopeless: no tree
    # every tree size costs more plain steps than half its most tokens: not viable, never built, even unknown
    costly = run.plan.method.with_table(run.plan, _table(random_pair, seconds=(1.0, 1.1, 50.0, 60.0, 70.0)))
    assert not probe_builds_tree(np.zeros((3, k)), costly)


def test_plain_burst_extends_the_drafter_context_like_single_steps(random_pair):
    """A burst of plain steps projects the drafter's context once per chunk of ``depth + 1`` steps; the context
    (and everything else) must equal that of the steps taken one by one, each extending the context."""
    target, drafter = random_pair
    run, args, state = _start(random_pair)
    plan = run.plan
    steps = 2 * (plan.depth + 1) + 3  # two whole chunks and a partial one
    state = dataclasses.replace(state, extra=dataclasses.replace(state.extra, gap=jnp.int32(steps), idle=jnp.int32(0)))
    key = jax.random.key(3)
    burst = jax.jit(lambda s: adaptive.auto_plain(target, drafter, s, key, plan=plan))(state)

    @jax.jit
    def one(s, j):
        return adaptive._plain_step(target, drafter, s, jax.random.fold_in(key, j), plan)[0]

    single = state
    for j in range(steps):
        single = one(single, j)
    assert int(burst.extra.idle) == steps
    np.testing.assert_array_equal(burst.out, single.out)
    np.testing.assert_array_equal(burst.ctx.lengths, single.ctx.lengths)
    np.testing.assert_array_equal(burst.cache.lengths, single.cache.lengths)
    assert int(burst.ctx.lengths.min()) == int(state.ctx.lengths.min()) + steps
    for b, n in enumerate(np.asarray(burst.ctx.lengths)):
        for got, want in ((burst.ctx.k, single.ctx.k), (burst.ctx.v, single.ctx.v)):
            np.testing.assert_allclose(np.stack(got)[:, b, :, :n], np.stack(want)[:, b, :, :n], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_instrumented_and_stream_auto_match(random_pair, ar_tokens):
    target, drafter = random_pair
    m = _auto(random_pair)
    ar = ar_tokens(PROMPTS3)
    inst = generate(target, drafter, PROMPTS3, method=m, max_new_tokens=NEW, instrument=True)
    assert inst.tokens == ar and inst.size_counts
    chunks = list(sparkjax.stream(target, drafter, PROMPTS3, method=m, max_new_tokens=NEW))
    assert [sum((c[b] for c in chunks), []) for b in range(3)] == ar


# ----------------------------------------------------------------------------- the memory carried across generations


@pytest.mark.slow  # the default run keeps a carried memory's exactness in the traced-input test
@pytest.mark.parametrize("batch", [1, 3])
def test_auto_memory_carries_across_generations_and_stays_exact(random_pair, ar_tokens, batch):
    """A chain of generations, each from the last one's memory (host copies, across batch sizes too): the tokens
    are the target's greedy ones; the memory has the method's candidates and sane values."""
    target, drafter = random_pair
    m = _auto(random_pair)
    memory = None
    for prompts in (PROMPTS3[:batch], PROMPTS3[::-1][:batch], PROMPTS3[1:2]):
        out = generate(target, drafter, prompts, method=m, max_new_tokens=NEW, auto_memory=memory)
        assert out.tokens == ar_tokens(prompts)
        memory = out.auto_memory
        assert memory.labels == m.resolve(drafter).labels()
        assert all(np.asarray(getattr(memory, f)).shape == (len(SIZES),) for f in ("real", "pred", "last"))
        assert np.all(np.isfinite(memory.real)) and np.all(memory.real >= 0) and 1 <= int(memory.gap) <= 128
    assert generate(target, drafter, PROMPTS3[:1], method="dspark", max_new_tokens=8).auto_memory is None


@pytest.mark.slow
def test_memory_and_table_set_the_first_round_state_and_plain_steps(random_pair, ar_tokens):
    """init_state from a memory (its calibration, predictions, gap; a probe due at once) or fresh; a memory of
    drafts accepting nothing makes every round a plain step, cheap drafts in a fresh start draft. When no drafted
    size can pay, a generation is plain steps only and the prompt's features never enter the drafter's context;
    a drafting auto (decide="draft") still keeps it."""
    target, drafter = random_pair
    m = _auto(random_pair)
    run = validate(target, drafter, PROMPTS3, method=m, max_new_tokens=NEW)
    k = len(SIZES)
    mem = adaptive.AutoMemory(real=np.zeros(k, np.float32), pred=np.full(k, 50.0, np.float32),
                              last=np.arange(k, dtype=np.float32), gap=np.int32(40), labels=run.plan.method.labels())
    st = adaptive.init_state(run.plan, 3, 20, adaptive.auto_inputs(run.plan, mem))
    np.testing.assert_array_equal(st.pred, mem.pred)
    np.testing.assert_array_equal(st.last, np.broadcast_to(mem.last, (3, k)))
    np.testing.assert_allclose(st.seconds, BASE)
    assert int(st.gap) == 40 and int(st.idle) == 40
    fresh = adaptive.init_state(run.plan, 3, 20, run.inputs)
    assert int(fresh.gap) == int(fresh.idle) == run.plan.method.floor == 4 and not np.asarray(fresh.pred).any()
    ar = ar_tokens(PROMPTS3)
    hopeless_memory = generate(target, drafter, PROMPTS3, method=m, max_new_tokens=NEW, auto_memory=mem)
    assert hopeless_memory.tokens == ar and set(hopeless_memory.size_counts) == {"ar"}
    eager = generate(target, drafter, PROMPTS3, method=_auto(random_pair, (1.0, 0.01, 0.01, 0.01, 0.01)),
                     max_new_tokens=NEW)
    assert eager.tokens == ar and set(eager.size_counts) != {"ar"}
    hopeless = _auto(random_pair, (1.0, 100.0, 100.0, 100.0, 100.0))
    out = generate(target, drafter, PROMPTS3, max_new_tokens=NEW, method=hopeless)
    assert out.tokens == ar and set(out.size_counts) == {"ar"}
    for method, kept in ((hopeless, False), (m, True)):
        run, _, state = _start(random_pair, method)
        assert run.plan.context == kept
        assert bool((np.asarray(state.ctx.lengths) > 0).all()) == kept
        if not kept:  # drafting every round (decide="draft") needs the context whatever the table
            bound = dataclasses.replace(run.plan.method, decide="draft")
            assert bound.with_table(run.plan, bound.table).context


def test_bad_auto_memory_names_the_argument(random_pair):
    target, drafter = random_pair
    m = _auto(random_pair)
    # a well-formed memory without a generation (memory is checked before anything compiles; a real output's
    # memory is accepted in the memory tests above)
    good = adaptive.fresh_memory(validate(target, drafter, PROMPTS3[:1], method=m, max_new_tokens=6).plan)
    other = _auto(random_pair, sizes=(0, "chain", 8), seconds=(1.0, 1.3, 1.4))
    bad = [
        (dict(method="dspark", auto_memory=good), "keeps no memory"),
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


@pytest.mark.slow
def test_eval_runner_carries_auto_memory_per_chain(random_pair, ar_tokens, monkeypatch):
    """The eval's pair runner keeps the memory of each chain (batch size, repetition) of method auto, and none without
    carry_auto or for other methods; its default auto takes the table for its shape (here a hand-made one)."""
    from sparkjax.engine import parse_method
    from sparkjax.eval.engine import PairRunner

    target, drafter = random_pair
    monkeypatch.setattr(costs, "profile", lambda t, d, plan, **kw: _table(random_pair, plan.method.sizes,
                                                                           BASE[: len(plan.method.sizes)]))
    kw = dict(eos=[], temperature=0.0, max_new_tokens=6, cache_size=64, prompt_width=8)
    eng = PairRunner(target, drafter, **kw)
    mc = parse_method("auto@16")
    assert eng.memory(mc, 1, 0) is None
    res = eng.launch(mc, PROMPTS3[:1], 0)
    eng.remember(mc, 1, 0, res)
    assert isinstance(eng.memory(mc, 1, 0), adaptive.AutoMemory) and eng.memory(mc, 1, 1) is None
    out = eng.outputs(eng.launch(mc, PROMPTS3[:1], 0, auto_memory=eng.memory(mc, 1, 0)), 1)
    assert out.tokens == [t[:6] for t in ar_tokens(PROMPTS3[:1])]
    eng.remember(parse_method("dspark"), 1, 0, eng.launch(parse_method("dspark"), PROMPTS3[:1], 0))
    assert eng.memory(parse_method("dspark"), 1, 0) is None
    fresh = PairRunner(target, drafter, carry_auto=False, **kw)
    fresh.remember(mc, 1, 0, res)
    assert fresh.memory(mc, 1, 0) is None


# ----------------------------------------------------------------------------- the cost table


def test_profile_costs_times_rounds_net_of_the_call_and_the_plain_step_in_a_burst(random_pair, monkeypatch):
    """On a fake clock: a candidate's time is its call's less a call of no round (PROFILE_ROUNDS forced rounds,
    the plain step one burst of PROFILE_BURST); a net time not positive keeps the whole time (never 0)."""
    target, drafter = random_pair
    sizes = (0, "chain", 6)
    per_step = {0: 0.5e-3, 1: 3e-3, 2: 4e-3}  # seconds per plain step / per drafted round
    overhead = 7e-3
    clock = [0.0]
    calls = []

    def fake(graphdefs, states, start, force, rounds, *, plan):
        i, rounds = int(force), int(rounds)
        calls.append((i, rounds, int(start.extra.gap)))
        clock[0] += overhead + rounds * (int(start.extra.gap) if i == 0 else 1) * per_step[i]
        return start

    monkeypatch.setattr(costs, "forced_rounds", fake)
    monkeypatch.setattr(costs.time, "perf_counter", lambda: clock[0])
    table = profile_costs(target, drafter, method=Auto(sizes=sizes), repeats=3)
    np.testing.assert_allclose(table.seconds, [per_step[0], per_step[1], per_step[2]], rtol=1e-9)
    timed = {(i, r, g) for i, r, g in calls if r > 0}
    assert timed == {(0, 1, costs.PROFILE_BURST), (1, costs.PROFILE_ROUNDS, 1), (2, costs.PROFILE_ROUNDS, 1)}
    # each timed call has its empty twin right after it (the warm-up's first call, empty too, compiles)
    assert all(calls[j + 1] == (i, 0, g) for j, (i, r, g) in enumerate(calls) if r > 0)
    assert sum(r == 0 for _, r, _ in calls) == sum(r > 0 for _, r, _ in calls) + 1

    def noisy(graphdefs, states, start, force, rounds, *, plan):
        clock[0] += 1e-3 if int(rounds) else 5e-3  # a busy machine: the empty call took longer than the whole one
        return start

    monkeypatch.setattr(costs, "forced_rounds", noisy)
    busy = profile_costs(target, drafter, method=Auto(sizes=sizes), repeats=1)
    assert busy.seconds[0] == pytest.approx(1e-3 / costs.PROFILE_BURST)
    assert busy.seconds[1] == pytest.approx(1e-3 / costs.PROFILE_ROUNDS) and min(busy.seconds) > 0


@pytest.mark.slow
def test_profile_costs_save_load_and_unreadable_tables(random_pair, ar_tokens, tmp_path):
    target, drafter = random_pair
    tab = profile_costs(target, drafter, method=Auto(sizes=(0, "chain")), batch_size=2, cache_size=64, repeats=1)
    assert tab.labels == ("ar", "dspark")
    assert all(s > 0 for s in tab.seconds) and all(0 < b <= s for b, s in zip(tab.best, tab.seconds, strict=True))
    key = tab.key_dict
    assert key["batch"] == 2 and key["cache_size"] == 64 and key["device"].startswith(jax.devices()[0].platform)
    assert key["jax"] == jax.__version__
    path = tmp_path / "costs.json"
    tab.save(path)
    back = load_cost_table(path, target=target, drafter=drafter, method=Auto(sizes=(0, "chain")),
                           batch_size=2, cache_size=64)
    assert back == tab
    m = Auto(sizes=(0, "chain"), table=back)  # a loaded table is used as is
    assert generate(target, drafter, PROMPTS3, method=m, max_new_tokens=NEW).tokens == ar_tokens(PROMPTS3)
    with pytest.raises(CostTableError, match=r"costs.json: key 'batch' is 2, this run needs 4"):
        load_cost_table(path, target=target, drafter=drafter, method=Auto(sizes=(0, "chain")),
                        batch_size=4, cache_size=64)
    with pytest.raises(CostTableError, match="key 'candidates'"):
        load_cost_table(path, target=target, drafter=drafter, method=Auto(sizes=(0, 4)), batch_size=2,
                        cache_size=64)
    # a pool with an idle slot: the same program, one sequence running; the key says so
    one = profile_costs(target, drafter, method=Auto(sizes=(0, "chain")), batch_size=2, cache_size=64, repeats=1,
                        active=1)
    assert one.key_dict["active"] == 1 and "active" not in key and all(s > 0 for s in one.seconds)
    with pytest.raises(ArgumentError, match="active: 3 running sequences of a batch of 2"):
        profile_costs(target, drafter, method=Auto(sizes=(0, "chain")), batch_size=2, active=3)
    # unreadable tables name the file
    neg = {"format": "sparkjax-cost-table", "key": {}, "candidates": [{"label": "ar", "seconds": -1.0}]}
    for name, text, words in (("none", None, "none.json: unreadable"), ("bad", "{not json", "bad.json: unreadable"),
                              ("other", json.dumps({"format": "x"}), "other.json: unreadable.*not a sparkjax cost"),
                              ("neg", json.dumps(neg), "neg.json")):
        if text is not None:
            (tmp_path / f"{name}.json").write_text(text)
        with pytest.raises(CostTableError, match=words):
            load_cost_table(tmp_path / f"{name}.json")
    assert issubclass(CostTableError, SparkjaxError)


# ----------------------------------------------------------------------------- the per-machine table cache


def test_a_profiled_table_is_kept_per_machine_and_a_damaged_file_is_rewritten(random_pair, ar_tokens, tmp_path,
                                                                               monkeypatch, recwarn):
    """The first default ``auto`` run profiles and writes its table; a new process reads it; a damaged file (bad
    JSON, wrong fields, another key) is ignored with one warning and rewritten; ``off`` writes nothing."""
    target, drafter = random_pair
    monkeypatch.setenv("SPARKJAX_CACHE_DIR", str(tmp_path))
    profiled = []

    def fake(t, d, plan, *, batch_size, cache_size, **kw):
        profiled.append((batch_size, cache_size))
        return CostTable(plan.method.labels(), BASE, BASE, costs.cost_key(t, d, plan, batch_size, cache_size))

    monkeypatch.setattr(costs, "profile", fake)
    ar = ar_tokens(PROMPTS3)
    assert generate(target, drafter, PROMPTS3, method=Auto(sizes=SIZES), max_new_tokens=NEW).tokens == ar
    files = list((tmp_path / "costs").glob("*.json"))
    assert len(profiled) == 1 and len(files) == 1
    saved = load_cost_table(files[0])
    assert saved.seconds == BASE and saved.key_dict["jax"] == jax.__version__
    monkeypatch.setattr(costs, "_TABLES", {})

    def refuse(*a, **k):
        raise AssertionError("profiled although the cache folder holds the table")

    monkeypatch.setattr(costs, "profile", refuse)
    assert generate(target, drafter, PROMPTS3, method=Auto(sizes=SIZES), max_new_tokens=NEW).tokens == ar
    monkeypatch.setattr(costs, "profile", fake)
    plan = Auto(sizes=SIZES).plan(target, drafter, False)
    other_key = dataclasses.replace(saved, key=(("batch", 99),))
    for damage in ("{not json", json.dumps({"format": "sparkjax-cost-table", "candidates": []}),
                   json.dumps(other_key.as_dict())):
        files[0].write_text(damage)
        monkeypatch.setattr(costs, "_TABLES", {})
        recwarn.clear()
        assert costs.table_for(target, drafter, plan, 3, 64).seconds == BASE
        assert len(recwarn) == 1 and "damaged cost table" in str(recwarn[0].message)
        assert "\n" not in str(recwarn[0].message)
        assert load_cost_table(files[0]).key == costs.cost_key(target, drafter, plan, 3, 64)  # rewritten
    off = tmp_path / "off"
    monkeypatch.setenv("SPARKJAX_CACHE_DIR", "off")
    monkeypatch.setattr(costs, "_TABLES", {})
    costs.table_for(target, drafter, plan, 3, 64)
    assert not off.exists() and list((tmp_path / "costs").glob("*.json")) == files


def test_a_pool_table_profiles_each_batch_size_once_compiling_all_before_timing(random_pair, tmp_path,
                                                                              monkeypatch, caplog):
    """A pool's table profiles each visit size once, all of its batch running (the midpoint count of a larger
    batch gets that batch's table); every size's programs compile, two at a time, before any timing starts; a
    second process reads them all from the cache folder."""
    import threading

    target, drafter = random_pair
    monkeypatch.setenv("SPARKJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(costs, "profile_threads", lambda: 2)
    plan = Auto(sizes=SIZES).plan(target, drafter, False)
    events = []
    both = [threading.Barrier(2, timeout=60)]  # broken unless two compile at once

    def compile_programs(self):
        events.append(("compile", self.batch_size))
        both[0].wait()
        self.start = "compiled"
        events.append(("compiled", self.batch_size))
        return self

    def warm(self):
        assert self.start == "compiled"
        events.append(("warm", self.batch_size))
        self.warm_s = 0.1 * self.batch_size
        return self

    def measure(self):
        assert self.warm_s is not None
        events.append(("time", self.batch_size))
        return CostTable(self.plan.method.labels(), tuple(self.batch_size * s for s in BASE), key=self.key)

    monkeypatch.setattr(costs.Profiler, "compile_programs", compile_programs)
    monkeypatch.setattr(costs.Profiler, "warm", warm)
    monkeypatch.setattr(costs.Profiler, "measure", measure)
    caplog.set_level(logging.INFO, logger="sparkjax.auto")
    table = costs.pool_table_for(target, drafter, plan, 8, 64, sizes=(1, 8))
    assert table.counts == (1, 4, 8)
    # the log: both stages, each step with its count, the compile stage's total before the first warm-up
    logged = [r.getMessage() for r in caplog.records if r.name == "sparkjax.auto"]
    stage = [m for m in logged if ": compiling" in m or "timing" in m or " timed in " in m]
    assert [m.split(";")[0].split(" (")[0].split(" in ")[0] for m in stage] == [
        *sorted(f"profiling auto's round costs: compiling: batch size {i} of 2" for i in (1, 2)),
        "profiling auto's round costs: compiling: 2 batch sizes",
        "profiling auto's round costs: warming up and timing: batch size 1 of 2", "batch 1 warmed up and timed",
        "profiling auto's round costs: warming up and timing: batch size 2 of 2", "batch 8 warmed up and timed",
        "profiling auto's round costs: warming up and timing: 2 batch sizes"]
    assert "(2 at a time)" in stage[2] and f"{len(SIZES)} candidates x 5 repetitions" in stage[3]
    assert "about 0 s at its warm-up's pace" in stage[3] and "about 4 s at its warm-up's pace" in stage[5]
    assert sorted(events[:2]) == [("compile", 1), ("compile", 8)]  # both compiling at once
    assert sorted(events[2:4]) == [("compiled", 1), ("compiled", 8)]
    assert events[4:] == [("warm", 1), ("time", 1), ("warm", 8), ("time", 8)]  # each alone, after every compile
    assert [t.key_dict["batch"] for t in table.tables] == [1, 8, 8]
    assert all("active" not in t.key_dict for t in table.tables)
    assert table.tables[1] is table.tables[2] and table.rows()[3] == table.rows()[7]  # 4 active: batch 8's row
    assert table.rows()[1] == pytest.approx([(1 + 7 / 3) * s for s in BASE])  # 2 active: a third of the way from 1 to 8
    assert len(list((tmp_path / "costs").glob("*.json"))) == 2
    monkeypatch.setattr(costs, "_TABLES", {})
    events.clear()
    again = costs.pool_table_for(target, drafter, plan, 8, 64, sizes=(1, 8))
    assert events == [] and again.rows() == table.rows()
    # only the missing size is profiled
    monkeypatch.setattr(costs, "_TABLES", {})
    both[0] = threading.Barrier(1)
    costs._path(costs.cost_key(target, drafter, plan, 8, 64)).unlink()
    assert costs.pool_table_for(target, drafter, plan, 8, 64, sizes=(1, 8)).rows() == table.rows()
    assert events == [("compile", 8), ("compiled", 8), ("warm", 8), ("time", 8)]


@pytest.mark.slow
def test_profile_points_times_each_batch_size(random_pair):
    """profile_points on the device: a table per batch size, its key that batch's (no idle slot)."""
    target, drafter = random_pair
    plan = Auto(sizes=(0, "chain")).plan(target, drafter, False)
    one, two = costs.profile_points(target, drafter, plan, [1, 2], 64, workers=2, repeats=1)
    assert one.key == costs.cost_key(target, drafter, plan, 1, 64)
    assert two.key == costs.cost_key(target, drafter, plan, 2, 64)
    assert one.labels == two.labels == ("ar", "dspark") and min(one.seconds + two.seconds) > 0


@pytest.mark.slow
def test_default_auto_profiles_once_and_is_exact(random_pair, ar_tokens, monkeypatch):
    target, drafter = random_pair
    calls = []
    real = costs.profile

    def counting(*a, **k):
        calls.append(k.get("batch_size"))
        return real(*a, **{**k, "repeats": 1})

    monkeypatch.setattr(costs, "profile", counting)
    ar = ar_tokens(PROMPTS3)
    assert generate(target, drafter, PROMPTS3, method="auto", max_new_tokens=NEW).tokens == ar
    assert generate(target, drafter, PROMPTS3, method="auto", max_new_tokens=12).tokens == [t[:12] for t in ar]
    assert calls == [3]  # profiled once for this batch and cache size, then kept in the process


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kw,words", [
    (dict(sizes=()), "sizes: empty candidate set"), (dict(sizes=[]), "sizes: empty candidate set"),
    (dict(sizes="chain"), "sizes"), (dict(sizes=(0, "tree")), r"sizes\[1\]"), (dict(sizes=(0, -3)), r"sizes\[1\]"),
    (dict(sizes=(0, True)), r"sizes\[1\]"), (dict(sizes=(8, 8)), r"sizes\[1\]: 8 is listed twice"),
    (dict(sizes=(0, 8, 128), budget=64), "sizes: tree size 128 exceeds budget=64"),
    (dict(tree="dspark"), "tree"), (dict(tree="sparklingtree-beam"), "tree"), (dict(chain="ddtree"), "chain"),
    (dict(decide="later"), "decide"), (dict(probe=0), "probe"), (dict(viable_share=0), "viable_share"),
    (dict(viable_share=1.5), "viable_share"), (dict(viable_share="half"), "viable_share"),
    (dict(viable_share=float("nan")), "viable_share"), (dict(table={"ar": 1.0}), "table"),
])
def test_bad_auto_options_name_the_argument(kw, words):
    with pytest.raises(ArgumentError, match=words):
        Auto(**kw)


def test_auto_checks_against_the_pair(random_pair):
    target, drafter = random_pair
    plain = testing.random_pair(markov=None)[1]
    for call, words in (
        (lambda: generate(target, None, PROMPTS3, method="auto"), "drafter: method 'auto' needs a drafter"),
        # 16 ** 4 + ... reachable, but not with top_c=2
        (lambda: generate(target, drafter, PROMPTS3, method=Auto(sizes=(0, 64), top_c=2), max_new_tokens=4), "budget"),
        (lambda: generate(target, drafter, PROMPTS3, method=Auto(sizes=(0, 8), table=_table(random_pair)),
                          max_new_tokens=4), "table: its candidates"),
        (lambda: profile_costs(target, drafter, method="dspark"),
         "method: profile_costs times the candidates of method 'auto'"),
        (lambda: load_cost_table("x.json", target=target, drafter=drafter, method="ar", batch_size=1, cache_size=64),
         "method: cost tables are for method 'auto'"),
        (lambda: generate(target, plain, PROMPTS3, method=Auto(tree="sparklingtree"), max_new_tokens=4),
         "method: 'auto' needs a drafter with a Markov head"),
    ):
        with pytest.raises(ArgumentError, match=words):
            call()


def test_eval_describes_every_default_method(random_pair):
    """The eval's per-method record (results.json) for every method it runs by default, auto included: the
    tree options resolve (auto reports the candidates of the tree it builds; chains have none)."""
    from sparkjax.engine import parse_method
    from sparkjax.eval.config import EvalConfig, method_configs
    from sparkjax.eval.engine import PairRunner

    target, drafter = random_pair
    eng = PairRunner(target, drafter, eos=[], temperature=0.0, max_new_tokens=8, cache_size=256, prompt_width=64)
    seen = {}
    for mc in method_configs(EvalConfig(methods=sparkjax.engine.METHODS))[0]:  # the eval's own budgets
        seen[mc.name] = eng.describe(mc)
    assert set(seen) == set(sparkjax.engine.METHODS) and seen["pctree"]["nodes"] == 16  # 1 + k x depth 4, the root
    assert eng.plan(parse_method("auto")).candidates == "union"
    assert seen["auto"]["nodes"] == max(Auto().sizes[2:])
    assert eng.plan(parse_method("dspark")).candidates is None and seen["ddtree"]["candidates"] == "base"
    assert seen["sparklingtree"]["candidates"] == "union"
