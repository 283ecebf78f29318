"""The run store: round trip, fingerprints, torn lines, index speed, full disk."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import orjson
import polars as pl
import pytest

from kit.run.store import (
    FingerprintMismatch,
    ProgressReader,
    RunStore,
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
        doc["fingerprint"] == _config().fingerprint()
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
    assert changed.fingerprint_parts()["sampling"]["max_tokens"] == 128


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
    assert doc["fingerprint"] == new.fingerprint() != _config().fingerprint()


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


@pytest.mark.slow
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
from kit.run.store import RunStore, StoreWriteError
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


# ---------------------------------------------------------------- incremental progress


def _strip(ps) -> list:
    """DatasetProgress list without tokens/s (it depends on the clock of each call)."""
    return [dataclasses.replace(p, tokens_per_s=0.0) for p in ps]


def _same(incremental, full, rates: bool = True) -> None:
    assert _strip(incremental) == _strip(full)
    for a, b in zip(incremental if rates else [], full, strict=False):
        assert a.tokens_per_s == pytest.approx(b.tokens_per_s, rel=0.05)


def test_progress_reader_matches_a_full_rescan(tmp_path):
    store = RunStore(tmp_path)
    store.init(_config(budgets={"alpaca": 10_000, "chat": 10_000}), _prompts())
    reader, want = ProgressReader(tmp_path), {"alpaca": [0, 0, 0], "chat": [0, 0, 0]}
    for batch in range(6):
        for i in range(batch * 7, batch * 7 + 7):
            ds = ("alpaca", "chat")[i % 2]
            finish = "length" if i % 5 == 0 else "stop"
            store.append(_record(ds, i, 10 + i, finish=finish))
            want[ds] = [want[ds][0] + 10 + i, want[ds][1] + 1, want[ds][2] + (finish == "length")]
        if batch == 1:  # chat-99 fails; batch 3 resolves it, chat-98 stays failed
            store.append_error(ErrorRecord("chat", "chat-99", 0, "timeout: read", 5, time.time()))
            store.append_error(ErrorRecord("chat", "chat-98", 0, "timeout: read", 5, time.time()))
        if batch == 3:
            store.append(_record("chat", 99, 5))
            want["chat"] = [want["chat"][0] + 5, want["chat"][1] + 1, want["chat"][2]]
        store.flush()
        got = reader.read()
        _same(got, progress(tmp_path))  # progress() = a fresh reader: a full rescan
        assert {p.dataset: [p.tokens_done, p.samples_done, p.truncated] for p in got} == want
        assert got[1].errors == (0 if batch < 1 else 2 if batch < 3 else 1)
        assert got[0].tokens_per_s > 0
    store.close()


def test_progress_reader_waits_for_a_torn_line_and_rescans_a_rewritten_file(tmp_path):
    store = RunStore(tmp_path)
    store.init(_config(budgets={"alpaca": 10_000, "chat": 10_000}), _prompts())
    for i in range(3):
        store.append(_record("alpaca", i, 10))
    store.close()
    path, reader = tmp_path / "records" / "alpaca.jsonl", ProgressReader(tmp_path)
    assert reader.read()[0].samples_done == 3
    line = path.read_bytes().splitlines(keepends=True)[0].replace(b'"alpaca-0"', b'"alpaca-3"')
    with open(path, "ab") as f:  # a record being written: the poll must not count it
        f.write(line[:40])
    assert (reader.read()[0].samples_done, reader.read()[0].tokens_done) == (3, 30)
    with open(path, "ab") as f:
        f.write(line[40:])
    assert (reader.read()[0].samples_done, reader.read()[0].tokens_done) == (4, 40)

    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + lines[1])  # shrank (e.g. cut back after a failed write)
    assert (reader.read()[0].samples_done, reader.read()[0].tokens_done) == (2, 20)
    bigger = line.replace(b'"completion_tokens":10', b'"completion_tokens":77')
    path.write_bytes(lines[0] + bigger + bigger.replace(b"alpaca-3", b"alpaca-4"))
    assert path.stat().st_size >= len(lines[0] + lines[1])  # shrank then regrew between polls
    got = reader.read()
    assert (got[0].samples_done, got[0].tokens_done) == (3, 10 + 77 + 77)
    _same(got, progress(tmp_path))


def _write_lines(path: Path, ds: str, start: int, count: int, t_done: float) -> int:
    """Append `count` record lines as RunStore writes them; returns their tokens."""
    from kit.run.lines import LINE_ORDER

    text, tokens = "The quick brown fox jumps over the lazy dog. " * 10, 0
    with open(path, "ab") as f:
        for i in range(start, start + count):
            rec = Record(
                dataset=ds, prompt_id=f"{i:016x}", sample=0, messages=[{"role": "user", "content": text[:200]}],
                completion=text, finish_reason="stop", completion_tokens=100 + i % 7, count_source="server_ids",
                prompt_tokens=50, output_ids=list(range(100)), endpoint="http://x/v1", latency_s=1.0, t_done=t_done,
            )  # fmt: skip
            f.write(orjson.dumps({k: getattr(rec, k) for k in LINE_ORDER}) + b"\n")
            tokens += rec.completion_tokens
    return tokens


@pytest.mark.slow
def test_progress_poll_of_100k_records_first_vs_incremental(tmp_path):
    names = ("a", "b", "c", "d")
    RunStore(tmp_path).init(_config(budgets=dict.fromkeys(names, 10**9), source_hashes={}))
    now, want = time.time(), dict.fromkeys(names, 0)
    for ds in names:
        want[ds] += _write_lines(tmp_path / "records" / f"{ds}.jsonl", ds, 0, 25_000, now - 99)
    size = sum(p.stat().st_size for p in (tmp_path / "records").glob("*.jsonl"))
    reader = ProgressReader(tmp_path)
    t0 = time.perf_counter()
    first = reader.read()
    t_first = time.perf_counter() - t0
    for ds in ("a", "c"):  # what a second of a busy run appends
        want[ds] += _write_lines(tmp_path / "records" / f"{ds}.jsonl", ds, 25_000, 50, now)
    t0 = time.perf_counter()
    polled = reader.read()
    t_inc = time.perf_counter() - t0
    t0 = time.perf_counter()
    full = progress(tmp_path)
    t_full = time.perf_counter() - t0
    print(
        f"\nprogress poll, 100,100 records ({size / 1e6:.0f} MB): first {1e3 * t_first:.0f} ms, "
        f"incremental {1e3 * t_inc:.1f} ms, full rescan {1e3 * t_full:.0f} ms "
        f"({t_full / t_inc:.0f}x)"
    )
    assert sum(p.samples_done for p in first) == 100_000
    assert {p.dataset: p.tokens_done for p in polled} == want
    _same(polled, full, rates=False)  # tokens/s: the calls are a second apart (clock-dependent)
    assert [p.tokens_per_s > 0 for p in polled] == [True, False, True, False]  # a, c appended now
    assert t_inc < t_full
