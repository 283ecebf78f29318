"""The context guard: prompts too long for the target are skipped, counted and listed, never sent."""

from __future__ import annotations

import json
import shutil

import orjson
import polars as pl
import pytest
from faultserver import FaultConfig, FaultServer

import kit
from kit.run.guard import model_context
from kit.run.store import progress, records_frame
from kit.tokens import count_prompt_tokens
from kit.types import RunConfig, Sampling

MAX_TOKENS, MAX_CONTEXT = 40, 400


def frame(spec: dict[str, dict[str, int]]) -> pl.DataFrame:
    """spec = {dataset: {kind: count}}; kinds short (~40 tokens), medium (~80), long (~430)."""
    words = {"short": 3, "medium": 40, "long": 400}
    rows = []
    for ds, kinds in spec.items():
        for kind, count in kinds.items():
            for i in range(count):
                text = f"{kind} question {i} " + "word " * words[kind]
                rows.append({"dataset": ds, "prompt_id": f"{ds}-{kind}-{i}", "n_turns": 1, "row": len(rows), "messages": [{"role": "user", "content": text}]})  # fmt: skip
    return pl.DataFrame(rows)


def config(srv, budgets, model_dir, **kw) -> RunConfig:
    base = dict(model="fake", endpoints=srv.base_url, budgets=budgets, tokenizer=str(model_dir), sampling=Sampling(max_tokens=MAX_TOKENS), concurrency=8, retry_base=0.02)  # fmt: skip
    return RunConfig(**(base | kw))


@pytest.mark.server
@pytest.mark.slow
def test_long_prompts_are_skipped_counted_and_listed(model_dir, tmp_path):
    prompts = frame({"a": {"short": 60, "medium": 5, "long": 5}, "b": {"short": 20, "medium": 4, "long": 3}})  # fmt: skip
    counted = count_prompt_tokens(model_dir, prompts)  # the truth, every prompt tokenized
    truth = counted.filter(pl.col("prompt_tokens") + MAX_TOKENS > MAX_CONTEXT)
    assert sorted(truth["prompt_id"]) == sorted(p for p in prompts["prompt_id"] if "long" in p)
    budgets = {"a": 600, "b": 100_000}
    with FaultServer(FaultConfig(latency=0.01, min_words=5, max_words=60)) as srv:
        cfg = config(srv, budgets, model_dir, max_context=MAX_CONTEXT)
        run = kit.generate_sync(prompts, cfg, run_dir=tmp_path / "run")
        sent = srv.stats()["requests"]
        summary = {r["dataset"]: r for r in run.summary().iter_rows(named=True)}
        print(f"\n{run.summary()}")
        assert {d: summary[d]["skipped_context"] for d in budgets} == {"a": 5, "b": 3}
        records = records_frame(run.run_dir)
        assert sent == len(records) and summary["a"]["errors"] == summary["b"]["errors"] == 0
        assert not set(records["prompt_id"]) & set(truth["prompt_id"])  # never sent
        over = summary["a"]["tokens_done"] - budgets["a"]
        assert summary["a"]["state"] == "budget_reached" and 0 <= over <= MAX_TOKENS
        assert summary["b"]["state"] == "exhausted" and summary["b"]["samples_done"] == 24

        listed = [
            orjson.loads(x) for x in (run.run_dir / "skipped.jsonl").read_bytes().splitlines()
        ]
        expect = dict(zip(truth["prompt_id"], truth["prompt_tokens"], strict=True))
        assert {r["prompt_id"]: r["prompt_tokens"] for r in listed} == expect
        assert all(r["reason"] == "context" and r["max_context"] == MAX_CONTEXT for r in listed)
        on_disk = {p.dataset: p for p in progress(run.run_dir)}  # kit.watch's view
        assert (on_disk["a"].skipped, on_disk["b"].skipped, on_disk["b"].state) == (
            5,
            3,
            "exhausted",
        )
        status = json.loads((run.run_dir / "status.json").read_text())
        assert [d["skipped"] for d in status["datasets"]] == [5, 3]

        before = (run.run_dir / "skipped.jsonl").read_bytes()
        again = kit.generate_sync(None, cfg, run_dir=run.run_dir)  # resume: nothing new to send
        assert srv.stats()["requests"] == sent
        assert (run.run_dir / "skipped.jsonl").read_bytes() == before  # listed once, not per start
        assert again.summary()["skipped_context"].to_list() == [5, 3]


@pytest.mark.server
def test_default_context_comes_from_the_model(model_dir, tmp_path):
    assert model_context(model_dir) == 8192  # config.json max_position_embeddings
    nested = tmp_path / "nested"
    nested.mkdir()
    (nested / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 4096}}))  # fmt: skip
    assert model_context(nested) == 4096
    bare = tmp_path / "bare"  # no config.json: the tokenizer's model_max_length
    bare.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, bare / name)
    assert model_context(bare) == 8192

    prompts = frame({"a": {"short": 6}})
    huge = {"dataset": "a", "prompt_id": "a-huge", "n_turns": 1, "row": 6, "messages": [{"role": "user", "content": "word " * 9000}]}  # fmt: skip
    prompts = pl.concat([prompts, pl.DataFrame([huge])])
    with FaultServer(FaultConfig(min_words=5, max_words=30)) as srv:
        cfg = config(srv, {"a": 10_000}, model_dir)
        run = kit.generate_sync(prompts, cfg, run_dir=tmp_path / "run")
        assert srv.stats()["requests"] == 6
    row = run.summary().row(0, named=True)
    assert (row["skipped_context"], row["samples_done"], row["state"]) == (1, 6, "exhausted")
    listed = orjson.loads((run.run_dir / "skipped.jsonl").read_bytes())
    assert listed["prompt_id"] == "a-huge" and listed["max_context"] == 8192
    assert listed["prompt_tokens"] > 9000


def test_no_tokenizer_no_guard_and_bad_settings_raise(tmp_path):
    prompts = frame({"a": {"short": 3, "long": 2}})
    with FaultServer(FaultConfig(min_words=5, max_words=30)) as srv:
        args = dict(model="fake", endpoints=srv.base_url, sampling=Sampling(max_tokens=MAX_TOKENS), retry_base=0.02)  # fmt: skip
        run = kit.generate_sync(
            prompts, RunConfig(budgets={"a": 10_000}, **args), run_dir=tmp_path / "run"
        )
        assert srv.stats()["requests"] == 5  # without a tokenizer every prompt is sent
        assert run.summary()["skipped_context"].to_list() == [0]
        assert not (tmp_path / "run" / "skipped.jsonl").exists()
    for value in (0, 2.5):  # the config refuses these itself
        with pytest.raises(ValueError, match=f"RunConfig.max_context must be .*, got {value}"):
            RunConfig(budgets={"a": 100}, max_context=value, tokenizer="x", **args)
    bad = [  # refused by generate before anything is loaded, sent or written
        ({"max_context": 400}, "max_context=400 needs tokenizer"),
        ({"max_context": 30, "tokenizer": "x"}, "max_context=30 leaves no room"),
    ]
    for extra, message in bad:
        with pytest.raises(ValueError, match=message):
            kit.generate_sync(prompts, RunConfig(budgets={"a": 100}, **args, **extra), run_dir=tmp_path / "bad")  # fmt: skip
    assert not (tmp_path / "bad").exists()
