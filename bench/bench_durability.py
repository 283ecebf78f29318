"""Durable records: what the run database costs, and what a kill -9 loses.

Part A: requests/s of `kit.generate` writing every record into run.sqlite (committed in
batches, synchronous=FULL) against a raw aiohttp loop that keeps nothing, on the
zero-latency fault server (tests/faultserver.py) in its own process; best of interleaved
rounds, and the ratio (goal >= 0.7x).

Part B: `kit.generate` in a child process against the fault server (a little latency, so
the run lasts), SIGKILLed at a random moment, again and again. Every record the runner took
in is announced on a pipe before it is buffered, so after the kill
    lost = taken in - committed   (goal: at most one batch, max(32, concurrency))
    duplicated = stored keys - distinct keys, and refused inserts on resume (goal: 0)
and a resume finishes the run with every prompt answered once.

    python bench/bench_durability.py [--requests 5000] [--concurrency 256] [--kills 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_client import _prompt_frame, case_generate, case_raw, measure  # noqa: E402
from faultserver import free_port  # noqa: E402

CHILD = """
import json, sys
import kit
from kit.run import store
args = json.loads(sys.argv[1])
out = open(sys.stdout.fileno(), "w", buffering=1, closefd=False)
append = store.RunStore.append

def announced(self, record):  # the runner took it in: say so before it is buffered
    out.write(f"{record.prompt_id}\\n")
    append(self, record)

store.RunStore.append = announced
frame = kit.load(args["prompts"]).frame
kit.generate_sync(frame, kit.RunConfig.from_dict(args["config"]), run_dir=args["run_dir"])
"""


def start_server(port: int, latency: float) -> subprocess.Popen:
    cmd = [
        sys.executable,
        str(ROOT / "tests" / "faultserver.py"),
        "--port",
        str(port),
        "--mode",
        "ok",
        "--latency",
        str(latency),
        "--max-words",
        "32",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()  # "faultserver listening on ..."
    return proc


# ---------------------------------------------------------------- part A


def part_a(args) -> None:
    port = free_port()
    server = start_server(port, 0.0)
    try:
        url = f"http://127.0.0.1:{port}/v1"
        asyncio.run(case_raw(url, 200, 32))  # warm-up, imports, the frame outside the timing
        _prompt_frame(args.requests)
        asyncio.run(case_generate(url, 200, 32))
        best = {"raw aiohttp": 0.0, "kit.generate (durable)": 0.0}
        cases = {"raw aiohttp": case_raw, "kit.generate (durable)": case_generate}
        for _ in range(args.repeat):
            for name, case in cases.items():
                rate, _, _ = measure(case, url, args.requests, args.concurrency, server.pid)
                best[name] = max(best[name], rate)
        raw = best["raw aiohttp"]
        print(
            f"part A: {args.requests} requests, {args.concurrency} in flight, best of {args.repeat} interleaved rounds"
        )
        for name, rate in best.items():
            print(f"  {name:<24}{rate:>8.0f} req/s  {rate / raw:.2f}x raw")
        print("  goal: kit.generate >= 0.70x raw")
    finally:
        server.terminate()
        server.wait(10)


# ---------------------------------------------------------------- part B


def _committed(run_dir: Path) -> list[tuple]:
    path = run_dir / "run.sqlite"
    if not path.exists():
        return []
    conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT dataset, prompt_id, sample FROM records").fetchall()
    except sqlite3.OperationalError:  # not migrated yet
        return []
    finally:
        conn.close()


def _one_kill(work: Path, trial: int, url: str, args, rng: random.Random) -> dict:
    import kit

    run_dir = work / f"run{trial}"
    config = kit.RunConfig(
        model="m",
        endpoints=url,
        budgets={"bench": 10**9},
        sampling={"max_tokens": 32},
        concurrency=args.kill_concurrency,
    )
    spec = {
        "prompts": str(work / "bench.jsonl"),
        "run_dir": str(run_dir),
        "config": config.to_dict(),
    }
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(spec)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not _committed(run_dir) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(rng.random() * args.kill_window)  # a random moment of a live run
    proc.send_signal(signal.SIGKILL)
    proc.wait(60)
    taken = set(proc.stdout.read().split())
    keys = _committed(run_dir)
    committed = {pid for _, pid, _ in keys}
    row = {"taken": len(taken), "committed": len(keys), "lost": len(taken - committed)}
    row["duplicated"] = len(keys) - len(set(keys))
    row["ended_by_itself"] = proc.returncode != -signal.SIGKILL
    frame = kit.load(work / "bench.jsonl").frame
    kit.generate_sync(frame, config, run_dir=run_dir)  # the resume: the same call
    keys = _committed(run_dir)
    conn = sqlite3.connect(run_dir / "run.sqlite")
    rejected = conn.execute("SELECT value FROM state WHERE key = 'rejected'").fetchone()
    conn.close()
    row["after_resume"], row["distinct_after"] = len(keys), len(set(keys))
    row["refused_on_resume"] = int(rejected[0]) if rejected else 0
    return row


def part_b(args) -> None:
    work = Path(tempfile.mkdtemp(prefix="kit-durability-"))
    with open(work / "bench.jsonl", "w") as f:
        for i in range(args.kill_prompts):
            f.write(json.dumps({"instruction": f"bench task {i}", "input": ""}) + "\n")
    port = free_port()
    server = start_server(port, args.latency)
    rng = random.Random(args.seed)
    batch = max(32, args.kill_concurrency)
    rows = []
    try:
        url = f"http://127.0.0.1:{port}/v1"
        print(
            f"part B: {args.kills} kill -9s of kit.generate ({args.kill_prompts} prompts, {args.kill_concurrency} in flight, server latency {args.latency} s, batch {batch})"
        )
        print(
            f"  {'trial':>5}{'taken in':>10}{'committed':>11}{'lost':>6}{'dup':>5}{'after resume':>14}{'refused':>9}"
        )
        for trial in range(args.kills):
            r = _one_kill(work, trial, url, args, rng)
            rows.append(r)
            note = "  (ended before the kill)" if r["ended_by_itself"] else ""
            print(
                f"  {trial:>5}{r['taken']:>10}{r['committed']:>11}{r['lost']:>6}{r['duplicated']:>5}{r['after_resume']:>14}{r['refused_on_resume']:>9}{note}",
                flush=True,
            )
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    worst = max(r["lost"] for r in rows)
    dups = sum(
        r["duplicated"] + r["refused_on_resume"] + r["after_resume"] - r["distinct_after"]
        for r in rows
    )
    whole = all(r["distinct_after"] == args.kill_prompts for r in rows)
    print(
        f"  most lost in one kill: {worst} (goal <= {batch}); duplicated: {dups} (goal 0); every resume complete: {whole}"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="durable records vs a raw loop; kill -9 losses")
    p.add_argument("--requests", type=int, default=5000, help="part A: requests per case and round")
    p.add_argument("--concurrency", type=int, default=256, help="part A: requests in flight")
    p.add_argument("--repeat", type=int, default=3, help="part A: interleaved rounds")
    p.add_argument("--kills", type=int, default=10, help="part B: kill -9 trials")
    p.add_argument("--kill-prompts", type=int, default=3000)
    p.add_argument("--kill-concurrency", type=int, default=64)
    p.add_argument("--kill-window", type=float, default=2.0, help="kill within this many s")
    p.add_argument("--latency", type=float, default=0.01, help="part B: server latency (s)")
    p.add_argument("--seed", type=int, default=22)
    p.add_argument("--part", choices=["a", "b", "both"], default="both")
    args = p.parse_args(argv)
    if args.part in ("a", "both"):
        part_a(args)
    if args.part in ("b", "both"):
        part_b(args)
    print(f"({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end)")


if __name__ == "__main__":
    main()
