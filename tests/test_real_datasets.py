"""Issue 24: public prompt sets nobody here wrote, end to end (rows written here in their
real formats: GSM8K, HumanEval, MT-bench, FastChat/ShareGPT conversations, Alpaca, a
function-calling set in OpenAI messages with tools). One test (or a few) per item; the tool
dataset on the real vLLM is tests/test_vllm.py::test_vllm_tool_dataset_end_to_end."""

from __future__ import annotations

import asyncio
import json
import math
import sqlite3
import warnings

import polars as pl
import pytest
from faultserver import FaultConfig, FaultServer
from test_audit import ANSWERS, make_record, plant_run
from test_cli import FakeRun, fake_pilot
from test_cli import run_main as run_kit
from test_export import set_config

import kit
from kit.errors import BackendError
from kit.report.flags import AuditThresholds
from kit.run.backends import VLLMChat
from kit.run.reader import read_config
from kit.types import Record, RunConfig, Sampling

# ---------------------------------------------------------------- rows in real formats

GSM8K = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
        "many clips in May. How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72",
    },
    {
        "question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes "
        "of babysitting. How much did she earn?",
        "answer": "#### 10",
    },
]
HUMANEVAL = [
    {
        "task_id": "HumanEval/0",
        "entry_point": "has_close_elements",
        "test": "def check(c): ...",
        "prompt": "from typing import List\n\n\ndef has_close_elements(numbers: List[float], "
        'threshold: float) -> bool:\n    """ Check if in given list of numbers, are any two '
        'numbers closer to each other than\n    given threshold.\n    """\n',
        "canonical_solution": "    return False\n",
    },
]
MT_BENCH = [
    {
        "question_id": 81,
        "category": "writing",
        "turns": [
            "Compose an engaging travel blog post about a recent trip to Hawaii.",
            "Rewrite your previous response. Start every sentence with the letter A.",
        ],
    },
    {
        "question_id": 101,
        "category": "reasoning",
        "turns": [
            "Imagine you are participating in a race. If you have just overtaken the second "
            "person, what's your current position?",
            'If the "second person" is changed to "last person" in the above question, what '
            "would the answer be?",
        ],
    },
]
FASTCHAT = [  # ShareGPT/FastChat conversations, whitespace and U+2028 as the dataset has them
    {
        "id": "sg_1",
        "conversations": [
            {"from": "human", "value": "  Write a haiku about rain.\u2028"},
            {"from": "gpt", "value": "Rain taps the window\n"},
            {"from": "human", "value": "Now one about snow. \n"},
        ],
    },
]
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


def calls(city: str) -> list[dict]:
    """A tool call as vLLM returns it in message.tool_calls."""
    args = json.dumps({"city": city})
    return [
        {
            "id": f"call_0_{city}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": args},
        }
    ]


# ---------------------------------------------------------------- item 1: tool calls


def vllm_answer(message: dict, finish: str, ids: list[int]) -> dict:
    return {
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "token_ids": ids}],
        "prompt_token_ids": [1, 2, 3],
        "usage": {"completion_tokens": len(ids)},
    }


def complete_with(answer: dict, tools=None):
    backend = VLLMChat("http://127.0.0.1:9/v1", "m")
    sent = {}

    async def post(path, body, timeout, max_tokens):
        sent.update(body)
        return answer

    backend._post = post
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    comp = asyncio.run(backend.complete(messages, Sampling(max_tokens=48), timeout=5, tools=tools))
    return comp, sent


def test_tool_calls_in_an_answer_are_kept_and_counted_as_the_server_counts():
    """vLLM's answer to a tool call: content null, message.tool_calls, finish "tool_calls"."""
    message = {"role": "assistant", "content": None, "tool_calls": calls("Paris")}
    comp, sent = complete_with(vllm_answer(message, "tool_calls", list(range(10, 31))), [WEATHER])
    assert sent["tools"] == [WEATHER] and sent["return_token_ids"] is True
    assert comp.tool_calls == calls("Paris") and comp.text == ""
    assert (comp.finish_reason, comp.completion_tokens, comp.count_source) == (
        "tool_calls",
        21,
        "server_ids",
    )
    bad = {"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}
    with pytest.raises(BackendError, match="no function call"):
        complete_with(vllm_answer(bad, "tool_calls", [5, 6]))


def test_the_embedded_vllm_starts_with_a_tool_call_parser():
    from kit.serve import vllm

    argv = vllm.command(vllm.REPO / "m", 8000, "127.0.0.1")
    i = argv.index("--tool-call-parser")
    assert "--enable-auto-tool-choice" in argv and argv[i + 1] == "xlam"


def tool_store(run_dir, tok, records: list[Record], frame: pl.DataFrame):
    """A run directory written by RunStore itself (the run database)."""
    from kit.run.store import RunStore

    cfg = RunConfig(
        model="m",
        endpoints="http://127.0.0.1:9/v1",
        budgets={"fc": 10_000},
        tokenizer=tok.name_or_path,
        sampling=Sampling(max_tokens=64),
    )
    store = RunStore(run_dir)
    store.init(cfg, frame)
    for r in records:
        store.append(r)
    store.close()
    return run_dir


@pytest.fixture
def tool_run(tmp_path, model_dir):
    tok = kit.tokens.load_tokenizer(model_dir)
    loaded = kit.load(
        {
            "fc": [
                {"messages": [{"role": "user", "content": f"Weather in {c}?"}], "tools": [WEATHER]}
                for c in ("Paris", "Rome", "Oslo")
            ]
        }
    )
    records = []
    for i, row in enumerate(loaded.frame.to_dicts()):
        city = row["messages"][0]["content"].split()[-1].rstrip("?")
        text = json.dumps([{"name": "get_weather", "arguments": {"city": city}}])
        prompt = tok.apply_chat_template(
            row["messages"], tokenize=False, add_generation_prompt=True
        )
        out = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        has_call = i < 2  # the third answered in words
        records.append(
            Record(
                dataset="fc",
                prompt_id=row["prompt_id"],
                sample=0,
                messages=row["messages"],
                completion="" if has_call else ANSWERS[0],
                finish_reason="stop",
                completion_tokens=len(out),
                count_source="server_ids",
                output_ids=out,
                prompt_ids=tok.encode(prompt, add_special_tokens=False),
                t_done=1.7e9 + i,
                tools=[WEATHER],
                tool_calls=calls(city) if has_call else None,
            )
        )
        if not has_call:
            records[-1].output_ids = tok.encode(ANSWERS[0], add_special_tokens=False) + [
                tok.eos_token_id
            ]
            records[-1].completion_tokens = len(records[-1].output_ids)
    return tool_store(tmp_path / "run", tok, records, loaded.frame), records


@pytest.mark.server  # the tokenizer only (model_dir): no server is started
def test_tool_calls_are_exported_audited_and_validated(tool_run, tmp_path):
    run_dir, records = tool_run
    conn = sqlite3.connect(run_dir / "run.sqlite")  # the calls stored as JSON, NULL for none
    stored = dict(conn.execute("SELECT prompt_id, tool_calls FROM records").fetchall())
    conn.close()
    assert {r.prompt_id: r.tool_calls for r in records} == {
        k: v and json.loads(v) for k, v in stored.items()
    }
    both = kit.export(run_dir, tmp_path / "both", formats=("specforge", "token_ids"))
    alone = kit.export(run_dir, tmp_path / "alone", formats=("specforge",))  # polars path
    assert kit.validate(tmp_path / "both").ok and kit.validate(tmp_path / "alone").ok
    sf = (tmp_path / "both" / "specforge/train.jsonl").read_bytes()
    assert sf == (tmp_path / "alone" / "specforge/train.jsonl").read_bytes()
    rows = {r["id"]: r for r in map(json.loads, sf.decode().splitlines())}
    tok_rows = {
        json.loads(x)["id"]: json.loads(x)
        for x in (tmp_path / "both" / "token_ids/train.jsonl").read_text().splitlines()
    }
    for r in records:
        key = f"fc-{r.prompt_id}-0"
        assert tok_rows[key]["input_ids"] == r.prompt_ids + r.output_ids  # the server's ids
        assert tok_rows[key]["ids_source"] == "server"
        if not r.completion:  # calls only: SpecForge would train a lone <|im_end|>, left out
            assert key not in rows
            continue
        last = rows[key]["conversations"][-1]
        assert last.get("tool_calls") == r.tool_calls and rows[key]["tools"] == [WEATHER]
    assert both.manifest["token_rows"]["fc"]["exact"] == 3 and alone.counts["fc"]["records"] == 3
    no_text = both.manifest["trainers"]["no_text"]["rows"]
    assert no_text == {"fc": {"train": {"tool_calls": 2}, "validation": {}}}
    report = kit.audit(run_dir)
    row = report.datasets.row(0, named=True)
    assert (row["tool_calls"], row["empty"], row["ids_text_mismatch"]) == (2, 0, 0)
    assert report.findings.filter(pl.col("check").is_in(["empty", "ids_text_mismatch"])).height == 0


# ---------------------------------------------------------------- item 2: turn lists


def test_mt_bench_user_turns_load_and_every_turn_is_answered_in_order(tmp_path):
    loaded = kit.load({"mt_bench": MT_BENCH})
    assert loaded.formats == {"mt_bench": "turns"} and loaded.frame.height == 2
    assert [m["role"] for m in loaded.frame["messages"][0]] == ["user", "user"]
    mapped = kit.load({"mt": [{"qs": r["turns"]} for r in MT_BENCH]}, mapping={"turns": "qs"})
    assert mapped.frame["prompt_id"].to_list() == loaded.frame["prompt_id"].to_list()
    with FaultServer(FaultConfig(min_words=3, max_words=12)) as srv:
        cfg = RunConfig(
            model="fake",
            endpoints=srv.base_url,
            budgets=10_000,
            retry_base=0.02,
            sampling=Sampling(max_tokens=20),
        )
        with pytest.raises(ValueError, match="all_turns"):  # sent whole they are no chat
            kit.generate_sync(loaded, cfg, run_dir=tmp_path / "last")
        cfg = RunConfig(**{**cfg.to_dict(), "turns": "all_turns"})
        run = kit.generate_sync(loaded, cfg, run_dir=tmp_path / "run")
        requests = srv.stats()["requests"]
    assert run.stop_reason is None
    from kit.run.reader import records_frame

    records = records_frame(tmp_path / "run").to_dicts()
    assert len(records) == 2 and requests == 4  # two turns each, each answered
    for r in records:
        turns = json.loads(r["turns"])
        roles = [m["role"] for m in r["messages"]]
        assert roles == ["user", "assistant", "user"] and len(turns) == 1
        assert r["messages"][1]["content"] == turns[0]["content"]  # the target's own answer
        assert (
            r["completion_tokens"] == turns[0]["completion_tokens"] + len(r["output_ids"] or [])
            or r["count_source"] != "server_ids"
        )


# ---------------------------------------------------------------- item 3: per-source mapping


def test_gsm8k_and_humaneval_share_one_load_each_with_its_mapping(tmp_path):
    paths = {}
    for name, rows in (("gsm8k", GSM8K), ("humaneval", HUMANEVAL)):
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    mapping = {"gsm8k": {"prompt": "question"}, "humaneval": {"prompt": "prompt"}}
    res = kit.load([str(p) for p in paths.values()], mapping=mapping)
    assert res.formats == {"gsm8k": "mapping", "humaneval": "mapping"}
    got = {r["dataset"]: r["messages"][0]["content"] for r in res.frame.to_dicts() if r["row"] == 0}
    assert got == {"gsm8k": GSM8K[0]["question"], "humaneval": HUMANEVAL[0]["prompt"]}
    assert kit.data.sources.reload(res.specs).frame.equals(res.frame)
    with pytest.raises(ValueError, match=r"\['gsm8k_typo'\]"):
        kit.load([str(p) for p in paths.values()], mapping={"gsm8k_typo": {"prompt": "question"}})
    mixed = kit.load(
        {"mt": MT_BENCH, "h": HUMANEVAL},
        format={"mt": "turns"},
        mapping={"h": {"prompt": "prompt"}},
    )
    assert mixed.formats == {"mt": "turns", "h": "mapping"}


def test_cli_per_source_mapping_and_turns_kept_in_the_plan(tmp_path, monkeypatch, capsys):
    fake_pilot.calls = []
    monkeypatch.setattr(kit.plan, "pilot_sync", fake_pilot)
    files = []
    for name, rows in (("gsm8k", GSM8K), ("humaneval", HUMANEVAL), ("mt_bench", MT_BENCH)):
        files.append(tmp_path / f"{name}.jsonl")
        files[-1].write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    argv = [
        "plan",
        "--samples",
        *map(str, files),
        "--run-dir",
        str(run_dir),
        "--budget",
        "500",
        "--base-url",
        "http://127.0.0.1:9/v1",
        "--model",
        "m",
        "--turns",
        "all_turns",
        "--mapping",
        'gsm8k={"prompt": "question"}',
        'humaneval={"prompt": "prompt"}',
    ]
    code, _, err = run_kit(argv, capsys)
    assert code == 0, err
    plan = kit.plan.read_plan(run_dir)
    assert plan["config"].turns == "all_turns"
    specs = plan["sources"]
    assert (specs["gsm8k"]["mapping"], specs["humaneval"]["mapping"]) == (
        {"prompt": "question"},
        {"prompt": "prompt"},
    )
    assert specs["mt_bench"]["format"] == "turns"
    assert plan["server"] == {"embedded": False, "engine": None}


# ---------------------------------------------------------------- item 5: thinking off


def ignoring_template(tmp_path, model_dir):
    """The embedded tokenizer with a template that opens a think block whatever it is told."""
    import shutil

    folder = tmp_path / "tok"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
        "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.server  # the tokenizer only (model_dir): no server is started
def test_thinking_switched_off_but_template_opens_it_is_said_so(tmp_path, model_dir):
    recs = [make_record(None, "math", i, f"q{i}", "", ids=False) for i in range(4)]
    for r in recs:
        r.finish_reason, r.reasoning = "length", "Let me think step by step about it"
    run = plant_run(
        tmp_path / "run",
        recs,
        budgets={"math": 10_000},
        tokenizer=ignoring_template(tmp_path, model_dir),
    )
    sampling = read_config(run).to_dict()["sampling"]
    set_config(run, sampling=sampling | {"chat_template_kwargs": {"enable_thinking": False}})
    report = kit.audit(run)
    found = {f["check"]: f["message"] for f in report.findings.iter_rows(named=True)}
    assert "length_in_reasoning" not in found  # not "the model spent every token thinking"
    assert "ignored the switch" in found["thinking_not_off"]
    assert "4 of 4 records (100.0%) hold reasoning" in found["thinking_not_off"]
    assert "opens <think>" in found["thinking_not_off"]
    assert "thinking_not_off" in report.summary()
    result = kit.export(run, tmp_path / "out", formats=("specforge",))
    assert result.manifest["thinking"]["math"]["template_opens_think"] is True
    assert "ignores enable_thinking=False" in result.summary()


# ---------------------------------------------------------------- item 6: audit blind spots


def test_audit_flags_overshoot_short_budget_and_cut_earlier_turns(tmp_path):
    small = [
        make_record(None, "small", i, f"s{i}", ANSWERS[i], ids=False, completion_tokens=60)
        for i in range(4)
    ]
    short = [
        make_record(None, "short", i, f"t{i}", ANSWERS[i], ids=False, completion_tokens=181)
        for i in range(5)
    ]
    multi = [
        make_record(None, "multi", i, f"m{i}", ANSWERS[i], ids=False, completion_tokens=90)
        for i in range(4)
    ]
    for i, r in enumerate(multi):  # all_turns: one earlier turn each, two of them cut
        r.turns = [
            {
                "content": "cut" if i < 2 else "done",
                "finish_reason": "length" if i < 2 else "stop",
                "completion_tokens": 64 if i < 2 else 20,
                "count_source": "usage",
            }
        ]
    prompts = {
        "small": [f"s{i}" for i in range(9)],
        "short": [f"t{i}" for i in range(5)],
        "multi": [f"m{i}" for i in range(4)],
    }
    budgets = {"small": 200, "short": 1000, "multi": 360}  # 240 = +20%; 905 = 9.5% short
    run = plant_run(tmp_path / "run", small + short + multi, budgets=budgets, prompts=prompts)
    report = kit.audit(run)
    found = {(f["dataset"], f["check"]): f for f in report.findings.iter_rows(named=True)}
    over = found[("small", "overshoot")]
    assert over["severity"] == "warn" and ("small", "over_budget") not in found
    assert "over by 40 (+20.0%" in over["message"] and "allowance" in over["message"]
    short_f = found[("short", "short_of_budget")]
    assert "9.5% short" in short_f["message"] and "905 of 1,000" in short_f["message"]
    cut = found[("multi", "truncation_earlier_turns")]
    assert "2 of 4 earlier generated turns (50.0%)" in cut["message"]
    text = report.summary()
    assert all(
        check in text for check in ("overshoot", "short_of_budget", "truncation_earlier_turns")
    )
    quiet = kit.audit(run, thresholds=AuditThresholds(overshoot_share=0.25, short_share=0.1))
    assert {f["check"] for f in quiet.findings.iter_rows(named=True)} & {
        "overshoot",
        "short_of_budget",
    } == set()


# ---------------------------------------------------------------- item 7: planner intervals


def test_the_plan_states_an_interval_that_holds_over_repeated_seeds():
    import random

    table = kit.plan.budget(
        {"a": 50_000},
        {"a": [40, 300, 120, 90, 75, 210] * 5},
        prompts_available={"a": 10_000},
        throughput=100.0,
    )
    row = table.row(0, named=True)
    assert row["samples_low"] < row["samples_needed"] < row["samples_high"]
    assert row["hours_low"] <= row["hours_to_go"] <= row["hours_high"]
    total = table.filter(pl.col("dataset") == kit.plan.TOTAL).row(0, named=True)
    assert total["samples_low"] == row["samples_low"]
    rng, hits, trials = random.Random(7), 0, 300  # skewed lengths capped at max_tokens 512

    def draw(k):
        return [min(512, max(1, round(rng.lognormvariate(math.log(120), 0.9)))) for _ in range(k)]

    for _ in range(trials):
        t = kit.plan.budget({"d": 20_000}, {"d": draw(30)}, prompts_available={"d": 10**6})
        low, high = t.row(0, named=True)["samples_low"], t.row(0, named=True)["samples_high"]
        tokens, actual = 0, 0
        while tokens < 20_000:
            tokens, actual = tokens + draw(1)[0], actual + 1
        hits += low <= actual <= high
    assert hits / trials >= 0.85, hits / trials  # nominal 90%; bench_plan_accuracy reports it


# ---------------------------------------------------------------- item 8: the plan's server


def test_generate_uses_the_plans_endpoints_for_a_plan_made_with_base_url(
    tmp_path, monkeypatch, capsys
):
    from kit.serve import models_root

    fake_pilot.calls = []
    monkeypatch.setattr(kit.plan, "pilot_sync", fake_pilot)
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    model = str(models_root() / "SmolLM2-135M-Instruct")  # the embedded model, served elsewhere
    run_dir = tmp_path / "run"
    argv = [
        "plan",
        "--samples",
        str(data),
        "--run-dir",
        str(run_dir),
        "--budget",
        "500",
        "--base-url",
        "http://127.0.0.1:9/v1",
        "--model",
        model,
        "--mapping",
        '{"prompt": "question"}',
    ]
    assert run_kit(argv, capsys)[0] == 0
    started, seen = [], []
    monkeypatch.setattr(kit.serve, "start", lambda *a, **k: started.append(k) or 1 / 0)

    monkeypatch.setattr(kit, "generate_sync", lambda p, c, **kw: seen.append(c) or FakeRun())
    code, _, err = run_kit(["generate", "--run-dir", str(run_dir)], capsys)
    assert code == 0, err
    assert started == [] and seen[0].endpoints == ["http://127.0.0.1:9/v1"]


def test_a_dead_endpoint_is_named_after_the_first_probe():
    from kit.run.backends import OpenAIChat
    from kit.run.pool import EndpointPool

    async def go():
        pool = EndpointPool([OpenAIChat("http://127.0.0.1:9/v1", "m")], no_endpoint_timeout=120)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            await pool.start()
        await pool.aclose()
        return [str(w.message) for w in caught]

    said = asyncio.run(go())
    assert any("http://127.0.0.1:9/v1" in m and "120 s" in m for m in said), said


# ---------------------------------------------------------------- item 9: content as given


def test_message_content_is_kept_as_the_dataset_has_it(tmp_path):
    res = kit.load({"fastchat": FASTCHAT})
    messages = res.frame["messages"][0].to_list()
    source = FASTCHAT[0]["conversations"]
    assert [m["content"] for m in messages] == [t["value"] for t in source]
    assert res.stripped == {} and "stripped" not in res.summary().columns
    stripped = kit.load({"fastchat": FASTCHAT}, strip=True)
    assert [m["content"] for m in stripped.frame["messages"][0]] == [
        "Write a haiku about rain.",
        "Rain taps the window",
        "Now one about snow.",
    ]
    assert stripped.stripped == {"fastchat": 1} and stripped.summary()["stripped"].to_list() == [1]
    assert stripped.specs["fastchat"]["strip"] is True
    alpaca = kit.load(
        {"alpaca": [{"instruction": "Give three tips.  ", "input": "", "output": "x"}]}
    )
    assert alpaca.frame["messages"][0][0]["content"] == "Give three tips.  "
