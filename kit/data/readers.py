"""File and in-memory readers behind kit.data.sources: rows in order, never a crash on a row.

read(source) gives the rows of a file or in-memory object as blocks (lists of rows, or
polars frames of a columnar source), a block at a time: a JSONL or Parquet file is never
held whole (a JSON document is: its parser needs it all). A row that cannot be parsed
becomes a Skip in its place (a JSONL line that is not JSON, a row nested too deep for the
JSON parser). list_dir(path) splits a directory into the files kit reads and the ones it
ignores, each with the reason (unsupported type, a directory, a symlink loop, a broken
symlink), so nothing is passed over without a word.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import polars as pl

from kit.errors import DataError, MissingPath, Skip

SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}
CODECS = (".gz", ".zst")  # a JSON or JSONL file compressed: read streaming (gzip, pyarrow's zstd)
BLANK = object()  # a blank JSONL line: keeps row == line index, not counted as a row
_TOO_DEEP = "nested too deep for the JSON parser"
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.S)  # strings and brackets
_WS = re.compile(r"[ \t\n\r]*")
BLOCK = 10_000  # rows (JSONL lines, Parquet rows) read per block


def read(source) -> Iterator[list | pl.DataFrame]:
    """The rows of a source in order, as blocks (a list of rows, or a frame of a columnar
    source); a row that fails to parse becomes a Skip. A missing or unreadable file raises
    here, before any block."""
    if not isinstance(source, Path):
        return iter([_read_memory(source)])
    if problem := _file_problem(source):
        if problem == "no such file":
            also = f" (and {_unsupported(source)})" if source.suffix and not kind_of(source) else ""
            raise MissingPath(f"{source}: no such file or directory{also}")
        raise DataError(f"{source}: {problem}")
    kind = kind_of(source)
    if kind == "json":
        return iter([_read_json(source)])
    return _read_jsonl(source) if kind == "jsonl" else _read_parquet(source)


def _file_problem(path: Path) -> str | None:
    """Why kit cannot read `path` as a data file, or None when it can (one line, no raise)."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "symlink loop (too many levels of symbolic links): point it at a real file"
        if path.is_symlink():
            return f"broken symlink to {os.readlink(path)} (no such file)"
        if exc.errno == errno.ENOENT:
            return "no such file"
        return f"cannot read it ({exc.strerror})"
    if stat.S_ISDIR(mode):
        return "a directory (directories are not searched inside; pass it on its own)"
    if kind_of(path) is None:
        return _unsupported(path)
    if not stat.S_ISREG(mode):
        return "not a regular file"
    return None


def _unsupported(path: Path) -> str:
    codec = path.suffix.lower() in CODECS
    suffix = "".join(path.suffixes[-2:]) if codec else path.suffix
    return (
        f"unsupported file type {suffix!r}; expected .jsonl, .ndjson, "
        ".json or .parquet (a JSON or JSONL file may be compressed: .gz, .zst)"
    )


def kind_of(path: Path) -> str | None:
    """ "jsonl", "json" or "parquet" from a file name (a .gz or .zst JSON/JSONL file is its
    inner kind), or None for a type kit does not read."""
    name = path.name.lower()
    codec = next((c for c in CODECS if name.endswith(c)), "")
    kind = SUFFIXES.get(Path(name.removesuffix(codec)).suffix)
    return None if codec and kind == "parquet" else kind


def _open(path: Path):
    """A binary file object over a data file's bytes, decompressed as its name says."""
    name = path.name.lower()
    if name.endswith(".gz"):
        import gzip

        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        import io

        import pyarrow as pa

        return io.BufferedReader(pa.input_stream(str(path), compression="zstd"))
    return open(path, "rb")  # noqa: SIM115 - the caller closes it


def list_dir(path: Path) -> tuple[list[Path], list[dict]]:
    """A directory's data files (sorted) and the entries it ignores: [{"path", "reason"}]."""
    found, ignored = [], []
    for entry in sorted(path.iterdir()):
        if problem := _file_problem(entry):
            ignored.append({"path": str(entry), "reason": problem})
        else:
            found.append(entry)
    return found, ignored


def _read_jsonl(path: Path) -> Iterator[list]:
    """Rows of a JSONL file, BLOCK lines at a time (opened before the first); blank lines are
    ignored, row = 0-based line number."""
    f = _open(path)  # an error opening it is the caller's, now

    def blocks():
        try:
            yield from lines()
        except (EOFError, OSError) as exc:  # a compressed file cut short or damaged
            raise DataError(f"{path}: cannot read it ({type(exc).__name__}: {exc})") from None

    def lines():
        with f:
            rows: list = []
            for i, line in enumerate(f):
                if i == 0:
                    line = line.removeprefix(b"\xef\xbb\xbf")  # UTF-8 byte-order mark
                if len(rows) == BLOCK:
                    yield rows
                    rows = []
                if not line.strip():
                    rows.append(BLANK)  # keeps row == line index; not counted as a row
                    continue
                try:
                    rows.append(json.loads(line))
                except ValueError as exc:
                    rows.append(Skip("bad_json", f"line {i + 1}: {exc}"))
                except RecursionError:
                    rows.append(Skip("too_deep", f"line {i + 1}: {_TOO_DEEP}"))
            yield rows

    return blocks()


def _jsonl_rows(path: Path) -> list:
    """Every row of a JSONL file at once (a JSONL file named .json, read as JSON is)."""
    return [row for block in _read_jsonl(path) for row in block]


def _read_json(path: Path) -> list:
    """Rows of a JSON file: a list of objects or {"data": [...]}; JSONL misnamed .json also works."""
    with _open(path) as f:
        data = f.read()
    try:
        doc = json.loads(data)
    except RecursionError:
        return _read_json_deep(path, data.decode(json.detect_encoding(data), "surrogatepass"))
    except ValueError as exc:
        if "Extra data" in str(exc):
            return _jsonl_rows(path)
        raise DataError(f"{path}: not valid JSON ({exc})") from None
    if isinstance(doc, dict) and isinstance(doc.get("data"), list):
        doc = doc["data"]
    if not isinstance(doc, list):
        found = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise DataError(f'{path}: expected a JSON list of rows or {{"data": [...]}}, found {found}')
    return doc


def _read_json_deep(path: Path, text: str) -> list:
    """A JSON file one of whose rows is too deep to parse: read it row by row instead."""
    pos = _ws(text, 0)
    if text.startswith("{", pos):
        end = _value_end(text, pos)
        if text[end:].strip():
            return _jsonl_rows(path)  # JSONL named .json
        pos = _data_array(text, pos, path)
    if not text.startswith("[", pos):
        raise DataError(f'{path}: expected a JSON list of rows or {{"data": [...]}}')
    rows: list = []
    decoder = json.JSONDecoder()
    pos = _ws(text, pos + 1)
    while not text.startswith("]", pos):
        try:
            row, pos = decoder.raw_decode(text, pos)
        except RecursionError:
            row, pos = Skip("too_deep", f"row {len(rows)}: {_TOO_DEEP}"), _value_end(text, pos)
        except ValueError as exc:
            raise DataError(f"{path}: not valid JSON ({exc})") from None
        rows.append(row)
        pos = _ws(text, pos)
        if text.startswith(",", pos):
            pos = _ws(text, pos + 1)
        elif not text.startswith("]", pos):
            raise DataError(f"{path}: not valid JSON (expected ',' or ']' at char {pos})")
    return rows


def _data_array(text: str, pos: int, path: Path) -> int:
    """Position of the list under the top-level object's "data" key (the object starts at pos)."""
    decoder = json.JSONDecoder()
    keys = []
    pos = _ws(text, pos + 1)
    while text.startswith('"', pos):
        key, pos = decoder.raw_decode(text, pos)
        pos = _ws(text, pos)
        if not text.startswith(":", pos):
            raise DataError(f"{path}: not valid JSON (expected ':' at char {pos})")
        pos = _ws(text, pos + 1)
        if key == "data" and text.startswith("[", pos):
            return pos
        keys.append(key)
        pos = _ws(text, _value_end(text, pos))
        pos = _ws(text, pos + 1) if text.startswith(",", pos) else pos
    raise DataError(
        f'{path}: expected a JSON list of rows or {{"data": [...]}}, found {sorted(keys)}'
    )


def _value_end(text: str, pos: int) -> int:
    """Index just past the JSON value at pos, found without recursion (strings are skipped)."""
    if text[pos] not in "[{":
        return json.JSONDecoder().raw_decode(text, pos)[1]
    depth = 0
    for match in _TOKEN.finditer(text, pos):
        token = match.group()
        if token[0] in "[{":
            depth += 1
        elif token[0] in "]}":
            depth -= 1
            if depth == 0:
                return match.end()
    raise DataError(f"not valid JSON: the value at char {pos} is never closed")


def _ws(text: str, pos: int) -> int:
    return _WS.match(text, pos).end()


def _read_parquet(path: Path) -> Iterator[pl.DataFrame]:
    """A Parquet file as frames of BLOCK rows (rows become dicts after the format is known);
    its footer is read before the first."""
    import pyarrow.parquet as pq

    def fail(exc: Exception):
        return ValueError(f"{path}: cannot read Parquet ({type(exc).__name__}: {exc})")

    try:
        file = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several error types for a bad file
        raise fail(exc) from None

    def blocks():
        empty = True
        try:
            for batch in file.iter_batches(batch_size=BLOCK):
                empty = False
                yield pl.from_arrow(batch)
        except Exception as exc:
            raise fail(exc) from None
        if empty:
            yield pl.from_arrow(file.schema_arrow.empty_table())

    return blocks()


def _read_memory(obj) -> list | pl.DataFrame:
    """Rows of an in-memory source: list of dicts, polars frame, datasets.Dataset, iterable."""
    if isinstance(obj, pl.DataFrame):
        return obj
    if hasattr(obj, "to_list") and hasattr(obj, "column_names"):  # datasets.Dataset
        return list(obj.to_list())
    if hasattr(obj, "to_dicts"):
        return list(obj.to_dicts())
    if hasattr(obj, "to_dict") and hasattr(obj, "columns"):  # pandas.DataFrame
        return obj.to_dict("records")
    try:
        return list(obj)
    except TypeError:
        raise DataError(f"cannot read rows from a {type(obj).__name__}") from None
