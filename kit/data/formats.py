"""Readers and per-format row parsers behind kit.data.sources (see its docstring for the rules).

read(source) gives the rows of a file or in-memory object; detect() names the format from
the columns; raw_turns(row, fmt, mapping) gives [(role, content), ...] for one row (a Skip
in either slot marks a broken turn), before kit.data.sources cuts the prompt at the last user
turn and checks it.
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl

FORMATS = ("sharegpt", "openai", "ultrachat", "alpaca", "magicoder", "opencodeinstruct", "mapping")
SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}
BLANK = object()  # a blank JSONL line: keeps row == line index, not counted as a row
_DETECT_ROWS = 200  # rows whose keys decide the format
_ROLES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "system": "system",
}


class Skip(Exception):
    """A row that cannot give a prompt; `reason` is one of kit.data.sources.REASONS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail


def read(source) -> list:
    """All rows of a source, in order; a JSONL line that fails to parse becomes a Skip."""
    if not isinstance(source, Path):
        return _read_memory(source)
    kind = SUFFIXES.get(source.suffix.lower())
    if kind is None:
        raise ValueError(
            f"{source}: unsupported file type {source.suffix!r}; expected .jsonl, .json or .parquet"
        )
    if not source.is_file():
        raise FileNotFoundError(f"no such file: {source}")
    return {"jsonl": _read_jsonl, "json": _read_json, "parquet": _read_parquet}[kind](source)


def _read_jsonl(path: Path) -> list:
    """Rows of a JSONL file; blank lines are ignored, row = 0-based line number."""
    rows: list = []
    with open(path, "rb") as f:
        for i, line in enumerate(f):
            if i == 0:
                line = line.removeprefix(b"\xef\xbb\xbf")  # UTF-8 byte-order mark
            if not line.strip():
                rows.append(BLANK)  # keeps row == line index; not counted as a row
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as exc:
                rows.append(Skip("bad_json", f"line {i + 1}: {exc}"))
    return rows


def _read_json(path: Path) -> list:
    """Rows of a JSON file: a list of objects or {"data": [...]}; JSONL misnamed .json also works."""
    try:
        data = json.loads(path.read_bytes())
    except ValueError as exc:
        if "Extra data" in str(exc):
            return _read_jsonl(path)
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        found = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(
            f'{path}: expected a JSON list of rows or {{"data": [...]}}, found {found}'
        )
    return data


def _read_parquet(path: Path) -> pl.DataFrame:
    """A Parquet file as a frame (rows become dicts after the format is known)."""
    try:
        return pl.read_parquet(path)
    except Exception as exc:  # polars raises several error types for a bad file
        raise ValueError(f"{path}: cannot read Parquet ({type(exc).__name__}: {exc})") from None


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
        raise ValueError(f"cannot read rows from a {type(obj).__name__}") from None


def columns(rows: list | pl.DataFrame) -> list[str]:
    """Keys with a non-null value in the first _DETECT_ROWS object rows."""
    if isinstance(rows, pl.DataFrame):
        head = rows.head(_DETECT_ROWS)
        return [c for c in head.columns if head.height == 0 or head[c].null_count() < head.height]
    keys: dict[str, None] = {}
    for row in [r for r in rows if isinstance(r, dict)][:_DETECT_ROWS]:
        keys.update((k, None) for k, v in row.items() if v is not None)
    return list(keys)


def detect(rows: list | pl.DataFrame, label: str) -> str:
    """Pick the format from the columns found; raise naming the source and its columns.

    Example:
        >>> detect([{"instruction": "Name a colour.", "input": ""}], "tasks.jsonl")
        'alpaca'
    """
    cols = set(columns(rows))
    for fmt, needs in (
        ("sharegpt", {"conversations"}),
        ("openai", {"messages"}),
        ("ultrachat", {"data"}),
        ("alpaca", {"instruction", "input"}),
        ("magicoder", {"problem"}),
        ("magicoder", {"instruction"}),
        ("opencodeinstruct", {"input"}),
    ):
        if needs <= cols:
            return fmt
    raise ValueError(
        f"cannot detect the prompt format of {label}: columns found {sorted(cols)}; "
        f"pass format= (one of {FORMATS}) or mapping={{'prompt': <column>}}"
    )


_FIELDS = {  # format -> the columns its rows are read from
    "sharegpt": ["conversations"],
    "openai": ["messages"],
    "ultrachat": ["data"],
    "alpaca": ["instruction", "input"],
    "magicoder": ["problem", "instruction"],
    "opencodeinstruct": ["input"],
}


def frame_rows(df: pl.DataFrame, fmt: str, mapping: dict | None) -> list[dict]:
    """Rows of a columnar source: only the needed columns, turn lists cut after the last user turn."""
    wanted = list(mapping.values()) if fmt == "mapping" else _FIELDS[fmt]
    df = df.select([c for c in df.columns if c in wanted])
    trims = [_trim_turns(c, df.schema[c]) for c in df.columns]
    return df.with_columns([t for t in trims if t is not None]).to_dicts()


def _trim_turns(col: str, dtype) -> pl.Expr | None:
    """Drop turns after the last user turn in polars (they are never read; saves converting them)."""
    if not (isinstance(dtype, pl.List) and isinstance(dtype.inner, pl.Struct)):
        return None
    fields = {f.name: f.dtype for f in dtype.inner.fields}
    keys = [k for k in ("from", "role") if fields.get(k) == pl.String]
    if not keys:
        return None
    role = pl.coalesce([pl.element().struct.field(k) for k in keys]).str.to_lowercase()
    user_at_or_after = role.is_in(["user", "human"]).reverse().cum_sum().reverse() > 0
    cut = pl.col(col).list.eval(pl.element().filter(user_at_or_after))
    return pl.when(cut.list.len() > 0).then(cut).otherwise(pl.col(col)).alias(col)


def _field(row: dict, key: str):
    """row[key], or a missing_field skip when absent or null."""
    value = row.get(key)
    if value is None:
        raise Skip("missing_field", f"no {key!r}")
    return value


def _turn(obj) -> tuple:
    """One turn object (role/content or from/value) -> (role, content); a problem is a Skip in its slot.

    The role stays readable when only the content is broken, so the last user turn is found
    by role alone: a broken last user turn skips the row instead of cutting before it.
    """
    if not isinstance(obj, dict):
        return (Skip("bad_type", f"turn is a {type(obj).__name__}, not an object"), None)
    role_key, content_key = (
        ("from", "value") if obj.get("from") is not None else ("role", "content")
    )
    raw, content = obj.get(role_key), obj.get(content_key)
    role = _ROLES.get(raw.lower()) if isinstance(raw, str) else None
    if role is None:
        role = (
            Skip("missing_field", "turn without a role")
            if raw is None
            else Skip("bad_role", f"role {raw!r}")
        )
    if content is None:
        content = Skip("missing_field", f"turn without {content_key!r}")
    return (role, content)


def _turn_list(row: dict, key: str) -> list:
    """A conversation field -> list of (role, content) per turn."""
    value = _field(row, key)
    if not isinstance(value, list):
        raise Skip("bad_type", f"{key!r} is a {type(value).__name__}, not a list")
    return [_turn(t) for t in value]


def _single(row: dict, prompt_key: str, system_key: str | None = None) -> list:
    """A single-prompt row -> [(system)?, (user, prompt)]; a blank or null system is no system."""
    turns = [("user", _field(row, prompt_key))]
    return _system(row, system_key) + turns


def _system(row: dict, key: str | None) -> list:
    """The optional system column as a leading turn, unless absent, null or blank."""
    value = row.get(key) if key else None
    blank = value is None or (isinstance(value, str) and not value.strip())
    return [] if blank else [("system", value)]


def _alpaca(row: dict) -> list:
    """instruction + "\\n\\n" + input (input optional)."""
    instruction, extra = _field(row, "instruction"), row.get("input")
    if not isinstance(instruction, str) or (extra is not None and not isinstance(extra, str)):
        raise Skip("non_string_content", "instruction/input is not a string")
    if extra and extra.strip():
        instruction = instruction.strip() + "\n\n" + extra.strip()
    return [("user", instruction)]


def _ultrachat(row: dict) -> list:
    """data: [user, assistant, user, ...] -> turns."""
    data = _field(row, "data")
    if not isinstance(data, list):
        raise Skip("bad_type", f"'data' is a {type(data).__name__}, not a list")
    return [("user" if i % 2 == 0 else "assistant", text) for i, text in enumerate(data)]


def raw_turns(row: dict, fmt: str, mapping: dict | None) -> list:
    """Row -> [(role, content), ...] (either may be a Skip) before the prompt is cut and checked.

    Example:
        >>> raw_turns({"data": ["Hi", "Hello!", "Bye"]}, "ultrachat", None)
        [('user', 'Hi'), ('assistant', 'Hello!'), ('user', 'Bye')]
    """
    if fmt == "sharegpt":
        return _turn_list(row, "conversations")
    if fmt == "openai":
        return _turn_list(row, "messages")
    if fmt == "ultrachat":
        return _ultrachat(row)
    if fmt == "alpaca":
        return _alpaca(row)
    if fmt == "magicoder":
        return _single(row, "problem" if row.get("problem") is not None else "instruction")
    if fmt == "opencodeinstruct":
        return _single(row, "input")
    if "messages" in mapping:
        return _system(row, mapping.get("system")) + _turn_list(row, mapping["messages"])
    return _single(row, mapping["prompt"], mapping.get("system"))
