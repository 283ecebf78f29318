"""The run database: one SQLite file per run directory, run_dir/run.sqlite, in WAL mode.

It holds everything a run writes: config and fingerprint, prompts, records, errors, skips,
per-dataset totals (updated in the transaction that adds the records they count) and state.
The schema is built by ordered migrations (small functions, each run once and recorded in
the `migrations` table). Token ids are little-endian uint32 blobs: 4 bytes a token. The
file must sit on a local filesystem: WAL needs shared memory, which NFS does not give.
One writer (kit.run.store.RunStore); readers (kit.run.reader) open it read-only.
"""

from __future__ import annotations

import errno
import hashlib
import json
import operator
import os
import sqlite3
import sys
import threading
import time
from array import array
from pathlib import Path

from kit.errors import DatabaseDamaged, MissingPath, StoreWriteError
from kit.types import COLUMNS, Record, record_columns

DB_NAME = "run.sqlite"
BUSY_MS = 30_000  # how long a statement waits for the other side's lock before it fails


# The writer's lock registry (kit.run.store): (st_dev, st_ino) of a run.sqlite -> this
# process's lock descriptor on it (never closed), and which of them a writer holds now
LOCK_FDS: dict[tuple, int] = {}
HELD: set[tuple] = set()
LOCKS_GUARD = threading.Lock()


def written_here(run_dir) -> bool:
    """True while a RunStore of this process holds run_dir's database."""
    try:
        st = os.stat(db_path(run_dir))
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) in HELD


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat's 22nd field),
    None when no such process runs: a pid with its start time names one process, never a
    later one given the same pid. Without /proc: 0 while the pid exists."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None
    except (OSError, ValueError, IndexError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return 0


def db_path(run_dir) -> Path:
    return Path(run_dir) / DB_NAME


def damaged(path: Path, err: Exception) -> DatabaseDamaged:
    """The one-line report of a damaged database, with what to do."""
    return DatabaseDamaged(
        f"run database {path} is damaged ({err}); nothing was read from it. Restore it from "
        f"a copy, or inspect it with `sqlite3 {path} 'PRAGMA integrity_check'` "
        "(`.recover` salvages what is left into a new file)"
    )


def connect(run_dir, *, write: bool = False) -> sqlite3.Connection:
    """A connection to run_dir's database: the writer's (created, migrated) or read-only.

    A reader opens it with mode=ro; where SQLite cannot make the -shm it needs (a read-only
    directory or mount, a file copied alone by `.backup`) and no -wal holds commits, with
    immutable=1 (nothing can write there). Raises MissingPath when a reader finds no
    database, DatabaseDamaged when the file is not a database SQLite can read,
    StoreWriteError when the writer cannot write there.
    """
    path = db_path(run_dir)
    if not write and not path.exists():
        raise MissingPath(f"{path} not found: is {run_dir} a kit run directory?")
    try:
        if write:
            conn = _writer(run_dir, path)
        else:
            conn = _reader(path)
            if not migrated(conn):  # written by an older kit: upgraded once, then read
                conn.close()
                try:
                    connect(run_dir, write=True).close()
                except StoreWriteError as e:
                    raise StoreWriteError(
                        f"run database {path} was written by an older kit and must be upgraded once, which needs write access ({e})"
                    ) from None
                return connect(run_dir)
    except sqlite3.DatabaseError as e:
        if is_damage(e):
            raise damaged(path, e) from None
        raise
    return conn


_CANNOT = ("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM", "SQLITE_AUTH")


def _cannot(e: sqlite3.Error) -> bool:
    """True for SQLite's errors of a file it may not write or open (not damage, not I/O)."""
    return getattr(e, "sqlite_errorname", "").startswith(_CANNOT)


def _writer(run_dir, path: Path) -> sqlite3.Connection:
    """The writer's connection, WAL mode, migrated; StoreWriteError in one line when the run
    directory or its database is read-only."""
    check_writable(run_dir)
    try:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout = {BUSY_MS}")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = FULL")  # a commit is on disk when it returns
        migrate(conn)
    except sqlite3.OperationalError as e:
        if _cannot(e):
            raise _read_only(run_dir, e) from None
        raise
    return conn


def check_writable(run_dir) -> None:
    """StoreWriteError (one line) when run_dir or its database is read-only: before a run
    starts anything (an embedded server included)."""
    path = db_path(run_dir)
    if path.parent.is_dir() and not (
        os.access(path.parent, os.W_OK) and (not path.exists() or os.access(path, os.W_OK))
    ):
        raise _read_only(run_dir)


def _read_only(run_dir, err: Exception | None = None) -> StoreWriteError:
    why = f" ({err})" if err else ""
    return StoreWriteError(
        errno.EROFS,
        f"run dir {run_dir} is read-only{why}: generate writes its database there (audit, "
        "export, records and watch read it as it is); to resume, copy it (`sqlite3 "
        "run.sqlite '.backup COPY/run.sqlite'`) to a writable directory and run there",
    )


def _reader(path: Path) -> sqlite3.Connection:
    """A read-only connection on reader_uri(path)."""
    return _open_ro(reader_uri(path))


def reader_uri(path: Path) -> str:
    """The URI a reader opens path by: mode=ro, or mode=ro&immutable=1 where SQLite cannot
    open the -shm that mode=ro needs and no -wal holds commits (see connect); StoreWriteError
    when a -wal holds commits that cannot be read."""
    path = Path(path)
    uri = f"{path.resolve().as_uri()}?mode=ro"
    if os.access(path.parent, os.W_OK) or path.with_name(path.name + "-shm").exists():
        return uri  # SQLite can make or open the -shm: no probe
    try:
        _open_ro(uri, probe=True).close()
        return uri
    except sqlite3.OperationalError as e:
        if not _cannot(e):
            raise
        wal = path.with_name(path.name + "-wal")
        if wal.exists() and wal.stat().st_size:  # commits only the WAL holds: not ignored
            raise StoreWriteError(
                errno.EACCES,
                f"cannot read {path}: its {wal.name} holds commits and SQLite cannot open "
                f"{path.name}-shm beside it ({e}); copy the run dir to a writable "
                "directory (cp -a) and read the copy",
            ) from None
    return uri + "&immutable=1"


def _open_ro(uri: str, *, probe: bool = False) -> sqlite3.Connection:
    """A connection on a read-only URI (probe: checked by a first read)."""
    conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_MS}")
        if probe:
            conn.execute("SELECT count(*) FROM sqlite_schema").fetchone()
    except BaseException:
        conn.close()
        raise
    return conn


def is_damage(e: sqlite3.Error) -> bool:
    """True for SQLite's "malformed" and "not a database" errors (not for I/O or locks)."""
    return getattr(e, "sqlite_errorname", "") in ("SQLITE_CORRUPT", "SQLITE_NOTADB")


# ---------------------------------------------------------------- schema


# The tables as first made. A migration is history, never edited: the records table they make
# is kit.types.Record's stored columns (tests/test_store.py checks it); a new Record field
# adds its column by a migration of its own.
_M001_SCHEMA = """
CREATE TABLE config (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    fingerprint TEXT NOT NULL,
    doc TEXT NOT NULL                  -- RunConfig.to_dict() as JSON
);
-- messages: the compact JSON [[role, content], ...] that kit.load's prompt_id hashes;
-- hash: that content hash of messages (and tools) when stored, checked on every read;
-- content_id: 1 when prompt_id is that hash (kit.load's ids), so it is checked too
CREATE TABLE prompts (
    dataset TEXT NOT NULL,
    prompt_id TEXT NOT NULL,
    messages TEXT NOT NULL,
    tools TEXT,                        -- compact JSON array of OpenAI tools, or NULL
    n_turns INTEGER,
    row INTEGER,                       -- the row in its source file
    hash TEXT NOT NULL,
    content_id INTEGER NOT NULL,
    PRIMARY KEY (dataset, prompt_id)
) WITHOUT ROWID;
CREATE TABLE records (
    dataset TEXT NOT NULL,
    prompt_id TEXT NOT NULL,
    sample INTEGER NOT NULL,
    completion TEXT NOT NULL,
    reasoning TEXT,
    finish_reason TEXT NOT NULL,
    completion_tokens INTEGER NOT NULL,
    count_source TEXT NOT NULL,
    prompt_tokens INTEGER,
    output_ids BLOB,                   -- uint32 little-endian, 4 bytes a token
    prompt_ids BLOB,
    endpoint TEXT NOT NULL,
    latency_s REAL NOT NULL,
    attempts INTEGER NOT NULL,
    t_done REAL NOT NULL,
    turns TEXT,                        -- all_turns: the earlier generated turns, JSON
    tool_calls TEXT,                   -- the answer's tool calls, JSON (OpenAI's shape)
    PRIMARY KEY (dataset, prompt_id, sample)
);
CREATE TABLE errors (
    id INTEGER PRIMARY KEY,
    dataset TEXT NOT NULL,
    prompt_id TEXT NOT NULL,
    sample INTEGER NOT NULL,
    error TEXT NOT NULL,               -- redacted
    attempts INTEGER NOT NULL,
    t REAL NOT NULL
);
CREATE INDEX errors_key ON errors (dataset, prompt_id, sample);
CREATE TABLE skips (
    dataset TEXT NOT NULL,
    prompt_id TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    max_tokens INTEGER NOT NULL,
    max_context INTEGER NOT NULL,
    samples INTEGER NOT NULL,
    reason TEXT NOT NULL,
    PRIMARY KEY (dataset, prompt_id)
) WITHOUT ROWID;
CREATE TABLE totals (
    dataset TEXT PRIMARY KEY,
    samples INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    truncated INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE state (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
"""

# prompts as a rowid table, its key a unique index. In M001's WITHOUT ROWID table a prompt
# over ~1 KB spilled into an overflow page of its own (59% of its bytes unused) and every key
# read walked the text pages; here texts pack into pages and key reads (counts, a restart's
# keys, a lookup by key) touch the small index alone. records_done covers the columns a
# restart reads of every record (RunStore.done), which sit past the texts in its rows.
_M002_PROMPT_KEYS = """
CREATE TABLE prompts_new (
    dataset TEXT NOT NULL,
    prompt_id TEXT NOT NULL,
    messages TEXT NOT NULL,
    tools TEXT,
    n_turns INTEGER,
    row INTEGER,
    hash TEXT NOT NULL,
    content_id INTEGER NOT NULL
);
INSERT INTO prompts_new SELECT dataset, prompt_id, messages, tools, n_turns, row, hash, content_id FROM prompts;
DROP TABLE prompts;
ALTER TABLE prompts_new RENAME TO prompts;
CREATE UNIQUE INDEX prompts_key ON prompts (dataset, prompt_id);
CREATE INDEX records_done ON records (dataset, prompt_id, sample, completion_tokens, finish_reason);
"""

# the plan (kit.plan.planfile): what 01_plan and `kit plan` hand to generate. Its RunConfig
# is the config row, whose fingerprint stays '' until a run starts with it
_M003_PLAN = """
CREATE TABLE plan (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    created TEXT NOT NULL,             -- ISO 8601, UTC
    budgets TEXT NOT NULL,             -- JSON dataset -> planned completion tokens
    sources TEXT,                      -- JSON dataset -> load spec {path, format, mapping}
    server TEXT,                       -- JSON {"embedded": bool, "engine": str | null}
    pilot TEXT                         -- JSON PilotResult.summary()
);
CREATE TABLE plan_rows (
    position INTEGER PRIMARY KEY,
    row TEXT NOT NULL                  -- JSON of one row of the budget() / allocate() table
);
"""

# the context guard's cache (kit.run.guard): a cache, never the truth (emptied: one render)
_M004_GUARD_CACHE = """
CREATE TABLE guard_tokenizer (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    doc TEXT NOT NULL                  -- JSON {"files", "chat_template_hash", "context"}
);
CREATE TABLE guard_datasets (
    dataset TEXT PRIMARY KEY,
    key TEXT NOT NULL,                 -- sha256 of everything too_long's answer depends on
    ids_key TEXT,                      -- the same from the prompt ids alone (content-hash ids)
    too_long TEXT NOT NULL             -- JSON [[prompt_id, prompt_tokens], ...]
) WITHOUT ROWID;
"""

# the dataset's own answer to each prompt (kit.load's `answer`): kept for reading, never sent
# and not hashed (prompt ids and hashes stay as they were)
_M005_PROMPT_ANSWERS = """
ALTER TABLE prompts ADD COLUMN answer TEXT;
"""

# what a start or resume changed in the run's settings (kit.run.store.RunStore.init): the
# config row holds the values in force; this table, when each changed and from what
_M006_RUN_CHANGES = """
CREATE TABLE run_changes (
    id INTEGER PRIMARY KEY,
    t REAL NOT NULL,                   -- unix time of the start that changed it
    field TEXT NOT NULL,               -- 'budgets.NAME', 'concurrency', 'endpoints', ...
    old TEXT,                          -- JSON, NULL when the field was absent
    new TEXT                           -- JSON, NULL when the field is gone
);
"""

# answers whose finish is no data (kit.run.runner: `abort`, `content_filter`, ...): never
# records, counted per attempt in the transaction that commits the records beside them
_M007_FINISH_COUNTS = """
CREATE TABLE finish_counts (
    dataset TEXT NOT NULL,
    finish_reason TEXT NOT NULL,       -- as the server sent it
    count INTEGER NOT NULL,
    PRIMARY KEY (dataset, finish_reason)
) WITHOUT ROWID;
"""

# (name, SQL script): append only; each runs once, in order, in one transaction, recorded
MIGRATIONS = [
    ("m001_schema", _M001_SCHEMA),
    ("m002_prompt_keys", _M002_PROMPT_KEYS),
    ("m003_plan", _M003_PLAN),
    ("m004_guard_cache", _M004_GUARD_CACHE),
    ("m005_prompt_answers", _M005_PROMPT_ANSWERS),
    ("m006_run_changes", _M006_RUN_CHANGES),
    ("m007_finish_counts", _M007_FINISH_COUNTS),
]


def migrate(conn: sqlite3.Connection) -> None:
    """Run the migrations this database has not had, each in its own transaction."""
    conn.execute("CREATE TABLE IF NOT EXISTS migrations (name TEXT PRIMARY KEY, t REAL NOT NULL)")
    for name, script in MIGRATIONS:
        if conn.execute("SELECT 1 FROM migrations WHERE name = ?", (name,)).fetchone():
            continue
        try:  # a second writer that ran it meanwhile makes the INSERT fail: nothing applied
            conn.executescript(
                f"BEGIN IMMEDIATE; {script}; "
                f"INSERT INTO migrations VALUES ('{name}', {time.time()}); COMMIT;"
            )
        except sqlite3.Error:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            if not conn.execute("SELECT 1 FROM migrations WHERE name = ?", (name,)).fetchone():
                raise


def migrated(conn: sqlite3.Connection) -> bool:
    """True when every migration has run on this database (or it has no migrations table:
    not one kit made, left as it is); reading it raises when the file is damaged."""
    if not conn.execute("SELECT 1 FROM sqlite_schema WHERE name = 'migrations'").fetchone():
        return True
    done = {n for (n,) in conn.execute("SELECT name FROM migrations")}
    return all(name in done for name, _ in MIGRATIONS)


def integrity(run_dir, *, quick: bool = False) -> list[str]:
    """SQLite's integrity check of run_dir's database: [] when it is sound, else its problems.
    quick: `PRAGMA quick_check`, every page and record checked but not that each index
    holds exactly its table's rows (that cross-check is the O(N log N) part: 13 of 17 CPU-s
    at 1M records)."""
    conn = connect(run_dir)
    try:
        pragma = "quick_check" if quick else "integrity_check"
        rows = [r for (r,) in conn.execute(f"PRAGMA {pragma}")]
    except sqlite3.DatabaseError as e:
        return [str(e)]
    finally:
        conn.close()
    return [] if rows == ["ok"] else rows


# ---------------------------------------------------------------- rows

PROMPT_CHUNK = 10_000  # prompts inserted per statement batch (a frame is streamed in)


PROMPT_SQL = (
    "INSERT OR IGNORE INTO prompts (dataset, prompt_id, messages, tools, n_turns, row, hash, "
    "content_id, answer) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


def content_hashes(messages, tools) -> list[str]:
    """kit.load's prompt_id (kit.data.sources.prompt_id) of each pair of two polars String
    series, stored messages JSON and tools; the payloads made by polars: one blake2b call a
    prompt, no Python string built.

    Example:
        >>> content_hashes(pl.Series(['[["user","Hi"]]']), pl.Series([None], dtype=pl.String))
        ['a8ae2d3c7604f939']
    """
    import polars as pl

    m, t = pl.col("m"), pl.col("t")
    with_tools = pl.concat_str(pl.lit('{"messages":'), m, pl.lit(',"tools":'), t, pl.lit("}"))
    payload = pl.when(t.is_null()).then(m).otherwise(with_tools).cast(pl.Binary)
    texts = pl.DataFrame([messages.alias("m"), tools.alias("t")]).select(payload).to_series()
    blake2b = hashlib.blake2b
    return [blake2b(p, digest_size=8).hexdigest() for p in texts.to_list()]


def prompt_rows(frame):
    """PROMPT_SQL's rows of a prompt frame, a chunk at a time: dataset, prompt_id, messages
    as the compact JSON kit.load's prompt_id hashes (encoded by polars, byte for byte
    json.dumps(ensure_ascii=False)), tools, n_turns, row, hash, content_id, answer."""
    import polars as pl

    pair = pl.concat_list(pl.element().struct.field("role"), pl.element().struct.field("content"))
    text = pl.struct(pl.col("messages").list.eval(pair).alias("m")).struct.json_encode()
    for part in frame.iter_slices(PROMPT_CHUNK):
        part = part.with_columns(_json=text.str.slice(5).str.strip_suffix("}"))
        if "tools" not in part.columns:
            part = part.with_columns(tools=pl.lit(None, dtype=pl.String))
        hashes = content_hashes(part["_json"], part["tools"])
        cols = [
            part[c].to_list() if c in part.columns else [None] * part.height
            for c in ("dataset", "prompt_id", "_json", "tools", "n_turns", "row", "answer")
        ]
        rows = zip(*cols, hashes, strict=True)
        yield [(*row, h, int(h == row[1]), answer) for *row, answer, h in rows]


STORED = record_columns(stored=True)  # the records table's columns (kit.types.Record)
RECORD_SQL = (
    f"INSERT OR IGNORE INTO records ({', '.join(STORED)}) VALUES ({', '.join('?' * len(STORED))})"
)
TOTALS_SQL = (
    "INSERT INTO totals (dataset, samples, tokens, truncated) VALUES (?, ?, ?, ?) "
    "ON CONFLICT (dataset) DO UPDATE SET samples = samples + excluded.samples, "
    "tokens = tokens + excluded.tokens, truncated = truncated + excluded.truncated"
)


def record_row(r: Record) -> list:
    """RECORD_SQL's row of a record: ids as blobs, JSON columns as JSON text (None: NULL)."""
    row = list(_VALUES(r))
    for i, kind in _ENCODED:
        if row[i] is not None:
            row[i] = ids_blob(row[i]) if kind == "ids" else json.dumps(row[i], ensure_ascii=False)
    return row


_VALUES = operator.attrgetter(*STORED)
_ENCODED = [
    (i, COLUMNS[n].kind) for i, n in enumerate(STORED) if COLUMNS[n].kind in ("ids", "json")
]


# ---------------------------------------------------------------- token ids

_LITTLE = sys.byteorder == "little"


def ids_blob(ids) -> bytes | None:
    """Token ids -> 4 bytes each (uint32, little-endian); None stays None.

    Example:
        >>> ids_blob([1, 258])
        b'\\x01\\x00\\x00\\x00\\x02\\x01\\x00\\x00'
    """
    if ids is None:
        return None
    a = array("I", ids)  # OverflowError for an id outside 0..2**32-1
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()
