"""The run's prompts, stored once per run (prompts.parquet) and looked up by (dataset, prompt_id).

Record lines written since kit 0.13 hold no `messages` and no `tools`: PromptStore gives
them back to every reader (kit.run.batches) without holding the prompts' text in memory,
and PromptColumns joins them onto a whole batch of records at once. A record written by
RunConfig.turns "all_turns" gets its prompt with the target's own earlier answers
(Record.turns) in place of the dataset's assistant turns, as the runner sent it (_as_sent).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from array import array
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson

from kit.run.lines import PROMPT_FIELDS, corrupt_entries, record_schema


class PromptStore:
    """The run's prompts, looked up by (dataset, prompt_id) without holding their text:
    copied once from prompts.parquet (a row group at a time) into a temporary file kit
    removes when done, one entry per prompt rendered by polars (_entry): its key, its
    messages as the SpecForge conversation's first part (kit.report.convo.specforge_lines
    writes it as it is), its tools as SpecForge writes them, and whether it holds an
    assistant turn. Memory keeps 24 bytes per prompt (a sorted array of key hashes and where
    each entry lies), so a million prompts cost ~24 MB, not their text. A lookup reads each
    entry with pread (no mapping of the file: its pages never count as the process's memory)
    and polars splits (and, for messages, decodes) them all at once. Prompts whose text is
    small (IN_MEMORY_BYTES) stay in memory instead: no file to write and read back. Every
    entry found has its key checked: a hash shared by two keys costs a second look, never a
    wrong prompt. A key held twice gives its first copy.

    Example:
        with PromptStore(run_dir) as prompts:
            prompts.get("alpaca", "9f2c...")  # -> (messages, tools) or None
    """

    def __init__(self, run_dir: Path | None, lazy: bool = False) -> None:
        self.run_dir, self.lazy = run_dir, lazy  # lazy: copied at the first lookup
        self._built = False
        self._hashes = self._starts = self._sizes = self._tmp = self._fd = self._entries = None
        self._lock, self._error = threading.Lock(), None

    def __enter__(self) -> PromptStore:
        return self if self.lazy else self.open()

    def open(self) -> PromptStore:
        """Copy the prompts now (once; other threads wait); raises what the copy raised."""
        with self._lock:
            if self._error is not None:
                raise self._error
            if not self._built:
                try:
                    self._open()
                except Exception as e:
                    self._error = e
                    raise
        return self

    def prepare(self) -> None:
        """open() for a background thread: a failure is kept for the next open() to raise."""
        try:
            self.open()
        except Exception:  # noqa: S110 - raised again by open()
            pass

    def _open(self) -> None:
        import numpy as np
        import polars as pl
        import pyarrow.parquet as pq

        self._built = True
        path = None if self.run_dir is None else Path(self.run_dir) / "prompts.parquet"
        if path is None or not path.exists():
            return
        f = pq.ParquetFile(path)
        names = f.schema_arrow.names
        cols = ["dataset", "prompt_id", "messages"] + (["tools"] if "tools" in names else [])
        in_memory = _text_bytes(f) <= IN_MEMORY_BYTES
        if not in_memory:
            self._tmp = tempfile.TemporaryDirectory(prefix="kit-prompts-")
        blob = None if in_memory else Path(self._tmp.name) / "prompts.bin"
        hashes, sizes, kept = [], array("q"), []

        sizes_of = [f.metadata.row_group(g).num_rows for g in range(f.num_row_groups)]
        firsts = [sum(sizes_of[:g]) for g in range(f.num_row_groups)]

        def entries(group: int):  # decoded by polars (pyarrow's row group reads: ~7x slower)
            part = pl.scan_parquet(path).select(cols).slice(firsts[group], sizes_of[group])
            table = part.collect()  # one row group's rows: polars reads only that group
            text = _entries(table, tools="tools" in names)
            arr = text.to_arrow(compat_level=pl.CompatLevel.oldest())  # one data buffer
            return _hashes(table), arr

        writing = contextlib.nullcontext() if in_memory else open(blob, "wb")  # noqa: SIM115
        with writing as out, ThreadPoolExecutor(2, thread_name_prefix="kit-prompts") as pool:
            ahead = [pool.submit(entries, g) for g in range(min(2, f.num_row_groups))]
            for group in range(f.num_row_groups):  # in order; two row groups in flight
                h, arr = ahead.pop(0).result()
                if group + 2 < f.num_row_groups:
                    ahead.append(pool.submit(entries, group + 2))
                hashes.append(h)
                if in_memory:
                    kept.append(pl.from_arrow(arr))
                    continue
                offsets = np.frombuffer(arr.buffers()[1], dtype=np.int64)[arr.offset : arr.offset + len(arr) + 1]  # fmt: skip
                data = arr.buffers()[2].slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
                out.write(data.to_pybytes())  # bytes: write(2) from an Arrow buffer is ~10x slower
                sizes.frombytes(np.diff(offsets).astype(np.int64).tobytes())
        h = np.concatenate(hashes) if hashes else np.zeros(0, dtype=np.uint64)
        if not len(h):
            return
        order = np.argsort(h, kind="stable")  # equal hashes keep file order: first copy first
        self._hashes = h[order]
        if in_memory:  # _starts: each entry's row in _entries
            self._entries, self._starts = pl.concat(kept).rechunk(), order
            return
        size = np.frombuffer(sizes, dtype=np.int64)
        self._sizes = size[order]
        self._starts = (np.cumsum(size) - size)[order]
        self._fd = os.open(blob, os.O_RDONLY)

    def _read(self, at, decode: bool = True) -> object:
        """The entries at these places of the sorted arrays: `_key` (JSON [dataset,
        prompt_id]), then with decode messages ({role, content}) and tools (JSON text or
        null), else `_frag` (the messages as SpecForge text), `_tools_sf` (the tools so,
        null for none) and `_held` (the prompt holds an assistant turn)."""
        import polars as pl

        if self._entries is not None:
            text = self._entries.gather(self._starts[at])
        else:
            fd, read = self._fd, os.pread
            raw = [read(fd, n, start) for start, n in zip(self._starts[at].tolist(), self._sizes[at].tolist(), strict=True)]  # fmt: skip
            text = pl.Series(raw, dtype=pl.Binary).cast(pl.String)
        e = text.str.split_exact(_SEP, 3).struct
        out = {"_key": e.field("field_0")}
        tools = e.field("field_2").replace("", None)
        if decode:
            msg = record_schema()["messages"]
            out |= {"messages": ("[" + e.field("field_1") + "]").str.json_decode(msg), "tools": tools}  # fmt: skip
        else:
            out |= {"_frag": e.field("field_1"), "_tools_sf": tools, "_held": e.field("field_3") == "1"}  # fmt: skip
        return pl.DataFrame(out)

    def frame(self, keys, fragments: bool = False):
        """The prompts of these keys (a frame with dataset and prompt_id, or a list of
        (dataset, prompt_id)) as a polars frame in their order: messages ({role, content}),
        tools (JSON text, null for none), and `found` (False where the run has no such
        prompt). fragments=True gives `_frag`, `_tools_sf` and `_held` in place of messages
        and tools (see _read)."""
        import numpy as np
        import polars as pl

        if not self._built:
            self.open()
        if isinstance(keys, list):
            keys = pl.DataFrame(keys, schema={"dataset": pl.String, "prompt_id": pl.String}, orient="row")  # fmt: skip
        if self._hashes is None or not keys.height:
            return None
        hs = _hashes(keys)
        at = np.minimum(self._hashes.searchsorted(hs), len(self._hashes) - 1)
        taken = self._read(at, not fragments)
        want = keys.select(_key_text()).to_series()
        found = (taken["_key"] == want).fill_null(False).to_numpy().copy()
        for i in np.flatnonzero(~found & (self._hashes[at] == hs)).tolist():
            j = int(at[i]) + 1  # a hash shared with another key: look at the next ones
            while j < len(self._hashes) and self._hashes[j] == hs[i]:
                row = self._read([j], not fragments)
                if row["_key"][0] == want[i]:
                    taken = pl.concat([taken[:i], row, taken[i + 1 :]])
                    found[i] = True
                    break
                j += 1
        return taken.drop("_key").with_columns(found=pl.Series(found, dtype=pl.Boolean))

    def lookup(self, keys: list[tuple]) -> list:
        """Per key (messages, tools) as Python objects, or None when the run has no such
        prompt; tools are None when the prompt has none ("[]" is none)."""
        frame = self.frame(keys)
        if frame is None:
            return [None] * len(keys)
        out = []
        for ok, messages, tools in frame.select("found", "messages", "tools").iter_rows():
            out.append((messages, _tools(tools)) if ok else None)
        return out

    def get(self, dataset: str, prompt_id: str):
        """(messages, tools) of the prompt, or None when the run has no such prompt."""
        return self.lookup([(dataset, prompt_id)])[0]

    def __exit__(self, *exc) -> None:
        self._entries = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


IN_MEMORY_BYTES = 512 << 20  # prompts' text up to this stays in memory: no temporary file


def _text_bytes(f) -> int:
    """About how many bytes the store's entries of a prompts.parquet file take: its messages
    and tools uncompressed, plus a fifth for the JSON around them."""
    meta = f.metadata
    total = sum(
        rg.column(i).total_uncompressed_size
        for rg in (meta.row_group(g) for g in range(meta.num_row_groups))
        for i in range(rg.num_columns)
        if rg.column(i).path_in_schema.split(".")[0] in ("messages", "tools")
    )
    return int(total * 1.2)


def _tools(text: str | None) -> list | None:
    """A prompt's tools text as stored -> its tool definitions, None for none ("[]" is none)."""
    return (orjson.loads(text) if text else None) or None


_SEP = "\x00"  # between an entry's parts: JSON text holds no raw NUL (it is escaped)


def json_text(expr):
    """A polars string expression as JSON text, exactly json.dumps(value, ensure_ascii=False)
    (null -> "null"): polars' JSON writer escapes strings as Python's json does."""
    import polars as pl

    return pl.struct(expr.alias("v")).struct.json_encode().str.strip_prefix('{"v":').str.strip_suffix("}")  # fmt: skip


def messages_text(column: str = "messages"):
    """A messages column as the SpecForge conversation's first part: each {role, content}
    as json.dumps writes it, joined by ", " ("" for none)."""
    import polars as pl

    e = pl.element().struct
    message = pl.concat_str(
        pl.lit('{"role": '), json_text(e.field("role")), pl.lit(', "content": '),
        json_text(e.field("content")), pl.lit("}"),
    )  # fmt: skip
    return pl.col(column).list.eval(message).list.join(", ").fill_null("")


def _key_text():
    """JSON [dataset, prompt_id]: an entry's key as the store holds it."""
    import polars as pl

    return pl.concat_str(pl.lit("["), json_text(pl.col("dataset")), pl.lit(","), json_text(pl.col("prompt_id")), pl.lit("]"))  # fmt: skip


def _hashes(frame):
    """A 64-bit hash of each (dataset, prompt_id) of the frame, as a numpy array (polars'
    hash: the same for the same key within one process, which is all the store needs)."""
    import polars as pl

    return frame.select(pl.struct("dataset", "prompt_id").hash(seed=0)).to_series().to_numpy()


def _entries(table, tools: bool):
    """The store's entry of each prompt (a row group of prompts.parquet): JSON [dataset,
    prompt_id], the messages as SpecForge text (messages_text), the tools as SpecForge
    writes them (json.dumps(tools, ensure_ascii=False); "" for none, "[]" is none), and "1"
    when the prompt holds an assistant turn, joined by NUL."""
    import json

    import polars as pl

    held = pl.col("messages").list.eval(pl.element().struct.field("role") == "assistant").list.any()  # fmt: skip
    if tools:  # free-form JSON: Python renders it, once per distinct text (prompts share tools)
        seen: dict = {None: ""}

        def sf_text(x) -> str:
            if x not in seen:
                seen[x] = json.dumps(t, ensure_ascii=False) if (t := _tools(x)) else ""
            return seen[x]

        sf = pl.Series([sf_text(x) for x in table["tools"]], dtype=pl.String)
    else:
        sf = pl.lit("")
    return table.select(pl.concat_str(
        _key_text(), pl.lit(_SEP), messages_text(), pl.lit(_SEP), sf, pl.lit(_SEP),
        pl.when(held.fill_null(False)).then(pl.lit("1")).otherwise(pl.lit("0")),
    ).alias("entry")).to_series()  # fmt: skip


def with_prompts(chunk: list[tuple], prompts: PromptStore, problems: list) -> list[tuple]:
    """Fill each row's messages and tools from the prompt store (lines that hold their own
    keep them); rows whose prompt is nowhere are skipped and reported."""
    need = [(row["dataset"], row["prompt_id"]) for _, _, row in chunk if "messages" not in row]
    found = iter(prompts.lookup(need))
    out = []
    for path, n, row in chunk:
        if "messages" not in row:
            got = next(found)
            if got is None:
                problems += corrupt_entries(path, [(n, "prompt_id not in prompts.parquet")])
                continue
            row["messages"] = _as_sent(got[0], row.get("turns"))
            if "tools" not in row:
                row["tools"] = got[1]
        out.append((path, n, row))
    return out


class PromptColumns:
    """record_batches' messages and tools for lines that do not hold their own: gathered
    from the prompt store for a whole frame at once, the same values PromptStore.lookup
    gives (messages as {role, content}; tools as compact JSON or null). With
    fragments=True, the store's SpecForge text instead (`_frag`, `_tools_sf`, `_held`:
    PromptStore.frame), for kit.run.batches.read_spans."""

    FRAGMENTS = ("_frag", "_tools_sf", "_held")

    def __init__(self, store: PromptStore, columns: list[str], fragments: bool = False) -> None:
        self.store, self.fragments = store, fragments
        self.columns = list(self.FRAGMENTS) if fragments else columns

    @staticmethod
    def can_join(chunk: list[tuple]) -> bool:
        """Rows that hold their own prompt or earlier turns (kit < 0.13, all_turns) take
        the row-by-row path (with_prompts, _as_sent)."""
        return not any("messages" in r or "tools" in r or r.get("turns") for _, _, r in chunk)

    def join(self, frame, problems: list):
        """The frame with the prompt columns asked for; rows whose prompt the run lacks are
        reported (by their _file, _line) and left out."""
        import polars as pl

        got = self.store.frame(frame.select("dataset", "prompt_id"), fragments=self.fragments)
        found = got["found"] if got is not None else pl.Series([False] * frame.height)
        for stem, n in frame.filter(~found).select("_file", "_line").iter_rows():
            problems += corrupt_entries(Path("records") / f"{stem}.jsonl", [(n, "prompt_id not in prompts.parquet")])  # fmt: skip
        if got is None:
            return frame.clear()
        frame, got = frame.filter(found), got.filter(found)
        if self.fragments:
            return frame.with_columns(got.select(self.columns))
        out = {}
        if "messages" in self.columns:  # decoded as {role, content} already (PromptStore._read)
            out["messages"] = got["messages"]
        if "tools" in self.columns:
            tools = [_tools(t) for t in got["tools"]]
            out["tools"] = pl.Series([orjson.dumps(t).decode() if t is not None else None for t in tools], dtype=pl.String)  # fmt: skip
        return frame.with_columns(**out)


def _as_sent(messages: list[dict], turns) -> list[dict]:
    """The prompt as the runner sent its last request: with all_turns (Record.turns), each
    assistant message holds the target's own earlier answer, in order, and a user turn
    right after another gets the target's answer before it (kit.run.turns)."""
    if not turns and all(len(m) == 2 for m in messages):
        return messages  # {role, content} as the prompt frame holds them
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if not turns:
        return messages
    answers, out = iter(turns), []
    for m in messages:
        missing = m["role"] == "user" and out and out[-1]["role"] == "user"
        if m["role"] == "assistant" or missing:
            turn = next(answers, None)
            if turn is not None:
                out.append({"role": "assistant", "content": turn.get("content") or ""})
            elif m["role"] == "assistant":
                out.append(m)
        if m["role"] != "assistant":
            out.append(m)
    return out


def with_earlier_prompts(run_dir: Path, frame):
    """The prompt frame to store: this start's, plus the prompts an earlier start stored
    that it lacks (a forced resume over other prompts): record lines name their prompt by
    (dataset, prompt_id) and hold no copy of it, so no stored prompt is ever dropped."""
    import polars as pl

    path = run_dir / "prompts.parquet"
    if not path.exists():
        return frame
    keys = ["dataset", "prompt_id"]
    old = pl.scan_parquet(path).join(frame.lazy().select(keys), on=keys, how="anti").collect()
    return pl.concat([frame, old], how="diagonal_relaxed") if old.height else frame


def prompt_keys(run_dir: Path) -> set:
    """(dataset, prompt_id) of every prompt in run_dir/prompts.parquet (empty without one)."""
    import polars as pl

    path = run_dir / "prompts.parquet"
    if not path.exists():
        return set()
    frame = pl.read_parquet(path, columns=["dataset", "prompt_id"])
    return set(frame.iter_rows())


def light_prompts(run_dir: Path):
    """run_dir/prompts.parquet without its text columns (messages, tools): a resume needs
    the keys of every prompt, the text of those with work left only (prompt_text)."""
    import polars as pl

    path = Path(run_dir) / "prompts.parquet"
    names = pl.read_parquet_schema(path)
    return pl.read_parquet(path, columns=[c for c in names if c not in PROMPT_FIELDS])


def prompt_text(frame, run_dir: Path, dataset: str, ids=None):
    """`frame`'s rows of `dataset` (only those of prompt ids `ids`, when given) with their
    messages and tools: from the frame when it holds them, else read from
    run_dir/prompts.parquet for that dataset and those ids only (its row groups one at a
    time), joined in the frame's row order."""
    import polars as pl

    part = frame.filter(pl.col("dataset") == dataset)
    if ids is not None:
        part = part.filter(pl.col("prompt_id").is_in(pl.Series(list(ids), dtype=pl.String).implode()))  # fmt: skip
    if "messages" in frame.columns:
        return part
    path = Path(run_dir) / "prompts.parquet"
    names = pl.read_parquet_schema(path)
    cols = ["prompt_id", *[c for c in PROMPT_FIELDS if c in names]]
    wanted = part["prompt_id"].unique().implode()
    text = (
        pl.scan_parquet(path)
        .filter((pl.col("dataset") == dataset) & pl.col("prompt_id").is_in(wanted))
        .select(cols)
        .collect()
    )
    rows = part.with_row_index("_row")  # a key held twice: the frame's copies pair in order
    rank = pl.int_range(pl.len()).over("prompt_id")
    rows = rows.with_columns(_k=rank)
    text = text.with_columns(_k=rank)
    out = rows.join(text, on=["prompt_id", "_k"], how="left").sort("_row")
    return out.drop("_row", "_k")
