"""Kill -9 a real runner process at random points, resume, count every record."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from faultserver import FaultConfig, FaultServer, chat_response

import kit
from kit.run import db, reader
from kit.run.progress import progress
from kit.types import RunConfig

ROOT = Path(__file__).resolve().parents[1]
RUNNER = """
import json, sys
import polars as pl
import kit
args = json.loads(sys.argv[1])
frame = pl.read_parquet(args["prompts"])
kit.generate_sync(frame, kit.RunConfig.from_dict(args["config"]), run_dir=args["run_dir"])
"""
RESUME = """
import asyncio, sys
from kit import resume
asyncio.run(resume(sys.argv[1], timeout=900))
"""
BUDGETS = {"a": 2500, "b": 1500, "c": 3500}
MAX_TOKENS = 40


def _frame() -> pl.DataFrame:
    rows = [
        {
            "dataset": ds,
            "prompt_id": f"{ds}-{i:04d}",
            "messages": [{"role": "user", "content": f"{ds} task {i}"}],
            "n_turns": 1,
            "row": i,
        }
        for ds in BUDGETS
        for i in range(150)
    ]
    return pl.DataFrame(rows)


def _config(url: str, **kw) -> RunConfig:
    base = dict(
        model="fake",
        endpoints=url,
        budgets=BUDGETS,
        concurrency=8,
        retry_base=0.02,
        sampling={"max_tokens": MAX_TOKENS},
    )
    return RunConfig(**(base | kw))


def _spawn(frame_path: Path, run_dir: Path, config: RunConfig) -> subprocess.Popen:
    args = {"prompts": str(frame_path), "run_dir": str(run_dir), "config": config.to_dict()}
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", RUNNER, json.dumps(args)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _count(run_dir: Path) -> int:
    """Committed records (the totals table), 0 before the runner made its database."""
    try:
        with reader.open_db(run_dir) as conn:
            return sum(samples for samples, _, _ in reader.totals(conn).values())
    except (FileNotFoundError, sqlite3.OperationalError):  # not created, or not migrated yet
        return 0


def _records(run_dir: Path) -> dict[tuple, tuple]:
    """Every committed record, read through kit.run.reader: key -> every field of it (the
    prompt's messages included); asserts no key is stored twice."""
    frame = reader.records_frame(run_dir)
    rows = [tuple(tuple(v) if isinstance(v, list) else v for v in row) for row in frame.iter_rows()]
    keys = [row[:3] for row in rows]
    assert len(keys) == len(set(keys)), f"{len(keys) - len(set(keys))} duplicate keys"
    return dict(zip(keys, rows, strict=True))


def _tokens(records: dict[tuple, tuple]) -> dict[str, int]:
    """dataset -> completion tokens of its records."""
    out: dict[str, int] = {}
    at = reader.RECORD_COLUMNS.index("completion_tokens")
    for (ds, _, _), row in records.items():
        out[ds] = out.get(ds, 0) + row[at]
    return out


def _as_answered(run_dir: Path, fault: FaultConfig) -> None:
    """Every record holds what the fault server answered its request (a deterministic
    function of the prompt, the sample's seed and max_tokens): text, finish, count, ids."""
    sampling = reader.read_config(run_dir).sampling
    for rec in reader.records(run_dir):
        seed = None if sampling.seed is None else sampling.seed + rec.sample
        body = {
            "messages": rec.messages,
            "seed": seed,
            "max_tokens": sampling.max_tokens,
            "return_token_ids": True,
        }
        answer = chat_response(body, fault)
        choice = answer["choices"][0]
        got = (rec.completion, rec.finish_reason, rec.completion_tokens)
        assert got == (
            choice["message"]["content"],
            choice["finish_reason"],
            answer["usage"]["completion_tokens"],
        ), rec.key
        assert rec.output_ids is None or rec.output_ids == choice["token_ids"], rec.key


def wait_for(cond, timeout: float = 60.0, what: str = "condition") -> None:
    """Poll cond() until it holds; fail after a generous timeout."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout:g} s")
        time.sleep(0.005)


def _wait_records(proc: subprocess.Popen, run_dir: Path, target: int, timeout: float = 120) -> None:
    """Wait until `target` records are committed; fail if the runner ended before."""
    wait_for(
        lambda: proc.poll() is not None or _count(run_dir) >= target,
        timeout,
        f"{target} committed records",
    )
    assert proc.poll() is None, (
        f"runner ended by itself ({proc.returncode}) before {target} records: "
        + proc.stderr.read().decode()[-2000:]
    )


def _check(run_dir: Path, before: dict, budgets: dict, max_tokens: int, fault=None) -> dict:
    """After the resume: nothing committed lost or changed, no key twice (none even offered
    twice), totals equal the records, budgets held, every record what the server answered."""
    assert db.integrity(run_dir) == []
    after = _records(run_dir)
    lost = [k for k, row in before.items() if after.get(k) != row]
    assert not lost, f"{len(lost)} committed records lost or changed"
    assert reader.state(run_dir, "rejected") is None, "the resume regenerated stored records"
    tokens = _tokens(after)
    with reader.open_db(run_dir) as conn:
        assert {ds: t for ds, (_, t, _) in reader.totals(conn).items()} == tokens
    for ds, budget in budgets.items():
        assert 0 <= tokens[ds] - budget <= max(0.01 * budget, max_tokens), (ds, tokens[ds], budget)
    if fault is not None:
        _as_answered(run_dir, fault)
    return {"before": len(before), "after": len(after)}


@pytest.mark.slow
def test_kill_9_at_random_points(tmp_path):
    """20 runs, each killed with SIGKILL once a random number of records is on disk.

    The fault server answers a random number of requests past that point, then hangs the
    rest: every kill lands in a live run (requests in flight, flushes due) that could not
    have finished, however fast or slow the machine is.
    """
    rng = random.Random(1234)
    frame_path = tmp_path / "prompts.parquet"
    _frame().write_parquet(frame_path)
    stats = {"records_before": 0, "records_after": 0}
    fault = FaultConfig(latency=0.03, min_words=5, max_words=60)
    with FaultServer(fault) as srv:
        for trial in range(20):
            run_dir = tmp_path / f"run{trial}"
            target = rng.randint(1, 150)
            # at most 182 answers of <= 40 tokens: < 7500, the run cannot finish before the kill
            srv.configure(hang_after=srv.stats()["requests"] + target + rng.randint(0, 32))
            proc = _spawn(frame_path, run_dir, _config(srv.base_url))
            try:
                _wait_records(proc, run_dir, target)
            finally:
                proc.send_signal(signal.SIGKILL)  # the crash (or the clean-up of a failed wait)
                proc.wait(60)
            assert db.integrity(run_dir) == [], f"trial {trial}"
            before = _records(run_dir)
            srv.configure(hang_after=None)
            kit.generate_sync(_frame(), _config(srv.base_url), run_dir=run_dir)  # the same call
            got = _check(run_dir, before, BUDGETS, MAX_TOKENS, fault)
            stats["records_before"] += got["before"]
            stats["records_after"] += got["after"]
    print(f"\n20 kill -9 trials, nothing lost, no duplicates: {stats}")


@pytest.mark.server
@pytest.mark.slow
def test_kill_9_against_the_embedded_server(embedded_server, tmp_path):
    frame = kit.load(
        [ROOT / "data/samples/alpaca_tasks.jsonl", ROOT / "data/samples/chat_general.jsonl"]
    ).frame
    frame.write_parquet(tmp_path / "prompts.parquet")
    budgets = dict.fromkeys(frame["dataset"].unique(maintain_order=True).to_list(), 300)
    run_dir = tmp_path / "run"
    config = RunConfig(
        model=embedded_server.model,
        endpoints=embedded_server.base_url,
        budgets=budgets,
        concurrency=8,
        sampling={"max_tokens": 48},
        timeout=900,
    )
    proc = _spawn(tmp_path / "prompts.parquet", run_dir, config)
    try:
        _wait_records(proc, run_dir, target=4, timeout=600)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
    before = _records(run_dir)
    # resume from the run database alone, in a fresh process
    out = subprocess.run(
        [sys.executable, "-c", RESUME, str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = _check(run_dir, before, budgets, 48)
    print(f"\nembedded crash trial: {got}\n{out.stdout}")


@pytest.mark.slow
def test_ctrl_c_stops_cleanly_and_resumes(tmp_path):
    frame_path = tmp_path / "prompts.parquet"
    _frame().write_parquet(frame_path)
    run_dir = tmp_path / "run"
    # 40 answers, then a stuck server: the runner is mid-run, requests in flight, at Ctrl-C
    fault = FaultConfig(latency=0.05, hang_after=40)
    with FaultServer(fault) as srv:
        proc = _spawn(frame_path, run_dir, _config(srv.base_url))
        try:
            _wait_records(proc, run_dir, target=20)
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
        finally:
            proc.send_signal(signal.SIGKILL)  # only when the wait above failed
            proc.wait(60)
        assert "KeyboardInterrupt" in proc.stderr.read().decode()
        before = _records(run_dir)
        status = json.loads(reader.state(run_dir, "status"))
        assert status["finished"]
        assert {d["state"] for d in status["datasets"]} <= {"stopped", "budget_reached"}
        assert sum(d["tokens_done"] for d in status["datasets"]) == sum(_tokens(before).values())
        srv.configure(hang_after=None)
        kit.generate_sync(pl.read_parquet(frame_path), _config(srv.base_url), run_dir=run_dir)
    got = _check(run_dir, before, BUDGETS, MAX_TOKENS, fault)
    assert got["after"] > got["before"]


def _kit(*argv: str, **kw) -> subprocess.Popen:
    """The real `kit` command in a child process."""
    code = "import sys; from kit.cli import main; sys.exit(main(sys.argv[1:]))"
    env = os.environ | {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-c", code, *argv], env=env, cwd=ROOT, **kw)


@pytest.mark.slow
def test_sigterm_stops_kit_generate_cleanly(tmp_path):
    """10 `kill PID` trials at random points: the status always equals the records.

    SIGTERM used to raise KeyboardInterrupt wherever the code was (inside os.fsync in
    store.flush): a write group dropped and the status disagreeing with the records.
    """
    samples = tmp_path / "samples"
    samples.mkdir()
    for ds in ("alpha", "beta"):
        rows = [{"instruction": f"{ds} task {i}", "input": ""} for i in range(400)]
        (samples / f"{ds}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rng = random.Random(7)
    fault = FaultConfig(latency=0.01, min_words=5, max_words=40)
    with FaultServer(fault) as srv:
        plan_dir = tmp_path / "plan"
        plan = _kit(
            "plan",
            "--samples",
            str(samples),
            "--run-dir",
            str(plan_dir),
            "--budget",
            "1000000",
            "--base-url",
            srv.base_url,
            "--model",
            "fake",
            "--max-tokens",
            "40",
            "--concurrency",
            "16",
            "--pilot-per-dataset",
            "4",
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        assert plan.wait(300) == 0, plan.stderr.read().decode()[-2000:]
        for trial in range(10):
            run_dir = tmp_path / f"run{trial}"
            run_dir.mkdir()
            (run_dir / "run.sqlite").write_bytes((plan_dir / "run.sqlite").read_bytes())  # the plan
            proc = _kit(
                "generate",
                "--run-dir",
                str(run_dir),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            try:
                _wait_records(proc, run_dir, target=rng.randint(5, 300))
                time.sleep(rng.random() * 0.05)
                proc.send_signal(signal.SIGTERM)
                code = proc.wait(60)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(60)
            err = proc.stderr.read().decode()
            assert "Traceback" not in err, f"trial {trial}: {err[-2000:]}"
            assert code == 1 and "SIGTERM" in err, f"trial {trial}: exit {code}, {err[-1000:]}"
            assert db.integrity(run_dir) == [], f"trial {trial}"
            stored = _tokens(_records(run_dir))
            status = json.loads(reader.state(run_dir, "status"))
            assert status["finished"], f"trial {trial}"
            assert "SIGTERM" in status["stop_reason"], f"trial {trial}: {status.get('stop_reason')}"
            in_status = {d["dataset"]: d["tokens_done"] for d in status["datasets"]}
            assert in_status == {ds: stored.get(ds, 0) for ds in in_status}, f"trial {trial}"
            _as_answered(run_dir, fault)
            # what `kit watch` shows later: the database's counts and the stop's note
            watched = progress(run_dir)
            assert {p.dataset: p.tokens_done for p in watched} == in_status
            assert all("SIGTERM" in p.note for p in watched if p.state == "stopped")
