"""The writer of a run directory: its SQLite database (kit.run.db), one writer at a time.

RunStore.init takes an exclusive flock on run.sqlite itself and names its pid in the `state`
table; a second writer gets RunLocked naming it (the kernel drops the lock when the process
ends, even by kill -9). The primary key (dataset, prompt_id, sample) refuses a second copy
of a record, counted (state "rejected"). Records and errors are committed together every
`flush_every` records or `flush_interval` seconds and on close, with the totals they add
(synchronous=FULL): a kill -9 loses at most the uncommitted batch, never a torn one. A
failed commit (full disk) is rolled back and raises StoreWriteError.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import os
import socket
import sqlite3
import time
from contextlib import contextmanager, suppress
from dataclasses import asdict, astuple
from pathlib import Path

from kit.errors import ConfigError, FingerprintMismatch, RunLocked, StoreWriteError, WALDeleted
from kit.run import db
from kit.run.db import RECORD_SQL, TOTALS_SQL, prompt_rows, record_row
from kit.run.reader import config_doc, done_frame, prompt_state, totals
from kit.types import DatasetProgress, ErrorRecord, Record, RunConfig

CHECKPOINT_EVERY = 60.0  # s: the most commits a deleted -wal can take with it
WAL_FILES = ("-wal", "-shm")  # SQLite's files beside run.sqlite while it is open


def _flatten(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _diff_parts(old: dict, new: dict) -> list[str]:
    """Lines 'sampling.max_tokens: 128 -> 64' for each changed part."""
    a, b = _flatten(old), _flatten(new)
    return [
        f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]


DERIVED = ("source_hashes", "chat_template_hash", "datasets")  # found by the run, not set


def _changes(old: dict, new: dict) -> list[tuple[str, str | None, str | None]]:
    """(field, old JSON, new JSON) of each setting a start changes (a budget per dataset:
    'budgets.NAME'); one budget for all is compared per dataset against named ones."""
    old, new = dict(old), dict(new)
    a, b = old.get("budgets"), new.get("budgets")
    if isinstance(a, dict) != isinstance(b, dict):
        names = a if isinstance(a, dict) else b
        old["budgets"], new["budgets"] = (
            v if isinstance(v, dict) else dict.fromkeys(names, v) for v in (a, b)
        )
    a, b = (_flatten({k: v for k, v in d.items() if k not in DERIVED}) for d in (old, new))
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k, a) != b.get(k, a))
    return [(k, *(json.dumps(d[k]) if k in d else None for d in (a, b))) for k in keys]


def _locked_message(run_dir: Path, holder: str) -> str:
    if holder.startswith(f"pid {os.getpid()} on {socket.gethostname()} "):
        return (
            f"run dir {run_dir} is in use by an earlier run in this same process ({holder}); "
            "wait for it to end or stop it (run.stop()), or use another run_dir"
        )
    return (
        f"run dir {run_dir} is in use by another kit run ({holder}); wait for it to end or "
        "stop it, or use another run_dir"
    )


class RunStore:
    """The writer side of a run directory.

    Args:
        run_dir: the directory (created on init).
        flush_every: commit after this many buffered records and errors.
        flush_interval: or after this many seconds (checked on append and `maybe_flush`).

    Example:
        store = RunStore("data/runs/demo")
        store.init(config, prompts)     # refuses a changed fingerprint unless force=True
        done = store.done()             # frame: dataset, prompt_id, sample (store.totals(): counts)
        store.append(record); store.close()
    """

    def __init__(self, run_dir, *, flush_every: int = 32, flush_interval: float = 1.0) -> None:
        self.run_dir = Path(run_dir)
        self.flush_every = flush_every
        self.flush_interval = flush_interval
        self.conn: sqlite3.Connection | None = None
        self._lock_fd: int | None = None
        self._records: list[Record] = []
        self._errors: list[ErrorRecord] = []
        self._finishes: dict[tuple[str, str], int] = {}  # (dataset, finish) -> answers not kept
        self._last_flush = time.monotonic()
        self.rejected = 0  # records refused this session: their key was already stored

    # -- setup
    def init(self, config: RunConfig, prompts_frame=None, *, force: bool = False) -> None:
        """Lock the run dir, create or reopen its database; store the config and prompts.

        Raises RunLocked when another writer holds the run dir (its pid named); the lock is
        held until close(). Raises FingerprintMismatch (naming each changed part, old -> new)
        when the database holds a different fingerprint, unless force=True. Budgets,
        concurrency, endpoints ... may change: the config row holds the new values, every
        later resume, audit and export uses them, and table run_changes records each change
        (when, field, old, new). Prompts are added, never replaced (prompt_id is a content hash).
        """
        try:
            self._open()
            self._init(config, prompts_frame, force)
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        """Create the run dir, open (and migrate) its database, take the writer's lock."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.conn = db.connect(self.run_dir, write=True)
        self._wal = self._wal_ids()
        self._last_checkpoint = time.monotonic()
        self._take_lock()

    def _init(self, config: RunConfig, prompts_frame, force: bool) -> None:
        old = config_doc(self.conn)
        started = self.conn.execute("SELECT fingerprint FROM config").fetchone()
        if started and started[0] and not force:  # '': a plan's config, no run made yet
            changes = _diff_parts(
                RunConfig.from_dict(old).fingerprint_parts(), config.fingerprint_parts()
            )
            if changes:
                raise FingerprintMismatch(
                    f"run dir {self.run_dir} was made with a different configuration:\n  "
                    + "\n  ".join(changes)
                    + "\nUse a new run_dir, or pass force=True to resume anyway."
                )
        same = (
            old is not None
            and config.source_hashes
            and old.get("source_hashes") == config.source_hashes
        )
        if prompts_frame is not None and not same:  # the same prompt ids are stored already
            self.add_prompts(prompts_frame)  # before the config that says they are
        elif self.conn.execute("SELECT 1 FROM state WHERE key = 'prompts'").fetchone() is None:
            with self._transaction():  # a database from before the count was kept
                self._put_state("prompts", json.dumps(prompt_state(self.conn)))
        doc = json.dumps(config.to_dict())
        changed = _changes(old, config.to_dict()) if old is not None else []
        with self._transaction():
            self.conn.executemany(
                "INSERT INTO run_changes (t, field, old, new) VALUES (?, ?, ?, ?)",
                [(time.time(), *c) for c in changed],
            )
            self.conn.execute(
                "INSERT INTO config VALUES (1, ?, ?) ON CONFLICT (id) DO UPDATE SET "
                "fingerprint = excluded.fingerprint, doc = excluded.doc",
                (config.fingerprint(), doc),
            )
        self.checkpoint("PASSIVE")  # the migrations' and prompts' pages out of the WAL

    def add_prompts(self, frame) -> None:
        """Add a prompt frame's prompts (kit.load's columns), a chunk per transaction, and
        count them per dataset in the same transaction (state "prompts", reader.prompt_state:
        what kit.watch reads instead of counting a million keys, and how many have ids that
        are not content hashes, which the context guard's cache key needs to know)."""
        from kit.data.sources import LoadResult

        frames = frame.batches() if isinstance(frame, LoadResult) else [frame]  # by part
        for rows in (rows for part in frames for rows in prompt_rows(part)):
            with self._transaction():
                doc = prompt_state(self.conn)
                counts, custom = doc["counts"], doc["custom_ids"]
                for (ds, content_id), run in itertools.groupby(rows, lambda r: (r[0], r[7])):
                    if ds not in counts:  # a new dataset: its custom ids are known from here
                        counts[ds], custom[ds] = 0, 0
                    added = self.conn.executemany(db.PROMPT_SQL, list(run)).rowcount  # ignored: 0
                    counts[ds] += added
                    if not content_id and ds in custom:
                        custom[ds] += added
                self._put_state("prompts", json.dumps(doc))

    def _take_lock(self) -> None:
        """Hold an exclusive flock on run.sqlite itself until close(); RunLocked when taken.

        The descriptor is opened once per database file per process and never closed:
        closing any descriptor of a file drops every POSIX lock the process holds on it,
        SQLite's own included (another process could then delete a live WAL). Released
        with LOCK_UN; a second writer in this process is refused from the registry."""
        st = os.stat(db.db_path(self.run_dir))
        key = (st.st_dev, st.st_ino)
        with db.LOCKS_GUARD:
            fd = db.LOCK_FDS.get(key)
            if fd is not None and key in db.HELD:
                raise RunLocked(_locked_message(self.run_dir, self._holder()))
            if fd is None:
                fd = db.LOCK_FDS[key] = os.open(db.db_path(self.run_dir), os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                raise RunLocked(_locked_message(self.run_dir, self._holder())) from None
            db.HELD.add(key)
        self._lock_key = key
        self._lock_fd = fd
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        pid, host = os.getpid(), socket.gethostname()
        with self._transaction():
            self._put_state("writer", f"pid {pid} on {host} since {since}")
            me = {"pid": pid, "host": host, "start": db.process_start(pid)}
            self._put_state("writer_process", json.dumps(me))  # kit.run.progress.writer_gone

    def _holder(self) -> str:
        row = self.conn.execute("SELECT value FROM state WHERE key = 'writer'").fetchone()
        return row[0] if row else "holder unknown"

    # -- reading (writer side)
    def done(self):
        """The records already stored: a frame of dataset, prompt_id, sample (one row per
        key, no text)."""
        self.flush()
        return done_frame(self.conn)

    def totals(self) -> dict[str, tuple[int, int, int]]:
        """dataset -> (samples, completion tokens, truncated) of the records stored."""
        self.flush()
        return totals(self.conn)

    # -- writing
    def append(self, record: Record) -> None:
        """Buffer one record; committed by count or time (maybe_flush)."""
        self._records.append(record)
        self.maybe_flush()

    def append_error(self, error: ErrorRecord) -> None:
        """Buffer one ErrorRecord (committed with the records)."""
        self._errors.append(error)
        self.maybe_flush()

    def count_finish(self, dataset: str, finish: str) -> None:
        """Count one answer whose finish is no data (committed with the records)."""
        key = (dataset, finish)
        self._finishes[key] = self._finishes.get(key, 0) + 1

    def maybe_flush(self) -> None:
        """Commit when `flush_every` rows are buffered or `flush_interval` has passed."""
        n = len(self._records) + len(self._errors)
        due = time.monotonic() - self._last_flush >= self.flush_interval
        if n >= self.flush_every or (n and due):
            self.flush()

    def flush(self) -> None:
        """Commit every buffered record and error, and the totals they add, in one transaction.

        A record whose key is already stored is refused by the primary key and counted in
        `rejected` (and the state row "rejected"). On a failed commit: rolled back, StoreWriteError.
        """
        records, self._records = self._records, []
        errors, self._errors = self._errors, []
        finishes, self._finishes = self._finishes, {}
        self._last_flush = time.monotonic()
        if not records and not errors and not finishes:
            return
        totals: dict[str, list[int]] = {}  # dataset -> [samples, tokens, truncated] added
        rejected = 0
        try:
            with self._transaction():
                for r in records:
                    if self.conn.execute(RECORD_SQL, record_row(r)).rowcount == 0:
                        rejected += 1
                        continue
                    t = totals.setdefault(r.dataset, [0, 0, 0])
                    t[0] += 1
                    t[1] += r.completion_tokens
                    t[2] += r.finish_reason == "length"
                self.conn.executemany(TOTALS_SQL, [(ds, *t) for ds, t in totals.items()])
                self.conn.executemany(
                    "INSERT INTO errors (dataset, prompt_id, sample, error, attempts, t) VALUES (?, ?, ?, ?, ?, ?)",
                    [astuple(e) for e in errors],  # ErrorRecord's fields, in order
                )
                self.conn.executemany(
                    "INSERT INTO finish_counts VALUES (?, ?, ?) ON CONFLICT DO UPDATE SET "
                    "count = count + excluded.count",
                    [(*key, n) for key, n in finishes.items()],
                )
                if rejected:
                    self._add_state_count("rejected", rejected)
        except sqlite3.Error as e:
            raise StoreWriteError(
                errno.ENOSPC if "full" in str(e) else errno.EIO,
                f"could not write {db.db_path(self.run_dir)} ({e}); the run stopped cleanly, "
                f"nothing half-written was kept; {len(records)} results not committed will be "
                "generated again on resume",
            ) from e
        self.rejected += rejected

    def _add_state_count(self, key: str, n: int) -> None:
        self.conn.execute(
            "INSERT INTO state VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET "
            "value = CAST(value AS INTEGER) + CAST(excluded.value AS INTEGER)",
            (key, str(n)),
        )

    def set_state(self, key: str, value: str) -> None:
        """Store one state row (a JSON text or a plain one), committed now."""
        with self._transaction():
            self._put_state(key, value)

    def _put_state(self, key: str, value: str) -> None:
        self.conn.execute(
            "INSERT INTO state VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (key, value),
        )

    def write_skips(self, rows: list[tuple]) -> None:
        """Replace the skips table: (dataset, prompt_id, prompt_tokens, max_tokens,
        max_context, samples, reason) of each prompt the context guard skips."""
        with self._transaction():
            self.conn.execute("DELETE FROM skips")
            self.conn.executemany("INSERT INTO skips VALUES (?, ?, ?, ?, ?, ?, ?)", rows)

    def write_status(
        self, progress: list[DatasetProgress], *, finished: bool = False, stop_reason=None
    ) -> None:
        """The live runner's view (in flight, retries, state, and why the run stopped early:
        `stop_reason`, null while running or when it ran to the end), as state "status"."""
        if self.conn is None:
            return
        doc = {"t": time.time(), "finished": finished, "pid": os.getpid()}
        doc |= {"stop_reason": stop_reason, "datasets": [asdict(p) for p in progress]}
        try:
            self.set_state("status", json.dumps(doc))
        except sqlite3.Error:
            pass  # status is advisory; records and errors carry the truth

    @contextmanager
    def _transaction(self):
        """A write transaction, then the WAL's care: a -wal deleted or replaced under this
        writer is caught at the commit after (WALDeleted); the WAL is checkpointed into
        run.sqlite at least every CHECKPOINT_EVERY s (a lost -wal costs at most that)."""
        with _transaction(self.conn):
            yield self.conn
        now = self._wal_ids()
        if lost := [p for p, a, b in zip(WAL_FILES, self._wal, now, strict=True) if a and a != b]:
            self._wal_lost(lost)
        self._wal = now
        if time.monotonic() - self._last_checkpoint >= CHECKPOINT_EVERY:
            self.checkpoint("PASSIVE")

    def _wal_ids(self) -> tuple:
        """(st_dev, st_ino) of run.sqlite-wal and -shm (None for one not there)."""
        return tuple(_file_id(self.run_dir / f"{db.DB_NAME}{p}") for p in WAL_FILES)

    def checkpoint(self, mode: str = "TRUNCATE") -> bool:
        """Copy the WAL's commits into run.sqlite (SQLite's wal_checkpoint); True when all were
        (a reader mid-read can hold some back: PASSIVE does not wait for it)."""
        self._last_checkpoint = time.monotonic()
        try:
            busy, log, moved = self.conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
        except sqlite3.Error:
            return False
        return not busy and log == moved

    def _wal_lost(self, lost: list[str]) -> None:
        """The -wal or -shm was deleted (or replaced) under this writer. The commits are still
        in the files SQLite holds open: checkpointed into run.sqlite through them, then the
        connection is opened again (new files) and WALDeleted stops the run."""
        saved = self.checkpoint()
        self.conn.close()
        self.conn = db.connect(self.run_dir, write=True)
        self._wal = self._wal_ids()
        kept = "every commit was copied into run.sqlite" if saved else "a reader held some back"
        names = " and ".join(f"{db.db_path(self.run_dir)}{p}" for p in lost)
        raise WALDeleted(
            errno.EIO,
            f"{names} deleted or replaced while kit wrote the run ({kept}); the run stopped. "
            f"Never delete run.sqlite-wal or -shm; resume with `kit generate --run-dir "
            f"{self.run_dir}`",
        )

    def close(self) -> None:
        """Commit what is buffered, checkpoint the WAL into run.sqlite, close the database,
        then drop the lock (safe twice)."""
        try:
            if self.conn is not None and self._lock_fd is not None:
                self.flush()
                self.checkpoint()
        finally:
            if self.conn is not None:
                self.conn.close()
                self.conn = None
            if self._lock_fd is not None:
                with db.LOCKS_GUARD:  # released, never closed: see _take_lock
                    fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                    db.HELD.discard(self._lock_key)
                self._lock_fd = None


def store_prompts(run_dir, frame) -> None:
    """Store a plan's prompts (a prompt frame, or a LoadResult's a part at a time) in run_dir's
    database under the writer's lock (kit.plan.write_plan). While no record was generated,
    they replace whatever is stored (nothing merged: a dataset the plan leaves out is gone,
    with the errors, skips and status of the run that made nothing); over records, the same
    prompts are kept and other ones refused (ConfigError naming the way forward)."""
    from kit.data.sources import LoadResult, source_hashes

    given = frame.source_hashes() if isinstance(frame, LoadResult) else source_hashes(frame)
    store = RunStore(run_dir)
    try:
        store._open()
        if why := _replan_refusal(store.conn, run_dir, given):
            raise ConfigError(why)
        if sum(n for n, _, _ in totals(store.conn).values()):
            return  # the run's own prompts, stored already
        with store._transaction():
            for table in ("prompts", "errors", "skips", "totals"):
                store.conn.execute(f"DELETE FROM {table}")
            store.conn.execute("DELETE FROM state WHERE key IN ('prompts', 'status', 'rejected')")
            store.conn.execute("UPDATE config SET fingerprint = ''")  # a plan again, no run
        store.add_prompts(frame)
    finally:
        store.close()


def replan_refusal(run_dir, given: dict[str, str]) -> str | None:
    """Why a plan over prompts whose source hashes are `given` cannot go into run_dir (records
    were generated from other prompts), with the way forward; None when it can."""
    from kit.run.reader import open_db

    if not db.db_path(run_dir).exists():
        return None
    with open_db(run_dir) as conn:
        return _replan_refusal(conn, run_dir, given)


def _replan_refusal(conn, run_dir, given: dict[str, str]) -> str | None:
    n = sum(samples for samples, _, _ in totals(conn).values())
    stored = (config_doc(conn) or {}).get("source_hashes") or {}
    if not n or stored == given:
        return None
    gone, new = sorted(stored.keys() - given.keys()), sorted(given.keys() - stored.keys())
    edited = sorted(k for k in stored.keys() & given.keys() if stored[k] != given[k])
    what = "; ".join(
        f"{label} {names}"
        for label, names in (("left out:", gone), ("new:", new), ("other prompts in:", edited))
        if names
    )
    return (
        f"{run_dir} holds {n:,} records generated from its stored prompts, and this plan's "
        f"prompts differ ({what}); a plan replaces the prompts only before the first record. "
        f"Plan into a new run directory (kit plan --run-dir NEW ...), or keep this run and "
        f"change its budgets at resume (kit generate --run-dir {run_dir} --budget NAME=TOKENS)"
    )


def _file_id(path: Path) -> tuple[int, int] | None:
    """(st_dev, st_ino) of a file, None when it is not there."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


@contextmanager
def _transaction(conn: sqlite3.Connection):
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on any exception."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        with suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
