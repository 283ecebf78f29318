"""Where kit.load puts the prompts it reads: Parquet parts in a temporary directory of its own.

new_dir(owner) makes the directory (kit-load-PID-*, under TMPDIR) and removes it when `owner`
(the LoadResult) goes; a directory a killed load left behind is removed by the next load once
its process is gone, if it holds nothing but part files. Nothing else is ever deleted.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import weakref
from pathlib import Path

_PART = re.compile(r"part-\d{5}\.parquet")


def new_dir(owner) -> Path:
    """A new parts directory, removed with `owner`; stale ones removed first."""
    _remove_stale(Path(tempfile.gettempdir()))
    path = Path(tempfile.mkdtemp(prefix=f"kit-load-{os.getpid()}-"))
    weakref.finalize(owner, shutil.rmtree, path, ignore_errors=True)
    return path


def part_path(spill: Path, index: int) -> Path:
    return spill / f"part-{index:05d}.parquet"


def _remove_stale(tmp: Path) -> None:
    """Remove the parts directories a killed kit.load left (kit-load-PID-*, PID not running),
    when they hold nothing but part files."""
    for spill in tmp.glob("kit-load-*-*"):
        pid = spill.name.split("-")[2]
        if not pid.isdigit() or not spill.is_dir() or spill.is_symlink():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # running (or another user's): not ours to touch
        except ProcessLookupError:
            pass
        except OSError:
            continue
        files = list(spill.iterdir())
        if all(_PART.fullmatch(f.name) and f.is_file() and not f.is_symlink() for f in files):
            for f in files:
                f.unlink(missing_ok=True)
            spill.rmdir()
