"""kit.export on planted runs and on a real embedded-server run; kit.validate on the exports.

Also: an old-layout run exports byte for byte as the old code did, the export is the same in
any batch size and with or without token rows, and an edited prompt stops it."""

from __future__ import annotations

import dataclasses
import itertools
import json
import sqlite3
from pathlib import Path

import polars as pl
import pytest
from test_audit import ANSWERS, make_record, pid, plant_run

import kit
from kit.report import export as export_mod
from kit.report.export import ExportOptions, export
from kit.report.validate import sha256_file, validate
from kit.run.reader import PromptMismatch, read_config, records_frame
from kit.run.store import RunStore
from kit.types import Record, RunConfig, Sampling

SECRET = "sk-kit-test-secret-7f3a9c"


@pytest.fixture(scope="module")
def tok(model_dir):
    return kit.tokens.load_tokenizer(model_dir)


def read_jsonl(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def set_config(run, **changes):
    """Rewrite a planted run's stored config (RunConfig.to_dict() in the run database) with
    fields changed, as they are given, and its fingerprint to match."""
    conn = sqlite3.connect(run / "run.sqlite")
    doc = json.loads(conn.execute("SELECT doc FROM config").fetchone()[0]) | changes
    with conn:
        conn.execute(
            "UPDATE config SET fingerprint = ?, doc = ?",
            (RunConfig.from_dict(doc).fingerprint(), json.dumps(doc)),
        )
    conn.close()
    return run


def varied_records(tok):
    """Two datasets: a system prompt, a multi-turn prompt, a truncation, server prompt_ids."""
    recs = [make_record(tok, "chat", i, f"Tell me fact {i}.", ANSWERS[i]) for i in range(6)]
    recs[0].messages = [{"role": "system", "content": "Be brief."}, *recs[0].messages]
    recs[1].messages = [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "Tell me fact 1."},
    ]
    recs[2].finish_reason = "length"  # truncated: the model never closed its turn
    recs[2].output_ids = recs[2].output_ids[:-1]
    recs[2].completion_tokens -= 1
    rendered = tok.apply_chat_template(recs[3].messages, tokenize=False, add_generation_prompt=True)
    recs[3].prompt_ids = tok.encode(rendered, add_special_tokens=False)  # as a server returns them
    recs[4].output_ids = None  # counted by usage: the completion is tokenized
    recs[4].count_source = "usage"
    recs += [
        make_record(tok, "code", 10 + i, f"Write code {i}.", f"print({i} * 'héllo 日本')")
        for i in range(4)
    ]
    return recs


@pytest.fixture
def planted(tmp_path, tok, model_dir):
    recs = varied_records(tok)
    return plant_run(
        tmp_path / "run", recs, budgets={"chat": 60, "code": 1000}, tokenizer=str(model_dir)
    )


def check_token_row(tok, row, conv, finish):
    """decode(input_ids) == the chat template's rendering (an exact row from the server's ids
    ends where the model stopped: no template text after it); the mask covers the completion
    only."""
    full = tok.apply_chat_template(conv, tokenize=False)
    prompt = tok.apply_chat_template(conv[:-1], tokenize=False, add_generation_prompt=True)
    if row["ids_source"] == "server":
        full = prompt + conv[-1]["content"] + (tok.eos_token if finish == "stop" else "")
    ids, mask = row["input_ids"], row["loss_mask"]
    assert len(ids) == len(mask) and all(type(i) is int for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == full
    on = [i for i, m in enumerate(mask) if m]
    start, end = (on[0], on[-1] + 1) if on else (len(ids), len(ids))
    assert on == list(range(start, end)), "loss_mask is one contiguous span"
    closer = tok.eos_token if finish == "stop" else ""
    assert tok.decode(ids[start:end], skip_special_tokens=False) == conv[-1]["content"] + closer
    assert tok.decode(ids[:start], skip_special_tokens=False) == prompt


@pytest.mark.server
def test_specforge_format_field_by_field(planted, tmp_path):
    out = tmp_path / "out"
    result = export(planted, out, formats=("specforge",), keep_truncated_conversations=True)
    rows = read_jsonl(out / "specforge/train.jsonl")
    records = records_frame(planted).sort("t_done").to_dicts()
    assert len(rows) == len(records) == 10
    for row, rec in zip(rows, records, strict=True):
        assert set(row) == {"id", "conversations"}
        assert row["id"] == f"{rec['dataset']}-{rec['prompt_id']}-{rec['sample']}"
        assert row["conversations"][:-1] == rec["messages"]
        assert row["conversations"][-1] == {"role": "assistant", "content": rec["completion"]}
        assert all(set(m) == {"role", "content"} for m in row["conversations"])
    assert rows[0]["conversations"][0] == {"role": "system", "content": "Be brief."}
    assert [m["role"] for m in rows[1]["conversations"]] == [
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert list(result.files) == ["specforge/train.jsonl", "linehashes/specforge/train.jsonl.txt"]


@pytest.mark.server
def test_token_rows_on_planted_records(planted, tmp_path, tok):
    out = tmp_path / "out"
    result = export(
        planted,
        out,
        formats=("token_ids", "specforge", "parquet"),
        keep_truncated_conversations=True,
    )
    rows = read_jsonl(out / "token_ids/train.jsonl")
    convs = read_jsonl(out / "specforge/train.jsonl")
    finish = records_frame(planted).sort("t_done")["finish_reason"].to_list()
    assert len(rows) == 10
    for row, conv, fin in zip(rows, convs, finish, strict=True):
        assert row["id"] == conv["id"]
        check_token_row(tok, row, conv["conversations"], fin)
    # the server's own ids were used where they decode to the stored text
    assert result.manifest["token_id_sources"] == {
        "output_ids": 9,
        "completion_retokenized": 1,
        "prompt_ids": 1,
        "prompt_tokenized": 9,
    }
    assert rows[2]["loss_mask"][-2:] == [
        0,
        0,
    ]  # truncated: the template's <|im_end|> is not trained
    assert rows[0]["loss_mask"][-2:] == [1, 0]  # stop: <|im_end|> was generated, "\n" was not
    table = pl.read_parquet(out / "parquet/train.parquet")
    assert table["id"].to_list() == [r["id"] for r in rows]
    assert table["input_ids"].to_list() == [r["input_ids"] for r in rows]
    assert validate(out).ok


@pytest.mark.server
def test_ids_that_do_not_match_text_are_retokenized(tmp_path, tok, model_dir):
    rec = make_record(tok, "d", 0, "Name a color.", "Blue is a color.")
    rec.output_ids = tok.encode("Red is a color.", add_special_tokens=False)
    run = plant_run(tmp_path / "run", [rec], budgets={"d": 100}, tokenizer=str(model_dir))
    result = export(run, tmp_path / "out", formats=("token_ids", "specforge"))
    row = read_jsonl(tmp_path / "out/token_ids/train.jsonl")[0]
    check_token_row(
        tok, row, read_jsonl(tmp_path / "out/specforge/train.jsonl")[0]["conversations"], "stop"
    )
    assert result.manifest["token_id_sources"]["completion_retokenized"] == 1


@pytest.mark.server
def test_trim_to_budget_is_exact(planted, tmp_path):
    result = export(
        planted,
        tmp_path / "out",
        formats=("specforge",),
        trim_to_budget=True,
        keep_truncated_conversations=True,
    )
    recs = records_frame(planted).filter(pl.col("dataset") == "chat").sort("t_done")
    tokens = recs["completion_tokens"].to_list()
    kept = result.counts["chat"]["records"]
    assert 0 < kept < len(tokens)
    assert sum(tokens[:kept]) == result.counts["chat"]["tokens"] <= 60 < sum(tokens[: kept + 1])
    ids = [
        r["id"]
        for r in read_jsonl(tmp_path / "out/specforge/train.jsonl")
        if r["id"].startswith("chat")
    ]
    assert ids == [f"chat-{p}-0" for p in recs["prompt_id"].to_list()[:kept]]  # the earliest stay
    assert result.counts["code"]["records"] == 4
    assert result.dropped["past_budget"] == len(tokens) - kept


def split_ids(out):
    return {
        s: [r["id"] for r in read_jsonl(out / f"specforge/{s}.jsonl")]
        for s in ("train", "validation")
    }


def test_split_is_seeded_and_disjoint(tmp_path):
    recs = [
        make_record(None, ds, i, f"{ds} prompt {i}", f"answer {ds} {chr(97 + i % 26)}", ids=False)
        for ds in ("a", "b")
        for i in range(20)
    ]
    recs += [make_record(None, "a", 40, "a prompt 3", "second sample", ids=False, sample=1)]
    run = plant_run(tmp_path / "run", recs, budgets={"a": 10**6, "b": 10**6})
    kw = dict(formats=("specforge",), val_fraction=0.25)
    first = split_ids(export(run, tmp_path / "s0", seed=0, **kw).out_dir)
    again = split_ids(export(run, tmp_path / "s0b", seed=0, **kw).out_dir)
    other = split_ids(export(run, tmp_path / "s1", seed=1, **kw).out_dir)
    assert first == again and first != other
    train, val = set(first["train"]), set(first["validation"])
    assert not train & val and len(train | val) == len(recs)
    assert sum(i.startswith("b-") for i in val) == 5  # round(0.25 * 20 prompts)
    prompt_of = {r.prompt_id: r.messages[0]["content"] for r in recs}
    val_prompts = {prompt_of[i.split("-")[1]] for i in val}
    train_prompts = {prompt_of[i.split("-")[1]] for i in train}
    assert not val_prompts & train_prompts  # both samples of "a prompt 3" sit in one split


def test_mix_by_token_share(tmp_path):
    recs = [
        make_record(
            None,
            "a",
            i,
            f"a{i}",
            " ".join(["x"] * 10) + f" {chr(97 + i)}",
            ids=False,
            completion_tokens=10,
        )
        for i in range(20)
    ]
    recs += [
        make_record(None, "b", 50 + i, f"b{i}", f"y {chr(97 + i)}", ids=False, completion_tokens=10)
        for i in range(5)
    ]
    recs += [make_record(None, "c", 90, "c0", "z", ids=False, completion_tokens=10)]
    run = plant_run(tmp_path / "run", recs, budgets={"a": 1000, "b": 1000, "c": 1000})
    result = export(run, tmp_path / "out", formats=("specforge",), mix={"a": 3, "b": 1})
    assert result.counts["b"]["tokens"] == 50  # b is the scarce one: all of it
    assert result.counts["a"]["tokens"] == 150  # 3:1
    assert "c" not in result.counts and result.dropped["mix"] == 20 - 15 + 1
    with pytest.raises(ValueError, match="nope"):
        export(run, tmp_path / "out2", formats=("specforge",), mix={"nope": 1})


def test_drop_options(tmp_path):
    recs = [make_record(None, "d", i, f"q{i}", ANSWERS[i], ids=False) for i in range(4)]
    recs[1].finish_reason = "length"
    recs[2].completion = ANSWERS[0].upper()  # near duplicate of record 0
    recs[3].finish_reason = "abort"
    run = plant_run(tmp_path / "run", recs, budgets={"d": 1000})
    kept = export(run, tmp_path / "a", formats=("specforge",))
    assert kept.counts["d"]["records"] == 3 and kept.dropped == {"errors": 1}
    opts = dict(
        formats=("specforge",), drop_truncated=True, drop_duplicates=True, drop_errors=False
    )
    result = export(run, tmp_path / "b", **opts)
    assert result.dropped == {"truncated": 1, "duplicates": 1}
    assert [r["id"] for r in read_jsonl(tmp_path / "b/specforge/train.jsonl")] == [
        f"d-{pid('q0')}-0",
        f"d-{pid('q3')}-0",
    ]


def test_options_validate(tmp_path):
    with pytest.raises(ValueError, match="formats.*csv"):
        ExportOptions(formats=("csv",))
    with pytest.raises(ValueError, match="val_fraction.*1.5"):
        ExportOptions(val_fraction=1.5)
    with pytest.raises(ValueError, match=r"mix\['a'\].*-1"):
        ExportOptions(mix={"a": -1})
    run = plant_run(
        tmp_path / "run", [make_record(None, "d", 0, "q", "a", ids=False)], budgets={"d": 9}
    )
    with pytest.raises(ValueError, match="token_ids.*tokenizer"):
        export(run, tmp_path / "out")
    export(run, tmp_path / "out", formats=("specforge",))
    with pytest.raises(FileExistsError, match="overwrite"):
        export(run, tmp_path / "out", formats=("specforge",))


@pytest.mark.server
def test_manifest_contents_and_no_secret(tmp_path, tok, model_dir, monkeypatch):
    monkeypatch.setenv("KIT_TEST_KEY", SECRET)
    recs = varied_records(tok)
    run = plant_run(
        tmp_path / "run",
        recs,
        budgets={"chat": 60, "code": 1000},
        tokenizer=str(model_dir),
        api_key_env="KIT_TEST_KEY",
    )
    set_config(run, endpoints=[f"http://user:{SECRET}@127.0.0.1:8000/v1?key={SECRET}"])
    fingerprint = read_config(run).fingerprint()
    out = tmp_path / "out"
    export(run, out, formats=("specforge", "token_ids", "parquet"), val_fraction=0.3, seed=3)
    m = json.loads((out / "manifest.json").read_text())
    assert m["model"] == "smollm2-135m" and m["run_fingerprint"] == fingerprint
    assert m["servers"] == {"api": "openai", "endpoints": ["http://127.0.0.1:8000/v1"]}
    assert m["sampling"] == {"max_tokens": 64, "temperature": 0.0, "top_p": 1.0, "seed": 1, "n": 1}
    assert m["tokenizer"]["chat_template_hash"] == kit.tokens.chat_template_hash(tok)
    assert m["tokenizer"]["end_of_turn"]["token"] == "<|im_end|>"
    assert m["budgets"] == {"chat": 60, "code": 1000} and m["kit_version"] == kit.__version__
    assert m["options"]["val_fraction"] == 0.3 and m["options"]["seed"] == 3
    chat = [r for r in recs if r.dataset == "chat"]
    assert m["counts"]["chat"]["records"] == 6
    assert m["counts"]["chat"]["tokens"] == sum(r.completion_tokens for r in chat)
    assert m["counts"]["chat"]["train"] + m["counts"]["chat"]["validation"] == 6
    for rel, entry in m["files"].items():
        data = (out / rel).read_bytes()
        assert entry["sha256"] == sha256_file(out / rel) and entry["bytes"] == len(data)
    for path in out.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
            assert b"KIT_TEST_KEY" not in path.read_bytes(), path


@pytest.mark.server
def test_validate_catches_corruption(planted, tmp_path):
    out = tmp_path / "out"
    export(planted, out, formats=("specforge", "token_ids", "parquet"))
    assert validate(out).ok
    sf = out / "specforge/train.jsonl"
    lines = sf.read_text().splitlines(keepends=True)
    lines[2] = lines[2].replace("Tell me", "Tell us")  # still valid JSON, still the right fields
    sf.write_text("".join(lines))
    result = validate(out)
    assert not result.ok and "specforge/train.jsonl line 3: edited after export" in result.summary()
    tk = out / "token_ids/train.jsonl"
    lines = tk.read_text().splitlines(keepends=True)
    row = json.loads(lines[4])
    row["loss_mask"] = row["loss_mask"][:-1]
    lines[4] = json.dumps(row) + "\n"
    lines[6] = "{not json\n"
    tk.write_text("".join(lines))
    text = validate(out).summary()
    assert "token_ids/train.jsonl line 5: loss_mask length" in text
    assert "token_ids/train.jsonl line 7: not valid JSON" in text
    (out / "parquet/train.parquet").unlink()
    assert "parquet/train.parquet: missing" in validate(out).summary()
    (out / "manifest.json").unlink()
    assert "manifest.json: missing" in validate(out).summary()


@pytest.mark.server
def test_real_server_run_token_rows(embedded_server, model_dir, tok, tmp_path):
    """Real completions from the embedded server: every token row decodes and masks exactly."""
    questions = ["What is 2 + 2?", "Name a primary color."]
    prompts = pl.DataFrame(
        [
            {
                "dataset": ds,
                "prompt_id": pid(ds + q),
                "messages": [{"role": "user", "content": q}],
                "n_turns": 1,
                "row": i,
            }
            for ds in ("qa", "chat")
            for i, q in enumerate(questions)
        ]
    )
    config = kit.RunConfig(
        model=embedded_server.model,
        endpoints=embedded_server.base_url,
        budgets={"qa": 10_000, "chat": 10_000},
        sampling=kit.Sampling(max_tokens=32, temperature=0.0),
        tokenizer=str(model_dir),
        concurrency=4,
        timeout=600,  # generous: a loaded 2-core CI box answers slowly
    )
    run = kit.generate_sync(prompts, config, run_dir=tmp_path / "run")
    out = tmp_path / "out"
    result = export(run.run_dir, out, val_fraction=0.5, keep_truncated_conversations=True)
    assert sum(c["records"] for c in result.counts.values()) == 4, kit.audit(run.run_dir).summary()
    finish = dict(
        records_frame(run.run_dir)
        .select(pl.format("{}-{}-{}", "dataset", "prompt_id", "sample"), "finish_reason")
        .iter_rows()
    )
    n = 0
    for split in ("train", "validation"):
        rows = read_jsonl(out / f"token_ids/{split}.jsonl")
        convs = read_jsonl(out / f"specforge/{split}.jsonl")
        for row, conv in zip(rows, convs, strict=True):
            check_token_row(tok, row, conv["conversations"], finish[row["id"]])
            n += 1
    assert n == 4
    assert validate(out).ok
    report = kit.audit(run.run_dir, tokenizer=tok)
    assert report.datasets["records"].sum() == 4 and report.datasets["ids_len_mismatch"].sum() == 0
    assert not set(report.findings["check"]) & {"over_budget", "ids_text_mismatch", "error_rate"}


def test_hf_format_or_a_clear_error(tmp_path):
    import importlib.util

    recs = [make_record(None, "d", i, f"q{i}", ANSWERS[i], ids=False) for i in range(3)]
    run = plant_run(tmp_path / "run", recs, budgets={"d": 1000})
    if importlib.util.find_spec("datasets") is None:
        with pytest.raises(ValueError, match="'hf' needs the `datasets` package"):
            export(run, tmp_path / "out", formats=("specforge", "hf"))
        assert not (tmp_path / "out").exists()  # refused before writing anything
        return
    import datasets

    export(run, tmp_path / "out", formats=("specforge", "hf"))
    table = datasets.load_from_disk(str(tmp_path / "out/hf/train"))
    assert table["id"] == [r["id"] for r in read_jsonl(tmp_path / "out/specforge/train.jsonl")]
    assert validate(tmp_path / "out").ok


def test_jsonl_files_go_to_disk_as_written(tmp_path, monkeypatch):
    """WriteBehind: a JSONL file is synced and dropped from the page cache a piece at a time,
    in order, every byte once, and its bytes are those of an export written in one piece."""
    import itertools
    import os

    from kit.report import writers

    recs = [
        make_record(None, "d", i, f"q{i} " * 20, ANSWERS[i % len(ANSWERS)] * 5, ids=False)
        for i in range(60)
    ]
    run = plant_run(tmp_path / "run", recs, budgets={"d": 10**6})
    whole = export(run, tmp_path / "whole", formats=("specforge",))
    calls = []
    real_sync, real_advise = os.fdatasync, os.posix_fadvise
    monkeypatch.setattr(writers, "SYNC_EVERY", 512)
    monkeypatch.setattr("kit.report.export.BATCH", 4)  # many writes: a few rows each
    monkeypatch.setattr(
        writers.os, "fdatasync", lambda fd: (calls.append(("sync", fd)), real_sync(fd))[1]
    )
    monkeypatch.setattr(
        writers.os,
        "posix_fadvise",
        lambda fd, at, n, how: (
            calls.append(("drop", fd, at, n, how)),
            real_advise(fd, at, n, how),
        )[1],
    )
    pieces = export(run, tmp_path / "pieces", formats=("specforge",))
    path = "specforge/train.jsonl"
    assert (tmp_path / "pieces" / path).read_bytes() == (tmp_path / "whole" / path).read_bytes()
    assert pieces.files[path] == whole.files[path] and validate(tmp_path / "pieces").ok
    drops = [c for c in calls if c[0] == "drop"]
    fd = drops[0][1]  # the train file's: the first written
    ranges = [(at, n) for _, d, at, n, how in drops if d == fd and how == os.POSIX_FADV_DONTNEED]
    size = (tmp_path / "pieces" / path).stat().st_size
    assert len(ranges) > 2 and size > 3 * 512  # synced while writing, not only at close
    assert ranges[0][0] == 0 and sum(n for _, n in ranges) == size
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(ranges))  # in order, no gap
    for i, c in enumerate(calls):  # each piece on disk before its pages are dropped
        if c[0] == "drop":
            assert calls[i - 1] == ("sync", c[1])


# ---------------------------------------------------------------- the run database's export

OLD = Path(__file__).parent / "fixtures" / "old_layout"


def test_an_old_layout_run_exports_byte_for_byte_as_the_old_code_did(tmp_path):
    """tests/fixtures/old_layout: a run of the JSONL layout (run.sql: as imported into the run
    database) and its SpecForge export by the code before the run database."""
    (tmp_path / "run").mkdir()
    conn = sqlite3.connect(tmp_path / "run" / "run.sqlite")
    conn.executescript((OLD / "run.sql").read_text())
    conn.close()
    result = export(
        tmp_path / "run",
        tmp_path / "out",
        formats=("specforge",),
        keep_truncated_conversations=True,
    )
    old = json.loads((OLD / "export/manifest.json").read_text())
    for rel in ("specforge/train.jsonl", "linehashes/specforge/train.jsonl.txt"):
        assert (tmp_path / "out" / rel).read_bytes() == (OLD / "export" / rel).read_bytes(), rel
        assert result.files[rel] == old["files"][rel]["sha256"]
    for key in ("counts", "dropped", "turns", "run_fingerprint", "specforge"):
        assert result.manifest[key] == old[key], key
    assert (tmp_path / "run/run.sqlite").exists() and validate(tmp_path / "out").ok


def _swap_prompts(run, a: str, b: str) -> None:
    """Swap two stored prompts' text in the run database, as a hand edit would."""
    conn = sqlite3.connect(run / "run.sqlite")
    text = dict(
        conn.execute("SELECT prompt_id, messages FROM prompts WHERE prompt_id IN (?, ?)", (a, b))
    )
    with conn:
        for pid_, other in ((a, b), (b, a)):
            conn.execute("UPDATE prompts SET messages = ? WHERE prompt_id = ?", (text[other], pid_))
    conn.close()


def test_an_edited_prompt_stops_the_export_and_names_it(tmp_path, capsys):
    from kit import cli

    recs = [make_record(None, "d", i, f"question {i}", ANSWERS[i], ids=False) for i in range(4)]
    run = plant_run(tmp_path / "run", recs, budgets={"d": 1000})
    export(run, tmp_path / "before", formats=("specforge",))
    a, b = recs[1].prompt_id, recs[2].prompt_id
    _swap_prompts(run, a, b)
    out = tmp_path / "out"
    with pytest.raises(PromptMismatch, match=f"prompt \\('d', '{a}'\\)"):
        export(run, out, formats=("specforge", "parquet"))
    assert not [p for p in out.rglob("*") if p.is_file()]  # nothing half written, no manifest
    code = cli.main(["export", str(run), str(tmp_path / "cli"), "--format", "specforge"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("kit: error:") and a in err and len(err.splitlines()) == 1
    conn = sqlite3.connect(run / "run.sqlite")
    with conn:
        conn.execute("DELETE FROM prompts WHERE prompt_id IN (?, ?)", (a, b))
    conn.close()
    with pytest.raises(PromptMismatch, match=f"record \\('d', '{a}'\\) has no stored prompt"):
        export(run, tmp_path / "out2", formats=("specforge",))


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
            rows.append(
                {
                    "dataset": ds,
                    "prompt_id": f"{ds}{i:02d}",
                    "messages": messages,
                    "tools": tools,
                    "n_turns": len(messages),
                    "row": i,
                }
            )
    return pl.DataFrame(rows)


def _config() -> RunConfig:
    return RunConfig(
        model="m",
        endpoints=["http://127.0.0.1:9/v1"],
        sampling=Sampling(max_tokens=64),
        budgets={"chat": 60, "agent": 80, "multi": 10**6},
        turns="all_turns",
    )


def _stored_run(run_dir) -> list[Record]:
    """A run through RunStore: tools, reasoning on some, duplicates, truncations, and multi's
    prompts answered by the target (all_turns: Record.turns holds its earlier answer)."""
    prompts, out = _prompts(), []
    for k, p in enumerate(prompts.to_dicts()):
        messages, turns = p["messages"], None
        if p["dataset"] == "multi":
            turns = [
                {
                    "content": f"target answer {k}",
                    "reasoning": None,
                    "finish_reason": "stop",
                    "completion_tokens": 3,
                    "count_source": "usage",
                    "output_ids": None,
                    "prompt_ids": None,
                }
            ]
            messages = [dict(m) for m in messages]
            messages[1]["content"] = f"target answer {k}"
        text = "same answer" if k % 5 == 0 else f"answer number {k} " + "word " * (k % 7)
        out.append(
            Record(
                dataset=p["dataset"],
                prompt_id=p["prompt_id"],
                sample=0,
                messages=messages,
                completion=text,
                finish_reason="length" if k % 6 == 0 else "stop",
                completion_tokens=5 + k % 9,
                count_source="usage",
                t_done=T0 + (k * 7919) % 101 + k / 1000,
                reasoning="thinking it over" if k % 4 == 0 else None,
                tools=json.loads(p["tools"]) if p["tools"] else None,
                turns=turns,
            )
        )
    out.sort(key=lambda r: r.t_done)
    store = RunStore(run_dir)
    store.init(_config(), prompts)
    for r in out:
        store.append(r)
    store.close()
    return out


def _files(out, part: str = "") -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != "manifest.json" and part in str(p.relative_to(out))
    }


@pytest.mark.parametrize(
    "opts",
    [
        dict(val_fraction=0.25),
        dict(drop_duplicates=True, drop_truncated=True, val_fraction=0.3, seed=4),
        dict(trim_to_budget=True),
        dict(mix={"chat": 1, "agent": 2}),
    ],
)
def test_the_export_is_the_same_in_any_batch_size_with_or_without_token_rows(
    tmp_path, monkeypatch, model_dir, opts
):
    """SpecForge lines (the one renderer: polars), tables and counts do not depend on the
    batch size or on which formats go along: reasoning, tools, all_turns answers, options."""
    records = _stored_run(tmp_path / "run")
    got, token_files = [], []
    for formats, batch in [
        (("specforge", "token_ids", "parquet"), 10_000),
        (("specforge", "parquet"), 10_000),
        (("specforge", "parquet"), 3),
        (("specforge", "token_ids", "parquet"), 3),
    ]:
        monkeypatch.setattr(export_mod, "BATCH", batch)
        out = tmp_path / f"out-{len(formats)}-{batch}"
        result = export(tmp_path / "run", out, formats=formats, tokenizer=model_dir, **opts)
        assert validate(out).ok and not result.dropped.pop("template_mismatch", 0)
        tables = {
            p.stem: pl.read_parquet(p).drop("input_ids", "loss_mask", "ids_source", strict=False)
            for p in (out / "parquet").glob("*.parquet")
        }
        got.append((_files(out, "specforge"), tables, result.counts, result.dropped))
        if "token_ids" in formats:  # token rows too: the same in any batch size
            token_files.append((_files(out, "token_ids"), result.manifest["token_rows"]))
    assert token_files[0] == token_files[1] and token_files[0][0]
    got.pop()
    assert got[0][0] == got[1][0] == got[2][0] and got[0][2:] == got[1][2:] == got[2][2:]
    assert got[0][1].keys() == got[1][1].keys() == got[2][1].keys()
    for s, table in got[0][1].items():
        assert table.equals(got[1][1][s]) and table.equals(got[2][1][s]) and table.height
    rows = [
        json.loads(x)
        for f, data in got[0][0].items()
        if f.startswith("specforge/")
        for x in data.splitlines()
    ]
    assert rows and len({r["id"] for r in rows}) == len(rows)
    by_id = {f"{r.dataset}-{r.prompt_id}-0": r for r in records}
    for row in rows:  # the conversation as the runner sent it, then the completion
        rec = by_id[row["id"]]
        assert row["conversations"][:-1] == rec.messages and row.get("tools") == rec.tools
        assert row["conversations"][-1]["content"] == rec.completion


def test_a_key_written_twice_is_exported_once_and_its_first_copy(tmp_path):
    records = _stored_run(tmp_path)
    first = records[3]
    store = RunStore(tmp_path)
    store.init(_config())
    store.append(dataclasses.replace(first, completion="a later copy", t_done=T0 + 500))
    store.close()
    result = export(
        tmp_path,
        tmp_path / "out",
        formats=("specforge",),
        drop_errors=False,
        keep_truncated_conversations=True,
    )
    rows = read_jsonl(tmp_path / "out/specforge/train.jsonl")
    assert len(rows) == 36 and sum(c["records"] for c in result.counts.values()) == 36
    mine = [r for r in rows if r["id"] == f"{first.dataset}-{first.prompt_id}-0"]
    assert [r["conversations"][-1]["content"] for r in mine] == [first.completion]


def test_export_writes_what_was_there_when_it_began(tmp_path, monkeypatch):
    """A run still being written: records committed between the two passes are not exported
    (they would be half of the options' decisions), and nothing else moves."""
    records = _stored_run(tmp_path / "run")
    real = export_mod._write

    def late_record(run_dir, *args, **kw):
        store = RunStore(run_dir)
        store.init(_config())
        store.append(dataclasses.replace(records[0], sample=1, t_done=T0))
        store.close()
        return real(run_dir, *args, **kw)

    monkeypatch.setattr(export_mod, "_write", late_record)
    result = export(tmp_path / "run", tmp_path / "out", formats=("specforge",))
    assert sum(c["records"] for c in result.counts.values()) == 36 - result.dropped["errors"]
    assert validate(tmp_path / "out").ok
    assert records_frame(tmp_path / "run", prompts=False).height == 37  # there for next time


def test_specforge_lines_are_json_dumps_byte_for_byte():
    """The polars rendering against json.dumps(row, ensure_ascii=False) on the strings that
    tell escapers apart: every control character, quotes, backslashes, slashes, U+2028,
    non-BMP characters, empty texts, no prompt messages, reasoning or none, tools, the
    target's tool calls or none."""
    from kit.report.convo import (
        conversation,
        rendered,
        row_id,
        specforge_lines,
        tools_json,
        with_tool_calls,
    )

    odd = "".join(chr(c) for c in range(0x20)) + '"\\/\x7f\u2028\u00e9\U0001f600 \\n'
    rows = [
        {
            "dataset": "d",
            "prompt_id": "p0",
            "sample": 0,
            "completion": odd,
            "reasoning": odd,
            "messages": [{"role": "system", "content": odd}, {"role": "user", "content": ""}],
        },
        {
            "dataset": "d/é",
            "prompt_id": 'p"1',
            "sample": 3,
            "completion": "",
            "reasoning": "",
            "messages": [],
        },
        {
            "dataset": "d",
            "prompt_id": "p2",
            "sample": 1,
            "completion": "ok",
            "reasoning": None,
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": odd}],
        },
        {
            "dataset": "d",
            "prompt_id": "p3",
            "sample": 0,
            "completion": "ok",
            "reasoning": None,
            "messages": [{"role": "user", "content": "hi"}],
        },
    ]
    stored = [
        json.dumps(TOOLS, separators=(",", ":")),
        None,
        json.dumps([{"x": 1.5e-05, "é": odd}]),
        "[]",
    ]
    call = {
        "id": "c\u2028",
        "type": "function",
        "function": {"name": "f", "arguments": json.dumps({"q": odd})},
    }
    calls = [json.dumps([call], ensure_ascii=False), None, json.dumps([call, call]), "[]"]
    frame = pl.DataFrame(rows).with_columns(
        tools_json=pl.Series(tools_json(stored), dtype=pl.String),
        tool_calls_json=pl.Series(tools_json(calls), dtype=pl.String),
    )
    want = []
    for r, t, tc in zip(rows, stored, calls, strict=True):
        conv = conversation(r["messages"], r["completion"], r["reasoning"])
        row = {"id": row_id(r), "conversations": with_tool_calls(conv, {"tool_calls": tc})}
        if t and json.loads(t):
            row["tools"] = json.loads(t)
        want.append(json.dumps(row, ensure_ascii=False) + "\n")
    data, offsets = rendered(specforge_lines(frame))
    assert data == "".join(want).encode()
    assert offsets == [0, *itertools.accumulate(len(w.encode()) for w in want)]


def test_token_lines_are_json_dumps_byte_for_byte():
    """token_lines (ids by orjson, an exact row's mask by repetition) against json.dumps(row, ensure_ascii=False) of
    each row: exact rows (`_zeros`), others with any mask, ids of every width, odd ids."""
    from kit.report.exactrows import token_lines

    rows = [
        {
            "dataset": "d/é",
            "prompt_id": 'p"0',
            "sample": 3,
            "input_ids": [0, 7, 49151, 10**9],
            "loss_mask": [0, 0, 1, 1],
            "ids_source": "server",
            "_zeros": 2,
        },
        {
            "dataset": "d",
            "prompt_id": "p1",
            "sample": 0,
            "input_ids": [5, 6, 7, 8, 9],
            "loss_mask": [0, 1, 0, 1, 1],
            "ids_source": "retokenized",
            "_zeros": None,
        },
        {
            "dataset": "d",
            "prompt_id": "p2",
            "sample": 1,
            "input_ids": [1, 2],
            "loss_mask": [0, 1],
            "ids_source": "server",
            "_zeros": 1,
        },
    ]
    frame = pl.DataFrame(
        rows, schema_overrides={"loss_mask": pl.List(pl.Int8), "_zeros": pl.UInt32}
    )
    want = [
        json.dumps(
            {
                "id": f"{r['dataset']}-{r['prompt_id']}-{r['sample']}",
                "input_ids": r["input_ids"],
                "loss_mask": r["loss_mask"],
                "ids_source": r["ids_source"],
            },
            ensure_ascii=False,
        )
        + "\n"
        for r in rows
    ]
    data, offsets = token_lines(frame)
    assert data == "".join(want).encode()
    assert offsets == [0, *itertools.accumulate(len(w.encode()) for w in want)]


def test_the_export_reads_bounded_batches_and_selects_without_text(tmp_path, monkeypatch):
    """Memory follows the batch: every frame the export reads through kit.run.reader holds
    at most a batch of records, and the selection reads no record (the key index alone,
    kit.run.reader.done_records, without drop_duplicates)."""
    from kit.run import reader

    _stored_run(tmp_path / "run")
    real, reads = reader.record_batches, []

    def spy(run_dir, **kw):
        for frame in real(run_dir, **kw):
            reads.append((kw.get("prompts", False), frame.height, set(frame.columns)))
            yield frame

    monkeypatch.setattr(reader, "record_batches", spy)
    monkeypatch.setattr(export_mod, "BATCH", 7)
    export(tmp_path / "run", tmp_path / "out", formats=("specforge", "parquet"), drop_errors=False)
    assert all(prompts for prompts, _, _ in reads)  # only the writing pass reads records
    writing = [n for prompts, n, _ in reads if prompts]
    assert max(writing) <= 7 and sum(writing) == 36


def test_drop_duplicates_keys_tool_calls_as_the_audit_does(tmp_path):
    """An answer of tool calls (empty text) is not empty: a copy of the same calls is an
    exact duplicate, other calls are not; the export drops what the audit counts."""

    def call(city: str) -> list[dict]:
        args = json.dumps({"city": city})
        return [{"id": "c", "type": "function", "function": {"name": "weather", "arguments": args}}]

    recs = [
        make_record(None, "fc", i, f"q{i}", "", ids=False, completion_tokens=9, tool_calls=c)
        for i, c in enumerate([call("Oslo"), call("Oslo"), call("Rome")])
    ]
    run = plant_run(tmp_path / "run", recs, budgets={"fc": 27})
    report = kit.audit(run)
    assert report.records["empty"].sum() == 0 and report.datasets["dup_exact"].to_list() == [1]
    result = export(run, tmp_path / "out", formats=("specforge",), drop_duplicates=True)
    assert result.dropped["duplicates"] == 1
    assert result.counts["fc"]["records"] == 2
    # answers of tool calls alone: left out of the SpecForge JSONL (SpecForge would train a
    # lone end-of-turn after the header), counted as such
    assert read_jsonl(tmp_path / "out" / "specforge" / "train.jsonl") == []
    no_text = result.manifest["trainers"]["no_text"]
    assert no_text["rows"] == {"fc": {"train": {"tool_calls": 2}, "validation": {}}}
    assert "2 rows with no answer text (tool_calls only 2) left out" in result.summary()
    assert kit.validate(tmp_path / "out").ok


def test_answers_without_text_leave_the_specforge_jsonl_and_are_counted(tmp_path):
    """Tool calls only, reasoning only, and content null with tokens counted: SpecForge's
    preprocessing would train a lone <|im_end|> after the assistant header, so the SpecForge
    JSONL leaves them out and the manifest and summary count them; Parquet keeps every row;
    validate refuses such a row in a SpecForge file."""
    from kit.report.checks import check_specforge

    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    recs = [
        make_record(None, "d", 0, "q0", ANSWERS[0], ids=False),
        make_record(None, "d", 1, "q1", "", ids=False, tool_calls=calls, finish="tool_calls"),
        make_record(None, "d", 2, "q2", "", ids=False, reasoning="I think so"),
        make_record(None, "d", 3, "q3", "", ids=False, reasoning="Cut", finish="length"),
        make_record(None, "d", 4, "q4", "", ids=False, completion_tokens=30),  # content null
    ]
    run = plant_run(tmp_path / "run", recs, budgets={"d": 10_000})
    out = tmp_path / "out"
    result = export(run, out, formats=("specforge", "parquet"))
    rows = read_jsonl(out / "specforge/train.jsonl")
    assert [r["id"].split("-")[1] for r in rows] == [recs[0].prompt_id]
    assert pl.read_parquet(out / "parquet/train.parquet").height == 5
    t = result.manifest["trainers"]
    want = {"train": {"empty": 1, "reasoning": 1, "tool_calls": 1}, "validation": {}}
    assert t["no_text"] == t["no_text"] | {"conversations": "left_out", "rows": {"d": want}}
    assert t["length"]["rows"] == {"d": {"train": 1, "validation": 0}}  # the cut one, once
    assert "3 rows with no answer text (empty 1, reasoning only 1, tool_calls only 1) left out" in (
        result.summary()
    )
    assert validate(out).ok
    bare = {"role": "assistant", "content": " ", "tool_calls": calls}
    why = check_specforge({"id": "x", "conversations": [{"role": "user", "content": "q"}, bare]})
    assert why.startswith("the last assistant message has no text")
    row = rows[0]
    row["conversations"][-1]["content"] = ""
    (out / "specforge/train.jsonl").write_text(json.dumps(row) + "\n")
    assert "specforge/train.jsonl line 1: the last assistant message has no text" in (
        validate(out).summary()
    )
