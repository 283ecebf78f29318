"""The writer base (kit.report.writers) and the format registry (kit.report.formats): a file
is hashed, counted and sized as written, a writer opens a split's files when its rows come,
and the formats chosen for an export are the writers it runs."""

import hashlib
import json

import polars as pl

from kit.report.formats import WRITERS, HFWriter, ParquetWriter, SpecForgeWriter, chosen
from kit.report.validate import sha256_file
from kit.report.writers import SPLITS, Context, JsonlFile, JsonlWriter


def test_a_jsonl_file_is_hashed_and_counted_as_written(tmp_path):
    lines = [json.dumps({"id": f"r{i}", "text": "é" * i}, ensure_ascii=False) for i in range(5)]
    data = "".join(x + "\n" for x in lines).encode()
    offsets = [0]
    for x in lines:
        offsets.append(offsets[-1] + len(x.encode()) + 1)
    out = JsonlFile(tmp_path, "specforge/train.jsonl")
    out.write(data[: offsets[2]], offsets[:3])
    out.write(data[offsets[2] :], [o - offsets[2] for o in offsets[2:]])
    files = {}
    out.close(files)
    entry, hashes = files["specforge/train.jsonl"], files["linehashes/specforge/train.jsonl.txt"]
    assert (tmp_path / "specforge/train.jsonl").read_bytes() == data
    assert entry == {
        "sha256": sha256_file(tmp_path / "specforge/train.jsonl"),
        "bytes": len(data),
        "rows": 5,
        "line_hashes": "linehashes/specforge/train.jsonl.txt",
    }
    want = [hashlib.sha256(x.encode()).hexdigest()[:16] for x in lines]
    assert (tmp_path / entry["line_hashes"]).read_text().splitlines() == want
    assert hashes["rows"] == 5 and hashes["bytes"] == 17 * 5


class _Echo(JsonlWriter):
    """A format of one line per row: its id."""

    name = "echo"

    def lines(self, part):
        text = "".join(f"{i}\n" for i in part["id"])
        ends = [0]
        for i in part["id"]:
            ends.append(ends[-1] + len(i) + 1)
        return text.encode(), ends


def test_a_writer_writes_each_split_and_opens_validation_only_with_rows(tmp_path):
    ctx = Context(tmp_path, tmp_path, None, None, None, rows=3)
    writer, files = _Echo(ctx), {}
    frame = pl.DataFrame({"id": ["a", "b", "c"], "split": ["train", "train", "train"]})
    writer.write(frame, {"train": frame}, lambda fn, *args: fn(*args))
    for split in SPLITS:
        writer.close(split, files)
    assert list(files) == ["echo/train.jsonl", "linehashes/echo/train.jsonl.txt"]
    assert (tmp_path / "echo/train.jsonl").read_text() == "a\nb\nc\n"
    assert not (tmp_path / "echo/validation.jsonl").exists()


def test_the_formats_chosen_are_the_writers_run():
    assert list(WRITERS) == ["specforge", "token_ids", "parquet", "hf"]
    assert chosen(("parquet", "specforge")) == [SpecForgeWriter, ParquetWriter]
    assert chosen(("hf", "parquet")) == [HFWriter]  # HF writes the Parquet file as well
    assert HFWriter.targets("train") == [*ParquetWriter.targets("train"), "hf/train"]
    assert [w.listed.format(split="validation") for w in WRITERS.values()] == [
        "specforge/validation.jsonl",
        "token_ids/validation.jsonl",
        "parquet/validation.parquet",
        "hf/validation/",
    ]
