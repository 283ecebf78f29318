"""A purpose-built local HTTP server for fault injection and client overhead measurement.

A minimal HTTP/1.1 server on raw asyncio (keep-alive, Content-Length bodies, no
pipelining), so it is cheap enough to measure a client against at thousands of
requests a second, and gives full control over how a request fails.

Routes:
    POST /v1/chat/completions   OpenAI shape; with "return_token_ids": true also the vLLM
                                fields (top-level prompt_token_ids, choices[0].token_ids)
    POST /generate              SGLang shape: text, output_ids, meta_info{finish_reason dict,
                                prompt_tokens, completion_tokens}; with return_logprob also
                                input_token_logprobs / input_top_logprobs (FaultConfig.logprobs),
                                or with logprob_start_len -1 the output_* ones
    GET  /health, /v1/models    200 unless the server is "down"; /v1/models lists `models`
    GET  /workers               {"workers": [{"url": u}, ...]} from `workers` (a gateway's list)
    GET  /stats                 {"requests": n, "outcomes": {outcome: n}, "paths": {path: n},
                                 "auth": {"Bearer" | "Basic" | "none": n}}
    GET  /last                  the last POST body and its headers (lower-cased names)
    GET  /log                   every request but these admin ones, in order: method, target
                                (query string included), headers received, and what was sent
                                (`sent`: the outcome, or the status of a GET)
    POST /control               JSON fields of FaultConfig to change on the fly

Every answer sent is logged (`sent()`, GET /sent): the outcome, the request body, the
status and the answer's JSON (None when there is none), so a test can count every stored
record against what the server really sent.

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
    post_redirect_loop  every POST is a 302 to itself; GETs are answered (health, models)
    bad_id / bad_prompt_id  the vLLM fields' first id (choices[0].token_ids, or the
                   top-level prompt_token_ids) is `bad_id` (2**32 unless set)
    finish         the answer's finish_reason is `finish` ("abort" unless set: SGLang's)
    content_null   content null, no thinking nor calls, its tokens still counted
    echo           a rotation of 200 error bodies, 200 non-JSON text, 400, 401 and 500, each
                   body echoing the Authorization header (as sent, lower/upper case, base64,
                   URL-encoded, the decoded Basic credentials) and the request target (its
                   query string as sent and decoded), also JSON-escaped as PHP ("\\/") and
                   Java ("\\u003d") write it, and (one in each message, in turn) the token
                   in hex (both cases), base32, reversed and spaced out

Transport modes (a broken HTTP layer; tests/test_transport.py):
    bad_status     a status line that is no HTTP ("HTTP/1.1 OK 200")
    bad_header     a header line without a colon
    huge_header    a 1 MB header value
    bad_length     a Content-Length that is not a number
    short_body     a Content-Length of 10**6, 10 bytes sent, the connection closed
    bad_chunked    a chunk size that is no hex number
    bad_gzip       Content-Encoding: gzip on a body that is not gzip
    endless        a 200 whose chunked JSON body never ends (sent as fast as the client reads)
    endless_error  the same with status 500
    redirect / redirect_307 / redirect_308  301 / 307 / 308 to `redirect_to` + the same path
                   (GET /health, /v1/models and /workers too)
    redirect_loop  302 to the same URL; redirect_invalid  302 to an unparseable URL

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
REDIRECTS = {"redirect": 301, "redirect_307": 307, "redirect_308": 308, "redirect_loop": 302}
REDIRECTS |= {"redirect_invalid": 302}
TRANSPORT = ("bad_status", "bad_header", "huge_header", "bad_length", "short_body")
TRANSPORT += ("bad_chunked", "bad_gzip", "endless", "endless_error")
MODES += (*REDIRECTS, *TRANSPORT)
MODES += ("post_redirect_loop", "bad_id", "bad_prompt_id", "finish", "content_null")
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
    workers: list[str] | None = None  # root URLs GET /workers lists (None: 404, no gateway)
    redirect_to: str | None = None  # the root URL the redirect modes send the client to
    bad_id: int = 2**32  # the id bad_id / bad_prompt_id put first
    finish: str = "abort"  # the finish_reason of mode "finish"
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
        if body.get("logprob_start_len") == -1:  # SGLang's default: the output's only
            meta.update(output_logprobs(len(ids), out_ids))
    return {"text": text, "output_ids": out_ids, "meta_info": meta}


def output_logprobs(start: int, out_ids: list[int]) -> dict:
    """SGLang's output logprob fields, the values input_logprobs gives the same ids at the
    same positions (a prefill and the decode agree here)."""
    tokens = [[token_logprob(start + j, t), t, None] for j, t in enumerate(out_ids)]
    tops = [
        [[lp, t, None] if is_top1(start + j, t) else [lp + 0.5, t + 1, None]]
        for j, (lp, t, _) in enumerate(tokens)
    ]
    return {"output_token_logprobs": tokens, "output_top_logprobs": tops}


def input_logprobs(ids: list[int], body: dict, cfg: FaultConfig) -> dict:
    """SGLang's input logprob fields for ids from logprob_start_len on: [logprob, id, None]
    per position (None logprob at position 0), and with top_logprobs_num the top list
    per position. Deterministic: token_logprob(pos, id); the token is its top-1 when
    is_top1(pos, id), else id + 1 is, 0.5 more likely."""
    start = body.get("logprob_start_len") or 0
    start = len(ids) if start < 0 else start  # -1: no input position
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


ECHO_FORMS = ("hex", "HEX", "b32", "reversed", "spaced")  # one in each message, in turn


def echo_body(headers: dict, turn: int = 0) -> bytes:
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
    encoded = {
        "hex": token.encode().hex(),
        "HEX": token.encode().hex().upper(),
        "b32": base64.b32encode(token.encode()).decode(),
        "reversed": token[::-1],
        "spaced": " ".join(token),
    }
    out = orjson.dumps(
        {
            "error": {
                "message": f"denied for {auth} ({encoded[ECHO_FORMS[turn % 5]]}) at {target}",
                "type": "auth",
                "echo": echo,
            }
        }
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
_REASONS |= {401: "Unauthorized", 301: "Moved Permanently", 302: "Found"}
_REASONS |= {307: "Temporary Redirect", 308: "Permanent Redirect"}


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
        self.log: list[dict] = []  # every request: method, target, headers, what was sent
        self.streaming = self.streaming_peak = 0  # endless bodies being sent now, at most
        self.sent: list[dict] = []  # every answer: outcome, request, status, answer JSON

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
            "streaming_peak": self.streaming_peak,
        }


class _Conn(asyncio.Protocol):
    """One client connection: parse requests, answer or misbehave."""

    def __init__(self, state: _State) -> None:
        self.state = state
        self.buf = b""
        self.transport = None
        self.entry: dict = {}  # the log entry of the request being answered
        self.lost = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.state.transports.add(transport)

    def connection_lost(self, exc) -> None:
        self.lost = True
        self.state.transports.discard(self.transport)
        self.state.streaming -= self.entry.get("sent") in ("endless", "endless_error")

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
        if path in ("/stats", "/last", "/control", "/log", "/sent"):
            return self.send(_http(200, orjson.dumps(self.admin(path, body))))
        self.entry = {"method": method, "target": headers[":target"], "headers": headers}
        st.log.append(self.entry)
        if st.cfg.mode in REDIRECTS:
            return self.redirect(st.cfg.mode, headers[":target"])
        if st.cfg.mode == "post_redirect_loop" and method == "POST":
            st.requests += 1
            return self.answer("post_redirect_loop", _redirect(path))
        if method == "GET":
            return self.get(path)
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
        if mode in TRANSPORT:
            return self.transport_fault(mode)
        if mode == "ok" and path not in ("/v1/chat/completions", "/generate"):
            return self.answer("not_found", _http(404, b'{"error": "not found"}'))
        self.respond(mode, path)

    def get(self, path: str) -> None:
        st = self.state
        if path == "/workers" and st.cfg.workers is not None:
            self.entry["sent"] = 200
            rows = [{"url": u, "model_id": "unknown"} for u in st.cfg.workers]
            return self.send(_http(200, orjson.dumps({"workers": rows})))
        ok = st.cfg.mode != "down" and path in ("/health", "/v1/models", "/v1/health")
        if ok and st.cfg.mode == "endless":
            self.entry["sent"] = "endless"
            return self.endless(200)
        listed = [{"id": m, "object": "model"} for m in st.cfg.models or ()]
        body = orjson.dumps({"object": "list", "data": listed if path == "/v1/models" else []})
        self.entry["sent"] = 200 if ok else 503
        self.send(_http(200 if ok else 503, body))

    def redirect(self, mode: str, target: str) -> None:
        """A redirect of any request (see "Transport modes" in the module docstring)."""
        st = self.state
        st.requests += 1
        where = {"redirect_loop": target, "redirect_invalid": "http://exa mple:99999:1/x"}
        location = where.get(mode, f"{st.cfg.redirect_to}{target}")
        self.answer(mode, _http(REDIRECTS[mode], b"{}", f"Location: {location}\r\n"))

    def transport_fault(self, mode: str) -> None:
        """A broken HTTP layer (see "Transport modes" in the module docstring)."""
        ok = b'{"choices": []}'
        if mode in ("endless", "endless_error"):
            self.state.outcomes[mode] += 1
            self.entry["sent"] = mode
            return self.endless(200 if mode == "endless" else 500)
        payloads = {
            "bad_status": b"HTTP/1.1 OK 200\r\nContent-Length: 2\r\n\r\n{}",
            "bad_header": b"HTTP/1.1 200 OK\r\nno colon here\r\nContent-Length: 2\r\n\r\n{}",
            "huge_header": b"HTTP/1.1 200 OK\r\nX-Big: " + b"x" * 2**20 + b"\r\n\r\n",
            "bad_length": b"HTTP/1.1 200 OK\r\nContent-Length: lots\r\n\r\n{}",
            "short_body": b'HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n{"choices"',
            "bad_chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n",
            "bad_gzip": _http(200, ok, "Content-Encoding: gzip\r\n"),
        }
        self.answer(mode, payloads[mode])
        if mode in ("short_body", "bad_chunked", "huge_header"):
            self.transport.close()

    def endless(self, status: int) -> None:
        """A chunked JSON body that never ends, written as fast as the client reads it."""
        st = self.state
        st.streaming += 1
        st.streaming_peak = max(st.streaming_peak, st.streaming)
        head = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
        self.send((head + "Transfer-Encoding: chunked\r\n\r\n").encode())
        start = b'{"choices": [{"message": {"content": "'
        self.send(b"%x\r\n%s\r\n" % (len(start), start))
        chunk = b"the " * 4096
        frame = b"%x\r\n%s\r\n" % (len(chunk), chunk)
        loop = asyncio.get_running_loop()

        def more() -> None:
            if self.lost or self.transport.is_closing():
                return
            if self.transport.get_write_buffer_size() < 4 * len(frame):
                self.transport.write(frame)
            loop.call_later(0.005, more)

        more()

    def admin(self, path: str, body: bytes) -> dict:
        st = self.state
        if path == "/stats":
            return st.stats()
        if path == "/log":
            return {"log": st.log}
        if path == "/last":
            return {"body": st.last_body, "headers": st.last_headers}
        if path == "/sent":
            return {"sent": st.sent}
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
        if mode == "bad_id" and "token_ids" in out["choices"][0]:
            out["choices"][0]["token_ids"][0] = st.cfg.bad_id
        if mode == "bad_prompt_id" and "prompt_token_ids" in out:
            out["prompt_token_ids"][0] = st.cfg.bad_id
        if mode == "finish":
            out["choices"][0]["finish_reason"] = st.cfg.finish
        if mode == "content_null":
            out["choices"][0]["message"]["content"] = None
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
        echo = echo_body(st.last_headers, st.echoes // len(ECHO_KINDS))
        if kind == "text_200":
            return self.answer("echo_" + kind, _http(200, b"denied: " + echo, ctype="text/plain"))
        status = 200 if kind == "error_200" else int(kind)
        self.answer("echo_" + kind, _http(status, echo))

    def answer(self, outcome: str, payload: bytes | None) -> None:
        st = self.state
        st.outcomes[outcome] += 1
        self.entry["sent"] = outcome
        st.sent.append(_logged(outcome, st.last_body, payload))
        if payload is not None:
            if st.cfg.latency > 0:
                asyncio.get_running_loop().call_later(st.cfg.latency, self.send, payload)
            else:
                self.send(payload)


def _redirect(path: str) -> bytes:
    """A 302 to the same path (a redirect loop)."""
    return _http(302, b"", f"Location: {path}\r\n")


def _logged(outcome: str, request, payload: bytes | None) -> dict:
    """One entry of the sent log: the status and answer JSON of the payload (None: none)."""
    status, answer = None, None
    if payload is not None:
        head, _, body = payload.partition(b"\r\n\r\n")
        parts = head.split(b" ", 2)
        status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
        with contextlib.suppress(orjson.JSONDecodeError):
            answer = orjson.loads(body)
    return {"outcome": outcome, "request": request, "status": status, "answer": answer}


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
            lambda: _Conn(self.state), "127.0.0.1", self.port, reuse_address=True, backlog=4096
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

    def sent(self) -> list[dict]:
        """Every answer sent so far (see the module docstring)."""
        return list(self.state.sent)

    @property
    def log(self) -> list[dict]:
        """Every request seen (see GET /log)."""
        return list(self.state.log)

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
