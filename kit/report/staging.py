"""An export is written into a staging folder beside its target and swapped in whole.

`Staged(out_dir)` owns `.<name>.kit-staging/` next to out_dir: it holds an exclusive flock
on that folder for the export's life (a second exporter on the same target is refused in
one line naming the holder), the export is written and validated in its `export/` folder
(beside kit's mark, so what is validated is exactly what is swapped in), and only then are
the previous export's own files moved aside (`.<name>.kit-previous/`), the new ones moved
in (manifest.json last) and the previous ones deleted. A failure before the swap (a
damaged run, a full disk, a validation problem) leaves the previous export as it was. A
kill leaves a staging or previous folder behind, each marked as kit's: the next export
names it, puts a previous export's files back where they were missing, and replaces it.
Only files kit wrote are ever moved or deleted.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import time
from pathlib import Path

from kit.errors import ExportBusy

MARK = ".kit-export"  # inside a staging or previous folder: written by kit, for out_dir


def side(out_dir: Path, kind: str) -> Path:
    """The staging ("staging") or previous ("previous") folder beside out_dir."""
    return out_dir.parent / f".{out_dir.name}.kit-{kind}"


def _is_ours(folder: Path, out_dir: Path) -> bool:
    try:
        return (folder / MARK).read_text().splitlines()[0] == str(out_dir.resolve())
    except (OSError, IndexError):
        return False


class Staged:
    """The staging folder of one export to out_dir (a context manager: lock, then clean up).

    Example:
        with Staged(out_dir) as stage:
            write the export into stage.path ...
            stage.swap_in(owned)        # owned: the previous export's files (validate.owned_files)
    """

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(out_dir)
        self.root = side(self.out_dir, "staging")  # the lock and MARK
        self.path = self.root / "export"  # the export, nothing else
        self.notes: list[str] = []  # what was found and replaced (a killed export's folders)
        self._fd: int | None = None

    def __enter__(self) -> Staged:
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self.root.mkdir(exist_ok=True)
        fd = os.open(self.root, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise ExportBusy(
                f"export: another kit export is writing {self.out_dir} ({self._holder()}); wait for it to end"
            ) from None
        self._fd = fd
        self._restore_previous()  # under the lock: no other exporter is swapping now
        if any(p.name != MARK for p in self.root.iterdir()):
            if not _is_ours(self.root, self.out_dir):
                self._release()
                raise FileExistsError(
                    f"export: {self.root} is in the way and was not written by kit; move it away, then export again"
                )
            self.notes.append(f"replaced a half export left at {self.root} by an earlier kill")
            self._empty(self.root)
        self.path.mkdir()
        (self.root / MARK).write_text(
            f"{self.out_dir.resolve()}\npid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        )
        return self

    def _holder(self) -> str:
        try:
            return (self.root / MARK).read_text().splitlines()[1]
        except (OSError, IndexError):
            return "holder unknown"

    def _restore_previous(self) -> None:
        """A kill mid-swap left the previous export's files aside: put back the missing ones."""
        prev = side(self.out_dir, "previous")
        if not prev.exists() or not _is_ours(prev, self.out_dir):
            return
        for src in sorted(p for p in prev.rglob("*") if p.is_file() and p.name != MARK):
            dst = self.out_dir / src.relative_to(prev)
            if not os.path.lexists(dst):
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.replace(src, dst)
        shutil.rmtree(prev)
        self.notes.append(f"restored the previous export's files from {prev} (an earlier kill)")

    def swap_in(self, owned: list[Path]) -> None:
        """Move the previous export's own files aside, the staged ones in (manifest.json
        last), then delete the previous ones. `owned`: validate.owned_files(out_dir, ...)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        prev = side(self.out_dir, "previous")
        if owned or (self.out_dir / "manifest.json").exists():
            prev.mkdir(exist_ok=True)
            (prev / MARK).write_text(f"{self.out_dir.resolve()}\n")
            manifest = self.out_dir / "manifest.json"
            for path in [manifest, *owned] if manifest.exists() else owned:  # manifest first
                dst = prev / path.relative_to(self.out_dir)
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, dst)
        staged = sorted(
            (p for p in self.path.rglob("*") if p.is_file()),
            key=lambda p: p.name == "manifest.json",
        )
        for src in staged:  # manifest.json last: the export is whole when it appears
            dst = self.out_dir / src.relative_to(self.path)
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, dst)
        _fsync_dir(self.out_dir)
        if prev.exists():
            shutil.rmtree(prev)  # kit's own files only: moved there above
        self._prune_empty(owned)

    def _prune_empty(self, owned: list[Path]) -> None:
        """Folders of the previous export that its files' move left empty."""
        parents = {p for path in owned for p in path.parents if self.out_dir in p.parents}
        for folder in sorted(parents, key=lambda p: len(p.parts), reverse=True):
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()

    @staticmethod
    def _empty(folder: Path) -> None:
        for p in folder.iterdir():
            if p.name != MARK:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()

    def _release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __exit__(self, *exc) -> None:
        try:
            if self.root.exists() and _is_ours(self.root, self.out_dir):
                shutil.rmtree(self.root)  # kit's staging: whatever is left is not an export
        finally:
            self._release()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
