"""The one reader of a run directory: SQL on its database into polars frames.

Audit, export, watch, progress and resume all read through here, in bounded batches
(`record_batches`), so memory follows the batch, not the run. Prompts are joined by SQL and
each one read with a record is checked against its content hash (prompt_id): an edited
prompt is a PromptMismatch naming it, never a wrong pair. Token ids come back as lists
(decoded from their 4-byte blobs with numpy and Arrow, no Python int per token).
"""

from __future__ import annotations

import itertools
import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager

from kit.errors import ConfigError, MissingPath, PromptMismatch
from kit.run import db
from kit.types import COLUMNS, KEY, KINDS, Record, RunConfig, record_columns

BATCH = 10_000  # records per frame a reader yields
RECORD_COLUMNS = record_columns(stored=True)  # the records table's (kit.types.Record)
PROMPT_COLUMNS = tuple(n for n in record_columns() if n not in RECORD_COLUMNS)  # joined on
_IDS = tuple(n for n in RECORD_COLUMNS if COLUMNS[n].kind == "ids")  # 4-byte blobs -> lists
COMPUTED = {"n_output_ids": "length(r.output_ids) / 4"}  # by SQL, no blob read: the ids' count
# what a record's prompt adds to record_batches (prompts=True, or "earlier"): alias -> SQL
_FOUND = {"_found": "p.prompt_id IS NOT NULL", "_dataset": "r.dataset", "_prompt_id": "r.prompt_id"}
_JOINED = {
    True: {
        "messages": "p.messages",
        "tools": "p.tools",
        "dataset_answer": "p.answer",
        "_hash": "p.hash",
        "_content_id": "p.content_id",
    },
    "earlier": {"earlier": "instr(p.messages, '[\"assistant\",') > 0"},  # compact JSON
}
# the polars type of each value SQLite gives: a record column's by its SQLite type, the others'
_BY_SQL = {"TEXT": "String", "INTEGER": "Int64", "REAL": "Float64", "BLOB": "Binary"}
_OTHERS = dict.fromkeys(["n_output_ids", "earlier", "_found", "_content_id", "_rowid"], "Int64")
_OTHERS |= dict.fromkeys(["n_turns", "row", "content_id"], "Int64")  # the prompts table's
_OTHERS |= {"answer": "String"}
_OTHERS |= {"_dataset": "String", "_prompt_id": "String", "_hash": "String", "hash": "String"}
_OTHERS |= {"error": "String", "t": "Float64", "resolved": "Boolean"}  # the errors table's


def _sql_schema(names) -> dict:
    """The polars type of each named column as SQLite holds it (ids as Binary)."""
    import polars as pl

    stored = {n: _BY_SQL[KINDS[c.kind][0]] for n, c in COLUMNS.items()}
    return {n: getattr(pl, stored.get(n) or _OTHERS[n]) for n in names}


def _where(column: str, values) -> tuple[str, list]:
    """The SQL filter ` WHERE column IN (values)` and its args ("" and [] for None)."""
    if values is None:
        return "", []
    values = list(values)
    return f" WHERE {column} IN ({', '.join('?' * len(values))})", values


@contextmanager
def open_db(run_dir):
    """A read-only connection to run_dir's database, closed on exit."""
    conn = db.connect(run_dir)
    try:
        yield conn
    except sqlite3.DatabaseError as e:
        if not db.is_damage(e):
            raise
        raise db.damaged(db.db_path(run_dir), e) from None
    finally:
        conn.close()


def config_doc(conn: sqlite3.Connection) -> dict | None:
    """The stored RunConfig.to_dict(), None before a run stored one."""
    row = conn.execute("SELECT doc FROM config WHERE id = 1").fetchone()
    return json.loads(row[0]) if row else None


def read_config(run_dir) -> RunConfig:
    """The RunConfig a run directory was made with.

    Example: read_config("data/runs/demo").budgets -> {"alpaca": 4000, "sharegpt": 2500}
    """
    with open_db(run_dir) as conn:
        doc = config_doc(conn)
    if doc is None:
        raise MissingPath(f"{run_dir} holds no run configuration: is it a run directory?")
    return RunConfig.from_dict(doc)


def run_changes(run_dir) -> list[tuple[float, str, object, object]]:
    """(t, field, old, new) of each setting a start or resume changed, in order (the config
    row holds the values in force; kit.run.store records each change).

    Example: run_changes("data/runs/demo") -> [(1796..., "budgets.a", 2000, 6000)]
    """
    with open_db(run_dir) as conn:
        rows = conn.execute("SELECT t, field, old, new FROM run_changes ORDER BY id").fetchall()
    return [(t, f, *(None if v is None else json.loads(v) for v in (a, b))) for t, f, a, b in rows]


def change_lines(run_dir) -> list[str]:
    """run_changes as lines 'budgets.a: 2000 -> 6000 (at 2026-12-07 16:40:03 UTC)'."""
    import time

    return [
        f"{f}: {a!r} -> {b!r} (at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(t))})"
        for t, f, a, b in run_changes(run_dir)
    ]


def state(run_dir, key: str) -> str | None:
    """One row of the state table ("status", "writer", "rejected", "guard"), or None."""
    with open_db(run_dir) as conn:
        row = conn.execute("SELECT value FROM state WHERE key = ?", (key,)).fetchone()
    return row[0] if row else None


def done_frame(conn: sqlite3.Connection):
    """dataset, prompt_id, sample of every stored record, read from the index records_done
    alone (not the records' text pages); their counts are the totals table's (totals)."""
    sql = "SELECT dataset, json_group_array(prompt_id), json_group_array(sample) FROM records INDEXED BY records_done GROUP BY dataset"
    return _grouped(conn, sql, [], _sql_schema(KEY[1:]))


def _grouped(conn: sqlite3.Connection, sql: str, args: list, schema: dict):
    """Rows of (dataset, a JSON array per column of `schema`) -> one frame with dataset first:
    no Python tuple per row (2.5x less CPU than fetchmany at 1M keys; no ADBC import)."""
    import orjson
    import polars as pl

    parts = [
        pl.DataFrame(dict(zip(schema, map(orjson.loads, cols), strict=True)), schema=schema).select(
            pl.lit(ds, pl.String).alias("dataset"), *schema
        )
        for ds, *cols in conn.execute(sql, args)
    ]
    return pl.concat(parts) if parts else pl.DataFrame(schema={"dataset": pl.String} | schema)


# the columns of the index records_done: what a restart and an export's selection read
DONE_COLUMNS = record_columns(
    "dataset", "prompt_id", "sample", "completion_tokens", "finish_reason"
)


def done_records(run_dir):
    """dataset, prompt_id, sample, completion_tokens, finish_reason of every stored record, in
    commit order (record_batches' order): read from the index records_done alone, not the
    records' pages (an export's selection)."""
    import polars as pl

    schema = _sql_schema(["_rowid", *DONE_COLUMNS])
    sql = f"SELECT rowid AS {', '.join(schema)} FROM records INDEXED BY records_done"
    parts = sql_frames(run_dir, sql, [], schema, 200_000)
    return pl.concat([pl.DataFrame(schema=schema), *parts]).sort("_rowid").drop("_rowid")


def _chunks(cur: sqlite3.Cursor, size: int) -> Iterator[list]:
    while rows := cur.fetchmany(size):
        yield rows


# ---------------------------------------------------------------- records


def record_schema() -> dict:
    """The polars schema of every record column as the reader gives it (kit.types.Record's
    order; token ids as lists of ints, JSON columns as text)."""
    import polars as pl

    return {c.name: c.polars(pl) for c in COLUMNS.values()}


def record_batches(
    run_dir, *, datasets=None, columns=None, prompts: bool = False, batch_size: int = BATCH
) -> Iterator:
    """The run's records as polars frames of at most `batch_size` rows, in commit order.

    Args:
        run_dir: the run directory.
        datasets: only these datasets (None: all).
        columns: the record columns wanted (RECORD_COLUMNS, or COMPUTED's; None: all).
        prompts: also each record's prompt, `messages` (list of {role, content}; with
            all_turns as sent, holding the target's earlier answers) and `tools` (JSON
            text), each checked against the hash stored with it (PromptMismatch).
            "earlier": instead, `earlier`, whether the stored prompt holds an assistant
            message (found by SQL in its JSON; no text read here, so none checked: for a
            reader that uses no prompt's text, or reads those it uses with prompts_frame).
        batch_size: rows per frame.
    """
    cols = list(columns or RECORD_COLUMNS)
    if bad := [c for c in cols if c not in RECORD_COLUMNS and c not in COMPUTED]:
        raise ConfigError(
            f"unknown record columns {bad}; choose from {RECORD_COLUMNS + tuple(COMPUTED)}"
        )
    names = {c: COMPUTED.get(c, f"r.{c}") for c in cols}  # alias -> SQL expression
    if prompts:
        names |= _FOUND | _JOINED[prompts]
    sql = f"SELECT {', '.join(f'{e} AS {a}' for a, e in names.items())} FROM records r"
    if prompts:
        sql += " LEFT JOIN prompts p ON p.dataset = r.dataset AND p.prompt_id = r.prompt_id"
    where, args = _where("r.dataset", datasets)
    sql += where + " ORDER BY r.rowid"
    for raw in sql_frames(run_dir, sql, args, _sql_schema(names), batch_size):
        yield _finish(raw, prompts)


def ids_by_key(run_dir, keys, columns=("output_ids",)):
    """Id columns (output_ids, prompt_ids: lists) of chosen records, by key: keys, a frame of
    dataset, prompt_id, sample -> those columns and `columns`, one row per key found (the
    audit's sample)."""
    if bad := [c for c in columns if c not in ("output_ids", "prompt_ids")]:
        raise ConfigError(f"ids_by_key reads output_ids and prompt_ids only, not {bad}")
    cols = "".join(f", r.{c}" for c in columns)
    sql = f"SELECT r.dataset, r.prompt_id, r.sample{cols} FROM json_each(?) k JOIN records r ON r.dataset = json_extract(k.value, '$[0]') AND r.prompt_id = json_extract(k.value, '$[1]') AND r.sample = json_extract(k.value, '$[2]')"
    args = [json.dumps(keys.select(KEY).rows())]
    return _finish(_frame(run_dir, sql, args, _sql_schema([*KEY, *columns])), False)


def owned(frame):
    """A frame of record_batches with its own copy of its columns, for a caller that keeps a
    few columns of every batch: a column read through ADBC keeps the whole Arrow batch it
    came in alive (the C data interface frees a batch as one), text and ids included."""
    import polars as pl

    return pl.from_arrow(frame.to_arrow())


def sql_frames(run_dir, sql: str, args: list, schema: dict, batch_size: int = BATCH) -> Iterator:
    """A query's rows as polars frames of `schema`, `batch_size` rows at a time.

    Bulk reads go through ADBC's SQLite driver (Arrow batches, ~4x faster than sqlite3's
    tuples), except while this process writes the database: ADBC brings its own copy of
    SQLite, and a second copy's open and close of the file would drop the writer's POSIX
    locks; sqlite3's fetchmany is used then (and where ADBC is not installed).
    """
    try:
        import adbc_driver_sqlite.dbapi as adbc
    except ImportError:
        adbc = None
    if adbc is None or db.written_here(run_dir):
        yield from _sqlite_frames(run_dir, sql, args, schema, batch_size)
    else:
        yield from _adbc_frames(adbc, run_dir, sql, args, schema, batch_size)


def _frame(run_dir, sql: str, args: list, schema: dict):
    """A query's rows as one frame of `schema` (read by sqlite3: small results)."""
    import polars as pl

    return pl.concat([pl.DataFrame(schema=schema), *_sqlite_frames(run_dir, sql, args, schema)])


def _sqlite_frames(
    run_dir, sql: str, args: list, schema: dict, batch_size: int = BATCH
) -> Iterator:
    import polars as pl

    with open_db(run_dir) as conn:
        for rows in _chunks(conn.execute(sql, args), batch_size):
            yield pl.DataFrame(rows, schema=schema, orient="row")


_LITERALS = {"String": "''", "Int64": "0", "Float64": "0.0", "Binary": "X''", "Boolean": "0"}


def _adbc_frames(adbc, run_dir, sql: str, args: list, schema: dict, batch_size: int) -> Iterator:
    """ADBC infers each column's type from its first batch (an all-NULL column becomes
    int64 and a later text fails), so a first row of typed literals leads, then is cut."""
    import polars as pl

    with open_db(run_dir):  # the old layout imported, a damaged file reported, first
        pass
    first = ", ".join(f"{_LITERALS[str(t)]} AS {n}" for n, t in schema.items())
    query = f"SELECT {first} UNION ALL SELECT * FROM ({sql})"
    path = db.db_path(run_dir).resolve()
    conn = adbc.connect(db.reader_uri(path))
    cur = conn.cursor()
    try:
        cur.adbc_statement.set_options(**{"adbc.sqlite.query.batch_rows": str(batch_size)})
        cur.execute(query, args or None)
        carry = None  # rows read but not yet yielded: every frame but the last is whole
        for i, batch in enumerate(cur.fetch_record_batch()):
            frame = pl.from_arrow(batch).cast(schema).slice(1 if i == 0 else 0)
            carry = frame if carry is None else pl.concat([carry, frame])
            while carry.height >= batch_size:
                yield carry.head(batch_size)
                carry = carry.slice(batch_size)
        if carry is not None and carry.height:
            yield carry
    except (adbc.Error, OSError) as e:  # its errors name SQLite's in text only
        if any(w in str(e) for w in ("malformed", "not a database")):
            raise db.damaged(path, e) from None
        raise
    finally:  # also when the reader stops early: the statement first, then its connection
        cur.close()
        conn.close()


def _finish(raw, prompts: bool):
    """A frame of SQL columns -> record_batches' frame: ids decoded; prompts checked,
    decoded and, with all_turns, as sent."""
    import polars as pl

    out = raw.with_columns(ids_series(raw[c].to_arrow(), c) for c in _IDS if c in raw.columns)
    if not prompts:
        return out
    if (missing := raw["_found"] == 0).any():
        ds, pid = raw.filter(missing).select("_dataset", "_prompt_id").row(0)
        raise PromptMismatch(f"record ({ds!r}, {pid!r}) has no stored prompt in the run database")
    out = out.drop(*_FOUND)
    if prompts == "earlier":
        return out.with_columns(pl.col("earlier").cast(pl.Boolean))
    names = {f"_{n}": n for n in ("dataset", "prompt_id", "hash", "content_id")}
    check_prompts(raw.select("messages", "tools", *names).rename(names))
    out = out.drop("_hash", "_content_id").with_columns(messages_series(raw["messages"]))
    if "turns" in out.columns and out["turns"].is_not_null().any():  # all_turns: as sent
        sent = [
            as_sent(m, json.loads(t)) if t else m
            for m, t in zip(out["messages"].to_list(), out["turns"].to_list(), strict=True)
        ]
        out = out.with_columns(pl.Series("messages", sent, dtype=out["messages"].dtype))
    return out


def check_prompts(prompts) -> None:
    """Raise PromptMismatch when a prompt's text does not hash to the hash stored with it
    (and, for kit.load's content ids, to its prompt_id); each distinct prompt hashed once.

    prompts: a frame of dataset, prompt_id, messages (the stored JSON text), tools, hash (the
    stored one) and content_id.
    """
    import polars as pl

    distinct = prompts.unique(["dataset", "prompt_id"], maintain_order=True)
    got = pl.Series(db.content_hashes(distinct["messages"], distinct["tools"]), dtype=pl.String)
    bad = (got != distinct["hash"]) | (
        (distinct["content_id"].fill_null(0) != 0) & (got != distinct["prompt_id"])
    )
    if bad.any():
        ds, pid = distinct.filter(bad).select("dataset", "prompt_id").row(0)
        raise PromptMismatch(
            f"prompt ({ds!r}, {pid!r}) in the run database is not the prompt stored with it "
            "(its text was changed after the run); nothing was paired with it. Restore the "
            "run database from a copy"
        )


def ids_series(blobs, name: str = "ids"):
    """4-byte token id blobs (a list of bytes or None, or an Arrow binary array) -> a polars
    List(Int64) series, without a Python int per token (numpy over the Arrow buffers).

    Example:
        >>> ids_series([db.ids_blob([1, 2]), None, b""]).to_list()
        [[1, 2], None, []]
    """
    import numpy as np
    import polars as pl
    import pyarrow as pa

    arr = blobs if isinstance(blobs, (pa.Array, pa.ChunkedArray)) else pa.array(blobs, pa.binary())
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    arr = arr.cast(pa.large_binary())
    _, offsets_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int64)[arr.offset : arr.offset + len(arr) + 1]
    data = (
        np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    )
    values = np.frombuffer(data[offsets[0] : offsets[-1]].tobytes(), dtype="<u4").astype(np.int64)
    lists = pa.LargeListArray.from_arrays(
        pa.array((offsets - offsets[0]) // 4), pa.array(values), mask=arr.is_null()
    )
    return pl.Series(name, lists, dtype=pl.List(pl.Int64))


def messages_series(texts):
    """Stored messages JSON ([[role, content], ...]) -> a list of {role, content} series."""
    import polars as pl

    texts = texts if isinstance(texts, pl.Series) else pl.Series("messages", texts, dtype=pl.String)
    pairs = texts.alias("messages").str.json_decode(pl.List(pl.List(pl.String)))
    return pairs.list.eval(
        pl.struct(role=pl.element().list.get(0), content=pl.element().list.get(1))
    )


def records_frame(run_dir, datasets=None, *, prompts: bool = True):
    """Every record as one frame (with its prompt by default): for small runs and tests."""
    import polars as pl

    if parts := list(record_batches(run_dir, datasets=datasets, prompts=prompts)):
        return pl.concat(parts)
    cols = RECORD_COLUMNS + (PROMPT_COLUMNS if prompts else ())
    return pl.DataFrame(schema={c: record_schema()[c] for c in cols})


def records(run_dir, datasets=None) -> Iterator[Record]:
    """The run's records as Record objects, messages as the runner sent them."""
    decoded = [n for n, c in COLUMNS.items() if c.kind == "json"]
    for batch in record_batches(run_dir, datasets=datasets, prompts=True):
        for row in batch.iter_rows(named=True):
            yield Record(**row | {k: json.loads(row[k]) if row[k] else None for k in decoded})


def as_sent(messages: list[dict], turns) -> list[dict]:
    """The prompt as the runner sent its last request: with all_turns (Record.turns), each
    assistant message holds the target's own earlier answer, in order, and a user turn
    right after another gets the target's answer before it (kit.run.turns).

    Example:
        >>> as_sent([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
        ...         [{"content": "A"}])[1]
        {'role': 'assistant', 'content': 'A'}
    """
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if not turns:
        return messages
    answers, out = iter(turns), []
    for m in messages:
        missing = m["role"] == "user" and out and out[-1]["role"] == "user"
        if m["role"] == "assistant" or missing:
            turn = next(answers, None)
            if turn is not None:
                out.append({"role": "assistant", "content": turn.get("content") or ""})
            elif m["role"] == "assistant":
                out.append(m)
        if m["role"] != "assistant":
            out.append(m)
    return out


# ---------------------------------------------------------------- prompts, errors, skips


def prompts_frame(run_dir, *, datasets=None, ids=None, text: bool = True):
    """The stored prompts in kit.load's columns (dataset, prompt_id, messages, n_turns, row,
    tools, answer), each text checked against its hash. text=False: dataset and prompt_id only, read
    from the key index (a resume's light view). `ids`: only these prompt ids (with one
    dataset), looked up by key."""
    import polars as pl

    cols = ["dataset", "prompt_id"]
    cols += ["n_turns", "row", "messages", "tools", "answer", "hash", "content_id"] if text else []
    schema = _sql_schema(cols)
    if not text and ids is None:  # keys only: the key index, a JSON array per dataset
        where, args = _where("dataset", datasets)
        sql = f"SELECT dataset, json_group_array(prompt_id) FROM prompts INDEXED BY prompts_key{where} GROUP BY dataset"
        with open_db(run_dir) as conn:
            return _grouped(conn, sql, args, _sql_schema(["prompt_id"]))
    parts = []
    with open_db(run_dir) as conn:  # an empty first part: the columns when no row is found
        for rows in itertools.chain([[]], _prompt_rows(conn, cols, datasets, ids)):
            part = pl.DataFrame(rows, schema=schema, orient="row")
            if text:
                check_prompts(part)
                part = part.with_columns(messages_series(part["messages"]))
            parts.append(part.drop("hash", "content_id", strict=False))
    return pl.concat(parts)


_ID_CHUNK = 50_000  # prompt ids looked up per statement


def _prompt_rows(conn, cols: list[str], datasets, ids) -> Iterator[list]:
    """prompts_frame's rows, a chunk at a time: by key (ids, one dataset) or by dataset."""
    sql = f"SELECT {', '.join(cols)} FROM prompts"
    if ids is None:
        where, args = _where("dataset", datasets)
        yield from _chunks(conn.execute(sql + where, args), 100_000)
        return
    if datasets is None or len(list(datasets)) != 1:
        raise ConfigError("prompts_frame: ids are looked up within one dataset (datasets=[name])")
    ids, (name,) = list(ids), list(datasets)
    sql += " INDEXED BY prompts_key WHERE dataset = ? AND prompt_id IN (SELECT value FROM json_each(?))"
    for k in range(0, len(ids), _ID_CHUNK):
        yield conn.execute(sql, (name, json.dumps(ids[k : k + _ID_CHUNK]))).fetchall()


def errors_frame(run_dir):
    """Every ErrorRecord as a frame, with `resolved` (the key now has a record; the rest are
    the effective error set)."""
    sql = "SELECT e.dataset, e.prompt_id, e.sample, e.error, e.attempts, e.t, EXISTS (SELECT 1 FROM records r WHERE r.dataset = e.dataset AND r.prompt_id = e.prompt_id AND r.sample = e.sample) FROM errors e ORDER BY e.id"
    return _frame(run_dir, sql, [], _sql_schema([*KEY, "error", "attempts", "t", "resolved"]))


def prompt_state(conn: sqlite3.Connection) -> dict:
    """{"counts": dataset -> prompts, "custom_ids": dataset -> those whose id is not their content
    hash} as the writer keeps them (state "prompts"); else counted, custom ids unknown (absent)."""
    row = conn.execute("SELECT value FROM state WHERE key = 'prompts'").fetchone()
    if row is not None:
        return json.loads(row[0])
    return {
        "counts": dict(
            conn.execute("SELECT dataset, count(*) FROM prompts GROUP BY dataset").fetchall()
        ),
        "custom_ids": {},
    }


def totals(conn: sqlite3.Connection) -> dict[str, tuple[int, int, int]]:
    """dataset -> (samples, completion tokens, truncated) of its committed records."""
    rows = conn.execute("SELECT dataset, samples, tokens, truncated FROM totals")
    return {ds: (s, t, x) for ds, s, t, x in rows}


def has_prompts(run_dir) -> bool:
    """True when run_dir's database holds prompts (a plan's, or a run's)."""
    if not is_run_dir(run_dir):
        return False
    with open_db(run_dir) as conn:
        return conn.execute("SELECT 1 FROM prompts LIMIT 1").fetchone() is not None


def is_run_dir(run_dir) -> bool:
    """True when run_dir holds a run database."""
    return db.db_path(run_dir).exists()
