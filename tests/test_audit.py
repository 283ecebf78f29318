"""kit.audit on planted run directories: each planted problem is flagged, a clean run is not.

Run directories are planted through kit's own writer (RunStore), records and prompts given
by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

import kit
from kit.data.sources import prompt_id
from kit.report.audit import AuditThresholds, normalize_text
from kit.run.reader import read_config
from kit.run.store import RunStore
from kit.types import ErrorRecord, Record, RunConfig, Sampling

T0 = 1_700_000_000.0


def pid(text: str) -> str:
    """The prompt_id of a one-turn user prompt."""
    return prompt_id([{"role": "user", "content": text}])


def make_record(tok, dataset, i, prompt, completion, *, finish="stop", ids=True, **kw) -> Record:
    """A Record whose counts come from the real tokenizer (output_ids end with EOS on stop)."""
    messages = [{"role": "user", "content": prompt}]
    out = tok.encode(completion, add_special_tokens=False) if tok is not None else None
    if out is not None and finish == "stop":
        out = out + [tok.eos_token_id]
    fields = dict(
        dataset=dataset,
        prompt_id=pid(prompt),
        sample=0,
        messages=messages,
        completion=completion,
        finish_reason=finish,
        completion_tokens=len(out) if out is not None else max(1, len(completion.split())),
        count_source="server_ids" if ids else "usage",
        output_ids=out if ids else None,
        endpoint="http://127.0.0.1:9/v1",
        latency_s=0.5,
        t_done=T0 + i,
    )
    fields.update(kw)
    return Record(**fields)


def plant_run(
    run_dir: Path,
    records: list[Record],
    *,
    budgets: dict[str, int],
    errors=(),
    prompts: dict[str, list[str]] | None = None,
    max_tokens: int = 64,
    tokenizer: str | None = None,
    api_key_env: str | None = None,
) -> Path:
    """Write a run directory through kit's own writer (RunStore): the records' prompts (their
    prompt_id set to the hash of their messages and tools), `prompts` more, then the records
    and errors."""
    cfg = RunConfig(
        model="smollm2-135m",
        endpoints=["http://127.0.0.1:9/v1"],
        sampling=Sampling(max_tokens=max_tokens, temperature=0.0, seed=1),
        budgets=budgets,
        tokenizer=tokenizer,
        api_key_env=api_key_env,
        chat_template_hash="planted",
    )
    rows = []
    for r in records:
        tools = json.dumps(r.tools, separators=(",", ":")) if r.tools else None
        r.prompt_id = prompt_id(r.messages, tools)
        rows.append(
            {
                "dataset": r.dataset,
                "prompt_id": r.prompt_id,
                "messages": r.messages,
                "tools": tools,
                "n_turns": 1,
                "row": 0,
            }
        )
    for ds, ps in (prompts or {}).items():
        rows += [
            {
                "dataset": ds,
                "prompt_id": pid(p),
                "messages": [{"role": "user", "content": p}],
                "tools": None,
                "n_turns": 1,
                "row": i,
            }
            for i, p in enumerate(ps)
        ]
    store = RunStore(run_dir)
    store.init(cfg, pl.DataFrame(rows, schema=PROMPT_SCHEMA) if rows else None)
    for r in records:
        store.append(r)
    for e in errors:
        store.append_error(e)
    store.close()
    return run_dir


PROMPT_SCHEMA = {
    "dataset": pl.String,
    "prompt_id": pl.String,
    "messages": pl.List(pl.Struct({"role": pl.String, "content": pl.String})),
    "tools": pl.String,
    "n_turns": pl.Int64,
    "row": pl.Int64,
}


ANSWERS = [
    "Paris is the capital of France.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "A haiku has three lines of five, seven and five syllables.",
    "Photosynthesis turns light, water and carbon dioxide into sugar.",
    "The Pacific is the largest ocean on Earth.",
    "Binary search halves the interval at every step.",
]


def clean_records(tok, dataset="clean", n=6):
    return [
        make_record(tok, dataset, i, f"Question {dataset} number {i}?", ANSWERS[i])
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def tok(model_dir):
    return kit.tokens.load_tokenizer(model_dir)


@pytest.fixture
def messy_run(tmp_path, tok):
    recs = clean_records(tok, "messy", 3)
    long_prompt = "Explain in detail how a hash map resolves collisions between keys."
    recs += [
        make_record(
            tok, "messy", 10, "Write a long story.", "Once upon a time there", finish="length"
        ),
        make_record(tok, "messy", 11, "Say nothing.", "   "),
        make_record(tok, "messy", 12, "Repeat fact one.", ANSWERS[0]),  # exact copy of record 0
        make_record(
            tok,
            "messy",
            13,
            "Repeat fact two.",
            "WATER boils at one hundred degrees celsius, at sea level!!",
        ),
        make_record(tok, "messy", 14, long_prompt, long_prompt + " It uses chaining."),  # echo
    ]
    bad_ids = make_record(tok, "messy", 15, "Name a color.", "Blue is a color.")
    bad_ids.output_ids = tok.encode("Red is a color.", add_special_tokens=False) + [
        tok.eos_token_id
    ]
    bad_len = make_record(tok, "messy", 16, "Name a fruit.", "An apple is a fruit.")
    bad_len.completion_tokens += 3
    recs += [bad_ids, bad_len]
    words = ["alpha", "beta", "gamma", "delta", "omega"]
    recs += [
        make_record(
            tok,
            "over",
            20 + i,
            f"Over {i}",
            f"{w} " * 60,
            finish="length",
            ids=False,
            completion_tokens=64,
        )
        for i, w in enumerate(words)
    ]
    errors = [ErrorRecord("messy", pid(f"failed {i}"), 0, "http_5xx: 503", 5, T0) for i in range(2)]
    prompts = {
        "messy": [r.messages[0]["content"] for r in recs if r.dataset == "messy"]
        + [f"failed {i}" for i in range(2)]
        + ["never run"]
    }
    prompts["over"] = [f"Over {i}" for i in range(8)]
    budgets = {"messy": 5000, "over": 100}
    return plant_run(tmp_path / "messy", recs, budgets=budgets, errors=errors, prompts=prompts)


@pytest.fixture
def clean_run(tmp_path, tok):
    recs = clean_records(tok)
    tokens = sum(r.completion_tokens for r in recs)
    prompts = {"clean": [r.messages[0]["content"] for r in recs]}
    return plant_run(tmp_path / "clean", recs, budgets={"clean": tokens}, prompts=prompts)


def test_normalize_text():
    assert normalize_text("Hello,  World! 42\n") == "hello world"
    assert normalize_text("WATER boils at 100!") == normalize_text("water boils at")


def test_thresholds_validate():
    with pytest.raises(ValueError, match="truncation_share.*1.5"):
        AuditThresholds(truncation_share=1.5)
    with pytest.raises(ValueError, match="echo_min_chars"):
        AuditThresholds(echo_min_chars=-1)
    with pytest.raises(ValueError, match="error_rate"):
        AuditThresholds(error_rate=float("nan"))


@pytest.mark.server
def test_messy_run_flags_each_problem(messy_run, tok):
    report = kit.audit(messy_run, tokenizer=tok)
    found = {(f["dataset"], f["check"]) for f in report.findings.iter_rows(named=True)}
    expected = {
        ("messy", "truncation"),
        ("messy", "empty"),
        ("messy", "duplicate_exact"),
        ("messy", "duplicate_near"),
        ("messy", "echo"),
        ("messy", "ids_text_mismatch"),
        ("messy", "ids_len_mismatch"),
        ("messy", "error_rate"),
        ("messy", "under_budget"),
        ("over", "over_budget"),
        ("over", "truncation"),
        ("over", "loop"),  # "alpha alpha ..." cut at max_tokens: a loop, told apart
    }
    assert found == expected, report.summary()
    assert not report.ok
    flags = report.records.filter(pl.col("dataset") == "messy").sort("t_done")
    assert flags["empty"].to_list()[4] and flags["dup_exact"].to_list()[5]
    assert flags["dup_near"].to_list()[6] and flags["echo"].to_list()[7]
    assert flags["ids_text_mismatch"].to_list()[8] and flags["ids_len_mismatch"].to_list()[9]
    assert (
        flags["dup_exact"].sum() == 1 and flags["dup_near"].sum() == 1
    )  # the originals are not flagged


@pytest.mark.server
def test_messy_run_numbers(messy_run, tok):
    report = kit.audit(messy_run, tokenizer=tok)
    row = report.datasets.filter(pl.col("dataset") == "messy").row(0, named=True)
    assert (row["records"], row["errors"], row["prompts_total"]) == (10, 2, 13)
    assert row["prompts_left"] == 3 and row["length"] == 1 and row["stop"] == 9
    assert row["error_rate"] == pytest.approx(2 / 12)
    over = report.findings.filter(pl.col("check") == "over_budget").row(0, named=True)
    assert over["value"] == 5 * 64 - 100 and over["threshold"] == 64 and over["severity"] == "error"
    lengths = report.lengths.filter(pl.col("dataset") == "over").row(0, named=True)
    assert (lengths["records"], lengths["mean"], lengths["max"]) == (5, 64.0, 64)
    finish = report.finish.filter(pl.col("dataset") == "messy")
    assert dict(finish.select("finish_reason", "count").iter_rows()) == {"stop": 9, "length": 1}
    text = report.summary()
    assert "over_budget" in text and "messy" in text and "<table" in report._repr_html_()


@pytest.mark.server
def test_clean_run_flags_nothing(clean_run, tok):
    report = kit.audit(clean_run, tokenizer=tok)
    assert report.findings.height == 0, report.summary()
    assert report.ok and report.notes == []
    row = report.datasets.row(0, named=True)
    assert row["ids_text_checked"] == 6 and row["server_ids"] == 6 and row["budget_share"] == 1.0
    assert "no findings" in report.summary()


def test_resolved_errors_and_missing_tokenizer(tmp_path):
    recs = [make_record(None, "d", i, f"q{i}", ANSWERS[i], ids=False) for i in range(3)]
    recs[0].output_ids = [1, 2, 3]
    recs[0].completion_tokens = 3
    # an error that a later resume resolved (its key now has a record) does not count
    errors = [ErrorRecord("d", recs[1].prompt_id, 0, "timeout: 30 s", 5, T0)]
    # every stored prompt is used: a budget the records meet (no short_of_budget)
    budgets = {"d": sum(r.completion_tokens for r in recs)}
    run = plant_run(tmp_path / "r", recs, budgets=budgets)
    report = kit.audit(run)
    assert report.findings.height == 0
    assert any("no tokenizer" in n for n in report.notes)
    assert report.records["ids_text_mismatch"].null_count() == 3
    resolved = kit.audit(plant_run(tmp_path / "r2", recs, budgets=budgets, errors=errors))
    assert resolved.datasets["errors"].to_list() == [0] and resolved.findings.height == 0
    errors.append(ErrorRecord("d", pid("never answered"), 0, "timeout: 30 s", 5, T0))
    unresolved = kit.audit(plant_run(tmp_path / "r3", recs, budgets=budgets, errors=errors))
    assert unresolved.datasets["errors"].to_list() == [1]
    assert unresolved.findings["check"].to_list() == ["error_rate"]


def test_refused_duplicates_are_a_finding(tmp_path):
    """A second copy of a stored record is refused by the database and counted: the audit says so."""
    recs = [make_record(None, "d", i, f"q{i}", ANSWERS[i], ids=False) for i in range(3)]
    budgets = {"d": sum(r.completion_tokens for r in recs)}  # met: no budget finding
    run = plant_run(tmp_path / "r", recs, budgets=budgets)
    store = RunStore(run)
    store.init(read_config(run))
    for r in recs[:2]:  # written again, as a second writer or a runner bug would
        store.append(r)
    store.close()
    report = kit.audit(run)
    found = report.findings.row(0, named=True)
    assert (found["dataset"], found["check"], found["value"], found["severity"]) == (
        "(run)",
        "rejected_duplicates",
        2.0,
        "warn",
    )
    assert "2 records were refused as duplicates" in report.summary()
    assert report.datasets["records"].to_list() == [3]


# ---------------------------------------------------------------- audit charts


def chart_records(n=30):
    recs = []
    for i in range(n):
        ds = "chat" if i % 3 else "code"
        r = make_record(None, ds, i * 7, f"{ds} {i}", f"answer {chr(97 + i % 26)}", ids=False)
        r.completion_tokens, r.prompt_tokens = 10 + 5 * i, 20 + i
        r.finish_reason = "length" if i % 5 == 0 else "stop"
        recs.append(r)
    return recs


@pytest.fixture
def chart_run(tmp_path):
    return plant_run(tmp_path / "charts", chart_records(), budgets={"chat": 1500, "code": 400})


def _values(spec) -> list[dict]:
    return next(iter(spec["datasets"].values()))


def test_chart_specs(chart_run):
    from kit.report import charts

    report = kit.audit(chart_run)
    recs = report.records
    spec = charts.token_distributions(report).to_dict()
    hist, box = spec["hconcat"]
    assert hist["facet"]["row"]["field"] == "dataset"
    assert [layer["mark"]["type"] for layer in box["layer"]] == ["rule", "bar", "tick"]
    assert hist["spec"]["encoding"]["x"]["bin"] == "binned"  # bins counted in polars
    bars = spec["datasets"][hist["data"]["name"]]
    assert sum(v["count"] for v in bars) == 30 and {v["dataset"] for v in bars} == {"chat", "code"}
    spread = {v["dataset"]: v for v in spec["datasets"][box["data"]["name"]]}
    assert (
        spread["code"]["max"] == recs.filter(pl.col("dataset") == "code")["completion_tokens"].max()
    )

    spec = charts.budget_vs_actual(report).to_dict()
    assert [layer["mark"]["type"] for layer in spec["layer"]] == ["bar", "tick", "text"]
    values = {v["dataset"]: v for v in _values(spec)}
    code_tokens = recs.filter(pl.col("dataset") == "code")["completion_tokens"].sum()
    assert values["code"]["tokens"] == code_tokens and values["code"]["budget"] == 400
    assert values["code"]["share"] == pytest.approx(code_tokens / 400)

    spec = charts.finish_reasons(recs).to_dict()
    assert spec["mark"]["type"] == "bar" and spec["encoding"]["color"]["field"] == "finish_reason"
    counts = {(v["dataset"], v["finish_reason"]): v["count"] for v in _values(spec)}
    assert counts == {
        ("chat", "stop"): 16,
        ("chat", "length"): 4,
        ("code", "stop"): 8,
        ("code", "length"): 2,
    }

    spec = charts.throughput(recs, bins=10).to_dict()
    assert spec["encoding"]["y"]["field"] == "tokens_per_s"
    width = (recs["t_done"].max() - (recs["t_done"] - recs["latency_s"]).min()) / 10
    steps = _values(spec)
    end = max(v["minutes"] for v in steps)  # each dataset's last point closes its last step
    total = sum(v["tokens_per_s"] for v in steps if v["minutes"] < end) * width
    assert total == pytest.approx(recs["completion_tokens"].sum())  # every token drawn once

    spec = charts.completion_vs_prompt(recs).to_dict()
    assert (spec["encoding"]["x"]["field"], spec["encoding"]["y"]["field"]) == (
        "prompt_tokens",
        "completion_tokens",
    )
    assert len(_values(spec)) == 30


@pytest.mark.slow
def test_charts_render_png(chart_run, tmp_path):
    import vl_convert as vlc

    from kit.report import charts

    report = kit.audit(chart_run)
    builders = [
        charts.token_distributions,
        charts.budget_vs_actual,
        charts.finish_reasons,
        charts.throughput,
        charts.completion_vs_prompt,
    ]
    for build in builders:
        png = vlc.vegalite_to_png(build(report).to_json(), scale=1)
        assert png[:8] == b"\x89PNG\r\n\x1a\n", build.__name__
        assert len(png) > 5_000, (build.__name__, len(png))


# ---------------------------------------------------------------- thinking models, all_turns


def test_reasoning_finish_class_and_think_markers(tmp_path):
    recs = [make_record(None, "r", i, f"q{i}", ANSWERS[i], ids=False) for i in range(4)]
    recs[0].finish_reason, recs[0].completion, recs[0].reasoning = "length", "", "Let me see..."
    recs[1].finish_reason, recs[1].reasoning = "length", "Short thought."  # truncated answer
    recs[2].completion = "<think>plan</think> Paris."  # the parser did not split it
    run = plant_run(tmp_path / "run", recs, budgets={"r": 10_000})
    report = kit.audit(run)
    finish = dict(report.finish.select("finish_reason", "count").iter_rows())
    assert finish == {"stop": 2, "length": 1, "length_in_reasoning": 1}
    row = report.datasets.row(0, named=True)
    assert (row["length"], row["length_in_reasoning"], row["think_markers"], row["reasoning"]) == (
        2,
        1,
        1,
        2,
    )
    found = {f["check"]: f["message"] for f in report.findings.iter_rows(named=True)}
    msg = found["reasoning_only"]  # named as such, never plain "empty"
    assert msg.startswith("1 of 4 records (25.0%) are reasoning only") and "empty" not in found
    assert "0 ended the turn" in msg and "1 cut at max_tokens inside it" in msg
    assert "<think> / </think>" in found["think_markers"]
    assert report.records["finish_class"].to_list()[:2] == ["length_in_reasoning", "length"]


def test_all_turns_counts_are_checked_per_turn(tmp_path):
    """completion_tokens counts every generated turn, output_ids only the last one."""
    rec = make_record(None, "m", 0, "q", "last answer", ids=False)
    rec.output_ids, rec.count_source = list(range(60)), "server_ids"
    turns = [
        {
            "content": "a",
            "reasoning": None,
            "finish_reason": "stop",
            "completion_tokens": 50,
            "count_source": "server_ids",
            "output_ids": list(range(50)),
            "prompt_ids": [1],
        }
    ]
    rec.turns, rec.completion_tokens = turns, 110  # > max_tokens + 1, but no turn is
    bad = make_record(None, "m", 1, "q2", "other answer", ids=False)
    bad.output_ids, bad.count_source = list(range(10)), "server_ids"
    bad.turns = [dict(turns[0], output_ids=list(range(49)))]  # this turn's ids miss one
    bad.completion_tokens = 60
    run = plant_run(tmp_path / "run", [rec, bad], budgets={"m": 10_000})
    flags = kit.audit(run).records.sort("t_done")
    assert flags["count_over_max"].to_list() == [False, False]
    assert flags["ids_len_mismatch"].to_list() == [False, True]


def test_ids_spell_with_reasoning():
    from kit.tokens import ids_spell

    class Tok:  # ids index a tiny vocabulary; 0 is the only special token
        all_special_ids = [0]
        vocab = ["<eos>", "<think>", "\nplan\n", "</think>", "\n\n", "Paris"]

        def decode(self, ids, skip_special_tokens=False):
            return "".join(self.vocab[i] for i in ids if not (skip_special_tokens and i == 0))

    ids = [1, 2, 3, 4, 5, 0]
    assert ids_spell(Tok(), ids, "Paris", "plan")
    assert not ids_spell(Tok(), ids, "Paris")  # without the reasoning it is no match
    assert not ids_spell(Tok(), ids, "Rome", "plan")
    assert not ids_spell(Tok(), ids, "Paris", "other thoughts")
    assert ids_spell(Tok(), [5, 0], "Paris")


def spoil_page(run_dir: Path, table: str) -> None:
    """Overwrite the root page of one table or index of a closed run database with garbage."""
    import random
    import sqlite3

    path = run_dir / "run.sqlite"
    conn = sqlite3.connect(path)
    size = conn.execute("PRAGMA page_size").fetchone()[0]
    root = conn.execute("SELECT rootpage FROM sqlite_schema WHERE name = ?", (table,)).fetchone()[0]
    conn.close()
    with open(path, "r+b") as f:
        f.seek((root - 1) * size)
        f.write(random.Random(7).randbytes(size))


def test_integrity_check_failure_is_a_finding(tmp_path):
    """Damage the records' key index only: the records still read, SQLite's check fails."""
    recs = [make_record(None, "d", i, f"q{i}", ANSWERS[i], ids=False) for i in range(3)]
    run = plant_run(tmp_path / "r", recs, budgets={"d": 10_000})
    spoil_page(run, "sqlite_autoindex_records_1")
    report = kit.audit(run)
    assert report.records.height == 3
    found = report.findings.filter(pl.col("check") == "database_integrity").row(0, named=True)
    assert found["dataset"] == "(run)" and found["severity"] == "error" and not report.ok
    assert (
        "fails SQLite's integrity check" in found["message"]
        and "Restore it from a copy" in found["message"]
    )


def test_no_record_ids_are_read_unless_the_draft_vocabulary_is_asked_for(tmp_path, monkeypatch):
    """Without draft_vocab (and without a tokenizer sample) the ids' counts come from SQL:
    the ids are never decoded, and a count that disagrees is still flagged."""
    import kit.run.reader as reader

    recs = [make_record(None, "d", i, f"q{i}", ANSWERS[i], ids=False) for i in range(3)]
    recs[0].output_ids, recs[0].completion_tokens = [1, 2, 3], 3
    recs[1].output_ids, recs[1].completion_tokens = [4, 5], 3  # 2 ids, counted 3
    run = plant_run(tmp_path / "r", recs, budgets={"d": 10_000})
    real = reader.ids_series

    def refuse(*args, **kw):
        raise AssertionError("token ids decoded")

    monkeypatch.setattr(reader, "ids_series", refuse)
    report = kit.audit(run)
    assert report.draft_vocab is None and "draft vocabulary" not in report.summary()
    flags = report.records.sort("prompt_id").select("prompt_id", "has_ids", "ids_len_mismatch")
    got = {r[0]: r[1:] for r in flags.iter_rows()}
    assert got == {
        recs[0].prompt_id: (True, False),
        recs[1].prompt_id: (True, True),
        recs[2].prompt_id: (False, False),
    }
    assert "PRAGMA quick_check" in report.summary().splitlines()[-1]
    monkeypatch.setattr(reader, "ids_series", real)
    table = kit.audit(run, draft_vocab=4).draft_vocab
    assert table["dataset"].to_list() == ["d", "TOTAL"]  # asked for: the ids are read
