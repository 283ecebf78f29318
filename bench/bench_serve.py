"""Embedded server engines side by side: start-up, completion tokens/s, RSS, token ids.

For each engine (kit.serve.start(engine=...): `transformers serve` and vLLM's CPU build),
one after the other in the same run on the same model and prompts: start-up time (process
start to a served warm-up completion), then for each concurrency `concurrency * rounds`
chat requests (max_tokens fixed, greedy, the end token allowed) with exactly that many in
flight, completion tokens/s, the server's peak RSS (its whole process group, sampled every
0.2 s) and whether answers carry the server's token ids. Ends with the vllm/transformers
ratio of tokens/s per concurrency. With --url, measures that server only.

    python bench/bench_serve.py [--engines transformers vllm] [--concurrency 1 8 32]
                                [--max-tokens 64] [--rounds 2]
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


IDS = {"seen": 0, "with_ids": 0, "ask": False}  # ask: send return_token_ids (vLLM only)


async def one(session, url, model, i, max_tokens) -> int:
    """Send one chat request; return its completion tokens (and note whether ids came)."""
    messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if IDS["ask"]:  # transformers serve refuses fields it does not know (HTTP 422)
        body["return_token_ids"] = True
    async with session.post(f"{url}/chat/completions", json=body) as response:
        response.raise_for_status()
        data = await response.json()
    IDS["seen"] += 1
    IDS["with_ids"] += isinstance(data["choices"][0].get("token_ids"), list)
    return data["usage"]["completion_tokens"]


class PeakRSS:
    """Samples the summed RSS of a process group every 0.2 s on a thread; .peak_mb."""

    def __init__(self, pgid: int) -> None:
        import threading

        self.pgid, self.peak_mb, self._stop = pgid, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from kit.serve.server import group_pids

        while not self._stop.wait(0.2):
            total = 0
            for pid in group_pids(self.pgid):
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                for line in status.splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
            self.peak_mb = max(self.peak_mb, total / 1024)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_mb


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


def measure(url, model, args) -> dict[int, float]:
    """tokens/s per concurrency against one server, printed as a table."""
    rates = {}
    print(f"{'concurrency':>11} {'requests':>8} {'tokens':>7} {'seconds':>8} {'tok/s':>7}")
    for c in args.concurrency:
        n, tokens, secs = asyncio.run(level(url, model, c, args.rounds, args.max_tokens))
        rates[c] = tokens / secs
        print(f"{c:>11} {n:>8} {tokens:>7} {secs:>8.1f} {rates[c]:>7.1f}", flush=True)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an already running server's base URL (…/v1)")
    parser.add_argument("--model", help="model name for --url")
    parser.add_argument("--engines", nargs="+", default=["transformers", "vllm"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--extra-args", default="", help="more server options (every engine)")
    args = parser.parse_args()
    if args.url is not None:
        measure(args.url, args.model, args)
        return
    from kit.serve import start

    results = {}
    for engine in args.engines:
        t0 = time.perf_counter()
        server = start(
            extra_args=shlex.split(args.extra_args),
            engine=engine,
            timeout=1200,
            temperature=0.0,
            reuse=False,  # its own start is what it times
        )
        startup = time.perf_counter() - t0
        rss = PeakRSS(server.pid)
        IDS.update(seen=0, with_ids=0, ask=server.api == "vllm")
        print(
            f"\n== {engine}: start-up (process to warm-up answer) {startup:.1f} s  {server.base_url}"
        )
        try:
            rates = measure(server.base_url, server.model, args)
        finally:
            peak = rss.stop()
            server.stop()
        ids = f"{IDS['with_ids']}/{IDS['seen']}"
        results[engine] = {"startup": startup, "rates": rates, "rss": peak, "ids": ids}
        print(f"peak RSS {peak:,.0f} MB; answers with token ids {ids}")
    print(
        "\n| engine | start-up s | "
        + " | ".join(f"tok/s @{c}" for c in args.concurrency)
        + " | peak RSS MB | token ids |"
    )
    print("|---" * (4 + len(args.concurrency)) + "|")
    for engine, r in results.items():
        cells = " | ".join(f"{r['rates'][c]:.1f}" for c in args.concurrency)
        print(f"| {engine} | {r['startup']:.0f} | {cells} | {r['rss']:,.0f} | {r['ids']} |")
    if {"transformers", "vllm"} <= set(results):
        ratio = ", ".join(
            f"@{c}: {results['vllm']['rates'][c] / results['transformers']['rates'][c]:.2f}x"
            for c in args.concurrency
        )
        print(f"vllm / transformers tokens/s: {ratio}")


if __name__ == "__main__":
    main()
