"""Issue 11, hostile files: what kit does with a user's folders, a second writer, a damaged
run database (truncated, pages overwritten, prompts edited after the run), an empty run
and counts that are not counts.

Each test names the defect it pins; its docstring says what broke before the fix.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from faultserver import FaultConfig, FaultServer
from test_audit import ANSWERS, make_record, plant_run

import kit
from kit.cli import main as cli_main
from kit.report.export import export
from kit.report.validate import file_entry, validate
from kit.run import store
from kit.run.db import DatabaseDamaged
from kit.run.progress import progress
from kit.run.reader import PromptMismatch, read_config, records_frame, state
from kit.run.store import RunStore
from kit.types import RunConfig

ROOT = Path(__file__).resolve().parents[1]
RUNNER = """
import json, sys
import polars as pl
import kit
args = json.loads(sys.argv[1])
kit.generate_sync(pl.read_parquet(args["prompts"]), kit.RunConfig.from_dict(args["config"]),
                  run_dir=args["run_dir"])
"""


def _frame(n: int = 20, datasets=("a",)) -> pl.DataFrame:
    rows = [
        {
            "dataset": ds,
            "prompt_id": f"{ds}-{i:04d}",
            "messages": [{"role": "user", "content": f"{ds} task {i}"}],
            "n_turns": 1,
            "row": i,
        }
        for ds in datasets
        for i in range(n)
    ]
    return pl.DataFrame(rows)


def _config(url: str, budgets=None, **kw) -> RunConfig:
    base = dict(
        model="fake",
        endpoints=url,
        budgets=budgets or {"a": 10**6},
        concurrency=4,
        retry_base=0.02,
        sampling={"max_tokens": 40},
    )
    return RunConfig(**(base | kw))


def wait_for(cond, timeout: float = 60.0, what: str = "condition") -> None:
    """Poll cond() until it holds; fail after a generous deadline."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout:g} s")
        time.sleep(0.01)


def _keys(run_dir: Path) -> list[tuple]:
    return list(records_frame(run_dir).select("dataset", "prompt_id", "sample").iter_rows())


def _tree(root: Path, skip: str = "") -> dict[str, bytes]:
    """relative path -> bytes of every file under root (but `skip`)."""
    files = [p for p in sorted(root.rglob("*")) if p.is_file() and p.name != skip]
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


def _small_run(tmp_path: Path) -> Path:
    recs = [make_record(None, "d", i, f"Question {i}?", ANSWERS[i], ids=False) for i in range(4)]
    return plant_run(tmp_path / "run", recs, budgets={"d": 1000})


# ---------------------------------------------------------------- item 1: export ownership


def test_export_refuses_a_foreign_directory_and_keeps_its_files(tmp_path):
    """Before: export(run, out, formats=("specforge",)) into out/ holding
    out/parquet/important_results.txt deleted it, even with overwrite=False."""
    run = _small_run(tmp_path)
    out = tmp_path / "out"
    (out / "parquet").mkdir(parents=True)
    (out / "parquet" / "important_results.txt").write_text("months of work")
    before = _tree(out)
    for overwrite in (False, True):
        with pytest.raises(FileExistsError) as e:
            export(run, out, formats=("specforge",), overwrite=overwrite)
        msg = str(e.value)
        assert "\n" not in msg and "not a kit export" in msg and str(out) in msg, msg
        assert _tree(out) == before
    assert sorted(p.name for p in out.rglob("*")) == ["important_results.txt", "parquet"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export(run, empty, formats=("specforge",)).counts["d"]["records"] == 4


def test_export_overwrite_replaces_only_the_files_its_manifest_lists(tmp_path):
    """Before: overwrite=True removed whole specforge/, parquet/, ... folders, with whatever
    the user had put beside the export's own files."""
    run = _small_run(tmp_path)
    out = tmp_path / "out"
    export(run, out, formats=("specforge", "parquet"))
    mine = {"NOTES.md": "mine", "parquet/mine.txt": "mine too", "specforge/extra.jsonl": "{}\n"}
    for rel, text in mine.items():
        (out / rel).write_text(text)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export(run, out, formats=("specforge",))
    second = export(run, out, formats=("specforge",), overwrite=True)
    assert {rel: (out / rel).read_text() for rel in mine} == mine
    assert not (out / "parquet" / "train.parquet").exists()  # kit's own old file is gone
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert on_disk == set(second.files) | set(mine) | {"manifest.json"}
    extra = [
        f"{rel}: not listed in manifest.json (a file the export did not write)"
        for rel in sorted(mine)
    ]
    assert validate(out).problems == extra  # issue 23: kept, but named by kit.validate

    # a file kit wrote but someone edited since is no longer kit's to delete: refused
    (out / "specforge" / "train.jsonl").write_text("edited by hand\n")
    with pytest.raises(FileExistsError, match="changed since") as e:
        export(run, out, formats=("specforge",), overwrite=True)
    assert "\n" not in str(e.value)
    assert (out / "specforge" / "train.jsonl").read_text() == "edited by hand\n"

    # a manifest that lists a file outside the export is never followed
    out2, victim = tmp_path / "out2", tmp_path / "victim.txt"
    victim.write_text("not kit's")
    export(run, out2, formats=("specforge",))
    manifest = json.loads((out2 / "manifest.json").read_text())
    manifest["files"]["../victim.txt"] = file_entry(victim, None)
    (out2 / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FileExistsError, match="outside"):
        export(run, out2, formats=("specforge",), overwrite=True)
    assert victim.read_text() == "not kit's"


# ---------------------------------------------------------------- item 2: one writer per run dir


def _spawn(tmp_path: Path, run_dir: Path, config: RunConfig) -> subprocess.Popen:
    frame_path = tmp_path / "prompts.parquet"
    _frame().write_parquet(frame_path)
    args = {"prompts": str(frame_path), "run_dir": str(run_dir), "config": config.to_dict()}
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", RUNNER, json.dumps(args)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _wait_running(proc: subprocess.Popen, srv: FaultServer, requests: int) -> None:
    """Wait until the server has seen `requests` requests: the runner is past its lock."""
    wait_for(
        lambda: proc.poll() is not None or srv.stats()["requests"] >= requests,
        120,
        "the first runner's requests",
    )
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]


def _check_complete(run_dir: Path, n: int) -> None:
    keys = _keys(run_dir)
    assert sorted(keys) == [("a", f"a-{i:04d}", 0) for i in range(n)]
    refused = state(run_dir, "rejected")  # a second copy of a key is refused and counted
    assert refused is None, f"{refused} records refused as copies: some were generated twice"


def test_second_writer_is_refused_while_a_run_holds_the_lock(tmp_path):
    """Before: two kit.generate on one run dir both ran, every sample generated twice."""
    # in one process: a second RunStore is refused until the first closes
    config = _config("http://127.0.0.1:9/v1")
    first = RunStore(tmp_path / "same")
    first.init(config)
    with pytest.raises(store.RunLocked, match=f"pid {os.getpid()}"):
        RunStore(tmp_path / "same").init(config)
    first.close()
    second = RunStore(tmp_path / "same")
    second.init(config)
    second.close()

    # two processes: the runner holds the lock for the life of its run
    run_dir = tmp_path / "run"
    with FaultServer(FaultConfig(hang_after=0)) as srv:  # every request hangs: the run cannot end
        config = _config(srv.base_url)
        proc = _spawn(tmp_path, run_dir, config)
        try:
            _wait_running(proc, srv, 1)
            before = read_config(run_dir).to_dict()
            with pytest.raises(store.RunLocked) as e:
                kit.generate_sync(_frame(), config, run_dir=run_dir)
            msg = str(e.value)
            assert f"pid {proc.pid}" in msg and "\n" not in msg, msg
            assert isinstance(e.value, RuntimeError)
            # the refused writer wrote nothing: the holder is still named, its config kept
            assert state(run_dir, "writer").startswith(f"pid {proc.pid} ")
            assert read_config(run_dir).to_dict() == before
            # readers take no lock
            assert records_frame(run_dir).height == 0
            assert [p.dataset for p in progress(run_dir)] == ["a"]
            assert kit.audit(run_dir).datasets["dataset"].to_list() == ["a"]
            proc.send_signal(signal.SIGINT)  # the first writer ends (cleanly)
            proc.wait(60)
        finally:
            proc.send_signal(signal.SIGKILL)  # only when something above failed
            proc.wait(60)
        assert "KeyboardInterrupt" in proc.stderr.read().decode()
        srv.configure(hang_after=None)
        kit.generate_sync(_frame(), config, run_dir=run_dir)  # now the second one runs
    _check_complete(run_dir, 20)


def test_lock_is_released_when_the_holder_is_killed_9(tmp_path):
    """The lock is a kernel flock: a writer killed with SIGKILL leaves no stale lock."""
    run_dir = tmp_path / "run"
    with FaultServer(FaultConfig(hang_after=3)) as srv:  # 3 answers, then every request hangs
        config = _config(srv.base_url)
        proc = _spawn(tmp_path, run_dir, config)
        try:
            _wait_running(proc, srv, 4)
            with pytest.raises(store.RunLocked, match=f"pid {proc.pid}"):
                kit.generate_sync(_frame(), config, run_dir=run_dir)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(60)
        assert proc.returncode == -signal.SIGKILL
        srv.configure(hang_after=None)
        kit.generate_sync(_frame(), config, run_dir=run_dir)
    _check_complete(run_dir, 20)


# ---------------------------------------------------------------- a damaged run database


def _big_run(tmp_path: Path) -> Path:
    """A closed run whose records span many pages (1 KB completions)."""
    recs = [
        make_record(None, "d", i, f"Question {i}?", f"{ANSWERS[i % 6]} {i} " * 30, ids=False)
        for i in range(200)
    ]
    return plant_run(tmp_path / "run", recs, budgets={"d": 10**6})


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _garbage_pages(path: Path) -> None:
    """Overwrite eight pages in the middle of the file (records pages) with random bytes."""
    import random

    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek((size // 2) // 4096 * 4096)
        f.write(random.Random(3).randbytes(8 * 4096))


@pytest.mark.parametrize("damage", [_truncate, _garbage_pages])
def test_a_damaged_database_is_one_line_with_what_to_do(tmp_path, capsys, damage):
    """A run.sqlite cut to half its size or with garbage pages in the middle: every reader
    raises DatabaseDamaged, every command says so in one line and exits non-zero."""
    run = _big_run(tmp_path)
    damage(run / "run.sqlite")
    with pytest.raises(DatabaseDamaged, match="Restore it from a copy"):
        kit.audit(run)
    with pytest.raises(DatabaseDamaged):
        export(run, tmp_path / "api-out", formats=("specforge",))
    capsys.readouterr()
    for argv in (
        ["audit", str(run)],
        ["export", str(run), str(tmp_path / "out"), "--format", "specforge"],
        ["records", str(run)],
    ):
        code = cli_main(argv)
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert code != 0 and len(lines) == 1, (argv, err)
        assert lines[0].startswith("kit: error: run database ") and "is damaged" in lines[0], err
        assert "Restore it from a copy" in lines[0] and "Traceback" not in err


def test_prompts_swapped_after_the_run_are_refused_by_name(tmp_path, capsys):
    """Two prompts' messages swapped with sqlite3 after the run: audit, export and `kit
    records` refuse naming a prompt; no record is ever paired with the other's prompt."""
    import sqlite3

    run = _small_run(tmp_path)
    conn = sqlite3.connect(run / "run.sqlite")
    (a, ma), (b, mb) = conn.execute(
        "SELECT prompt_id, messages FROM prompts ORDER BY prompt_id LIMIT 2"
    ).fetchall()
    conn.execute("UPDATE prompts SET messages = ? WHERE prompt_id = ?", (mb, a))
    conn.execute("UPDATE prompts SET messages = ? WHERE prompt_id = ?", (ma, b))
    conn.commit()
    conn.close()
    with pytest.raises(PromptMismatch) as e:
        kit.audit(run)
    assert a in str(e.value) or b in str(e.value)
    with pytest.raises(PromptMismatch):
        export(run, tmp_path / "api-out", formats=("specforge",))
    assert not (tmp_path / "api-out" / "specforge" / "train.jsonl").exists()
    capsys.readouterr()
    for argv in (
        ["audit", str(run)],
        ["export", str(run), str(tmp_path / "out"), "--format", "specforge"],
        ["records", str(run)],
    ):
        code = cli_main(argv)
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "Traceback" not in captured.err, (
            argv,
            captured.err,
        )
        assert a in lines[0] or b in lines[0], lines[0]
        assert ma not in captured.out and mb not in captured.out  # no pair was written out


def test_audit_and_export_of_a_run_with_zero_records(tmp_path):
    """Before: both raised polars InvalidOperationError ("dtype Null not supported in 'not'
    operation") on a run with no records."""
    run = plant_run(tmp_path / "run", [], budgets={"a": 100}, prompts={"a": ["x", "y"]})
    report = kit.audit(run)
    assert report.datasets["dataset"].to_list() == ["a"]
    assert report.datasets.row(0, named=True)["records"] == 0
    assert report.records.height == 0 and "completion_tokens" in report.records.columns
    assert report.lengths.columns == ["dataset", "records", "mean", "p50", "p90", "p99", "max"]
    assert report.finish.columns == ["dataset", "finish_reason", "count", "share"]
    checks = report.findings.filter(pl.col("dataset") == "a")["check"].to_list()
    assert "no_records" in checks, report.summary()
    assert "no records" in report.summary()

    result = export(run, tmp_path / "out", formats=("specforge", "parquet"))
    assert result.counts == {} and any("no records" in n for n in result.notes)
    assert "no records" in result.summary()
    assert (tmp_path / "out" / "specforge" / "train.jsonl").read_text() == ""
    assert validate(tmp_path / "out").ok


# ---------------------------------------------------------------- item 4: counts the audit checks


def test_audit_flags_counts_that_are_not_counts(tmp_path):
    """Before: a record with completion_tokens -15000 audited as "-15,000 tokens of 400"
    with no finding. The runner refuses such counts from a server (kit.run.answers); here
    they are planted in the database."""
    recs = [make_record(None, "neg", i, f"q{i}", ANSWERS[i], ids=False) for i in range(4)]
    recs[1].completion_tokens = -15000
    recs += [make_record(None, "odd", 10 + i, f"o{i}", ANSWERS[i], ids=False) for i in range(4)]
    recs[6].completion_tokens = 10**9  # far above max_tokens (64)
    recs[7].output_ids = [5, 6, 7]  # ids present, count differs
    recs[7].completion_tokens = 9
    run = plant_run(tmp_path / "run", recs, budgets={"neg": 400, "odd": 400})
    report = kit.audit(run)
    rows = {(f["dataset"], f["check"]): f for f in report.findings.iter_rows(named=True)}
    assert rows[("neg", "bad_count")]["value"] == 1, report.summary()
    assert rows[("odd", "bad_count")]["value"] == 1, report.summary()
    assert rows[("odd", "ids_len_mismatch")]["value"] == 1
    for key in [("neg", "bad_count"), ("odd", "bad_count")]:
        assert rows[key]["severity"] == "error"
    assert "-15,000" not in report.summary() and "-14," not in report.summary()
    neg = report.datasets.filter(pl.col("dataset") == "neg").row(0, named=True)
    assert neg["tokens"] == sum(r.completion_tokens for r in recs[:4] if r.completion_tokens > 0)
    assert neg["records"] == 4


@pytest.mark.server
def test_audit_flags_a_server_that_under_reports(tmp_path, model_dir):
    """Before: usage counts far below the text's own token count passed the audit."""
    tok = kit.tokens.load_tokenizer(model_dir)
    long = " ".join(ANSWERS)
    recs = [make_record(tok, "honest", i, f"q{i}", ANSWERS[i], ids=False) for i in range(4)]
    recs += [make_record(tok, "liar", 10 + i, f"l{i}", long, ids=False) for i in range(4)]
    for r in recs:
        r.completion_tokens = len(tok.encode(r.completion, add_special_tokens=False))
    for r in recs[4:7]:
        r.completion_tokens = 3  # the server says 3 tokens for ~60
    run = plant_run(
        tmp_path / "run", recs, budgets={"honest": 1000, "liar": 1000}, tokenizer=str(model_dir)
    )
    report = kit.audit(run)
    rows = {(f["dataset"], f["check"]): f for f in report.findings.iter_rows(named=True)}
    assert rows[("liar", "count_under_reported")]["value"] == 3, report.summary()
    assert ("honest", "count_under_reported") not in rows
    assert report.datasets.filter(pl.col("dataset") == "liar")["count_checked"].item() == 4
