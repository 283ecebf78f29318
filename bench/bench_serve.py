"""Embedded server throughput: completion tokens/s at several concurrencies.

Starts the embedded server (kit.serve.start) unless --url is given, then for each
concurrency sends `concurrency * rounds` chat requests (max_tokens fixed) with exactly
that many in flight, and prints start-up time, requests, completion tokens and tokens/s.

    python bench/bench_serve.py [--concurrency 1 8 32] [--max-tokens 64] [--rounds 2]
                                [--extra-args "--cb-max-batch-tokens 512"]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "Give three tips for learning to cook.",
    "What causes the seasons on Earth?",
    "Describe a busy market in the morning.",
    "How do I reverse a list in Python?",
]


async def one(session, url, model, i, max_tokens) -> int:
    """Send one chat request; return its completion tokens."""
    messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens}
    async with session.post(f"{url}/chat/completions", json=body) as response:
        response.raise_for_status()
        return (await response.json())["usage"]["completion_tokens"]


async def level(url, model, concurrency, rounds, max_tokens) -> tuple[int, int, float]:
    """Run concurrency*rounds requests, concurrency in flight; return (requests, tokens, seconds)."""
    n = concurrency * rounds
    queue = iter(range(n))
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def worker() -> int:
            return sum([await one(session, url, model, i, max_tokens) for i in queue])

        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(worker() for _ in range(concurrency))))
        return n, tokens, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an already running server's base URL (…/v1)")
    parser.add_argument("--model", help="model name for --url")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--extra-args", default="", help="more `transformers serve` options")
    args = parser.parse_args()
    server = None
    if args.url is None:
        from kit.serve import start

        t0 = time.perf_counter()
        server = start(extra_args=shlex.split(args.extra_args))
        print(f"start-up (health + warm-up): {time.perf_counter() - t0:.1f} s  {server.base_url}")
    url, model = (args.url, args.model) if server is None else (server.base_url, server.model)
    try:
        print(f"{'concurrency':>11} {'requests':>8} {'tokens':>7} {'seconds':>8} {'tok/s':>7}")
        for c in args.concurrency:
            n, tokens, secs = asyncio.run(level(url, model, c, args.rounds, args.max_tokens))
            print(f"{c:>11} {n:>8} {tokens:>7} {secs:>8.1f} {tokens / secs:>7.1f}")
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
