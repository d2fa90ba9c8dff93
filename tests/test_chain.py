"""The DSpark Markov chain: the fixed-point (Jacobi) formulation gives the scan's tokens (greedy and sampled, batch 1
and 3) and the logits they were chosen from within G passes (integer weights: exact logits, ties bit for bit); the
first-max helpers of sparkjax.sampling against jnp.argmax / jax.random.categorical."""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkjax import sampling
from sparkjax.config import DrafterConfig
from sparkjax.engine import Options, drafting, generate
from sparkjax.errors import ArgumentError
from sparkjax.nn.drafter import Drafter

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "tiny_dspark_b16")
V, G, R = 24, 8, 4  # the hypothesis drafters: small vocabulary, block 8, rank 4


def small_drafter(head_type="vanilla", vocab=V, block=G, rank=R, seed=0) -> Drafter:
    with open(os.path.join(FIX, "drafter", "config.json")) as f:
        base = json.load(f)
    cfg = DrafterConfig.from_hf_config({
        **base, "vocab_size": vocab, "block_size": block, "markov_rank": rank, "markov_head_type": head_type,
        "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "layer_types": ["full_attention"],
        "head_dim": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "mask_token_id": vocab - 1,
    })
    return Drafter(cfg, rngs=nnx.Rngs(seed))


class Runner:
    """Both chain formulations of one drafter structure, jitted once; weights are arguments."""

    def __init__(self, drafter: Drafter, candidates: int = drafting.CHAIN_CANDIDATES):
        self.module = drafter
        self.graphdef, self.state = nnx.split(drafter)
        gd = self.graphdef

        def both(state, base, hidden, x0, temperature, key):
            d = nnx.merge(gd, state)
            ref = drafting.markov_chain(d, base, hidden, x0, temperature, key, mode="scan")
            fp, passes = drafting.markov_chain_fixed_point(d, base, hidden, x0, temperature, key,
                                                           candidates=candidates)
            forced = base + drafting.markov_bias(d, hidden, drafting.chain_prev(x0, fp.tokens))
            return ref, fp, passes, forced

        self.greedy = jax.jit(lambda state, base, hidden, x0: both(state, base, hidden, x0, 0.0, None))
        self.sampled = jax.jit(both)

    def with_weights(self, w1, w2):
        d = nnx.clone(self.module)
        d.markov_head.markov_w1.weight[...] = jnp.asarray(w1, jnp.float32)
        d.markov_head.markov_w2.weight[...] = jnp.asarray(w2, jnp.float32)
        return nnx.split(d)[1]


@pytest.fixture(scope="module")
def runners():
    return {(kind, c): Runner(small_drafter(kind), c) for kind, c in HEADS}


HEADS = [("vanilla", 0), ("vanilla", 3), ("gated", 8)]  # (head type, candidates per slot)


def check_chain(ref, fp, passes, forced, g, exact):
    np.testing.assert_array_equal(np.asarray(fp.tokens), np.asarray(ref.tokens))
    if exact:
        np.testing.assert_array_equal(np.asarray(fp.logits), np.asarray(ref.logits))
    else:
        np.testing.assert_allclose(np.asarray(fp.logits), np.asarray(ref.logits), rtol=1e-6, atol=1e-5)
    # the returned logits are the corrected logits of the chain's own prev ids
    np.testing.assert_allclose(np.asarray(fp.logits), np.asarray(forced), rtol=1e-6, atol=1e-5)
    assert 1 <= int(passes) <= g


@pytest.mark.slow  # over 5 s; CI runs it in its slow step
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.sampled_from([1, 3]),
    integer=st.booleans(),
    head=st.sampled_from(HEADS),
    temperature=st.sampled_from([None, 0.0, 0.5, 1.0, 3.0]),
)
def test_fixed_point_equals_scan(runners, seed, batch, integer, head, temperature):
    rng = np.random.default_rng(seed)
    kind = head[0]
    if integer:  # small integers: exact logits, many ties
        w1 = rng.integers(-1, 2, (V, R))
        w2 = rng.integers(-2, 3, (V, R))
        base = rng.integers(-3, 4, (batch, G, V)).astype(np.float32)
    else:
        w1 = rng.normal(size=(V, R))
        w2 = rng.normal(size=(V, R)) * rng.choice([0.3, 1.0, 3.0])
        base = rng.normal(size=(batch, G, V)).astype(np.float32) * 2
    hidden = jnp.asarray(rng.normal(size=(batch, G, 16)), jnp.float32)
    x0 = jnp.asarray(rng.integers(0, V, batch), jnp.int32)
    r = runners[head]
    state = r.with_weights(w1, w2)
    if temperature is None:
        out = r.greedy(state, jnp.asarray(base), hidden, x0)
    else:
        out = r.sampled(state, jnp.asarray(base), hidden, x0, jnp.float32(temperature), jax.random.key(seed))
    check_chain(*out, G, exact=integer and kind == "vanilla")


@pytest.mark.slow  # about 20 s on a loaded machine; CI runs it in its slow step
def test_pass_counts_best_and_worst_case():
    """W2 = 0: one pass. A head forcing ``next = prev + 1``: every token a candidate, one pass; plain Jacobi on
    zero base logits, G passes; 2 candidates never holding the true token, about G. Always the scan's tokens."""
    v = g = 12
    drafter = small_drafter(vocab=v, block=g, rank=v)
    runs = {c: Runner(drafter, c) for c in (0, 2, v)}
    hidden = jnp.zeros((3, g, 16), jnp.float32)
    x0 = jnp.array([2, 5, 9], jnp.int32)
    zero = jnp.zeros((3, g, v), jnp.float32)
    for c, r in runs.items():
        ref, fp, passes, forced = r.greedy(r.with_weights(np.eye(v), np.zeros((v, v))), zero, hidden, x0)
        check_chain(ref, fp, passes, forced, g, exact=True)
        assert int(passes) == 1 and np.all(np.asarray(fp.tokens) == 0), c
    shift = np.roll(np.eye(v), 1, axis=0) * 10  # bias(prev)[w] = 10 if w == prev + 1 (mod v)
    favour = zero.at[..., :2].set(3.0)  # the base prefers tokens 0 and 1 at every slot
    want = (np.asarray(x0)[:, None] + np.arange(1, g + 1)[None]) % v
    for c, base, n in ((0, zero, g), (2, favour, None), (v, favour, 1)):
        r = runs[c]
        ref, fp, passes, forced = r.greedy(r.with_weights(np.eye(v), shift), base, hidden, x0)
        check_chain(ref, fp, passes, forced, g, exact=True)
        np.testing.assert_array_equal(np.asarray(fp.tokens), want)
        if n is not None:
            assert int(passes) == n, c
        else:  # the chain visits 0 and 1 once per 12 tokens: a pass is lost at all but those slots
            assert int(passes) >= g - 3, c
        # sampled at a low temperature the same chain comes out (the bias dominates the Gumbel noise)
        ref, fp, passes, forced = r.sampled(r.with_weights(np.eye(v), shift * 20), base, hidden, x0,
                                            jnp.float32(0.5), jax.random.key(3))
        check_chain(ref, fp, passes, forced, g, exact=True)
        np.testing.assert_array_equal(np.asarray(fp.tokens), want)


@pytest.mark.slow  # about 20 s on a loaded machine; CI runs it in its slow step
def test_fixture_rounds_both_formulations(ref, fixture_drafter):
    """Every round of the fixture's generation: fixed point == scan (per round and all 41 as a batch, greedy and
    sampled) == upstream DeepSpec's draft tokens at every decisive slot."""
    drafter = fixture_drafter
    assert not drafter.markov_head.gated  # the vanilla head ignores the block hidden states
    r = Runner(drafter)
    state = r.state
    g = drafter.config.block_size
    base = jnp.asarray(ref["c.round_base_logits"])
    starts = ref["c.round_start"]
    x0 = jnp.asarray(ref["c.spec_output_ids"][0, starts], jnp.int32)
    hidden = jnp.zeros((base.shape[0], g, drafter.config.hidden_size), jnp.float32)
    upstream = ref["c.round_verify_input_ids"][:, 1:]
    accs = ref["c.acceptance_lengths"]

    chain_ref, fp, passes, forced = r.greedy(state, base, hidden, x0)
    check_chain(chain_ref, fp, passes, forced, g, exact=False)
    for i in range(base.shape[0]):
        decisive = min(int(accs[i]), g)
        np.testing.assert_array_equal(np.asarray(fp.tokens[i, :decisive]), upstream[i, :decisive])
        one = r.greedy(state, base[i:i + 1], hidden[i:i + 1], x0[i:i + 1])
        check_chain(*one, g, exact=False)
        np.testing.assert_array_equal(np.asarray(one[1].tokens[0]), np.asarray(fp.tokens[i]))
    assert np.sum(np.all(np.asarray(fp.tokens) == upstream, axis=1)) >= base.shape[0] - 2
    for seed in range(4):
        out = r.sampled(state, base, hidden, x0, jnp.float32(1.0), jax.random.key(seed))
        check_chain(*out, g, exact=False)
        out = r.sampled(state, base[:3], hidden[:3], x0[:3], jnp.float32(0.7), jax.random.key(seed))
        check_chain(*out, g, exact=False)


def test_markov_chain_modes_errors_and_one_device_program(ref, fixture_drafter):
    drafter = fixture_drafter
    base = jnp.asarray(ref["b.base_logits"])
    hidden = jnp.asarray(ref["b.block_hidden"])
    x0 = jnp.asarray(ref["b.first_token"], jnp.int32)
    for mode in drafting.CHAIN_MODES:  # one program each, not op by op
        chain = jax.jit(lambda b, h, x, m=mode: drafting.markov_chain(drafter, b, h, x, mode=m))(base, hidden, x0)
        np.testing.assert_array_equal(np.asarray(chain.tokens), ref["b.draft_tokens"], err_msg=mode)
        np.testing.assert_allclose(np.asarray(chain.logits), ref["b.corrected_logits"], rtol=1e-4, atol=1e-4)
    # auto: the scan on the CPU backend, the fixed point on accelerators
    assert drafting.chain_mode() == ("scan" if jax.default_backend() == "cpu" else "fixed_point")
    assert drafting.chain_mode("fixed_point") == "fixed_point" and drafting.chain_mode("scan") == "scan"
    with pytest.raises(ArgumentError, match="^mode:.*'jacobi'"):
        drafting.markov_chain(drafter, base, hidden, x0, mode="jacobi")
    with pytest.raises(ArgumentError, match="key"):
        drafting.markov_chain_fixed_point(drafter, base, hidden, x0, 0.7)
    with pytest.raises(ArgumentError, match="temperature"):
        drafting.markov_chain_fixed_point(drafter, base, hidden, x0, -1.0)
    for bad in (-1, 2.5, True):
        with pytest.raises(ArgumentError, match="^candidates:"):
            drafting.markov_chain_fixed_point(drafter, base, hidden, x0, candidates=bad)
    # the compiled fixed-point chain is one program: a while loop, no host callback, no transfer to or from the host
    gd, state = nnx.split(drafter)
    fn = jax.jit(lambda s, b, h, x, t, k: drafting.markov_chain(nnx.merge(gd, s), b, h, x, t, k, mode="fixed_point"))
    hlo = fn.lower(state, base, hidden, x0, jnp.float32(1.0), jax.random.key(0)).compile().as_text()
    assert "while(" in hlo
    for op in ("custom-call", "outfeed", "infeed", "send(", "recv(", "host"):
        assert op not in hlo.lower(), op


@pytest.mark.slow  # about a minute: seven generation programs are compiled
def test_generation_with_the_fixed_point_chain(ref, fixture_target, fixture_drafter, fixture_prompts, fixture_ar):
    """``Options(chain_mode="fixed_point")`` in generation: DeepSpec's rounds on the fixture, greedy == ar at batch
    3, sampling == the scan's draw for draw (same seed)."""
    target, drafter = fixture_target, fixture_drafter
    prompt = ref["a.prompt_ids"]

    def run(mode, *args, **kwargs):
        return generate(target, drafter, *args, method="dspark", options=Options(chain_mode=mode), **kwargs)

    out = run("fixed_point", prompt, max_new_tokens=64)
    assert out.tokens[0] == ref["c.spec_output_ids"][0, prompt.shape[1]:].tolist()
    assert out.acceptance_lengths[0] == ref["c.acceptance_lengths"].tolist()[:-1]
    prompts3, ar = fixture_prompts, fixture_ar
    fixed = run("fixed_point", prompts3, max_new_tokens=24)
    assert fixed.tokens == ar
    assert fixed.acceptance_lengths == run("scan", prompts3, max_new_tokens=24).acceptance_lengths
    a = run("fixed_point", prompts3, max_new_tokens=24, temperature=1.0, seed=5)
    b = run("scan", prompts3, max_new_tokens=24, temperature=1.0, seed=5)
    assert a.tokens == b.tokens and a.acceptance_lengths == b.acceptance_lengths
    assert a.tokens != ar  # really sampled


# ----------------------------------------------------------------------------- first_argmax / categorical


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    shape=st.sampled_from([(7,), (3, 4, 6), (2, 65)]),
    levels=st.sampled_from([2, 3, 50, 0]),
    specials=st.sampled_from(["", "nan", "inf", "-inf", "mixed"]),
    dtype=st.sampled_from(["float32", "bfloat16", "int32"]),
)
def test_first_argmax_equals_argmax(seed, shape, levels, specials, dtype):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, levels, shape).astype(np.float32) if levels else rng.normal(size=shape).astype(np.float32)
    if dtype != "int32" and specials:
        values = (rng.choice([np.nan, np.inf, -np.inf], size=shape) if specials == "mixed"
                  else np.full(shape, float(specials)))
        x = np.where(rng.random(shape) < 0.2, values, x).astype(np.float32)
    x = x.astype(jnp.dtype(dtype))  # on the host (no specials in the int32 case)
    for axis, (g, w) in zip(range(-len(shape), len(shape)), _argmaxes_all_axes(x), strict=True):
        assert g.dtype == jnp.int32 and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"axis {axis}")


@jax.jit
def _argmaxes_all_axes(x):
    return [(sampling.first_argmax(x, a), jnp.argmax(x, axis=a)) for a in range(-x.ndim, x.ndim)]


def test_first_argmax_all_equal_and_all_nan_and_greedy_pick():
    x = np.array([[-np.inf] * 4, [2.0] * 4, [np.nan] * 4, [1.0, np.nan, 3.0, np.nan]], np.float32)
    first, arg = (np.asarray(a) for a in jax.jit(lambda x: (sampling.first_argmax(x), jnp.argmax(x, -1)))(x))
    np.testing.assert_array_equal(first, [0, 0, 0, 1])
    np.testing.assert_array_equal(first, arg)
    # pick: greedy (ties to the first max) at a Python or a traced zero temperature (compiled, one program each)
    logits = np.array([[0.0, 2.0, 2.0, 1.0], [5.0, 5.0, -1.0, 5.0]], np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda lg: sampling.pick(lg, 0.0, None))(logits)), [1, 0])
    traced = jax.jit(lambda lg, t: sampling.pick(lg, t, jax.random.key(0)))(logits, np.float32(0.0))
    np.testing.assert_array_equal(np.asarray(traced), [1, 0])
    draws = jax.jit(lambda lg: jax.vmap(lambda k: sampling.pick(lg, 1.0, k))(jax.random.split(jax.random.key(2), 64)))(
        logits)
    assert len(np.unique(np.asarray(draws)[:, 1])) > 1


@pytest.mark.parametrize("shape", [(6,), (4, 33), (2, 3, 320)])
def test_categorical_equals_jax_random_categorical(shape):
    logits, keys, more = _categorical_inputs(shape)
    got, want, draws = (np.asarray(x) for x in _categorical_draws(logits, keys, more))
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(got)) > 1
    # -inf logits are never drawn
    assert np.all(draws % 2 == 1)


@functools.partial(jax.jit, static_argnums=0)
def _categorical_inputs(shape):
    """Random logits of ``shape``, 20 keys and 200 more (as key data): one program per shape."""
    split = lambda seed, n: jax.random.key_data(jax.random.split(jax.random.key(seed), n))  # noqa: E731
    return jax.random.normal(jax.random.key(0), shape) * 3, split(0, 20), split(1, 200)


@jax.jit
def _categorical_draws(logits, keys, more):
    """A draw of sampling.categorical and of jax.random.categorical per key, and one of sampling.categorical with
    every even logit -inf per key of ``more``."""
    keys, more = jax.random.wrap_key_data(keys), jax.random.wrap_key_data(more)
    got = jax.vmap(lambda k: sampling.categorical(k, logits))(keys)
    want = jax.vmap(lambda k: jax.random.categorical(k, logits, axis=-1))(keys)
    masked = logits.at[..., ::2].set(-jnp.inf)
    draws = jax.vmap(lambda k: sampling.categorical(k, masked))(more)
    return got, want, draws
