"""Issue 23, item 7: kill -9 of `kit generate` while it runs the embedded vLLM left vLLM's
EngineCore and Worker processes running with parent 1 (about 3.5 GB each here; a GPU's
memory on a GPU box, so the next start failed). The embedded server now runs under a
keeper (kit/serve/watchdog.py) that ends its whole process tree when kit dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from faultserver import FaultServer

from kit import cli

ROOT = Path(__file__).resolve().parents[1]
KIT = "import sys; from kit.cli import main; sys.exit(main(sys.argv[1:]))"


def server_tree(kit_pid: int) -> dict[int, float]:
    """pid -> create time of the embedded server's keeper and every process below it."""
    keepers = [
        p for p in psutil.Process(kit_pid).children() if "watchdog.py" in " ".join(p.cmdline())
    ]
    assert len(keepers) == 1, keepers
    procs = [keepers[0], *keepers[0].children(recursive=True)]
    return {p.pid: p.create_time() for p in procs}


def running(pid: int, created: float) -> bool:
    """True while that process (not a later one with its pid) runs (a zombie does not)."""
    try:
        p = psutil.Process(pid)
        return p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def read_until(proc: subprocess.Popen, needle: str, timeout: float) -> str:
    """proc's stderr up to and including the first line holding needle."""
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise AssertionError(f"no {needle!r} from kit in {timeout:.0f}s:\n{''.join(seen)[-3000:]}")


@pytest.mark.slow
def test_kill_9_of_kit_generate_ends_the_embedded_vllm_tree(tmp_path, model_dir):
    """`kit generate` starts the embedded vLLM; mid-run, kill -9 kit. Every process of the
    server's tree, captured at start by parentage (not found by name), is gone within 10 s."""
    rows = [
        {"messages": [{"role": "user", "content": f"Write a long story number {i}."}]}
        for i in range(400)
    ]
    samples = tmp_path / "stories.jsonl"
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    with FaultServer() as srv:  # the plan's pilot needs answers, not the real model
        code = cli.main(
            [
                "plan",
                "--samples",
                str(samples),
                "--budget",
                "100000000",
                "--run-dir",
                str(run_dir),
                "--max-tokens",
                "256",
                "--api",
                "vllm",
                "--base-url",
                srv.base_url,
                "--model",
                str(model_dir),
                "--pilot-per-dataset",
                "2",
            ]
        )
    assert code == 0
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    kit = subprocess.Popen(
        # --engine: the plan was made against the fault server (its pilot), and a plan's
        # endpoints are used unless told otherwise (issue 24 item 8): start the embedded vLLM
        [
            sys.executable,
            "-c",
            KIT,
            "generate",
            "--run-dir",
            str(run_dir),
            "--concurrency",
            "8",
            "--engine",
            "vllm",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    tree: dict[int, float] = {}
    try:
        read_until(kit, "embedded server at", timeout=1200)
        read_until(kit, "starting the run", timeout=60)
        time.sleep(5)  # requests in flight
        assert kit.poll() is None, "kit ended before it could be killed"
        tree = server_tree(kit.pid)
        names = [psutil.Process(p).name() for p in tree]
        assert len(tree) >= 4, names  # keeper, API server, EngineCore, Worker (at least)
        kit.send_signal(signal.SIGKILL)
        kit.wait(10)
        deadline = time.monotonic() + 10
        while (
            left := [p for p, t in tree.items() if running(p, t)]
        ) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == [], [(p, psutil.Process(p).name()) for p in left if running(p, tree[p])]
    finally:
        if kit.poll() is None:
            kit.kill()
        kit.wait()
        for pid, created in tree.items():  # never leave 3.5 GB behind, whatever failed
            if running(pid, created):
                os.kill(pid, signal.SIGKILL)
