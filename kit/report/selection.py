"""Which records an export keeps, and in which split (kit.report.export's first pass).

light_frame(run_dir, opts, corrupt, upto) reads every record once, in t_done order, keeping
no text: key, counts, finish reason, whether it has reasoning or tools, and (with
drop_duplicates) 64-bit hashes of its completion and of its normalized text. When no option
needs the text and the resume index covers every records file, it reads the index instead
of the lines (the writing pass then checks each line it writes). select()
applies the drop / trim / mix options to it, split() adds the validation split. The writing
pass then reads the records again in the same order and writes the kept ones, so memory
holds one batch of text and one small row per record, however large the run.
"""

from __future__ import annotations

import random
from array import array
from pathlib import Path


def select(light, budgets: dict, opts) -> tuple[object, dict[str, int]]:
    """Apply the drop / trim / mix options in that order to the light frame (one row per
    record in t_done order, no text); returns (the rows kept, dropped counts)."""
    import polars as pl

    frame = light
    dropped = {}
    steps = [
        ("errors", opts.drop_errors, ~pl.col("finish_reason").is_in(["stop", "length"])),
        ("truncated", opts.drop_truncated, pl.col("finish_reason") == "length"),
        ("duplicates", opts.drop_duplicates, pl.col("dup_exact") | pl.col("dup_near")),
    ]
    for reason, on, cond in steps:
        if on:
            cond = cond.fill_null(True) if reason == "errors" else cond.fill_null(False)
            dropped[reason] = frame.filter(cond).height
            frame = frame.filter(~cond)
    if opts.trim_to_budget:
        n = frame.height
        frame = _keep_prefix(frame, {d: b for d, b in budgets.items() if b})
        dropped["past_budget"] = n - frame.height
    if opts.mix:
        n = frame.height
        frame = _mix(frame, opts.mix)
        dropped["mix"] = n - frame.height
    return frame, dropped


_LIGHT = ["dataset", "prompt_id", "sample", "finish_reason", "completion_tokens", "t_done"]


def light_frame(run_dir, opts, corrupt: list, upto: dict):
    """Pass 1: every record's key, counts and what the options and the tables' columns need
    (has_reasoning, has_tools, duplicate flags with drop_duplicates), no text, in t_done
    order, with `_pos` its place in that order and where its line is (_file, _line, _start,
    _size, _plain: kit.run.batches.read_spans reads it again from there)."""
    import polars as pl

    from kit.run.batches import record_rows

    schema = _light_schema()
    light = None
    if not opts.drop_duplicates and set(opts.formats) == {"specforge"}:
        light = _from_index(run_dir, upto, schema)  # no text needed: the index may do
    if light is not None:
        return _finish(run_dir, light, opts)
    parts = []
    rows_of = record_rows(
        run_dir, corrupt=corrupt, order="t_done", upto=upto, prompts=False, dedupe=False,
        located=True, spans=True,
    )  # fmt: skip
    stems: dict = {}  # path -> its stem (Path.stem per line costs more than the rest)
    for located in rows_of:
        rows = [item[2] for item in located]
        data = {c: [r.get(c) for r in rows] for c in _LIGHT}
        data["_file"] = [stems.get(p) or stems.setdefault(p, p.stem) for p, *_ in located]
        data["_line"] = [item[1] for item in located]
        data["_start"] = [item[3] for item in located]
        data["_size"] = [item[4] for item in located]
        data["_plain"] = [not ("messages" in r or "tools" in r or r.get("turns")) for r in rows]
        data["has_reasoning"] = [bool(r.get("reasoning")) for r in rows]
        data["has_tools"] = [bool(r.get("tools")) for r in rows]  # lines that hold their own
        b = pl.DataFrame(data, schema=schema)
        if opts.drop_duplicates:
            b = b.with_columns(_duplicate_keys([r["completion"] for r in rows]))
        parts.append(b)
    light = pl.concat(parts) if parts else pl.DataFrame(schema=schema)
    return _finish(run_dir, light, opts)


def _finish(run_dir, light, opts):
    """The light frame of every line read, in t_done order -> its records: `_pos`, first
    copies only, duplicate flags, has_tools from the prompts."""
    import polars as pl

    light = light.with_row_index("_pos")  # the place of every line read, copies included
    first = pl.struct("dataset", "prompt_id", "sample").is_first_distinct()
    light = light.filter(first)  # a key's first copy is its record, as every reader has it
    if opts.drop_duplicates:
        light = light.with_columns(_duplicate_flags())
    tools = _prompts_with_tools(run_dir)
    if tools is not None:
        light = light.join(tools, on=["dataset", "prompt_id"], how="left", maintain_order="left")
        light = light.with_columns(pl.col("has_tools") | pl.col("_tools").fill_null(False))
        light = light.drop("_tools")
    return light


def _from_index(run_dir, upto: dict, schema: dict):
    """Pass 1 from the resume index (kit.run.index) without reading a line: the heads it
    holds (key, count, finish reason, t_done) and each line's place from a newline scan.
    None (read the lines) unless every records file is exactly what its index covers, read
    with the index's regex (every line a RunStore head in plain text, none damaged, none
    empty) and in t_done order. The lines are not checked here as records: the writing pass
    parses them strictly (kit.run.batches.read_spans) and reports any that are not. So a
    line the export leaves out (an error, a later copy, past the budget) is never read, and
    one whose head is whole but whose rest is damaged is not listed in corrupt_lines, as a
    full read would list it (nothing of it is written either way).
    has_reasoning (only the tables need it) is left False: the caller asks for SpecForge
    lines only (the token-id pass reads lines its own way)."""
    import numpy as np
    import polars as pl

    from kit.run import index
    from kit.run.lines import record_files

    parts = []
    for stem, path in record_files(Path(run_dir)).items():
        if stem not in upto:
            return None  # a file the first look did not see: record_rows reads it whole
        size = upto[stem]
        if not size:
            continue
        got = index.load(path)
        if got is None or not got.fast or got.problems or got.size != size or got.lines != got.frame.height:  # fmt: skip
            return None
        if not got.frame["t_done"].is_sorted():
            return None  # the merge of unsorted files is record_rows' to make
        ends = _newlines(path, size)
        if len(ends) != got.lines:
            return None
        starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
        parts.append(got.frame.with_columns(
            _file=pl.lit(stem), _line=pl.int_range(1, got.lines + 1, dtype=pl.Int64),
            _start=pl.Series(starts), _size=pl.Series(ends - starts), _plain=pl.lit(None, pl.Boolean),
            has_reasoning=pl.lit(False), has_tools=pl.lit(False),
        ).select([pl.col(c).cast(t) for c, t in schema.items()]))  # fmt: skip
    light = pl.concat(parts) if parts else pl.DataFrame(schema=schema)
    return light.sort("t_done", maintain_order=True)  # = record_rows' merge: ties in file order


def _newlines(path, size: int):
    """The offsets of the newlines in a file's first `size` bytes, read in 32 MB pieces into
    one buffer (fresh memory per piece costs more here than the search: bytes.find, memchr)."""
    import numpy as np

    found, at = [], 0
    buf = bytearray(min(32 << 20, max(size, 1)))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while at < size:
            n = f.readinto(view[: min(len(buf), size - at)])
            if not n:
                break
            ends, find = array("q"), buf.find
            i = find(b"\n", 0, n)
            while i != -1:
                ends.append(i)
                i = find(b"\n", i + 1, n)
            found.append(np.frombuffer(ends, dtype=np.int64) + at)
            at += n
    return np.concatenate(found).astype(np.int64) if found else np.zeros(0, dtype=np.int64)


def _prompts_with_tools(run_dir):
    """(dataset, prompt_id, _tools) of the prompts that have tool definitions; None when
    prompts.parquet has no tools column."""
    import polars as pl
    import pyarrow.parquet as pq

    path = run_dir / "prompts.parquet"
    if not path.exists() or "tools" not in pq.ParquetFile(path).schema_arrow.names:
        return None
    frame = pl.scan_parquet(path).select("dataset", "prompt_id", "tools")
    has = pl.col("tools").is_not_null() & (pl.col("tools").str.strip_chars() != "[]")
    frame = frame.filter(has).select("dataset", "prompt_id", _tools=pl.lit(True))
    return frame.unique(["dataset", "prompt_id"]).collect()


def _light_schema() -> dict:
    import polars as pl

    from kit.run.lines import record_schema

    schema = {c: t for c, t in record_schema().items() if c in _LIGHT}
    where = {"_file": pl.String, "_line": pl.Int64, "_start": pl.Int64, "_size": pl.Int64}
    where |= {"_plain": pl.Boolean}  # no prompt or earlier turns of its own (read_spans)
    return schema | {"has_reasoning": pl.Boolean, "has_tools": pl.Boolean} | where


def _duplicate_keys(texts: list[str]) -> list:
    """empty, and 64-bit hashes of each completion and of its normalized text, as the audit
    computes them (kit.report.flags: blank, normalized)."""
    import polars as pl

    from kit.report.flags import blank, normalized

    text = pl.Series(texts, dtype=pl.String)
    norm = normalized(text)
    return [
        pl.select(blank(pl.lit(text))).to_series().alias("empty"),
        text.hash().alias("_exact"),
        norm.hash().alias("_near"),
        (norm == "").alias("_near_empty"),
    ]


def _duplicate_flags() -> list:
    """dup_exact / dup_near as kit.report.flags defines them (first by t_done stays)."""
    import polars as pl

    later_exact = pl.int_range(pl.len()).over(["dataset", "_exact"]) > 0
    later_near = pl.int_range(pl.len()).over(["dataset", "_near"]) > 0
    return [
        (~pl.col("empty") & later_exact).alias("dup_exact"),
        (~pl.col("empty") & ~pl.col("_near_empty") & later_near & ~later_exact).alias("dup_near"),
    ]


def _keep_prefix(frame, limits: dict[str, float]):
    """Per dataset, keep records in t_done order while cumulative tokens <= its limit."""
    import polars as pl

    limit = pl.col("dataset").replace_strict(limits, default=None, return_dtype=pl.Float64)
    cum = pl.col("completion_tokens").cum_sum().over("dataset")
    return frame.filter(limit.is_null() | (cum <= limit))


def _mix(frame, mix: dict):
    """Keep token shares: total T = min(available_d / share_d); dataset d keeps share_d * T."""
    import polars as pl

    avail = dict(frame.group_by("dataset").agg(pl.col("completion_tokens").sum()).iter_rows())
    missing = [d for d in mix if d not in avail]
    if missing:
        raise ValueError(
            f"mix names datasets with no records to export: {missing}; have {sorted(avail)}"
        )
    total = sum(mix.values())
    shares = {d: s / total for d, s in mix.items()}
    t = min(avail[d] / s for d, s in shares.items())
    frame = frame.filter(pl.col("dataset").is_in(list(mix)))
    return _keep_prefix(frame, {d: s * t for d, s in shares.items()})


def split_by_prompt(frame, val_fraction: float, seed: int):
    """Add `split`: per dataset a seeded shuffle of prompt ids; the first round(f*n) validate.

    Samples of one prompt stay together, so no prompt is in both splits.
    """
    import polars as pl

    val_keys = []
    for name in sorted(frame["dataset"].unique().to_list()):
        ids = sorted(frame.filter(pl.col("dataset") == name)["prompt_id"].unique().to_list())
        random.Random(f"{seed}:{name}").shuffle(ids)
        val_keys += [(name, p) for p in ids[: int(val_fraction * len(ids) + 0.5)]]
    val = pl.DataFrame(
        val_keys, schema={"dataset": pl.String, "prompt_id": pl.String}, orient="row"
    )
    val = val.with_columns(split=pl.lit("validation"))
    out = frame.join(val, on=["dataset", "prompt_id"], how="left", maintain_order="left")
    return out.with_columns(pl.col("split").fill_null("train"))
