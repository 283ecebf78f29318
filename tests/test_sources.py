"""kit.data.sources (kit.load): every format and container, malformed rows counted by reason,
stable ids. Every input is written by the test itself; tests/test_samples.py checks the
shipped files in data/samples."""

import json
import os
import random
import time
from pathlib import Path

import polars as pl
import pytest

import kit
from kit.data import sources


def write_jsonl(path: Path, rows: list) -> Path:
    """Rows -> JSONL; a str row is written verbatim (for broken lines)."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def msgs(frame: pl.DataFrame) -> list[list[dict]]:
    return frame["messages"].to_list()


def user(text: str) -> dict:
    return {"role": "user", "content": text}


# ---------------------------------------------------------------- formats


def test_sharegpt_roles_system_and_cut(tmp_path):
    row = {
        "conversations": [
            {"from": "system", "value": "Be kind."},
            {"from": "human", "value": "Hi there "},
            {"from": "gpt", "value": "Hello!"},
            {"from": "human", "value": "Tell me a joke."},
            {"from": "gpt", "value": "Why did the chicken..."},
        ]
    }
    res = kit.load(write_jsonl(tmp_path / "sg.jsonl", [row]))
    assert res.formats == {"sg": "sharegpt"}
    assert msgs(res.frame) == [
        [
            {"role": "system", "content": "Be kind."},
            user("Hi there "),  # content as the dataset has it
            {"role": "assistant", "content": "Hello!"},
            user("Tell me a joke."),
        ]
    ]
    assert res.frame["n_turns"].to_list() == [2]
    assert res.frame.schema == pl.Schema(sources.SCHEMA)


def test_openai_messages_and_user_assistant_roles_in_sharegpt(tmp_path):
    rows = [
        {"messages": [user("What is 2+2?"), {"role": "assistant", "content": "4"}]},
        {"conversations": [{"from": "user", "value": "a"}, {"from": "assistant", "value": "b"}]},
    ]
    res = kit.load(write_jsonl(tmp_path / "oa.jsonl", rows[:1]))
    assert res.formats["oa"] == "openai" and msgs(res.frame) == [[user("What is 2+2?")]]
    res = kit.load(write_jsonl(tmp_path / "sg2.jsonl", rows[1:]))
    assert res.formats["sg2"] == "sharegpt" and msgs(res.frame) == [[user("a")]]


def test_ultrachat_data_alternates_from_user(tmp_path):
    row = {"id": "x", "data": ["Q1", "A1", "Q2", "A2"]}
    res = kit.load(write_jsonl(tmp_path / "uc.jsonl", [row]))
    assert res.formats["uc"] == "ultrachat"
    assert msgs(res.frame) == [[user("Q1"), {"role": "assistant", "content": "A1"}, user("Q2")]]
    assert res.frame["n_turns"].to_list() == [2]


def test_alpaca_joins_instruction_and_input(tmp_path):
    rows = [
        {"instruction": "Translate to French. ", "input": " Good morning.", "output": "Bonjour."},
        {"instruction": "Name a colour.", "input": "", "output": "Red"},
        {"instruction": "Name a fruit.", "output": "Apple"},
    ]
    res = kit.load(write_jsonl(tmp_path / "al.jsonl", rows))
    assert res.formats["al"] == "alpaca"
    assert msgs(res.frame) == [
        [user("Translate to French.\n\nGood morning.")],
        [user("Name a colour.")],
        [user("Name a fruit.")],
    ]


def test_magicoder_problem_or_instruction_and_opencodeinstruct(tmp_path):
    oss = kit.load(write_jsonl(tmp_path / "oss.jsonl", [{"problem": "Write X.", "solution": "x"}]))
    evol = kit.load(
        write_jsonl(tmp_path / "evol.jsonl", [{"instruction": "Do Y.", "response": "y"}])
    )
    oci = kit.load(
        write_jsonl(tmp_path / "oci.jsonl", [{"id": "1", "input": "Write Z.", "output": "z"}])
    )
    assert (oss.formats["oss"], msgs(oss.frame)) == ("magicoder", [[user("Write X.")]])
    assert (evol.formats["evol"], msgs(evol.frame)) == ("magicoder", [[user("Do Y.")]])
    assert (oci.formats["oci"], msgs(oci.frame)) == ("opencodeinstruct", [[user("Write Z.")]])


def test_generic_mapping_with_system_column(tmp_path):
    rows = [
        {"question": "Why is the sky blue?", "sys_col": "Answer briefly."},
        {"question": "What is rain?", "sys_col": None},
    ]
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    res = kit.load(path, mapping={"prompt": "question", "system": "sys_col"})
    assert res.formats == {"qa": "mapping"}
    assert msgs(res.frame) == [
        [{"role": "system", "content": "Answer briefly."}, user("Why is the sky blue?")],
        [user("What is rain?")],
    ]


def test_mapping_to_a_messages_column(tmp_path):
    rows = [{"chat": [user("hello"), {"role": "assistant", "content": "hi"}, user("bye")]}]
    res = kit.load(write_jsonl(tmp_path / "m.jsonl", rows), mapping={"messages": "chat"})
    assert res.frame["n_turns"].to_list() == [2]


def test_bad_arguments_name_the_field_and_value(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "q"}])
    with pytest.raises(ValueError, match="not found.*questoin|questoin.*not found"):
        kit.load(path, mapping={"prompt": "questoin"})
    with pytest.raises(ValueError, match="format must be one of.*'alpacca'"):
        kit.load(path, format="alpacca")
    with pytest.raises(ValueError, match="mapping needs exactly one of"):
        kit.load(path, mapping={"system": "question"})
    with pytest.raises(ValueError, match="dataset name 'bad name'"):
        kit.load(path, name="bad name")


def test_forced_format_overrides_detection(tmp_path):
    row = {"conversations": [{"from": "human", "value": "sharegpt"}], "messages": [user("openai")]}
    path = write_jsonl(tmp_path / "f.jsonl", [row])
    assert kit.load(path).formats == {"f": "sharegpt"}
    assert msgs(kit.load(path, format="openai").frame) == [[user("openai")]]
    # a second prompt field the forced format does not read is a skip, not a silent drop
    both = write_jsonl(tmp_path / "both.jsonl", [{"instruction": "one", "problem": "two"}])
    for fmt in ("magicoder", "alpaca"):
        with pytest.warns(UserWarning, match="0 prompts"):
            res = kit.load(both, format=fmt)
        assert res.skipped == {"both": {"conflicting_fields": 1}}


def test_unknown_format_names_path_and_columns(tmp_path):
    path = write_jsonl(tmp_path / "weird.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(ValueError) as err:
        kit.load(path)
    assert str(path) in str(err.value)
    assert "['answer', 'question']" in str(err.value)


# ---------------------------------------------------------------- containers


def test_json_list_json_data_key_and_misnamed_jsonl(tmp_path):
    rows = [{"messages": [user("one")]}, {"messages": [user("two")]}]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    (tmp_path / "b.json").write_text(json.dumps({"data": rows}))
    write_jsonl(tmp_path / "c.json", rows)
    res = kit.load([tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"])
    assert res.frame.group_by("dataset").len().sort("dataset")["len"].to_list() == [2, 2, 2]
    (tmp_path / "d.json").write_text('{"rows": []}')
    with pytest.raises(ValueError, match=r"d\.json.*found \['rows'\]"):
        kit.load(tmp_path / "d.json")


def test_parquet_nested_and_flat(tmp_path):
    nested = pl.DataFrame(
        {
            "messages": [
                [user("p1")],
                [user("p2"), {"role": "assistant", "content": "a"}, user("p3")],
            ]
        }
    )
    nested.write_parquet(tmp_path / "nested.parquet")
    pl.DataFrame({"instruction": ["i1", "i2"], "input": ["x", None]}).write_parquet(
        tmp_path / "flat.parquet"
    )
    res = kit.load([tmp_path / "nested.parquet", tmp_path / "flat.parquet"])
    assert res.formats == {"nested": "openai", "flat": "alpaca"}
    assert msgs(res.frame) == [
        [user("p1")],
        [user("p2"), {"role": "assistant", "content": "a"}, user("p3")],
        [user("i1\n\nx")],
        [user("i2")],
    ]


class DuckDataset:
    """Stands in for a user's datasets.Dataset: column_names + to_list()."""

    def __init__(self, rows):
        self.rows = rows
        self.column_names = sorted(rows[0])

    def to_list(self):
        return list(self.rows)


class DuckPandas:
    """Stands in for a pandas.DataFrame (not installed here): columns + to_dict("records")."""

    def __init__(self, rows):
        self.rows, self.columns = rows, sorted(rows[0])

    def to_dict(self, orient):
        assert orient == "records"
        return list(self.rows)

    def __iter__(self):  # like pandas: iterating gives column names, not rows
        return iter(self.columns)


def test_in_memory_sources_need_a_name():
    rows = [{"conversations": [{"from": "human", "value": "hey"}]}]
    sources_in = {"duck": DuckDataset(rows), "plain": rows, "frame": pl.DataFrame(rows)}
    res = kit.load({**sources_in, "pd": DuckPandas(rows)})
    assert res.frame["dataset"].to_list() == ["duck", "plain", "frame", "pd"]
    assert set(res.frame["prompt_id"]) == {sources.prompt_id([user("hey")])}
    assert res.paths == {"duck": "", "plain": "", "frame": "", "pd": ""}
    assert kit.load(rows, name="named").frame["dataset"].to_list() == ["named"]
    with pytest.raises(ValueError, match="in-memory data needs a name"):
        kit.load(DuckDataset(rows))


def test_names_from_stems_sanitized_and_clashes_refused(tmp_path):
    row = {"input": "x"}
    res = kit.load(write_jsonl(tmp_path / "my data (v2).jsonl", [row]))
    assert list(res.formats) == ["my_data_v2"]
    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "sub" / "same.jsonl", [row])
    write_jsonl(tmp_path / "same.jsonl", [row])
    with pytest.raises(ValueError, match="'same' used twice"):
        kit.load([tmp_path / "same.jsonl", tmp_path / "sub" / "same.jsonl"])
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        kit.load(tmp_path / "x.csv")


def test_directory_loads_its_data_files(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"input": "x"}])
    pl.DataFrame({"problem": ["y"]}).write_parquet(tmp_path / "b.parquet")
    (tmp_path / "README.md").write_text("not data")
    res = kit.load(tmp_path)
    assert res.summary()["dataset"].to_list() == ["a", "b"]


# ---------------------------------------------------------------- bad rows


def test_malformed_rows_are_counted_by_reason(tmp_path):
    good = [
        {"messages": [user("good one")]},
        {"messages": [user("good two"), {"role": "assistant", "content": ""}]},  # tail not checked
    ]
    bad = [
        "{not json",  # bad_json
        '["a", "list"]',  # not_object
        {"messages": "hello"},  # bad_type
        {"messages": [user("ok"), 7, user("again")]},  # bad_type (turn)
        {"other": 1},  # missing_field
        {"messages": [{"role": "narrator", "content": "x"}, user("q")]},  # bad_role
        {"messages": [user(12)]},  # non_string_content
        {"messages": [user("   ")]},  # empty_content
        {"messages": [{"role": "assistant", "content": "x"}]},  # no_user_turn
        {"messages": []},  # no_user_turn
        {"messages": [{"role": "assistant", "content": "x"}, user("y")]},  # bad_order
        {"messages": [user("x"), user("y")]},  # bad_order
        {"messages": [user("x"), {"role": "system", "content": "s"}, user("y")]},  # bad_order
    ]
    path = write_jsonl(tmp_path / "mixed.jsonl", [good[0], *bad, "", good[1]])
    res = kit.load(path)
    assert msgs(res.frame) == [[user("good one")], [user("good two")]]
    assert res.skipped["mixed"] == {
        "bad_json": 1,
        "not_object": 1,
        "bad_type": 2,
        "missing_field": 1,
        "bad_role": 1,
        "non_string_content": 1,
        "empty_content": 1,
        "no_user_turn": 2,
        "bad_order": 3,
    }
    assert res.rows["mixed"] == 15  # the blank line is not a row
    assert res.frame["row"].to_list() == [0, 15]  # row = 0-based line index
    first = res.skipped_rows.row(0, named=True)
    assert (first["row"], first["reason"]) == (1, "bad_json")
    assert first["detail"].startswith("line 2:")
    summary = res.summary().row(0, named=True)
    assert (summary["prompts"], summary["skipped"]) == (2, 13)
    assert "bad_order: 3" in summary["skip_reasons"]


def test_non_object_rows_in_json_and_memory(tmp_path):
    (tmp_path / "j.json").write_text(json.dumps([{"input": "ok"}, None, 3, "s"]))
    res = kit.load(tmp_path / "j.json")
    assert res.skipped["j"] == {"not_object": 3} and res.frame.height == 1


def test_duplicates_dropped_and_counted_first_row_kept(tmp_path):
    rows = [{"input": "same"}, {"input": "other"}, {"input": "same  "}, {"input": " same"}]
    res = kit.load(write_jsonl(tmp_path / "d.jsonl", rows), strip=True)
    assert res.frame["row"].to_list() == [0, 1]
    assert res.duplicates == {"d": 3 - 1}
    assert res.summary()["duplicates"].to_list() == [2]
    assert res.stripped == {"d": 2}
    kept = kit.load(write_jsonl(tmp_path / "d.jsonl", rows))  # as given: four prompts
    assert kept.frame["row"].to_list() == [0, 1, 2, 3] and kept.duplicates == {"d": 0}


def test_same_prompt_in_two_datasets_kept_in_both(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"input": "shared"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"problem": "shared"}])
    res = kit.load([a, b])
    assert res.frame.height == 2 and res.frame["prompt_id"].n_unique() == 1
    assert res.duplicates == {"a": 0, "b": 0}


# ---------------------------------------------------------------- identity


def ids_by_prompt(res) -> dict[str, str]:
    """Prompt text -> prompt_id."""
    texts = [str(m) for m in res.frame["messages"].to_list()]
    return dict(zip(texts, res.frame["prompt_id"], strict=True))


def test_prompt_id_stable_under_shuffle_and_reload(tmp_path):
    rows = [{"data": [f"question {i}", f"answer {i}", f"follow-up {i}"]} for i in range(50)]
    first = kit.load(write_jsonl(tmp_path / "a.jsonl", rows))
    random.Random(3).shuffle(rows)
    second = kit.load(write_jsonl(tmp_path / "a.jsonl", rows))
    assert ids_by_prompt(first) == ids_by_prompt(second)
    assert first.frame["prompt_id"].to_list() != second.frame["prompt_id"].to_list()  # reordered
    assert first.source_hashes() == second.source_hashes()
    assert first.frame["prompt_id"].n_unique() == 50
    assert first.frame["prompt_id"].str.contains(r"^[0-9a-f]{16}$").all()


def test_prompt_id_is_the_documented_hash_of_stripped_messages():
    import hashlib

    messages = [{"role": "system", "content": "S"}, user("Hello")]
    payload = '[["system","S"],["user","Hello"]]'
    assert (
        sources.prompt_id(messages) == hashlib.blake2b(payload.encode(), digest_size=8).hexdigest()
    )
    rows = [{"messages": [{"role": "system", "content": "S\n"}, user("  Hello ")]}]
    res = kit.load({"x": rows}, strip=True)
    assert res.frame["prompt_id"].to_list() == [sources.prompt_id(messages)]


def test_prompt_id_hashes_json_dumps_bytes_for_every_code_point():
    """prompt_id's payload is json.dumps(ensure_ascii=False, compact) byte for byte, for every
    code point (orjson writes it; a lone surrogate still fails as json's encoding does)."""
    import hashlib

    chars = [chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    for at in range(0, len(chars), 4096):
        text = "".join(chars[at : at + 4096])
        messages = [user(text), {"role": "assistant", "content": '"\\\n\t'}, user(text[::-1])]
        tools = '[{"type":"function","function":{"name":"f\u00e9"}}]'
        want = json.dumps(
            [[m["role"], m["content"]] for m in messages], ensure_ascii=False, separators=(",", ":")
        )
        assert (
            sources.prompt_id(messages) == hashlib.blake2b(want.encode(), digest_size=8).hexdigest()
        )
        whole = f'{{"messages":{want},"tools":{tools}}}'.encode()
        assert (
            sources.prompt_id(messages, tools) == hashlib.blake2b(whole, digest_size=8).hexdigest()
        )
    with pytest.raises(UnicodeEncodeError):
        sources.prompt_id([user("a \ud800 b")])


# ---------------------------------------------------------------- display and scale


def test_summary_and_reprs(tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [{"input": "a"}, "oops", {"input": "a"}])
    res = kit.load(path)
    assert res.summary().columns == [
        "dataset",
        "format",
        "rows",
        "prompts",
        "with_tools",
        "answers",
        "duplicates",
        "skipped",
        "skip_reasons",
        "unused",
    ]
    text = repr(res)
    assert "1 prompts, 1 skipped, 1 duplicates" in text and "bad_json: 1" in text
    assert "<table" in res._repr_html_()


def test_prompts_moved_into_frame_parts_as_they_load_give_the_same_frame(monkeypatch):
    """kit.load holds at most CHUNK prompts as Python objects; the frame is the same."""
    tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    data = {
        "a": [{"instruction": f"a{i}"} for i in range(7)],
        "b": [{"instruction": f"b{i}"} | ({"tools": tool} if i == 4 else {}) for i in range(5)],
        "c": [{"instruction": f"c{i}"} for i in range(2)],
    }
    whole = kit.load(data).frame
    monkeypatch.setattr(sources, "CHUNK", 3)
    parts = kit.load(data).frame
    assert parts.equals(whole) and parts.height == 14 and parts["tools"].null_count() == 13
    assert "tools" not in kit.load({"c": data["c"]}).frame.columns


def test_a_load_streams_files_into_parquet_parts_it_removes(tmp_path, monkeypatch):
    """JSONL and Parquet are read a block at a time and the prompts written a part at a time:
    no step holds a whole file or every prompt. frame, batches() and scan() give the same
    rows in load order; the parts' directory goes with the LoadResult."""
    import gc

    from kit.data import readers

    rows = [{"instruction": f"task {i}"} if i % 9 else "{broken" for i in range(40)]
    write_jsonl(tmp_path / "a.jsonl", rows)
    pl.DataFrame({"problem": [f"p{i}" for i in range(11)]}).write_parquet(tmp_path / "b.parquet")
    whole = kit.load(tmp_path).frame
    monkeypatch.setattr(readers, "BLOCK", 4)
    monkeypatch.setattr(sources, "CHUNK", 6)
    res = kit.load(tmp_path)
    assert res.frame.equals(whole) and res.height == whole.height == 35 + 11
    assert [b.height for b in res.batches()] == [6] * 7 + [4]  # a: 35 = 5x6 + 5, b on top
    assert pl.concat(list(res.batches())).equals(whole) and res.scan().collect().equals(whole)
    assert res.skipped == {"a": {"bad_json": 5}, "b": {}} and res.rows == {"a": 40, "b": 11}
    assert res.summary()["prompts"].to_list() == [35, 11]
    assert res.source_hashes() == sources.source_hashes(whole)
    spill = res.spill
    assert sorted(p.name for p in spill.iterdir()) == [f"part-{i:05d}.parquet" for i in range(8)]
    del res
    gc.collect()
    assert not spill.exists()


def test_parts_a_killed_load_left_are_removed_and_nothing_else(tmp_path, monkeypatch):
    """A kill -9 leaves kit-load-PID-* behind: the next load removes it when PID is gone and
    it holds only part files; a live PID's, or one holding another file, stays."""
    import subprocess
    import sys

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = int(gone.stdout)
    stale, kept, live = (tmp_path / f"kit-load-{pid}-x{i}" for i, pid in enumerate([dead, dead, 1]))
    for d in (stale, kept, live):
        d.mkdir()
        (d / "part-00000.parquet").write_bytes(b"x")
    (kept / "notes.txt").write_text("not kit's")
    res = kit.load({"a": [{"instruction": "hi"}]})
    assert res.spill.parent == tmp_path and res.spill.name.startswith(f"kit-load-{os.getpid()}-")
    assert (
        not stale.exists()
        and (kept / "notes.txt").exists()
        and (live / "part-00000.parquet").exists()
    )


def test_a_mapped_tools_column_past_the_first_block_is_found(tmp_path, monkeypatch):
    """Detection reads a file's head; a mapped tools column met only later is no error, one
    no row holds is (named, as before streaming)."""
    from kit.data import readers

    monkeypatch.setattr(readers, "BLOCK", 4)
    tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    rows = [{"q": f"q{i}"} | ({"fns": tool} if i == 30 else {}) for i in range(40)]
    res = kit.load(write_jsonl(tmp_path / "t.jsonl", rows), mapping={"prompt": "q", "tools": "fns"})
    assert res.frame["tools"].null_count() == 39 and res.with_tools == {"t": 1}
    rows = [{"q": f"q{i}"} for i in range(40)]
    with pytest.raises(ValueError, match=r"mapping columns \['fns'\] not found in .*t2.jsonl"):
        kit.load(write_jsonl(tmp_path / "t2.jsonl", rows), mapping={"prompt": "q", "tools": "fns"})


@pytest.mark.slow
def test_100k_rows_load_in_seconds(tmp_path):
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for i in range(100_000):
            conv = [
                {"from": "human", "value": f"question number {i}"},
                {"from": "gpt", "value": "an answer " * 20},
            ]
            f.write(json.dumps({"conversations": conv}) + "\n")
    start = time.process_time()  # CPU time: other test runs share the machine's cores
    res = kit.load(path)
    elapsed = time.process_time() - start
    assert res.frame.height == 100_000
    assert elapsed < 10, f"100K rows took {elapsed:.1f} CPU seconds"


def test_parquet_sharegpt_and_mapping_keep_row_index(tmp_path):
    turns = [
        [{"from": "human", "value": "q1"}, {"from": "gpt", "value": ""}],  # empty answer: dropped
        [{"from": "gpt", "value": "only an answer"}],
        [
            {"from": "human", "value": "q2"},
            {"from": "gpt", "value": "a2"},
            {"from": "human", "value": "q3"},
        ],
    ]
    pl.DataFrame({"conversations": turns, "extra": [1, 2, 3]}).write_parquet(
        tmp_path / "sg.parquet"
    )
    res = kit.load(tmp_path / "sg.parquet")
    assert msgs(res.frame) == [
        [user("q1")],
        [user("q2"), {"role": "assistant", "content": "a2"}, user("q3")],
    ]
    assert res.frame["row"].to_list() == [0, 2]
    assert res.skipped["sg"] == {"no_user_turn": 1}
    pl.DataFrame({"q": ["a", None, "c"], "s": ["sys", "sys", None]}).write_parquet(
        tmp_path / "m.parquet"
    )
    res = kit.load(tmp_path / "m.parquet", mapping={"prompt": "q", "system": "s"})
    assert res.frame["row"].to_list() == [0, 2] and res.skipped["m"] == {"missing_field": 1}
    assert res.frame["n_turns"].to_list() == [1, 1]


def test_broken_last_user_turn_skips_the_row_instead_of_cutting_early(tmp_path):
    rows = [
        {"messages": [user("q1"), {"role": "assistant", "content": "a1"}, {"role": "user"}]},
        {"conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": None}]},
    ]
    with pytest.warns(UserWarning, match="0 prompts"):
        res = kit.load(write_jsonl(tmp_path / "b.jsonl", rows[:1]))
    assert res.frame.height == 0 and res.skipped["b"] == {"missing_field": 1}
    assert res.frame.schema == pl.Schema(sources.SCHEMA)  # an all-bad file still gives the frame
    res = kit.load(write_jsonl(tmp_path / "c.jsonl", rows[1:]))  # a broken answer costs nothing
    assert msgs(res.frame) == [[user("q1")]]


def test_bom_and_blank_system_column(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"q": "hi", "s": "  "}).encode() + b"\n")
    res = kit.load(path, mapping={"prompt": "q", "system": "s"})
    assert msgs(res.frame) == [[user("hi")]] and res.skipped["bom"] == {}
