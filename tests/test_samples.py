"""data/samples itself: every file is the format data/samples/README.md says, loads with no
skips and no duplicates, holds the prompt count the README gives, and make_samples.py
writes it again byte for byte. (tests/test_sources.py tests the loader on its own inputs.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

import kit

SAMPLES = Path(__file__).resolve().parents[1] / "data" / "samples"
# a README table row: | `file` | format | prompts | what it holds |
ROW = re.compile(r"^\| `(?P<file>[^`]+)` \| (?P<format>[^|]+?) \| (?P<prompts>[^|]+?) \|")
SUFFIX = {"JSON list": ".json", "Parquet": ".parquet"}  # container named in the format column


def readme_table() -> dict[str, dict]:
    """file name -> {"format": kit format name, "suffix": container, "prompts": int}."""
    out = {}
    for line in (SAMPLES / "README.md").read_text(encoding="utf-8").splitlines():
        m = ROW.match(line)
        if m is None or m["prompts"] == "-":  # the header, or make_samples.py itself
            continue
        described = m["format"]
        suffix = next((s for k, s in SUFFIX.items() if k in described), ".jsonl")
        fmt = re.match(r"\w+", described)[0].lower()  # "OpenAI `messages`" -> "openai"
        out[m["file"]] = {"format": fmt, "suffix": suffix, "prompts": int(m["prompts"])}
    return out


TABLE = readme_table()


def test_readme_lists_exactly_the_data_files():
    on_disk = sorted(
        p.name for p in SAMPLES.iterdir() if p.suffix in (".jsonl", ".json", ".parquet")
    )
    assert sorted(TABLE) == on_disk
    assert len(TABLE) == 8


@pytest.mark.parametrize("name", sorted(TABLE))
def test_each_file_loads_clean_as_its_readme_row_says(name):
    want = TABLE[name]
    path = SAMPLES / name
    assert path.suffix == want["suffix"], f"{name}: README says the container is {want['suffix']}"
    res = kit.load(path)
    dataset = path.stem
    assert res.formats == {dataset: want["format"]}
    assert res.skipped[dataset] == {}, res.skipped[dataset]
    assert res.duplicates[dataset] == 0
    assert res.frame.height == want["prompts"] == res.rows[dataset]  # every row is a prompt
    assert res.frame["prompt_id"].n_unique() == res.frame.height


def test_the_directory_loads_as_eight_datasets_with_unique_prompts():
    res = kit.load(SAMPLES)
    summary = res.summary()
    assert sorted(summary["dataset"]) == sorted(Path(n).stem for n in TABLE)
    assert summary["skipped"].sum() == 0 and summary["duplicates"].sum() == 0
    assert res.frame.height == sum(row["prompts"] for row in TABLE.values())
    assert res.frame["prompt_id"].n_unique() == res.frame.height  # no prompt in two datasets
    assert set(summary["format"]) == {
        "openai",
        "sharegpt",
        "ultrachat",
        "alpaca",
        "magicoder",
        "opencodeinstruct",
    }
    assert res.frame.filter(pl.col("n_turns") > 1).height >= 20  # multi-turn context present
    systems = res.frame["messages"].list.first().struct.field("role") == "system"
    assert systems.sum() >= 20


def test_prompt_lengths_differ_between_datasets():
    lengths = (
        kit.load(SAMPLES)
        .frame.with_columns(
            chars=pl.col("messages")
            .list.eval(pl.element().struct.field("content").str.len_chars())
            .list.sum()
        )
        .group_by("dataset")
        .agg(pl.col("chars").mean())
    )
    means = dict(zip(lengths["dataset"], lengths["chars"], strict=True))
    assert means["multi_turn"] > 4 * means["chat_general"]  # earlier turns as context
    assert means["code_instruct"] > 2.5 * means["chat_general"]


def test_make_samples_regenerates_the_files_byte_for_byte(tmp_path):
    # the script writes next to itself (no output-dir option): run a copy in a temp dir
    script = tmp_path / "make_samples.py"
    script.write_bytes((SAMPLES / "make_samples.py").read_bytes())
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    for name in TABLE:
        assert (tmp_path / name).read_bytes() == (SAMPLES / name).read_bytes(), name
    written = sorted(p.name for p in tmp_path.iterdir() if p.name != "make_samples.py")
    assert written == sorted(TABLE)
