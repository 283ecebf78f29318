"""Planning again from the stored pilot: `kit plan` (and kit.plan.stored_pilot) reuse it with
no request when the model, sampling, turns and server are the same and it is large enough,
and say why when they pilot again; a pilot with no answer says how many requests failed and
why, a dead port fails at once, a SIGTERM during the pilot says it was interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from faultserver import FaultConfig, FaultServer

import kit
from kit import cli, plan
from kit.errors import ConnectError
from kit.types import RunConfig, Sampling

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "data" / "samples"

pytestmark = pytest.mark.filterwarnings("ignore:weak pilot:UserWarning")


def kit_plan(run_dir, samples, url, *extra, capsys, model="m") -> tuple[int, str, str]:
    """`kit plan` in this process against url: (exit code, stdout, stderr)."""
    argv = ["plan", "--run-dir", str(run_dir), "--samples", *map(str, samples)]
    argv += ["--base-url", url, "--model", model, "--max-tokens", "32", "--concurrency", "4"]
    argv += ["--pilot-per-dataset", "3", "--budget", "2000", *extra]
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def stored_rows(run_dir) -> dict:
    return kit.plan.read_plan(run_dir)["pilot"]["rows"]


@pytest.fixture
def two_sets(tmp_path) -> list[Path]:
    """Two of the samples, copied (a test edits them)."""
    out = []
    for name in ("chat_general.jsonl", "alpaca_tasks.jsonl"):
        (tmp_path / name).write_bytes((SAMPLES / name).read_bytes())
        out.append(tmp_path / name)
    return out


def test_a_second_plan_reuses_the_stored_pilot_and_sends_no_request(tmp_path, two_sets, capsys):
    """Issue 34 item 8: every `kit plan` ran the pilot again (1 min 55 s each, and another
    sample's means). The same model, sampling and server now reuse the stored pilot."""
    run_dir = tmp_path / "run"
    with FaultServer(FaultConfig(latency=0.01)) as srv:
        code, _, err = kit_plan(run_dir, two_sets, srv.base_url, capsys=capsys)
        assert code == 0, err
        first = srv.stats()["requests"]
        assert first == 6  # 3 prompts x 2 datasets
        rows, created = stored_rows(run_dir), kit.plan.read_plan(run_dir)["created"]

        t0 = time.monotonic()
        argv = ("--budget", "chat_general=5000", "alpaca_tasks=700")
        code, out, err = kit_plan(run_dir, two_sets, srv.base_url, *argv, capsys=capsys)
        took = time.monotonic() - t0
        assert code == 0, err
        assert srv.stats()["requests"] == first  # not one request
    assert "reusing the pilot stored in" in err and "no request sent" in err
    assert took < 10
    back = kit.plan.read_plan(run_dir)
    assert back["budgets"] == {"chat_general": 5000, "alpaca_tasks": 700}
    assert back["pilot"]["rows"] == rows and back["pilot"]["completions"] == 6
    assert back["created"] >= created and "plan written" in out
    table = back["table"].filter(pl.col("dataset") == "chat_general")
    assert table["budget"].to_list() == [5000]  # planned from the stored lengths


def test_a_larger_or_new_pilot_is_run_when_asked(tmp_path, two_sets, capsys):
    run_dir = tmp_path / "run"
    with FaultServer(FaultConfig(latency=0.01)) as srv:
        assert kit_plan(run_dir, two_sets, srv.base_url, capsys=capsys)[0] == 0
        assert srv.stats()["requests"] == 6

        code, _, err = kit_plan(
            run_dir, two_sets, srv.base_url, "--pilot-per-dataset", "2", capsys=capsys
        )
        assert code == 0 and "reusing" in err  # fewer asked: the stored 3 answer for it
        assert srv.stats()["requests"] == 6

        code, _, err = kit_plan(
            run_dir, two_sets, srv.base_url, "--pilot-per-dataset", "5", capsys=capsys
        )
        assert code == 0, err
        assert "not reused: 5 prompts of 'alpaca_tasks' asked, it sent 3" in err
        assert srv.stats()["requests"] == 6 + 10
        assert kit.plan.read_plan(run_dir)["pilot"]["chosen"] == {
            "alpaca_tasks": 5,
            "chat_general": 5,
        }

        code, _, err = kit_plan(run_dir, two_sets, srv.base_url, "--new-pilot", capsys=capsys)
        assert code == 0 and "pilot: a new one (--new-pilot)" in err
        assert srv.stats()["requests"] == 6 + 10 + 6


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (("--max-tokens", "16"), "sampling.max_tokens 32 -> 16"),
        (("--temperature", "0.2"), "sampling.temperature 0.5 -> 0.2"),
        (("--frequency-penalty", "0.3"), "sampling.frequency_penalty 0.0 -> 0.3"),
        (("--turns", "all_turns"), "turns 'last_turn' -> 'all_turns'"),
        (("--api", "vllm"), "(openai api)' -> "),
    ],
)
def test_another_sampling_or_server_says_why_and_pilots_again(
    flags, reason, tmp_path, two_sets, capsys
):
    """A changed model or sampling makes the stored lengths another target's: the plan says
    which field changed, then pilots again (what the user asked for is a plan of the new
    settings; --show keeps the old plan readable until this one is written)."""
    run_dir = tmp_path / "run"
    with FaultServer(FaultConfig(latency=0.01)) as srv:
        assert kit_plan(run_dir, two_sets, srv.base_url, capsys=capsys)[0] == 0
        code, _, err = kit_plan(run_dir, two_sets, srv.base_url, *flags, capsys=capsys)
        assert code == 0, err
        assert srv.stats()["requests"] == 12  # a new pilot
    assert "is not reused: it was made with another " in err and reason in err


def test_another_model_server_or_prompts_pilot_again(tmp_path, two_sets, capsys):
    run_dir = tmp_path / "run"
    with FaultServer(FaultConfig(latency=0.01)) as srv, FaultServer() as other:
        assert kit_plan(run_dir, two_sets, srv.base_url, capsys=capsys)[0] == 0
        code, _, err = kit_plan(run_dir, two_sets, srv.base_url, model="other", capsys=capsys)
        assert code == 0 and "model 'm' -> 'other'" in err
        assert srv.stats()["requests"] == 12

        code, _, err = kit_plan(run_dir, two_sets, other.base_url, model="other", capsys=capsys)
        assert code == 0 and f"server '{srv.base_url} (openai api)' -> '{other.base_url}" in err
        assert other.stats()["requests"] == 6

        # an edited file: the prompts the stored pilot measured are gone
        text = two_sets[0].read_text()
        two_sets[0].write_text(text.replace('"content": "', '"content": "Please: '))
        code, _, err = kit_plan(run_dir, two_sets, other.base_url, model="other", capsys=capsys)
        assert code == 0 and "3 of the prompts it measured are no longer among" in err
        assert other.stats()["requests"] == 12

        # a dataset more: the stored pilot has none of its lengths
        more = [*two_sets, SAMPLES / "code_problems.jsonl"]
        budget = ("--budget", "3000")
        code, _, err = kit_plan(
            run_dir, more, other.base_url, *budget, model="other", capsys=capsys
        )
        assert code == 0 and "it has no completion of dataset 'code_problems'" in err
        # and a dataset fewer: the stored pilot still answers for the rest
        code, _, err = kit_plan(run_dir, two_sets, other.base_url, model="other", capsys=capsys)
        assert code == 0 and "reusing" in err
        assert other.stats()["requests"] == 12 + 9


def test_stored_pilot_api_and_an_embedded_plan_reused_without_starting_a_server(
    tmp_path, monkeypatch, capsys
):
    """01_plan's path (kit.plan.stored_pilot), and `kit plan` on the embedded server: a
    reuse starts no server; the plan keeps the stored model, endpoints and api."""
    loaded = kit.load(SAMPLES / "chat_general.jsonl")
    run_dir = tmp_path / "run"
    sampling = Sampling(max_tokens=32)
    with FaultServer(FaultConfig(latency=0.01)) as srv:
        config = RunConfig(
            model="/models/smol",
            endpoints=srv.base_url,
            budgets=2000,
            sampling=sampling,
            api="vllm",
            concurrency=4,
        )
        res = plan.pilot_sync(loaded, config, per_dataset=4)
    table = plan.budget(2000, res, prompts_available=loaded)
    server = {"embedded": True, "engine": "vllm"}
    plan.write_plan(run_dir, table, config, pilot=res, prompts=loaded, server=server)

    before = RunConfig(
        model="embedded", endpoints="http://embedded/v1", budgets=2000, sampling=sampling
    )
    again, cfg, why = plan.stored_pilot(run_dir, loaded, before, per_dataset=4, server=server)
    assert again is not None and why.startswith("reusing the pilot stored in")
    assert again.frame.equals(res.frame) and again.errors == res.errors
    assert again.throughput == res.throughput and again.chosen == {"chat_general": 4}
    assert (cfg.model, cfg.endpoints, cfg.api) == ("/models/smol", [srv.base_url], "vllm")
    none, cfg, why = plan.stored_pilot(
        run_dir, loaded, before, per_dataset=4, server={"embedded": True, "engine": "transformers"}
    )
    assert none is None and cfg is before
    assert "server 'embedded vllm' -> 'embedded transformers'" in why
    assert plan.stored_pilot(tmp_path / "none", loaded, before)[0] is None

    def no_server(*a, **k):
        raise AssertionError("a reused pilot needs no server")

    monkeypatch.setattr(kit.serve, "start", no_server)
    monkeypatch.setattr(kit.plan, "pilot_sync", no_server)
    argv = ["plan", "--run-dir", str(run_dir), "--samples", str(SAMPLES / "chat_general.jsonl")]
    argv += ["--max-tokens", "32", "--concurrency", "4", "--pilot-per-dataset", "4"]
    assert cli.main([*argv, "--budget", "9000"]) == 0, capsys.readouterr().err
    assert "reusing the pilot" in capsys.readouterr().err
    back = plan.read_plan(run_dir)
    assert back["budgets"] == {"chat_general": 9000} and back["server"] == server
    assert (back["config"].model, back["config"].endpoints) == ("/models/smol", [srv.base_url])


# ------------------------------------------------------------ a pilot that got no answer


def test_a_pilot_against_a_dead_port_fails_at_once(free_port, tmp_path, capsys):
    """Issue 34 item 9 / 35 item 10: a dead endpoint held the pilot 120 s, then said
    "(0 requests failed, see above)". Every endpoint refusing the connection fails now."""
    url = f"http://127.0.0.1:{free_port()}/v1"
    config = RunConfig(model="m", endpoints=url, budgets=1, sampling=Sampling(max_tokens=8))
    prompts = kit.load(SAMPLES / "chat_general.jsonl")
    t0 = time.monotonic()
    with pytest.raises(ConnectError, match=rf"{url}: Connection refused"):
        plan.pilot_sync(prompts, config, per_dataset=2)
    assert time.monotonic() - t0 < 5
    t0 = time.monotonic()
    code, _, err = kit_plan(tmp_path / "r", [SAMPLES / "chat_general.jsonl"], url, capsys=capsys)
    assert code == 2 and time.monotonic() - t0 < 10
    assert "kit: error: connect: the pilot cannot reach its server" in err
    assert "Connection refused" in err and not (tmp_path / "r" / "run.sqlite").exists()
    with FaultServer(FaultConfig(latency=0.01)) as srv:  # one dead of two: the live one answers
        both = RunConfig(model="m", endpoints=[url, srv.base_url], budgets=1, concurrency=2)
        res = plan.pilot_sync(prompts, both, per_dataset=2)
    assert res.frame.height == 2 and res.errors == []


def test_a_pilot_with_no_answer_says_how_many_failed_and_why(tmp_path, monkeypatch, capsys):
    secret = "sk-PILOT-0123456789abcdef"
    monkeypatch.setenv("KIT_TEST_KEY", secret)
    chat = [SAMPLES / "chat_general.jsonl"]
    with FaultServer(FaultConfig(mode="400")) as srv:
        code, out, err = kit_plan(tmp_path / "r", chat, srv.base_url, capsys=capsys)
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert line.startswith("kit: error: the pilot got no completion for datasets ['chat_general']")
    assert ": 3 of 3 requests failed; first: chat_general/" in line and "http_4xx" in line
    assert "0 requests failed" not in err

    with FaultServer(FaultConfig(mode="echo")) as srv:  # a server echoing the key back
        argv = ("--api-key-env", "KIT_TEST_KEY")
        code, out, err = kit_plan(tmp_path / "r2", chat, srv.base_url, *argv, capsys=capsys)
    assert code == 2, err
    assert "requests failed; first: chat_general/" in err and "***" in err
    assert secret not in out + err and secret.lower() not in (out + err).lower()


def test_sigterm_during_the_pilot_says_it_was_interrupted(tmp_path):
    """Issue 35 item 10: a SIGTERM during the pilot was reported as "0 requests failed"."""
    run_dir = tmp_path / "r"
    with FaultServer(FaultConfig(hang_after=2)) as srv:  # the third request never answers
        code = "import sys; from kit.cli import main; sys.exit(main(sys.argv[1:]))"
        argv = ["plan", "--run-dir", str(run_dir), "--samples", str(SAMPLES / "chat_general.jsonl")]
        argv += ["--base-url", srv.base_url, "--model", "m", "--budget", "100"]
        argv += ["--pilot-per-dataset", "6", "--concurrency", "2"]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
        child = subprocess.Popen(
            [sys.executable, "-c", code, *argv],
            env=env,
            cwd=ROOT,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        while srv.stats()["requests"] < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.stats()["requests"] >= 4, "the pilot never reached the hanging requests"
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=30)
    assert child.returncode == 128 + signal.SIGTERM, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("kit: error: the pilot was interrupted (stopped by SIGTERM)"), err
    assert "after 2 of 6 requests answered" in line and "nothing was planned" in line
    assert "failed" not in line and "Traceback" not in err
    with pytest.raises(FileNotFoundError):
        kit.plan.read_plan(run_dir)
    assert json.loads(json.dumps(srv.stats()))["requests"] >= 4


# -------------------------------------------------------------------- the real server


@pytest.mark.server
def test_replan_against_the_embedded_server_reuses_its_measured_pilot(
    embedded_server, tmp_path, capsys
):
    """On the real server: the second plan holds the first pilot's very timings (a new pilot
    at temperature 0.7 could not repeat them), made in seconds."""
    run_dir, chat = tmp_path / "run", [SAMPLES / "chat_general.jsonl"]
    url, model = embedded_server.base_url, embedded_server.model
    flags = ("--max-tokens", "16", "--pilot-per-dataset", "4")
    code, _, err = kit_plan(run_dir, chat, url, *flags, model=model, capsys=capsys)
    assert code == 0, err
    first = kit.plan.read_plan(run_dir)["pilot"]
    assert first["completions"] == 4
    t0 = time.monotonic()
    code, _, err = kit_plan(
        run_dir, chat, url, *flags, "--budget", "777", model=model, capsys=capsys
    )
    assert code == 0 and "reusing the pilot" in err
    assert time.monotonic() - t0 < 15
    again = kit.plan.read_plan(run_dir)
    assert again["pilot"]["rows"] == first["rows"] and again["budgets"] == {"chat_general": 777}
    assert len(set(first["rows"]["t_done"])) == 4  # real, distinct timings


@pytest.mark.slow
def test_01_plan_reuses_the_stored_pilot_through_the_same_api(tmp_path, monkeypatch):
    """01_plan, run twice cold into one run directory: the second run sends no request and
    says it reused the pilot (kit.plan.stored_pilot, as `kit plan`)."""
    import nbformat

    from kit.cli import demo

    monkeypatch.setattr(demo, "NOTEBOOKS", ("01_plan",))
    run_dir = tmp_path / "run"
    with FaultServer(FaultConfig(latency=0.01)) as srv:
        parameters = {
            "run_dir": run_dir,
            "data": [str(SAMPLES / "chat_general.jsonl")],
            "budgets": {"chat_general": 500},
            "max_tokens": 32,
            "pilot_per_dataset": 3,
            "concurrency": 4,
            "base_url": srv.base_url,
            "model": "m",
            "tokenizer": str(ROOT / "data" / "models" / "SmolLM2-135M-Instruct"),
        }
        texts = []
        for budget in (500, 800):
            parameters["budgets"] = {"chat_general": budget}
            executed = demo.run_notebooks(run_dir, parameters)
            nb = nbformat.read(executed / "01_plan.ipynb", as_version=4)
            outputs = [o for c in nb.cells for o in c.get("outputs", [])]
            texts.append("".join(o.get("text", "") for o in outputs if o.output_type == "stream"))
            assert srv.stats()["requests"] == 3  # the first run's pilot only
    assert "no pilot stored in" in texts[0] and "reusing the pilot stored in" in texts[1]
    assert kit.plan.read_plan(run_dir)["budgets"] == {"chat_general": 800}
