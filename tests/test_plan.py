"""kit.plan: profiles, budget math, bounds, allocation, validation, the seed story, the stored plan,
the pilot (faults, n samples, the embedded server), and the planning charts' specs."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import math
import random
import sqlite3
import statistics

import polars as pl
import pytest

from kit import plan
from kit.plan.pilots import PilotResult
from kit.report import charts
from kit.run.reader import prompts_frame
from kit.run.store import RunStore
from kit.types import RunConfig, Sampling

# the pilots here are small on purpose (fast); the warning they raise is tested in
# tests/test_plan_censored.py
pytestmark = pytest.mark.filterwarnings("ignore:weak pilot:UserWarning")


def spread(mean: int, n: int = 100) -> list[int]:
    """n lengths (n a multiple of 5) with exactly this mean and a realistic spread (+-40%)."""
    offsets = [-round(0.4 * mean), -round(0.2 * mean), 0, round(0.2 * mean), round(0.4 * mean)]
    return [mean + d for d in offsets] * (n // 5)


def row(table: pl.DataFrame, dataset: str) -> dict:
    return table.filter(pl.col("dataset") == dataset).row(0, named=True)


# ---------------------------------------------------------------- profiles


def test_profile_statistics_and_truncation():
    a = [10, 20, 30, 40, 128]
    frame = pl.DataFrame(
        {
            "dataset": ["a"] * 5 + ["b"] * 2,
            "completion_tokens": a + [5, 7],
            "finish_reason": ["stop", "stop", "stop", "length", "stop", "stop", "stop"],
        }
    )
    out = plan.profile(frame, max_tokens=128)
    ra = row(out, "a")
    assert ra["n"] == 5 and ra["max"] == 128
    assert ra["mean"] == pytest.approx(statistics.mean(a))
    assert ra["std"] == pytest.approx(statistics.stdev(a))
    assert ra["p50"] == 30
    assert ra["truncated_share"] == pytest.approx(2 / 5)  # one "length", one at max_tokens
    assert row(out, "b")["truncated_share"] == 0
    assert out.columns[:8] == ["dataset", "n", "mean", "std", "p50", "p90", "p99", "max"]


def test_profile_without_truncation_evidence_is_null_and_missing_column_errors():
    frame = pl.DataFrame({"dataset": ["a"], "completion_tokens": [3]})
    assert plan.profile(frame)["truncated_share"].to_list() == [None]
    with pytest.raises(ValueError, match="'prompt_tokens'"):
        plan.profile(frame, "prompt_tokens")


# ---------------------------------------------------------------- the seed story


def test_seed_story_sample_cap_overshoots_2_66x():
    table = plan.budget(
        {"sharegpt": 10_000_000},
        {"sharegpt": spread(3793)},
        prompts_available={"sharegpt": 88_000},
        sample_cap=7000,
    )
    r = row(table, "sharegpt")
    assert r["mean"] == 3793
    assert round(r["cap_tokens"] / 1e6, 1) == 26.6
    assert round(r["overshoot"], 2) == 2.66
    assert abs(r["samples_needed"] - 2636) <= 1  # the budget needs ~2.6K samples, not 7K


def test_seed_story_after_1720_responses_about_950_more():
    done = {"sharegpt": (1720, 1720 * 3693)}
    table = plan.budget(
        {"sharegpt": 10_000_000},
        {"sharegpt": spread(3793)},
        prompts_available={"sharegpt": 88_000},
        done=done,
    )
    r = row(table, "sharegpt")
    assert round(r["tokens_done"] / 1e6, 2) == 6.35
    remaining = 10_000_000 - 1720 * 3693
    assert r["tokens_remaining"] == remaining
    needed = r["samples_needed"]
    assert needed * 3793 >= remaining > (needed - 1) * 3793  # the smallest count that reaches it
    assert abs(needed - 950) / 950 < 0.02  # "about 950 more"


STORY_MEANS = {"sharegpt": 3793, "opencodeinstruct": 1500, "ultrachat": 2600, "magicoder": 6500}
STORY_BUDGETS = {"sharegpt": 10e6, "opencodeinstruct": 30e6, "ultrachat": 30e6, "magicoder": 22e6}


@pytest.mark.parametrize("throughput, low, high", [(1500, 16.5, 17.5), (1000, 25.0, 26.0)])
def test_seed_story_budgeted_run_17_to_26_hours_vs_all_prompts_57_plus(throughput, low, high):
    samples = {name: spread(mean) for name, mean in STORY_MEANS.items()}
    available = dict.fromkeys(STORY_MEANS, 22_000)  # 88K prompts in all
    table = plan.budget(STORY_BUDGETS, samples, prompts_available=available, throughput=throughput)
    total = row(table, plan.TOTAL)
    assert total["prompts_available"] == 88_000
    assert round(total["budget"] / 1e6) == 92
    assert 37_000 <= total["samples_needed"] <= 39_000  # ~38K samples
    assert low <= total["hours_to_go"] <= high  # 92M tokens: 17 h at 1.5K tok/s, 26 h at 1K
    assert total["cap_hours"] >= 57  # running all 88K prompts instead
    assert not total["shortfall"]


# ---------------------------------------------------------------- budget math


def test_bounds_hold_the_point_estimate_and_narrow_as_the_pilot_grows():
    rng = random.Random(0)
    widths = []
    for n in (10, 100, 1000):
        lengths = [int(rng.gammavariate(2.0, 400)) + 1 for _ in range(n)]
        r = row(plan.budget(1_000_000, {"d": lengths}, prompts_available={"d": 10**6}), "d")
        assert r["samples_needed_upper"] >= r["samples_needed"]
        assert r["mean_lower"] < r["mean"]
        widths.append(r["samples_needed_upper"] - r["samples_needed"])
    assert widths[0] > widths[1] > widths[2]


def test_upper_bound_covers_the_truth_about_95_percent_of_the_time():
    rng = random.Random(1)
    true_mean = 2.0 * 400  # gamma(k=2, theta=400)
    budget_tokens = 1_000_000
    true_needed = math.ceil(budget_tokens / true_mean)
    covered = 0
    trials = 300
    for _ in range(trials):
        lengths = [rng.gammavariate(2.0, 400) for _ in range(20)]
        r = row(plan.budget(budget_tokens, {"d": lengths}, prompts_available={"d": 10**6}), "d")
        covered += r["samples_needed_upper"] >= true_needed
    assert 0.90 <= covered / trials <= 0.99


def test_shortfall_flag_and_what_the_prompts_can_give():
    table = plan.budget(
        {"small": 100_000}, {"small": spread(500)}, prompts_available={"small": 150}
    )
    r = row(table, "small")
    assert r["samples_needed"] == 200 and r["shortfall"]
    assert r["max_tokens_available"] == 150 * 500
    assert "shortfall" in r["note"]
    assert row(table, plan.TOTAL)["shortfall"]


def test_done_as_records_frame_and_budget_reached():
    records = pl.DataFrame({"dataset": ["a"] * 4, "completion_tokens": [300, 300, 300, 300]})
    table = plan.budget({"a": 1000}, {"a": spread(300)}, prompts_available={"a": 50}, done=records)
    r = row(table, "a")
    assert (r["samples_done"], r["tokens_done"], r["tokens_remaining"], r["samples_needed"]) == (
        4,
        1200,
        0,
        0,
    )
    assert "budget reached" in r["note"]


def test_one_number_budgets_every_dataset_and_total_sums():
    samples = {"a": spread(100), "b": spread(400)}
    table = plan.budget(
        40_000, samples, prompts_available={"a": 1000, "b": 1000}, sample_cap=500, throughput=10
    )
    assert table["dataset"].to_list() == ["a", "b", plan.TOTAL]
    assert row(table, "a")["samples_needed"] == 400 and row(table, "b")["samples_needed"] == 100
    total = row(table, plan.TOTAL)
    assert total["samples_needed"] == 500 and total["budget"] == 80_000
    assert total["cap_tokens"] == 500 * 100 + 500 * 400
    assert total["overshoot"] == pytest.approx(250_000 / 80_000)
    assert total["hours_to_go"] == pytest.approx(80_000 / 10 / 3600)


def test_censored_pilot_gets_a_note_and_a_max_tokens_recommendation():
    lengths = [40, 60, 80, 100] * 6 + [128] * 6  # 20% hit max_tokens=128
    table = plan.budget(
        {"a": 10_000}, {"a": lengths}, prompts_available={"a": 1000}, max_tokens=128
    )
    r = row(table, "a")
    assert r["truncated_share"] == pytest.approx(0.2)
    assert "censored" in r["note"] and "max_tokens=256" in r["note"]
    assert r["recommended_max_tokens"] == 256
    assert r["samples_needed_upper"] is None and r["mean_lower"] is None  # no bound claimed
    ok = plan.budget(
        {"a": 10_000}, {"a": [40, 60, 80, 100] * 8}, prompts_available={"a": 1000}, max_tokens=128
    )
    assert row(ok, "a")["recommended_max_tokens"] is None and row(ok, "a")["note"] is None
    assert row(ok, "a")["samples_needed_upper"] > row(ok, "a")["samples_needed"]


def test_finish_reason_marks_truncation_without_max_tokens():
    frame = pl.DataFrame(
        {
            "dataset": ["a"] * 10,
            "completion_tokens": [50] * 10,
            "finish_reason": ["length"] * 3 + ["stop"] * 7,
        }
    )
    r = row(plan.budget({"a": 1000}, frame, prompts_available={"a": 100}), "a")
    assert r["truncated_share"] == pytest.approx(0.3) and "censored" in r["note"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"budgets": {"a": 0}}, "'a'.*0"),
        ({"budgets": {"a": -5}}, "'a'.*-5"),
        ({"budgets": {"a": float("nan")}}, "'a'.*nan"),
        ({"budgets": {"zzz": 100}}, "budgets\\['zzz'\\].*no completion samples"),
        ({"samples": {"a": []}}, "samples is empty"),
        ({"prompts_available": {"b": 3}}, "budgets\\['a'\\].*not in prompts_available"),
        ({"prompts_available": {"a": -1}}, "prompts_available\\['a'\\].*-1"),
        ({"throughput": 0}, "throughput.*0"),
        ({"confidence": 1.5}, "confidence.*1.5"),
        ({"sample_cap": -3}, "sample_cap.*-3"),
        ({"done": {"a": (1,)}}, "done\\['a'\\]"),
    ],
)
def test_budget_validation_names_field_and_value(kwargs, match):
    args = {
        "budgets": {"a": 1000},
        "samples": {"a": [10, 20]},
        "prompts_available": {"a": 10},
    } | kwargs
    budgets, samples = args.pop("budgets"), args.pop("samples")
    with pytest.raises(ValueError, match=match):
        plan.budget(budgets, samples, **args)


# ---------------------------------------------------------------- allocate


def test_allocate_equal_split_water_fills_past_a_small_dataset():
    samples = {"a": spread(100), "b": spread(100), "c": spread(200)}
    out = plan.allocate(1, 100, samples, {"a": 10, "b": 10_000, "c": 10_000})  # 360K tokens
    assert row(out, "a")["tokens"] == 1000 and row(out, "a")["capped"]  # all it has
    assert row(out, "b")["tokens"] == row(out, "c")["tokens"] == 179_500  # the rest, equally
    assert row(out, plan.TOTAL)["tokens"] == 360_000
    assert row(out, "c")["samples_needed"] == math.ceil(179_500 / 200)


def test_allocate_proportional_and_everything_capped():
    samples = {"a": spread(100), "b": spread(100)}
    out = plan.allocate(
        1, 100, samples, {"a": 10_000, "b": 10_000}, split="proportional", weights={"a": 3, "b": 1}
    )
    assert row(out, "a")["tokens"] == 270_000 and row(out, "b")["tokens"] == 90_000
    small = plan.allocate(10, 100, samples, {"a": 10, "b": 20})  # far more time than prompts
    assert row(small, plan.TOTAL)["tokens"] == 3000 and row(small, plan.TOTAL)["capped"]
    default = plan.allocate(1, 100, samples, {"a": 1000, "b": 3000}, split="proportional")
    assert row(default, "b")["tokens"] == 3 * row(default, "a")["tokens"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"hours": 0}, "hours.*0"),
        ({"throughput": float("nan")}, "throughput.*nan"),
        ({"split": "random"}, "split.*random"),
        ({"weights": {"a": 1}}, "weights= needs split='proportional'"),
        ({"split": "proportional", "weights": {"zz": 1}}, "weights\\['zz'\\]"),
        ({"split": "proportional", "weights": {"a": -1}}, "weights\\['a'\\].*-1"),
    ],
)
def test_allocate_validation(kwargs, match):
    args = {
        "hours": 1,
        "throughput": 10,
        "samples": {"a": [5]},
        "prompts_available": {"a": 3},
    } | kwargs
    with pytest.raises(ValueError, match=match):
        plan.allocate(**args)


# ---------------------------------------------------------------- the stored plan


def config(**kw) -> RunConfig:
    """A RunConfig for plans and pilots; budgets are a placeholder (plans replace them)."""
    return RunConfig(**({"model": "m", "endpoints": "http://127.0.0.1:9/v1", "budgets": 1} | kw))


def test_write_and_read_plan_round_trip(tmp_path):
    table = plan.budget(
        {"a": 1000, "b": 2000},
        {"a": spread(100), "b": spread(50)},
        prompts_available={"a": 99, "b": 99},
    )
    cfg = config(
        model="smol",
        sampling=Sampling(max_tokens=128, temperature=0.0),
        datasets={"a": "data/samples/a.jsonl"},
        chat_template_hash="abc",
        concurrency=7,
    )
    measured = PilotResult(
        frame=pl.DataFrame({"dataset": ["a"], "completion_tokens": [100]}),
        wall_s=2.0,
        sampling=cfg.sampling,
    )
    path = plan.write_plan(tmp_path / "run", table, cfg, pilot=measured)
    assert path == tmp_path / "run" / "run.sqlite" and not (tmp_path / "run" / "plan.json").exists()
    back = plan.read_plan(tmp_path / "run")
    assert back["pilot"]["completions"] == 1 and back["pilot"]["tokens_per_s"] == 50.0
    assert isinstance(back["config"], RunConfig)
    assert back["config"] == dataclasses.replace(cfg, budgets={"a": 1000, "b": 2000})
    assert back["config"].fingerprint() == cfg.fingerprint()  # budgets are not identity
    assert back["budgets"] == {"a": 1000, "b": 2000}
    assert back["table"]["samples_needed"].to_list() == table["samples_needed"].to_list()
    assert back["created"].endswith("+00:00")
    assert plan.pilot_means(back) == {"a": 100.0, "b": 50.0}


def test_write_plan_budgets_override_the_table_rounded_up(tmp_path):
    table = plan.budget({"a": 1000}, {"a": spread(100)}, prompts_available={"a": 99})
    plan.write_plan(tmp_path, table, config(), budgets={"a": 1234.2})
    assert plan.read_plan(tmp_path)["config"].budgets == {"a": 1235}
    with pytest.raises(ValueError, match="no dataset/budget columns"):
        plan.write_plan(tmp_path, pl.DataFrame({"x": [1]}), config())


def test_read_plan_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no plan at"):
        plan.read_plan(tmp_path)
    (tmp_path / "plan.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid plan"):
        plan.read_plan(tmp_path)
    bad = config(budgets={"a": 5}).to_dict() | {"budgets": {"a": -1}}
    (tmp_path / "plan.json").write_text(json.dumps({"budgets": {"a": -1}, "config": bad}))
    with pytest.raises(ValueError, match="not a valid plan.*'a'.*-1"):
        plan.read_plan(tmp_path)
    old = {"budgets": {"a": 10}, "sampling": {}, "model": "m"}  # a version-1 plan: no config
    (tmp_path / "plan.json").write_text(json.dumps(old))
    with pytest.raises(ValueError, match="not a valid plan.*make it again"):
        plan.read_plan(tmp_path)


def test_plan_prompts_and_write_plan_prompts_checks(tmp_path):
    import kit

    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"q": f"question {i}"}) + "\n" for i in range(5)))
    loaded = kit.load(data, mapping={"prompt": "q"})
    table = pl.DataFrame({"dataset": ["q"], "budget": [500]})
    plan.write_plan(tmp_path / "bare", table, config(datasets={"q": str(data)}))
    back = plan.read_plan(tmp_path / "bare")  # no prompts given: the config's paths, detected
    assert back["sources"] is None
    with pytest.raises(ValueError, match="cannot detect"):  # a mapped file needs its spec
        plan.plan_prompts(tmp_path / "bare")

    run_dir = tmp_path / "run"
    plan.write_plan(run_dir, table, config(), prompts=loaded)
    assert plan.plan_prompts(run_dir) is None  # generate runs the prompts in run.sqlite
    assert not plan.run_started(run_dir) and not plan.run_started(tmp_path / "nowhere")
    with sqlite3.connect(run_dir / "run.sqlite") as conn:  # the spec alone loads them again
        conn.execute("DELETE FROM prompts")
        conn.execute("DELETE FROM state WHERE key = 'prompts'")
    conn.close()
    again = plan.plan_prompts(run_dir)
    assert again.frame["prompt_id"].to_list() == loaded.frame["prompt_id"].to_list()

    with pytest.raises(ValueError, match=r"budgets has no entry for datasets \['q'\]"):
        plan.write_plan(
            tmp_path / "x",
            pl.DataFrame({"dataset": ["z"], "budget": [5]}),
            config(),
            prompts=loaded,
        )
    with pytest.raises(ValueError, match="no prompt"):
        plan.write_plan(tmp_path / "x", table, config(), prompts=loaded.frame.clear())
    plan.write_plan(run_dir, table, config(), prompts=loaded)
    assert (
        prompts_frame(run_dir)["prompt_id"].sort().to_list()
        == loaded.frame["prompt_id"].sort().to_list()
    )
    store = RunStore(run_dir)  # a run started over these prompts: its config stored
    store.init(config(source_hashes=loaded.source_hashes()))
    store.close()
    assert plan.run_started(run_dir)
    plan.write_plan(run_dir, table, config(), prompts=loaded)  # the same prompts: fine
    other = kit.load({"q": [{"q": "another question"}]}, mapping={"prompt": "q"})
    plan.write_plan(run_dir, table, config(), prompts=other)  # no record yet: replaced
    assert prompts_frame(run_dir)["prompt_id"].to_list() == other.frame["prompt_id"].to_list()
    assert not plan.run_started(run_dir)  # a plan again (refused over records: test_run_dir)
    assert plan.plan_prompts(run_dir) is None and not (tmp_path / "x").exists()


# ---------------------------------------------------------------- pilot sampling


def _prompts(sizes: dict[str, int]) -> pl.DataFrame:
    rows = [
        {
            "dataset": d,
            "prompt_id": f"{d}-{i:04d}",
            "messages": [{"role": "user", "content": f"Say the number {i}."}],
        }
        for d, n in sizes.items()
        for i in range(n)
    ]
    return pl.DataFrame(rows)


def test_pilot_sample_is_seeded_and_independent_of_row_order():
    prompts = _prompts({"a": 50, "b": 20})
    first = plan.pilot_sample(prompts, 5, seed=3)
    again = plan.pilot_sample(prompts.sample(fraction=1.0, shuffle=True, seed=9), 5, seed=3)
    assert first["prompt_id"].to_list() == again["prompt_id"].to_list()
    assert (
        first["prompt_id"].to_list() != plan.pilot_sample(prompts, 5, seed=4)["prompt_id"].to_list()
    )
    counts = dict(plan.pilot_sample(prompts, 0.1).group_by("dataset").len().iter_rows())
    assert counts == {"a": 5, "b": 2}
    assert dict(plan.pilot_sample(prompts, {"a": 3}).group_by("dataset").len().iter_rows()) == {
        "a": 3
    }
    assert plan.pilot_sample(prompts, 500).height == 70  # capped at what exists
    for bad in (0, 1.5, -2, {"a": -1}, {"zz": 1}):
        with pytest.raises(ValueError, match="per_dataset"):
            plan.pilot_sample(prompts, bad)


def test_pilot_default_is_at_least_30_per_dataset():
    for fn in (plan.pilot, plan.pilot_sample):
        assert inspect.signature(fn).parameters["per_dataset"].default == plan.PILOT_PER_DATASET
    assert plan.PILOT_PER_DATASET >= 30
    counts = plan.pilot_sample(_prompts({"a": 50, "b": 12})).group_by("dataset").len()
    assert dict(counts.iter_rows()) == {"a": 30, "b": 12}  # 30, or all when fewer


def test_pilot_to_a_down_server_counts_errors_and_the_plan_refuses_it():
    """A server that accepts connections but fails its health check (a refused port fails
    at once: tests/test_plan_reuse.py)."""
    from faultserver import FaultConfig, FaultServer

    with FaultServer(FaultConfig(mode="down")) as srv:
        cfg = config(
            endpoints=srv.base_url,
            sampling=Sampling(max_tokens=8),
            timeout=5,
            no_endpoint_timeout=1,
        )
        res = plan.pilot_sync(_prompts({"a": 4}), cfg, per_dataset=3)
    assert res.frame.height == 0 and len(res.errors) == 3
    assert all(e.startswith("a/a-") and "no healthy endpoint" in e for e in res.errors)
    with pytest.raises(ValueError, match="samples is empty"):
        plan.budget(100, res, prompts_available={"a": 4})
    with pytest.raises(ValueError, match="RunConfig.model must be"):  # no pilot without a model
        config(model="", endpoints=srv.base_url)


def test_pilot_retries_transient_faults_and_counts_hard_ones():
    from faultserver import FaultConfig, FaultServer

    prompts = _prompts({"a": 6, "b": 6})
    sampling = Sampling(max_tokens=32)
    with FaultServer(FaultConfig(mode="500", first_k=3)) as srv:  # 3 failures, then fine
        cfg = config(endpoints=srv.base_url, sampling=sampling, max_attempts=3)
        res = plan.pilot_sync(prompts, cfg, per_dataset=3)
    assert res.errors == [] and res.frame.height == 6
    assert res.frame["completion_tokens"].sum() > 0 and res.tokens_per_s > 0
    with FaultServer(FaultConfig(mode="400")) as srv:  # not retryable: counted, not raised
        res = plan.pilot_sync(
            prompts, config(endpoints=srv.base_url, sampling=sampling), per_dataset=2
        )
        assert srv.stats()["requests"] == 4  # one attempt each
    assert res.frame.height == 0 and len(res.errors) == 4
    with pytest.raises(ValueError, match="max_attempts.*0"):
        config(max_attempts=0)


def test_pilot_takes_n_samples_per_prompt_like_a_run():
    from faultserver import FaultConfig, FaultServer

    prompts = _prompts({"a": 6, "b": 6})
    sampling = Sampling(max_tokens=32, n=3)
    with FaultServer(FaultConfig(latency=0.01)) as srv:
        res = plan.pilot_sync(
            prompts, config(endpoints=srv.base_url, sampling=sampling), per_dataset=2
        )
    assert res.errors == [] and res.frame.height == 12  # 2 prompts x 3 samples x 2 datasets
    assert res.frame.group_by("dataset", "prompt_id").len()["len"].to_list() == [3] * 4
    assert plan.budget(100, res, prompts_available=prompts)["n_pilot"].to_list()[:2] == [6, 6]
    with FaultServer(FaultConfig(mode="400")) as srv:  # every sample's failure is listed
        res = plan.pilot_sync(
            prompts, config(endpoints=srv.base_url, sampling=sampling), per_dataset=1
        )
    assert len(res.errors) == 6 and sum("#2:" in e for e in res.errors) == 2


def test_pilot_progress_is_the_runs_monitor_counting_every_request():
    """The pilot reports through kit.generate's progress callback, so the run's monitor draws
    it; with no budget (budget 0) each dataset's row counts the requests done, answered or
    failed, of all it sends, and the last report counts every one."""
    import io

    from faultserver import FaultConfig, FaultServer

    from kit.report.monitor import ConsoleMonitor

    seen, out = [], io.StringIO()
    monitor = ConsoleMonitor(out, min_interval=0)

    def progress(rows):
        seen.append(rows)
        monitor(rows)

    sampling = Sampling(max_tokens=16, n=2)
    with FaultServer(FaultConfig(mode="400", fraction=0.5, latency=0.01)) as srv:
        cfg = config(endpoints=srv.base_url, sampling=sampling, concurrency=3)
        res = plan.pilot_sync(_prompts({"a": 6, "b": 6}), cfg, per_dataset=4, progress=progress)
    monitor.close()
    assert res.errors and res.frame.height  # some answered, some failed (400, not retried)
    assert len(seen) >= 2  # while it ran, and once at the end
    last = {p.dataset: p for p in seen[-1]}
    block = out.getvalue().rsplit("[kit ", 1)[1].splitlines()
    for name in ("a", "b"):
        p = last[name]
        answered = res.frame.filter(pl.col("dataset") == name).height
        assert (p.budget, p.prompts_total, p.samples_done) == (0, 8, answered)
        assert p.errors == sum(e.startswith(f"{name}/") for e in res.errors) == 8 - answered
        line = next(line for line in block if line.startswith(f"{name} "))
        assert "[####################]  100%" in line and f" {answered}/8 " in line


def test_pilot_keeps_its_records_in_run_dir_and_resumes(tmp_path):
    from faultserver import FaultConfig, FaultServer

    prompts = _prompts({"a": 5})
    with FaultServer(FaultConfig(latency=0.01)) as srv:
        cfg = config(endpoints=srv.base_url, sampling=Sampling(max_tokens=16))
        first = plan.pilot_sync(prompts, cfg, per_dataset=3, run_dir=tmp_path / "pilot")
        again = plan.pilot_sync(prompts, cfg, per_dataset=3, run_dir=tmp_path / "pilot")
        assert srv.stats()["requests"] == 3  # the second pilot found every record on disk
    assert (tmp_path / "pilot" / "run.sqlite").is_file()
    assert again.frame["prompt_id"].to_list() == first.frame["prompt_id"].to_list()


@pytest.mark.server
def test_pilot_against_the_embedded_server(embedded_server):
    prompts = _prompts({"a": 10, "b": 10})
    cfg = config(
        model=embedded_server.model,
        endpoints=embedded_server.base_url,
        sampling=Sampling(max_tokens=16),
        seed=1,
        concurrency=4,
    )
    seen = []
    res = asyncio.run(plan.pilot(prompts, cfg, per_dataset=3, progress=seen.append))
    assert res.errors == [] and res.frame.height == 6
    last = [(p.dataset, p.samples_done, p.prompts_total, p.budget) for p in seen[-1]]
    assert sorted(last) == [("a", 3, 3, 0), ("b", 3, 3, 0)]  # every request, counted
    assert res.frame["dataset"].to_list() == ["a"] * 3 + ["b"] * 3
    assert set(res.frame["prompt_id"]) == set(plan.pilot_sample(prompts, 3, seed=1)["prompt_id"])
    assert all(0 < n <= 16 for n in res.frame["completion_tokens"])
    assert set(res.frame["finish_reason"]) <= {"stop", "length"}
    assert res.tokens_per_s > 0 and res.wall_s > 0
    assert (res.frame["latency_s"] > 0).all()
    prof = plan.profile_completions(res)
    assert prof["n"].to_list() == [3, 3]
    table = plan.budget(200, res, prompts_available=prompts, max_tokens=16)
    assert row(table, "a")["samples_needed"] >= math.ceil(200 / 16)  # can't beat max_tokens
    assert res.summary()["completions"] == 6

    async def inside_a_running_loop():  # a notebook: the sync wrapper must still work
        return plan.pilot_sync(prompts, cfg, per_dataset=3)

    again = asyncio.run(inside_a_running_loop())
    assert sorted(again.frame["prompt_id"]) == sorted(res.frame["prompt_id"])


# ---------------------------------------------------------------- charts


def _story_table() -> pl.DataFrame:
    samples = {name: spread(mean) for name, mean in STORY_MEANS.items()}
    return plan.budget(
        STORY_BUDGETS,
        samples,
        prompts_available=dict.fromkeys(STORY_MEANS, 22_000),
        sample_cap=7000,
    )


def _data_rows(spec: dict) -> list[int]:
    return sorted(len(v) for v in spec["datasets"].values())


def test_length_distribution_spec():
    frame = pl.DataFrame(
        {
            "dataset": ["a"] * 300 + ["b"] * 200,
            "completion_tokens": list(range(1, 301)) + list(range(1, 201)),
        }
    )
    spec = charts.length_distribution(frame, bins=10).to_dict()
    boxes, hist = spec["vconcat"]
    assert [layer["mark"]["type"] for layer in boxes["layer"]] == ["rule", "bar", "tick"]
    assert hist["facet"]["row"]["field"] == "dataset"
    assert hist["spec"]["mark"]["type"] == "bar"
    assert (
        hist["spec"]["encoding"]["x"]["field"] == "start"
        and hist["spec"]["encoding"]["x2"]["field"] == "end"
    )
    assert _data_rows(spec) == [2, 17]  # box stats per dataset; 10 + 7 non-empty bins
    log = charts.length_distribution(frame, log=True, bins=10).to_dict()
    assert log["vconcat"][1]["spec"]["encoding"]["x"]["scale"]["type"] == "log"
    counts = [r["count"] for d in log["datasets"].values() for r in d if "count" in r]
    assert sum(counts) == 500  # every row lands in a bin


def test_samples_needed_spec():
    spec = charts.samples_needed(_story_table()).to_dict()
    marks = [layer["mark"]["type"] for layer in spec["layer"]]
    assert marks == ["errorbar", "point", "tick"]
    assert spec["layer"][0]["encoding"]["x2"]["field"] == "samples_needed_upper"
    assert spec["layer"][2]["encoding"]["x"]["field"] == "prompts_available"
    assert _data_rows(spec) == [4]  # no TOTAL row


def test_budget_vs_cap_spec():
    spec = charts.budget_vs_cap(_story_table()).to_dict()
    assert [layer["mark"]["type"] for layer in spec["layer"]] == ["bar", "text"]
    assert spec["layer"][0]["encoding"]["yOffset"]["field"] == "kind"
    assert _data_rows(spec) == [4, 8]  # labels; budget + cap per dataset
    labels = {
        r["dataset"]: r["label"] for d in spec["datasets"].values() for r in d if "label" in r
    }
    assert labels["sharegpt"] == "2.66x"


def test_the_plan_config_is_the_run_config_stored_once(tmp_path):
    """The plan's RunConfig is the config row: no fingerprint until a run starts with it,
    then a new plan must keep the run's fingerprint."""
    table = pl.DataFrame({"dataset": ["a"], "budget": [500]})
    run_dir = tmp_path / "run"
    plan.write_plan(run_dir, table, config())
    fingerprint = "SELECT fingerprint FROM config"
    with sqlite3.connect(run_dir / "run.sqlite") as conn:
        assert conn.execute(fingerprint).fetchone() == ("",)
    conn.close()
    store = RunStore(run_dir)  # the first run may change anything: nothing ran before it
    store.init(config(model="other", budgets={"a": 500}))
    store.close()
    assert plan.run_started(run_dir) and plan.read_plan(run_dir)["config"].model == "other"
    with pytest.raises(ValueError, match="holds a run made with another model"):
        plan.write_plan(run_dir, table, config())
    plan.write_plan(
        run_dir,
        pl.DataFrame({"dataset": ["a"], "budget": [900]}),
        config(model="other", concurrency=3),
    )
    back = plan.read_plan(run_dir)
    assert (back["config"].budgets, back["config"].concurrency) == ({"a": 900}, 3)
    with sqlite3.connect(run_dir / "run.sqlite") as conn:
        assert conn.execute(fingerprint).fetchone() == (config(model="other").fingerprint(),)
    conn.close()


def test_a_plan_json_of_an_older_kit_is_imported_once(tmp_path):
    table = plan.budget({"a": 1000}, {"a": spread(100)}, prompts_available={"a": 99})
    cfg = config(budgets={"a": 1000}, concurrency=5)
    doc = {
        "version": 2,
        "created": "2026-12-01T10:00:00+00:00",
        "budgets": {"a": 1000},
        "config": cfg.to_dict(),
        "sources": None,
        "server": {"embedded": False, "engine": None},
        "pilot": None,
        "table": table.to_dicts(),
    }
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    back = plan.read_plan(tmp_path)
    assert not (tmp_path / "plan.json").exists() and (tmp_path / "plan.json.imported").is_file()
    assert back["config"] == cfg and back["created"] == doc["created"]
    assert back["server"] == doc["server"] and plan.pilot_means(back) == {"a": 100.0}
    assert plan.read_plan(tmp_path)["table"].equals(back["table"])  # from the database now


def test_a_prompt_frame_gives_n_samples_a_prompt():
    """With sampling.n = 2 a dataset of 3 prompts gives 6 samples: a budget needing 5 is no
    shortfall (a frame counted as prompts said so); a count given as a dict is taken as is."""
    prompts = pl.DataFrame({"dataset": ["a"] * 3, "prompt_id": ["p0", "p1", "p2"]})
    lengths = pl.DataFrame({"dataset": ["a"] * 4, "completion_tokens": [90, 100, 110, 100]})

    def planned(n, available):
        pilot = PilotResult(frame=lengths, wall_s=1.0, sampling=Sampling(max_tokens=512, n=n))
        return plan.budget({"a": 500}, pilot, prompts_available=available).row(0, named=True)

    two = planned(2, prompts)
    assert (two["prompts_available"], two["shortfall"]) == (6, False)
    one = planned(1, prompts)
    assert (one["prompts_available"], one["shortfall"]) == (3, True)
    assert "3 samples left" in one["note"]
    assert planned(2, {"a": 3})["prompts_available"] == 3
