"""Issue 23: a real run's export broken on purpose, then checked (item 2: strict
kit.validate), and an export onto a full disk (item 6: one line, not a traceback)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import polars as pl
import pytest
from faultserver import FaultConfig, FaultServer

import kit
from kit import cli

N = 40


@pytest.fixture(scope="module")
def exported(tmp_path_factory, model_dir) -> Path:
    """A real run of N prompts (the fault server's ids spell the text with the model's
    tokenizer) exported as SpecForge, token ids and Parquet."""
    root = tmp_path_factory.mktemp("export")
    rows = [
        {
            "dataset": "a",
            "prompt_id": f"a-{i:03d}",
            "n_turns": 1,
            "row": i,
            "messages": [{"role": "user", "content": f"question {i}"}],
        }
        for i in range(N)
    ]
    with FaultServer(FaultConfig(tokenizer=str(model_dir), max_words=20)) as srv:
        cfg = kit.RunConfig(
            model="m",
            endpoints=srv.base_url,
            budgets=10**6,
            api="vllm",
            sampling=kit.Sampling(max_tokens=40),
            tokenizer=str(model_dir),
        )
        run = kit.generate_sync(pl.DataFrame(rows), cfg, run_dir=root / "run")
    assert run.summary()["samples_done"][0] == N
    kit.export(
        root / "run", root / "out", formats=("specforge", "token_ids", "parquet"), val_fraction=0.1
    )
    return root / "out"


def broken(exported: Path, tmp_path: Path, change) -> list[str]:
    """kit.validate's problems for a copy of the export that change(copy) broke."""
    out = tmp_path / "copy"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(exported, out)
    change(out)
    return kit.validate(out).problems


def edit_manifest(fn):
    def change(out: Path) -> None:
        m = json.loads((out / "manifest.json").read_text())
        fn(m)
        (out / "manifest.json").write_text(json.dumps(m))

    return change


def edit_token_row(fn):
    """Rewrite the first token-id row (the file's sha256 then differs, as any edit does)."""

    def change(out: Path) -> None:
        path = out / "token_ids/train.jsonl"
        lines = path.read_text().splitlines()
        row = json.loads(lines[0])
        fn(row)
        lines[0] = json.dumps(row)
        path.write_text("\n".join(lines) + "\n")

    return change


def test_validate_is_strict_about_files_rows_and_a_malformed_manifest(exported, tmp_path):
    """Item 2: kit.validate passed an export whose manifest listed `"files": {}` with counts
    of rows, never noticed files it did not list, never read the line-hash files unless a
    hash differed, took token ids past the vocabulary and loss masks on the prompt or on
    nothing, ignored ids_source against the manifest, and raised on a malformed manifest.
    Now each is a named problem, and the intact export checks every row."""
    good = kit.validate(exported)
    assert good.ok, good.summary()
    assert (
        good.rows_checked == 2 * N and good.files_checked == 10
    )  # 3 formats x 2 splits + 4 line-hash files
    m = json.loads((exported / "manifest.json").read_text())
    assert m["tokenizer"]["vocab_size"] == 49152
    assert m["token_rows"]["a"]["exact"] == N

    def one(change, needle: str) -> None:
        problems = broken(exported, tmp_path, change)
        assert any(needle in p for p in problems), (needle, problems)

    one(
        lambda out: (out / "specforge/stray.jsonl").write_text("{}\n"),
        "specforge/stray.jsonl: not listed in manifest.json",
    )
    one(
        lambda out: (out / "token_ids/validation.jsonl").unlink(),
        "token_ids/validation.jsonl: missing",
    )
    one(
        lambda out: (out / "linehashes/specforge/train.jsonl.txt").unlink(),
        "linehashes/specforge/train.jsonl.txt: missing",
    )
    one(
        edit_manifest(lambda m: m["files"].pop("linehashes/token_ids/train.jsonl.txt")),
        "its line-hash file linehashes/token_ids/train.jsonl.txt is not listed",
    )
    one(
        edit_manifest(lambda m: m.__setitem__("files", {})),
        "counts say 36 train rows, but it lists no specforge/train.jsonl",
    )
    one(
        edit_token_row(lambda r: r["input_ids"].__setitem__(0, 49152)),
        "token id 49152 is not below the vocabulary size 49152",
    )
    one(
        edit_token_row(lambda r: r.__setitem__("loss_mask", [0] * len(r["loss_mask"]))),
        "loss_mask is all 0",
    )
    one(
        edit_token_row(lambda r: r.__setitem__("loss_mask", [1] * len(r["loss_mask"]))),
        "the prompt is trained",
    )
    one(edit_token_row(lambda r: r["loss_mask"].__setitem__(-3, 0)), "stretches of 1s")
    one(
        edit_token_row(lambda r: r.__setitem__("ids_source", "retokenized")),
        "disagrees with manifest.json token_rows",
    )
    one(edit_manifest(lambda m: m.pop("tokenizer")), "tokenizer.vocab_size missing")
    # malformed manifests: a problem each, never a traceback
    for text, needle in [
        ("{not json", "manifest.json: unreadable"),
        ("[1, 2]", "not a JSON object"),
        ('{"files": [], "counts": {}, "options": {"formats": []}}', "'files' must be an object"),
    ]:
        one(lambda out, t=text: (out / "manifest.json").write_text(t), needle)
    for fn, needle in [
        (
            lambda m: m["files"].__setitem__("../../etc/passwd", {"sha256": "x"}),
            "outside the export's folders",
        ),
        (
            lambda m: m["files"].__setitem__("specforge/train.jsonl", "abc"),
            "must be an object with a 'sha256'",
        ),
        (
            lambda m: m["files"]["specforge/train.jsonl"].__setitem__("rows", "36"),
            ".rows must be an int",
        ),
        (lambda m: m.__setitem__("counts", {"a": {"train": "36"}}), "'counts' must be an object"),
        (lambda m: m.pop("options"), "'options.formats' must be a list"),
    ]:
        one(edit_manifest(fn), needle)


def test_export_onto_a_full_disk_is_one_line_and_exit_1(exported, tmp_path, capsys):
    """Item 6: `kit export` onto a full disk ended in a raw traceback (an OSError from the
    JSONL writer, a polars ComputeError from Parquet). Now both are one line, exit 1."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        (disk / "filler").write_bytes(b"\0" * (56 * 1024))  # a few pages left: no export fits
        run_dir = exported.parent / "run"
        for formats, what in (
            (["specforge"], "No space left on device"),
            (["parquet"], "(os error 28)"),
        ):
            code = cli.main(["export", str(run_dir), str(disk / formats[0]), "--format", *formats])
            err = capsys.readouterr().err.strip()
            assert code == 1 and "Traceback" not in err, err
            assert len(err.splitlines()) == 1 and err.startswith(
                "kit: error: No space left on device"
            ), err
            assert what in err and err.endswith(
                "free some space (or choose another directory), then run it again"
            )
    finally:
        subprocess.run(["umount", str(disk)], check=True)
