"""Issue 34: public prompt sets in their own files and field names (tests/fixtures/public/,
written by make_public.py): nothing dropped unsaid at load, transcripts, nested message
lists, compressed files, and the dataset's own answer kept beside each prompt."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import polars as pl
import pytest
from test_cli import run_main

import kit
from kit.data.sources import prompt_id, reload
from kit.errors import DataError, MissingPath, Undetectable
from kit.run import reader
from kit.run.store import RunStore
from kit.types import Record, RunConfig, Sampling

PUBLIC = Path(__file__).parent / "fixtures" / "public"


def _rows(frame: pl.DataFrame) -> list[tuple]:
    return [(r["messages"], r["answer"]) for r in frame.iter_rows(named=True)]


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


# ---------------------------------------------------------------- item 1: nothing dropped unsaid


def test_dolly_puts_its_context_into_the_prompt_and_names_category_unused():
    """databricks-dolly-15k: detected (and format="alpaca") as instruction + context, the
    response as the answer; category, read into nothing, named at load."""
    for res in (
        kit.load(PUBLIC / "dolly.jsonl"),
        kit.load(PUBLIC / "dolly.jsonl", format="alpaca"),
    ):
        assert res.formats == {"dolly": "alpaca"}
        assert _rows(res.frame)[0] == (
            [_user("Summarize the text below.\n\nKit plans budgets.")],
            "Kit decides how many tokens each dataset gets.",
        )
        assert _rows(res.frame)[1][0] == [_user("Which is a species of fish? Tope or Rope")]
        assert res.unused == {"dolly": ["category"]} and res.answers == {"dolly": 3}
        assert "context" in res.notes["dolly"][0]
        text = repr(res)
        assert "unused): category" in text and "instruction + blank line + context" in text
        assert res.summary()["unused"].to_list() == ["category"]


def test_a_format_that_does_not_read_dollys_context_skips_the_row_and_says_so():
    """format="magicoder" reads the instruction alone: a row whose context holds text is a
    counted conflicting_fields skip, never a prompt without its context; a blank one is not."""
    res = kit.load(PUBLIC / "dolly.jsonl", format="magicoder")
    assert res.skipped == {"dolly": {"conflicting_fields": 2}} and res.prompts == {"dolly": 1}
    assert "'context'" in res.skipped_rows["detail"][0]


def test_a_source_with_text_columns_it_does_not_read_names_them():
    """A mapped MBPP loads its `text` as the prompt; its `code`, unmapped, is named unused,
    and mapped as the answer it is the answer (int and list columns are no text)."""
    res = kit.load(PUBLIC / "mbpp.jsonl", mapping={"prompt": "text"})
    assert res.unused == {"mbpp": ["code"]} and res.answers == {"mbpp": 0}
    res = kit.load(PUBLIC / "mbpp.jsonl", mapping={"prompt": "text", "answer": "code"})
    assert res.unused == {"mbpp": []} and res.frame["answer"][0].startswith("def similar")
    assert res.frame["messages"][0].to_list() == [
        _user("Write a function to find the similar elements from the given two tuple lists.")
    ]


def test_a_parquet_source_names_its_unused_text_columns():
    """The sanitized MBPP split, Parquet compressed with zstd: its text columns besides the
    prompt and answer are named (source_file)."""
    res = kit.load(
        PUBLIC / "mbpp_sanitized.parquet", mapping={"prompt": "prompt", "answer": "code"}
    )
    assert res.prompts == {"mbpp_sanitized": 1} and res.unused == {
        "mbpp_sanitized": ["source_file"]
    }
    assert res.frame["answer"][0] == "def similar_elements(a, b):\n  return tuple(set(a) & set(b))"


# ---------------------------------------------------------------- item 2: transcripts


def test_hh_rlhf_transcripts_load_as_conversations_without_their_answer():
    """hh-rlhf (.jsonl.gz, chosen/rejected): detected as transcripts of `chosen`; the prompt
    is every turn before the last Assistant turn, which is the answer and never in the
    prompt; `rejected` is named unused; reload from the specs gives the same prompts."""
    res = kit.load(PUBLIC / "hh_rlhf.jsonl.gz")
    assert res.formats == {"hh_rlhf": "transcript"} and res.prompts == {"hh_rlhf": 2}
    messages, answer = _rows(res.frame)[0]
    assert messages == [
        _user("What are some cuss words in english?"),
        {"role": "assistant", "content": "I'd rather not list those."},
        _user("What's your favorite one?"),
    ]
    assert answer == "I don't have one."
    assert all(answer not in m["content"] for m in messages)
    assert res.unused == {"hh_rlhf": ["rejected"]}
    assert "transcript column 'chosen'" in res.notes["hh_rlhf"][0]
    assert reload(res.specs).frame.equals(res.frame)
    rejected = kit.load(PUBLIC / "hh_rlhf.jsonl.gz", mapping={"transcript": "rejected"})
    assert rejected.frame["prompt_id"].equals(res.frame["prompt_id"])  # the same prompts
    assert rejected.frame["answer"].to_list() == ["Ass.", "Buy it."]


def test_undetectable_advice_never_offers_a_transcript_as_one_turn(tmp_path):
    """A source kit cannot detect: the advice names its text columns as a prompt, leaving
    out one holding a transcript (a minority of rows, so not detected as one)."""
    rows = [{"note": "a", "log": "\n\nHuman: hi\n\nAssistant: yo"}] + [
        {"note": "b", "log": "x"}
    ] * 2
    path = tmp_path / "logs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(Undetectable) as err:
        kit.load(path)
    assert "mapping={'prompt': <one of ['note']>}" in str(err.value)
    prompt_advice = str(err.value).split("or mapping=")[1]
    assert "'log'" not in prompt_advice and "mapping={'transcript': <one of ['log']>}" in str(
        err.value
    )


def test_a_transcript_with_text_before_its_first_turn_is_a_counted_skip():
    rows = [{"t": "preamble\n\nHuman: hi\n\nAssistant: yo"}, {"t": "\n\nHuman: hi"}]
    res = kit.load({"d": rows}, mapping={"transcript": "t"})
    assert res.skipped == {"d": {"bad_role": 1}} and res.prompts == {"d": 1}
    assert res.frame["answer"].to_list() == [None]  # the conversation ends with Human


# ---------------------------------------------------------------- item 3: nested turns


def test_bfcl_question_lists_of_message_lists_load_as_conversations():
    """BFCL simple_python: `question` holds [[{role, content}]]: the first list is the
    conversation, the later ones counted in a note; `function` carried as tools; the
    undetected source's advice names the message-list column."""
    path = PUBLIC / "bfcl_simple_python.jsonl"
    with pytest.raises(Undetectable, match=r"mapping=\{'messages': 'question'\}"):
        kit.load(path)
    res = kit.load(path, mapping={"messages": "question", "tools": "function"})
    assert res.prompts == {"bfcl_simple_python": 2} and res.skipped == {"bfcl_simple_python": {}}
    assert res.frame["messages"][1].to_list() == [
        _user("What is the area of a triangle of base 3, height 4?")
    ]
    assert res.with_tools == {"bfcl_simple_python": 2}
    assert json.loads(res.frame["tools"][0])[0]["function"]["name"] == "calculate_triangle_area"
    assert res.notes["bfcl_simple_python"] == [
        "2 rows hold a list of message lists: the first list is the conversation; "
        "1 later lists not read"
    ]
    assert res.unused == {"bfcl_simple_python": ["id"]}


# ---------------------------------------------------------------- item 4: compressed files


def test_compressed_files_load_like_plain_ones(tmp_path):
    """.jsonl.gz, .json.gz, .jsonl.zst: the same prompts as the plain file, named by their
    stem; a gzip file cut short is a DataError naming it."""
    plain = tmp_path / "sharegpt.jsonl"
    zst = kit.load(PUBLIC / "sharegpt.jsonl.zst")
    rows = [json.loads(x) for x in reader_lines(zst.paths["sharegpt"])]
    plain.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert kit.load(plain).frame.equals(zst.frame) and zst.formats == {"sharegpt": "sharegpt"}
    alpaca = kit.load(PUBLIC / "code_alpaca.json.gz")
    assert alpaca.formats == {"code_alpaca": "alpaca"} and alpaca.answers == {"code_alpaca": 2}
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(plain.read_bytes() * 50)[:-30])
    with pytest.raises(DataError, match=r"cut\.jsonl\.gz: cannot read it"):
        kit.load(cut)
    for codec in ("gzip", "snappy", "zstd"):
        path = tmp_path / f"p_{codec}.parquet"
        pl.DataFrame({"instruction": ["a", "b"], "input": ["", "c"]}).write_parquet(
            path, compression=codec
        )
        assert kit.load(path).prompts == {f"p_{codec}": 2}


def reader_lines(path: str) -> list[bytes]:
    from kit.data.readers import _open

    with _open(Path(path)) as f:
        return f.read().splitlines()


# ---------------------------------------------------------------- item 5: the dataset's answer


def test_the_answer_never_changes_a_prompt_id(tmp_path):
    """Prompt ids hash the prompt alone: ShareGPT rows cut before their gpt answers (as kit
    loaded them before answers were kept) and with them give the same ids."""
    res = kit.load(PUBLIC / "sharegpt.jsonl.zst")
    cut = [
        {"conversations": r["conversations"][:-1]}
        for r in (json.loads(x) for x in reader_lines(res.paths["sharegpt"]))
    ]
    before = kit.load({"sharegpt": cut})
    assert before.frame["prompt_id"].equals(res.frame["prompt_id"])
    assert before.frame["answer"].to_list() == [None, None]
    assert res.frame["answer"].to_list() == [
        "A prince avenges his father's murder and dies doing it.",
        "7",
    ]
    assert res.frame["prompt_id"].to_list() == [
        prompt_id(m.to_list()) for m in res.frame["messages"]
    ]


def test_the_answer_is_stored_and_shown_by_kit_records(tmp_path, capsys):
    """The answer goes into the run store's prompts table (m005_prompt_answers) and `kit
    records` shows it beside the completion (dataset_answer)."""
    res = kit.load(PUBLIC / "sharegpt.jsonl.zst")
    cfg = RunConfig(
        model="smollm2-135m",
        endpoints=["http://127.0.0.1:9/v1"],
        sampling=Sampling(max_tokens=16, temperature=0.0, seed=1),
        budgets={"sharegpt": 100},
        chat_template_hash="planted",
    )
    run = tmp_path / "run"
    store = RunStore(run)
    store.init(cfg, res)
    first = res.frame.row(1, named=True)
    store.append(
        Record(
            dataset="sharegpt",
            prompt_id=first["prompt_id"],
            sample=0,
            messages=first["messages"],
            completion="11",
            finish_reason="stop",
            completion_tokens=1,
            count_source="usage",
        )
    )
    store.close()
    stored = reader.prompts_frame(run).sort("row")
    assert stored["answer"].to_list() == res.frame["answer"].to_list()
    code, out, err = run_main(["records", str(run)], capsys)
    assert code == 0, err
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert (row["completion"], row["dataset_answer"]) == ("11", "7")


# ---------------------------------------------------------------- item 9: a missing path


def test_a_missing_path_says_it_does_not_exist(tmp_path, capsys):
    with pytest.raises(MissingPath, match="/nonexistent: no such file or directory$"):
        kit.load("/nonexistent")
    code, _, err = run_main(
        ["plan", "--samples", "/nonexistent", "--run-dir", str(tmp_path / "r"), "--budget", "1000"],
        capsys,
    )
    assert code != 0 and "/nonexistent does not exist" in err and "unsupported" not in err


def test_a_parquet_conversation_keeps_the_turn_after_its_last_user_turn(tmp_path):
    """Parquet turn lists are cut in polars after the answer, not before it."""
    turns = [("human", "Hi"), ("gpt", "Hello"), ("human", "Q"), ("gpt", "A"), ("human", "late")]
    rows = [
        {"conversations": [{"from": f, "value": v} for f, v in turns]},
        {"conversations": [{"from": f, "value": v} for f, v in turns[:4]]},
    ]
    pl.DataFrame(rows).write_parquet(tmp_path / "sg.parquet")
    res = kit.load(tmp_path / "sg.parquet")
    assert res.frame["answer"].to_list() == [None, "A"]
    assert [len(m) for m in res.frame["messages"].to_list()] == [5, 3]
