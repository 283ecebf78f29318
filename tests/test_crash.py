"""Kill -9 a real runner process at random points, resume, count every record."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from faultserver import FaultConfig, FaultServer

import kit
from kit.types import Sampling

ROOT = Path(__file__).resolve().parents[1]
RUNNER = """
import json, sys
import polars as pl
import kit
from kit.types import Sampling
args = json.loads(sys.argv[1])
frame = pl.read_parquet(args.pop("prompts"))
args["sampling"] = Sampling(**args["sampling"])
kit.generate_sync(frame, **args)
"""
BUDGETS = {"a": 2500, "b": 1500, "c": 3500}
MAX_TOKENS = 40


def _frame() -> pl.DataFrame:
    rows = [
        {"dataset": ds, "prompt_id": f"{ds}-{i:04d}", "messages": [{"role": "user", "content": f"{ds} task {i}"}], "n_turns": 1, "row": i}
        for ds in BUDGETS
        for i in range(150)
    ]  # fmt: skip
    return pl.DataFrame(rows)


def _spawn(args: dict) -> subprocess.Popen:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", RUNNER, json.dumps(args)], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip


def _lines(run_dir: Path) -> tuple[list[bytes], int]:
    """Complete record lines of every file, and how many files end in a torn line."""
    lines, torn = [], 0
    for path in sorted((run_dir / "records").glob("*.jsonl")):
        data = path.read_bytes()
        cut = data.rfind(b"\n") + 1
        torn += cut < len(data)
        lines += data[:cut].splitlines()
    return lines, torn


def _kill_when(proc: subprocess.Popen, run_dir: Path, target: int, timeout: float = 60) -> None:
    """kill -9 once `target` complete record lines exist (or the process ends by itself)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if (run_dir / "records").exists() and len(_lines(run_dir)[0]) >= target:
            break
        time.sleep(0.005)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)


def _check(run_dir: Path, before: list[bytes], budgets: dict, max_tokens: int) -> dict:
    """After the resume: nothing acknowledged lost, no duplicate keys, budgets held."""
    after, torn = _lines(run_dir)
    assert torn == 0
    lost = set(before) - set(after)
    keys = [tuple(json.loads(x)[k] for k in ("dataset", "prompt_id", "sample")) for x in after]
    totals = {}
    for line in after:
        row = json.loads(line)
        totals[row["dataset"]] = totals.get(row["dataset"], 0) + row["completion_tokens"]
    for ds, budget in budgets.items():
        assert 0 <= totals[ds] - budget <= max(0.01 * budget, max_tokens), (ds, totals[ds], budget)
    assert not lost and len(keys) == len(set(keys))
    return {
        "before": len(before),
        "after": len(after),
        "lost": len(lost),
        "dups": len(keys) - len(set(keys)),
    }


def test_kill_9_at_random_points(tmp_path):
    rng = random.Random(1234)
    frame_path = tmp_path / "prompts.parquet"
    _frame().write_parquet(frame_path)
    stats = {
        "trials": 0,
        "mid_run_kills": 0,
        "torn_tails": 0,
        "lost": 0,
        "dups": 0,
        "records_before": 0,
    }
    with FaultServer(FaultConfig(latency=0.03, min_words=5, max_words=60)) as srv:
        for trial in range(20):
            run_dir = tmp_path / f"run{trial}"
            args = {"prompts": str(frame_path), "run_dir": str(run_dir), "model": "fake",
                    "endpoints": srv.base_url, "budgets": BUDGETS, "concurrency": 8, "retry_base": 0.02,
                    "sampling": {"max_tokens": MAX_TOKENS}}  # fmt: skip
            proc = _spawn(args)
            _kill_when(proc, run_dir, target=rng.randint(1, 200))
            time.sleep(rng.random() * 0.02)
            before, torn = _lines(run_dir)
            stats["mid_run_kills"] += proc.returncode == -signal.SIGKILL
            stats["torn_tails"] += torn
            resume = args | {"sampling": Sampling(max_tokens=MAX_TOKENS)}
            kit.generate_sync(
                pl.read_parquet(resume.pop("prompts")), **resume
            )  # the same call again
            got = _check(run_dir, before, BUDGETS, MAX_TOKENS)
            stats["trials"] += 1
            stats["lost"] += got["lost"]
            stats["dups"] += got["dups"]
            stats["records_before"] += got["before"]
    print(f"\ncrash trials: {stats}")
    assert stats["trials"] == 20 and stats["lost"] == 0 and stats["dups"] == 0
    assert stats["mid_run_kills"] >= 15  # the kills did land mid-run


@pytest.mark.server
def test_kill_9_against_the_embedded_server(embedded_server, tmp_path):
    frame = kit.load(
        [ROOT / "data/samples/alpaca_tasks.jsonl", ROOT / "data/samples/chat_general.jsonl"]
    ).frame
    frame.write_parquet(tmp_path / "prompts.parquet")
    budgets = dict.fromkeys(frame["dataset"].unique(maintain_order=True).to_list(), 300)
    run_dir = tmp_path / "run"
    args = {"prompts": str(tmp_path / "prompts.parquet"), "run_dir": str(run_dir), "model": embedded_server.model,
            "endpoints": embedded_server.base_url, "budgets": budgets, "concurrency": 8,
            "sampling": {"max_tokens": 48}, "timeout": 900}  # fmt: skip
    proc = _spawn(args)
    _kill_when(proc, run_dir, target=4, timeout=180)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    before, _ = _lines(run_dir)
    # resume through the module's own entry point, from run_dir/config.json alone
    out = subprocess.run([sys.executable, "-m", "kit.generate", str(run_dir), "--timeout", "900"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env=os.environ | {"PYTHONPATH": str(ROOT)})  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    got = _check(run_dir, before, budgets, 48)
    print(f"\nembedded crash trial: {got}\n{out.stdout}")
    assert got["before"] >= 4


def test_ctrl_c_stops_cleanly_and_resumes(tmp_path):
    frame_path = tmp_path / "prompts.parquet"
    _frame().write_parquet(frame_path)
    run_dir = tmp_path / "run"
    with FaultServer(FaultConfig(latency=0.05, min_words=5, max_words=60)) as srv:
        args = {"prompts": str(frame_path), "run_dir": str(run_dir), "model": "fake", "endpoints": srv.base_url,
                "budgets": BUDGETS, "concurrency": 8, "retry_base": 0.02, "sampling": {"max_tokens": MAX_TOKENS}}  # fmt: skip
        proc = _spawn(args)
        deadline = time.monotonic() + 60
        while len(_lines(run_dir)[0]) < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
        assert "KeyboardInterrupt" in proc.stderr.read().decode()
        before, torn = _lines(run_dir)
        status = json.loads((run_dir / "status.json").read_text())
        assert (
            torn == 0
            and status["finished"]
            and {d["state"] for d in status["datasets"]} <= {"stopped", "budget_reached"}
        )
        assert sum(d["tokens_done"] for d in status["datasets"]) == sum(
            json.loads(x)["completion_tokens"] for x in before
        )
        resume = args | {"sampling": Sampling(max_tokens=MAX_TOKENS)}
        kit.generate_sync(pl.read_parquet(resume.pop("prompts")), **resume)
    got = _check(run_dir, before, BUDGETS, MAX_TOKENS)
    assert got["after"] > got["before"] >= 20
