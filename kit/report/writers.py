"""The files of an export, written a batch at a time (kit.report.export streams records).

    sink = JsonlSink(out_dir, "specforge/train.jsonl")
    sink.write(rows)            # any number of times; each row one JSON line
    sink.close(files)           # adds the file and its line-hash file to the manifest's files

JSONL lines are json.dumps(row, ensure_ascii=False), as every kit export wrote them; the
line-hash file beside each (linehashes/<file>.txt) holds the first 16 hex digits of each
line's sha256, so kit.validate names an edited line. A JSONL file goes to disk as it is
written (WriteBehind: every SYNC_EVERY bytes are synced and dropped from the page cache), so
a million-record export does not wait on a page cache filling with gigabytes. Parquet is written in parts, one per
batch, then joined into one file by polars' streaming sink; HF datasets are built from that
Parquet file (the one format that holds a whole split in memory: `datasets` builds it so).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
from pathlib import Path

from kit.report.convo import conversation, parsed, row_id, tools_of, with_tool_calls
from kit.report.validate import file_entry

SYNC_EVERY = 64 << 20  # bytes of a JSONL file written before they are synced and dropped


class WriteBehind:
    """A large output file sent to disk as it is written: every SYNC_EVERY bytes are synced
    (fdatasync) and their pages dropped from the page cache (posix_fadvise DONTNEED, where
    the system has it). Filling the page cache with fresh pages is what a multi-GB write
    waits on here (bench/bench_scale.py, the write floor: 4 GB written plainly took 16-27 s
    on this machine, written so 2.4 s); written pages are dropped only once on disk, so
    nothing is lost, and a reader later reads them from disk. close() syncs the rest: the
    file is durable before the export's manifest.json is written.

    Example:
        with open(path, "wb") as f:
            behind = WriteBehind(f)
            for data in pieces:
                f.write(data)
                behind.wrote(len(data))
            behind.sync()
    """

    def __init__(self, f, every: int | None = None) -> None:
        self.f, self.every = f, SYNC_EVERY if every is None else every
        self.synced = self.written = 0  # bytes of the file on disk (and dropped); written

    def wrote(self, n: int) -> None:
        self.written += n
        if self.written - self.synced >= self.every:
            self.sync()

    def sync(self) -> None:
        """Everything written so far to disk, and out of the page cache."""
        self.f.flush()
        fd = self.f.fileno()
        getattr(os, "fdatasync", os.fsync)(fd)
        if hasattr(os, "posix_fadvise") and self.written > self.synced:
            os.posix_fadvise(fd, self.synced, self.written - self.synced, os.POSIX_FADV_DONTNEED)
        self.synced = self.written


class JsonlSink:
    """One JSONL file of an export and its line-hash file, appended a batch at a time."""

    def __init__(self, out_dir: Path, rel: str) -> None:
        self.out_dir, self.rel, self.rows = out_dir, rel, 0
        path = out_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        hashes = out_dir / "linehashes" / f"{rel}.txt"
        hashes.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._h = open(hashes, "w", encoding="utf-8", newline="")  # noqa: SIM115 - closed in close()
        self._behind = WriteBehind(self._f)
        self._sha, self._h_sha = hashlib.sha256(), hashlib.sha256()  # the files', as written

    def write(self, rows: list[dict]) -> None:
        self.write_lines([json.dumps(r, ensure_ascii=False) for r in rows])

    def write_lines(self, lines: list[str]) -> None:
        """Rows already rendered as JSON text."""
        encoded = [x.encode() + b"\n" for x in lines]
        self.write_rendered(b"".join(encoded), [0, *itertools.accumulate(map(len, encoded))])

    def write_rendered(self, data, offsets) -> None:
        """Lines already rendered and encoded, each ending in a newline (kit.report.convo.
        rendered); line i is data[offsets[i]:offsets[i + 1]]. Written as they are."""
        self.put(*self.hashed(data, offsets))

    @staticmethod
    def hashed(data, offsets) -> tuple:
        """write_rendered's work before the files: (data, its line hashes as text, lines)."""
        view = memoryview(data)
        sha = hashlib.sha256
        hashes = [sha(view[a : b - 1]).hexdigest()[:16] + "\n" for a, b in itertools.pairwise(offsets)]  # fmt: skip
        return data, "".join(hashes), len(hashes)

    def put(self, data, hashes: str, rows: int) -> None:
        """write_rendered's writes: the lines and their hashes (from hashed())."""
        self._f.write(data)
        self._sha.update(data)
        self._behind.wrote(len(data))
        self._h.write(hashes)
        self._h_sha.update(hashes.encode())
        self.rows += rows

    def close(self, files: dict) -> None:
        self._behind.sync()  # the file is on disk before the manifest names it
        self._f.close()
        self._h.flush()
        os.fsync(self._h.fileno())
        self._h.close()
        lh = f"linehashes/{self.rel}.txt"
        files[self.rel] = file_entry(self.out_dir / self.rel, self.rows, line_hashes=lh, sha256=self._sha.hexdigest())  # fmt: skip
        files[lh] = file_entry(self.out_dir / lh, self.rows, sha256=self._h_sha.hexdigest())


class ParquetSink:
    """One Parquet file of an export, written as parts (one per batch), joined at close."""

    def __init__(self, out_dir: Path, split: str) -> None:
        self.out_dir, self.split, self.rows = out_dir, split, 0
        self.parts = out_dir / "parquet" / f".parts-{split}"  # kit's own; removed at close
        self.parts.mkdir(parents=True, exist_ok=True)
        self._n = 0
        self.empty = None  # the schema of a split without rows (its first table)

    def write(self, table) -> None:
        if self.empty is None:
            self.empty = table.clear()
        if table.height:
            table.write_parquet(self.parts / f"{self._n:06d}.parquet")
            self._n += 1
            self.rows += table.height

    def close(self, files: dict) -> Path:
        import polars as pl

        rel = f"parquet/{self.split}.parquet"
        target = self.out_dir / rel
        if self._n:
            pl.scan_parquet(sorted(self.parts.glob("*.parquet"))).sink_parquet(target)
        else:
            self.empty.write_parquet(target)
        shutil.rmtree(self.parts)
        files[rel] = file_entry(target, self.rows)
        return target


def write_hf(out_dir: Path, split: str, parquet: Path, files: dict) -> None:
    """hf/<split>/ (datasets.Dataset.save_to_disk) from the split's Parquet file."""
    import datasets
    import polars as pl

    target = out_dir / "hf" / split
    frame = pl.read_parquet(parquet)
    datasets.Dataset.from_dict(frame.to_dict(as_series=False)).save_to_disk(str(target))
    for p in sorted(target.rglob("*")):
        if p.is_file():
            files[str(p.relative_to(out_dir))] = file_entry(p, None)


# ---------------------------------------------------------------- one split's files


def _specforge_row(rid: str, conv: list[dict], r: dict) -> dict:
    """One SpecForge row: id, conversations (the target's tool calls on the last turn), and
    the record's tools when it has any."""
    row = {"id": rid, "conversations": with_tool_calls(conv, r)}
    tools = tools_of(r)
    if tools:
        row["tools"] = tools
    return row


_COUNTS = ("dataset", "prompt_id", "sample", "finish_reason", "completion_tokens", "count_source")


class Split:
    """The files of one split (opts: kit.report.export.ExportOptions), written a batch at a time."""

    def __init__(self, out_dir: Path, split: str, opts, columns: dict) -> None:
        self.out_dir, self.split, self.opts, self.columns = out_dir, split, opts, columns
        fmts = [f for f in ("specforge", "token_ids") if f in opts.formats]
        self.jsonl = {f: JsonlSink(out_dir, f"{f}/{split}.jsonl") for f in fmts}
        tabular = "parquet" in opts.formats or "hf" in opts.formats
        self.parquet = ParquetSink(out_dir, split) if tabular else None

    def write(self, rows: list[dict], tok_rows: dict) -> None:
        ids = [row_id(r) for r in rows]
        convs = [conversation(r["messages"], r["completion"], r.get("reasoning")) for r in rows]
        if "specforge" in self.jsonl:
            sf = [_specforge_row(i, c, r) for i, c, r in zip(ids, convs, rows, strict=True)]
            self.jsonl["specforge"].write(sf)
        if "token_ids" in self.jsonl:
            self.jsonl["token_ids"].write([tok_rows[i] for i in ids])
        if self.parquet is not None:
            self.parquet.write(table(rows, ids, convs, tok_rows, self.columns))

    def _table(self, rows: list[dict]) -> None:
        ids = [row_id(r) for r in rows]
        convs = [conversation(r["messages"], r["completion"], r.get("reasoning")) for r in rows]
        self.parquet.write(table(rows, ids, convs, {}, self.columns))

    def write_frame(self, frame, later=None) -> None:
        """write() for a records frame: SpecForge lines rendered by polars; the tables from
        its rows (no token rows: this path has none). The frame holds messages and tools,
        or the prompts as SpecForge text (_frag, _tools_sf: kit.run.batches.read_spans).
        `later(fn, *args)`, when given, runs the JSONL writes and their line hashes (in call
        order: kit.report.export hands them to one writer thread), so the caller renders the
        next batch while this one is hashed and written."""
        import polars as pl

        from kit.report.convo import rendered, specforge_lines
        from kit.run.lines import record_schema

        if "_frag" in frame.columns:
            tools = frame["_tools_sf"]
        else:
            tools = pl.Series([json.dumps(t, ensure_ascii=False) if (t := parsed(x)) else None for x in frame["tools"]], dtype=pl.String)  # fmt: skip
        if "specforge" in self.jsonl:
            sink = self.jsonl["specforge"]
            lines = rendered(specforge_lines(frame, tools))
            if later is None:
                sink.write_rendered(*lines)
            else:  # the line hashes too: the writer thread's work, beside the rendering
                later(sink.write_rendered, *lines)
        if self.parquet is not None:
            if "_frag" in frame.columns:
                msg = ("[" + pl.col("_frag") + "]").str.json_decode(record_schema()["messages"])
                frame = frame.with_columns(messages=msg, tools=tools)
            self._table(frame.to_dicts())

    def close(self, files: dict) -> None:
        for sink in self.jsonl.values():
            sink.close(files)
        if self.parquet is None:
            return
        if self.parquet.empty is None:  # a split without rows: its table's columns, no rows
            self.parquet.write(table([], [], [], {}, self.columns))
        path = self.parquet.close(files)
        if "hf" in self.opts.formats:
            write_hf(self.out_dir, self.split, path, files)
        if "parquet" not in self.opts.formats:  # written for hf only: kit's own, removed
            files.pop(f"parquet/{self.split}.parquet")
            path.unlink()
            if not any(path.parent.iterdir()):
                path.parent.rmdir()


def table(rows, ids, convs, tok_rows, columns: dict):
    """The Parquet / HF table of one batch of a split; `columns` says which optional columns
    the split has (reasoning_content, tools, token ids), the same for every batch."""
    import polars as pl

    from kit.run.lines import record_schema

    fields = {"role": pl.String, "content": pl.String}
    if columns["reasoning"]:
        fields["reasoning_content"] = pl.String
    msg = pl.List(pl.Struct(fields))
    out = pl.DataFrame(
        {"id": ids, "conversations": convs}, schema={"id": pl.String, "conversations": msg}
    ).with_columns(
        pl.DataFrame(
            {c: [r[c] for r in rows] for c in _COUNTS},
            schema={c: record_schema()[c] for c in _COUNTS},
        )
    )
    if columns["tools"]:
        tools = [tools_of(r) for r in rows]
        text = [json.dumps(t, ensure_ascii=False) if t else None for t in tools]
        out = out.with_columns(tools=pl.Series(text, dtype=pl.String))
    if columns["token_ids"]:
        out = out.with_columns(
            input_ids=pl.Series([tok_rows[i]["input_ids"] for i in ids], dtype=pl.List(pl.Int64)),
            loss_mask=pl.Series([tok_rows[i]["loss_mask"] for i in ids], dtype=pl.List(pl.Int8)),
            ids_source=pl.Series([tok_rows[i]["ids_source"] for i in ids], dtype=pl.String),
        )
    return out
