"""Trainer formats and a manifest: SpecForge conversations, token-id rows, Parquet, HF datasets.

    result = kit.export("data/runs/demo", "data/exports/demo", val_fraction=0.05)
    kit.validate("data/exports/demo").ok   # -> True (kit.report.validate)

Layout of an export (every file listed in manifest.json with its sha256 and row count):

    specforge/{train,validation}.jsonl   {"id", "conversations": [{"role", "content"}, ...],
                                         "tools": [...] when the record has tools}
    token_ids/{train,validation}.jsonl   {"id", "input_ids": [int], "loss_mask": [0|1],
                                         "ids_source": "server" | "retokenized"}
    parquet/{train,validation}.parquet   one row per sample: id, conversations, counts (+ input_ids,
                                         loss_mask, ids_source when token_ids is among the
                                         formats; tools as JSON text when any record has them)
    hf/{train,validation}/               datasets.Dataset.save_to_disk (format "hf")
    linehashes/<file>.txt                one short sha256 per JSONL line (validate names the line)
    manifest.json                        how the export was made (written last)

kit deletes only files it wrote: out_dir must be new, empty, or a kit export; overwrite=True
replaces only the files the old manifest.json lists (each checked against its sha256), then
removes the folders they leave empty. Files of anyone else are never touched.

SpecForge format, field by field, as SpecForge reads it (sgl-project/SpecForge,
docs/basic_usage/data_preparation.md "Option 1: Conversation Format" and
specforge/data/parse.py GeneralParser.parse): `id` a non-empty string; `conversations` a
list of {"role": "system"|"user"|"assistant", "content": str}; an optional leading system
message replaces the template's default system prompt; then user/assistant turns, the
conversation ending with the target's assistant completion, which carries the target's
thinking as "reasoning_content" when it has any; "tools" (the record's tool definitions)
when present. kit/report/convo.py cites where SpecForge reads each field.

Which assistant turns are trained (RunConfig.turns): "last_turn" (default): only the
generated one; a prompt's earlier assistant turns are the dataset's. Token-id rows mask them
0; SpecForge has no per-row switch, only train_only_last_turn for the whole dataset, which
these rows then need (manifest "specforge"). "all_turns": every assistant turn is the
target's and is trained in both formats (leave train_only_last_turn off). The manifest says
per dataset how many rows hold earlier turns.

Token-id rows (kit/report/tokenrows.py): exactly the server's prompt_ids + output_ids where
the record has both ("ids_source": "server"), else the chat template applied to prompt +
completion with the record's tools and the dataset's chat_template_kwargs ("retokenized",
approximate); loss_mask is 1 on the generated tokens and on the end-of-turn token the model
emitted (finish_reason "stop"), as SpecForge's GeneralParser counts end_of_turn_token in the
assistant span. manifest.json "token_rows" counts per dataset exact vs re-tokenized rows and
the exact rows whose server prompt ids differ from kit's rendering (reported, never hidden).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from kit.report import manifest as _manifest
from kit.report.convo import conversation, row_id, tools_of
from kit.report.tokenrows import token_rows
from kit.report.validate import (  # noqa: F401 - ValidationResult, validate: re-exported
    ValidationResult,
    clear_export,
    file_entry,
    owned_files,
    validate,
)

FORMATS = ("specforge", "token_ids", "parquet", "hf")
SPLITS = ("train", "validation")


@dataclass
class ExportOptions:
    """What to keep and how to split; validates itself (ValueError names the field)."""

    formats: tuple = ("specforge", "token_ids", "parquet")
    drop_truncated: bool = False
    drop_errors: bool = True  # finish reasons other than stop/length (abort, error, ...)
    drop_duplicates: bool = False  # exact and near (normalized-text) copies; the first stays
    trim_to_budget: bool = False
    mix: dict | None = None  # dataset -> token share
    val_fraction: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        self.formats = (self.formats,) if isinstance(self.formats, str) else tuple(self.formats)
        bad = [f for f in self.formats if f not in FORMATS]
        if bad or not self.formats:
            raise ValueError(
                f"formats must be a non-empty subset of {FORMATS}, got {self.formats!r}"
            )
        if not (isinstance(self.val_fraction, (int, float)) and 0 <= self.val_fraction < 1):
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        for name, share in (self.mix or {}).items():
            if not isinstance(share, (int, float)) or isinstance(share, bool) or not share > 0:
                raise ValueError(f"mix[{name!r}] must be a positive share, got {share!r}")
        if self.mix is not None and not self.mix:
            raise ValueError("mix must name at least one dataset, got {}")


@dataclass
class ExportResult:
    """What an export wrote: paths (relative to out_dir) with sha256, and counts."""

    out_dir: Path
    files: dict[str, str]  # relative path -> sha256
    counts: dict[str, dict]  # dataset -> {"records", "tokens", "train", "validation"}
    dropped: dict[str, int]  # reason -> records left out
    manifest: dict = field(repr=False)
    corrupt: int = 0  # record lines skipped as not records (manifest "corrupt_lines" lists them)
    notes: list[str] = field(default_factory=list)  # e.g. "no records in <run_dir>"

    def summary(self) -> str:
        """Plain text: counts per dataset, what was dropped or skipped, files written."""
        from kit.run.lines import describe_corrupt

        lines = [f"export -> {self.out_dir}"]
        for name, c in self.counts.items():
            lines.append(f"  {name}: {c['records']} records, {c['tokens']:,} tokens "
                         f"(train {c['train']}, validation {c['validation']})")  # fmt: skip
        lines += [f"  dropped {n} ({why})" for why, n in self.dropped.items() if n]
        lines += _manifest.summary_lines(self.manifest)
        if self.corrupt:
            listed = self.manifest.get("corrupt_lines", {}).get("lines", [])
            lines.append("  " + describe_corrupt(listed, total=self.corrupt))
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  wrote {p}" for p in self.files]
        return "\n".join(lines)


# ---------------------------------------------------------------- selection


def _select(records, budgets: dict, opts: ExportOptions) -> tuple[object, dict[str, int]]:
    """Apply the drop / trim / mix options in that order; returns (frame, dropped counts)."""
    import polars as pl

    from kit.report.flags import flag_records

    frame = flag_records(records).sort("t_done", maintain_order=True)
    dropped = {}
    steps = [
        ("errors", opts.drop_errors, ~pl.col("finish_reason").is_in(["stop", "length"])),
        ("truncated", opts.drop_truncated, pl.col("finish_reason") == "length"),
        ("duplicates", opts.drop_duplicates, pl.col("dup_exact") | pl.col("dup_near")),
    ]
    for reason, on, cond in steps:
        if on:
            dropped[reason] = frame.filter(cond).height
            frame = frame.filter(~cond)
    if opts.trim_to_budget:
        n = frame.height
        frame = _keep_prefix(frame, {d: b for d, b in budgets.items() if b})
        dropped["past_budget"] = n - frame.height
    if opts.mix:
        n = frame.height
        frame = _mix(frame, opts.mix)
        dropped["mix"] = n - frame.height
    return frame, dropped


def _keep_prefix(frame, limits: dict[str, float]):
    """Per dataset, keep records in t_done order while cumulative tokens <= its limit."""
    import polars as pl

    limit = pl.col("dataset").replace_strict(limits, default=None, return_dtype=pl.Float64)
    cum = pl.col("completion_tokens").cum_sum().over("dataset")
    return frame.filter(limit.is_null() | (cum <= limit))


def _mix(frame, mix: dict):
    """Keep token shares: total T = min(available_d / share_d); dataset d keeps share_d * T."""
    import polars as pl

    avail = dict(frame.group_by("dataset").agg(pl.col("completion_tokens").sum()).iter_rows())
    missing = [d for d in mix if d not in avail]
    if missing:
        raise ValueError(
            f"mix names datasets with no records to export: {missing}; have {sorted(avail)}"
        )
    total = sum(mix.values())
    shares = {d: s / total for d, s in mix.items()}
    t = min(avail[d] / s for d, s in shares.items())
    frame = frame.filter(pl.col("dataset").is_in(list(mix)))
    return _keep_prefix(frame, {d: s * t for d, s in shares.items()})


def _split(frame, val_fraction: float, seed: int):
    """Add `split`: per dataset a seeded shuffle of prompt ids; the first round(f*n) validate.

    Samples of one prompt stay together, so no prompt is in both splits.
    """
    import polars as pl

    val_keys = []
    for name in sorted(frame["dataset"].unique().to_list()):
        ids = sorted(frame.filter(pl.col("dataset") == name)["prompt_id"].unique().to_list())
        random.Random(f"{seed}:{name}").shuffle(ids)
        val_keys += [(name, p) for p in ids[: int(val_fraction * len(ids) + 0.5)]]
    val = pl.DataFrame(
        val_keys, schema={"dataset": pl.String, "prompt_id": pl.String}, orient="row"
    )
    val = val.with_columns(split=pl.lit("validation"))
    out = frame.join(val, on=["dataset", "prompt_id"], how="left", maintain_order="left")
    return out.with_columns(pl.col("split").fill_null("train"))


# ---------------------------------------------------------------- writing


def _write_jsonl(out_dir: Path, rel: str, rows: list[dict], files: dict) -> None:
    path = out_dir / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r, ensure_ascii=False) for r in rows]
    path.write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    hashes = "".join(hashlib.sha256(x.encode()).hexdigest()[:16] + "\n" for x in lines)
    lh = out_dir / "linehashes" / f"{rel}.txt"
    lh.parent.mkdir(parents=True, exist_ok=True)
    lh.write_text(hashes)
    files[rel] = file_entry(path, len(rows), line_hashes=f"linehashes/{rel}.txt")
    files[f"linehashes/{rel}.txt"] = file_entry(lh, len(rows))


def _specforge_row(rid: str, conv: list[dict], r: dict) -> dict:
    """One SpecForge row: id, conversations, and the record's tools when it has any."""
    row = {"id": rid, "conversations": conv}
    tools = tools_of(r)
    if tools:
        row["tools"] = tools
    return row


def _write_split(out_dir, split, part, tok_rows, opts, files) -> None:
    """Write one split in every requested format."""

    rows = part.to_dicts()
    ids = [row_id(r) for r in rows]
    convs = [conversation(r["messages"], r["completion"], r.get("reasoning")) for r in rows]
    if "specforge" in opts.formats:
        sf = [_specforge_row(i, c, r) for i, c, r in zip(ids, convs, rows, strict=True)]
        _write_jsonl(out_dir, f"specforge/{split}.jsonl", sf, files)
    if "token_ids" in opts.formats:
        _write_jsonl(out_dir, f"token_ids/{split}.jsonl", [tok_rows[i] for i in ids], files)
    table = _table(part, rows, ids, convs, tok_rows)
    if "parquet" in opts.formats:
        (out_dir / "parquet").mkdir(exist_ok=True)
        table.write_parquet(out_dir / f"parquet/{split}.parquet")
        files[f"parquet/{split}.parquet"] = file_entry(
            out_dir / f"parquet/{split}.parquet", len(rows)
        )
    if "hf" in opts.formats:
        _write_hf(out_dir, split, table, files)


def _table(part, rows, ids, convs, tok_rows):
    """The Parquet / HF table of one split (columns for reasoning and tools only when used)."""
    import polars as pl

    fields = {"role": pl.String, "content": pl.String}
    if any(len(c[-1]) > 2 for c in convs):
        fields["reasoning_content"] = pl.String
    msg = pl.List(pl.Struct(fields))
    table = pl.DataFrame(
        {"id": ids, "conversations": convs}, schema={"id": pl.String, "conversations": msg}
    ).with_columns(
        part.select(
            "dataset", "prompt_id", "sample", "finish_reason", "completion_tokens", "count_source"
        )
    )
    tools = [tools_of(r) for r in rows]
    if any(tools):
        text = [json.dumps(t, ensure_ascii=False) if t else None for t in tools]
        table = table.with_columns(tools=pl.Series(text, dtype=pl.String))
    if tok_rows:
        table = table.with_columns(
            input_ids=pl.Series([tok_rows[i]["input_ids"] for i in ids], dtype=pl.List(pl.Int64)),
            loss_mask=pl.Series([tok_rows[i]["loss_mask"] for i in ids], dtype=pl.List(pl.Int8)),
            ids_source=pl.Series([tok_rows[i]["ids_source"] for i in ids], dtype=pl.String),
        )
    return table


def _write_hf(out_dir: Path, split: str, table, files: dict) -> None:
    import datasets

    target = out_dir / "hf" / split
    datasets.Dataset.from_dict(table.to_dict(as_series=False)).save_to_disk(str(target))
    for p in sorted(target.rglob("*")):
        if p.is_file():
            files[str(p.relative_to(out_dir))] = file_entry(p, None)


def _targets(formats) -> list[str]:
    """The paths (relative to out_dir) an export in these formats writes, manifest aside."""
    out = []
    for split in SPLITS:
        for fmt in ("specforge", "token_ids"):
            if fmt in formats:
                out += [f"{fmt}/{split}.jsonl", f"linehashes/{fmt}/{split}.jsonl.txt"]
        out += [f"parquet/{split}.parquet"] if "parquet" in formats else []
        out += [f"hf/{split}"] if "hf" in formats else []
    return out


def export(
    run_dir,
    out_dir,
    *,
    formats=("specforge", "token_ids", "parquet"),
    tokenizer=None,
    drop_truncated: bool = False,
    drop_errors: bool = True,
    drop_duplicates: bool = False,
    trim_to_budget: bool = False,
    mix: dict | None = None,
    val_fraction: float = 0.0,
    seed: int = 0,
    overwrite: bool = False,
) -> ExportResult:
    """Write a run's records in trainer formats, with manifest.json.

    Args:
        run_dir: the run directory.
        out_dir: where to write: new, empty, or a kit export (replaced only with overwrite;
            a non-empty folder that is not a kit export is refused, nothing deleted).
        formats: any of "specforge", "token_ids", "parquet", "hf" (needs `datasets`).
        tokenizer: tokenizer or local path for token_ids (default the run's config.tokenizer).
        drop_truncated / drop_errors / drop_duplicates: leave those records out.
        trim_to_budget: per dataset keep records in t_done order while tokens <= budget.
        mix: dataset -> token share (e.g. {"code": 1, "chat": 3}); other datasets are left out.
        val_fraction: share of each dataset's prompts put in the validation split.
        seed: seeds the split.
    Returns:
        ExportResult (files with sha256, counts per dataset, dropped counts, the manifest).

    Example:
        r = export("data/runs/demo", "data/exports/demo", val_fraction=0.1, trim_to_budget=True)
        r.counts["alpaca"]  # -> e.g. {"records": 41, "tokens": 3998, "train": 37, "validation": 4}
    """
    from kit.run.store import read_config, read_records

    opts = ExportOptions(formats, drop_truncated, drop_errors, drop_duplicates, trim_to_budget, mix, val_fraction, seed)  # fmt: skip
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    owned = owned_files(out_dir, overwrite, _targets(opts.formats))  # refuse before any work
    config = read_config(run_dir)
    tok = _tokenizer(tokenizer, config, opts)
    records, corrupt = read_records(run_dir)
    frame, dropped = _select(records, config.budgets, opts)
    frame = _split(frame, opts.val_fraction, opts.seed)
    stats: dict[str, int] = {}
    by_dataset: dict[str, dict] = {}  # dataset -> how its token rows were made
    tok_rows = {}
    if "token_ids" in opts.formats:
        kwargs_for = lambda d: config.sampling_for(d).chat_template_kwargs  # noqa: E731
        made = token_rows(tok, frame.to_dicts(), stats, by_dataset, turns=config.turns, kwargs_for=kwargs_for)  # fmt: skip
        keep = [r is not None for r in made]
        dropped["template_mismatch"] = keep.count(False)
        frame = frame.filter(keep)
        tok_rows = {r["id"]: r for r in made if r is not None}
    clear_export(out_dir, owned)
    files: dict[str, dict] = {}
    for split in SPLITS:
        part = frame.filter(frame["split"] == split)
        if part.height or split == "train":
            _write_split(out_dir, split, part, tok_rows, opts, files)
    notes = [] if frame.height else [_manifest.empty_note(run_dir, records.height)]
    manifest = _manifest.build(run_dir, config, tok, frame, dropped, stats, by_dataset, opts, files)  # fmt: skip
    manifest |= {"corrupt_lines": {"count": len(corrupt), "lines": corrupt[:100]}, "notes": notes}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return ExportResult(
        out_dir=out_dir,
        files={p: e["sha256"] for p, e in files.items()},
        counts=manifest["counts"],
        dropped=dropped,
        manifest=manifest,
        corrupt=len(corrupt),
        notes=notes,
    )


def _tokenizer(tokenizer, config, opts: ExportOptions):
    from kit.report.tokenrows import load_tokenizer_for

    tok = load_tokenizer_for(tokenizer, config)
    if tok is None and "token_ids" in opts.formats:
        raise ValueError(
            "formats includes 'token_ids' but no tokenizer: pass tokenizer= (object or local "
            "path) or set RunConfig.tokenizer, or leave 'token_ids' out of formats"
        )
    if "hf" in opts.formats:
        try:
            import datasets  # noqa: F401
        except ImportError as e:
            raise ValueError(
                "format 'hf' needs the `datasets` package: pip install datasets"
            ) from e
    return tok
