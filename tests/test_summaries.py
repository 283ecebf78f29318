"""What a person sees: objects shown in a notebook cell or printed read as summaries (not
dataclass dumps), the plan's text table keeps whole words, the budget chart says why a bar
has its colour (issue 27 item 4 and item 1's legend)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import polars as pl

from kit.plan.pilots import PilotResult, Throughput
from kit.report import charts
from kit.report.validate import ValidationResult
from kit.types import Sampling


def test_validation_result_shows_its_summary():
    ok = ValidationResult(Path("/x/export"), files_checked=1, rows_checked=1200)
    assert repr(ok) == str(ok) == "export /x/export: 1 file, 1,200 rows: OK"
    bad = ValidationResult(Path("e"), ["a.jsonl line 3: no id"], files_checked=2, rows_checked=1)
    assert repr(bad).splitlines() == [
        "export e: 2 files, 1 row: 1 problem",
        "  a.jsonl line 3: no id",
    ]


def test_pilot_result_and_throughput_read_as_sentences():
    frame = pl.DataFrame(
        {
            "dataset": ["a", "a", "b", "b"],
            "prompt_id": ["1", "2", "3", "4"],
            "completion_tokens": [10, 128, 50, 70],
            "finish_reason": ["stop", "length", "stop", "stop"],
            "latency_s": [1.0, 2.0, 1.0, 1.0],
            "t_done": [1.0, 2.0, 1.0, 1.0],
        }
    )
    pilot = PilotResult(frame, wall_s=2.0, sampling=Sampling(max_tokens=128), concurrency=4)
    text = repr(pilot)
    assert text.startswith("PilotResult: 4 completions of 2 datasets in 2.0 s, 0 failed;")
    assert "1 stopped at max_tokens=128 (25%)" in text and "DataFrame" not in text
    assert (
        str(Throughput(212.34, 16, 20.05))
        == "212.3 tok/s with 16 requests in flight (measured over 20.1 s)"
    )


def budget_spec(report) -> tuple[dict, dict]:
    spec = charts.budget_vs_actual(report).to_dict()
    rows = next(iter(spec["datasets"].values()))
    return {r["dataset"]: r["state"] for r in rows}, spec["layer"][0]["encoding"]["color"]


def test_budget_bars_are_coloured_by_the_allowance_with_a_legend():
    datasets = pl.DataFrame(
        {
            "dataset": ["under", "at", "inside", "beyond"],
            "tokens": [500, 1030, 1400, 3000],
            "budget": [1000, 1000, 1000, 1000],
        }
    )
    findings = pl.DataFrame(
        {"dataset": ["inside", "beyond"], "check": ["overshoot", "over_budget"]}
    )
    states, color = budget_spec(SimpleNamespace(datasets=datasets, findings=findings))
    assert states == {
        "under": "under budget",
        "at": "at budget",
        "inside": "over, inside the allowance",
        "beyond": "over the allowance",
    }
    assert color["field"] == "state" and color["title"] == "against the budget"
    assert color["scale"]["domain"] == list(charts.BUDGET_STATES)  # every class in the legend
    # a bare frame has no findings: nothing is called over the allowance
    states, _ = budget_spec(datasets)
    assert states["beyond"] == "over, inside the allowance"


def test_plan_rows_without_an_upper_end_read_as_such():
    from kit.report.widgets import summary_frame

    row = {
        "dataset": "multi_turn",
        "budget": 1500,
        "mean": 104.2,
        "samples_needed": 15,
        "samples_low": 8,
        "samples_high": None,
        "samples_needed_upper": 31,
        "prompts_available": 75,
        "hours_to_go": 0.001,
        "hours_low": 0.0005,
        "hours_high": None,
        "cap_tokens": 6252.0,
        "overshoot": 4.17,
    }
    out = summary_frame(pl.DataFrame([row])).row(0, named=True)
    assert out["samples (90%)"] == "15 (8 or more)" and out["time (90%)"] == "<1 min"
    assert out["cap tokens"] == "6,252 (x4.17)"
