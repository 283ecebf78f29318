"""Draft vocabulary (issue 25 item 5): token frequencies and d2t/t2d from a run's exact ids,
written for SpecForge and speculators and loaded by their own code (.venv-trainers, `make
trainers`), and the audit's per-dataset top-K table."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from test_audit import make_record, plant_run

import kit
from kit.report import draftvocab

REPO = Path(__file__).resolve().parents[1]
TRAINERS = REPO / ".venv-trainers" / "bin" / "python"

# token ids by dataset; totals: 3:1 5:3 7:3 9:3 12:1 20:3 21:2 22:1 (8 distinct)
IDS = {"a": [[5, 5, 5, 7, 7, 9], [3, 9, 9, 12]], "b": [[7, 20, 20, 20, 21], [21, 22]]}
V = 64  # the planted target's vocab_size
# top 6: 5, 7, 9, 20 (3 each), 21 (2), then of the ties at 1 (3, 12, 22) the lowest id, 3
TOP6 = [3, 5, 7, 9, 20, 21]
# 12 > the 8 seen: the 8, then the lowest unseen ids 0, 1, 2, 4
TOP12 = [0, 1, 2, 3, 4, 5, 7, 9, 12, 20, 21, 22]


def records():
    out = [
        make_record(
            None,
            d,
            10 * j + i,
            f"q {d} {i}",
            f"answer {i}",
            ids=False,
            output_ids=ids,
            count_source="server_ids",
        )
        for j, (d, rows) in enumerate(IDS.items())
        for i, ids in enumerate(rows)
    ]
    return out + [make_record(None, "b", 30, "q b 9", "no ids here", ids=False)]  # excluded


@pytest.fixture
def run(tmp_path) -> Path:
    run_dir = plant_run(tmp_path / "run", records(), budgets={"a": 100, "b": 100})
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(
        json.dumps({"hidden_size": 32, "num_hidden_layers": 4, "vocab_size": V})
    )
    return run_dir


def test_selection_ties_and_fill():
    total = draftvocab.TokenCounts()
    total.add(
        pl.DataFrame(
            {
                "dataset": ["a", "a", "b", "b"],
                "output_ids": [r for rows in IDS.values() for r in rows],
            }
        )
    )
    freq = total.total()
    assert draftvocab.select_ids(freq, 6).tolist() == TOP6
    assert draftvocab.select_ids(freq, 12).tolist() == TOP12
    d2t, t2d = draftvocab.mapping(freq, 6, V)
    assert d2t.tolist() == [3, 4, 5, 6, 16, 16]  # id - position
    assert np.flatnonzero(t2d).tolist() == TOP6 and t2d.shape == (V,) and d2t.dtype == np.int64


def test_all_turns_records_count_earlier_turns_or_are_excluded():
    c = draftvocab.TokenCounts()
    turns = [json.dumps([{"output_ids": [1, 1]}]), json.dumps([{"output_ids": None}]), None]
    c.add(pl.DataFrame({"dataset": ["x"] * 3, "output_ids": [[2], [2], None], "turns": turns}))
    assert c.per["x"].tolist() == [
        0,
        2,
        1,
    ]  # the second record (a turn without ids) and the third out
    assert (c.records["x"], c.excluded["x"]) == (1, 2)


def test_coverage_per_dataset(run):
    table = kit.audit(run, draft_vocab=6).draft_vocab  # the audit's pass counts the run
    rows = {r["dataset"]: r for r in table.iter_rows(named=True)}
    assert rows["a"]["in_top_k"] == pytest.approx(9 / 10)  # 12 (1 of 10) is outside
    assert rows["b"]["in_top_k"] == pytest.approx(6 / 7)  # 22 is outside
    assert (rows["a"]["adds"], rows["b"]["adds"]) == (
        3,
        2,
    )  # without a: 3, 5, 9 go; without b: 20, 21
    assert (rows["b"]["records"], rows["b"]["excluded"]) == (2, 1)
    assert rows["TOTAL"]["tokens"] == 17


def test_audit_shows_the_top_k_table(run):
    report = kit.audit(run, draft_vocab=6)
    shares = dict(report.draft_vocab.select("dataset", "in_top_k").iter_rows())
    assert shares["a"] == pytest.approx(0.9)
    assert "a: 90.0% of 10 tokens inside the top 6, adds 3 ids" in report.summary()
    assert "1 records without server ids excluded" in report.summary()


def test_export_refuses_without_a_target_vocab_and_bad_k(run, tmp_path):
    with pytest.raises(ValueError, match="needs the target's vocab_size"):
        kit.export(run, tmp_path / "x", formats=("specforge",), draft_vocab=6)
    with pytest.raises(ValueError, match="positive number of token ids, got 0"):
        kit.export(
            run,
            tmp_path / "y",
            formats=("specforge",),
            draft_vocab=0,
            target_config=tmp_path / "target",
        )


def test_export_caps_k_at_the_target_vocab(run, tmp_path):
    res = kit.export(
        run,
        tmp_path / "out",
        formats=("specforge",),
        draft_vocab=1000,
        target_config=tmp_path / "target",
    )
    assert res.manifest["draft_vocab"]["draft_vocab_size"] == V
    assert np.load(tmp_path / "out" / "draft_vocab" / f"d2t-{V}.npy").tolist() == [0] * V


@pytest.mark.parametrize(("k", "top"), [(6, TOP6), (12, TOP12)])
def test_trainers_load_the_mapping_kit_claims(run, tmp_path, k, top):
    out = tmp_path / "out"
    res = kit.export(
        run, out, formats=("specforge",), draft_vocab=k, target_config=tmp_path / "target"
    )
    assert kit.validate(out).ok
    assert set(draftvocab.targets(k)) <= set(res.manifest["files"])
    assert f"draft vocabulary of {k:,} (target {V:,})" in res.summary()
    assert TRAINERS.exists(), f"{TRAINERS} missing: build it with `make trainers`"
    proc = subprocess.run(
        [
            str(TRAINERS),
            str(REPO / "tests" / "trainers_vocab.py"),
            str(out / "draft_vocab"),
            str(k),
            str(V),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    want = {
        "d2t": [t - i for i, t in enumerate(top)],
        "t2d": top,
        "t2d_len": V,
        "d2t_dtype": "torch.int64",
        "t2d_dtype": "torch.bool",
    }
    assert got["specforge"]["loaded"] == want
    assert got["specforge"]["from_counts"] == want  # SpecForge's own rule on kit's counts
    assert got["speculators"]["loaded"] == want
    assert got["speculators"]["from_freq"] == want  # speculators' own rule on token_freq.pt
    assert got["speculators"]["token_freq"] == {
        "3": 1,
        "5": 3,
        "7": 3,
        "9": 3,
        "12": 1,
        "20": 3,
        "21": 2,
        "22": 1,
    }


def test_kit_export_draft_vocab_flag(run, tmp_path, capsys):
    from kit import cli

    out = tmp_path / "out"
    argv = [
        "export",
        str(run),
        str(out),
        "--format",
        "specforge",
        "--draft-vocab",
        "--target-config",
        str(tmp_path / "target"),
    ]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert f"draft vocabulary of {V} (target {V})" in printed  # the default 32,000, capped
    assert sorted(p.name for p in (out / "draft_vocab").iterdir()) == [
        "d2t-64.npy",
        "draft_vocab.json",
        "t2d-64.npy",
        "token_freq.pt",
        "vocab_mapping.pt",
    ]
