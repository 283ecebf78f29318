"""The run store: round trip, fingerprints, torn lines, index speed, full disk."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import orjson
import polars as pl
import pytest

from kit.store import (
    FingerprintMismatch,
    RunStore,
    fingerprint,
    fingerprint_parts,
    progress,
    read_config,
    read_errors,
    records_frame,
)
from kit.types import ErrorRecord, Record, RunConfig, Sampling

ROOT = Path(__file__).resolve().parents[1]


def _config(**changes) -> RunConfig:
    base = dict(
        model="smol", endpoints=["http://127.0.0.1:1/v1"], sampling=Sampling(max_tokens=64),
        budgets={"alpaca": 300, "chat": 200}, source_hashes={"alpaca": "aa", "chat": "cc"},
        api_key_env="KIT_TEST_KEY",
    )  # fmt: skip
    return RunConfig(**(base | changes))


def _prompts() -> pl.DataFrame:
    rows = [
        {"dataset": ds, "prompt_id": f"{ds}-{i}", "messages": [{"role": "user", "content": f"q{i}"}], "n_turns": 1, "row": i}
        for ds in ("alpaca", "chat")
        for i in range(5)
    ]  # fmt: skip
    return pl.DataFrame(rows)


def _record(ds: str, i: int, tokens: int = 10, **kw) -> Record:
    return Record(
        dataset=ds, prompt_id=f"{ds}-{i}", sample=0, messages=[{"role": "user", "content": f"q{i}"}],
        completion="word " * tokens, finish_reason=kw.pop("finish", "stop"), completion_tokens=tokens,
        count_source="usage", t_done=time.time(), **kw,
    )  # fmt: skip


def test_round_trip(tmp_path):
    store = RunStore(tmp_path)
    store.init(_config(), _prompts())
    store.append(_record("alpaca", 0, 12, output_ids=[5, 6, 7], prompt_ids=[1, 2]))
    store.append(_record("alpaca", 1, 30, finish="length"))
    store.append(_record("chat", 0, 7))
    store.close()

    assert store.index() == {
        ("alpaca", "alpaca-0", 0): 12,
        ("alpaca", "alpaca-1", 0): 30,
        ("chat", "chat-0", 0): 7,
    }
    frame = records_frame(tmp_path).sort("dataset", "prompt_id")
    assert frame.columns == list(Record.__dataclass_fields__)
    assert frame["output_ids"].to_list() == [[5, 6, 7], None, None]
    assert frame["prompt_ids"].to_list()[0] == [1, 2]
    assert frame["messages"].to_list()[0] == [{"role": "user", "content": "q0"}]
    assert records_frame(tmp_path, datasets=["chat"])["dataset"].to_list() == ["chat"]
    assert read_config(tmp_path) == _config()
    assert pl.read_parquet(tmp_path / "prompts.parquet").equals(_prompts())
    doc = json.loads((tmp_path / "config.json").read_text())
    assert (
        doc["fingerprint"] == fingerprint(_config())
        and doc["config"]["api_key_env"] == "KIT_TEST_KEY"
    )


def test_progress_from_files(tmp_path):
    store = RunStore(tmp_path)
    store.init(_config(budgets={"alpaca": 40, "chat": 200}), _prompts())
    for i in range(3):
        store.append(_record("alpaca", i, 15))
    store.append(_record("chat", 0, 20, finish="length"))
    store.append_error(ErrorRecord("chat", "chat-1", 0, "timeout: read", 5, time.time()))
    store.close()
    by = {p.dataset: p for p in progress(tmp_path)}
    assert (by["alpaca"].tokens_done, by["alpaca"].samples_done, by["alpaca"].state) == (
        45,
        3,
        "budget_reached",
    )
    assert (by["chat"].tokens_done, by["chat"].truncated, by["chat"].errors) == (20, 1, 1)
    assert by["chat"].prompts_total == 5 and by["chat"].state == "stopped"


def test_fingerprint_mismatch_names_the_change(tmp_path):
    RunStore(tmp_path).init(_config(), _prompts())
    changed = _config(
        sampling=Sampling(max_tokens=128), source_hashes={"alpaca": "aa", "chat": "zz"}
    )
    with pytest.raises(FingerprintMismatch) as err:
        RunStore(tmp_path).init(changed)
    msg = str(err.value)
    assert "sampling.max_tokens: 64 -> 128" in msg and "source_hashes.chat: 'cc' -> 'zz'" in msg
    assert "model" not in msg and "force=True" in msg
    assert isinstance(err.value, ValueError)
    assert fingerprint_parts(changed)["sampling"]["max_tokens"] == 128


def test_budget_and_endpoint_changes_resume(tmp_path):
    RunStore(tmp_path).init(_config(), _prompts())
    new = _config(budgets={"alpaca": 900, "chat": 50}, endpoints=["http://h:2/v1"], concurrency=4)
    RunStore(tmp_path).init(new)
    assert read_config(tmp_path).budgets == {"alpaca": 900, "chat": 50}
    assert read_config(tmp_path).endpoints == ["http://h:2/v1"]


def test_force_records_new_fingerprint(tmp_path):
    RunStore(tmp_path).init(_config(), _prompts())
    new = _config(model="other")
    RunStore(tmp_path).init(new, force=True)
    doc = json.loads((tmp_path / "config.json").read_text())
    assert doc["fingerprint"] == fingerprint(new) != fingerprint(_config())


def test_torn_last_line_is_ignored_and_repaired(tmp_path):
    store = RunStore(tmp_path)
    store.init(_config(), _prompts())
    for i in range(3):
        store.append(_record("alpaca", i))
    store.close()
    path = tmp_path / "records" / "alpaca.jsonl"
    good = path.read_bytes()
    with open(path, "ab") as f:  # what a kill -9 mid-write leaves
        f.write(
            orjson.dumps(
                {"dataset": "alpaca", "prompt_id": "alpaca-3", "sample": 0, "completion_tokens": 9}
            )[:-5]
        )

    assert len(records_frame(tmp_path)) == 3  # readers never parse past the last newline
    assert len(RunStore(tmp_path).index()) == 3
    store = RunStore(tmp_path)
    store.init(_config(), None)
    assert path.read_bytes() == good and len(store.repaired) == 1
    log = [json.loads(line) for line in (tmp_path / "repair.log").read_text().splitlines()]
    assert log[0]["file"] == "records/alpaca.jsonl" and log[0]["bytes"] > 0
    store.append(_record("alpaca", 3))
    store.close()
    assert sorted(k[1] for k in store.index()) == ["alpaca-0", "alpaca-1", "alpaca-2", "alpaca-3"]


def test_errors_effective_set(tmp_path):
    store = RunStore(tmp_path)
    store.init(_config(), _prompts())
    store.append_error(ErrorRecord("chat", "chat-1", 0, "http_5xx: boom", 5, 1.0))
    store.append_error(ErrorRecord("chat", "chat-2", 0, "timeout: read", 5, 2.0))
    store.append(_record("chat", 1))  # a resume succeeded
    store.close()
    assert list(store.errors()) == [("chat", "chat-2", 0)]
    errs = read_errors(tmp_path).sort("prompt_id")
    assert errs["resolved"].to_list() == [True, False]


def test_index_of_100k_records_is_fast(tmp_path):
    text = "The quick brown fox jumps over the lazy dog. " * 10
    store = RunStore(tmp_path, flush_every=10_000)
    (tmp_path / "records").mkdir()
    for ds in ("a", "b", "c", "d"):
        for i in range(25_000):
            store.append(Record(
                dataset=ds, prompt_id=f"{i:016x}", sample=0, messages=[{"role": "user", "content": text[:200]}],
                completion=text, finish_reason="stop", completion_tokens=100 + i % 7, count_source="server_ids",
                prompt_tokens=50, output_ids=list(range(100)), endpoint="http://x/v1", latency_s=1.0, t_done=1.7e9,
            ))  # fmt: skip
    store.close()
    t0, c0 = time.perf_counter(), time.process_time()
    index = RunStore(tmp_path).index()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"index of {len(index)} records ({store.run_dir}): {wall:.2f} s wall, {cpu:.2f} s CPU")
    assert len(index) == 100_000
    assert sum(index.values()) == 4 * sum(100 + i % 7 for i in range(25_000))
    assert cpu < 2.0  # CPU time: the machine running the tests is shared


FULL_DISK = """
import resource, signal, sys, time
sys.path.insert(0, {root!r})
from kit.store import RunStore, StoreWriteError
from kit.types import Record
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
store = RunStore({run_dir!r}, flush_every=7)
(store.run_dir / "records").mkdir(parents=True)
resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
try:
    for i in range(10_000):
        store.append(Record("a", f"p{{i}}", 0, [{{"role": "user", "content": "x"}}], "y" * (i % 97),
                            "stop", i % 97, "usage", t_done=time.time()))
except StoreWriteError as e:
    print("STOPPED", e)
    sys.exit(0)
sys.exit(1)
"""


def test_full_disk_leaves_no_corrupt_line(tmp_path):
    run_dir = tmp_path / "run"
    code = textwrap.dedent(FULL_DISK.format(root=str(ROOT), run_dir=str(run_dir)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "STOPPED" in out.stdout and "no partial line was kept" in out.stdout
    data = (run_dir / "records" / "a.jsonl").read_bytes()
    assert data.endswith(b"\n") and 0 < len(data) <= 20_000
    lines = data.splitlines()
    assert [orjson.loads(line)["prompt_id"] for line in lines] == [
        f"p{i}" for i in range(len(lines))
    ]
    assert len(lines) % 7 == 0  # whole group flushes only


def test_lines_in_another_shape_are_parsed_and_garbage_skipped(tmp_path):
    store = RunStore(tmp_path)
    store.init(_config(), _prompts())
    store.append(_record("alpaca", 0, 11))
    store.close()
    foreign = {
        f: getattr(_record("alpaca", 1, 22), f) for f in Record.__dataclass_fields__
    }  # field order
    with open(tmp_path / "records" / "alpaca.jsonl", "ab") as f:
        f.write(orjson.dumps(foreign) + b"\n" + b'{"dataset": "alpaca", "prompt_id": \n')
    assert store.index() == {("alpaca", "alpaca-0", 0): 11, ("alpaca", "alpaca-1", 0): 22}
    assert records_frame(tmp_path)["completion_tokens"].to_list() == [11, 22]
