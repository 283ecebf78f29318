"""Progress of a run from its database: what kit.watch polls every second.

Totals come from the `totals` table, which the writer updates in the transaction that
commits the records they count, and prompt counts from the writer's count of them, so a
poll reads a few small rows however large the run is (no record and no prompt key).
tokens/s, in-flight and retry counts come from the live runner's status row while it is
fresh (the runner's own rate over its last 30 s of answers); a run not writing has none.
"""

from __future__ import annotations

import json
import socket
import time

from kit.errors import MissingPath
from kit.run import db
from kit.run.reader import config_doc, open_db, prompt_state, state, totals
from kit.types import DatasetProgress, RunConfig


def progress(run_dir, *, stale_s: float = 15.0) -> list[DatasetProgress]:
    """Where each dataset of a run stands, from its database.

    Tokens, samples and truncations from the committed totals; tokens/s, in-flight and
    retry counts from the runner's status while it writes it (older than `stale_s`: not
    live, tokens/s 0); `skipped` from the skips.

    Example: [p.tokens_done for p in progress("data/runs/demo")] -> [4012, 2561]
    """
    return progress_and_writer(run_dir, stale_s=stale_s)[0]


def progress_and_writer(
    run_dir, *, stale_s: float = 15.0
) -> tuple[list[DatasetProgress], str | None]:
    """(progress(run_dir), writer_gone(run_dir)) from one read: what kit.watch polls."""
    with open_db(run_dir) as conn:
        doc = config_doc(conn)
        if doc is None:
            raise MissingPath(f"{run_dir} holds no run configuration yet")
        config = RunConfig.from_dict(doc)
        done = totals(conn)
        prompts = prompt_state(conn)["counts"]
        skipped = dict(
            conn.execute("SELECT dataset, sum(samples) FROM skips GROUP BY dataset").fetchall()
        )
        errors = dict(conn.execute(_OPEN_ERRORS).fetchall())
        row = conn.execute("SELECT value FROM state WHERE key = 'status'").fetchone()
        gone = _writer_gone(conn, run_dir)
    live = _live(row[0] if row else None, stale_s)
    n = config.sampling.n
    out = []
    for name in dict.fromkeys([*config.budgets, *prompts]):
        p = DatasetProgress(dataset=name, budget=int(config.budgets.get(name, 0)))
        p.samples_done, p.tokens_done, p.truncated = done.get(name, (0, 0, 0))
        p.errors, p.prompts_total = errors.get(name, 0), prompts.get(name, 0) * n
        p.skipped = int(skipped.get(name) or 0)
        _apply_live(p, live.get(name))
        if gone and not p.note and p.state not in ("budget_reached", "exhausted", "failed"):
            p.note = gone
        out.append(p)
    return out, gone


def writer_gone(run_dir) -> str | None:
    """Why no kit process writes run_dir any more (its writer ended: stopped, or its process
    is gone, killed), with the way on; None while one may (or none has started)."""
    with open_db(run_dir) as conn:
        return _writer_gone(conn, run_dir)


def _writer_gone(conn, run_dir) -> str | None:
    rows = dict(
        conn.execute("SELECT key, value FROM state WHERE key IN ('status', 'writer_process')")
    )
    try:
        writer = json.loads(rows["writer_process"])
        status = json.loads(rows.get("status") or "{}")
    except (KeyError, ValueError):
        return None
    pid, host = writer.get("pid"), writer.get("host")
    resume = f"resume with `kit generate --run-dir {run_dir}`"
    if status.get("finished") and status.get("pid") == pid:
        return f"the run stopped (its writer, pid {pid}, ended it); {resume}"
    if host != socket.gethostname() or db.process_start(pid) == writer.get("start"):
        return None  # alive (or on another host: its staleness tells)
    return (
        f"the writer of this run (pid {pid} on {host}) is gone without finishing (killed?); "
        f"its committed records are kept: {resume}"
    )


_OPEN_ERRORS = (
    "SELECT dataset, count(DISTINCT prompt_id || ':' || sample) FROM errors e WHERE NOT EXISTS "
    "(SELECT 1 FROM records r WHERE r.dataset = e.dataset AND r.prompt_id = e.prompt_id "
    "AND r.sample = e.sample) GROUP BY dataset"
)


def _live(text: str | None, stale_s: float) -> dict:
    """dataset -> the runner's status entry (in_flight 0 and stale when not fresh)."""
    try:
        doc = json.loads(text) if text else {}
    except ValueError:
        return {}
    rows = doc.get("datasets", []) if isinstance(doc, dict) else []
    if doc.get("finished") or time.time() - doc.get("t", 0) > stale_s:
        return {d["dataset"]: {**d, "in_flight": 0, "stale": True} for d in rows}
    return {d["dataset"]: d for d in rows}


def finish_counts(run_dir) -> dict[tuple[str, str], int]:
    """(dataset, finish_reason) -> answers not kept because their finish is no data
    (`abort`, `content_filter`, ...: retried, never records); {} for none.

    Example: finish_counts("data/runs/demo") -> {("alpaca_tasks", "abort"): 12}
    """
    with open_db(run_dir) as conn:
        if not conn.execute("SELECT 1 FROM sqlite_schema WHERE name = 'finish_counts'").fetchone():
            return {}  # a run database older than the table
        rows = conn.execute("SELECT dataset, finish_reason, count FROM finish_counts").fetchall()
    return {(ds, finish): n for ds, finish, n in rows}


def stop_reason(run_dir) -> str | None:
    """Why the last run stopped early (the runner's status), None when it ran to the end."""
    try:
        return json.loads(state(run_dir, "status") or "{}").get("stop_reason")
    except ValueError:
        return None


def _apply_live(p: DatasetProgress, live: dict | None) -> None:
    """Merge the runner's live counts; derive the state from the totals otherwise."""
    if live:
        p.in_flight, p.retries = live.get("in_flight", 0), live.get("retries", 0)
        if not live.get("stale"):
            p.tokens_per_s = float(live.get("tokens_per_s") or 0.0)
        if isinstance(live.get("note"), str):
            p.note = live["note"]  # e.g. "run stopped: stopped by SIGTERM", or a Retry-After cap
    if p.budget and p.tokens_done >= p.budget:
        p.state = "budget_reached"
    elif live and live.get("state") == "failed":  # the runner's verdict outlives the run
        p.state = "failed"
    elif p.prompts_total and p.samples_done + p.errors + p.skipped >= p.prompts_total:
        p.state = "exhausted"
    elif live and not live.get("stale"):
        p.state = live.get("state", "running")
    elif p.samples_done:
        p.state = "stopped"
