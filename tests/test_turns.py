"""The runner's side of issue 12: all_turns regeneration, tools and per-dataset template
kwargs sent with each request, against the fault server (its answers are deterministic)."""

from __future__ import annotations

import json

import polars as pl
from faultserver import FaultConfig, FaultServer

import kit
from kit.run.reader import open_db, records_frame
from kit.run.turns import slots
from kit.types import RunConfig, Sampling

MAX_TOKENS = 30


def conversations(n: int, dataset: str = "chat") -> pl.DataFrame:
    """n prompts with 0, 1 or 2 earlier assistant turns written by "the dataset"."""
    rows = []
    for i in range(n):
        messages = [{"role": "user", "content": f"{dataset} question {i}"}]
        for k in range(i % 3):
            messages += [
                {"role": "assistant", "content": f"DATASET ANSWER {i}.{k}"},
                {"role": "user", "content": f"follow-up {i}.{k}"},
            ]
        rows.append(
            {
                "dataset": dataset,
                "prompt_id": f"{dataset}-{i:03d}",
                "messages": messages,
                "n_turns": len(messages),
                "row": i,
            }
        )
    return pl.DataFrame(rows)


def config(url: str, budgets, **kw) -> RunConfig:
    base = dict(
        model="fake",
        endpoints=url,
        budgets=budgets,
        concurrency=8,
        retry_base=0.02,
        sampling=Sampling(max_tokens=MAX_TOKENS),
    )
    return RunConfig(**(base | kw))


def raw(run_dir) -> list[dict]:
    """The records as a reader gives them back: a record holds no prompt (the prompts table
    does), the reader rebuilds it with the target's own earlier answers (Record.turns)."""
    with open_db(run_dir) as conn:
        stored = [c for (_, c, *_) in conn.execute("PRAGMA table_info(records)")]
        n = conn.execute("SELECT count(*) FROM records").fetchone()[0]
    assert n and "messages" not in stored and "tools" not in stored
    rows = records_frame(run_dir).to_dicts()
    assert len(rows) == n
    return [r | {k: json.loads(r[k]) if r[k] else None for k in ("turns", "tools")} for r in rows]


def test_all_turns_replaces_every_dataset_answer_and_counts_every_turn(tmp_path):
    frame = conversations(60)
    budget = 2500
    with FaultServer(FaultConfig(min_words=5, max_words=40)) as srv:
        run = kit.generate_sync(
            frame, config(srv.base_url, budget, turns="all_turns"), run_dir=tmp_path / "run"
        )
        requests = srv.stats()["requests"]
    records = raw(tmp_path / "run")
    assert run.stop_reason is None and records
    sources = {r["prompt_id"]: r["messages"] for r in frame.to_dicts()}
    multi = 0
    for r in records:
        source = sources[r["prompt_id"]]
        assistant = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
        assert not any("DATASET ANSWER" in a for a in assistant), r["prompt_id"]  # target text only
        assert [m for m in r["messages"] if m["role"] != "assistant"] == [
            m for m in source if m["role"] != "assistant"
        ]
        turns = r["turns"] or []
        assert len(turns) == slots(source) - 1 and assistant == [t["content"] for t in turns]
        assert r["completion_tokens"] == sum(t["completion_tokens"] for t in turns) + len(
            r["completion"].split()
        )
        multi += bool(turns)
    assert multi >= 10
    assert requests == sum(slots(sources[r["prompt_id"]]) for r in records)  # no hidden requests
    total = sum(r["completion_tokens"] for r in records)
    most = 3 * MAX_TOKENS  # the longest conversation's generated turns
    assert budget <= total <= budget + max(0.01 * budget, most), total
    assert records_frame(tmp_path / "run")["completion_tokens"].sum() == total


def test_last_turn_keeps_the_dataset_turns_and_sends_one_request(tmp_path):
    frame = conversations(30)
    with FaultServer(FaultConfig()) as srv:
        kit.generate_sync(frame, config(srv.base_url, 10**6), run_dir=tmp_path / "run")
        assert srv.stats()["requests"] == 30
    records = raw(tmp_path / "run")
    sources = {r["prompt_id"]: r["messages"] for r in frame.to_dicts()}
    assert all(r["messages"] == sources[r["prompt_id"]] and r["turns"] is None for r in records)


def test_tools_and_template_kwargs_reach_the_requests(tmp_path):
    tools = [
        {
            "type": "function",
            "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
        }
    ]
    agent = conversations(3, "agent").with_columns(tools=pl.lit(json.dumps(tools)))
    plain = conversations(3, "plain").with_columns(tools=pl.lit(None, pl.String))
    thinking = Sampling(max_tokens=MAX_TOKENS, chat_template_kwargs={"enable_thinking": True})
    sent = {}
    for name, frame in (("agent", agent), ("plain", plain)):
        with FaultServer(FaultConfig()) as srv:
            cfg = config(
                srv.base_url,
                10**6,
                concurrency=1,
                sampling=thinking,
                template_kwargs={"plain": {"enable_thinking": False}},
            )
            kit.generate_sync(frame, cfg, run_dir=tmp_path / name)
            sent[name] = srv.last_body
    assert sent["agent"]["tools"] == tools
    assert sent["agent"]["chat_template_kwargs"] == {"enable_thinking": True}
    assert "tools" not in sent["plain"]
    assert sent["plain"]["chat_template_kwargs"] == {"enable_thinking": False}
    records = raw(tmp_path / "agent") + raw(tmp_path / "plain")
    assert sorted(json.dumps(r["tools"]) for r in records) == [json.dumps(tools)] * 3 + ["null"] * 3
