"""Issue 11, items 3-5: a hostile or broken server against real runs (tests/faultserver.py).

3. the API key (env var or URL credentials) never lands in a file kit writes or prints;
4. completion-token counts from the server are checked, never trusted blindly;
5. a run where nothing can succeed stops early with a reason (Run.stop_reason, status.json),
   and a Retry-After over the cap is shown in the monitor and warned about once.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
import warnings
from pathlib import Path
from urllib.parse import quote

import polars as pl
import pytest
from faultserver import FaultConfig, FaultServer, free_port

import kit
from kit.errors import BackendError
from kit.report.monitor import ConsoleMonitor
from kit.run.backends import OpenAIChat, VLLMChat
from kit.run.progress import progress
from kit.run.reader import errors_frame as read_errors
from kit.run.reader import read_config, records_frame, state
from kit.run.runner import Runner
from kit.types import RunConfig, Sampling

KEY_ENV = "KIT_HOSTILE_KEY"
KEY = "sk-Hostile-KEY-0123456789abcdefXYZ"  # mixed case: its lower/upper forms differ
USER, PASSWORD = "alice", "Url-Pa55word-secret-4567XYZ"
MAX_TOKENS = 40


def prompts(n: int, dataset: str = "a") -> pl.DataFrame:
    rows = [
        {
            "dataset": dataset,
            "prompt_id": f"{dataset}-{i:04d}",
            "n_turns": 1,
            "row": i,
            "messages": [{"role": "user", "content": f"{dataset} item {i}"}],
        }
        for i in range(n)
    ]
    return pl.DataFrame(rows)


def config(endpoints, **kw) -> RunConfig:
    base = dict(
        model="fake",
        endpoints=endpoints,
        budgets={"a": 1_000_000},
        # no penalty: the request bodies the fault server's seeded draws were chosen for
        sampling=Sampling(max_tokens=MAX_TOKENS, frequency_penalty=0),
        concurrency=4,
        retry_base=0.01,
    )
    return RunConfig(**(base | kw))


def raw_records(run_dir: Path) -> list[dict]:
    """Every record of the run as stored (no prompt)."""
    return records_frame(run_dir, prompts=False).to_dicts()


def b64_cores(secret: str) -> list[str]:
    """The base64 characters that only the secret's bytes determine, at each of the 3
    alignments it can have inside a longer encoded string (e.g. base64 of "Bearer KEY")."""
    data, out = secret.encode(), []
    for pad in range(3):
        enc = base64.b64encode(b"\0" * pad + data).decode()
        first, last = -(-8 * pad // 6), 8 * (pad + len(data)) // 6
        out += [enc[first:last], enc[first:last].replace("+", "-").replace("/", "_")]
    return out


def leak_forms(*secrets: str) -> set[bytes]:
    """Each secret as is, lower/upper case, base64 (whole and at any alignment), URL-encoded,
    hex (both cases), base32, reversed and spaced out (issue 35, item 7)."""
    forms = set()
    for s in secrets:
        forms |= {s, s.lower(), s.upper(), base64.b64encode(s.encode()).decode(), quote(s, safe="")}
        forms |= set(b64_cores(s))
        raw = s.encode()
        forms |= {raw.hex(), raw.hex().upper(), base64.b32encode(raw).decode().rstrip("=")}
        forms |= {s[::-1], " ".join(s)}
    return {f.encode() for f in forms}


def status_texts(status: dict) -> str:
    """status.json's run-level stop_reason and its datasets' notes, one per line."""
    notes = [d.get("note", "") for d in status["datasets"]]
    return "\n".join([status.get("stop_reason") or "", *notes])


# --------------------------------------------------------------------------- item 3


def test_api_key_never_lands_in_run_files_exports_or_output(tmp_path, monkeypatch, capfd):
    """Item 3: a server echoing the Authorization header in 200 error bodies and 4xx/5xx
    bodies put the key in errors.jsonl (redaction ran only for status >= 400 and missed its
    lower-case and base64 copies), and credentials in a base URL were stored in config.json
    and in every record's `endpoint`. Now: grep every file of the run directory, its export
    and everything printed for the env key and the URL password (and user:password), in
    every form: 0 hits."""
    monkeypatch.setenv(KEY_ENV, KEY)
    run_dir, out_dir = tmp_path / "run", tmp_path / "export"
    echo = FaultConfig(mode="echo", fraction=0.5, seed=3)
    with FaultServer(echo) as bearer_srv, FaultServer(echo) as basic_srv:
        url_with_creds = basic_srv.base_url.replace("http://", f"http://{USER}:{PASSWORD}@")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            endpoints = [bearer_srv.base_url, url_with_creds]
            cfg = config(endpoints, api_key_env=KEY_ENV, max_attempts=1)
            run = kit.generate_sync(prompts(80), cfg, run_dir=run_dir)
            print(run.summary(), run.stop_reason, repr(cfg), cfg)
            kit.export(run_dir, out_dir, formats=("specforge", "parquet"))
        stats = [bearer_srv.stats(), basic_srv.stats()]
    # the test means something: both auth schemes were sent, every echo kind was answered
    assert stats[0]["auth"] == {"Bearer": stats[0]["requests"]} and stats[0]["requests"] > 10
    assert stats[1]["auth"] == {"Basic": stats[1]["requests"]} and stats[1]["requests"] > 10
    kinds = {k for s in stats for k in s["outcomes"]}
    assert {"echo_error_200", "echo_text_200", "echo_400", "echo_401", "echo_500"} <= kinds
    frame = read_errors(run_dir)
    errors = frame["error"].to_list()
    for shown in ("HTTP 400", "HTTP 401", "HTTP 500", "malformed"):
        assert any(shown in e for e in errors), (shown, errors[:5])
    assert any("***" in e for e in errors)  # the echo reached the error text, redacted
    records = raw_records(run_dir)
    # a prompt is used up by a record or a refusal (a 4xx); a 5xx or malformed one is due again
    refused = frame.filter(pl.col("error").str.contains("HTTP 40[01]"))["prompt_id"].unique()
    assert len(records) + len(refused) == 80 and run.stop_reason is None
    assert set(refused).isdisjoint(r["prompt_id"] for r in records)
    assert {r["endpoint"] for r in records} == {bearer_srv.base_url, basic_srv.base_url}
    assert read_config(run_dir).endpoints == [bearer_srv.base_url, basic_srv.base_url]
    assert any("api_key_env" in str(w.message) for w in caught)  # advice: no keys in URLs
    # the grep: every file written, everything printed, every warning
    out, err = capfd.readouterr()
    blobs = {
        str(p): p.read_bytes() for d in (run_dir, out_dir) for p in d.rglob("*") if p.is_file()
    }
    blobs |= {"stdout": out.encode(), "stderr": err.encode()}
    blobs |= {f"warning {i}": str(w.message).encode() for i, w in enumerate(caught)}
    assert "run.sqlite" in {Path(n).name for n in blobs}  # config, errors, status: its pages
    assert read_errors(run_dir).height and state(run_dir, "status")  # grepped there, in bytes
    hits = [
        (name, f)
        for name, data in blobs.items()
        for f in leak_forms(KEY, PASSWORD, f"{USER}:{PASSWORD}")
        if f in data
    ]
    assert hits == [], hits


# --------------------------------------------------------------------------- item 4


@pytest.mark.parametrize(
    ("mode", "api"),
    [
        ("usage_negative", "openai"),
        ("usage_huge", "openai"),
        ("usage_bool", "openai"),
        ("usage_string", "openai"),
        ("usage_float", "openai"),
        ("ids_mismatch", "vllm"),
    ],
)
def test_server_counts_are_checked_not_trusted(tmp_path, mode, api):
    """Item 4: usage.completion_tokens was taken as given: negative -> the budget was never
    reached and every prompt sent; huge -> the dataset stopped after 4 records; `true` ->
    counted as 1; a string -> resume and progress() crashed; vLLM ids and usage disagreeing
    went unnoticed. Now each is a `malformed` answer: no record carries it, the errors say
    what was wrong, the run stops early, and progress/resume still read the run."""
    run_dir = tmp_path / "run"
    with FaultServer(FaultConfig(mode=mode)) as srv:
        cfg = config(srv.base_url, budgets={"a": 4000}, api=api)
        run = kit.generate_sync(prompts(300), cfg, run_dir=run_dir)
        sent = srv.stats()["requests"]
        bad = [r["completion_tokens"] for r in raw_records(run_dir)]
        assert bad == []  # not one record with the server's bad count
        errors = read_errors(run_dir)
        assert len(errors) >= 1 and errors["error"].str.contains("completion_tokens").all()
        assert run.stop_reason and "completion_tokens" in run.stop_reason, run.stop_reason
        assert sent < 100, f"{sent} requests for 300 prompts"
        p = progress(run_dir)[0]
        assert (p.tokens_done, p.samples_done, p.errors) == (0, 0, len(errors))
        again = kit.generate_sync(None, cfg, run_dir=run_dir)  # resume reads the run back
        assert again.stop_reason and len(records_frame(run_dir)) == 0
        assert srv.stats()["requests"] - sent < 100


def test_bad_counts_among_good_ones_are_retried_and_the_budget_holds(tmp_path):
    """Item 4: with some answers counting -n tokens the run under-counted what it wrote and
    overshot the budget by far; now a bad count is retried and every record's count is the
    true one (the fault server's completion_tokens == words of the text)."""
    run_dir = tmp_path / "run"
    with FaultServer(FaultConfig(mode="usage_negative", fraction=0.3, seed=2)) as srv:
        cfg = config(srv.base_url, budgets={"a": 3000}, max_attempts=8)
        run = kit.generate_sync(prompts(300), cfg, run_dir=run_dir)
        assert srv.stats()["outcomes"]["usage_negative"] > 5
    records = raw_records(run_dir)
    assert records and all(r["completion_tokens"] == len(r["completion"].split()) for r in records)
    total = sum(r["completion_tokens"] for r in records)
    assert 3000 <= total <= 3000 + MAX_TOKENS and run.summary()["tokens_done"][0] == total
    assert run.stop_reason is None and run.summary()["state"][0] == "budget_reached"


@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_ids_and_count_that_disagree_are_malformed(api, model_dir):
    """Item 4: a server whose usage count disagreed with its own token ids was believed
    (whichever field the backend read). Now len(ids) must equal the count when both are given;
    the ids win when they agree (count_source "server_ids")."""
    kinds = {
        "vllm": (VLLMChat, {}),
        "sglang": (kit.run.backends.SGLangGenerate, {"tokenizer": model_dir}),
    }
    cls, kw = kinds[api]
    msgs = [{"role": "user", "content": "hi"}]
    real = {"tokenizer": str(model_dir)} if api == "sglang" else {}  # ids that spell the text
    with FaultServer(FaultConfig(mode="ids_mismatch", **real)) as srv:
        url = srv.base_url if api == "vllm" else srv.root_url
        err = asyncio.run(_error(cls(url, "m", **kw), msgs))
        srv.configure(mode="ok")
        ok = asyncio.run(_complete(cls(url, "m", **kw), msgs))
    assert err.kind == "malformed" and "completion_tokens" in str(err) and err.retryable
    assert ok.count_source == "server_ids" and ok.completion_tokens == len(ok.output_ids)


def test_usage_far_below_the_tokenizer_count_is_malformed(model_dir):
    """Item 4: with a tokenizer at hand, a server reporting 1 token for a 30-word answer was
    believed. Now the text is re-tokenized and an under-report is a `malformed` answer."""
    msgs = [{"role": "user", "content": "hi"}]
    with FaultServer(FaultConfig(mode="usage_low", min_words=20)) as srv:
        err = asyncio.run(_error(OpenAIChat(srv.base_url, "m", tokenizer=model_dir), msgs))
        srv.configure(mode="ok")
        ok = asyncio.run(_complete(OpenAIChat(srv.base_url, "m", tokenizer=model_dir), msgs))
    assert err.kind == "malformed" and "under-reports" in str(err), str(err)
    assert ok.count_source == "usage" and ok.completion_tokens == len(ok.text.split())


async def _complete(backend, msgs):
    try:
        return await backend.complete(msgs, Sampling(max_tokens=MAX_TOKENS), timeout=10)
    finally:
        await backend.aclose()


async def _error(backend, msgs) -> BackendError:
    with pytest.raises(BackendError) as info:
        await _complete(backend, msgs)
    return info.value


# --------------------------------------------------------------------------- item 5


@pytest.mark.parametrize(
    ("mode", "cause"),
    [
        ("nousage", "no token counts"),
        ("usage_float", "completion_tokens"),
        ("error_200", "The model does not exist"),
        ("sse", "event stream"),
        ("400", "HTTP 400"),
    ],
)
def test_systemic_failures_stop_the_run_with_a_reason(tmp_path, mode, cause):
    """Item 5: usage missing (no tokenizer), float usage, a 200 with an error body, a
    streaming-only server: every prompt was sent, every answer thrown away (300 errors of
    300) and stop_reason stayed None. Now the run stops after max_consecutive_failures
    answers in a row that cannot succeed, with a one-line reason naming the cause and the
    last error, in Run.stop_reason and status.json; the server saw far fewer than 300."""
    run_dir = tmp_path / "run"
    with FaultServer(FaultConfig(mode=mode)) as srv:
        run = kit.generate_sync(prompts(300), config(srv.base_url), run_dir=run_dir)
        sent = srv.stats()["requests"]
    reason = run.stop_reason
    assert reason and "\n" not in reason and cause in reason and "'a'" in reason, reason
    assert sent < 60, f"{sent} requests for 300 prompts"
    status = json.loads(state(run_dir, "status"))
    assert status["finished"] and reason in status_texts(status)
    assert run.summary()["errors"][0] == len(read_errors(run_dir)) >= 1
    with pytest.raises(ValueError, match="max_consecutive_failures must be an int >= 1"):
        config(srv.base_url, max_consecutive_failures=0)


def test_dead_endpoint_stop_reason_reaches_status_json(tmp_path):
    """Item 5: endpoint death stopped the run with Run.stop_reason set, but status.json (what
    kit.watch and the CLI read) did not say why."""
    url = f"http://127.0.0.1:{free_port()}/v1"  # nobody listens
    run = kit.generate_sync(prompts(20), config(url, no_endpoint_timeout=0.5), run_dir=tmp_path)
    assert run.stop_reason and "no healthy endpoint" in run.stop_reason
    status = json.loads(state(tmp_path, "status"))
    assert run.stop_reason in status_texts(status)


def test_retry_after_over_the_cap_is_shown_and_warned_once(tmp_path, monkeypatch):
    """Item 5: a server asking Retry-After: 3600 got a silent 300 s wait per retry: nothing in
    the monitor, nothing in the log. Now the dataset's line carries a note and one warning
    is issued per run, however many 429s arrive."""
    monkeypatch.setattr(Runner, "retry_after_cap", 0.05)  # the rule, without the 300 s wait
    out = io.StringIO()
    with FaultServer(FaultConfig(mode="429", first_k=8, retry_after="3600")) as srv:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mon = ConsoleMonitor(out, min_interval=0)
            run = kit.generate_sync(
                prompts(10), config(srv.base_url), run_dir=tmp_path, progress=mon
            )
            mon.close()
        assert srv.stats()["outcomes"]["429"] == 8
    about = [w for w in caught if "Retry-After" in str(w.message)]
    assert len(about) == 1 and "3600" in str(about[0].message), [str(w.message) for w in caught]
    assert "Retry-After 3600s" in out.getvalue().splitlines()[-1], out.getvalue()[-500:]
    assert run.summary()["samples_done"][0] == 10 and run.stop_reason is None
    status = json.loads(state(tmp_path, "status"))
    assert "Retry-After 3600s" in status_texts(status)
    assert time.time() - status["t"] < 600
