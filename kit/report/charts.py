"""Altair chart builders for planning and auditing. They return charts and never display.

The audit charts take a records frame (kit.run.reader.records_frame) or an AuditReport and
aggregate in polars first (a chart's data holds bins, not records); the planning charts take
kit.plan.budget()'s table. altair is imported inside each builder, so `import kit` stays
light. Render in a notebook by leaving the chart as the cell's value; save with
`chart.save("x.png")` (vl-convert) or `chart.to_dict()`.
"""

from __future__ import annotations

import math

from kit.errors import ConfigError
from kit.types import record_columns


def enable_offline() -> None:
    """Draw charts in Jupyter without a CDN (altair's default loads Vega from
    cdn.jsdelivr.net, so offline every chart cell stays blank): once, before the first chart.
    They are drawn as SVG: sharp at any zoom, and each mark's place can be read in the page."""
    import altair as alt

    alt.renderers.enable("jupyter", offline=True, embed_options={"renderer": "svg"})


# ---------------------------------------------------------------- audit charts


def _records(records_or_report, *columns: str):
    """These record columns of an AuditReport's records or of a records frame."""
    frame = getattr(records_or_report, "records", records_or_report)
    return frame.select(record_columns(*columns))


LABEL_PX = 52  # room right of a bar's end for its text label ("4.62x", "113%")


def _counts(title: str):
    """An axis of counts: whole-number ticks only (never 0.5 records), thousands separated."""
    import altair as alt

    return alt.Axis(title=title, tickMinStep=1, format=",d")


def _tokens(title: str, top: float | None = None, width: int | None = None) -> dict:
    """alt.X keywords for a token axis in short numbers (5k, 1.2M); with `top` and `width` a
    scale from 0 that leaves LABEL_PX after `top` inside the chart, so no label runs past it."""
    import altair as alt

    zero = "datum.value == 0 ? '0' : datum.label"  # "0", not "0k"
    out = {"axis": alt.Axis(title=title, format="~s", labelExpr=zero)}
    if top is not None and width is not None:
        out["scale"] = alt.Scale(domain=[0, (top or 1) * width / (width - LABEL_PX)])
    return out


def token_distributions(records, *, bins: int = 40):
    """Completion-length histograms faceted by dataset (`bins` shared edges) beside box
    plots per dataset (rule min-max, bar q1-q3, tick median): an alt.HConcatChart.

    Example: token_distributions(kit.audit(run_dir)).save("lengths.png")
    """
    import altair as alt

    data = _records(records, "dataset", "completion_tokens")
    boxes, hist = _spread(data, "completion_tokens", False, bins, "records", width=320)
    return alt.hconcat(hist, boxes).properties(title="completion-length distributions")


# budget_vs_actual's classes, in legend order, and their colours
BUDGET_STATES = {
    "under budget": "#9e9e9e",  # stopped below it (prompts ran out, or not finished)
    "at budget": "#4c78a8",  # within overshoot_share (5%) of it
    "over, inside the allowance": "#f2a93b",  # audit finding "overshoot": a warning
    "over the allowance": "#d62728",  # audit finding "over_budget": an error
}


def budget_vs_actual(audit_or_frames):
    """Completion tokens per dataset as bars coloured by where they stand against the budget
    (a legend names each class), the budget as a tick, tokens / budget as a label.

    The classes follow the audit's budget findings: over by more than the allowance
    (max(1% of the budget, one max_tokens)) is "over_budget", over by more than 5% inside it
    is "overshoot" (a large share only when one max_tokens is large next to the budget).

    `audit_or_frames`: an AuditReport (its findings say which datasets are over), or a
    frame with dataset, tokens, budget columns (report.datasets; then any dataset over by
    more than 5% is drawn as "over, inside the allowance").

    Example: budget_vs_actual(kit.audit(run_dir))
    """
    import altair as alt
    import polars as pl

    frame = getattr(audit_or_frames, "datasets", audit_or_frames)
    findings = getattr(audit_or_frames, "findings", None)
    beyond = []  # datasets the audit found over the allowance
    if findings is not None:
        beyond = findings.filter(pl.col("check") == "over_budget")["dataset"].to_list()
    share = pl.when(pl.col("budget") > 0).then(pl.col("tokens") / pl.col("budget"))
    data = frame.select("dataset", "tokens", "budget").with_columns(share=share)
    data = data.with_columns(
        state=pl.when(pl.col("dataset").is_in(beyond))
        .then(pl.lit("over the allowance"))
        .when(pl.col("share").is_null() | (pl.col("share") < 1))
        .then(pl.lit("under budget"))
        .when(pl.col("share") <= 1.05)
        .then(pl.lit("at budget"))
        .otherwise(pl.lit("over, inside the allowance"))
    )
    base = alt.Chart(data).encode(y=alt.Y("dataset:N", title=None))
    scale = alt.Scale(domain=list(BUDGET_STATES), range=list(BUDGET_STATES.values()))
    legend = alt.Legend(orient="bottom", columns=2)
    width = 420
    top = max(data["tokens"].max() or 0, data["budget"].max() or 0)
    bars = base.mark_bar().encode(
        x=alt.X("tokens:Q", **_tokens("completion tokens", top, width)),
        color=alt.Color("state:N", scale=scale, title="against the budget", legend=legend),
        tooltip=["dataset", "tokens", "budget", "state", alt.Tooltip("share:Q", format=".1%")],
    )
    budget = base.mark_tick(color="black", thickness=3, size=28).encode(x="budget:Q")
    label = base.mark_text(align="left", dx=4).encode(
        x="tokens:Q", text=alt.Text("share:Q", format=".0%")
    )
    return (bars + budget + label).properties(
        title="completion tokens vs budget (tick = budget, label = tokens / budget)", width=width
    )


def finish_reasons(records):
    """Stacked bars of finish reasons (stop, length, ...) per dataset.

    Example: finish_reasons(records_frame(run_dir))
    """
    import altair as alt
    import polars as pl

    data = (
        _records(records, "dataset", "finish_reason")
        .group_by("dataset", "finish_reason")
        .agg(count=pl.len())
    )
    data = data.with_columns(share=pl.col("count") / pl.col("count").sum().over("dataset"))
    return (
        alt.Chart(data.sort("dataset", "finish_reason"))
        .mark_bar()
        .encode(
            x=alt.X("count:Q", stack="zero", axis=_counts("records")),
            y=alt.Y("dataset:N", title=None),
            color=alt.Color("finish_reason:N", title="finish reason"),
            tooltip=["dataset", "finish_reason", "count", alt.Tooltip("share:Q", format=".1%")],
        )
        .properties(title="finish reasons", width=420)
    )


def throughput(records, *, bins: int = 40):
    """Completion tokens per second per dataset over the run, stacked, flat over each of
    `bins` buckets (of at least a second): the rate kit.plan.measure_throughput averages (the
    pilot's), each record's tokens spread evenly over its request's time in flight (t_done -
    latency_s to t_done), so a batch finishing together is no spike. A record without a
    latency counts at its t_done.

    Example: throughput(records_frame(run_dir))
    """
    import altair as alt
    import numpy as np
    import polars as pl

    data = _records(records, "dataset", "completion_tokens", "latency_s", "t_done")
    data = data.with_columns(
        pl.col("latency_s").fill_null(0.0).clip(lower_bound=0.0),
        pl.col("completion_tokens").fill_null(0).cast(pl.Float64),
    ).with_columns(t_sent=pl.col("t_done") - pl.col("latency_s"))
    t0 = data["t_sent"].min() or 0.0
    span = (data["t_done"].max() or 0.0) - t0
    width = max(span / bins, 1.0)
    edges = width * np.arange(max(1, math.ceil(span / width)) + 1)  # seconds since t0
    parts = []
    for (name,), part in sorted(data.partition_by("dataset", as_dict=True).items()):
        sent, done = (part[c].to_numpy() - t0 for c in ("t_sent", "t_done"))
        got = _delivered(sent, done, part["completion_tokens"].to_numpy(), edges)
        rate = np.clip(np.diff(got) / width, 0.0, None)  # no -1e-12 from rounding
        rate = np.append(rate, rate[-1])  # the last edge closes the last step
        parts.append(pl.DataFrame({"dataset": name, "minutes": edges / 60, "tokens_per_s": rate}))
    schema = {"dataset": pl.String, "minutes": pl.Float64, "tokens_per_s": pl.Float64}
    data = pl.concat(parts) if parts else pl.DataFrame(schema=schema)
    return (
        alt.Chart(data)
        .mark_area(interpolate="step-after", opacity=0.8)
        .encode(
            x=alt.X("minutes:Q", title="minutes since the first request"),
            y=alt.Y(
                "tokens_per_s:Q",
                stack="zero",
                title="completion tokens / s",
                axis=alt.Axis(format="~s"),
            ),
            color=alt.Color("dataset:N"),
            tooltip=["dataset", "minutes", alt.Tooltip("tokens_per_s:Q", format=".1f")],
        )
        .properties(
            title=f"throughput (each request's tokens over its time in flight; {width:.0f} s steps)",
            width=480,
        )
    )


def _delivered(sent, done, tokens, at):
    """Tokens delivered by each time in `at` when each request's tokens arrive evenly from
    `sent` to `done` (all at `done` when they are equal): one sorted pass, any row count."""
    import numpy as np

    span = done - sent
    rate = np.divide(tokens, span, out=np.zeros_like(tokens), where=span > 0)
    times = np.concatenate([sent, done])
    order = np.argsort(times, kind="stable")
    slope = np.concatenate([rate, -rate])[order].cumsum()  # tokens/s of requests in flight
    offset = np.concatenate([rate * sent, -rate * sent])[order].cumsum()
    finished = np.concatenate([np.where(span > 0, 0.0, tokens), np.where(span > 0, tokens, 0.0)])
    finished = finished[order].cumsum()
    i = np.searchsorted(times[order], at, side="right") - 1
    j = np.clip(i, 0, None)
    return np.where(i >= 0, finished[j] + at * slope[j] - offset[j], 0.0)


def completion_vs_prompt(records, *, max_points: int = 5000, seed: int = 0):
    """Completion tokens against prompt tokens, coloured by dataset, shaped by finish reason;
    rows without prompt_tokens left out, a seeded sample of `max_points` for large runs.

    Example: completion_vs_prompt(records_frame(run_dir))
    """
    import altair as alt

    data = _records(records, "dataset", "prompt_tokens", "completion_tokens", "finish_reason")
    data = data.drop_nulls("prompt_tokens")
    if data.height > max_points:
        data = data.sample(max_points, seed=seed)
    return (
        alt.Chart(data)
        .mark_point(filled=True, opacity=0.6)
        .encode(
            x=alt.X("prompt_tokens:Q", **_tokens("prompt tokens")),
            y=alt.Y("completion_tokens:Q", **_tokens("completion tokens")),
            color=alt.Color("dataset:N"),
            shape=alt.Shape("finish_reason:N", title="finish reason"),
            tooltip=data.columns,
        )
        .properties(title="completion vs prompt length", width=420)
    )


# ---------------------------------------------------------------- planning charts (kit.plan)


def _length_bins(frame, column: str, log: bool, bins: int):
    """Histogram counts and box statistics per dataset, computed in polars (any row count)."""
    import polars as pl

    v = pl.col("v")
    data = frame.select("dataset", pl.col(column).cast(pl.Float64).alias("v")).drop_nulls()
    t = data.with_columns(v.clip(lower_bound=1).log10()) if log else data
    lo, hi = t["v"].min() or 0.0, t["v"].max() or 0.0
    width = (hi - lo) / bins or 1.0
    back = (lambda e: 10**e) if log else (lambda e: e)  # noqa: E731  bin edges in tokens
    hist = (
        t.with_columns(bin=((v - lo) / width).floor().clip(0, bins - 1).cast(pl.Int64))
        .group_by("dataset", "bin")
        .len("count")
        .with_columns(
            start=back(lo + pl.col("bin") * width), end=back(lo + (pl.col("bin") + 1) * width)
        )
        .sort("dataset", "bin")
    )
    box = data.group_by("dataset").agg(
        n=pl.len(),
        min=v.min(),
        q1=v.quantile(0.25, "linear"),
        median=v.median(),
        q3=v.quantile(0.75, "linear"),
        max=v.max(),
        mean=v.mean(),
    )
    return hist, box.sort("dataset")


def _spread(frame, column: str, log: bool, bins: int, unit: str, width: int = 420):
    """(box plots per dataset, histogram faceted by dataset) of a length column."""
    import altair as alt

    hist, box = _length_bins(frame, column, log, bins)
    scale = alt.Scale(type="log") if log else alt.Scale(zero=True)
    x_title = column.replace("_", " ") + (" (log)" if log else "")
    axis = _tokens(x_title)["axis"]
    color = alt.Color("dataset:N", legend=None)
    base = alt.Chart(box).encode(
        y=alt.Y("dataset:N", title=None), color=color, tooltip=list(box.columns)
    )
    boxes = alt.layer(
        base.mark_rule().encode(x=alt.X("min:Q", scale=scale, axis=axis), x2="max:Q"),
        base.mark_bar(size=12).encode(x="q1:Q", x2="q3:Q"),
        base.mark_tick(size=14, thickness=2).encode(x="median:Q", color=alt.value("black")),
    ).properties(width=width, title=f"{x_title} per dataset")
    bars = (
        alt.Chart(hist)
        .mark_bar()
        .encode(
            x=alt.X("start:Q", bin="binned", scale=scale, axis=axis),
            x2="end:Q",
            y=alt.Y("count:Q", axis=_counts(unit)),
            y2=alt.datum(0),
            color=color,
            tooltip=["dataset", "start", "end", "count"],
        )
        .properties(width=width, height=80)
        .facet(row=alt.Row("dataset:N", title=None))
        .resolve_scale(y="independent")
    )
    return boxes, bars


def length_distribution(
    frame, column: str = "completion_tokens", *, log: bool = False, bins: int = 40
):
    """Box plots per dataset above a histogram per dataset of a length column of `frame` (a
    pilot frame, records, a prompt frame with prompt_tokens); `log`: bins equal in log space.

    Example: length_distribution(pilot_result.frame, log=True).save("pilot.png")
    """
    import altair as alt

    if frame.select(column).drop_nulls().height == 0:
        raise ConfigError(f"frame has no {column!r} values to chart")
    return alt.vconcat(*_spread(frame, column, log, bins, "rows"))


def samples_needed(plan_frame):
    """Samples each budget needs: a point at the estimate, an error bar up to the upper bound,
    a red tick at the prompts available.

    Example: samples_needed(kit.plan.budget(budgets, pilot, prompts_available=prompts))
    """
    import altair as alt
    import polars as pl

    data = plan_frame.filter(pl.col("dataset") != "TOTAL").select(
        "dataset",
        "samples_needed",
        pl.col("samples_needed_upper").fill_null(pl.col("samples_needed")),
        "prompts_available",
        "shortfall",
    )
    base = alt.Chart(data).encode(y=alt.Y("dataset:N", title=None))
    return alt.layer(
        base.mark_errorbar(ticks=True).encode(
            x=alt.X("samples_needed:Q", axis=_counts("samples")), x2="samples_needed_upper:Q"
        ),
        base.mark_point(filled=True, size=80).encode(
            x="samples_needed:Q",
            color=alt.Color("shortfall:N", title="shortfall"),
            tooltip=list(data.columns),
        ),
        base.mark_tick(color="red", thickness=2, size=18).encode(x="prompts_available:Q"),
    ).properties(width=360, title="samples needed (point, upper bound) vs prompts available (red)")


def budget_vs_cap(plan_frame):
    """Each dataset's token budget beside what a per-dataset sample cap would produce, with
    a "2.66x" overshoot label.

    Example: budget_vs_cap(kit.plan.budget(10_000_000, pilot, prompts_available=p, sample_cap=7000))
    """
    import altair as alt
    import polars as pl

    rows = plan_frame.filter(pl.col("dataset") != "TOTAL")
    long = rows.select("dataset", "cap", budget="budget", **{"sample cap": "cap_tokens"}).unpivot(
        ["budget", "sample cap"],
        index=["dataset", "cap"],
        variable_name="kind",
        value_name="tokens",
    )
    labels = rows.select(
        "dataset", "cap_tokens", pl.format("{}x", pl.col("overshoot").round(2)).alias("label")
    )
    y = alt.Y("dataset:N", title=None)
    width = 360
    top = long["tokens"].max() or 0
    bars = (
        alt.Chart(long)
        .mark_bar()
        .encode(
            x=alt.X("tokens:Q", **_tokens("completion tokens", top, width)),
            y=y,
            yOffset="kind:N",
            color=alt.Color("kind:N", title=None, legend=alt.Legend(orient="bottom")),
            tooltip=["dataset", "kind", "tokens", "cap"],
        )
    )
    text = (
        alt.Chart(labels)
        .mark_text(align="left", dx=4)
        .encode(x="cap_tokens:Q", y=y, text="label:N")
    )
    return alt.layer(bars, text).properties(
        width=width, title="token budget vs a sample cap (overshoot)"
    )
