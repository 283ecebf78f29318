"""Client overhead: requests/s of kit's backend+pool path against a raw aiohttp loop.

The zero-latency fault server (tests/faultserver.py, raw asyncio) runs in its own
process so client and server do not share a GIL. Each case sends the same requests at
each concurrency; the table gives requests/s, the ratio to the raw loop, and the server
process's CPU share: near 100% means the server, not the client, set the pace.

    python bench/bench_client.py [--requests 10000] [--concurrency 256 1024]
    python bench/bench_client.py --pairs 11     # raw vs kit.generate, median of 11 pairs

`--pairs N` runs N back-to-back (raw aiohttp, kit.generate) pairs per concurrency, in
alternating order, and prints each pair's ratio with the median and range: on a machine
shared with other work, a pair's two runs see the same load, so the median of pair ratios
is the figure to quote.

"kit.generate" is the whole runner: a synthetic prompt frame of n distinct prompts in one
dataset with a budget every prompt fits in, a fresh run directory on disk (records are
written and fsynced in groups, status.json once a second), pool start-up and shutdown all
inside the timing. Goal: >= 0.7x the raw loop's requests/s.

Adding a case: write `async def case_x(url, n, concurrency) -> None` that sends n
requests with at most `concurrency` in flight, and add it to CASES.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from faultserver import free_port  # noqa: E402

from kit.run.backends import OpenAIChat  # noqa: E402
from kit.run.pool import EndpointPool  # noqa: E402
from kit.types import RunConfig, Sampling  # noqa: E402

MESSAGES = [{"role": "user", "content": "Say something short about speculative decoding."}]
SAMPLING = Sampling(max_tokens=32, temperature=0.0)


async def _bounded(n: int, concurrency: int, one) -> None:
    """Run one() n times with at most `concurrency` in flight."""
    sem = asyncio.Semaphore(concurrency)

    async def run() -> None:
        async with sem:
            await one()

    await asyncio.gather(*(run() for _ in range(n)))


async def case_raw(url: str, n: int, concurrency: int) -> None:
    """The baseline: semaphore + session.post + json, nothing else."""
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 32, "temperature": 0.0}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one() -> None:
            async with session.post(
                url + "/chat/completions",
                data=orjson.dumps(body),
                headers={"Content-Type": "application/json"},
            ) as r:
                orjson.loads(await r.read())["choices"][0]["message"]["content"]

        await _bounded(n, concurrency, one)


async def case_kit(url: str, n: int, concurrency: int) -> None:
    """kit's path: EndpointPool.acquire + OpenAIChat.complete + report."""
    pool = EndpointPool([OpenAIChat(url, "m")])
    await pool.start()

    async def one() -> None:
        async with pool.acquire() as backend:
            await backend.complete(MESSAGES, SAMPLING, timeout=60)
            pool.report(backend, True)

    try:
        await _bounded(n, concurrency, one)
    finally:
        await pool.aclose()


async def case_openai(url: str, n: int, concurrency: int) -> None:
    """The openai package's AsyncOpenAI, default transport."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)

    async def one() -> None:
        await client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=32, temperature=0.0
        )

    try:
        await _bounded(n, concurrency, one)
    finally:
        await client.close()


_FRAMES: dict = {}  # n -> prompt frame (built once, outside the timing)
RUNS_ROOT = Path(tempfile.gettempdir())  # run directories go under here (a real disk: fsync counts)


def _prompt_frame(n: int):
    """A prompt frame (kit.types columns) of n distinct one-turn prompts in dataset "bench"."""
    if n not in _FRAMES:
        import polars as pl

        from kit.data.sources import MESSAGE_TYPE, prompt_id

        msgs = [[{"role": "user", "content": f"{MESSAGES[0]['content']} (#{i})"}] for i in range(n)]
        _FRAMES[n] = pl.DataFrame(
            {
                "dataset": ["bench"] * n,
                "prompt_id": [prompt_id(m) for m in msgs],
                "messages": msgs,
                "n_turns": [1] * n,
                "row": list(range(n)),
            },
            schema_overrides={"messages": MESSAGE_TYPE},
        )
    return _FRAMES[n]


async def case_generate(url: str, n: int, concurrency: int) -> None:
    """The full runner: kit.generate over n prompts into a fresh run directory."""
    from kit.run.generate import generate

    frame = _prompt_frame(n)
    config = RunConfig(
        model="m",
        endpoints=url,
        budgets=n * SAMPLING.max_tokens * 2,
        sampling=SAMPLING,
        concurrency=concurrency,
        max_attempts=1,
    )
    run_dir = Path(tempfile.mkdtemp(prefix="kit-bench-", dir=RUNS_ROOT))
    try:
        run = await generate(frame, config, run_dir=run_dir / "run")
        done = run.summary()["samples_done"].sum()
        if done != n or run.stop_reason is not None:
            raise RuntimeError(f"kit.generate wrote {done} of {n} records ({run.stop_reason})")
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


CASES = {
    "raw aiohttp": case_raw,
    "kit pool+backend": case_kit,
    "kit.generate": case_generate,
    "openai AsyncOpenAI": case_openai,
}


def _cpu_seconds(pid: int) -> float:
    """User+system CPU seconds of a process (Linux /proc)."""
    parts = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def _start_server(port: int) -> subprocess.Popen:
    cmd = [
        sys.executable,
        str(ROOT / "tests" / "faultserver.py"),
        "--port",
        str(port),
        "--mode",
        "ok",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()  # "faultserver listening on ..."
    return proc


def measure(case, url: str, n: int, concurrency: int, pid: int) -> tuple[float, float, float]:
    """(requests/s, client CPU share, server CPU share) of one case."""
    cpu0, own0, t0 = _cpu_seconds(pid), time.process_time(), time.perf_counter()
    asyncio.run(case(url, n, concurrency))
    wall = time.perf_counter() - t0
    return n / wall, (time.process_time() - own0) / wall, (_cpu_seconds(pid) - cpu0) / wall


SLOW = {"openai AsyncOpenAI": 1000}  # case -> max requests (slow cases need fewer to measure)
HEADER = ("case", "in flight", "req/s", "x raw", "cpu us/req", "x raw", "client CPU", "server CPU")


def run_table(url: str, pid: int, args) -> None:
    """One row per (concurrency, case): best of args.repeat interleaved rounds.

    "cpu us/req" is the client's CPU time per request: on a contended machine it compares
    the paths more fairly than wall-clock requests/s. Both ratios are raw / case, so
    higher is better and 1.00 means "as cheap as the raw loop".
    """
    print("{:<20}{:>10}{:>8}{:>7}{:>12}{:>7}{:>12}{:>12}".format(*HEADER))
    for conc in args.concurrency:
        rate: dict[str, float] = {}
        cpu_us: dict[str, float] = {}
        share: dict[str, tuple[float, float]] = {}
        for _ in range(args.repeat):
            for name in args.cases:
                n = min(args.requests, SLOW.get(name, args.requests))
                r, own, srv = measure(CASES[name], url, n, conc, pid)
                if r > rate.get(name, 0):
                    rate[name], share[name] = r, (own, srv)
                cpu_us[name] = min(cpu_us.get(name, 1e18), own * 1e6 / r)
        raw_rate, raw_cpu = rate.get("raw aiohttp"), cpu_us.get("raw aiohttp")
        for name in rate:
            x_rate = f"{rate[name] / raw_rate:.2f}" if raw_rate else "-"
            x_cpu = f"{raw_cpu / cpu_us[name]:.2f}" if raw_cpu else "-"
            own, srv = share[name]
            print(
                f"{name:<20}{conc:>10}{rate[name]:>8.0f}{x_rate:>7}{cpu_us[name]:>12.0f}"
                f"{x_cpu:>7}{own:>11.0%}{srv:>11.0%}",
                flush=True,
            )


def run_pairs(url: str, pid: int, args) -> None:
    """args.pairs (raw, kit.generate) pairs per concurrency, order alternating (ABBA...):
    each pair's ratio of requests/s (and of client CPU per request, raw / kit), then the
    median and the range of each."""
    for conc in args.concurrency:
        rates, cpus = [], []
        for i in range(args.pairs):
            order = ["raw aiohttp", "kit.generate"][:: 1 if i % 2 == 0 else -1]
            got = {name: measure(CASES[name], url, args.requests, conc, pid) for name in order}
            (raw, raw_own, _), (kit, kit_own, _) = got["raw aiohttp"], got["kit.generate"]
            rates.append(kit / raw)
            cpus.append((raw_own / raw) / (kit_own / kit))
            print(
                f"in flight {conc:>5}  pair {i + 1:>2}: raw {raw:>6.0f} req/s, kit.generate "
                f"{kit:>6.0f} req/s = {rates[-1]:.2f}x (cpu/req {cpus[-1]:.2f}x)",
                flush=True,
            )
        for what, xs in (("req/s", rates), ("cpu/req", cpus)):
            print(
                f"in flight {conc:>5}  kit.generate / raw {what} over {len(xs)} pairs: median "
                f"{statistics.median(xs):.2f}x, range {min(xs):.2f}-{max(xs):.2f}x",
                flush=True,
            )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="kit client overhead vs a raw aiohttp loop")
    p.add_argument("--requests", type=int, default=5000, help="requests per case and round")
    p.add_argument("--concurrency", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--repeat", type=int, default=3, help="interleaved rounds; the best is shown")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument(
        "--pairs",
        type=int,
        default=0,
        help="instead of the table: N (raw, kit.generate) pairs, median ratio",
    )
    args = p.parse_args(argv)
    port = free_port()
    server = _start_server(port)
    try:
        url = f"http://127.0.0.1:{port}/v1"
        asyncio.run(case_raw(url, 200, 32))  # warm-up
        if args.pairs or "kit.generate" in args.cases:  # imports; the frame outside the timing
            _prompt_frame(args.requests)
            asyncio.run(case_generate(url, 200, 32))
        print("zero-latency fault server (raw asyncio) in its own process")
        if args.pairs:
            print(f"{args.requests} requests per run, {args.pairs} pairs per concurrency")
            run_pairs(url, server.pid, args)
        else:
            print(
                f"up to {args.requests} requests per row, best of {args.repeat} interleaved rounds;"
            )
            run_table(url, server.pid, args)
        print("goal: kit.generate >= 0.70x raw aiohttp req/s at each concurrency")
        print("caveat: server CPU near 100% means the fault server set that row's pace; client")
        print("CPU well under 100% means the machine was contended by other work")
        print(f"({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end).")
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
