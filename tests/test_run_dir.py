"""The run directory under a real `kit` process: settings changed at resume, re-planning,
the write-ahead log, read-only copies and a dead writer. Each test breaks a real run
against the fault server and counts every record it stored."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from faultserver import FaultConfig, FaultServer
from test_crash import _as_answered, _count, _kit, _records, _tokens, wait_for

from kit.run import reader

ROOT = Path(__file__).resolve().parents[1]

MAX_TOKENS = 40


def _samples(root: Path, sizes: dict[str, int]) -> Path:
    """A folder of alpaca JSONL sources, one per dataset (named by the file's stem)."""
    root.mkdir(parents=True, exist_ok=True)
    for ds, n in sizes.items():
        rows = [{"instruction": f"{ds} task {i}", "input": ""} for i in range(n)]
        (root / f"{ds}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _run(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = _kit(*argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(argv, proc.returncode, out.decode(), err.decode())


def _plan(samples: Path, run_dir: Path, url: str, budget: str = "2000", *extra: str):
    return _run(
        *("plan", "--samples", *map(str, sorted(samples.iterdir())), "--run-dir", str(run_dir)),
        *("--budget", budget, "--base-url", url, "--model", "fake"),
        *("--max-tokens", str(MAX_TOKENS), "--concurrency", "8", "--pilot-per-dataset", "4"),
        *extra,
    )


def _interrupted(run_dir: Path, at: int, *flags: str) -> subprocess.CompletedProcess:
    """`kit generate --run-dir run_dir *flags`, SIGINT once `at` records are committed."""
    proc = _kit(
        "generate",
        "--run-dir",
        str(run_dir),
        *flags,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(lambda: proc.poll() is not None or _count(run_dir) >= at, 120, f"{at} records")
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)
    return subprocess.CompletedProcess(flags, proc.returncode, out.decode(), err.decode())


def _unchanged(before: dict, after: dict) -> None:
    """Every committed record is still there, byte for byte; none twice (_records checks)."""
    lost = [k for k, row in before.items() if after.get(k) != row]
    assert not lost, f"{len(lost)} committed records lost or changed"


# ------------------------------------------------------------------- item 5: resume changes


def test_a_budget_raised_at_resume_is_kept_by_every_later_resume_and_the_export(tmp_path):
    """The issue's case: generate --budget alpha=6000, interrupted, then the plain `kit
    generate` kit suggests: alpha runs to 6000 (not the planned 2000), the change is
    recorded once, and export --trim-to-budget keeps alpha's 6000."""
    samples = _samples(tmp_path / "samples", {"alpha": 400, "beta": 400})
    run_dir = tmp_path / "run"
    fault = FaultConfig(latency=0.02, min_words=20, max_words=40)
    with FaultServer(fault) as srv:
        plan = _plan(samples, run_dir, srv.base_url)
        assert plan.returncode == 0, plan.stderr[-2000:]
        cut = _interrupted(run_dir, 40, "--budget", "alpha=6000")
        assert cut.returncode == 130, cut.stderr[-2000:]
        before = _records(run_dir)
        assert reader.read_config(run_dir).budgets == {"alpha": 6000, "beta": 2000}
        again = _run("generate", "--run-dir", str(run_dir))
        assert again.returncode == 0, again.stderr[-2000:]
        after = _records(run_dir)
        third = _run("generate", "--run-dir", str(run_dir))  # nothing left to do
        assert third.returncode == 0, third.stderr[-2000:]
    _unchanged(before, after)
    assert _records(run_dir) == after, "a resume past the budget generated more"
    _as_answered(run_dir, fault)
    tokens = _tokens(after)
    assert 6000 <= tokens["alpha"] <= 6000 + MAX_TOKENS, tokens
    assert 2000 <= tokens["beta"] <= 2000 + MAX_TOKENS, tokens
    budgets = [c for c in reader.run_changes(run_dir) if c[1].startswith("budgets.")]
    assert [c[1:] for c in budgets] == [("budgets.alpha", 2000, 6000)]
    audit = _run("audit", str(run_dir))
    assert "budgets.alpha: 2000 -> 6000" in audit.stdout, audit.stdout
    assert f"of {6000:,}" in audit.stdout, audit.stdout
    out = tmp_path / "export"
    ex = _run("export", str(run_dir), str(out), "--format", "parquet", "--trim-to-budget")
    assert ex.returncode == 0, ex.stderr[-2000:]
    kept = pl.read_parquet(list(out.rglob("*.parquet")))
    got = dict(kept.group_by("dataset").agg(pl.col("completion_tokens").sum()).iter_rows())
    assert 6000 - MAX_TOKENS < got["alpha"] <= 6000, got
    assert 2000 - MAX_TOKENS < got["beta"] <= 2000, got


def test_concurrency_and_endpoint_changed_at_resume_are_recorded_and_kept(tmp_path):
    """Neighbours of the budget: --concurrency and --base-url given at a resume stay in force
    for the next plain resume, each recorded old -> new; one budget for all is compared per
    dataset."""
    samples = _samples(tmp_path / "samples", {"alpha": 300, "beta": 300})
    run_dir = tmp_path / "run"
    fault = FaultConfig(latency=0.02, min_words=20, max_words=40)
    with FaultServer(fault) as one, FaultServer(fault) as two:
        assert _plan(samples, run_dir, one.base_url).returncode == 0
        cut = _interrupted(
            run_dir, 20, "--concurrency", "3", "--base-url", two.base_url, "--budget", "2500"
        )
        assert cut.returncode == 130, cut.stderr[-2000:]
        before = _records(run_dir)
        served = one.stats()["requests"]
        again = _run("generate", "--run-dir", str(run_dir))
        assert again.returncode == 0, again.stderr[-2000:]
        assert one.stats()["requests"] == served, "the plain resume went back to the plan's server"
    config = reader.read_config(run_dir)
    assert (config.concurrency, config.endpoints) == (3, [two.base_url])
    changes = {c[1]: c[2:] for c in reader.run_changes(run_dir)}
    assert changes["concurrency"] == (8, 3)
    assert changes["endpoints"] == ([one.base_url], [two.base_url])
    assert changes["budgets.alpha"] == (2000, 2500) and changes["budgets.beta"] == (2000, 2500)
    after = _records(run_dir)
    _unchanged(before, after)
    assert all(2500 <= t <= 2500 + MAX_TOKENS for t in _tokens(after).values()), _tokens(after)


# ---------------------------------------------------------------------- item 6: re-planning


def _stored_prompts(run_dir: Path) -> set[tuple[str, str]]:
    return set(reader.prompts_frame(run_dir, text=False).select("dataset", "prompt_id").rows())


def _loaded(samples: Path) -> set[tuple[str, str]]:
    import kit

    loaded = kit.load(sorted(str(p) for p in samples.iterdir()))
    return set(loaded.scan().select("dataset", "prompt_id").collect().rows())


def test_replanning_before_any_record_replaces_the_prompts(tmp_path):
    """Plan, edit the prompts file, plan again with one dataset fewer, generate --budget 500:
    the database holds exactly the new prompts and every record comes from one of them; the
    dataset left out is never generated."""
    samples = _samples(tmp_path / "samples", {"alpha": 200, "beta": 200})
    run_dir = tmp_path / "run"
    fault = FaultConfig(latency=0.005, min_words=20, max_words=40)
    with FaultServer(fault) as srv:
        assert _plan(samples, run_dir, srv.base_url).returncode == 0
        assert {d for d, _ in _stored_prompts(run_dir)} == {"alpha", "beta"}
        (samples / "beta.jsonl").unlink()
        rows = [{"instruction": f"alpha edited {i}", "input": ""} for i in range(150)]
        (samples / "alpha.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        again = _plan(samples, run_dir, srv.base_url)
        assert again.returncode == 0, again.stderr[-2000:]
        assert _stored_prompts(run_dir) == _loaded(samples)
        run = _run("generate", "--run-dir", str(run_dir), "--budget", "500")
        assert run.returncode == 0, run.stderr[-2000:]
    records = _records(run_dir)
    assert records and {k[:2] for k in records} <= _loaded(samples)
    assert {k[0] for k in records} == {"alpha"}
    assert 500 <= _tokens(records)["alpha"] <= 500 + MAX_TOKENS
    _as_answered(run_dir, fault)


def test_replanning_over_records_is_refused_before_the_pilot_and_keeps_them(tmp_path):
    """Records exist: a plan over other prompts is refused in one line naming a new
    --run-dir, before any pilot request, the records untouched; a plan over the same
    prompts (a new budget) still goes in."""
    samples = _samples(tmp_path / "samples", {"alpha": 200, "beta": 200})
    run_dir = tmp_path / "run"
    fault = FaultConfig(latency=0.005, min_words=20, max_words=40)
    with FaultServer(fault) as srv:
        assert _plan(samples, run_dir, srv.base_url, "800").returncode == 0
        assert _run("generate", "--run-dir", str(run_dir)).returncode == 0
        before = _records(run_dir)
        (samples / "beta.jsonl").unlink()
        sent = srv.stats()["requests"]
        refused = _plan(samples, run_dir, srv.base_url)
        assert refused.returncode == 2, refused.stderr[-2000:]
        assert "Traceback" not in refused.stderr
        assert "--run-dir NEW" in refused.stderr and "left out: ['beta']" in refused.stderr
        assert srv.stats()["requests"] == sent, "the pilot ran before the refusal"
        assert _records(run_dir) == before
        assert {d for d, _ in _stored_prompts(run_dir)} == {"alpha", "beta"}
        _samples(samples, {"beta": 200})  # the same prompts again: a new budget is a plan
        same = _plan(samples, run_dir, srv.base_url, "1600")
        assert same.returncode == 0, same.stderr[-2000:]
        assert _run("generate", "--run-dir", str(run_dir)).returncode == 0
    after = _records(run_dir)
    _unchanged(before, after)
    assert all(1600 <= t <= 1600 + MAX_TOKENS for t in _tokens(after).values()), _tokens(after)


# ------------------------------------------------------------------ item 8: the write-ahead log

KIT_WITH = """
import sys
import kit.run.store
kit.run.store.CHECKPOINT_EVERY = float(sys.argv[1])
from kit.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _generate(run_dir: Path, checkpoint_every: float = 60.0) -> subprocess.Popen:
    """`kit generate --run-dir run_dir` in a child, its WAL checkpointed every
    `checkpoint_every` s."""
    env = os.environ | {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-c", KIT_WITH, str(checkpoint_every), "generate", "--run-dir"]
    return subprocess.Popen(
        [*argv, str(run_dir)], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def _planned(tmp_path: Path, url: str, budget: str = "6000") -> Path:
    samples = _samples(tmp_path / "samples", {"alpha": 400, "beta": 400})
    run_dir = tmp_path / "run"
    plan = _plan(samples, run_dir, url, budget)
    assert plan.returncode == 0, plan.stderr[-2000:]
    return run_dir


@pytest.mark.parametrize("victim", ["-wal", "-shm"])
def test_a_wal_or_shm_deleted_under_the_writer_stops_the_run_and_loses_nothing(tmp_path, victim):
    """run.sqlite-wal (or -shm) deleted while kit writes: the run stops with one line, exit
    1; every record committed before is in run.sqlite, and a resume reaches the budgets with
    none twice and each one as the server answered it."""
    fault = FaultConfig(latency=0.05, min_words=20, max_words=40)
    with FaultServer(fault) as srv:
        run_dir = _planned(tmp_path, srv.base_url)
        proc = _generate(run_dir)
        try:
            wait_for(lambda: proc.poll() is not None or _count(run_dir) >= 40, 120, "40 records")
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            before = _records(run_dir)
            os.unlink(run_dir / f"run.sqlite{victim}")
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(60)
        err = err.decode()
        assert proc.returncode == 1, err[-2000:]
        assert "Traceback" not in err, err[-2000:]
        line = [x for x in err.splitlines() if x.startswith("kit: error:")]
        assert len(line) == 1 and f"run.sqlite{victim}" in line[0] and "resume" in line[0], err
        stopped = _records(run_dir)
        _unchanged(before, stopped)
        assert len(stopped) >= len(before)
        again = _run("generate", "--run-dir", str(run_dir))
        assert again.returncode == 0, again.stderr[-2000:]
    after = _records(run_dir)
    _unchanged(stopped, after)
    assert all(6000 <= t <= 6000 + MAX_TOKENS for t in _tokens(after).values())
    _as_answered(run_dir, fault)


def test_a_wal_deleted_after_kill_9_costs_at_most_the_last_checkpoint_interval(tmp_path):
    """kill -9, then run.sqlite-wal and -shm deleted: every record committed more than one
    checkpoint interval (2 s here, 60 s by default) before the kill is still there, and the
    config with it; the resume completes the run."""
    fault = FaultConfig(latency=0.3, min_words=20, max_words=40)
    with FaultServer(fault) as srv:
        run_dir = _planned(tmp_path, srv.base_url)
        proc = _generate(run_dir, checkpoint_every=2.0)
        try:
            wait_for(lambda: proc.poll() is not None or _count(run_dir) >= 40, 120, "40 records")
            before = _records(run_dir)
            time.sleep(2.0 + 2.5)  # one interval, and a commit (1 s) to checkpoint at
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            proc.send_signal(signal.SIGKILL)
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(60)
        wal = run_dir / "run.sqlite-wal"
        assert wal.exists()
        killed = _records(run_dir)
        wal.unlink()
        (run_dir / "run.sqlite-shm").unlink(missing_ok=True)
        kept = _records(run_dir)
        _unchanged(before, kept)
        assert set(kept) <= set(killed)
        assert reader.read_config(run_dir).budgets == {"alpha": 6000, "beta": 6000}
        again = _run("generate", "--run-dir", str(run_dir))
        assert again.returncode == 0, again.stderr[-2000:]
    after = _records(run_dir)
    _unchanged(kept, after)
    assert all(6000 <= t <= 6000 + MAX_TOKENS for t in _tokens(after).values())
    _as_answered(run_dir, fault)


def test_a_clean_stop_checkpoints_the_wal(tmp_path):
    """Ctrl-C: the WAL is copied into run.sqlite before kit exits, so a -wal deleted after a
    clean stop takes nothing."""
    fault = FaultConfig(latency=0.05, min_words=20, max_words=40)
    with FaultServer(fault) as srv:
        run_dir = _planned(tmp_path, srv.base_url)
        cut = _interrupted(run_dir, 40)
        assert cut.returncode == 130, cut.stderr[-2000:]
    before = _records(run_dir)
    wal = run_dir / "run.sqlite-wal"
    assert not wal.exists() or wal.stat().st_size == 0
    wal.unlink(missing_ok=True)
    assert _records(run_dir) == before


# -------------------------------------------------------- item 9: read-only run directories

RO = """
import subprocess, sys
ro, argv = sys.argv[1], sys.argv[2:]
subprocess.run(["mount", "--bind", "-o", "ro", ro, ro], check=True)
from kit.cli import main
sys.exit(main(argv))
"""


def _ro_kit(ro: Path, *argv: str) -> subprocess.CompletedProcess:
    """`kit *argv` with `ro` bind-mounted read-only (a private mount namespace: writes there
    fail with EROFS even for root, as on a read-only mount)."""
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    cmd = ["unshare", "-rm", sys.executable, "-c", RO, str(ro), *argv]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    return out


def _cut_run(tmp_path: Path, url: str, signal_: int) -> Path:
    run_dir = _planned(tmp_path, url)
    proc = _generate(run_dir)
    try:
        wait_for(lambda: proc.poll() is not None or _count(run_dir) >= 40, 120, "40 records")
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        proc.send_signal(signal_)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)
    return run_dir


@pytest.mark.parametrize("copy", ["backup", "killed"])
def test_every_reading_command_works_on_a_read_only_run_dir(tmp_path, copy):
    """A `.backup` copy (run.sqlite alone) and a kill -9'd run (its -wal and -shm left) on a
    read-only mount: audit, records, export, watch and plan --show read every record;
    generate refuses it in one line."""
    fault = FaultConfig(latency=0.05, min_words=20, max_words=40)
    with FaultServer(fault) as srv:
        run_dir = _cut_run(tmp_path, srv.base_url, signal.SIGKILL)
    ro = tmp_path / "ro"
    if copy == "backup":
        ro.mkdir()
        src = sqlite3.connect(run_dir / "run.sqlite")
        dst = sqlite3.connect(ro / "run.sqlite")
        src.backup(dst)
        src.close(), dst.close()
        assert sorted(p.name for p in ro.iterdir()) == ["run.sqlite"]
    else:
        shutil.copytree(run_dir, ro)
        assert (ro / "run.sqlite-wal").stat().st_size > 0
    expected = _records(run_dir)
    before = {p.name: p.read_bytes() for p in ro.iterdir()}
    records = _ro_kit(ro, "records", str(ro))
    assert records.returncode == 0, records.stderr[-2000:]
    keys = [
        (r["dataset"], r["prompt_id"], r["sample"])
        for r in map(json.loads, records.stdout.splitlines())
    ]
    assert sorted(keys) == sorted(expected) and len(keys) == len(expected)
    audit = _ro_kit(ro, "audit", str(ro))
    assert audit.returncode == 0, audit.stderr[-2000:]
    n = {ds: sum(1 for k in expected if k[0] == ds) for ds in ("alpha", "beta")}
    assert all(f"{ds}: {c} records" in audit.stdout for ds, c in n.items()), audit.stdout
    out = tmp_path / "export"
    ex = _ro_kit(ro, "export", str(ro), str(out), "--format", "parquet")
    assert ex.returncode == 0, ex.stderr[-2000:]
    assert pl.read_parquet(list(out.rglob("*.parquet"))).height == len(expected)
    watch = _ro_kit(ro, "watch", str(ro), "--stall-timeout", "5")
    assert watch.returncode == 0 and "alpha" in watch.stdout, watch.stderr[-2000:]
    show = _ro_kit(ro, "plan", "--show", str(ro))
    assert show.returncode == 0 and "alpha" in show.stdout, show.stderr[-2000:]
    gen = _ro_kit(ro, "generate", "--run-dir", str(ro))
    assert gen.returncode == 1 and "Traceback" not in gen.stderr, gen.stderr[-2000:]
    assert gen.stderr.count("\n") == 1 and "read-only" in gen.stderr, gen.stderr
    assert {p.name: p.read_bytes() for p in ro.iterdir()} == before, "a reader wrote"


# ------------------------------------------------------------ item 10: watch, a dead writer


def test_watch_says_at_once_that_a_killed_writer_is_gone(tmp_path):
    """kill -9 of `kit generate`: `kit watch` (stall timeout 300 s) stops within seconds,
    naming the pid that is gone and the resume; it counts every committed record."""
    fault = FaultConfig(latency=0.05, min_words=20, max_words=40)
    with FaultServer(fault) as srv:
        run_dir = _cut_run(tmp_path, srv.base_url, signal.SIGKILL)
    pid = json.loads(reader.state(run_dir, "writer_process"))["pid"]
    t0 = time.monotonic()
    watch = _run("watch", str(run_dir), "--stall-timeout", "300", timeout=120)
    took = time.monotonic() - t0
    assert watch.returncode == 0, watch.stderr[-2000:]
    assert took < 30, f"watch took {took:.0f} s"
    assert f"pid {pid}" in watch.stdout and "is gone" in watch.stdout, watch.stdout
    assert f"kit generate --run-dir {run_dir}" in watch.stdout
    tokens = _tokens(_records(run_dir))
    assert all(
        f"{t:,}" in watch.stdout or f"{t / 1000:.2f}k" in watch.stdout for t in tokens.values()
    )


def test_a_reused_pid_is_not_taken_for_the_writer(tmp_path):
    """The writer is named by pid and start time: a live process that got the dead writer's
    pid (here: this one, with another start time) is not it; the writer itself is live."""
    from kit.run import db
    from kit.run.progress import writer_gone
    from kit.run.store import RunStore

    store = RunStore(tmp_path / "run")
    store._open()
    try:
        assert writer_gone(tmp_path / "run") is None  # this process writes it
        me = json.loads(reader.state(tmp_path / "run", "writer_process"))
        assert me["start"] == db.process_start(os.getpid()) is not None
        store.set_state("writer_process", json.dumps(me | {"start": me["start"] - 1}))
        assert "is gone" in writer_gone(tmp_path / "run")
    finally:
        store.close()
