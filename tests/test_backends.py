"""kit.run.backends against the fault server (tests/faultserver.py) and the embedded server."""

from __future__ import annotations

import asyncio
import email.utils
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
from faultserver import FaultConfig, FaultServer, free_port

from kit.errors import (
    BackendError,
    ConnectError,
    HTTPStatusError,
    MalformedAnswer,
    NoEndpoint,
    RequestTimeout,
)
from kit.run.answers import normalize_finish, parse_retry_after
from kit.run.backends import OpenAIChat, SGLangGenerate, VLLMChat, make_backend
from kit.run.pool import EndpointPool, unanswered
from kit.types import Sampling

MSGS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name three colours."},
]
KEY_ENV = "KIT_TEST_API_KEY"
SECRET = "sk-test-5ecret-value-0123456789"


@pytest.fixture
def srv():
    with FaultServer() as server:
        yield server


def run(coro):
    return asyncio.run(coro)


async def complete(backend, sampling=None, timeout=5.0):
    try:
        return await backend.complete(MSGS, sampling or Sampling(max_tokens=200), timeout=timeout)
    finally:
        await backend.aclose()


async def error_of(backend, timeout=5.0) -> BackendError:
    with pytest.raises(BackendError) as info:
        await complete(backend, timeout=timeout)
    return info.value


async def wait_until(cond, timeout: float = 60.0, what: str = "condition") -> None:
    """Poll cond() on the running loop until it holds; fail after a generous timeout."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout:g} s")
        await asyncio.sleep(0.02)


# --- OpenAI-compatible chat ---------------------------------------------------------------


def test_openai_request_shape_and_parse(srv):
    b = OpenAIChat(srv.base_url + "/", "tiny", extra_body={"top_k": 5})
    c = run(complete(b, Sampling(max_tokens=200, temperature=0.3, top_p=0.9, seed=7)))
    body = srv.last_body
    assert body["model"] == "tiny" and body["messages"] == MSGS
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["seed"]) == (
        200,
        0.3,
        0.9,
        7,
    )
    assert body["top_k"] == 5 and "return_token_ids" not in body
    assert c.count_source == "usage" and c.finish_reason == "stop"
    assert c.completion_tokens == len(c.text.split()) > 0
    assert c.prompt_tokens == len("Be brief. Name three colours.".split())


def test_openai_omits_seed_when_unset_and_is_deterministic(srv):
    a = run(complete(OpenAIChat(srv.base_url, "m"), Sampling(seed=None)))
    assert "seed" not in srv.last_body
    b = run(complete(OpenAIChat(srv.base_url, "m"), Sampling(seed=None)))
    assert a.text == b.text


def test_openai_length_finish_when_max_tokens_hit(srv):
    srv.configure(min_words=50, max_words=50)
    c = run(complete(OpenAIChat(srv.base_url, "m"), Sampling(max_tokens=8)))
    assert (c.finish_reason, c.completion_tokens, len(c.text.split())) == ("length", 8, 8)


@pytest.mark.server  # the real model's tokenizer
def test_openai_no_usage_retokenizes_with_tokenizer(srv, model_dir):
    srv.configure(mode="nousage")
    c = run(complete(OpenAIChat(srv.base_url, "m", tokenizer=str(model_dir))))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert c.count_source == "retokenized"
    assert c.completion_tokens == len(tok.encode(c.text, add_special_tokens=False)) > 0


def test_openai_no_usage_without_tokenizer_is_a_config_error(srv):
    srv.configure(mode="nousage")
    err = run(error_of(OpenAIChat(srv.base_url, "m")))
    assert err.kind == "config" and not err.retryable and "tokenizer" in str(err)


# --- vLLM and SGLang ----------------------------------------------------------------------


def test_vllm_sends_return_token_ids_and_keeps_ids(srv):
    c = run(complete(VLLMChat(srv.base_url, "m"), Sampling(max_tokens=300, seed=1)))
    assert srv.last_body["return_token_ids"] is True
    assert c.count_source == "server_ids"
    assert c.completion_tokens == len(c.output_ids) == len(c.text.split())
    assert c.prompt_ids and c.prompt_tokens == len(c.prompt_ids)


@pytest.mark.parametrize("backend", [OpenAIChat, VLLMChat])
def test_penalties_are_sent_when_set(srv, backend):
    run(complete(backend(srv.base_url, "m"), Sampling(frequency_penalty=0.5)))
    assert srv.last_body["frequency_penalty"] == 0.5 and "presence_penalty" not in srv.last_body
    run(complete(backend(srv.base_url, "m"), Sampling(frequency_penalty=0)))  # 0: sent as ever
    assert "frequency_penalty" not in srv.last_body and "presence_penalty" not in srv.last_body


def test_vllm_without_ids_falls_back_to_usage(srv):
    b = VLLMChat(srv.base_url, "m", extra_body={"return_token_ids": False})  # server omits the ids
    c = run(complete(b))
    assert c.count_source == "usage" and c.output_ids is None


@pytest.mark.server  # the real model's tokenizer
def test_sglang_renders_template_and_parses_meta(srv, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    b = SGLangGenerate(srv.root_url, "m", tokenizer=tok)
    srv.configure(min_words=40, max_words=40, tokenizer=str(model_dir))  # ids that spell the text
    c = run(complete(b, Sampling(max_tokens=16, temperature=0.5, top_p=0.8, seed=3)))
    body = srv.last_body
    expected = tok.apply_chat_template(
        MSGS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert body["input_ids"] == list(expected)
    assert body["sampling_params"] == {
        "max_new_tokens": 16,
        "temperature": 0.5,
        "top_p": 0.8,
        "sampling_seed": 3,
    }
    assert srv.stats()["paths"] == {"/generate": 1}
    assert (c.finish_reason, c.completion_tokens, c.count_source) == ("length", 16, "server_ids")
    run(complete(b, Sampling(max_tokens=16, frequency_penalty=0.4, presence_penalty=-0.2)))
    params = srv.last_body["sampling_params"]
    assert (params["frequency_penalty"], params["presence_penalty"]) == (0.4, -0.2)
    assert c.prompt_ids == list(expected) and c.prompt_tokens == len(expected)
    srv.configure(min_words=3, max_words=3)
    assert run(complete(b)).finish_reason == "stop"


def test_sglang_needs_a_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        SGLangGenerate("http://127.0.0.1:1", "m", tokenizer=None)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"type": "length", "length": 9}, "length"),
        ({"type": "stop", "matched": 2}, "stop"),
        ({"type": "abort", "message": "x"}, "abort"),
        ("stop", "stop"),
        (None, "unknown"),
    ],
)
def test_normalize_finish(raw, expected):
    assert normalize_finish(raw) == expected


# --- faults -> BackendError kinds ---------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "cls", "kind", "status", "retryable"),
    [
        ("429", HTTPStatusError, "http_429", 429, True),
        ("500", HTTPStatusError, "http_5xx", 500, True),
        ("400", HTTPStatusError, "http_4xx", 400, False),
        ("reset", ConnectError, "connect", None, True),
        ("malformed", MalformedAnswer, "malformed", None, True),
    ],
)
def test_fault_becomes_the_right_error(srv, mode, cls, kind, status, retryable):
    srv.configure(mode=mode, retry_after="3")
    err = run(error_of(OpenAIChat(srv.base_url, "m")))
    assert type(err) is cls and str(err).startswith(f"{kind}: ")  # the errors table's label
    assert (err.kind, err.status, err.retryable) == (kind, status, retryable)
    assert err.retry_after == (3.0 if mode == "429" else None)


def test_429_then_ok_with_first_k(srv):
    srv.configure(mode="429", first_k=2)
    b = OpenAIChat(srv.base_url, "m")
    kinds = []
    for _ in range(3):
        try:
            run(complete(b))
            kinds.append("ok")
        except BackendError as e:
            kinds.append(e.kind)
    assert kinds == ["http_429", "http_429", "ok"]
    assert srv.stats()["outcomes"] == {"429": 2, "ok": 1}


def test_retry_after_http_date(srv):
    when = email.utils.formatdate(time.time() + 3600, usegmt=True)  # whole seconds
    srv.configure(mode="429", retry_after=when)
    err = run(error_of(OpenAIChat(srv.base_url, "m")))
    assert 3600 - 300 <= err.retry_after <= 3600  # seconds from now, however long the request took


def test_parse_retry_after():
    now = 1_700_000_000.0
    assert parse_retry_after("2.5") == 2.5 and parse_retry_after("-4") == 0.0
    assert parse_retry_after(email.utils.formatdate(now + 10, usegmt=True), now=now) == 10.0
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None


def test_timeout_is_enforced(srv):
    srv.configure(mode="hang")  # never answers: only the backend's own timeout ends the request
    err = run(asyncio.wait_for(error_of(OpenAIChat(srv.base_url, "m"), timeout=0.3), 60))
    assert isinstance(err, RequestTimeout) and err.kind == "timeout" and err.retryable


def test_connection_refused_is_connect():
    err = run(error_of(OpenAIChat(f"http://127.0.0.1:{free_port()}/v1", "m")))
    assert err.kind == "connect" and err.retryable


def test_health(srv):
    async def check(b):
        try:
            return await b.health()
        finally:
            await b.aclose()

    assert run(check(OpenAIChat(srv.base_url, "m"))) is True
    srv.configure(mode="down")
    assert run(check(OpenAIChat(srv.base_url, "m"))) is False
    assert run(check(OpenAIChat(f"http://127.0.0.1:{free_port()}/v1", "m"))) is False


def test_redact_finds_every_form_of_a_secret():
    import base64
    from urllib.parse import quote

    from kit.secrets import redact

    key = "sk-Mixed/Case+Key=0123456789"
    forms = [
        key,
        key.lower(),
        key.upper(),
        quote(key, safe=""),
        base64.b64encode(key.encode()).decode(),
    ]
    forms += [base64.b64encode(f"{p}{key}".encode()).decode() for p in ("Bearer ", "x", "xy")]
    for form in forms:
        out = redact(f"echo: {form} end", [key])
        assert out.startswith("echo: ") and out.endswith(" end") and "***" in out, (form, out)
        assert len(out) < len(form) + 10, (form, out)  # nothing but a boundary char or two left
    assert redact("nothing here", [key, "", None]) == "nothing here"


# --- API key --------------------------------------------------------------------------------


def test_api_key_sent_and_never_exposed(srv, monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)
    b = OpenAIChat(srv.base_url, "m", api_key_env=KEY_ENV)
    run(complete(b))
    assert srv.last_headers["authorization"] == f"Bearer {SECRET}"
    assert SECRET not in repr(b) and SECRET not in str(vars(b))
    assert SECRET.encode() not in pickle.dumps(b)
    srv.configure(mode="500")
    err = run(error_of(b))
    assert SECRET not in str(err) and SECRET not in repr(err.args)


def test_missing_api_key_variable_is_a_clear_error(srv, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(ValueError, match=KEY_ENV):
        OpenAIChat(srv.base_url, "m", api_key_env=KEY_ENV)
    monkeypatch.setenv(KEY_ENV, SECRET)
    b = OpenAIChat(srv.base_url, "m", api_key_env=KEY_ENV)
    monkeypatch.delenv(KEY_ENV)
    err = run(error_of(b))
    assert err.kind == "config" and not err.retryable and KEY_ENV in str(err)
    assert srv.stats()["requests"] == 0


def test_make_backend():
    assert type(make_backend("openai", "http://h:1/v1", "m")) is OpenAIChat
    assert type(make_backend("vllm", "http://h:1/v1", "m")) is VLLMChat
    assert type(make_backend("sglang", "http://h:1", "m", tokenizer=object())) is SGLangGenerate
    with pytest.raises(ValueError, match="'tgi'"):
        make_backend("tgi", "http://h:1", "m")
    with pytest.raises(ValueError, match="base_url"):
        OpenAIChat("127.0.0.1:8000", "m")


# --- EndpointPool -------------------------------------------------------------------------


def test_pool_validates_its_config():
    b = [OpenAIChat("http://h:1/v1", "m")]
    for kwargs, field in [
        ({"per_endpoint_concurrency": 0}, "per_endpoint_concurrency"),
        ({"fail_threshold": 0}, "fail_threshold"),
        ({"health_interval": -1}, "health_interval"),
    ]:
        with pytest.raises(ValueError, match=field):
            EndpointPool(b, **kwargs)
    with pytest.raises(ValueError, match="distinct"):
        EndpointPool(b + [OpenAIChat("http://h:1/v1", "m")])


def test_pool_least_loaded_and_per_endpoint_limit():
    async def go(urls):
        pool = EndpointPool([OpenAIChat(u, "m") for u in urls], per_endpoint_concurrency=1)
        await pool.start()
        try:
            async with pool.acquire() as b1, pool.acquire() as b2:
                assert {b1.url, b2.url} == set(urls)  # one each: the least loaded
                cm = pool.acquire()
                third = asyncio.ensure_future(cm.__aenter__())
                for _ in range(20):  # let it run as far as it can: it parks, both are full
                    await asyncio.sleep(0)
                assert not third.done()  # both endpoints full: waits
            b3 = await asyncio.wait_for(third, 60)  # a slot came free
            assert [s["in_flight"] for s in pool.stats().values()].count(1) == 1
            await cm.__aexit__(None, None, None)
            assert pool.stats()[b3.url]["in_flight"] == 0
        finally:
            await pool.aclose()

    with FaultServer() as a, FaultServer() as b:
        run(go([a.base_url, b.base_url]))


def test_pool_takes_dead_endpoint_out_and_brings_it_back():
    async def go(a, b):
        pool = EndpointPool(
            [OpenAIChat(a.base_url, "m"), OpenAIChat(b.base_url, "m")],
            health_interval=0.1,
            fail_threshold=2,
        )
        await pool.start()
        a.kill()
        served = {a.base_url: 0, b.base_url: 0}
        try:
            for _ in range(12):
                async with pool.acquire() as backend:
                    try:
                        await backend.complete(MSGS, Sampling(), timeout=2)
                        pool.report(backend, True)
                        served[backend.url] += 1
                    except BackendError as err:
                        pool.report(backend, False, err)
            st = pool.stats()[a.base_url]
            assert not st["healthy"] and 1 <= st["failures"] <= 2  # out (2 errors or a probe)
            assert served == {a.base_url: 0, b.base_url: 12 - st["failures"]}
            a.restart()  # the prober (every 0.1 s) brings it back
            await wait_until(lambda: pool.stats()[a.base_url]["healthy"], what="endpoint back")
            async with pool.acquire() as b1, pool.acquire() as b2:
                assert {b1.url, b2.url} == {a.base_url, b.base_url}
        finally:
            await pool.aclose()

    with FaultServer() as a, FaultServer() as b:
        run(go(a, b))


def test_the_class_says_whether_an_endpoint_is_down():
    """No answer (connect, timeout, any exception kit did not classify) or a 5xx counts
    toward taking an endpoint out; a 429, another 4xx, a malformed answer do not."""
    down = [ConnectError("x"), RequestTimeout("x"), HTTPStatusError("x", status=502), OSError()]
    alive = [HTTPStatusError("x", status=s) for s in (429, 404)] + [MalformedAnswer("x")]
    assert [unanswered(e) for e in down + alive] == [True] * 4 + [False] * 3
    assert unanswered(None) and not unanswered(NoEndpoint("x"))


def test_pool_no_endpoint_after_timeout_and_429_keeps_endpoint():
    async def go(s):
        url = s.base_url
        pool = EndpointPool(
            [OpenAIChat(url, "m")], health_interval=0.1, fail_threshold=1, no_endpoint_timeout=0.3
        )
        await pool.start()
        try:
            b = pool.backends[0]
            pool.report(b, False, HTTPStatusError("busy", status=429))
            assert pool.stats()[url]["healthy"]  # a busy server is alive
            s.configure(mode="down")
            pool.report(b, False, HTTPStatusError("boom", status=503))
            assert not pool.stats()[url]["healthy"]

            async def acquire_once():
                async with pool.acquire():
                    pass

            t0 = time.monotonic()
            with pytest.raises(BackendError) as info:
                await asyncio.wait_for(acquire_once(), 60)
            assert isinstance(info.value, NoEndpoint) and info.value.kind == "no_endpoint"
            assert time.monotonic() - t0 >= 0.29  # it waited no_endpoint_timeout (0.3 s) first
        finally:
            await pool.aclose()

    with FaultServer() as s:
        run(go(s))


# --- the fault server as a process -------------------------------------------------------


def test_faultserver_process_dies_after_n():
    port = free_port()
    script = Path(__file__).with_name("faultserver.py")
    cmd = [sys.executable, str(script), "--port", str(port), "--die-after", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert "listening" in proc.stdout.readline()
        b = OpenAIChat(f"http://127.0.0.1:{port}/v1", "m")
        assert all(run(complete(b)).completion_tokens > 0 for _ in range(2))
        kinds = [run(error_of(b)).kind for _ in range(2)]  # the 3rd request kills it
        assert kinds == ["connect", "connect"]
        assert proc.wait(60) == 3
    finally:
        proc.kill()
        proc.wait()


# --- the real embedded server ---------------------------------------------------------------


@pytest.mark.server
def test_openai_chat_against_embedded_server(embedded_server):
    b = OpenAIChat(embedded_server.base_url, embedded_server.model)
    c = run(complete(b, Sampling(max_tokens=24, temperature=0.0), timeout=120))
    assert c.count_source == "usage" and 0 < c.completion_tokens <= 24
    assert c.finish_reason in ("stop", "length") and c.text
    # with the target's tokenizer the usage count is checked against the text: a real
    # server's counts pass (the under-report rule must not misfire)
    b = OpenAIChat(
        embedded_server.base_url, embedded_server.model, tokenizer=embedded_server.model_dir
    )
    c = run(complete(b, Sampling(max_tokens=48, temperature=0.7, seed=3), timeout=120))
    assert c.count_source == "usage" and 0 < c.completion_tokens <= 49

    async def healthy():
        b = OpenAIChat(embedded_server.base_url, embedded_server.model)
        try:
            return await b.health()
        finally:
            await b.aclose()

    assert run(healthy()) is True


def test_fault_fraction_is_reproducible():
    async def outcomes(srv):
        b, seen = OpenAIChat(srv.base_url, "m"), []
        for i in range(16):
            msgs = [{"role": "user", "content": f"prompt {i % 8}"}]  # each body is sent twice
            try:
                await b.complete(msgs, Sampling(), timeout=5)
                seen.append("ok")
            except BackendError as e:
                seen.append(e.kind)
        await b.aclose()
        return seen

    cfg = FaultConfig(mode="500", fraction=0.5, seed=11)
    with FaultServer(cfg) as a, FaultServer(cfg) as b:
        first, second = run(outcomes(a)), run(outcomes(b))
    assert first == second and 0 < first.count("http_5xx") < 16
