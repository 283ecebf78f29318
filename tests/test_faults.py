"""Run-level faults: 429, 5xx, resets, hangs, malformed answers, dead servers, a full disk."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from faultserver import FaultConfig, FaultServer

import kit
from kit.run.db import integrity
from kit.run.reader import errors_frame as read_errors
from kit.run.reader import records_frame
from kit.types import RunConfig, Sampling

ROOT = Path(__file__).resolve().parents[1]


def prompts(n: int, datasets=("a",)) -> pl.DataFrame:
    rows = [
        {
            "dataset": ds,
            "prompt_id": f"{ds}-{i:04d}",
            "messages": [{"role": "user", "content": f"{ds} item {i}"}],
            "n_turns": 1,
            "row": i,
        }
        for ds in datasets
        for i in range(n)
    ]
    return pl.DataFrame(rows)


def config(url, **kw) -> RunConfig:
    base = dict(
        model="fake",
        endpoints=url,
        budgets={"a": 1_000_000},
        sampling=Sampling(max_tokens=40),
        concurrency=8,
        retry_base=0.02,
    )
    return RunConfig(**(base | kw))


def lines_ok(run_dir: Path) -> int:
    """The database is sound, every record reads back whole and keys are unique; the count."""
    assert integrity(run_dir) == []
    f = records_frame(run_dir, prompts=False)
    assert not f.select("dataset", "prompt_id", "sample").is_duplicated().any()
    return f.height


def test_429_honours_retry_after(tmp_path):
    run_dir = tmp_path / "run"
    with FaultServer(FaultConfig(mode="429", first_k=3, retry_after="1")) as srv:
        t0 = time.monotonic()
        run = kit.generate_sync(prompts(10), config(srv.base_url, concurrency=2), run_dir=run_dir)
        elapsed = time.monotonic() - t0
        assert srv.stats()["outcomes"]["429"] == 3
    row = run.summary().row(0, named=True)
    f = records_frame(tmp_path / "run")
    assert len(f) == 10 and row["retries"] == 3 and row["errors"] == 0
    assert (
        f["attempts"].sum() - len(f) == 3 and elapsed >= 1.0
    )  # waited as told, not the 0.02 s backoff


@pytest.mark.parametrize(
    "mode",  # 500s and resets take the endpoint out: the pool's 5 s health probe brings it back
    [
        pytest.param("500", marks=pytest.mark.slow),
        pytest.param("reset", marks=pytest.mark.slow),
        "malformed",
    ],
)
def test_transient_faults_are_retried(tmp_path, mode):
    with FaultServer(FaultConfig(mode=mode, fraction=0.3, seed=5)) as srv:
        cfg = config(srv.base_url, max_attempts=6)
        run = kit.generate_sync(prompts(60), cfg, run_dir=tmp_path / "run")
        faults = srv.stats()["outcomes"][mode]
        row = run.summary().row(0, named=True)
        assert faults > 5 and row["retries"] >= faults - row["errors"] * 6
        n_errors = int((~read_errors(tmp_path / "run")["resolved"]).sum())
        assert lines_ok(tmp_path / "run") + n_errors == 60  # every request accounted for
        srv.configure(mode="ok")
        kit.generate_sync(prompts(60), config(srv.base_url), run_dir=tmp_path / "run")
    assert lines_ok(tmp_path / "run") == 60 and read_errors(tmp_path / "run")["resolved"].all()


@pytest.mark.slow
def test_hung_requests_time_out_to_errors_and_are_sent_again(tmp_path):
    with FaultServer(FaultConfig(mode="hang", fraction=0.5, seed=1)) as srv:
        cfg = config(srv.base_url, timeout=0.3, max_attempts=2)
        run = kit.generate_sync(prompts(20), cfg, run_dir=tmp_path / "run")
        errors = read_errors(tmp_path / "run")
        print(f"\nhang: {run.summary().select('samples_done', 'retries', 'errors').row(0)}")
        assert len(errors) >= 1 and errors["error"].str.starts_with("timeout").all()
        # a prompt whose attempts all timed out went back to its queue: answered later
        assert lines_ok(tmp_path / "run") == 20 and errors["resolved"].all()
        srv.configure(mode="ok")
        kit.generate_sync(prompts(20), cfg, run_dir=tmp_path / "run")
    assert lines_ok(tmp_path / "run") == 20
    assert read_errors(tmp_path / "run")["resolved"].all()


def test_server_killed_mid_run_stops_cleanly_then_resumes(tmp_path):
    budgets = {"a": 3000}

    async def until_killed(srv):
        cfg = config(srv.base_url, budgets=budgets, no_endpoint_timeout=1.0)
        run = await kit.generate(prompts(300), cfg, run_dir=tmp_path / "run", background=True)
        deadline = time.monotonic() + 60
        while run.status().frame["tokens_done"].sum() < 800:
            assert time.monotonic() < deadline, "800 tokens not done within 60 s"
            await asyncio.sleep(0.02)
        srv.kill()
        await asyncio.wait_for(run.wait(), 60)
        return run

    with FaultServer(FaultConfig(latency=0.02)) as srv:
        run = asyncio.run(until_killed(srv))
        print(f"\nkilled: {run.stop_reason}\n{run.summary()}")
        assert run.stop_reason and "in a row failed" in run.stop_reason
        assert run.summary()["tokens_done"][0] < 3000
        before = records_frame(tmp_path / "run", prompts=False)
        n_before = lines_ok(tmp_path / "run")
        srv.restart()
        cfg = config(srv.base_url, budgets=budgets)
        done = kit.generate_sync(prompts(300), cfg, run_dir=tmp_path / "run")
    after = records_frame(tmp_path / "run", prompts=False)
    assert after.head(before.height).equals(before)  # what was committed stays as it was
    f = records_frame(tmp_path / "run")
    assert lines_ok(tmp_path / "run") == len(f) > n_before  # no duplicate keys
    assert (
        3000 <= f["completion_tokens"].sum() <= 3040
        and done.summary()["state"][0] == "budget_reached"
    )


def test_dead_endpoint_the_other_finishes(tmp_path):
    with (
        FaultServer(FaultConfig(latency=0.01, die_after=30)) as dying,
        FaultServer(FaultConfig(latency=0.01)) as ok,
    ):
        cfg = config([dying.base_url, ok.base_url], budgets={"a": 4000})
        run = kit.generate_sync(prompts(200), cfg, run_dir=tmp_path / "run")
    f = records_frame(tmp_path / "run")
    by = dict(f.group_by("endpoint").len().iter_rows())
    print(f"\nrecords per endpoint: {by}")
    assert 4000 <= f["completion_tokens"].sum() <= 4040 and run.summary()["errors"][0] == 0
    assert 0 < by.get(dying.base_url, 0) <= 30 and by[ok.base_url] > by.get(dying.base_url, 0)


FULL_DISK = """
import json, resource, signal, sys
import polars as pl
import kit
from kit.run.store import StoreWriteError
a = json.loads(sys.argv[1])
frame = pl.read_parquet(a["prompts"])
config = kit.RunConfig.from_dict(a["config"])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))
try:
    kit.generate_sync(frame, config, run_dir=a["run_dir"])
except StoreWriteError as e:
    print("STOPPED:", e)
"""


def test_full_disk_stops_the_run_cleanly(tmp_path):
    prompts(400).write_parquet(tmp_path / "p.parquet")
    with FaultServer(FaultConfig(latency=0.01)) as srv:
        cfg = config(srv.base_url, budgets={"a": 8000}, concurrency=32)
        a = {
            "prompts": str(tmp_path / "p.parquet"),
            "run_dir": str(tmp_path / "run"),
            "config": cfg.to_dict(),
        }
        out = subprocess.run(
            [sys.executable, "-c", FULL_DISK, json.dumps(a)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env=os.environ | {"PYTHONPATH": str(ROOT)},
        )
        assert "STOPPED:" in out.stdout and "nothing half-written was kept" in out.stdout, (
            out.stderr[-2000:]
        )
        n = lines_ok(tmp_path / "run")
        assert 0 < n
        kit.generate_sync(prompts(400), cfg, run_dir=tmp_path / "run")
    f = records_frame(tmp_path / "run")
    assert lines_ok(tmp_path / "run") == len(f) > n and f["completion_tokens"].sum() >= 8000
