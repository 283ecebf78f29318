"""The JSONL line format of a run directory: how lines are written whole and read back.

Record lines start with HEAD_FIELDS in a fixed order, so the resume index reads them with
one regex instead of parsing every JSON line (lines in any other shape fall back to orjson).
Nothing after a file's last newline is ever read: a torn tail is not data. A complete line
that is not a record (garbage, a NUL byte, half of a split line, a JSON non-object, a
missing field, a count that is not an int >= 0) is skipped and reported as
(line number, problem), so every reader can say which lines it could not use.
"""

from __future__ import annotations

import codecs
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
# What a line leaves out when the run directory holds the prompt frame (prompts.parquet):
# the prompt is stored once per run, records refer to it by (dataset, prompt_id).
PROMPT_FIELDS = ("messages", "tools")
LINE_ORDER_SHORT = [f for f in LINE_ORDER if f not in PROMPT_FIELDS]
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
_TEXT_BYTES = bytes(range(0x20, 0x100)) + b"\n"  # what a RunStore line may hold (orjson output)
_CHECK_CHUNK = 64 << 20
Problem = tuple  # (line number, what is wrong), e.g. (7, "not JSON: unexpected character")


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


def _kind(value) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


def _count_problem(row: dict, name: str) -> str | None:
    if name not in row:
        return f"missing field '{name}'"
    value = row[name]
    if type(value) is not int or not 0 <= value < 1 << 63:
        return f"{name} {value!r:.40} is not a count (an int >= 0)"
    return None


def head_problem(row) -> str | None:
    """What keeps a parsed line from being a record's head (key, count), or None."""
    if not isinstance(row, dict):
        return f"a JSON {_kind(row)}, not an object"
    for name in ("dataset", "prompt_id"):
        if name not in row:
            return f"missing field '{name}'"
        if not isinstance(row[name], str):
            return f"{name} {row[name]!r:.40} is not a string"
    for name in ("sample", "completion_tokens"):
        problem = _count_problem(row, name)
        if problem:
            return problem
    if not isinstance(row.get("finish_reason"), (str, type(None))):
        return f"finish_reason {row['finish_reason']!r:.40} is not a string"
    t = row.get("t_done")
    if t is not None and (type(t) not in (int, float)):
        return f"t_done {t!r:.40} is not a number"
    return None


_OPTIONAL_TYPES = {  # field -> accepted types besides None (a record line's other fields)
    "count_source": (str,), "prompt_tokens": (int,), "output_ids": (list,),
    "prompt_ids": (list,), "endpoint": (str,), "latency_s": (int, float), "attempts": (int,),
    "reasoning": (str,), "tools": (list,), "turns": (list,), "tool_calls": (list,),
}  # fmt: skip


_S, _I, _N, _L = (str, type(None)), (int, type(None)), (int, float, type(None)), (list, type(None))


def _whole_record(row) -> bool:
    """The common case, checked fast: a line RunStore wrote (no messages: prompts.parquet
    holds them), the checks of record_problem written out (no loop: this runs on every
    line). Anything else goes through the checks that name the problem."""
    get = row.get if type(row) is dict else None
    if get is None or "messages" in row:
        return False
    sample, count, t = get("sample"), get("completion_tokens"), type(get("t_done"))
    return (
        type(get("dataset")) is str and type(get("prompt_id")) is str
        and type(sample) is int and type(count) is int and sample >= 0 and 0 <= count < 1 << 63
        and type(get("completion")) is str and type(get("finish_reason")) in _S
        and t in _N
        and type(get("count_source")) in _S and type(get("prompt_tokens")) in _I
        and type(get("output_ids")) in _L and type(get("prompt_ids")) in _L
        and type(get("endpoint")) in _S and type(get("latency_s")) in _N
        and type(get("attempts")) in _I and type(get("reasoning")) in _S
        and type(get("tools")) in _L and type(get("turns")) in _L
        and type(get("tool_calls")) in _L
    )  # fmt: skip


def record_problem(row) -> str | None:
    """What keeps a parsed line from being a whole Record, or None (see head_problem)."""
    if _whole_record(row):
        return None
    problem = head_problem(row)
    if problem:
        return problem
    if "completion" not in row:
        return "missing field 'completion'"
    if not isinstance(row["completion"], str):
        return f"completion {row['completion']!r:.40} is not a string"
    messages = row.get("messages", [])  # absent: the prompt frame holds it (kit.run.batches)
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ):
        return "messages is not a list of {role, content} strings"
    for name, types in _OPTIONAL_TYPES.items():
        value = row.get(name)
        if value is not None and (type(value) not in types):
            return f"{name} {value!r:.40} has the wrong type"
    return None


def parse_line(line: bytes, check=head_problem) -> tuple[dict | None, str | None]:
    """One JSONL line -> (row, None), or (None, the problem) when it is not a record."""
    try:
        row = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        return None, "not JSON: a NUL byte" if b"\x00" in line else f"not JSON: {e.msg}"
    problem = check(row)
    return (None, problem) if problem else (row, None)


def corrupt_entries(path: Path, problems: list) -> list[dict]:
    """(line, problem) pairs of a records file -> [{"file", "line", "problem"}]."""
    rel = f"{path.parent.name}/{path.name}"
    return [{"file": rel, "line": n, "problem": p} for n, p in problems]


def describe_corrupt(corrupt: list[dict], limit: int = 3, total: int | None = None) -> str:
    """One line naming the skipped lines, e.g. for the runner to print ("" when none).

    `total` is the count when `corrupt` lists only the first of them.

    Example: describe_corrupt([{"file": "records/a.jsonl", "line": 3, "problem": "not JSON"}])
    -> "1 corrupt line skipped: records/a.jsonl line 3 (not JSON); its sample is generated
    again on resume" (one line)
    """
    n = len(corrupt) if total is None else total
    if not n:
        return ""
    where = "; ".join(f"{c['file']} line {c['line']} ({c['problem']})" for c in corrupt[:limit])
    more = f"; and {n - min(limit, len(corrupt))} more" if n > limit else ""
    lines, its = ("lines", "their samples are") if n > 1 else ("line", "its sample is")
    return f"{n} corrupt {lines} skipped: {where}{more}; {its} generated again on resume"


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


def heads(data, problems: list | None = None, first_line: int = 1) -> list[tuple]:
    """(dataset, prompt_id, sample, completion_tokens, finish_reason, t_done) per complete line.

    `data` (bytes or mmap) may end in a torn line: nothing after the last newline is read.
    Lines that are not records are skipped; `problems` (when given) gets (line, problem) for
    each, numbered from `first_line`.
    """
    end = data.rfind(b"\n")
    if end < 0:
        return []
    found = [m.groups() for m in _HEAD_NL.finditer(data, 0, end)]
    first = _HEAD.match(data, 0, end)
    if first:
        found.insert(0, first.groups())
    if len(found) == len(_NEWLINE.findall(data, 0, end + 1)) and _plain_text(data, end + 1):
        return [(text(a), text(b), int(c), int(d), text(e), float(f)) for a, b, c, d, e, f in found]
    out = []  # some lines were not written by RunStore (or are damaged): parse line by line
    for n, line in enumerate(bytes(data[: end + 1]).split(b"\n")[:-1], first_line):
        if not line:
            continue
        row, problem = parse_line(line)
        if problem is None:
            out.append(tuple(row.get(f) for f in HEAD_FIELDS[:5]) + (row.get("t_done") or 0.0,))
        elif problems is not None:
            problems.append((n, problem))
    return out


def _plain_text(data, size: int) -> bool:
    """No control byte but newlines and valid UTF-8 (what orjson writes): a damaged tail after
    a well-formed head (a NUL, garbage bytes) sends heads() to the line-by-line parse."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        for start in range(0, size, _CHECK_CHUNK):
            piece = data[start : min(start + _CHECK_CHUNK, size)]
            if piece.translate(None, _TEXT_BYTES):
                return False
            decoder.decode(piece)
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    return True


def scan_heads(path: Path, problems: list | None = None) -> list[tuple]:
    """heads of a records file, read through mmap (no copy of a large file)."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return []
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                return heads(m, problems)
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


# ---------------------------------------------------------------- the records frame


def record_schema() -> dict:
    """The columns of a records frame (kit.run.store.records_frame) and their dtypes."""
    import polars as pl

    msg = pl.List(pl.Struct({"role": pl.String, "content": pl.String}))
    return {
        "dataset": pl.String, "prompt_id": pl.String, "sample": pl.Int64, "messages": msg,
        "completion": pl.String, "finish_reason": pl.String, "completion_tokens": pl.Int64,
        "count_source": pl.String, "prompt_tokens": pl.Int64, "output_ids": pl.List(pl.Int64),
        "prompt_ids": pl.List(pl.Int64), "endpoint": pl.String, "latency_s": pl.Float64,
        "attempts": pl.Int64, "t_done": pl.Float64, "reasoning": pl.String,
        "tools": pl.String, "turns": pl.String,  # JSON text (free-form nested lists), or null
        "tool_calls": pl.String,  # JSON text too
    }  # fmt: skip


_JSON_COLUMNS = ("tools", "turns", "tool_calls")


def _cell(row: dict, key: str):
    """A row's value for its frame column (tools, turns and tool_calls as JSON text)."""
    value = row.get(key)
    if key in _JSON_COLUMNS and value is not None:
        return orjson.dumps(value).decode()
    return value


def frame_rows(rows: list[tuple], schema: dict) -> tuple[object, list[dict]]:
    """[(path, line, row)] -> (frame of the schema's columns, [{"file", "line", "problem"}]
    for rows polars cannot take, e.g. a string among output_ids: those are left out)."""
    import polars as pl

    def build(part):
        rows = [r for _, _, r in part]
        data = {k: [_cell(r, k) for r in rows] if k in _JSON_COLUMNS else [r.get(k) for r in rows] for k in schema}  # fmt: skip
        return pl.DataFrame(data, schema=schema)

    try:
        return build(rows), []
    except (TypeError, ValueError, OverflowError, pl.exceptions.PolarsError):
        pass
    good, bad = [], []
    for path, n, row in rows:
        problem = _ids_problem(row) or _one_row_problem(build, (path, n, row))
        if problem:
            bad += corrupt_entries(path, [(n, problem)])
        else:
            good.append((path, n, row))
    return build(good), bad


def _one_row_problem(build, item) -> str | None:
    import polars as pl

    try:
        build([item])
    except (TypeError, ValueError, OverflowError, pl.exceptions.PolarsError) as e:
        return f"a value does not fit its column ({str(e).splitlines()[0][:80]})"
    return None


def _ids_problem(row: dict) -> str | None:
    for name in ("output_ids", "prompt_ids"):
        if row.get(name) is not None and not all(type(x) is int for x in row[name]):
            return f"{name} holds a value that is not an int"
    return None
