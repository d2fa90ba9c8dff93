"""Exactness, in one table: every method's greedy tokens equal ``ar``'s token for token, and its samples follow the
target's own distribution (the two-sample tests). Where each cell of method x batch x greedy/sampled x mesh runs:

* greedy, batch 3, the fixture pair (``test_greedy_equals_ar``): dflash, dspark and every tree method at budget 8
  (pctree@8); budgets 1 and 64 and pctree with k=2 in the slow run; the tree options (candidates, widths) slow.
* greedy, the random pair: auto (its shared cost table, decide="previous", batch 3); auto at batch 1 and with
  decide="draft", and every other method, in the slow run; each of auto's candidates forced alone (slow).
* greedy, block-7 pairs (DeepSpec's released block size), vanilla and gated heads: pctree with its defaults and the
  seed's SparklingTree (``sparklingtree@24:seed:fanout=6``).
* greedy, batch 1, ``stream`` and ``instrument=True`` (slow); EOS inside an accepted path; trace-time options.
* sampled (``test_sampling_is_lossless``): sparklingtree, and top-p / top-k for one tree and one chain method by
  default; temperature 0.6, every other method and auto (decide "draft" and "previous") in the slow run.
* mesh: tests/test_mesh.py (every method on 8 CPU devices and two processes, in subprocesses, against one device;
  a one-device mesh). Serving schedules: tests/test_serve_engine.py (greedy tokens whenever a request joins, auto
  in a pool, seeded rows alone and in a busy pool). Elsewhere, the same rule on other axes: the trained demo pair
  (tests/test_demo.py), the split attention (tests/test_attention.py, slow), the chain's two formulations
  (tests/test_chain.py), logprobs (tests/test_logprobs.py).

The shapes are the ones the other engine tests share (conftest: ``fixture_prompts`` / ``PROMPTS3``, NEW_LONG new
tokens, batch 3), so most rows reuse compiled programs.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparkjax.engine import Auto, CostTable, Options, PCTree, Tree, generate, stream
from tests.conftest import AUTO_SIZES, NEW_LONG, PROMPTS3, auto_method, jit_call

TREES = ("ddtree", "sparklingtree", "sparklingtree-beam", "pctree")
NEW = NEW_LONG
SLOW = pytest.mark.slow


# ----------------------------------------------------------------------------- greedy: the table


def _row(pair, method, batch=3, slow=False, id=None):
    return pytest.param(pair, method, batch, id=id or f"{pair}-{method}-b{batch}", marks=SLOW if slow else ())


GREEDY = [
    # the fixture pair: every method at one tree budget by default, and the default pctree@32 with k=2; the
    # smallest and largest budgets in the slow run
    _row("fixture", "dflash"), _row("fixture", "dspark"),
    _row("fixture", PCTree(k=2), slow=True, id="fixture-pctree-k2-b3"),
    *[_row("fixture", f"{m}@{b}", slow=b != 8) for m in TREES for b in (1, 8, 64)
      if not (m in ("sparklingtree-beam", "pctree") and b == 1)],
    # the random pair: auto by default at batch 3, decide="previous" (decide="draft" in a pool:
    # tests/test_serve_engine.py); batch 1 and decide="draft" in the slow run
    _row("random", "auto-previous"),
    *[_row("random", f"auto-{d}", b, slow=True) for b, d in ((1, "draft"), (1, "previous"), (3, "draft"))],
    # the fixture pair runs every method in the default run; the random pair in the slow run
    *[_row("random", f"{m}@8" if m in TREES else m, slow=True)
      for m in ("sparklingtree", "dflash", "dspark", "ddtree", "sparklingtree-beam", "pctree")],
]


@pytest.mark.parametrize("which,method,batch", GREEDY)
def test_greedy_equals_ar(request, which, method, batch):
    """The method's greedy tokens are ar's (the same prompts, batch 3, sliced to the batch); each round commits
    1 to num_drafts + 1 tokens and the rounds count every token after the prefill's."""
    fixtures = ("pair", "fixture_prompts", "fixture_ar") if which == "fixture" else ("random_pair", None, "random_ar")
    (target, drafter), prompts, ar = (request.getfixturevalue(f) if f else PROMPTS3 for f in fixtures)
    prompts, ar = prompts[:batch], ar[:batch]
    auto = isinstance(method, str) and method.startswith("auto-")
    if auto:
        method = auto_method(drafter, decide=method.removeprefix("auto-"))
    out = generate(target, drafter, prompts, method=method, max_new_tokens=NEW)
    assert out.tokens == ar
    for lens, toks in zip(out.acceptance_lengths, out.tokens, strict=True):
        assert 1 <= min(lens) and max(lens) <= drafter.config.num_drafts + 1
        assert 1 + sum(lens) == len(toks)  # the prefill's token plus what the rounds committed (the last one cut)
    if which == "fixture" and (method in ("dspark", "sparklingtree@8", "sparklingtree@64") or method == PCTree(k=2)):
        assert max(max(lens) for lens in out.acceptance_lengths) > 2  # the trained drafter really gets accepted
    if auto:
        assert [len(c) for c in out.size_choices] == out.rounds
        assert sum(out.size_counts.values()) == sum(out.rounds)
        assert set(out.size_counts) <= set(method.table.labels)
        for lens, sizes in zip(out.acceptance_lengths, out.size_choices, strict=True):
            for n, label in zip(lens, sizes, strict=True):
                assert n == 1 or label != "ar"  # a plain step commits exactly one token


@SLOW  # the defaults of both tree methods are rows of the table above
@pytest.mark.parametrize("method,kw", [("sparklingtree", {"candidates": "corrected"}),
                                       ("sparklingtree-beam", {"candidates": "union", "widths": "auto"}),
                                       ("sparklingtree-beam", {"widths": "auto", "candidates": "base"})])
def test_greedy_equals_ar_with_tree_options(pair, fixture_prompts, fixture_ar, method, kw):
    target, drafter = pair
    out = generate(target, drafter, fixture_prompts, method=Tree(method, 8, **kw), max_new_tokens=NEW)
    assert out.tokens == fixture_ar
    assert max(max(lens) for lens in out.acceptance_lengths) > 2  # the trained drafter really gets accepted


@SLOW
@pytest.mark.parametrize("decide", ["draft", "previous"])
def test_every_auto_candidate_alone_is_exact(random_pair, random_ar, decide):
    """A cost table that makes one candidate far cheaper forces it each round (but the probe drafts of
    decide="previous" when it is the plain step): each branch is exact on its own."""
    target, drafter = random_pair
    labels = Auto(sizes=AUTO_SIZES).resolve(drafter).labels()
    for i, label in enumerate(labels):
        seconds = tuple(1e-3 if j == i else 1.0 for j in range(len(labels)))
        out = generate(target, drafter, PROMPTS3, max_new_tokens=NEW,
                       method=Auto(sizes=AUTO_SIZES, decide=decide, table=CostTable(labels, seconds)))
        assert out.tokens == random_ar, label
        counts = out.size_counts
        if decide == "draft" or label != "ar":
            assert set(counts) == {label}, (label, counts)
        else:
            assert counts["ar"] > sum(counts.values()) / 2, counts


@pytest.mark.parametrize("head", ["vanilla", "gated"])
def test_block7_pairs_with_defaults_equal_ar(head):
    """A block-7 drafter (DeepSpec's released block size): pctree with its defaults, and the seed's SparklingTree
    (its candidates and normaliser, the gated head's own features), equal ar greedily."""
    from sparkjax.testing import random_pair

    target, drafter = random_pair(3, vocab=32, block=7, markov=head)
    assert drafter.config.markov_head_type == head and PCTree().nodes(drafter) == 28
    ar = generate(target, None, PROMPTS3, max_new_tokens=20).tokens
    for method in ("pctree", "sparklingtree@24:seed:fanout=6"):
        out = generate(target, drafter, PROMPTS3, method=method, max_new_tokens=20)
        assert out.tokens == ar, method
        assert all(1 + sum(a) == len(t) for a, t in zip(out.acceptance_lengths, out.tokens, strict=True))


def test_eos_inside_an_accepted_path(pair, fixture_prompts, fixture_ar):
    """EOS committed in the middle of a multi-token round stops that sequence right there."""
    target, drafter = pair
    base = generate(target, drafter, fixture_prompts, method="sparklingtree@8", max_new_tokens=NEW)
    toks, lens = base.tokens[0], base.acceptance_lengths[0]
    # a token committed strictly inside a multi-token round, at its first occurrence in sequence 0
    starts = np.cumsum([1] + lens[:-1])  # index in `toks` of each round's first committed token
    inside = [j for s, a in zip(starts, lens, strict=True) for j in range(s, min(s + a - 1, len(toks)))]
    choice = next(j for j in inside if toks.index(toks[j]) == j)
    eos = toks[choice]
    ar_out = generate(target, None, fixture_prompts, max_new_tokens=NEW, eos_token_ids=eos)
    ar = ar_out.tokens
    assert ar[0] == toks[: choice + 1]
    assert ar == [t[: t.index(eos) + 1] if eos in t else t for t in fixture_ar]
    assert ar_out.acceptance_lengths == [[1] * (len(t) - 1) for t in ar]  # the prefill's token, then one a step
    for method in ("sparklingtree@8", "dspark"):
        out = generate(target, drafter, fixture_prompts, method=method, max_new_tokens=NEW, eos_token_ids=[eos])
        assert out.tokens == ar, method
        # a round counts what it committed: the path cut at EOS (sequence 0's, inside a round) or at max_new
        assert [1 + sum(lens) for lens in out.acceptance_lengths] == [len(t) for t in ar], method
        for lens, hits in zip(out.acceptance_lengths, out.accepted_per_depth, strict=True):
            assert hits == [sum(a > k + 1 for a in lens) for k in range(len(hits))], method  # depth k: count > k


@SLOW
def test_batch_one_stream_and_instrumented(pair, fixture_prompts, fixture_ar):
    target, drafter = pair
    out = generate(target, drafter, [fixture_prompts[0]], method="sparklingtree@8", max_new_tokens=NEW)
    assert out.tokens == [fixture_ar[0]]
    chunks = list(stream(target, drafter, fixture_prompts, method="sparklingtree@8", max_new_tokens=NEW))
    assert [list(itertools.chain.from_iterable(c[b] for c in chunks)) for b in range(3)] == fixture_ar
    assert len(chunks) > 2
    inst = generate(target, drafter, fixture_prompts, method="sparklingtree@8", max_new_tokens=NEW, instrument=True)
    assert inst.tokens == fixture_ar
    # each yield after the prefill's is one round's commit (none once a sequence is done): the per-round counts
    assert [[len(c[b]) for c in chunks[1:] if c[b]] for b in range(3)] == inst.acceptance_lengths
    assert [1 + sum(lens) for lens in inst.acceptance_lengths] == [len(t) for t in fixture_ar]
    assert set(inst.stage_seconds) == {"draft", "propose", "verify", "commit"}
    assert all(v > 0 for v in inst.stage_seconds.values())


def test_options_change_the_program_not_the_tokens(pair, fixture_prompts, fixture_ar):
    """Every trace-time setting is part of the static plan: another value compiles another program, with the
    same greedy tokens."""
    from sparkjax.engine.programs import spec_program

    target, drafter = pair
    base = dict(method="sparklingtree@8", max_new_tokens=NEW)
    assert generate(target, drafter, fixture_prompts, **base).tokens == fixture_ar  # the greedy table's program
    before = spec_program._cache_size()
    opts = Options(attention="prefix", block_slots=16, chain_mode="fixed_point", candidate_chain_passes=None,
                   union_top_k=1)
    assert generate(target, drafter, fixture_prompts, **base, options=opts).tokens == fixture_ar
    assert spec_program._cache_size() == before + 1


# ----------------------------------------------------------------------------- sampled: the two-sample tests


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


def _sampling_auto(decide: str):
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
    spec = _sampling_auto(method.partition("-")[2]) if method.startswith("auto") else method
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

    run = jax.jit(lambda probs, p, k: truncate(jnp.log(probs), p, k))  # one program: p and k traced scalars
    kept = lambda probs, p, k: np.isfinite(np.asarray(run(np.asarray(probs, np.float32), p, k))).tolist()  # noqa
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
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    got = np.asarray(jax.jit(lambda probs, t, p, k: jax.nn.softmax(process(jnp.log(probs), Sampling.of(t, p, k)),
                                                                    axis=-1))(
        f32([probs] * 4), f32([1.0, 0.5, 0.0, 2.0]), f32([0.5, 1.0, 0.1, 1.0]), np.asarray([0, 3, 1, 0], np.int32)))
    want = np.array([[4 / 7, 3 / 7, 0, 0], np.array([16, 9, 4, 0]) / 29, probs, np.sqrt(probs) / np.sqrt(probs).sum()])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(_processed(np.asarray(probs), 0.5, 0), [4 / 7, 3 / 7, 0, 0])  # the tests' reference


