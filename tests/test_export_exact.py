"""kit.export of issue 12's records: token rows exactly from the server's ids, reasoning,
tools, template kwargs, and which assistant turns are trained (last_turn / all_turns), with
the SpecForge rows and the token-id rows agreeing on it."""

from __future__ import annotations

import json

import polars as pl
import pytest
from test_audit import ANSWERS, make_record, plant_run
from test_export import read_jsonl, set_config

import kit.report.exactrows as exactrows
from kit.report.export import export
from kit.report.validate import validate

# A Qwen3-like template: tools in a system block, the last assistant turn's reasoning_content
# in a <think> block (empty without), and enable_thinking=False closing an empty think block
# in the prompt.
THINK_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n' }}{%- for t in tools %}"
    "{{ t | tojson }}{{ '\\n' }}{%- endfor %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' and loop.last %}"
    "{{ '<think>\\n' + (m.reasoning_content or '') + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{ m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tok(model_dir):
    import kit

    return kit.tokens.load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def think_tok(model_dir):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)  # not the cached one
    t.chat_template = THINK_TEMPLATE
    return t


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def prompt_ids(tok, messages, **kw) -> list[int]:
    """The prompt's ids as a server renders and tokenizes it."""
    return enc(
        tok, tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    )


def spans(tok, row) -> list[str]:
    """The decoded text of each contiguous run of loss_mask 1."""
    out, start, mask = [], None, row["loss_mask"] + [0]
    for i, m in enumerate(mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append(tok.decode(row["input_ids"][start:i], skip_special_tokens=False))
            start = None
    return out


def specforge_trained(conv: list[dict], only_last: bool) -> list[str]:
    """The assistant texts SpecForge trains in a row (all, or the last with
    train_only_last_turn)."""
    texts = [m["content"] for m in conv if m["role"] == "assistant"]
    return texts[-1:] if only_last else texts


def assert_exports_agree(tok, out, eos="<|im_end|>"):
    """Per row: the SpecForge row's trained assistant texts == the token row's masked spans."""
    m = json.loads((out / "manifest.json").read_text())
    only_last = m["specforge"]["train_only_last_turn"]
    sf = {r["id"]: r for r in read_jsonl(out / "specforge/train.jsonl")}
    n = 0
    for row in read_jsonl(out / "token_ids/train.jsonl"):
        got = [s.removesuffix(eos) for s in spans(tok, row)]
        assert got == specforge_trained(sf[row["id"]]["conversations"], only_last), row["id"]
        n += 1
    return n


# ---------------------------------------------------------------- exact rows


@pytest.mark.server
def test_exact_rows_are_the_server_ids(tmp_path, tok, model_dir):
    recs = [make_record(tok, "d", i, f"Tell me fact {i}.", ANSWERS[i]) for i in range(5)]
    for r in recs[:4]:
        r.prompt_ids = prompt_ids(tok, r.messages)
    recs[1].output_ids = recs[1].output_ids[:-1]  # stop, but the server left the EOS out
    recs[2].finish_reason, recs[2].output_ids = "length", recs[2].output_ids[:-1]
    sys = [{"role": "system", "content": "Be terse."}, *recs[3].messages]
    recs[3].prompt_ids = prompt_ids(tok, sys)  # the server rendered another system prompt
    run = plant_run(tmp_path / "run", recs, budgets={"d": 1000}, tokenizer=str(model_dir))
    result = export(run, tmp_path / "out", formats=("specforge", "token_ids", "parquet"))
    rows = {r["id"]: r for r in read_jsonl(tmp_path / "out/token_ids/train.jsonl")}
    eos = tok.eos_token_id
    for r in recs[:4]:
        row = rows[f"d-{r.prompt_id}-0"]
        assert row["ids_source"] == "server"
        p, o = r.prompt_ids, r.output_ids
        closer = [eos] if r is recs[1] else []
        assert row["input_ids"] == p + o + closer  # verbatim: nothing re-tokenized, no tail
        assert row["loss_mask"] == [0] * len(p) + [1] * (len(o) + len(closer))
    assert rows[f"d-{recs[0].prompt_id}-0"]["input_ids"].count(eos) == 3  # no second EOS
    assert rows[f"d-{recs[2].prompt_id}-0"]["input_ids"][-1] != eos  # length: never closed
    assert rows[f"d-{recs[4].prompt_id}-0"]["ids_source"] == "retokenized"
    counts = result.manifest["token_rows"]["d"]
    assert counts == {
        "exact": 4,
        "retokenized": 1,
        "end_of_turn_appended": 1,
        "prompt_render_differs": 1,
    }
    text = result.summary()
    assert (
        "d: 1 row: the server's prompt ids differ from kit's rendering; the server's ids are used"
        in text
    )
    assert "d: token rows 4 exact (server ids), 1 approximate: re-tokenized text" in text
    table = pl.read_parquet(tmp_path / "out/parquet/train.parquet")
    assert sorted(table["ids_source"].to_list()) == ["retokenized"] + ["server"] * 4
    assert validate(tmp_path / "out").ok


# ---------------------------------------------------------------- reasoning and tools


@pytest.mark.server
def test_exact_row_checks_run_on_a_stated_sample_and_a_lie_widens_them(
    tmp_path, tok, model_dir, monkeypatch
):
    """The server's ids are checked against the text and kit's rendering on the first
    CHECK_SAMPLE rows of each dataset (manifest token_checks); a lie found there has every
    later row of that dataset decoded, so its later lies are re-tokenized too; past a clean
    sample nothing is decoded, and the manifest says so."""
    monkeypatch.setattr(exactrows, "CHECK_SAMPLE", 2)
    wrong = enc(tok, "Something else entirely.") + [tok.eos_token_id]
    recs = {
        ds: [make_record(tok, ds, i, f"{ds} question {i}?", ANSWERS[i]) for i in range(6)]
        for ds in ("liar", "late")
    }
    for r in recs["liar"] + recs["late"]:
        r.prompt_ids = prompt_ids(tok, r.messages)
    for r in (recs["liar"][1], recs["liar"][4], recs["late"][4]):  # in the sample, and past it
        r.output_ids = wrong
    run = plant_run(
        tmp_path / "run",
        recs["liar"] + recs["late"],
        budgets={"liar": 10_000, "late": 10_000},
        tokenizer=str(model_dir),
    )
    result = export(run, tmp_path / "out", formats=("token_ids",))
    rows, checks = result.manifest["token_rows"], result.manifest["token_checks"]["per_dataset"]
    assert (rows["liar"]["exact"], rows["liar"]["ids_text_differ"]) == (4, 2)
    assert checks["liar"] == {
        "exact_candidates": 6,
        "ids_decoded": 6,
        "prompt_rendered": 2,
        "decoded_all": True,
    }
    assert rows["late"]["exact"] == 6 and "ids_text_differ" not in rows["late"]
    assert checks["late"] == {
        "exact_candidates": 6,
        "ids_decoded": 2,
        "prompt_rendered": 2,
        "decoded_all": False,
    }
    assert "500" not in result.manifest["token_checks"]["how"] and validate(tmp_path / "out").ok


@pytest.mark.server
def test_reasoning_tools_and_template_kwargs(tmp_path, think_tok, tok, model_dir):
    t = think_tok
    kw = {"enable_thinking": False}
    a = make_record(t, "math", 0, "What is 2 + 3?", "5")  # exact, with thinking and tools
    a.reasoning, a.tools = "Two plus three is five.", TOOLS
    a.output_ids = enc(t, "<think>\nTwo plus three is five.\n</think>\n\n5") + [t.eos_token_id]
    a.prompt_ids = prompt_ids(t, a.messages, tools=TOOLS, **kw)  # rendered with the kwargs
    c = make_record(t, "math", 2, "Say hi.", "Hi!", ids=False)  # a plain old record
    b = make_record(t, "think", 1, "What is 4 + 4?", "8", ids=False)  # re-tokenized, thinking on
    b.reasoning = "Four and four make eight."
    budgets = {"math": 1000, "think": 1000}
    run = plant_run(tmp_path / "run", [a, b, c], budgets=budgets, tokenizer=str(model_dir))
    set_config(run, template_kwargs={"math": kw})  # only math's prompts closed the thinking
    result = export(run, tmp_path / "out", tokenizer=t)
    sf = {r["id"]: r for r in read_jsonl(tmp_path / "out/specforge/train.jsonl")}
    ra, rb, rc = (sf[f"{r.dataset}-{r.prompt_id}-{r.sample}"] for r in (a, b, c))
    assert ra["tools"] == TOOLS and "tools" not in rb and set(rc) == {"id", "conversations"}
    assert ra["conversations"][-1] == {
        "role": "assistant",
        "content": "5",
        "reasoning_content": a.reasoning,
    }
    assert rc["conversations"][-1] == {"role": "assistant", "content": "Hi!"}
    rows = {r["id"]: r for r in read_jsonl(tmp_path / "out/token_ids/train.jsonl")}
    row_a, row_b, row_c = rows[ra["id"]], rows[rb["id"]], rows[rc["id"]]
    assert row_a["input_ids"] == a.prompt_ids + a.output_ids  # the thinking as generated
    assert spans(t, row_a) == ["<think>\nTwo plus three is five.\n</think>\n\n5<|im_end|>"]
    assert row_b["ids_source"] == "retokenized"  # rendered by the template with its reasoning
    assert spans(t, row_b) == ["<think>\nFour and four make eight.\n</think>\n\n8<|im_end|>"]
    assert spans(t, row_c) == ["Hi!<|im_end|>"]  # the empty think block is the prompt's
    assert "# Tools" in t.decode(row_a["input_ids"])
    assert t.decode(row_c["input_ids"]).endswith(
        "assistant\n<think>\n\n</think>\n\nHi!<|im_end|>\n"
    )
    # the prompt kit renders (tools, enable_thinking=False) is the server's: nothing differs
    rows_made = result.manifest["token_rows"]
    assert rows_made == {"math": {"exact": 1, "retokenized": 1}, "think": {"retokenized": 1}}
    table = pl.read_parquet(tmp_path / "out/parquet/train.parquet").sort("prompt_id")
    by_id = dict(zip(table["id"], table["tools"], strict=True))
    assert json.loads(by_id[ra["id"]]) == TOOLS and by_id[rb["id"]] is None is by_id[rc["id"]]
    table = table.filter(pl.col("id") == ra["id"])
    assert table["conversations"][0][-1]["reasoning_content"] == a.reasoning
    assert validate(tmp_path / "out").ok
    # a template with no place for reasoning (SmolLM2's) drops it: counted, not hidden
    other = export(run, tmp_path / "out2", tokenizer=tok, formats=("token_ids",))
    assert other.manifest["token_rows"]["think"]["reasoning_not_rendered"] == 1
    assert other.manifest["token_rows"]["math"]["prompt_render_differs"] == 1  # no tools there
    assert "1 row: re-tokenized, and the chat template drops reasoning_content" in other.summary()


# ---------------------------------------------------------------- turns


def multi_turn(tok, i, users, answers, *, exact=True):
    """An all_turns record: the target answered every user turn; earlier turns in turns."""
    msgs, turns = [], []
    for u, ans in zip(users[:-1], answers[:-1], strict=True):
        msgs.append({"role": "user", "content": u})
        out = enc(tok, ans) + [tok.eos_token_id]
        turns.append(
            {
                "content": ans,
                "reasoning": None,
                "finish_reason": "stop",
                "completion_tokens": len(out),
                "count_source": "server_ids",
                "output_ids": out,
                "prompt_ids": prompt_ids(tok, msgs),
            }
        )
        msgs.append({"role": "assistant", "content": ans})
    msgs.append({"role": "user", "content": users[-1]})
    rec = make_record(tok, "multi", i, users[-1], answers[-1], prompt_id=f"m{i}")
    rec.messages, rec.turns = msgs, turns
    rec.prompt_ids = prompt_ids(tok, msgs) if exact else None
    rec.completion_tokens += sum(t["completion_tokens"] for t in turns)
    return rec


@pytest.mark.server
def test_all_turns_trains_every_target_turn_in_both_exports(tmp_path, tok, model_dir):
    users = ["Hi!", "Name a planet.", "And a star?"]
    recs = [
        multi_turn(tok, 0, users, ["Hello! How can I help?", "Mars is a planet.", "The Sun."]),
        multi_turn(tok, 1, users[1:], ["Venus.", "Sirius is a star."], exact=False),
        multi_turn(tok, 2, users[1:], ["Jupiter, the largest.", "Vega."]),
        multi_turn(tok, 3, users[1:], ["Saturn has rings.", "Polaris."]),
    ]
    # the server tokenized an earlier answer its own way: not verbatim in the later prompt
    recs[2].turns[0]["output_ids"] = [t for ch in "Jupiter" for t in enc(tok, ch)] + enc(
        tok, ", the largest."
    )
    # the server's prompt does not hold the earlier answer at all: the row is re-tokenized
    recs[3].prompt_ids = prompt_ids(
        tok,
        [
            {"role": "user", "content": "Name a planet."},
            {"role": "assistant", "content": "Pluto."},
            {"role": "user", "content": "And a star?"},
        ],
    )
    run = plant_run(tmp_path / "run", recs, budgets={"multi": 10_000}, tokenizer=str(model_dir))
    set_config(run, turns="all_turns")
    result = export(run, tmp_path / "out", formats=("specforge", "token_ids"))
    m = result.manifest
    assert m["specforge"]["train_only_last_turn"] is False
    assert m["turns"]["rows_with_earlier_turns"] == {"multi": 4} and m["turns"]["earlier_trained"]
    counts = m["token_rows"]["multi"]
    assert counts["exact"] == 2 and counts["retokenized"] == 2
    assert counts["earlier_turns_trained"] == 4 and counts["earlier_turns_fallback"] == 1
    assert counts["earlier_turns_rendered"] == 1  # rec 2: its own ids are not in the prompt
    assert assert_exports_agree(tok, tmp_path / "out") == 4
    rows = {r["id"]: r for r in read_jsonl(tmp_path / "out/token_ids/train.jsonl")}
    assert [rows[f"multi-{r.prompt_id}-0"]["ids_source"] for r in recs] == [
        "server",
        "retokenized",
        "server",
        "retokenized",
    ]
    first = rows[f"multi-{recs[0].prompt_id}-0"]
    assert first["input_ids"] == recs[0].prompt_ids + recs[0].output_ids
    assert spans(tok, first) == [
        "Hello! How can I help?<|im_end|>",
        "Mars is a planet.<|im_end|>",
        "The Sun.<|im_end|>",
    ]
    assert "rows with earlier target turns, trained in every format" in result.summary()


@pytest.mark.server
def test_last_turn_never_trains_dataset_turns(tmp_path, tok, model_dir):
    recs = [make_record(tok, "chat", i, f"Tell me fact {i}.", ANSWERS[i]) for i in range(3)]
    for r in recs[:2]:
        r.messages = [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello, how can I help?"},
            *r.messages,
        ]
    recs[0].prompt_ids = prompt_ids(tok, recs[0].messages)  # exact row with a dataset turn
    run = plant_run(tmp_path / "run", recs, budgets={"chat": 10_000}, tokenizer=str(model_dir))
    result = export(run, tmp_path / "out", formats=("specforge", "token_ids"))
    m = result.manifest
    assert m["specforge"]["train_only_last_turn"] is True and m["turns"]["mode"] == "last_turn"
    assert m["turns"]["rows_with_earlier_turns"] == {"chat": 2}
    assert assert_exports_agree(tok, tmp_path / "out") == 3  # the last turn only, both formats
    text = result.summary()
    assert "chat: 2 rows with earlier dataset turns, not trained" in text
    assert "--train-only-last-turn" in text


# ---------------------------------------------------------------- without a tokenizer


def test_specforge_rows_carry_tools_and_reasoning_without_a_tokenizer(tmp_path):
    recs = [make_record(None, "d", i, f"q{i}", ANSWERS[i], ids=False) for i in range(3)]
    recs[0].tools, recs[0].reasoning = TOOLS, "Think first."
    recs[1].messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        *recs[1].messages,
    ]
    run = plant_run(tmp_path / "run", recs, budgets={"d": 1000})
    result = export(run, tmp_path / "out", formats=("specforge", "parquet"))
    rows = read_jsonl(tmp_path / "out/specforge/train.jsonl")
    assert (
        rows[0]["tools"] == TOOLS
        and rows[0]["conversations"][-1]["reasoning_content"] == "Think first."
    )
    assert [set(r) for r in rows[1:]] == [{"id", "conversations"}] * 2
    assert result.manifest["turns"]["rows_with_earlier_turns"] == {"d": 1}
    assert validate(tmp_path / "out").ok
    path = tmp_path / "out/specforge/train.jsonl"
    bad = dict(rows[0], tools={"name": "add"})
    path.write_text("\n".join(json.dumps(r) for r in [bad, *rows[1:]]) + "\n")
    assert (
        "line 1: 'tools' must be a list of tool definitions" in validate(tmp_path / "out").summary()
    )


def test_token_rows_alone_read_only_the_prompts_they_use(tmp_path, tok, model_dir, monkeypatch):
    """A token_ids-only export reads a prompt's text only where a row uses it (the sampled
    render checks, re-tokenized rows), each checked against its hash; the rows, the counts
    of earlier turns and the bytes are those of an export that reads every prompt. Two
    unsampled exact rows' prompts swapped: the same export; a sampled or a re-tokenized
    row's prompt swapped: PromptMismatch naming it."""
    import sqlite3

    from kit.run.reader import PromptMismatch

    monkeypatch.setattr(exactrows, "CHECK_SAMPLE", 2)
    recs = [make_record(tok, "d", i, f"Tell me fact {i}.", ANSWERS[i]) for i in range(6)]
    recs[5] = make_record(tok, "d", 5, "No ids here.", ANSWERS[5], ids=False)
    recs[3].messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        *recs[3].messages,
    ]
    for r in recs[:5]:
        r.prompt_ids = prompt_ids(tok, r.messages)
    run = plant_run(tmp_path / "run", recs, budgets={"d": 1000}, tokenizer=str(model_dir))
    alone = export(run, tmp_path / "alone", formats=("token_ids",))
    both = export(run, tmp_path / "both", formats=("specforge", "token_ids"))
    rel = "token_ids/train.jsonl"
    assert (tmp_path / "alone" / rel).read_bytes() == (tmp_path / "both" / rel).read_bytes()
    for key in ("counts", "token_rows", "turns", "token_checks"):
        assert alone.manifest[key] == both.manifest[key], key
    assert alone.manifest["turns"]["rows_with_earlier_turns"] == {"d": 1}
    assert alone.manifest["token_rows"]["d"] == {"exact": 5, "retokenized": 1}

    def swap(a, b):
        with sqlite3.connect(run / "run.sqlite") as conn:
            text = dict(
                conn.execute(
                    "SELECT prompt_id, messages FROM prompts WHERE prompt_id IN (?, ?)", (a, b)
                )
            )
            for x, y in ((a, b), (b, a)):
                conn.execute("UPDATE prompts SET messages = ? WHERE prompt_id = ?", (text[y], x))
        conn.close()

    ids = [r.prompt_id for r in recs]  # plant_run set them, in commit order
    swap(ids[2], ids[4])  # past the sample of 2, exact: their text is not read
    again = export(run, tmp_path / "again", formats=("token_ids",))
    assert (tmp_path / "again" / rel).read_bytes() == (tmp_path / "alone" / rel).read_bytes()
    assert again.manifest["token_checks"] == alone.manifest["token_checks"]
    swap(ids[2], ids[4])
    for a, b in ((ids[0], ids[4]), (ids[5], ids[4])):  # a sampled row's, a re-tokenized row's
        swap(a, b)
        with pytest.raises(PromptMismatch, match=a):
            export(run, tmp_path / "no", formats=("token_ids",))
        swap(a, b)


def test_rows_that_break_the_format_stop_the_export_before_the_swap(tmp_path, tok, model_dir):
    """The rows are checked against kit.validate's rules as they are written: a server's
    prompt id past the vocabulary is an ExportInvalid naming the row, and the previous
    export stays as it was."""
    from kit.report.export import ExportInvalid

    recs = [make_record(tok, "d", i, f"Tell me fact {i}.", ANSWERS[i]) for i in range(3)]
    for r in recs:
        r.prompt_ids = prompt_ids(tok, r.messages)
    run = plant_run(tmp_path / "run", recs, budgets={"d": 1000}, tokenizer=str(model_dir))
    out = tmp_path / "out"
    export(run, out, formats=("token_ids",))
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    recs[1].prompt_ids = recs[1].prompt_ids + [len(tok) + 5]
    bad = plant_run(tmp_path / "bad", recs, budgets={"d": 1000}, tokenizer=str(model_dir))
    with pytest.raises(
        ExportInvalid,
        match=f"row d-{recs[1].prompt_id}-0: a token id is not below the vocabulary size {len(tok)}",
    ):
        export(bad, out, formats=("token_ids",), overwrite=True)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert validate(out).ok
