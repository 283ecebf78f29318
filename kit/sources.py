"""Load prompt datasets from real formats into one polars prompt frame.

Formats (detected from the row keys, or forced with `format=`):

    sharegpt          {"conversations": [{"from": "human"|"gpt"|"system", "value": str}, ...]}
    openai            {"messages": [{"role": "user"|"assistant"|"system", "content": str}, ...]}
    ultrachat         {"data": [user, assistant, user, ...]}  (alternating strings)
    alpaca            {"instruction": str, "input": str}  -> instruction + "\\n\\n" + input
    magicoder         {"problem": str} or {"instruction": str}
    opencodeinstruct  {"input": str}
    mapping           mapping={"prompt": column, "system": column} or {"messages": column}

Turn lists accept both from/value and role/content keys; roles human/gpt/chatgpt/model
are read as user/assistant.

The prompt is the conversation up to and including its LAST user turn; turns after it
(the old answer) are dropped before any check, so a broken answer never costs a prompt.
Each kept turn's content is `str.strip()`-ed. A prompt is valid when it is: at most one
system turn, first; then user/assistant strictly alternating, starting with user.

prompt_id = blake2b (8-byte digest, 16 hex chars) of the compact JSON of
[[role, content], ...] for the stored (stripped) prompt. It does not depend on the
dataset name, the file, or the row order, so it is stable across re-loads.

Bad rows are skipped and counted by reason (REASONS); duplicate prompts within a dataset
keep their first row and are counted. Nothing in a file's rows raises.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

FORMATS = ("sharegpt", "openai", "ultrachat", "alpaca", "magicoder", "opencodeinstruct", "mapping")
REASONS = (
    "bad_json",  # a JSONL line is not valid JSON (or not UTF-8)
    "not_object",  # a row is not a JSON object
    "bad_type",  # a turn list is not a list, or a turn is not an object
    "missing_field",  # the format's field (or a turn's role/content) is absent or null
    "bad_role",  # a turn's role is not system/user/assistant (or a known alias)
    "non_string_content",  # a prompt turn's content is not a string
    "empty_content",  # a prompt turn's content is empty or whitespace
    "no_user_turn",  # the conversation has no user turn
    "bad_order",  # roles out of order: assistant first, two in a row, system not first
)
MESSAGE_TYPE = pl.List(pl.Struct({"role": pl.String, "content": pl.String}))
SCHEMA = {
    "dataset": pl.String,
    "prompt_id": pl.String,
    "messages": MESSAGE_TYPE,
    "n_turns": pl.Int64,
    "row": pl.Int64,
}
MAX_SKIP_ROWS = 1000  # skipped rows kept per dataset in LoadResult.skipped_rows (counts are exact)

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
_NAME_OK = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}
_DETECT_ROWS = 200  # rows whose keys decide the format
_BLANK = object()  # a blank JSONL line


class _Skip(Exception):
    """A row that cannot give a prompt; `reason` is one of REASONS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail


@dataclass(slots=True)
class LoadResult:
    """Prompts loaded from one or more datasets, with what was dropped and why."""

    frame: pl.DataFrame  # dataset, prompt_id, messages, n_turns, row (see kit.types)
    skipped: dict[str, dict[str, int]] = field(default_factory=dict)  # dataset -> reason -> rows
    duplicates: dict[str, int] = field(default_factory=dict)  # dataset -> rows dropped as repeats
    formats: dict[str, str] = field(default_factory=dict)  # dataset -> format name
    paths: dict[str, str] = field(default_factory=dict)  # dataset -> source path ("" in memory)
    rows: dict[str, int] = field(default_factory=dict)  # dataset -> rows read
    skipped_rows: pl.DataFrame | None = None  # dataset, row, reason, detail (first MAX_SKIP_ROWS)

    def summary(self) -> pl.DataFrame:
        """One row per dataset: format, rows read, prompts kept, duplicates, skips by reason."""
        kept = Counter(self.frame["dataset"].to_list())
        out = []
        for name, fmt in self.formats.items():
            skips = self.skipped.get(name, {})
            reasons = ", ".join(f"{reason}: {n}" for reason, n in skips.items())
            out.append(
                {
                    "dataset": name,
                    "format": fmt,
                    "rows": self.rows.get(name, 0),
                    "prompts": kept.get(name, 0),
                    "duplicates": self.duplicates.get(name, 0),
                    "skipped": sum(skips.values()),
                    "skip_reasons": reasons,
                }
            )
        return pl.DataFrame(out)

    def source_hashes(self) -> dict[str, str]:
        """dataset -> 16-hex hash of its sorted prompt_ids (RunConfig.source_hashes)."""
        out = {}
        for name in self.formats:
            ids = sorted(self.frame.filter(pl.col("dataset") == name)["prompt_id"].to_list())
            out[name] = hashlib.blake2b("\n".join(ids).encode(), digest_size=8).hexdigest()
        return out

    def _headline(self) -> str:
        skipped = sum(sum(s.values()) for s in self.skipped.values())
        dups = sum(self.duplicates.values())
        return (
            f"LoadResult: {len(self.formats)} datasets, {self.frame.height} prompts, "
            f"{skipped} skipped, {dups} duplicates"
        )

    def __repr__(self) -> str:
        with pl.Config(
            tbl_rows=50, tbl_cols=20, fmt_str_lengths=120, tbl_hide_dataframe_shape=True
        ):
            return f"{self._headline()}\n{self.summary()}"

    def _repr_html_(self) -> str:
        return f"<p><b>{self._headline()}</b></p>{self.summary()._repr_html_()}"


def load(paths_or_mapping, *, format=None, name=None, mapping=None) -> LoadResult:
    """Load prompt datasets into one prompt frame.

    Args:
        paths_or_mapping: a path, a directory (its .jsonl/.json/.parquet files), a list of
            those, or {dataset_name: path or in-memory rows}
            (a list of dicts, a polars DataFrame, a Hugging Face `datasets.Dataset`).
        format: force one of FORMATS for every source; None detects it per source.
        name: dataset name for a single source (default: the file stem, sanitized).
        mapping: {"prompt": column, "system": column (optional)} or {"messages": column}.

    Returns:
        LoadResult with `.frame` (dataset, prompt_id, messages, n_turns, row), `.skipped`,
        `.duplicates` and `.summary()`.

    Example:
        >>> res = kit.load("data/samples/chat_general.jsonl")
        >>> res.frame.columns
        ['dataset', 'prompt_id', 'messages', 'n_turns', 'row']
        >>> res.summary().select("dataset", "format", "prompts", "skipped").row(0)
        ('chat_general', 'openai', 80, 0)
    """
    fmt = _check_format(format, mapping)
    cols: dict[str, list] = {key: [] for key in SCHEMA}
    result = LoadResult(frame=pl.DataFrame(schema=SCHEMA))
    skip_rows: list[dict] = []
    for ds, source in _sources(paths_or_mapping, name):
        label = str(source) if isinstance(source, Path) else f"in-memory dataset {ds!r}"
        rows = _read(source)
        result.formats[ds] = fmt or _detect(rows, label)
        result.paths[ds] = str(source) if isinstance(source, Path) else ""
        if mapping:
            _check_mapping_columns(mapping, rows, label)
        if isinstance(rows, pl.DataFrame):
            rows = _frame_rows(rows, result.formats[ds], mapping)
        _convert(ds, rows, result.formats[ds], mapping, cols, result, skip_rows)
    result.frame = _frame(cols)
    result.skipped_rows = pl.DataFrame(
        skip_rows,
        schema={"dataset": pl.String, "row": pl.Int64, "reason": pl.String, "detail": pl.String},
    )
    return result


def prompt_id(messages: list[dict]) -> str:
    """16-hex content hash of prompt messages: [{"role": "user", "content": "Hi"}] -> 'a1b2...'."""
    payload = json.dumps(
        [[m["role"], m["content"]] for m in messages], ensure_ascii=False, separators=(",", ":")
    )
    return hashlib.blake2b(payload.encode("utf-8"), digest_size=8).hexdigest()


def _frame(cols: dict[str, list]) -> pl.DataFrame:
    """Column lists -> the prompt frame (messages go through pyarrow: 40x faster than polars)."""
    import pyarrow as pa

    struct = pa.struct([("role", pa.string()), ("content", pa.string())])
    messages = pl.from_arrow(pa.array(cols["messages"], type=pa.list_(struct)))
    frame = pl.DataFrame(
        {k: v for k, v in cols.items() if k != "messages"}, schema_overrides=SCHEMA
    )
    return frame.insert_column(2, messages.alias("messages")).cast(SCHEMA)


# ---------------------------------------------------------------- inputs


def _check_format(format, mapping) -> str | None:
    """Validate format/mapping arguments; return the forced format or None."""
    if format is not None and format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if mapping is None:
        if format == "mapping":
            raise ValueError("format='mapping' needs mapping={'prompt': column}")
        return format
    if not isinstance(mapping, dict) or not mapping:
        raise ValueError(f"mapping must be a non-empty dict, got {mapping!r}")
    unknown = set(mapping) - {"prompt", "system", "messages"}
    if unknown or ("prompt" in mapping) == ("messages" in mapping):
        raise ValueError(
            f"mapping needs exactly one of 'prompt' or 'messages' (plus optional 'system'), got {mapping!r}"
        )
    if not all(isinstance(v, str) and v for v in mapping.values()):
        raise ValueError(f"mapping values must be column names, got {mapping!r}")
    if format not in (None, "mapping"):
        raise ValueError(f"format={format!r} conflicts with mapping={mapping!r}")
    return "mapping"


def _sources(spec, name) -> list[tuple[str, object]]:
    """Normalize the first argument of load() to [(dataset_name, Path or rows object)]."""
    if isinstance(spec, dict):
        if name is not None:
            raise ValueError("name= is for a single source; a dict already names its datasets")
        pairs = [(_check_name(k), _as_source(v)) for k, v in spec.items()]
    elif isinstance(spec, (str, Path)) and not Path(spec).is_dir():
        pairs = [(_check_name(name) if name else _stem_name(Path(spec)), Path(spec))]
    elif isinstance(spec, (str, Path, list, tuple)) and _all_paths(spec):
        if name is not None:
            raise ValueError("name= is for a single file; pass {name: path} for several")
        pairs = [(_stem_name(p), p) for p in _expand(spec)]
    elif name is not None:
        pairs = [(_check_name(name), spec)]
    else:
        raise ValueError(
            f"load() takes a path, a list of paths or {{name: path_or_rows}}, got {type(spec).__name__}; "
            "in-memory data needs a name: load({'name': data})"
        )
    if not pairs:
        raise ValueError("load() got no sources")
    _check_unique(pairs)
    return pairs


def _all_paths(spec) -> bool:
    """True for a path or a list/tuple of paths."""
    items = spec if isinstance(spec, (list, tuple)) else [spec]
    return all(isinstance(p, (str, Path)) for p in items)


def _expand(spec) -> list[Path]:
    """Paths, with each directory replaced by its .jsonl/.ndjson/.json/.parquet files, sorted."""
    out = []
    for item in spec if isinstance(spec, (list, tuple)) else [spec]:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix.lower() in _SUFFIXES)
            if not found:
                raise ValueError(f"{path}: no .jsonl, .json or .parquet files in this directory")
            out.extend(found)
        else:
            out.append(path)
    return out


def _as_source(value):
    """A dict value: a path becomes a Path, anything else is in-memory rows."""
    return Path(value) if isinstance(value, (str, Path)) else value


def _check_unique(pairs) -> None:
    """Raise when two sources share a dataset name."""
    seen: dict[str, object] = {}
    for ds, src in pairs:
        if ds in seen:
            raise ValueError(
                f"dataset name {ds!r} used twice ({seen[ds]} and {src}); pass {{name: path}} to rename"
            )
        seen[ds] = src


def _check_name(name) -> str:
    """Dataset names become file names in the run directory: [A-Za-z0-9_.-], no leading dot."""
    if not isinstance(name, str) or not _NAME_OK.fullmatch(name):
        raise ValueError(
            f"dataset name {name!r} must match [A-Za-z0-9_.-]+ and not start with '.' or '-' "
            "(it names files in the run directory)"
        )
    return name


def _stem_name(path: Path) -> str:
    """'my data (v2).jsonl' -> 'my_data_v2'."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", path.name[: -len(path.suffix) or None])
    stem = stem.strip("_.-")
    if not stem:
        raise ValueError(f"cannot make a dataset name from {str(path)!r}; pass name= or a dict")
    return stem


# ---------------------------------------------------------------- reading


def _read(source) -> list:
    """All rows of a source, in order; a JSONL line that fails to parse becomes a _Skip."""
    if not isinstance(source, Path):
        return _read_memory(source)
    kind = _SUFFIXES.get(source.suffix.lower())
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
            if not line.strip():
                rows.append(_BLANK)  # keeps row == line index; not counted as a row
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as exc:
                rows.append(_Skip("bad_json", f"line {i + 1}: {exc}"))
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
    try:
        return list(obj)
    except TypeError:
        raise ValueError(f"cannot read rows from a {type(obj).__name__}") from None


# ---------------------------------------------------------------- formats


def _columns(rows: list | pl.DataFrame) -> list[str]:
    """Keys with a non-null value in the first _DETECT_ROWS object rows."""
    if isinstance(rows, pl.DataFrame):
        head = rows.head(_DETECT_ROWS)
        return [c for c in head.columns if head.height == 0 or head[c].null_count() < head.height]
    keys: dict[str, None] = {}
    for row in [r for r in rows if isinstance(r, dict)][:_DETECT_ROWS]:
        keys.update((k, None) for k, v in row.items() if v is not None)
    return list(keys)


def _detect(rows: list, label: str) -> str:
    """Pick the format from the columns found; raise naming the source and its columns."""
    cols = set(_columns(rows))
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


def _check_mapping_columns(mapping: dict, rows: list, label: str) -> None:
    """A mapped column missing from every row is a typo, not a bad row: raise."""
    cols = _columns(rows)
    missing = [c for c in mapping.values() if c not in cols]
    if missing and cols:
        raise ValueError(f"mapping columns {missing} not found in {label}; columns found {cols}")


_FIELDS = {  # format -> the columns its rows are read from
    "sharegpt": ["conversations"],
    "openai": ["messages"],
    "ultrachat": ["data"],
    "alpaca": ["instruction", "input"],
    "magicoder": ["problem", "instruction"],
    "opencodeinstruct": ["input"],
}


def _frame_rows(df: pl.DataFrame, fmt: str, mapping: dict | None) -> list[dict]:
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
        raise _Skip("missing_field", f"no {key!r}")
    return value


def _turn(obj) -> tuple[str, object] | _Skip:
    """One turn object (role/content or from/value) -> (role, content) or the problem."""
    if not isinstance(obj, dict):
        return _Skip("bad_type", f"turn is a {type(obj).__name__}, not an object")
    role_key, content_key = ("from", "value") if "from" in obj else ("role", "content")
    raw, content = obj.get(role_key), obj.get(content_key)
    if raw is None or content is None:
        return _Skip("missing_field", f"turn without {role_key!r}/{content_key!r}")
    role = _ROLES.get(raw.lower()) if isinstance(raw, str) else None
    return (role, content) if role else _Skip("bad_role", f"role {raw!r}")


def _turn_list(row: dict, key: str) -> list:
    """A conversation field -> list of (role, content) or _Skip per turn."""
    value = _field(row, key)
    if not isinstance(value, list):
        raise _Skip("bad_type", f"{key!r} is a {type(value).__name__}, not a list")
    return [_turn(t) for t in value]


def _single(row: dict, prompt_key: str, system_key: str | None = None) -> list:
    """A single-prompt row -> [(system)?, (user, prompt)]."""
    turns = [("user", _field(row, prompt_key))]
    system = row.get(system_key) if system_key else None
    if system is not None and system != "":
        turns.insert(0, ("system", system))
    return turns


def _alpaca(row: dict) -> list:
    """instruction + "\\n\\n" + input (input optional)."""
    instruction, extra = _field(row, "instruction"), row.get("input")
    if not isinstance(instruction, str) or (extra is not None and not isinstance(extra, str)):
        raise _Skip("non_string_content", "instruction/input is not a string")
    if extra and extra.strip():
        instruction = instruction.strip() + "\n\n" + extra.strip()
    return [("user", instruction)]


def _ultrachat(row: dict) -> list:
    """data: [user, assistant, user, ...] -> turns."""
    data = _field(row, "data")
    if not isinstance(data, list):
        raise _Skip("bad_type", f"'data' is a {type(data).__name__}, not a list")
    return [("user" if i % 2 == 0 else "assistant", text) for i, text in enumerate(data)]


def _raw_turns(row: dict, fmt: str, mapping: dict | None) -> list:
    """Row -> list of (role, content) or _Skip, before the prompt is cut and checked."""
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
        turns = _turn_list(row, mapping["messages"])
        return _single_system(row, mapping) + turns
    return _single(row, mapping["prompt"], mapping.get("system"))


def _single_system(row: dict, mapping: dict) -> list:
    """The optional mapped system column as a leading turn (for a mapped messages column)."""
    system = row.get(mapping["system"]) if "system" in mapping else None
    return [("system", system)] if system is not None and system != "" else []


# ---------------------------------------------------------------- prompts


def _prompt(turns: list) -> list[dict]:
    """Cut at the last user turn, check what is kept, return stripped messages."""
    last = max(
        (i for i, t in enumerate(turns) if isinstance(t, tuple) and t[0] == "user"), default=-1
    )
    if last < 0:
        raise next((t for t in turns if isinstance(t, _Skip)), _Skip("no_user_turn"))
    messages = []
    for i, turn in enumerate(turns[: last + 1]):
        if isinstance(turn, _Skip):
            raise _Skip(turn.reason, f"turn {i}: {turn.detail}")
        role, content = turn
        if not isinstance(content, str):
            raise _Skip("non_string_content", f"turn {i} content is a {type(content).__name__}")
        if not content.strip():
            raise _Skip("empty_content", f"turn {i} ({role}) is empty")
        messages.append({"role": role, "content": content.strip()})
    _check_order([m["role"] for m in messages])
    return messages


def _check_order(roles: list[str]) -> None:
    """One optional system turn first, then user/assistant alternating from user."""
    body = roles[1:] if roles[0] == "system" else roles
    expected = "user"
    for i, role in enumerate(body):
        if role != expected:
            raise _Skip(
                "bad_order", f"{role} at turn {i + len(roles) - len(body)}, {expected} expected"
            )
        expected = "assistant" if role == "user" else "user"


def _convert(ds, rows, fmt, mapping, cols, result: LoadResult, skip_rows: list) -> None:
    """Append the prompts of one dataset to cols; count skips and duplicates in result."""
    seen: set[str] = set()
    skips: Counter = Counter()
    dups = n_rows = 0
    for i, row in enumerate(rows):
        if row is _BLANK:
            continue
        n_rows += 1
        try:
            if isinstance(row, _Skip):
                raise row
            if not isinstance(row, dict):
                raise _Skip("not_object", f"row is a {type(row).__name__}")
            messages = _prompt(_raw_turns(row, fmt, mapping))
        except _Skip as skip:
            skips[skip.reason] += 1
            if skips.total() <= MAX_SKIP_ROWS:
                skip_rows.append(
                    {"dataset": ds, "row": i, "reason": skip.reason, "detail": skip.detail}
                )
            continue
        pid = prompt_id(messages)
        if pid in seen:
            dups += 1
            continue
        seen.add(pid)
        for key, value in zip(
            SCHEMA, (ds, pid, messages, sum(m["role"] == "user" for m in messages), i), strict=True
        ):
            cols[key].append(value)
    result.skipped[ds] = {r: skips[r] for r in REASONS if skips[r]}
    result.duplicates[ds] = dups
    result.rows[ds] = n_rows
