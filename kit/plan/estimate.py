"""Budget math: samples needed per completion-token budget, bounds, time to go.

Pure functions over polars frames (the pilot, in kit/plan/pilots.py, is the one that talks
to a server). A plan answers, before any GPU hour is spent: how many samples each
dataset's completion-token budget needs (with an upper confidence bound), whether its
prompts suffice, how long the run takes, and what a naive per-dataset sample cap would
produce instead. Re-exported as kit.plan.budget, kit.plan.TOTAL.

    res = await kit.plan.pilot(prompts, config, per_dataset=32)   # config: a kit.RunConfig
    table = kit.plan.budget({"sharegpt": 10_000_000}, res, prompts_available=prompts,
                            throughput=1500, sample_cap=7000)
    kit.plan.write_plan(run_dir, table, config, pilot=res)
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import TYPE_CHECKING, Any

from kit.plan.lengths import _truncated_expr, profile
from kit.plan.pilots import PilotResult
from kit.types import Budget

if TYPE_CHECKING:
    import polars as pl

TOTAL = "TOTAL"  # the dataset name of the summary row
CENSORED_SHARE = 0.05  # above this share of completions hitting max_tokens, the mean is censored


# ---------------------------------------------------------------- inputs


def _samples_frame(samples: Any) -> pl.DataFrame:
    """Completion-length samples as a frame with dataset, completion_tokens[, finish_reason]."""
    import polars as pl

    if isinstance(samples, PilotResult):
        samples = samples.frame
    if isinstance(samples, dict):
        rows = [(d, int(v)) for d, values in samples.items() for v in values]
        samples = pl.DataFrame(
            rows, schema={"dataset": pl.String, "completion_tokens": pl.Int64}, orient="row"
        )
    if not isinstance(samples, pl.DataFrame):
        raise ValueError(
            f"samples must be a frame, a dict or a PilotResult, got {type(samples).__name__}"
        )
    for name in ("dataset", "completion_tokens"):
        if name not in samples.columns:
            raise ValueError(f"samples has no {name!r} column (columns: {samples.columns})")
    samples = samples.filter(pl.col("completion_tokens").is_not_null())
    if samples.height == 0:
        raise ValueError("samples is empty: the pilot produced no completions to plan from")
    return samples


def _counts(value: Any, field: str) -> dict[str, int]:
    """A dataset -> int mapping from a dict or a frame with a dataset column (rows counted)."""
    import polars as pl

    if isinstance(value, pl.DataFrame):
        if "dataset" not in value.columns:
            raise ValueError(f"{field} frame has no 'dataset' column (columns: {value.columns})")
        return dict(value.group_by("dataset").len().iter_rows())
    if not isinstance(value, dict):
        raise ValueError(
            f"{field} must be a dict dataset -> count or a prompt frame, got {type(value).__name__}"
        )
    for name, count in value.items():
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"{field}[{name!r}] must be an int >= 0, got {count!r}")
    return dict(value)


def _budgets(budgets: Any, names: list[str]) -> dict[str, float]:
    """Validated budgets: a dict, or one number for every dataset in names."""
    if not isinstance(budgets, dict):
        budgets = {name: budgets for name in names}
    Budget(tokens=budgets)  # raises ValueError naming the dataset and the value
    if not budgets:
        raise ValueError("budgets is empty: give at least one dataset's token budget")
    return budgets


def _progress(done: Any) -> dict[str, tuple[int, int]]:
    """Progress so far: dataset -> (samples, tokens), from a dict or a frame."""
    import polars as pl

    if done is None:
        return {}
    if isinstance(done, pl.DataFrame):
        if {"samples_done", "tokens_done"} <= set(done.columns):
            return {
                r[0]: (int(r[1]), int(r[2]))
                for r in done.select("dataset", "samples_done", "tokens_done").rows()
            }
        if "completion_tokens" in done.columns:  # raw records
            agg = done.group_by("dataset").agg(pl.len(), pl.col("completion_tokens").sum())
            return {r[0]: (int(r[1]), int(r[2])) for r in agg.rows()}
        raise ValueError(
            f"done frame needs samples_done/tokens_done or completion_tokens (columns: {done.columns})"
        )
    out = {}
    for name, pair in done.items():
        if len(pair) != 2 or min(pair) < 0:
            raise ValueError(f"done[{name!r}] must be (samples, tokens) >= 0, got {pair!r}")
        out[name] = (int(pair[0]), int(pair[1]))
    return out


def _positive(value: Any, field: str, allow_none: bool = True) -> None:
    """Raise ValueError unless value is a positive finite number (or None when allowed)."""
    if value is None and allow_none:
        return
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )
    if not ok:
        raise ValueError(f"{field} must be a positive number, got {value!r}")


def _check_known(budgets: dict, stats: dict, available: dict) -> None:
    """Every budgeted dataset must have samples and a prompt count."""
    for name in budgets:
        if name not in stats:
            raise ValueError(
                f"budgets[{name!r}]: dataset has no completion samples (samples has: {sorted(stats)})"
            )
        if name not in available:
            raise ValueError(
                f"budgets[{name!r}]: dataset not in prompts_available (has: {sorted(available)})"
            )


def t_quantile(confidence: float, dof: int) -> float:
    """One-sided Student-t quantile (Cornish-Fisher expansion; within 0.5% for dof >= 2).

    Example:
        >>> round(t_quantile(0.95, 9), 3)
        1.833
    """
    z = NormalDist().inv_cdf(confidence)
    if dof < 1:
        return math.inf
    g = [
        (z**3 + z) / 4,
        (5 * z**5 + 16 * z**3 + 3 * z) / 96,
        (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
        (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160,
    ]
    return z + sum(gi / dof ** (i + 1) for i, gi in enumerate(g))


# ---------------------------------------------------------------- budget


def budget(
    budgets: dict[str, float] | float,
    samples: Any,
    *,
    prompts_available: dict[str, int] | pl.DataFrame,
    done: dict[str, tuple[int, int]] | pl.DataFrame | None = None,
    throughput: float | None = None,
    max_tokens: int | None = None,
    confidence: float = 0.95,
    sample_cap: int | None = None,
) -> pl.DataFrame:
    """Samples each completion-token budget needs, with bounds, shortfall, time and a cap's cost.

    Args:
        budgets: dataset -> completion tokens, or one number for every sampled dataset.
        samples: completion lengths: a frame (dataset, completion_tokens[, finish_reason]),
            a PilotResult, or a dict dataset -> list of lengths.
        prompts_available: dataset -> samples the prompts can give, or a prompt frame.
        done: progress so far, dataset -> (samples, tokens), or a frame (records, or
            samples_done/tokens_done columns). The remainder is planned at the sample mean.
        throughput: completion tokens/s of the whole run (for hours_to_go, cap_hours).
        max_tokens: the pilot's max_tokens (lengths >= it count as truncated; default: a
            PilotResult's own).
        confidence: one-sided level of samples_needed_upper (Student-t on the mean).
        sample_cap: the naive alternative to compare: this many samples per dataset
            (default: every prompt).

    Returns:
        One row per dataset plus a "TOTAL" row: budget, n_pilot, mean, std, p50, p90, p99,
        truncated_share, mean_lower, samples_done, tokens_done, tokens_remaining,
        samples_needed (ceil(remaining / mean)), samples_needed_upper (ceil(remaining /
        mean_lower)), prompts_available, shortfall, max_tokens_available, hours_to_go, cap,
        cap_tokens, overshoot (cap_tokens / budget), cap_hours, recommended_max_tokens, note.

    Example:
        >>> t = budget({"sharegpt": 10_000_000}, {"sharegpt": [3793] * 50},
        ...            prompts_available={"sharegpt": 88_000}, sample_cap=7000)
        >>> t.filter(pl.col("dataset") == "sharegpt").select("samples_needed", "cap_tokens", "overshoot").row(0)
        (2637, 26551000.0, 2.6551)
    """
    import polars as pl

    if max_tokens is None and isinstance(samples, PilotResult):
        max_tokens = samples.sampling.max_tokens
    frame = _samples_frame(samples)
    stats = {
        row["dataset"]: row for row in profile(frame, max_tokens=max_tokens).iter_rows(named=True)
    }
    available = _counts(prompts_available, "prompts_available")
    wanted = _budgets(budgets, sorted(stats))
    _check_known(wanted, stats, available)
    _positive(throughput, "throughput")
    _positive(sample_cap, "sample_cap")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    progress = _progress(done)
    uncensored = _uncensored_p99(frame, max_tokens)
    rows = [
        _plan_row(
            name,
            wanted[name],
            stats[name],
            available[name],
            progress.get(name, (0, 0)),
            throughput=throughput,
            confidence=confidence,
            sample_cap=sample_cap,
            max_tokens=max_tokens,
            p99_uncensored=uncensored.get(name),
        )
        for name in sorted(wanted)
    ]
    table = pl.DataFrame(rows, schema=plan_schema(), orient="row")
    return pl.concat([table, _total_row(table, throughput)])


_PLAN_COLUMNS = """dataset:String budget:Float64 n_pilot:Int64 mean:Float64 std:Float64 p50:Float64
    p90:Float64 p99:Float64 truncated_share:Float64 mean_lower:Float64 samples_done:Int64
    tokens_done:Int64 tokens_remaining:Float64 samples_needed:Int64 samples_needed_upper:Int64
    prompts_available:Int64 shortfall:Boolean max_tokens_available:Float64 hours_to_go:Float64
    cap:Int64 cap_tokens:Float64 overshoot:Float64 cap_hours:Float64 recommended_max_tokens:Int64
    note:String"""  # name:polars dtype, the budget() table in order


def plan_schema() -> dict:
    """The budget() table's schema: column name -> polars dtype.

    Example:
        >>> list(plan_schema())[:4]
        ['dataset', 'budget', 'n_pilot', 'mean']
    """
    import polars as pl

    return {n: getattr(pl, t) for n, t in (c.split(":") for c in _PLAN_COLUMNS.split())}


def _plan_row(
    name,
    target,
    st,
    available,
    progress,
    *,
    throughput,
    confidence,
    sample_cap,
    max_tokens,
    p99_uncensored,
):
    """One dataset's plan row (values in plan_schema() order)."""
    mean, std, n = st["mean"], st["std"], st["n"]
    half = t_quantile(confidence, n - 1) * std / math.sqrt(n) if std is not None and n > 1 else None
    lower = mean - half if half is not None else None
    s_done, t_done = progress
    remaining = max(target - t_done, 0.0)
    needed = math.ceil(remaining / mean) if mean > 0 else None
    upper = math.ceil(remaining / lower) if lower and lower > 0 else None
    left = max(available - s_done, 0)
    shortfall = needed is None or needed > left
    expected = min(remaining, left * mean)
    cap = min(sample_cap or available, available)
    cap_tokens = cap * mean
    censored = st["truncated_share"] is not None and st["truncated_share"] > CENSORED_SHARE
    recommend = _recommend_max_tokens(max_tokens, st["max"], p99_uncensored) if censored else None
    note = _note(st, needed, upper, left, t_done + left * mean, remaining, recommend, max_tokens)
    return (
        name, float(target), n, mean, std, st["p50"], st["p90"], st["p99"], st["truncated_share"], lower,
        s_done, t_done, remaining, needed, upper, available, shortfall, t_done + left * mean,
        _hours(expected, throughput), cap, cap_tokens, cap_tokens / target, _hours(cap_tokens, throughput),
        recommend, note,
    )  # fmt: skip


def _hours(tokens: float, throughput: float | None) -> float | None:
    """Hours to generate tokens at throughput tokens/s (None without a throughput)."""
    return tokens / throughput / 3600 if throughput else None


def _uncensored_p99(frame: pl.DataFrame, max_tokens: int | None) -> dict[str, float]:
    """p99 of the completions that did not hit max_tokens, per dataset."""
    import polars as pl

    hit = _truncated_expr(frame, "completion_tokens", max_tokens)
    kept = frame if hit is None else frame.filter(hit == 0)
    agg = kept.group_by("dataset").agg(pl.col("completion_tokens").quantile(0.99, "linear"))
    return dict(agg.iter_rows())


def _recommend_max_tokens(
    max_tokens: int | None, observed_max: int, p99_uncensored: float | None
) -> int:
    """A max_tokens to re-pilot with: 2x the current cap, rounded up to a multiple of 256."""
    base = max(2 * (max_tokens or observed_max), p99_uncensored or 0)
    return int(math.ceil(base / 256) * 256)


def _note(st, needed, upper, left, most, remaining, recommend, max_tokens) -> str | None:
    """Plain-text warnings for one plan row."""
    parts = []
    if recommend is not None:
        cap = max_tokens if max_tokens is not None else st["max"]
        parts.append(
            f"{st['truncated_share']:.0%} of pilot completions hit max_tokens={cap}: the mean is "
            f"censored (true lengths are longer) and as many samples will be cut short; to keep "
            f"them whole, re-pilot with max_tokens={recommend}"
        )
    if remaining == 0:
        parts.append("budget reached")
    elif needed is None:
        parts.append("mean completion length is 0: no number of samples reaches the budget")
    elif needed > left:
        parts.append(
            f"shortfall: needs ~{needed:,} samples, {left:,} prompts left (at most {most:,.0f} tokens)"
        )
    elif upper is not None and upper > left:
        parts.append(f"may run short: upper bound {upper:,} samples > {left:,} prompts left")
    if st["n"] < 2:
        parts.append("one pilot sample: no confidence bound")
    return "; ".join(parts) or None


def _total_row(table: pl.DataFrame, throughput: float | None) -> pl.DataFrame:
    """The TOTAL row: sums, the effective mean of what is left, overall overshoot."""
    import polars as pl

    s = table.sum()
    needed = s["samples_needed"][0]
    upper = None if table["samples_needed_upper"].null_count() else s["samples_needed_upper"][0]
    values = {
        "dataset": TOTAL,
        "mean": s["tokens_remaining"][0] / needed if needed else None,
        "samples_needed_upper": upper,
        "shortfall": bool(table["shortfall"].any()),
        "overshoot": s["cap_tokens"][0] / s["budget"][0],
        "hours_to_go": s["hours_to_go"][0] if throughput else None,
        "cap_hours": s["cap_hours"][0] if throughput else None,
    }
    sums = [
        "budget",
        "n_pilot",
        "samples_done",
        "tokens_done",
        "tokens_remaining",
        "samples_needed",
    ]
    sums += ["prompts_available", "max_tokens_available", "cap_tokens"]
    values.update({name: s[name][0] for name in sums})
    return pl.DataFrame([{k: values.get(k) for k in plan_schema()}], schema=plan_schema())
