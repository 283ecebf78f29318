"""The trainer hand-off of an export (kit/report/trainers.py), on planted runs: `length` rows
left out of the SpecForge JSONL by default and counted, kept when asked; reasoning rows
counted per dataset with what becomes of them; the SpecForge template read off the
tokenizer; token-id rows never training an end-of-turn the model did not emit.
(tests/test_trainers.py runs the trainers' own code on real exports.)"""

from __future__ import annotations

import json

import pytest
from test_audit import ANSWERS, make_record, plant_run
from test_export import read_jsonl

from kit.report.export import export
from kit.report.trainers import chatml_parts, register_code, renders_reasoning, renders_tool_calls
from kit.report.validate import validate


@pytest.fixture(scope="module")
def tok(model_dir):
    import kit

    return kit.tokens.load_tokenizer(model_dir)


def planted(tmp_path, tok, model_dir):
    """d: 4 records, 2 of them `length` (one with server ids, one without), 1 with reasoning,
    1 with a tool call; e: 1 plain record."""
    recs = [make_record(tok, "d", i, f"Tell me fact {i}.", ANSWERS[i]) for i in range(4)]
    recs[1].finish_reason, recs[1].output_ids = "length", recs[1].output_ids[:-1]
    recs[1].completion_tokens -= 1
    recs[2] = make_record(tok, "d", 2, "Tell me fact 2.", ANSWERS[2], finish="length", ids=False)
    recs[3].reasoning = "Recall the ocean sizes."
    recs[0].tool_calls = [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ]
    recs.append(make_record(tok, "e", 5, "Tell me fact 5.", ANSWERS[5]))
    budgets = {"d": 1000, "e": 1000}
    return plant_run(tmp_path / "run", recs, budgets=budgets, tokenizer=str(model_dir)), recs


@pytest.mark.server
def test_length_rows_left_out_of_conversations_and_counted(tmp_path, tok, model_dir):
    run, recs = planted(tmp_path, tok, model_dir)
    result = export(run, tmp_path / "out", formats=("specforge", "token_ids"), val_fraction=0.0)
    sf = [r["id"] for r in read_jsonl(tmp_path / "out/specforge/train.jsonl")]
    ids = [r["id"] for r in read_jsonl(tmp_path / "out/token_ids/train.jsonl")]
    cut = {f"d-{r.prompt_id}-0" for r in recs[1:3]}
    assert len(ids) == 5 and sf == [i for i in ids if i not in cut]
    t = result.manifest["trainers"]
    assert t["length"]["conversations"] == "left_out"
    assert t["length"]["rows"] == {"d": {"train": 2, "validation": 0}}
    assert "d: 2 `length` rows left out of the SpecForge JSONL" in result.summary()
    assert validate(tmp_path / "out").ok
    # an edited SpecForge file (a left-out row put back) is caught
    path = tmp_path / "out/specforge/train.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:1] + lines) + "\n")
    assert not validate(tmp_path / "out").ok
    kept = export(
        run,
        tmp_path / "kept",
        formats=("specforge", "token_ids"),
        keep_truncated_conversations=True,
    )
    assert len(read_jsonl(tmp_path / "kept/specforge/train.jsonl")) == 5
    assert kept.manifest["trainers"]["length"]["conversations"] == "kept"
    assert kept.manifest["trainers"]["length"]["rows"] == {"d": {"train": 2, "validation": 0}}
    assert "d: 2 `length` rows kept in the SpecForge JSONL" in kept.summary()
    assert validate(tmp_path / "kept").ok


@pytest.mark.server
def test_token_rows_never_train_an_end_of_turn_not_emitted(tmp_path, tok, model_dir):
    run, recs = planted(tmp_path, tok, model_dir)
    export(run, tmp_path / "out", formats=("token_ids",))
    rows = {r["id"]: r for r in read_jsonl(tmp_path / "out/token_ids/train.jsonl")}
    eos = tok.eos_token_id
    for r in recs:
        row = rows[f"{r.dataset}-{r.prompt_id}-0"]
        trained = [i for i, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
        if r.finish_reason == "length":  # exact (1) or re-tokenized (2): never an EOS trained
            assert eos not in trained, (r.prompt_id, row["ids_source"])
        else:
            assert trained[-1] == eos


@pytest.mark.server
def test_reasoning_rows_counted_with_their_fate(tmp_path, tok, model_dir):
    run, _ = planted(tmp_path, tok, model_dir)
    result = export(run, tmp_path / "out", formats=("specforge", "token_ids"))
    t = result.manifest["trainers"]
    assert list(t["reasoning"]) == ["d"] and t["reasoning"]["d"]["rows"] == 1
    assert t["reasoning"]["d"]["specforge"].startswith("dropped: GeneralParser")
    assert "d: 1 row with reasoning: SpecForge dropped" in result.summary()
    sf = t["specforge"]
    assert sf["data.train_only_last_turn"] is True and sf["data.chat_template"].startswith("kit-")
    assert sf["template"]["end_of_turn_token"] == "<|im_end|>"  # not "<|im_end|>\n" (qwen's)
    assert sf["template"]["system_prompt"] is None  # the tokenizer's template adds its own
    assert sf["template"]["parser_type"] == "general"  # SmolLM2 renders no reasoning_content
    assert "TEMPLATE_REGISTRY.register(name='kit-" in sf["register"]
    assert t["token_ids"]["specforge"] == {"data.prompts_path": "token_ids/train.jsonl"}
    assert "--data token_ids/train.jsonl" in t["token_ids"]["speculators"]
    assert t["tool_calls"] == {"d": {"rows": 1, "template_renders_them": False}}
    assert "d: 1 row with tool calls, which the chat template does not render" in result.summary()
    assert json.loads((tmp_path / "out/manifest.json").read_text())["trainers"] == t


@pytest.mark.server
def test_template_parts_read_off_the_tokenizer(tok):
    from test_export_exact import THINK_TEMPLATE
    from transformers import AutoTokenizer

    assert chatml_parts(tok) == {
        "assistant_header": "<|im_start|>assistant\n",
        "user_header": "<|im_start|>user\n",
        "end_of_turn_token": "<|im_end|>",
    }
    assert not renders_reasoning(tok)
    think = AutoTokenizer.from_pretrained(tok.name_or_path, local_files_only=True)
    think.chat_template = THINK_TEMPLATE  # Qwen3-like: the last turn's reasoning_content rendered
    assert renders_reasoning(think)
    assert register_code(None) is None
    assert not renders_tool_calls(tok)  # SmolLM2's template has no place for them
