"""A purpose-built local HTTP server for fault injection and client overhead measurement.

A minimal HTTP/1.1 server on raw asyncio (keep-alive, Content-Length bodies, no
pipelining), so it is cheap enough to measure a client against at thousands of
requests a second, and gives full control over how a request fails.

Routes:
    POST /v1/chat/completions   OpenAI shape; with "return_token_ids": true also the vLLM
                                fields (top-level prompt_token_ids, choices[0].token_ids)
    POST /generate              SGLang shape: text, output_ids, meta_info{finish_reason dict,
                                prompt_tokens, completion_tokens}; with return_logprob also
                                input_token_logprobs / input_top_logprobs (FaultConfig.logprobs)
    GET  /health, /v1/models    200 unless the server is "down"; /v1/models lists `models`
    GET  /stats                 {"requests": n, "outcomes": {outcome: n}, "paths": {path: n},
                                 "auth": {"Bearer" | "Basic" | "none": n}}
    GET  /last                  the last POST body and its headers (lower-cased names)
    POST /control               JSON fields of FaultConfig to change on the fly

Completions are deterministic functions of (prompt, seed): the text is `words` words
drawn from a fixed vocabulary, completion_tokens == number of words, token ids are
vocabulary indices + 100. A request gets a fault when it is among the first `first_k`
requests, or when a draw seeded by (config seed, request body, times this body was seen)
falls under `fraction`, so a retry of the same body draws again, reproducibly.
With `hang_after` N, every request after the first N (counted since start) hangs: a run
against it cannot finish, so a test can act on it mid-run whatever the machine's speed.

A thinking model (`reasoning` = "reasoning" (vLLM 0.3x) or "reasoning_content" (SGLang,
older vLLM)): the first half of the words (at least one) go into message.<that field>, the
rest into content; counts and token ids cover both. A max_tokens cut inside the first half,
or `truncate_in_reasoning` (a cut at a quarter of the words), gives content null and finish
"length". /generate has no parser: its text is "<think>thinking</think>answer", raw.

Hostile modes (a broken or malicious server; tests/test_hostile_server.py):
    usage_negative / usage_huge / usage_bool / usage_string / usage_float / usage_low /
    usage_half  usage.completion_tokens is -n / 10**9 / true / "n" / n.0 / 1 / n // 2
                (text and ids stay true)
    reasoning_number  message.reasoning is a number (a thinking field that is no text)
    usage_zero     usage.completion_tokens is 0 (a non-empty answer)
    ids_mismatch   vLLM fields present but usage.completion_tokens = len(token_ids) // 2
    ids_lie        vLLM / SGLang token ids rotated by one: as many as the count says, but they
                   spell another text (with `tokenizer`, a real one)
                   (/generate: meta_info.completion_tokens likewise)
    error_200      200 with an OpenAI error body and no choices
    sse            200 with a text/event-stream body (a streaming-only server)
    echo           a rotation of 200 error bodies, 200 non-JSON text, 400, 401 and 500, each
                   body echoing the Authorization header (as sent, lower/upper case, base64,
                   URL-encoded, the decoded Basic credentials) and the request target (its
                   query string as sent and decoded), also JSON-escaped as PHP ("\\/") and
                   Java ("\\u003d") write it

In a test:
    with FaultServer(FaultConfig(mode="429", first_k=2)) as srv:
        ...srv.base_url ("http://127.0.0.1:PORT/v1"), srv.stats(), srv.last_body

As a process (the crash tests kill the client; the bench needs a separate core):
    python tests/faultserver.py --port 8123 --mode ok [--latency 0.01] [--die-after 50]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import hashlib
import os
import random
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, fields
from urllib.parse import quote, unquote

import orjson

MODES = ("ok", "429", "500", "400", "reset", "hang", "malformed", "nousage", "down")
BAD_USAGE = {
    "usage_negative": lambda n: -n,
    "usage_huge": lambda n: 10**9,
    "usage_bool": lambda n: True,
    "usage_string": lambda n: str(n),
    "usage_float": lambda n: float(n),
    "usage_low": lambda n: 1,
    "usage_half": lambda n: n // 2,
    "usage_zero": lambda n: 0,
}
MODES += (*BAD_USAGE, "ids_mismatch", "ids_lie", "error_200", "sse", "echo", "reasoning_number")
REASONING_FIELDS = (None, "reasoning", "reasoning_content")
ECHO_KINDS = ("error_200", "text_200", "400", "401", "500")
VOCAB = [
    "the",
    "model",
    "answers",
    "with",
    "a",
    "short",
    "plain",
    "sentence",
    "about",
    "data",
    "tokens",
    "and",
    "budget",
    "drafts",
    "speculative",
    "decoding",
    "target",
    "runs",
    "fast",
    "slow",
    "prompt",
    "reply",
    "server",
    "client",
    "each",
    "word",
    "counts",
    "once",
    "here",
    "more",
]


@dataclass
class FaultConfig:
    """How the server misbehaves. `mode` applies to faulted requests, the rest answer ok."""

    mode: str = "ok"  # one of MODES
    first_k: int | None = None  # fault the first K requests (then answer ok)
    fraction: float = 1.0  # else fault this share of requests (seeded draw); 1.0 = all
    retry_after: str = "1"  # Retry-After header for 429: seconds or an HTTP date
    latency: float = 0.0  # seconds before each answer
    die_after: int | None = None  # answer N requests, then die on the next (exit as a process)
    hang_after: int | None = None  # answer N requests, then never answer another (a stuck server)
    min_words: int = 5
    max_words: int = 60
    seed: int = 0
    reasoning: str | None = None  # one of REASONING_FIELDS: answer as a thinking model
    truncate_in_reasoning: bool = False  # with reasoning: cut inside the thinking ("length")
    # a local tokenizer path: token ids (and counts) are the text's own ids with it, cut at
    # max_tokens (then the text is their decode); not with `reasoning`
    tokenizer: str | None = None
    refuse_tools: bool = False  # a request with "tools" gets 400 (a server without tool calling)
    models: list[str] | None = None  # what GET /v1/models lists (None: an empty list)
    # /generate with "return_logprob": "ok" (meta_info input_token_logprobs and, with
    # top_logprobs_num, input_top_logprobs from logprob_start_len on), "none" (an SGLang
    # that ignores it), "short" (the last position missing)
    logprobs: str = "ok"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"FaultConfig.mode must be one of {MODES}, got {self.mode!r}")
        if not 0 <= self.fraction <= 1:
            raise ValueError(f"FaultConfig.fraction must be in [0, 1], got {self.fraction!r}")
        if not 1 <= self.min_words <= self.max_words:
            raise ValueError(f"FaultConfig words range is bad: {self.min_words}..{self.max_words}")
        if self.reasoning not in REASONING_FIELDS:
            raise ValueError(f"FaultConfig.reasoning must be one of {REASONING_FIELDS}")
        if self.reasoning and self.tokenizer:
            raise ValueError("FaultConfig.tokenizer does not go with reasoning")


def _digest(*parts: object) -> int:
    """Stable 64-bit hash of the parts."""
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def completion_words(prompt_key: object, seed: object, cfg: FaultConfig) -> list[int]:
    """Vocabulary indices of the deterministic completion for (prompt, seed)."""
    rng = random.Random(_digest(prompt_key, seed, cfg.seed))
    n = rng.randint(cfg.min_words, cfg.max_words)
    return [rng.randrange(len(VOCAB)) for _ in range(n)]


def _finish(words: list[int], limit: int | None) -> tuple[list[int], str]:
    """Cut words to the token limit; finish reason "length" when cut, else "stop"."""
    if limit is not None and len(words) > limit:
        return words[:limit], "length"
    return words, "stop"


def _text(words: list[int]) -> str:
    return " ".join(VOCAB[w] for w in words)


def _think(words: list[int], limit: int | None, cfg: FaultConfig):
    """(words kept, finish, thinking words, answer words or None: cut inside the thinking)."""
    half = max(1, len(words) // 2)
    if cfg.truncate_in_reasoning:
        cut = max(1, half // 2)
        limit = cut if limit is None else min(limit, cut)
    kept, finish = _finish(words, limit)
    inside = finish == "length" and len(kept) <= half
    return kept, finish, kept[:half], None if inside else kept[half:]


@functools.lru_cache(maxsize=2)
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _answer(words: list[int], limit: int | None, cfg: FaultConfig) -> tuple[list[int], str, str]:
    """(token ids, text, finish) of an answer without thinking: ids are vocabulary index + 100,
    or with cfg.tokenizer the text's real ids, cut at the limit (the text is then their decode)."""
    if not cfg.tokenizer:
        words, finish = _finish(words, limit)
        return [100 + w for w in words], _text(words), finish
    tok = _tokenizer(cfg.tokenizer)
    ids = tok.encode(_text(words), add_special_tokens=False)
    if limit is not None and len(ids) > limit:
        return ids[:limit], tok.decode(ids[:limit]), "length"
    return ids, _text(words), "stop"


def chat_response(body: dict, cfg: FaultConfig, *, usage: bool = True) -> dict:
    """OpenAI chat.completion for a request body (vLLM token-id fields when asked)."""
    messages = body.get("messages") or []
    prompt_text = " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    words = completion_words(prompt_text, body.get("seed"), cfg)
    message = {"role": "assistant"}
    if cfg.reasoning:
        words, finish, thinking, answer = _think(words, body.get("max_tokens"), cfg)
        message |= {"content": None if answer is None else _text(answer)}
        message[cfg.reasoning] = _text(thinking)
        ids = [100 + w for w in words]
    else:
        ids, message["content"], finish = _answer(words, body.get("max_tokens"), cfg)
    n_prompt = len(prompt_text.split())
    choice = {"index": 0, "message": message, "finish_reason": finish}
    out = {"id": "chatcmpl-fault", "object": "chat.completion", "created": int(time.time())}
    out |= {"model": body.get("model", ""), "choices": [choice]}
    if usage:
        out["usage"] = {
            "prompt_tokens": n_prompt,
            "completion_tokens": len(ids),
            "total_tokens": n_prompt + len(ids),
        }
    if body.get("return_token_ids"):
        out["prompt_token_ids"] = [100 + _digest(w) % 1000 for w in prompt_text.split()]
        choice["token_ids"] = ids
    return out


def generate_response(body: dict, cfg: FaultConfig, *, mismatch: bool = False) -> dict:
    """SGLang /generate answer for a request body with input_ids."""
    ids = body.get("input_ids") or []
    params = body.get("sampling_params") or {}
    words = completion_words(tuple(ids), params.get("sampling_seed"), cfg)
    limit = params.get("max_new_tokens")
    if cfg.reasoning:  # raw text, thinking inline: /generate has no reasoning parser
        words, finish, thinking, answer = _think(words, limit, cfg)
        text = "<think>" + _text(thinking) + ("" if answer is None else "</think>" + _text(answer))
        out_ids = [100 + w for w in words]
    else:
        out_ids, text, finish = _answer(words, limit, cfg)
    reason = (
        {"type": "length", "length": len(out_ids)}
        if finish == "length"
        else {"type": "stop", "matched": 2}
    )
    meta = {"id": "fault", "finish_reason": reason, "prompt_tokens": len(ids)}
    meta["completion_tokens"] = len(out_ids) // 2 if mismatch else len(out_ids)
    if body.get("return_logprob") and cfg.logprobs != "none":
        meta.update(input_logprobs(ids, body, cfg))
    return {"text": text, "output_ids": out_ids, "meta_info": meta}


def input_logprobs(ids: list[int], body: dict, cfg: FaultConfig) -> dict:
    """SGLang's input logprob fields for ids from logprob_start_len on: [logprob, id, None]
    per position (None logprob at position 0), and with top_logprobs_num the top list
    per position. Deterministic: token_logprob(pos, id); the token is its top-1 when
    is_top1(pos, id), else id + 1 is, 0.5 more likely."""
    start = max(0, body.get("logprob_start_len") or 0)
    positions = range(start, len(ids) - (cfg.logprobs == "short"))
    tokens = [[token_logprob(p, ids[p]) if p else None, ids[p], None] for p in positions]
    out: dict = {"input_token_logprobs": tokens}
    if body.get("top_logprobs_num"):
        out["input_top_logprobs"] = [
            None
            if lp is None
            else [[lp, tok, None] if is_top1(p, tok) else [lp + 0.5, tok + 1, None]]
            for p, (lp, tok, _) in zip(positions, tokens, strict=True)
        ]
    return out


def token_logprob(pos: int, token: int) -> float:
    """The fault server's log-probability of token at pos: in [-4.0, -0.5]."""
    return -0.5 - (_digest("lp", pos, token) % 36) / 10


def is_top1(pos: int, token: int) -> bool:
    """Whether the fault server ranks token first at pos (about half the time)."""
    return _digest("top", pos, token) % 2 == 0


def _rotated(ids: list[int]) -> list[int]:
    """The ids rotated by one (as many, another text), plus one when all are alike."""
    out = ids[1:] + ids[:1]
    return [i + 1 for i in out] if out == ids else out


def echo_body(headers: dict) -> bytes:
    """An error body echoing the Authorization header and the request target (a key in the
    query string) in every form a leak could take, JSON-escaped as PHP ("\\/") and Java
    ("\\u003d") encoders write it too."""
    auth = headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    try:
        decoded = base64.b64decode(token).decode() if scheme.lower() == "basic" else ""
    except ValueError:
        decoded = ""
    target = headers.get(":target", "")
    query = unquote(target.partition("?")[2])
    echo = {
        "as_sent": auth,
        "lower": auth.lower(),
        "upper": auth.upper(),
        "token": token,
        "b64": base64.b64encode(auth.encode()).decode(),
        "quoted": quote(token, safe=""),
        "token_b64": base64.b64encode(token.encode()).decode(),
        "decoded": decoded,
        "target": target,
        "query": query,
    }
    out = orjson.dumps(
        {"error": {"message": f"denied for {auth} at {target}", "type": "auth", "echo": echo}}
    )
    php = orjson.dumps(f"{token} {query}").replace(b"/", b"\\/")
    java = orjson.dumps(f"{token} {query}")
    for c in b"=+/":
        java = java.replace(bytes([c]), b"\\u%04x" % c)
    return out[:-2] + b',"php":' + php + b',"java":' + java + b"}}"


def sse_body(body: dict, cfg: FaultConfig) -> bytes:
    """The answer as an event stream (what a streaming-only server sends)."""
    out = chat_response(body, cfg)
    chunk = {
        "id": out["id"],
        "object": "chat.completion.chunk",
        "choices": [
            {"index": 0, "delta": {"content": out["choices"][0]["message"]["content"] or ""}}
        ],
    }
    return b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n"


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 411: "Length Required"}
_REASONS |= {429: "Too Many Requests", 500: "Internal Server Error", 503: "Service Unavailable"}
_REASONS |= {401: "Unauthorized"}


def _http(status: int, body: bytes, extra: str = "", ctype: str = "application/json") -> bytes:
    """Serialize one HTTP/1.1 response."""
    head = f"HTTP/1.1 {status} {_REASONS.get(status, 'X')}\r\nContent-Type: {ctype}\r\n"
    return (head + f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


class _State:
    """What the server has seen; shared by all connections."""

    def __init__(self, cfg: FaultConfig) -> None:
        self.cfg = cfg
        self.requests = 0
        self.outcomes: Counter = Counter()
        self.paths: Counter = Counter()
        self.auth: Counter = Counter()  # Authorization scheme of each POST ("none" without)
        self.seen: Counter = Counter()  # body digest -> times seen
        self.last_body: dict | None = None
        self.last_headers: dict = {}
        self.transports: set = set()
        self.server: asyncio.AbstractServer | None = None
        self.exit_on_die = False
        self.echoes = 0  # echo-mode answers so far (picks the next ECHO_KINDS entry)

    def faulted(self, raw: bytes) -> bool:
        """Whether this request gets the configured fault (deterministic, see module doc)."""
        cfg = self.cfg
        if cfg.mode == "ok":
            return False
        if cfg.first_k is not None:
            return self.requests <= cfg.first_k
        key = _digest(raw)
        self.seen[key] += 1
        return random.Random(_digest(cfg.seed, key, self.seen[key])).random() < cfg.fraction

    def stats(self) -> dict:
        return {
            "requests": self.requests,
            "outcomes": dict(self.outcomes),
            "paths": dict(self.paths),
            "auth": dict(self.auth),
        }


class _Conn(asyncio.Protocol):
    """One client connection: parse requests, answer or misbehave."""

    def __init__(self, state: _State) -> None:
        self.state = state
        self.buf = b""
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.state.transports.add(transport)

    def connection_lost(self, exc) -> None:
        self.state.transports.discard(self.transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1").split("\r\n")
            headers = {}
            for line in head[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            n = int(headers.get("content-length", 0) or 0)
            if len(self.buf) < end + 4 + n:
                return
            body = self.buf[end + 4 : end + 4 + n]
            self.buf = self.buf[end + 4 + n :]
            method, target = head[0].split(" ")[:2]
            headers[":target"] = target  # as sent, query string included (echo mode shows it)
            self.handle(method, target.partition("?")[0], headers, body)

    def send(self, payload: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(payload)

    def handle(self, method: str, path: str, headers: dict, body: bytes) -> None:
        st = self.state
        if path in ("/stats", "/last", "/control"):
            return self.send(_http(200, orjson.dumps(self.admin(path, body))))
        if method == "GET":
            ok = st.cfg.mode != "down" and path in ("/health", "/v1/models", "/v1/health")
            listed = [{"id": m, "object": "model"} for m in st.cfg.models or ()]
            body = orjson.dumps({"object": "list", "data": listed if path == "/v1/models" else []})
            return self.send(_http(200 if ok else 503, body))
        st.requests += 1
        if st.cfg.die_after is not None and st.requests > st.cfg.die_after:
            return _die(st)
        st.paths[path] += 1
        st.auth[headers.get("authorization", "none").partition(" ")[0]] += 1
        try:
            st.last_body, st.last_headers = orjson.loads(body), headers
        except orjson.JSONDecodeError:
            return self.answer("bad_json", _http(400, b'{"error": "bad json"}'))
        if st.cfg.hang_after is not None and st.requests > st.cfg.hang_after:
            return self.answer("hang", None)
        if st.cfg.refuse_tools and isinstance(st.last_body, dict) and "tools" in st.last_body:
            err = b'{"error": {"message": "tool choice requires --enable-auto-tool-choice"}}'
            return self.answer("tools_refused", _http(400, err))
        mode = st.cfg.mode if st.faulted(body) else "ok"
        if mode == "ok" and path not in ("/v1/chat/completions", "/generate"):
            return self.answer("not_found", _http(404, b'{"error": "not found"}'))
        self.respond(mode, path)

    def admin(self, path: str, body: bytes) -> dict:
        st = self.state
        if path == "/stats":
            return st.stats()
        if path == "/last":
            return {"body": st.last_body, "headers": st.last_headers}
        st.cfg = FaultConfig(**(asdict(st.cfg) | orjson.loads(body)))
        return asdict(st.cfg)

    def respond(self, mode: str, path: str) -> None:
        st, body = self.state, self.state.last_body
        if mode in ("echo", "error_200", "sse", "reasoning_number") or mode in BAD_USAGE:
            return self.hostile(mode, path)
        if mode == "hang":
            return self.answer("hang", None)
        if mode == "reset":
            st.outcomes["reset"] += 1
            return self.transport.abort()
        if mode in ("429", "500", "400", "down"):
            extra = f"Retry-After: {st.cfg.retry_after}\r\n" if mode == "429" else ""
            status = 503 if mode == "down" else int(mode)
            return self.answer(mode, _http(status, b'{"error": {"message": "injected"}}', extra))
        if mode == "malformed":
            return self.answer("malformed", _http(200, b'{"choices": [{"mess'))
        if path == "/generate":
            out = generate_response(body, st.cfg, mismatch=mode == "ids_mismatch")
            if mode == "ids_lie":
                out["output_ids"] = _rotated(out["output_ids"])
            outcome = mode if mode in ("ids_mismatch", "ids_lie") else "ok"
            return self.answer(outcome, _http(200, orjson.dumps(out)))
        out = chat_response(body, st.cfg, usage=mode != "nousage")
        if mode == "ids_mismatch" and "token_ids" in out["choices"][0]:
            out["usage"]["completion_tokens"] = len(out["choices"][0]["token_ids"]) // 2
        if mode == "ids_lie" and "token_ids" in out["choices"][0]:
            out["choices"][0]["token_ids"] = _rotated(out["choices"][0]["token_ids"])
        self.answer(mode, _http(200, orjson.dumps(out)))

    def hostile(self, mode: str, path: str) -> None:
        """A broken or malicious answer (see "Hostile modes" in the module docstring)."""
        st, body = self.state, self.state.last_body
        if mode in BAD_USAGE and path == "/generate":  # no output_ids: the count is all there is
            out = generate_response(body, st.cfg)
            meta, _ = out["meta_info"], out.pop("output_ids")
            meta["completion_tokens"] = BAD_USAGE[mode](meta["completion_tokens"])
            return self.answer(mode, _http(200, orjson.dumps(out)))
        if mode in BAD_USAGE:
            out = chat_response(body, st.cfg)
            out["usage"]["completion_tokens"] = BAD_USAGE[mode](out["usage"]["completion_tokens"])
            return self.answer(mode, _http(200, orjson.dumps(out)))
        if mode == "sse":
            return self.answer(mode, _http(200, sse_body(body, st.cfg), ctype="text/event-stream"))
        if mode == "reasoning_number":
            out = chat_response(body, st.cfg)
            out["choices"][0]["message"]["reasoning"] = 12345
            return self.answer(mode, _http(200, orjson.dumps(out)))
        if mode == "error_200":
            err = {"error": {"message": "The model does not exist", "type": "invalid_request"}}
            return self.answer(mode, _http(200, orjson.dumps(err)))
        kind = ECHO_KINDS[st.echoes % len(ECHO_KINDS)]
        st.echoes += 1
        echo = echo_body(st.last_headers)
        if kind == "text_200":
            return self.answer("echo_" + kind, _http(200, b"denied: " + echo, ctype="text/plain"))
        status = 200 if kind == "error_200" else int(kind)
        self.answer("echo_" + kind, _http(status, echo))

    def answer(self, outcome: str, payload: bytes | None) -> None:
        st = self.state
        st.outcomes[outcome] += 1
        if payload is not None:
            if st.cfg.latency > 0:
                asyncio.get_running_loop().call_later(st.cfg.latency, self.send, payload)
            else:
                self.send(payload)


def _die(st: _State) -> None:
    """Stop listening and drop every connection (exit when running as a process)."""
    if st.exit_on_die:
        os._exit(3)
    if st.server is not None:
        st.server.close()
    for t in list(st.transports):
        t.abort()


def free_port() -> int:
    """A TCP port that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FaultServer:
    """The fault server in a background thread; a context manager.

    Args:
        config: FaultConfig (default: mode "ok").
        port: fixed port (default: a free one).

    Example:
        >>> with FaultServer(FaultConfig(mode="500", first_k=1)) as srv:
        ...     srv.base_url
        'http://127.0.0.1:...'
    """

    def __init__(self, config: FaultConfig | None = None, port: int | None = None) -> None:
        self.state = _State(config or FaultConfig())
        self.port = port or free_port()
        self.root_url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.root_url + "/v1"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> FaultServer:
        started = threading.Event()
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._listen())
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("fault server did not start")
        return self

    async def _listen(self) -> None:
        self.state.server = await self._loop.create_server(
            lambda: _Conn(self.state), "127.0.0.1", self.port, reuse_address=True
        )

    def _call(self, fn) -> None:
        fut = asyncio.run_coroutine_threadsafe(_as_coro(fn), self._loop)
        fut.result(10)

    def kill(self) -> None:
        """Stop listening and drop connections, like a dead server (restart() revives it)."""
        self._call(lambda: _die(self.state))

    def restart(self) -> None:
        """Listen again on the same port."""
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)

    def configure(self, **changes) -> None:
        """Change the FaultConfig fields given (validated)."""
        self.state.cfg = FaultConfig(**(asdict(self.state.cfg) | changes))

    def stats(self) -> dict:
        return self.state.stats()

    @property
    def last_body(self) -> dict | None:
        return self.state.last_body

    @property
    def last_headers(self) -> dict:
        return self.state.last_headers

    def stop(self) -> None:
        if self._loop is None:
            return
        self._call(lambda: _die(self.state))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
        self._loop = None

    def __enter__(self) -> FaultServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


async def _as_coro(fn):
    return fn()


async def _serve_forever(cfg: FaultConfig, host: str, port: int) -> None:
    state = _State(cfg)
    state.exit_on_die = True
    loop = asyncio.get_running_loop()
    state.server = await loop.create_server(lambda: _Conn(state), host, port, reuse_address=True)
    print(f"faultserver listening on http://{host}:{port} mode={cfg.mode}", flush=True)
    with contextlib.suppress(asyncio.CancelledError):
        await state.server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    """Run the server as a process (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    for f in fields(FaultConfig):
        kinds = {
            "int | None": int,
            "float": float,
            "int": int,
            "list[str] | None": lambda v: v.split(","),
        }
        kind = kinds.get(str(f.type), str)
        kind = (lambda v: v.lower() in ("1", "true", "yes")) if f.type == "bool" else kind
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default)
    args = vars(p.parse_args(argv))
    host, port = args.pop("host"), args.pop("port")
    asyncio.run(_serve_forever(FaultConfig(**args), host, port))


if __name__ == "__main__":
    sys.exit(main())
