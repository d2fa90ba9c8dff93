"""The OpenAI-compatible HTTP server over a slot-pool :class:`~sparkjax.serve.Engine` (Starlette on uvicorn).

    app = create_app(engine, tokenizer=tok, model="sparkjax-demo", eos_token_ids=[2], api_key=None)
    serve(app, host="127.0.0.1", port=8000, grace_s=30.0)      # blocks; SIGTERM / Ctrl-C end it with 0

The endpoints, fields, limits, streaming format and error bodies are in docs/serving.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import math
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..engine.checks import MAX_SEED, check_prompt
from ..engine.logprobs import MAX_LOGPROBS
from ..errors import ArgumentError, EngineClosedError, EngineFailure, QueueFullError, SparkjaxError, TokenizerError
from ..text import encode_chat, encode_text
from .engine import Histogram

log = logging.getLogger("sparkjax.serve")

DEFAULT_MAX_BODY_BYTES = 1 << 20
TEMPERATURE_MAX = 2.0  # OpenAI's range is [0, 2]
MAX_STOP = 16  # stop sequences per request (OpenAI takes 4; lm-eval's completions add the EOS string to a task's)
DEFAULT_MAX_N = 8  # choices per request (--max-n)
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound for completions' logprobs (chat's top_logprobs: MAX_LOGPROBS, 20)
MAX_JSON_DEPTH = 64  # nesting levels a request body may have (arrays and objects)
# Idle keep-alive connections are kept longer than clients keep them (httpx and the openai client: 5 s), so a client
# never sends a request on a connection the server is closing at that moment.
KEEP_ALIVE_S = 30
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the engine's bound
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# message roles, as the chat template sees them
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
HEARTBEAT_S = 2.0  # an idle stream sends an SSE comment this often: proxies keep it open, a gone client is seen

# fields accepted only at the value that changes nothing (what OpenAI does by default); a null is always accepted
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0,
           "suffix": None, "logit_bias": None, "tools": None,
           "tool_choice": None, "parallel_tool_calls": None}
TOOL_CHOICES = ("none", "auto")  # without tools, either calls none
COMMON = {"model", "logprobs", "top_logprobs", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
          "stream_options", "user", "ignore_eos", "response_format", "echo", "n", "best_of", *NEUTRAL}
FIELDS = {"completions": COMMON | {"prompt"}, "chat": COMMON | {"messages", "max_completion_tokens"}}
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")
# the engine's argument names, as the API calls them (an engine ArgumentError names the former)
API_NAMES = {"n": "n", "max_new_tokens": "max_tokens", "prompt_ids": "prompt", "temperature": "temperature",
             "seed": "seed", "stop": "stop", "top_p": "top_p", "top_k": "top_k"}


class APIError(Exception):
    """A refused request: its status code and OpenAI-style error fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, f"{param}: {message}" if param else message, param=param, code=code)


def _kind(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(v), type(v).__name__)


# --- request fields -----------------------------------------------------------------------------------------------


def _integer(body: dict, name: str, default: Any, *, minimum: int | None = None, maximum: int | None = None,
             limit_what: str = "") -> Any:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(name, f"expected an integer, got {_kind(v)}")
    if minimum is not None and v < minimum:
        raise bad(name, f"must be at least {minimum}, got {v}")
    if maximum is not None and v > maximum:
        raise bad(name, f"must be at most {maximum}{limit_what}, got {v}")
    return v


def _temperature(body: dict, default: float) -> float:
    v = body.get("temperature")
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise bad("temperature", f"expected a number in [0, {TEMPERATURE_MAX:g}], got {_kind(v)}")
    if not 0 <= v <= TEMPERATURE_MAX:
        raise bad("temperature", f"must be in [0, {TEMPERATURE_MAX:g}], got {v}")
    return float(v)


def _top_p(body: dict) -> float:
    v = body.get("top_p")
    if v is None:
        return 1.0
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise bad("top_p", f"expected a number in (0, 1], got {_kind(v)}")
    if not 0 < v <= 1:
        raise bad("top_p", f"must be in (0, 1] (1 = off), got {v}")
    return float(v)


def _top_k(body: dict) -> int:
    """vLLM's ``top_k``: 0 or -1 (vLLM's older default) is off."""
    v = _integer(body, "top_k", 0, minimum=-1, maximum=2**31 - 1)
    return max(v, 0)


def _stop(body: dict) -> list[str] | None:
    v = body.get("stop")
    if v is None:
        return None
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad("stop", f"expected a string or an array of strings, got {_kind(v)}")
    if len(items) > MAX_STOP:
        raise bad("stop", f"at most {MAX_STOP} sequences, got {len(items)}")
    if any(s == "" for s in items):
        raise bad("stop", "a stop sequence must not be empty")
    return items or None


def _is_neutral(name: str, v: Any, neutral: Any) -> bool:
    """Whether ``v`` asks for nothing beyond the default: the neutral value itself (a boolean for a boolean, a
    number for a number), or for a field whose default is null: false or an empty string, array or object (and for
    ``tool_choice`` "none" or "auto", for ``parallel_tool_calls`` any boolean: without tools they call none)."""
    if v is None:
        return True
    if name == "tool_choice" and v in TOOL_CHOICES:
        return True
    if name == "parallel_tool_calls":
        return isinstance(v, bool)
    if isinstance(neutral, bool):
        return v is neutral
    if neutral is None:
        return v is False or (isinstance(v, str | list | dict) and not v)
    return isinstance(v, int | float) and not isinstance(v, bool) and v == neutral


def _check_fields(body: dict, kind: str) -> None:
    for name in body:
        if name not in FIELDS[kind]:
            raise bad(name, "unsupported field", code="unsupported_field")
    for name, neutral in NEUTRAL.items():
        v = body.get(name)
        if not _is_neutral(name, v, neutral):
            only = "null or false" if neutral is None else json.dumps(neutral)
            raise bad(name, f"unsupported value {_short(v)} (only {only} is supported)", code="unsupported_value")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise bad("response_format", f'unsupported value {_short(fmt)} (only {{"type": "text"}} is supported: this '
                  f'server has no JSON mode)', code="unsupported_value")
    for name in ("user",):
        if name in body and not isinstance(body[name], str | type(None)):
            raise bad(name, f"expected a string, got {_kind(body[name])}")
    for name in ("stream", "ignore_eos"):
        if not isinstance(body.get(name, False), bool | type(None)):
            raise bad(name, f"expected a boolean, got {_kind(body[name])}")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - set(STREAM_OPTIONS) \
                or not all(isinstance(v, bool | type(None)) for v in opts.values()):
            raise bad("stream_options", 'expected {"include_usage": true|false, "continuous_usage_stats": '
                                        'true|false}')
        if not body.get("stream"):
            raise bad("stream_options", "only allowed with stream: true")


def _short(v: Any, limit: int = 80) -> str:
    text = json.dumps(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_body(data: Any) -> None:
    """Refuses a parsed body nested deeper than :data:`MAX_JSON_DEPTH` levels, or holding a string that is not
    Unicode text (a lone surrogate such as ``"\\ud800"``: JSON's escapes allow it, UTF-8 cannot encode it); the
    400 names the field. Iterative, so any depth the parser produced is safe."""
    stack: list[tuple[Any, int, tuple]] = [(data, 1, ())]
    while stack:
        v, depth, path = stack.pop()
        if isinstance(v, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise bad(_path(path[:1]) if path else None, f"nested deeper than {MAX_JSON_DEPTH} levels",
                          code="invalid_json")
            items = v.items() if isinstance(v, dict) else enumerate(v)
            stack.extend((x, depth + 1, (*path, k)) for k, x in items)
            if isinstance(v, dict):
                stack.extend((k, depth, (*path, k)) for k in v)  # keys are strings too
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise bad(_path(path) or None, f"not valid Unicode text: {e.reason} ({v[e.start:e.end]!a} at "
                          f"character {e.start})", code="invalid_text") from None


def _path(path: tuple) -> str:
    """``("messages", 0, "content")`` as ``messages[0].content``."""
    out = ""
    for k in path:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out


def _encode(what: str, fn: Callable[[], list[int]]) -> list[int]:
    """``fn()``'s ids; any failure of the tokenizer or the template is the client's 400 naming ``what``."""
    try:
        return fn()
    except APIError:
        raise
    except SparkjaxError as e:  # a template that does not render, a tokenizer without one
        raise bad(what, str(e)) from None
    except Exception as e:  # noqa: BLE001 - text the tokenizer or the chat template cannot take
        raise bad(what, f"cannot be encoded ({type(e).__name__}: {e})", code="invalid_text") from None


def _prompt_ids(body: dict, tokenizer, vocab: int | None) -> list[int]:
    if "prompt" not in body:
        raise bad("prompt", "missing")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]  # one prompt in an array
    if isinstance(p, str):
        ids = _encode("prompt", lambda: encode_text(tokenizer, p))
    elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        ids = p
    elif isinstance(p, list) and len(p) > 1 and all(isinstance(t, str | list) for t in p):
        raise bad("prompt", f"one prompt per request is supported, got {len(p)}")
    else:
        raise bad("prompt", f"expected a string or an array of token ids, got {_kind(p)}")
    try:
        return check_prompt(ids, vocab, name="prompt")
    except ArgumentError as e:
        raise APIError(400, str(e), param="prompt") from None


def _message_text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                         and isinstance(part.get("text"), str) for part in content):
        return "".join(part["text"] for part in content)
    raise bad(f"messages[{i}].content", f"expected a string or an array of text parts, got {_kind(content)}")


def render_messages(tokenizer, messages: list[dict]) -> str:
    """The chat-template text of a conversation followed by the assistant header, rendered as
    :func:`sparkjax.text.render_chat` renders one user turn (thinking off)."""
    if not getattr(tokenizer, "chat_template", None):
        raise TokenizerError("the tokenizer has no chat template: send one user message")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=False)
    except Exception as e:  # noqa: BLE001 - a template that does not render (jinja2's TemplateError, ...)
        raise TokenizerError(f"the chat template does not render these messages ({type(e).__name__}: {e})") \
            from None


def chat_turns(messages: Any) -> list[dict]:
    """The checked ``messages`` as the chat template receives them: ``role`` (``developer`` as ``system``),
    ``content`` (text parts joined) and, when given, ``name``."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", f"expected a non-empty array of messages, got {_kind(messages)}")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", f"expected an object, got {_kind(m)}")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise bad(f"messages[{i}].{sorted(extra)[0]}", "unsupported field", code="unsupported_field")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad(f"messages[{i}].role", f"expected one of {', '.join(ROLES)}, got {_short(role)}")
        turn = {"role": ROLES[role], "content": _message_text(i, m.get("content"))}
        if m.get("name") is not None:
            if not isinstance(m["name"], str):
                raise bad(f"messages[{i}].name", f"expected a string, got {_kind(m['name'])}")
            turn["name"] = m["name"]
        turns.append(turn)
    return turns


def _chat_ids(body: dict, tokenizer) -> list[int]:
    turns = chat_turns(body.get("messages"))

    def encode() -> list[int]:
        if len(turns) == 1 and set(turns[0]) == {"role", "content"} and turns[0]["role"] == "user":
            return encode_chat(tokenizer, turns[0]["content"])
        return encode_text(tokenizer, render_messages(tokenizer, turns))

    ids = _encode("messages", encode)
    if not ids:
        raise bad("messages", "encode to no tokens")
    return ids


@dataclasses.dataclass(frozen=True)
class Parsed:
    """A checked request: the prompt's ids and the engine's arguments."""

    kind: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    seed: int | None
    stop: list[str] | None
    stream: bool
    include_usage: bool  # a last chunk with the usage
    continuous_usage: bool = False  # the usage so far in every chunk (vLLM's continuous_usage_stats)
    ignore_eos: bool = False  # generate past EOS ids, to max_tokens or a stop string
    top_p: float = 1.0  # 1: off
    top_k: int = 0  # 0: off
    logprobs: int | None = None  # the alternatives per token asked for (None: no logprobs)
    n: int = 1  # choices
    echo: bool = False  # completions: the prompt before the completion (with logprobs: the prompt's scored too)
    prompt_text: str = ""  # the prompt as echoed (a string prompt as given, token ids decoded)


# --- the app ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Stats:
    """What the server itself counts for /metrics: responses per (path, status) and times to first token."""

    responses: Counter = dataclasses.field(default_factory=Counter)
    ttft: Histogram = dataclasses.field(default_factory=lambda: Histogram(TTFT_BUCKETS))


class Server:
    """The request handlers over one engine (see :func:`create_app`)."""

    def __init__(self, engine, *, tokenizer, model: str, eos_token_ids: Sequence[int] | None = None,
                 api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 default_temperature: float = 1.0, vocab_size: int | None = None, max_n: int = DEFAULT_MAX_N):
        if isinstance(max_n, bool) or not isinstance(max_n, int) or max_n < 1:
            raise ArgumentError(f"max_n: expected a positive integer, got {max_n!r}")
        self.max_n = max_n
        if not isinstance(max_body_bytes, int) or isinstance(max_body_bytes, bool) or max_body_bytes < 1:
            raise ArgumentError(f"max_body_bytes: expected a positive integer, got {max_body_bytes!r}")
        if api_key is not None and not (isinstance(api_key, str) and api_key):
            raise ArgumentError("api_key: expected a non-empty string (or None for no key)")
        self.engine, self.tokenizer, self.model = engine, tokenizer, model
        self.eos = None if eos_token_ids is None else [int(i) for i in eos_token_ids]
        self.api_key, self.max_body_bytes = api_key, max_body_bytes
        self.default_temperature, self.vocab = default_temperature, vocab_size
        self.created = int(time.time())
        self.stats = Stats()
        self.draining = False

    # -- plumbing

    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            what = "no API key given" if not auth else "wrong API key"
            raise APIError(401, f"{what}: send the header 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key")

    async def read_json(self, request: Request) -> dict:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise APIError(413, f"request body of {length} bytes exceeds the limit of {self.max_body_bytes} bytes",
                           code="body_too_large")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > self.max_body_bytes:
                raise APIError(413, f"request body exceeds the limit of {self.max_body_bytes} bytes",
                               code="body_too_large")

        def no_constant(name):
            raise ValueError(f"{name} is not valid JSON")

        try:
            data = json.loads(bytes(body), parse_constant=no_constant)
        except (ValueError, UnicodeDecodeError) as e:
            raise bad(None, f"the body is not valid JSON ({e})", code="invalid_json") from None
        except RecursionError:  # far deeper than MAX_JSON_DEPTH
            raise bad(None, f"the body is nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") \
                from None
        if not isinstance(data, dict):
            raise bad(None, f"the body must be a JSON object, got {_kind(data)}", code="invalid_json")
        check_body(data)
        return data

    def parse(self, body: dict, kind: str) -> Parsed:
        _check_fields(body, kind)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise bad("model", f"expected a string, got {_kind(model)}")
        if model is not None and model != self.model:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model!r}", param="model",
                           code="model_not_found")
        limit = self.engine.max_new_tokens
        default = min(COMPLETIONS_DEFAULT_MAX_TOKENS, limit) if kind == "completions" else limit
        name = "max_tokens"
        if kind == "chat" and body.get("max_completion_tokens") is not None:
            if body.get("max_tokens") is not None:
                raise bad("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
            name = "max_completion_tokens"
        echo = self._echo(body, kind)
        max_tokens = _integer(body, name, default, minimum=0 if echo else 1, maximum=limit,
                              limit_what=" (the server's limit)")
        temperature = _temperature(body, self.default_temperature)
        top_p, top_k = _top_p(body), _top_k(body)
        seed = _integer(body, "seed", None, minimum=0, maximum=MAX_SEED - 1)
        stop = _stop(body)
        ids = _prompt_ids(body, self.tokenizer, self.vocab) if kind == "completions" else \
            _chat_ids(body, self.tokenizer)
        if len(ids) > self.engine.max_prompt_tokens:
            raise bad("prompt" if kind == "completions" else "messages", f"{len(ids)} tokens, more than the server's "
                      f"limit of {self.engine.max_prompt_tokens} prompt tokens", code="context_length_exceeded")
        opts = body.get("stream_options") or {}
        return Parsed(kind, ids, max_tokens, temperature, seed, stop, bool(body.get("stream")),
                      bool(opts.get("include_usage")), bool(opts.get("continuous_usage_stats")),
                      bool(body.get("ignore_eos")), top_p, top_k, self._logprobs(body, kind), self._n(body), echo,
                      self._prompt_text(body, ids) if echo else "")

    def _n(self, body: dict) -> int:
        """``n`` choices (1..max_n); ``best_of`` null or equal to ``n`` (no choice is generated and dropped)."""
        n = _integer(body, "n", 1, minimum=1, maximum=self.max_n, limit_what=" (the server's --max-n)")
        best = body.get("best_of")
        if best is not None and (isinstance(best, bool) or not isinstance(best, int | float) or best != n):
            raise bad("best_of", f"only null or equal to n ({n}) is supported, got {_short(best)}",
                      code="unsupported_value")
        return n

    @staticmethod
    def _echo(body: dict, kind: str) -> bool:
        """Completions ``echo`` (a boolean)."""
        v = body.get("echo")
        if v is None or v is False:
            return False
        if kind != "completions":
            raise bad("echo", "a completions field: chat has no echo", code="unsupported_field")
        if not isinstance(v, bool):
            raise bad("echo", f"expected a boolean, got {_kind(v)}")
        return True

    def _prompt_text(self, body: dict, ids: list[int]) -> str:
        p = body["prompt"]
        p = p[0] if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list) else p
        if isinstance(p, str):
            return p
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)

    def _logprobs(self, body: dict, kind: str) -> int | None:
        """The alternatives per token a request asks for: completions ``logprobs`` 0..5, chat ``logprobs`` true
        with ``top_logprobs`` 0..20 (at most the pool's ``max_logprobs``); None when it asks for none."""
        limit = getattr(self.engine, "max_logprobs", None)
        if kind == "completions":
            if body.get("top_logprobs") is not None:
                raise bad("top_logprobs", "a chat field: completions take logprobs (an integer 0-5)")
            if body.get("logprobs") is None:
                return None
            n = _integer(body, "logprobs", None, minimum=0, maximum=MAX_COMPLETION_LOGPROBS)
            name = "logprobs"
        else:
            on, top = body.get("logprobs"), body.get("top_logprobs")
            if not isinstance(on, bool | type(None)):
                raise bad("logprobs", f"expected a boolean, got {_kind(on)}")
            if not on:
                if top is not None:
                    raise bad("top_logprobs", "only allowed with logprobs: true")
                return None
            n = _integer(body, "top_logprobs", 0, minimum=0, maximum=MAX_LOGPROBS)
            name = "top_logprobs"
        if limit is None:
            raise bad("logprobs", "this server computes no log-probabilities (started with --max-logprobs off)",
                      code="unsupported_value")
        if n > limit:
            raise bad(name, f"{n} is more than this server's --max-logprobs ({limit})")
        return n

    def _token_text(self, i: int) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode([i])

    def logprobs_body(self, p: Parsed, lps: list, offset: int = 0) -> dict | None:
        """The ``logprobs`` object of a choice (or of a streamed chunk) for ``lps`` (engine ``TokenLogprob`` s) in
        OpenAI's completions or chat format; ``offset``: the text's characters before these tokens."""
        if p.logprobs is None:
            return None
        if p.kind == "completions":
            tokens = [self._token_text(t.token_id) for t in lps]
            offsets = []
            for tok in tokens:
                offsets.append(offset)
                offset += len(tok)
            return {"tokens": tokens, "token_logprobs": [_finite(t.logprob) for t in lps],
                    "top_logprobs": [{self._token_text(i): _finite(v) for i, v in t.top} for t in lps],
                    "text_offset": offsets}

        def entry(i: int, v: float) -> dict:
            tok = self._token_text(i)
            return {"token": tok, "logprob": _finite(v), "bytes": list(tok.encode("utf-8", "surrogatepass"))}

        return {"content": [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, v) for i, v in t.top]}
                            for t in lps]}

    def prompt_logprobs_body(self, p: Parsed, scored: list, generated: dict | None) -> dict:
        """Completions ``logprobs`` with ``echo``: the prompt's tokens (the first one's logprob and alternatives
        null) and then ``generated``'s (:meth:`logprobs_body` of the completion, its offsets after the prompt)."""
        tokens = [self._token_text(i) for i in p.prompt_ids]
        offsets, offset = [], 0
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        body = {"tokens": tokens,
                "token_logprobs": [None if t is None else _finite(t.logprob) for t in scored],
                "top_logprobs": [None if t is None else {self._token_text(i): _finite(v) for i, v in t.top}
                                 for t in scored],
                "text_offset": offsets}
        if generated is not None:
            shift = len(p.prompt_text)
            for k in ("tokens", "token_logprobs", "top_logprobs"):
                body[k] += generated[k]
            body["text_offset"] += [o + shift for o in generated["text_offset"]]
        return body

    async def score_prompt(self, p: Parsed) -> list:
        """The prompt's :meth:`Engine.score` (awaited; the engine's thread runs it between visits)."""
        try:
            future = self.engine.score(p.prompt_ids, p.logprobs)
        except EngineClosedError as e:
            raise APIError(503, f"the engine admits no new request: {e}", type="server_error",
                           code="shutting_down") from None
        try:
            return await asyncio.wrap_future(future)
        except EngineClosedError as e:
            raise APIError(503, f"the engine closed before scoring the prompt: {e}", type="server_error",
                           code="shutting_down") from None
        except EngineFailure as e:
            raise _failure(e) from None

    def parse_request(self, body: dict, kind: str) -> Parsed:
        """:meth:`parse`, with any failure other than a refusal turned into a 400 (a client's mistake the checks
        did not foresee is still the client's: no 500, no traceback in the log)."""
        try:
            return self.parse(body, kind)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001
            log.debug("request refused: %s: %s", type(e).__name__, e)  # the client's: no traceback
            raise bad(None, f"the request could not be parsed ({type(e).__name__}: {e})",
                      code="invalid_request") from None

    def _admitting(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down and admits no new request", type="server_error",
                           code="shutting_down")

    def submit_all(self, p: Parsed) -> Choices:
        """The request's ``n`` engine requests, queued together or refused together
        (:meth:`~sparkjax.serve.Engine.submit_choices`: choice i with
        :func:`~sparkjax.serve.engine.choice_seed`, the choices sharing the prompt's prefill)."""
        self._admitting()
        try:
            kw = {} if p.logprobs is None else {"logprobs": p.logprobs}
            return Choices(self.engine.submit_choices(
                p.prompt_ids, n=p.n, max_new_tokens=p.max_tokens, temperature=p.temperature, seed=p.seed,
                eos_token_ids=[] if p.ignore_eos else self.eos, stop=p.stop, top_p=p.top_p, top_k=p.top_k, **kw))
        except QueueFullError as e:
            raise APIError(429, f"the request queue is full: {e}; retry later", type="rate_limit_error",
                           code="queue_full") from None
        except EngineClosedError as e:
            raise APIError(503, f"the engine admits no new request: {e}", type="server_error",
                           code="shutting_down") from None
        except ArgumentError as e:
            arg = str(e).split(":", 1)[0].strip()
            raise bad(None, str(e)) if arg not in API_NAMES else APIError(400, str(e), param=API_NAMES[arg]) \
                from None

    # -- endpoints

    async def health(self, request: Request) -> Response:
        if self.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        m = self.engine.metrics()
        return JSONResponse({"status": "ok", "model": self.model, "slots": self.engine.slots,
                             "active_slots": m.get("active_slots"), "queue_length": m.get("queue_length")})

    async def models(self, request: Request) -> Response:
        self.check_key(request)
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model",
                                                         "created": self.created, "owned_by": "sparkjax"}]})

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(prometheus(self.engine.metrics(), self.stats),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def generate(self, request: Request, kind: str) -> Response:
        self.check_key(request)
        p = self.parse_request(await self.read_json(request), kind)
        t0 = time.perf_counter()
        self._admitting()
        scored = await self.score_prompt(p) if p.echo and p.logprobs is not None else None
        rid = ("cmpl-" if kind == "completions" else "chatcmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if p.echo and p.max_tokens == 0:  # the prompt alone: nothing generated
            if p.stream:
                return _SSE(self.echo_events(p, rid, created, scored), media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            lps = None if scored is None else self.prompt_logprobs_body(p, scored, None)
            return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": self.model,
                                 "choices": [{"index": i, "text": p.prompt_text, "logprobs": lps,
                                              "finish_reason": "length"} for i in range(p.n)],
                                 "usage": _usage(len(p.prompt_ids), 0)})
        group = self.submit_all(p)
        watcher = asyncio.ensure_future(_cancel_on_disconnect(request, group))
        chunks = [aiter(r) for r in group.reqs]
        try:
            firsts = await asyncio.gather(*(anext(c) for c in chunks))
        except BaseException as e:
            watcher.cancel()
            group.cancel()
            if isinstance(e, EngineFailure):
                raise _failure(e) from None
            raise
        if any(f.finish_reason == "cancelled" for f in firsts):  # before a first token (shutdown, grace): a status
            watcher.cancel()
            group.cancel()
            raise _cancelled(self.draining)
        self.stats.ttft.add(time.perf_counter() - t0)
        if p.stream:
            return _SSE(self.events(p, rid, created, firsts, chunks, group, watcher, scored),
                        media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        async def collect(first, it) -> list:
            pieces = [first]
            while pieces[-1].finish_reason is None:
                pieces.append(await anext(it))
            return pieces

        try:
            results = await asyncio.gather(*(collect(f, c) for f, c in zip(firsts, chunks, strict=True)))
        except EngineFailure as e:
            raise _failure(e) from None
        finally:
            watcher.cancel()
            group.cancel()  # nothing for the finished ones
        if any(pieces[-1].finish_reason == "cancelled" for pieces in results):
            raise _cancelled(self.draining)
        choices = []
        for i, pieces in enumerate(results):
            text = "".join(c.text for c in pieces)
            if p.echo:
                text = p.prompt_text + text
            out = {"text": text} if kind == "completions" else {"message": {"role": "assistant", "content": text}}
            lps = self.logprobs_body(p, [t for c in pieces for t in (c.logprobs or [])])
            if scored is not None:
                lps = self.prompt_logprobs_body(p, scored, lps)
            choices.append({"index": i, **out, "logprobs": lps, "finish_reason": pieces[-1].finish_reason})
        obj = "text_completion" if kind == "completions" else "chat.completion"
        n_out = sum(len(c.token_ids) for pieces in results for c in pieces)
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": self.model, "choices": choices,
                             "usage": _usage(len(p.prompt_ids), n_out)})

    def echo_event(self, p: Parsed, head: dict, i: int, scored: list | None) -> str:
        """A streamed ``echo``'s first event of choice ``i``: the prompt's text and, with ``logprobs``, its tokens'
        (the first one's null), as the whole response's ``logprobs`` starts."""
        lps = None if scored is None else self.prompt_logprobs_body(p, scored, None)
        usage = {"usage": _usage(len(p.prompt_ids), 0)} if p.continuous_usage else {}
        return _sse({**head, "choices": [{"index": i, "text": p.prompt_text, "logprobs": lps, "finish_reason": None}],
                     **usage})

    async def echo_events(self, p: Parsed, rid: str, created: int, scored: list | None) -> AsyncIterator[str]:
        """The SSE events of a streamed ``echo`` with ``max_tokens`` 0: each choice's prompt, then its end."""
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.model}
        usage = {"usage": _usage(len(p.prompt_ids), 0)}
        for i in range(p.n):
            yield self.echo_event(p, head, i, scored)
            yield _sse({**head, "choices": [{"index": i, "text": "", "logprobs": None, "finish_reason": "length"}],
                        **(usage if p.continuous_usage else {})})
        if p.include_usage:
            yield _sse({**head, "choices": [], **usage})
        yield "data: [DONE]\n\n"

    async def events(self, p: Parsed, rid: str, created: int, firsts: list, chunks: list[AsyncIterator],
                     group: Choices, watcher, scored: list | None = None) -> AsyncIterator[str]:
        """The SSE events of ``p.n`` choices: each chunk names its choice ``index``; the choices' chunks
        interleave as they come; the usage (when asked for) sums the choices' tokens. With ``echo``, each choice
        opens with its prompt (:meth:`echo_event`; ``scored``: the prompt's logprobs)."""
        obj = "text_completion" if p.kind == "completions" else "chat.completion.chunk"
        head = {"id": rid, "object": obj, "created": created, "model": self.model}
        n = len(chunks)
        n_out, finished = [0] * n, [False] * n
        offset = [len(p.prompt_text) if p.echo else 0] * n  # the text before a chunk's tokens

        def event(i: int, delta: str | None, finish: str | None, role: bool = False, lps=None) -> str:
            part = {"text": delta or ""} if p.kind == "completions" else \
                {"delta": {"role": "assistant", "content": ""} if role else ({"content": delta} if delta else {})}
            usage = {"usage": _usage(len(p.prompt_ids), sum(n_out))} if p.continuous_usage else {}
            body = None if lps is None else self.logprobs_body(p, lps, offset[i])
            return _sse({**head, "choices": [{"index": i, **part, "logprobs": body, "finish_reason": finish}],
                         **usage})

        def on_chunk(i: int, c) -> list[str]:
            """The events of choice i's chunk c (None: a cancellation ends the stream)."""
            out = []
            n_out[i] += len(c.token_ids)
            if c.finish_reason == "cancelled":
                return None
            if c.text or (p.logprobs is not None and c.logprobs):  # a token's logprobs go with its chunk
                out.append(event(i, c.text, None, lps=c.logprobs if p.logprobs is not None else None))
                offset[i] += sum(len(self._token_text(t.token_id)) for t in c.logprobs or []) \
                    if p.kind == "completions" and p.logprobs is not None else 0
            if c.finish_reason is not None:
                finished[i] = True
                out.append(event(i, None, c.finish_reason))
            return out

        pending: dict = {}
        try:
            if p.kind == "chat":
                for i in range(n):
                    yield event(i, None, None, role=True)
            if p.echo:
                for i in range(n):
                    yield self.echo_event(p, head, i, scored)
            ready, cancelled = list(enumerate(firsts)), False
            while not cancelled:
                for i, c in ready:
                    events = on_chunk(i, c)
                    if events is None:
                        yield _sse(_cancelled(self.draining).body())
                        cancelled = True
                        break
                    for e in events:
                        yield e
                    if not finished[i]:
                        pending[asyncio.ensure_future(anext(chunks[i]))] = i
                if cancelled:
                    break
                if not pending:
                    if p.include_usage:
                        yield _sse({**head, "choices": [], "usage": _usage(len(p.prompt_ids), sum(n_out))})
                    break
                done, _ = await asyncio.wait({*pending, watcher}, timeout=HEARTBEAT_S,
                                             return_when=asyncio.FIRST_COMPLETED)
                done.discard(watcher)
                if watcher.done() and not done:  # the client left: its requests are cancelled
                    return
                if not done:
                    yield ": keep-alive\n\n"  # a comment: clients skip it; a write to a closed socket fails
                ready = [(pending.pop(f), f.result()) for f in done]
        except EngineFailure as e:
            yield _sse(_failure(e).body())
        finally:
            for f in pending:
                f.cancel()
            watcher.cancel()
            if not all(finished):
                group.cancel()
        yield "data: [DONE]\n\n"


class _SSE(StreamingResponse):
    """A streaming response whose client may leave: a failed send ends the stream quietly (the events' own
    ``finally`` cancels the request)."""

    async def __call__(self, scope, receive, send) -> None:
        async def guarded(message):
            with contextlib.suppress(OSError):
                await send(message)

        try:
            await self.stream_response(guarded)
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()


def _finite(v: float) -> float:
    """A log-probability JSON can carry: -inf (a token top-k / top-p removed) as -9999.0, vLLM's stand-in."""
    return v if math.isfinite(v) else -9999.0


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _failure(e: BaseException) -> APIError:
    cause = e.__cause__ or e
    return APIError(500, f"the engine failed while generating this request ({type(cause).__name__}: {cause}); "
                         f"the server keeps serving", type="server_error", code="engine_failure")


def _cancelled(draining: bool) -> APIError:
    why = "the server is shutting down" if draining else "the request was cancelled"
    return APIError(503, f"{why}; the request was not completed", type="server_error", code="cancelled")


class Choices:
    """The engine requests of one HTTP request's choices, cancelled together."""

    def __init__(self, reqs: list):
        self.reqs = reqs

    def cancel(self) -> None:
        for r in self.reqs:
            r.cancel()


async def _cancel_on_disconnect(request: Request, req) -> None:
    """Cancels ``req`` when the client disconnects (the body has been read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            req.cancel()
            return


def create_app(engine, *, tokenizer, model: str = "sparkjax", eos_token_ids: Sequence[int] | None = None,
               api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               default_temperature: float = 1.0, max_n: int = DEFAULT_MAX_N) -> Starlette:
    """The Starlette app serving a started ``engine`` (:class:`sparkjax.serve.Engine`) as ``model``.

    ``tokenizer`` encodes prompts and chat messages; ``eos_token_ids`` (the pair's, :func:`sparkjax.text.eos_ids`)
    end every generation; ``api_key`` (None: none) is then required as ``Authorization: Bearer KEY`` on every
    ``/v1/*`` request (``/health`` and ``/metrics`` stay open); bodies over ``max_body_bytes`` get a 413;
    ``default_temperature`` applies when a request gives none (OpenAI's default is 1); ``max_n``: the largest ``n``
    (choices) a request may ask for. ``app.state.server`` is
    the :class:`Server` (its ``draining`` flag refuses new requests with a 503)."""
    server = Server(engine, tokenizer=tokenizer, model=model, eos_token_ids=eos_token_ids, api_key=api_key,
                    max_body_bytes=max_body_bytes, default_temperature=default_temperature,
                    vocab_size=getattr(engine, "vocab_size", None), max_n=max_n)

    def route(path: str, fn: Callable, method: str) -> Route:
        async def endpoint(request: Request) -> Response:
            try:
                response = await fn(request)
            except APIError as e:
                response = e.response()
            server.stats.responses[(path, response.status_code)] += 1
            return response

        return Route(path, endpoint, methods=[method])

    async def http_error(request: Request, exc: HTTPException) -> Response:
        server.stats.responses[("other", exc.status_code)] += 1
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}").response()

    async def internal(request: Request, exc: Exception) -> Response:
        log.exception("internal error on %s %s", request.method, request.url.path)
        server.stats.responses[(request.url.path, 500)] += 1
        return APIError(500, f"internal server error ({type(exc).__name__}: {exc})", type="server_error").response()

    app = Starlette(routes=[route("/v1/completions", functools.partial(server.generate, kind="completions"), "POST"),
                            route("/v1/chat/completions", functools.partial(server.generate, kind="chat"), "POST"),
                            route("/v1/models", server.models, "GET"),
                            route("/health", server.health, "GET"),
                            route("/metrics", server.metrics, "GET")],
                    exception_handlers={HTTPException: http_error, Exception: internal})
    app.state.server = server
    return app


# --- /metrics -----------------------------------------------------------------------------------------------------


# the engine's metrics() keys: (Prometheus name, type, label of a dict's keys)
ENGINE_METRICS = {
    "requests": ("sparkjax_requests_total", "counter", "reason"),
    "submitted": ("sparkjax_requests_submitted_total", "counter", None),
    "prompt_tokens": ("sparkjax_prompt_tokens_total", "counter", None),
    "generated_tokens": ("sparkjax_generated_tokens_total", "counter", None),
    "rounds": ("sparkjax_rounds_total", "counter", None),
    "visits": ("sparkjax_host_visits_total", "counter", None),
    "accepted_tokens": ("sparkjax_accepted_tokens_total", "counter", None),
    "tau": ("sparkjax_tau", "gauge", None),
    "verify_sizes": ("sparkjax_verify_rounds_total", "counter", "size"),
    "faults": ("sparkjax_engine_faults_total", "counter", None),
    "prefills": ("sparkjax_prefills_total", "counter", None),
    "prefill_tokens": ("sparkjax_prefill_tokens_total", "counter", None),
    "shared_prefills": ("sparkjax_shared_prefills_total", "counter", None),
    "queue_length": ("sparkjax_queue_length", "gauge", None),
    "active_slots": ("sparkjax_active_slots", "gauge", None),
    "slots": ("sparkjax_slots", "gauge", None),
    "compile_s": ("sparkjax_compile_seconds", "gauge", None),
}


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 2**53 else repr(float(v))


def _histogram(name: str, h: dict) -> list[str]:
    """A histogram's lines from a :meth:`~sparkjax.serve.engine.Histogram.snapshot`."""
    lines = [f"# TYPE {name} histogram"]
    lines += [f'{name}_bucket{{le="{b:g}"}} {n}' for b, n in h["buckets"]]
    return lines + [f'{name}_bucket{{le="+Inf"}} {h["count"]}', f"{name}_sum {h['sum']!r}",
                    f"{name}_count {h['count']}"]


def prometheus(engine_metrics: dict, stats: Stats) -> str:
    """Prometheus text exposition of the engine's :meth:`metrics` (the keys of :data:`ENGINE_METRICS` under their
    names, a dict as one series per key, skipping values that are not finite numbers; ``ttft`` as the histogram
    ``sparkjax_time_to_first_token_seconds``, ``method`` as a label of ``sparkjax_info``), followed by the
    server's own response counts and its time-to-first-token histogram (request received to first token)."""
    m = engine_metrics
    lines = ["# TYPE sparkjax_info gauge", f'sparkjax_info{{method="{_label(m["method"])}"}} 1']
    for key, (name, kind, label) in sorted(ENGINE_METRICS.items()):
        value = m.get(key)
        series = [(k, float(v)) for k, v in (value.items() if isinstance(value, dict) else [(None, value)])
                  if isinstance(v, int | float) and math.isfinite(v)]
        if series:
            lines.append(f"# TYPE {name} {kind}")
            lines += [f'{name}{{{label}="{_label(k)}"}} {_fmt(v)}' if label else f"{name} {_fmt(v)}"
                      for k, v in series]
    spec = m.get("spec_decode")
    if spec is not None:  # vLLM's speculation counters, under our prefix (only for a method that drafts)
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            name = f"sparkjax:spec_decode_{key}_total"
            lines += [f"# TYPE {name} counter", f"{name} {_fmt(spec[key])}"]
        name = "sparkjax:spec_decode_num_accepted_tokens_per_pos_total"
        lines.append(f"# TYPE {name} counter")
        lines += [f'{name}{{position="{pos}"}} {_fmt(n)}'
                  for pos, n in sorted(spec["num_accepted_tokens_per_pos"].items())]
    lines += _histogram("sparkjax_time_to_first_token_seconds", m["ttft"])
    lines.append("# TYPE sparkjax_http_responses_total counter")
    lines += [f'sparkjax_http_responses_total{{path="{_label(path)}",code="{code}"}} {n}'
              for (path, code), n in sorted(stats.responses.items())]
    lines += _histogram("sparkjax_http_time_to_first_token_seconds", stats.ttft.snapshot())
    return "\n".join(lines) + "\n"


def _label(v: Any) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


# --- running it ---------------------------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # another host name, or "" (every address)
        return False


def _uvicorn_server(app: Starlette, host: str, port: int, *, grace_s: float, on_exit: Callable[[], None] | None,
                    access_log: bool, ready: Callable[[str], None] | None):
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn's server, but a signal only starts the graceful shutdown (``on_exit``) and is not raised again
        afterwards, so the process exits 0; ``ready(address)`` once the socket accepts connections."""

        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit and on_exit is not None:
                threading.Thread(target=on_exit, name="sparkjax-serve-drain", daemon=True).start()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            import signal

            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            previous = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, h in previous.items():
                    signal.signal(s, h)

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started and ready is not None:
                bound = port
                with contextlib.suppress(Exception):
                    bound = self.servers[0].sockets[0].getsockname()[1]
                ready(f"http://{host}:{bound}")

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=access_log,
                            timeout_graceful_shutdown=max(1.0, grace_s + 5.0), timeout_keep_alive=KEEP_ALIVE_S,
                            lifespan="off")
    return _Server(config)


def drain(app: Starlette, engine, grace_s: float) -> None:
    """Stops admitting (new requests get 503), lets the engine finish what is in flight within ``grace_s``
    seconds and cancels the rest (their clients get a 503 naming the shutdown)."""
    app.state.server.draining = True
    engine.close(grace_s=grace_s)


def serve(app: Starlette, *, host: str = "127.0.0.1", port: int = 8000, grace_s: float = 30.0,
          access_log: bool = False, ready: Callable[[str], None] | None = None) -> int:
    """Runs ``app`` (from :func:`create_app`) on ``host:port`` until SIGTERM or Ctrl-C, then drains
    (:func:`drain`) and returns 0. ``ready(address)`` is called once the socket accepts connections."""
    engine = app.state.server.engine
    server = _uvicorn_server(app, host, port, grace_s=grace_s, on_exit=lambda: drain(app, engine, grace_s),
                             access_log=access_log, ready=ready)
    server.run()
    if not app.state.server.draining:  # the server ended without a signal (e.g. the port was taken)
        drain(app, engine, 0.0)
    return 0 if server.started else 1


class ServerThread:
    """``app`` served on ``host:port`` from a background thread (tests and benchmarks); ``port=0`` picks a free
    port, read back as :attr:`port` once :meth:`start` returns. :meth:`stop` drains like a signal would."""

    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 0, grace_s: float = 5.0):
        self.app, self.host, self.port, self.grace_s = app, host, port, grace_s
        self._ready = threading.Event()
        self.server = _uvicorn_server(app, host, port, grace_s=grace_s, on_exit=None, access_log=False,
                                      ready=self._started)
        self._thread = threading.Thread(target=self.server.run, name="sparkjax-serve-http", daemon=True)

    def _started(self, address: str) -> None:
        self.port = int(address.rsplit(":", 1)[1])
        self._ready.set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"the server did not start on {self.host}:{self.port} within {timeout} s")
        return self

    def stop(self) -> None:
        drain(self.app, self.app.state.server.engine, self.grace_s)
        self.server.should_exit = True
        self._thread.join(timeout=self.grace_s + 10)
