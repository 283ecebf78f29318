"""kit behind a real gateway: the SGLang Model Gateway (`smg`, installed by `make setup`).

The real path: `smg launch --backend vllm` in front of two vLLM workers (the session's
vllm_server and one of this module's own), a budgeted `kit generate` through the gateway's
one URL, the module's worker SIGKILLed mid-run. Every record is there once, budgets held,
the surviving worker finished the run, and the token ids are the server's, exact.

Bad input, on fault servers behind the same gateway: no live worker -> one line and a
non-zero exit within NO_WORKER_BOUND seconds; a worker serving another model -> refused,
naming the model.

Records are read in one place, `records()` (kit.audit and the token-id export: public API).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import pytest
from faultserver import FaultConfig, FaultServer

import kit
from kit.serve import gateway

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "data" / "samples"
DATASETS = ("chat_general", "alpaca_tasks")
BUDGET, MAX_TOKENS = 1500, 48
# a gateway with no live worker: kit stops within this (README, "More than one machine")
NO_WORKER_BOUND = 60.0
pytestmark = pytest.mark.slow


def kit_cli(*args: str, **popen) -> subprocess.Popen:
    """`kit ARGS` in a child process, on this work tree's package."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    code = "import sys; from kit.cli import main; sys.exit(main())"
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **popen,
    )


def kit_run(*args: str, timeout: float = 600) -> tuple[int, str, str]:
    proc = kit_cli(*args)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def plan_args(run_dir: Path, url: str, model: str, *more: str) -> list[str]:
    samples = [str(SAMPLES / f"{name}.jsonl") for name in DATASETS]
    return [
        "plan",
        "--samples",
        *samples,
        "--run-dir",
        str(run_dir),
        "--budget",
        str(BUDGET),
        "--base-url",
        url,
        "--model",
        model,
        "--api",
        "vllm",
        "--max-tokens",
        str(MAX_TOKENS),
        "--pilot-per-dataset",
        "4",
        "--concurrency",
        "16",
        *more,
    ]


def records(run_dir: Path, out: Path) -> tuple[object, list[dict], dict]:
    """(the audit, the token-id rows, the export manifest) of a run: the one place this test
    reads records, through kit.audit and kit.export (switch here if that ever changes)."""
    report = kit.audit(run_dir)
    result = kit.export(run_dir, out, formats=("token_ids",))
    assert kit.validate(out).ok
    rows = [
        orjson.loads(line)
        for split in ("train", "validation")
        if (out / f"token_ids/{split}.jsonl").exists()
        for line in (out / f"token_ids/{split}.jsonl").read_bytes().splitlines()
    ]
    return report, rows, result.manifest


def served(server) -> int:
    """Chat requests a vLLM worker answered, from its access log (kit starts vLLM with
    --disable-log-stats: no Prometheus counters)."""
    text = Path(server.log_path).read_text(errors="replace")
    return text.count('"POST /v1/chat/completions HTTP/1.1" 200')


# ---------------------------------------------------------------- two vLLM workers


@pytest.fixture(scope="module")
def workers(request, model_dir):
    """(survivor, victim): the session's vLLM and this module's own, started side by side."""
    from kit.serve import start

    own: dict = {}

    def start_own() -> None:
        try:
            own["server"] = start(model_dir, engine="vllm")  # 1200 s to start, as vllm_server
        except BaseException as e:  # noqa: BLE001 - raised in the test's thread below
            own["error"] = e

    thread = threading.Thread(target=start_own)
    thread.start()
    survivor = request.getfixturevalue("vllm_server")
    thread.join()
    if "error" in own:
        raise own["error"]
    yield survivor, own["server"]
    own["server"].stop()


@pytest.fixture(scope="module")
def gw(workers):
    with gateway.start([w.base_url for w in workers]) as g:
        yield g


def test_worker_killed_mid_run_behind_the_gateway(workers, gw, tmp_path):
    survivor, victim = workers
    run_dir = tmp_path / "run"
    code, _, err = kit_run(
        *plan_args(run_dir, gw.base_url, victim.model, "--tokenizer", victim.model)
    )
    assert code == 0, err
    victim_before = served(victim)
    t0 = time.monotonic()
    # --base-url again: without it a plan on the embedded model starts an embedded server
    proc = kit_cli("generate", "--run-dir", str(run_dir), "--base-url", gw.base_url)
    while served(victim) - victim_before < 10:  # about a third of the run
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - t0 < 300, "the victim served too little in 300 s"
        time.sleep(0.1)
    at_kill, wall_kill = served(survivor), time.time()  # both sampled before the kill
    os.killpg(victim.pid, signal.SIGKILL)  # the worker's whole process group, no goodbye
    killed_at = time.monotonic() - t0
    out, err = proc.communicate(timeout=600)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, err
    assert victim.process.poll() is not None and gw.base_url

    report, rows, manifest = records(run_dir, tmp_path / "out")
    recs = report.records
    keys = list(zip(recs["dataset"], recs["prompt_id"], recs["sample"], strict=True))
    assert len(keys) == len(set(keys)) == len(rows), "a record lost or written twice"
    assert len({r["id"] for r in rows}) == len(rows)
    progress = {p.dataset: p for p in kit.watch(run_dir, monitor=lambda p: None, stall_timeout=5)}
    for row in report.datasets.iter_rows(named=True):  # budgets held, nothing failed for good
        assert BUDGET <= row["tokens"] <= BUDGET + MAX_TOKENS, row
        assert row["errors"] == 0 and progress[row["dataset"]].state == "budget_reached", row
        assert progress[row["dataset"]].samples_done == row["records"], row
    retries = sum(p.retries for p in progress.values())
    after = (recs["t_done"] > wall_kill).sum()
    # every record answered after the kill came from the survivor, except answers the victim
    # had already sent when it died (at most the 16 in flight; kit logs t_done a moment later)
    assert served(survivor) - at_kill >= after - 16 and after > 16, (
        "the survivor did not finish the run"
    )
    # token ids: the server's own, through the gateway, and kit's rendering agrees with them
    assert set(recs["count_source"]) == {"server_ids"}
    assert all(r["ids_source"] == "server" for r in rows)
    made = manifest["token_rows"]  # dataset -> how its rows were made
    assert sum(c.get("exact", 0) for c in made.values()) == len(rows), made
    assert sum(c.get("prompt_render_differs", 0) for c in made.values()) == 0, made
    assert sum(sum(r["loss_mask"]) for r in rows) == int(recs["completion_tokens"].sum())
    print(
        f"\ngateway run: {len(rows)} records in {elapsed:.1f} s; victim killed at "
        f"{killed_at:.1f} s, {after} records finished after on the survivor; {retries} "
        f"retries; every token-id row exact"
    )


# ---------------------------------------------------------------- bad input, fault servers

MODEL = "smol-test"


@pytest.fixture
def stubs():
    """Two fault-server workers serving MODEL, with vLLM's token-id fields."""
    servers = [FaultServer(FaultConfig(models=[MODEL], latency=0.01)).start() for _ in range(2)]
    yield servers
    for srv in servers:
        srv.stop()


def test_gateway_with_no_live_worker_stops_in_one_line(stubs, tmp_path):
    with gateway.start([s.root_url for s in stubs]) as gw:
        code, _, err = kit_run(*plan_args(tmp_path / "run", gw.base_url, MODEL))
        assert code == 0, err
        for srv in stubs:
            srv.kill()
        t0 = time.monotonic()
        code, out, err = kit_run("generate", "--run-dir", str(tmp_path / "run"), timeout=300)
        elapsed = time.monotonic() - t0
    said = [line for line in err.splitlines() if line.startswith("kit: ")]
    print(f"\nno live worker: exit {code} after {elapsed:.1f} s: {said}")
    assert code != 0 and len(said) == 1 and "http_5xx" in said[0], err
    assert "Traceback" not in err
    assert elapsed < NO_WORKER_BOUND, f"took {elapsed:.1f} s"


@pytest.mark.parametrize("behind", ["gateway", "pool"])
def test_worker_serving_another_model_is_refused(behind, stubs, tmp_path):
    stubs[1].configure(models=["other-model"])
    urls = [s.root_url for s in stubs]
    if behind == "gateway":  # the gateway lists what its workers serve
        stubs[0].configure(models=["other-model"])
        with gateway.start(urls) as gw:
            code, _, err = kit_run(*plan_args(tmp_path / "run", gw.base_url, MODEL))
    else:  # kit's own pool: the one wrong endpoint is named
        args = plan_args(tmp_path / "run", stubs[0].base_url, MODEL)
        code, _, err = kit_run(*args, "--base-url", stubs[1].base_url)
    lines = err.strip().splitlines()
    assert code == 2 and lines[-1].startswith("kit: error: "), err
    assert "serves ['other-model'], not 'smol-test'" in lines[-1], err
    if behind == "pool":
        assert stubs[1].base_url in lines[-1] and stubs[0].base_url not in lines[-1]
    assert sum(s.stats()["requests"] for s in stubs) == 0  # refused before any request
