"""Token log-probabilities (``generate(..., logprobs=N)``): the target's log-softmax at each generated token, equal
to transformers' on the same target, the same whichever method decoded the tokens; under sampling, the processed
distribution's (temperature, top-k, top-p)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from sparkjax import sampling
from sparkjax.engine import generate, stream
from sparkjax.errors import ArgumentError
from tests.conftest import FIXTURE, NEW_SHORT, PROMPTS3, jit_call

TOP = 3


@pytest.fixture(scope="module")
def hf_target():
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(str(FIXTURE / "target"), torch_dtype=torch.float32).eval()


def _hf_logprobs(hf, prompt, tokens):
    """transformers' log_softmax at the positions that predict ``tokens`` after ``prompt`` ``[len(tokens), V]``."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1).numpy()
    return lp[len(prompt) - 1: len(prompt) - 1 + len(tokens)]


@pytest.fixture(scope="module")
def ar_out(pair):
    return generate(pair[0], None, PROMPTS3, max_new_tokens=NEW_SHORT, logprobs=TOP)


@pytest.mark.parametrize("method", ["ar", "sparklingtree", "dspark"])
def test_greedy_logprobs_match_transformers_under_every_method(pair, hf_target, ar_out, method):
    target, drafter = pair
    out = ar_out if method == "ar" else generate(target, drafter, PROMPTS3, method=method, max_new_tokens=NEW_SHORT,
                                                  logprobs=TOP)
    assert out.tokens == ar_out.tokens
    if method != "ar":
        assert max(max(a) for a in out.acceptance_lengths) > 1  # rounds committed several tokens
    worst = 0.0
    for b, prompt in enumerate(PROMPTS3):
        toks = out.tokens[b]
        ref = _hf_logprobs(hf_target, prompt, toks)
        assert len(out.token_logprobs[b]) == len(toks) == len(out.top_logprobs[b])
        for i, tok in enumerate(toks):
            worst = max(worst, abs(out.token_logprobs[b][i] - ref[i, tok]))
            ids, vals = zip(*out.top_logprobs[b][i], strict=True)
            assert len(ids) == TOP and list(vals) == sorted(vals, reverse=True)
            assert ids[0] == tok  # greedy: the chosen token is the likeliest
            np.testing.assert_allclose(vals, ref[i, list(ids)], atol=1e-4)
            np.testing.assert_allclose(vals, np.sort(ref[i])[::-1][:TOP], atol=1e-4)
        # the same values whichever method decoded them
        np.testing.assert_allclose(out.token_logprobs[b], ar_out.token_logprobs[b], atol=1e-4)
    assert worst <= 1e-4, worst


def test_without_logprobs_nothing_is_returned(pair):
    out = generate(pair[0], None, PROMPTS3, max_new_tokens=NEW_SHORT)
    assert out.token_logprobs is None and out.top_logprobs is None


def test_logprobs_zero_is_the_chosen_token_only(pair, ar_out):
    out = generate(pair[0], None, PROMPTS3, max_new_tokens=NEW_SHORT, logprobs=0)
    assert out.tokens == ar_out.tokens
    assert all(t == [] for row in out.top_logprobs for t in row)
    for a, b in zip(out.token_logprobs, ar_out.token_logprobs, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("method", ["ar", "sparklingtree", "dflash"])
def test_sampled_logprobs_are_the_processed_distribution(random_pair, method):
    target, drafter = random_pair
    params = dict(temperature=0.7, top_p=0.9, top_k=6)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 1]]
    out = generate(target, drafter if method != "ar" else None, prompts, method=method, max_new_tokens=12, seed=3,
                   logprobs=4, **params)
    v = target.config.vocab_size
    for b, prompt in enumerate(prompts):
        toks = out.tokens[b]
        seq = prompt + toks
        logits = np.asarray(jit_call(target, np.asarray([seq], np.int32), np.arange(len(seq))[None]).logits[0])
        rows = logits[len(prompt) - 1: len(prompt) - 1 + len(toks)]
        lp = np.asarray(jax.nn.log_softmax(sampling.process(rows, sampling.Sampling.of(**params)), axis=-1))
        for i, tok in enumerate(toks):
            assert np.isfinite(out.token_logprobs[b][i])  # a sampled token is in the kept set
            np.testing.assert_allclose(out.token_logprobs[b][i], lp[i, tok], atol=1e-4)
            ids, vals = zip(*out.top_logprobs[b][i], strict=True)
            np.testing.assert_allclose(vals, np.sort(lp[i])[::-1][:4], atol=1e-4)
            kept = np.isfinite(lp[i])
            assert kept.sum() <= 6 and kept.sum() < v  # top-k / top-p removed tokens: -inf
            np.testing.assert_allclose(np.exp(lp[i][kept]).sum(), 1.0, atol=1e-5)


def test_stream_yields_each_rounds_logprobs(pair, ar_out):
    """``stream(..., logprobs=N)`` yields ``(tokens, token_logprobs, top_logprobs)`` per round; concatenated, they
    are generate's (the values ``ar``'s one-token steps give, from the tree's verify pass)."""
    target, drafter = pair
    rounds = list(stream(target, drafter, PROMPTS3, method="sparklingtree", max_new_tokens=NEW_SHORT, logprobs=TOP))
    assert all(isinstance(r, tuple) and len(r) == 3 for r in rounds)
    assert max(len(r[0][b]) for r in rounds for b in range(len(PROMPTS3))) > 1  # a round committed several tokens
    for b in range(len(PROMPTS3)):
        toks = [t for r in rounds for t in r[0][b]]
        lps = [v for r in rounds for v in r[1][b]]
        tops = [t for r in rounds for t in r[2][b]]
        assert toks == ar_out.tokens[b] and len(lps) == len(tops) == len(toks)
        np.testing.assert_allclose(lps, ar_out.token_logprobs[b], atol=1e-5)
        for top, ref in zip(tops, ar_out.top_logprobs[b], strict=True):
            assert [i for i, _ in top] == [i for i, _ in ref]
            np.testing.assert_allclose([v for _, v in top], [v for _, v in ref], atol=1e-5)


@pytest.mark.parametrize("bad", [-1, 21, 2.0, "3", True])
def test_bad_logprobs(pair, bad):
    with pytest.raises(ArgumentError, match="logprobs"):
        generate(pair[0], None, PROMPTS3, max_new_tokens=NEW_SHORT, logprobs=bad)


@pytest.mark.parametrize("method", ["ar", "sparklingtree@8", "auto"])
def test_serving_engine_returns_the_same_logprobs(pair, ar_out, method):
    """The serving engine's logprobs are generate's ``ar``'s, whatever the method. ``auto`` (on a table where drafting
    pays, so its rounds verify drafts): the chosen tokens' within 1e-5, the alternatives' within 2e-5 (float32
    rounding: the verify pass and the one-token step differ by up to ~1.2e-5 on values near -2, and generate's own
    ``ar`` at batch 1 and 3 by up to ~7e-6)."""
    from sparkjax.engine import Auto, CostTable
    from sparkjax.serve import Engine

    target, drafter = pair
    atol = top_atol = 1e-4
    if method == "auto":
        sizes = (0, "chain", 8)
        method = Auto(sizes=sizes, table=CostTable(Auto(sizes=sizes).resolve(drafter).labels(), (1.0, 1.0, 1.0)))
        atol, top_atol = 1e-5, 2e-5
    eng = Engine(target, None if method == "ar" else drafter, method=method, slots=2, max_prompt_tokens=16,
                 max_new_tokens=NEW_SHORT, sampling=False, visit_sizes=(2,), max_logprobs=TOP, rounds_per_visit=2)
    try:
        reqs = [eng.submit(p, max_new_tokens=NEW_SHORT, logprobs=n) for p, n in zip(PROMPTS3, (TOP, 1, None),
                                                                                      strict=True)]
        res = [r.result(timeout=300) for r in reqs]
        assert [r.token_ids for r in res] == ar_out.tokens
        for b, (r, n) in enumerate(zip(res, (TOP, 1, None), strict=True)):
            if n is None:
                assert r.logprobs is None
                continue
            assert [t.token_id for t in r.logprobs] == r.token_ids
            np.testing.assert_allclose([t.logprob for t in r.logprobs], ar_out.token_logprobs[b], rtol=0, atol=atol)
            for t, ref in zip(r.logprobs, ar_out.top_logprobs[b], strict=True):
                assert [i for i, _ in t.top] == [i for i, _ in ref[:n]]
                np.testing.assert_allclose([v for _, v in t.top], [v for _, v in ref[:n]], rtol=0, atol=top_atol)
        if isinstance(method, Auto):  # drafted rounds committed some of the tokens
            assert eng.metrics()["spec_decode"]["num_drafts"] > 0
        with pytest.raises(ArgumentError, match="logprobs"):
            eng.submit(PROMPTS3[0], max_new_tokens=2, logprobs=TOP + 1)
    finally:
        eng.close()
