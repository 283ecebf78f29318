"""Read a run's records in bounded batches: memory stays flat from 1K to 1M records.

    for frame in record_batches(run_dir, columns=["dataset", "completion_tokens"]):
        ...  # a polars DataFrame of at most batch_size records

Records are read line by line from records/<dataset>.jsonl (nothing after a file's last
newline: a torn tail is not data), checked like every reader checks them
(kit.run.lines.record_problem), and the first copy of a key wins. Lines that are not
records are skipped and listed in `corrupt` ({"file", "line", "problem"}).

Prompts are stored once per run: record lines written since kit 0.13 hold no `messages`
and no `tools`; both are joined back from run_dir/prompts.parquet by (dataset, prompt_id),
only when a caller asks for those columns. A record written by RunConfig.turns
"all_turns" gets its prompt with the target's own earlier answers (Record.turns) in place
of the dataset's assistant turns, as the runner sent it. Older lines that still hold
their messages keep them. A record whose prompt is in neither place is skipped and listed
in `corrupt` (its conversation cannot be rebuilt).

Order: "file" reads file by file (kit.run.lines.record_files order); "t_done" merges the
files by t_done, ties in file order: the order a stable sort of all records by t_done gives
when each file is in t_done order, as the runner appends them.
"""

from __future__ import annotations

import heapq
import itertools
import os
import tempfile
from array import array
from collections.abc import Iterator
from pathlib import Path

import orjson

from kit.run.lines import (
    corrupt_entries,
    parse_line,
    record_files,
    record_problem,
    record_schema,
    safe_name,
)

PROMPT_COLUMNS = ("messages", "tools")
_READ = 1 << 20  # bytes read from a records file at once (one piece per file is held)


def record_batches(
    run_dir,
    *,
    datasets=None,
    batch_size: int = 5_000,
    columns=None,
    corrupt: list | None = None,
    order: str = "file",
    upto: dict[str, int] | None = None,
) -> Iterator[object]:
    """Yield the run's records as polars frames of at most `batch_size` rows.

    Args:
        run_dir: the run directory.
        datasets: names to read (default: all).
        batch_size: rows per frame.
        columns: the columns wanted (default: every column of records_frame, in its order).
        corrupt: a list that gets {"file", "line", "problem"} for each line skipped.
        order: "file" or "t_done" (see the module docstring).
        upto: file stem -> bytes: read each file only that far (file_sizes() taken before a
            first pass, so a second pass over a run still being written reads the same
            records); files not named are read to their end.

    Example:
        sum(f.height for f in record_batches(run_dir, columns=["dataset"]))  # -> records
    """
    from kit.run.lines import frame_rows

    schema = record_schema()
    cols = list(schema) if columns is None else [c for c in schema if c in set(columns)]
    unknown = set(columns or ()) - set(schema)
    if unknown:
        raise ValueError(f"unknown record columns {sorted(unknown)}; have {list(schema)}")
    problems = [] if corrupt is None else corrupt
    prompts = any(c in PROMPT_COLUMNS for c in cols)
    for chunk in record_rows(
        run_dir, datasets=datasets, batch_size=batch_size, corrupt=problems, order=order,
        upto=upto, prompts=prompts, located=True,
    ):  # fmt: skip
        frame, bad = frame_rows(chunk, {c: schema[c] for c in cols})
        problems += bad
        if frame.height:
            yield frame


def record_rows(
    run_dir,
    *,
    datasets=None,
    batch_size: int = 5_000,
    corrupt: list | None = None,
    order: str = "file",
    upto: dict[str, int] | None = None,
    prompts: bool = True,
    located: bool = False,
    dedupe: bool = True,
) -> Iterator[list]:
    """Yield the run's records as lists of row dicts (the JSON lines, with `messages` and
    `tools` filled from prompts.parquet when prompts=True); with located=True each item is
    (path, line number, row). Same arguments as record_batches, and `dedupe`: False yields
    later copies of a key too (the caller drops them: a set of a million keys is ~250 MB of
    Python objects, a polars is_first_distinct over them a few MB)."""
    if order not in ("file", "t_done"):
        raise ValueError(f"order must be 'file' or 't_done', got {order!r}")
    run_dir = Path(run_dir)
    wanted = None if datasets is None else set(datasets)
    names = None if datasets is None else {safe_name(d) for d in datasets}
    files = [p for n, p in record_files(run_dir).items() if names is None or n in names]
    seen: set | None = set() if dedupe else None
    problems = [] if corrupt is None else corrupt
    limit = upto or {}
    streams = [
        _rows(path, limit.get(path.stem), wanted, seen, problems, order == "t_done")
        for path in files
    ]
    if order == "file":
        rows = itertools.chain(*streams)
    else:  # heapq.merge is stable: equal t_done come in file order
        rows = heapq.merge(*streams, key=_first)
    with PromptStore(run_dir if prompts else None) as lookup:
        while True:
            chunk = list(itertools.islice(rows, batch_size))
            if not chunk:
                return
            if order == "t_done":
                chunk = [item[1] for item in chunk]
            if prompts:
                chunk = _with_prompts(chunk, lookup, problems)
            yield chunk if located else [row for _, _, row in chunk]


def _first(item: tuple) -> float:
    return item[0]


def _rows(path: Path, limit, wanted, seen: set | None, problems: list, keyed: bool):
    """(path, line number, row) per record line of one file, first copy of a key only;
    with keyed=True as (t_done, (path, line, row)) for heapq.merge."""
    for n, line in _lines(path, limit):
        row, problem = parse_line(line, record_problem)
        if problem:
            problems += corrupt_entries(path, [(n, problem)])
            continue
        if wanted is not None and row["dataset"] not in wanted:
            continue
        if seen is not None:
            key = (row["dataset"], row["prompt_id"], row["sample"])
            if key in seen:
                continue
            seen.add(key)
        item = (path, n, row)
        yield ((row.get("t_done") or 0.0), item) if keyed else item


def _lines(path: Path, limit: int | None = None):
    """(line number, bytes) of every complete non-empty line (within the first `limit`
    bytes when given), read in pieces."""
    n, rest, left = 0, b"", float("inf") if limit is None else limit
    with open(path, "rb") as f:
        while True:
            data = f.read(int(min(_READ, left)))
            left -= len(data)
            if not data:
                return  # what is left in `rest` has no newline: a torn tail, never data
            data = rest + data
            end = data.rfind(b"\n")
            if end < 0:
                rest = data
                continue
            rest = data[end + 1 :]
            for line in data[:end].split(b"\n"):
                n += 1
                if line:
                    yield n, line


class PromptStore:
    """The run's prompts, looked up by (dataset, prompt_id) without holding their text:
    copied once from prompts.parquet (a row group at a time) into a temporary file kit
    removes when done; memory keeps 24 bytes per prompt (a sorted array of key hashes and
    where each entry lies in that file), so a million prompts cost ~24 MB, not their text.
    Each entry holds its key, checked on every lookup: a hash shared by two keys costs a
    second read, never a wrong prompt.

    Example:
        with PromptStore(run_dir) as prompts:
            prompts.get("alpaca", "9f2c...")  # -> (messages, tools) or None
    """

    def __init__(self, run_dir: Path | None) -> None:
        self.run_dir = run_dir
        self._hashes = self._starts = self._ends = None  # numpy arrays, sorted by hash
        self._fd, self._tmp = None, None

    def __enter__(self) -> PromptStore:
        import numpy as np

        path = None if self.run_dir is None else Path(self.run_dir) / "prompts.parquet"
        if path is None or not path.exists():
            return self
        self._tmp = tempfile.TemporaryDirectory(prefix="kit-prompts-")
        blob = Path(self._tmp.name) / "prompts.jsonl"
        hashes, starts = array("q"), array("q")
        offset = 0
        with open(blob, "wb") as f:
            for rows in _prompt_rows(path):
                for d, pid, messages, tools in rows:
                    line = orjson.dumps([d, pid, messages, tools])
                    hashes.append(hash((d, pid)))
                    starts.append(offset)
                    f.write(line)
                    offset += len(line)
        order = np.argsort(np.frombuffer(hashes, dtype=np.int64), kind="stable")
        bounds = np.append(np.frombuffer(starts, dtype=np.int64), offset)
        self._hashes = np.frombuffer(hashes, dtype=np.int64)[order]
        self._starts, self._ends = bounds[:-1][order], bounds[1:][order]
        self._fd = os.open(blob, os.O_RDONLY)
        return self

    def get(self, dataset: str, prompt_id: str):
        """(messages, tools) of the prompt, or None when the run has no such prompt; the
        first copy in prompts.parquet when it holds a key twice."""
        if self._hashes is None:
            return None
        key = (dataset, prompt_id)
        h = hash(key)
        i = int(self._hashes.searchsorted(h))
        while i < len(self._hashes) and self._hashes[i] == h:  # equal hashes: file order
            start, end = int(self._starts[i]), int(self._ends[i])
            d, pid, messages, tools = orjson.loads(os.pread(self._fd, end - start, start))
            if (d, pid) == key:
                tools = orjson.loads(tools) if tools else None
                return orjson.loads(messages), tools or None  # [] is no tools
            i += 1
        return None

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _prompt_rows(path: Path):
    """(dataset, prompt_id, messages JSON, tools JSON) of prompts.parquet, a batch at a time."""
    import polars as pl
    import pyarrow.parquet as pq

    f = pq.ParquetFile(path)
    names = f.schema_arrow.names
    cols = ["dataset", "prompt_id", "messages"] + (["tools"] if "tools" in names else [])
    for batch in f.iter_batches(batch_size=20_000, columns=cols):
        frame = pl.from_arrow(batch)
        tools = pl.col("tools") if "tools" in cols else pl.lit(None, pl.String)
        frame = frame.select(
            "dataset", "prompt_id",
            pl.col("messages").list.eval(pl.element().struct.json_encode()).list.join(","),
            tools.alias("tools"),
        )  # fmt: skip
        yield [(d, i, f"[{m}]", t) for d, i, m, t in frame.iter_rows()]


def _with_prompts(chunk: list[tuple], prompts: PromptStore, problems: list) -> list[tuple]:
    """Fill each row's messages and tools from the prompt store (lines that hold their own
    keep them); rows whose prompt is nowhere are skipped and reported."""
    out = []
    for path, n, row in chunk:
        if "messages" not in row:
            found = prompts.get(row["dataset"], row["prompt_id"])
            if found is None:
                problems += corrupt_entries(path, [(n, "prompt_id not in prompts.parquet")])
                continue
            row["messages"] = _as_sent(found[0], row.get("turns"))
            if "tools" not in row:
                row["tools"] = found[1]
        out.append((path, n, row))
    return out


def _as_sent(messages: list[dict], turns) -> list[dict]:
    """The prompt as the runner sent its last request: with all_turns (Record.turns), each
    assistant message holds the target's own earlier answer, in order."""
    if not turns and all(len(m) == 2 for m in messages):
        return messages  # {role, content} as the prompt frame holds them
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if not turns:
        return messages
    answers = iter(turns)
    for m in messages:
        if m["role"] == "assistant":
            turn = next(answers, None)
            if turn is None:
                break
            m["content"] = turn.get("content") or ""
    return messages


def file_sizes(run_dir) -> dict[str, int]:
    """records file stem -> its size now (for record_batches(upto=...))."""
    return {n: p.stat().st_size for n, p in record_files(Path(run_dir)).items()}


def read_records(run_dir, datasets=None) -> tuple[object, list[dict]]:
    """(every record as one frame, the lines skipped as not records: [{"file", "line",
    "problem"}]). Holds the whole run in memory: for large runs iterate record_batches.

    Example: frame, corrupt = read_records(run_dir); describe_corrupt(corrupt) -> one line
    """
    import polars as pl

    corrupt: list[dict] = []
    frames = list(record_batches(run_dir, datasets=datasets, corrupt=corrupt))
    schema = record_schema()
    frame = pl.concat(frames) if frames else pl.DataFrame(schema=schema)
    return frame, sorted(corrupt, key=lambda c: (c["file"], c["line"]))


def with_earlier_prompts(run_dir: Path, frame):
    """The prompt frame to store: this start's, plus the prompts an earlier start stored
    that it lacks (a forced resume over other prompts): record lines name their prompt by
    (dataset, prompt_id) and hold no copy of it, so no stored prompt is ever dropped."""
    import polars as pl

    path = run_dir / "prompts.parquet"
    if not path.exists():
        return frame
    keys = ["dataset", "prompt_id"]
    old = pl.scan_parquet(path).join(frame.lazy().select(keys), on=keys, how="anti").collect()
    return pl.concat([frame, old], how="diagonal_relaxed") if old.height else frame


def prompt_keys(run_dir: Path) -> set:
    """(dataset, prompt_id) of every prompt in run_dir/prompts.parquet (empty without one)."""
    import polars as pl

    path = run_dir / "prompts.parquet"
    if not path.exists():
        return set()
    frame = pl.read_parquet(path, columns=["dataset", "prompt_id"])
    return set(frame.iter_rows())


def records_frame(run_dir, datasets=None):
    """Every record of a run as a polars frame (one column per Record field).

    Args:
        run_dir: the run directory.
        datasets: names to read (default: all).
    Returns:
        DataFrame; output_ids/prompt_ids are list[int] or null; duplicates keep the first.
        Damaged lines are skipped (read_records also lists them).

    Example: records_frame("data/runs/demo").group_by("dataset").agg(pl.col("completion_tokens").sum())
    """
    return read_records(run_dir, datasets)[0]
