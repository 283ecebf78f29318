"""The runner: interleaving, seeded order, n samples, budgets, resume, sync parity, background."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

import polars as pl
import pytest
from faultserver import FaultConfig, FaultServer

import kit
from kit.run import reader
from kit.run import runner as runner_module
from kit.run.reader import open_db, read_config, records_frame
from kit.run.store import FingerprintMismatch
from kit.types import RunConfig, Sampling


def prompts(sizes: dict[str, int]) -> pl.DataFrame:
    """A prompt frame: sizes = {dataset: number of prompts}."""
    rows = [
        {
            "dataset": ds,
            "prompt_id": f"{ds}-{i:04d}",
            "messages": [{"role": "user", "content": f"{ds} question {i}"}],
            "n_turns": 1,
            "row": i,
        }
        for ds, n in sizes.items()
        for i in range(n)
    ]
    return pl.DataFrame(rows)


@pytest.fixture
def server():
    with FaultServer(FaultConfig(latency=0.01, min_words=5, max_words=60)) as srv:
        yield srv


def config(srv, budgets, **kw) -> RunConfig:
    """The tests' RunConfig: the fault server, max_tokens 40, fast retries."""
    base = dict(
        model="fake",
        endpoints=srv.base_url,
        budgets=budgets,
        sampling=Sampling(max_tokens=40),
        concurrency=16,
        retry_base=0.02,
    )
    return RunConfig(**(base | kw))


async def wait_for(cond, timeout: float = 60.0, what: str = "condition") -> None:
    """Poll cond() on the running loop until it holds; fail after a generous timeout."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout:g} s")
        await asyncio.sleep(0.01)


def totals(run_dir) -> dict[str, int]:
    f = records_frame(run_dir)
    return dict(f.group_by("dataset").agg(pl.col("completion_tokens").sum()).iter_rows())


def assert_no_duplicates(run_dir) -> int:
    """Every stored record is a distinct key, and the totals equal the records; the count."""
    f = records_frame(run_dir, prompts=False)
    keys = list(f.select("dataset", "prompt_id", "sample").iter_rows())
    assert len(keys) == len(set(keys)), Counter(keys).most_common(3)
    sums = {
        ds: (n, t)
        for ds, n, t in f.group_by("dataset")
        .agg(pl.len(), pl.col("completion_tokens").sum())
        .iter_rows()
    }
    with open_db(run_dir) as conn:
        assert {ds: (n, t) for ds, (n, t, _) in reader.totals(conn).items()} == sums
    return len(keys)


def test_datasets_are_interleaved(server, tmp_path):
    budgets = {"a": 1500, "b": 1500, "c": 1500}
    frame = prompts(dict.fromkeys(budgets, 100))
    kit.generate_sync(frame, config(server, budgets, concurrency=6), run_dir=tmp_path / "run")
    first = records_frame(tmp_path / "run").sort("t_done").head(15)
    assert set(first["dataset"]) == {"a", "b", "c"}


def test_seeded_order_is_a_random_sample(server, tmp_path):
    frame = prompts({"a": 300})

    def done_ids(seed, name):
        cfg = config(server, {"a": 400}, concurrency=1, seed=seed)
        kit.generate_sync(frame, cfg, run_dir=tmp_path / name)
        return set(records_frame(tmp_path / name)["prompt_id"])

    first, again, other = done_ids(0, "s0"), done_ids(0, "s0b"), done_ids(1, "s1")
    assert first == again and first != other
    rows = sorted(int(p.split("-")[1]) for p in first)
    assert 5 <= len(rows) < 60 and rows[-1] > 100  # a sample spread over the file, not its head


def test_n_samples_per_prompt(server, tmp_path):
    cfg = config(server, {"a": 100_000}, sampling=Sampling(max_tokens=40, n=3, seed=7))
    run = kit.generate_sync(prompts({"a": 10}), cfg, run_dir=tmp_path / "run")
    f = records_frame(tmp_path / "run")
    assert sorted(zip(f["prompt_id"], f["sample"], strict=True)) == [
        (f"a-{i:04d}", s) for i in range(10) for s in range(3)
    ]
    distinct = f.group_by("prompt_id").agg(pl.col("completion").n_unique())["completion"]
    assert (distinct == 3).sum() >= 8  # sample i is sent with seed 7 + i
    row = run.summary().row(0, named=True)
    assert row["state"] == "exhausted" and row["shortfall"] == 100_000 - row["tokens_done"] > 0


def test_one_budget_number_applies_to_every_dataset(server, tmp_path):
    frame = prompts({"a": 100, "b": 100})
    run = kit.generate_sync(frame, config(server, 300), run_dir=tmp_path / "run")
    got = totals(tmp_path / "run")
    assert run.summary()["budget"].to_list() == [300, 300]
    assert all(0 <= got[d] - 300 <= 40 for d in ("a", "b")), got
    assert read_config(tmp_path / "run").budgets == {"a": 300, "b": 300}  # stored expanded


@pytest.mark.parametrize("policy", ["drain", "cancel"])
def test_budgets_are_held(server, tmp_path, policy):
    budgets = {"a": 2000, "b": 5000, "c": 800}
    max_tokens = 40
    cfg = config(server, budgets, policy=policy, concurrency=64)
    run = kit.generate_sync(prompts(dict.fromkeys(budgets, 400)), cfg, run_dir=tmp_path / "run")
    got = totals(tmp_path / "run")
    for ds, budget in budgets.items():
        over = got[ds] - budget
        print(f"{policy} {ds}: budget {budget}, final {got[ds]}, overshoot {over}")
        assert 0 <= over <= max(0.01 * budget, max_tokens)
        if policy == "cancel":
            assert over < max_tokens  # at most the last record crosses
    assert set(run.summary()["state"]) == {"budget_reached"}
    assert run.summary()["tokens_done"].to_list() == [got[d] for d in budgets]
    assert_no_duplicates(tmp_path / "run")


def test_background_stop_then_resume(tmp_path):
    asyncio.run(_background_stop_then_resume(tmp_path))


async def _background_stop_then_resume(tmp_path):
    budgets = {"a": 3000, "b": 2000}
    frame = prompts(dict.fromkeys(budgets, 300))
    run_dir = tmp_path / "run"
    with FaultServer(FaultConfig(latency=0.05, min_words=5, max_words=60)) as srv:
        cfg = config(srv, budgets, concurrency=8)
        run = await kit.generate(frame, cfg, run_dir=run_dir, background=True)
        assert not run.done
        seen_in_flight = 0

        def past_1000() -> bool:  # polled on the runner's own loop: it cannot run far ahead
            nonlocal seen_in_flight
            status = run.status()
            seen_in_flight = max(seen_in_flight, int(status.frame["in_flight"].sum()))
            return status.frame["tokens_done"].sum() > 1000

        await wait_for(past_1000, what="1000 tokens done")
        run.stop()
        await run.wait()
        assert run.done and run.stop_reason == "stopped by user" and seen_in_flight > 0
        assert set(run.status().frame["state"]) == {"stopped"}
        before = {p: p.read_bytes() for p in (run_dir / "records").glob("*.jsonl")}
        assert 1000 < sum(totals(run_dir).values()) < 5000

        run2 = await kit.generate(None, cfg, run_dir=run_dir)  # resume from prompts.parquet
        for p, data in before.items():
            assert p.read_bytes().startswith(data)
        got = totals(run_dir)
        assert all(0 <= got[d] - b <= 40 for d, b in budgets.items()), got
        assert set(run2.summary()["state"]) == {"budget_reached"}
        n = assert_no_duplicates(run_dir)

        bigger = config(srv, {"a": 4000, "b": 2000}, concurrency=8)
        await kit.generate(frame, bigger, run_dir=run_dir)  # a bigger budget continues
        assert 4000 <= totals(run_dir)["a"] <= 4040 and assert_no_duplicates(run_dir) > n

        run3 = await kit.resume(run_dir, budgets={"a": 4000, "b": 2500})
        assert 2500 <= totals(run_dir)["b"] <= 2540 and assert_no_duplicates(run_dir) > n
        assert run3.summary()["budget"].to_list() == [4000, 2500]


def test_sync_matches_async(server, tmp_path):
    frame = prompts({"a": 40, "b": 25})
    budgets = {"a": 100_000, "b": 100_000}  # every prompt runs: the sets must be equal
    cfg = config(server, budgets, sampling=Sampling(max_tokens=40, temperature=0.0, seed=3))

    def table(run_dir):
        f = records_frame(run_dir).select(
            "dataset", "prompt_id", "sample", "completion", "completion_tokens"
        )
        return f.sort("dataset", "prompt_id", "sample")

    async def in_loop():  # generate_sync inside a running loop (Jupyter): worker thread
        return kit.generate_sync(frame, cfg, run_dir=tmp_path / "t")

    kit.generate_sync(frame, cfg, run_dir=tmp_path / "s")
    asyncio.run(kit.generate(frame, cfg, run_dir=tmp_path / "a"))
    asyncio.run(in_loop())
    s, a, t = table(tmp_path / "s"), table(tmp_path / "a"), table(tmp_path / "t")
    assert len(s) == 65 and s.equals(a) and s.equals(t)


def test_a_load_result_runs_without_its_frame_read_whole(server, tmp_path, monkeypatch):
    """kit.generate(LoadResult): the store takes its prompts a part at a time and the queues
    read the texts back by key (as a resume does); the records equal those of its frame."""
    from kit.data import sources

    rows = [{"instruction": f"{ds} task {i}"} for ds in "ab" for i in range(23)]
    for ds in "ab":
        (tmp_path / f"{ds}.jsonl").write_text(
            "".join(f'{{"instruction": "{ds} task {i}"}}\n' for i in range(23))
        )
    monkeypatch.setattr(sources, "CHUNK", 5)
    loaded = kit.load([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")])
    frame = loaded.frame
    assert len(loaded.parts) == 10 and frame.height == len(rows)
    cfg = config(
        server,
        {"a": 100_000, "b": 100_000},
        sampling=Sampling(max_tokens=40, temperature=0.0, seed=3),
    )
    kit.generate_sync(frame, cfg, run_dir=tmp_path / "f")
    monkeypatch.setattr(
        sources.LoadResult, "frame", property(lambda self: pytest.fail("frame read"))
    )
    kit.generate_sync(loaded, cfg, run_dir=tmp_path / "l")
    cols = ["dataset", "prompt_id", "sample", "messages", "completion", "completion_tokens"]
    f, g = (records_frame(tmp_path / d).select(cols).sort(cols[:3]) for d in "fl")
    assert f.height == 46 and f.equals(g)
    assert (
        reader.prompts_frame(tmp_path / "l")
        .sort("prompt_id")
        .equals(reader.prompts_frame(tmp_path / "f").sort("prompt_id"))
    )


class Ticks:
    """A fake clock: each call moves it on by `step` seconds; `.t` reads it without moving."""

    def __init__(self, step: float) -> None:
        self.t, self.step, self.calls = 0.0, step, 0

    def __call__(self) -> float:
        self.t += self.step
        self.calls += 1
        return self.t


def test_progress_callback_at_most_once_a_second(server, tmp_path, monkeypatch):
    # the runner's report clock moves 0.25 s per scheduling step: a callback every 4th step
    ticks = Ticks(0.25)
    monkeypatch.setattr(runner_module.Runner, "clock", staticmethod(ticks))
    calls = []
    kit.generate_sync(
        prompts({"a": 100}),
        config(server, {"a": 2000}, concurrency=4),
        run_dir=tmp_path / "run",
        progress=lambda p: calls.append((ticks.t, p)),
    )
    gaps = [b[0] - a[0] for a, b in zip(calls[:-2], calls[1:-1], strict=True)]
    assert len(calls) >= 3 and all(g >= 1.0 for g in gaps), gaps
    assert len(calls) <= ticks.calls / 4 + 2  # the steps in between were not reported
    assert calls[-1][1][0].state == "budget_reached" and calls[-1][1][0].tokens_done >= 2000


def test_bad_settings_raise(tmp_path):
    frame = prompts({"a": 3})
    cfg = RunConfig(model="fake", endpoints="http://127.0.0.1:9/v1", budgets={"b": 10})
    with pytest.raises(ValueError, match=r"no entry for datasets \['a'\]"):
        kit.generate_sync(frame, cfg, run_dir=tmp_path / "run")
    with pytest.raises(ValueError, match=r"names datasets \['b'\] that have no prompts"):
        kit.generate_sync(
            prompts({"a": 3, "b": 2}).filter(pl.col("dataset") == "a"),
            RunConfig(**(cfg.to_dict() | {"budgets": {"a": 5, "b": 10}})),
            run_dir=tmp_path / "run",
        )
    with pytest.raises(TypeError, match="config must be a kit.RunConfig, got dict"):
        kit.generate_sync(frame, cfg.to_dict(), run_dir=tmp_path / "run")
    with pytest.raises(ValueError, match="prompt frame lacks columns"):
        kit.generate_sync(frame.drop("messages"), cfg, run_dir=tmp_path / "run")
    with pytest.raises(ValueError, match="prompts=None but"):
        kit.generate_sync(None, cfg, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_changed_fingerprint_is_refused(server, tmp_path):
    frame = prompts({"a": 5})
    kit.generate_sync(frame, config(server, {"a": 50}), run_dir=tmp_path / "run")
    changed = config(server, {"a": 50}, sampling=Sampling(max_tokens=20))
    with pytest.raises(FingerprintMismatch, match="sampling.max_tokens: 40 -> 20"):
        kit.generate_sync(frame, changed, run_dir=tmp_path / "run")
    kit.generate_sync(frame, changed, run_dir=tmp_path / "run", force=True)
    assert read_config(tmp_path / "run").sampling.max_tokens == 20


def test_api_key_never_written(server, tmp_path, monkeypatch):
    secret = "sk-test-0123456789abcdef"
    monkeypatch.setenv("KIT_TEST_KEY", secret)
    cfg = config(server, {"a": 300}, api_key_env="KIT_TEST_KEY")
    kit.generate_sync(prompts({"a": 20}), cfg, run_dir=tmp_path / "run")
    assert server.last_headers["authorization"] == f"Bearer {secret}"  # the key was used
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert (tmp_path / "run" / "run.sqlite") in files  # the database, its bytes included
    assert not any(secret.encode() in p.read_bytes() for p in files)
    assert read_config(tmp_path / "run").api_key_env == "KIT_TEST_KEY"


SAMPLE_SETS = ["alpaca_tasks.jsonl", "chat_general.jsonl", "code_instruct.jsonl", "math_word.json"]


@pytest.mark.server
@pytest.mark.slow
def test_real_server_holds_budgets(embedded_server, tmp_path):
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "data" / "samples"
    frame = kit.load([root / name for name in SAMPLE_SETS]).frame
    names = frame["dataset"].unique(maintain_order=True).to_list()
    budgets = dict(zip(names, [600, 900, 750, 600], strict=True))
    max_tokens = 64
    for policy in ("drain", "cancel"):
        run_dir = tmp_path / policy
        cfg = RunConfig(
            model=embedded_server.model,
            endpoints=embedded_server.base_url,
            budgets=budgets,
            sampling=Sampling(max_tokens=max_tokens, temperature=0.7),
            concurrency=16,
            policy=policy,
            tokenizer=str(embedded_server.model_dir),
            timeout=900,
        )
        t0 = time.monotonic()
        run = kit.generate_sync(frame, cfg, run_dir=run_dir)
        print(f"\n{policy}: {time.monotonic() - t0:.0f} s\n{run.summary()}")
        got = totals(run_dir)
        for ds, budget in budgets.items():
            over = got[ds] - budget
            print(
                f"{policy} {ds}: budget {budget}, final {got[ds]}, overshoot {over} ({over / budget:.1%})"
            )
            assert 0 <= over <= max(0.01 * budget, max_tokens)
            if policy == "cancel":
                assert over < max_tokens
        assert run.summary()["errors"].sum() == 0
        assert_no_duplicates(run_dir)


def test_cancelled_task_stops_cleanly(server, tmp_path):
    async def main():
        cfg = config(server, {"a": 5000}, concurrency=4)
        run = await kit.generate(
            prompts({"a": 300}), cfg, run_dir=tmp_path / "run", background=True
        )
        await wait_for(lambda: run.status().frame["samples_done"].sum() >= 10, what="10 samples")
        run.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run.wait()
        return run

    run = asyncio.run(main())
    assert run.done and run.stop_reason == "interrupted (CancelledError)"
    frame = run.status().frame
    assert frame["state"][0] == "stopped" and frame["in_flight"][0] == 0
    assert assert_no_duplicates(tmp_path / "run") == frame["samples_done"][0] >= 10


def test_the_heap_is_frozen_only_while_a_run_schedules(server, tmp_path):
    """gc.freeze while the run schedules (full collections skip the older heap), unfrozen
    when it ends, even by a cancel; a heap frozen by the host process is left as it was."""
    import gc

    async def main(run_dir, stop):
        run = await kit.generate(
            prompts({"a": 300}),
            config(server, {"a": 5000}, concurrency=4),
            run_dir=run_dir,
            background=True,
        )
        await wait_for(lambda: run.status().frame["samples_done"].sum() >= 5, what="5 samples")
        during = gc.get_freeze_count()
        stop(run)
        with contextlib.suppress(asyncio.CancelledError):
            await run.wait()
        return during

    assert gc.get_freeze_count() == 0
    assert asyncio.run(main(tmp_path / "a", lambda run: run.stop())) > 0
    assert gc.get_freeze_count() == 0
    assert asyncio.run(main(tmp_path / "b", lambda run: run.task.cancel())) > 0
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()  # it only shrinks, as frozen objects are freed
        assert asyncio.run(main(tmp_path / "c", lambda run: run.stop())) <= frozen
        assert 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def test_samples_are_sent_sample_major_in_a_seeded_prompt_order():
    from kit.run.queues import seeded_order

    ids = [f"p{i:03d}" for i in range(50)]
    order = seeded_order(ids, "d", seed=3, n=4)
    assert sorted(order) == sorted((p, s) for p in ids for s in range(4))
    assert [s for _, s in order] == sorted(s for _, s in order)  # every sample 0 first
    first = [p for p, s in order if s == 0]
    assert first == [p for p, _ in seeded_order(list(reversed(ids)), "d", seed=3)]  # file order
    assert first == [p for p, s in order if s == 3] and first != sorted(ids)
    assert first != [p for p, _ in seeded_order(ids, "other", seed=3)]
    # a budget that takes a quarter of the samples still sees every prompt once
    assert len({p for p, _ in order[: len(order) // 4]}) == len(ids)


def test_a_budget_cut_short_spreads_over_distinct_prompts(server, tmp_path):
    # 40 prompts x 4 samples; a budget of ~30 samples (40 tokens max each) stops in sample 0
    cfg = config(server, {"a": 600}, concurrency=4, sampling=Sampling(max_tokens=40, n=4))
    kit.generate_sync(prompts({"a": 40}), cfg, run_dir=tmp_path / "run")
    f = records_frame(tmp_path / "run")
    assert 10 <= f.height < 40 and set(f["sample"]) == {0}
    assert f["prompt_id"].n_unique() == f.height
    from kit.run.queues import seeded_order

    order = [p for p, _ in seeded_order([f"a-{i:04d}" for i in range(40)], "a", 0)]
    assert set(f["prompt_id"]) == set(order[: f.height])  # the run's first prompts, in order
