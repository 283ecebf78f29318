"""An export is written into a staging folder beside its target and swapped in whole.

`Staged(out_dir)` owns `.<name>.kit-staging/` next to out_dir, under an exclusive flock (a
second exporter on the same target is refused, naming the holder); the export is written
and validated in its `export/` folder, then the previous export's own files are moved aside
(`.<name>.kit-previous/`), the new ones moved in (manifest.json last) and the previous
ones deleted. A failure before the swap leaves the previous export as it was; a kill leaves
a folder marked as kit's, which the next export names and replaces (a previous export's
missing files put back first). Only files kit wrote are ever moved or deleted: owned_files
names those of the export already there, and refuses any other in the way.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import time
from pathlib import Path

from kit.errors import ExportBusy, PathExists
from kit.report.checks import FOLDERS
from kit.report.writers import sha256_file

MARK = ".kit-export"  # inside a staging or previous folder: written by kit, for out_dir


def side(out_dir: Path, kind: str) -> Path:
    """The staging ("staging") or previous ("previous") folder beside out_dir."""
    return out_dir.parent / f".{out_dir.name}.kit-{kind}"


def _mark_line(folder: Path, i: int) -> str | None:
    """Line i of folder's MARK: 0 the export it is for, 1 its holder; None when absent."""
    try:
        return (folder / MARK).read_text().splitlines()[i]
    except (OSError, IndexError):
        return None


def _is_ours(folder: Path, out_dir: Path) -> bool:
    return _mark_line(folder, 0) == str(out_dir.resolve())


class Staged:
    """The staging folder of one export to out_dir (a context manager: lock, then clean up).

    Example:
        with Staged(out_dir) as stage:
            write the export into stage.path ...
            stage.swap_in(owned)        # owned: the previous export's files (owned_files)
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
            holder = _mark_line(self.root, 1) or "holder unknown"
            raise ExportBusy(
                f"export: another kit export is writing {self.out_dir} ({holder}); wait for it to end"
            ) from None
        self._fd = fd
        self._restore_previous()  # under the lock: no other exporter is swapping now
        if any(p.name != MARK for p in self.root.iterdir()):
            if not _is_ours(self.root, self.out_dir):
                self._release()
                raise PathExists(
                    f"export: {self.root} is in the way and was not written by kit; move it away, then export again"
                )
            self.notes.append(f"replaced a half export left at {self.root} by an earlier kill")
            self._empty(self.root)
        self.path.mkdir()
        (self.root / MARK).write_text(
            f"{self.out_dir.resolve()}\npid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        )
        return self

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
        last), then delete the previous ones. `owned`: owned_files(out_dir, ...)."""
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


# ---------------------------------------------------------------- what kit may replace


def _old_files(out_dir: Path) -> dict | None:
    """The `files` of out_dir's kit manifest.json; None when out_dir holds no kit export."""
    path = out_dir / "manifest.json"
    try:
        doc = None if path.is_symlink() else json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(doc, dict) and "kit_version" in doc and isinstance(doc.get("files"), dict)
    return doc["files"] if ok else None


def owned_files(out_dir: Path, overwrite: bool, targets: list[str]) -> list[Path]:
    """The files of an old export that a new export may delete; FileExistsError for the rest.

    `targets` are the paths the new export writes (relative to out_dir).

    Refused (one line): a non-empty out_dir that is not a kit export; an export without
    overwrite; a manifest naming a path outside the export's folders; a listed file changed
    since kit wrote it; a file this export would write that the old manifest does not list.
    """
    if not os.path.lexists(out_dir) or (out_dir.is_dir() and not any(out_dir.iterdir())):
        return []
    files = _old_files(out_dir) if out_dir.is_dir() else None
    if files is None:
        raise PathExists(
            f"export: {out_dir} is not empty and is not a kit export (no kit manifest.json); "
            "kit deletes only files it wrote, so choose a new or empty directory"
        )
    if not overwrite:
        raise PathExists(
            f"export: {out_dir} already holds an export; pass overwrite=True to replace it "
            "(only the files its manifest.json lists are replaced)"
        )
    owned = [p for rel, entry in files.items() if (p := _own_file(out_dir, rel, entry))]
    mine = {str(p.relative_to(out_dir)) for p in owned}
    for target in targets:
        path = out_dir / target
        found = [q for q in path.rglob("*") if not q.is_dir()] if path.is_dir() else [path]
        for q in (q for q in found if os.path.lexists(q)):
            if str(q.relative_to(out_dir)) not in mine:
                raise PathExists(
                    f"export: {q} is in the way and is not a file of the previous export "
                    "(its manifest.json does not list it); move it away, then export again"
                )
    return owned


def _own_file(out_dir: Path, rel: str, entry) -> Path | None:
    """out_dir/rel when it is the file the old manifest lists (same size and sha256)."""
    path = out_dir / rel
    inside = path.resolve().is_relative_to(out_dir.resolve())
    if (
        Path(rel).is_absolute()
        or ".." in Path(rel).parts
        or rel.split("/")[0] not in FOLDERS
        or not inside
    ):
        raise PathExists(
            f"export: {out_dir / 'manifest.json'} lists {rel!r}, outside the export's own "
            "folders; kit deletes nothing it cannot identify, so remove that manifest.json"
        )
    if not os.path.lexists(path):
        return None
    same = isinstance(entry, dict) and not path.is_symlink() and path.is_file()
    same = same and path.stat().st_size == entry.get("bytes")
    if not (same and sha256_file(path) == entry.get("sha256")):
        raise PathExists(
            f"export: {path} changed since kit wrote it (its sha256 differs from manifest.json); "
            "move it away or delete it, then export again"
        )
    return path
