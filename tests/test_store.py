"""The run store (kit.run.store, kit.run.db, kit.run.reader): round trip, fingerprints, one
writer, duplicates refused and counted, damaged databases, older schemas upgraded, full disk
and kill -9 between commits."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import fields
from pathlib import Path

import polars as pl
import pytest

from kit.data.sources import prompt_id
from kit.run import db, reader
from kit.run.db import DatabaseDamaged
from kit.run.progress import progress
from kit.run.store import FingerprintMismatch, RunLocked, RunStore
from kit.types import COLUMNS, KEY, DatasetProgress, ErrorRecord, Record, RunConfig, Sampling

ROOT = Path(__file__).resolve().parents[1]
ENV = os.environ | {"PYTHONPATH": str(ROOT)}


def _config(**changes) -> RunConfig:
    base = dict(
        model="smol",
        endpoints=["http://127.0.0.1:1/v1"],
        sampling=Sampling(max_tokens=64),
        budgets={"alpaca": 300, "chat": 200},
        source_hashes={"alpaca": "aa", "chat": "cc"},
        api_key_env="KIT_TEST_KEY",
    )
    return RunConfig(**(base | changes))


def _messages(ds: str, i: int) -> list[dict]:
    return [{"role": "user", "content": f"{ds} q{i}"}]


def _pid(ds: str, i: int) -> str:
    return prompt_id(_messages(ds, i))


def _prompts(n: int = 5) -> pl.DataFrame:
    rows = [
        {
            "dataset": ds,
            "prompt_id": _pid(ds, i),
            "messages": _messages(ds, i),
            "n_turns": 1,
            "row": i,
        }
        for ds in ("alpaca", "chat")
        for i in range(n)
    ]
    return pl.DataFrame(rows)


def _record(ds: str, i: int, tokens: int = 10, **kw) -> Record:
    return Record(
        dataset=ds,
        prompt_id=_pid(ds, i),
        sample=0,
        messages=_messages(ds, i),
        completion="word " * tokens,
        finish_reason=kw.pop("finish", "stop"),
        completion_tokens=tokens,
        count_source="usage",
        t_done=time.time(),
        **kw,
    )


def _init(run_dir: Path, config: RunConfig, prompts=None, **kw) -> None:
    store = RunStore(run_dir)
    store.init(config, prompts, **kw)
    store.close()


def _unsound(run_dir: Path) -> bool:
    """SQLite's integrity check finds problems, or cannot open the database at all."""
    try:
        return db.integrity(run_dir) != []
    except DatabaseDamaged:
        return True


def _one_line(err: BaseException) -> str:
    msg = str(err)
    assert "\n" not in msg, msg
    return msg


def _sql(run_dir: Path, query: str, args=()) -> list[tuple]:
    conn = sqlite3.connect(f"{db.db_path(run_dir).as_uri()}?mode=ro", uri=True)
    try:
        return conn.execute(query, args).fetchall()
    finally:
        conn.close()


def _totals_match_records(run_dir: Path) -> dict:
    """The totals table, asserted equal to the sums over the records table."""
    summed = _sql(
        run_dir,
        "SELECT dataset, count(*), sum(completion_tokens), sum(finish_reason = 'length') "
        "FROM records GROUP BY dataset ORDER BY dataset",
    )
    stored = _sql(
        run_dir, "SELECT dataset, samples, tokens, truncated FROM totals ORDER BY dataset"
    )
    assert stored == summed
    return {ds: (s, t, x) for ds, s, t, x in stored}


# ---------------------------------------------------------------- round trip, config


def test_the_records_table_is_the_one_record_declares(tmp_path):
    """kit.types.Record declares the record's columns: the migrations make the records
    table of exactly its stored ones (type, NOT NULL, the key), the prompts table holds
    the others, and a Record written and read back is the Record (every kind encoded)."""
    db.connect(tmp_path, write=True).close()

    def made(table: str) -> dict:  # column -> (SQLite type, place in the primary key)
        rows = _sql(tmp_path, f"PRAGMA table_info({table})")
        return {name: (kind + " NOT NULL" * notnull, pk) for _, name, kind, notnull, _, pk in rows}

    stored = [c for c in COLUMNS.values() if c.table == "records"]
    assert made("records") == {
        c.name: (c.sql, KEY.index(c.name) + 1 if c.name in KEY else 0) for c in stored
    }
    assert reader.RECORD_COLUMNS == tuple(c.name for c in stored)
    assert reader.PROMPT_COLUMNS == ("messages", "tools", "dataset_answer")
    table = {"dataset_answer": "answer"}  # the prompts table's name of it
    assert {n: made("prompts")[table.get(n, n)][0] for n in reader.PROMPT_COLUMNS} == {
        n: COLUMNS[n].sql for n in reader.PROMPT_COLUMNS
    }
    assert set(reader.record_schema()) == set(COLUMNS) == {f.name for f in fields(Record)}
    rec = Record(
        "a",
        "p",
        0,
        _messages("a", 0),
        "x",
        "stop",
        3,
        "server_ids",
        prompt_tokens=4,
        output_ids=[1, 2**32 - 1],
        prompt_ids=[],
        endpoint="http://h/v1",
        latency_s=0.5,
        attempts=2,
        t_done=1.5,
        reasoning="r",
        tools=[{"type": "function"}],
        turns=[{"content": "y"}],
        tool_calls=[{"id": "c"}],
    )
    prompt = {"dataset": "a", "prompt_id": "p", "messages": rec.messages, "n_turns": 1, "row": 0}
    store = RunStore(tmp_path / "run")
    store.init(
        _config(budgets={"a": 10}), pl.DataFrame([prompt | {"tools": json.dumps(rec.tools)}])
    )
    store.append(rec)
    store.close()
    assert list(reader.records(tmp_path / "run")) == [rec]


def test_round_trip(tmp_path):
    store = RunStore(tmp_path)
    store.init(_config(), _prompts())
    store.append(_record("alpaca", 0, 12, output_ids=[5, 6, 2**32 - 1], prompt_ids=[1, 2]))
    store.append(_record("alpaca", 1, 30, finish="length", reasoning="hmm"))
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"é": 1}'}}]
    store.append(_record("chat", 0, 7, tool_calls=calls))
    store.close()

    done = RunStore(tmp_path)
    done.init(_config())
    keys, totals = done.done().sort("dataset", "prompt_id"), done.totals()
    done.close()
    want = sorted(
        [
            ("alpaca", _pid("alpaca", 0), 0),
            ("alpaca", _pid("alpaca", 1), 0),
            ("chat", _pid("chat", 0), 0),
        ]
    )
    assert sorted(keys.rows()) == want and totals == {"alpaca": (2, 42, 1), "chat": (1, 7, 0)}

    frame = reader.records_frame(tmp_path).sort("dataset", "completion_tokens")
    assert frame.columns == [*reader.RECORD_COLUMNS, *reader.PROMPT_COLUMNS]
    assert frame["output_ids"].to_list() == [[5, 6, 2**32 - 1], None, None]
    assert frame["prompt_ids"].to_list()[0] == [1, 2]
    assert frame["reasoning"].to_list() == [None, "hmm", None]
    assert [c and json.loads(c) for c in frame["tool_calls"]] == [None, None, calls]  # JSON text
    assert _sql(tmp_path, "SELECT count(*) FROM records WHERE tool_calls IS NULL") == [(2,)]
    assert frame["messages"].to_list()[0] == _messages("alpaca", 0)
    assert reader.records_frame(tmp_path, datasets=["chat"])["dataset"].to_list() == ["chat"]
    back = {r.key: r for r in reader.records(tmp_path)}
    assert back[("alpaca", _pid("alpaca", 1), 0)].completion == "word " * 30
    assert back[("chat", _pid("chat", 0), 0)].tool_calls == calls
    assert back[("alpaca", _pid("alpaca", 0), 0)].tool_calls is None
    assert reader.read_config(tmp_path) == _config()
    prompts = reader.prompts_frame(tmp_path).sort("dataset", "row")
    assert (
        prompts.select("dataset", "prompt_id", "messages").rows()
        == _prompts().select("dataset", "prompt_id", "messages").rows()
    )
    [(fingerprint, doc)] = _sql(tmp_path, "SELECT fingerprint, doc FROM config")
    assert fingerprint == _config().fingerprint()
    assert json.loads(doc)["api_key_env"] == "KIT_TEST_KEY"
    assert _totals_match_records(tmp_path)["alpaca"] == (2, 42, 1)
    assert db.integrity(tmp_path) == []


def test_progress_from_the_database(tmp_path):
    store = RunStore(tmp_path)
    store.init(_config(budgets={"alpaca": 40, "chat": 200}), _prompts())
    for i in range(3):
        store.append(_record("alpaca", i, 15))
    store.append(_record("chat", 0, 20, finish="length"))
    store.append_error(ErrorRecord("chat", _pid("chat", 1), 0, "timeout: read", 5, time.time()))
    store.close()
    by = {p.dataset: p for p in progress(tmp_path)}
    alpaca = by["alpaca"]
    assert (alpaca.tokens_done, alpaca.samples_done, alpaca.state) == (45, 3, "budget_reached")
    assert (by["chat"].tokens_done, by["chat"].truncated, by["chat"].errors) == (20, 1, 1)
    assert by["chat"].prompts_total == 5 and by["chat"].state == "stopped"


def test_progress_counts_only_committed_records(tmp_path):
    store = RunStore(tmp_path, flush_every=3, flush_interval=1e9)
    store.init(_config(), _prompts())
    store.append(_record("alpaca", 0, 11))
    store.append(_record("alpaca", 1, 11))
    assert progress(tmp_path)[0].samples_done == 0  # buffered, not committed: not counted
    store.append(_record("alpaca", 2, 11))
    assert (progress(tmp_path)[0].samples_done, progress(tmp_path)[0].tokens_done) == (3, 33)
    store.close()


def test_fingerprint_mismatch_names_the_change(tmp_path):
    _init(tmp_path, _config(), _prompts())
    changed = _config(
        sampling=Sampling(max_tokens=128), source_hashes={"alpaca": "aa", "chat": "zz"}
    )
    with pytest.raises(FingerprintMismatch) as err:
        _init(tmp_path, changed)
    msg = str(err.value)
    assert "sampling.max_tokens: 64 -> 128" in msg and "source_hashes.chat: 'cc' -> 'zz'" in msg
    assert "model" not in msg and "force=True" in msg
    assert isinstance(err.value, ValueError)
    assert changed.fingerprint_parts()["sampling"]["max_tokens"] == 128
    assert reader.read_config(tmp_path) == _config()  # the refused config was not stored


def test_budget_and_endpoint_changes_resume(tmp_path):
    _init(tmp_path, _config(), _prompts())
    new = _config(budgets={"alpaca": 900, "chat": 50}, endpoints=["http://h:2/v1"], concurrency=4)
    _init(tmp_path, new)
    assert reader.read_config(tmp_path).budgets == {"alpaca": 900, "chat": 50}
    assert reader.read_config(tmp_path).endpoints == ["http://h:2/v1"]


def test_force_records_new_fingerprint(tmp_path):
    _init(tmp_path, _config(), _prompts())
    new = _config(model="other")
    _init(tmp_path, new, force=True)
    [(fingerprint,)] = _sql(tmp_path, "SELECT fingerprint FROM config")
    assert fingerprint == new.fingerprint() != _config().fingerprint()


def test_errors_effective_set(tmp_path):
    store = RunStore(tmp_path)
    store.init(_config(), _prompts())
    store.append_error(ErrorRecord("chat", _pid("chat", 1), 0, "http_5xx: boom", 5, 1.0))
    store.append_error(ErrorRecord("chat", _pid("chat", 2), 0, "timeout: read", 5, 2.0))
    store.append(_record("chat", 1))  # a resume succeeded
    store.close()
    errs = reader.errors_frame(tmp_path).sort("t")
    assert errs["resolved"].to_list() == [True, False]
    assert errs.filter(~errs["resolved"]).select("dataset", "prompt_id", "sample").rows() == [
        ("chat", _pid("chat", 2), 0)
    ]


# ---------------------------------------------------------------- one writer


SECOND_WRITER = """
import json, sys
from kit.run.store import RunLocked, RunStore
from kit.types import RunConfig
try:
    RunStore(sys.argv[1]).init(RunConfig.from_dict(json.loads(sys.argv[2])))
except RunLocked as e:
    print(e)
    sys.exit(3)
"""


def _second_writer(run_dir: Path) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-c", SECOND_WRITER, str(run_dir), json.dumps(_config().to_dict())]
    return subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=120)


def test_a_second_writer_process_is_refused_naming_the_holder(tmp_path):
    store = RunStore(tmp_path)
    store.init(_config(), _prompts())
    store.append(_record("alpaca", 0))
    out = _second_writer(tmp_path)
    assert out.returncode == 3, out.stderr[-2000:]
    line = out.stdout.strip()
    assert "\n" not in line and f"pid {os.getpid()} on " in line and "another kit run" in line
    assert reader.state(tmp_path, "writer").startswith(f"pid {os.getpid()} on ")
    with pytest.raises(RunLocked) as err:  # a second writer in this same process, too
        _init(tmp_path, _config())
    assert "same process" in _one_line(err.value) and f"pid {os.getpid()} " in str(err.value)
    store.close()
    out = _second_writer(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]  # the lock went with close()
    assert len(reader.records_frame(tmp_path)) == 1


OTHER_CONNECTION = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1])
conn.execute("SELECT count(*) FROM records").fetchone()
conn.close()
"""


def test_a_refused_writer_in_the_same_process_leaves_the_holder_whole(tmp_path):
    """After a second RunStore in the holder's process is refused, another process that
    opens and closes the database (a refused `kit generate`, a sqlite3 shell) must not take
    the holder's write-ahead log away: what the holder commits next stays visible and kept."""
    store = RunStore(tmp_path, flush_every=1000, flush_interval=1e9)
    store.init(_config(), _prompts())
    store.append(_record("alpaca", 0))
    store.flush()
    with pytest.raises(RunLocked):
        RunStore(tmp_path).init(_config())
    subprocess.run(
        [sys.executable, "-c", OTHER_CONNECTION, str(db.db_path(tmp_path))], check=True, timeout=120
    )
    wal_kept = db.db_path(tmp_path).with_name("run.sqlite-wal").exists()
    for i in range(1, 4):
        store.append(_record("alpaca", i))
    store.flush()
    try:
        seen = _sql(tmp_path, "SELECT count(*) FROM records")[0][0]
    except sqlite3.Error as e:  # what a reader gets today: "disk I/O error"
        seen = str(e)
    store.close()
    assert (wal_kept, seen) == (True, 4)


def _writer(run_dir: Path, locked: bool, **kw) -> RunStore:
    store = RunStore(run_dir, **kw)
    if not locked:
        store._take_lock = lambda: None  # what deleting or ignoring the lock would do
    store.init(_config(), _prompts(40))
    return store


def test_two_writers_past_the_lock_store_each_record_once(tmp_path):
    first = _writer(tmp_path, locked=True, flush_every=5)
    second = _writer(tmp_path, locked=False, flush_every=3)
    keys_a = [(ds, i) for ds in ("alpaca", "chat") for i in range(0, 30)]
    keys_b = [(ds, i) for ds in ("alpaca", "chat") for i in range(10, 40)]

    failed = []

    def write(store: RunStore, keys: list, seed: int) -> None:
        try:
            for ds, i in random.Random(seed).sample(keys, len(keys)):
                store.append(_record(ds, i, 10 + i, finish="length" if i % 4 == 0 else "stop"))
            store.flush()
        except Exception as e:  # noqa: BLE001 - reported below, in the test's thread
            failed.append(e)

    threads = [
        threading.Thread(target=write, args=(first, keys_a, 1)),
        threading.Thread(target=write, args=(second, keys_b, 2)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    first.close()
    second.close()
    assert not failed, failed

    rows = _sql(tmp_path, "SELECT dataset, prompt_id, sample FROM records")
    assert len(rows) == len(set(rows)) == 2 * 40  # every key once
    overlap = 2 * 20
    assert first.rejected + second.rejected == overlap
    assert reader.state(tmp_path, "rejected") == str(overlap)
    totals = _totals_match_records(tmp_path)  # each record counted once
    assert totals["alpaca"][:2] == (40, sum(10 + i for i in range(40)))


def test_a_record_stored_twice_by_one_writer_is_refused_and_counted(tmp_path):
    store = RunStore(tmp_path)
    store.init(_config(), _prompts())
    store.append(_record("alpaca", 0, 10))
    store.flush()
    store.append(_record("alpaca", 0, 99))  # e.g. a resume that regenerated a stored key
    store.close()
    assert store.rejected == 1 and reader.state(tmp_path, "rejected") == "1"
    assert _totals_match_records(tmp_path)["alpaca"] == (1, 10, 0)
    assert reader.records_frame(tmp_path)["completion_tokens"].to_list() == [10]


# ---------------------------------------------------------------- damage


def _made_run(run_dir: Path, n: int = 3000) -> Path:
    store = RunStore(run_dir, flush_every=500)
    store.init(_config(), _prompts(n))
    for i in range(n):
        store.append(
            _record(("alpaca", "chat")[i % 2], i, 5 + i % 9, output_ids=list(range(i % 20)))
        )
    store.close()
    assert db.integrity(run_dir) == []
    return run_dir


def _read_everything(run_dir: Path) -> None:
    for _ in reader.record_batches(run_dir, prompts=True):
        pass
    reader.errors_frame(run_dir)
    reader.prompts_frame(run_dir)


def test_a_truncated_database_is_reported_in_one_line(tmp_path):
    run_dir = _made_run(tmp_path / "run")
    path = db.db_path(run_dir)
    size = path.stat().st_size
    os.truncate(path, size // 2)
    with pytest.raises(DatabaseDamaged) as err:
        _read_everything(run_dir)
    msg = _one_line(err.value)
    assert str(path) in msg and "damaged" in msg and "integrity_check" in msg
    assert _unsound(run_dir)


def test_overwritten_pages_are_reported_in_one_line(tmp_path):
    run_dir = _made_run(tmp_path / "run")
    path = db.db_path(run_dir)
    size = path.stat().st_size
    garbage = random.Random(5).randbytes(size // 5)
    with open(path, "r+b") as f:  # a fifth of the file, from its middle, overwritten
        f.seek(size * 2 // 5)
        f.write(garbage)
    with pytest.raises(DatabaseDamaged) as err:
        _read_everything(run_dir)
    assert str(path) in _one_line(err.value)
    assert _unsound(run_dir)


def test_a_file_that_is_no_database_is_reported_in_one_line(tmp_path):
    db.db_path(tmp_path).write_bytes(b"not a database at all\n" * 400)
    with pytest.raises(DatabaseDamaged) as err:
        reader.read_config(tmp_path)
    assert "damaged" in _one_line(err.value)


def _m001_database(run_dir: Path, n: int = 5) -> None:
    """A run database as kit wrote it before m002 (M001's schema only): prompts and records."""
    run_dir.mkdir(parents=True)
    conn = sqlite3.connect(db.db_path(run_dir), isolation_level=None)
    conn.execute("CREATE TABLE migrations (name TEXT PRIMARY KEY, t REAL NOT NULL)")
    conn.executescript(
        f"BEGIN; {db.MIGRATIONS[0][1]}; INSERT INTO migrations VALUES ('m001_schema', 0); COMMIT;"
    )
    conn.execute(
        "INSERT INTO config VALUES (1, ?, ?)",
        (_config().fingerprint(), json.dumps(_config().to_dict())),
    )
    for rows in db.prompt_rows(_prompts(n)):  # M001's eight columns (no answer)
        conn.executemany(
            "INSERT INTO prompts VALUES (?, ?, ?, ?, ?, ?, ?, ?)", [r[:8] for r in rows]
        )
    conn.executemany(
        db.RECORD_SQL,
        [db.record_row(_record(ds, i, 3 + i)) for ds in ("alpaca", "chat") for i in range(3)],
    )
    conn.executemany(db.TOTALS_SQL, [(ds, 3, 12, 0) for ds in ("alpaca", "chat")])
    conn.close()


@pytest.mark.parametrize("first", ["reader", "writer"])
def test_a_database_of_the_m001_schema_is_upgraded_whole(tmp_path, first):
    run_dir = tmp_path / "run"
    _m001_database(run_dir)
    before = _sql(run_dir, "SELECT * FROM prompts ORDER BY dataset, prompt_id")
    if first == "reader":  # kit watch or export on an old run: upgraded, then read
        assert [p.samples_done for p in progress(run_dir)] == [3, 3]
    else:
        _init(run_dir, _config())
    assert [n for (n,) in _sql(run_dir, "SELECT name FROM migrations ORDER BY t")] == [
        name for name, _ in db.MIGRATIONS
    ]
    after = _sql(run_dir, "SELECT * FROM prompts ORDER BY dataset, prompt_id")
    assert [r[:-1] for r in after] == before and {r[-1] for r in after} == {None}  # no answer
    assert db.integrity(run_dir) == []
    keys = reader.prompts_frame(run_dir, text=False)
    assert keys.columns == ["dataset", "prompt_id"] and keys.height == 10
    got = reader.prompts_frame(
        run_dir, datasets=["chat"], ids=[_pid("chat", 4), _pid("chat", 1), "nope"]
    )
    assert sorted(got["messages"].to_list(), key=str) == [
        _messages("chat", 1),
        _messages("chat", 4),
    ]
    frame = reader.records_frame(run_dir).sort("dataset", "completion_tokens")
    assert frame["messages"].to_list() == [
        _messages(ds, i) for ds in ("alpaca", "chat") for i in range(3)
    ]
    store = RunStore(run_dir)
    store.init(_config())
    store.add_prompts(_prompts(6))  # prompts are added, a key stored already is not twice
    assert store.done().height == 6 and store.totals() == {"alpaca": (3, 12, 0), "chat": (3, 12, 0)}
    store.close()
    assert _sql(run_dir, "SELECT count(*), count(DISTINCT dataset || prompt_id) FROM prompts") == [
        (12, 12)
    ]


def test_key_reads_touch_the_indexes_only(tmp_path):
    """What a restart and kit watch read of every prompt and record never reaches a text page."""
    _init(tmp_path, _config(), _prompts())
    conn = sqlite3.connect(f"{db.db_path(tmp_path).as_uri()}?mode=ro", uri=True)
    plan = lambda q, *a: " ".join(r[-1] for r in conn.execute(f"EXPLAIN QUERY PLAN {q}", a))  # noqa: E731
    assert "COVERING INDEX prompts_key" in plan(
        "SELECT dataset, count(*) FROM prompts GROUP BY dataset"
    )
    assert "COVERING INDEX prompts_key" in plan("SELECT dataset, prompt_id FROM prompts")
    assert "COVERING INDEX records_done" in plan(
        "SELECT dataset, prompt_id, sample, completion_tokens, finish_reason FROM records INDEXED BY records_done"
    )
    assert "INDEX prompts_key (dataset=? AND prompt_id=?)" in plan(
        "SELECT messages FROM prompts INDEXED BY prompts_key WHERE dataset = ? AND prompt_id IN (SELECT value FROM json_each(?))",
        "a",
        "[]",
    )
    conn.close()


def test_a_resume_reads_prompt_texts_as_its_queue_reaches_them(tmp_path, monkeypatch):
    from kit.run import queues

    monkeypatch.setattr(queues.PromptQueue, "BATCH", 2)
    _init(tmp_path, _config(), _prompts())
    store = RunStore(tmp_path)
    store.init(_config())
    store.append(_record("alpaca", 3))
    frame = queues.prompt_frame(None, tmp_path)  # keys only
    data = queues.dataset_queues(frame, _config(), store.done(), {}, {}, tmp_path)
    store.close()
    q = data["alpaca"].queue
    assert len(q) == 4 and q.messages == {}  # nothing read up front
    order = [
        pid
        for pid, _ in queues.seeded_order(
            frame.filter(pl.col("dataset") == "alpaca")["prompt_id"], "alpaca", 0
        )
    ]
    order.remove(_pid("alpaca", 3))
    want = {_pid("alpaca", i): _messages("alpaca", i) for i in range(5)}
    first = q.popleft()
    assert first == (order[0], 0, want[order[0]]) and len(q.messages) == 2  # one batch read
    sent = [first] + [q.popleft() for _ in range(3)]
    assert [pid for pid, _, _ in sent] == order and not q
    assert all(m == want[pid] for pid, _, m in sent)
    q.appendleft(sent[-1])  # a failed request goes back first
    assert q[0] == sent[-1]


def test_a_resume_refuses_a_prompt_changed_in_the_database(tmp_path):
    from kit.run import queues

    _init(tmp_path, _config(), _prompts())
    conn = sqlite3.connect(db.db_path(tmp_path))
    conn.execute("UPDATE prompts SET messages = '[[\"user\",\"edited\"]]' WHERE dataset = 'chat'")
    conn.commit()
    conn.close()
    with reader.open_db(tmp_path) as conn:
        done = reader.done_frame(conn)  # none
    data = queues.dataset_queues(
        queues.prompt_frame(None, tmp_path), _config(), done, {}, {}, tmp_path
    )
    assert data["alpaca"].queue.popleft()[2][0]["content"].startswith("alpaca q")
    with pytest.raises(reader.PromptMismatch, match="'chat'"):
        data["chat"].queue.popleft()


# ---------------------------------------------------------------- full disk, kill -9


FULL_DISK = """
import resource, signal, sys, time
from kit.run.store import RunStore, StoreWriteError
from kit.types import Record, RunConfig
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
store = RunStore(sys.argv[1], flush_every=7, flush_interval=1e9)
store.init(RunConfig(model="smol", endpoints="http://127.0.0.1:1/v1", budgets={"d0": 10**9}))
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
try:
    for i in range(100_000):
        store.append(Record("a", f"p{i}", 0, [], "y" * (i % 97), "stop", i % 97, "usage", t_done=time.time()))
except StoreWriteError as e:
    print("STOPPED", e)
    sys.exit(0)
sys.exit(1)
"""


def test_full_disk_keeps_whole_commits_only(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FULL_DISK), str(run_dir)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "STOPPED" in out.stdout and "nothing half-written was kept" in out.stdout
    rows = _sql(
        run_dir, "SELECT prompt_id, completion, completion_tokens FROM records ORDER BY rowid"
    )
    assert 0 < len(rows) and len(rows) % 7 == 0  # whole commits only
    assert rows == [(f"p{i}", "y" * (i % 97), i % 97) for i in range(len(rows))]
    _totals_match_records(run_dir)
    assert db.integrity(run_dir) == []


DURABLE = """
import sys, time
from kit.run.store import RunStore
from kit.types import Record, RunConfig
run_dir, every, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store = RunStore(run_dir, flush_every=every, flush_interval=1e9)
store.init(RunConfig(model="smol", endpoints="http://127.0.0.1:1/v1", budgets={"d0": 10**9}))
print("ready", flush=True)
for i in range(start, 10**9):
    store.append(Record(f"d{i % 3}", f"p{i}", 0, [], f"text {i} " * (i % 41), "length" if i % 5 == 0 else "stop",
                        i % 41, "server_ids", output_ids=[i % 7919 + j for j in range(i % 41)], t_done=time.time()))
    if (i + 1) % every == 0:
        print(i + 1, flush=True)  # every record up to i is committed: append() flushed
"""


def _expected(i: int) -> tuple:
    return (
        f"d{i % 3}",
        f"p{i}",
        f"text {i} " * (i % 41),
        i % 41,
        [i % 7919 + j for j in range(i % 41)],
    )


def _kill_writer_after(run_dir: Path, every: int, start: int, target: int, rng) -> int:
    """Run DURABLE from record `start` until `target` records are acknowledged, SIGKILL it
    a random moment later; returns the highest count it acknowledged as committed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", DURABLE, str(run_dir), str(every), str(start)],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    acked = start
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-2000:]
        while acked < target:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()[-2000:]
            acked = int(line)
        time.sleep(rng.random() * 0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
    return max([acked, *(int(x) for x in proc.stdout.read().split())])


def test_kill_9_between_commits_loses_no_committed_record(tmp_path):
    """A writer appends records (a commit every k) and is SIGKILLed at a random moment,
    five times on one database: every acknowledged record is there and whole, none twice,
    and what is stored is whole commits; the totals equal the records' sums."""
    rng = random.Random(22)
    run_dir, every, stored = tmp_path / "run", 13, 0
    for trial in range(5):
        acked = _kill_writer_after(run_dir, every, stored, stored + rng.randint(1, 400), rng)
        cols = ["dataset", "prompt_id", "completion", "completion_tokens", "output_ids"]
        got = reader.records_frame(run_dir, prompts=False).select(cols).rows()  # commit order
        stored = len(got)
        assert stored >= acked, f"trial {trial}: {acked} acknowledged, {stored} stored"
        assert stored % every == 0, f"trial {trial}: a partial commit of {stored % every}"
        assert got == [_expected(i) for i in range(stored)], f"trial {trial}"
        _totals_match_records(run_dir)
    assert db.integrity(run_dir) == []
    with reader.open_db(run_dir) as conn:
        assert sum(s for s, _, _ in reader.totals(conn).values()) == stored


def test_prompt_counts_are_kept_by_the_writer_and_read_without_counting(tmp_path, monkeypatch):
    """The writer counts the prompts it adds (ignored duplicates not; ids that are not
    content hashes apart), in the transaction that adds them; progress reads that count,
    and the live runner's tokens/s, never the prompts' keys or the records' tail."""
    custom = pl.DataFrame(
        [
            {
                "dataset": "chat",
                "prompt_id": "mine-1",
                "messages": _messages("chat", 99),
                "n_turns": 1,
                "row": 9,
            }
        ]
    )
    store = RunStore(tmp_path)
    store.init(_config(), pl.concat([_prompts(), _prompts(3)]))  # 3 of each dataset twice
    store.add_prompts(custom)
    store.append(_record("chat", 0, 20))
    store.write_status(
        [
            DatasetProgress(
                dataset="chat", budget=200, in_flight=4, tokens_per_s=12.5, state="running"
            )
        ]
    )
    store.close()
    counted = dict(_sql(tmp_path, "SELECT dataset, count(*) FROM prompts GROUP BY dataset"))
    with reader.open_db(tmp_path) as conn:
        assert reader.prompt_state(conn) == {
            "counts": counted,
            "custom_ids": {"alpaca": 0, "chat": 1},
        }
    assert counted == {"alpaca": 5, "chat": 6}
    seen: list[str] = []
    monkeypatch.setattr(db, "connect", _tracing(db.connect, seen))
    by = {p.dataset: p for p in progress(tmp_path)}
    assert (by["chat"].prompts_total, by["alpaca"].prompts_total) == (6, 5)
    assert (by["chat"].tokens_per_s, by["chat"].in_flight, by["alpaca"].tokens_per_s) == (
        12.5,
        4,
        0.0,
    )
    assert seen and not [q for q in seen if "FROM prompts" in q or "t_done" in q]
    assert progress(tmp_path, stale_s=0.0)[1].tokens_per_s == 0.0  # not live: no rate


def _tracing(connect, seen: list):
    """db.connect whose connections record every SQL statement they run."""

    def traced(*args, **kw):
        conn = connect(*args, **kw)
        conn.set_trace_callback(seen.append)
        return conn

    return traced


def test_a_database_without_prompt_counts_gets_them_from_its_writer(tmp_path):
    _init(tmp_path, _config(), _prompts())
    conn = sqlite3.connect(db.db_path(tmp_path))
    conn.execute("DELETE FROM state WHERE key = 'prompts'")  # as kit wrote it before the count
    conn.commit()
    conn.close()
    assert {p.dataset: p.prompts_total for p in progress(tmp_path)} == {"alpaca": 5, "chat": 5}
    _init(tmp_path, _config())  # a restart: counted once, custom ids unknown from then on
    with reader.open_db(tmp_path) as conn:
        assert reader.prompt_state(conn) == {"counts": {"alpaca": 5, "chat": 5}, "custom_ids": {}}
