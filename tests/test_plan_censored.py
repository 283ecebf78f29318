"""Planner defaults a plan can trust: a censored pilot claims no upper bound, a pilot takes
30 per dataset (and warns below), and the time estimate says at what concurrency its
throughput was measured."""

from __future__ import annotations

import warnings

import polars as pl
import pytest

from kit import plan
from kit.plan.pilots import PilotResult, Throughput
from kit.types import RunConfig, Sampling

CENSORED_NOTE = "censored: 20% of the pilot hit max_tokens=128; re-pilot with a larger max_tokens for an upper bound"


def row(table: pl.DataFrame, dataset: str) -> dict:
    return table.filter(pl.col("dataset") == dataset).row(0, named=True)


def pilot_frame(lengths: dict[str, list[int]], max_tokens: int) -> pl.DataFrame:
    """A pilot frame: finish "length" exactly where a completion reached max_tokens."""
    rows = [
        {
            "dataset": d,
            "prompt_id": f"{d}-{i}",
            "completion_tokens": n,
            "finish_reason": "length" if n >= max_tokens else "stop",
        }
        for d, values in lengths.items()
        for i, n in enumerate(values)
    ]
    return pl.DataFrame(rows)


def spread(mean: int, n: int = 30) -> list[int]:
    return [mean - mean // 3, mean, mean + mean // 3] * (n // 3)


# ---------------------------------------------------------------- censored pilots


def test_censored_pilot_gives_no_upper_bound_and_says_why():
    lengths = {"cut": [40, 60, 80, 100] * 6 + [128] * 6, "whole": spread(60)}  # cut: 6 of 30
    frame = pilot_frame(lengths, 128)
    res = PilotResult(frame=frame, wall_s=10.0, sampling=Sampling(max_tokens=128))
    table = plan.budget(10_000, res, prompts_available={"cut": 1000, "whole": 1000})
    cut, whole, total = row(table, "cut"), row(table, "whole"), row(table, plan.TOTAL)
    assert cut["truncated_share"] == pytest.approx(0.2)
    assert cut["mean"] == pytest.approx(81.6)
    assert cut["samples_needed"] == 123  # the point estimate stays: ceil(10_000 / 81.6)
    assert cut["samples_needed_upper"] is None and cut["mean_lower"] is None
    assert CENSORED_NOTE in cut["note"]
    assert whole["samples_needed_upper"] > whole["samples_needed"]  # an uncut pilot: a bound
    assert whole["note"] is None
    assert total["samples_needed_upper"] is None  # no total bound with one unbounded dataset


def test_censoring_threshold_is_ten_percent():
    base = [40, 60, 80, 100, 50, 70]
    at = plan.budget(
        1000,
        {"a": base * 4 + [40, 60, 80] + [128] * 3},
        prompts_available={"a": 99},
        max_tokens=128,
    )
    above = plan.budget(
        1000, {"a": base * 4 + [40, 60] + [128] * 4}, prompts_available={"a": 99}, max_tokens=128
    )
    assert row(at, "a")["truncated_share"] == pytest.approx(0.1)
    assert row(at, "a")["samples_needed_upper"] is not None and row(at, "a")["note"] is None
    assert row(above, "a")["samples_needed_upper"] is None
    assert "censored: 13% of the pilot hit max_tokens=128" in row(above, "a")["note"]


def test_an_all_truncated_pilot_never_claims_certainty():
    frame = pilot_frame({"a": [256] * 30}, 256)  # zero spread: a t bound would equal the mean
    r = row(plan.budget(5000, frame, prompts_available={"a": 100}, max_tokens=256), "a")
    assert r["std"] == 0 and r["truncated_share"] == 1.0
    assert r["samples_needed"] == 20 and r["samples_needed_upper"] is None
    assert "censored: 100% of the pilot hit max_tokens=256" in r["note"]
    assert "max_tokens=512" in r["note"] and r["recommended_max_tokens"] == 512
    # finish_reason alone tells (no max_tokens known): the longest length is named
    only = pilot_frame({"a": [256] * 30}, 256)
    r = row(plan.budget(5000, only, prompts_available={"a": 100}), "a")
    assert r["samples_needed_upper"] is None and "hit max_tokens (longest: 256)" in r["note"]


def test_no_spread_without_truncation_evidence_gives_no_bound_either():
    r = row(plan.budget(5000, {"a": [250] * 30}, prompts_available={"a": 100}), "a")
    assert r["truncated_share"] is None  # nothing tells whether these were cut
    assert r["samples_needed"] == 20 and r["samples_needed_upper"] is None
    assert "no spread: all 30 pilot lengths are 250" in r["note"]


# ---------------------------------------------------------------- pilot size


def test_a_small_pilot_is_noted_weak_in_the_plan():
    r = row(plan.budget(5000, {"a": [100, 200, 300, 400]}, prompts_available={"a": 100}), "a")
    assert "weak: a pilot of 4 (fewer than 30)" in r["note"]
    assert r["samples_needed_upper"] is not None  # still bounded, just loosely
    big = row(plan.budget(5000, {"a": [100, 200, 300] * 10}, prompts_available={"a": 100}), "a")
    assert big["note"] is None


def _prompts(sizes: dict[str, int]) -> pl.DataFrame:
    return pl.DataFrame(
        [
            {
                "dataset": d,
                "prompt_id": f"{d}-{i:04d}",
                "messages": [{"role": "user", "content": f"Say the number {i}."}],
            }
            for d, n in sizes.items()
            for i in range(n)
        ]
    )


def config(url: str, **kw) -> RunConfig:
    return RunConfig(
        **({"model": "m", "endpoints": url, "budgets": 1, "sampling": Sampling(max_tokens=32)} | kw)
    )


def test_pilot_defaults_to_30_per_dataset_and_warns_below():
    from faultserver import FaultConfig, FaultServer

    prompts = _prompts({"a": 40, "b": 12})
    with FaultServer(FaultConfig()) as srv:
        with pytest.warns(UserWarning, match=r"weak pilot: b: 12 \(all its 12 prompts\)") as seen:
            res = plan.pilot_sync(prompts, config(srv.base_url))  # the default: 30, or all
        assert srv.stats()["requests"] == 42
        assert "a:" not in str(seen[0].message)  # a got its 30
        assert dict(res.frame.group_by("dataset").len().iter_rows()) == {"a": 30, "b": 12}
        with pytest.warns(UserWarning, match=r"weak pilot: a: 4, b: 4 completions.*\+127\.5%"):
            plan.pilot_sync(prompts, config(srv.base_url), per_dataset=4)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # 30 each (10 prompts x n=3): no warning
            plan.pilot_sync(
                _prompts({"a": 40}),
                config(srv.base_url, sampling=Sampling(max_tokens=32, n=3)),
                per_dataset=10,
            )


# ---------------------------------------------------------------- throughput at concurrency


def timed_frame() -> pl.DataFrame:
    """Two lanes of three 1 s requests (2 in flight for 3 s), then one 2 s request alone."""
    latency = [1.0] * 6 + [2.0]
    t_done = [1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 5.0]
    return pl.DataFrame(
        {
            "dataset": ["a"] * 7,
            "prompt_id": [f"p{i}" for i in range(7)],
            "completion_tokens": [100] * 7,
            "finish_reason": ["stop"] * 7,
            "latency_s": latency,
            "t_done": [1000.0 + t for t in t_done],
        }
    )


def test_throughput_is_measured_while_the_pipe_was_full():
    res = PilotResult(frame=timed_frame(), wall_s=5.0, sampling=Sampling(), concurrency=2)
    assert res.tokens_per_s == 140.0  # 700 tokens / 5 s of wall time, the tail included
    assert res.throughput == Throughput(tokens_per_s=200.0, concurrency=2, window_s=3.0)
    summary = res.summary()
    assert summary["concurrency"] == 2
    assert summary["throughput"] == {"tokens_per_s": 200.0, "concurrency": 2, "window_s": 3.0}
    assert plan.measure_throughput(timed_frame(), 1) == Throughput(140.0, 1, 5.0)  # >= 1: all 5 s
    assert plan.measure_throughput(pl.DataFrame({"completion_tokens": [5]})) is None


def test_budget_notes_a_time_estimate_from_another_concurrency():
    samples = {"a": spread(300)}
    res = PilotResult(frame=timed_frame(), wall_s=5.0, sampling=Sampling(), concurrency=8)
    measured = res.throughput  # the pilot never had the run's 8 in flight
    assert measured.concurrency == 2
    table = plan.budget(
        720_000, samples, prompts_available={"a": 10_000}, throughput=measured, concurrency=8
    )
    assert row(table, plan.TOTAL)["hours_to_go"] == pytest.approx(720_000 / 200 / 3600)
    for r in table.iter_rows(named=True):
        assert "measured with 2 requests in flight, the run allows 8" in r["note"], r["dataset"]
        assert "hours are extrapolated (likely high" in r["note"]
    same = plan.budget(
        720_000, samples, prompts_available={"a": 10_000}, throughput=measured, concurrency=2
    )
    assert same["note"].to_list() == [None, None]
    number = plan.budget(
        720_000, samples, prompts_available={"a": 10_000}, throughput=200.0, concurrency=8
    )
    assert number["note"].to_list() == [None, None]  # a number is the rate at the run's concurrency
    fewer = plan.budget(
        720_000, samples, prompts_available={"a": 10_000}, throughput=measured, concurrency=1
    )
    assert "the run allows 1: hours are extrapolated (likely low" in row(fewer, "a")["note"]
    unknown = plan.budget(720_000, samples, prompts_available={"a": 10_000}, throughput=measured)
    assert "the run's concurrency is unknown" in row(unknown, "a")["note"]
    with pytest.raises(ValueError, match="concurrency must be a positive number, got 0"):
        plan.budget(1000, samples, prompts_available={"a": 10}, concurrency=0)


def test_budget_takes_the_run_concurrency_from_the_pilot_result():
    frame = timed_frame().vstack(
        pilot_frame({"a": spread(100)}, 128).with_columns(
            latency_s=pl.lit(None, pl.Float64), t_done=pl.lit(None, pl.Float64)
        )
    )
    res = PilotResult(frame=frame, wall_s=5.0, sampling=Sampling(max_tokens=128), concurrency=8)
    table = plan.budget(10_000, res, prompts_available={"a": 1000}, throughput=res.throughput)
    assert "the run allows 8" in row(table, "a")["note"]


def test_throughput_without_per_request_times_is_the_mean_in_flight():
    frame = pl.DataFrame(
        {"dataset": ["a"] * 4, "completion_tokens": [50] * 4, "latency_s": [1.0] * 4}
    )
    res = PilotResult(frame=frame, wall_s=2.0, sampling=Sampling(), concurrency=4)
    assert res.throughput == Throughput(tokens_per_s=100.0, concurrency=2, window_s=2.0)
    bare = PilotResult(frame=frame.drop("latency_s"), wall_s=2.0, sampling=Sampling())
    assert bare.throughput is None and bare.summary()["throughput"] is None


def test_a_real_pilot_measures_at_the_run_concurrency_when_it_can():
    from faultserver import FaultConfig, FaultServer

    with FaultServer(FaultConfig(latency=0.05)) as srv:
        full = plan.pilot_sync(_prompts({"a": 30}), config(srv.base_url, concurrency=4))
        few = plan.pilot_sync(_prompts({"a": 30}), config(srv.base_url, concurrency=64))
    assert full.concurrency == 4 and full.throughput.concurrency == 4
    assert 0 < full.throughput.window_s < full.wall_s
    assert full.throughput.tokens_per_s > full.tokens_per_s  # ramp-up and tail left out
    assert few.concurrency == 64 and few.throughput.concurrency == 30  # 30 requests: 30 at most
    table = plan.budget(10_000, few, prompts_available={"a": 30}, throughput=few.throughput)
    assert "measured with 30 requests in flight, the run allows 64" in row(table, "a")["note"]


def test_the_planner_widget_keeps_the_measured_concurrency():
    """01_plan's Planner: the pilot's Throughput shown as its rate, the extrapolation noted
    while the box holds it; a rate typed in is taken as the run's own."""
    from kit.report.widgets import Planner

    res = PilotResult(
        frame=timed_frame(), wall_s=5.0, sampling=Sampling(max_tokens=100), concurrency=2
    )
    planner = Planner(
        {"a": 2000}, res, prompts_available={"a": 500}, throughput=res.throughput, concurrency=64
    )
    assert planner.throughput.value == 200.0
    assert "extrapolated" in (row(planner.table, "a")["note"] or "")
    planner.throughput.value = 150.0
    assert "extrapolated" not in (row(planner.table, "a")["note"] or "")


def test_throughput_per_endpoint_and_what_n_servers_would_give():
    two = timed_frame().with_columns(
        endpoint=pl.Series(["http://a/v1", "http://b/v1"] * 3 + ["http://a/v1"])
    )
    res = PilotResult(frame=two, wall_s=5.0, sampling=Sampling(), concurrency=2)
    measured = res.throughput  # both endpoints together: 200 tok/s over 2
    assert measured == Throughput(200.0, 2, 3.0, endpoints=2) and measured.per_endpoint == 100.0
    per = res.per_endpoint  # each endpoint alone, with its share (1) of the concurrency
    assert set(per) == {"http://a/v1", "http://b/v1"}
    assert per["http://b/v1"] == Throughput(100.0, 1, 3.0)
    assert res.summary()["per_endpoint"] == {u: m.tokens_per_s for u, m in per.items()}
    samples = {"a": spread(300)}
    eight = plan.budget(
        720_000,
        samples,
        prompts_available={"a": 10_000},
        throughput=measured,
        concurrency=8,
        servers=8,
    )
    assert row(eight, plan.TOTAL)["hours_to_go"] == pytest.approx(720_000 / 800 / 3600)
    assert (
        "time for 8 servers: 100.0 tok/s per endpoint (measured over 2) x 8"
        in row(eight, "a")["note"]
    )
    assert "extrapolated" not in row(eight, "a")["note"]  # 8 in flight = 1 per server, as piloted
    with pytest.raises(ValueError, match="servers=2 scales a measured Throughput"):
        plan.budget(1000, samples, prompts_available={"a": 10}, throughput=100.0, servers=2)
