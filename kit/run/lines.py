"""The JSONL line format of a run directory: how lines are written whole and read back.

Record lines start with HEAD_FIELDS in a fixed order, so the resume index reads them with
one regex instead of parsing every JSON line (lines in any other shape fall back to orjson).
Nothing after a file's last newline is ever read: a torn tail is not data.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import re
from pathlib import Path

import orjson

from kit.types import ErrorRecord, Record

Key = tuple  # (dataset, prompt_id, sample)

RECORD_FIELDS = [f.name for f in dataclasses.fields(Record)]
# Lines start with these fields in this order, so the index reads them with one regex
# instead of parsing each JSON line (other lines fall back to orjson).
HEAD_FIELDS = ["dataset", "prompt_id", "sample", "completion_tokens", "finish_reason", "t_done"]
LINE_ORDER = HEAD_FIELDS + [f for f in RECORD_FIELDS if f not in HEAD_FIELDS]
_STR = rb'"((?:[^"\\]|\\.)*)"'
_HEAD = re.compile(
    rb'^\{"dataset":'
    + _STR
    + rb',"prompt_id":'
    + _STR
    + rb',"sample":(\d+),"completion_tokens":(\d+),'
    rb'"finish_reason":(?:' + _STR + rb'|null),"t_done":([-+.\deE]+)[,}]',
)
_HEAD_NL = re.compile(b"\n" + _HEAD.pattern[1:])  # the same, for a line after a newline
_NEWLINE = re.compile(b"\n")
ERROR_FIELDS = [f.name for f in dataclasses.fields(ErrorRecord)]


def write_atomic(path: Path, data: bytes) -> None:
    """Write via a temp file, fsync, rename: readers see the old or the new file, whole."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------- line reading


def complete_bytes(path: Path) -> bytes:
    """The file's bytes up to and including its last newline (a torn tail is never data)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return b""
    end = data.rfind(b"\n")
    return data[: end + 1]


def parse_lines(data: bytes) -> tuple[list[dict], int]:
    """Parse complete JSONL bytes -> (rows, bad line count)."""
    rows, bad = [], 0
    loads = orjson.loads
    for line in data.split(b"\n"):
        if not line:
            continue
        try:
            row = loads(line)
        except orjson.JSONDecodeError:
            bad += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    return rows, bad


def record_files(run_dir: Path) -> dict[str, Path]:
    """dataset -> records file."""
    rec = run_dir / "records"
    return {p.stem: p for p in sorted(rec.glob("*.jsonl"))} if rec.exists() else {}


def record_key(row: dict) -> Key:
    return (row["dataset"], row["prompt_id"], row["sample"])


def text(raw: bytes | None) -> str | None:
    """A regex-captured JSON string body -> str."""
    if raw is None or b"\\" not in raw:
        return None if raw is None else raw.decode()
    return orjson.loads(b'"' + raw + b'"')


def heads(data) -> list[tuple]:
    """(dataset, prompt_id, sample, completion_tokens, finish_reason, t_done) per complete line.

    `data` (bytes or mmap) may end in a torn line: nothing after the last newline is read.
    """
    end = data.rfind(b"\n")
    if end < 0:
        return []
    found = [m.groups() for m in _HEAD_NL.finditer(data, 0, end)]
    first = _HEAD.match(data, 0, end)
    if first:
        found.insert(0, first.groups())
    if len(found) == len(_NEWLINE.findall(data, 0, end + 1)):
        return [(text(a), text(b), int(c), int(d), text(e), float(f)) for a, b, c, d, e, f in found]
    out = []  # some lines were not written by RunStore (or are damaged): parse line by line
    for r in parse_lines(bytes(data[: end + 1]))[0]:
        if all(isinstance(r.get(f), (str, int)) for f in HEAD_FIELDS[:4]):
            out.append(tuple(r.get(f) for f in HEAD_FIELDS[:5]) + (r.get("t_done") or 0.0,))
    return out


def scan_heads(path: Path) -> list[tuple]:
    """heads of a records file, read through mmap (no copy of a large file)."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return []
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                return heads(m)
    except FileNotFoundError:
        return []


def safe_name(dataset: str) -> str:
    """A dataset name usable as a file name ('a/b' -> 'a_b')."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in dataset) or "_"


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def truncate_quietly(fd: int, size: int) -> None:
    try:
        os.ftruncate(fd, size)
    except OSError:
        pass
