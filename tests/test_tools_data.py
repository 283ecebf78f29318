"""Tool-call datasets through kit.load (kit.data.tools): tool definitions carried in the
frame's `tools` column, tool turns in the history and broken tools counted as skips, and
loads without tools unchanged. Every input is written by the test itself, in the shapes of
real datasets (OpenAI chat files, Hermes function calling, LLaMA-Factory/glaive ShareGPT,
xLAM)."""

import json
import math
from pathlib import Path

import polars as pl
import pytest

import kit
from kit.data import sources
from kit.data.tools import drop_nulls, row_tools
from kit.errors import Skip

SAMPLES = Path(__file__).resolve().parent.parent / "data" / "samples"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
ADD = {"name": "add", "description": "Add two numbers.", "parameters": {"type": "object"}}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def tools_of(res) -> list:
    """The frame's tools column, each parsed back (None stays None)."""
    return [None if t is None else json.loads(t) for t in res.frame["tools"].to_list()]


# ---------------------------------------------------------------- carried


def test_openai_tools_are_carried_and_round_trip(tmp_path):
    answer = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 3}'},
        {"role": "assistant", "content": "It is 3 degrees."},
    ]
    rows = [
        {
            "messages": [{"role": "system", "content": "Use tools."}, user("Weather in Oslo?")]
            + answer,
            "tools": [WEATHER],
            "parallel_tool_calls": False,
        },
        {"messages": [user("Hello")]},
    ]
    res = kit.load(write_jsonl(tmp_path / "fc.jsonl", rows))
    assert res.frame.columns == [*sources.SCHEMA, "tools"]
    assert res.frame.schema["tools"] == pl.String
    assert tools_of(res) == [[WEATHER], None]
    # the old answer (tool call, tool result, reply) is cut with the rest of the answer
    first = res.frame["messages"].to_list()[0]
    assert first == [{"role": "system", "content": "Use tools."}, user("Weather in Oslo?")]
    # no tools: the id is the messages' hash as before; tools: part of the identity
    assert res.frame["prompt_id"][1] == sources.prompt_id([user("Hello")])
    assert res.frame["prompt_id"][0] == sources.prompt_id(first, res.frame["tools"][0])
    assert res.frame["prompt_id"][0] != sources.prompt_id(first)
    summary = res.summary().row(0, named=True)
    assert (summary["prompts"], summary["with_tools"], summary["skipped"]) == (2, 1, 0)
    again = sources.reload(res.specs)
    assert again.frame["prompt_id"].equals(res.frame["prompt_id"])
    assert again.frame["tools"].equals(res.frame["tools"])


def test_rows_differing_only_in_tools_are_two_prompts(tmp_path):
    ask = [user("What can you do?")]
    rows = [
        {"messages": ask, "tools": [WEATHER]},
        {"messages": ask, "tools": [{"type": "function", "function": ADD}]},
        {"messages": ask},
        {"messages": ask, "tools": [WEATHER]},  # a true repeat
    ]
    res = kit.load(write_jsonl(tmp_path / "same.jsonl", rows))
    assert res.frame.height == 3 and res.frame["prompt_id"].n_unique() == 3
    assert res.duplicates["same"] == 1
    assert tools_of(res) == [[WEATHER], [{"type": "function", "function": ADD}], None]


def test_sharegpt_tools_string_of_bare_functions_is_wrapped(tmp_path):
    """LLaMA-Factory / glaive ShareGPT: `tools` is a JSON string of bare function
    definitions; function_call/observation turns follow the question (the old answer)."""
    bare = [ADD, {"name": "get_time", "parameters": {"type": "object", "properties": {}}}]
    row = {
        "conversations": [
            {"from": "system", "value": "You can call functions."},
            {"from": "human", "value": "What is 2 + 3?"},
            {"from": "function_call", "value": '{"name": "add", "arguments": {"a": 2, "b": 3}}'},
            {"from": "observation", "value": "5"},
            {"from": "gpt", "value": "2 + 3 = 5."},
        ],
        "tools": json.dumps(bare),
    }
    res = kit.load(write_jsonl(tmp_path / "glaive.jsonl", [row]))
    assert res.formats == {"glaive": "sharegpt"}
    assert tools_of(res) == [[{"type": "function", "function": f} for f in bare]]
    assert res.frame["n_turns"].to_list() == [1]
    assert res.skipped["glaive"] == {}


def test_hermes_tools_string_with_tool_turns_after_the_question(tmp_path):
    """Hermes function calling: ShareGPT with OpenAI tools as a JSON string and `tool`
    turns after the last human turn."""
    row = {
        "id": "h1",
        "conversations": [
            {"from": "system", "value": "You are a function calling AI model. <tools>...</tools>"},
            {"from": "human", "value": "Weather in Lima?"},
            {"from": "gpt", "value": "<tool_call>\n{'name': 'get_weather'}\n</tool_call>"},
            {"from": "tool", "value": "<tool_response>{}</tool_response>"},
            {"from": "gpt", "value": "Sunny."},
        ],
        "tools": json.dumps([WEATHER]),
        "category": "Weather",
    }
    res = kit.load(write_jsonl(tmp_path / "hermes.jsonl", [row]))
    assert tools_of(res) == [[WEATHER]]
    assert [m["role"] for m in res.frame["messages"][0]] == ["system", "user"]


def test_xlam_rows_load_with_a_mapping_and_keep_their_tools(tmp_path):
    """xLAM: {query, answers, tools} with tools a JSON string of bare functions whose
    parameters are not JSON Schema: carried as they are, wrapped."""
    tools = [
        {
            "name": "live_giveaways",
            "description": "Giveaways.",
            "parameters": {"type": {"description": "Type.", "type": "str", "default": "game"}},
        }
    ]
    rows = [
        {"id": 0, "query": "Any game giveaways?", "answers": "[]", "tools": json.dumps(tools)},
        {"id": 1, "query": "No tools here.", "answers": "[]", "tools": "[]"},
    ]
    path = write_jsonl(tmp_path / "xlam.jsonl", rows)
    with pytest.raises(ValueError, match="cannot detect the prompt format"):
        kit.load(path)
    res = kit.load(path, mapping={"prompt": "query"})
    assert tools_of(res) == [[{"type": "function", "function": tools[0]}], None]
    renamed = [{"query": r["query"], "functions_json": r["tools"]} for r in rows]
    path2 = write_jsonl(tmp_path / "renamed.jsonl", renamed)
    res2 = kit.load(path2, mapping={"prompt": "query", "tools": "functions_json"})
    assert res2.frame["tools"].equals(res.frame["tools"])
    assert res2.specs["renamed"]["mapping"] == {"prompt": "query", "tools": "functions_json"}
    assert sources.reload(res2.specs).frame["tools"].equals(res2.frame["tools"])
    with pytest.raises(ValueError, match=r"mapping columns \['tool_defs'\] not found"):
        kit.load(path2, mapping={"prompt": "query", "tools": "tool_defs"})


def test_a_sparse_mapped_tools_column_is_not_a_typo(tmp_path):
    rows = [{"q": f"question {i}", "t": None} for i in range(250)]
    rows.append({"q": "last", "t": json.dumps([ADD])})
    res = kit.load(
        write_jsonl(tmp_path / "sparse.jsonl", rows), mapping={"prompt": "q", "tools": "t"}
    )
    assert res.frame["tools"].null_count() == 250 and res.summary()["with_tools"][0] == 1


def test_legacy_openai_functions_are_wrapped_and_conflicts_counted(tmp_path):
    rows = [
        {"messages": [user("Add 1 and 2")], "functions": [ADD]},
        {"messages": [user("Both")], "functions": [ADD], "tools": [WEATHER]},
    ]
    res = kit.load(write_jsonl(tmp_path / "legacy.jsonl", rows))
    assert tools_of(res) == [[{"type": "function", "function": ADD}]]
    assert res.skipped["legacy"] == {"conflicting_fields": 1}
    assert res.skipped_rows["row"].to_list() == [1]


def test_empty_tools_are_no_tools_and_add_no_column(tmp_path):
    rows = [
        {"messages": [user("a")], "tools": None},
        {"messages": [user("b")], "tools": []},
        {"messages": [user("c")], "tools": ""},
        {"messages": [user("d")], "tools": "[]"},
        {"messages": [user("e")], "tools": "  "},
    ]
    res = kit.load(write_jsonl(tmp_path / "empty.jsonl", rows))
    assert res.frame.columns == list(sources.SCHEMA)
    assert res.frame["prompt_id"].to_list() == [sources.prompt_id([user(t)]) for t in "abcde"]


def test_datasets_with_and_without_tools_in_one_load(tmp_path):
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"messages": [user(f"p{i}")]} for i in range(3)])
    tooled = write_jsonl(tmp_path / "tooled.jsonl", [{"messages": [user("t")], "tools": [WEATHER]}])
    alone = kit.load(plain)
    both = kit.load([plain, tooled])
    assert "tools" not in alone.frame.columns and "tools" in both.frame.columns
    mine = both.frame.filter(pl.col("dataset") == "plain")
    assert mine["prompt_id"].equals(alone.frame["prompt_id"])
    assert mine["tools"].null_count() == 3
    assert both.source_hashes()["plain"] == alone.source_hashes()["plain"]


# ---------------------------------------------------------------- unchanged without tools


def test_sample_loads_are_unchanged(tmp_path):
    """No sample has tools: the frame keeps its five columns, every prompt id is the hash of
    its messages, and the source hashes are the ones kit computed before tools existed
    (commit bd249eb), so existing run fingerprints still match (code_problems and essays:
    the ones of their short rewrite for the demo, issue 27)."""
    res = kit.load(SAMPLES)
    assert res.frame.columns == list(sources.SCHEMA)
    assert res.frame["prompt_id"].to_list() == [
        sources.prompt_id(m) for m in res.frame["messages"].to_list()
    ]
    assert res.source_hashes() == {
        "alpaca_tasks": "f2f20f32252321ff",
        "chat_general": "c1133d41259aa5b4",
        "code_instruct": "449ee6c8b568eb03",
        "code_problems": "f29853f22fdb6400",  # rewritten short (issue 27)
        "essays": "d30311917ec3f498",  # rewritten short (issue 27)
        "math_word": "f53ebfc9a61d2530",
        "multi_turn": "ab0b4e090e9284d7",
        "sharegpt_chat": "2374b1aa5e311bf2",
    }
    assert set(res.summary()["with_tools"].to_list()) == {0}


# ---------------------------------------------------------------- tool turns


def test_tool_turns_in_the_history_are_counted_skips(tmp_path):
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    history = [
        # OpenAI: an assistant tool call and a tool result before the next question
        [
            user("a"),
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "3"},
            {"role": "assistant", "content": "3."},
            user("again"),
        ],
        # a tool call with text content: the tool_calls field must not vanish
        [
            user("b"),
            {"role": "assistant", "content": "Let me add.", "tool_calls": [call]},
            user("thanks"),
        ],
        # OpenAI's legacy function_call / function role
        [
            user("c"),
            {"role": "assistant", "content": "", "function_call": {"name": "add"}},
            {"role": "function", "name": "add", "content": "3"},
            user("more"),
        ],
    ]
    rows = [{"messages": h, "tools": [WEATHER]} for h in history]
    rows.append(
        {
            "messages": [
                user("fine"),
                {"role": "assistant", "content": "ok", "tool_calls": []},
                user("go"),
            ]
        }
    )
    res = kit.load(write_jsonl(tmp_path / "turns.jsonl", rows))
    assert res.skipped["turns"] == {"tool_turns": 3}
    assert res.frame["row"].to_list() == [3]  # an empty tool_calls list carries nothing
    skips = res.skipped_rows.to_dicts()
    assert [s["row"] for s in skips] == [0, 1, 2]
    assert all("tool-call turns in the history are not supported yet" in s["detail"] for s in skips)
    assert skips[1]["detail"].startswith("turn 1: 'assistant' turn with 'tool_calls'")
    summary = res.summary().row(0, named=True)
    assert summary["skip_reasons"] == "tool_turns: 3" and summary["skipped"] == 3


def test_sharegpt_tool_roles_in_the_history_are_counted_skips(tmp_path):
    rows = [
        {
            "conversations": [
                {"from": "human", "value": "q"},
                {"from": role, "value": "x"},
                {"from": "gpt", "value": "a"},
                {"from": "human", "value": "q2"},
            ]
        }
        for role in ("function_call", "observation", "tool", "ipython")
    ]
    with pytest.warns(UserWarning, match="kept 0 prompts"):
        res = kit.load(write_jsonl(tmp_path / "roles.jsonl", rows))
    assert res.skipped["roles"] == {"tool_turns": 4}
    details = res.skipped_rows["detail"].to_list()
    assert (
        details[0]
        == "turn 1: role 'function_call': " + "tool-call turns in the history are not supported yet"
    )


# ---------------------------------------------------------------- broken tools


@pytest.mark.parametrize(
    ("tools", "detail"),
    [
        ("[{not json", "'tools' is not valid JSON"),
        ({"name": "add"}, "'tools' is a dict, not a list of tools"),
        ('{"name": "add"}', "'tools' is a dict, not a list of tools"),
        ([7], "'tools' tool 0 is a int, not an object"),
        ([ADD, {"description": "no name"}], "'tools' tool 1 has no function name"),
        ([{"type": "function", "function": {"name": " "}}], "'tools' tool 0 has no function name"),
        ([{"type": "code_interpreter"}], "'tools' tool 0 has type 'code_interpreter'"),
        ([{"type": "function", "function": "add"}], "'tools' tool 0 has no 'function' object"),
        ([{"name": "f", "parameters": "x"}], "'tools' tool 0 (f) 'parameters' is a str"),
        ([{"name": "f", "description": 3}], "'tools' tool 0 (f) 'description' is a int"),
        (["not an object"], "'tools' tool 0 is a string that is not a JSON object"),
        ('[{"name": "f", "parameters": {"default": NaN}}]', "'tools' cannot be sent as JSON"),
    ],
)
def test_broken_tools_are_counted_and_named(tmp_path, tools, detail):
    rows = [{"messages": [user("ok")]}, {"messages": [user("broken")], "tools": tools}]
    res = kit.load({"broken": rows})
    assert res.frame["row"].to_list() == [0]
    assert res.skipped["broken"] == {"bad_tools": 1}
    skip = res.skipped_rows.row(0, named=True)
    assert skip["row"] == 1 and skip["reason"] == "bad_tools"
    assert skip["detail"].startswith(detail), skip["detail"]
    assert "bad_tools: 1" in res.summary()["skip_reasons"][0]


def test_a_prompt_problem_is_named_before_a_tools_problem(tmp_path):
    rows = [{"messages": [user("  ")], "tools": "nope"}, {"messages": [user("x")], "tools": 5}]
    res = kit.load({"both": rows + [{"messages": [user("fine")]}]})
    assert res.skipped["both"] == {"empty_content": 1, "bad_tools": 1}


def test_tools_as_a_list_of_json_strings(tmp_path):
    """LMFlow-style: one JSON string per tool."""
    res = kit.load({"lm": [{"messages": [user("q")], "tools": [json.dumps(ADD)]}]})
    assert tools_of(res) == [[{"type": "function", "function": ADD}]]


# ---------------------------------------------------------------- columnar sources


def test_parquet_tools_as_json_strings_and_as_structs(tmp_path):
    other = {
        "type": "function",
        "function": {
            "name": "ping",
            "parameters": {"type": "object", "properties": {"host": {"type": "string"}}},
        },
    }
    rows = [
        {"messages": [user("w")], "tools": [WEATHER]},
        {"messages": [user("p")], "tools": [other]},
        {"messages": [user("n")], "tools": None},
    ]
    as_text = pl.DataFrame(
        {
            "messages": [r["messages"] for r in rows],
            "tools": [None if r["tools"] is None else json.dumps(r["tools"]) for r in rows],
        }
    )
    as_text.write_parquet(tmp_path / "text.parquet")
    structs = pl.DataFrame(rows)  # one struct type: the union of both tools' keys
    assert isinstance(structs.schema["tools"], pl.List)
    structs.write_parquet(tmp_path / "structs.parquet")
    res = kit.load([tmp_path / "text.parquet", tmp_path / "structs.parquet"])
    for name in ("text", "structs"):
        part = res.frame.filter(pl.col("dataset") == name)
        got = [None if t is None else json.loads(t) for t in part["tools"].to_list()]
        assert got == [r["tools"] for r in rows], name
    ids = res.frame.group_by("dataset", maintain_order=True).agg("prompt_id")["prompt_id"]
    assert ids[0].to_list() == ids[1].to_list()


def test_in_memory_rows_keep_null_values_in_tools():
    """Plain Python rows are exact: a null in a tool definition is kept (only struct
    columns, where absent and null are one thing, drop nulls)."""
    tool = {"name": "f", "parameters": {"type": "object", "default": None}}
    res = kit.load({"exact": [{"messages": [user("q")], "tools": [tool]}]})
    assert tools_of(res) == [[{"type": "function", "function": tool}]]
    frame = pl.DataFrame([{"messages": [user("q")], "tools": [tool]}])
    res2 = kit.load({"frame": frame})
    assert tools_of(res2) == [[{"type": "function", "function": drop_nulls(tool)}]]


def test_row_tools_is_compact_json_and_refuses_what_json_cannot_hold():
    out = row_tools({"tools": [WEATHER]}, None)
    assert out == json.dumps([WEATHER], separators=(",", ":"))
    with pytest.raises(Skip) as err:
        row_tools({"tools": [{"name": "f", "parameters": {"x": math.inf}}]}, None)
    assert err.value.reason == "bad_tools"


def test_parquet_messages_with_tool_call_fields(tmp_path):
    """OpenAI rows in Parquet: every turn struct has a tool_calls field (null in most);
    a null one is no tool call, a real one in the history is a tool_turns skip, and one in
    the old answer is cut with it."""
    call = [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]
    plain = {"role": "assistant", "content": "ok", "tool_calls": None}
    calling = {"role": "assistant", "content": "", "tool_calls": call}
    rows = [
        {"messages": [user("history") | {"tool_calls": None}, calling, user("next")]},
        {"messages": [user("answer") | {"tool_calls": None}, calling]},
        {"messages": [user("plain") | {"tool_calls": None}, plain, user("more")]},
    ]
    pl.DataFrame(rows).write_parquet(tmp_path / "calls.parquet")
    res = kit.load(tmp_path / "calls.parquet")
    assert res.skipped["calls"] == {"tool_turns": 1}
    assert res.frame["row"].to_list() == [1, 2]
    assert res.frame.columns == list(sources.SCHEMA)
