"""Issue 23 item 1: exports are staged beside their target and swapped in only when whole
and validated; a second exporter is refused; a killed export is named and replaced; a
failing export (damaged run, full disk) leaves the previous export as it was.

Each test makes a real run against the fault server and counts every record exported.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from faultserver import FaultConfig, FaultServer

import kit
from kit.report.validate import validate
from kit.run.reader import records_frame

ROOT = Path(__file__).resolve().parents[1]
ENV = os.environ | {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A real run: 30 prompts through the fault server (some requests fail and are retried)."""
    import polars as pl

    from kit.data.sources import prompt_id

    msgs = [[{"role": "user", "content": f"Explain topic {i} briefly."}] for i in range(30)]
    frame = pl.DataFrame(
        {
            "dataset": ["a"] * 30,
            "prompt_id": [prompt_id(m) for m in msgs],
            "messages": msgs,
            "n_turns": [1] * 30,
            "row": list(range(30)),
        }
    )
    run_dir = tmp_path_factory.mktemp("staging") / "run"
    with FaultServer(FaultConfig(mode="500", fraction=0.2, min_words=5, max_words=30)) as srv:
        config = kit.RunConfig(
            model="fault",
            endpoints=srv.base_url,
            budgets={"a": 10**6},
            sampling=kit.Sampling(max_tokens=64),
            retry_base=0.01,
        )
        kit.generate_sync(frame, config, run_dir=run_dir)
    assert records_frame(run_dir, prompts=False).height == 30
    return run_dir


def rows(out: Path) -> int:
    return sum(1 for _ in (out / "specforge" / "train.jsonl").open())


def cli_export(run_dir, out, *extra):
    kit_cli = str(Path(sys.executable).parent / "kit")
    return subprocess.run(
        [kit_cli, "export", str(run_dir), str(out), "--format", "specforge", *extra],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )


HOLD = """
import sys, time
from pathlib import Path
from kit.report.staging import Staged
stage = Staged(Path(sys.argv[1])).__enter__()
(stage.path / "specforge").mkdir()
(stage.path / "specforge" / "train.jsonl").write_text('{"half": true}\\n')
print("HOLDING", flush=True)
time.sleep(600)
"""


def test_a_second_exporter_is_refused_and_a_killed_one_is_replaced(run, tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True, env=ENV
    )
    try:
        assert holder.stdout.readline().strip() == "HOLDING"
        second = cli_export(run, out)
        assert second.returncode != 0 and "another kit export is writing" in second.stderr
        assert len(second.stderr.strip().splitlines()) == 1 and not out.exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    staging = tmp_path / ".out.kit-staging"
    assert (staging / "export" / "specforge" / "train.jsonl").exists()  # the killed export's half
    again = cli_export(run, out)
    assert again.returncode == 0, again.stderr
    assert "replaced a half export" in again.stdout + again.stderr
    assert not staging.exists() and rows(out) == 30 and validate(out).ok


def test_overwrite_keeps_the_previous_export_until_the_new_one_is_whole(run, tmp_path):
    out = tmp_path / "out"
    first = kit.export(run, out, formats=("specforge",))
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert rows(out) == 30 and validate(out).ok
    damaged = tmp_path / "damaged"
    import shutil

    shutil.copytree(run, damaged)
    with sqlite3.connect(damaged / "run.sqlite") as conn:  # two prompts' text swapped
        a, b = conn.execute("SELECT prompt_id, messages FROM prompts LIMIT 2").fetchall()
        conn.execute("UPDATE prompts SET messages = ? WHERE prompt_id = ?", (b[1], a[0]))
        conn.execute("UPDATE prompts SET messages = ? WHERE prompt_id = ?", (a[1], b[0]))
    with pytest.raises(ValueError, match="changed after the run"):
        kit.export(damaged, out, formats=("specforge",), overwrite=True)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert validate(out).ok and first.counts["a"]["records"] == 30
    assert not (tmp_path / ".out.kit-staging").exists()


@pytest.fixture
def small_disk(tmp_path):
    """A folder on a tmpfs of `size` bytes (a real ENOSPC), unmounted after the test."""
    mounted = []

    def make(size: int) -> Path:
        disk = tmp_path / "disk"
        disk.mkdir()
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], check=True
        )
        mounted.append(disk)
        return disk

    yield make
    import gc

    gc.collect()  # a writer the failed export left to the collector still holds its file
    for disk in mounted:
        if subprocess.run(["umount", str(disk)], check=False).returncode:
            subprocess.run(["umount", "-l", str(disk)], check=True)  # detached once released


def test_a_full_disk_during_export_leaves_the_previous_export(run, tmp_path, small_disk):
    """The disk holds one export but not two: the second (overwrite) fails while staging,
    and the first stays whole and valid."""
    probe = tmp_path / "probe"
    kit.export(run, probe, formats=("specforge",))
    pages = sum(-(-p.stat().st_size // 4096) for p in probe.rglob("*") if p.is_file())
    out = small_disk((pages + 2) * 4096) / "out"
    kit.export(run, out, formats=("specforge",))
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(OSError) as failed:
        kit.export(run, out, formats=("specforge",), overwrite=True)
    assert failed.value.errno == 28  # ENOSPC, from a real disk
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert rows(out) == 30 and validate(out).ok
    assert not (out.parent / ".out.kit-staging").exists()


def test_a_kill_mid_swap_restores_the_previous_export(run, tmp_path):
    """The previous export's files moved aside, then the process died: the next export puts
    them back before it starts, and replaces them whole."""
    from kit.report.staging import MARK, side

    out = tmp_path / "out"
    kit.export(run, out, formats=("specforge",))
    prev = side(out, "previous")
    (prev / "specforge").mkdir(parents=True)
    (prev / MARK).write_text(f"{out.resolve()}\n")
    os.replace(out / "manifest.json", prev / "manifest.json")
    os.replace(out / "specforge" / "train.jsonl", prev / "specforge" / "train.jsonl")
    assert not validate(out).ok
    time.sleep(0.01)
    result = kit.export(run, out, formats=("specforge",), overwrite=True)
    assert not prev.exists() and rows(out) == 30 and validate(out).ok
    assert json.loads((out / "manifest.json").read_text())["counts"] == result.manifest["counts"]


def test_a_short_write_fails_the_staged_check_and_is_not_swapped_in(run, tmp_path, monkeypatch):
    """The staged folder is checked without reading its files again (the writer hashed and
    counted the bytes it wrote): a file shorter on disk than the writer wrote, as a lost
    write would leave it, fails the check, and the previous export stays."""
    from kit.report import export as export_module
    from kit.report.export import ExportInvalid

    out = tmp_path / "out"
    kit.export(run, out, formats=("specforge",))
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    real = export_module.validate

    def after_a_lost_write(path, **kw):
        data = (path / "specforge" / "train.jsonl").read_bytes()
        (path / "specforge" / "train.jsonl").write_bytes(data[: len(data) // 2])
        return real(path, **kw)

    monkeypatch.setattr(export_module, "validate", after_a_lost_write)
    with pytest.raises(
        ExportInvalid, match=r"specforge/train.jsonl: \d+ bytes on disk, the export wrote \d+"
    ):
        kit.export(run, out, formats=("specforge",), overwrite=True)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert validate(out).ok
