"""Issue 33: an answer cut at max_tokens inside a multi-byte character is exact for the
runner, the audit and the export alike (one check, kit.tokens.ids_spell), ids that do not
spell their text are a mismatch everywhere, and `kit demo` says why in its last line when
it exits 1.

tests/fixtures/cut_mid_character.json holds real answers of the embedded vLLM (its "how"
says how they were got): CJK text whose output ids end one or two bytes into a character,
decoded "春\ufffd" while the server's text is "春".
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest
from test_audit import make_record, plant_run

import kit
from kit import tokens
from kit.cli import demo
from kit.report.tokenrows import token_rows
from kit.run.backends import VLLMChat
from kit.types import Sampling

FIXTURE = Path(__file__).with_name("fixtures") / "cut_mid_character.json"
CUT = json.loads(FIXTURE.read_text())["records"]
FFFD = "\ufffd"


@pytest.fixture(scope="module")
def tok(model_dir):
    return tokens.load_tokenizer(model_dir)


def test_the_fixture_ends_inside_a_character(tok):
    for r in CUT:
        assert r["finish_reason"] == "length" and len(r["output_ids"]) == r["max_tokens"]
        assert tok.decode(r["output_ids"]) == r["text"] + FFFD and FFFD not in r["text"]
        assert tokens.render(tok, [r["messages"]], tokenize=True)[0] == r["prompt_ids"]


def spelling_cases(tok) -> list[tuple]:
    """(ids, text, reasoning, finish, whether the ids spell the text)."""
    r = CUT[0]
    ids, text = r["output_ids"], r["text"]
    more = tok.encode("好", add_special_tokens=False)
    think = tok.encode("<think>plan</think>", add_special_tokens=False)
    return [
        (ids, text, None, "length", True),  # the server's text leaves the partial out
        (ids, text + FFFD, None, "length", True),  # or keeps the U+FFFD
        (ids, "", text, "length", True),  # cut inside the thinking
        (think + ids, text, "plan", "length", True),  # cut inside the answer, after thinking
        (ids[:2] + [tok.eos_token_id], "春", None, "stop", True),  # a trailing EOS
        (ids, text, None, "stop", False),  # a stop cuts no character
        (think + ids, text, "plan", "stop", False),
        (ids + more, text + "好", None, "length", False),  # a U+FFFD in the middle
        (ids, text + "天", None, "length", False),  # the cut character made up
        (ids, "夏", None, "length", False),  # another text
    ]


def test_one_rule_per_row_and_batched(tok):
    cases = spelling_cases(tok)
    for ids, text, why, finish, want in cases:
        assert tokens.ids_spell(tok, ids, text, why, None, finish) is want, (text, finish)
    columns = list(zip(*cases, strict=True))
    ids, texts, why, finishes, want = columns
    assert tokens.ids_spell_batch(tok, ids, texts, why, None, finishes) == list(want)


def answer(r: dict, **changes) -> dict:
    """The vLLM chat answer the fixture's record came from (return_token_ids)."""
    r = r | changes
    message = {"role": "assistant", "content": r["text"]}
    choice = {"index": 0, "message": message, "finish_reason": r["finish_reason"]}
    choice["token_ids"] = r["output_ids"]
    usage = {"prompt_tokens": len(r["prompt_ids"]), "completion_tokens": len(r["output_ids"])}
    return {"choices": [choice], "prompt_token_ids": r["prompt_ids"], "usage": usage}


async def complete_against(answers: list[dict], port: int, model_dir) -> list:
    """Each answer served in turn by a local HTTP server, asked by VLLMChat with the
    tokenizer (the runner's lying-server check)."""
    from aiohttp import web

    queue = list(answers)

    async def chat(request):
        return web.json_response(queue.pop(0))

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    backend = VLLMChat(f"http://127.0.0.1:{port}/v1", "m", tokenizer=str(model_dir))
    try:
        return [
            await backend.complete(CUT[0]["messages"], Sampling(max_tokens=3), timeout=10)
            for _ in answers
        ]
    finally:
        await backend.aclose()
        await runner.cleanup()


def test_the_runner_believes_a_cut_answer(model_dir, free_port):
    lies = [answer(CUT[0], finish_reason="stop"), answer(CUT[0], text="夏天")]
    got = asyncio.run(complete_against([answer(r) for r in CUT] + lies, free_port(), model_dir))
    for r, c in zip(CUT, got[: len(CUT)], strict=True):
        assert (c.count_source, c.completion_tokens, c.output_ids) == (
            "server_ids",
            len(r["output_ids"]),
            r["output_ids"],
        )
    assert [c.count_source for c in got[len(CUT) :]] == ["retokenized", "retokenized"]


def cut_records(lie: bool = False) -> list:
    """The fixture's answers as records (plus, with `lie`, one whose ids spell another text)."""
    recs = []
    for i, r in enumerate(CUT):
        rec = make_record(None, "cjk", i, r["messages"][0]["content"], r["text"], ids=False)
        rec.finish_reason, rec.count_source = "length", "server_ids"
        rec.output_ids, rec.prompt_ids = r["output_ids"], r["prompt_ids"]
        rec.completion_tokens = len(r["output_ids"])
        recs.append(rec)
    if lie:
        recs[-1].completion = "夏天"
    return recs


def plant(run_dir: Path, model_dir, lie: bool = False) -> Path:
    budget = sum(len(r["output_ids"]) for r in CUT)
    recs = cut_records(lie)
    return plant_run(run_dir, recs, budgets={"cjk": budget}, max_tokens=3, tokenizer=str(model_dir))


def test_the_audit_finds_no_mismatch_in_a_cut_record(tmp_path, model_dir):
    report = kit.audit(plant(tmp_path / "run", model_dir))
    assert report.records["ids_text_mismatch"].to_list() == [False] * len(CUT)
    assert "ids_text_mismatch" not in report.findings["check"].to_list()
    assert report.ok, report.summary()
    lying = kit.audit(plant(tmp_path / "lie", model_dir, lie=True))
    assert lying.records["ids_text_mismatch"].sum() == 1
    found = lying.findings.filter(lying.findings["check"] == "ids_text_mismatch")
    assert found["severity"].to_list() == ["error"] and not lying.ok


def test_the_export_keeps_a_cut_record_exact(tmp_path, model_dir, tok):
    out = tmp_path / "out"
    result = kit.export(plant(tmp_path / "run", model_dir), out, formats=("token_ids",))
    assert result.manifest["token_rows"]["cjk"] == {"exact": len(CUT)}
    rows = [json.loads(line) for line in (out / "token_ids/train.jsonl").read_text().splitlines()]
    assert sorted(r["input_ids"] for r in rows) == sorted(
        r["prompt_ids"] + r["output_ids"] for r in CUT
    )
    lie = plant(tmp_path / "lie", model_dir, lie=True)
    lying = kit.export(lie, tmp_path / "out2", formats=("token_ids",))
    counts = lying.manifest["token_rows"]["cjk"]
    assert (counts["exact"], counts["ids_text_differ"]) == (len(CUT) - 1, 1)
    # the rows the export makes one by one (all_turns, re-tokenized) apply the same rule
    dicts = [dataclasses.asdict(r) for r in cut_records(lie=True)]
    made = token_rows(tok, dicts, {})
    assert [m["ids_source"] for m in made] == ["server"] * (len(CUT) - 1) + ["retokenized"]


def fake_notebooks(model_dir, lie: bool):
    """demo.run_notebooks' stand-in: the run planted and exported as 02 and 04 would."""

    def run(run_dir: Path, parameters: dict) -> Path:
        plant(run_dir, model_dir, lie=lie)
        kit.export(run_dir, run_dir / "export", overwrite=True)
        return run_dir / "notebooks"

    return run


@pytest.mark.parametrize("lie", [False, True], ids=["cut_record", "lying_record"])
def test_kit_demo_on_a_run_holding_a_cut_record(tmp_path, model_dir, monkeypatch, capsys, lie):
    """Exit 0 on the cut record; on a record whose ids lie, exit 1 with the audit's error
    in the last line."""
    from kit.cli import main

    monkeypatch.setattr(demo, "run_notebooks", fake_notebooks(model_dir, lie))
    monkeypatch.setattr(demo, "save_charts", lambda run_dir: [])
    argv = ["demo", "--run-dir", str(tmp_path / "d"), "--base-url", "http://h/v1"]
    code = main([*argv, "--model", "m", "--tokenizer", str(model_dir)])
    err = capsys.readouterr().err
    assert code == int(lie), err
    if lie:
        last = err.strip().splitlines()[-1]
        assert last.startswith("kit demo: the audit found 1 error: [error] cjk ids_text_mismatch")


def failed_notebook(source: str):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# plan"), nbformat.v4.new_code_cell("x = 1")]
    bad = nbformat.v4.new_code_cell(source)
    bad.outputs = [nbformat.v4.new_output("error", ename="ValueError", evalue="e", traceback=[])]
    nb.cells.append(bad)
    return nb


@pytest.mark.parametrize("evalue", ["no pilot completions", "fingerprint differs:\n- a\n+ b"])
def test_a_failed_notebook_is_named_with_its_cell_in_the_last_line(evalue):
    nb = failed_notebook("pilot = kit.pilot(config)\nprint(pilot)")
    exc = SimpleNamespace(ename="ValueError", evalue=evalue)
    text = demo.failure("notebooks/01_plan.ipynb", nb, exc, Path("/r/notebooks/01_plan.ipynb"))
    first, last = text.splitlines()[0], text.splitlines()[-1]
    assert first.startswith("notebooks/01_plan.ipynb failed: ValueError: ")
    assert "notebooks/01_plan.ipynb" in last and "cell 3 `pilot = kit.pilot(config)`" in last
    assert "/r/notebooks/01_plan.ipynb" in last
    assert evalue.splitlines()[-1] in text
