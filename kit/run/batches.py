"""Read a run's records in bounded batches: memory stays flat from 1K to 1M records.

    for frame in record_batches(run_dir, columns=["dataset", "completion_tokens"]):
        ...  # a polars DataFrame of at most batch_size records

Records are read line by line from records/<dataset>.jsonl (nothing after a file's last
newline: a torn tail is not data), checked like every reader checks them
(kit.run.lines.record_problem), and the first copy of a key wins. Lines that are not
records are skipped and listed in `corrupt` ({"file", "line", "problem"}).

Prompts are stored once per run: record lines written since kit 0.13 hold no `messages`
and no `tools`; both are joined back from run_dir/prompts.parquet by (dataset, prompt_id),
only when a caller asks for those columns (kit.run.prompts: a batch at a time). A record
written by RunConfig.turns "all_turns" gets its prompt with the target's own earlier
answers (Record.turns) in place of the dataset's assistant turns, as the runner sent it.
Older lines that still hold their messages keep them. A record whose prompt is in neither place is skipped and listed
in `corrupt` (its conversation cannot be rebuilt).

Order: "file" reads file by file (kit.run.lines.record_files order); "t_done" merges the
files by t_done, ties in file order: the order a stable sort of all records by t_done gives
when each file is in t_done order, as the runner appends them.

A second pass over records a first pass found (export's writing pass) reads them by place:
record_rows(spans=True) gives each line's byte offset and length, read_spans reads those
byte ranges back a batch at a time, polars parses the lines (strictly where the first
pass took them from the resume index without reading them), and the prompts come from the
store as SpecForge text. A batch it cannot read so goes line by line, as above.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
from collections.abc import Iterator
from pathlib import Path

from kit.run.lines import (
    LINE_ORDER_SHORT,
    PROMPT_FIELDS,
    corrupt_entries,
    parse_line,
    record_files,
    record_problem,
    record_schema,
    safe_name,
)
from kit.run.prompts import (  # noqa: F401 - PromptStore, with_earlier_prompts, prompt_keys: re-exported
    PromptColumns,
    PromptStore,
    prompt_keys,
    with_earlier_prompts,
    with_prompts,
)

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

    schema = record_schema()
    cols = list(schema) if columns is None else [c for c in schema if c in set(columns)]
    unknown = set(columns or ()) - set(schema)
    if unknown:
        raise ValueError(f"unknown record columns {sorted(unknown)}; have {list(schema)}")
    problems = [] if corrupt is None else corrupt
    wanted = [c for c in cols if c in PROMPT_FIELDS]
    own = {c: schema[c] for c in dict.fromkeys(["dataset", "prompt_id", *cols]) if c not in wanted}
    where = {"_file": pl.String, "_line": pl.Int64}  # kept when located, else dropped
    own |= where
    cols += list(where) if located else []
    made = PromptStore(run_dir if wanted else None, lazy=True) if store is None else None
    with made or contextlib.nullcontext(store) as store:
        joined = PromptColumns(store, wanted) if wanted else None
        for chunk in record_rows(
            run_dir, datasets=datasets, batch_size=batch_size, corrupt=problems, order=order,
            upto=upto, prompts=False, located=True, dedupe=dedupe,
        ):  # fmt: skip
            for path, n, row in chunk:
                row["_file"], row["_line"] = path.stem, n
            frame = _chunk_frame(chunk, store, joined, own, schema | where, problems)
            if frame.height:
                yield frame.select(cols)


def _chunk_frame(chunk: list[tuple], store, joined, own: dict, full: dict, problems: list):
    """[(path, line, row)] -> a frame: own columns, the prompt columns joined a batch at a
    time (PromptColumns), or row by row (with_prompts) for lines that hold their own."""
    from kit.run.lines import frame_rows

    if joined is not None and not joined.can_join(chunk):
        frame, bad = frame_rows(with_prompts(chunk, store, problems), full)
    elif joined is not None:
        frame, bad = frame_rows(chunk, own)
        frame = joined.join(frame, problems)
    else:
        frame, bad = frame_rows(chunk, own)
    problems += bad
    return frame


_GAP, _RUN = 1 << 20, 32 << 20  # lines this close share one pread, of at most this size


def read_spans(run_dir, rows, columns, store: PromptStore, corrupt: list, batch_size=5_000, carry=()):  # fmt: skip
    """Yield the records at these places as polars frames of at most batch_size rows, in
    the order of `rows` (a frame from a first pass: _file, _line, _start, _size, _plain
    and the key columns, from record_rows(spans=True) or the resume index; _plain: True
    for a line pass 1 parsed and found plain, False for one it found not plain, null where
    it did not parse the line).

    Each batch's lines are read by byte range (pread) and parsed by polars' JSON reader; the
    prompts come from `store` as SpecForge text (`_frag`, `_tools_sf`, `_held`: see
    PromptStore.frame). A batch that polars cannot parse, whose keys differ from `rows`, or
    that holds lines with their own prompt or earlier turns (`_plain` false) is parsed line
    by line as record_batches does (with messages and tools), and any line that is not a
    record is listed in `corrupt` (a second pass over the same bytes finds what the first
    did). `columns`: record columns besides the prompt's; _file, _line and the `carry`
    columns of `rows` are added. The one reading that differs from orjson's on a line the
    first pass accepted: a key written twice in one line (no kit version writes one) is
    read with its first value here, its last by orjson."""

    import polars as pl

    schema = record_schema()
    own = {c: schema[c] for c in dict.fromkeys(["dataset", "prompt_id", "sample", *columns])}
    where = {"_file": pl.String, "_line": pl.Int64}
    keys = ["dataset", "prompt_id", "sample"]
    paths = record_files(Path(run_dir))
    fragments = PromptColumns(store, [], fragments=True)
    fds = {stem: os.open(p, os.O_RDONLY) for stem, p in paths.items()}
    try:
        for at in range(0, rows.height, batch_size):
            part = rows.slice(at, batch_size)
            lines = _gather(fds, part["_file"].to_list(), part["_start"].to_list(), part["_size"].to_list())  # fmt: skip
            plain = part["_plain"]  # True: checked plain by pass 1; null: not checked
            frame = None
            if plain.all(ignore_nulls=True):  # no line known not plain
                frame = _native(lines, own, schema, checked=plain.null_count() == 0)
            if frame is not None and (frame.height != part.height or not frame.select(keys).equals(part.select(keys))):  # fmt: skip
                frame = None
            if frame is None:  # line by line, as record_batches reads them
                frame = _parsed(lines, part, paths, store, own, schema | where, corrupt)
                on = list(where)
                frame = frame.join(part.select(*on, *carry), on=on, how="left", maintain_order="left")  # fmt: skip
            else:
                frame = frame.with_columns(part.select(*where, *carry))
                frame = fragments.join(frame, corrupt)
            if frame.height:
                yield frame
    finally:
        for fd in fds.values():
            os.close(fd)


# What polars' JSON reader reads otherwise than orjson and record_problem: any value in a
# String column is taken as text (5 -> "5"); a lone surrogate escape is read as a NUL (orjson
# refuses it). A line with its own messages or tools (even null) is not a plain line. Any of
# these in a batch sends it line by line (a nested key so named only costs that).
_STRINGS = ["dataset", "prompt_id", "completion", "finish_reason", "count_source", "endpoint", "reasoning"]  # fmt: skip
_SUSPECT = '"(?:' + "|".join(_STRINGS) + ')":[^"n]|"(?:messages|tools)":' + r"|\\u[dD][89a-fA-F]"


def _native(lines: list[bytes], own: dict, schema: dict, checked: bool = False):
    """A batch of lines parsed by polars, or None when any of them may not be a plain
    RunStore record as orjson and record_problem read it (the caller goes line by line):
    valid UTF-8, nothing _SUSPECT matches, every count >= 0, turns and tool_calls null, one
    row a line.
    `schema`: record_schema(). `checked`: the first pass parsed each line with orjson and record_problem, and found
    it plain (no scan then); else it took them from the resume index (kit.report.selection)."""
    import io

    import polars as pl

    data = b"\n".join(lines)
    try:
        if not all(lines):
            return None
        if not checked:
            text = pl.Series([data], dtype=pl.Binary).cast(pl.String)  # UTF-8 checked
            if text.str.contains(_SUSPECT)[0]:
                return None
        fields = dict(own)
        if not checked:  # every field of theirs typed: polars is strict on ints, floats, lists
            fields |= {c: schema[c] for c in LINE_ORDER_SHORT}
        nested = {"turns": pl.String, "tool_calls": pl.String}  # must be null: see `ok`
        frame = pl.read_ndjson(io.BytesIO(data), schema=fields | nested)
    except pl.exceptions.PolarsError:
        return None
    c = pl.col
    ok = (
        c("dataset").is_not_null() & c("prompt_id").is_not_null() & c("completion").is_not_null()
        & (c("sample") >= 0) & (c("completion_tokens") >= 0) & c("turns").is_null()
        & c("tool_calls").is_null()
    ).fill_null(False)  # fmt: skip
    if frame.height != len(lines) or not frame.select(ok.all()).item():
        return None
    return frame.select(list(own))


def _gather(fds: dict, files: list, starts: list, sizes: list) -> list[bytes]:
    """The lines at these places, one pread per run of nearby lines of a file (b"" for a
    line no longer there)."""
    out: list[bytes] = [b""] * len(files)
    by_file: dict[str, list[int]] = {}
    for i, stem in enumerate(files):
        by_file.setdefault(stem, []).append(i)
    for stem, idx in by_file.items():
        fd = fds.get(stem)
        if fd is None:
            continue
        idx.sort(key=starts.__getitem__)
        run = [idx[0]]
        for i in idx[1:] + [None]:
            lo, hi = starts[run[0]], starts[run[-1]] + sizes[run[-1]]
            if i is not None and starts[i] - hi <= _GAP and starts[i] + sizes[i] - lo <= _RUN:
                run.append(i)
                continue
            buf = os.pread(fd, hi - lo, lo)
            for j in run:
                a = starts[j] - lo
                out[j] = buf[a : a + sizes[j]] if a + sizes[j] <= len(buf) else b""
            run = [i]
    return out


def _parsed(lines, part, paths, store, own, full, corrupt) -> object:
    """A batch of read_spans parsed line by line: the frame record_batches makes of it."""
    chunk = []
    for stem, n, line in zip(part["_file"].to_list(), part["_line"].to_list(), lines, strict=True):  # fmt: skip
        path = paths.get(stem, Path("records") / f"{stem}.jsonl")
        row, problem = parse_line(line, record_problem) if line else (None, "the line is gone (the file is shorter than when the export began)")  # fmt: skip
        if problem:
            corrupt += corrupt_entries(path, [(n, problem)])
            continue
        row["_file"], row["_line"] = stem, n
        chunk.append((path, n, row))
    wanted = list(PROMPT_FIELDS)
    frame = _chunk_frame(chunk, store, PromptColumns(store, wanted), own | {"_file": full["_file"], "_line": full["_line"]}, full, corrupt)  # fmt: skip
    return frame.select([*own, *wanted, "_file", "_line"])


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
    spans: bool = False,
) -> Iterator[list]:
    """Yield the run's records as lists of row dicts (the JSON lines, with `messages` and
    `tools` filled from prompts.parquet when prompts=True); with located=True each item is
    (path, line number, row). Same arguments as record_batches, and `dedupe`: False yields
    later copies of a key too (the caller drops them: a set of a million keys is ~250 MB of
    Python objects, a polars is_first_distinct over them a few MB), and `spans`: located
    items carry the line's byte offset and length too, (path, line, row, start, size), for
    read_spans."""
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
        _rows(path, limit.get(path.stem), wanted, seen, problems, order == "t_done", spans)
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
                chunk = with_prompts(chunk, lookup, problems)
            yield chunk if located else [item[2] for item in chunk]


def _first(item: tuple) -> float:
    return item[0]


def _rows(path: Path, limit, wanted, seen: set | None, problems: list, keyed: bool, spans=False):
    """(path, line number, row) per record line of one file, first copy of a key only
    (spans: plus the line's start and size); with keyed=True as (t_done, item) for
    heapq.merge."""
    for n, line, start in _lines(path, limit):
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
        item = (path, n, row, start, len(line)) if spans else (path, n, row)
        yield ((row.get("t_done") or 0.0), item) if keyed else item


def _lines(path: Path, limit: int | None = None):
    """(line number, bytes, byte offset) of every complete non-empty line (within the first
    `limit` bytes when given), read in pieces."""
    n, rest, left, at = 0, b"", float("inf") if limit is None else limit, 0
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
                    yield n, line, at
                at += len(line) + 1


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
