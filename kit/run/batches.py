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

import contextlib
import heapq
import itertools
import tempfile
import threading
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
_LOOKUP = 1_000  # prompts gathered at once from the prompt store's mapped file


def record_batches(
    run_dir,
    *,
    datasets=None,
    batch_size: int = 5_000,
    columns=None,
    corrupt: list | None = None,
    order: str = "file",
    upto: dict[str, int] | None = None,
    located: bool = False,
    dedupe: bool = True,
    store: PromptStore | None = None,
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
        located: add `_file` (the records file's stem) and `_line` (its line number).
        dedupe: False yields later copies of a key too (see record_rows).
        store: an open PromptStore of the run to take the prompts from (default: one made
            here, when messages or tools are asked for).

    Example:
        sum(f.height for f in record_batches(run_dir, columns=["dataset"]))  # -> records
    """
    import polars as pl

    from kit.run.lines import frame_rows

    schema = record_schema()
    cols = list(schema) if columns is None else [c for c in schema if c in set(columns)]
    unknown = set(columns or ()) - set(schema)
    if unknown:
        raise ValueError(f"unknown record columns {sorted(unknown)}; have {list(schema)}")
    problems = [] if corrupt is None else corrupt
    wanted = [c for c in cols if c in PROMPT_COLUMNS]
    own = {c: schema[c] for c in dict.fromkeys(["dataset", "prompt_id", *cols]) if c not in wanted}
    where = {"_file": pl.String, "_line": pl.Int64}  # kept when located, else dropped
    own |= where
    cols += list(where) if located else []
    own_store = PromptStore(run_dir if wanted else None, lazy=True) if store is None else None
    with contextlib.nullcontext(store) if store is not None else own_store as store:
        joined = _PromptColumns(store, wanted) if wanted else None
        for chunk in record_rows(
            run_dir, datasets=datasets, batch_size=batch_size, corrupt=problems, order=order,
            upto=upto, prompts=False, located=True, dedupe=dedupe,
        ):  # fmt: skip
            for path, n, row in chunk:
                row["_file"], row["_line"] = path.stem, n
            if joined is not None and not joined.can_join(chunk):
                frame, bad = frame_rows(_with_prompts(chunk, store, problems), schema | where)
            elif joined is not None:
                frame, bad = frame_rows(chunk, own)
                frame = joined.join(frame, problems)
            else:
                frame, bad = frame_rows(chunk, own)
            problems += bad
            if frame.height:
                yield frame.select(cols)


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
    copied once from prompts.parquet (a batch at a time) into an uncompressed Arrow IPC file
    in a temporary folder kit removes when done; memory keeps 16 bytes per prompt (a sorted
    array of key hashes and each one's row), so a million prompts cost ~16 MB, not their
    text. A lookup maps the file, gathers the rows it needs (Arrow `take`) and unmaps it:
    only those rows' pages are read. Every row found has its key checked: a hash shared by
    two keys costs a second look, never a wrong prompt. A key held twice gives its first copy.

    Example:
        with PromptStore(run_dir) as prompts:
            prompts.get("alpaca", "9f2c...")  # -> (messages, tools) or None
    """

    def __init__(self, run_dir: Path | None, lazy: bool = False) -> None:
        self.run_dir, self.lazy = run_dir, lazy  # lazy: copied at the first lookup
        self._built = False
        self._hashes = self._rows = self._starts = self._ipc = self._tmp = None
        self._lock, self._error = threading.Lock(), None

    def __enter__(self) -> PromptStore:
        return self if self.lazy else self.open()

    def open(self) -> PromptStore:
        """Copy the prompts now (once; other threads wait); raises what the copy raised."""
        with self._lock:
            if self._error is not None:
                raise self._error
            if not self._built:
                try:
                    self._open()
                except Exception as e:
                    self._error = e
                    raise
        return self

    def prepare(self) -> None:
        """open() for a background thread: a failure is kept for the next open() to raise."""
        try:
            self.open()
        except Exception:  # noqa: S110 - raised again by open()
            pass

    def _open(self) -> None:
        import numpy as np
        import pyarrow as pa
        import pyarrow.parquet as pq

        self._built = True
        path = None if self.run_dir is None else Path(self.run_dir) / "prompts.parquet"
        if path is None or not path.exists():
            return
        f = pq.ParquetFile(path)
        names = f.schema_arrow.names
        cols = ["dataset", "prompt_id", "messages"] + (["tools"] if "tools" in names else [])
        self._tmp = tempfile.TemporaryDirectory(prefix="kit-prompts-")
        self._ipc = str(Path(self._tmp.name) / "prompts.arrow")
        hashes, writer, starts = array("q"), None, []
        with pa.OSFile(self._ipc, "wb") as sink:
            for batch in f.iter_batches(batch_size=20_000, columns=cols):
                starts.append(len(hashes))
                if "tools" not in names:
                    batch = batch.append_column("tools", pa.nulls(batch.num_rows, pa.large_string()))  # fmt: skip
                keys = zip(batch["dataset"].to_pylist(), batch["prompt_id"].to_pylist(), strict=True)  # fmt: skip
                hashes.extend(hash(k) for k in keys)
                writer = writer or pa.ipc.new_file(sink, batch.schema)
                writer.write_batch(batch)
            if writer is not None:
                writer.close()
        self._starts = np.array(starts, dtype=np.int64)  # each IPC batch's first row
        h = np.frombuffer(hashes, dtype=np.int64)
        self._rows = np.argsort(h, kind="stable")  # equal hashes keep file order
        self._hashes = h[self._rows]
        if not len(h):
            self._hashes = None

    def _take(self, rows):
        """The store's rows at these places, as a polars frame: gathered batch by batch of
        the mapped file (a chunked `take` would first join every batch, reading it all),
        then put back in the order asked; the mapping is dropped before returning."""
        import numpy as np
        import polars as pl
        import pyarrow as pa

        rows = np.asarray(rows, dtype=np.int64)
        batch = np.searchsorted(self._starts, rows, side="right") - 1
        order = np.argsort(batch, kind="stable")
        pieces = []
        with pa.memory_map(self._ipc) as source:
            reader = pa.ipc.open_file(source)
            for b in np.unique(batch).tolist():
                local = rows[batch == b] - self._starts[b]
                pieces.append(reader.get_batch(b).take(pa.array(local)))
            del reader
        gathered = pa.Table.from_batches(pieces).combine_chunks()
        back = np.empty_like(order)
        back[order] = np.arange(len(order))  # gathered holds the rows sorted by batch
        return pl.from_arrow(gathered.take(pa.array(back))).rechunk()

    def frame(self, keys: list[tuple]):
        """The prompts of these (dataset, prompt_id) keys as a polars frame in their order:
        dataset, prompt_id, messages, tools (text as prompts.parquet holds it), and
        `found` (False where the run has no such prompt: the other columns are null)."""
        import numpy as np
        import polars as pl

        if not self._built:
            self.open()
        n = len(keys)
        if self._hashes is None or not n:
            return None
        if n > _LOOKUP:  # each gathered row maps its pages (and their neighbours): in parts
            parts = [self.frame(keys[i : i + _LOOKUP]) for i in range(0, n, _LOOKUP)]
            return pl.concat(parts)
        hs = np.fromiter((hash(k) for k in keys), dtype=np.int64, count=n)
        at = np.minimum(self._hashes.searchsorted(hs), len(self._hashes) - 1)
        taken = self._take(self._rows[at])
        wanted = pl.DataFrame(keys, schema=["dataset", "prompt_id"], orient="row")
        same = (taken["dataset"] == wanted["dataset"]) & (taken["prompt_id"] == wanted["prompt_id"])
        found = same.fill_null(False).to_numpy()
        for i in np.flatnonzero(~found & (self._hashes[at] == hs)).tolist():
            j = int(at[i]) + 1  # a hash shared with another key: look at the next ones
            while j < len(self._hashes) and self._hashes[j] == hs[i]:
                row = self._take([int(self._rows[j])])
                if row.row(0)[:2] == keys[i]:
                    taken = pl.concat([taken[:i], row, taken[i + 1 :]])
                    found[i] = True
                    break
                j += 1
        return taken.with_columns(found=pl.Series(found, dtype=pl.Boolean))

    def lookup(self, keys: list[tuple]) -> list:
        """Per key (messages, tools) as Python objects, or None when the run has no such
        prompt; tools are None when the prompt has none ("[]" is none)."""
        frame = self.frame(keys)
        if frame is None:
            return [None] * len(keys)
        out = []
        for ok, messages, tools in frame.select("found", "messages", "tools").iter_rows():
            if not ok:
                out.append(None)
                continue
            tools = orjson.loads(tools) if tools else None
            out.append((messages, tools or None))
        return out

    def get(self, dataset: str, prompt_id: str):
        """(messages, tools) of the prompt, or None when the run has no such prompt."""
        return self.lookup([(dataset, prompt_id)])[0]

    def __exit__(self, *exc) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _with_prompts(chunk: list[tuple], prompts: PromptStore, problems: list) -> list[tuple]:
    """Fill each row's messages and tools from the prompt store (lines that hold their own
    keep them); rows whose prompt is nowhere are skipped and reported."""
    need = [(row["dataset"], row["prompt_id"]) for _, _, row in chunk if "messages" not in row]
    found = iter(prompts.lookup(need))
    out = []
    for path, n, row in chunk:
        if "messages" not in row:
            got = next(found)
            if got is None:
                problems += corrupt_entries(path, [(n, "prompt_id not in prompts.parquet")])
                continue
            row["messages"] = _as_sent(got[0], row.get("turns"))
            if "tools" not in row:
                row["tools"] = got[1]
        out.append((path, n, row))
    return out


class _PromptColumns:
    """record_batches' messages and tools for lines that do not hold their own: gathered
    from the prompt store for a whole frame at once, the same values PromptStore.lookup
    gives (messages as {role, content}; tools as compact JSON or null)."""

    def __init__(self, store: PromptStore, columns: list[str]) -> None:
        self.store, self.columns = store, columns

    @staticmethod
    def can_join(chunk: list[tuple]) -> bool:
        """Rows that hold their own prompt or earlier turns (kit < 0.13, all_turns) take
        the row-by-row path (_with_prompts, _as_sent)."""
        return not any("messages" in r or "tools" in r or r.get("turns") for _, _, r in chunk)

    def join(self, frame, problems: list):
        """The frame with the prompt columns asked for; rows whose prompt the run lacks are
        reported (by their _file, _line) and left out."""
        import polars as pl

        keys = list(zip(frame["dataset"].to_list(), frame["prompt_id"].to_list(), strict=True))
        got = self.store.frame(keys)
        found = got["found"] if got is not None else pl.Series([False] * frame.height)
        for stem, n in frame.filter(~found).select("_file", "_line").iter_rows():
            problems += corrupt_entries(Path("records") / f"{stem}.jsonl", [(n, "prompt_id not in prompts.parquet")])  # fmt: skip
        if got is None:
            return frame.clear()
        frame, got = frame.filter(found), got.filter(found)
        out = {}
        if "messages" in self.columns:
            e = pl.element().struct
            msg = pl.struct(e.field("role").cast(pl.String), e.field("content").cast(pl.String))
            out["messages"] = got["messages"].list.eval(msg).cast(record_schema()["messages"])
        if "tools" in self.columns:
            parsed = [(orjson.loads(t) if t else None) or None for t in got["tools"]]
            out["tools"] = pl.Series([orjson.dumps(t).decode() if t is not None else None for t in parsed], dtype=pl.String)  # fmt: skip
        return frame.with_columns(**out)


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
