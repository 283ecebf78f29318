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
thinking as "reasoning_content" and its tool calls as "tool_calls" when it has any; "tools" (the record's tool definitions)
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
import threading
from dataclasses import dataclass, field
from pathlib import Path

from kit.report import manifest as _manifest
from kit.report.selection import light_frame, select, split_by_prompt
from kit.report.tokenrows import token_rows
from kit.report.validate import (  # noqa: F401 - ValidationResult, validate: re-exported
    ValidationResult,
    clear_export,
    file_entry,
    owned_files,
    validate,
)
from kit.report.writers import Split
from kit.run.batches import PromptStore

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
    if "token_ids" in opts.formats:  # the row-by-row path: no prompt store to build
        return _export(run_dir, out_dir, config, tok, opts, owned, upto, corrupt, None)
    with PromptStore(run_dir, lazy=True) as store:
        building = threading.Thread(target=store.prepare, daemon=True)
        building.start()  # the prompt store is built while the first pass reads
        try:
            return _export(run_dir, out_dir, config, tok, opts, owned, upto, corrupt, store)
        finally:
            building.join()  # before the store's temporary file goes


def _export(run_dir, out_dir, config, tok, opts, owned, upto, corrupt, store) -> ExportResult:
    light = light_frame(run_dir, opts, corrupt, upto)
    kept, dropped = select(light, config.budgets, opts)
    kept = split_by_prompt(kept, opts.val_fraction, opts.seed).sort("_pos")
    clear_export(out_dir, owned)
    files: dict[str, dict] = {}
    if store is None:
        written = _write(run_dir, out_dir, kept, config, tok, opts, upto, files, dropped)
    else:
        store.open()  # waits for the build; raises what it raised, if it failed
        written = _write_frames(run_dir, out_dir, kept, opts, files, corrupt, store)
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

    def add_frame(self, frame, split: str) -> None:
        """add() for every row of a records frame (dataset, completion_tokens, messages)."""
        import polars as pl

        if "_held" in frame.columns:  # kit.run.batches.read_spans: the prompt store says
            held = pl.col("_held")
        else:
            is_assistant = pl.element().struct.field("role") == "assistant"
            held = pl.col("messages").list.eval(is_assistant).list.any()
        per = frame.group_by("dataset", maintain_order=True).agg(
            n=pl.len(), tokens=pl.col("completion_tokens").sum(), held=held.sum()
        )
        for d, n, tokens, earlier in per.iter_rows():
            c = self.per.setdefault(d, {"records": 0, "tokens": 0, "train": 0, "validation": 0})  # fmt: skip
            c["records"] += n
            c["tokens"] += tokens
            c[split] += n
            self.rows += n
            self.earlier[d] = self.earlier.get(d, 0) + earlier

    def counts(self) -> dict[str, dict]:
        return {d: self.per[d] for d in sorted(self.per)}


_FRAME_COLUMNS = ["dataset", "prompt_id", "sample", "messages", "completion", "finish_reason",
                  "completion_tokens", "count_source", "reasoning", "tools", "tool_calls"]  # fmt: skip


def _columns(kept, opts) -> dict:
    """Per split, the optional columns of its tables (the same for every batch)."""
    import polars as pl

    return {
        split: {
            "reasoning": kept.filter(pl.col("split") == split)["has_reasoning"].any(),
            "tools": kept.filter(pl.col("split") == split)["has_tools"].any(),
            "token_ids": "token_ids" in opts.formats and kept.height > 0,
        }
        for split in SPLITS
    }


WRITES_IN_FLIGHT = 4  # rendered batches queued for the writer thread (~17 MB each here)


def _write_frames(run_dir, out_dir, kept, opts, files, corrupt, store) -> _Written:
    """Pass 2 without token rows: the kept records read again from where pass 1 found them
    (kit.run.batches.read_spans: polars parses a batch of lines; the prompts come as
    SpecForge text from the prompt store), SpecForge lines rendered by polars
    (kit.report.convo.specforge_lines: the same bytes as json.dumps of each row) and hashed
    here, written by one writer thread (in order), so reading and rendering go on while the
    page cache and the disk take the last batches (a few batches in flight bound memory)."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    import polars as pl

    from kit.run.batches import read_spans

    done, columns, problems = _Written(), _columns(kept, opts), []
    splits = {"train": Split(out_dir, "train", opts, columns["train"])}  # even when empty
    columns_read = [c for c in _FRAME_COLUMNS if c not in ("messages", "tools")]
    frames = read_spans(run_dir, kept, columns_read, store, problems, batch_size=BATCH, carry=["split"])  # fmt: skip
    pending: deque = deque()
    with ThreadPoolExecutor(1, thread_name_prefix="kit-export") as pool:

        def later(fn, *args) -> None:
            while len(pending) >= WRITES_IN_FLIGHT:
                pending.popleft().result()  # raises what a write raised
            pending.append(pool.submit(fn, *args))

        for frame in frames:  # the lines the first pass kept, in its order
            for split in SPLITS:
                part = frame.filter(pl.col("split") == split)
                if not part.height:
                    continue
                if split not in splits:
                    splits[split] = Split(out_dir, split, opts, columns[split])
                splits[split].write_frame(part, later)
                done.add_frame(part, split)
        while pending:
            pending.popleft().result()
    for split in SPLITS:
        if split in splits:
            splits[split].close(files)
    seen = {(c["file"], c["line"]) for c in corrupt}  # pass 2 finds what pass 1 did, and
    corrupt += [c for c in problems if (c["file"], c["line"]) not in seen]  # lost prompts
    return done


def _kept_rows(batch: list[tuple], kept, at: int) -> tuple[list[tuple], int]:
    """(row, split) of the batch's records the first pass kept, picked by (file, line), in
    the batch's order, and where the next batch's search starts in `kept`. The batch reads
    the lines pass 1 read, in its order, so its kept rows are the next ones of `kept`: only
    kept[at : at + len(batch)] is searched (one batch, not the whole run, per batch)."""
    import polars as pl

    where = pl.DataFrame(
        {"_file": [path.stem for path, _, _ in batch], "_line": [n for _, n, _ in batch]},
        schema={"_file": pl.String, "_line": pl.Int64},
    ).with_row_index("_i")
    window = kept.slice(at, len(batch)).select("_file", "_line", "split").with_row_index("_k")
    found = where.join(window, on=["_file", "_line"], how="inner", maintain_order="left")
    rows = [(batch[i][2], s) for i, s in found.select("_i", "split").iter_rows()]
    return rows, at + (found["_k"].max() + 1 if found.height else 0)


def _write(run_dir, out_dir, kept, config, tok, opts, upto, files, dropped) -> _Written:
    """Pass 2: read the records again in the same order, a batch at a time, and write the
    kept ones to their split's files; token rows the template cannot split are dropped
    from every format (counted as template_mismatch)."""

    from kit.run.batches import record_rows

    done = _Written()
    if "token_ids" in opts.formats:
        dropped["template_mismatch"] = 0
    columns = _columns(kept, opts)
    splits = {"train": Split(out_dir, "train", opts, columns["train"])}
    at = 0  # where the next batch's kept rows start in `kept`
    kwargs_for = lambda d: config.sampling_for(d).chat_template_kwargs  # noqa: E731
    size = min(BATCH, TOKEN_BATCH) if "token_ids" in opts.formats else BATCH
    rows_of = record_rows(
        run_dir, order="t_done", upto=upto, batch_size=size, dedupe=False, located=True
    )
    for batch in rows_of:  # the same lines as the first pass read, in its order
        rows = []
        picked, at = _kept_rows(batch, kept, at)
        for row, s in picked:
            row["split"] = s
            rows.append(row)
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
                splits[split] = Split(out_dir, split, opts, columns[split])
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
