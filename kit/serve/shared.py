"""Servers `kit serve` shares: each announces itself in a per-user runtime file, and
kit.serve.start() reuses a live one serving what it is asked for instead of paying another
start (minutes with vLLM), so notebooks and commands run one after another on one server.

An announcement ($XDG_RUNTIME_DIR/kit, else /tmp/kit-UID: mode 0700, ours alone, or kit
neither reads nor writes it) holds the pid and start time of `kit serve`, its base_url,
model, engine, engine flags and sampling; nothing secret. A file whose process is gone (a
kill -9) is removed when read. A reused server is not ours: its stop() leaves it running.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from kit.run.db import process_start


class Served:
    """What callers read of an embedded server, whoever runs it: `model` (the name requests
    carry, the model folder's path) and `engine`."""

    model: str
    engine: str

    @property
    def api(self) -> str:
        """The RunConfig.api for this server: "vllm" (token ids returned) or "openai"."""
        return "vllm" if self.engine == "vllm" else "openai"

    @property
    def tokenizer_path(self) -> str:
        """Local folder with the model's tokenizer and chat template."""
        return self.model


@dataclass
class SharedServer(Served):
    """An embedded server another process (`kit serve`, pid) runs: EmbeddedServer's shape;
    stop() and `with` leave it running."""

    base_url: str
    model: str
    engine: str
    pid: int
    log_path: Path
    sampling: dict = field(default_factory=dict)

    @property
    def model_dir(self) -> Path:
        return Path(self.model)

    def alive(self) -> bool:
        return process_start(self.pid) is not None

    def stop(self, grace: float = 5.0) -> None:
        """Nothing: the server is `kit serve`'s (Ctrl-C there ends it)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def runtime_dir() -> Path | None:
    """The per-user folder of announcements (created 0700); None when it is not ours alone
    (another owner, or group/other access): such a folder is neither read nor written."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = Path(base) / "kit" if base else Path(tempfile.gettempdir()) / f"kit-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.lstat()
    except OSError:
        return None
    if info.st_uid != os.getuid() or info.st_mode & 0o077 or not path.is_dir():
        return None
    return path


def announce(server, engine_args: Sequence[str]) -> Path | None:
    """Write this process's announcement of `server` (an EmbeddedServer it runs); its path,
    None when there is no private runtime folder (nothing is shared then)."""
    folder = runtime_dir()
    if folder is None:
        return None
    pid = os.getpid()
    doc = {
        "pid": pid,
        "start": process_start(pid),
        "base_url": server.base_url,
        "model": server.model,
        "engine": server.engine,
        "engine_args": list(engine_args),
        "sampling": server.sampling,
        "log": str(server.log_path),
    }
    path = folder / f"serve-{pid}.json"
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)
    return path


def announced() -> list[dict]:
    """The announcements of live `kit serve` processes; files of dead ones are removed."""
    folder = runtime_dir()
    if folder is None:
        return []
    out = []
    for path in sorted(folder.glob("serve-*.json")):
        try:
            doc = json.loads(path.read_text())
            live = process_start(int(doc["pid"])) == doc["start"]
        except (OSError, ValueError, KeyError, TypeError):
            live, doc = False, None
        if live:
            out.append(doc)
        else:
            path.unlink(missing_ok=True)
    return out


def find(
    model: str, engine: str, engine_args: Sequence[str], sampling: dict, host: str, port
) -> SharedServer | None:
    """A live announced server serving `model` on `engine` with these engine flags (and, for
    `transformers serve`, whose server-wide sampling is this), at host (and port when
    given), answering /health; said on stderr, as is one that serves something else."""
    for doc in announced():
        url = doc["base_url"]
        want = {"engine": engine, "engine_args": list(engine_args)}
        if engine == "transformers":
            want["sampling"] = sampling
        differs = [key for key, value in want.items() if doc.get(key) != value]
        if Path(doc.get("model") or "").resolve() != Path(model).resolve():  # a symlink's
            differs.insert(0, "model")
        at = urlsplit(url)
        if at.hostname != host or port not in (None, at.port):
            differs.append("host:port")
        if differs:
            print(
                f"kit serve at {url} (pid {doc['pid']}) has another {', '.join(differs)}: "
                "not reused",
                file=sys.stderr,
            )
            continue
        if not get_ok(url.removesuffix("/v1") + "/health"):
            continue
        print(
            f"reusing the server kit serve runs at {url} (pid {doc['pid']}); it keeps "
            "running after this",
            file=sys.stderr,
            flush=True,
        )
        return SharedServer(  # the model as the server names it: requests carry that
            url, doc["model"], engine, int(doc["pid"]), Path(doc["log"]), doc.get("sampling") or {}
        )
    return None


def get_ok(url: str) -> bool:
    """True when GET url answers 200 within 2 s."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False
