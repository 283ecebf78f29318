"""The `kit` command (kit.cli) without a server: one-line user errors (exit 2), budgets required,
plan -> generate through the stored plan (the pilot and the run replaced by fakes), the plan's
server honoured on resume, `kit plan --show`, the demo's
run-directory guard and its papermill-style parameter injection."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import queue
import shutil
import sqlite3
import time
from pathlib import Path

import nbformat
import polars as pl
import pytest

import kit
from kit import cli
from kit.cli import commands, demo
from kit.errors import (
    ConfigError,
    ExportBusy,
    KitError,
    NotebookFailed,
    RunLocked,
    ServerError,
    StoreWriteError,
)
from kit.run.reader import prompts_frame

REPO = Path(__file__).resolve().parents[1]
CHAT = REPO / "data" / "samples" / "chat_general.jsonl"


def drop_stored_prompts(run_dir: Path) -> None:
    """Delete the prompts stored with a plan, as if it had been written without them."""
    with sqlite3.connect(run_dir / "run.sqlite") as conn:
        conn.execute("DELETE FROM prompts")
        conn.execute("DELETE FROM state WHERE key = 'prompts'")
    conn.close()


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    """main(argv) -> (exit code, stdout, stderr); argparse's SystemExit becomes its code."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line_error(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kit: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], err


# ------------------------------------------------------------------------ user errors


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([], "COMMAND"),
        (["plan", "--run-dir", "x"], "--budget"),  # no silent default budget
        (["generate"], "--run-dir"),
        (["generate", "--run-dir", "x", "--concurrency", "many"], "--concurrency"),
        (["generate", "--run-dir", "x", "--policy", "later"], "--policy"),
        (["export", "run"], "out_dir"),
        (["nonsense"], "nonsense"),
    ],
)
def test_argument_errors_are_one_line_exit_2(argv, needle, capsys):
    code, out, err = run_main(argv, capsys)
    assert code == 2
    assert_one_line_error(err, needle)
    assert "--help" in err  # where to look next


@pytest.mark.parametrize(
    ("budget", "needle"),
    [(["0"], "positive"), (["lots"], "positive"), (["a=b"], "--budget a"), (["=5"], "NAME=TOKENS")],
)
def test_bad_budget_is_refused_before_any_work(budget, needle, tmp_path, capsys):
    argv = ["plan", "--run-dir", str(tmp_path / "r"), "--budget", *budget]
    code, _, err = run_main(argv, capsys)
    assert code == 2
    assert_one_line_error(err, needle)
    assert not (tmp_path / "r").exists()


def test_parse_budgets():
    assert commands.parse_budgets(["1e7"]) == 10_000_000
    assert commands.parse_budgets(["a=5000", "b=2.5e3"]) == {"a": 5000, "b": 2500}


def test_budget_for_an_unknown_dataset_names_the_missing_ones(tmp_path, capsys):
    argv = [
        "plan",
        "--samples",
        str(CHAT),
        "--run-dir",
        str(tmp_path / "r"),
        "--budget",
        "essays=100",
        "--base-url",
        "http://127.0.0.1:9/v1",
        "--model",
        "m",
    ]
    code, _, err = run_main(argv, capsys)
    assert code == 2
    assert_one_line_error(err, "chat_general")


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--budget", "mbp=1000", "chat=5"], "--budget: no dataset 'mbp' (did you mean 'mbpp'?)"),
        (["--budget", "mbpp=1000"], "--budget gives no budget for datasets ['chat']"),
        (
            ["--budget", "9", "--format", "mbp=alpaca"],
            "--format: no dataset 'mbp' (did you mean 'mbpp'?)",
        ),
        (
            ["--budget", "9", "--mapping", 'mbbp={"prompt": "text"}'],
            "--mapping: no dataset 'mbbp' (did you mean 'mbpp'?)",
        ),
        (
            ["--budget", "9", "--format", "zzz=alpaca"],
            "no dataset 'zzz' (the datasets are: chat, mbpp)",
        ),
    ],
)
def test_a_flag_naming_an_unknown_dataset_says_the_flag_and_the_closest_name(
    flags, needle, tmp_path, capsys
):
    """Issue 34 item 9: `--budget mbp=1000` for dataset mbpp said "RunConfig.budgets has no
    entry for datasets ['mbpp']": the API's field, not the flag nor the name given."""
    row = '{"messages": [{"role": "user", "content": "%s"}]}\n'
    (tmp_path / "mbpp.jsonl").write_text(row % "Write a function.")
    (tmp_path / "chat.jsonl").write_text(row % "Hi")
    argv = ["plan", "--samples", str(tmp_path / "mbpp.jsonl"), str(tmp_path / "chat.jsonl")]
    argv += [
        "--run-dir",
        str(tmp_path / "r"),
        "--base-url",
        "http://127.0.0.1:9/v1",
        "--model",
        "m",
    ]
    code, _, err = run_main([*argv, *flags], capsys)
    assert code == 2
    assert_one_line_error(err, needle)
    assert "RunConfig" not in err and not (tmp_path / "r").exists()


def test_a_missing_samples_path_says_it_does_not_exist(tmp_path, capsys):
    """Issue 34 item 9: `--samples /nonexistent` said "unsupported file type ''"."""
    argv = ["plan", "--samples", str(tmp_path / "nonexistent"), "--run-dir", str(tmp_path / "r")]
    code, _, err = run_main(
        [*argv, "--budget", "9", "--base-url", "http://h/v1", "--model", "m"], capsys
    )
    assert code == 2
    assert_one_line_error(err, f"--samples: {tmp_path / 'nonexistent'} does not exist")


def test_generate_budget_names_the_closest_planned_dataset(planned, capsys):
    argv = ["generate", "--run-dir", str(planned), "--budget", "chat_genral=100"]
    code, _, err = run_main(argv, capsys)
    assert code == 2
    assert_one_line_error(
        err, "--budget: no dataset 'chat_genral' in the plan (did you mean 'chat_general'?)"
    )


def test_base_url_needs_model(tmp_path, capsys):
    argv = ["plan", "--run-dir", str(tmp_path), "--budget", "100", "--base-url", "http://h/v1"]
    code, _, err = run_main(argv, capsys)
    assert code == 2
    assert_one_line_error(err, "--model")


def test_generate_in_a_missing_run_dir(tmp_path, capsys):
    code, _, err = run_main(["generate", "--run-dir", str(tmp_path / "nope")], capsys)
    assert code == 2
    assert_one_line_error(err, "does not exist", "kit plan")


def test_generate_without_a_plan(tmp_path, capsys):
    code, _, err = run_main(["generate", "--run-dir", str(tmp_path)], capsys)
    assert code == 2
    assert_one_line_error(err, "no plan at", "kit plan")


def test_generate_with_a_broken_plan(tmp_path, capsys):
    (tmp_path / "plan.json").write_text("{not json")
    code, _, err = run_main(["generate", "--run-dir", str(tmp_path)], capsys)
    assert code == 2
    assert_one_line_error(err, "not a valid plan")


def test_audit_of_a_missing_run_dir(tmp_path, capsys):
    code, _, err = run_main(["audit", str(tmp_path / "nope")], capsys)
    assert code == 2
    assert_one_line_error(err, "run.sqlite not found")


def test_fingerprint_mismatch_keeps_its_lines_first_one_prefixed():
    from kit.errors import FingerprintMismatch

    exc = FingerprintMismatch(
        "run dir r was made with a different configuration:\n  model: a -> b\n"
        "Use a new run_dir, or pass force=True to resume anyway."
    )
    lines = cli.error_line(exc).splitlines()
    assert lines[0] == "kit: error: run dir r was made with a different configuration:"
    assert lines[1] == "  model: a -> b"
    assert "--force" in lines[2] and "force=True" not in lines[2]


@pytest.mark.parametrize(
    ("exc", "code", "needle"),
    [
        (ConfigError("RunConfig.concurrency must be >= 1, got 0"), 2, "concurrency"),
        (RunLocked("run dir r is held by pid 7"), 2, "pid 7"),  # a RuntimeError too
        (ExportBusy("another export writes out"), 2, "another export"),
        (ServerError("vllm exited with code 1"), 2, "exited"),
        (NotebookFailed("02_generate.ipynb raised"), 1, "02_generate"),
        (StoreWriteError(errno.ENOSPC, "could not write run.sqlite"), 1, "free some space"),
    ],
)
def test_every_kit_error_is_one_line(monkeypatch, capsys, exc, code, needle):
    def fails(args):
        raise exc

    monkeypatch.setattr(cli, "cmd_audit", fails)
    got, _, err = run_main(["audit", "somewhere"], capsys)
    assert got == code and isinstance(exc, KitError)
    assert_one_line_error(err, needle)


def test_unexpected_exceptions_keep_their_traceback(monkeypatch):
    def boom(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "cmd_audit", boom)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["audit", "somewhere"])


def test_serve_help_lists_host_and_port(capsys):
    code, out, _ = run_main(["serve", "--help"], capsys)
    assert code == 0
    assert "--host" in out and "--port" in out


def test_serve_passes_host_and_port_through(monkeypatch):
    seen = {}
    monkeypatch.setattr("kit.serve.server.serve_forever", lambda **kw: seen.update(kw) or 0)
    assert cli.main(["serve", "--host", "0.0.0.0", "--port", "8123"]) == 0
    assert seen == {
        "host": "0.0.0.0",
        "port": 8123,
        "temperature": 0.7,
        "top_p": 1.0,
        "timeout": None,
        "engine": "vllm",
        "engine_args": (),
    }


def test_serve_passes_the_flags_after_double_dash_to_the_engine(monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr("kit.serve.server.serve_forever", lambda **kw: seen.update(kw) or 0)
    flags = ["--reasoning-parser", "qwen3", "--enable-scale-out"]
    assert cli.main(["serve", "--port", "8123", "--", *flags]) == 0
    assert seen["engine_args"] == tuple(flags) and seen["port"] == 8123
    seen.clear()  # kit's own flags, and flags without `--`, are refused before any start
    assert cli.main(["serve", "--", "--port=9000"]) == 2
    with pytest.raises(SystemExit, match="2"):
        cli.main(["serve", "--max-model-len", "1024"])
    assert cli.main(["serve", "x"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert seen == {} and len(err) == 3, err
    assert "engine flag --port=9000 is set by kit itself" in err[0]
    assert "unrecognized arguments: --max-model-len" in err[1]
    assert "engine flags go after `--`: kit serve [options] -- x" in err[2]


def test_start_refuses_engine_flags_it_cannot_pass(tmp_path):
    """Before anything starts: one string (not split), a non-string, a flag kit sets."""
    from kit.errors import ConfigError
    from kit.serve import start

    for flags, needle in (
        ("--max-model-len 1024", "must be a list of strings"),
        (["--max-model-len", 1024], "must be a list of strings"),
        (["--served-model-name", "x"], "--served-model-name is set by kit itself"),
    ):
        with pytest.raises(ConfigError, match=needle):
            start(tmp_path, extra_args=flags, engine="transformers")


# ------------------------------------------------------------- plan -> generate, faked


def fake_pilot(prompts, config, *, per_dataset, progress=None):
    """A PilotResult without a server: 12 completions of 40..62 tokens per dataset."""
    names = sorted(getattr(prompts, "frame", prompts)["dataset"].unique().to_list())
    rows = [
        {
            "dataset": d,
            "prompt_id": f"p{i}",
            "completion_tokens": 40 + 2 * i,
            "finish_reason": "stop",
            "count_source": "usage",
            "prompt_tokens": 20,
            "latency_s": 0.1,
        }
        for d in names
        for i in range(12)
    ]
    fake_pilot.calls.append({"config": config, "per_dataset": per_dataset})
    return kit.plan.PilotResult(frame=pl.DataFrame(rows), wall_s=2.0, sampling=config.sampling)


class FakeRun:
    stop_reason = None
    failed: dict = {}  # noqa: RUF012 - read only
    short: dict = {}  # noqa: RUF012 - read only

    def summary(self):
        return pl.DataFrame([dict.fromkeys([*commands.SUMMARY, "skipped_context"], 0)])


@pytest.fixture
def planned(tmp_path, monkeypatch, capsys) -> Path:
    """`kit plan` against a (fake) remote server: the plan stored in run_dir/run.sqlite."""
    fake_pilot.calls = []
    monkeypatch.setattr(kit.plan, "pilot_sync", fake_pilot)
    run_dir = tmp_path / "run"
    argv = [
        "plan",
        "--samples",
        str(CHAT),
        "--run-dir",
        str(run_dir),
        "--budget",
        "3000",
        "--base-url",
        "http://127.0.0.1:9/v1",
        "--model",
        "m",
        "--max-tokens",
        "64",
        "--concurrency",
        "8",
        "--timeout",
        "30",
    ]
    code, out, err = run_main(argv, capsys)
    assert code == 0, err
    assert "plan written" in out
    return run_dir


def test_plan_stores_the_config_built_from_its_flags(planned):
    (call,) = fake_pilot.calls
    assert call["per_dataset"] == 30
    plan = kit.plan.read_plan(planned)
    config = plan["config"]
    assert plan["budgets"] == {"chat_general": 3000} == config.budgets
    assert (config.model, config.endpoints) == ("m", ["http://127.0.0.1:9/v1"])
    assert (config.sampling.max_tokens, config.concurrency, config.timeout) == (64, 8, 30.0)
    assert config.datasets == {"chat_general": str(CHAT)}  # absolute: generate reloads it


def test_generate_applies_only_the_flags_given(planned, monkeypatch, capsys):
    calls = []

    def fake_generate(prompts, config, **kw):
        calls.append((prompts, config, kw))
        return FakeRun()

    monkeypatch.setattr(kit, "generate_sync", fake_generate)
    argv = [
        "generate",
        "--run-dir",
        str(planned),
        "--base-url",
        "http://a/v1",
        "--base-url",
        "http://b/v1",
        "--concurrency",
        "4",
        "--budget",
        "chat_general=500",
    ]
    code, out, err = run_main(argv, capsys)
    assert code == 0, err
    (prompts, config, kw) = calls[0]
    assert config.endpoints == ["http://a/v1", "http://b/v1"]
    assert (config.concurrency, config.budgets) == (4, {"chat_general": 500})
    assert (config.model, config.timeout, config.sampling.max_tokens) == ("m", 30.0, 64)
    assert prompts is None  # the plan's own prompts, stored in run_dir/run.sqlite
    assert kw["run_dir"] == planned and kw["force"] is False
    assert set(kw["expected_tokens"]) == {"chat_general"}

    drop_stored_prompts(planned)  # a plan without stored prompts: its sources, reloaded
    run_main(["generate", "--run-dir", str(planned)], capsys)
    prompts, config, _ = calls[1]
    assert prompts.paths == {"chat_general": str(CHAT)}
    assert config.endpoints == ["http://127.0.0.1:9/v1"]


def test_plan_with_a_mapping_runs_from_the_run_dir(tmp_path, monkeypatch, capsys):
    """Item 9: data needing mapping= could not go through the CLI (no --mapping), and a plan
    recorded only paths, so `kit generate` failed to reload it. Now the plan stores the
    load spec and the prompt frame; generate runs the run directory's own prompts."""
    fake_pilot.calls = []
    monkeypatch.setattr(kit.plan, "pilot_sync", fake_pilot)
    data = tmp_path / "quiz.jsonl"
    rows = [{"question": f"What is {i} + {i}?", "sys": "Be brief."} for i in range(20)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    argv = [
        "plan",
        "--samples",
        str(data),
        "--run-dir",
        str(run_dir),
        "--budget",
        "500",
        "--base-url",
        "http://127.0.0.1:9/v1",
        "--model",
        "m",
        "--mapping",
        '{"prompt": "question", "system": "sys"}',
    ]
    code, _, err = run_main(argv, capsys)
    assert code == 0, err
    plan = kit.plan.read_plan(run_dir)
    assert plan["sources"]["quiz"]["mapping"] == {"prompt": "question", "system": "sys"}
    frame = prompts_frame(run_dir).sort("row")
    assert frame.height == 20
    assert frame["messages"][0].to_list() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 0 + 0?"},
    ]
    calls = []
    monkeypatch.setattr(kit, "generate_sync", lambda p, c, **kw: calls.append(p) or FakeRun())
    shutil.copy(run_dir / "run.sqlite", tmp_path / "kept.sqlite")
    drop_stored_prompts(run_dir)
    data.unlink()  # without its frame and its file, the plan cannot run: said in one line
    code, _, err = run_main(["generate", "--run-dir", str(run_dir)], capsys)
    assert code == 2 and "quiz.jsonl" in err, err
    shutil.copy(tmp_path / "kept.sqlite", run_dir / "run.sqlite")
    code, _, err = run_main(["generate", "--run-dir", str(run_dir)], capsys)
    assert code == 0 and calls == [None], err


@pytest.mark.parametrize(
    "mapping, needle",
    [
        ("{prompt: question}", "must be a JSON object"),
        ('["question"]', "must map field names"),
        ('{"prompt": "nope"}', "nope"),
    ],
)
def test_a_bad_mapping_is_one_line(mapping, needle, tmp_path, capsys):
    argv = [
        "plan",
        "--samples",
        str(CHAT),
        "--run-dir",
        str(tmp_path / "r"),
        "--budget",
        "5",
        "--base-url",
        "http://127.0.0.1:9/v1",
        "--model",
        "m",
        "--mapping",
        mapping,
    ]
    code, _, err = run_main(argv, capsys)
    assert code == 2
    assert_one_line_error(err, needle)


def test_generate_refuses_a_budget_for_a_dataset_the_plan_lacks(planned, capsys):
    argv = ["generate", "--run-dir", str(planned), "--budget", "essays=100"]
    code, _, err = run_main(argv, capsys)
    assert code == 2
    assert_one_line_error(err, "essays")


def test_a_run_that_stops_early_exits_1(planned, monkeypatch, capsys):
    run = FakeRun()
    run.stop_reason = "40 requests in a row failed"
    monkeypatch.setattr(kit, "generate_sync", lambda *a, **k: run)
    code, _, err = run_main(["generate", "--run-dir", str(planned)], capsys)
    assert code == 1
    assert "40 requests in a row failed" in err and "--run-dir" in err


# ------------------------------------------------------------------------------ demo


def test_demo_refuses_a_directory_it_did_not_make(tmp_path, capsys):
    (tmp_path / "precious.txt").write_text("keep me")
    code, _, err = run_main(["demo", "--run-dir", str(tmp_path)], capsys)
    assert code == 2
    assert_one_line_error(err, "not made by `kit demo`")
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_demo_clears_only_its_own_run_dir(tmp_path):
    run_dir = tmp_path / "demo"
    demo._claim_demo_dir(run_dir, keep=False)  # new: made and marked
    (run_dir / "old.txt").write_text("from the last demo")
    (tmp_path / "beside.txt").write_text("not the demo's")
    demo._claim_demo_dir(run_dir, keep=True)
    assert (run_dir / "old.txt").exists()
    demo._claim_demo_dir(run_dir, keep=False)
    assert not (run_dir / "old.txt").exists() and (run_dir / demo.DEMO_MARK).exists()
    assert (tmp_path / "beside.txt").exists()


def read_nb(name: str):
    return nbformat.read(REPO / "notebooks" / f"{name}.ipynb", as_version=4)


def test_injected_parameters_follow_the_parameters_cell():
    nb = read_nb("01_plan")
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    demo.inject_parameters(nb, {"run_dir": Path("/tmp/r"), "budgets": {"a": 5}, "model": None})
    cell = nb.cells[at + 1]
    assert cell.cell_type == "code" and cell.metadata["tags"] == ["injected-parameters"]
    assert "run_dir = '/tmp/r'" in cell.source and "budgets = {'a': 5}" in cell.source
    assert "model = None" in cell.source
    demo.inject_parameters(nb, {"run_dir": "/tmp/s"})  # again: replaced, not stacked
    injected = [c for c in nb.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert len(injected) == 1 and nb.cells[at + 1].source == "# Parameters\nrun_dir = '/tmp/s'"
    nbformat.validate(nb)


def test_injected_values_override_the_defaults():
    nb = demo.inject_parameters(read_nb("04_export"), {"run_dir": "/x", "overwrite": True})
    names: dict = {}
    for cell in nb.cells:
        if set(cell.metadata.get("tags", [])) & {"parameters", "injected-parameters"}:
            exec(cell.source, names)  # noqa: S102 - the notebook's own assignments
    assert names["run_dir"] == "/x" and names["overwrite"] is True
    assert names["val_fraction"] == 0.1  # a default left alone


def test_kit_plan_01_plan_and_run_config_share_their_defaults(tmp_path):
    """max_tokens, temperature, penalties and concurrency: 01_plan's config as shipped (its
    parameters cell, then its own code up to the RunConfig), `kit plan`'s flags and
    kit.RunConfig / kit.Sampling agree; only the demo sets its own."""
    import ast

    from kit.types import RunConfig, default

    nb = read_nb("01_plan")
    names = {"__name__": "nb"}
    exec(nb.cells[1].source, names)  # noqa: S102 - the notebook's own parameters
    names.update(data=str(REPO / "data" / "samples"), run_dir=str(tmp_path))
    cell = next(c for c in nb.cells if "config = kit.RunConfig(" in c.source)
    body = ast.parse(cell.source).body
    built = next(
        i
        for i, n in enumerate(body)
        if "config" in {getattr(t, "id", "") for t in getattr(n, "targets", [])}
    )
    exec(compile(ast.Module(body[: built + 1], []), "01_plan", "exec"), names)  # noqa: S102
    notebook = names["config"]
    args = cli.parser().parse_args(["plan", "--run-dir", "r", "--budget", "1"])

    sampling = ("max_tokens", "temperature", "frequency_penalty", "presence_penalty")
    declared = {name: default(kit.Sampling, name) for name in sampling}
    declared["concurrency"] = default(RunConfig, "concurrency")
    in_notebook = {name: getattr(notebook.sampling, name) for name in sampling}
    in_notebook["concurrency"] = notebook.concurrency
    assert in_notebook == declared
    assert {name: getattr(args, name) for name in declared} == declared
    assert notebook.sampling == kit.Sampling()  # top_p, seed, n... as declared too
    overridden = set(declared) & set(demo.DEMO_PARAMETERS)  # the demo's, stated in kit.cli.demo
    assert all(demo.DEMO_PARAMETERS[name] != declared[name] for name in overridden)


def test_the_demo_parameters_are_notebook_parameters():
    """Everything the demo injects is a parameter of some notebook (no typo goes unseen)."""
    known = {n for name in demo.NOTEBOOKS for n in demo.notebook_parameters(read_nb(name))}
    given = {*demo.DEMO_PARAMETERS, "run_dir", "data", "out_dir", "overwrite"}
    given |= {"base_url", "model", "tokenizer"}
    assert given <= known, given - known


class MissedWakeUp:
    """A kernel channel whose reply is there, but a poll that began before it arrived sleeps
    out its whole timeout (pyzmq's missed wake-up); a later poll sees it."""

    def __init__(self, arrives_after: float | None):
        self.arrives = None if arrives_after is None else time.monotonic() + arrives_after
        self.polls = []

    async def get_msg(self, timeout=None):
        self.polls.append(timeout)
        began = time.monotonic()
        if self.arrives is not None and began >= self.arrives:
            return {"msg_type": "execute_reply"}
        await asyncio.sleep(timeout)
        raise queue.Empty


def test_a_reply_missed_by_one_poll_is_read_by_the_next():
    """Before: nbclient polled the shell once for a cell's whole timeout (an hour), and the demo
    sat idle after 01_plan's planner cell had finished (4 runs of 23)."""
    channel = MissedWakeUp(arrives_after=0.05)
    demo.poll_in_slices(channel, step=0.2)
    reply = asyncio.run(asyncio.wait_for(channel.get_msg(timeout=3600), 5))  # unsliced: 3600 s
    assert reply == {"msg_type": "execute_reply"} and channel.polls[0] == pytest.approx(0.2)


def test_sliced_polls_keep_the_timeout_and_wait_forever_without_one():
    channel = MissedWakeUp(arrives_after=None)  # never
    demo.poll_in_slices(channel, step=0.1)
    start = time.monotonic()
    with pytest.raises(queue.Empty):
        asyncio.run(channel.get_msg(timeout=0.35))
    assert 0.3 < time.monotonic() - start < 1.5 and sum(channel.polls) == pytest.approx(
        0.35, abs=0.05
    )

    async def a_second_of_none():
        return await asyncio.wait_for(channel.get_msg(timeout=None), 1.0)

    with pytest.raises(TimeoutError):  # no timeout: still polling when cancelled
        asyncio.run(a_second_of_none())


def test_plan_show_prints_the_stored_plan(planned, capsys):
    assert not (planned / "plan.json").exists()  # the plan is in run.sqlite
    code, out, err = run_main(["plan", "--show", str(planned)], capsys)
    assert code == 0, err
    assert "server: remote at http://127.0.0.1:9/v1" in out and "(no run yet)" in out
    (row,) = [line.split() for line in out.splitlines() if line.strip().startswith("chat_gene")]
    assert row == ["chat_general", "3,000", "51.0"]  # budget, the fake pilot's mean
    config = json.loads(out[out.index("config: ") + len("config: ") :])
    assert config == kit.plan.read_plan(planned)["config"].to_dict() and config["concurrency"] == 8
    code, _, err = run_main(["plan", "--show", str(planned / "nowhere")], capsys)
    assert code == 2 and "no plan at" in err


class FakeServer:
    base_url, model, api, tokenizer_path = "http://127.0.0.1:7/v1", "/models/smol", "vllm", "/tok"


def test_a_resume_honours_the_plans_server(planned, monkeypatch, capsys):
    """A plan made against a remote server resumes there (no embedded server started); one
    made on the embedded server starts a fresh one of the plan's engine; --base-url wins."""
    started, calls = [], []
    monkeypatch.setattr(
        "kit.serve.start",
        lambda *a, **kw: started.append(kw["engine"]) or contextlib.nullcontext(FakeServer),
    )
    monkeypatch.setattr(kit, "generate_sync", lambda p, c, **kw: calls.append(c) or FakeRun())
    assert run_main(["generate", "--run-dir", str(planned)], capsys)[0] == 0
    assert started == [] and calls[-1].endpoints == ["http://127.0.0.1:9/v1"]
    spec = kit.plan.read_plan(planned)
    kit.plan.write_plan(
        planned, spec["table"], spec["config"], server={"embedded": True, "engine": "transformers"}
    )
    assert run_main(["generate", "--run-dir", str(planned)], capsys)[0] == 0
    assert started == ["transformers"] and calls[-1].endpoints == [FakeServer.base_url]
    assert (calls[-1].model, calls[-1].api) == (FakeServer.model, "vllm")
    argv = ["generate", "--run-dir", str(planned), "--base-url", "http://gpu:30000/v1"]
    assert run_main(argv, capsys)[0] == 0
    assert started == ["transformers"] and calls[-1].endpoints == ["http://gpu:30000/v1"]

    seen = []  # the Python API (02_generate) takes the same path

    async def fake_generate(prompts, config, **kw):
        seen.append((config, kw))
        return FakeRun()

    monkeypatch.setattr("kit.run.generate.generate", fake_generate)
    asyncio.run(kit.resume(planned, concurrency=3, budgets={"chat_general": 10}))
    config, kw = seen[0]
    assert started == ["transformers", "transformers"] and config.endpoints == [FakeServer.base_url]
    assert (config.concurrency, config.budgets) == (3, {"chat_general": 10})
    assert set(kw) == {"run_dir", "expected_tokens", "progress", "force"}


def test_a_failing_notebook_is_named_with_its_error(tmp_path, monkeypatch, capsys):
    """`kit demo` names the notebook, the cell's error and the executed copy; exit 1."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("raise ValueError('no pilot completions')")]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    monkeypatch.setattr(demo, "NOTEBOOKS", ("01_plan",))
    monkeypatch.setattr(demo, "parameterized", lambda name, parameters: nb)
    monkeypatch.setattr("kit.serve.start", lambda **kw: pytest.fail("no server wanted"))
    argv = ["demo", "--run-dir", str(tmp_path / "d"), "--base-url", "http://h/v1", "--model", "m"]
    code, _, err = run_main(argv, capsys)
    assert code == 1
    assert "\nkit: error: notebooks/01_plan.ipynb failed: ValueError: no pilot" in err
    assert (tmp_path / "d" / "notebooks" / "01_plan.ipynb").is_file()


def test_validate_command_checks_an_export_and_fails_on_a_broken_one(tmp_path, capsys):
    """`kit validate EXPORT_DIR`: 0 for a good export, 1 once a listed file changes."""
    import kit
    from kit.cli import main
    from kit.run.store import RunStore
    from kit.types import RunConfig

    run = tmp_path / "run"
    store = RunStore(run)
    store.init(RunConfig(model="m", endpoints="http://127.0.0.1:9/v1", budgets={"a": 10}))
    store.close()
    kit.export(run, tmp_path / "out", formats=("specforge",))
    assert main(["validate", str(tmp_path / "out")]) == 0
    listed = next((tmp_path / "out").rglob("*.jsonl"))
    listed.write_text('{"id": "x"}\n')
    assert main(["validate", str(tmp_path / "out")]) == 1
    assert main(["validate", str(tmp_path / "nowhere")]) == 1
    assert "manifest.json: missing" in capsys.readouterr().out


def test_logs_show_every_plan_row_and_the_export_as_text(tmp_path, capsys):
    """Item 10: output meant for logs. The plan table hid rows and columns behind "..." and
    `kit export` printed an object dump of its validation; now every row and column of the
    plan, and the export's and the validation's plain summaries."""
    from kit.report.widgets import summary_text
    from kit.run.store import RunStore
    from kit.types import RunConfig

    names = [f"dataset_{i:02d}" for i in range(40)]
    table = kit.plan.budget(
        dict.fromkeys(names, 10_000),
        {n: [40, 64, 30, 64, 52] for n in names},
        prompts_available=dict.fromkeys(names, 500),
    )
    text = summary_text(table)
    assert "…" not in text and "..." not in text and "shape:" not in text
    assert all(n in text for n in names)
    head = [
        "dataset",
        "budget",
        "mean",
        "samples (90%)",
        "upper",
        "prompts",
        "time (90%)",
        "cap tokens",
    ]
    assert all(c in text.splitlines()[1] for c in head)
    assert max(len(line) for line in text.splitlines()) <= 160  # a row a person can read
    assert "notes:" in text and "weak: a pilot of 5" in text  # the notes below, whole

    run = tmp_path / "run"
    store = RunStore(run)
    store.init(RunConfig(model="m", endpoints="http://127.0.0.1:9/v1", budgets={"a": 10}))
    store.close()
    code, out, err = run_main(
        ["export", str(run), str(tmp_path / "out"), "--format", "specforge"], capsys
    )
    assert code == 0, err
    assert f"export -> {tmp_path / 'out'}" in out and ": OK" in out
    assert "Result(" not in out and "object at" not in out


# ------------------------------------------------------------------------------ records


def test_records_streams_jsonl_one_record_a_line(tmp_path, capsys):
    """`kit records RUN_DIR [--dataset NAME]`: what jq and tail read in the JSONL layout."""
    from dataclasses import fields

    from test_audit import ANSWERS, make_record, plant_run

    from kit.types import Record

    recs = [
        make_record(None, ("a", "b")[i % 2], i, f"q{i}", ANSWERS[i], ids=False) for i in range(4)
    ]
    recs[0].output_ids, recs[0].reasoning = [5, 6, 7], "thinking"
    run = plant_run(tmp_path / "run", recs, budgets={"a": 100, "b": 100})
    code, out, err = run_main(["records", str(run)], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [list(r) for r in rows] == [[f.name for f in fields(Record)]] * 4
    assert [(r["dataset"], r["prompt_id"], r["completion"]) for r in rows] == [
        (r.dataset, r.prompt_id, r.completion) for r in recs
    ]
    assert rows[0]["messages"] == [{"role": "user", "content": "q0"}]
    assert (rows[0]["output_ids"], rows[0]["reasoning"], rows[1]["output_ids"]) == (
        [5, 6, 7],
        "thinking",
        None,
    )
    code, out, _ = run_main(["records", str(run), "--dataset", "b"], capsys)
    assert code == 0 and [json.loads(line)["dataset"] for line in out.splitlines()] == ["b", "b"]
    code, _, err = run_main(["records", str(run), "--dataset", "nope"], capsys)
    assert code == 2
    assert_one_line_error(err, "--dataset: no dataset 'nope'", "the datasets are: a, b")
    code, _, err = run_main(["records", str(run), "--dataset", "aa"], capsys)
    assert code == 2
    assert_one_line_error(err, "--dataset: no dataset 'aa' in ", "(did you mean 'a'?)")
    code, _, err = run_main(["records", str(tmp_path / "missing")], capsys)
    assert code == 2
    assert_one_line_error(err, "run.sqlite not found")


def test_every_option_has_help_and_every_command_is_named(capsys):
    p = cli.parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    missing = [
        f"{name} {a.dest}"
        for name, sp in sub.choices.items()
        for a in sp._actions
        if not a.help and not isinstance(a, argparse._HelpAction)
    ]
    assert missing == []
    assert all(name in p.description for name in sub.choices)
    code, out, _ = run_main(["plan", "--help"], capsys)
    shown = " ".join(out.split())
    assert code == 0 and f"(default: {kit.Sampling().max_tokens})" in shown  # --max-tokens
    assert "prompt order and pilot sample (default: 0)" in shown  # a 0 is shown too


def test_watch_writes_its_table_to_stdout(tmp_path, capsys, monkeypatch):
    from kit.types import DatasetProgress

    final = [DatasetProgress("a", budget=100, tokens_done=100, samples_done=2)]

    def fake_watch(run_dir, interval, monitor, stall_timeout):
        monitor(final)
        monitor.close()
        return final

    monkeypatch.setattr("kit.watch", fake_watch)
    code, out, err = run_main(["watch", str(tmp_path)], capsys)
    assert code == 0 and err == ""
    assert out.splitlines()[-1].split()[:2] == ["a", "[####################]"]


def test_demo_kernels_talk_over_ipc_without_the_tcp_warning(tmp_path, monkeypatch, capfd):
    """Issue 27: the demo's log had ipykernel's "running over TCP without encryption" once a
    notebook; its kernels use local IPC sockets in a private folder instead, and each is shut
    down when its notebook ends (a kernel manager passed in would be left running)."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("print('hi')")]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    monkeypatch.setattr(demo, "NOTEBOOKS", ("01_plan",))
    monkeypatch.setattr(demo, "parameterized", lambda name, parameters: nb)
    monkeypatch.chdir(tmp_path)
    demo.run_notebooks(tmp_path / "run", {})
    err = capfd.readouterr().err
    assert "without encryption" not in err and "running notebooks/01_plan.ipynb" in err
    assert "Parent appears to have exited" not in err  # each kernel shut down after its notebook
    executed = nbformat.read(tmp_path / "run" / "notebooks" / "01_plan.ipynb", as_version=4)
    assert executed.cells[0].outputs[0]["text"] == "hi\n"
    assert not list(tmp_path.glob("kernel-ipc*"))  # no socket files left where it ran


def test_a_builtin_value_error_is_a_bug_with_its_traceback(monkeypatch):
    """kit's own mistakes are KitErrors (one line); a ValueError that is not one is a bug."""

    def bug(args):
        raise ValueError("a bug, not the user's input")

    monkeypatch.setattr(cli, "cmd_audit", bug)
    with pytest.raises(ValueError, match="a bug"):
        cli.main(["audit", "somewhere"])
