"""The fast prompt-count path: tiktoken mirror (kit._bpe), shape rendering (kit._template),
shape segments (kit._fastcount). Every fast answer is compared with the slow, exact one."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import polars as pl
import pytest
from test_tokens import CONVERSATIONS, _sample_conversations
from tokenizers import Tokenizer

from kit import _bpe, tokens
from kit._fastcount import ShapeCounter
from kit._template import ShapeRenderer, content_is_pasted

ROOT = Path(__file__).resolve().parents[1]
# Llama 3's pre-tokenizer split (Split + ByteLevel without its own regex), from its tokenizer.json
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
ODD_TEXTS = [
    "",
    " ",
    "\n\n\n",
    "   leading and trailing   ",
    "tabs\tand\r\nwindows\r\nlines",
    "digits 1234567890 3.14159 1e-10 0x1F",
    "Ünïcödé — 日本語のテキスト 🚀👩‍👩‍👧 and emoji, Ελληνικά, русский, عربى",
    "it's they're we've I'm you'll he'd IT'S",
    "<|im_start|>user\nliteral specials<|im_end|><|endoftext|>",
    "<|im_start|<|im_end|>|><|im_",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
    "a" * 5000,
    "word " * 3000,
]


def corpus() -> list[str]:
    """Varied real text: the samples rendered, kit's own source, the stdlib json package, odd cases."""
    texts = list(ODD_TEXTS)
    texts += [m["content"] for conv in CONVERSATIONS + _sample_conversations() for m in conv]
    texts += [p.read_text() for p in sorted((ROOT / "kit").glob("*.py"))]
    texts += [p.read_text() for p in sorted(Path(json.__file__).parent.glob("*.py"))]
    texts += [p.read_text() for p in sorted((ROOT / "data" / "samples").glob("*.json*"))]
    return texts


@pytest.fixture(scope="module")
def tok(model_dir):
    return tokens.load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def spec(tok):
    return json.loads(tok.backend_tokenizer.to_str())


@pytest.mark.server
def test_mirror_counts_equal_the_tokenizer(tok):
    count = _bpe.fast_counter(tok)
    assert count is not None, _bpe.why_not(tok)
    texts = corpus()
    expected = [len(e) for e in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]
    assert count(texts) == expected
    assert sum(expected) > 100_000  # a real amount of text was compared
    many = texts * (_bpe._MIN_PARALLEL // len(texts) + 1)  # the threaded path
    assert count(many) == expected * (_bpe._MIN_PARALLEL // len(texts) + 1)


@pytest.mark.server
def test_mirror_of_a_split_pretokenizer_equals_the_tokenizer(spec):
    variant = copy.deepcopy(spec)
    variant["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False},
        ],
    }  # fmt: skip
    hf = Tokenizer.from_str(json.dumps(variant))
    mirror = _bpe.encoding_from_spec(variant)
    assert mirror is not None
    texts = corpus()
    expected = [len(e) for e in hf.encode_batch(texts, add_special_tokens=False)]
    assert [len(mirror.encode(t, allowed_special="all")) for t in texts] == expected
    plain = [len(e) for e in Tokenizer.from_str(json.dumps(spec)).encode_batch(texts)]
    assert expected != plain  # the variant really splits differently


@pytest.mark.server
@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda s: s.update(normalizer={"type": "NFC"}), "normalizer"),
        (lambda s: s["model"].update(byte_fallback=True), "byte fallback"),
        (lambda s: s["added_tokens"][1].update(lstrip=True), "strip"),
        (lambda s: s.update(pre_tokenizer={"type": "Whitespace"}), "pre-tokenizer"),
        (lambda s: s["pre_tokenizer"].update(add_prefix_space=True), "pre-tokenizer"),
        (lambda s: s["model"].update(type="WordPiece"), "model type"),
    ],
)
def test_what_the_mirror_cannot_copy_is_refused(spec, change, reason):
    variant = copy.deepcopy(spec)
    change(variant)
    assert reason in _bpe._unsupported(variant)
    assert _bpe.encoding_from_spec(variant) is None


@pytest.mark.server
def test_content_is_pasted_reads_the_template(tok):
    compiled = tokens._template_and_kwargs(tok)[0]
    yes = [
        "{{ m['content'] }}",
        "{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] ~ '\\n' }}{% endfor %}",
        tok.get_chat_template(),
    ]
    no = [
        "{{ m['content'] | trim }}",
        "{{ m.content.strip() }}",
        "{% if m['content'] == '' %}x{% endif %}{{ m['content'] }}",
        "{% if '</think>' in m.content %}{% endif %}",
        "{% set c = m['content'] %}{{ c }}",
        "{% for part in m.content %}{{ part }}{% endfor %}",
        "{{ m.get('content') }}",
        "{% if m['content'] is string %}{{ m['content'] }}{% endif %}",
    ]
    assert all(content_is_pasted(compiled, t) for t in yes)
    assert not any(content_is_pasted(compiled, t) for t in no)


@pytest.mark.server
def test_shape_rendering_equals_jinja_for_reordered_and_repeated_contents(tok):
    from transformers.utils.chat_template_utils import _compile_jinja_template

    source = (
        "{% for m in messages | reverse %}[{{ m['role'] }}]{{ m['content'] }}|{% endfor %}"
        "first again: {{ messages[0]['content'] }}{% if add_generation_prompt %}>{% endif %}"
    )
    compiled = _compile_jinja_template(source)
    assert content_is_pasted(compiled, source)
    shapes = ShapeRenderer(compiled, {}, True)
    for conv in CONVERSATIONS + _sample_conversations()[:50]:
        expected = compiled.render(messages=conv, add_generation_prompt=True)
        assert shapes.render(conv) == expected


@pytest.mark.server
def test_a_template_that_changes_content_goes_row_by_row(tok):
    trimming = copy.deepcopy(tok)
    trimming.chat_template = tok.get_chat_template().replace(
        "message['content']", "(message['content'] | trim)"
    )
    assert tokens._template_and_kwargs(trimming)[2] is False
    convs = CONVERSATIONS + _sample_conversations()[:50]
    frame = pl.DataFrame({"messages": convs})
    counted = tokens.count_prompt_tokens(trimming, frame)["prompt_tokens"].to_list()
    expected = [
        len(trimming.apply_chat_template(m, add_generation_prompt=True, return_dict=False))
        for m in convs
    ]
    assert counted == expected
    assert counted[2] != tokens.count_prompt_tokens(tok, frame[2:3])["prompt_tokens"][0]


def test_a_special_token_that_could_straddle_a_content_boundary_is_not_split_on():
    from transformers.utils.chat_template_utils import _compile_jinja_template

    compiled = _compile_jinja_template("{{ messages[0]['content'] }}<|im_end|>tail")

    def counter(specials):
        shapes = ShapeRenderer(compiled, {}, False)
        return ShapeCounter(shapes, lambda texts: [len(t) for t in texts], specials)

    conv = [{"role": "user", "content": "A"}]
    # "A" + "<|im_end|>" would be the longer special "A<|im_end|>": no safe split there
    assert counter(["<|im_end|>", "A<|im_end|>"]).layout(conv) is None
    # with only "<|im_end|>": the special and "tail" are constants, the content a segment
    assert counter(["<|im_end|>"]).layout(conv) == (len("<|im_end|>") + len("tail"), [[0]])


@pytest.mark.server
def test_rows_the_frame_path_leaves_are_counted_row_by_row(tok):
    convs = [
        [{"role": "user", "content": "plain", "name": None}],
        [{"role": "user", "content": "named", "name": "ann"}],
        [{"role": "system", "content": "sys", "name": None}, {"role": "user", "content": "q"}],
        [],  # apply_chat_template refuses an empty conversation: null, reported
    ]
    frame = pl.DataFrame({"messages": convs})
    with pytest.warns(UserWarning, match="1 of 4 prompts could not be rendered"):
        counted = tokens.count_prompt_tokens(tok, frame)["prompt_tokens"].to_list()
    plain = [[{k: v for k, v in m.items() if v is not None} for m in c] for c in convs[:3]]
    expected = [
        len(tok.apply_chat_template(m, add_generation_prompt=True, return_dict=False))
        for m in plain
    ]
    assert counted == [*expected, None]


@pytest.mark.server
def test_a_mirror_that_disagrees_is_caught_and_the_tokenizer_counts(tok, monkeypatch):
    convs = CONVERSATIONS + _sample_conversations()[:100]
    frame = pl.DataFrame({"messages": convs})
    expected = tokens.count_prompt_tokens(tok, frame)["prompt_tokens"].to_list()
    monkeypatch.setattr(tokens, "fast_counter", lambda _tok: lambda texts: [1] * len(texts))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counted = tokens.count_prompt_tokens(tok, frame)["prompt_tokens"].to_list()
    assert counted == expected
    messages = [str(w.message) for w in caught]
    assert any("disagreed" in m for m in messages), messages


@pytest.mark.server
def test_a_vocabulary_word_the_merges_cannot_make_is_refused(spec):
    assert _bpe._encoding_for(json.dumps(spec)) is not None
    variant = copy.deepcopy(spec)
    del variant["model"]["merges"][500]  # its token stays in the vocabulary, unreachable
    hf = Tokenizer.from_str(json.dumps(variant))
    assert hf is not None and _bpe._encoding_for(json.dumps(variant)) is None
