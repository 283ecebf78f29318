"""kit's exports through the trainers' own data code (SpecForge 0.2.0, speculators 0.9.0 from
PyPI, in .venv-trainers: `make trainers`), on real runs of the embedded vLLM: plain
(last_turn, with a multi-turn dataset), all_turns, and reasoning (the thinking variant).

tests/trainer_oracle.py runs their preprocessing and prints what they train; here it is
compared with kit's token-id rows: the token-id route must be kit's rows verbatim, and the
conversation route (with the template the manifest names) must train kit's tokens on every
`stop` row but for the differences the manifest counts.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from test_vllm import SAMPLES, read_jsonl, vllm_config
from transformers import AutoTokenizer

import kit
from kit.report.convo import conversation, row_id, with_tool_calls
from kit.report.manifest import trainer_lines

ROOT = Path(__file__).resolve().parents[1]
TRAINERS = ROOT / ".venv-trainers" / "bin" / "python"
pytestmark = pytest.mark.slow


def oracle(out: Path, model, routes, manifest=None, endpoint=None) -> dict:
    """tests/trainer_oracle.py in .venv-trainers on the export at out."""
    assert TRAINERS.exists(), "run `make trainers` first (.venv-trainers)"
    hand = (manifest or {}).get("trainers", {})
    args = {
        "export": str(out),
        "model": str(model),
        "routes": list(routes),
        "template": hand.get("specforge", {}).get("template"),
        "train_only_last_turn": hand.get("specforge", {}).get("train_only_last_turn", False),
        "render_endpoint": endpoint,
    }
    done = subprocess.run(
        [str(TRAINERS), str(ROOT / "tests/trainer_oracle.py"), json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def trained(ids, mask) -> list[int]:
    return [i for i, m in zip(ids, mask, strict=True) if m]


def run_and_export(server, tmp, frame, budgets, max_tokens, **kw):
    sampling = kit.Sampling(max_tokens=max_tokens, temperature=0.7, seed=1)
    run = kit.generate_sync(
        frame, vllm_config(server, budgets, sampling=sampling, **kw), run_dir=tmp / "run"
    )
    assert run.stop_reason is None, run.stop_reason
    result = kit.export(tmp / "run", tmp / "out", formats=("specforge", "token_ids"))
    assert kit.validate(tmp / "out").ok
    return tmp / "out", result


@pytest.fixture(scope="module")
def plain(vllm_server, tmp_path_factory):
    """Every sample dataset, last_turn (multi_turn's earlier turns are the dataset's)."""
    loaded = kit.load(str(SAMPLES))
    names = sorted(loaded.frame["dataset"].unique().to_list())
    out, result = run_and_export(
        vllm_server, tmp_path_factory.mktemp("plain"), loaded, dict.fromkeys(names, 400), 160
    )
    return out, result, vllm_server


SHORT = [
    ("What is the capital of France?", "And of Italy?"),
    ("Name a primary color.", "Another one?"),
    ("What is 2 + 2?", "And 3 + 3?"),
    ("Say hello.", "Say goodbye."),
    ("Name a fruit.", "Name a vegetable."),
    ("What color is the sky?", "And grass?"),
]


@pytest.fixture(scope="module")
def all_turns(vllm_server, tmp_path_factory):
    """Two-question conversations (the `turns` format) with short answers, all_turns: every
    assistant turn is the target's (multi_turn's long answers would all stop at max_tokens)."""
    tmp = tmp_path_factory.mktemp("all")
    src = tmp / "short_turns.jsonl"
    src.write_text("".join(json.dumps({"turns": list(q)}) + "\n" for q in SHORT))
    frame = kit.load(str(src)).frame
    out, result = run_and_export(
        vllm_server, tmp, frame, {"short_turns": 1500}, 160, turns="all_turns", concurrency=8
    )
    return out, result, vllm_server


@pytest.fixture(scope="module")
def reasoning(vllm_thinking, tmp_path_factory):
    frame = kit.load(str(SAMPLES / "chat_general.jsonl")).frame.head(16)
    out, result = run_and_export(
        vllm_thinking,
        tmp_path_factory.mktemp("think"),
        frame,
        {"chat_general": 1500},
        256,
        concurrency=16,
    )
    return out, result, vllm_thinking


def base_url(server) -> str:
    return server.base_url.removesuffix("/v1")


ROUTES = ["specforge_ids", "speculators_ids", "specforge_conv", "speculators_conv"]
EXPORTS = ["plain", "all_turns", "reasoning"]


@pytest.fixture(scope="module")
def trained_by(request):
    """export name -> (the trainers' output, kit's token rows by id, SpecForge rows, manifest)."""
    done = {}

    def get(which):
        if which not in done:
            out, result, server = request.getfixturevalue(which)
            empty = not (out / "specforge/train.jsonl").read_text()  # the trainers refuse it
            routes = [r for r in ROUTES if not (empty and r.endswith("_conv"))]
            got = oracle(out, server.tokenizer_path, routes, result.manifest, base_url(server))
            rows = {r["id"]: r for r in read_jsonl(out / "token_ids/train.jsonl")}
            sf = {r["id"]: r for r in read_jsonl(out / "specforge/train.jsonl")}
            done[which] = got, rows, sf, result.manifest, server
        return done[which]

    return get


@pytest.mark.parametrize("which", EXPORTS)
def test_token_id_route_trains_kits_rows_verbatim(which, trained_by):
    got, rows, _, _, _ = trained_by(which)
    mine = {k: (r["input_ids"], r["loss_mask"]) for k, r in rows.items()}
    sf = got["specforge_ids"]  # data.prompts_path: every row, in order, as written
    assert sf["n"] == len(rows) and {k: tuple(map(list, v)) for k, v in sf["rows"].items()} == mine
    sp = sorted(got["speculators_ids"]["multiset"])  # prepare-data shuffles: as multisets
    assert got["speculators_ids"]["n"] == len(rows) and sp == sorted(map(list, mine.values()))
    print(
        f"\n{which}: token-id route, {len(rows)} rows: SpecForge {len(rows)}/{len(rows)}, "
        f"speculators {len(rows)}/{len(rows)} identical"
    )


def differing(trainer_rows, kit_rows, sf_rows, tail=()) -> dict[str, list[str]]:
    """dataset -> ids of the SpecForge JSONL rows whose trained tokens (all of the row's
    trainer rows', each less `tail`) differ from kit's token row's."""
    out = {}
    for rid, got in trainer_rows.items():
        got = got if got and isinstance(got[0][0], list) else [got]  # speculators: rows per turn
        theirs = []
        for ids, mask in got:
            t, n = trained(ids, mask), len(tail)
            if n:  # the row must end with the tail; a row without it differs
                t = t[:-n] if t[-n:] == list(tail) else [*t, "no tail"]
            theirs += t
        if theirs != trained(kit_rows[rid]["input_ids"], kit_rows[rid]["loss_mask"]):
            out.setdefault(sf_rows[rid]["id"].rsplit("-", 2)[0], []).append(rid)
    return out


def explained(diff: dict, sf_rows: dict, manifest: dict) -> None:
    """Every differing row is a counted one: reasoning rows (trainers.reasoning) or answers
    that re-tokenize otherwise (trainers.specforge.retokenized_differently)."""
    t = manifest["trainers"]
    with_reasoning = {}  # dataset -> SpecForge rows with reasoning_content
    for rid, row in sf_rows.items():
        if row["conversations"][-1].get("reasoning_content"):
            with_reasoning[rid.rsplit("-", 2)[0]] = with_reasoning.get(rid.rsplit("-", 2)[0], 0) + 1
    assert with_reasoning == {d: r["rows"] for d, r in t["reasoning"].items()}
    for name, ids in diff.items():
        thinking = [i for i in ids if sf_rows[i]["conversations"][-1].get("reasoning_content")]
        rest = len(ids) - len(thinking)
        assert len(thinking) == with_reasoning.get(name, 0), (name, thinking)  # dropped, each
        assert rest == t["specforge"]["retokenized_differently"].get(name, 0), (name, ids)


@pytest.mark.parametrize("which", EXPORTS)
def test_conversation_route_trains_kits_tokens_but_what_the_manifest_counts(which, trained_by):
    got, rows, sf_rows, manifest, server = trained_by(which)
    t = manifest["trainers"]
    cut = sum(sum(n.values()) for n in t["length"]["rows"].values())
    bare = sum(sum(n.values()) for s in t["no_text"]["rows"].values() for n in s.values())
    assert t["length"]["conversations"] == "left_out" and len(sf_rows) == len(rows) - cut - bare
    if which == "reasoning" and not sf_rows:  # every answer thinking only: none to compare
        held = {k for s in t["no_text"]["rows"].values() for n in s.values() for k in n}
        assert bare and held == {"reasoning"} and "specforge_conv" not in got, t["no_text"]
        print(f"\nreasoning: all {bare} uncut rows are reasoning only: none in the SpecForge JSONL")
        return
    assert sf_rows, f"{which}: no stop row to compare"
    # SpecForge, data.chat_template the manifest names (registered as it says)
    sf = got["specforge_conv"]
    assert sf["pipeline_same"] and sf["n"] == len(sf_rows)  # the per-row calls are its pipeline
    sf_diff = differing(sf["rows"], rows, sf_rows)
    explained(sf_diff, sf_rows, manifest)
    # speculators: one row per assistant turn, each trained to the end of the render
    sp = got["speculators_conv"]
    assert sp["pipeline_same"]
    if which == "plain":  # last_turn: the earlier (dataset) turns are rows of their own
        extra = sum(t["speculators"]["earlier_turn_rows"].values())
        assert extra and sp["n"] == len(sf_rows) + extra
        said = "\n".join(trainer_lines(t))  # the export's summary says so, per dataset
        for name, n in t["speculators"]["earlier_turn_rows"].items():
            assert (
                f"  {name}: {n} earlier assistant turn{'s' * (n != 1)} of the dataset's own (few-shot) answers become training rows of the speculators conversation route"
                in said
            )
        sp_rows = {k: v[-1:] for k, v in sp["rows"].items()}
    else:
        sp_rows = sp["rows"]
    tok = AutoTokenizer.from_pretrained(server.tokenizer_path, local_files_only=True)
    tail = tok.encode(t["speculators"]["trains_after_end_of_turn"], add_special_tokens=False)
    assert tail, "SmolLM2's template writes a newline after <|im_end|>: speculators trains it"
    sp_diff = differing({k: v for k, v in sp_rows.items() if v}, rows, sf_rows, tail)
    skipped = [k for k, v in sp_rows.items() if not v]
    assert sp_diff == sf_diff and not skipped, (sp_diff, skipped)
    n_diff = sum(map(len, sf_diff.values()))
    print(
        f"\n{which}: conversation route, {len(sf_rows)} stop rows ({cut} `length` rows left "
        f"out): SpecForge trains kit's tokens on {len(sf_rows) - n_diff}, speculators on "
        f"{len(sf_rows) - n_diff} (plus its trailing {t['speculators']['trains_after_end_of_turn']!r}); "
        f"differing, counted in the manifest: {dict((k, len(v)) for k, v in sf_diff.items())}"
    )


def test_retokenized_answers_are_compared_on_a_sample_then_in_full(model_dir, monkeypatch):
    """count_retokenized compares the first RETOKENIZE_SAMPLE rows of a dataset, across
    batches; once one differs, every later row of that dataset is compared too."""
    import polars as pl

    from kit.report import trainers

    tok = AutoTokenizer.from_pretrained(model_dir)
    monkeypatch.setattr(trainers, "RETOKENIZE_SAMPLE", 2)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    canon = tok("hello world", add_special_tokens=False)["input_ids"]
    split = (
        tok("hel", add_special_tokens=False)["input_ids"]
        + tok("lo world", add_special_tokens=False)["input_ids"]
    )
    assert split != canon and tok.decode(split) == "hello world"
    ids = {"a": [canon] * 5, "b": [canon, split, split, canon, split]}
    rows = [
        {
            "dataset": d,
            "completion": "hello world",
            "reasoning": None,
            "tool_calls_json": None,
            "ids_source": "server",
            "finish_reason": "stop",
            "turns": None,
            "input_ids": [1, 2, *answer, eot],
            "loss_mask": [0, 0] + [1] * (len(answer) + 1),
        }
        for i in range(5)
        for d, answer in ((d, ids[d][i]) for d in ids)
    ]
    frame = pl.DataFrame(
        rows, schema_overrides={"input_ids": pl.List(pl.Int64), "loss_mask": pl.List(pl.Int8)}
    )
    out: dict = {}
    for batch in (frame.slice(0, 4), frame.slice(4)):  # rows 0-1 of each dataset, then the rest
        trainers.count_retokenized(tok, batch, out, keep=False)
    assert out == {
        "a": {"rows": 5, "compared": 2, "differ": 0, "compared_all": False},
        "b": {"rows": 5, "compared": 5, "differ": 3, "compared_all": True},
    }


def test_rows_without_answer_text_would_train_a_lone_end_of_turn(model_dir, tmp_path):
    """Tool-call-only and reasoning-only rows: SpecForge's own preprocessing of their
    conversation (kit's rendering of it) trains <|im_end|> alone after the assistant header,
    not the target's tokens. So kit's SpecForge JSONL leaves them out, counted in the
    manifest (trainers.no_text), and the token-id route trains the server's own ids."""
    from test_audit import make_record, plant_run

    tok = AutoTokenizer.from_pretrained(model_dir)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    call = {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    calls = [{"id": "c0", "type": "function", "function": call}]
    call_text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    recs = [
        make_record(tok, "mixed", 0, "What is the capital of France?", "Paris."),
        make_record(tok, "mixed", 1, "Weather in Oslo?", "", tool_calls=calls),
        make_record(tok, "mixed", 2, "Is 7 prime?", "", reasoning="7 has no divisors but 1 and 7"),
    ]
    recs[1].output_ids = tok.encode(call_text, add_special_tokens=False) + [eot]
    recs[2].output_ids = tok.encode(recs[2].reasoning, add_special_tokens=False) + [eot]
    for r in recs:
        r.completion_tokens = len(r.output_ids)
        r.prompt_ids = tok.encode(kit.tokens.render(tok, [r.messages])[0], add_special_tokens=False)
    run = plant_run(tmp_path / "run", recs, budgets={"mixed": 10_000}, tokenizer=str(model_dir))
    out = tmp_path / "out"
    result = kit.export(run, out, formats=("specforge", "token_ids"))
    assert kit.validate(out).ok
    ids = {r.key: row_id(_key(r)) for r in recs}
    sf = read_jsonl(out / "specforge/train.jsonl")
    assert [r["id"] for r in sf] == [ids[recs[0].key]]
    t = result.manifest["trainers"]
    assert t["no_text"]["rows"] == {
        "mixed": {"train": {"reasoning": 1, "tool_calls": 1}, "validation": {}}
    }
    # what SpecForge would train had they been written: kit's own rendering of the two rows
    bare = tmp_path / "bare"
    (bare / "specforge").mkdir(parents=True)
    lines = []
    for r in recs[1:]:
        conv = conversation(r.messages, r.completion, r.reasoning)
        conv = with_tool_calls(conv, {"tool_calls": r.tool_calls})
        lines.append(json.dumps({"id": ids[r.key], "conversations": conv}) + "\n")
    (bare / "specforge/train.jsonl").write_text("".join(lines))
    got = oracle(bare, model_dir, ["specforge_conv"], result.manifest)["specforge_conv"]
    assert got["pipeline_same"] and got["n"] == 2
    for r in recs[1:]:
        assert trained(*got["rows"][ids[r.key]]) == [eot], r.key  # a lone end-of-turn
    # the token-id route trains the server's ids of those answers, verbatim
    rows = {r["id"]: r for r in read_jsonl(out / "token_ids/train.jsonl")}
    by_ids = oracle(out, model_dir, ["specforge_ids"])["specforge_ids"]["rows"]
    for r in recs:
        row = rows[ids[r.key]]
        assert row["ids_source"] == "server" and row["input_ids"] == r.prompt_ids + r.output_ids
        assert trained(*by_ids[ids[r.key]]) == r.output_ids
    print(
        f"\nrows without answer text: SpecForge's conversation route trains {[eot]} alone on "
        f"each of {len(recs) - 1} (tool calls only, reasoning only): left out of the SpecForge "
        f"JSONL, counted; the token-id route trains their {[len(r.output_ids) for r in recs[1:]]} "
        "server ids"
    )


def _key(r) -> dict:
    return {"dataset": r.dataset, "prompt_id": r.prompt_id, "sample": r.sample}
