"""Two workers, two ways: the SGLang Model Gateway (`smg`) vs kit's own EndpointPool.

In one run, the same budgeted job (two sample datasets, 4 samples a prompt, the same
budgets, sampling and concurrency) goes to the same two vLLM workers twice: once through `smg launch --backend
openai` (kit sees one URL) and once through kit's pool (kit sees both). Each run loses a
worker when a third of the budget is done. Printed per way: completion tokens/s before the
death (both workers) and over the whole run, requests retried, requests failed for good
(errors), recovery (from the death until every request in flight at that moment was
answered), the longest pause in answers after it, and whether every budget held.

A worker "dies" by its relay: each worker is reached through a TCP relay in its own process
(`python bench/bench_fleet.py --relay PORT --to PORT`), SIGKILLed at the death, which
refuses new connections and resets open ones as a dead node would, and started again for
the next way, so the vLLM workers start once (about 2-3 min each here).

    python bench/bench_fleet.py [--budget 3000] [--concurrency 16] [--max-tokens 48]
                                [--rounds 2]          # ABBA: gateway, pool, pool, gateway
                                [--workers URL URL]   # running workers instead of two new
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import kit  # noqa: E402
from kit.serve import gateway  # noqa: E402
from kit.serve.server import free_port  # noqa: E402

DATASETS = ("chat_general", "alpaca_tasks")


# ---------------------------------------------------------------- the relay


async def _pipe(reader, writer) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()


async def _relay(port: int, to: int) -> None:
    async def handle(reader, writer) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", to)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", port, reuse_address=True)
    print("relay up", flush=True)
    await server.serve_forever()


class Relay:
    """127.0.0.1:port -> 127.0.0.1:to in its own process; kill() is the worker's death."""

    def __init__(self, to: int) -> None:
        self.to, self.port, self.proc = to, free_port(), None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> Relay:
        cmd = [sys.executable, __file__, "--relay", str(self.port), "--to", str(self.to)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "relay up"
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


# ---------------------------------------------------------------- one way


async def one_way(name, endpoints, model, relays, args) -> dict:
    """The budgeted job through `endpoints`; relays[1] dies at a third of the budget."""
    loaded = kit.load([str(ROOT / "data" / "samples" / f"{d}.jsonl") for d in DATASETS])
    budgets = dict.fromkeys(DATASETS, args.budget)
    config = kit.RunConfig(
        model=model,
        endpoints=endpoints,
        api="vllm",
        budgets=budgets,
        tokenizer=model,
        sampling=kit.Sampling(max_tokens=args.max_tokens, temperature=0.7, seed=1, n=4),
        concurrency=args.concurrency,
        timeout=600,
    )
    with tempfile.TemporaryDirectory(prefix=f"bench-fleet-{name}-") as tmp:
        t0 = time.time()
        run = await kit.generate(loaded, config, run_dir=Path(tmp) / "run", background=True)
        while run.status().frame["tokens_done"].sum() < len(DATASETS) * args.budget / 3:
            await asyncio.sleep(0.05)
        relays[1].kill()
        death = time.time()
        await run.wait()
        end = time.time()
        report = kit.audit(Path(tmp) / "run")
        progress = run.status().datasets
    return summarize(name, report, progress, t0, death, end, args)


def summarize(name, report, progress, t0, death, end, args) -> dict:
    """The figures of one way from its audit (records' t_done and latency_s) and progress."""
    recs = report.records.select("completion_tokens", "latency_s", "t_done").rows()
    before = sum(n for n, _, t in recs if t <= death)
    hit = [t for n, lat, t in recs if t - lat < death < t]  # in flight at the death
    after = sorted([death] + [t for _, _, t in recs if t > death])
    held = all(
        p.state == "budget_reached" and p.tokens_done <= args.budget + args.max_tokens
        for p in progress
    )
    return {
        "way": name,
        "records": len(recs),
        "tok/s before": before / (death - t0),
        "tok/s run": sum(n for n, _, _ in recs) / (end - t0),
        "retries": sum(p.retries for p in progress),
        "errors": sum(p.errors for p in progress),
        "recovery s": (max(hit) - death) if hit else 0.0,
        "longest pause s": max(b - a for a, b in zip(after, after[1:], strict=False)),
        "budgets held": held,
    }


# ---------------------------------------------------------------- main


def mean_row(rows: list[dict]) -> dict:
    """The mean of each numeric figure over the runs of one way."""
    return {
        k: sum(r[k] for r in rows) / len(rows)
        for k, v in rows[0].items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def start_workers() -> list:
    """Two embedded vLLM workers, started side by side."""
    from kit.serve import start

    out: list = [None, None]

    def one(i: int) -> None:
        out[i] = start(engine="vllm", reuse=False)  # two servers, never a shared one

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if None in out:
        for s in out:
            if s is not None:
                s.stop()
        raise SystemExit("a vLLM worker did not start (see data/models/logs/)")
    return out


async def main_async(args) -> list[dict]:
    own = [] if args.workers else start_workers()
    urls = args.workers or [s.base_url for s in own]
    ports = [int(u.rstrip("/").removesuffix("/v1").rsplit(":", 1)[1]) for u in urls]
    model = args.model or (own[0].model if own else None)
    rows = []
    try:
        for name in ("gateway", "pool", "pool", "gateway")[: 2 * args.rounds]:  # ABBA
            relays = [Relay(p).start() for p in ports]
            try:
                if name == "gateway":
                    with gateway.start([r.url for r in relays]) as gw:
                        rows.append(await one_way(name, [gw.base_url], model, relays, args))
                else:
                    rows.append(await one_way(name, [r.url for r in relays], model, relays, args))
            finally:
                for r in relays:
                    r.kill()
    finally:
        for s in own:
            s.stop()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=int, default=3000, help="completion tokens per dataset")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument(
        "--rounds", type=int, default=2, help="ABBA: 1 = gateway, pool; 2 = + pool, gateway"
    )
    p.add_argument("--workers", nargs=2, help="two running vLLM workers' base URLs")
    p.add_argument("--model", help="the workers' model name (default: the embedded model's)")
    p.add_argument("--relay", type=int, help=argparse.SUPPRESS)
    p.add_argument("--to", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.relay:
        with __import__("contextlib").suppress(KeyboardInterrupt):
            asyncio.run(_relay(args.relay, args.to))
        return
    if args.workers and not args.model:
        from kit.serve import prepare_model

        args.model = str(prepare_model())
    rows = asyncio.run(main_async(args))
    print(
        f"\nbudget {args.budget} x {len(DATASETS)} datasets, concurrency {args.concurrency}, "
        f"max_tokens {args.max_tokens}; one of two workers dies at a third of the budget"
    )
    keys = list(rows[0])
    print("  ".join(f"{k:>15}" for k in keys))
    for r in rows:
        print(
            "  ".join(f"{v:>15.1f}" if isinstance(v, float) else f"{v!s:>15}" for v in r.values())
        )
    g, q = (mean_row([r for r in rows if r["way"] == way]) for way in ("gateway", "pool"))
    print(
        f"means: recovery gateway {g['recovery s']:.1f} s, pool {q['recovery s']:.1f} s; "
        f"errors {g['errors']:.0f} / {q['errors']:.0f}; retries {g['retries']:.1f} / {q['retries']:.1f}"
    )
    print(
        f"gateway/pool tokens/s before the death: {g['tok/s before'] / q['tok/s before']:.2f}x; "
        f"over the run: {g['tok/s run'] / q['tok/s run']:.2f}x"
    )


if __name__ == "__main__":
    main()
