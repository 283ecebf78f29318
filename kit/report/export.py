"""kit.export: a run's records in trainer formats, with manifest.json, read as
select -> write -> validate -> swap.

    result = kit.export("data/runs/demo", "data/exports/demo", val_fraction=0.05)
    kit.validate("data/exports/demo").ok   # -> True (kit.report.validate)

Select: the run's key index (kit.report.selection). Write: the records read again a batch at
a time, the next on a thread meanwhile, each format's writer (kit.report.formats) making its
rows and checking them against kit.validate's rules. Validate the staged folder without
reading its files again, then swap it in (kit.report.staging): kit deletes only files it wrote.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kit.errors import ConfigError, ExportError, ExportInvalid
from kit.report import draftvocab
from kit.report import manifest as _manifest
from kit.report.formats import WRITERS, chosen
from kit.report.selection import light_frame, select, split_by_prompt
from kit.report.staging import Staged, owned_files
from kit.report.validate import ValidationResult, validate  # noqa: F401 - re-exported
from kit.report.writers import SPLITS, Context
from kit.types import record_columns

FORMATS = tuple(WRITERS)


@dataclass
class ExportOptions:
    """What to keep and how to split; validates itself (ValueError names the field)."""

    formats: tuple = ("specforge", "token_ids", "parquet")
    drop_truncated: bool = False
    keep_truncated_conversations: bool = False  # `length` rows in the SpecForge JSONL (see below)
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
            raise ConfigError(
                f"formats must be a non-empty subset of {FORMATS}, got {self.formats!r}"
            )
        if not (isinstance(self.val_fraction, (int, float)) and 0 <= self.val_fraction < 1):
            raise ConfigError(f"val_fraction must be in [0, 1), got {self.val_fraction!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"seed must be an int, got {self.seed!r}")
        for name, share in (self.mix or {}).items():
            if not isinstance(share, (int, float)) or isinstance(share, bool) or not share > 0:
                raise ConfigError(f"mix[{name!r}] must be a positive share, got {share!r}")
        if self.mix is not None and not self.mix:
            raise ConfigError("mix must name at least one dataset, got {}")


@dataclass
class ExportResult:
    """What an export wrote: paths (relative to out_dir) with sha256, and counts."""

    out_dir: Path
    files: dict[str, str]  # relative path -> sha256
    counts: dict[str, dict]  # dataset -> {"records", "tokens", "train", "validation"}
    dropped: dict[str, int]  # reason -> records left out
    manifest: dict = field(repr=False)
    corrupt: int = 0  # always 0: the run database holds whole records only (kept for the API)
    notes: list[str] = field(default_factory=list)  # e.g. "no records in <run_dir>"

    def summary(self) -> str:
        """Plain text: counts per dataset, what was dropped or skipped, files written."""
        lines = [f"export -> {self.out_dir}"]
        for name, c in self.counts.items():
            lines.append(
                f"  {name}: {c['records']} records, {c['tokens']:,} tokens "
                f"(train {c['train']}, validation {c['validation']})"
            )
        lines += [f"  dropped {n} ({why})" for why, n in self.dropped.items() if n]
        lines += _manifest.summary_lines(self.manifest)
        if v := self.manifest.get("draft_vocab"):
            import polars as pl

            lines.append(
                f"  draft vocabulary of {v['draft_vocab_size']:,} (target {v['target_vocab_size']:,}):"
            )
            lines += draftvocab.coverage_text(pl.DataFrame(v["datasets"]), v["draft_vocab_size"])
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  wrote {p}" for p in self.files]
        return "\n".join(lines)

    __repr__ = __str__ = summary  # what a notebook cell or print shows


# ---------------------------------------------------------------- writing

BATCH = 5_000  # records per batch of the writing pass: bounds its memory
WRITES_IN_FLIGHT = 4  # batches rendered and queued for the writer thread
_READ = list(record_columns(stored=True, exported=True))  # and the prompt (messages, tools)


def export(
    run_dir,
    out_dir,
    *,
    formats=("specforge", "token_ids", "parquet"),
    tokenizer=None,
    drop_truncated: bool = False,
    keep_truncated_conversations: bool = False,
    drop_errors: bool = True,
    drop_duplicates: bool = False,
    trim_to_budget: bool = False,
    mix: dict | None = None,
    val_fraction: float = 0.0,
    seed: int = 0,
    overwrite: bool = False,
    draft_vocab: int | None = None,
    target_config=None,
) -> ExportResult:
    """Write a run's records in trainer formats, with manifest.json.

    Args:
        run_dir: the run directory.
        out_dir: where to write: new, empty, or a kit export (replaced only with overwrite;
            a non-empty folder that is not a kit export is refused, nothing deleted).
        formats: any of "specforge", "token_ids", "parquet", "hf" (needs `datasets`).
        tokenizer: tokenizer or local path for token_ids (default the run's config.tokenizer).
        drop_truncated / drop_errors / drop_duplicates: leave those records out.
        keep_truncated_conversations: keep `length` rows in the SpecForge JSONL too (left out
            by default: a trainer would train an end-of-turn the model never emitted after
            their cut answer; the token-id rows keep them, unclosed). Counted either way.
        trim_to_budget: per dataset keep records in commit order while tokens <= budget.
        mix: dataset -> token share (e.g. {"code": 1, "chat": 3}); other datasets are left out.
        val_fraction: share of each dataset's prompts put in the validation split.
        seed: seeds the split.
        draft_vocab: also write draft_vocab/ (kit.report.draftvocab): the token frequencies
            and d2t/t2d of a draft vocabulary of this many ids (e.g. 32000), for SpecForge
            and speculators, counted from the exported records' server ids.
        target_config: the target's config.json or folder, for its vocab_size (default: the
            run's tokenizer folder).
    Returns:
        ExportResult (files with sha256, counts per dataset, dropped counts, the manifest).

    Example:
        r = export("data/runs/demo", "data/exports/demo", val_fraction=0.1, trim_to_budget=True)
        r.counts["alpaca"]  # -> e.g. {"records": 41, "tokens": 3998, "train": 37, "validation": 4}
    """
    opts = ExportOptions(
        formats,
        drop_truncated,
        keep_truncated_conversations,
        drop_errors,
        drop_duplicates,
        trim_to_budget,
        mix,
        val_fraction,
        seed,
    )
    run_dir, out_dir, kinds = Path(run_dir), Path(out_dir), chosen(opts.formats)
    with Staged(out_dir) as stage:  # written beside out_dir, swapped in only when validated
        targets = [t for split in SPLITS for kind in kinds for t in kind.targets(split)]
        targets += draftvocab.targets(draft_vocab) if draft_vocab is not None else []
        owned_files(out_dir, overwrite, targets)  # refuse before any work
        config, tok, light, kept, dropped = _select(run_dir, opts, tokenizer, kinds)
        ctx = Context(stage.path, run_dir, config, tok, opts, kept.height)
        writers, files = [kind(ctx) for kind in kinds], {}
        ids = draftvocab.TokenCounts() if draft_vocab is not None else None  # counted as written
        written = _write(run_dir, kept, writers, files, dropped, ids)
        manifest = _manifest.build(
            run_dir, config, tok, written.counts(), written.earlier, dropped, opts, files
        )
        for w in writers:
            w.manifest(manifest)
        empty = [] if written.rows else [_manifest.empty_note(run_dir, light.height)]
        manifest["notes"] = stage.notes + empty
        if ids is not None:
            vocab = _draft_vocab(stage.path, ids, draft_vocab, config, target_config, files)
            manifest["draft_vocab"] = vocab
        (stage.path / "manifest.json").write_text(json.dumps(manifest, indent=2))
        _check_staged(stage.path, out_dir)
        stage.swap_in(owned_files(out_dir, overwrite, targets))
    return ExportResult(
        out_dir=out_dir,
        files={p: e["sha256"] for p, e in files.items()},
        counts=manifest["counts"],
        dropped=dropped,
        manifest=manifest,
        notes=manifest["notes"],
    )


def _select(run_dir, opts, tokenizer, kinds):
    """The run's config, the tokenizer (loaded on a thread meanwhile: it imports
    transformers, seconds), the light frame and the records kept with their split, sorted
    in commit order, and the dropped counts (kit.report.selection)."""
    from concurrent.futures import ThreadPoolExecutor

    from kit.run.reader import read_config

    config = read_config(run_dir)
    with ThreadPoolExecutor(1, thread_name_prefix="kit-tokenizer") as loading:
        tok = loading.submit(_tokenizer, tokenizer, config, kinds)
        light = light_frame(run_dir, opts)
        kept, dropped = select(light, config.budgets, opts)
        kept = split_by_prompt(kept, opts.val_fraction, opts.seed).sort("_pos")
        return config, tok.result(), light, kept, dropped


def _check_staged(path: Path, out_dir: Path) -> None:
    """kit.validate of the staged folder without reading its files again (the rows were
    checked as written, each file hashed and counted as it was written)."""
    check = validate(path, rows=False)
    if not check.ok:
        raise ExportInvalid(
            f"export: the new export failed validation, {out_dir} was left as it was: {'; '.join(check.problems[:3])}"
        )


class _Written:
    """What the writing pass wrote, in any format: per dataset records, tokens and split
    rows, and rows holding earlier assistant turns."""

    def __init__(self) -> None:
        self.rows, self.per, self.earlier = 0, {}, {}

    def add(self, frame) -> None:
        """Count a written batch (dataset, split, completion_tokens, messages or earlier)."""
        import polars as pl

        if "messages" in frame.columns:
            assistant = pl.element().struct.field("role") == "assistant"
            held = pl.col("messages").list.eval(assistant).list.any()
        else:  # read without prompts (kit.run.reader's `earlier`)
            held = pl.col("earlier")
        per = frame.group_by("dataset", "split", maintain_order=True).agg(
            n=pl.len(), tokens=pl.col("completion_tokens").sum(), held=held.sum()
        )
        for d, split, n, tokens, earlier in per.iter_rows():
            c = self.per.setdefault(d, {"records": 0, "tokens": 0, "train": 0, "validation": 0})
            c["records"] += n
            c["tokens"] += tokens
            c[split] += n
            self.rows += n
            self.earlier[d] = self.earlier.get(d, 0) + earlier

    def counts(self) -> dict[str, dict]:
        return {d: self.per[d] for d in sorted(self.per)}


def _write(run_dir, kept, writers, files, dropped, ids=None) -> _Written:
    """Read the records again (kit.run.reader, prompts checked), a batch at a time, the next
    on a thread meanwhile, and hand the kept ones to every writer: each may add columns
    first (the token-id rows; rows its template cannot split leave every format), then
    each checks the batch and writes its rows. One writer thread takes the JSONL writes in
    order, a few batches queued, while the next batch is read and rendered."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    from kit.run.reader import record_batches

    columns = [*_READ, *(c for w in writers for c in w.columns)]
    columns += ["output_ids"] if ids is not None else []  # the draft vocabulary's
    text = any(w.needs_text for w in writers)  # else batches come without their prompts
    batches = record_batches(
        run_dir,
        columns=list(dict.fromkeys(columns)),
        prompts=True if text else "earlier",
        batch_size=BATCH,
    )
    done, pending = _Written(), deque()
    with (
        ThreadPoolExecutor(1, thread_name_prefix="kit-export") as pool,
        _read_ahead(batches) as batches,
    ):

        def later(fn, *args) -> None:
            while len(pending) >= WRITES_IN_FLIGHT:
                pending.popleft().result()  # raises what a write raised
            pending.append(pool.submit(fn, *args))

        at = found = 0  # records read so far; kept ones among them
        for batch in batches:
            frame, at = _kept(batch, kept, at), at + batch.height
            if ids is not None:  # the draft vocabulary's counts (kit.report.draftvocab)
                ids.add(frame)
            found += frame.height
            _write_batch(run_dir, _prepared(frame), writers, later, done)
        while pending:
            pending.popleft().result()
    if found != kept.height:
        raise ExportError(
            f"export: {kept.height - found} records of {run_dir} were not found again when writing"
        )
    for split in SPLITS:  # the manifest lists a split's files together
        for w in writers:
            w.close(split, files)
    for w in writers:
        dropped.update(w.dropped())
    return done


def _write_batch(run_dir, frame, writers, later, done: _Written) -> None:
    """One batch through every writer: prepared (columns added, rows left out), checked
    against kit.validate's rules, then written by split and counted."""
    for w in writers:
        frame = w.prepare(frame)
    if problems := [p for w in writers for p in w.problems(frame)]:
        raise ExportInvalid(
            f"export: rows of {run_dir} break the export's format, nothing was swapped in: {'; '.join(problems[:3])}"
        )
    splits = frame["split"].unique(maintain_order=True).to_list()
    if len(splits) == 1:  # the batch as it is, no copy
        parts = {splits[0]: frame}
    else:
        parts = {s: p for s in SPLITS if (p := frame.filter(frame["split"] == s)).height}
    for w in writers:
        w.write(frame, parts, later)
    done.add(frame)


@contextmanager
def _read_ahead(batches):
    """The batches, each read by a thread while the caller works on the one before (SQLite,
    ADBC and polars let go of the GIL as they read). The iterator is used and closed on
    that thread only (a sqlite3 connection belongs to the thread that made it)."""
    from concurrent.futures import ThreadPoolExecutor

    def ahead():
        nxt = reader.submit(next, batches, None)
        while (batch := nxt.result()) is not None:
            nxt = reader.submit(next, batches, None)
            yield batch

    with ThreadPoolExecutor(1, thread_name_prefix="kit-read") as reader:
        try:
            yield ahead()
        finally:
            reader.submit(batches.close).result()


def _kept(batch, kept, at: int):
    """The batch's records the first pass kept, with their split. The second read gives the
    records in the first read's order (commit order; later records come after), so the
    batch's are the kept rows whose _pos is in [at, at + batch.height): their keys are checked."""
    import polars as pl

    bounds = pl.Series([at, at + batch.height], dtype=pl.UInt32)
    lo, hi = kept["_pos"].search_sorted(bounds).to_list()
    window = kept.slice(lo, hi - lo)
    if window.height < batch.height:  # some were dropped (all kept: the batch as it is)
        batch = batch.select(pl.all().gather(window["_pos"] - at))
    keys = ("dataset", "prompt_id", "sample")
    if not all((batch[k] == window[k]).all() for k in keys):
        raise ExportError("export: the run's records changed order while they were exported")
    return batch.with_columns(window["split"])


def _prepared(frame):
    """A batch with the columns every format reads: `tools_json` (when it has its prompts)
    and `tool_calls_json` (kit.report.convo.tools_json), `_cut`, a generated turn
    stopped at max_tokens (kit.report.convo.cut_rows), and `_bare`, an answer without text
    (kit.report.flags.blank): what it holds instead, "tool_calls", "reasoning" or "empty"
    (null for an answer with text)."""
    import polars as pl

    from kit.report.convo import cut_rows, tools_json
    from kit.report.flags import blank

    if "tools" in frame.columns:  # messages come as sent already (kit.run.reader)
        frame = frame.with_columns(
            tools_json=pl.Series(tools_json(frame["tools"].to_list()), dtype=pl.String)
        )
    c = pl.col
    frame = frame.with_columns(
        tool_calls_json=pl.Series(tools_json(frame["tool_calls"].to_list()), dtype=pl.String),
        _cut=cut_rows(),
    )
    held = (
        pl.when(c("tool_calls_json").is_not_null())
        .then(pl.lit("tool_calls"))
        .when(~blank(c("reasoning")))
        .then(pl.lit("reasoning"))
        .otherwise(pl.lit("empty"))
    )
    return frame.with_columns(_bare=pl.when(blank(c("completion"))).then(held))


def _draft_vocab(out_dir, counts, k, config, target_config, files) -> dict:
    """draft_vocab/ of the kept records' counts (kit.report.draftvocab); its manifest section."""
    from kit.plan.hidden import shape_for

    shape = shape_for(target_config, config.tokenizer)
    if shape is None or shape.vocab_size is None:
        raise ConfigError(
            "draft_vocab needs the target's vocab_size: pass target_config= (its config.json or folder)"
        )
    return draftvocab.write(out_dir, counts, k, shape.vocab_size, files)


def _tokenizer(tokenizer, config, kinds):
    """The tokenizer, loaded only when given or a format needs one (loading one imports
    transformers: seconds); each format then says whether it can be written."""
    from kit.report.tokenrows import load_tokenizer_for

    needed = tokenizer is not None or any(k.needs_tokenizer for k in kinds)
    tok = load_tokenizer_for(tokenizer, config) if needed else None
    for kind in kinds:
        kind.ready(tok)
    return tok
