"""Read an export back and check it against its manifest and its formats (kit.validate),
streaming: each format's writer (kit.report.formats) says what is checked of it."""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from kit.report.checks import Rules, is_int, read_manifest
from kit.report.formats import ROW_CHECKS, WRITERS
from kit.report.writers import digest, file_entry, sha256_file

__all__ = ["ValidationResult", "file_entry", "sha256_file", "validate"]

MAX_PER_FILE = 20  # problems listed per file before "... and N more"


@dataclass(repr=False)
class ValidationResult:
    """The outcome of kit.validate: ok, and every problem as "file line N: what"; shown (repr,
    print, a notebook cell) as its summary."""

    path: Path
    problems: list[str] = field(default_factory=list)
    files_checked: int = 0
    rows_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def __bool__(self) -> bool:
        return self.ok

    def summary(self) -> str:
        """Plain text: OK with counts, or every problem on its own line."""
        files, rows, n = self.files_checked, self.rows_checked, len(self.problems)
        head = f"export {self.path}: {files:,} file{'s' * (files != 1)}, {rows:,} row{'s' * (rows != 1)}"
        if self.ok:
            return f"{head}: OK"
        lines = [f"{head}: {n} problem{'s' * (n != 1)}", *("  " + p for p in self.problems)]
        return "\n".join(lines)

    __repr__ = __str__ = summary


class _Ids:
    """The ids of one JSONL file's rows, kept as a count and a digest, not a list (an
    export of a million rows is checked in constant memory); `n` alone where the rows
    were counted, not read (validate's rows=False)."""

    def __init__(self, n: int = 0, read: bool = True) -> None:
        self.n, self._h = n, hashlib.sha256() if read else None

    def add(self, rid) -> None:
        self.n += 1
        self._h.update(repr(rid).encode() + b"\n")

    def digest(self) -> str | None:
        return None if self._h is None else self._h.hexdigest()


def _row_id(line: str):
    try:
        row = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    return row.get("id") if isinstance(row, dict) else None


def _check_jsonl(root: Path, rel: str, result: ValidationResult, rules: Rules) -> _Ids:
    """Parse and check every line of one JSONL export file, streaming; returns its ids."""
    check, ids, problems = ROW_CHECKS[rel.split("/")[0]], _Ids(), []
    with open(root / rel, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError:
                try:
                    row = json.loads(line)  # what orjson refuses and json takes (NaN) is checked
                except json.JSONDecodeError as e:
                    problems.append(f"{rel} line {n}: not valid JSON ({e.msg} at column {e.colno})")
                    continue
            what = check(row, rules, line)
            if what:
                problems.append(f"{rel} line {n}: {what}")
            ids.add(row.get("id") if isinstance(row, dict) else None)
    result.rows_checked += ids.n
    _add(result, problems)
    return ids


def _add(result: ValidationResult, problems: list[str]) -> None:
    result.problems += problems[:MAX_PER_FILE]
    if len(problems) > MAX_PER_FILE:
        result.problems.append(f"... and {len(problems) - MAX_PER_FILE} more in that file")


def _changed_lines(root: Path, rel: str, entry: dict) -> list[str]:
    """Which lines of a JSONL file differ from the export, via its line-hash file."""
    lh = root / entry.get("line_hashes", "")
    if "line_hashes" not in entry or not lh.is_file():
        return [f"{rel}: contents changed after export (sha256 differs from manifest.json)"]
    out, want_n, got_n = [], 0, 0
    with open(lh) as want, open(root / rel, encoding="utf-8", newline="") as got:
        for i, (a, b) in enumerate(itertools.zip_longest(want, got)):
            want_n += a is not None
            got_n += b is not None
            if a is None or b is None:
                continue
            line = b[:-1] if b.endswith("\n") else b
            if a.strip() != hashlib.sha256(line.encode()).hexdigest()[:16]:
                out.append(
                    f"{rel} line {i + 1}: edited after export (differs from the line written)"
                )
    if got_n != want_n:
        out.append(f"{rel}: has {got_n} lines, the export wrote {want_n}")
    return out or [f"{rel}: bytes changed after export (sha256 differs; lines unchanged)"]


def _check_files(
    root: Path, files: dict, rules: Rules, result: ValidationResult, read_rows: bool
) -> dict[str, _Ids]:
    """Existence, hashes, row counts and formats of every listed file; returns ids per JSONL.
    With read_rows False (kit.export's staged folder, whose writer hashed, counted and synced
    each file's bytes as it wrote them) no file is read again: each one's size is checked
    against the manifest and a JSONL file's lines are the rows the manifest says."""
    ids = {}
    for rel, entry in files.items():
        path = root / rel
        if not path.is_file() or path.is_symlink():
            result.problems.append(f"{rel}: missing (listed in manifest.json)")
            continue
        result.files_checked += 1
        if read_rows:
            sha, lines = digest(path)
            if sha != entry["sha256"]:
                _add(result, _changed_lines(root, rel, entry))
        else:
            lines = entry.get("rows")
            if (size := path.stat().st_size) != entry.get("bytes"):
                result.problems.append(
                    f"{rel}: {size} bytes on disk, the export wrote {entry.get('bytes')}"
                )
        hashes = entry.get("line_hashes")
        if hashes is not None and (
            hashes not in files or files[hashes].get("rows") != entry.get("rows")
        ):
            result.problems.append(
                f"{rel}: its line-hash file {hashes} is not listed with {entry.get('rows')} rows in manifest.json"
            )
        if rel.split("/")[0] in ROW_CHECKS and read_rows:
            ids[rel] = _check_jsonl(root, rel, result, rules)
            rows = ids[rel].n
        elif rel.split("/")[0] in ROW_CHECKS:
            ids[rel] = _Ids(lines, read=False)
            result.rows_checked += lines
            rows = lines
        elif rel.endswith(".parquet") and rel.startswith("parquet/"):
            import pyarrow as pa
            import pyarrow.parquet as pq

            try:
                rows = pq.ParquetFile(path).metadata.num_rows
            except (pa.ArrowException, OSError) as e:
                result.problems.append(f"{rel}: not a readable Parquet file ({e})")
                continue
        elif rel.startswith("linehashes/"):
            rows = lines
        else:
            continue
        if entry.get("rows") is not None and rows != entry["rows"]:
            result.problems.append(f"{rel}: {rows} rows, manifest.json says {entry['rows']}")
    return ids


def _first_different_id(root: Path, a: str, b: str) -> int:
    """The 0-based line where two JSONL files' ids first differ (or the shorter's length)."""
    with open(root / a, encoding="utf-8") as fa, open(root / b, encoding="utf-8") as fb:
        for i, (x, y) in enumerate(itertools.zip_longest(fa, fb)):
            if x is None or y is None or _row_id(x) != _row_id(y):
                return i
    return 0


def _subsequence(root: Path, a: str, b: str) -> bool:
    """Whether file a's ids are file b's in order with some left out, streaming."""
    with open(root / a, encoding="utf-8") as fa, open(root / b, encoding="utf-8") as fb:
        want = next(fa, None)
        for line in fb:
            if want is not None and _row_id(want) == _row_id(line):
                want = next(fa, None)
        return want is None


def _check_counts(manifest: dict, ids: dict[str, _Ids], result: ValidationResult) -> None:
    """Rows per split agree with manifest counts, every format asked for has a file for every
    split with rows, and formats hold the same ids in order (a format that leaves rows out,
    in order, less those)."""
    counts, files = manifest["counts"], manifest["files"]
    writers = [WRITERS[f] for f in manifest["options"]["formats"] if f in WRITERS]
    for split in ("train", "validation"):
        want = sum(c.get(split, 0) for c in counts.values())
        for w in writers if want else ():
            rel = w.listed.format(split=split)
            if not any(f == rel or (rel.endswith("/") and f.startswith(rel)) for f in files):
                result.problems.append(
                    f"manifest.json: counts say {want} {split} rows, but it lists no {rel} ({w.name} was asked for)"
                )
        found = {rel: v for rel, v in ids.items() if rel.endswith(f"/{split}.jsonl")}
        left = {rel: WRITERS[rel.split("/")[0]].left_out(manifest, split) for rel in found}
        for rel, v in found.items():
            if v.n != want - left[rel]:
                result.problems.append(
                    f"{rel}: {v.n} rows, manifest counts say {want - left[rel]} {split} rows"
                )
        whole = [rel for rel in found if not left[rel]]
        if not whole or any(v.digest() is None for v in found.values()):
            continue  # nothing to compare with, or counted, not read (validate's rows=False)
        ref = whole[0]
        for rel in found:
            if rel != ref and left[rel] and not _subsequence(result.path, rel, ref):
                result.problems.append(
                    f"{rel}: its ids are not {ref}'s in order, less the left-out `length` rows"
                )
            elif rel != ref and not left[rel] and found[rel].digest() != found[ref].digest():
                first = _first_different_id(result.path, ref, rel)
                result.problems.append(f"{rel} line {first + 1}: id differs from {ref}")


def validate(path, *, rows: bool = True) -> ValidationResult:
    """Read an export back and check it against manifest.json and its formats.

    Checks: the manifest is well formed (a malformed one is a problem, never a traceback);
    it lists every file of the export and every listed file exists with its sha256 (an
    edited JSONL line is named by file and line, through its line-hash file, which must be
    listed with the same row count); every JSONL line parses with the right fields and
    types (SpecForge conversations, a string reasoning_content, a list of tool dicts; token
    ids are ints below tokenizer.vocab_size, loss_mask is 0/1, as long as input_ids, trains
    something but never the first token, in one stretch for last_turn exports, ids_source
    "server" or "retokenized" and as many of each as token_rows says); row counts match the
    manifest and every format asked for has its file for every split with rows; SpecForge
    and token-id files hold the same ids in order.

    Args:
        path: the export directory (holding manifest.json).
        rows: read every file, hash it and parse and check every JSONL line. False:
            kit.export's check of its staged folder, whose writer checked the rows it rendered
            and hashed and counted each file's bytes as it wrote them: no file is read again
            (each one's size is checked against the manifest, a JSONL file's lines are the
            rows it says), and the per-row checks, ids_source's counts and the formats'
            same-ids check are left out.
    Returns:
        ValidationResult; `.ok`, `.problems` (e.g. "token_ids/train.jsonl line 3: loss_mask
        length 40 != input_ids length 41"), `.summary()`.

    Example: kit.validate("data/exports/demo").ok -> True (after kit.export to that folder)
    """
    root = Path(path)
    result = ValidationResult(path=root)
    manifest = read_manifest(root, result.problems)
    if manifest is None:
        return result
    _check_listing(root, manifest["files"], result)
    rules = _rules(manifest, result)
    ids = _check_files(root, manifest["files"], rules, result, rows)
    _check_counts(manifest, ids, result)
    for w in WRITERS.values() if rows else ():
        result.problems += w.check_manifest(manifest, rules, list(ids))
    return result


def _rules(manifest: dict, result: ValidationResult) -> Rules:
    """The token-row rules from the manifest (a token-id export must name its vocabulary)."""
    tok = manifest.get("tokenizer") if isinstance(manifest.get("tokenizer"), dict) else {}
    vocab = tok.get("vocab_size")
    formats = manifest["options"]["formats"]
    needs = any(WRITERS[f].needs_vocab for f in formats if f in WRITERS)
    if needs and not (is_int(vocab) and vocab > 0):
        result.problems.append(
            "manifest.json: tokenizer.vocab_size missing or not a positive int: token ids cannot be checked"
        )
        vocab = None
    turns = manifest.get("turns") if isinstance(manifest.get("turns"), dict) else {}
    return Rules(vocab_size=vocab, one_span=turns.get("mode", "last_turn") == "last_turn")


def _check_listing(root: Path, files: dict, result: ValidationResult) -> None:
    """Every file of the export is listed in the manifest (nothing extra, nothing outside)."""
    found = []
    for p in sorted(root.rglob("*")):
        if p.is_file() or p.is_symlink():
            rel = p.relative_to(root).as_posix()
            if rel != "manifest.json" and rel not in files:
                found.append(
                    f"{rel}: not listed in manifest.json (a file the export did not write)"
                )
    _add(result, found)
