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
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
from collections.abc import Iterator
from pathlib import Path

from kit.run.lines import (
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

    from kit.run.lines import frame_rows

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
            if joined is not None and not joined.can_join(chunk):
                frame, bad = frame_rows(with_prompts(chunk, store, problems), schema | where)
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
                chunk = with_prompts(chunk, lookup, problems)
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
