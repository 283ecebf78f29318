"""kit.audit at scale: the streamed, vectorized audit against the whole-frame Python checks
it replaced, the sampled tokenizer checks, and charts that hold aggregates, not records.

The reference (`old_flags`) is the per-record Python computation kit.audit used before it
streamed: every record read into one frame, normalize_text / difflib / finish_class /
think markers / turns parsing per record, the tokenizer checks on every record.
"""

from __future__ import annotations

import difflib

import polars as pl
import pytest
from test_audit import ANSWERS, T0, make_record, pid

import kit
from kit.report import audit as audit_mod
from kit.report import charts
from kit.report.exactrows import prompt_ids_differ
from kit.report.findings import findings as findings_frame
from kit.report.flags import (
    AuditThresholds,
    _count_flags,
    call_attempt,
    finish_class,
    normalize_text,
    tail_ratio,
)
from kit.report.textchecks import (
    HASH_SEED,
    THINK_MARKERS,
    TextSample,
    ids_text_flags,
    under_reported_flags,
)
from kit.run.reader import errors_frame, read_config, records_frame
from kit.run.store import RunStore
from kit.types import ErrorRecord, RunConfig, Sampling

FLAGS = [
    "empty",
    "dup_exact",
    "dup_near",
    "echo",
    "has_ids",
    "ids_len_mismatch",
    "ids_text_mismatch",
    "under_reported",
    "count_over_max",
    "finish_class",
    "think_marker",
    "has_reasoning",
    "reasoning_only",
    "loop",
    "tools_sent",
    "call_attempt",
    "prompt_ids_differ",
]


def _last_user(messages) -> str:
    for m in reversed(messages or []):
        if m["role"] == "user":
            return m["content"] or ""
    return ""


def old_is_echo(user: str, completion: str, th: AuditThresholds) -> bool:
    u, c = normalize_text(user), normalize_text(completion)
    if len(u) < th.echo_min_chars or not c:
        return False
    if c.startswith(u):
        return True
    if 2 * min(len(u), len(c)) / (len(u) + len(c)) < th.echo_similarity:
        return False
    return difflib.SequenceMatcher(None, u, c, autojunk=False).ratio() >= th.echo_similarity


def old_flags(records, tokenizer, th: AuditThresholds, max_tokens):
    """The whole-frame, per-record Python flags kit.audit computed before it streamed."""
    recs = records.with_row_index("_row").sort("t_done", maintain_order=True)
    texts, reasoning = recs["completion"].to_list(), recs["reasoning"].to_list()
    pairs = zip(recs["messages"].to_list(), texts, strict=True)
    len_bad, over, n_earlier, n_length = _count_flags(recs, max_tokens)
    fin = zip(recs["finish_reason"].to_list(), texts, reasoning, strict=True)
    calls = [bool(c) for c in recs["tool_calls"].to_list()]
    thought = [bool((r or "").strip()) for r in reasoning]
    tools = [t if t and t.strip() not in ("", "[]") else None for t in recs["tools"].to_list()]
    answers = [t if t.strip() else (r or "") for t, r in zip(texts, reasoning, strict=True)]
    blank = [not t.strip() and not c for t, c in zip(texts, calls, strict=True)]
    prompts = recs.select("dataset", "messages", "tools", "prompt_ids").to_dicts()
    differ = prompt_ids_differ(tokenizer, [p for p in prompts if p["prompt_ids"] is not None])
    differ.reverse()
    recs = recs.with_columns(
        pl.Series("empty", [b and not r for b, r in zip(blank, thought, strict=True)]),
        pl.Series("reasoning_only", [b and r for b, r in zip(blank, thought, strict=True)]),
        pl.Series("loop", [(tail_ratio(a) or 1) <= th.loop_ratio for a in answers]),
        pl.Series("tools_sent", [t is not None for t in tools], dtype=pl.Boolean),
        pl.Series(
            "call_attempt",
            [
                t is not None and not c and bool(x.strip()) and call_attempt(x, t)
                for x, c, t in zip(texts, calls, tools, strict=True)
            ],
            dtype=pl.Boolean,
        ),
        pl.Series(
            "prompt_ids_differ",
            [None if p["prompt_ids"] is None else differ.pop() for p in prompts],
            dtype=pl.Boolean,
        ),
        pl.Series("_norm", [normalize_text(t) for t in texts], dtype=pl.String),
        pl.Series("echo", [old_is_echo(_last_user(m), c, th) for m, c in pairs], dtype=pl.Boolean),
        pl.Series("ids_len_mismatch", len_bad, dtype=pl.Boolean),
        pl.Series("count_over_max", over, dtype=pl.Boolean),
        pl.Series("finish_class", [finish_class(*x) for x in fin], dtype=pl.String),
        pl.Series(
            "think_marker", [any(m in t for m in THINK_MARKERS) for t in texts], dtype=pl.Boolean
        ),
        pl.Series("earlier_turns", n_earlier, dtype=pl.Int64),
        pl.Series("earlier_length", n_length, dtype=pl.Int64),
        has_ids=pl.col("output_ids").is_not_null(),
        has_reasoning=pl.col("reasoning").fill_null("").str.strip_chars() != "",
        has_tool_calls=pl.col("tool_calls").fill_null("") != "",
    )
    first_exact = pl.int_range(pl.len()).over(["dataset", "completion"]) > 0
    first_norm = pl.int_range(pl.len()).over(["dataset", "_norm"]) > 0
    recs = recs.with_columns(
        dup_exact=~pl.col("empty") & first_exact,
        dup_near=~pl.col("empty") & (pl.col("_norm") != "") & first_norm & ~first_exact,
    )
    recs = recs.with_columns(
        ids_text_flags(recs, tokenizer),
        under_reported_flags(recs, tokenizer, th.under_report_ratio),
    )
    return recs.sort("_row").drop("_row", "_norm")


def old_tables(run_dir, tokenizer, th: AuditThresholds):
    """(datasets, finish, findings, flags) the whole-frame way."""
    config = read_config(run_dir)
    records = records_frame(run_dir)
    max_tokens = config.sampling.max_tokens
    flags = old_flags(records, tokenizer, th, max_tokens)
    totals, _ = audit_mod._run_counts(run_dir)
    table = audit_mod._dataset_table(flags, config, errors_frame(run_dir), totals)
    findings = findings_frame(table, th, max_tokens)
    return table, audit_mod._finish_table(flags), findings, flags


@pytest.fixture(scope="module")
def tok(model_dir):
    return kit.tokens.load_tokenizer(model_dir)


# ---------------------------------------------------------------- a run with every problem

HINDI = "नमस्ते दुनिया, यह एक परीक्षण वाक्य है जो काफी लंबा है"
HINDI_NEAR = "नमस् ते दुनि या यह एक परी क्षण वा क्य है जो का फी लं बा है!!"
GREEK = "ΟΔΟΣ ΚΑΙ ΣΟΦΙΑ ΕΙΝΑΙ ΚΑΛΑ ΠΡΑΓΜΑΤΑ ΓΙΑ ΟΛΟΥΣ"


def _records(tok):
    """Records planting each check, in file order (t_done not always increasing)."""
    long_prompt = "Explain in detail how a hash map resolves collisions between keys."
    near_prompt = "Describe the water cycle from evaporation to rain in a few words."
    specs = [  # dataset, i (t_done offset), prompt, completion, extra fields
        ("a", 0, "q0", ANSWERS[0], {}),
        ("a", 1, "q1", ANSWERS[1], {}),
        ("a", 2, "q2", ANSWERS[0], {}),  # exact duplicate of a/0
        ("a", 3, "q3", "WATER boils at 100 degrees celsius at sea level!!", {}),
        ("a", 4, "q4", "Ｗａｔｅｒ boils at one hundred degrees Celsius at sea level.", {}),
        ("a", 5, long_prompt, long_prompt + " It uses chaining.", {}),  # echo (prefix)
        ("a", 6, near_prompt, near_prompt.replace("evaporation", "evaporating"), {}),  # difflib
        ("a", 7, "q7", "<think>plan</think> Paris.", {}),
        ("a", 8, "q8", "", {"finish": "length", "reasoning": "Let me see..."}),
        ("a", 9, "q9", "   ", {}),
        ("a", 10, "q10", "\x1c\u3000", {}),  # blank to Python's str.strip()
        ("a", 11, "q11", "x² and y³", {}),
        ("a", 12, "q12", "x and y", {}),  # near duplicate of a/11 (NFKC: ² -> 2, dropped)
        ("a", 13, "q13", HINDI, {}),
        ("a", 14, "q14", HINDI_NEAR, {}),
        ("a", 15, "q15", GREEK, {}),
        ("a", 16, "q16", GREEK.lower(), {}),
        ("a", 17, "q17", "truncated story", {"finish": "length", "reasoning": "short"}),
        ("b", 5, "b5", ANSWERS[2], {}),  # file order: b5 before b1; t_done: b1 first
        ("b", 1, "b1", ANSWERS[2], {}),
        ("b", 1, "b1x", ANSWERS[3], {}),  # a t_done tie: file order decides
        ("b", 1, "b1y", ANSWERS[3], {}),
        ("b", 2, "b2", ANSWERS[4] + "!", {}),
        ("b", 3, "b3", ANSWERS[4] + "?", {}),
    ]
    recs = []
    for ds, i, prompt, text, extra in specs:
        r = make_record(tok, ds, i, prompt, text, finish=extra.get("finish", "stop"))
        r.reasoning = extra.get("reasoning")
        recs.append(r)
    bad_ids = make_record(tok, "a", 20, "Name a color.", "Blue is a color.")
    bad_ids.output_ids = tok.encode("Red is a color.", add_special_tokens=False)
    liar = make_record(tok, "a", 21, "Tell a long tale.", " ".join(ANSWERS), ids=False)
    liar.completion_tokens = 3  # far below the text's own count
    recs += [bad_ids, liar]
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
    plan = [(60, 50, 110), (10, 49, 60), (150, 50, 200)]  # ok, a turn's ids miss one, over max
    for k, (last_ids, turn_ids, count) in enumerate(plan):
        r = make_record(
            None, "m", 30 + k, f"multi {k}", f"final {('alpha', 'beta', 'gamma')[k]}", ids=False
        )
        r.messages = [
            {"role": "user", "content": f"multi {k}"},
            {"role": "assistant", "content": "old"},
            {"role": "user", "content": "and then?"},
        ]
        r.output_ids, r.count_source = list(range(last_ids)), "server_ids"
        r.turns, r.completion_tokens = [dict(turns[0], output_ids=list(range(turn_ids)))], count
        recs.append(r)
    return recs


@pytest.fixture
def hostile_run(tmp_path, tok):
    """A run written by RunStore holding every planted problem, and an error."""
    recs = _records(tok)
    prompts = [
        {
            "dataset": r.dataset,
            "prompt_id": r.prompt_id,
            "messages": r.messages,
            "n_turns": len(r.messages),
            "row": i,
        }
        for i, r in enumerate(recs)
    ]
    config = RunConfig(
        model="smollm2-135m",
        endpoints=["http://127.0.0.1:9/v1"],
        budgets={"a": 2000, "b": 40, "m": 500},
        sampling=Sampling(max_tokens=64, seed=1),
    )
    run_dir = tmp_path / "run"
    store = RunStore(run_dir)
    store.init(config, pl.DataFrame(prompts))
    for r in recs:
        store.append(r)
    store.append_error(ErrorRecord("b", pid("never"), 0, "http_5xx: 503", 5, T0))
    store.close()
    return run_dir


@pytest.mark.parametrize("batch_size", [3, 20_000])
def test_streamed_audit_equals_the_whole_frame_checks(hostile_run, tok, monkeypatch, batch_size):
    monkeypatch.setattr(audit_mod, "BATCH_SIZE", batch_size)
    assert normalize_text(HINDI) == normalize_text(HINDI_NEAR)  # the planted near duplicate
    th = AuditThresholds()
    report = kit.audit(hostile_run, tokenizer=tok, thresholds=th)
    table, finish, findings, flags = old_tables(hostile_run, tok, th)
    assert report.datasets.equals(table.select(report.datasets.columns))
    assert report.finish.equals(finish)
    assert report.findings.equals(findings), report.summary()
    recs, keys = _records(tok), ["dataset", "prompt_id", "sample"]
    new = report.records.select(keys + FLAGS)
    assert new.equals(flags.select(keys + FLAGS))
    assert {"completion", "messages", "output_ids", "reasoning"}.isdisjoint(report.records.columns)
    # every planted problem is there (the comparison above is not of two empty sets)
    got = {
        c: report.records.filter(pl.col(c))["prompt_id"].to_list()
        for c in FLAGS[:9]
        if c != "has_ids"
    }
    assert got["dup_exact"] == [pid("q2"), pid("b5"), pid("b1y")]
    assert got["dup_near"] == [pid("q4"), pid("q12"), pid("q14"), pid("q16"), pid("b3")]
    echoes = ("Explain in detail how", "Describe the water cycle")
    assert got["echo"] == [
        next(r.prompt_id for r in recs if r.messages[0]["content"].startswith(e)) for e in echoes
    ]
    assert got["empty"] == [pid("q9"), pid("q10")]  # q8 holds reasoning: reasoning_only
    assert report.records.filter(pl.col("reasoning_only"))["prompt_id"].to_list() == [pid("q8")]
    assert got["ids_len_mismatch"] == [pid("Name a color."), pid("multi 1")]
    assert got["count_over_max"] == [pid("q15"), pid("multi 2")]  # Greek capitals: many tokens
    # ids without the reasoning (q8, q17), other ids (a color), made-up ids (multi-turn)
    assert got["ids_text_mismatch"] == [
        pid(p) for p in ("q8", "q17", "Name a color.", "multi 0", "multi 1", "multi 2")
    ]
    assert got["under_reported"] == [pid("Tell a long tale.")]
    assert report.records.filter(pl.col("think_marker"))["prompt_id"].to_list() == [pid("q7")]
    assert "length_in_reasoning" in report.records["finish_class"].to_list()
    assert report.datasets.filter(pl.col("dataset") == "a")["records"].item() == 20


def test_texts_of_flagged_records_are_read_back(hostile_run, tok):
    report = kit.audit(hostile_run, tokenizer=tok)
    echoed = report.records.filter(pl.col("echo"))
    texts = report.texts(echoed)
    assert texts["prompt_id"].to_list() == echoed["prompt_id"].to_list()
    assert texts["completion"].to_list()[0].endswith("It uses chaining.")
    assert texts["messages"].to_list()[0][0]["content"].startswith("Explain in detail")
    one = audit_mod.record_texts(hostile_run, [("b", pid("b1"), 0)], columns=["completion"])
    assert one.to_dicts() == [
        {"dataset": "b", "prompt_id": pid("b1"), "sample": 0, "completion": ANSWERS[2]}
    ]


# ---------------------------------------------------------------- the sampled tokenizer checks


@pytest.mark.parametrize("batch_size", [4, 5000])
def test_tokenizer_checks_run_on_a_seeded_sample_and_say_how_many(
    tmp_path, tok, monkeypatch, batch_size
):
    """With 4-record batches the first dataset's sample is checked while the second is read."""
    from test_audit import plant_run

    monkeypatch.setattr(audit_mod, "BATCH_SIZE", batch_size)
    early, check = [], TextSample.check

    def spy(self, tokenizer, ratio, datasets=None):
        early.append(datasets)
        return check(self, tokenizer, ratio, datasets)

    monkeypatch.setattr(TextSample, "check", spy)
    recs = [make_record(tok, "big", i, f"q{i}", ANSWERS[i % 6] + f" {i}") for i in range(40)]
    for r in recs:  # every record's ids are wrong and its count under-reported
        r.output_ids = tok.encode("Something else entirely.", add_special_tokens=False)
        r.completion_tokens = len(r.output_ids)
        r.completion = " ".join(ANSWERS) + f" {r.t_done}"
    recs += [make_record(tok, "small", 100 + i, f"s{i}", ANSWERS[i]) for i in range(5)]
    run = plant_run(tmp_path / "run", recs, budgets={"big": 10_000, "small": 10_000})
    th = AuditThresholds(text_check_sample=7)
    report = kit.audit(run, tokenizer=tok, thresholds=th)
    # a dataset is checked once its committed count is read; `checks` then finds nothing left
    assert early == ([{"big"}, {"small"}, None] if batch_size == 4 else [{"big", "small"}, None])
    big = report.datasets.filter(pl.col("dataset") == "big").row(0, named=True)
    assert (big["ids_text_checked"], big["ids_text_mismatch"], big["with_ids"]) == (7, 7, 40)
    assert (big["count_checked"], big["under_reported"], big["countable"]) == (7, 7, 40)
    small = report.datasets.filter(pl.col("dataset") == "small").row(0, named=True)
    assert (small["ids_text_checked"], small["count_checked"]) == (5, 5)  # all of a small one
    rows = {f["check"]: f for f in report.findings.iter_rows(named=True) if f["dataset"] == "big"}
    assert (
        "7 of 7 records with ids checked (a seeded sample of 40)"
        in rows["ids_text_mismatch"]["message"]
    )
    assert "seeded sample of 7 of 40" in rows["count_under_reported"]["message"]
    assert [n for n in report.notes if n.startswith("big:")] == [
        "big: tokenizer checks on a seeded sample: ids decoded on 7 of 40 records with ids; "
        "counts re-tokenized on 7 of 40 records"
    ]
    assert not any(n.startswith("small:") for n in report.notes)
    checked = report.records.filter(pl.col("ids_text_mismatch").is_not_null())["prompt_id"]
    # the sample is the 7 smallest key hashes of each dataset, whatever the batches
    prio = report.records.select(
        "dataset", "prompt_id", h=pl.struct("dataset", "prompt_id", "sample").hash(HASH_SEED)
    )
    want = prio.filter(pl.col("h").rank("ordinal").over("dataset") <= 7)["prompt_id"]
    assert sorted(checked.to_list()) == sorted(want.to_list())
    full = kit.audit(run, tokenizer=tok, thresholds=AuditThresholds(text_check_sample=None))
    assert full.datasets.filter(pl.col("dataset") == "big")["ids_text_checked"].item() == 40
    assert not any("seeded sample" in n for n in full.notes)


def test_text_check_sample_is_validated():
    with pytest.raises(ValueError, match="text_check_sample"):
        AuditThresholds(text_check_sample=0)
    with pytest.raises(ValueError, match="text_check_sample"):
        AuditThresholds(text_check_sample=2.5)


# ---------------------------------------------------------------- charts of aggregates


def test_charts_hold_aggregates_not_records(tmp_path):
    from test_audit import plant_run

    recs = []
    for i in range(900):
        ds = ("x", "y", "z")[i % 3]
        r = make_record(None, ds, i, f"{ds} {i}", f"answer {i}", ids=False)
        r.completion_tokens, r.prompt_tokens = 1 + (i * 37) % 500, 10 + i % 90
        r.finish_reason = "length" if i % 7 == 0 else "stop"
        recs.append(r)
    run = plant_run(tmp_path / "run", recs, budgets={"x": 10**6, "y": 10**6, "z": 10**6})
    report = kit.audit(run)
    assert report.records.height == 900
    bins, datasets = 12, 3

    def rows(chart) -> dict[str, int]:
        return {name: len(v) for name, v in chart.to_dict()["datasets"].items()}

    sizes = rows(charts.token_distributions(report, bins=bins))
    assert max(sizes.values()) <= bins * datasets and min(sizes.values()) == datasets
    hist = charts.token_distributions(report, bins=bins).to_dict()
    bars = hist["datasets"][hist["hconcat"][0]["data"]["name"]]
    assert sum(v["count"] for v in bars) == 900
    assert max(rows(charts.throughput(report, bins=bins)).values()) <= (bins + 1) * datasets
    assert max(rows(charts.finish_reasons(report)).values()) <= 2 * datasets
    assert max(rows(charts.completion_vs_prompt(report, max_points=50)).values()) == 50
    assert max(rows(charts.budget_vs_actual(report)).values()) == datasets


def test_normalized_matches_normalize_text():
    from kit.report.flags import normalized

    texts = [
        "Hello,  World! 42",
        "  lead and trail  ",
        "a\tb\n\nc",
        "tabs\t \t",
        "x² y³ ½",
        "Ｆｕｌｌｗｉｄｔｈ ＡＢＣ",
        "ﬁne ligature …",
        "snake_case and-dash",
        "ΟΔΟΣ ΣΟΦΟΣ",
        HINDI,
        "e\u0301 cafe\u0301",
        "Ⅻ roman Ⅷ",
        "",
        "!!!",
        "   ",
        "a  b",
        "a , b",
        "emoji 🙂 ok",
        "İstanbul",
        "straße",
        "\x1c\x1d sep",
        "a.b,c;d",
    ]
    got = normalized(pl.Series(texts + [None])).to_list()
    assert got == [normalize_text(t) for t in texts] + [""]


def lcs_len(a: str, b: str) -> int:
    """The longest common subsequence's length from rapidfuzz's Indel distance, as the echo
    check's bound (kit.report.flags._mostly_equal) reads it."""
    from rapidfuzz.distance import Indel

    return (len(a) + len(b) - Indel.distance(a, b)) // 2


def test_lcs_len_is_the_longest_common_subsequence_and_bounds_difflib():
    import random

    def dp(a: str, b: str) -> int:
        prev = [0] * (len(b) + 1)
        for x in a:
            cur = [0]
            for j, y in enumerate(b):
                cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
            prev = cur
        return prev[-1]

    rng = random.Random(5)
    for _ in range(500):
        a = "".join(rng.choice("abé ") for _ in range(rng.randint(0, 40)))
        b = "".join(rng.choice("abé ") for _ in range(rng.randint(0, 40)))
        n = lcs_len(a, b)
        assert n == dp(a, b) == lcs_len(b, a), (a, b)
        blocks = difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks()
        assert sum(m.size for m in blocks) <= n
