"""The SGLang Model Gateway (`smg`, from PyPI: a Rust router inside the wheel) in front of workers.

kit talks to a gateway like to one server (its URL is RunConfig.endpoints). start() runs
`smg launch --backend vllm --worker-urls ...` under the embedded server's keeper. What kit
relies on (smg 1.13.0, HTTP workers): `--backend vllm` or `sglang` balances (`openai` does
not); the body passes through, so `return_token_ids` comes back; GET /workers lists the
workers (kit.run.served checks each one's model); a worker dying mid-request has its
requests retried on a live one; with no live worker every request gets a 5xx at once while
/health still says OK (kit stops on the streak: kit.run.runner).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kit.errors import MissingPath
from kit.serve import watchdog
from kit.serve.server import Kept, check_running, free_port

# a worker checked every 5 s, taken out after 2 failed checks; SIGTERM waits 2 s at most
DEFAULT_ARGS = tuple(
    "--policy round_robin --health-check-interval-secs 5 --health-failure-threshold 2 "
    "--shutdown-grace-period-secs 2 --log-level warn".split()
)


def _smg_command() -> str:
    """The `smg` executable: next to this interpreter (the project's .venv), else on PATH;
    MissingPath, with the command that installs it, when neither."""
    local = Path(sys.executable).with_name("smg")
    found = str(local) if local.is_file() else shutil.which("smg")
    if not found:
        raise MissingPath(
            "no `smg` (SGLang Model Gateway): `make setup` installs it (the dev extra), "
            "or `pip install smg==1.13.0`"
        )
    return found


@dataclass(eq=False)
class Gateway(Kept):
    """A running `smg launch`; stop() it or use it as a context manager."""

    port: int
    host: str
    workers: list[str]  # worker root URLs, as the gateway was given them
    log_path: Path
    process: subprocess.Popen = field(repr=False)  # the keeper (kit/serve/watchdog.py)
    lifeline: int | None = field(default=None, repr=False)  # kit's end of the keeper's pipe

    def workers_state(self) -> list[dict]:
        """The gateway's view of its workers (GET /workers): url, is_healthy, load, ..."""
        return _get_json(f"http://{self.host}:{self.port}/workers", 5.0).get("workers", [])


def start(
    worker_urls: Sequence[str],
    *,
    port: int | None = None,
    host: str = "127.0.0.1",
    backend: str = "vllm",
    extra_args: Sequence[str] = (),
    timeout: float = 60.0,
    log_path: str | os.PathLike | None = None,
) -> Gateway:
    """Start `smg launch` in front of worker_urls and wait until it lists them all healthy.

    `.base_url` of the Gateway is what RunConfig.endpoints takes; ServerError (with its
    log tail) when smg exits or is not ready in time. `backend`: smg's --backend, "vllm" or
    "sglang" (the workers' engine; both balance and pass kit's body through, token ids
    asked; "openai" does not balance); `extra_args` come after DEFAULT_ARGS and win; the
    log goes to data/models/logs/smg-<port>.log unless `log_path`.

    Example (two workers already running):
        with start(["http://127.0.0.1:8001", "http://127.0.0.1:8002"]) as gw:
            gw.base_url   # 'http://127.0.0.1:41873/v1'
    """
    from kit.serve.prepare import models_root

    workers = [u.rstrip("/").removesuffix("/v1") for u in worker_urls]
    port = port or free_port(host)
    log_path = Path(log_path) if log_path else models_root() / "logs" / f"smg-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = [_smg_command(), "launch", "--host", host, "--port", str(port), "--backend", backend]
    # its metrics listener binds 0.0.0.0:29000 unless told: this host, a free port
    argv += ["--prometheus-host", host, "--prometheus-port", str(free_port(host))]
    argv += ["--worker-urls", *workers, *DEFAULT_ARGS, *extra_args]
    process, lifeline = watchdog.spawn(argv, dict(os.environ), log_path)
    gateway = Gateway(port, host, workers, log_path, process, lifeline)
    try:
        _wait_ready(gateway, timeout)
    except BaseException:
        gateway.stop(grace=1.0)
        raise
    return gateway


def _wait_ready(gateway: Gateway, timeout: float) -> None:
    """Poll until the gateway lists every worker as healthy (GET /workers)."""
    deadline = time.monotonic() + timeout
    while True:
        check_running(gateway, "smg", deadline, timeout)
        try:
            state = gateway.workers_state()
            if len(state) == len(gateway.workers) and all(w.get("is_healthy") for w in state):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.25)


def _get_json(url: str, timeout: float) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - a local URL
        return json.loads(response.read())
