"""The run directory: append-only, crash-safe records and the resume index.

Layout (see kit/types.py): config.json, prompts.parquet, records/<dataset>.jsonl,
errors.jsonl, plus repair.log (torn lines cut after a crash) and status.json (the live
runner's in-flight/retry counts). `progress` and `ProgressReader` (kit/_progress.py) read a
run's progress back from these files.

One writer: a RunStore that writes holds an exclusive flock on run_dir/.lock (which names
its pid and host) from init() to close(); a second writer gets RunLocked. The kernel drops
the lock when the process ends, even by kill -9. Readers take no lock.

Damaged lines: a complete line that is not a record is skipped by every reader and
reported as {"file", "line", "problem"} (RunStore.scan().corrupt, read_records,
ProgressReader.corrupt; kit.audit and kit.export report them too).

Crash safety: records are buffered and written as whole lines in group flushes (every
`flush_every` records or `flush_interval` seconds, and on close), each followed by fsync.
A kill -9 can only tear the last line of a file; the writer cuts it off on open and logs
it in repair.log, and readers never parse past the last newline. A failed write (full
disk) truncates the file back to its last complete line and raises StoreWriteError.

Resume index: close() (a clean stop) writes run_dir/index/<stem>.parquet + .json for each
records file (kit/run/index.py); scan() takes a valid one and parses only what came after.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

import orjson

from kit.run import index as _index
from kit.run import progress as _progress
from kit.run.batches import read_records, records_frame  # noqa: F401 - re-exported
from kit.run.lines import (  # noqa: F401 - corrupt_entries, describe_corrupt: re-exported
    ERROR_FIELDS,
    LINE_ORDER,
    LINE_ORDER_SHORT,
    complete_bytes,
    corrupt_entries,
    describe_corrupt,
    parse_lines,
    record_files,
    record_key,
    safe_name,
    truncate_quietly,
    write_all,
    write_atomic,
)
from kit.run.prompts import prompt_keys, with_earlier_prompts
from kit.types import DatasetProgress, ErrorRecord, Record, RunConfig

Key = tuple  # (dataset, prompt_id, sample)
PROMPT_ROW_GROUP = 10_000  # rows per row group of prompts.parquet
ProgressReader = _progress.ProgressReader  # re-exported: the readers live in kit/_progress.py
progress = _progress.progress


class FingerprintMismatch(ValueError):
    """A run directory was made with a different output-changing configuration."""


class StoreWriteError(OSError):
    """A write to the run directory failed (e.g. full disk); nothing half-written remains."""


class RunLocked(RuntimeError):
    """Another writer (named by pid and host) holds the run directory's lock."""


class ScanResult(dict):
    """{(dataset, prompt_id, sample): (completion_tokens, finish_reason)}, plus `corrupt`:
    the lines skipped as not records, [{"file", "line", "problem"}]."""

    def __init__(self) -> None:
        super().__init__()
        self.corrupt: list[dict] = []


# ---------------------------------------------------------------- fingerprint


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


def _lock_holder(f) -> str:
    """Who holds the lock, as its holder wrote it ("pid 123 on host since ...")."""
    for _ in range(50):  # the holder writes its pid just after taking the lock
        f.seek(0)
        text = f.read().strip()
        if text:
            return text.splitlines()[0]
        time.sleep(0.01)
    return "holder unknown"


# ---------------------------------------------------------------- config io


def read_config(run_dir) -> RunConfig:
    """The RunConfig stored in run_dir/config.json.

    Example: read_config("data/runs/demo").budgets -> {"alpaca": 4000, "sharegpt": 2500}
    """
    path = Path(run_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a run directory?")
    return RunConfig.from_dict(json.loads(path.read_text())["config"])


# ---------------------------------------------------------------- the writer


class RunStore:
    """The writer side of a run directory.

    Args:
        run_dir: the directory (created on init).
        flush_every: group flush after this many buffered lines.
        flush_interval: or after this many seconds (checked on append and `maybe_flush`).

    Example:
        store = RunStore("data/runs/demo")
        store.init(config, prompts)          # refuses a changed fingerprint unless force=True
        done = store.index()                 # {(dataset, prompt_id, sample): completion_tokens}
        store.append(record); store.close()
    """

    def __init__(self, run_dir, *, flush_every: int = 32, flush_interval: float = 1.0) -> None:
        self.run_dir = Path(run_dir)
        self.flush_every = flush_every
        self.flush_interval = flush_interval
        self._fds: dict[Path, int] = {}
        self._pending: dict[Path, list[bytes]] = {}
        self._pending_heads: dict[Path, list] = {}  # records file -> heads of pending lines
        self._paths: dict[str, Path] = {}  # dataset -> records file (built once: append is hot)
        self._n_pending = 0
        self._last_flush = time.monotonic()
        self.repaired: list[dict] = []  # torn tails cut on open: {"file", "bytes", "t"}
        self.corrupt: list[dict] = []  # lines the last scan() skipped: {"file", "line", "problem"}
        self._lock = None  # the open run_dir/.lock while this store may write
        self._prompt_keys: set | None = None  # (dataset, prompt_id) of prompts.parquet
        # the resume index (kit/run/index.py), kept so close() writes it without a rescan:
        self._known: dict[Path, _index.FileHeads] = {}  # records file -> heads at last scan()
        self._heads: dict[Path, _index.Appended] = {}  # records file -> heads written since then
        self._opened: dict[Path, int] = {}  # file -> its size when this store opened it

    # -- setup
    def init(self, config: RunConfig, prompts_frame=None, *, force: bool = False) -> None:
        """Lock the run dir, create or reopen it; write config.json and prompts.parquet.

        Raises RunLocked when another writer holds the run dir (its pid named); the lock is
        held until close(). Raises FingerprintMismatch (naming each changed part, old -> new)
        when the run dir holds a different fingerprint, or records but no config.json, unless
        force=True. Budgets/endpoints may change.
        """
        (self.run_dir / "records").mkdir(parents=True, exist_ok=True)
        self._take_lock()
        try:
            self._init(config, prompts_frame, force)
        except BaseException:
            self._release_lock()
            raise

    def _init(self, config: RunConfig, prompts_frame, force: bool) -> None:
        cfg_path = self.run_dir / "config.json"
        if not cfg_path.exists() and not force and self._has_records():
            raise FingerprintMismatch(
                f"run dir {self.run_dir} holds records but no config.json, so the settings they "
                "were made with cannot be checked against this run's; restore config.json, use a "
                "new run_dir, or pass force=True to resume anyway"
            )
        if cfg_path.exists() and not force:
            old = read_config(self.run_dir)
            changes = _diff_parts(old.fingerprint_parts(), config.fingerprint_parts())
            if changes:
                raise FingerprintMismatch(
                    f"run dir {self.run_dir} was made with a different configuration:\n  "
                    + "\n  ".join(changes)
                    + "\nUse a new run_dir, or pass force=True to resume anyway."
                )
        doc = {"fingerprint": config.fingerprint(), "config": config.to_dict()}
        write_atomic(cfg_path, json.dumps(doc, indent=2).encode())
        if prompts_frame is not None:
            tmp = self.run_dir / "prompts.parquet.tmp"
            # small row groups: a reader decodes 10K prompts at a time (PromptStore)
            frame = with_earlier_prompts(self.run_dir, prompts_frame)
            frame.write_parquet(tmp, row_group_size=PROMPT_ROW_GROUP)
            os.replace(tmp, self.run_dir / "prompts.parquet")
        self.repair()

    def _has_records(self) -> bool:
        return any(p.stat().st_size for p in record_files(self.run_dir).values())

    def _take_lock(self) -> None:
        """Hold an exclusive flock on run_dir/.lock until close(); RunLocked when taken."""
        if self._lock is not None:
            return
        f = open(self.run_dir / ".lock", "a+")  # noqa: SIM115 - held open until close()
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _lock_holder(f)
            f.close()
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise RunLocked(_locked_message(self.run_dir, holder)) from None
        f.seek(0)
        f.truncate()
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since {since}\n")
        f.flush()
        self._lock = f

    def _release_lock(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.close()  # closing the file drops the flock

    def repair(self) -> list[dict]:
        """Cut a torn last line off every records/errors file; log it in repair.log."""
        files = list(record_files(self.run_dir).values()) + [self.run_dir / "errors.jsonl"]
        for path in files:
            try:
                with open(path, "rb") as f:  # only the end is read: the file may be GBs
                    size = os.fstat(f.fileno()).st_size
                    keep = _index.line_start(f, size + 1) if size else 0
            except FileNotFoundError:
                continue
            if keep < size:
                os.truncate(path, keep)
                entry = {
                    "file": str(path.relative_to(self.run_dir)),
                    "bytes": size - keep,
                    "t": time.time(),
                }
                self.repaired.append(entry)
                with open(self.run_dir / "repair.log", "ab") as f:
                    f.write(orjson.dumps(entry) + b"\n")
        return self.repaired

    # -- reading (writer side)
    def index(self) -> dict[Key, int]:
        """Scan records: {(dataset, prompt_id, sample): completion_tokens}; first copy wins."""
        return {key: tokens for key, (tokens, _) in self.scan().items()}

    def scan(self) -> ScanResult:
        """Scan records: {key: (completion_tokens, finish_reason)}; first copy wins.

        Lines that are not records are skipped and listed in `.corrupt` (also kept as
        self.corrupt): their samples count as not done, so a resume generates them again.
        Each file is read from its resume index on, when it has a valid one (kit.run.index).
        """
        out = ScanResult()
        for found, got in self._scan_files(out.corrupt):
            if found is None:
                _index.add_heads(out, got.frame)
            for head in found or ():
                out.setdefault(head[:3], head[3:5])
        return out

    def scan_frame(self):
        """scan() as a polars frame, without a Python object per record (a restart's view):
        dataset, prompt_id, sample, completion_tokens, finish_reason of each key's first
        copy, in file order; skipped lines in self.corrupt. None when a head does not fit
        the frame (a count over 2**63): scan() then.

        Example: RunStore(run_dir).scan_frame()["completion_tokens"].sum() -> 4012
        """
        frames = [got.frame for _, got in self._scan_files([])]
        return None if any(f is None for f in frames) else _index.first_copies(frames)

    def _scan_files(self, corrupt: list) -> list[tuple]:
        """index.scan_file of each records file; their skipped lines go to `corrupt` and
        self.corrupt, their heads to what close() writes the resume index from."""
        out = []
        for path in record_files(self.run_dir).values():
            found, got = _index.scan_file(path)  # the index + what came after, or all
            out.append((found, got))
            corrupt += corrupt_entries(path, got.problems)
            self._known[path] = got  # close() adds what this store writes after it
            self._heads.pop(path, None)
        self.corrupt = corrupt
        return out

    def errors(self) -> dict[Key, ErrorRecord]:
        """The effective error set: latest ErrorRecord per key, minus keys now in records."""
        done = self.index()
        out = {}
        for row in _error_rows(self.run_dir):
            if record_key(row) not in done:
                out[record_key(row)] = ErrorRecord(**{k: row[k] for k in ERROR_FIELDS})
        return out

    # -- writing
    def append(self, record: Record) -> None:
        """Buffer one record; group-flushed (write + fsync) by count or time."""
        if self._prompt_keys is None:
            self._prompt_keys = prompt_keys(self.run_dir)
        # a prompt of prompts.parquet is stored there once, not on each of its records
        short = (record.dataset, record.prompt_id) in self._prompt_keys
        row = {f: getattr(record, f) for f in (LINE_ORDER_SHORT if short else LINE_ORDER)}
        path = self._paths.get(record.dataset)
        if path is None:
            path = self.run_dir / "records" / f"{safe_name(record.dataset)}.jsonl"
            self._paths[record.dataset] = path
        self._buffer(path, orjson.dumps(row) + b"\n", _index.record_head(record))

    def append_error(self, error: ErrorRecord) -> None:
        """Buffer one ErrorRecord for errors.jsonl."""
        row = {f: getattr(error, f) for f in ERROR_FIELDS}
        self._buffer(self.run_dir / "errors.jsonl", orjson.dumps(row) + b"\n")

    def _buffer(self, path: Path, line: bytes, head=False) -> None:
        self._pending.setdefault(path, []).append(line)
        if head is not False:  # a record's (record_head): kept for the resume index
            self._pending_heads.setdefault(path, []).append(head)
        self._n_pending += 1
        self.maybe_flush()

    def maybe_flush(self) -> None:
        """Flush when `flush_every` lines are buffered or `flush_interval` has passed."""
        due = time.monotonic() - self._last_flush >= self.flush_interval
        if self._n_pending >= self.flush_every or (self._n_pending and due):
            self.flush()

    def flush(self) -> None:
        """Write every buffered line and fsync. On OSError: truncate back, raise StoreWriteError."""
        pending, self._pending, self._n_pending = self._pending, {}, 0
        heads, self._pending_heads = self._pending_heads, {}
        self._last_flush = time.monotonic()
        for path, lines in pending.items():
            fd = self._fd(path)
            start = os.fstat(fd).st_size
            try:
                data = b"".join(lines)
                write_all(fd, data)
                os.fsync(fd)
                if path in heads:
                    self._heads.setdefault(path, _index.Appended()).add(heads[path], len(data))
            except OSError as e:
                truncate_quietly(fd, start)
                lost = sum(len(v) for v in pending.values())
                raise StoreWriteError(
                    e.errno,
                    f"could not write {path} ({e.strerror or e}); the run stopped cleanly, "
                    f"no partial line was kept; up to {lost} unwritten results will be "
                    "generated again on resume",
                ) from e

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._fds[path] = fd
            self._opened.setdefault(path, os.fstat(fd).st_size)
        return fd

    def close(self) -> None:
        """Flush, fsync and close every file, then drop the lock (safe to call twice)."""
        try:
            if self._n_pending:
                self.flush()
            if self._fds or self._lock is not None:  # a writer, once, on a clean stop:
                records = self.run_dir / "records"  # the resume index, without a rescan
                _index.write_session(records, self._known, self._heads, self._opened)
        finally:
            for fd in self._fds.values():
                os.close(fd)
            self._fds = {}
            self._release_lock()

    def write_status(
        self, progress: list[DatasetProgress], *, finished: bool = False, stop_reason=None
    ) -> None:
        """Write status.json: the live runner's view (in flight, retries, state, and why the
        run stopped early: `stop_reason`, null while running or when it ran to the end)."""
        doc = {
            "t": time.time(),
            "finished": finished,
            "pid": os.getpid(),
            "stop_reason": stop_reason,
        }
        doc["datasets"] = [dataclasses.asdict(p) for p in progress]
        try:
            write_atomic(self.run_dir / "status.json", orjson.dumps(doc))
        except OSError:
            pass  # status is advisory; records and errors carry the truth


# ---------------------------------------------------------------- readers


def read_errors(run_dir):
    """Every ErrorRecord line as a polars frame, with `resolved` (the key now has a record).

    Example: read_errors(run_dir).filter(~pl.col("resolved")) -> the effective error set
    """
    import polars as pl

    run_dir = Path(run_dir)
    rows = _error_rows(run_dir)
    schema = {"dataset": pl.String, "prompt_id": pl.String, "sample": pl.Int64, "error": pl.String, "attempts": pl.Int64, "t": pl.Float64, "resolved": pl.Boolean}  # fmt: skip
    wanted = {record_key(r) for r in rows}
    done = _done_among(run_dir, wanted) if wanted else set()
    data = [
        {**{k: r.get(k) for k in ERROR_FIELDS}, "resolved": record_key(r) in done} for r in rows
    ]
    return pl.DataFrame(data, schema=schema)


def _done_among(run_dir: Path, keys: set) -> set:
    """The keys (of a few error lines) that now have a record: the run's heads are scanned
    as a polars frame (the resume index where valid), not a dict of every key."""
    import polars as pl

    store = RunStore(run_dir)
    heads = store.scan_frame()
    if heads is None:  # a head that does not fit a frame: the dict scan
        return keys & store.index().keys()
    cols = ["dataset", "prompt_id", "sample"]
    want = pl.DataFrame(list(keys), schema=dict(zip(cols, (pl.String, pl.String, pl.Int64), strict=True)), orient="row")  # fmt: skip
    return set(want.join(heads.select(cols), on=cols, how="semi").iter_rows())


def _error_rows(run_dir: Path) -> list[dict]:
    """The lines of errors.jsonl that are ErrorRecords (a damaged line is not one)."""
    rows, _ = parse_lines(complete_bytes(run_dir / "errors.jsonl"))
    types = {"dataset": str, "prompt_id": str, "sample": int, "error": str, "attempts": int}
    return [
        r
        for r in rows
        if all(type(r.get(k)) is t for k, t in types.items())
        and isinstance(r.get("t"), (int, float))
    ]
