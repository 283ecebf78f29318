"""Issue 12, items 3 and 5 (wire protocol): thinking, chat_template_kwargs and tools.

Against the fault server (tests/faultserver.py, FaultConfig.reasoning): a thinking model's
answer is split into Completion.reasoning and Completion.text, counts cover both parts,
a length stop inside the thinking is text "" with finish "length", a thinking field that is
no text is `malformed`; Sampling.chat_template_kwargs and tools reach the request body, and
SGLangGenerate.render passes both to apply_chat_template. No model needed.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from faultserver import FaultConfig, FaultServer, free_port

from kit.errors import BackendError
from kit.run.answers import message_parts
from kit.run.backends import OpenAIChat, SGLangGenerate, VLLMChat
from kit.types import Sampling

MSGS = [{"role": "user", "content": "What is 2 + 2?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            },
        },
    }
]
BACKENDS = {"openai": OpenAIChat, "vllm": VLLMChat}
WORDS = 20  # every answer below: 20 words, so the thinking is the first 10


class WordTokenizer:
    """A stand-in tokenizer: one token per word; records apply_chat_template's kwargs."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[dict] = []
        self.fail = fail

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [7] * len(text.split())

    def apply_chat_template(self, messages, **kwargs) -> list[int]:
        self.calls.append(kwargs)
        if self.fail:
            raise ValueError("this template does not know tools")
        return [1, 2, 3, 10 + len(messages)]


@pytest.fixture
def srv():
    with FaultServer(FaultConfig(min_words=WORDS, max_words=WORDS)) as server:
        yield server


async def complete(backend, sampling=None, **kw):
    try:
        return await backend.complete(MSGS, sampling or Sampling(max_tokens=200), timeout=5.0, **kw)
    finally:
        await backend.aclose()


def run(coro):
    return asyncio.run(coro)


def error_of(backend, sampling=None, **kw) -> BackendError:
    with pytest.raises(BackendError) as info:
        run(complete(backend, sampling, **kw))
    return info.value


# --- reasoning capture -------------------------------------------------------------------


@pytest.mark.parametrize("api", ["openai", "vllm"])
@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_reasoning_is_split_off_and_counted(srv, api, field):
    plain = run(complete(BACKENDS[api](srv.base_url, "m")))  # the same answer, unsplit
    assert plain.reasoning is None and len(plain.text.split()) == WORDS
    srv.configure(reasoning=field)
    c = run(complete(BACKENDS[api](srv.base_url, "m")))
    assert len(c.reasoning.split()) == WORDS // 2 and len(c.text.split()) == WORDS // 2
    assert f"{c.reasoning} {c.text}" == plain.text  # thinking first, then the answer
    assert c.finish_reason == "stop" and c.completion_tokens == WORDS  # both parts
    if api == "vllm":
        assert c.count_source == "server_ids" and len(c.output_ids) == c.completion_tokens
    else:
        assert c.count_source == "usage" and c.output_ids is None


@pytest.mark.parametrize("api", ["openai", "vllm"])
@pytest.mark.parametrize("how", ["max_tokens", "truncate_in_reasoning"])
def test_length_stop_inside_the_thinking_is_empty_text(srv, api, how):
    srv.configure(reasoning="reasoning", truncate_in_reasoning=how == "truncate_in_reasoning")
    sampling = Sampling(max_tokens=5 if how == "max_tokens" else 200)
    c = run(complete(BACKENDS[api](srv.base_url, "m"), sampling))
    assert srv.last_body["max_tokens"] == sampling.max_tokens
    assert (c.text, c.finish_reason, c.completion_tokens) == ("", "length", 5)
    assert len(c.reasoning.split()) == 5
    if api == "vllm":
        assert len(c.output_ids) == 5


def test_length_stop_after_the_thinking_keeps_both_parts(srv):
    srv.configure(reasoning="reasoning_content")
    c = run(complete(VLLMChat(srv.base_url, "m"), Sampling(max_tokens=15)))
    assert len(c.reasoning.split()) == 10 and len(c.text.split()) == 5
    assert (c.finish_reason, c.completion_tokens, len(c.output_ids)) == ("length", 15, 15)


def test_retokenized_count_covers_thinking_and_answer(srv):
    srv.configure(mode="nousage", reasoning="reasoning")
    c = run(complete(OpenAIChat(srv.base_url, "m", tokenizer=WordTokenizer())))
    assert c.count_source == "retokenized" and c.completion_tokens == WORDS  # not just 10
    assert len(c.text.split()) == WORDS // 2


def test_usage_that_omits_the_thinking_is_malformed_with_a_tokenizer(srv):
    # usage_half reports 10 of 20 tokens: as many as the answer alone, so only a check
    # against thinking + answer catches it
    srv.configure(mode="usage_half", reasoning="reasoning")
    err = error_of(OpenAIChat(srv.base_url, "m", tokenizer=WordTokenizer()))
    assert err.kind == "malformed" and "under-reports" in str(err)
    srv.configure(mode="ok")
    c = run(complete(OpenAIChat(srv.base_url, "m", tokenizer=WordTokenizer())))
    assert (c.count_source, c.completion_tokens) == ("usage", WORDS)


@pytest.mark.parametrize("api", ["openai", "vllm"])
def test_thinking_that_is_no_text_is_malformed(srv, api):
    srv.configure(mode="reasoning_number")
    err = error_of(BACKENDS[api](srv.base_url, "m"))
    assert err.kind == "malformed" and err.retryable and "message.reasoning=12345" in str(err)


def test_message_parts_field_rules():
    def parts(message):
        return message_parts({"choices": [{"message": message}]}, "http://h/v1")[1:]

    assert parts({"content": "4", "reasoning": "r", "reasoning_content": "rc"}) == ("4", "r")
    assert parts({"content": "4", "reasoning": None, "reasoning_content": "rc"}) == ("4", "rc")
    assert parts({"content": "4", "reasoning_content": "rc"}) == ("4", "rc")
    assert parts({"content": "4", "reasoning": None}) == ("4", None)
    assert parts({"content": None, "reasoning": "r"}) == ("", "r")
    assert parts({"reasoning": "r"}) == ("", "r")  # no content key: the thinking was cut
    for bad in (
        {"content": "4", "reasoning": "r", "reasoning_content": ["x"]},
        {"content": "4", "reasoning": {"text": "r"}},
        {"content": 4},
        {"reasoning": None},
        {"role": "assistant"},
    ):
        with pytest.raises(BackendError) as info:
            parts(bad)
        assert info.value.kind == "malformed", bad
    for data in ({}, {"choices": []}, {"choices": [{"message": "hi"}]}, {"choices": ["x"]}):
        with pytest.raises(BackendError, match="malformed"):
            message_parts(data, "http://h/v1")


# --- chat_template_kwargs and tools in the body -------------------------------------------


@pytest.mark.parametrize("api", ["openai", "vllm"])
def test_chat_template_kwargs_and_tools_reach_the_body(srv, api):
    sampling = Sampling(max_tokens=50, chat_template_kwargs={"enable_thinking": False})
    run(complete(BACKENDS[api](srv.base_url, "m"), sampling, tools=TOOLS))
    body = srv.last_body
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["tools"] == TOOLS and body["messages"] == MSGS
    run(complete(BACKENDS[api](srv.base_url, "m")))  # neither given: neither sent
    assert "chat_template_kwargs" not in srv.last_body and "tools" not in srv.last_body


def test_sampling_kwargs_merge_over_extra_body_kwargs(srv):
    extra = {"chat_template_kwargs": {"enable_thinking": True, "thinking_budget": 64}}
    b = OpenAIChat(srv.base_url, "m", extra_body=extra)
    run(complete(b, Sampling(chat_template_kwargs={"enable_thinking": False})))
    assert srv.last_body["chat_template_kwargs"] == {
        "enable_thinking": False,
        "thinking_budget": 64,
    }
    run(complete(OpenAIChat(srv.base_url, "m", extra_body=extra)))
    assert srv.last_body["chat_template_kwargs"] == extra["chat_template_kwargs"]


@pytest.mark.parametrize("tools", [{"type": "function"}, ["add"], "[]"])
def test_tools_that_are_not_a_list_of_dicts_are_a_config_error(srv, tools):
    err = error_of(OpenAIChat(srv.base_url, "m"), tools=tools)
    assert err.kind == "config" and not err.retryable and "tools" in str(err)
    assert srv.stats()["requests"] == 0


# --- SGLang: kit renders, the server does not split ----------------------------------------


def test_sglang_render_passes_tools_and_template_kwargs(srv):
    tok = WordTokenizer()
    b = SGLangGenerate(srv.root_url, "m", tokenizer=tok)
    sampling = Sampling(max_tokens=50, chat_template_kwargs={"enable_thinking": False})
    c = run(complete(b, sampling, tools=TOOLS))
    assert tok.calls[-1] == {
        "tools": TOOLS,
        "add_generation_prompt": True,
        "tokenize": True,
        "return_dict": False,
        "enable_thinking": False,
    }
    assert srv.last_body["input_ids"] == [1, 2, 3, 11] == c.prompt_ids
    run(complete(b))
    assert tok.calls[-1] == {
        "tools": None,
        "add_generation_prompt": True,
        "tokenize": True,
        "return_dict": False,
    }


def test_sglang_render_refuses_its_own_names_and_reports_template_errors(srv):
    b = SGLangGenerate(srv.root_url, "m", tokenizer=WordTokenizer())
    err = error_of(b, Sampling(chat_template_kwargs={"tokenize": False}))
    assert err.kind == "config" and not err.retryable and "tokenize" in str(err)
    err = error_of(
        SGLangGenerate(srv.root_url, "m", tokenizer=WordTokenizer(fail=True)), tools=TOOLS
    )
    assert err.kind == "config" and "does not know tools" in str(err)
    assert srv.stats()["requests"] == 0  # nothing was sent


def test_sglang_leaves_the_thinking_inline(srv):
    srv.configure(reasoning="reasoning_content")
    c = run(complete(SGLangGenerate(srv.root_url, "m", tokenizer=WordTokenizer())))
    assert c.reasoning is None and c.text.startswith("<think>") and "</think>" in c.text
    assert c.count_source == "server_ids" and c.completion_tokens == len(c.output_ids) == WORDS
    c = run(
        complete(
            SGLangGenerate(srv.root_url, "m", tokenizer=WordTokenizer()), Sampling(max_tokens=4)
        )
    )
    assert (c.finish_reason, c.completion_tokens) == ("length", 4) and "</think>" not in c.text


def test_faultserver_process_takes_the_reasoning_options():
    port = free_port()
    script = Path(__file__).with_name("faultserver.py")
    cmd = [
        sys.executable,
        str(script),
        "--port",
        str(port),
        "--reasoning",
        "reasoning",
        "--truncate-in-reasoning",
        "true",
        "--min-words",
        "20",
        "--max-words",
        "20",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert "listening" in proc.stdout.readline()
        c = run(complete(VLLMChat(f"http://127.0.0.1:{port}/v1", "m")))
        assert (c.text, c.finish_reason, c.completion_tokens) == ("", "length", 5)
    finally:
        proc.kill()
        proc.wait()
