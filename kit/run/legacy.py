"""Run directories of kit's JSONL layout (config.json, prompts.parquet, records/*.jsonl,
errors.jsonl, skipped.jsonl), imported once into the run database.

The import writes run.sqlite.importing and renames it into place when complete, so a kill
mid-import leaves no half database; the old files are left as they were (kit reads only the
database afterwards). Lines that are not whole records (a torn last line, damage) are not
imported and are counted in the state row "imported" with the first few named.
"""

from __future__ import annotations

import heapq
import json
import os
from pathlib import Path

from kit.run import db
from kit.types import ErrorRecord, Record

_FIELDS = set(Record.__slots__) - {"messages", "tools"}
_LISTS = ("output_ids", "prompt_ids", "turns", "tool_calls")  # JSON lists in a record line
_ERROR_FIELDS = ("dataset", "prompt_id", "sample", "error", "attempts", "t")
_SKIP_FIELDS = (
    "dataset",
    "prompt_id",
    "prompt_tokens",
    "max_tokens",
    "max_context",
    "samples",
    "reason",
)


def is_old_layout(run_dir: Path) -> bool:
    return not db.db_path(run_dir).exists() and (run_dir / "config.json").is_file()


def import_old_layout(run_dir: Path) -> dict | None:
    """Import run_dir's JSONL layout into run_dir/run.sqlite, once; None when there is none.

    Returns {"records", "errors", "skipped_lines", "problems"} of what was imported.
    """
    run_dir = Path(run_dir)
    if not is_old_layout(run_dir):
        return None
    tmp = run_dir / (db.DB_NAME + ".importing")
    for leftover in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm"), Path(f"{tmp}-journal")):
        leftover.unlink(missing_ok=True)  # kit's own half import from a killed earlier try
    import sqlite3

    conn = sqlite3.connect(tmp, isolation_level=None)
    try:
        db.migrate(conn)
        conn.execute("BEGIN")
        report = _fill(conn, run_dir)
        conn.execute("INSERT INTO state VALUES ('imported', ?)", (json.dumps(report),))
        conn.execute("COMMIT")
    finally:
        conn.close()
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, db.db_path(run_dir))
    return report


def _fill(conn, run_dir: Path) -> dict:
    doc = json.loads((run_dir / "config.json").read_text())
    conn.execute(
        "INSERT INTO config VALUES (1, ?, ?)", (doc["fingerprint"], json.dumps(doc["config"]))
    )
    if (run_dir / "prompts.parquet").exists():
        import polars as pl

        frame = pl.read_parquet(run_dir / "prompts.parquet")
        for rows in db.prompt_rows(frame):
            conn.executemany(db.PROMPT_SQL, rows)
    problems: list[str] = []
    n_records = 0
    for path, lineno, row in _in_t_done_order(
        sorted((run_dir / "records").glob("*.jsonl")), problems
    ):
        try:
            if bad := [
                k for k in _LISTS if row.get(k) is not None and not isinstance(row[k], list)
            ]:
                raise ValueError(f"{bad[0]} is not a list")
            rec = Record(messages=[], **{k: row[k] for k in _FIELDS if k in row})
            added = conn.execute(db.RECORD_SQL, db.record_row(rec)).rowcount
        except (TypeError, ValueError, OverflowError) as e:
            problems.append(f"{path.name}:{lineno}: {e}")
            continue
        if row.get("messages"):  # a line that held its own prompt
            _own_prompt(conn, rec, row)
        if added:
            n_records += 1
            conn.execute(
                db.TOTALS_SQL,
                (rec.dataset, 1, rec.completion_tokens, int(rec.finish_reason == "length")),
            )
    n_errors = 0
    for _, row in _lines(run_dir / "errors.jsonl", problems):
        try:
            e = ErrorRecord(**{k: row[k] for k in _ERROR_FIELDS})
        except (KeyError, TypeError):
            continue
        conn.execute(
            "INSERT INTO errors (dataset, prompt_id, sample, error, attempts, t) VALUES (?, ?, ?, ?, ?, ?)",
            (e.dataset, e.prompt_id, e.sample, e.error, e.attempts, e.t),
        )
        n_errors += 1
    for _, row in _lines(run_dir / "skipped.jsonl", problems):
        conn.execute(
            "INSERT OR IGNORE INTO skips VALUES (?, ?, ?, ?, ?, ?, ?)",
            tuple(row.get(k) for k in _SKIP_FIELDS),
        )
    return {
        "records": n_records,
        "errors": n_errors,
        "skipped_lines": len(problems),
        "problems": problems[:20],
    }


def _own_prompt(conn, rec: Record, row: dict) -> None:
    """A line of a prompt prompts.parquet lacked: store that prompt (never over another)."""
    import polars as pl

    frame = pl.DataFrame(
        {"dataset": [rec.dataset], "prompt_id": [rec.prompt_id], "messages": [row["messages"]]}
    )
    if row.get("tools"):
        frame = frame.with_columns(tools=pl.lit(json.dumps(row["tools"], separators=(",", ":"))))
    for rows in db.prompt_rows(frame):
        conn.executemany(db.PROMPT_SQL, rows)


def _in_t_done_order(paths: list[Path], problems: list):
    """(path, line number, dict) of the files' lines merged by t_done, ties in file order:
    the order every reader of this layout gave (each file is in t_done order as the runner
    appended it), so records are committed, and exported, in that order."""

    def keyed(path):
        for lineno, row in _lines(path, problems):
            t = row.get("t_done")
            yield (t if isinstance(t, (int, float)) else 0.0), path, lineno, row

    for _, path, lineno, row in heapq.merge(*map(keyed, paths), key=lambda item: item[0]):
        yield path, lineno, row


def _lines(path: Path, problems: list):
    """(line number, dict) of each whole JSON line of a file; the rest counted in problems."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below; a records file may be GBs
    except FileNotFoundError:
        return
    with f:
        for i, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                problems.append(f"{path.name}:{i}: torn last line (no newline)")
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                problems.append(f"{path.name}:{i}: not a whole JSON line")
                continue
            if isinstance(row, dict):
                yield i, row
            else:
                problems.append(f"{path.name}:{i}: not a JSON object")
