"""`kit serve` announces its server; kit.serve.start() reuses a live one that serves what it
asks (kit.serve.shared), and `kit serve -- FLAGS` passes FLAGS to the engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from faultserver import FaultConfig, FaultServer

from kit.run.db import process_start
from kit.serve import shared, start

ROOT = Path(__file__).resolve().parents[1]
KIT = "import sys; from kit.cli import main; sys.exit(main(sys.argv[1:]))"


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    """A private runtime folder of this test's own."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path / "kit"


def write(folder: Path, pid: int, **doc) -> Path:
    folder.mkdir(mode=0o700, exist_ok=True)
    base = {"pid": pid, "start": process_start(pid), "base_url": "http://127.0.0.1:9/v1"}
    base |= {"model": "/m", "engine": "vllm", "engine_args": [], "sampling": {}, "log": "/l"}
    path = folder / f"serve-{pid}.json"
    path.write_text(json.dumps(base | doc))
    return path


def test_a_dead_servers_announcement_is_removed_and_never_reused(runtime):
    dead = write(runtime, os.getpid(), start=-1)  # this pid, another process's start time
    live = write(runtime, os.getppid())
    assert [d["pid"] for d in shared.announced()] == [os.getppid()]
    assert not dead.exists() and live.exists()


def test_another_model_engine_or_flags_is_not_reused_and_says_why(runtime, capsys):
    write(runtime, os.getpid(), engine_args=["--max-model-len", "1024"])
    assert shared.find("/m", "vllm", [], {}, "127.0.0.1", None) is None
    assert shared.find("/other", "transformers", [], {}, "127.0.0.1", None) is None
    assert shared.find("/m", "vllm", ["--max-model-len", "1024"], {}, "127.0.0.1", 8000) is None
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"kit serve at http://127.0.0.1:9/v1 (pid {os.getpid()}) has another {d}: not reused"
        for d in ("engine_args", "model, engine, engine_args", "host:port")
    ]


def test_a_matching_server_that_does_not_answer_is_not_reused(runtime, capsys):
    with FaultServer(FaultConfig(mode="down")) as srv:
        write(runtime, os.getpid(), base_url=srv.base_url)
        assert shared.find("/m", "vllm", [], {}, "127.0.0.1", None) is None
    assert "reusing" not in capsys.readouterr().err


def test_start_reuses_a_live_matching_announcement_and_starts_nothing(
    runtime, tmp_path, monkeypatch, capsys
):
    """start() finds the announcement of a live process whose server answers /health (a
    stdlib one here: the real vLLM case is below) and returns it without spawning; through a
    symlink to its model folder too; its stop() is a no-op."""
    import http.server
    import threading

    from kit.serve import server as serve_module

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    model = tmp_path / "model"
    model.mkdir()
    (tmp_path / "link").symlink_to(model)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_port}/v1"
    monkeypatch.setattr(serve_module, "_spawn", lambda *a: pytest.fail("a server was started"))
    try:
        write(runtime, os.getpid(), base_url=url, model=str(model), engine_args=["--x", "1"])
        server = start(tmp_path / "link", extra_args=("--x", "1"))
        with server:
            assert (server.base_url, server.model, server.pid) == (url, str(model), os.getpid())
        assert server.alive() and server.api == "vllm"
    finally:
        httpd.shutdown()
    assert (
        f"reusing the server kit serve runs at {url} (pid {os.getpid()})" in capsys.readouterr().err
    )


def test_kit_serve_announces_while_it_serves_and_removes_it_at_the_end(runtime, monkeypatch):
    """serve_forever's announcement (what start() reads) exists while its server lives, holds
    what is matched on and nothing else, and is gone once it ends; the server is stopped."""
    from kit.serve import server as serve_module

    seen = []

    class Served:  # what start() returns, minus the engine
        base_url, model, engine, engine_args = "http://127.0.0.1:9/v1", "/m", "vllm", ("--x",)
        sampling, log_path = {"temperature": 0.7, "top_p": 1.0}, Path("/l")

        def alive(self):
            seen.append([json.loads(p.read_text()) for p in runtime.glob("serve-*.json")])
            return len(seen) < 2

        def log_tail(self):
            return ""

        def stop(self):
            seen.append("stopped")

    monkeypatch.setattr(serve_module, "start", lambda *a, **kw: Served())
    monkeypatch.setattr(serve_module.signal, "signal", lambda *a: None)
    assert serve_module.serve_forever(engine_args=("--x",)) == 1  # its server ended
    (doc,) = seen[0]
    assert set(doc) == {"pid", "start", "base_url", "model", "engine", "engine_args"} | {
        "sampling",
        "log",
    }
    assert (doc["pid"], doc["engine_args"], doc["model"]) == (os.getpid(), ["--x"], "/m")
    assert seen[-1] == "stopped" and list(runtime.glob("serve-*")) == []


def test_a_folder_others_can_read_is_neither_read_nor_written(runtime):
    write(runtime, os.getpid())
    runtime.chmod(0o755)
    assert shared.runtime_dir() is None and shared.announced() == []
    assert shared.announce(object(), []) is None


def vllm_pids() -> set[int]:
    """Pids of vLLM API servers (a /proc scan of command lines)."""
    out = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"vllm.entrypoints.openai.api_server" in cmdline.read_bytes():
                out.add(int(cmdline.parent.name))
        except OSError:
            continue
    return out


def tree(pid: int) -> set[int]:
    """pid and every live process below it."""
    import psutil

    root = psutil.Process(pid)
    return {root.pid, *(p.pid for p in root.children(recursive=True))}


@pytest.mark.server
def test_kit_serve_passes_engine_flags_and_start_reuses_it(model_dir, runtime, tmp_path):
    """One `kit serve -- --max-model-len 1024` on the real vLLM: the flag reaches the engine
    (/v1/models), start() with the same flags reuses it (no second vLLM) and its stop()
    leaves it serving; kill -9 of kit serve ends its whole tree, and its stale announcement
    is dropped by the next reader."""
    import psutil

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-c", KIT, "serve", "--", "--max-model-len", "1024"]
    kit = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        lines, deadline = [], time.monotonic() + 1200
        while time.monotonic() < deadline and "reuses it" not in "".join(lines):
            line = kit.stdout.readline()
            assert line or kit.poll() is None, "kit serve ended:\n" + "".join(lines)
            lines.append(line)
        assert "engine flags --max-model-len 1024" in lines[0], lines
        base_url = lines[0].split()[1]
        with urllib.request.urlopen(f"{base_url}/models", timeout=10) as response:
            assert json.loads(response.read())["data"][0]["max_model_len"] == 1024
        before, processes = vllm_pids(), tree(kit.pid)
        assert before & processes  # kit serve's vLLM (its engine core may share the name)
        server = start(Path(model_dir).resolve(), extra_args=["--max-model-len", "1024"])
        assert isinstance(server, shared.SharedServer) and server.base_url == base_url
        assert server.pid == kit.pid and server.api == "vllm" and server.model == str(model_dir)
        assert vllm_pids() == before  # no second vLLM
        server.stop()  # not ours: it keeps serving
        body = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}]}
        request = urllib.request.Request(
            f"{base_url}/chat/completions",
            json.dumps(body | {"max_tokens": 4}).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.loads(response.read())["choices"][0]["message"]["content"]
        kit.send_signal(signal.SIGKILL)
        kit.wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in processes):
            time.sleep(0.2)
        left = [p for p in processes if psutil.pid_exists(p)]
        left = [p for p in left if psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert left == [], f"left running after kill -9 of kit serve: {left}"
        assert list(runtime.glob("serve-*.json"))  # kill -9: the file outlived it
        assert shared.announced() == [] and not list(runtime.glob("serve-*.json"))
    finally:
        if kit.poll() is None:
            kit.kill()
            kit.wait(10)


@pytest.mark.server
def test_transformers_gets_the_flags_too_and_one_it_refuses_is_said(model_dir, tmp_path):
    """`transformers serve` is given the flags as well: one it does not know ends it at once,
    and the ServerError carries its own words about that flag."""
    from kit.errors import ServerError

    log = tmp_path / "serve.log"
    flags = ["--no-such-flag", "1"]
    with pytest.raises(ServerError, match="exited with code") as caught:
        start(model_dir, engine="transformers", extra_args=flags, log_path=log, reuse=False)
    assert "--no-such-flag" in caught.value.log  # the engine's own words, in the message too
