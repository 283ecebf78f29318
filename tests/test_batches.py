"""Records without bulk, read in batches (kit/run/batches.py), and the streaming export.

A run written by RunStore stores each prompt once (prompts.parquet); its record lines hold
no messages and no tools. These tests check that nothing a reader needs is lost: the same
run planted the old way (every line holding its prompt) exports byte for byte the same,
in batches of 3 records as in one batch, and a live run's new lines are not half-read.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np
import orjson
import polars as pl
import pytest

from kit.report import export as export_mod
from kit.report.export import export
from kit.report.validate import validate
from kit.run.batches import read_records, record_batches
from kit.run.store import RunStore
from kit.types import Record, RunConfig, Sampling

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
T0 = 1_700_000_000.0


def _prompts() -> pl.DataFrame:
    rows = []
    for ds in ("chat", "agent", "multi"):
        for i in range(12):
            messages = [{"role": "user", "content": f"{ds} question {i}"}]
            if ds == "multi":
                messages = [
                    {"role": "user", "content": f"first {i}"},
                    {"role": "assistant", "content": f"DATASET ANSWER {i}"},
                    {"role": "user", "content": f"second {i}"},
                ]
            tools = json.dumps(TOOLS) if ds == "agent" and i % 2 == 0 else None
            rows.append({"dataset": ds, "prompt_id": f"{ds}{i:02d}", "messages": messages,
                         "tools": tools, "n_turns": len(messages), "row": i})  # fmt: skip
    return pl.DataFrame(rows)


def _records(prompts: pl.DataFrame) -> list[Record]:
    """Records as the runner makes them: messages and tools from the prompt frame; multi's
    prompt holds the target's own earlier answer (all_turns); some reasoning, duplicates."""
    out = []
    for k, p in enumerate(prompts.to_dicts()):
        messages, turns = p["messages"], None
        if p["dataset"] == "multi":
            turns = [{"content": f"target answer {k}", "reasoning": None, "finish_reason": "stop",
                      "completion_tokens": 3, "count_source": "usage", "output_ids": None,
                      "prompt_ids": None}]  # fmt: skip
            messages = [dict(m) for m in messages]
            messages[1]["content"] = f"target answer {k}"
        text = "same answer" if k % 5 == 0 else f"answer number {k} " + "word " * (k % 7)
        out.append(Record(
            dataset=p["dataset"], prompt_id=p["prompt_id"], sample=0, messages=messages,
            completion=text, finish_reason="length" if k % 6 == 0 else "stop",
            completion_tokens=5 + k % 9, count_source="usage", t_done=T0 + (k * 7919) % 101 + k / 1000,
            reasoning="thinking it over" if k % 4 == 0 else None,
            tools=json.loads(p["tools"]) if p["tools"] else None, turns=turns,
        ))  # fmt: skip
    return sorted(out, key=lambda r: r.t_done)


def _config() -> RunConfig:
    return RunConfig(
        model="m", endpoints=["http://127.0.0.1:9/v1"], sampling=Sampling(max_tokens=64),
        budgets={"chat": 60, "agent": 80, "multi": 10**6}, turns="all_turns",
    )  # fmt: skip


def _stored_run(run_dir):
    """The run written by RunStore (short lines); returns its records."""
    prompts = _prompts()
    records = _records(prompts)
    store = RunStore(run_dir)
    store.init(_config(), prompts)
    for r in records:
        store.append(r)
    store.close()
    return records


def _planted_run(run_dir, records):
    """The same run written the old way: every line holds its messages and tools."""
    (run_dir / "records").mkdir(parents=True)
    cfg = _config()
    doc = {"fingerprint": cfg.fingerprint(), "config": cfg.to_dict()}
    (run_dir / "config.json").write_text(json.dumps(doc))
    for r in records:
        with open(run_dir / "records" / f"{r.dataset}.jsonl", "ab") as f:
            f.write(orjson.dumps(dataclasses.asdict(r)) + b"\n")


def _files(out) -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }


OPTIONS = [
    dict(val_fraction=0.25),
    dict(drop_duplicates=True, drop_truncated=True, val_fraction=0.3, seed=4),
    dict(trim_to_budget=True),
    dict(mix={"chat": 1, "agent": 2}),
]


def test_lines_hold_no_prompt_and_the_reader_rebuilds_it(tmp_path):
    records = _stored_run(tmp_path)
    lines = [orjson.loads(x) for p in (tmp_path / "records").glob("*.jsonl") for x in p.read_bytes().splitlines()]  # fmt: skip
    assert len(lines) == len(records) and not any("messages" in r or "tools" in r for r in lines)
    frame, corrupt = read_records(tmp_path)
    assert not corrupt
    got = {(r["dataset"], r["prompt_id"]): r for r in frame.to_dicts()}
    for r in records:  # the messages as the runner sent them, the tools of the prompt
        row = got[(r.dataset, r.prompt_id)]
        assert row["messages"] == r.messages
        assert (json.loads(row["tools"]) if row["tools"] else None) == r.tools
        assert row["completion"] == r.completion and row["reasoning"] == r.reasoning


def test_export_of_short_lines_equals_the_old_layout_in_any_batch_size(tmp_path, monkeypatch, model_dir):  # fmt: skip
    records = _stored_run(tmp_path / "short")
    _planted_run(tmp_path / "old", records)
    formats = ("specforge", "token_ids", "parquet")
    for k, opts in enumerate(OPTIONS):
        outs = []
        for run, batch in (("old", 10_000), ("short", 10_000), ("short", 3)):
            monkeypatch.setattr(export_mod, "BATCH", batch)
            monkeypatch.setattr(export_mod, "TOKEN_BATCH", batch)
            out = tmp_path / f"out{k}-{run}-{batch}"
            result = export(tmp_path / run, out, formats=formats, tokenizer=model_dir, **opts)
            assert validate(out).ok, validate(out).summary()
            outs.append((_files(out), result.counts, result.dropped))
        assert outs[0] == outs[1] == outs[2], opts
        assert sum(c["records"] for c in outs[0][1].values()) > 0


def test_t_done_order_is_a_stable_sort_of_the_files(tmp_path):
    _stored_run(tmp_path)
    frame, _ = read_records(tmp_path)
    want = frame.sort("t_done", maintain_order=True).select("dataset", "prompt_id")
    got = pl.concat(list(record_batches(tmp_path, order="t_done", batch_size=4, columns=["dataset", "prompt_id"])))  # fmt: skip
    assert got.equals(want)


def test_a_record_whose_prompt_is_gone_is_reported_not_guessed(tmp_path):
    _stored_run(tmp_path)
    prompts = pl.read_parquet(tmp_path / "prompts.parquet")
    prompts.filter(pl.col("prompt_id") != "chat03").write_parquet(tmp_path / "prompts.parquet")
    corrupt: list = []
    rows = pl.concat(list(record_batches(tmp_path, corrupt=corrupt)))
    assert "chat03" not in rows["prompt_id"].to_list() and rows.height == 35
    assert [c["problem"] for c in corrupt] == ["prompt_id not in prompts.parquet"]
    assert corrupt[0]["file"] == "records/chat.jsonl"
    counts = pl.concat(list(record_batches(tmp_path, columns=["dataset", "prompt_id"])))
    assert counts.height == 36  # columns without the prompt do not need it


def test_export_reads_what_was_there_when_it_began(tmp_path, monkeypatch):
    """A run still being written: lines appended between the two passes are not exported
    (they would be half of the options' decisions), and nothing is torn."""
    _stored_run(tmp_path / "run")
    real = export_mod._write_frames  # the pass-2 path without token rows

    def late_lines(run_dir, *args, **kw):
        store = RunStore(run_dir)
        store.init(_config())
        extra = _records(_prompts())[0]
        store.append(dataclasses.replace(extra, prompt_id="chat00", sample=1, t_done=T0))
        store.close()
        return real(run_dir, *args, **kw)

    monkeypatch.setattr(export_mod, "_write_frames", late_lines)
    result = export(tmp_path / "run", tmp_path / "out", formats=("specforge",))
    assert sum(c["records"] for c in result.counts.values()) == 36 - result.dropped["errors"]
    assert validate(tmp_path / "out").ok
    assert read_records(tmp_path / "run")[0].height == 37  # the late line is there for next time


def test_export_reports_a_record_whose_prompt_is_gone(tmp_path):
    """The writing pass takes prompts from the store a batch at a time: a record whose
    prompt is missing is left out and named (file, line) in the manifest, never guessed."""
    _stored_run(tmp_path / "run")
    path = tmp_path / "run" / "prompts.parquet"
    pl.read_parquet(path).filter(pl.col("prompt_id") != "chat03").write_parquet(path)
    result = export(tmp_path / "run", tmp_path / "out", formats=("specforge",), drop_errors=False)
    lines = (tmp_path / "out/specforge/train.jsonl").read_text().splitlines()
    assert len(lines) == 35 and not any('"chat-chat03-0"' in x for x in lines)
    listed = result.manifest["corrupt_lines"]
    assert result.corrupt == 1 and listed["lines"][0]["file"] == "records/chat.jsonl"
    assert listed["lines"][0]["problem"] == "prompt_id not in prompts.parquet"
    chat = (tmp_path / "run/records/chat.jsonl").read_text().splitlines()
    assert '"prompt_id":"chat03"' in chat[listed["lines"][0]["line"] - 1]


def test_a_file_cut_between_the_passes_loses_only_its_cut_lines(tmp_path, monkeypatch):
    """The writing pass reads each kept line again by its byte range: lines no longer there
    (a records file cut short after the first pass) are reported, the rest written whole."""
    _stored_run(tmp_path / "run")
    path = tmp_path / "run/records/chat.jsonl"
    real = export_mod._write_frames

    def cut(run_dir, *args, **kw):
        data = path.read_bytes()
        path.write_bytes(data[: data.rfind(b"\n", 0, len(data) - 1) + 1])  # its last line
        return real(run_dir, *args, **kw)

    monkeypatch.setattr(export_mod, "_write_frames", cut)
    n = len(path.read_bytes().splitlines())
    result = export(tmp_path / "run", tmp_path / "out", formats=("specforge",), drop_errors=False)
    assert sum(c["records"] for c in result.counts.values()) == 35 and result.corrupt == 1
    assert result.manifest["corrupt_lines"]["lines"] == [
        {
            "file": "records/chat.jsonl",
            "line": n,
            "problem": "the line is gone (the file is shorter than when the export began)",
        }  # fmt: skip
    ]
    assert validate(tmp_path / "out").ok


def test_pass_one_from_the_index_finds_what_reading_every_line_finds(tmp_path, monkeypatch):
    """A SpecForge export after a clean close takes its first pass from the resume index
    (no line read); a line whose head is whole but whose rest is not a record (a
    non-string completion or reasoning, a count that is text, a lone surrogate: each read
    otherwise by polars alone than by orjson) is then found by the writing pass, which
    parses strictly. Files, counts and the lines reported equal the export that reads
    every line in its first pass."""
    from kit.report import selection
    from kit.run import index

    _stored_run(tmp_path / "run")
    path = tmp_path / "run/records/chat.jsonl"
    good = orjson.loads(path.read_bytes().splitlines()[0])
    good["t_done"] = T0 + 10_000  # after every other line: the file stays in t_done order
    bad = [good | {"prompt_id": "chat00", "sample": 7, "completion": 5},
           good | {"prompt_id": "chat01", "sample": 7, "reasoning": 1.5},
           good | {"prompt_id": "chat03", "sample": 7, "prompt_tokens": "12"}]  # fmt: skip
    lines = [orjson.dumps(b) for b in bad]
    lines.append(orjson.dumps(good | {"prompt_id": "chat02", "sample": 7}).replace(b'"completion":"', b'"completion":"\\ud800'))  # fmt: skip
    with open(path, "ab") as f:
        f.write(b"".join(x + b"\n" for x in lines))
    store = RunStore(tmp_path / "run")
    store.init(_config())
    store.scan()
    store.close()  # the index now covers the planted lines too
    got = index.load(path)
    assert got is not None and got.fast and got.size == path.stat().st_size
    taken = []
    real = selection._from_index
    monkeypatch.setattr(selection, "_from_index", lambda *a: taken.append(real(*a)) or taken[-1])
    a = export(tmp_path / "run", tmp_path / "a", formats=("specforge",), drop_errors=False)
    assert taken and taken[0] is not None  # the index did pass 1
    monkeypatch.setattr(selection, "_from_index", lambda *a: None)
    b = export(tmp_path / "run", tmp_path / "b", formats=("specforge",), drop_errors=False)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    assert a.counts == b.counts and a.corrupt == b.corrupt == 4
    problems = sorted((c["line"], c["problem"][:10]) for c in a.manifest["corrupt_lines"]["lines"])
    assert problems == sorted((c["line"], c["problem"][:10]) for c in b.manifest["corrupt_lines"]["lines"])  # fmt: skip
    assert validate(tmp_path / "a").ok


@pytest.mark.parametrize("batch_size", [1, 5, 100])
def test_batches_are_bounded_and_complete(tmp_path, batch_size):
    _stored_run(tmp_path)
    sizes = [f.height for f in record_batches(tmp_path, batch_size=batch_size)]
    assert max(sizes) <= batch_size and sum(sizes) == 36


def test_a_forced_resume_over_other_prompts_keeps_the_earlier_ones(tmp_path):
    """Lines name their prompt and hold no copy: a start with another prompt frame (force)
    must not drop the prompts earlier records refer to."""
    records = _stored_run(tmp_path)
    store = RunStore(tmp_path)
    store.init(_config(), _prompts().filter(pl.col("dataset") == "chat"), force=True)
    store.close()
    frame, corrupt = read_records(tmp_path)
    assert not corrupt and frame.height == len(records)
    assert pl.read_parquet(tmp_path / "prompts.parquet").height == 36


def test_a_key_written_twice_is_exported_once_and_its_first_copy(tmp_path):
    records = _stored_run(tmp_path)
    first = records[3]
    store = RunStore(tmp_path)
    store.init(_config())
    store.append(dataclasses.replace(first, completion="a later copy", t_done=T0 + 500))
    store.close()
    result = export(tmp_path, tmp_path / "out", formats=("specforge",), drop_errors=False)
    rows = [json.loads(x) for x in (tmp_path / "out/specforge/train.jsonl").read_text().splitlines()]  # fmt: skip
    assert len(rows) == 36 and sum(c["records"] for c in result.counts.values()) == 36
    mine = [r for r in rows if r["id"] == f"{first.dataset}-{first.prompt_id}-0"]
    assert mine[0]["conversations"][-1]["content"] == first.completion


@pytest.mark.parametrize("in_memory", [True, False])
def test_prompt_lookups_survive_hash_collisions(tmp_path, monkeypatch, in_memory):
    """Every key hashed alike: each lookup still reads back its own prompt (entries hold
    their key), and a key prompts.parquet holds twice gives its first copy; with the
    entries in memory and in the temporary file."""
    from kit.run import prompts as store_mod

    if not in_memory:
        monkeypatch.setattr(store_mod, "IN_MEMORY_BYTES", 0)

    _stored_run(tmp_path)
    prompts = pl.read_parquet(tmp_path / "prompts.parquet")
    twice = prompts.head(1).with_columns(
        messages=pl.lit(
            [{"role": "user", "content": "second copy"}], dtype=prompts.schema["messages"]
        )  # fmt: skip
    )
    pl.concat([prompts, twice]).write_parquet(tmp_path / "prompts.parquet")
    alike = lambda frame: np.full(frame.height, 7, dtype=np.uint64)  # noqa: E731
    monkeypatch.setattr(store_mod, "_hashes", alike)
    with store_mod.PromptStore(tmp_path) as store:
        assert (store._fd is None) == in_memory
        for row in prompts.to_dicts():
            messages, _ = store.get(row["dataset"], row["prompt_id"])
            assert messages == row["messages"]
        assert store.get("chat", "no such prompt") is None
        keys = prompts.select("dataset", "prompt_id").reverse()
        got = store.frame(keys, fragments=True)  # a whole batch, as export reads it
        assert got["found"].all()
        frags = got["_frag"].to_list()
        for row, frag in zip(prompts.reverse().to_dicts(), frags, strict=True):
            assert json.loads("[" + frag + "]") == row["messages"]


def test_export_without_token_rows_writes_what_the_row_by_row_path_writes(tmp_path, monkeypatch, model_dir):  # fmt: skip
    """Without token_ids the writing pass reads polars frames and renders the SpecForge lines
    in polars (kit.report.convo.specforge_lines); with token_ids it goes row by row through
    json.dumps. Both write the same bytes, in any batch size, for short and old lines
    (reasoning, tools, all_turns answers, copies, every option)."""
    records = _stored_run(tmp_path / "short")
    _planted_run(tmp_path / "old", records)
    for k, opts in enumerate(OPTIONS):
        for run in ("short", "old"):
            outs = []
            for formats, batch in [(("specforge", "token_ids"), 10_000), (("specforge",), 10_000), (("specforge", "parquet"), 3)]:  # fmt: skip
                monkeypatch.setattr(export_mod, "BATCH", batch)
                out = tmp_path / f"out{k}-{run}-{len(formats)}-{batch}"
                result = export(tmp_path / run, out, formats=formats, tokenizer=model_dir, **opts)
                assert validate(out).ok and not result.dropped.get("template_mismatch")
                sf = {n: b for n, b in _files(out).items() if "specforge" in n}
                outs.append((sf, result.counts, {w: n for w, n in result.dropped.items() if w != "template_mismatch"}))  # fmt: skip
            assert outs[0] == outs[1] == outs[2], (opts, run)
            assert sum(c["records"] for c in outs[0][1].values()) > 0


def test_the_prompt_store_in_a_file_or_in_memory_gives_the_same_export(tmp_path, monkeypatch):  # fmt: skip
    """Small prompt sets stay in memory, large ones go to a temporary file: the same files."""
    from kit.run import prompts as store_mod

    _stored_run(tmp_path / "run")
    outs = []
    for limit in (store_mod.IN_MEMORY_BYTES, 0):
        monkeypatch.setattr(store_mod, "IN_MEMORY_BYTES", limit)
        monkeypatch.setattr(export_mod, "BATCH", 7)
        out = tmp_path / f"out{limit}"
        export(tmp_path / "run", out, formats=("specforge", "parquet"), val_fraction=0.2)
        outs.append(_files(out))
    assert outs[0] == outs[1] and len(outs[0]) > 3


def test_specforge_lines_are_json_dumps_byte_for_byte():
    """The polars rendering against json.dumps(row, ensure_ascii=False) on the strings that
    tell escapers apart: every control character, quotes, backslashes, slashes, U+2028,
    non-BMP characters, empty texts, no prompt messages, reasoning or none, tools."""
    from kit.report.convo import conversation, rendered, row_id, specforge_lines

    odd = "".join(chr(c) for c in range(0x20)) + '"\\/\x7f\u2028\u00e9\U0001f600 \\n'
    rows = [
        {"dataset": "d", "prompt_id": "p0", "sample": 0, "completion": odd, "reasoning": odd,
         "messages": [{"role": "system", "content": odd}, {"role": "user", "content": ""}]},
        {"dataset": "d/é", "prompt_id": 'p"1', "sample": 3, "completion": "", "reasoning": "",
         "messages": []},
        {"dataset": "d", "prompt_id": "p2", "sample": 1, "completion": "ok", "reasoning": None,
         "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": odd}]},
    ]  # fmt: skip
    tools = [json.dumps(TOOLS, ensure_ascii=False), None, json.dumps([{"x": 1.5e-05, "é": odd}], ensure_ascii=False)]  # fmt: skip
    frame = pl.DataFrame(rows)
    want = []
    for r, t in zip(rows, tools, strict=True):
        row = {"id": row_id(r), "conversations": conversation(r["messages"], r["completion"], r["reasoning"])}  # fmt: skip
        if t:
            row["tools"] = json.loads(t)
        want.append(json.dumps(row, ensure_ascii=False) + "\n")
    data, offsets = rendered(specforge_lines(frame, pl.Series(tools, dtype=pl.String)))
    assert data == "".join(want).encode()
    assert offsets == [0, *itertools.accumulate(len(w.encode()) for w in want)]


def test_the_prompt_store_without_a_tools_column_and_with_empty_tools(tmp_path):
    """prompts.parquet of a run without tools has no tools column; "[]" is no tools."""
    from kit.run.prompts import PromptStore

    msg = [{"role": "user", "content": "q"}]
    pl.DataFrame({"dataset": ["a", "a"], "prompt_id": ["1", "2"], "messages": [msg, msg]}).write_parquet(tmp_path / "prompts.parquet")  # fmt: skip
    with PromptStore(tmp_path) as store:
        assert store.get("a", "2") == (msg, None) and store.get("b", "1") is None
    tools = ["[]", json.dumps(TOOLS)]
    pl.DataFrame({"dataset": ["a", "a"], "prompt_id": ["1", "2"], "messages": [msg, msg], "tools": tools}).write_parquet(tmp_path / "prompts.parquet")  # fmt: skip
    with PromptStore(tmp_path) as store:
        assert store.lookup([("a", "1"), ("a", "2"), ("a", "3")]) == [
            (msg, None),
            (msg, TOOLS),
            None,
        ]
