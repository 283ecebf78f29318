"""Fake OpenAI-compatible endpoints and synthetic datasets for bench/bench_scale.py.

Eight datasets, each with its own lognormal completion length (a long tail, cut at
max_tokens: finish "length", else "stop"). A prompt carries its dataset and index in the
first message ("[chat_short] 17. ..."), so an endpoint knows which distribution to draw
from and which prompt it answered. Texts are words of VOCAB, each a single token for the
SmolLM2 tokenizer with or without a leading space (check_vocab), so a completion of n
words re-tokenizes to n tokens and usage.completion_tokens = n is exact.

Everything is a deterministic function of (prompt, seed): `completion(messages, seed,
max_tokens)` gives what an endpoint answers, so bench_scale.py can write a run directory
directly with the same records the runner would have written.

An endpoint is a raw asyncio HTTP server (tests/faultserver.py's connection parser) in its
own process, with a small random latency per answer:

    POST /v1/chat/completions   the completion (usage: prompt words, completion words)
    GET  /health, /v1/models    200
    GET  /stats                 {"requests", "first_t" (time.time() of the first request
                                 since start or the last /reset), "tokens"}
    GET  /answered              {dataset: [prompt index, ...]} one entry per answer
    POST /reset                 forget requests, first_t and answers

    python bench/fleet.py --port 8123 [--latency-ms 5]      # one endpoint
    with Fleet(4) as fleet: fleet.urls                        # four, each its own process
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import random
import subprocess
import sys
import time
import urllib.request
from array import array
from collections import defaultdict
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from faultserver import _Conn, _http, free_port  # noqa: E402

TOKENIZER = ROOT / "data" / "models" / "SmolLM2-135M-Instruct"
MAX_TOKENS = 4096
# dataset -> (median completion tokens, lognormal sigma); tool_calls prompts carry tools
DATASETS = {
    "chat_short": (150, 0.6),
    "tool_calls": (180, 0.7),
    "qa": (200, 0.8),
    "summarize": (250, 0.6),
    "chat_long": (300, 0.7),
    "code": (500, 0.8),
    "math": (700, 0.9),
    "reasoning": (1500, 1.0),
}
TOOLS_DATASET = "tool_calls"
VOCAB = """the model answers with a short plain sentence about data tokens and budget target
runs fast slow prompt reply server client each word counts once here more time people year way
day thing man world life hand part child eye woman place work week case point number group
problem fact good new first last long great little own other old right big high different small
large next early young important few public bad same able be have do say get make go know take
see come think look want give use find tell ask feel try leave call keep let begin show play run
move live hold write sit stand pay include continue set learn change lead understand watch
follow stop create read allow add grow open walk win offer remember love consider buy wait send
expect build stay fall cut reach water house system program question government company story
student country school state family night area money book job business issue side kind head home
service friend father power hour game line end member law car city community name president team
minute idea kid body information back parent face others level office door health person art
history party result reason research girl moment air teacher force education step value list
table index file function code class method object string array loop test error output input
query answer proof sum product graph tree node edge path key map order sort search count total
average rate price cost plan design layer weight train batch loss""".split()
_CORPUS_WORDS = 1 << 20  # a fixed random word stream; texts are slices of it
_MAX_SLICE = 8192  # the longest text slice (words)
_TOOL_DEFS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ')} for the user",
            "parameters": {
                "type": "object",
                "properties": {
                    arg: {"type": "string", "description": f"the {arg}"} for arg in args
                },
                "required": list(args[:1]),
            },
        },
    }
    for name, args in [
        ("get_weather", ("city", "unit")),
        ("search_docs", ("query", "limit")),
        ("run_code", ("language", "source")),
        ("send_email", ("to", "subject", "body")),
        ("lookup_price", ("item", "currency")),
    ]
]

_corpus: tuple[str, array] | None = None


def corpus() -> tuple[str, array]:
    """(text, word start offsets): a seeded stream of VOCAB words, built once per process."""
    global _corpus
    if _corpus is None:
        rng = random.Random(1234)
        words = rng.choices(VOCAB, k=_CORPUS_WORDS + 1)
        text = " ".join(words)
        starts, pos = array("q"), 0
        for w in words:
            starts.append(pos)
            pos += len(w) + 1
        _corpus = (text, starts)
    return _corpus


def words(offset: int, n: int) -> str:
    """n corpus words from word `offset` (0 <= offset, n <= _MAX_SLICE), space-separated.

    Example: len(words(10, 5).split()) -> 5
    """
    text, starts = corpus()
    offset %= _CORPUS_WORDS - _MAX_SLICE
    return text[starts[offset] : starts[offset + n] - 1] if n else ""


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def prompt(dataset: str, index: int) -> tuple[list[dict], str | None]:
    """(messages, tools JSON text or None) of prompt `index` of a dataset: 1-3 messages
    (user; system + user; user + assistant + user) of 50-400 words in all; the first
    message starts "[dataset] index." (what an endpoint reads back, see dataset_of).

    Example: prompt("qa", 3)[0][0]["content"].startswith("[qa] 3.") -> True
    """
    rng = random.Random(_digest(f"{dataset}:{index}"))
    total = rng.randint(50, 400)
    shape = rng.choices(
        [("user",), ("system", "user"), ("user", "assistant", "user")], weights=[6, 2, 2]
    )[0]
    cuts = sorted(rng.sample(range(1, total), len(shape) - 1)) if len(shape) > 1 else []
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
    messages = [
        {"role": role, "content": words(rng.randrange(_CORPUS_WORDS), k)}
        for role, k in zip(shape, sizes, strict=True)
    ]
    messages[0]["content"] = f"[{dataset}] {index}. " + messages[0]["content"]
    tools = None
    if dataset == TOOLS_DATASET:
        chosen = rng.sample(_TOOL_DEFS, rng.randint(1, 3))
        tools = json.dumps(chosen, separators=(",", ":"))
    return messages, tools


def dataset_of(messages: list[dict]) -> tuple[str, int]:
    """(dataset, prompt index) from the first message's "[dataset] index." tag."""
    head = messages[0]["content"][:80]
    name, _, rest = head[1:].partition("] ")
    return name, int(rest.partition(".")[0])


def length(messages: list[dict], seed) -> int:
    """The uncut completion length (tokens) of a prompt: lognormal per dataset, >= 1."""
    median, sigma = DATASETS[dataset_of(messages)[0]]
    rng = random.Random(_digest(_key(messages, seed)))
    return max(1, round(median * math.exp(sigma * rng.gauss(0.0, 1.0))))


def _key(messages: list[dict], seed) -> str:
    return "\x00".join(m["content"] for m in messages) + f"\x00{seed}"


def completion(messages: list[dict], seed, max_tokens: int | None) -> tuple[str, int, str]:
    """(text, tokens, finish_reason) an endpoint answers to these messages and seed.

    Example: completion(prompt("qa", 0)[0], None, 4)[1:] -> (4, 'length') when the drawn
    length is over 4 tokens.
    """
    key = _key(messages, seed)
    n = length(messages, seed)
    limit = min(max_tokens or _MAX_SLICE, _MAX_SLICE)
    finish = "length" if n > limit else "stop"
    n = min(n, limit)
    return words(_digest(key + "\x01text"), n), n, finish


def mean_length(dataset: str, max_tokens: int = MAX_TOKENS, draws: int = 20_000) -> float:
    """The mean completion tokens of a dataset after the max_tokens cut (seeded Monte Carlo)."""
    median, sigma = DATASETS[dataset]
    rng = random.Random(7)
    total = sum(
        min(max_tokens, max(1, round(median * math.exp(sigma * rng.gauss(0, 1)))))
        for _ in range(draws)
    )
    return total / draws


def check_vocab(tokenizer=TOKENIZER) -> list[str]:
    """Problems with VOCAB for the tokenizer: words that are not one token (bare and after
    a space), a text of n words that does not re-tokenize to n tokens; [] when none."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer) / "tokenizer.json"))
    problems = [
        w
        for w in VOCAB
        if any(len(tok.encode(x, add_special_tokens=False).ids) != 1 for x in (w, " " + w))
    ]
    for i in range(20):
        text = words(i * 9973, 50 + 200 * i)
        got = len(tok.encode(text, add_special_tokens=False).ids)
        if got != len(text.split()):
            problems.append(f"text of {len(text.split())} words is {got} tokens")
    return problems


# ---------------------------------------------------------------- the endpoint


class _State:
    """What one endpoint has seen."""

    def __init__(self, latency_ms: float) -> None:
        self.latency = latency_ms / 1000
        self.transports: set = set()
        self.reset()

    def reset(self) -> None:
        self.requests, self.tokens, self.first_t = 0, 0, None
        self.answered: dict[str, list[int]] = defaultdict(list)


class _FleetConn(_Conn):
    """faultserver's HTTP parsing; answers from `completion`."""

    def handle(self, method: str, path: str, headers: dict, body: bytes) -> None:
        st = self.state
        if path == "/stats":
            doc = {"requests": st.requests, "first_t": st.first_t, "tokens": st.tokens}
            return self.send(_http(200, orjson.dumps(doc)))
        if path == "/answered":
            return self.send(_http(200, orjson.dumps(st.answered)))
        if path == "/reset":
            st.reset()
            return self.send(_http(200, b"{}"))
        if method == "GET":
            return self.send(_http(200, b'{"data": []}'))
        if path != "/v1/chat/completions":
            return self.send(_http(404, b'{"error": "not found"}'))
        if st.first_t is None:
            st.first_t = time.time()
        st.requests += 1
        req = orjson.loads(body)
        messages = req["messages"]
        text, n, finish = completion(messages, req.get("seed"), req.get("max_tokens"))
        name, index = dataset_of(messages)
        st.answered[name].append(index)
        st.tokens += n
        n_prompt = sum(len(m["content"].split()) + 4 for m in messages)
        out = {
            "id": "chatcmpl-fleet",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.get("model", ""),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": finish,
                }
            ],
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": n,
                "total_tokens": n_prompt + n,
            },
        }
        payload = _http(200, orjson.dumps(out))
        delay = random.uniform(0, st.latency)
        if delay > 0:
            asyncio.get_running_loop().call_later(delay, self.send, payload)
        else:
            self.send(payload)


async def _serve(port: int, latency_ms: float) -> None:
    corpus()
    state = _State(latency_ms)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _FleetConn(state), "127.0.0.1", port, reuse_address=True
    )
    print(f"fleet endpoint listening on http://127.0.0.1:{port}", flush=True)
    await server.serve_forever()


class Fleet:
    """k endpoints, each its own process; a context manager.

    Example:
        with Fleet(4, latency_ms=5) as fleet:
            config = kit.RunConfig(model="m", endpoints=fleet.urls, ...)
            fleet.stats()   # [{"requests", "first_t", "tokens"}, ...] per endpoint
    """

    def __init__(self, k: int = 4, latency_ms: float = 5.0) -> None:
        self.ports = [free_port() for _ in range(k)]
        self.urls = [f"http://127.0.0.1:{p}/v1" for p in self.ports]
        self.latency_ms = latency_ms
        self.procs: list[subprocess.Popen] = []

    def start(self) -> Fleet:
        for port in self.ports:
            cmd = [
                sys.executable,
                __file__,
                "--port",
                str(port),
                "--latency-ms",
                str(self.latency_ms),
            ]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
            self.procs.append(proc)
        for proc in self.procs:
            if not proc.stdout.readline():
                raise RuntimeError("a fleet endpoint did not start")
        return self

    def _get(self, url: str, path: str, method: str = "GET"):
        root = url.removesuffix("/v1")
        req = urllib.request.Request(
            root + path, method=method, data=b"{}" if method == "POST" else None
        )
        with urllib.request.urlopen(req, timeout=60) as r:  # noqa: S310 - our own local server
            return orjson.loads(r.read())

    def stats(self) -> list[dict]:
        return [self._get(u, "/stats") for u in self.urls]

    def answered(self) -> dict[str, list[int]]:
        """dataset -> prompt indices answered, over every endpoint (one entry per answer)."""
        out: dict[str, list[int]] = defaultdict(list)
        for u in self.urls:
            for name, idx in self._get(u, "/answered").items():
                out[name] += idx
        return dict(out)

    def reset(self) -> None:
        for u in self.urls:
            self._get(u, "/reset", "POST")

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(10)
        self.procs = []

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="one fake OpenAI-compatible endpoint (bench_scale)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--latency-ms", type=float, default=5.0, help="answers wait U(0, this) ms")
    args = p.parse_args(argv)
    try:
        asyncio.run(_serve(args.port, args.latency_ms))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
