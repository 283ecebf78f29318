"""What the charts draw, read from their specs and from Vega's own layout (vl-convert's
scenegraph): every bar and its label inside the chart's width, whole-number ticks on count
axes, and the throughput drawn at the rate the pilot measures (kit.plan.measure_throughput).
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from test_plan import _story_table

from kit.plan.pilots import measure_throughput
from kit.report import charts

GLYPH_EM = 0.65  # widest digit, "x" or "%" of a sans-serif font, in font sizes (DejaVu: 0.64)


def scene(chart) -> dict:
    """Vega's laid-out scenegraph of a chart (marks with their pixel positions)."""
    import vl_convert as vlc

    return vlc.vegalite_to_scenegraph(chart.to_dict())["scenegraph"]


def marks(node: dict, role: str = "mark") -> list[tuple[str, dict]]:
    """(marktype, item) of every item under `node` whose mark has this role."""
    found = []
    for item in node.get("items", []):
        if item.get("role") == role:
            found += [(item["marktype"], it) for it in item.get("items", [])]
        found += marks(item, role)
    return found


def assert_inside(chart, at_least: float = 0.6) -> None:
    """No bar or text mark ends past the plot's width; the longest bar uses `at_least` of it."""
    root = scene(chart)
    width = root["items"][0]["width"]
    ends = []
    for kind, item in marks(root):
        if kind == "rect":
            ends.append((item["x"] + item["width"], "bar", item.get("description")))
        elif kind == "text":
            right = item["x"] + item.get("dx", 0) + len(item["text"]) * GLYPH_EM * item["fontSize"]
            ends.append((right, "label", item["text"]))
    over = [e for e in ends if e[0] > width + 0.5]
    assert not over, f"past the chart's {width} px: {over}"
    longest = max(end for end, kind, _ in ends if kind == "bar")
    assert longest >= at_least * width, (longest, width)  # the room is for labels, not waste


def test_cap_chart_holds_its_longest_bars_and_their_labels():
    table = _story_table()
    chart = charts.budget_vs_cap(table)
    x = chart.to_dict()["layer"][0]["encoding"]["x"]
    rows = table.filter(pl.col("dataset") != "TOTAL")
    top = max(rows["budget"].max(), rows["cap_tokens"].max())
    width = chart.to_dict()["width"]
    assert x["scale"]["domain"][1] >= top * width / (width - charts.LABEL_PX)
    assert_inside(chart)


def test_budget_chart_holds_an_overshoot_and_its_label():
    frame = pl.DataFrame(
        {
            "dataset": ["a", "b", "c"],
            "tokens": [1_130, 2_000, 1_500],
            "budget": [1_000, 2_000, 2_000],
        }
    )
    chart = charts.budget_vs_actual(frame)
    labels = sorted(it["text"] for kind, it in marks(scene(chart)) if kind == "text")
    assert labels == ["100%", "113%", "75%"]  # 2,000 ends the axis: its label needs room
    assert_inside(chart)


def test_count_axes_tick_at_whole_numbers():
    frame = pl.DataFrame(
        {"dataset": ["a"] * 4 + ["b"] * 3, "completion_tokens": [10, 20, 20, 30, 5, 9, 9]}
    )
    chart = charts.length_distribution(frame, bins=5)
    hist = chart.to_dict()["vconcat"][1]["spec"]["encoding"]["y"]
    assert (hist["axis"]["tickMinStep"], hist["axis"]["format"]) == (1, ",d")
    labels = [it["text"] for _, it in marks(scene(chart), "axis-label")]
    assert "1" in labels and "2" in labels  # the counts axis is drawn ...
    assert not [t for t in labels if "." in t], labels  # ... and never at 0.5
    finish = pl.DataFrame({"dataset": ["a", "a", "b"], "finish_reason": ["stop", "length", "stop"]})
    x = charts.finish_reasons(finish).to_dict()["encoding"]["x"]
    assert x["axis"]["tickMinStep"] == 1
    samples = charts.samples_needed(_story_table()).to_dict()["layer"][0]["encoding"]["x"]
    assert samples["axis"]["tickMinStep"] == 1


def _total_rate(chart) -> dict[float, float]:
    """minutes -> tokens/s summed over datasets (the top of the stack), last closing point off."""
    spec = chart.to_dict()
    steps = next(iter(spec["datasets"].values()))
    out: dict[float, float] = {}
    for v in steps:
        out[v["minutes"]] = out.get(v["minutes"], 0.0) + v["tokens_per_s"]
    return dict(sorted(out.items())[:-1])


def lockstep(slots=32, batches=10, latency=12.0, t0=1.8e9) -> pl.DataFrame:
    """A batch of `slots` requests sent together, all ending together (max_tokens answers)."""
    rows = [
        {
            "dataset": "ab"[k % 2],
            "completion_tokens": 100 + k,
            "latency_s": latency,
            "t_done": t0 + latency * (b + 1),
        }
        for b in range(batches)
        for k in range(slots)
    ]
    return pl.DataFrame(rows)


def test_throughput_of_a_lockstep_run_is_the_pilots_rate_not_a_spike():
    frame = lockstep()
    pilot = measure_throughput(frame, 32).tokens_per_s
    chart = charts.throughput(frame, bins=40)  # 3 s steps, 4 a batch
    rates = list(_total_rate(chart).values())
    assert rates == pytest.approx([pilot] * len(rates), rel=0.01)  # within 1% at every step
    # the same steps counted by completions (tokens at t_done) would spike to 4x
    width = 120.0 / 40
    done = frame.with_columns(step=((pl.col("t_done") - 1.8e9 - 1e-9) / width).floor())
    spikes = done.group_by("step").agg(pl.col("completion_tokens").sum() / width)
    assert spikes["completion_tokens"].max() > 3.5 * pilot


def test_throughput_of_staggered_requests_is_the_pilots_rate():
    """16 slots sending back to back, each at its own rate and random latencies: the drawn
    rate equals the pilot's at every step the pipe is full (within 1%), and the steps add up
    to every token."""
    rng = np.random.default_rng(0)
    rows, ends = [], []
    for slot in range(16):
        t, speed = 0.0, 5.0 + slot  # tokens/s of this slot
        for _ in range(12):
            latency = float(rng.uniform(2.0, 9.0))
            t += latency
            rows.append(
                {
                    "dataset": f"d{slot % 3}",
                    "completion_tokens": round(speed * latency),
                    "latency_s": latency,
                    "t_done": 1.8e9 + t,
                }
            )
        ends.append(t)
    frame = pl.DataFrame(rows)
    pilot = measure_throughput(frame, 16)
    full_until = min(ends)  # every slot busy from 0 to here
    width = max(ends) / 40
    steps = _total_rate(charts.throughput(frame, bins=40))
    full = [r for m, r in steps.items() if m * 60 + width <= full_until]
    assert len(full) >= 20 and full == pytest.approx([pilot.tokens_per_s] * len(full), rel=0.01)
    assert sum(steps.values()) * width == pytest.approx(frame["completion_tokens"].sum())
    drawn = next(iter(charts.throughput(frame, bins=40).to_dict()["datasets"].values()))
    assert min(v["tokens_per_s"] for v in drawn) >= 0  # a dataset done draws 0, not -1e-12


def test_planner_charts_share_a_row_that_wraps():
    """The planner's two charts side by side where the notebook is wide enough, one under the
    other where it is not: never one chart twice their width, cut by the output area."""
    from kit.report.widgets import Planner

    samples = {name: [40 + 9 * k for k in range(30)] for name in ("alpaca_tasks", "essays")}
    planner = Planner(
        1000, samples, prompts_available={"alpaca_tasks": 74, "essays": 75}, throughput=250.0
    )
    row = planner.widget.children[-1]
    assert row.layout.flex_flow == "row wrap" and list(row.children) == planner.charts


def test_notebook_charts_are_svg():
    """enable_offline draws in SVG, where the browser test measures each bar and label."""
    import altair as alt

    before, options = alt.renderers.active, dict(alt.renderers.options)
    try:
        charts.enable_offline()
        assert alt.renderers.active == "jupyter"
        assert alt.renderers.options == {"offline": True, "embed_options": {"renderer": "svg"}}
    finally:
        alt.renderers.enable(before, **options)
