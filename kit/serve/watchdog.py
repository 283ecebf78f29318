"""The embedded server's keeper: its whole process tree ends when kit does, by any signal.

Run as `python watchdog.py FD` (standard library only) leading a new session, with FD the
read end of a pipe whose write end only kit holds and the server's argv in
KIT_WATCHDOG_ARGV (JSON). It becomes the child subreaper, starts the server, then waits:
when kit's end closes (kit exited or was killed -9) it SIGKILLs the group and every
descendant until none is left (an orphaned vLLM holds GBs of RAM, or a GPU); when the
server exits (stop() SIGTERMs the group; the keeper ignores SIGTERM and SIGINT) what it
left gets SIGTERM, then SIGKILL after GRACE, and the keeper exits with the server's code.
`spawn()` is kit's side: a command under a keeper, and kit's end of the pipe.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

ARGV_ENV = "KIT_WATCHDOG_ARGV"
GRACE = 5.0  # s between SIGTERM and SIGKILL for what a server that exited left behind


def _prctl(option: int, value: int) -> None:
    """prctl(option, value) on Linux; nothing elsewhere."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, value)


def processes() -> dict[int, tuple[str, int, int]]:
    """pid -> (state, ppid, process group) of every process, from /proc ("Z": a zombie)."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        out[int(stat.parent.name)] = (fields[0], int(fields[1]), int(fields[2]))
    return out


def tree(root: int) -> set[int]:
    """Live (non-zombie) pids in root's process group or descending from root, from /proc."""
    procs = processes()
    parent = {pid: ppid for pid, (_, ppid, _) in procs.items()}
    live = {pid for pid, (state, _, _) in procs.items() if state != "Z"}
    group = {pid for pid, (_, _, pgrp) in procs.items() if pgrp == root}
    found, todo = set(), [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in found]
        found.update(kids)
        todo += kids
    return (found | group) & live - {os.getpid()}


def _reap() -> None:
    """Collect every exited child (the subreaper adopts the tree's orphans)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _end_tree(grace: float) -> None:
    """SIGTERM the tree (none when grace is 0), then SIGKILL it until nothing is left."""
    me = os.getpid()
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        if wait <= 0:
            continue
        deadline = time.monotonic() + wait
        while (pids := tree(me)) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            _reap()
            time.sleep(0.05)
        if not pids:
            return


def spawn(argv: list[str], env: dict, log_path: Path) -> tuple[subprocess.Popen, int]:
    """Start argv under a keeper leading a new session, output to log_path -> (the keeper's
    process, the pipe's write end: kit holds it; closing it, or kit dying, ends the tree)."""
    env = {**env, ARGV_ENV: json.dumps(argv)}
    read_end, write_end = os.pipe()  # only kit holds the write end (not inherited)
    try:
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), str(read_end)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                pass_fds=(read_end,),
            )
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    return process, write_end


def main(argv: list[str]) -> int:
    fd = int(argv[1])
    server_argv = json.loads(os.environ.pop(ARGV_ENV))
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stop() SIGTERMs the group: the server goes
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    server = subprocess.Popen(
        server_argv, stdin=subprocess.DEVNULL, preexec_fn=lambda: _prctl(1, signal.SIGKILL)
    )  # PR_SET_PDEATHSIG: SIGKILL the server if the keeper itself is killed
    while True:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready and not os.read(fd, 1):  # EOF: kit is gone
            _end_tree(0.0)
            return 137
        code = server.poll()
        if code is not None:
            _end_tree(GRACE)
            return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
