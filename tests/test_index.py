"""The resume index (kit/run/index.py): a scan from it equals a full scan, whatever happened
to the records file since; a restart's queues from it; kit watch's first read from it."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import polars as pl
import pytest
from faultserver import FaultConfig, FaultServer

import kit
from kit.run import index
from kit.run.lines import LINE_ORDER, corrupt_entries, record_files, scan_heads
from kit.run.progress import ProgressReader
from kit.run.queues import _datasets, seeded_order
from kit.run.store import RunStore
from kit.types import ErrorRecord, Record, RunConfig, Sampling

ROOT = Path(__file__).resolve().parents[1]


def _config(**changes) -> RunConfig:
    base = dict(model="m", endpoints=["http://127.0.0.1:1/v1"], sampling=Sampling(max_tokens=64),
                budgets={"a": 10**6, "b": 10**6}, source_hashes={"a": "aa", "b": "bb"})  # fmt: skip
    return RunConfig(**(base | changes))


def _prompts(n: int = 50) -> pl.DataFrame:
    rows = [
        {"dataset": ds, "prompt_id": f"{ds}-{i}", "messages": [{"role": "user", "content": f"q{i}"}], "n_turns": 1, "row": i}
        for ds in ("a", "b")
        for i in range(n)
    ]  # fmt: skip
    return pl.DataFrame(rows)


def _record(ds: str, i: int, tokens: int | None = None, **kw) -> Record:
    tokens = 5 + i % 13 if tokens is None else tokens
    return Record(
        dataset=ds, prompt_id=f"{ds}-{i}", sample=kw.pop("sample", 0),
        messages=[{"role": "user", "content": f"q{i}"}], completion="w " * tokens,
        finish_reason="length" if i % 4 == 0 else "stop", completion_tokens=tokens,
        count_source="usage", t_done=kw.pop("t_done", 1.7e9 + i), **kw,
    )  # fmt: skip


def _line(ds: str, i: int, **kw) -> bytes:
    """A record line as RunStore writes it (every field)."""
    rec = _record(ds, i, **kw)
    return orjson.dumps({f: getattr(rec, f) for f in LINE_ORDER}) + b"\n"


def _run(run_dir: Path, records: list[tuple[str, int]], *, scan: bool = False) -> RunStore:
    """A writer session: init (lock), optionally scan, append the records, close."""
    store = RunStore(run_dir)
    store.init(_config(), _prompts())
    if scan:
        store.scan()
    for ds, i in records:
        store.append(_record(ds, i))
    store.close()
    return store


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def reference(run_dir: Path) -> tuple[dict, list]:
    """What RunStore.scan() was before the index: lines.heads of every whole file."""
    out, corrupt = {}, []
    for path in record_files(run_dir).values():
        problems: list = []
        for head in scan_heads(path, problems):
            out.setdefault(head[:3], head[3:5])
        corrupt += corrupt_entries(path, problems)
    return out, corrupt


@pytest.fixture
def full_scans(monkeypatch) -> list:
    """The records files read in full by kit.run.index from now on."""
    calls: list = []
    real = index.full_scan

    def spy(path):
        calls.append(path.name)
        return real(path)

    monkeypatch.setattr(index, "full_scan", spy)
    return calls


def check_scan(run_dir: Path) -> None:
    """scan() and scan_frame() equal a full scan: the keys, first copies and corrupt lines."""
    want, want_corrupt = reference(run_dir)
    store = RunStore(run_dir)
    got = store.scan()
    assert dict(got) == want and list(got) == list(want)  # same keys, values and order
    assert got.corrupt == want_corrupt == store.corrupt
    frame = RunStore(run_dir).scan_frame()
    rows = {(d, p, s): (n, f) for d, p, s, n, f in frame.iter_rows()}
    assert rows == want and frame.height == len(want)


# ---------------------------------------------------------------- the index and a scan


def test_close_writes_an_index_a_scan_takes_whole(tmp_path, full_scans):
    _run(tmp_path, [(ds, i) for i in range(30) for ds in ("a", "b")])
    path = tmp_path / "records" / "a.jsonl"
    meta = json.loads((tmp_path / "index" / "a.json").read_text())
    assert meta["size"] == path.stat().st_size and meta["lines"] == meta["rows"] == 30
    assert meta["fast"] is True and meta["problems"] == [] and meta["file"] == "records/a.jsonl"
    frame = pl.read_parquet(tmp_path / "index" / "a.parquet")
    assert frame["prompt_id"].to_list() == [f"a-{i}" for i in range(30)]
    assert frame["t_done"].to_list() == [1.7e9 + i for i in range(30)]
    check_scan(tmp_path)
    assert full_scans == []  # every file came from its index
    assert not list((tmp_path / "index").glob("*.tmp"))


def test_records_after_the_index_are_read_from_the_tail(tmp_path, full_scans):
    _run(tmp_path, [("a", i) for i in range(20)])
    before = (tmp_path / "index" / "a.json").read_bytes()
    _run(tmp_path, [("a", i) for i in range(20, 35)])  # no scan: it cannot rewrite the index
    assert (tmp_path / "index" / "a.json").read_bytes() == before  # the old one, still valid
    _append(tmp_path / "records" / "a.jsonl", _line("a", 3, tokens=99))  # a duplicate key
    check_scan(tmp_path)
    assert RunStore(tmp_path).index()[("a", "a-3", 0)] != 99  # the first copy wins
    assert full_scans == []
    _run(tmp_path, [("a", 40), ("b", 0)], scan=True)  # scans, appends, rewrites both indexes
    meta = json.loads((tmp_path / "index" / "a.json").read_text())
    assert meta["size"] == (tmp_path / "records" / "a.jsonl").stat().st_size
    assert meta["lines"] == 37 and (tmp_path / "index" / "b.json").exists()
    check_scan(tmp_path)
    assert full_scans == []


def test_a_torn_tail_after_the_index_is_never_read_then_repaired(tmp_path, full_scans):
    _run(tmp_path, [("a", i) for i in range(10)])
    path = tmp_path / "records" / "a.jsonl"
    _append(path, _line("a", 10) + _line("a", 11)[:40])  # what a kill -9 mid-write leaves
    check_scan(tmp_path)
    assert ("a", "a-10", 0) in RunStore(tmp_path).scan() and len(RunStore(tmp_path).scan()) == 11
    store = RunStore(tmp_path)
    store.init(_config(), None)  # repair cuts the torn line
    assert store.repaired[0]["bytes"] == 40 and path.read_bytes().endswith(b"\n")
    store.close()
    check_scan(tmp_path)
    assert full_scans == []


def test_corrupt_lines_before_and_after_the_index_offset(tmp_path, full_scans):
    _run(tmp_path, [("a", i) for i in range(5)])
    path = tmp_path / "records" / "a.jsonl"
    _append(path, b"garbage\n" + _line("a", 5) + b'{"dataset": "a"}\n' + _line("a", 6))
    _run(tmp_path, [("a", 7)], scan=True)  # indexes the corrupt lines (read line by line)
    meta = json.loads((tmp_path / "index" / "a.json").read_text())
    assert meta["fast"] is False and [n for n, _ in meta["problems"]] == [6, 8]
    full_scans.clear()
    _append(path, _line("a", 8) + b"\x00\x00\n" + _line("a", 9) + b"[1, 2]\n")
    check_scan(tmp_path)
    assert full_scans == []  # index + tail, the tail read line by line as the whole file is
    lines = [c["line"] for c in RunStore(tmp_path).scan().corrupt]
    assert lines == [6, 8, 12, 14]
    _run(tmp_path, [], scan=True)  # the index now covers them all
    assert json.loads((tmp_path / "index" / "a.json").read_text())["size"] == path.stat().st_size
    _append(path, _line("a", 10)[:-30] + _line("a", 11))  # a tail the regex would take whole...
    check_scan(tmp_path)  # ...is read line by line, as the whole file is: the splice is corrupt
    assert [c["line"] for c in RunStore(tmp_path).scan().corrupt] == [6, 8, 12, 14, 15]
    assert full_scans == []


def test_a_regex_read_index_with_a_line_by_line_tail_is_dropped(tmp_path, full_scans):
    """lines.heads reads a file with one regex or line by line, and the two differ on a line
    whose head is whole but whose rest is not JSON: the index never mixes the two."""
    _run(tmp_path, [("a", i) for i in range(4)])
    path = tmp_path / "records" / "a.jsonl"
    spliced = _line("a", 4)[:-30] + _line("a", 5)  # a torn line someone appended to
    _append(path, spliced)
    _run(tmp_path, [("a", 6)], scan=True)
    meta = json.loads((tmp_path / "index" / "a.json").read_text())
    assert meta["fast"] is True and meta["problems"] == []  # the regex took the spliced line
    foreign = {f: getattr(_record("a", 7), f) for f in reversed(LINE_ORDER)}  # other key order
    _append(path, orjson.dumps(foreign) + b"\n")
    full_scans.clear()
    check_scan(tmp_path)  # now the whole file is read line by line: the spliced line is corrupt
    assert full_scans == ["a.jsonl"] * 2  # scan and scan_frame
    assert [c["line"] for c in RunStore(tmp_path).scan().corrupt] == [5]


def _shrink(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _edit_last_line(path: Path) -> None:
    data = bytearray(path.read_bytes())
    at = data.rindex(b'"attempts":1')
    data[at : at + 12] = b'"attempts":2'  # same size
    path.write_bytes(bytes(data))


def _edit_first_line(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[data.index(b'"completion_tokens":') + 20] ^= 1  # 5 -> 4: same size
    path.write_bytes(bytes(data))


def _rewrite_bigger(path: Path) -> None:
    path.write_bytes(b"".join(_line("a", i, tokens=7) for i in range(100, 400)))


@pytest.mark.parametrize("change", [_shrink, _edit_last_line, _edit_first_line, _rewrite_bigger])
def test_a_file_changed_in_the_indexed_region_rejects_its_index(tmp_path, full_scans, change):
    _run(tmp_path, [("a", i) for i in range(200)])
    path = tmp_path / "records" / "a.jsonl"
    assert index.load(path) is not None
    change(path)
    assert index.load(path) is None
    check_scan(tmp_path)
    assert full_scans == ["a.jsonl"] * 2  # scan and scan_frame: the whole file


def _garbage(folder: Path) -> None:
    (folder / "a.json").write_bytes(b"\x00not json")


def _other_version(folder: Path) -> None:
    meta = json.loads((folder / "a.json").read_text())
    (folder / "a.json").write_text(json.dumps(meta | {"version": 99}))


def _missing_field(folder: Path) -> None:
    meta = json.loads((folder / "a.json").read_text())
    del meta["problems"]
    (folder / "a.json").write_text(json.dumps(meta))


def _parquet_garbage(folder: Path) -> None:
    (folder / "a.parquet").write_bytes(b"PAR1 garbage PAR1")


def _parquet_of_another_file(folder: Path) -> None:
    (folder / "a.parquet").write_bytes((folder / "b.parquet").read_bytes())


def _parquet_gone(folder: Path) -> None:
    (folder / "a.parquet").unlink()


@pytest.mark.parametrize(
    "spoil",
    [_garbage, _other_version, _missing_field, _parquet_garbage, _parquet_of_another_file, _parquet_gone],
)  # fmt: skip
def test_a_spoiled_index_is_rejected_then_rewritten(tmp_path, full_scans, spoil):
    _run(tmp_path, [(ds, i) for i in range(12) for ds in ("a", "b")])
    spoil(tmp_path / "index")
    path = tmp_path / "records" / "a.jsonl"
    assert index.load(path) is None and index.load(tmp_path / "records" / "b.jsonl") is not None
    check_scan(tmp_path)
    _run(tmp_path, [], scan=True)  # a clean stop writes it again
    assert index.load(path) is not None


def test_a_record_that_would_not_read_back_the_same_is_not_indexed(tmp_path):
    store = RunStore(tmp_path)
    store.init(_config(), _prompts())
    store.append(_record("a", 0))
    store.append(dataclasses.replace(_record("a", 1), sample=True))  # written as `true`
    store.append(_record("b", 0))
    store.close()
    assert not (tmp_path / "index" / "a.json").exists() and (tmp_path / "index" / "b.json").exists()
    check_scan(tmp_path)
    assert RunStore(tmp_path).scan().corrupt[0]["problem"].startswith("sample True")


def test_heads_a_writer_keeps_equal_what_a_scan_reads(tmp_path, full_scans):
    heads = [("a", "a-0", 0, 5, "stop", 1.5), ("a", "é-ü-漢", 1, 0, None, 2.0),
             ("a/b", "a-0", 2, 2**62, "length", -3.25), ("a", "", 0, 7, "", 1e300)]  # fmt: skip
    added = index.Appended()
    added.add(heads[:2], 10)
    added.add(heads[2:], 20)
    assert added.frame().equals(index.to_frame(heads)) and added.bytes == 30
    store = RunStore(tmp_path)
    store.init(_config(), _prompts())
    for ds, pid, s, n, fin, t in heads:
        rec = dataclasses.replace(_record("a", 0), dataset=ds, prompt_id=pid, sample=s)
        store.append(dataclasses.replace(rec, completion_tokens=n, finish_reason=fin, t_done=t))
    store.close()
    frame = pl.read_parquet(tmp_path / "index" / "a_b.parquet")  # 'a/b' is a_b.jsonl
    assert frame.rows() == [heads[2]]
    assert pl.read_parquet(tmp_path / "index" / "a.parquet").rows() == heads[:2] + heads[3:]
    _run(tmp_path, [("a", i) for i in range(11, 30)], scan=True)
    assert json.loads((tmp_path / "index" / "a.json").read_text())["rows"] == 22
    check_scan(tmp_path)
    assert full_scans == []


def test_duplicates_across_files_first_file_wins(tmp_path):
    _run(tmp_path, [("a", 0), ("b", 0)])
    _append(tmp_path / "records" / "b.jsonl", _line("a", 0, tokens=77))  # a's key in b's file
    _append(tmp_path / "records" / "a.jsonl", _line("b", 0, tokens=88))  # b's key in a's file
    _run(tmp_path, [], scan=True)
    check_scan(tmp_path)
    assert RunStore(tmp_path).index()[("b", "b-0", 0)] == 88  # a.jsonl comes first


def test_a_store_that_only_reads_writes_no_index(tmp_path):
    _run(tmp_path, [("a", 0)])
    (tmp_path / "index" / "a.json").unlink()
    RunStore(tmp_path).scan()
    RunStore(tmp_path).close()
    assert not (tmp_path / "index" / "a.json").exists()


def test_line_start_and_repair_read_only_the_end(tmp_path):
    path = tmp_path / "f"
    long = b"x" * 200_000
    path.write_bytes(b"one\n" + long + b"\n" + long)  # a torn line longer than a read
    with open(path, "rb") as f:
        size = path.stat().st_size
        assert index.line_start(f, size + 1) == 4 + len(long) + 1  # the torn line's start
        assert index.line_start(f, 4 + len(long) + 1) == 4  # the last complete line's start
        assert index.line_start(f, 4) == 0
    (tmp_path / "records").mkdir()
    rec = tmp_path / "records" / "a.jsonl"
    rec.write_bytes(_line("a", 0) + long)
    store = RunStore(tmp_path)
    assert store.repair()[0]["bytes"] == len(long) and rec.read_bytes() == _line("a", 0)
    rec.write_bytes(long)  # no newline at all: nothing is a line
    assert RunStore(tmp_path).repair()[0]["bytes"] == len(long) and rec.read_bytes() == b""


# ---------------------------------------------------------------- a restart's queues


def test_queues_from_the_frame_equal_queues_from_the_dict(tmp_path):
    config = _config(sampling=Sampling(max_tokens=64, n=2), seed=3)
    store = RunStore(tmp_path)
    store.init(config, _prompts())
    rng = random.Random(0)
    for ds in ("a", "b"):
        for i in rng.sample(range(50), 30):
            store.append(_record(ds, i, sample=rng.randint(0, 1)))
    store.close()
    frame, skips = _prompts(), {("a", "a-7"): (900, 2), ("b", "b-1"): (901, 1)}
    by_dict = _datasets(frame, config, RunStore(tmp_path).scan(), {}, skips)
    by_frame = _datasets(frame, config, RunStore(tmp_path).scan_frame(), {}, skips)
    done = RunStore(tmp_path).scan()
    for name in ("a", "b"):
        a, b = by_dict[name], by_frame[name]
        assert list(a.queue) == list(b.queue) and a.tools == b.tools == {}
        ids = [f"{name}-{i}" for i in range(50)]
        want = [(p, s) for p, s in seeded_order(ids, name, 3, 2)
                if (name, p) not in skips and (name, p, s) not in done]  # fmt: skip
        assert [(p, s) for p, s, _ in a.queue] == want
        assert all(m == [{"role": "user", "content": f"q{p.split('-')[1]}"}] for p, _, m in a.queue)
        mine = [v for k, v in done.items() if k[0] == name]
        totals = (sum(t for t, _ in mine), len(mine), sum(f == "length" for _, f in mine))
        for d in (a, b):
            assert (d.tokens_done, d.samples_done, d.truncated) == totals
            assert (d.total, d.skipped) == (100, 2 if name == "a" else 1)


def test_queue_order_is_seeded_order_for_any_prompt_ids():
    rng = random.Random(5)
    chars = ["a", "Z", "é", "漢", "😀", "\x7f", " ", "0", "\uffff", "\ue000"]
    ids = list(dict.fromkeys("".join(rng.choices(chars, k=rng.randint(1, 6))) for _ in range(300)))
    rows = [{"dataset": "u", "prompt_id": p, "messages": [{"role": "user", "content": p}]} for p in ids]  # fmt: skip
    frame = pl.DataFrame(rows + rows[:5])  # a prompt twice: listed once
    config = _config(budgets={"u": 10**6}, sampling=Sampling(max_tokens=64, n=2), seed=11)
    got = _datasets(frame, config, {("u", ids[3], 0): (5, "stop")}, {}, {})["u"]
    want = [(p, s) for p, s in seeded_order(ids, "u", 11, 2) if (p, s) != (ids[3], 0)]
    assert [(p, s) for p, s, _ in got.queue] == want and got.total == 2 * len(ids)
    assert all(m == [{"role": "user", "content": p}] for p, _, m in got.queue)


# ---------------------------------------------------------------- kit watch's first read


def _reader_state(reader: ProgressReader) -> dict:
    return {
        stem: (t.tokens, t.samples, t.truncated, list(t.recent), t.resolved, t.lines, t.offset)
        for stem, t in reader._records.items()
    }


def test_progress_first_read_from_the_index_equals_a_full_read(tmp_path, monkeypatch):
    now = time.time()
    store = RunStore(tmp_path)
    store.init(_config(), _prompts())
    for i in range(40):
        store.append(_record("a" if i % 3 else "b", i, t_done=now - 40 + i))
    store.append_error(ErrorRecord("a", "a-1", 0, "timeout", 5, now))  # resolved by a record
    store.append_error(ErrorRecord("a", "a-90", 0, "timeout", 5, now))  # still failed
    store.close()
    path = tmp_path / "records" / "a.jsonl"
    _append(path, b"garbage\n" + _line("a", 41, t_done=now - 1) + _line("a", 42)[:30])
    _append(tmp_path / "records" / "b.jsonl", _line("b", 43, t_done=now))
    store = RunStore(tmp_path)  # a later session appended after the index, then a torn line
    reader = ProgressReader(tmp_path)
    got = reader.read()
    assert index.load(path).size < path.stat().st_size  # the index covers a part only
    monkeypatch.setattr(index, "load", lambda path: None)
    full = ProgressReader(tmp_path)
    want = full.read()
    strip = lambda ps: [dataclasses.replace(p, tokens_per_s=0.0) for p in ps]  # noqa: E731
    assert strip(got) == strip(want)
    assert _reader_state(reader) == _reader_state(full)
    assert reader.corrupt == full.corrupt == [{"file": "records/a.jsonl", "line": 27, "problem": reader.corrupt[0]["problem"]}]  # fmt: skip
    assert [p.errors for p in got] == [1, 0]
    assert got[0].tokens_per_s == pytest.approx(want[0].tokens_per_s, rel=0.05) and got[0].tokens_per_s > 0  # fmt: skip
    for stem, tail in reader._records.items():  # the marks a full read sets
        other = full._records[stem]
        assert (tail.first, tail.last_pos) == (other.first, other.last_pos) and tail.last
    _append(path, _line("a", 42)[30:] + _line("a", 44))  # the torn line completed, one more
    assert strip(reader.read()) == strip(full.read())
    assert _reader_state(reader) == _reader_state(full)
    assert reader._records["a"].samples == 26 + 1 + 2
    store.close()


# ---------------------------------------------------------------- kill -9 and resume

RUNNER = """
import json, sys
import polars as pl
import kit
args = json.loads(sys.argv[1])
kit.generate_sync(pl.read_parquet(args["prompts"]), kit.RunConfig.from_dict(args["config"]),
                  run_dir=args["run_dir"])
"""


def _lines(run_dir: Path) -> list[bytes]:
    out = []
    for path in sorted((run_dir / "records").glob("*.jsonl")):
        data = path.read_bytes()
        out += data[: data.rfind(b"\n") + 1].splitlines()
    return out


def test_resume_after_kill_9_takes_the_old_index_and_the_tail(tmp_path, full_scans):
    frame = pl.DataFrame([
        {"dataset": ds, "prompt_id": f"{ds}-{i:04d}", "messages": [{"role": "user", "content": f"{ds} task {i}"}], "n_turns": 1, "row": i}
        for ds in ("a", "b") for i in range(200)
    ])  # fmt: skip
    frame.write_parquet(tmp_path / "prompts.parquet")
    run_dir = tmp_path / "run"

    def config(url: str, budget: int) -> RunConfig:
        return RunConfig(model="fake", endpoints=url, budgets={"a": budget, "b": budget},
                         concurrency=8, retry_base=0.02, sampling={"max_tokens": 40})  # fmt: skip

    with FaultServer(FaultConfig(latency=0.02, min_words=5, max_words=30)) as srv:
        kit.generate_sync(frame, config(srv.base_url, 800), run_dir=run_dir)  # a clean stop
        old = {ds: json.loads((run_dir / "index" / f"{ds}.json").read_text()) for ds in "ab"}
        assert all(m["size"] == (run_dir / "records" / f"{ds}.jsonl").stat().st_size for ds, m in old.items())  # fmt: skip
        n0 = len(_lines(run_dir))
        srv.configure(hang_after=srv.stats()["requests"] + 60)  # it cannot finish: killed mid-run
        args = {"prompts": str(tmp_path / "prompts.parquet"), "run_dir": str(run_dir),
                "config": config(srv.base_url, 3000).to_dict()}  # fmt: skip
        env = os.environ | {"PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen([sys.executable, "-c", RUNNER, json.dumps(args)], env=env,
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while len(_lines(run_dir)) < n0 + 40 and proc.poll() is None:
                assert time.monotonic() < deadline, "the runner wrote too few records"
                time.sleep(0.01)
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(60)
        before = _lines(run_dir)
        now = {ds: json.loads((run_dir / "index" / f"{ds}.json").read_text()) for ds in "ab"}
        assert now == old  # a kill -9 writes no index: the old one stays, and is valid
        assert all(index.load(run_dir / "records" / f"{ds}.jsonl") is not None for ds in "ab")
        check_scan(run_dir)
        full_scans.clear()
        srv.configure(hang_after=None)
        run = kit.generate_sync(frame, config(srv.base_url, 3000), run_dir=run_dir)
        assert full_scans == []  # the resume read the old index and the tail only
    after = _lines(run_dir)
    keys = [tuple(orjson.loads(x)[k] for k in ("dataset", "prompt_id", "sample")) for x in after]
    assert not set(before) - set(after), "records lost"
    assert len(keys) == len(set(keys)), "duplicate keys"
    for row in run.summary().iter_rows(named=True):
        rows = [orjson.loads(x) for x in after]
        tokens = sum(r["completion_tokens"] for r in rows if r["dataset"] == row["dataset"])
        assert row["tokens_done"] == tokens and 0 <= tokens - 3000 <= 40
    meta = json.loads((run_dir / "index" / "a.json").read_text())
    assert meta["size"] == (run_dir / "records" / "a.jsonl").stat().st_size  # rewritten whole
    check_scan(run_dir)
