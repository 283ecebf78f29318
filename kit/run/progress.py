"""Progress of a run from its directory, read incrementally: what kit.watch polls every second.

`ProgressReader` follows each records file by byte offset with running totals (tokens,
samples, truncated, recent (t_done, tokens) for tokens/s, errors a later record resolved):
a poll parses only the complete lines appended since the last one, so it costs the same
on a multi-GB run as on a new one. A torn last line is left for the next poll. A file that
shrank (repaired after a crash, cut back after a failed write), was replaced (new inode),
or whose first or last line read changed is read again from the start. errors.jsonl
is followed the same way; config.json, prompts.parquet and skipped.jsonl are re-read only
when they change; status.json (the live runner's in-flight and retry counts) every poll.
Lines that are not records are skipped and listed in `ProgressReader.corrupt`.

A first read (and a re-read from the start) of a records file takes its totals from the
resume index (kit/run/index.py) when it is valid for the file, and reads only the bytes
after it: a finished run of a million records is watched at once.
"""

from __future__ import annotations

import os
import time
from collections import deque
from pathlib import Path

import orjson

from kit.run import index as _index
from kit.run.lines import heads, parse_lines, record_files, safe_name
from kit.types import DatasetProgress

_CHUNK = 32 << 20  # bytes read at once: a first poll of a GB file reads it in pieces
_MARK = 128  # head bytes of the first and last line read, checked each poll (rewritten file?)
_RECENT = 20_000  # (t_done, tokens) pairs kept per file for tokens/s


class _Tail:
    """A file followed by byte offset; subclasses keep totals of the lines consumed."""

    def __init__(self) -> None:
        self.ino: int | None = None
        self.offset = 0
        self.first = b""  # the head of the file's first line, as read
        self.last_pos, self.last = 0, b""  # where the last line read starts, and its head

    def update(self, path: Path) -> bool:
        """Consume the complete lines appended since the last call; True when it re-read all."""
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            rewound = self.offset > 0
            if rewound:
                self._rewind()
            return rewound
        with f:
            st = os.fstat(f.fileno())
            rewound = self.offset > 0 and (
                st.st_ino != self.ino or st.st_size < self.offset or not self._same_mark(f)
            )
            if rewound:
                self._rewind()
            self.ino = st.st_ino
            if self.offset == 0:
                self.start(path, f)
            self._consume_until(f, st.st_size)
        return rewound

    def start(self, path: Path, f) -> None:
        """Before a read from the start: a subclass may begin further on (an index)."""

    def _same_mark(self, f) -> bool:
        """Whether the heads of the first and the last line read are still there."""
        f.seek(0)
        first = f.read(len(self.first))
        f.seek(self.last_pos)
        return first == self.first and f.read(len(self.last)) == self.last

    def _rewind(self) -> None:
        self.offset, self.first, self.last_pos, self.last = 0, b"", 0, b""
        self.reset()

    def _consume_until(self, f, size: int) -> None:
        """Consume whole lines up to size in chunks; a line without its newline waits."""
        want = _CHUNK
        while self.offset < size:
            f.seek(self.offset)
            data = f.read(min(want, size - self.offset))
            end = data.rfind(b"\n") + 1
            if end == 0:
                if self.offset + len(data) >= size:
                    return  # a torn (or still being written) last line
                want *= 2  # a line longer than a chunk
                continue
            self.consume(data[:end])
            if self.offset == 0:
                self.first = data[:_MARK]
            start = data.rfind(b"\n", 0, end - 1) + 1  # the last line's head: its key and t_done
            self.last_pos, self.last = self.offset + start, data[start : start + _MARK]
            self.offset += end
            want = _CHUNK

    def reset(self) -> None:
        raise NotImplementedError

    def consume(self, data: bytes) -> None:
        raise NotImplementedError


class _Records(_Tail):
    """Running totals of one records file."""

    def __init__(self, failed: dict) -> None:
        super().__init__()
        self.failed = failed  # shared: keys in errors.jsonl
        self.reset()

    def reset(self) -> None:
        self.tokens = self.samples = self.truncated = 0
        self.recent: deque = deque(maxlen=_RECENT)  # (t_done, tokens)
        self.resolved: set = set()  # failed keys that a later attempt wrote
        self.lines = 0  # complete lines consumed
        self.problems: list = []  # (line, problem) of the lines that are not records

    def start(self, path: Path, f) -> None:
        """Take the totals of the bytes the file's valid index covers; read on after them."""
        got = _index.load(path)
        if got is None or got.size == 0:
            return
        frame = got.frame
        tokens = frame["completion_tokens"]
        self.tokens, self.samples = int(tokens.sum()), frame.height
        self.truncated = int((frame["finish_reason"] == "length").sum())
        last = frame.tail(_RECENT)
        self.recent.extend(
            zip(last["t_done"].to_list(), last["completion_tokens"].to_list(), strict=True)
        )
        self.resolved |= _index.failed_in(frame, self.failed)
        self.lines, self.problems = got.lines, list(got.problems)
        self.offset = got.size
        f.seek(0)
        self.first = f.read(min(_MARK, got.size))
        self.last_pos = _index.line_start(f, got.size)
        f.seek(self.last_pos)
        self.last = f.read(min(_MARK, got.size - self.last_pos))

    def consume(self, data: bytes) -> None:
        found = heads(data, self.problems, self.lines + 1)
        self.lines += data.count(b"\n")
        for ds, pid, sample, tokens, finish, t_done in found:
            self.tokens += tokens
            self.samples += 1
            self.truncated += finish == "length"
            self.recent.append((t_done, tokens))
            if (ds, pid, sample) in self.failed:
                self.resolved.add((ds, pid, sample))

    def rate(self, now: float, window_s: float) -> float:
        """Tokens/s of the records whose t_done is within window_s of now."""
        while self.recent and now - self.recent[0][0] > window_s:
            self.recent.popleft()
        if len(self.recent) < 2:
            return 0.0
        return sum(c for _, c in self.recent) / max(now - self.recent[0][0], 1.0)


class _Errors(_Tail):
    """The keys of errors.jsonl and their count per dataset."""

    def __init__(self) -> None:
        super().__init__()
        self.failed: dict = {}  # (dataset, prompt_id, sample) -> None, in first-seen order
        self.reset()

    def reset(self) -> None:
        self.failed.clear()  # in place: _Records hold a reference
        self.per_dataset: dict[str, int] = {}  # dataset -> distinct failed keys

    def consume(self, data: bytes) -> None:
        for row in parse_lines(data)[0]:
            key = (row.get("dataset"), row.get("prompt_id"), row.get("sample"))
            if isinstance(key[0], str) and key not in self.failed:
                self.failed[key] = None
                self.per_dataset[key[0]] = self.per_dataset.get(key[0], 0) + 1


class ProgressReader:
    """Incremental `progress` of one run directory: each read() parses only what was appended.

    Args:
        run_dir: the run directory (kit.types layout).
        window_s: tokens/s over the records of the last window_s seconds.
        stale_s: a status.json older than this is not a live runner (in_flight 0).

    Example:
        reader = ProgressReader("data/runs/demo")
        reader.read()   # first call: reads every record file once
        reader.read()   # later calls: only the lines appended since -> [DatasetProgress, ...]
    """

    def __init__(self, run_dir, *, window_s: float = 30.0, stale_s: float = 15.0) -> None:
        self.run_dir = Path(run_dir)
        self.window_s, self.stale_s = window_s, stale_s
        self._errors = _Errors()
        self._records: dict[str, _Records] = {}  # file stem -> tail
        self._cache: dict[str, tuple] = {}  # file name -> (stat key, parsed value)

    def read(self) -> list[DatasetProgress]:
        """Where each dataset stands now; FileNotFoundError before config.json exists."""
        config = self._cached("config.json", _load_config)
        n = config.sampling.n
        totals = {d: c * n for d, c in self._cached("prompts.parquet", _prompt_counts).items()}
        skipped = self._cached("skipped.jsonl", _skipped_counts)
        live = _read_status(self.run_dir, self.stale_s) or {}
        if self._errors.update(self.run_dir / "errors.jsonl"):
            self._records.clear()  # resolved sets were built against the old error set
        files = record_files(self.run_dir)
        for stem, path in files.items():
            self._records.setdefault(stem, _Records(self._errors.failed)).update(path)
        now = time.time()
        out = []
        for name in dict.fromkeys([*config.budgets, *totals]):
            p = DatasetProgress(dataset=name, budget=int(config.budgets.get(name, 0)))
            tail = self._records.get(safe_name(name)) if safe_name(name) in files else None
            if tail is not None:
                p.tokens_done, p.samples_done, p.truncated = (
                    tail.tokens,
                    tail.samples,
                    tail.truncated,
                )
                p.tokens_per_s = tail.rate(now, self.window_s)
            resolved = len(tail.resolved) if tail is not None else 0
            p.errors = self._errors.per_dataset.get(name, 0) - resolved
            p.prompts_total, p.skipped = totals.get(name, 0), skipped.get(name, 0)
            _apply_live(p, live.get(name))
            out.append(p)
        return out

    __call__ = read

    @property
    def corrupt(self) -> list[dict]:
        """The lines read so far that are not records: [{"file", "line", "problem"}]."""
        out = []
        for stem, tail in sorted(self._records.items()):
            out += [
                {"file": f"records/{stem}.jsonl", "line": n, "problem": p} for n, p in tail.problems
            ]
        return out

    def _cached(self, name: str, load):
        """load(path) of a small run-dir file, re-run only when the file changed."""
        path = self.run_dir / name
        try:
            st = path.stat()
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            key = None
        hit = self._cache.get(name)
        if hit is not None and hit[0] == key:
            return hit[1]
        value = load(path)
        self._cache[name] = (key, value)
        return value


def progress(run_dir, *, window_s: float = 30.0, stale_s: float = 15.0) -> list[DatasetProgress]:
    """Where each dataset of a run stands, from its files (one full read; `ProgressReader`
    follows a run incrementally, as kit.watch does).

    Tokens and samples come from the records; tokens/s from the t_done of records in the
    last `window_s` seconds; in-flight and retry counts from status.json while the runner
    writes it (older than `stale_s`: not live); `skipped` from skipped.jsonl.

    Example: [p.tokens_done for p in progress("data/runs/demo")] -> [4012, 2561]
    """
    return ProgressReader(run_dir, window_s=window_s, stale_s=stale_s).read()


def _load_config(path: Path):
    """The RunConfig of run_dir/config.json (FileNotFoundError when absent)."""
    from kit.run.store import read_config

    return read_config(path.parent)


def _prompt_counts(path: Path) -> dict[str, int]:
    """dataset -> prompts in prompts.parquet ({} when absent)."""
    import polars as pl

    if not path.exists():
        return {}
    counts = pl.read_parquet(path, columns=["dataset"])["dataset"].value_counts()
    return dict(counts.iter_rows())


def _skipped_counts(path: Path) -> dict[str, int]:
    """dataset -> samples skipped (skipped.jsonl lines, kit._guard; {} when absent)."""
    try:
        rows, _ = parse_lines(path.read_bytes())
    except FileNotFoundError:
        return {}
    out: dict[str, int] = {}
    for r in rows:
        out[r.get("dataset")] = out.get(r.get("dataset"), 0) + int(r.get("samples", 1))
    return out


def _read_status(run_dir: Path, stale_s: float) -> dict | None:
    """dataset -> live status dict, or None when no fresh runner status exists."""
    try:
        doc = orjson.loads((run_dir / "status.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    if doc.get("finished") or time.time() - doc.get("t", 0) > stale_s:
        return {d["dataset"]: {**d, "in_flight": 0, "stale": True} for d in doc.get("datasets", [])}
    return {d["dataset"]: d for d in doc.get("datasets", [])}


def _apply_live(p: DatasetProgress, live: dict | None) -> None:
    """Merge the runner's live counts; derive the state from the files otherwise."""
    if live:
        p.in_flight, p.retries = live.get("in_flight", 0), live.get("retries", 0)
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
