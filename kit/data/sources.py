"""Load prompt datasets into one polars prompt frame (kit.load): files, folders or rows.

The frame is written as it is read, CHUNK prompts at a time, to temporary Parquet parts the
LoadResult owns, so a million prompts load in the memory of a few thousand. A format is
detected from the row keys (kit.data.formats) or forced with format=/mapping=. A prompt is
the conversation up to its last user turn (a broken later answer costs no prompt), as
given unless strip=True, with its tools in a `tools` column (kit.data.tools) and the
dataset's own answer in `answer` (never sent, never hashed). prompt_id hashes turns and
tools, not dataset, file or row order: stable across re-loads. Bad rows and duplicates are
skipped and counted by reason (REASONS), unreadable sources reported in one error, text
columns read into no prompt nor answer named (LoadResult.unused); reload(LoadResult.specs)
loads the same prompts again.
"""

from __future__ import annotations

import hashlib
import html
import itertools
import json
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import polars as pl

from kit.data import parts
from kit.data.formats import (
    DETECT_ROWS,
    FORMATS,
    Nested,
    answer,
    columns,
    detect,
    frame_rows,
    prompt,
    raw_prompts,
    read_columns,
    transcript_column,
    user_runs,
)
from kit.data.inputs import check_format, check_mapping_columns, check_name, for_each, sources
from kit.data.readers import BLANK, read
from kit.data.tools import row_tools
from kit.errors import ConfigError, DataError, Skip, Undetectable

REASONS = (
    "bad_json",  # a JSONL line is not valid JSON (or not UTF-8)
    "too_deep",  # a row nested too deep for the JSON parser
    "not_object",  # a row is not a JSON object
    "bad_type",  # a turn list is not a list, or a turn is not an object
    "missing_field",  # the format's field (or a turn's role/content) is absent or null
    "bad_role",  # a turn's role is not system/user/assistant (or a known alias)
    "non_string_content",  # a prompt turn's content is not a string
    "empty_content",  # a prompt turn's content is empty or whitespace
    "no_user_turn",  # the conversation has no user turn
    "bad_order",  # roles out of order: assistant first, two in a row, system not first
    "conflicting_fields",  # two prompt fields hold a value where the format reads one
    "tool_turns",  # a tool call or tool result in the prompt's history (kit.data.tools)
    "bad_tools",  # tool definitions that are not JSON, not a list of tools, unnamed, or too deep
    "bad_unicode",  # text holding a lone surrogate ("\\ud800"): not valid Unicode, cannot be sent
)
MESSAGE_TYPE = pl.List(pl.Struct({"role": pl.String, "content": pl.String}))
SCHEMA = {
    "dataset": pl.String,
    "prompt_id": pl.String,
    "messages": MESSAGE_TYPE,
    "n_turns": pl.Int64,
    "row": pl.Int64,
    "answer": pl.String,  # the dataset's own answer to the prompt, or null (kit.data.formats)
}
TOOLS = "tools"  # the optional column: compact JSON array of OpenAI tools, or null
MAX_SKIP_ROWS = 1000  # skipped rows kept per dataset in LoadResult.skipped_rows (counts are exact)


@dataclass(slots=True, weakref_slot=True)
class LoadResult:
    """Prompts loaded from one or more datasets, with what was dropped and why.

    The prompts live in Parquet parts (at most CHUNK prompts each) in a temporary directory
    removed with this object: `frame` reads them all, `batches()` a part at a time and
    `scan()` lazily, for millions of prompts.
    """

    parts: list[Path] = field(default_factory=list)  # the prompt frame's parts, in order
    prompts: dict[str, int] = field(default_factory=dict)  # dataset -> prompts kept
    with_tools: dict[str, int] = field(default_factory=dict)  # dataset -> prompts with tools
    skipped: dict[str, dict[str, int]] = field(default_factory=dict)  # dataset -> reason -> rows
    duplicates: dict[str, int] = field(default_factory=dict)  # dataset -> rows dropped as repeats
    formats: dict[str, str | None] = field(default_factory=dict)  # dataset -> format or None
    paths: dict[str, str] = field(default_factory=dict)  # dataset -> source path ("" in memory)
    rows: dict[str, int] = field(default_factory=dict)  # dataset -> rows read
    skipped_rows: pl.DataFrame | None = None  # dataset, row, reason, detail (first MAX_SKIP_ROWS)
    ignored_files: list[dict] = field(default_factory=list)  # [{"path", "reason"}] not loaded
    specs: dict[str, dict] = field(default_factory=dict)  # dataset -> path, format, mapping, strip
    stripped: dict[str, int] = field(default_factory=dict)  # dataset -> prompts strip changed
    answers: dict[str, int] = field(default_factory=dict)  # dataset -> prompts with an answer
    unused: dict[str, list[str]] = field(default_factory=dict)  # dataset -> text columns unread
    notes: dict[str, list[str]] = field(default_factory=dict)  # dataset -> the rules it took
    spill: Path | None = None  # the temporary directory of `parts`, removed with this object

    @property
    def height(self) -> int:
        """Prompts kept, over every dataset."""
        return sum(self.prompts.values())

    @property
    def frame(self) -> pl.DataFrame:
        """The prompt frame (dataset, prompt_id, messages, n_turns, row, answer, and `tools`
        when some prompt has tool definitions), read whole from the parts: each call reads
        it again."""
        return self.scan().collect()

    def scan(self) -> pl.LazyFrame:
        """The prompt frame as a polars LazyFrame over the parts (nothing read until collected)."""
        if not self.parts:
            return pl.LazyFrame(schema=self._schema())
        return pl.scan_parquet(self.parts).select(list(self._schema()))

    def batches(self) -> Iterator[pl.DataFrame]:
        """The prompt frame a part (at most CHUNK prompts) at a time, in order."""
        for part in self.parts:
            yield pl.read_parquet(part).select(list(self._schema()))

    def _schema(self) -> dict:
        """The frame's columns: the tools column only when some prompt has tools."""
        return SCHEMA | ({TOOLS: pl.String} if any(self.with_tools.values()) else {})

    def summary(self) -> pl.DataFrame:
        """One row per dataset: format, rows read, prompts kept, with_tools, answers (prompts
        with the dataset's own answer), duplicates, (strip=True) stripped, skips by reason,
        the text columns read into no prompt (ignored directory entries: `ignored_files`)."""
        kept, tooled = self.prompts, self.with_tools
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
                    "with_tools": tooled.get(name, 0),
                    "answers": self.answers.get(name, 0),
                    "duplicates": self.duplicates.get(name, 0),
                    "skipped": sum(skips.values()),
                    "skip_reasons": reasons,
                    "unused": ", ".join(self.unused.get(name, [])),
                }
            )
        frame = pl.DataFrame(out, schema_overrides={"format": pl.String})
        if self.stripped:  # strip=True: the prompts it changed
            stripped = [self.stripped.get(name, 0) for name in self.formats]
            frame = frame.insert_column(7, pl.Series("stripped", stripped, dtype=pl.Int64))
        return frame

    def source_hashes(self) -> dict[str, str]:
        """dataset -> 16-hex hash of its sorted prompt_ids (RunConfig.source_hashes)."""
        return source_hashes(self.scan().select("dataset", "prompt_id").collect())

    def _headline(self) -> str:
        skipped = sum(sum(s.values()) for s in self.skipped.values())
        dups, n = sum(self.duplicates.values()), len(self.ignored_files)
        ignored = f", {n} file{'s' * (n != 1)} ignored" if n else ""
        return (
            f"LoadResult: {len(self.formats)} datasets, {self.height} prompts, "
            f"{skipped} skipped, {dups} duplicates{ignored}"
        )

    def _ignored_lines(self) -> list[str]:
        """The directory entries ignored, then each dataset's rules and unused text columns."""
        lines = [f"ignored {f['path']}: {f['reason']}" for f in self.ignored_files]
        lines += [f"{ds}: {note}" for ds, notes in self.notes.items() for note in notes]
        return lines + [
            f"{ds}: text columns in no prompt or answer (unused): {', '.join(cols)}"
            for ds, cols in self.unused.items()
            if cols
        ]

    def __repr__(self) -> str:
        with pl.Config(
            tbl_rows=50,
            tbl_cols=20,
            fmt_str_lengths=120,
            tbl_hide_dataframe_shape=True,
            tbl_width_chars=160,
            tbl_hide_column_data_types=True,
        ):  # whole words (no cell wrapped mid-word), no dtype row
            return "\n".join([self._headline(), *self._ignored_lines(), str(self.summary())])

    def _repr_html_(self) -> str:
        items = "".join(f"<li>{html.escape(line)}</li>" for line in self._ignored_lines())
        ignored = f"<ul>{items}</ul>" if items else ""
        return f"<p><b>{self._headline()}</b></p>{ignored}{self.summary()._repr_html_()}"


def load(paths_or_mapping, *, format=None, name=None, mapping=None, strip=False) -> LoadResult:
    """Load prompt datasets into one prompt frame.

    Args:
        paths_or_mapping: a path, a directory (its .jsonl/.ndjson/.json/.parquet files, the
            first three also as .gz or .zst, read streaming), a
            list of those, or {dataset_name: path or in-memory rows}
            (a list of dicts, a polars DataFrame, a Hugging Face `datasets.Dataset`).
        format: force one of FORMATS for every source, or {dataset: format} for some;
            None detects it per source.
        name: dataset name for a single source (default: the file stem, sanitized).
        mapping: {"prompt": column, "system": column (optional), "answer": column
            (optional: the dataset's own answer)}, {"messages": column}, {"turns": column}
            (a list of user turns) or {"transcript": column} (Human:/Assistant: text); any
            may add "tools": column (default: the `tools` column, if any). One for every
            source, or {dataset: mapping}.
        strip: str.strip() each message's content (off: content as the dataset has it);
            the prompts it changes are counted in LoadResult.stripped.

    Returns:
        LoadResult with `.frame` (dataset, prompt_id, messages, n_turns, row, answer, and
        `tools` when some prompt has tool definitions), `.skipped`, `.duplicates`,
        `.unused` (text columns read into no prompt or answer), `.notes`,
        `.ignored_files`, `.specs` and `.summary()`.

    Raises:
        ValueError (FileNotFoundError for a missing file) naming every source that cannot
        be read or whose format cannot be detected, all at once. Warns (UserWarning) when a
        dataset keeps 0 prompts.

    Example:
        >>> res = kit.load("data/samples/chat_general.jsonl")
        >>> res.frame.columns
        ['dataset', 'prompt_id', 'messages', 'n_turns', 'row', 'answer']
        >>> res.summary().select("dataset", "format", "prompts", "skipped").row(0)
        ('chat_general', 'openai', 80, 0)
    """
    pairs, ignored = sources(paths_or_mapping, name)
    how = for_each([ds for ds, _ in pairs], format, mapping)
    if not isinstance(strip, bool):
        raise ConfigError(f"strip must be True or False, got {strip!r}")
    return _load([(ds, source, *how[ds], strip) for ds, source in pairs], ignored)


def reload(specs: dict[str, dict]) -> LoadResult:
    """Load datasets again from their recorded specs (LoadResult.specs).

    Example:
        >>> res = kit.load("data/samples/alpaca_tasks.jsonl")
        >>> reload(res.specs).frame["prompt_id"].equals(res.frame["prompt_id"])
        True
    """
    if not specs:
        raise ConfigError("reload() got no dataset specs")
    if in_memory := [ds for ds, spec in specs.items() if not spec.get("path")]:
        raise ConfigError(
            f"datasets {in_memory} were loaded from memory: no file to load them from again; "
            "run from the prompts stored in the run directory (kit.generate(None, config, run_dir=...))"
        )
    items = [
        (
            check_name(ds),
            Path(s["path"]),
            check_format(s.get("format"), s.get("mapping")),
            s.get("mapping"),
            bool(s.get("strip")),
        )
        for ds, s in specs.items()
    ]
    return _load(items, [])


def _load(items: list[tuple], ignored: list[dict]) -> LoadResult:
    """Load [(dataset, source, format or None, mapping or None, strip)]; raise every
    failure at once."""
    cols: dict[str, list] = {key: [] for key in [*SCHEMA, TOOLS]}
    result = LoadResult(ignored_files=ignored)
    skip_rows: list[dict] = []
    failures: list[Exception] = []
    for ds, source, fmt, mapping, strip in items:
        try:
            rows, fmt, mapping, columnar, check = _read_source(ds, source, fmt, mapping)
        except (ValueError, OSError) as exc:
            failures.append(exc)
            continue
        result.formats[ds] = fmt
        result.paths[ds] = str(source) if isinstance(source, Path) else ""
        result.specs[ds] = {"path": result.paths[ds], "format": fmt, "mapping": mapping}
        if strip:
            result.specs[ds]["strip"] = True
        try:
            _convert(ds, rows, (fmt, mapping, strip), columnar, cols, result, skip_rows)
            result.unused[ds], notes = check()
            result.notes[ds] = notes + result.notes.get(ds, [])
        except (ValueError, OSError) as exc:  # a file that goes bad past its first block
            failures.append(exc)
    _raise_failures(failures)
    if cols["dataset"]:
        _spill(cols, result)
    result.skipped_rows = pl.DataFrame(
        skip_rows,
        schema={"dataset": pl.String, "row": pl.Int64, "reason": pl.String, "detail": pl.String},
    )
    _warn_empty(result)
    return result


def _read_source(ds: str, source, fmt: str | None, mapping: dict | None) -> tuple:
    """(rows, format, mapping, columnar, check) of one source: rows an iterator (a block
    read at a time), check() to call once they are read (a mapped tools column must be in
    some row), which returns the text columns no prompt or answer read. Raises
    ValueError/OSError when it cannot be used at all. columnar: nested values came from
    typed columns (kit.data.tools.drop_nulls). A transcript source's mapping names its
    column."""
    label = str(source) if isinstance(source, Path) else f"in-memory dataset {ds!r}"
    blocks = read(source)
    head = next(blocks, [])
    while isinstance(head, list) and sum(isinstance(r, dict) for r in head) < DETECT_ROWS:
        more = next(blocks, None)  # detection reads the first DETECT_ROWS object rows
        if more is None:
            break
        head += more
    columnar = isinstance(head, pl.DataFrame) or hasattr(source, "columns")  # pandas too
    columnar = columnar or hasattr(source, "column_names")  # datasets.Dataset
    fmt = fmt or detect(head, label)
    if fmt == "transcript" and not mapping:
        if (col := transcript_column(head)) is None:
            raise DataError(f"{label}: no column of 'Human:' / 'Assistant:' transcripts found")
        mapping = {"transcript": col}
    used = set(read_columns(fmt, mapping)) if fmt else set()
    unused: dict[str, None] = {}  # text columns no prompt or answer reads, in order found
    following = next(blocks, None)  # None: the head is every row
    key = (mapping or {}).get("tools")
    # a JSONL file's rows past its head: the mapped tools column is looked for as they stream
    seen = [key is None or isinstance(head, pl.DataFrame) or following is None]
    if mapping:
        check_mapping_columns(
            {k: v for k, v in mapping.items() if k != "tools" or seen[0]}, head, label
        )

    def rows():
        rest = () if following is None else itertools.chain([following], blocks)
        for block in itertools.chain([head], rest):
            if isinstance(block, pl.DataFrame):
                unused.update(dict.fromkeys(_text_columns(block, used | set(unused))))
                block = frame_rows(block, fmt, mapping)
            else:
                seen[0] = seen[0] or any(isinstance(r, dict) and key in r for r in block)
                for row in block:
                    if isinstance(row, dict):
                        unused.update(
                            (k, None)
                            for k, v in row.items()
                            if type(v) is str and k not in used and k not in unused and v.strip()
                        )
            yield from block

    def check() -> tuple[list[str], list[str]]:
        if not seen[0] and (found := columns(head)):
            raise DataError(
                f"mapping columns [{key!r}] not found in {label}; columns found {found}"
            )
        return list(unused), _notes(fmt, mapping, columns(head))

    return rows(), fmt, mapping, columnar, check


def _text_columns(frame: pl.DataFrame, skip: set) -> list[str]:
    """The frame's string columns outside `skip` holding some non-blank text."""
    strings = [c for c, t in frame.schema.items() if t == pl.String and c not in skip]
    if not strings or frame.height == 0:
        return []
    held = frame.select(pl.col(strings).str.strip_chars().str.len_bytes().max() > 0).row(0)
    return [c for c, h in zip(strings, held, strict=True) if h]


def _notes(fmt: str | None, mapping: dict | None, cols: list[str]) -> list[str]:
    """The rules a source's prompts and answers are read by that its columns do not say."""
    if fmt == "alpaca" and "context" in cols:
        return [
            "prompt = instruction + blank line + context (dolly's layout; a blank context: the instruction alone)"
        ]
    if fmt == "transcript" or "transcript" in (mapping or {}):
        return [
            f"transcript column {mapping['transcript']!r}: prompt = the turns before its last "
            "Assistant turn; answer = that turn (never in the prompt)"
        ]
    return []


def _raise_failures(failures: list[Exception]) -> None:
    """One failure: raise it as it is; several: one ValueError listing each on its line."""
    if len(failures) == 1:
        raise failures[0]
    if failures:
        lines = [
            f"{e.label}: format not detected, columns found {e.columns}"
            if isinstance(e, Undetectable)
            else str(e)
            for e in failures
        ]
        raise DataError(
            f"cannot load {len(failures)} files or datasets:\n  "
            + "\n  ".join(lines)
            + f"\nfix or move them, or load each on its own with format= (one of {FORMATS}) "
            "or mapping={'prompt': <column>}"
        )


def _warn_empty(result: LoadResult) -> None:
    """Warn, naming each file and why, when a dataset kept no prompt at all."""
    empty = [ds for ds in result.formats if not result.prompts.get(ds)]
    if not empty:
        return
    parts = []
    for ds in empty:
        skips = ", ".join(f"{r}: {n}" for r, n in result.skipped.get(ds, {}).items())
        where = result.paths[ds] or f"in-memory dataset {ds!r}"
        parts.append(f"{where}: {result.rows[ds]} rows" + (f", skipped {skips}" if skips else ""))
    scope = "" if len(empty) == len(result.formats) else f" in {len(empty)} datasets"
    warnings.warn(
        f"kit.load kept 0 prompts{scope}: "
        + "; ".join(parts)
        + " (LoadResult.skipped_rows has each row; pass format= or mapping= if misread)",
        UserWarning,
        stacklevel=4,
    )


def source_hashes(frame: pl.DataFrame) -> dict[str, str]:
    """dataset -> 16-hex blake2b of its sorted prompt_ids (the sources part of a fingerprint)."""
    out = {}
    for (name,), part in frame.group_by("dataset", maintain_order=True):
        ids = part["prompt_id"].sort().str.join("\n").item()  # polars' order == sorted()'s
        out[name] = hashlib.blake2b((ids or "").encode(), digest_size=8).hexdigest()
    return out


def prompt_id(messages: list[dict], tools: str | None = None) -> str:
    """16-hex content hash of prompt messages and their tools column string (the module
    docstring says what is hashed); without tools it is the hash of the messages alone.

    Example:
        >>> prompt_id([{"role": "user", "content": "Hi"}])
        'a8ae2d3c7604f939'
        >>> prompt_id([{"role": "user", "content": "Hi"}], '[{"type":"function","function":{"name":"f"}}]')
        '82ba325c2353846a'
    """
    pairs = [[m["role"], m["content"]] for m in messages]
    try:  # orjson writes json.dumps(ensure_ascii=False, compact)'s bytes (every code point tested)
        payload = orjson.dumps(pairs)
    except orjson.JSONEncodeError:  # a lone surrogate: json names it (UnicodeEncodeError)
        payload = json.dumps(pairs, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    if tools is not None:
        payload = b'{"messages":' + payload + b',"tools":' + tools.encode("utf-8") + b"}"
    return hashlib.blake2b(payload, digest_size=8).hexdigest()


CHUNK = 20_000  # prompts held as Python objects at most, then written as a part


def _spill(cols: dict[str, list], result: LoadResult) -> None:
    """Write what cols hold as the next Parquet part of result (cols are emptied; messages go
    through pyarrow, much faster than polars). The first part makes result's directory."""
    import pyarrow as pa

    struct = pa.struct([("role", pa.string()), ("content", pa.string())])
    messages = pl.from_arrow(pa.array(cols["messages"], type=pa.list_(struct)))
    schema = SCHEMA | {TOOLS: pl.String}
    frame = pl.DataFrame({k: cols[k] for k in schema if k != "messages"}, schema_overrides=schema)
    for values in cols.values():
        values.clear()
    frame = frame.insert_column(2, messages.alias("messages")).cast(schema)
    if result.spill is None:
        result.spill = parts.new_dir(result)
    path = parts.part_path(result.spill, len(result.parts))
    frame.write_parquet(path, compression="lz4", statistics=False)
    result.parts.append(path)


# ---------------------------------------------------------------- prompts


def _row_prompts(row, fmt: str | None, mapping: dict | None) -> list:
    """A row's raw prompts (turn lists, or a Skip per broken one), or [Skip] for a broken row."""
    try:
        if isinstance(row, Skip):
            raise row
        if not isinstance(row, dict):
            raise Skip("not_object", f"row is a {type(row).__name__}")
        if fmt is None:
            raise Skip("missing_field", "no field holds a value")
        return raw_prompts(row, fmt, mapping)
    except Skip as skip:
        return [skip]


def _skip(skip: Skip, ds: str, row: int, skips: Counter, skip_rows: list) -> None:
    """Count a skip; keep its row (the first MAX_SKIP_ROWS of a dataset)."""
    skips[skip.reason] += 1
    if skips.total() <= MAX_SKIP_ROWS:
        skip_rows.append({"dataset": ds, "row": row, "reason": skip.reason, "detail": skip.detail})


def _convert(ds, rows, how, columnar, cols, result: LoadResult, skip_rows) -> None:
    """Append the prompts of one dataset to cols (written as a part of result every CHUNK
    prompts); count prompts, skips, duplicates and (strip on) stripped prompts in result.
    how: (format, mapping, strip). A row's tools are read once its prompt is valid: a
    prompt problem is named first."""
    fmt, mapping, strip = how
    runs = user_runs(fmt, mapping)
    seen: set[str] = set()
    skips: Counter = Counter()
    dups = n_rows = stripped = kept = tooled = answered = nested = rest = 0
    for i, row in enumerate(rows):
        if row is BLANK:
            continue
        n_rows += 1
        for turns in _row_prompts(row, fmt, mapping):
            if isinstance(turns, Nested):
                nested, rest = nested + 1, rest + turns.rest
            try:
                if isinstance(turns, Skip):
                    raise turns
                messages = prompt(turns, strip=strip, user_runs=runs)
                tools = row_tools(row, mapping, columnar)
                if strip:
                    stripped += messages != prompt(turns, user_runs=runs)
            except Skip as skip:
                _skip(skip, ds, i, skips, skip_rows)
                continue
            try:
                pid = prompt_id(messages, tools)
            except UnicodeEncodeError as exc:  # a lone surrogate: every later step would fail
                where = result.paths.get(ds) or f"in-memory dataset {ds!r}"
                at = f"line {i + 1}" if where.endswith((".jsonl", ".ndjson")) else f"row {i}"
                bad = exc.object[exc.start : exc.end].encode("unicode_escape").decode()
                why = f"{where} {at}: a lone surrogate {bad} (not valid Unicode)"
                _skip(Skip("bad_unicode", why), ds, i, skips, skip_rows)
                continue
            if pid in seen:
                dups += 1
                continue
            seen.add(pid)
            kept += 1
            tooled += tools is not None
            own = answer(turns)
            answered += own is not None
            n_user = sum(m["role"] == "user" for m in messages)
            for key, value in zip(SCHEMA, (ds, pid, messages, n_user, i, own), strict=True):
                cols[key].append(value)
            cols[TOOLS].append(tools)
            if len(cols["dataset"]) >= CHUNK:
                _spill(cols, result)
    result.prompts[ds], result.with_tools[ds] = kept, tooled
    result.skipped[ds] = {r: skips[r] for r in REASONS if skips[r]}
    result.duplicates[ds] = dups
    result.rows[ds] = n_rows
    result.answers[ds] = answered
    if nested:
        result.notes[ds] = [
            f"{nested} rows hold a list of message lists: the first list is the conversation; "
            f"{rest} later lists not read"
        ]
    if strip:
        result.stripped[ds] = stripped
