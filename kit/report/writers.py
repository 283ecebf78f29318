"""The files of an export, written a batch at a time (kit.report.export streams records).

    sink = JsonlSink(out_dir, "specforge/train.jsonl")
    sink.write(rows)            # any number of times; each row one JSON line
    sink.close(files)           # adds the file and its line-hash file to the manifest's files

JSONL lines are json.dumps(row, ensure_ascii=False), as every kit export wrote them; the
line-hash file beside each (linehashes/<file>.txt) holds the first 16 hex digits of each
line's sha256, so kit.validate names an edited line. Parquet is written in parts, one per
batch, then joined into one file by polars' streaming sink; HF datasets are built from that
Parquet file (the one format that holds a whole split in memory: `datasets` builds it so).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from kit.report.validate import file_entry


class JsonlSink:
    """One JSONL file of an export and its line-hash file, appended a batch at a time."""

    def __init__(self, out_dir: Path, rel: str) -> None:
        self.out_dir, self.rel, self.rows = out_dir, rel, 0
        path = out_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        hashes = out_dir / "linehashes" / f"{rel}.txt"
        hashes.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._h = open(hashes, "w")  # noqa: SIM115 - closed in close()

    def write(self, rows: list[dict]) -> None:
        lines = [json.dumps(r, ensure_ascii=False) for r in rows]
        self._f.write("".join(x + "\n" for x in lines))
        self._h.write("".join(hashlib.sha256(x.encode()).hexdigest()[:16] + "\n" for x in lines))
        self.rows += len(lines)

    def close(self, files: dict) -> None:
        self._f.close()
        self._h.close()
        lh = f"linehashes/{self.rel}.txt"
        files[self.rel] = file_entry(self.out_dir / self.rel, self.rows, line_hashes=lh)
        files[lh] = file_entry(self.out_dir / lh, self.rows)


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
    table = pl.read_parquet(parquet)
    datasets.Dataset.from_dict(table.to_dict(as_series=False)).save_to_disk(str(target))
    for p in sorted(target.rglob("*")):
        if p.is_file():
            files[str(p.relative_to(out_dir))] = file_entry(p, None)
