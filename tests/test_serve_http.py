"""The OpenAI-compatible server over HTTP: one live server on 127.0.0.1 (a free port, a background thread) with the
demo pair and a 16-node SparklingTree (auto in a pool: tests/test_serve_engine.py), driven by the real ``openai``
client and by httpx.

Greedy responses equal ``sparkjax.generate`` (the target's own greedy tokens) for that prompt alone, whatever shares
the pool; a cancelled stream frees its slot; every refused request gets its 4xx and an OpenAI-style error body;
after all of that the server still answers. The tests run in file order and share the server.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from flax import nnx

import sparkjax
from sparkjax import demo
from sparkjax.serve import Engine
from sparkjax.serve.engine import choice_seed
from sparkjax.serve.server import ServerThread, create_app, render_messages
from sparkjax.text import encode_text
from tests.conftest import VisitGate

KEY = "test-key"
MODEL = "sparkjax-demo"
SLOTS = 4
MAX_PROMPT = 64
MAX_NEW = 96  # room for the long requests that keep slots busy (cache 256 with the prompt and a round)
QUEUE = 32
CONCURRENT = 24
BODY_LIMIT = 4096
METHOD = "sparklingtree@16"
CLIENT_REQUESTS = sorted((pathlib.Path(__file__).parent / "fixtures" / "client_requests").glob("*.json"))


@pytest.fixture(scope="module")
def pair():
    return demo.load(dtype="float32")


@pytest.fixture(scope="module")
def engine(pair):
    eng = Engine(pair.target, pair.dspark, method=METHOD, slots=SLOTS,
                 max_prompt_tokens=MAX_PROMPT, max_new_tokens=MAX_NEW, queue_limit=QUEUE, tokenizer=pair.tokenizer,
                 eos_token_ids=pair.eos_token_ids, visit_sizes=(SLOTS,),  # packed visits: tests/test_serve_engine
                 max_logprobs=5)
    eng.start()
    yield eng
    eng.close(grace_s=0)


@pytest.fixture(scope="module")
def live(pair, engine):
    app = create_app(engine, tokenizer=pair.tokenizer, model=MODEL, eos_token_ids=pair.eos_token_ids, api_key=KEY,
                     max_body_bytes=BODY_LIMIT)
    server = ServerThread(app).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def solo(pair):
    """The target's own greedy continuation of one prompt alone: ``solo(ids, max_new) -> token ids`` (one
    compiled program for every prompt and length)."""

    def run(ids: list[int], max_new: int, eos=pair.eos_token_ids) -> list[int]:  # eos []: none (the same program)
        return sparkjax.generate(pair.target, None, [ids], method="ar", max_new_tokens=max_new, capacity=MAX_NEW,
                                 prompt_width=MAX_PROMPT, eos_token_ids=eos).tokens[0]

    return run


def expected(pair, tokens: list[int]) -> tuple[str, str, int]:
    """(text, finish_reason, completion_tokens) of a generation's token ids."""
    finish = "stop" if tokens and tokens[-1] in pair.eos_token_ids else "length"
    return pair.tokenizer.decode(tokens, skip_special_tokens=True), finish, len(tokens)


def expected_stop(pair, tokens: list[int], stops: list[str]) -> tuple[str, str, int]:
    """(text, finish_reason, completion_tokens) of a generation's token ids cut at its first stop string: the text
    before it, and the tokens up to and including the one that completed it."""
    for k in range(1, len(tokens) + 1):
        text = pair.tokenizer.decode(tokens[:k], skip_special_tokens=True)
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[: min(hits)], "stop", k
    return expected(pair, tokens)


def got(r) -> tuple[str, str, int]:
    """(text, finish_reason, completion_tokens) of a whole completions or chat response."""
    c = r.choices[0]
    return c.text if r.object == "text_completion" else c.message.content, c.finish_reason, r.usage.completion_tokens


def ask(client, q: str, n: int, **kw):
    """A greedy chat completion of one user turn."""
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=n,
                                          temperature=0, **kw)


def questions() -> list[str]:
    return [row["turns"][0] for name in demo.PROMPT_SETS for row in demo.prompts(name) if "turns" in row]


def test_completions_and_chat_with_the_openai_client(pair, client, solo):
    prompt = "def read_lines(path):\n"
    want = expected(pair, solo(encode_text(pair.tokenizer, prompt), 12))
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert got(r) == want
    assert r.usage.prompt_tokens == len(encode_text(pair.tokenizer, prompt)) and r.object == "text_completion"
    pieces = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in pieces) == want[0] and pieces[-1].choices[0].finish_reason == want[1]

    q = questions()[0]
    want = expected(pair, solo(pair.encode_chat(q), 16))
    r = ask(client, q, 16)
    assert got(r) == want
    assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens == len(pair.encode_chat(q))
    chunks = list(ask(client, q, 16, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want[0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want[1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want[2]

    # a conversation goes through the chat template as a whole
    convo = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": q},
             {"role": "assistant", "content": "Sure."}, {"role": "user", "content": [{"type": "text", "text": "Why?"}]}]
    ids = encode_text(pair.tokenizer, render_messages(pair.tokenizer, [{**m, "content": m["content"] if isinstance(
        m["content"], str) else "Why?"} for m in convo]))
    r = client.chat.completions.create(model=MODEL, messages=convo, max_tokens=8, temperature=0)
    assert got(r) == expected(pair, solo(ids, 8)) and r.usage.prompt_tokens == len(ids)
    assert [m.id for m in client.models.list()] == [MODEL]


def test_concurrent_requests_joining_at_different_times_are_each_exact(pair, engine, client, solo, caplog):
    qs = questions()
    jobs = []  # (kind, prompt, ids, max_tokens, stream, delay)
    for i in range(CONCURRENT):
        q = qs[i % len(qs)]
        chat = i % 3 != 2
        ids = pair.encode_chat(q) if chat else encode_text(pair.tokenizer, q)
        jobs.append(("chat" if chat else "text", q, ids, 3 + (7 * i) % 30, i % 2 == 0, 0.04 * (i % 8)))
    assert len({len(j[2]) for j in jobs}) > 4 and len({j[3] for j in jobs}) > 4  # mixed lengths

    def send(job):
        kind, q, _, n, stream, delay = job
        time.sleep(delay)
        if kind == "chat":
            r = ask(client, q, n, stream=stream)
        else:
            r = client.completions.create(model=MODEL, prompt=q, max_tokens=n, temperature=0, stream=stream)
        if not stream:
            return got(r)
        parts = [c.choices[0] for c in r if c.choices]
        text = "".join(p.delta.content or "" if kind == "chat" else p.text for p in parts)
        return text, parts[-1].finish_reason, None

    def sample(seed, top_p=None, top_k=None):  # sampled requests with seeds of every kind (the high half zero or
        # not) share the pool; top_p / top_k are traced per slot: they compile nothing
        extra = {} if top_k is None else {"extra_body": {"top_k": top_k}}
        r = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=12, temperature=0.8, seed=seed,
                                      top_p=top_p, **extra)
        return r.choices[0].text, r.usage.completion_tokens

    x = jnp.ones(3)
    caplog.set_level(logging.WARNING, logger="jax")
    with jax.log_compiles(), concurrent.futures.ThreadPoolExecutor(CONCURRENT + 4) as pool:
        pending = pool.map(sample, (7, None, 2**31 + 1, 2**40 + 3, 5, 6), (None,) * 4 + (0.5, None),
                           (None,) * 4 + (3, 0))  # submitted now, read after the jobs
        answers = list(pool.map(send, jobs))
        sampled = list(pending)
        assert all(0 < n <= 12 for _, n in sampled)
        assert sample(7) == sampled[0]  # a seeded request draws the same tokens alone as in the busy pool
        assert sample(5, 0.5, 3) == sampled[4]  # and so does one with top-p and top-k
        jax.jit(lambda x: x * 5)(x)  # the log works: this one compiles
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling")]
    assert any("jit(<lambda>)" in m for m in logged)
    assert [m for m in logged if "<lambda>" not in m] == []  # the started engine compiles nothing more
    for job, (text, finish, n) in zip(jobs, answers, strict=True):
        want = expected(pair, solo(job[2], job[3]))
        assert (text, finish) == want[:2], job
        assert n is None or n == want[2], job
    used = {k for k, v in engine.metrics()["verify_sizes"].items() if v > 0}
    assert used - {"ar"}, used  # drafted rounds were verified (which sizes depends on the timing)


def _wait(cond, timeout=240.0, what="condition"):  # generous: an admission may compile on a loaded machine
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_cancelled_stream_frees_its_slot_for_a_later_request(pair, engine, client, solo):
    # a prompt whose greedy continuation runs past one round without EOS
    prompt = next(q for q in questions() if len(solo(encode_text(pair.tokenizer, q), MAX_NEW)) == MAX_NEW)
    ids = pair.encode_chat(questions()[1])
    first = threading.Event()
    holder = {}
    cancelled = engine.metrics()["requests"]["cancelled"]

    def stream_a():
        s = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_NEW, temperature=0, stream=True)
        holder["stream"], holder["first"] = s, next(iter(s))
        first.set()

    with VisitGate(engine) as gate:
        # every slot but A's holds a long request that cannot end early (no EOS ids); none advances while gated
        busy = [engine.submit(ids, max_new_tokens=MAX_NEW, temperature=0.0, eos_token_ids=[]) for _ in range(SLOTS - 1)]
        try:
            a = threading.Thread(target=stream_a)
            a.start()
            _wait(lambda: engine.metrics()["active_slots"] == SLOTS, what="every slot taken")
            gate.steps = 1  # one round: A's first tokens reach the client
            assert first.wait(60) and holder["first"].choices[0].finish_reason is None
            a.join()
            holder["stream"].close()  # the client leaves mid-stream
            _wait(lambda: engine.metrics()["active_slots"] == SLOTS - 1, what="the cancelled stream's slot freed")
            q = questions()[2]
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                b = pool.submit(ask, client, q, 4)
                _wait(lambda: engine.metrics()["active_slots"] == SLOTS, what="the later request admitted")
                assert not any(r.done for r in busy)  # so it took the freed slot
                gate.open = True
                assert got(b.result(timeout=120)) == expected(pair, solo(pair.encode_chat(q), 4))
        finally:
            gate.open = True
            for req in busy:
                req.cancel()
    ends = [req.result(timeout=60).finish_reason for req in busy]  # they ran on once the gate opened
    assert set(ends) <= {"cancelled", "length"}
    assert engine.metrics()["requests"]["cancelled"] == cancelled + 1 + ends.count("cancelled")  # A counts


def _post(live, body, *, path="/v1/completions", key=KEY):
    """POSTs ``body`` (bytes as they are, anything else as JSON)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(live.url + path, content=content, headers={"Content-Type": "application/json", **auth},
                      timeout=60)


BAD = [  # (body or raw bytes, path, status, param, words in the message)
    (b"{not json", "/v1/completions", 400, None, "not valid JSON"),
    (b"[1, 2]", "/v1/completions", 400, None, "JSON object"),
    (b'{"prompt": "x", "max_tokens": NaN}', "/v1/completions", 400, None, "NaN"),
    ({"prompt": "x", "max_tokens": "4"}, "/v1/completions", 400, "max_tokens", "integer"),
    ({"prompt": "x", "temperature": "hot"}, "/v1/completions", 400, "temperature", "number"),
    ({"prompt": "x", "stop": 5}, "/v1/completions", 400, "stop", "string"),
    ({"prompt": 5}, "/v1/completions", 400, "prompt", "string"),
    ({"prompt": "x", "seed": -1}, "/v1/completions", 400, "seed", "at least 0"),
    ({"prompt": "x", "stream": "yes"}, "/v1/completions", 400, "stream", "boolean"),
    ({"messages": "hi"}, "/v1/chat/completions", 400, "messages", "array"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "/v1/chat/completions", 400, "messages[0].role", "robot"),
    ({"prompt": "word " * 200}, "/v1/completions", 400, "prompt", f"limit of {MAX_PROMPT}"),
    ({"messages": [{"role": "user", "content": "word " * 200}]}, "/v1/chat/completions", 400, "messages",
     f"limit of {MAX_PROMPT}"),
    ({"prompt": "x", "max_tokens": 0}, "/v1/completions", 400, "max_tokens", "at least 1"),
    ({"prompt": "x", "max_tokens": MAX_NEW + 1}, "/v1/completions", 400, "max_tokens", f"at most {MAX_NEW}"),
    ({"prompt": "x", "model": "gpt-4"}, "/v1/completions", 404, "model", "gpt-4"),
    ({"prompt": "x", "temperature": 2.5}, "/v1/completions", 400, "temperature", "[0, 2]"),
    ({"prompt": "x", "n": 9}, "/v1/completions", 400, "n", "at most 8 (the server's --max-n)"),
    ({"prompt": "x", "n": 0}, "/v1/completions", 400, "n", "at least 1"),
    ({"prompt": "x", "n": 2, "best_of": 3}, "/v1/completions", 400, "best_of", "equal to n (2)"),
    ({"prompt": "x", "best_of": 2}, "/v1/completions", 400, "best_of", "equal to n (1)"),
    ({"prompt": "x", "top_p": 0}, "/v1/completions", 400, "top_p", "(0, 1]"),
    ({"prompt": "x", "top_p": 1.5}, "/v1/completions", 400, "top_p", "(0, 1]"),
    ({"prompt": "x", "top_p": "0.9"}, "/v1/completions", 400, "top_p", "number"),
    ({"prompt": "x", "top_k": -2}, "/v1/completions", 400, "top_k", "at least -1"),
    ({"prompt": "x", "top_k": 2.5}, "/v1/completions", 400, "top_k", "integer"),
    ({"prompt": "x", "frobnicate": True}, "/v1/completions", 400, "frobnicate", "unsupported field"),
    ({"prompt": ["a", "b"]}, "/v1/completions", 400, "prompt", "one prompt"),
    ({"prompt": [1, 10**9]}, "/v1/completions", 400, "prompt", "token id 1000000000 is outside [0, "),
    ({"prompt": []}, "/v1/completions", 400, "prompt", "empty prompt"),
    # what cannot be honoured is refused, never ignored
    ({"prompt": "x", "logprobs": 6}, "/v1/completions", 400, "logprobs", "at most 5"),
    ({"prompt": "x", "logprobs": True}, "/v1/completions", 400, "logprobs", "integer"),
    ({"prompt": "x", "top_logprobs": 2}, "/v1/completions", 400, "top_logprobs", "chat field"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "/v1/chat/completions", 400,
     "top_logprobs", "logprobs: true"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 6}, "/v1/chat/completions",
     400, "top_logprobs", "--max-logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "/v1/chat/completions", 400, "logprobs",
     "boolean"),
    ({"prompt": "x", "n": True}, "/v1/completions", 400, "n", "expected an integer, got a boolean"),
    ({"prompt": "x", "echo": "yes"}, "/v1/completions", 400, "echo", "boolean"),
    ({"messages": [{"role": "user", "content": "x"}], "echo": True}, "/v1/chat/completions", 400, "echo",
     "chat has no echo"),
    ({"prompt": "x", "echo": True, "max_tokens": -1}, "/v1/completions", 400, "max_tokens", "at least 0"),
    ({"prompt": "x", "response_format": {"type": "json_object"}}, "/v1/completions", 400, "response_format", "text"),
    ({"prompt": "x", "ignore_eos": "yes"}, "/v1/completions", 400, "ignore_eos", "boolean"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": True, "every": True}}, "/v1/completions",
     400, "stream_options", "continuous_usage_stats"),
    ({"messages": [{"role": "user", "content": "hi", "name": 5}]}, "/v1/chat/completions", 400, "messages[0].name",
     "string"),
    (b'{"prompt": "\\ud800", "max_tokens": 4}', "/v1/completions", 400, "prompt", "not valid Unicode"),
    (b'{"prompt": "' + b"x" * BODY_LIMIT + b'"}', "/v1/completions", 413, None, f"{BODY_LIMIT} bytes"),
]


@pytest.mark.parametrize("body,path,status,param,words", BAD, ids=[f"{b[2]}-{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_a_bad_request_gets_its_4xx_and_an_error_body(live, body, path, status, param, words):
    r = _post(live, body, path=path)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and err["type"] == "invalid_request_error", err


def _errors_logged(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def test_malformed_bodies_get_400_never_500_and_log_no_traceback(pair, engine, caplog):
    """Hostile bodies (100,000 levels of nesting, a lone surrogate sent as a JSON escape), other
    text UTF-8 cannot encode, and a tokenizer that fails: each a 400 naming the field, nothing logged. Through the
    app in-process (its body limit is the server default's, 1 MiB; nothing reaches the engine)."""
    from starlette.testclient import TestClient

    class Broken:  # a tokenizer that cannot take the text it is given
        chat_template = None

        def __call__(self, text, **kw):
            raise ValueError(f"cannot tokenize {text!r}")

    deep = b"[" * 100_000 + b"]" * 100_000
    cases = [  # (tokenizer, path, raw body, param, words)
        (None, "/v1/completions", b'{"prompt": ' + deep + b', "max_tokens": 4}', None, "nested deeper than 64"),
        (None, "/v1/completions", b'{"prompt": "x", "stop": ' + b"[" * 70 + b"]" * 70 + b"}", "stop",
         "nested deeper than 64"),
        (None, "/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 4}', "prompt", "not valid Unicode"),
        (None, "/v1/completions", b'{"prompt": "x", "stop": ["a\\udfff"]}', "stop[0]", "not valid Unicode"),
        (None, "/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": '
         b'"\\udc00"}]}]}', "messages[0].content[0].text", "not valid Unicode"),
        (Broken(), "/v1/completions", b'{"prompt": "hi"}', "prompt", "cannot be encoded (ValueError"),
        (Broken(), "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}', "messages",
         "cannot be encoded (ValueError"),
    ]
    caplog.set_level(logging.WARNING)
    apps = {}
    for tok, path, raw, param, words in cases:
        if id(tok) not in apps:
            apps[id(tok)] = TestClient(create_app(engine, tokenizer=tok or pair.tokenizer, model=MODEL),
                                       raise_server_exceptions=False)
        r = apps[id(tok)].post(path, content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (raw[:60], r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"] and err["type"] == "invalid_request_error", err
    assert _errors_logged(caplog) == []


def _stream(live, body, path="/v1/completions") -> tuple[int, list]:
    """POSTs a streaming request: (status, its events: each data line's JSON, "[DONE]" as is; a refusal: [body])."""
    with httpx.stream("POST", live.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.json()]
        events = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
    return 200, [e if e == "[DONE]" else json.loads(e) for e in events]


def _streamed(events) -> tuple[str, str, list[dict]]:
    """(text, finish_reason, the chunks with choices) of a completions or chat stream's events."""
    chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
    part = [c["choices"][0] for c in chunks]
    text = "".join(p.get("text") or (p.get("delta") or {}).get("content") or "" for p in part)
    return text, part[-1]["finish_reason"], chunks


ISSUE_STOP = {"prompt": "Question: What is 2 + 3?\nAnswer:", "max_tokens": 32, "temperature": 0, "stop": ["\n"]}


def test_a_stop_string_counts_the_tokens_up_to_the_one_that_completed_it(pair, engine, live, solo):
    """A stop string right after the prompt: the text ends before the stop string, and usage counts the
    generated tokens up to and including the one that completed it, never the ones the device generated after it
    in the same visit (the same in a stream, with the usage in every chunk, and in the Engine)."""
    ids = encode_text(pair.tokenizer, ISSUE_STOP["prompt"])
    ref = solo(ids, 32)
    want = expected_stop(pair, ref, ["\n"])
    assert want[1] == "stop" and want[2] < len(ref)  # the example does stop, with tokens after it
    r = _post(live, ISSUE_STOP)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert (c["text"], c["finish_reason"], r.json()["usage"]["completion_tokens"]) == want

    opts = {"include_usage": True, "continuous_usage_stats": True}
    status, events = _stream(live, {**ISSUE_STOP, "stream": True, "stream_options": opts})
    text, finish, chunks = _streamed(events)
    assert status == 200 and (text, finish) == want[:2] and events[-1] == "[DONE]"
    assert all(ch["usage"]["completion_tokens"] <= want[2] for ch in chunks)  # usage in every chunk
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == want[2]

    out = engine.submit(ids, max_new_tokens=32, eos_token_ids=pair.eos_token_ids, stop=["\n"]).result(timeout=120)
    assert (out.text, out.finish_reason, out.completion_tokens) == want and out.token_ids == ref[: want[2]]


@pytest.mark.parametrize("path", CLIENT_REQUESTS, ids=[p.stem for p in CLIENT_REQUESTS])
def test_recorded_client_requests(pair, live, solo, path, caplog):
    """The bodies guidellm and lm-eval send (tests/fixtures/client_requests/README.md), replayed as they are."""
    body = json.loads(path.read_text())
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    if body.get("echo"):  # lm-eval's loglikelihood: the prompt's logprobs (echo), then one generated token
        ids = body["prompt"][0]
        r = _post(live, body, path=route)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        lp, n = c["logprobs"], len(ids) + body["max_tokens"]
        assert [len(lp[k]) for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")] == [n] * 4
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["tokens"][: len(ids)] == [pair.tokenizer.decode([t]) for t in ids]
        assert all(len(d) == body["logprobs"] for d in lp["top_logprobs"][1:])
        gen = solo(ids, body["max_tokens"])
        ref = _reference_logprobs(pair, ids + gen)
        np.testing.assert_allclose(lp["token_logprobs"][1:], [ref[j, t] for j, t in enumerate((ids + gen)[1:])],
                                   atol=1e-4)
        assert c["text"] == pair.tokenizer.decode(ids) + pair.tokenizer.decode(gen, skip_special_tokens=True)
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        assert r.json()["usage"]["completion_tokens"] == len(gen)
        assert _errors_logged(caplog) == []
        return
    if body.get("stream"):  # guidellm: ignore_eos, the usage in every chunk, then a usage chunk
        n = body.get("max_tokens") or body["max_completion_tokens"]
        status, events = _stream(live, body, route)
        assert status == 200, events
        text, finish, chunks = _streamed(events)
        counts = [ch["usage"]["completion_tokens"] for ch in chunks]
        assert counts == sorted(counts) and counts[-1] == n and finish == "length"
        assert all(ch["usage"]["total_tokens"] == ch["usage"]["prompt_tokens"] + ch["usage"]["completion_tokens"]
                   for ch in chunks)
        assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == n
        assert events[-1] == "[DONE]"
        return
    # lm-eval's generate_until: greedy, cut at the first of its stop strings
    ids = body["prompt"][0] if route == "/v1/completions" else pair.encode_chat(body["messages"][0]["content"])
    want = expected_stop(pair, solo(ids, body["max_tokens"]), body["stop"])
    r = _post(live, body, path=route)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert (c.get("text", (c.get("message") or {}).get("content")), c["finish_reason"],
            r.json()["usage"]["completion_tokens"]) == want
    assert _errors_logged(caplog) == []


def test_developer_role_names_response_format_and_ignore_eos(pair, live, client, solo, monkeypatch):
    q = questions()[0]
    system = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": q}]
    developer = [{**system[0], "role": "developer"}, system[1]]
    a, b = (client.chat.completions.create(model=MODEL, messages=m, max_tokens=6, temperature=0,
                                           response_format={"type": "text"}) for m in (system, developer))
    ids = encode_text(pair.tokenizer, render_messages(pair.tokenizer, system))
    assert got(a) == got(b) == expected(pair, solo(ids, 6))  # developer is system

    seen = []  # the chat template receives each message's name (this one ignores it)
    real = pair.tokenizer.apply_chat_template
    monkeypatch.setattr(pair.tokenizer, "apply_chat_template", lambda msgs, **kw: seen.append(msgs) or real(msgs, **kw))
    named = [{**system[0], "name": "rules"}, {**system[1], "name": "ada"}]
    assert got(client.chat.completions.create(model=MODEL, messages=named, max_tokens=6, temperature=0)) == got(a)
    assert [m.get("name") for m in seen[-1]] == ["rules", "ada"]
    monkeypatch.undo()

    # ignore_eos: past the EOS id to max_tokens, the target's greedy tokens with no EOS id
    prompt = "Question: Tom has 3 apples and buys 2 more. How many apples does he have?\nAnswer:"
    ids = encode_text(pair.tokenizer, prompt)
    plain, past = solo(ids, 32), solo(ids, 32, [])
    assert plain[-1] in pair.eos_token_ids and len(plain) < 32  # it would stop at EOS
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == \
        (pair.tokenizer.decode(past, skip_special_tokens=True), "length", 32)


def test_keys_routes_and_a_full_queue(pair, live, engine, client):
    # idle connections outlive the client's pool, so a reused one is never being closed by the server
    assert live.server.config.timeout_keep_alive > httpx.Limits().keepalive_expiry
    for key in (None, "wrong"):
        r = _post(live, {"prompt": "x"}, key=key)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{live.url}/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {}
                         ).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{live.url}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    assert httpx.get(f"{live.url}/health").status_code == 200  # open without a key
    r = httpx.get(f"{live.url}/v1/nothing", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and "error" in r.json()
    assert httpx.get(f"{live.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}).status_code == 405

    # fill the queue behind busy slots, straight through the engine; the next HTTP request gets 429
    ids = pair.encode_chat(questions()[0])
    held = []
    with VisitGate(engine) as gate:  # no slot frees up meanwhile
        try:
            def fill():
                with pytest.raises(sparkjax.errors.QueueFullError):
                    for _ in range(SLOTS + QUEUE + 1):
                        held.append(engine.submit(ids, max_new_tokens=MAX_NEW, temperature=0.0, eos_token_ids=[]))

            fill()
            _wait(lambda: engine.metrics()["active_slots"] == SLOTS, what="every slot taken")
            fill()  # the queue again, now that nothing leaves it
            r = _post(live, {"prompt": "x", "max_tokens": 2})
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
            # one place left: a request's n choices are queued all or none
            held[-1].cancel()
            _wait(lambda: engine.metrics()["queue_length"] == QUEUE - 1, what="a place in the queue")
            submitted = engine.metrics()["submitted"]
            r = _post(live, {"prompt": "x", "max_tokens": 2, "n": 2})
            assert r.status_code == 429 and "no room for 2 choices" in r.json()["error"]["message"], r.text
            m = engine.metrics()
            assert (m["queue_length"], m["submitted"]) == (QUEUE - 1, submitted)  # nothing of it was queued
        finally:
            for h in held:
                h.cancel()
            gate.open = True
    for h in held:
        h.result(timeout=60)


def test_an_engine_fault_fails_the_requests_in_flight_with_500_and_the_engine_recovers(pair, engine, client,
                                                                                       solo):
    real = engine._visit_call
    faults = []

    def failing(*args, **kwargs):  # the next device visit raises, as a device error would
        faults.append(1)
        engine._visit_call = real
        raise RuntimeError("injected device fault")

    for stream in (False, True):
        engine._visit_call = failing
        with pytest.raises(openai.InternalServerError, match="injected device fault"):
            r = client.completions.create(model=MODEL, prompt="x = 1\n", max_tokens=8, temperature=0, stream=stream)
            list(r) if stream else None
    engine._visit_call = real
    assert len(faults) == 2 and engine.metrics()["faults"] == 2
    prompt = "for i in range(3):\n"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert got(r) == expected(pair, solo(encode_text(pair.tokenizer, prompt), 8))


def test_after_everything_the_server_still_answers(pair, live, engine, client, solo):
    h = httpx.get(f"{live.url}/health").json()
    assert h["status"] == "ok" and h["slots"] == SLOTS
    _wait(lambda: engine.metrics()["active_slots"] == 0, what="every slot to be free")
    q = questions()[3]
    assert got(ask(client, q, 10)) == expected(pair, solo(pair.encode_chat(q), 10))
    text = httpx.get(f"{live.url}/metrics").text
    series = dict(ln.rsplit(" ", 1) for ln in text.splitlines() if ln and not ln.startswith("#"))
    assert all(float(v) == float(v) for v in series.values())  # every value a number, none NaN
    codes = Counter()
    for name, v in series.items():
        if name.startswith("sparkjax_http_responses_total"):
            codes[name.split('code="')[1][:3]] += int(v)
    # the only 5xx responses are the two injected engine faults
    assert codes["200"] > CONCURRENT and sum(n for c, n in codes.items() if c.startswith("5")) == codes["500"] == 2
    assert int(series["sparkjax_http_time_to_first_token_seconds_count"]) > CONCURRENT
    # vLLM's speculation counters under our prefix: every round of this method is a draft of 16 nodes; a round
    # commits its accepted drafts and one more token; position d counts the rounds that accepted d + 1 drafts
    drafts = int(series["sparkjax:spec_decode_num_drafts_total"])
    accepted = int(series["sparkjax:spec_decode_num_accepted_tokens_total"])
    per_pos = [int(series[f'sparkjax:spec_decode_num_accepted_tokens_per_pos_total{{position="{d}"}}'])
               for d in range(engine.plan.depth)]
    assert drafts == int(series["sparkjax_rounds_total"]) > 0
    assert int(series["sparkjax:spec_decode_num_draft_tokens_total"]) == 16 * drafts
    assert accepted == sum(per_pos) == int(series["sparkjax_accepted_tokens_total"]) - drafts
    assert per_pos == sorted(per_pos, reverse=True) and 0 < per_pos[0] <= drafts
    assert not any(k.startswith("sparkjax:spec") and "position" in k and k not in
                   {f'sparkjax:spec_decode_num_accepted_tokens_per_pos_total{{position="{d}"}}'
                    for d in range(engine.plan.depth)} for k in series)
    # every admission is a prefill, or a copy of one for another choice of the same request (n)
    m = engine.metrics()
    exported = {k: int(series[f"sparkjax_{k}_total"]) for k in ("prefills", "prefill_tokens", "shared_prefills")}
    assert exported == {k: m[k] for k in exported} and 0 < m["prefills"] < m["prefill_tokens"]


def test_logprobs_in_the_completions_and_chat_formats(pair, live):
    """Completions ``logprobs: N`` and chat ``logprobs`` / ``top_logprobs`` in OpenAI's formats, plain and streamed,
    with the values ``generate(logprobs=...)`` gives for the same prompt (the target's log-softmax)."""
    prompt = "def read_lines(path):\n"
    ids = encode_text(pair.tokenizer, prompt)
    ref = sparkjax.generate(pair.target, None, [ids], method="ar", max_new_tokens=8, capacity=MAX_NEW,
                            prompt_width=MAX_PROMPT, eos_token_ids=pair.eos_token_ids, logprobs=5)
    toks, lps, tops = ref.tokens[0], ref.token_logprobs[0], ref.top_logprobs[0]
    r = _post(live, {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 2})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    lp = c["logprobs"]
    assert lp["tokens"] == [pair.tokenizer.decode([t]) for t in toks]
    np.testing.assert_allclose(lp["token_logprobs"], lps, atol=1e-4)
    assert [len(d) for d in lp["top_logprobs"]] == [2] * len(toks)
    for d, top in zip(lp["top_logprobs"], tops, strict=True):
        np.testing.assert_allclose(sorted(d.values(), reverse=True), [v for _, v in top[:2]], atol=1e-4)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    r0 = _post(live, {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 0}).json()["choices"][0]
    assert r0["logprobs"]["top_logprobs"] == [{}] * len(toks)
    np.testing.assert_allclose(r0["logprobs"]["token_logprobs"], lps, atol=1e-4)
    assert _post(live, {"prompt": prompt, "max_tokens": 2}).json()["choices"][0]["logprobs"] is None

    # streamed: every token's logprobs, once, in the chunks that carry it
    with httpx.stream("POST", live.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    streamed = [v for e in events for ch in e["choices"] if ch["logprobs"] for v in ch["logprobs"]["token_logprobs"]]
    np.testing.assert_allclose(streamed, lps, atol=1e-4)

    msgs = [{"role": "user", "content": "Say something."}]
    chat_ids = pair.encode_chat("Say something.")
    cref = sparkjax.generate(pair.target, None, [chat_ids], method="ar", max_new_tokens=6, capacity=MAX_NEW,
                             prompt_width=MAX_PROMPT, eos_token_ids=pair.eos_token_ids, logprobs=5)
    r = _post(live, {"messages": msgs, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3},
              path="/v1/chat/completions")
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [pair.tokenizer.decode([t]) for t in cref.tokens[0]]
    np.testing.assert_allclose([e["logprob"] for e in content], cref.token_logprobs[0], atol=1e-4)
    for e, top in zip(content, cref.top_logprobs[0], strict=True):
        assert e["bytes"] == list(e["token"].encode())
        assert [t["token"] for t in e["top_logprobs"]] == [pair.tokenizer.decode([i]) for i, _ in top[:3]]
        np.testing.assert_allclose([t["logprob"] for t in e["top_logprobs"]], [v for _, v in top[:3]], atol=1e-4)
    r = _post(live, {"messages": msgs, "max_tokens": 6, "temperature": 0, "logprobs": True},
              path="/v1/chat/completions").json()["choices"][0]["logprobs"]["content"]
    assert all(e["top_logprobs"] == [] for e in r)


def _reference_logprobs(pair, ids: list[int]) -> np.ndarray:
    """The target's own log-softmax over ``ids`` (one forward pass, no generate, compiled): row j scores token
    j + 1."""
    pos = np.arange(len(ids), dtype=np.int32)[None]
    return np.asarray(_forward_log_softmax(pair.target, np.asarray([ids], np.int32), pos))


@nnx.jit
def _forward_log_softmax(target, ids, pos):
    logits = target(ids, pos).logits[0]
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def test_echo_scores_the_prompt_and_max_tokens_0_generates_nothing(pair, live):
    """Completions ``echo`` with ``logprobs``: the prompt's tokens and their log-probabilities under the target (the
    first null), equal to the target's log-softmax; ``max_tokens: 0`` scores only; ``echo`` alone echoes the
    prompt's text before the completion."""
    prompt = "def read_lines(path):\n"
    ids = encode_text(pair.tokenizer, prompt)
    ref = _reference_logprobs(pair, ids)
    r = _post(live, {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    c = body["choices"][0]
    assert c["text"] == prompt and c["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    lp = c["logprobs"]
    assert lp["tokens"] == [pair.tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    np.testing.assert_allclose(lp["token_logprobs"][1:], [ref[j, t] for j, t in enumerate(ids[1:])], atol=1e-4)
    for j, d in enumerate(lp["top_logprobs"][1:]):
        want = {pair.tokenizer.decode([int(i)]): ref[j, i] for i in np.argsort(-ref[j])[:3]}
        assert list(d) == list(want)
        np.testing.assert_allclose(list(d.values()), list(want.values()), atol=1e-4)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])

    plain = _post(live, {"prompt": prompt, "max_tokens": 4, "temperature": 0}).json()["choices"][0]["text"]
    r = _post(live, {"prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == prompt + plain, r.text
    assert r.json()["choices"][0]["logprobs"] is None
    r = _post(live, {"prompt": prompt, "max_tokens": 0, "echo": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == prompt, r.text


def test_a_streamed_echo_opens_with_the_prompt(pair, live):
    """``echo`` with ``stream``: each choice's first event is the prompt's text (with ``logprobs``, its tokens', the
    first null), then the completion's chunks; joined, they are the whole response's text and ``logprobs``. With
    ``max_tokens: 0``, the prompt and the end."""
    prompt = "def read_lines(path):\n"
    ids = encode_text(pair.tokenizer, prompt)
    for max_tokens in (6, 0):
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "echo": True, "logprobs": 2, "n": 2}
        whole = _post(live, body).json()
        status, events = _stream(live, {**body, "stream": True, "stream_options": {"include_usage": True}})
        assert status == 200 and events[-1] == "[DONE]", events
        assert events[-2]["choices"] == [] and events[-2]["usage"] == whole["usage"]
        for i, want in enumerate(whole["choices"]):
            mine = [e["choices"][0] for e in events[:-2] if e["choices"][0]["index"] == i]
            assert mine[0]["text"] == prompt and mine[0]["finish_reason"] is None
            assert mine[0]["logprobs"]["tokens"] == [pair.tokenizer.decode([t]) for t in ids]
            assert mine[0]["logprobs"]["token_logprobs"][0] is None
            assert "".join(c["text"] for c in mine) == want["text"]
            assert mine[-1]["finish_reason"] == want["finish_reason"]
            got = {k: [v for c in mine if c["logprobs"] for v in c["logprobs"][k]] for k in want["logprobs"]}
            lp = want["logprobs"]
            assert got["tokens"] == lp["tokens"] and got["text_offset"] == lp["text_offset"]
            assert got["token_logprobs"][0] is None and len(got["token_logprobs"]) == len(ids) + max_tokens
            np.testing.assert_allclose(got["token_logprobs"][1:], lp["token_logprobs"][1:], rtol=0, atol=1e-5)
            for d, w in zip(got["top_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
                assert list(d) == list(w)
                np.testing.assert_allclose(list(d.values()), list(w.values()), rtol=0, atol=1e-5)
        assert whole["usage"]["prompt_tokens"] == len(ids)
    r = _post(live, {"prompt": prompt, "max_tokens": 2, "echo": True, "stream": True})
    assert r.status_code == 200 and r.text.startswith("data: ") and prompt.replace("\n", "\\n") in r.text


def test_n_choices_greedy_identical_seeded_distinct_and_reproducible(pair, live, engine, solo):
    """``n`` choices with indices 0..n-1, sharing the prompt's prefill (one prefill, n - 1 copies of its slot, with
    the slots free); greedy they are identical (the target's own tokens); with a seed choice i draws from
    ``choice_seed(seed, i)``: distinct choices, each (tokens and logprobs) the ``n: 1`` response for that seed, the
    same again for the same seed; usage counts the prompt once and every choice's tokens; a stream names each
    chunk's choice."""
    prompt = "def read_lines(path):\n"
    ids = encode_text(pair.tokenizer, prompt)
    want = expected(pair, solo(ids, 8))
    _wait(lambda: engine.metrics()["active_slots"] == 0, what="every slot to be free")
    before = engine.metrics()
    r = _post(live, {"prompt": prompt, "max_tokens": 8, "temperature": 0, "n": 3, "best_of": 3})
    assert r.status_code == 200, r.text
    after = engine.metrics()
    assert [after[k] - before[k] for k in ("prefills", "prefill_tokens", "shared_prefills")] == [1, len(ids), 2]
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all((c["text"], c["finish_reason"]) == want[:2] for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 3 * want[2],
                             "total_tokens": len(ids) + 3 * want[2]}

    seeded = {"prompt": prompt, "max_tokens": 12, "temperature": 1.0, "seed": 7, "n": 3, "logprobs": 2}
    a, b = (_post(live, seeded).json() for _ in range(2))
    texts = [c["text"] for c in a["choices"]]
    assert a["choices"] == b["choices"] and len(set(texts)) == 3, texts
    assert a["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in a["choices"])
    for i, c in enumerate(a["choices"]):  # each choice is the lone request with its seed (prefilled alone)
        one = _post(live, {**seeded, "n": 1, "seed": choice_seed(7, i)}).json()["choices"][0]
        assert (one["text"], one["finish_reason"], one["index"]) == (c["text"], c["finish_reason"], 0)
        lp, lp1 = c["logprobs"], one["logprobs"]
        assert lp["tokens"] == lp1["tokens"] and [list(d) for d in lp["top_logprobs"]] == \
            [list(d) for d in lp1["top_logprobs"]]
        np.testing.assert_allclose(lp["token_logprobs"], lp1["token_logprobs"], rtol=0, atol=1e-5)
    assert choice_seed(7, 0) == 7  # choice 0 keeps the request's seed

    status, events = _stream(live, {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 6,
                                    "temperature": 0, "n": 3, "stream": True,
                                    "stream_options": {"include_usage": True}}, "/v1/chat/completions")
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert {ch["choices"][0]["index"] for ch in chunks} == {0, 1, 2}
    by_index = {i: "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks
                           if ch["choices"][0]["index"] == i) for i in (0, 1, 2)}
    ref = expected(pair, solo(pair.encode_chat("Say something."), 6))
    assert by_index == {0: ref[0], 1: ref[0], 2: ref[0]}
    assert sorted(ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"][0]["finish_reason"]) == \
        [ref[1]] * 3
    assert events[-2]["usage"]["completion_tokens"] == 3 * ref[2]
    assert events[-2]["usage"]["prompt_tokens"] == len(pair.encode_chat("Say something."))


def test_shutdown_gives_a_queued_stream_503_and_starts_no_visit_after_the_grace_period(pair, live, engine, solo):
    """The last test on the live server: it drains it. A stream still queued when the grace period ends gets a 503
    JSON error (no first token yet: an HTTP status, even though it asked to stream); one already streaming ends
    with an error event; no host visit starts after the grace period; the engine's thread ends."""
    real, late = engine._visit_call, []

    def visit(*args):  # records visits that start after the grace period
        late.append(engine._abort)
        return real(*args)

    ids = pair.encode_chat(questions()[0])
    with VisitGate(engine) as gate:  # nothing advances but for the rounds let through
        busy = [engine.submit(ids, max_new_tokens=MAX_NEW, temperature=0.0, eos_token_ids=[]) for _ in range(SLOTS - 1)]
        _wait(lambda: engine.metrics()["active_slots"] == SLOTS - 1, what="the busy slots")
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            # a prompt whose greedy continuation runs past one round without EOS
            prompt = next(q for q in questions() if len(solo(encode_text(pair.tokenizer, q), MAX_NEW)) == MAX_NEW)
            body = {"prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "stream": True}
            running = pool.submit(_stream, live, body)
            _wait(lambda: engine.metrics()["active_slots"] == SLOTS, what="the streaming request admitted")
            gate.steps = 1  # one round: its first tokens are out
            _wait(lambda: any(r is not None and r.first_token for r in engine._in_slot if r not in busy),
                  what="the first tokens")
            queued = pool.submit(_stream, live, {**body, "prompt": "import os\n"})
            _wait(lambda: engine.metrics()["queue_length"] == 1, what="the queued request")
            live.grace_s = 0.5
            gate.real = visit  # the gate's visits go through the recorder
            live.stop()
            status, events = queued.result(timeout=120)
            assert status == 503 and events[0]["error"]["code"] == "cancelled", events
            assert "shutting down" in events[0]["error"]["message"]
            status, events = running.result(timeout=120)
            assert status == 200 and events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
    assert not engine._thread.is_alive() and all(r.done for r in busy)
    assert late and True not in late[:-1]  # at most the visit running when the grace period ended; none after it
    engine._visit_call = real


# --- the command line ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_refuses_bad_flags_before_loading_anything(capsys):
    from sparkjax.serve.__main__ import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for argv, words in ((["--slots", "0"], "--slots"), (["--drafter", "d"], "--drafter"),
                            (["--port", str(port)], "cannot bind"), (["--grace-s", "-1"], "--grace-s"),
                            (["--port", "70000"], "--port"), (["--visit-sizes", "1,4"], "--visit-sizes"),
                            (["--visit-sizes", "x"], "--visit-sizes")):
            assert main(argv) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith("error:") and words in err[0], err


@pytest.mark.slow
def test_sigterm_finishes_in_flight_requests_then_exits_0(tmp_path):
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "sparkjax.serve", "--port", str(port), "--slots", "2",
                             "--max-new-tokens", "64", "--grace-s", "20"], stderr=subprocess.PIPE, text=True, env=env)
    log: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stderr:
            log.append(line)
            if " ready on " in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(1500), "".join(log)  # generous: the warm-up compiles and profiles auto
        assert any("device:" in ln for ln in log) and any("compiled" in ln for ln in log)
        # the first start's phases, each step with its count (the estimate follows the first step)
        for words in ("loading: part 1 of 3 (the target", "profiling auto's round costs: compiling: batch size 1 of 2",
                      "profiling auto's round costs: warming up and timing: batch size 2 of 2",
                      "compiling and warming up: program 2 of", "about"):
            assert any(words in ln for ln in log), (words, "".join(log))
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        stream = c.completions.create(model=MODEL, prompt="import os\n", max_tokens=64, temperature=0, stream=True)
        it = iter(stream)
        first = next(it)
        proc.send_signal(signal.SIGTERM)
        rest = list(it)
        assert (rest or [first])[-1].choices[0].finish_reason in ("stop", "length")
        assert proc.wait(120) == 0, "".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()
