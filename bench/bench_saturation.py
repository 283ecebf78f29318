"""Saturation: completion tokens/s of kit.generate against a raw aiohttp loop, same server.

One embedded server (kit.serve.start, greedy: the continuous-batching server fixes its
sampling at warm-up, so temperature 0 makes both paths do the same work) answers two
clients in one run: a raw aiohttp loop (semaphore + session.post + orjson) and the full
runner kit.generate (scheduler, pool, retries, crash-safe store in a fresh run directory).
Both send the same prompts from data/samples, in the same order, with the same body
fields, max_tokens and concurrency. Passes run in ABBA order (raw, kit, kit, raw, ...)
so that a linear drift of the shared machine cancels out of the sums; an unmeasured raw
pass first warms the server up (its first pass is much slower). The server is the
bottleneck here, so the goal is kit >= 0.95x raw in completion tokens/s.

    python bench/bench_saturation.py [--prompts 160] [--max-tokens 64] [--concurrency 32]
                                     [--rounds 1] [--url URL --model NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DATASET = "saturation"  # every prompt goes into one dataset so kit's order is one seeded shuffle
SEED = 0
TIMEOUT = 900.0  # per request, both clients: a loaded machine queues requests in the server


def prompt_frame(n: int):
    """n distinct prompts drawn (seeded) from data/samples, all in dataset DATASET."""
    import polars as pl

    from kit.data.sources import load

    frame = load(ROOT / "data" / "samples").frame.unique(subset="prompt_id", keep="first")
    if frame.height < n:
        raise ValueError(f"--prompts {n}: data/samples holds only {frame.height} distinct prompts")
    frame = frame.sort("dataset", "prompt_id").sample(n, seed=SEED)
    return frame.with_columns(pl.lit(DATASET).alias("dataset"))


def kit_order(frame) -> list[list[dict]]:
    """The messages in the order kit's runner sends them (seeded shuffle of sorted ids)."""
    part = frame.sort("prompt_id")
    rows = list(zip(part["prompt_id"].to_list(), part["messages"].to_list(), strict=True))
    random.Random(f"{SEED}:{DATASET}").shuffle(rows)
    return [messages for _, messages in rows]


async def run_raw(url: str, model: str, prompts: list, max_tokens: int, conc: int) -> int:
    """The baseline: the same request bodies as kit.run.backends.OpenAIChat; returns tokens."""
    sem = asyncio.Semaphore(conc)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=TIMEOUT)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(messages) -> int:
            body = {
                "model": model,
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "top_p": 1.0,
            }
            async with sem:
                async with session.post(
                    url + "/chat/completions",
                    data=orjson.dumps(body),
                    headers={"Content-Type": "application/json"},
                ) as r:
                    data = orjson.loads(await r.read())
            if r.status != 200:
                raise RuntimeError(f"raw request failed: {r.status} {data}")
            return data["usage"]["completion_tokens"]

        return sum(await asyncio.gather(*(one(m) for m in prompts)))


async def run_kit(url: str, model: str, frame, max_tokens: int, conc: int) -> int:
    """kit.generate into a fresh run directory; returns completion tokens written."""
    from kit.run.generate import generate
    from kit.types import RunConfig, Sampling

    config = RunConfig(
        model=model,
        endpoints=url,
        budgets={DATASET: frame.height * max_tokens * 4},
        sampling=Sampling(max_tokens=max_tokens, temperature=0.0),
        concurrency=conc,
        seed=SEED,
        max_attempts=1,
        timeout=TIMEOUT,
    )
    run_dir = Path(tempfile.mkdtemp(prefix="kit-saturation-"))
    try:
        run = await generate(frame, config, run_dir=run_dir / "run")
        summary = run.summary()
        done = summary["samples_done"].sum()
        if done != frame.height or run.stop_reason is not None:
            raise RuntimeError(f"kit.generate wrote {done} of {frame.height} ({run.stop_reason})")
        return int(summary["tokens_done"].sum())
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def timed(coro) -> tuple[int, float]:
    """(completion tokens, seconds) of one pass."""
    t0 = time.perf_counter()
    tokens = asyncio.run(coro)
    return tokens, time.perf_counter() - t0


def passes(url: str, model: str, frame, args) -> dict[str, list[tuple[int, float]]]:
    """ABBA passes: per client, a list of (tokens, seconds); prints each pass as it ends."""
    prompts = kit_order(frame)
    clients = {
        "raw": lambda: run_raw(url, model, prompts, args.max_tokens, args.concurrency),
        "kit": lambda: run_kit(url, model, frame, args.max_tokens, args.concurrency),
    }
    out: dict[str, list] = {"raw": [], "kit": []}
    for r in range(args.rounds):
        for name in ("raw", "kit", "kit", "raw") if r % 2 == 0 else ("kit", "raw", "raw", "kit"):
            tokens, secs = timed(clients[name]())
            out[name].append((tokens, secs))
            load = os.getloadavg()[0]
            print(
                f"{name:<4}{frame.height:>8}{tokens:>8}{secs:>9.1f}{tokens / secs:>8.1f}"
                f"{load:>7.1f}",
                flush=True,
            )
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=160, help="prompts per pass")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1, help="ABBA rounds (4 passes each)")
    p.add_argument("--url", help="an already running server's base URL (.../v1); must be greedy")
    p.add_argument("--model", help="model name for --url")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run `finally`: stop the server
    frame = prompt_frame(args.prompts)
    server = None
    if args.url is None:
        from kit.serve.server import start

        t0 = time.perf_counter()
        server = start(temperature=0.0)
        print(f"embedded server up in {time.perf_counter() - t0:.0f} s (greedy), {server.base_url}")
    url, model = (args.url, args.model) if server is None else (server.base_url, server.model)
    try:
        tokens, secs = timed(
            run_raw(url, model, kit_order(frame), args.max_tokens, args.concurrency)
        )
        print(f"warm-up pass (raw, not counted): {tokens} tokens in {secs:.1f} s")
        print(
            f"{args.prompts} prompts a pass, max_tokens {args.max_tokens}, "
            f"concurrency {args.concurrency}, ABBA order"
        )
        print(f"{'pass':<4}{'prompts':>8}{'tokens':>8}{'seconds':>9}{'tok/s':>8}{'load':>7}")
        out = passes(url, model, frame, args)
    finally:
        if server is not None:
            server.stop()
    rate = {k: sum(t for t, _ in v) / sum(s for _, s in v) for k, v in out.items()}
    print(f"raw aiohttp   {rate['raw']:.1f} completion tok/s")
    print(f"kit.generate  {rate['kit']:.1f} completion tok/s")
    print(f"kit / raw     {rate['kit'] / rate['raw']:.3f}  (goal >= 0.95)")
    secs = [s for v in out.values() for _, s in v]
    if max(secs) > 1.25 * min(secs):
        print(
            f"warning: pass times ranged {min(secs):.1f}-{max(secs):.1f} s for the same work: the "
            "server's pace varied more than any client difference; rerun on a quieter machine"
        )
    print(f"({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end)")


if __name__ == "__main__":
    main()
