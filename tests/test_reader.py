"""kit.run.reader: both fetch paths (ADBC's Arrow batches, sqlite3's tuples while this
process writes) give the same frames, at any batch size, with NULLs first and text later."""

from __future__ import annotations

import polars as pl
import pytest
from test_audit import make_record, plant_run

from kit.run import db, reader


@pytest.fixture
def run_dir(tmp_path):
    recs = [make_record(None, "a", i, f"Question {i}?", f"Answer {i}.") for i in range(7)]
    for r in recs[:4]:  # the first batches: no reasoning, no ids, no turns (all NULL)
        r.output_ids, r.count_source = None, "usage"
    recs[5].reasoning = "thinking it through"
    recs[6].output_ids, recs[6].prompt_ids = [1, 2, 2**32 - 1], [7]
    recs[6].turns = [{"content": "earlier answer", "finish_reason": "stop"}]
    recs += [make_record(None, "b", 10 + i, f"Other {i}?", "x" * i) for i in range(3)]
    return plant_run(tmp_path / "run", recs, budgets={"a": 100, "b": 100})


@pytest.mark.parametrize("batch_size", [1, 3, 10_000])
def test_adbc_and_sqlite3_paths_read_the_same(run_dir, monkeypatch, batch_size):
    fast = list(reader.record_batches(run_dir, prompts=True, batch_size=batch_size))
    monkeypatch.setattr(db, "written_here", lambda _: True)  # as while this process writes
    slow = list(reader.record_batches(run_dir, prompts=True, batch_size=batch_size))
    assert [f.height for f in fast] == [f.height for f in slow]
    assert all(f.height <= batch_size for f in fast)
    a, b = pl.concat(fast), pl.concat(slow)
    assert a.equals(b) and a.height == 10
    assert a["output_ids"].to_list()[6] == [1, 2, 2**32 - 1] and a["output_ids"][0] is None
    assert a["reasoning"].to_list()[5] == "thinking it through"
    assert a["dataset"].to_list() == ["a"] * 7 + ["b"] * 3  # commit order


def test_a_dataset_filter_and_columns(run_dir):
    (f,) = reader.record_batches(run_dir, datasets=["b"], columns=["prompt_id", "completion"])
    assert f.columns == ["prompt_id", "completion"] and f["completion"].to_list() == ["", "x", "xx"]
    with pytest.raises(ValueError, match="unknown record columns"):
        next(reader.record_batches(run_dir, columns=["nope"]))
