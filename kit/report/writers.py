"""The files of an export, written a batch at a time (kit.report.export streams records).

    sink = JsonlSink(out_dir, "specforge/train.jsonl")
    sink.write(rows)            # any number of times; each row one JSON line
    sink.close(files)           # adds the file and its line-hash file to the manifest's files

JSONL lines are json.dumps(row, ensure_ascii=False), as every kit export wrote them; the
line-hash file beside each (linehashes/<file>.txt) holds the first 16 hex digits of each
line's sha256, so kit.validate names an edited line. A JSONL file goes to disk as it is
written (WriteBehind: every SYNC_EVERY bytes are synced and dropped from the page cache), so
a million-record export does not wait on a page cache filling with gigabytes. Parquet is
written in parts, one per batch, then joined into one file by polars' streaming sink; HF
datasets are built from that Parquet file (the one format that holds a whole split in
memory: `datasets` builds it so). Split writes one split's files from a records frame.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
from pathlib import Path

from kit.report.convo import rendered, row_ids, specforge_lines
from kit.report.exactrows import token_lines
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
        self._h_bytes = 0

    def write(self, rows: list[dict]) -> None:
        """Rows as json.dumps(row, ensure_ascii=False) lines."""
        encoded = [json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in rows]
        self.write_rendered(b"".join(encoded), [0, *itertools.accumulate(map(len, encoded))])

    def write_rendered(self, data: bytes | memoryview, offsets: list[int]) -> None:
        """Lines already rendered and encoded, each ending in a newline (kit.report.convo.
        rendered); line i is data[offsets[i]:offsets[i + 1]]. Written as they are."""
        view = memoryview(data)
        hashes = "".join(
            hashlib.sha256(view[a : b - 1]).hexdigest()[:16] + "\n"
            for a, b in itertools.pairwise(offsets)
        )
        self._f.write(data)
        self._sha.update(data)
        self._behind.wrote(len(data))
        self._h.write(hashes)
        self._h_sha.update(encoded := hashes.encode())
        self._h_bytes += len(encoded)
        self.rows += len(offsets) - 1

    def close(self, files: dict) -> None:
        self._behind.sync()  # the file is on disk before the manifest names it
        self._f.close()
        self._h.flush()
        os.fsync(self._h.fileno())
        self._h.close()
        lh = f"linehashes/{self.rel}.txt"
        files[self.rel] = file_entry(
            self.out_dir / self.rel,
            self.rows,
            line_hashes=lh,
            sha256=self._sha.hexdigest(),
            size=self._behind.written,
        )
        files[lh] = file_entry(
            self.out_dir / lh, self.rows, sha256=self._h_sha.hexdigest(), size=self._h_bytes
        )


class ParquetSink:
    """One Parquet file of an export, written as parts (one per batch), joined at close.

    Every part holds the optional columns (reasoning_content in the conversations, tools);
    close() keeps them only when some row has one, so a split's columns do not depend on
    how its rows fell into batches.
    """

    def __init__(self, out_dir: Path, split: str) -> None:
        self.out_dir, self.split, self.rows = out_dir, split, 0
        self.parts = out_dir / "parquet" / f".parts-{split}"  # kit's own; removed at close
        self.parts.mkdir(parents=True, exist_ok=True)
        self.reasoning = self.tools = False  # whether any row has them

    def write(self, table) -> None:
        self.reasoning |= table["has_reasoning"].any()
        self.tools |= table["tools"].is_not_null().any()
        if table.height or not self.rows:  # an empty first part: the split's columns
            table.drop("has_reasoning").write_parquet(self.parts / f"{self.rows:012d}.parquet")
            self.rows += table.height

    def close(self, files: dict) -> Path:
        import polars as pl

        rel = f"parquet/{self.split}.parquet"
        target = self.out_dir / rel
        frame = pl.scan_parquet(sorted(self.parts.glob("*.parquet")))
        if not self.reasoning:
            e = pl.element().struct
            plain = pl.struct(role=e.field("role"), content=e.field("content"))
            frame = frame.with_columns(pl.col("conversations").list.eval(plain))
        if not self.tools:
            frame = frame.drop("tools")
        frame.sink_parquet(target)
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


class Split:
    """The files of one split (opts: kit.report.export.ExportOptions), written a batch at a
    time from records frames; `token_ids`: its tables have the token-id columns."""

    def __init__(self, out_dir: Path, split: str, opts, token_ids: bool) -> None:
        self.out_dir, self.split, self.opts, self.token_ids = out_dir, split, opts, token_ids
        fmts = [f for f in ("specforge", "token_ids") if f in opts.formats]
        self.jsonl = {f: JsonlSink(out_dir, f"{f}/{split}.jsonl") for f in fmts}
        tabular = "parquet" in opts.formats or "hf" in opts.formats
        self.parquet = ParquetSink(out_dir, split) if tabular else None

    def write(self, frame, later) -> None:
        """One batch of the split: a records frame with prompts (kit.run.reader), its
        `tools_json` and `tool_calls_json` (kit.report.convo.tools_json) and, with token ids,
        its input_ids, loss_mask and ids_source columns (kit.report.exactrows).
        `later(fn, *args)` runs the JSONL writes and line hashes in call order
        (kit.report.export hands them to one writer thread), so the caller renders the next
        batch meanwhile. `_cut`: rows the SpecForge file leaves out unless kept."""
        import polars as pl

        if "specforge" in self.jsonl:
            convs = (
                frame if self.opts.keep_truncated_conversations else frame.filter(~pl.col("_cut"))
            )
            if convs.height:
                later(self.jsonl["specforge"].write_rendered, *rendered(specforge_lines(convs)))
        if "token_ids" in self.jsonl:
            later(self.jsonl["token_ids"].write_rendered, *token_lines(frame))
        if self.parquet is not None:
            self.parquet.write(table(frame, self.token_ids))

    def close(self, files: dict) -> None:
        for sink in self.jsonl.values():
            sink.close(files)
        if self.parquet is None:
            return
        if not self.parquet.rows:  # a split without rows: its table's columns, no rows
            self.parquet.write(table(None, self.token_ids))
        path = self.parquet.close(files)
        if "hf" in self.opts.formats:
            write_hf(self.out_dir, self.split, path, files)
        if "parquet" not in self.opts.formats:  # written for hf only: kit's own, removed
            files.pop(f"parquet/{self.split}.parquet")
            path.unlink()
            if not any(path.parent.iterdir()):
                path.parent.rmdir()


_COUNTS = ("dataset", "prompt_id", "sample", "finish_reason", "completion_tokens", "count_source")


def table(frame, token_ids: bool):
    """The Parquet / HF table of one batch of a split (None: no rows): id, conversations
    (with reasoning_content), the counts, tools (JSON text), the token-id columns, and
    has_reasoning (for ParquetSink, not written)."""
    import polars as pl

    from kit.run.reader import record_schema

    schema = record_schema()
    if frame is None:
        cols = [*_COUNTS, "messages", "completion", "reasoning", "tools_json"]
        frame = pl.DataFrame(schema={c: schema.get(c, pl.String) for c in cols})
        frame = frame.with_columns(
            input_ids=pl.lit(None, pl.List(pl.Int64)),
            loss_mask=pl.lit(None, pl.List(pl.Int8)),
            ids_source=pl.lit(None, pl.String),
        )
    msg = pl.Struct({"role": pl.String, "content": pl.String, "reasoning_content": pl.String})
    reasoning = pl.when(pl.col("reasoning").fill_null("") != "").then(pl.col("reasoning"))
    last = pl.struct(
        role=pl.lit("assistant"), content=pl.col("completion"), reasoning_content=reasoning
    )
    conversations = pl.concat_list(pl.col("messages").cast(pl.List(msg)), last)
    cols = [row_ids().alias("id"), conversations.alias("conversations"), *_COUNTS]
    cols += [pl.col("tools_json").alias("tools"), reasoning.is_not_null().alias("has_reasoning")]
    if token_ids:
        cols += [
            pl.col("input_ids"),
            pl.col("loss_mask").cast(pl.List(pl.Int8)),
            pl.col("ids_source"),
        ]
    return frame.select(cols)
