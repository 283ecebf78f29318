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

from kit.data.formats import (
    BLANK,
    FORMATS,
    SUFFIXES,
    Skip,
    columns,
    detect,
    frame_rows,
    raw_turns,
    read,
)

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

_NAME_OK = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


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
        return source_hashes(self.frame)

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
        rows = read(source)
        result.formats[ds] = fmt or detect(rows, label)
        result.paths[ds] = str(source) if isinstance(source, Path) else ""
        if mapping:
            _check_mapping_columns(mapping, rows, label)
        if isinstance(rows, pl.DataFrame):
            rows = frame_rows(rows, result.formats[ds], mapping)
        _convert(ds, rows, result.formats[ds], mapping, cols, result, skip_rows)
    result.frame = _frame(cols)
    result.skipped_rows = pl.DataFrame(
        skip_rows,
        schema={"dataset": pl.String, "row": pl.Int64, "reason": pl.String, "detail": pl.String},
    )
    return result


def source_hashes(frame: pl.DataFrame) -> dict[str, str]:
    """dataset -> 16-hex blake2b of its sorted prompt_ids (the sources part of a fingerprint)."""
    out = {}
    for (name,), part in frame.group_by("dataset", maintain_order=True):
        ids = sorted(part["prompt_id"].to_list())
        out[name] = hashlib.blake2b("\n".join(ids).encode(), digest_size=8).hexdigest()
    return out


def prompt_id(messages: list[dict]) -> str:
    """16-hex content hash of prompt messages (the module docstring says what is hashed).

    Example:
        >>> prompt_id([{"role": "user", "content": "Hi"}])
        'a8ae2d3c7604f939'
    """
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
            found = sorted(p for p in path.iterdir() if p.suffix.lower() in SUFFIXES)
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


def _check_mapping_columns(mapping: dict, rows: list, label: str) -> None:
    """A mapped column missing from every row is a typo, not a bad row: raise."""
    cols = columns(rows)
    missing = [c for c in mapping.values() if c not in cols]
    if missing and cols:
        raise ValueError(f"mapping columns {missing} not found in {label}; columns found {cols}")


# ---------------------------------------------------------------- prompts


def _prompt(turns: list) -> list[dict]:
    """Cut at the last user turn, check what is kept, return stripped messages."""
    last = next((i for i in range(len(turns) - 1, -1, -1) if turns[i][0] == "user"), -1)
    if last < 0:
        raise next((t[0] for t in turns if isinstance(t[0], Skip)), Skip("no_user_turn"))
    messages = []
    for i, (role, content) in enumerate(turns[: last + 1]):
        for part in (role, content):
            if isinstance(part, Skip):
                raise Skip(part.reason, f"turn {i}: {part.detail}")
        if not isinstance(content, str):
            raise Skip("non_string_content", f"turn {i} content is a {type(content).__name__}")
        if not content.strip():
            raise Skip("empty_content", f"turn {i} ({role}) is empty")
        messages.append({"role": role, "content": content.strip()})
    _check_order([m["role"] for m in messages])
    return messages


def _check_order(roles: list[str]) -> None:
    """One optional system turn first, then user/assistant alternating from user."""
    body = roles[1:] if roles[0] == "system" else roles
    expected = "user"
    for i, role in enumerate(body):
        if role != expected:
            raise Skip(
                "bad_order", f"{role} at turn {i + len(roles) - len(body)}, {expected} expected"
            )
        expected = "assistant" if role == "user" else "user"


def _convert(ds, rows, fmt, mapping, cols, result: LoadResult, skip_rows: list) -> None:
    """Append the prompts of one dataset to cols; count skips and duplicates in result."""
    seen: set[str] = set()
    skips: Counter = Counter()
    dups = n_rows = 0
    for i, row in enumerate(rows):
        if row is BLANK:
            continue
        n_rows += 1
        try:
            if isinstance(row, Skip):
                raise row
            if not isinstance(row, dict):
                raise Skip("not_object", f"row is a {type(row).__name__}")
            messages = _prompt(raw_turns(row, fmt, mapping))
        except Skip as skip:
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
