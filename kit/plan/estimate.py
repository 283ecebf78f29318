"""Budget math: samples needed per completion-token budget, bounds, time to go.

Pure functions over polars frames (kit.plan.pilots talks to the server). budget() says,
before any GPU hour is spent, how many samples each dataset's token budget needs, whether
its prompts suffice, how long the run takes, and what a naive per-dataset cap would give.
samples_low..samples_high is a PREDICTION-level interval (the pilot mean's error and the
run's own sampling, cv * sqrt(1/n_pilot + 1/needed), Student-t, the pilot's spread widened
to its SPREAD_LEVEL upper bound); hours_low..hours_high spans a token-bound server to a
request-bound one. A censored pilot (over CENSORED_SHARE hit max_tokens) or one without
spread gives no upper bound; a throughput measured at another concurrency says so.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import TYPE_CHECKING, Any

from kit.errors import ConfigError
from kit.plan import inputs, lengths
from kit.plan.lengths import profile
from kit.plan.pilots import PILOT_PER_DATASET, PilotResult, Throughput

if TYPE_CHECKING:
    import polars as pl

TOTAL = "TOTAL"  # the dataset name of the summary row
# Above this share of pilot completions cut at max_tokens the pilot's mean is censored (by
# an amount it cannot show): no upper bound. With an exponential tail the cut mean is low
# by about the cut share (E[min(L, M)] = mu * (1 - share)), well inside the bound's own
# half-width at a pilot of 30; 10% of 30 is 4 cut, where 5% (2 of 30) would be noise.
CENSORED_SHARE = 0.10
PREDICTION = 0.90  # two-sided level of samples_low..samples_high and hours_low..hours_high
SPREAD_LEVEL = 0.75  # the pilot's std is widened to this upper confidence bound (chi-square)


def _t_quantile(confidence: float, dof: int) -> float:
    """One-sided Student-t quantile (Cornish-Fisher expansion; within 0.5% for dof >= 2).

    Example:
        >>> round(_t_quantile(0.95, 9), 3)
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


def _spread_factor(n: int, level: float = SPREAD_LEVEL) -> float:
    """sqrt((n-1) / chi2_{1-level}(n-1)): a sample std times this is its `level` upper
    confidence bound (Wilson-Hilferty's chi-square quantile).

    Example:
        >>> round(_spread_factor(30), 3)
        1.109
    """
    k = n - 1
    if k < 1:
        return math.inf
    z = NormalDist().inv_cdf(1 - level)
    q = k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3
    return math.sqrt(k / q) if q > 0 else math.inf


def _samples_interval(
    remaining: float, mean: float, std: float, n: int, level: float = PREDICTION
) -> tuple[int, int | None]:
    """(low, high) of the samples that reach `remaining` tokens at this pilot (mean, std of
    n lengths), a two-sided `level` prediction interval; high None when unbounded.

    Example:
        >>> _samples_interval(10_000, 100.0, 80.0, 30)
        (77, 146)
    """
    needed = math.ceil(remaining / mean)
    t = _t_quantile(1 - (1 - level) / 2, n - 1)
    h = t * std * _spread_factor(n) * math.sqrt(1 / n + 1 / max(needed, 1))
    high = math.ceil(remaining / (mean - h)) if mean - h > 0 else None
    return math.ceil(remaining / (mean + h)), high


# ---------------------------------------------------------------- budget


def budget(
    budgets: dict[str, float] | float,
    samples: Any,
    *,
    prompts_available: dict[str, int] | pl.DataFrame,
    done: dict[str, tuple[int, int]] | pl.DataFrame | None = None,
    throughput: float | Throughput | None = None,
    concurrency: int | None = None,
    max_tokens: int | None = None,
    confidence: float = 0.95,
    sample_cap: int | None = None,
    servers: int | None = None,
) -> pl.DataFrame:
    """Samples each completion-token budget needs, with bounds, shortfall, time and a cap's cost.

    Args:
        budgets: dataset -> completion tokens, or one number for every sampled dataset.
        samples: completion lengths: a frame (dataset, completion_tokens[, finish_reason]),
            a PilotResult, or a dict dataset -> list of lengths.
        prompts_available: dataset -> samples the prompts can give, or a prompt frame (its
            prompts times a PilotResult's samples a prompt, sampling.n).
        done: progress so far, dataset -> (samples, tokens), or a frame (records, or
            samples_done/tokens_done columns). The remainder is planned at the sample mean.
        throughput: completion tokens/s of the whole run (for hours_to_go, cap_hours): a
            number (the rate at the run's concurrency), or a Throughput (a pilot's): when
            measured at another concurrency, every row's note says the time is extrapolated.
        concurrency: the run's requests in flight (default: a PilotResult's).
        max_tokens: the pilot's max_tokens (lengths >= it count as truncated; default: a
            PilotResult's own).
        confidence: one-sided level of samples_needed_upper (Student-t on the mean).
        sample_cap: the naive alternative to compare: this many samples per dataset
            (default: every prompt).
        servers: time the run on this many endpoints instead of the pilot's: a Throughput's
            per-endpoint rate times servers (Throughput.servers; the note says so).

    Returns:
        One row per dataset plus a "TOTAL" row, columns plan_schema(): samples_needed is
        ceil(remaining / mean), samples_needed_upper ceil(remaining / mean_lower),
        overshoot cap_tokens / budget. mean_lower, samples_needed_upper and the intervals
        are null when the pilot cannot bound the mean: fewer than 2 samples, no spread, or
        censored (the note says by how much and what to re-pilot with; cap_tokens,
        max_tokens_available and cap_hours are then lower bounds).

    Example:
        >>> t = budget({"sharegpt": 10_000_000}, {"sharegpt": [3793] * 50},
        ...            prompts_available={"sharegpt": 88_000}, sample_cap=7000)
        >>> t.filter(pl.col("dataset") == "sharegpt").select("samples_needed", "cap_tokens", "overshoot").row(0)
        (2637, 26551000.0, 2.6551)
    """
    import polars as pl

    if max_tokens is None and isinstance(samples, PilotResult):
        max_tokens = samples.sampling.max_tokens
    if concurrency is None and isinstance(samples, PilotResult):
        concurrency = samples.concurrency
    inputs.positive(concurrency, "concurrency")
    throughput, servers_note = _servers(throughput, servers)
    rate, time_note = _rate(throughput, concurrency)
    time_note = "; ".join(n for n in (servers_note, time_note) if n) or None
    frame = inputs.samples_frame(samples)
    uncensored = _uncensored_p99(frame, max_tokens)
    stats = {
        row["dataset"]: row | {"p99_kept": uncensored.get(row["dataset"])}
        for row in profile(frame, max_tokens=max_tokens).iter_rows(named=True)
    }
    available = inputs.counts(prompts_available, "prompts_available")
    per_prompt = samples.sampling.n if isinstance(samples, PilotResult) else 1
    if per_prompt > 1 and not isinstance(prompts_available, dict):  # a frame counts prompts
        available = {name: count * per_prompt for name, count in available.items()}
    wanted = inputs.budgets(budgets, sorted(stats))
    inputs.check_known(wanted, stats, available)
    inputs.positive(sample_cap, "sample_cap")
    if not 0 < confidence < 1:
        raise ConfigError(f"confidence must be in (0, 1), got {confidence!r}")
    progress = inputs.progress(done)
    given = dict(throughput=rate, confidence=confidence, cap=sample_cap, max_tokens=max_tokens)
    rows = [
        _plan_row(n, wanted[n], stats[n], available[n], progress.get(n, (0, 0)), **given)
        for n in sorted(wanted)
    ]
    table = pl.DataFrame(rows, schema=plan_schema(), orient="row")
    table = pl.concat([table, _total_row(table, rate)])
    if time_note:
        joined = pl.concat_str([pl.col("note"), pl.lit(time_note)], separator="; ")
        table = table.with_columns(note=pl.coalesce(joined, pl.lit(time_note)))
    return table


def _servers(throughput: Any, servers: int | None) -> tuple[Any, str | None]:
    """(throughput for `servers` endpoints, note); unchanged without servers."""
    if servers is None:
        return throughput, None
    inputs.positive(servers, "servers")
    if not isinstance(throughput, Throughput):
        raise ConfigError(
            f"servers={servers} scales a measured Throughput (a pilot's), got throughput={throughput!r}"
        )
    note = (
        f"time for {servers} servers: {throughput.per_endpoint:,.1f} tok/s per endpoint "
        f"(measured over {throughput.endpoints}) x {servers}"
    )
    return throughput.servers(servers), note


def _rate(throughput: Any, concurrency: int | None) -> tuple[float | None, str | None]:
    """(tokens/s, note) from a number or a Throughput; the note when its concurrency is
    not the run's."""
    if not isinstance(throughput, Throughput):
        inputs.positive(throughput, "throughput")
        return throughput, None
    rate, measured = throughput.tokens_per_s, throughput.concurrency
    inputs.positive(rate, f"throughput (measured with {measured} in flight)")
    if measured == concurrency:
        return rate, None
    said = f"time from {rate:,.1f} tok/s measured with {measured} requests in flight"
    if concurrency is None:
        return rate, f"{said}; the run's concurrency is unknown (pass concurrency=)"
    low = measured > concurrency
    note = (
        f"{said}, the run allows {concurrency}: hours are extrapolated (likely "
        f"{'low' if low else 'high'}: throughput usually grows with concurrency)"
    )
    return rate, note if low else f"{note}; pilot at least {concurrency} requests to measure it"


_PLAN_COLUMNS = """dataset:String budget:Float64 n_pilot:Int64 mean:Float64 std:Float64 p50:Float64
    p90:Float64 p99:Float64 truncated_share:Float64 mean_lower:Float64 samples_done:Int64
    tokens_done:Int64 tokens_remaining:Float64 samples_needed:Int64 samples_needed_upper:Int64
    samples_low:Int64 samples_high:Int64 prompts_available:Int64 shortfall:Boolean
    max_tokens_available:Float64 hours_to_go:Float64 hours_low:Float64 hours_high:Float64 cap:Int64 cap_tokens:Float64 overshoot:Float64 cap_hours:Float64 recommended_max_tokens:Int64
    note:String"""  # name:polars dtype, the budget() table in order


def plan_schema() -> dict:
    """The budget() table's schema: column name -> polars dtype.

    Example:
        >>> list(plan_schema())[:4]
        ['dataset', 'budget', 'n_pilot', 'mean']
    """
    import polars as pl

    return {n: getattr(pl, t) for n, t in (c.split(":") for c in _PLAN_COLUMNS.split())}


def _plan_row(name, target, st, available, progress, *, throughput, confidence, cap, max_tokens):
    """One dataset's plan row (values in plan_schema() order); cap: the sample_cap."""
    mean, std, n = st["mean"], st["std"], st["n"]
    censored = st["truncated_share"] is not None and st["truncated_share"] > CENSORED_SHARE
    bounded = n > 1 and std is not None and std > 0 and not censored
    lower = mean - _t_quantile(confidence, n - 1) * std / math.sqrt(n) if bounded else None
    s_done, t_done = progress
    remaining = max(target - t_done, 0.0)
    needed = math.ceil(remaining / mean) if mean > 0 else None
    upper = math.ceil(remaining / lower) if lower and lower > 0 else None
    left = max(available - s_done, 0)
    shortfall = needed is None or needed > left
    expected = min(remaining, left * mean)
    cap = min(cap or available, available)
    cap_tokens = cap * mean
    recommend = _recommend_max_tokens(max_tokens, st["max"], st["p99_kept"]) if censored else None
    note = _note(st, needed, upper, left, t_done + left * mean, remaining, recommend, max_tokens)
    low, high = _samples_interval(remaining, mean, std, n) if bounded and needed else (None, None)
    hours = _hours(expected, throughput)
    h_low, h_high = _hours_interval(hours, needed, low, high, left)
    pilot = (n, mean, std, st["p50"], st["p90"], st["p99"], st["truncated_share"], lower)
    samples = (s_done, t_done, remaining, needed, upper, low, high)
    prompts = (available, shortfall, t_done + left * mean, hours, h_low, h_high)
    cost = (cap, cap_tokens, cap_tokens / target, _hours(cap_tokens, throughput))
    return (name, float(target), *pilot, *samples, *prompts, *cost, recommend, note)


def _hours_interval(hours, needed, low, high, left) -> tuple[float | None, float | None]:
    """hours_low..hours_high: from the token-bound time (hours) to the request-bound one
    (hours scaled by the samples the run sends, at most the prompts left)."""
    if hours is None or low is None or not needed:
        return None, None
    sent = min(needed, left) or 1
    low_f = min(low, left) / sent
    high_f = min(high, left) / sent if high is not None else None
    return hours * min(1.0, low_f), (hours * max(1.0, high_f) if high_f is not None else None)


def _hours(tokens: float, throughput: float | None) -> float | None:
    """Hours to generate tokens at throughput tokens/s (None without a throughput)."""
    return tokens / throughput / 3600 if throughput else None


def _uncensored_p99(frame: pl.DataFrame, max_tokens: int | None) -> dict[str, float]:
    """p99 of the completions that did not hit max_tokens, per dataset."""
    import polars as pl

    hit = lengths.truncated_expr(frame, "completion_tokens", max_tokens)
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
        cap = f"={max_tokens}" if max_tokens is not None else f" (longest: {st['max']})"
        parts.append(
            f"censored: {st['truncated_share']:.0%} of the pilot hit max_tokens{cap}; re-pilot "
            f"with a larger max_tokens for an upper bound (try max_tokens={recommend}); as "
            f"many samples of the run would be cut short"
        )
    if remaining == 0:
        parts.append("budget reached")
    elif needed is None:
        parts.append("mean completion length is 0: no number of samples reaches the budget")
    elif needed > left:
        parts.append(
            f"shortfall: needs ~{needed:,} samples, {left:,} samples left (at most {most:,.0f} tokens)"
        )
    elif upper is not None and upper > left:
        parts.append(f"may run short: upper bound {upper:,} samples > {left:,} samples left")
    if st["n"] < 2:
        parts.append("one pilot sample: no confidence bound")
    elif st["std"] == 0 and recommend is None:
        parts.append(f"no spread: all {st['n']} pilot lengths are {st['mean']:.0f}, no upper bound")
    if 1 < st["n"] < PILOT_PER_DATASET:
        parts.append(
            f"weak: a pilot of {st['n']} (fewer than {PILOT_PER_DATASET}) may be far off the mean"
        )
    return "; ".join(parts) or None


def _total_row(table: pl.DataFrame, throughput: float | None) -> pl.DataFrame:
    """The TOTAL row: sums, the effective mean of what is left, overall overshoot."""
    import polars as pl

    s = table.sum()
    needed = s["samples_needed"][0]
    bounds = ("samples_needed_upper", "samples_low", "samples_high", "hours_low", "hours_high")
    values = {
        "dataset": TOTAL,
        "mean": s["tokens_remaining"][0] / needed if needed else None,
        # a bound of every dataset, or none; summed intervals are wider than the TOTAL's own
        **{c: None if table[c].null_count() else s[c][0] for c in bounds},
        "shortfall": bool(table["shortfall"].any()),
        "overshoot": s["cap_tokens"][0] / s["budget"][0],
        "hours_to_go": s["hours_to_go"][0] if throughput else None,
        "cap_hours": s["cap_hours"][0] if throughput else None,
    }
    sums = ["budget", "n_pilot", "samples_done", "tokens_done", "tokens_remaining"]
    sums += ["samples_needed", "prompts_available", "max_tokens_available", "cap_tokens"]
    values.update({name: s[name][0] for name in sums})
    return pl.DataFrame([{k: values.get(k) for k in plan_schema()}], schema=plan_schema())
