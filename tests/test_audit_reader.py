"""kit.audit sees what a reader of the answers sees: repetition loops told apart from plain
truncation, tools the chat template never rendered, call attempts left as text, answers
that are reasoning only, finish reasons as sent (tool_calls a stop, every other one listed),
prompt ids that are not the prompt's rendering. Planted runs for the logic; the real vLLM
(SmolLM2's template drops tools; a loop cut at max_tokens; a thinking model cut inside its
thinking) where the server's behaviour matters.
"""

from __future__ import annotations

import json

import polars as pl
import pytest
from test_audit import ANSWERS, make_record, plant_run

import kit
from kit.report.convo import row_id
from kit.report.flags import LOOP_MIN_CHARS, call_attempt, tail_ratio

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "triangle_area",
            "description": "Area of a triangle.",
            "parameters": {
                "type": "object",
                "properties": {"base": {"type": "integer"}, "height": {"type": "integer"}},
            },
        },
    }
]
STORY = (
    "The lighthouse keeper climbed the stairs each evening, counting the steps, greeting the "
    "gulls, and trimming the wick before the fog rolled in from the harbour. One night a "
    "small boat drifted toward the rocks, its sailor asleep at the tiller, and the keeper "
    "rang the bell until the man woke, turned hard to port, and waved his cap in thanks."
)


def findings(report) -> dict[str, dict]:
    return {f["check"]: f for f in report.findings.iter_rows(named=True)}


def test_loop_measure_separates_loops_from_prose_and_code():
    loops = ["baby" * 150, "_initialization" * 50, "The answer is 42. " * 40]
    prose = [STORY * 2, " ".join(ANSWERS) * 2]
    code = open(kit.report.flags.__file__).read()[2000:2600]
    assert all(tail_ratio(t) <= 0.1 for t in loops)
    assert all(tail_ratio(t) >= 0.3 for t in [*prose, code])
    assert tail_ratio("baby" * (LOOP_MIN_CHARS // 4 - 1)) is None  # too short to tell


def test_loops_are_told_apart_from_plain_truncation(tmp_path):
    recs = [
        make_record(None, "d", 0, "q0", "baby" * 150, finish="length", ids=False),  # cut loop
        make_record(None, "d", 1, "q1", STORY, finish="length", ids=False),  # cut prose
        make_record(None, "d", 2, "q2", "Yes. " * 80, ids=False),  # a loop that stopped
        make_record(None, "d", 3, "q3", STORY, ids=False),
        make_record(None, "d", 4, "q4", "", ids=False, reasoning="hmm, " * 100, finish="length"),
    ]
    report = kit.audit(plant_run(tmp_path / "run", recs, budgets={"d": 10_000}))
    loop = report.records.filter(pl.col("loop"))["prompt_id"].to_list()
    assert loop == [recs[0].prompt_id, recs[2].prompt_id, recs[4].prompt_id]  # reasoning too
    f = findings(report)
    assert f["loop"]["value"] == 3 / 5 and f["loop"]["example"] == row_id(vars_of(recs[0]))
    msg = f["loop"]["message"]
    assert msg.startswith("3 of 5 records (60.0%) end in a repetition loop")
    assert "last 600 characters" in msg and "20% of their size or less" in msg
    assert "2 cut at max_tokens, 1 ended otherwise" in msg
    assert "3 of 5 records (60.0%) finish_reason length" in f["truncation"]["message"]
    assert "(2 of them a repetition loop: see loop)" in f["truncation"]["message"]


def vars_of(r) -> dict:
    return {"dataset": r.dataset, "prompt_id": r.prompt_id, "sample": r.sample}


def test_call_attempts_left_as_text_on_tool_prompts(tmp_path):
    calls = [
        {"id": "c", "type": "function", "function": {"name": "triangle_area", "arguments": "{}"}}
    ]
    texts = [
        '<tool_call>{"name": "triangle_area", "arguments": {"base": 3}}</tool_call>',
        '{"name": "triangle_area", "arguments": {"base": 3, "height": 4}}',
        "[triangle_area(base=3, height=4)]",
        '```json\n{"parameters": {"base": 3}, "name": "triangle_area"}\n```',
        "The area is 6.",  # an answer, no attempt
    ]
    recs = [
        make_record(None, "t", i, f"area {i}", t, ids=False, tools=TOOLS)
        for i, t in enumerate(texts)
    ]
    recs.append(make_record(None, "t", 9, "area 9", "", ids=False, tools=TOOLS, tool_calls=calls))
    # the same text without tools: not a call attempt (no tool was offered)
    recs.append(make_record(None, "t", 10, "json please", texts[1], ids=False))
    report = kit.audit(plant_run(tmp_path / "run", recs, budgets={"t": 10_000}))
    row = report.datasets.row(0, named=True)
    assert (row["tools_sent"], row["call_attempt"], row["tool_calls"]) == (6, 4, 1)
    got = report.records.filter(pl.col("call_attempt"))["prompt_id"].to_list()
    assert got == [r.prompt_id for r in recs[:4]]
    f = findings(report)["call_attempt"]
    assert f["message"].startswith("4 of 6 answers to prompts sent tools (66.7%) try a tool call")
    assert f["example"] == row_id(vars_of(recs[0]))
    assert call_attempt("print(triangle_area)", TOOLS) is False  # named, not called
    assert call_attempt("math.triangle_area(3, 4)", TOOLS) is False  # another function


def test_reasoning_only_answers_are_named_never_empty(tmp_path):
    recs = [make_record(None, "r", i, f"q{i}", ANSWERS[i], ids=False) for i in range(4)]
    recs[0].completion, recs[0].reasoning = "", "The user wants a fact. I will"  # stopped
    recs[1].completion, recs[1].reasoning, recs[1].finish_reason = "", "Think: one", "length"
    recs[2].completion = ""  # empty: no text, no call, no reasoning
    report = kit.audit(plant_run(tmp_path / "run", recs, budgets={"r": 10_000}))
    f = findings(report)
    msg = f["reasoning_only"]["message"]
    assert msg.startswith("2 of 4 records (50.0%) are reasoning only")
    assert "1 ended the turn after (or inside) the thinking" in msg
    assert "1 cut at max_tokens inside it, the think block never closed" in msg
    assert f["empty"]["message"].startswith("1 of 4 records (25.0%) empty")
    assert f["empty"]["example"] == row_id(vars_of(recs[2]))


def test_tool_calls_finish_is_a_stop_and_other_finishes_are_listed(tmp_path):
    finishes = ["tool_calls", "stop", "abort", "abort", "content_filter", "length"]
    recs = [
        make_record(None, "f", i, f"q{i}", ANSWERS[i], ids=False, finish=fin)
        for i, fin in enumerate(finishes)
    ]
    run = plant_run(tmp_path / "run", recs, budgets={"f": 10_000})
    report = kit.audit(run)
    row = report.datasets.row(0, named=True)
    assert (row["stop"], row["length"], row["other"]) == (2, 1, 3)
    assert row["other_reasons"] == "abort 2, content_filter 1"
    finish = dict(report.finish.select("finish_reason", "count").iter_rows())
    assert finish["tool_calls"] == 1  # as sent
    msg = findings(report)["finish_other"]["message"]
    assert msg.startswith("3 of 6 records (50.0%) finish reasons other than stop/tool_calls")
    assert ": abort 2, content_filter 1;" in msg
    result = kit.export(run, tmp_path / "out", formats=("parquet",))
    assert result.dropped["errors"] == 3 and result.counts["f"]["records"] == 3


@pytest.fixture(scope="module")
def tok(model_dir):
    return kit.tokens.load_tokenizer(model_dir)


def test_prompt_ids_that_are_not_the_prompt_are_a_finding(tmp_path, tok, model_dir):
    recs = [make_record(tok, "p", i, f"Question number {i}?", ANSWERS[i]) for i in range(3)]
    for r in recs:
        text = kit.tokens.render(tok, [r.messages])[0]
        r.prompt_ids = tok.encode(text, add_special_tokens=False)
        r.prompt_tokens = len(r.prompt_ids)
    recs[1].prompt_ids = tok.encode(
        kit.tokens.render(tok, [[{"role": "user", "content": "Another prompt"}]])[0],
        add_special_tokens=False,
    )
    run = plant_run(tmp_path / "run", recs, budgets={"p": 10_000}, tokenizer=str(model_dir))
    report = kit.audit(run)
    assert report.records["prompt_ids_differ"].to_list() == [False, True, False]
    f = findings(report)["prompt_ids_differ"]
    assert f["severity"] == "error" and f["example"] == row_id(vars_of(recs[1]))
    assert f["message"].startswith("1 of 3 records with prompt ids checked")
    assert not report.ok


def test_tools_the_template_does_not_render_are_a_finding(tmp_path, tok, model_dir):
    recs = [
        make_record(tok, "bfcl", i, f"Area of a triangle {i}?", ANSWERS[i], tools=TOOLS)
        for i in range(3)
    ]
    recs.append(make_record(tok, "bfcl", 3, "No tools here", ANSWERS[3]))
    run = plant_run(tmp_path / "run", recs, budgets={"bfcl": 10_000}, tokenizer=str(model_dir))
    f = findings(kit.audit(run))["tools_not_rendered"]
    assert f["message"].startswith("3 of 4 records were sent tools that the chat template")
    assert "0 answers called a tool" in f["message"]
    assert f["example"] == row_id(vars_of(recs[0]))


@pytest.mark.slow
def test_vllm_loop_cut_at_max_tokens_is_a_loop(vllm_server, tmp_path):
    """The real model asked to repeat a word, greedy, runs into max_tokens repeating it: the
    audit names the loop, apart from the plain truncation of a long story."""
    from test_vllm import vllm_config

    src = tmp_path / "loops.jsonl"
    prompts = [
        "Repeat the word baby forever: baby baby baby baby baby baby baby baby",
        "Write the word hello one thousand times, separated by spaces.",
        "Write a very long story about a lighthouse keeper and his life by the sea.",
    ]
    src.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in prompts))
    frame = kit.load(str(src)).frame
    sampling = kit.Sampling(max_tokens=160, temperature=0.0, seed=1)
    cfg = vllm_config(vllm_server, {"loops": 10_000}, sampling=sampling)
    run = kit.generate_sync(frame, cfg, run_dir=tmp_path / "run")
    assert run.stop_reason is None, run.stop_reason
    report = kit.audit(tmp_path / "run")
    recs = report.records.sort("prompt_id")
    texts = report.texts(recs).sort("prompt_id")
    loops = recs.filter(pl.col("loop"))
    print(
        "\nvLLM loops:",
        [
            (f, lp, t[-60:])
            for f, lp, t in zip(
                recs["finish_reason"], recs["loop"], texts["completion"], strict=True
            )
        ],
    )
    assert loops.height >= 1 and (loops["finish_reason"] == "length").all(), texts["completion"]
    f = findings(report)["loop"]
    assert f"{loops.height} cut at max_tokens" in f["message"]
    assert f["example"] in {row_id(r) for r in loops.iter_rows(named=True)}
    assert "repetition loop: see loop" in findings(report)["truncation"]["message"]


@pytest.mark.slow
def test_vllm_reasoning_only_answers_are_named_as_such(vllm_thinking, tmp_path):
    """The thinking model cut at max_tokens inside its thinking: every answer is reasoning
    only, the audit says so (and how each ended), never "empty"."""
    from test_vllm import SAMPLES, vllm_config

    frame = kit.load(str(SAMPLES / "chat_general.jsonl")).frame.head(6)
    sampling = kit.Sampling(max_tokens=12, temperature=0.7, seed=1)
    cfg = vllm_config(vllm_thinking, {"chat_general": 10_000}, sampling=sampling)
    run = kit.generate_sync(frame, cfg, run_dir=tmp_path / "run")
    assert run.stop_reason is None, run.stop_reason
    report = kit.audit(tmp_path / "run")
    only = report.records.filter(pl.col("reasoning_only"))
    cut = only.filter(pl.col("finish_reason") == "length").height
    print(f"\nvLLM thinking, max_tokens 12: {only.height}/{report.records.height} reasoning only")
    assert only.height >= report.records.height // 2 and cut, report.summary()
    f = findings(report)
    assert f["reasoning_only"]["message"].startswith(
        f"{only.height} of {report.records.height} records"
    )
    assert f"{cut} cut at max_tokens inside it" in f["reasoning_only"]["message"]
    assert report.records.filter(pl.col("empty")).height == 0 and "empty" not in f
