"""Every failure of a request is a server error, counted and retried; only what kit keeps uses
a prompt up (issue 35 items 1, 2, 3 and 10, runner side). Each run is counted against the
fault servers' logs of what they sent: 0 records changed, 0 duplicated, 0 lost beyond the
batch a kill leaves uncommitted."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import polars as pl
import pytest
from faultserver import FaultConfig, FaultServer

import kit
from kit.run import backends
from kit.run.db import integrity
from kit.run.progress import finish_counts
from kit.run.reader import errors_frame, records_frame
from kit.types import RunConfig, Sampling

ROOT = Path(__file__).resolve().parents[1]
DATA = {"stop", "length", "tool_calls"}


def prompts(n: int, datasets=("a", "b")) -> pl.DataFrame:
    rows = [
        {
            "dataset": ds,
            "prompt_id": f"{ds}-{i:04d}",
            "messages": [{"role": "user", "content": f"{ds} item {i}"}],
            "n_turns": 1,
            "row": i,
        }
        for ds in datasets
        for i in range(n)
    ]
    return pl.DataFrame(rows)


def config(endpoints, **kw) -> RunConfig:
    base = dict(
        model="fake",
        endpoints=endpoints,
        budgets={"a": 1500, "b": 1000},
        sampling=Sampling(max_tokens=40),
        concurrency=8,
        retry_base=0.01,
    )
    return RunConfig(**(base | kw))


def sent_ok(sent: list[dict]) -> dict[str, set]:
    """prompt text -> the (content, finish) of every answer a server sent as kept-able."""
    out: dict[str, set] = {}
    for e in sent:
        if e["outcome"] == "ok" and e["status"] == 200:
            text = " ".join(m["content"] for m in e["request"]["messages"])
            choice = e["answer"]["choices"][0]
            out.setdefault(text, set()).add((choice["message"]["content"], choice["finish_reason"]))
    return out


def against_log(run_dir: Path, sent: list[dict]) -> dict:
    """Every stored record against the servers' log: counts of records, changed, duplicated,
    and answers sent (kept-able) whose prompt has no record (lost)."""
    assert integrity(run_dir) == []
    recs = records_frame(run_dir)
    ok = sent_ok(sent)
    texts = [" ".join(m["content"] for m in ms) for ms in recs["messages"].to_list()]
    rows = zip(texts, recs["completion"].to_list(), recs["finish_reason"].to_list(), strict=True)
    changed = sum((c, f) not in ok.get(t, ()) for t, c, f in rows)
    dup = int(recs.select("dataset", "prompt_id", "sample").is_duplicated().sum())
    return {
        "records": recs.height,
        "changed": changed,
        "dup": dup,
        "lost": len(set(ok) - set(texts)),
    }


# ------------------------------------------------------------------ item 1


@pytest.mark.parametrize("broken", ["bad_status", "bad_header", "post_redirect_loop", "malformed"])
def test_a_pool_with_one_broken_endpoint_reaches_every_budget_burning_nothing(tmp_path, broken):
    """One healthy and one broken endpoint (the broken one answers fastest): the broken answers
    are server errors, retried elsewhere, and take their endpoint out; both budgets are
    reached, no prompt is used up without a record, every record is what was sent."""
    run_dir = tmp_path / "run"
    with (
        FaultServer(FaultConfig(latency=0.01)) as good,
        FaultServer(FaultConfig(mode=broken)) as bad,
    ):
        run = kit.generate_sync(
            prompts(300), config([bad.base_url, good.base_url]), run_dir=run_dir
        )
        sent = good.sent() + bad.sent()
        hits = bad.stats()["outcomes"].get(broken, 0)
    states = dict(run.summary().select("dataset", "state").iter_rows())
    assert states == {"a": "budget_reached", "b": "budget_reached"}, run.summary()
    assert run.short == {} and run.stop_reason is None and hits >= 3
    got = against_log(run_dir, sent)
    assert got["changed"] == got["dup"] == got["lost"] == 0 and got["records"] > 50, got
    errors = errors_frame(run_dir)
    assert not errors["error"].str.contains("internal|HTTP 4").any()  # nothing burned
    assert (~errors["resolved"]).sum() <= 8  # at most those in flight at the budget


@pytest.mark.parametrize("broken", ["bad_status", "post_redirect_loop", "500"])
def test_a_lone_broken_endpoint_ends_short_non_zero_with_the_reason(tmp_path, broken):
    """With only a broken endpoint nothing is kept: the run ends saying why (API: stop_reason
    or `short`), every prompt stays due (no record, none used up)."""
    run_dir = tmp_path / "run"
    with FaultServer(FaultConfig(mode=broken)) as srv:
        cfg = config(srv.base_url, budgets={"a": 1500}, max_attempts=2, max_consecutive_failures=5)
        run = kit.generate_sync(prompts(30, ("a",)), cfg, run_dir=run_dir)
    assert run.short or run.stop_reason, run.summary()
    why = " ".join([run.stop_reason or "", *run.short.values()])
    assert ("broken" in why or "malformed" in why or "HTTP 500" in why) and "internal" not in why
    assert records_frame(run_dir).height == 0
    assert errors_frame(run_dir)["prompt_id"].n_unique() <= 30


def _request_info() -> aiohttp.RequestInfo:
    from multidict import CIMultiDict, CIMultiDictProxy
    from yarl import URL

    url = URL("http://127.0.0.1:1/v1/chat/completions")
    return aiohttp.RequestInfo(url, "POST", CIMultiDictProxy(CIMultiDict()), url)


@pytest.mark.parametrize(
    ("raised", "kind"),
    [
        (lambda: OverflowError("Python int too large to convert to C long"), "malformed"),
        (lambda: UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), "malformed"),
        (lambda: ValueError("invalid literal for int() with base 16"), "malformed"),
        (lambda: ConnectionResetError(104, "Connection reset by peer"), "connect"),
        (lambda: aiohttp.TooManyRedirects(_request_info(), ()), "malformed"),
        (lambda: aiohttp.InvalidURL("http://[::1"), "malformed"),
        (lambda: asyncio.TimeoutError(), "timeout"),
    ],
)
def test_whatever_a_transport_raises_is_a_retried_server_error(tmp_path, monkeypatch, raised, kind):
    """Any exception out of a request that the backend did not turn into a BackendError
    (aiohttp's, an OSError, bad data: what an escaped `except` lets through) is a server
    error: retried, stored with its kind, never `internal`; every prompt gets its record."""
    real = backends.OpenAIChat.complete
    calls = {"n": 0}

    async def flaky(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise raised()
        return await real(self, *args, **kwargs)

    run_dir = tmp_path / "run"
    monkeypatch.setattr(backends.OpenAIChat, "complete", flaky)
    with FaultServer() as srv:
        cfg = config(srv.base_url, budgets={"a": 10**6})
        run = kit.generate_sync(prompts(40, ("a",)), cfg, run_dir=run_dir)
        sent = srv.sent()
    assert run.stop_reason is None and run.short == {}
    assert against_log(run_dir, sent) == {"records": 40, "changed": 0, "dup": 0, "lost": 0}
    assert run.summary()["retries"][0] >= 10
    errors = errors_frame(run_dir)["error"]
    assert errors.str.starts_with(kind + ":").all() and not errors.str.contains("internal").any()


def test_kits_own_bug_stops_the_run_with_its_traceback_and_burns_nothing(tmp_path, monkeypatch):
    """A TypeError inside a request is no server's fault: the run stops and raises it, writes
    no `internal` error row, and a resume answers every prompt."""
    real = backends.OpenAIChat.complete
    calls = {"n": 0}

    async def buggy(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 20:
            raise TypeError("a bug in kit")
        return await real(self, *args, **kwargs)

    run_dir = tmp_path / "run"
    with FaultServer() as srv:
        cfg = config(srv.base_url, budgets={"a": 10**6})
        monkeypatch.setattr(backends.OpenAIChat, "complete", buggy)
        with pytest.raises(TypeError, match="a bug in kit") as info:
            kit.generate_sync(prompts(60, ("a",)), cfg, run_dir=run_dir)
        assert any(f.name == "buggy" for f in info.traceback)
        assert errors_frame(run_dir).height == 0
        monkeypatch.setattr(backends.OpenAIChat, "complete", real)
        kit.generate_sync(prompts(60, ("a",)), cfg, run_dir=run_dir)
        sent = srv.sent()
    got = against_log(run_dir, sent)
    assert got == {"records": 60, "changed": 0, "dup": 0, "lost": 0}


def test_cli_exits_non_zero_when_a_dataset_ends_short(tmp_path, capsys):
    """`kit generate` on a server that refuses some prompts (a 400): the dataset runs out of
    prompts short of its budget, so the command exits 1 naming it and the refusals."""
    from kit.cli import main

    run_dir = tmp_path / "run"
    samples = tmp_path / "a.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"task {i}"}]} for i in range(30)]
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with FaultServer() as srv:  # the pilot gets answers, then the server refuses some
        base = ["--run-dir", str(run_dir), "--base-url", srv.base_url, "--model", "fake"]
        plan = ["plan", "--samples", str(samples), "--budget", "100000", "--max-tokens", "40"]
        plan_code = main([*plan, "--pilot-per-dataset", "2", *base])
        srv.configure(mode="400", fraction=0.3, seed=2)
        code = main(["generate", *base])
    err = capsys.readouterr().err
    assert plan_code == 0 and code == 1, err[-2000:]
    assert "kit: dataset 'a' ended short of its budget" in err and "refused by the server" in err


# ------------------------------------------------------------------ item 2


@pytest.mark.parametrize(
    ("mode", "bad"),
    [
        ("bad_id", 2**32),
        ("bad_id", 2**63),
        ("bad_id", -1),
        ("bad_prompt_id", 2**32),
        ("bad_prompt_id", 2**40),
    ],
)
def test_impossible_token_ids_are_malformed_and_retried_never_fail_a_commit(tmp_path, mode, bad):
    run_dir = tmp_path / "run"
    fault = FaultConfig(mode=mode, bad_id=bad, fraction=0.3, seed=4)
    with FaultServer(fault) as srv:
        cfg = config(srv.base_url, api="vllm", budgets={"a": 10**6})
        run = kit.generate_sync(prompts(60, ("a",)), cfg, run_dir=run_dir)
        sent, faults = srv.sent(), srv.stats()["outcomes"].get(mode, 0)
    assert faults >= 5 and run.stop_reason is None and run.short == {}
    got = against_log(run_dir, sent)
    assert got == {"records": 60, "changed": 0, "dup": 0, "lost": 0}
    errors = errors_frame(run_dir)["error"]
    assert run.summary()["retries"][0] >= faults - 5 * errors.len()
    assert errors.str.starts_with("malformed").all()


def test_ids_past_the_tokenizers_vocabulary_are_malformed(tmp_path, model_dir):
    """With a tokenizer kit knows the vocabulary: an id at its size is no token."""
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(model_dir)))
    run_dir = tmp_path / "run"
    fault = FaultConfig(mode="bad_id", bad_id=vocab, fraction=0.3, seed=4, tokenizer=str(model_dir))
    with FaultServer(fault) as srv:
        cfg = config(srv.base_url, api="vllm", budgets={"a": 10**6}, tokenizer=str(model_dir))
        kit.generate_sync(prompts(30, ("a",)), cfg, run_dir=run_dir)
        sent, faults = srv.sent(), srv.stats()["outcomes"].get("bad_id", 0)
    assert faults >= 3
    assert against_log(run_dir, sent) == {"records": 30, "changed": 0, "dup": 0, "lost": 0}
    assert errors_frame(run_dir)["error"].str.contains(f"0..{vocab - 1}").all()


# ------------------------------------------------------------------ item 3


@pytest.mark.parametrize("finish", ["abort", "content_filter", "cancelled"])
def test_finishes_that_are_no_data_are_retried_counted_apart_and_never_fill_a_budget(
    tmp_path, finish
):
    """20% of answers end in `finish`: none is a record, each is counted per finish reason in
    the run database, retried; `budget_reached` means the kept records reach the budget."""
    run_dir = tmp_path / "run"
    with FaultServer(FaultConfig(mode="finish", finish=finish, fraction=0.2, seed=6)) as srv:
        run = kit.generate_sync(prompts(300), config(srv.base_url), run_dir=run_dir)
        sent, faults = srv.sent(), srv.stats()["outcomes"]["finish"]
    assert faults >= 10 and run.short == {}
    got = against_log(run_dir, sent)
    assert got["changed"] == got["dup"] == got["lost"] == 0, got
    recs = records_frame(run_dir, prompts=False)
    assert set(recs["finish_reason"]) <= DATA
    counts = finish_counts(run_dir)
    assert sum(counts.values()) == faults and {f for _, f in counts} == {finish}
    kept = dict(recs.group_by("dataset").agg(pl.col("completion_tokens").sum()).iter_rows())
    summary = run.summary()
    for ds, budget in {"a": 1500, "b": 1000}.items():
        row = summary.filter(pl.col("dataset") == ds).row(0, named=True)
        assert row["state"] == "budget_reached" and kept[ds] == row["tokens_done"] >= budget


# ------------------------------------------------------------------ item 10


def test_content_null_with_tokens_counted_is_malformed(tmp_path):
    run_dir = tmp_path / "run"
    with FaultServer(FaultConfig(mode="content_null", fraction=0.3, seed=8)) as srv:
        cfg = config(srv.base_url, budgets={"a": 10**6})
        kit.generate_sync(prompts(40, ("a",)), cfg, run_dir=run_dir)
        sent, faults = srv.sent(), srv.stats()["outcomes"]["content_null"]
    assert faults >= 5
    assert against_log(run_dir, sent) == {"records": 40, "changed": 0, "dup": 0, "lost": 0}
    assert records_frame(run_dir, prompts=False)["completion"].str.len_chars().min() > 0
    assert errors_frame(run_dir)["error"].str.contains("no content").all()


RUNNER = """
import json, sys
import polars as pl
import kit
args = json.loads(sys.argv[1])
run = kit.generate_sync(pl.read_parquet(args["prompts"]), kit.RunConfig.from_dict(args["config"]),
                        run_dir=args["run_dir"])
print(json.dumps({"stop_reason": run.stop_reason}))
"""


def _spawn(tmp_path: Path, url: str) -> tuple[subprocess.Popen, Path]:
    frame_path, run_dir = tmp_path / "prompts.parquet", tmp_path / "run"
    prompts(2000).write_parquet(frame_path)
    cfg = config(url, budgets={"a": 10**6, "b": 10**6})
    args = {"prompts": str(frame_path), "run_dir": str(run_dir), "config": cfg.to_dict()}
    proc = subprocess.Popen(
        [sys.executable, "-c", RUNNER, json.dumps(args)],
        env=os.environ | {"PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, run_dir


def _wait_for_records(srv: FaultServer, n: int) -> None:
    deadline = time.monotonic() + 90
    while srv.stats()["requests"] < n:
        assert time.monotonic() < deadline, "the runner sent too few requests"
        time.sleep(0.05)


def test_sighup_stops_as_cleanly_as_sigterm(tmp_path):
    """A closed terminal: records flushed, the status says stopped by SIGHUP, exit 0 (the
    API run returned), not 129 with the status left "running"."""
    with FaultServer(FaultConfig(latency=0.02)) as srv:
        proc, run_dir = _spawn(tmp_path, srv.base_url)
        _wait_for_records(srv, 200)
        proc.send_signal(signal.SIGHUP)
        out, err = proc.communicate(timeout=60)
        sent = srv.sent()
    assert proc.returncode == 0, err[-2000:]
    assert json.loads(out.splitlines()[-1])["stop_reason"] == "stopped by SIGHUP"
    status = kit.run.progress.progress(run_dir)
    assert {p.state for p in status} == {"stopped"}
    got = against_log(run_dir, sent)
    # every answer sent was written: a clean stop flushes, only in-flight requests are lost
    assert got["changed"] == got["dup"] == 0 and got["lost"] <= 8 and got["records"] >= 150, got


def test_three_ctrl_c_within_100ms_write_no_false_internal_error(tmp_path):
    with FaultServer(FaultConfig(latency=0.02)) as srv:
        proc, run_dir = _spawn(tmp_path, srv.base_url)
        _wait_for_records(srv, 200)
        for _ in range(3):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.03)
        proc.communicate(timeout=60)
        sent = srv.sent()
    errors = errors_frame(run_dir)["error"]
    assert not errors.str.contains("internal|KeyboardInterrupt").any(), errors.to_list()
    got = against_log(run_dir, sent)
    assert got["changed"] == got["dup"] == 0 and got["records"] >= 100, got
    assert got["lost"] <= max(8, 32)  # at most the batch not yet committed


def test_ctrl_c_landing_inside_a_request_writes_no_error_row_and_burns_nothing(
    tmp_path, monkeypatch
):
    """The KeyboardInterrupt of a second Ctrl-C raised inside a request (what three Ctrl-C
    within 100 ms do when one lands mid-request): the run stops, no `internal:
    KeyboardInterrupt` row is written, and a resume answers every prompt."""
    real = backends.OpenAIChat.complete
    calls = {"n": 0}

    async def interrupted(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 20:
            raise KeyboardInterrupt
        return await real(self, *args, **kwargs)

    run_dir = tmp_path / "run"
    with FaultServer() as srv:
        cfg = config(srv.base_url, budgets={"a": 10**6})
        monkeypatch.setattr(backends.OpenAIChat, "complete", interrupted)
        with pytest.raises(KeyboardInterrupt):
            kit.generate_sync(prompts(60, ("a",)), cfg, run_dir=run_dir)
        assert errors_frame(run_dir).height == 0
        monkeypatch.setattr(backends.OpenAIChat, "complete", real)
        kit.generate_sync(prompts(60, ("a",)), cfg, run_dir=run_dir)
        sent = srv.sent()
    assert against_log(run_dir, sent) == {"records": 60, "changed": 0, "dup": 0, "lost": 0}
