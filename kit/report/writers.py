"""The base of an export's writers (datatrove's DiskWriter is the model): a Writer opens one
format's files in the staging folder, one set per split, writes a batch of records at a
time and closes them into manifest entries; kit.report.formats holds one class per format.

An OutputFile hashes, counts and syncs its bytes as it writes them (WriteBehind: every
SYNC_EVERY bytes are synced and dropped from the page cache), so a million-record export
does not wait on a page cache filling with gigabytes, and the staged check reads no file
again. A JSONL line's hash goes to linehashes/<file>.txt, so kit.validate names an edited line.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from dataclasses import dataclass
from pathlib import Path

SYNC_EVERY = 64 << 20  # bytes of a file written before they are synced and dropped
SPLITS = ("train", "validation")


class WriteBehind:
    """A large output file sent to disk as it is written: every SYNC_EVERY bytes are synced
    (fdatasync) and their pages dropped from the page cache (posix_fadvise DONTNEED, where
    the system has it), only once on disk, so nothing is lost. Filling the page cache is what
    a multi-GB write waits on here (bench/bench_scale.py, the write floor). `wrote(n)` after
    each write; sync() at close: the file is durable before the manifest names it."""

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


def digest(path: Path) -> tuple[str, int]:
    """(hex sha256, newlines) of a file, in one read of 1 MiB chunks."""
    h, lines = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            lines += chunk.count(b"\n")
    return h.hexdigest(), lines


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    return digest(path)[0]


def file_entry(
    path: Path,
    rows: int | None,
    *,
    line_hashes: str | None = None,
    sha256: str | None = None,
    size: int | None = None,
) -> dict:
    """The manifest entry of one written file; `sha256` and `size`: its hash and bytes as the
    writer counted them while writing (else the file is read again for them)."""
    entry = {
        "sha256": sha256 or sha256_file(path),
        "bytes": path.stat().st_size if size is None else size,
        "rows": rows,
    }
    if line_hashes:
        entry["line_hashes"] = line_hashes
    return entry


class OutputFile:
    """One file of an export, written in order: its sha256, bytes and rows counted as they
    are written, sent to disk as it goes (WriteBehind); close() syncs it and adds its entry."""

    def __init__(self, root: Path, rel: str) -> None:
        self.root, self.rel, self.rows = root, rel, 0
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        self._f = open(root / rel, "wb")  # noqa: SIM115 - closed in close()
        self._behind, self._sha = WriteBehind(self._f), hashlib.sha256()

    def write(self, data: bytes | memoryview, rows: int) -> None:
        self._f.write(data)
        self._sha.update(data)
        self._behind.wrote(len(data))
        self.rows += rows

    def close(self, files: dict, line_hashes: str | None = None) -> None:
        self._behind.sync()  # on disk before the manifest names it
        self._f.close()
        sha, size = self._sha.hexdigest(), self._behind.written
        files[self.rel] = file_entry(
            self.root / self.rel, self.rows, line_hashes=line_hashes, sha256=sha, size=size
        )


class JsonlFile:
    """A JSONL file and its line-hash file (the first 16 hex digits of each line's sha256)."""

    def __init__(self, root: Path, rel: str) -> None:
        self.lines = OutputFile(root, rel)
        self.hashes = OutputFile(root, f"linehashes/{rel}.txt")

    def write(self, data: bytes | memoryview, offsets: list[int]) -> None:
        """Lines rendered and encoded, each ending in a newline (kit.report.convo.rendered);
        line i is data[offsets[i]:offsets[i + 1]]."""
        view = memoryview(data)
        hashes = "".join(
            hashlib.sha256(view[a : b - 1]).hexdigest()[:16] + "\n"
            for a, b in itertools.pairwise(offsets)
        )
        self.lines.write(data, len(offsets) - 1)
        self.hashes.write(hashes.encode(), len(offsets) - 1)

    def close(self, files: dict) -> None:
        self.lines.close(files, line_hashes=self.hashes.rel)
        self.hashes.close(files)


@dataclass
class Context:
    """What every writer of one export reads: where it writes, the run, its config and
    tokenizer, the options (kit.report.export.ExportOptions) and how many records are kept."""

    root: Path  # the staging folder (kit.report.staging)
    run_dir: Path
    config: object
    tok: object
    opts: object
    rows: int


class Writer:
    """One format's files, a set per split, written a batch of records at a time.

    A subclass names its files (`targets`, `listed`), opens a split's (`open`) and writes a
    split's rows into them (`write_split`), then closes them (`close_split`). It may first
    add columns to the batch every format writes (`prepare`), check it against
    kit.validate's rules (`problems`), and add its sections to the manifest (`manifest`).
    The train split is opened at once (an export without rows has its empty train files).
    """

    name = ""  # the format, as ExportOptions.formats names it
    listed = ""  # the manifest path proving a split was written ("{split}" filled in)
    columns: tuple = ()  # record columns it reads besides kit.report.export's
    needs_tokenizer = False
    needs_vocab = False  # kit.validate needs the manifest's tokenizer.vocab_size
    check = None  # (row, rules, line) -> problem or None: the rule of a JSONL format's lines

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.splits = {SPLITS[0]: self.open(SPLITS[0])}

    @classmethod
    def ready(cls, tok) -> None:
        """Raise ValueError when this format cannot be written (a missing tokenizer, package)."""

    @classmethod
    def targets(cls, split: str) -> list[str]:
        """The paths (relative to the export) this format writes for a split."""
        raise NotImplementedError

    @staticmethod
    def left_out(manifest: dict, split: str) -> int:
        """Rows of a split this format leaves out of its file (kit.validate's counts)."""
        return 0

    @property
    def needs_text(self) -> bool:
        """Whether its rows use the prompts' text (messages, tools)."""
        return True

    def prepare(self, frame):
        return frame

    def problems(self, frame) -> list[str]:
        return []

    def write(self, frame, parts: dict, later) -> None:
        """One batch, and its rows by split (`parts`, those with rows): each split's to its
        files. `later(fn, *args)` runs writes in call order on the export's writer thread."""
        for split, part in parts.items():
            if split not in self.splits:
                self.splits[split] = self.open(split)
            self.write_split(self.splits[split], part, split, later)

    def close(self, split: str, files: dict) -> None:
        if split in self.splits:
            self.close_split(self.splits.pop(split), split, files)

    def dropped(self) -> dict[str, int]:
        """Records this format left out of every format (reason -> count)."""
        return {}

    def manifest(self, manifest: dict) -> None:
        """Add this format's sections to the manifest."""

    @staticmethod
    def check_manifest(manifest: dict, rules, read: list[str]) -> list[str]:
        """kit.validate's problems with this format's manifest sections, given the rows of
        the files `read` (their facts counted in `rules`)."""
        return []

    def open(self, split: str):
        raise NotImplementedError

    def write_split(self, out, part, split: str, later) -> None:
        raise NotImplementedError

    def close_split(self, out, split: str, files: dict) -> None:
        out.close(files)


class JsonlWriter(Writer):
    """A JSONL format: <name>/<split>.jsonl and its line-hash file; `lines` renders a split's
    rows as (bytes, offsets), written on the writer thread."""

    @classmethod
    def targets(cls, split: str) -> list[str]:
        return [f"{cls.name}/{split}.jsonl", f"linehashes/{cls.name}/{split}.jsonl.txt"]

    def open(self, split: str) -> JsonlFile:
        return JsonlFile(self.ctx.root, f"{self.name}/{split}.jsonl")

    def write_split(self, out: JsonlFile, part, split: str, later) -> None:
        rendered = self.lines(part)
        if rendered is not None:
            later(out.write, *rendered)

    def lines(self, part) -> tuple | None:
        raise NotImplementedError
