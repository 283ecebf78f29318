"""The context guard: prompts too long for the target are skipped, counted and listed, never sent."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sqlite3

import polars as pl
import pytest
from faultserver import FaultConfig, FaultServer

import kit
from kit.run import guard
from kit.run.guard import model_context
from kit.run.progress import progress
from kit.run.reader import open_db, records_frame, state
from kit.tokens import count_prompt_tokens
from kit.types import RunConfig, Sampling

MAX_TOKENS, MAX_CONTEXT = 40, 400


def skips_frame(run_dir) -> pl.DataFrame:
    """The prompts the guard listed: the run database's skips table, read by SQL."""
    with open_db(run_dir) as conn:
        cur = conn.execute("SELECT * FROM skips ORDER BY dataset, prompt_id")
        rows, names = cur.fetchall(), [d[0] for d in cur.description]
    return pl.DataFrame(rows, schema=names, orient="row")


def frame(spec: dict[str, dict[str, int]]) -> pl.DataFrame:
    """spec = {dataset: {kind: count}}; kinds short (~40 tokens), medium (~80), long (~430)."""
    words = {"short": 3, "medium": 40, "long": 400}
    rows = []
    for ds, kinds in spec.items():
        for kind, count in kinds.items():
            for i in range(count):
                text = f"{kind} question {i} " + "word " * words[kind]
                rows.append(
                    {
                        "dataset": ds,
                        "prompt_id": f"{ds}-{kind}-{i}",
                        "n_turns": 1,
                        "row": len(rows),
                        "messages": [{"role": "user", "content": text}],
                    }
                )
    return pl.DataFrame(rows)


def config(srv, budgets, model_dir, **kw) -> RunConfig:
    base = dict(
        model="fake",
        endpoints=srv.base_url,
        budgets=budgets,
        tokenizer=str(model_dir),
        sampling=Sampling(max_tokens=MAX_TOKENS),
        concurrency=8,
        retry_base=0.02,
    )
    return RunConfig(**(base | kw))


@pytest.mark.server
@pytest.mark.slow
def test_long_prompts_are_skipped_counted_and_listed(model_dir, tmp_path):
    prompts = frame(
        {"a": {"short": 60, "medium": 5, "long": 5}, "b": {"short": 20, "medium": 4, "long": 3}}
    )
    counted = count_prompt_tokens(model_dir, prompts)  # the truth, every prompt tokenized
    truth = counted.filter(pl.col("prompt_tokens") + MAX_TOKENS > MAX_CONTEXT)
    assert sorted(truth["prompt_id"]) == sorted(p for p in prompts["prompt_id"] if "long" in p)
    budgets = {"a": 600, "b": 100_000}
    with FaultServer(FaultConfig(latency=0.01, min_words=5, max_words=60)) as srv:
        cfg = config(srv, budgets, model_dir, max_context=MAX_CONTEXT)
        run = kit.generate_sync(prompts, cfg, run_dir=tmp_path / "run")
        sent = srv.stats()["requests"]
        summary = {r["dataset"]: r for r in run.summary().iter_rows(named=True)}
        print(f"\n{run.summary()}")
        assert {d: summary[d]["skipped_context"] for d in budgets} == {"a": 5, "b": 3}
        records = records_frame(run.run_dir)
        assert sent == len(records) and summary["a"]["errors"] == summary["b"]["errors"] == 0
        assert not set(records["prompt_id"]) & set(truth["prompt_id"])  # never sent
        over = summary["a"]["tokens_done"] - budgets["a"]
        assert summary["a"]["state"] == "budget_reached" and 0 <= over <= MAX_TOKENS
        assert summary["b"]["state"] == "exhausted" and summary["b"]["samples_done"] == 24

        listed = skips_frame(run.run_dir).to_dicts()
        expect = dict(zip(truth["prompt_id"], truth["prompt_tokens"], strict=True))
        assert {r["prompt_id"]: r["prompt_tokens"] for r in listed} == expect
        assert all(r["reason"] == "context" and r["max_context"] == MAX_CONTEXT for r in listed)
        on_disk = {p.dataset: p for p in progress(run.run_dir)}  # kit.watch's view
        assert (on_disk["a"].skipped, on_disk["b"].skipped, on_disk["b"].state) == (
            5,
            3,
            "exhausted",
        )
        status = json.loads(state(run.run_dir, "status"))
        assert [d["skipped"] for d in status["datasets"]] == [5, 3]

        before = skips_frame(run.run_dir)
        again = kit.generate_sync(None, cfg, run_dir=run.run_dir)  # resume: nothing new to send
        assert srv.stats()["requests"] == sent
        assert skips_frame(run.run_dir).equals(before)  # listed once, not per start
        assert again.summary()["skipped_context"].to_list() == [5, 3]


@pytest.mark.server
def test_default_context_comes_from_the_model(model_dir, tmp_path):
    assert model_context(model_dir) == 8192  # config.json max_position_embeddings
    nested = tmp_path / "nested"
    nested.mkdir()
    (nested / "config.json").write_text(
        json.dumps({"text_config": {"max_position_embeddings": 4096}})
    )
    assert model_context(nested) == 4096
    bare = tmp_path / "bare"  # no config.json: the tokenizer's model_max_length
    bare.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, bare / name)
    assert model_context(bare) == 8192

    prompts = frame({"a": {"short": 6}})
    huge = {
        "dataset": "a",
        "prompt_id": "a-huge",
        "n_turns": 1,
        "row": 6,
        "messages": [{"role": "user", "content": "word " * 9000}],
    }
    prompts = pl.concat([prompts, pl.DataFrame([huge])])
    with FaultServer(FaultConfig(min_words=5, max_words=30)) as srv:
        cfg = config(srv, {"a": 10_000}, model_dir)
        run = kit.generate_sync(prompts, cfg, run_dir=tmp_path / "run")
        assert srv.stats()["requests"] == 6
    row = run.summary().row(0, named=True)
    assert (row["skipped_context"], row["samples_done"], row["state"]) == (1, 6, "exhausted")
    (listed,) = skips_frame(run.run_dir).to_dicts()
    assert listed["prompt_id"] == "a-huge" and listed["max_context"] == 8192
    assert listed["prompt_tokens"] > 9000


def test_no_tokenizer_no_guard_and_bad_settings_raise(tmp_path):
    prompts = frame({"a": {"short": 3, "long": 2}})
    with FaultServer(FaultConfig(min_words=5, max_words=30)) as srv:
        args = dict(
            model="fake",
            endpoints=srv.base_url,
            sampling=Sampling(max_tokens=MAX_TOKENS),
            retry_base=0.02,
        )
        run = kit.generate_sync(
            prompts, RunConfig(budgets={"a": 10_000}, **args), run_dir=tmp_path / "run"
        )
        assert srv.stats()["requests"] == 5  # without a tokenizer every prompt is sent
        assert run.summary()["skipped_context"].to_list() == [0]
        assert skips_frame(tmp_path / "run").height == 0
    for value in (0, 2.5):  # the config refuses these itself
        with pytest.raises(ValueError, match=f"RunConfig.max_context must be .*, got {value}"):
            RunConfig(budgets={"a": 100}, max_context=value, tokenizer="x", **args)
    bad = [  # refused by generate before anything is loaded, sent or written
        ({"max_context": 400}, "max_context=400 needs tokenizer"),
        ({"max_context": 30, "tokenizer": "x"}, "max_context=30 leaves no room"),
    ]
    for extra, message in bad:
        with pytest.raises(ValueError, match=message):
            kit.generate_sync(
                prompts, RunConfig(budgets={"a": 100}, **args, **extra), run_dir=tmp_path / "bad"
            )
    assert not (tmp_path / "bad").exists()


# ---------------------------------------------------------------- the guard cache (run.sqlite)


def tiny_tokenizer(folder, template: str = "{{ m['role'] }} {{ m['content'] }}\n"):
    """A word-level tokenizer (one token per word) with a chat template, in `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "<s>": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    chat = (
        "{% for m in messages %}"
        + template
        + "{% endfor %}{% if add_generation_prompt %}assistant{% endif %}"
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "[UNK]",
        "bos_token": "<s>",
        "chat_template": chat,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 300}))
    return folder


def guard_config(tok, **kw) -> RunConfig:
    from kit.tokens import chat_template_hash

    base = dict(
        model="fake",
        endpoints="http://127.0.0.1:1/v1",
        budgets={"a": 1000, "b": 1000},
        tokenizer=str(tok),
        sampling=Sampling(max_tokens=MAX_TOKENS),
        max_context=MAX_CONTEXT,
    )
    config = RunConfig(**(base | kw))
    return dataclasses.replace(config, chat_template_hash=chat_template_hash(str(tok)))


@pytest.fixture
def renders(monkeypatch) -> list:
    """The datasets guard.too_long renders from now on."""
    calls: list = []
    real = guard.too_long

    def spy(part, *args, **kw):
        calls.append(part["dataset"][0])
        return real(part, *args, **kw)

    monkeypatch.setattr(guard, "too_long", spy)
    return calls


def truth(prompts, config, limit=None) -> dict:
    """too_long of every dataset, no cache: what the guard must find."""
    out = {}
    for (name,), part in prompts.group_by("dataset", maintain_order=True):
        kwargs = config.sampling_for(name).chat_template_kwargs
        limit = limit or config.max_context
        out |= guard.too_long(part, config.tokenizer, limit, config.sampling.max_tokens, kwargs)
    return out


def test_guard_cache_is_reused_until_what_it_depends_on_changes(tmp_path, renders):
    tok = tiny_tokenizer(tmp_path / "tok")
    prompts = frame({"a": {"short": 6, "long": 2}, "b": {"short": 4, "medium": 3, "long": 1}})
    config, run_dir = guard_config(tok), tmp_path / "run"
    run_dir.mkdir()
    skips, listed = guard.apply(prompts, config, run_dir, {})
    assert renders == ["a", "b"] and {k: v[0] for k, v in skips.items()} == truth(prompts, config)
    assert sorted(pid for _, pid in skips) == ["a-long-0", "a-long-1", "b-long-0"]

    renders.clear()  # nothing changed: nothing rendered, the same answer and rows
    assert guard.apply(prompts, config, run_dir, {}) == (skips, listed) and renders == []
    done = {("a", "a-long-0", 0): (5, "stop")}  # done samples are not skipped (not cached)
    assert ("a", "a-long-0") not in guard.apply(prompts, config, run_dir, done)[0] and renders == []

    for changed in (
        dataclasses.replace(config, max_context=500),
        dataclasses.replace(config, sampling=Sampling(max_tokens=360)),
    ):
        renders.clear()
        got = guard.apply(prompts, changed, run_dir, {})[0]
        assert renders == ["a", "b"] and {k: v[0] for k, v in got.items()} == truth(
            prompts, changed
        )
    assert {pid for _, pid in got} > {pid for _, pid in skips}  # 360 of 400 for max_tokens: more
    renders.clear()
    assert guard.apply(prompts, config, run_dir, {})[0] == skips and renders == [
        "a",
        "b",
    ]  # 1 entry per dataset

    renders.clear()  # b's first prompt gets long under the same prompt_id: b only is rendered
    long_text = "long question 9 " + "word " * 400
    edited = prompts.with_columns(
        pl.when(pl.col("prompt_id") == "b-short-0")
        .then(pl.lit([{"role": "user", "content": long_text}]))
        .otherwise(pl.col("messages"))
        .alias("messages")
    )
    got = guard.apply(edited, config, run_dir, {})[0]
    assert renders == ["b"] and ("b", "b-short-0") in got
    renders.clear()
    kwargs = dataclasses.replace(config, template_kwargs={"b": {"enable_thinking": False}})
    guard.apply(edited, kwargs, run_dir, {})[0]
    assert renders == ["b"]  # b's template kwargs changed: b rendered again


def test_guard_cache_holds_the_tokenizer_facts_while_its_files_are_unchanged(
    tmp_path, renders, monkeypatch
):
    import kit.tokens

    tok = tiny_tokenizer(tmp_path / "tok")
    prompts = frame({"a": {"short": 3, "long": 1}})
    config, run_dir = (
        guard_config(tok, max_context=None),
        tmp_path / "run",
    )  # context from config.json
    run_dir.mkdir()
    first = guard.apply(prompts, config, run_dir, {})[0]
    assert list(first) == [("a", "a-long-0")]
    assert guard.template_hash(str(tok), run_dir) == config.chat_template_hash

    def refuse(*args, **kw):
        raise AssertionError("the tokenizer was loaded")

    with monkeypatch.context() as m:  # unchanged files: no tokenizer loaded for either fact
        m.setattr(kit.tokens, "chat_template_hash", refuse)
        m.setattr(guard, "model_context", refuse)
        assert guard.template_hash(str(tok), run_dir) == config.chat_template_hash
        renders.clear()
        assert guard.apply(prompts, config, run_dir, {})[0] == first and renders == []

    tiny_tokenizer(tok, template="[{{ m['role'] }}] {{ m['content'] }}\n")  # a new template
    kit.tokens._load_cached.cache_clear()  # this process holds the old one (a restart would not)
    new_hash = guard.template_hash(str(tok), run_dir)
    assert new_hash != config.chat_template_hash
    renders.clear()
    guard.apply(prompts, dataclasses.replace(config, chat_template_hash=new_hash), run_dir, {})
    assert renders == ["a"]
    with sqlite3.connect(run_dir / "run.sqlite") as conn:  # a spoiled cache is only a miss
        conn.execute("UPDATE guard_datasets SET too_long = 'garbage'")
    conn.close()
    renders.clear()
    assert list(
        guard.apply(prompts, dataclasses.replace(config, chat_template_hash=new_hash), run_dir, {})[
            0
        ]
    ) == [("a", "a-long-0")] and renders == ["a"]


def test_an_older_guard_json_is_imported_once_then_removed(tmp_path, renders):
    tok = tiny_tokenizer(tmp_path / "tok")
    prompts = frame({"a": {"short": 3, "long": 1}, "b": {"short": 2}})
    config, run_dir = guard_config(tok), tmp_path / "run"
    run_dir.mkdir()
    first = guard.apply(prompts, config, run_dir, {})[0]
    conn = sqlite3.connect(run_dir / "run.sqlite")
    (tokenizer,) = conn.execute("SELECT doc FROM guard_tokenizer").fetchone()
    rows = conn.execute("SELECT dataset, key, ids_key, too_long FROM guard_datasets").fetchall()
    conn.close()
    datasets = {d: {"key": k, "ids_key": i, "too_long": json.loads(t)} for d, k, i, t in rows}
    doc = {"version": 1, "tokenizer": json.loads(tokenizer), "datasets": datasets}
    (run_dir / "run.sqlite").unlink()  # the run directory of an older kit: its cache a file
    (run_dir / "guard.json").write_text(json.dumps(doc))
    renders.clear()
    assert guard.apply(prompts, config, run_dir, {})[0] == first and renders == []
    assert not (run_dir / "guard.json").exists()  # imported into the database, then removed
    assert guard.apply(prompts, config, run_dir, {})[0] == first and renders == []
    conn = sqlite3.connect(run_dir / "run.sqlite")
    assert conn.execute("SELECT count(*) FROM guard_datasets").fetchone() == (2,)
    conn.close()


def test_a_restart_renders_nothing_and_loads_no_tokenizer(tmp_path, monkeypatch):
    import kit.tokens

    tok = tiny_tokenizer(tmp_path / "tok")
    prompts = frame({"a": {"short": 5, "long": 2}})
    with FaultServer(FaultConfig(min_words=5, max_words=20)) as srv:
        config = RunConfig(
            model="fake",
            endpoints=srv.base_url,
            budgets={"a": 10_000},
            tokenizer=str(tok),
            sampling=Sampling(max_tokens=MAX_TOKENS),
            max_context=MAX_CONTEXT,
            retry_base=0.02,
        )
        run = kit.generate_sync(prompts, config, run_dir=tmp_path / "run")
        assert srv.stats()["requests"] == 5
        listed = skips_frame(tmp_path / "run")

        def refuse(*args, **kw):
            raise AssertionError("rendered or loaded on a restart")

        monkeypatch.setattr(guard, "too_long", refuse)
        monkeypatch.setattr(kit.tokens, "chat_template_hash", refuse)
        again = kit.generate_sync(None, config, run_dir=run.run_dir)  # resume: nothing to send
        assert srv.stats()["requests"] == 5
    assert skips_frame(tmp_path / "run").equals(listed)
    assert again.summary()["skipped_context"].to_list() == [2]


def test_a_restart_over_content_ids_reads_no_prompt_text(tmp_path, renders, monkeypatch):
    """Prompts whose ids are their content hashes (kit.load's): a restart finds the guard's
    answer by the ids alone, reading no text; custom ids (the other tests) read the texts."""
    from kit.data.sources import prompt_id
    from kit.run import queues
    from kit.run.reader import prompts_frame
    from kit.run.store import RunStore

    tok = tiny_tokenizer(tmp_path / "tok")
    prompts = frame({"a": {"short": 4, "long": 2}, "b": {"short": 3, "long": 1}})
    prompts = prompts.with_columns(
        prompt_id=pl.Series([prompt_id(m) for m in prompts["messages"].to_list()])
    )
    config, run_dir = guard_config(tok), tmp_path / "run"
    store = RunStore(run_dir)
    store.init(config, prompts)
    store.close()
    first = guard.apply(prompts, config, run_dir, {})[0]
    assert renders == ["a", "b"] and {k: v[0] for k, v in first.items()} == truth(prompts, config)
    keys = prompts_frame(run_dir, text=False)
    assert "messages" not in keys.columns

    def refuse(*args, **kw):
        raise AssertionError("prompt text read on a restart")

    monkeypatch.setattr(queues, "prompt_text", refuse)
    renders.clear()
    assert guard.apply(keys, config, run_dir, {})[0] == first and renders == []
    with pytest.raises(AssertionError, match="prompt text read"):  # another limit: texts needed
        guard.apply(keys, dataclasses.replace(config, max_context=500), run_dir, {})
