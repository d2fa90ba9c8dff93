"""The speculative decoding engine: exactness, upstream parity, lossless sampling, no host sync, bad input."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sparkjax
from sparkjax.engine import Auto, CostTable, Options, PCTree, Tree, generate, launch, stream
from sparkjax.nn.drafter import Drafter
from tests.conftest import NEW_LONG, PROMPTS3, jit_call

TREES = ("ddtree", "sparklingtree", "sparklingtree-beam", "pctree")
NEW = NEW_LONG


@pytest.fixture(scope="module")
def prompts3(ref):
    p = ref["a.prompt_ids"][0].tolist()
    rng = np.random.default_rng(7)
    return [p, rng.integers(0, 300, 13).tolist(), p[:19]]


@pytest.fixture(scope="module")
def ar3(pair, prompts3):
    return generate(pair[0], None, prompts3, max_new_tokens=NEW).tokens


SLOW = pytest.mark.slow
# every method at one tree budget by default, and the default pctree@32 with k=2; the smallest and largest
# budgets in the slow run
CASES = [("dflash", None), ("dspark", None), pytest.param(PCTree(k=2), None, id="pctree-k2", marks=SLOW)] + [
    pytest.param(m, b, id=f"{m}-{b}", marks=() if b == 8 else SLOW)
    for m in TREES for b in (1, 8, 64) if not (m in ("sparklingtree-beam", "pctree") and b == 1)
]


@pytest.mark.parametrize("method,budget", CASES)
def test_greedy_equals_ar_on_fixture_pair(pair, prompts3, ar3, method, budget):
    target, drafter = pair
    spec = method if budget is None else f"{method}@{budget}"
    out = generate(target, drafter, prompts3, method=spec, max_new_tokens=NEW)
    assert out.tokens == ar3
    for lens, toks in zip(out.acceptance_lengths, out.tokens, strict=True):
        assert 1 <= min(lens) and max(lens) <= drafter.config.num_drafts + 1
        assert 1 + sum(lens) == len(toks)  # the prefill's token plus what the rounds committed (the last one cut)
    if method in ("dspark", "sparklingtree", PCTree(k=2)) and budget != 1:
        assert max(max(lens) for lens in out.acceptance_lengths) > 2  # the trained drafter really gets accepted


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


def test_eos_inside_an_accepted_path(pair, prompts3, ar3):
    """EOS committed in the middle of a multi-token round stops that sequence right there."""
    target, drafter = pair
    base = generate(target, drafter, prompts3, method="sparklingtree@8", max_new_tokens=NEW)
    toks, lens = base.tokens[0], base.acceptance_lengths[0]
    # a token committed strictly inside a multi-token round, at its first occurrence in sequence 0
    starts = np.cumsum([1] + lens[:-1])  # index in `toks` of each round's first committed token
    inside = [j for s, a in zip(starts, lens, strict=True) for j in range(s, min(s + a - 1, len(toks)))]
    choice = next(j for j in inside if toks.index(toks[j]) == j)
    eos = toks[choice]
    ar_out = generate(target, None, prompts3, max_new_tokens=NEW, eos_token_ids=eos)
    ar = ar_out.tokens
    assert ar[0] == toks[: choice + 1]
    assert ar == [t[: t.index(eos) + 1] if eos in t else t for t in ar3]
    assert ar_out.acceptance_lengths == [[1] * (len(t) - 1) for t in ar]  # the prefill's token, then one a step
    for method in ("sparklingtree@8", "dspark"):
        out = generate(target, drafter, prompts3, method=method, max_new_tokens=NEW, eos_token_ids=[eos])
        assert out.tokens == ar, method
        # a round counts what it committed: the path cut at EOS (sequence 0's, inside a round) or at max_new
        assert [1 + sum(lens) for lens in out.acceptance_lengths] == [len(t) for t in ar], method
        for lens, hits in zip(out.acceptance_lengths, out.accepted_per_depth, strict=True):
            assert hits == [sum(a > k + 1 for a in lens) for k in range(len(hits))], method  # depth k: count > k


@SLOW
def test_batch_one_stream_and_instrumented(pair, prompts3, ar3):
    target, drafter = pair
    out = generate(target, drafter, [prompts3[0]], method="sparklingtree@8", max_new_tokens=NEW)
    assert out.tokens == [ar3[0]]
    chunks = list(stream(target, drafter, prompts3, method="sparklingtree@8", max_new_tokens=NEW))
    assert [list(itertools.chain.from_iterable(c[b] for c in chunks)) for b in range(3)] == ar3 and len(chunks) > 2
    inst = generate(target, drafter, prompts3, method="sparklingtree@8", max_new_tokens=NEW, instrument=True)
    assert inst.tokens == ar3
    # each yield after the prefill's is one round's commit (none once a sequence is done): the per-round counts
    assert [[len(c[b]) for c in chunks[1:] if c[b]] for b in range(3)] == inst.acceptance_lengths
    assert [1 + sum(lens) for lens in inst.acceptance_lengths] == [len(t) for t in ar3]
    assert set(inst.stage_seconds) == {"draft", "propose", "verify", "commit"}
    assert all(v > 0 for v in inst.stage_seconds.values())


def test_a_generation_transfers_nothing_to_the_host(pair, prompts3):
    target, drafter = pair
    jax.block_until_ready(launch(target, drafter, prompts3, method="sparklingtree@8", max_new_tokens=NEW))
    with jax.transfer_guard_device_to_host("disallow"):  # the generation itself syncs nothing
        res = jax.block_until_ready(launch(target, drafter, prompts3, method="sparklingtree@8",
                                           max_new_tokens=NEW))
    assert int(np.asarray(res.n).min()) == NEW


# ----------------------------------------------------------------------------- random pairs, sampling


# the fixture pair runs every method in the default run; the random pair in the slow run
@SLOW
@pytest.mark.parametrize("method", ["sparklingtree", "dflash", "dspark", "ddtree", "sparklingtree-beam", "pctree"])
def test_greedy_equals_ar_on_random_pair(random_pair, method):
    target, drafter = random_pair
    ar = generate(target, None, PROMPTS3, max_new_tokens=NEW).tokens
    out = generate(target, drafter, PROMPTS3, method=f"{method}@8" if method in TREES else method,
                   max_new_tokens=NEW)
    assert out.tokens == ar


def test_options_change_the_program_not_the_tokens(pair, prompts3, ar3):
    """Every trace-time setting is part of the static plan: another value compiles another program, with the
    same greedy tokens."""
    from sparkjax.engine.programs import spec_program

    target, drafter = pair
    base = dict(method="sparklingtree@8", max_new_tokens=NEW)
    assert generate(target, drafter, prompts3, **base).tokens == ar3  # the program of the greedy cases above
    before = spec_program._cache_size()
    opts = Options(attention="prefix", block_slots=16, chain_mode="fixed_point", candidate_chain_passes=None,
                   union_top_k=1)
    assert generate(target, drafter, prompts3, **base, options=opts).tokens == ar3
    assert spec_program._cache_size() == before + 1


def _processed(probs, top_p=1.0, top_k=0):
    """``probs`` [..., V] after top-k, then top-p (float64, written apart from sparkjax.sampling): the k likeliest
    kept (ties with the k-th too), renormalised; then the smallest set of likeliest ones whose mass reaches
    ``top_p`` (ties with the least of them too), renormalised."""
    probs = np.asarray(probs, np.float64)
    srt = -np.sort(-probs, axis=-1)
    if 0 < top_k < probs.shape[-1]:
        probs = np.where(probs >= srt[..., top_k - 1 : top_k], probs, 0.0)
        probs = probs / probs.sum(-1, keepdims=True)
        srt = -np.sort(-probs, axis=-1)
    if top_p < 1:
        before = np.cumsum(srt, axis=-1) - srt
        cut = np.min(np.where(before < top_p, srt, np.inf), axis=-1, keepdims=True)
        probs = np.where(probs >= cut, probs, 0.0)
        probs = probs / probs.sum(-1, keepdims=True)
    return probs


def _exact_joint(target, prompt, vocab, temperature, top_p=1.0, top_k=0):
    """The target's exact distribution of the first three generated tokens [V, V, V] (at ``temperature``, then
    top-k, then top-p)."""
    p = np.asarray(prompt, np.int32)
    grid = np.array(list(itertools.product(range(vocab), repeat=2)), np.int32)  # [V^2, 2]
    seqs = np.concatenate([np.broadcast_to(p, (len(grid), len(p))), grid], axis=1)
    pos = np.broadcast_to(np.arange(seqs.shape[1]), seqs.shape)
    logits = np.asarray(jit_call(target, jnp.asarray(seqs), jnp.asarray(pos)).logits, np.float64) / temperature
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs = _processed(probs / probs.sum(-1, keepdims=True), top_p, top_k)
    n = len(p)
    p1 = probs[0, n - 1]  # [V]
    p2 = probs[:: vocab, n].reshape(vocab, vocab)  # rows: x1 (x2 arbitrary in grid) -> p(x2 | x1)
    p3 = probs[:, n + 1].reshape(vocab, vocab, vocab)  # p(x3 | x1, x2)
    return p1[:, None, None] * p2[:, :, None] * p3


def _chi2_pvalue(counts, probs):
    from scipy import stats

    counts, probs = counts.ravel(), probs.ravel()
    n = counts.sum()
    big = probs * n >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(probs[big] * n, probs[~big].sum() * n)
    keep = exp > 0
    return stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue


def _auto(decide: str):
    """Method auto over a plain step, the chain and trees of 2 and 6 nodes, with a cost table under which the
    choice between them follows the drafter's predictions."""
    labels = ("ar", "dspark", "sparklingtree@2", "sparklingtree@6")
    return Auto(sizes=(0, "chain", 2, 6), decide=decide, table=CostTable(labels, (1.0, 1.0, 1.05, 1.1)))


# top-p / top-k: one tree method and one chain method by default (the programs of the plain case: the three
# values are traced), every other method in the slow run
TOP = [("sparklingtree", 1.0, 0.8, 6), ("dspark", 0.7, 0.9, 4)]
SLOW_TOP = [(m, 1.0, 0.85, 5) for m in ("ddtree", "dflash", "sparklingtree-beam", "pctree", "auto-draft",
                                        "auto-previous")]


@pytest.mark.parametrize(
    "method,temperature,top_p,top_k", [("sparklingtree", 1.0, 1.0, 0)] + TOP + [
        pytest.param(m, t, 1.0, 0, marks=SLOW) for m, t in (
            ("dspark", 0.6), ("auto-draft", 1.0), ("ddtree", 1.0), ("dspark", 1.0), ("dflash", 1.0),
            ("sparklingtree-beam", 1.0), ("pctree", 1.0), ("auto-previous", 1.0))] + [
        pytest.param(*case, marks=SLOW) for case in SLOW_TOP]
)
def test_sampling_is_lossless(random_pair, method, temperature, top_p, top_k):
    target, drafter = random_pair
    vocab = target.config.vocab_size
    prompt = [3, 1, 4, 1, 5]
    n = 6000
    spec = _auto(method.partition("-")[2]) if method.startswith("auto") else method
    if method in TREES:
        spec = f"{method}@{7 if method == 'pctree' else 6}"
    out = generate(target, drafter, [prompt] * n, method=spec, max_new_tokens=3, temperature=temperature,
                   top_p=top_p, top_k=top_k, seed=11)
    if method.startswith("auto"):
        assert len(out.size_counts) >= 1 and sum(out.size_counts.values()) == sum(out.rounds)
    samples = np.array(out.tokens)
    assert samples.shape == (n, 3)
    assert all(1 + sum(lens) == 3 for lens in out.acceptance_lengths)  # a round cut by max_new counts what it kept
    exact = _exact_joint(target, prompt, vocab, temperature, top_p, top_k)
    if top_p < 1 or top_k:
        assert (exact == 0).any(), "top-p / top-k should cut tokens here, or the case checks nothing"
        assert exact[samples[:, 0], samples[:, 1], samples[:, 2]].min() > 0  # no sample outside the kept sets
    accepted = sum(a - 1 for lens in out.acceptance_lengths for a in lens)
    # a truncated target is further from the random drafter (the beam with top-p 0.85 / top-k 5: 520 accepted)
    floor = n // 10 if top_p == 1 and not top_k else n // 20
    assert accepted > floor, "the drafter should be accepted sometimes, or the test checks nothing"
    counts12 = np.zeros((vocab, vocab))
    np.add.at(counts12, (samples[:, 0], samples[:, 1]), 1)
    counts23 = np.zeros((vocab, vocab))
    np.add.at(counts23, (samples[:, 1], samples[:, 2]), 1)
    # false failure rate: two tests at 2e-4 each
    assert _chi2_pvalue(counts12, exact.sum(2)) > 2e-4
    assert _chi2_pvalue(counts23, exact.sum(0)) > 2e-4


def test_processed_distribution_top_k_then_top_p():
    from sparkjax.sampling import Sampling, process, truncate

    kept = lambda logits, p, k: np.isfinite(np.asarray(truncate(jnp.log(jnp.asarray(logits)), p, k))).tolist()  # noqa
    probs = [0.4, 0.3, 0.2, 0.1]
    assert kept(probs, 1.0, 0) == [True] * 4  # both off
    assert kept(probs, 1.0, 2) == [True, True, False, False]  # top-k keeps k
    assert kept(probs, 1.0, 4) == kept(probs, 1.0, 9) == [True] * 4  # k >= V: all
    assert kept(probs, 0.3, 0) == [True, False, False, False]  # the first token alone reaches 0.3
    assert kept(probs, 0.41, 0) == [True, True, False, False]  # the smallest prefix whose mass reaches p
    assert kept(probs, 0.7, 0) == [True, True, False, False]  # 0.4 + 0.3 reaches 0.7 exactly
    assert kept(probs, 0.75, 0) == [True, True, True, False]
    assert kept([0.4, 0.2, 0.2, 0.2], 1.0, 2) == [True] * 4  # ties with the k-th are kept
    assert kept([0.4, 0.2, 0.2, 0.2], 0.5, 0) == [True] * 4  # ties with the least kept one too
    assert kept([0.25] * 4, 0.1, 1) == [True] * 4
    # top-p applies to the top-k distribution renormalised: of [0.4, 0.3] (4/7, 3/7), 0.5 keeps the first alone
    assert kept([0.3, 0.4, 0.2, 0.1], 0.5, 2) == [False, True, False, False]
    assert kept([0.3, 0.4, 0.2, 0.1], 0.6, 2) == [True, True, False, False]
    # per sequence, after the temperature; greedy rows and rows with both off are untouched
    logits = jnp.log(jnp.asarray([probs] * 4))
    s = Sampling.of(jnp.asarray([1.0, 0.5, 0.0, 2.0]), jnp.asarray([0.5, 1.0, 0.1, 1.0]), jnp.asarray([0, 3, 1, 0]))
    got = np.asarray(jax.nn.softmax(jax.jit(process)(logits, s), axis=-1))
    want = np.array([[4 / 7, 3 / 7, 0, 0], np.array([16, 9, 4, 0]) / 29, probs, np.sqrt(probs) / np.sqrt(probs).sum()])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(_processed(np.asarray(probs), 0.5, 0), [4 / 7, 3 / 7, 0, 0])  # the tests' reference


def test_sampling_is_seeded(random_pair):
    a, b, c = (generate(*random_pair, [[1, 2, 3]] * 4, method="sparklingtree@6", max_new_tokens=12,
                        temperature=1.0, seed=seed).tokens for seed in (5, 5, 6))
    assert a == b and a != c


# ----------------------------------------------------------------------------- bad input


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


def test_markov_methods_refuse_a_drafter_without_markov_head_and_pairs_must_fit(pair, random_pair, prompts3, ar3):
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
    assert generate(target, plain, prompts3, method="ddtree@8", max_new_tokens=NEW).tokens == ar3


def test_fixed_shapes_share_one_program(pair, prompts3, ar3):
    """prompt_width / capacity pin the shapes: a prefill-only run and a full exact run reuse one program."""
    from sparkjax.engine.programs import spec_program as _spec_program

    target, drafter = pair
    kw = dict(method="dspark", cache_size=256, prompt_width=64, capacity=NEW)
    launch(target, drafter, prompts3, max_new_tokens=NEW, **kw)
    before = _spec_program._cache_size()
    first = generate(target, drafter, [p[:5] for p in prompts3], max_new_tokens=1, **kw)
    assert [len(t) for t in first.tokens] == [1, 1, 1] and first.rounds == [0, 0, 0]
    assert generate(target, drafter, prompts3, max_new_tokens=NEW, **kw).tokens == ar3
    assert _spec_program._cache_size() == before
    with pytest.raises(sparkjax.ArgumentError, match="prompt_width"):
        generate(target, drafter, prompts3, max_new_tokens=8, **{**kw, "prompt_width": 8})
    with pytest.raises(sparkjax.ArgumentError, match="capacity"):
        generate(target, drafter, prompts3, max_new_tokens=2 * NEW, **kw)
