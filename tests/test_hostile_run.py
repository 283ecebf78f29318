"""Issue 23, items 3-5: runs against a server that cannot or will not answer, that echoes
secrets escaped, or that lies about counts and token ids (tests/faultserver.py). Each test
breaks a real run and accounts for every prompt: records + errors + never sent == prompts.

3. a run where nothing can succeed stops within a stated time, naming why; a dataset none
   of whose requests can succeed fails alone while the others go on; both exit non-zero;
4. a key echoed JSON-escaped (PHP, Java), URL-encoded or in a base URL's query string lands
   in no file kit writes and in nothing it prints;
5. a zero count for a non-empty answer is malformed; token ids that do not spell the text
   are never exported as the server's exact ids, and the manifest counts them.
"""

from __future__ import annotations

import base64
import json
import re
import sys
import time
import warnings
from pathlib import Path
from urllib.parse import quote, quote_plus

import polars as pl
import pytest
from faultserver import FaultConfig, FaultServer

import kit
from kit import cli
from kit.report.monitor import ConsoleMonitor
from kit.run.reader import errors_frame, records_frame, state
from kit.types import RunConfig, Sampling

MAX_TOKENS = 40
TOOLS = '[{"type":"function","function":{"name":"add","parameters":{"type":"object"}}}]'


def prompts(sizes: dict[str, int], tools: tuple[str, ...] = ()) -> pl.DataFrame:
    """sizes: dataset -> prompts; the datasets in `tools` carry a tool definition."""
    rows = [
        {
            "dataset": ds,
            "prompt_id": f"{ds}-{i:04d}",
            "n_turns": 1,
            "row": i,
            "messages": [{"role": "user", "content": f"{ds} item {i}"}],
            "tools": TOOLS if ds in tools else None,
        }
        for ds, n in sizes.items()
        for i in range(n)
    ]
    return pl.DataFrame(rows, schema_overrides={"tools": pl.String})


def config(endpoints, datasets, **kw) -> RunConfig:
    base = dict(
        model="fake",
        endpoints=endpoints,
        budgets=dict.fromkeys(datasets, 10**7),
        sampling=Sampling(max_tokens=MAX_TOKENS),
        concurrency=4,
        retry_base=0.01,
    )
    return RunConfig(**(base | kw))


def raw_records(run_dir: Path) -> list[dict]:
    """Every record of the run as stored (no prompt), through the one reader."""
    return records_frame(run_dir, prompts=False).to_dicts()


def read_errors(run_dir: Path) -> pl.DataFrame:
    """The run's open errors (keys with no record), from its errors table."""
    errors = errors_frame(run_dir)
    return errors.filter(~errors["resolved"])


def accounted(run, run_dir: Path, n: int) -> tuple[int, int, int]:
    """(records, errors, never sent), checked to add up to the n prompts."""
    records, errors = len(raw_records(run_dir)), len(read_errors(run_dir))
    s = run.summary()
    assert (s["samples_done"].sum(), s["errors"].sum()) == (records, errors)
    unsent = n - records - errors
    assert unsent >= 0
    return records, errors, unsent


# --------------------------------------------------------------------------- item 3


def test_systemic_failure_stops_in_bounded_time_and_failed_datasets_exit_non_zero(tmp_path):
    """Item 3: 12 prompts each refused (401) exited 0; HTTP 500 on chat with /health at 200
    took 76 s for 12 prompts and ran on past 5 minutes for 600, exit 0; 20 refusals in a row
    of one dataset stopped every dataset. Now: the 500 run stops once stall_timeout passed
    with every attempt failed (here 3 s, default 60 s), naming the cause; 12 refused prompts
    fail their dataset and the run; a dataset whose tools the server refuses fails alone
    while the others finish, and `kit generate` exits 1 naming it."""
    # HTTP 500 to every chat request while /health says 200: bounded, stated, non-zero
    with FaultServer(FaultConfig(mode="500")) as srv:
        cfg = config(srv.base_url, ["a"], stall_timeout=3.0, max_attempts=1000, retry_base=0.05)
        t0 = time.monotonic()
        run = kit.generate_sync(prompts({"a": 600}), cfg, run_dir=tmp_path / "r500")
        took = time.monotonic() - t0
        assert srv.stats()["outcomes"]["500"] >= 8
    # 3 s, or the time 8 attempts take to fail: the pool takes the endpoint out after 3 and
    # its prober (every 5 s) brings it back, since /health says 200
    assert 3.0 <= took < 3.0 + 8, took
    assert re.match(r"no request succeeded for \d+s \(stall_timeout 3s\)", run.stop_reason)
    assert "HTTP 500" in run.stop_reason
    records, errors, unsent = accounted(run, tmp_path / "r500", 600)
    assert records == 0 and unsent >= 590  # in-flight requests were cut short, none written

    # 12 prompts, every request refused (401): the dataset fails, and with it the run
    with FaultServer(FaultConfig(mode="400")) as srv:
        run = kit.generate_sync(
            prompts({"a": 12}), config(srv.base_url, ["a"]), run_dir=tmp_path / "r401"
        )
    assert accounted(run, tmp_path / "r401", 12) == (0, 12, 0)
    assert set(run.failed) == {"a"} and "all 12 requests failed" in run.failed["a"]
    assert run.stop_reason.startswith("every dataset failed: dataset 'a'")
    assert run.summary()["state"].to_list() == ["failed"]

    # tools refused for one dataset: it fails after 20 refusals, the other one finishes
    run_dir = tmp_path / "tools"
    with FaultServer(FaultConfig(refuse_tools=True)) as srv:
        frame = prompts({"plain": 100, "tooled": 100}, tools=("tooled",))
        run = kit.generate_sync(frame, config(srv.base_url, ["plain", "tooled"]), run_dir=run_dir)
        assert srv.stats()["outcomes"]["tools_refused"] < 30
    assert run.stop_reason is None and set(run.failed) == {"tooled"}
    assert "20 answers in a row failed" in run.failed["tooled"]
    assert "tool choice requires" in run.failed["tooled"]
    states = dict(run.summary().select("dataset", "state").iter_rows())
    assert states == {"plain": "exhausted", "tooled": "failed"}
    records = raw_records(run_dir)
    assert sorted(r["prompt_id"] for r in records) == [f"plain-{i:04d}" for i in range(100)]
    errors = read_errors(run_dir)
    assert set(errors["dataset"]) == {"tooled"} and 20 <= len(errors) < 30
    status = json.loads(state(run_dir, "status"))
    assert {d["dataset"]: d["state"] for d in status["datasets"]}["tooled"] == "failed"
    assert kit.watch(run_dir, until_done=True, monitor=lambda p: None)[1].state == "failed"


def test_requests_failing_every_attempt_with_5xx_stop_before_stall_timeout(tmp_path):
    """The runner's two run-level rules for a server that answers only 5xx, as one set
    (issues 23 and 26): with retries left the stall rule stops the run after stall_timeout
    (above); requests that used up their attempts on 5xx, max(8, concurrency) in a row, stop
    it at once as dead endpoints (a gateway with no live worker), long before stall_timeout."""
    with FaultServer(FaultConfig(mode="500")) as srv:
        cfg = config(srv.base_url, ["a"], stall_timeout=600.0, max_attempts=2)
        t0 = time.monotonic()
        run = kit.generate_sync(prompts({"a": 200}), cfg, run_dir=tmp_path)
        took = time.monotonic() - t0
    assert took < 60, took
    assert re.match(r"\d+ requests in a row failed, last: http_5xx: HTTP 500", run.stop_reason)
    records, errors, unsent = accounted(run, tmp_path, 200)
    assert records == 0 and 8 <= errors < 20 and not run.failed  # the dataset is not to blame


def test_cli_exits_non_zero_naming_a_failed_dataset(tmp_path, capsys):
    """Item 3, through `kit plan` + `kit generate`: a dataset whose tools the server refuses
    fails, the other finishes, exit 1, one line per failed dataset on stderr."""
    samples = tmp_path / "samples"
    samples.mkdir()
    for name, extra in (("plain", {}), ("tooled", {"tools": json.loads(TOOLS)})):
        rows = [
            {"messages": [{"role": "user", "content": f"{name} {i}"}]} | extra for i in range(30)
        ]
        (samples / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    with FaultServer() as srv:  # the pilot gets answers (a failed pilot stops `kit plan`)
        common = ["--base-url", srv.base_url, "--model", "fake"]
        plan = cli.main(
            [
                "plan",
                "--samples",
                str(samples),
                "--budget",
                "100000",
                "--run-dir",
                str(run_dir),
                "--max-tokens",
                "40",
                "--pilot-per-dataset",
                "2",
                *common,
            ]
        )
        assert plan == 0, capsys.readouterr().err[-2000:]
        capsys.readouterr()
        srv.configure(refuse_tools=True)  # then the server is restarted without tool calling
        code = cli.main(["generate", "--run-dir", str(run_dir), *common])
    err = capsys.readouterr().err
    assert code == 1, err[-2000:]
    failed = [line for line in err.splitlines() if line.startswith("kit: dataset")]
    assert len(failed) == 1 and failed[0].startswith("kit: dataset 'tooled' failed: ")
    assert "tool choice requires" in failed[0] and "Traceback" not in err
    records, errors = raw_records(run_dir), read_errors(run_dir)
    plain = sorted(r["prompt_id"] for r in records if r["dataset"] == "plain")
    assert len(plain) == len(set(plain)) == 30  # every prompt of the other dataset
    assert set(errors["dataset"]) == {"tooled"} and len(errors) >= 20


# --------------------------------------------------------------------------- item 4

KEY_ENV = "KIT_HOSTILE_KEY23"
KEY = "sk-TEST/abc+def=Hostile-0123456789XYZ"  # "/", "+", "=": escaped differently everywhere
QUERY_KEY = "qk-Query/Key+4567=abcXYZ"


def php(s: str) -> str:
    return s.replace("/", "\\/")


def java(s: str) -> str:
    return "".join(f"\\u{ord(c):04x}" if c in "/+=" else c for c in s)


def key_forms(secret: str) -> set[bytes]:
    """A secret as is, in either case, JSON-escaped as PHP and Java write it, URL-encoded,
    base64; and each of those as it reads once written inside a JSON string."""
    forms = {
        secret,
        secret.lower(),
        secret.upper(),
        php(secret),
        java(secret),
        java(secret).upper(),
        quote(secret, safe=""),
        quote_plus(secret),
        base64.b64encode(secret.encode()).decode(),
    }
    forms |= {json.dumps(f)[1:-1] for f in forms}
    return {f.encode() for f in forms}


def every_file(*roots: Path) -> dict[str, bytes]:
    """The raw bytes of every file under the roots (whatever the run directory's layout)."""
    return {str(p): p.read_bytes() for r in roots for p in sorted(r.rglob("*")) if p.is_file()}


def test_escaped_and_query_string_keys_land_nowhere(tmp_path, monkeypatch, capfd):
    """Item 4: a key echoed JSON-escaped ("sk-TEST\\/abc+def=..." as PHP writes it; Java's
    "\\u003d") reached the errors, the run's status and the console, and a key in a base URL's
    query string was printed in full by the credentials warning. Now: grep every file of
    the run directory and its export, everything printed and every warning, for both keys
    in every form: 0 hits; and the query key was sent with every request."""
    monkeypatch.setenv(KEY_ENV, KEY)
    run_dir, out_dir = tmp_path / "run", tmp_path / "export"
    echo = FaultConfig(mode="echo", fraction=0.5, seed=5)
    with FaultServer(echo) as bearer_srv, FaultServer(echo) as query_srv:
        query_url = f"{query_srv.base_url}?api_key={quote(QUERY_KEY, safe='')}"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = config(
                [bearer_srv.base_url, query_url], ["a"], api_key_env=KEY_ENV, max_attempts=1
            )
            mon = ConsoleMonitor(sys.stdout, min_interval=0)
            run = kit.generate_sync(prompts({"a": 80}), cfg, run_dir=run_dir, progress=mon)
            mon.close()
            print(run.summary(), run.stop_reason, run.failed, repr(cfg), cfg)
            kit.export(run_dir, out_dir, formats=("specforge", "parquet"))
            print(kit.validate(out_dir).summary())
        stats = [bearer_srv.stats(), query_srv.stats()]
        target = query_srv.last_headers[":target"]
    # the test means something: the keys were sent, every echo kind answered (the pool
    # routes around an endpoint while its answers are broken: fewer requests reach one)
    assert stats[0]["auth"] == {"Bearer": stats[0]["requests"]} and stats[0]["requests"] >= 5
    assert quote(QUERY_KEY, safe="")[:10] in target or QUERY_KEY[:10] in target, target
    kinds = {k for s in stats for k in s["outcomes"]}
    assert {"echo_error_200", "echo_text_200", "echo_400", "echo_401", "echo_500"} <= kinds
    frame = read_errors(run_dir)
    errors = frame["error"].to_list()
    assert any("***" in e for e in errors) and any("php" in e for e in errors)
    records = len(raw_records(run_dir))
    # a prompt is used up by a record or a refusal (a 4xx); a 5xx or malformed one is due again
    refused = frame.filter(pl.col("error").str.contains("HTTP 40[01]"))["prompt_id"].n_unique()
    assert records + refused == 80 and records > 20
    assert any("query string" in str(w.message) for w in caught)  # the warning was given
    out, err = capfd.readouterr()
    blobs = every_file(run_dir, out_dir) | {"stdout": out.encode(), "stderr": err.encode()}
    blobs |= {f"warning {i}": str(w.message).encode() for i, w in enumerate(caught)}
    assert {"run.sqlite", "manifest.json"} <= {Path(n).name for n in blobs}  # its pages hold
    assert read_errors(run_dir).height and state(run_dir, "status")  # errors and status
    hits = [
        (name, f)
        for name, data in blobs.items()
        for f in key_forms(KEY) | key_forms(QUERY_KEY)
        if f in data
    ]
    assert hits == [], hits[:10]


# --------------------------------------------------------------------------- item 5


def test_zero_counts_are_malformed_and_the_budget_holds(tmp_path):
    """Item 5: usage 0 for a non-empty answer was accepted, so the budget never stopped the
    run (600 prompts used for an 800-token budget). Now a zero count is a malformed answer:
    retried, every record carries the true count and the budget stops the run."""
    with FaultServer(FaultConfig(mode="usage_zero", fraction=0.5, seed=1)) as srv:
        # 20 attempts: a prompt drawing a zero count 20 times in a row (0.5**20) never errs
        cfg = config(srv.base_url, ["a"], budgets={"a": 800}, max_attempts=20)
        run = kit.generate_sync(prompts({"a": 600}), cfg, run_dir=tmp_path)
        stats = srv.stats()
    assert stats["outcomes"]["usage_zero"] > 5 and stats["requests"] < 120, stats
    records = raw_records(tmp_path)
    assert all(r["completion_tokens"] == len(r["completion"].split()) > 0 for r in records)
    total = sum(r["completion_tokens"] for r in records)
    assert 800 <= total <= 800 + MAX_TOKENS and run.summary()["state"][0] == "budget_reached"
    n, errors, unsent = accounted(run, tmp_path, 600)
    assert n == len(records) and errors == 0 and unsent == 600 - n


@pytest.mark.parametrize("at_run", [True, False], ids=["tokenizer_at_run", "export_only"])
def test_ids_that_do_not_spell_the_text_are_never_exported_as_exact(tmp_path, model_dir, at_run):
    """Item 5: token ids that did not decode to the text were exported as the server's exact
    ids. Now (with the run's tokenizer) such an answer is recorded with count_source
    "retokenized" and its text's own count; the export, which always has the tokenizer,
    re-tokenizes every row whose ids do not spell its text, and the manifest counts them
    (token_rows.<dataset>.ids_text_differ); the other rows stay exact."""
    lie = FaultConfig(mode="ids_lie", fraction=0.3, seed=4, tokenizer=str(model_dir), max_words=20)
    run_dir, out = tmp_path / "run", tmp_path / "out"
    with FaultServer(lie) as srv:
        tok = {"tokenizer": str(model_dir)} if at_run else {}
        cfg = config(srv.base_url, ["a"], api="vllm", **tok)
        run = kit.generate_sync(prompts({"a": 40}), cfg, run_dir=run_dir)
        lies = srv.stats()["outcomes"]["ids_lie"]
    assert accounted(run, run_dir, 40) == (40, 0, 0) and 5 <= lies <= 25
    records = raw_records(run_dir)
    sources = pl.Series([r["count_source"] for r in records]).value_counts(sort=True)
    expect = {"retokenized": lies, "server_ids": 40 - lies} if at_run else {"server_ids": 40}
    assert dict(sources.iter_rows()) == expect
    result = kit.export(run_dir, out, tokenizer=str(model_dir), formats=("token_ids",))
    counts = result.manifest["token_rows"]["a"]
    assert (counts["exact"], counts["ids_text_differ"], counts["retokenized"]) == (
        40 - lies,
        lies,
        lies,
    )
    assert f"a: {lies} rows: the server's output ids do not spell its text" in result.summary()
    rows = [json.loads(line) for line in (out / "token_ids/train.jsonl").read_text().splitlines()]
    assert len(rows) == 40 and sum(r["ids_source"] == "server" for r in rows) == 40 - lies
    assert kit.validate(out).ok
