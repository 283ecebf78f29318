"""Issue 11, items 8 and 9: hostile prompt files and plans made from data kit cannot re-load.

Every input is written by the test itself. Item 8 (loading): a too-deep JSON row, files a
directory load cannot use, a symlink loop, a load that keeps nothing, several undetectable
files, Alpaca rows with nested `instances`, fields kit cannot place, hostile tool
definitions (issue 12). Item 9: a plan made from an in-memory frame or a mapped file runs
from its run directory alone (plan.json records the load spec, the run database
holds the prompts), against the fault server.
"""

from __future__ import annotations

import asyncio
import json
import os
import warnings
from pathlib import Path

import polars as pl
import pytest
from faultserver import FaultServer

import kit
from kit.data import sources
from kit.run.reader import prompts_frame, records_frame
from kit.types import RunConfig, Sampling

DEEP = 100_000  # far past Python's recursion limit: json.loads raises RecursionError


def write_jsonl(path: Path, rows: list) -> Path:
    """Rows -> JSONL; a str row is written verbatim."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def deep_row() -> str:
    return '{"messages": ' + "[" * DEEP + "]" * DEEP + "}"


# ---------------------------------------------------------------- item 8: loading


def test_hostile_tools_are_counted_skips_not_crashes(tmp_path):
    """Issue 12, item 5: tool definitions nested past the parser's limit (as a JSON string,
    or as rows kit must serialize), NaN in a tool, a tools field of the wrong type: each
    a counted bad_tools skip naming the row; the good rows load with their tools."""
    deep = [[]]
    for _ in range(DEEP):
        deep = [deep]  # a Python list json.dumps cannot serialize (RecursionError)
    good_tool = {"type": "function", "function": {"name": "ok"}}
    rows = [
        {"messages": [user("good")], "tools": [good_tool]},
        {"messages": [user("deep string")], "tools": "[" * DEEP + "]" * DEEP},
        {"messages": [user("deep list")], "tools": [{"name": "f", "parameters": {"x": deep}}]},
        {"messages": [user("nan")], "tools": '[{"name": "f", "parameters": {"d": NaN}}]'},
        {"messages": [user("number")], "tools": 5},
    ]
    res = kit.load({"hostile": rows})
    assert res.frame["row"].to_list() == [0]
    assert json.loads(res.frame["tools"][0]) == [good_tool]
    assert res.skipped["hostile"] == {"bad_tools": 4}
    details = dict(zip(res.skipped_rows["row"], res.skipped_rows["detail"], strict=True))
    assert details[1] == "'tools' is nested too deep for the JSON parser"
    assert details[2].startswith("'tools' cannot be sent as JSON")
    assert details[3].startswith("'tools' cannot be sent as JSON")
    assert details[4] == "'tools' is a int, not a list of tools"


def test_deeply_nested_row_is_skipped_not_fatal(tmp_path):
    """A JSON row nested past the parser's recursion limit aborted the whole load with
    RecursionError (JSONL and JSON list alike); now that row is skipped as too_deep."""
    good = [{"messages": [user("one")]}, {"messages": [user("two")]}]
    path = write_jsonl(tmp_path / "deep.jsonl", [good[0], deep_row(), good[1]])
    res = kit.load(path)
    assert res.frame.height == 2 and res.rows["deep"] == 3
    assert res.skipped["deep"] == {"too_deep": 1}
    assert res.skipped_rows.row(0, named=True)["row"] == 1  # the line it was on

    listed = tmp_path / "listed.json"  # a JSON list: the other rows still load
    listed.write_text(
        "[" + json.dumps(good[0]) + ", " + deep_row() + ",\n" + json.dumps(good[1]) + "]"
    )
    wrapped = tmp_path / "wrapped.json"  # {"data": [...]} too
    wrapped.write_text(
        '{"note": {"a": [1, "]"]}, "data": [' + deep_row() + ", " + json.dumps(good[1]) + "]}"
    )
    res = kit.load([listed, wrapped])
    assert res.skipped == {"listed": {"too_deep": 1}, "wrapped": {"too_deep": 1}}
    assert res.frame.group_by("dataset").len().sort("dataset").rows() == [
        ("listed", 2),
        ("wrapped", 1),
    ]


def test_unsupported_files_in_a_directory_are_listed_not_silent(tmp_path):
    """.csv/.txt files in a dataset directory were skipped without a word; now each is in
    LoadResult.ignored_files with its reason, counted and shown in the load's summary."""
    write_jsonl(tmp_path / "a.jsonl", [{"input": "x"}])
    (tmp_path / "prompts.csv").write_text("prompt\nhello\n")
    (tmp_path / "notes.txt").write_text("more prompts here")
    (tmp_path / "nested").mkdir()
    res = kit.load(tmp_path)
    assert list(res.formats) == ["a"]
    ignored = {Path(f["path"]).name: f["reason"] for f in res.ignored_files}
    assert set(ignored) == {"prompts.csv", "notes.txt", "nested"}
    assert "'.csv'" in ignored["prompts.csv"] and "'.txt'" in ignored["notes.txt"]
    assert "directory" in ignored["nested"]
    text = repr(res)
    assert "3 files ignored" in text and "prompts.csv" in text and "notes.txt" in text
    assert "prompts.csv" in res._repr_html_()


def test_symlink_loop_is_reported_per_path_and_the_rest_loads(tmp_path):
    """A symlink loop in a directory failed the whole load with "no such file"; now the
    loop is reported as a symlink loop for its path, and the other files load."""
    write_jsonl(tmp_path / "a.jsonl", [{"input": "x"}])
    os.symlink(tmp_path / "loop.jsonl", tmp_path / "loop.jsonl")  # points at itself
    os.symlink(tmp_path / "gone.jsonl", tmp_path / "dangling.jsonl")  # points at nothing
    res = kit.load(tmp_path)
    assert list(res.formats) == ["a"] and res.frame.height == 1
    ignored = {Path(f["path"]).name: f["reason"] for f in res.ignored_files}
    assert "symlink loop" in ignored["loop.jsonl"]
    assert (
        "broken symlink" in ignored["dangling.jsonl"] and "gone.jsonl" in ignored["dangling.jsonl"]
    )
    with pytest.raises(ValueError, match=r"loop\.jsonl.*symlink loop"):
        kit.load(tmp_path / "loop.jsonl")  # named on its own: nothing else to load


def test_load_keeping_zero_prompts_warns_with_files_and_reasons(tmp_path):
    """A load that kept 0 prompts said nothing; now it warns, naming each file and why."""
    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": []}, {"messages": "hi"}, "{oops"])
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.warns(UserWarning, match="0 prompts") as caught:
        res = kit.load([path, empty])
    assert res.frame.height == 0
    (message,) = [str(w.message) for w in caught]
    assert str(path) in message and str(empty) in message
    assert "bad_json: 1" in message and "bad_type: 1" in message and "0 rows" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a load that keeps prompts does not warn
        kit.load(write_jsonl(tmp_path / "ok.jsonl", [{"input": "x"}]))


def test_all_undetectable_files_reported_at_once(tmp_path):
    """A directory load stopped at its first undetectable file; now one error lists every
    one of them with the columns found."""
    write_jsonl(tmp_path / "good.jsonl", [{"input": "x"}])
    write_jsonl(tmp_path / "odd1.jsonl", [{"question": "q", "answer": "a"}])
    write_jsonl(tmp_path / "odd2.jsonl", [{"text": "t"}])
    (tmp_path / "odd3.json").write_text("{broken")
    with pytest.raises(ValueError) as err:
        kit.load(tmp_path)
    text = str(err.value)
    assert "3 files" in text
    assert "odd1.jsonl" in text and "['answer', 'question']" in text
    assert "odd2.jsonl" in text and "['text']" in text
    assert "odd3.json" in text and "not valid JSON" in text
    assert "good.jsonl" not in text and "format=" in text


def seed_task(i: int, instruction: str, instances: list) -> dict:
    """A row shaped like self-instruct's seed_tasks.jsonl."""
    return {
        "id": f"seed_task_{i}",
        "name": f"task_{i}",
        "instruction": instruction,
        "instances": instances,
        "is_classification": False,
    }


def test_alpaca_seed_tasks_read_the_nested_input(tmp_path):
    """Alpaca seed-task rows ({instruction, instances: [{input, output}]}) were detected as
    Magicoder and lost their input; now they are Alpaca, each instance's input is joined
    to the instruction (one prompt per instance), and bad instances are counted skips."""
    rows = [
        seed_task(0, "Suggest a breakfast.", [{"input": "", "output": "Oats."}]),
        seed_task(1, "Fix the grammar.", [{"input": "He go home.", "output": "He goes home."}]),
        seed_task(
            2,
            "Classify the sentiment.",
            [
                {"input": "I love it.", "output": "positive"},
                {"input": "I hate it.", "output": "negative"},
            ],
        ),
        seed_task(3, "Answer.", []),  # no instance: the instruction alone
        seed_task(4, "Broken.", "not a list"),
        seed_task(5, "Broken too.", [{"input": {"nested": "dict"}, "output": ""}]),
        seed_task(6, "Half broken.", [{"input": "fine", "output": ""}, "not an object"]),
    ]
    res = kit.load(write_jsonl(tmp_path / "seed.jsonl", rows))
    assert res.formats == {"seed": "alpaca"}
    assert res.frame["messages"].to_list() == [
        [user("Suggest a breakfast.")],
        [user("Fix the grammar.\n\nHe go home.")],
        [user("Classify the sentiment.\n\nI love it.")],
        [user("Classify the sentiment.\n\nI hate it.")],
        [user("Answer.")],
        [user("Half broken.\n\nfine")],
    ]
    assert res.frame["row"].to_list() == [0, 1, 2, 2, 3, 6]  # the row each came from
    assert res.skipped["seed"] == {"bad_type": 2, "non_string_content": 1}
    details = res.skipped_rows["detail"].to_list()
    assert any("instance 1" in d for d in details) and any("instances" in d for d in details)

    parquet = tmp_path / "seed.parquet"  # the same rows, columnar
    pl.DataFrame(rows[:4]).write_parquet(parquet)
    from_parquet = kit.load(parquet)
    assert from_parquet.formats == {"seed": "alpaca"}
    assert from_parquet.frame["messages"].to_list() == res.frame["messages"].to_list()[:5]


def test_a_field_kit_cannot_place_is_a_counted_skip(tmp_path):
    """A row holding two prompt fields of its format kept one and dropped the other with
    no word (Alpaca input + instances, Magicoder problem + instruction); now the row is a
    conflicting_fields skip that names both fields."""
    alpaca = [
        {"instruction": "Do A.", "input": "x"},
        {"instruction": "Do B.", "input": "y", "instances": [{"input": "z", "output": ""}]},
    ]
    magicoder = [{"problem": "Write X."}, {"problem": "Write Y.", "instruction": "Write Z."}]
    res = kit.load({"al": alpaca, "mc": magicoder})
    assert res.formats == {"al": "alpaca", "mc": "magicoder"}
    assert res.frame["messages"].to_list() == [[user("Do A.\n\nx")], [user("Write X.")]]
    assert res.skipped == {"al": {"conflicting_fields": 1}, "mc": {"conflicting_fields": 1}}
    details = res.skipped_rows["detail"].to_list()
    assert "'input'" in details[0] and "'instances'" in details[0]
    assert "'problem'" in details[1] and "'instruction'" in details[1]


# ---------------------------------------------------------------- item 9: plans


def plan_and_run(tmp_path, prompts, name: str) -> tuple[Path, pl.DataFrame, dict]:
    """Write a plan with `prompts` into a fresh run dir, then run it from the run dir alone."""
    run_dir = tmp_path / "run"
    frame = getattr(prompts, "frame", prompts)
    with FaultServer() as srv:
        config = RunConfig(
            model="fake",
            endpoints=srv.base_url,
            budgets=1,
            sampling=Sampling(max_tokens=40),
            concurrency=4,
            retry_base=0.02,
        )
        table = pl.DataFrame({"dataset": [name], "budget": [1_000_000]})
        kit.plan.write_plan(run_dir, table, config, prompts=prompts)
        del prompts  # nothing but the run directory from here
        plan = kit.plan.read_plan(run_dir)
        run = asyncio.run(kit.generate(None, plan["config"], run_dir=run_dir))
    assert run.stop_reason is None
    return run_dir, frame, plan


def test_plan_from_an_in_memory_frame_runs_from_its_run_dir(tmp_path):
    """plan.json recorded only file paths, so a plan made from an in-memory frame could not
    be run by `kit generate --run-dir` / 02_generate; now write_plan(prompts=) stores the
    frame in the run database and generate(None, ...) runs it."""
    frame = pl.DataFrame(
        {
            "dataset": ["mem"] * 12,
            "prompt_id": [f"p{i:02d}" for i in range(12)],
            "messages": [[user(f"question {i}")] for i in range(12)],
            "n_turns": [1] * 12,
            "row": list(range(12)),
        }
    )
    run_dir, frame, plan = plan_and_run(tmp_path, frame, "mem")
    assert plan["sources"] == {"mem": {"path": "", "format": None, "mapping": None}}
    records = records_frame(run_dir)
    assert records.height == 12  # every prompt once
    assert sorted(records["prompt_id"]) == sorted(frame["prompt_id"])
    assert not list(run_dir.glob("*.tmp"))  # written atomically, nothing left over


def test_plan_from_a_mapped_file_runs_from_its_run_dir_and_records_its_spec(tmp_path):
    """A plan made from a file loaded with mapping= recorded the path but not the mapping;
    re-loading it failed. Now plan.json holds path, format and mapping per dataset (which
    re-load the same prompts) and the run uses the prompts stored in the run database."""
    rows = [{"question": f"What is {i} + {i}?", "sys": "Be brief."} for i in range(10)]
    path = write_jsonl(tmp_path / "qa.jsonl", rows + [{"question": None}])
    loaded = kit.load(path, mapping={"prompt": "question", "system": "sys"})
    assert loaded.specs == {
        "qa": {
            "path": str(path),
            "format": "mapping",
            "mapping": {"prompt": "question", "system": "sys"},
        }
    }
    run_dir, frame, plan = plan_and_run(tmp_path, loaded, "qa")
    assert plan["sources"] == loaded.specs
    assert plan["config"].datasets == {"qa": str(path)}
    again = sources.reload(plan["sources"])  # the spec alone loads the same prompts
    assert again.frame["prompt_id"].to_list() == frame["prompt_id"].to_list()
    records = records_frame(run_dir)
    assert records.height == 10
    assert sorted(records["prompt_id"]) == sorted(frame["prompt_id"])
    stored = prompts_frame(run_dir).sort("row")
    assert stored["messages"].to_list() == frame.sort("row")["messages"].to_list()


# ---------------------------------------------------------------- issue 23, item 6


def nested_schema(levels: int) -> dict:
    """A JSON schema `levels` objects deep (2 JSON levels each)."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def test_bad_unicode_and_too_deep_tools_are_skipped_at_load_and_the_run_sends_the_rest(tmp_path):
    """Issue 23, item 6: one row holding a lone surrogate ("\\ud800", valid JSON, invalid
    Unicode) aborted the whole kit.load with a UnicodeEncodeError naming no file or line;
    tools nested past 255 levels loaded, then every request with them failed (kit's JSON
    encoder refuses them). Now both are counted skips, the surrogate's naming its file and
    line, and a real run sends every other prompt: records == prompts kept, no error."""
    tool = {"type": "function", "function": {"name": "f", "parameters": nested_schema(10)}}
    deep_tool = {"type": "function", "function": {"name": "g", "parameters": nested_schema(200)}}
    rows = [json.dumps({"messages": [user(f"fine {i}")]}) for i in range(10)]
    rows[3] = '{"messages": [{"role": "user", "content": "bad \\ud800 text"}]}'
    rows[7] = (
        '{"messages": [{"role": "system", "content": "\\udfff"}, {"role": "user", "content": "q"}]}'
    )
    rows += [json.dumps({"messages": [user("tool ok")], "tools": [tool]})]
    rows += [json.dumps({"messages": [user("tool deep")], "tools": [deep_tool]})]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    res = kit.load(path)
    assert res.skipped["mixed"] == {"bad_tools": 1, "bad_unicode": 2}
    skipped = {r["row"]: r for r in res.skipped_rows.to_dicts()}
    assert skipped[3]["detail"] == f"{path} line 4: a lone surrogate \\ud800 (not valid Unicode)"
    assert skipped[7]["detail"] == f"{path} line 8: a lone surrogate \\udfff (not valid Unicode)"
    assert "nested deeper than 254 levels" in skipped[11]["detail"]
    assert res.frame.height == 9
    with FaultServer() as srv:
        cfg = RunConfig(
            model="m",
            endpoints=srv.base_url,
            budgets=10**6,
            sampling=Sampling(max_tokens=20),
            retry_base=0.01,
        )
        run = kit.generate_sync(res, cfg, run_dir=tmp_path / "run")
        assert srv.stats()["requests"] == 9
    assert run.summary()["errors"][0] == 0 and run.stop_reason is None and not run.failed
    records = records_frame(tmp_path / "run")
    assert sorted(records["prompt_id"]) == sorted(res.frame["prompt_id"])  # every one, once
