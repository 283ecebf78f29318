"""The resume index: what a records file held at a clean stop, so a restart reads only the rest.

For each records file RunStore.close() writes run_dir/index/<stem>.parquet, the heads of
its lines (dataset, prompt_id, sample, completion_tokens, finish_reason, t_done; one row per
line that is a record, in file order, duplicates kept), and <stem>.json, the meta: the
file's size then, its line count, the (line, problem) of the lines that are not records,
whether lines.heads reads those bytes with its one-regex path (`fast`), sha256 checksums of
the file's bytes before that size (its last <= 64 KiB as the main check, plus its first
64 KiB and 16 blocks of 4 KiB spread over it) and the sha256 of the parquet file.

A reader (RunStore.scan, ProgressReader) takes the index when the records file still holds
the indexed bytes (size >= indexed size, every checksum matches) and parses only what was
appended after them: records files are append-only. Anything else (a smaller file, other
bytes, an unreadable, torn or other-version index) means a full read: nothing is lost but
time. Edits inside the indexed region that keep the size and miss every checked block go
unnoticed; kit never edits a records file in place.

Why Parquet: polars reads it natively, so a reader gets the heads as columns (kit watch's
totals are column sums, no Python object per line), dataset and finish_reason are
dictionary-encoded and the rest compressed (~10 bytes a line), and a torn or foreign file is
refused by its own framing and by the sha256 in the meta.

lines.heads reads a whole region with one regex when every line is a RunStore head in
plain text, else line by line; the two readings differ on a line whose head is intact but
whose rest is damaged. So a region read one way is never joined to a region read the other
way: an index read line by line gets its tail read line by line too, and an index read with
the regex whose tail needs the line-by-line reading is dropped for a full scan. The result
always equals a full scan's (lines.heads of the whole file). (kit watch's full read parses
32 MB pieces, each read its own way: its first read from an index can differ from it on
such a damaged line only.)
"""

from __future__ import annotations

import hashlib
import io
import math
import mmap
import os
from array import array
from dataclasses import dataclass
from pathlib import Path

import orjson

from kit.run.lines import (
    _HEAD,  # the same regexes and text check as lines.heads: `fast` must be its rule
    _HEAD_NL,
    _NEWLINE,
    HEAD_FIELDS,
    _plain_text,
    heads,
    parse_line,
    text,
    write_atomic,
)

VERSION = 1
_TAIL = 64 << 10  # the main check: sha256 of the last <= 64 KiB before the indexed size
_BLOCK, _BLOCKS = 4 << 10, 16  # and of 16 blocks of 4 KiB spread over the indexed bytes
_CHUNK = 32 << 20  # bytes of a tail parsed at once: memory stays flat however long the tail


def schema() -> dict:
    """The columns of an index (the heads of a records file's lines) and their dtypes."""
    import polars as pl

    return {
        "dataset": pl.String, "prompt_id": pl.String, "sample": pl.Int64,
        "completion_tokens": pl.Int64, "finish_reason": pl.String, "t_done": pl.Float64,
    }  # fmt: skip


@dataclass
class FileHeads:
    """What a records file holds up to `size` bytes: its heads as a polars frame (index
    columns, file order, duplicates kept), its line count, (line, problem) of the lines that
    are not records, and whether lines.heads reads those bytes with its regex (`fast`).
    `from_index`: the bytes after the index were nothing (the index needs no rewrite)."""

    frame: object
    size: int
    lines: int
    problems: list
    fast: bool = True
    from_index: bool = False


def paths(path: Path) -> tuple[Path, Path]:
    """records/<stem>.jsonl -> (index/<stem>.parquet, index/<stem>.json) in its run dir."""
    folder = path.parent.parent / "index"
    return folder / f"{path.stem}.parquet", folder / f"{path.stem}.json"


def checks(f, size: int) -> dict:
    """sha256 checksums of an open file's bytes before `size`: its last <= 64 KiB ("tail"),
    first <= 64 KiB ("head") and 16 blocks of 4 KiB spread between ("spread")."""

    def digest(spans) -> str:
        h = hashlib.sha256()
        for start, n in spans:
            f.seek(start)
            h.update(f.read(n))
        return h.hexdigest()

    starts = [size * k // (_BLOCKS + 1) for k in range(1, _BLOCKS + 1)]
    spread = [(start, min(_BLOCK, size - start)) for start in starts]  # never past size
    return {
        "tail": digest([(max(0, size - _TAIL), min(_TAIL, size))]),
        "head": digest([(0, min(_TAIL, size))]),
        "spread": digest(spread),
    }


def record_head(record) -> tuple | None:
    """A Record's head as lines.heads reads its RunStore line back, or None when a value
    would not read back the same (a bool sample, a NaN t_done ...).

    Example: record_head(Record("a", "p", 0, [], "hi", "stop", 2, "usage", t_done=5))
             -> ("a", "p", 0, 2, "stop", 5.0)
    """
    r = record
    ds, pid, s, n, fin, t = (
        r.dataset, r.prompt_id, r.sample, r.completion_tokens, r.finish_reason, r.t_done,
    )  # fmt: skip
    ok = (
        type(ds) is str and type(pid) is str and type(s) is int and type(n) is int
        and 0 <= s < 1 << 63 and 0 <= n < 1 << 63 and (fin is None or type(fin) is str)
        and type(t) in (int, float) and math.isfinite(t)
    )  # fmt: skip
    return (ds, pid, s, n, fin, float(t)) if ok else None


def to_frame(rows: list[tuple]):
    """Head tuples -> an index frame; None when a value does not fit (a count over 2**63)."""
    import polars as pl

    try:
        return pl.DataFrame(rows, schema=schema(), orient="row")
    except (TypeError, ValueError, OverflowError, pl.exceptions.PolarsError):
        return None


def read_heads(data, problems: list, first_line: int = 1) -> tuple[list[tuple], bool]:
    """(lines.heads(data, problems, first_line), whether it read them with its regex).

    The regex reading is lines.heads' own (same patterns, same conversions); any other
    region goes to lines.heads itself.
    """
    end = data.rfind(b"\n")
    if end < 0:
        return [], True
    found = [m.groups() for m in _HEAD_NL.finditer(data, 0, end)]
    first = _HEAD.match(data, 0, end)
    if first:
        found.insert(0, first.groups())
    if len(found) == len(_NEWLINE.findall(data, 0, end + 1)) and _plain_text(data, end + 1):
        return [(text(a), text(b), int(c), int(d), text(e), float(f)) for a, b, c, d, e, f in found], True  # fmt: skip
    return heads(data, problems, first_line), False


def slow_heads(data: bytes, problems: list, first_line: int = 1) -> list[tuple]:
    """lines.heads' line-by-line reading, whatever the bytes: each line parsed with orjson."""
    out = []
    for n, line in enumerate(data.split(b"\n")[:-1], first_line):
        if not line:
            continue
        row, problem = parse_line(line)
        if problem is None:
            out.append(tuple(row.get(f) for f in HEAD_FIELDS[:5]) + (row.get("t_done") or 0.0,))
        else:
            problems.append((n, problem))
    return out


def line_start(f, end: int) -> int:
    """Where the line ending at byte `end` of an open file starts: 1 + the offset of the last
    newline before end - 1 (0 when there is none). end == size: the start of a torn tail."""
    pos = end - 1
    while pos > 0:
        start = max(0, pos - _TAIL)
        f.seek(start)
        cut = f.read(pos - start).rfind(b"\n")
        if cut >= 0:
            return start + cut + 1
        pos = start
    return 0


def add_heads(out: dict, frame) -> None:
    """out.setdefault((dataset, prompt_id, sample), (completion_tokens, finish_reason)) for
    each row of an index frame in order (the first copy of a key wins), built at C speed;
    one str object per distinct dataset and finish_reason."""
    import polars as pl

    first = frame.select(pl.struct("dataset", "prompt_id", "sample").is_first_distinct())
    if not first.to_series().all():
        frame = frame.filter(first.to_series())
    ds, fin = _shared(frame["dataset"]), _shared(frame["finish_reason"])
    ids, samples, counts = (frame[c].to_list() for c in ("prompt_id", "sample", "completion_tokens"))  # fmt: skip
    new = dict(zip(zip(ds, ids, samples), zip(counts, fin)))  # noqa: B905 - equal lengths
    for key in new.keys() & out.keys():
        new[key] = out[key]  # an earlier file's copy wins
    out.update(new)


def first_copies(frames: list):
    """Index frames (file order) -> one frame of each key's first copy: dataset, prompt_id,
    sample, completion_tokens, finish_reason (what RunStore.scan's dict holds)."""
    import polars as pl

    cols = ["dataset", "prompt_id", "sample", "completion_tokens", "finish_reason"]
    frame = pl.concat([f.select(cols) for f in frames]) if frames else to_frame([]).select(cols)
    return frame.unique(subset=cols[:3], keep="first", maintain_order=True)


def _shared(series) -> list:
    """series.to_list() of a String column, one str object per distinct value."""
    import polars as pl

    values = series.unique(maintain_order=True).drop_nulls().to_list()
    codes = series.cast(pl.Enum(values)).to_physical().to_list()
    values.append(None)  # code None -> values[-1]
    return [values[-1 if k is None else k] for k in codes]


def failed_in(frame, failed) -> set:
    """The keys (dataset, prompt_id, sample) of an index frame's rows that are in `failed`
    (errors.jsonl's keys, as kit.run.progress keeps them; a sample 0.0 equals 0 as in
    Python)."""
    import polars as pl

    keys = [
        (ds, pid, int(s))
        for ds, pid, s in failed
        if type(ds) is str and type(pid) is str and type(s) in (int, float, bool)
        and s == s // 1 and 0 <= s < 1 << 63
    ]  # fmt: skip
    if not keys or frame.height == 0:
        return set()
    cols = ["dataset", "prompt_id", "sample"]
    want = pl.DataFrame(keys, schema={c: schema()[c] for c in cols}, orient="row")
    return set(frame.select(cols).join(want, on=cols, how="semi").iter_rows())


class Appended:
    """Heads of the lines a RunStore wrote to one records file since its last scan, and
    their bytes, held column by column in typed arrays (~50 bytes a line, no Python object
    per line: a long session's writer stays small)."""

    def __init__(self) -> None:
        self.codes: dict = {}  # dataset or finish_reason value -> its code
        self.datasets, self.finishes = array("i"), array("i")
        self.samples, self.counts, self.t_done = array("q"), array("q"), array("d")
        self.ids, self.ends = bytearray(), array("q", [0])  # prompt_ids, UTF-8 back to back
        self.bytes = 0
        self.ok = True  # False: a head would not read back the same (see record_head)

    def add(self, heads: list, nbytes: int) -> None:
        self.bytes += nbytes
        self.ok = self.ok and None not in heads
        if not self.ok:
            return
        codes = self.codes
        for ds, pid, sample, count, finish, t in heads:
            self.datasets.append(codes.setdefault(ds, len(codes)))
            self.finishes.append(codes.setdefault(finish, len(codes)))
            self.samples.append(sample)
            self.counts.append(count)
            self.t_done.append(t)
            self.ids += pid.encode()
            self.ends.append(len(self.ids))

    def frame(self):
        """These heads as an index frame."""
        import numpy as np
        import polars as pl
        import pyarrow as pa

        n, values = len(self.samples), pl.Series(list(self.codes), dtype=pl.String)
        ids = pa.LargeStringArray.from_buffers(n, pa.py_buffer(self.ends), pa.py_buffer(self.ids))
        cols = {
            "dataset": values.gather(np.frombuffer(self.datasets, dtype=np.int32)),
            "prompt_id": pl.Series(ids),
            "sample": np.frombuffer(self.samples, dtype=np.int64),
            "completion_tokens": np.frombuffer(self.counts, dtype=np.int64),
            "finish_reason": values.gather(np.frombuffer(self.finishes, dtype=np.int32)),
            "t_done": np.frombuffer(self.t_done, dtype=np.float64),
        }
        return pl.DataFrame(cols).cast(schema())

    def extend(self, base: FileHeads):
        """base + these lines, as the FileHeads of the file now; None when not indexable."""
        import polars as pl

        if not self.ok or base.frame is None:
            return None
        frame = pl.concat([base.frame, self.frame()])
        lines = base.lines + len(self.samples)
        return FileHeads(frame, base.size + self.bytes, lines, base.problems, base.fast)


# ---------------------------------------------------------------- reading


def load(path: Path) -> FileHeads | None:
    """The index of records file `path` when it is valid for the file as it is now, else None.

    Valid: same VERSION, the parquet file the meta names (its sha256), and the records file
    still holding the indexed bytes (size >= the indexed size, every checksum matches).
    """
    import polars as pl

    heads_path, meta_path = paths(path)
    try:
        meta = orjson.loads(meta_path.read_bytes())
        if not isinstance(meta, dict) or meta.get("version") != VERSION:
            return None
        size, lines, fast = meta["size"], meta["lines"], meta["fast"]
        problems = [(int(n), str(p)) for n, p in meta["problems"]]
        if type(size) is not int or type(lines) is not int or type(fast) is not bool:
            return None
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < size or checks(f, size) != meta["checks"]:
                return None
        data = heads_path.read_bytes()
        if hashlib.sha256(data).hexdigest() != meta["heads_sha256"]:
            return None
        frame = pl.read_parquet(io.BytesIO(data))
        if dict(frame.schema) != schema() or frame.height != meta["rows"]:
            return None
    except (OSError, ValueError, TypeError, KeyError, pl.exceptions.PolarsError):
        return None  # absent, unreadable, torn or foreign: a full read
    return FileHeads(frame, size, lines, problems, fast, from_index=True)


def read_tail(path: Path, start: int, first_line: int, slow: bool):
    """Heads of the complete lines after byte `start`, read in pieces:
    (heads, problems, end offset, lines, fast). `slow`: read every line with orjson."""
    out, problems, offset, lines, fast = [], [], start, 0, True
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        want = _CHUNK
        while offset < size:
            f.seek(offset)
            data = f.read(min(want, size - offset))
            end = data.rfind(b"\n") + 1
            if end == 0:
                if offset + len(data) >= size:
                    break  # a torn last line: never data
                want *= 2  # a line longer than a piece
                continue
            data = data[:end]
            if slow:
                out += slow_heads(data, problems, first_line + lines)
            else:
                got, piece_fast = read_heads(data, problems, first_line + lines)
                out += got
                fast = fast and piece_fast
            lines += data.count(b"\n")
            offset += end
            want = _CHUNK
    return out, problems, offset, lines, fast


def full_scan(path: Path) -> tuple[list[tuple], FileHeads]:
    """lines.heads of the whole file (through mmap) and its FileHeads (frame None when the
    heads do not fit an index frame)."""
    problems: list = []
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return [], FileHeads(to_frame([]), 0, 0, [])
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                found, fast = read_heads(m, problems)
                size = m.rfind(b"\n") + 1
                lines = sum(
                    m[i : min(i + _CHUNK, size)].count(b"\n") for i in range(0, size, _CHUNK)
                )
    except FileNotFoundError:
        return [], FileHeads(to_frame([]), 0, 0, [])
    return found, FileHeads(to_frame(found), size, lines, problems, fast)


def scan_file(path: Path) -> tuple[list[tuple] | None, FileHeads]:
    """The heads of a records file, from its index plus the lines after it when the index
    is valid, else from a full scan: (the heads as tuples, or None when FileHeads.frame
    holds them; FileHeads, its frame None when they cannot be indexed). The heads, problems
    and line count equal a full scan's (lines.heads of the whole file)."""
    import polars as pl

    idx = load(path)
    if idx is None:
        return full_scan(path)
    found, problems, end, lines, fast = read_tail(path, idx.size, idx.lines + 1, not idx.fast)
    if idx.fast and not fast:
        return full_scan(path)  # the whole file is read line by line: so is the index's part
    if end == idx.size:
        return None, idx
    tail = to_frame(found)
    if tail is None:
        return full_scan(path)
    frame = pl.concat([idx.frame, tail])
    return None, FileHeads(frame, end, idx.lines + lines, idx.problems + problems, idx.fast)


# ---------------------------------------------------------------- writing


def write(path: Path, got: FileHeads) -> bool:
    """Write the index of records file `path` (heads and meta, each via tmp + rename).

    The records file must hold at least `got.size` bytes; False when it does not or a write
    failed (the run goes on: the next start reads more).
    """
    heads_path, meta_path = paths(path)
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < got.size:
                return False
            sums = checks(f, got.size)
        buf = io.BytesIO()
        got.frame.write_parquet(buf, compression="zstd")
        data = buf.getvalue()
        heads_path.parent.mkdir(exist_ok=True)
        write_atomic(heads_path, data)
        meta = {
            "version": VERSION, "file": f"{path.parent.name}/{path.name}", "size": got.size,
            "lines": got.lines, "rows": got.frame.height, "fast": got.fast,
            "problems": got.problems, "checks": sums,
            "heads_sha256": hashlib.sha256(data).hexdigest(),
        }  # fmt: skip
        write_atomic(meta_path, orjson.dumps(meta, option=orjson.OPT_INDENT_2))
    except Exception:  # noqa: BLE001 - the index is an optimisation: never fail a run for it
        return False  # a .tmp left behind is overwritten by the next write
    return True


def write_session(records: Path, known: dict, added: dict, opened: dict) -> None:
    """Write the index of each file in `records` whose every line a RunStore knows: those it
    scanned (`known`: path -> FileHeads) and those it created (`opened`: path -> size when
    it opened them, 0), plus what it wrote since (`added`: path -> Appended). A file it
    neither scanned nor created keeps its old index: still valid, the file only grew."""
    empty = FileHeads(to_frame([]), 0, 0, [])
    for path in dict.fromkeys([*known, *added]):
        base = known.get(path, empty if opened.get(path) == 0 else None)
        more = added.get(path)
        if path.parent != records or base is None or (more is None and base.from_index):
            continue  # errors.jsonl, a file it did not scan, or an index still whole
        try:  # an optimisation: a failure costs the next start a longer read, nothing else
            got = base if more is None else more.extend(base)
            if got is not None and got.frame is not None and path.stat().st_size == got.size:
                write(path, got)
        except Exception:  # noqa: BLE001
            continue
