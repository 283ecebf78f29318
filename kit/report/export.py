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

import json
from dataclasses import dataclass, field
from pathlib import Path

from kit.report import manifest as _manifest
from kit.report.convo import conversation, row_id, tools_of
from kit.report.selection import light_frame, select, split_by_prompt
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


# ---------------------------------------------------------------- writing

BATCH = 5_000  # records per batch of the writing pass: bounds its memory
TOKEN_BATCH = 1_000  # with token_ids: each row's ids are Python ints, ~36 bytes apiece


def _specforge_row(rid: str, conv: list[dict], r: dict) -> dict:
    """One SpecForge row: id, conversations, and the record's tools when it has any."""
    row = {"id": rid, "conversations": conv}
    tools = tools_of(r)
    if tools:
        row["tools"] = tools
    return row


_COUNTS = ("dataset", "prompt_id", "sample", "finish_reason", "completion_tokens", "count_source")


class _Split:
    """The files of one split, written a batch at a time (kit.report.writers)."""

    def __init__(self, out_dir: Path, split: str, opts: ExportOptions, columns: dict) -> None:
        from kit.report.writers import JsonlSink, ParquetSink

        self.out_dir, self.split, self.opts, self.columns = out_dir, split, opts, columns
        fmts = [f for f in ("specforge", "token_ids") if f in opts.formats]
        self.jsonl = {f: JsonlSink(out_dir, f"{f}/{split}.jsonl") for f in fmts}
        tabular = "parquet" in opts.formats or "hf" in opts.formats
        self.parquet = ParquetSink(out_dir, split) if tabular else None

    def write(self, rows: list[dict], tok_rows: dict) -> None:
        ids = [row_id(r) for r in rows]
        convs = [conversation(r["messages"], r["completion"], r.get("reasoning")) for r in rows]
        if "specforge" in self.jsonl:
            sf = [_specforge_row(i, c, r) for i, c, r in zip(ids, convs, rows, strict=True)]
            self.jsonl["specforge"].write(sf)
        if "token_ids" in self.jsonl:
            self.jsonl["token_ids"].write([tok_rows[i] for i in ids])
        if self.parquet is not None:
            self.parquet.write(_table(rows, ids, convs, tok_rows, self.columns))

    def close(self, files: dict) -> None:
        from kit.report.writers import write_hf

        for sink in self.jsonl.values():
            sink.close(files)
        if self.parquet is None:
            return
        if self.parquet.empty is None:  # a split without rows: its table's columns, no rows
            self.parquet.write(_table([], [], [], {}, self.columns))
        path = self.parquet.close(files)
        if "hf" in self.opts.formats:
            write_hf(self.out_dir, self.split, path, files)
        if "parquet" not in self.opts.formats:  # written for hf only: kit's own, removed
            files.pop(f"parquet/{self.split}.parquet")
            path.unlink()
            if not any(path.parent.iterdir()):
                path.parent.rmdir()


def _table(rows, ids, convs, tok_rows, columns: dict):
    """The Parquet / HF table of one batch of a split; `columns` says which optional columns
    the split has (reasoning_content, tools, token ids), the same for every batch."""
    import polars as pl

    from kit.run.lines import record_schema

    fields = {"role": pl.String, "content": pl.String}
    if columns["reasoning"]:
        fields["reasoning_content"] = pl.String
    msg = pl.List(pl.Struct(fields))
    table = pl.DataFrame(
        {"id": ids, "conversations": convs}, schema={"id": pl.String, "conversations": msg}
    ).with_columns(
        pl.DataFrame(
            {c: [r[c] for r in rows] for c in _COUNTS},
            schema={c: record_schema()[c] for c in _COUNTS},
        )
    )
    if columns["tools"]:
        tools = [tools_of(r) for r in rows]
        text = [json.dumps(t, ensure_ascii=False) if t else None for t in tools]
        table = table.with_columns(tools=pl.Series(text, dtype=pl.String))
    if columns["token_ids"]:
        table = table.with_columns(
            input_ids=pl.Series([tok_rows[i]["input_ids"] for i in ids], dtype=pl.List(pl.Int64)),
            loss_mask=pl.Series([tok_rows[i]["loss_mask"] for i in ids], dtype=pl.List(pl.Int8)),
            ids_source=pl.Series([tok_rows[i]["ids_source"] for i in ids], dtype=pl.String),
        )
    return table


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
    from kit.run.batches import file_sizes
    from kit.run.store import read_config

    opts = ExportOptions(formats, drop_truncated, drop_errors, drop_duplicates, trim_to_budget, mix, val_fraction, seed)  # fmt: skip
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    owned = owned_files(out_dir, overwrite, _targets(opts.formats))  # refuse before any work
    config = read_config(run_dir)
    tok = _tokenizer(tokenizer, config, opts)
    upto, corrupt = file_sizes(run_dir), []  # both passes read the same bytes of a live run
    light = light_frame(run_dir, opts, corrupt, upto)
    kept, dropped = select(light, config.budgets, opts)
    kept = split_by_prompt(kept, opts.val_fraction, opts.seed).sort("_pos")
    clear_export(out_dir, owned)
    files: dict[str, dict] = {}
    written = _write(run_dir, out_dir, kept, config, tok, opts, upto, files, dropped)
    notes = [] if written.rows else [_manifest.empty_note(run_dir, light.height)]
    manifest = _manifest.build(run_dir, config, tok, written.counts(), written.earlier, dropped, written.stats, written.by_dataset, opts, files)  # fmt: skip
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


class _Written:
    """What the writing pass wrote: per dataset records, tokens, split rows, rows holding
    earlier assistant turns, and how the token rows were made."""

    def __init__(self) -> None:
        self.rows = 0
        self.per: dict[str, dict] = {}
        self.earlier: dict[str, int] = {}
        self.stats: dict[str, int] = {}
        self.by_dataset: dict[str, dict] = {}

    def add(self, r: dict, split: str) -> None:
        c = self.per.setdefault(r["dataset"], {"records": 0, "tokens": 0, "train": 0, "validation": 0})  # fmt: skip
        c["records"] += 1
        c["tokens"] += r["completion_tokens"]
        c[split] += 1
        self.rows += 1
        held = any(m["role"] == "assistant" for m in r["messages"])
        self.earlier[r["dataset"]] = self.earlier.get(r["dataset"], 0) + held

    def counts(self) -> dict[str, dict]:
        return {d: self.per[d] for d in sorted(self.per)}


def _write(run_dir, out_dir, kept, config, tok, opts, upto, files, dropped) -> _Written:
    """Pass 2: read the records again in the same order, a batch at a time, and write the
    kept ones to their split's files; token rows the template cannot split are dropped
    from every format (counted as template_mismatch)."""
    import polars as pl

    from kit.run.batches import record_rows

    done = _Written()
    if "token_ids" in opts.formats:
        dropped["template_mismatch"] = 0
    columns = {
        split: {
            "reasoning": kept.filter(pl.col("split") == split)["has_reasoning"].any(),
            "tools": kept.filter(pl.col("split") == split)["has_tools"].any(),
            "token_ids": "token_ids" in opts.formats and kept.height > 0,
        }
        for split in SPLITS
    }
    splits = {"train": _Split(out_dir, "train", opts, columns["train"])}
    want = kept.select("_pos", "split")
    pos, cursor = 0, 0
    positions = want["_pos"]
    kwargs_for = lambda d: config.sampling_for(d).chat_template_kwargs  # noqa: E731
    size = min(BATCH, TOKEN_BATCH) if "token_ids" in opts.formats else BATCH
    rows_of = record_rows(run_dir, order="t_done", upto=upto, batch_size=size, dedupe=False)
    for batch in rows_of:  # the same lines as the first pass read, in its order
        end = pos + len(batch)
        stop = int(positions.search_sorted(end, side="left"))
        sel = want.slice(cursor, stop - cursor)
        cursor = stop
        rows = []
        for p, s in sel.iter_rows():
            row = batch[p - pos]
            row["split"] = s
            rows.append(row)
        pos = end
        if not rows:
            continue
        tok_rows = {}
        if "token_ids" in opts.formats:
            made = token_rows(tok, rows, done.stats, done.by_dataset, turns=config.turns, kwargs_for=kwargs_for)  # fmt: skip
            dropped["template_mismatch"] += sum(r is None for r in made)
            rows = [r for r, m in zip(rows, made, strict=True) if m is not None]
            tok_rows = {r["id"]: r for r in made if r is not None}
        for split in SPLITS:
            mask = [r["split"] == split for r in rows]
            if not any(mask):
                continue
            if split not in splits:
                splits[split] = _Split(out_dir, split, opts, columns[split])
            srows = [r for r, m in zip(rows, mask, strict=True) if m]
            splits[split].write(srows, tok_rows)
            for r in srows:
                done.add(r, split)
    for split in SPLITS:
        if split in splits:
            splits[split].close(files)
    return done


def _tokenizer(tokenizer, config, opts: ExportOptions):
    from kit.report.tokenrows import load_tokenizer_for

    # only token rows need it (loading one imports transformers: seconds, for nothing)
    needed = "token_ids" in opts.formats or tokenizer is not None
    tok = load_tokenizer_for(tokenizer, config) if needed else None
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
