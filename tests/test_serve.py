"""The embedded server: model preparation, real completions, clean start/stop/exit.

Every test but the models-dir one needs the prepared model or a server: marked `server`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from kit import serve
from kit.serve.server import group_pids

ROOT = Path(__file__).resolve().parents[1]


def chat(server, content: str, **params) -> dict:
    """One non-streaming chat completion against the server."""
    body = {"model": server.model, "messages": [{"role": "user", "content": content}], **params}
    request = urllib.request.Request(
        f"{server.base_url}/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def serve_pids(port: int) -> list[int]:
    """Pids whose command line is a `transformers serve` on this port (a /proc scan)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "serve" in args and "--port" in args and args[args.index("--port") + 1] == str(port):
            pids.append(int(cmdline.parent.name))
    return pids


def pid_alive(pid: int) -> bool:
    """True if pid exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.server
def test_prepared_model_has_chat_template_and_answers(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert serve.is_prepared(model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]
    assert "quantization_config" not in json.loads((model_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


@pytest.mark.server
def test_prepare_survives_a_killed_preparation(tmp_path, model_dir):
    code = "from kit.serve import prepare_model; prepare_model()"
    env = dict(os.environ, KIT_MODELS_DIR=str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env)
    deadline = time.monotonic() + 240
    while not list(tmp_path.glob(".SmolLM2-135M-Instruct.tmp-*")) and time.monotonic() < deadline:
        assert child.poll() is None, "preparation ended before it could be interrupted"
        time.sleep(0.2)
    child.send_signal(signal.SIGKILL)  # mid-conversion
    child.wait()
    assert list(tmp_path.glob(".SmolLM2-135M-Instruct.tmp-*")), "no leftover to clean"
    assert not serve.is_prepared(tmp_path / "SmolLM2-135M-Instruct")

    path = serve.prepare_model(tmp_path)
    assert path == tmp_path / "SmolLM2-135M-Instruct" and serve.is_prepared(path)
    assert not list(tmp_path.glob(".SmolLM2-135M-Instruct.tmp-*"))
    assert (path / "model.safetensors").stat().st_size == (
        (model_dir / "model.safetensors").stat().st_size
    )
    t0 = time.perf_counter()
    assert serve.prepare_model(tmp_path) == path  # idempotent, and instant
    assert time.perf_counter() - t0 < 1.0


def test_models_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv("KIT_MODELS_DIR", raising=False)
    assert serve.models_root("data/models") == ROOT / "data" / "models"
    assert serve.models_root(tmp_path) == tmp_path
    monkeypatch.setenv("KIT_MODELS_DIR", str(tmp_path / "elsewhere"))
    assert serve.models_root("data/models") == tmp_path / "elsewhere"


@pytest.mark.server
def test_usage_matches_tokenizer(embedded_server, model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for content, max_tokens in (("Write a short poem about the sea.", 40), ("Say hi.", 64)):
        reply = chat(embedded_server, content, max_tokens=max_tokens)
        choice, usage = reply["choices"][0], reply["usage"]
        text = choice["message"]["content"]
        n = len(tokenizer.encode(text, add_special_tokens=False))
        assert usage["completion_tokens"] > 0 and usage["prompt_tokens"] > 0
        # a "stop" completion also counts the end-of-turn token it generated
        extra = 1 if choice["finish_reason"] == "stop" else 0
        assert usage["completion_tokens"] == n + extra, (choice, usage)


@pytest.mark.server
def test_max_tokens_gives_finish_reason_length(embedded_server):
    reply = chat(embedded_server, "Tell me a long story about a dragon.", max_tokens=5)
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 5


@pytest.mark.server
def test_start_and_stop_leave_no_process(model_dir):
    with serve.start(model_dir, timeout=300, engine="transformers", reuse=False) as server:
        assert server.alive() and server.pid in group_pids(server.pid)  # the keeper leads
        assert serve_pids(server.port) and set(serve_pids(server.port)) < set(
            group_pids(server.pid)
        )
        assert chat(server, "Hi", max_tokens=3)["usage"]["completion_tokens"] == 3
    assert not pid_alive(server.pid)
    assert group_pids(server.pid) == []
    assert serve_pids(server.port) == []


@pytest.mark.server
def test_bad_model_dir_raises_with_log(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(serve.ServerError) as info:
        serve.start(tmp_path, timeout=300, log_path=tmp_path / "serve.log", engine="transformers")
    assert "exited with code" in str(info.value)
    assert info.value.log.strip() and info.value.log in str(info.value)
    assert (tmp_path / "serve.log").read_text().strip()


@pytest.mark.server
def test_start_validates_sampling(model_dir):
    with pytest.raises(ValueError, match="temperature"):
        serve.start(model_dir, temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        serve.start(model_dir, top_p=0)


@pytest.mark.server
def test_normal_exit_leaves_no_orphan(model_dir):
    code = textwrap.dedent(f"""
        from kit.serve import start
        server = start({str(model_dir)!r}, timeout=300, engine="transformers", reuse=False)
        print(server.port, server.pid, flush=True)
    """)  # exits without stop(): the atexit hook must stop the server
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=400
    )
    assert out.returncode == 0, out.stderr[-2000:]
    port, pid = map(int, out.stdout.split())
    assert not pid_alive(pid)
    assert serve_pids(port) == []
