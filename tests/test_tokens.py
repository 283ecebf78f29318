"""kit.tokens against the embedded model's real tokenizer and chat template."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import polars as pl
import pytest

import kit
from kit import tokens

SAMPLES = Path(__file__).resolve().parents[1] / "data" / "samples"

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a prime."}],
    [
        {"role": "user", "content": "Write a haiku about rain."},
        {
            "role": "assistant",
            "content": "Soft drops on the roof\nthe gutter hums its one note\nnight keeps the tempo",
        },
        {"role": "user", "content": "Now one about   snow, with trailing spaces   "},
    ],
    [
        {
            "role": "user",
            "content": "def f(x):\n\treturn {'a': x ** 2}  # code, tabs, braces {{ }} {% raw %}",
        }
    ],
    [{"role": "user", "content": "Ünïcödé — 日本語のテキスト 🚀 and emoji"}],
    [{"role": "user", "content": "literal special tokens <|im_start|> and <|im_end|> in text"}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "word " * 2000}],
]


def _sample_conversations() -> list[list[dict]]:
    """Prompts from data/samples (kit.data.sources) when the samples exist, else none."""
    files = sorted(p for p in SAMPLES.glob("*") if p.suffix in (".json", ".jsonl", ".parquet"))
    if not files:
        return []
    from kit.data.sources import load

    frame = load([str(p) for p in files]).frame
    return frame.sample(n=min(300, frame.height), seed=0)["messages"].to_list()


@pytest.fixture(scope="module")
def tok(model_dir):
    return tokens.load_tokenizer(model_dir)


@pytest.mark.server
@pytest.mark.parametrize("gen", [True, False])
def test_render_equals_apply_chat_template(tok, gen):
    convs = CONVERSATIONS + _sample_conversations()
    expected = [
        tok.apply_chat_template(m, tokenize=False, add_generation_prompt=gen) for m in convs
    ]
    assert tokens.render(tok, convs, add_generation_prompt=gen) == expected


@pytest.mark.server
def test_render_rows_with_none_and_extra_fields_equal(tok):
    convs = [
        [{"role": "user", "content": "x", "name": None}],  # None values dropped, as transformers
        [{"role": "user", "content": "y", "reasoning": "hidden"}],  # reasoning aliasing
    ]
    expected = [
        tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in convs
    ]
    assert tokens.render(tok, convs) == expected


@pytest.mark.server
def test_prompt_counts_equal_tokenizer_counts(tok):
    convs = CONVERSATIONS + _sample_conversations()
    frame = pl.DataFrame({"dataset": ["d"] * len(convs), "messages": convs})
    counted = tokens.count_prompt_tokens(tok, frame)["prompt_tokens"].to_list()
    expected = [
        len(
            tok.apply_chat_template(m, tokenize=True, add_generation_prompt=True, return_dict=False)
        )
        for m in convs
    ]
    assert counted == expected
    assert counted[7] > 2000  # the long one


def _exact_count(tok, messages) -> int:
    """len(apply_chat_template(tokenize=True)); transformers 5 returns a BatchEncoding."""
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return len(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.server
def test_every_sample_prompt_count_equals_apply_chat_template(tok):
    frame = kit.load(str(SAMPLES)).frame
    assert frame.height > 0
    counted = tokens.count_prompt_tokens(tok, frame)["prompt_tokens"].to_list()
    assert counted == [_exact_count(tok, m) for m in frame["messages"].to_list()]


@pytest.mark.server
def test_a_row_the_template_refuses_is_null_with_one_warning(tok, monkeypatch):
    refusing = copy.deepcopy(tok)  # a template that raises on a role it does not take
    refusing.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('no tool turns') }}{% endif %}{% endfor %}" + tok.get_chat_template()
    )
    monkeypatch.setattr(tokens, "_CHUNK", 4)  # the bad row sits inside a batched chunk
    convs = [[{"role": "user", "content": f"q{i}"}] for i in range(10)]
    convs[5] = [{"role": "user", "content": "q5"}, {"role": "tool", "content": "42"}]
    frame = pl.DataFrame(
        {"dataset": ["d"] * 10, "prompt_id": [f"p{i}" for i in range(10)], "messages": convs}
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counts = tokens.count_prompt_tokens(refusing, frame)["prompt_tokens"].to_list()
    assert counts[5] is None
    assert [n for i, n in enumerate(counts) if i != 5] == [
        _exact_count(tok, m) for i, m in enumerate(convs) if i != 5
    ]
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "1 of 10 prompts" in messages[0] and "row 5 (p5)" in messages[0]
    with pytest.raises(ValueError, match="row 5: .*no tool turns"):
        tokens.render(refusing, convs)


@pytest.mark.server
def test_no_chat_template_is_an_error_not_nulls(tok):
    bare = copy.deepcopy(tok)
    bare.chat_template = None
    frame = pl.DataFrame({"dataset": ["d"], "messages": [[{"role": "user", "content": "hi"}]]})
    with pytest.raises(ValueError, match="chat template"):
        tokens.count_prompt_tokens(bare, frame)


@pytest.mark.server
def test_encode_lengths_ignore_truncation_left_on_the_backend(tok):
    texts = ["word " * 50, "hello world", ""]
    expected = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    truncating = copy.deepcopy(tok)
    truncating.backend_tokenizer.enable_truncation(8)
    assert tokens.encode_lengths(tok, texts) == expected
    assert tokens.encode_lengths(truncating, texts) == expected


@pytest.mark.server
def test_unrenderable_row_is_counted_null_and_reported(tok):
    frame = pl.DataFrame(
        {
            "dataset": ["d", "d", "d"],
            "prompt_id": ["p0", "p1", "p2"],
            "messages": [
                [{"role": "user", "content": "ok"}],
                [{"role": "user"}],
                [{"role": "user", "content": "ok2"}],
            ],
        }
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = tokens.count_prompt_tokens(tok, frame)
    counts = out["prompt_tokens"].to_list()
    assert counts[1] is None and counts[0] > 0 and counts[2] > 0
    assert any("1 of 3 prompts" in str(w.message) and "p1" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match="row 1"):
        tokens.render(tok, frame["messages"].to_list())


@pytest.mark.server
def test_completion_count_source_preference(tok):
    records = pl.DataFrame(
        {
            "completion": [
                "Hello there, friend.",
                "ignored text",
                "ignored too",
                "Retokenize me please",
            ],
            "completion_tokens": [None, 7, 99, None],
            "count_source": [None, None, "server_ids", None],
            "output_ids": [None, None, [1, 2, 3], None],
        },
        schema_overrides={"completion_tokens": pl.Int64, "output_ids": pl.List(pl.Int64)},
    )
    out = tokens.count_completion_tokens(records, tok)
    retok = [
        len(tok(t, add_special_tokens=False)["input_ids"])
        for t in ("Hello there, friend.", "Retokenize me please")
    ]
    assert out["completion_tokens"].to_list() == [retok[0], 7, 3, retok[1]]
    assert out["count_source"].to_list() == ["retokenized", "usage", "server_ids", "retokenized"]
    with pytest.raises(ValueError, match="2 records have no server token count"):
        tokens.count_completion_tokens(records, None)


def test_completion_counts_need_no_tokenizer_when_server_counted():
    records = pl.DataFrame(
        {
            "completion": ["a", "b"],
            "completion_tokens": [5, 6],
            "count_source": ["usage", "server_ids"],
        }
    )
    out = tokens.count_completion_tokens(records)
    assert out["completion_tokens"].to_list() == [5, 6]
    assert out["count_source"].to_list() == ["usage", "server_ids"]


@pytest.mark.server
def test_chat_template_hash_tracks_the_template(tok):
    h = tokens.chat_template_hash(tok)
    assert h == tokens.chat_template_hash(tok) and len(h) == 16
    other = copy.deepcopy(tok)
    other.chat_template = tok.get_chat_template().replace("helpful", "unhelpful")
    assert tokens.chat_template_hash(other) != h


@pytest.mark.server
def test_load_tokenizer_is_cached_and_local_only(model_dir, tmp_path):
    assert tokens.load_tokenizer(model_dir) is tokens.load_tokenizer(str(model_dir))
    with pytest.raises(FileNotFoundError, match="local files only"):
        tokens.load_tokenizer(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no such GGUF"):
        tokens.load_tokenizer(tmp_path / "missing.gguf")


@pytest.mark.server
@pytest.mark.slow
def test_gguf_tokenizer_renders_like_the_prepared_folder(tok):
    from kit.serve.prepare import gguf_path

    from_gguf = tokens.load_tokenizer(gguf_path())
    frame = pl.DataFrame({"dataset": ["d"] * len(CONVERSATIONS), "messages": CONVERSATIONS})
    assert tokens.render(from_gguf, CONVERSATIONS) == tokens.render(tok, CONVERSATIONS)
    a = tokens.count_prompt_tokens(from_gguf, frame)["prompt_tokens"].to_list()
    assert a == tokens.count_prompt_tokens(tok, frame)["prompt_tokens"].to_list()


def test_render_puts_tools_and_template_kwargs_into_the_prompt(model_dir, tmp_path):
    """A tools row is rendered with its tools, as a server renders it; kwargs reach the
    template (the thinking variant opens its think block unless enable_thinking is false)."""
    import json
    import shutil

    from thinking_model import prepare_thinking_model

    from kit.tokens import load_tokenizer, render

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}" + config["chat_template"]
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tools = [
        {
            "type": "function",
            "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
        }
    ]
    tok = load_tokenizer(str(tmp_path))
    msgs = [[{"role": "user", "content": "What time is it?"}]] * 3
    got = render(tok, msgs, tools=[json.dumps(tools), None, tools])
    assert got[0].startswith("TOOLS [{") and "get_time" in got[0] and got[0] == got[2]
    assert got[1] == render(tok, msgs[:1])[0] and "TOOLS" not in got[1]
    think = str(prepare_thinking_model(model_dir))
    assert render(think, msgs[:1])[0].endswith(
        "<think>\nLet me think about this step by step. First,"
    )
    off = render(think, msgs[:1], template_kwargs={"enable_thinking": False})[0]
    assert off.endswith("<|im_start|>assistant\n")
