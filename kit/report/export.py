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
    draft_vocab/                         with draft_vocab=K: vocab_mapping.pt (SpecForge), token_freq.pt,
                                         d2t-K.npy, t2d-K.npy (speculators), draft_vocab.json
    manifest.json                        how the export was made (written last)

kit deletes only files it wrote: out_dir must be new, empty, or a kit export; overwrite=True
replaces only the files the old manifest.json lists (each checked against its sha256), then
removes the folders they leave empty. Files of anyone else are never touched.

The selection reads the run's key index (kit.report.selection: drops, trim, mix, split);
then the records are read once through kit.run.reader in commit order, with their prompts, a
batch at a time (each prompt checked against its hash: an edited one stops the export with
PromptMismatch, and the files begun are removed), and the kept ones written
(kit.report.writers). A token_ids-only export reads the text of only the prompts its rows
use (exact rows use none). Each batch's rows are checked against kit.validate's rules as
they are rendered, and each file hashed and counted as it is written; the staged folder is
then validated without reading its files again (validate(rows=False): the manifest, the
listing, each file's size against what was written, the counts) and swapped in. Memory holds one batch of text.

SpecForge format, field by field, as SpecForge reads it (sgl-project/SpecForge,
docs/basic_usage/data_preparation.md "Option 1: Conversation Format" and
specforge/data/parse.py GeneralParser.parse): `id` a non-empty string; `conversations` a
list of {"role": "system"|"user"|"assistant", "content": str}; an optional leading system
message replaces the template's default system prompt; then user/assistant turns, the
conversation ending with the target's assistant completion, which carries the target's
thinking as "reasoning_content" and its tool calls as "tool_calls" when it has any; "tools"
(the record's tool definitions) when present. kit/report/convo.py cites where SpecForge
reads each field.

Which assistant turns are trained (RunConfig.turns): "last_turn" (default): only the
generated one; a prompt's earlier assistant turns are the dataset's. Token-id rows mask them
0; SpecForge has no per-row switch, only train_only_last_turn for the whole dataset, which
these rows then need (manifest "specforge"). "all_turns": every assistant turn is the
target's and is trained in both formats (leave train_only_last_turn off). The manifest says
per dataset how many rows hold earlier turns.

Token-id rows: the server's ids verbatim where the record has them ("ids_source": "server"),
else the chat template re-tokenized ("retokenized"); kit/report/tokenrows.py says how, and
the manifest's "token_rows" counts each kind per dataset. The checks of the server's ids
against the text and kit's rendering run on a sample per dataset, which the manifest's
"token_checks" states (kit/report/exactrows.py).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kit.errors import ExportInvalid
from kit.report import draftvocab
from kit.report import manifest as _manifest
from kit.report.exactrows import Checks, token_columns
from kit.report.selection import light_frame, select, split_by_prompt
from kit.report.staging import Staged
from kit.report.validate import (  # noqa: F401 - ValidationResult, validate: re-exported
    ValidationResult,
    owned_files,
    validate,
)
from kit.report.writers import Split

FORMATS = ("specforge", "token_ids", "parquet", "hf")
SPLITS = ("train", "validation")


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
_READ = [
    "dataset",
    "prompt_id",
    "sample",
    "completion",
    "reasoning",
    "finish_reason",
    "completion_tokens",
    "count_source",
    "turns",
    "tool_calls",
]


def _targets(formats) -> list[str]:
    """The paths (relative to out_dir) an export in these formats writes, manifest aside."""
    out = []
    for split in SPLITS:
        for fmt in ("specforge", "token_ids"):
            if fmt in formats:
                out += [f"{fmt}/{split}.jsonl", f"linehashes/{fmt}/{split}.jsonl.txt"]
        out += (
            [f"parquet/{split}.parquet", f"parquet/.parts-{split}"]
            if {"parquet", "hf"} & set(formats)
            else []
        )
        out += [f"hf/{split}"] if "hf" in formats else []
    return out


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
    from concurrent.futures import ThreadPoolExecutor

    from kit.run.reader import read_config

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
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    with Staged(out_dir) as stage:  # written beside out_dir, swapped in only when validated
        targets = _targets(opts.formats) + (
            draftvocab.targets(draft_vocab) if draft_vocab is not None else []
        )
        owned_files(out_dir, overwrite, targets)  # refuse before any work
        config = read_config(run_dir)
        with ThreadPoolExecutor(1, thread_name_prefix="kit-tokenizer") as loading:
            # loading a tokenizer imports transformers (seconds): meanwhile, the selection
            tok = loading.submit(_tokenizer, tokenizer, config, opts)
            light = light_frame(run_dir, opts)
            kept, dropped = select(light, config.budgets, opts)
            kept = split_by_prompt(kept, opts.val_fraction, opts.seed).sort("_pos")
            tok = tok.result()
        files: dict[str, dict] = {}
        ids = draftvocab.TokenCounts() if draft_vocab is not None else None  # counted as written
        written = _write(run_dir, stage.path, kept, config, tok, opts, files, dropped, ids)
        vocab = _draft_vocab(stage.path, ids, draft_vocab, config, target_config, files)
        notes = stage.notes + (
            [] if written.rows else [_manifest.empty_note(run_dir, light.height)]
        )
        manifest = _manifest.build(
            run_dir,
            config,
            tok,
            written.counts(),
            written.earlier,
            dropped,
            written.stats,
            written.by_dataset,
            opts,
            files,
            written.trainer,
            written.retokenized,
        )
        manifest["notes"] = notes
        if "token_ids" in opts.formats:
            manifest["token_checks"] = written.checks.section()
        if vocab is not None:
            manifest["draft_vocab"] = vocab
        (stage.path / "manifest.json").write_text(json.dumps(manifest, indent=2))
        check = validate(stage.path, rows=False)  # the rows were checked as written (_write)
        if not check.ok:
            raise ExportInvalid(
                f"export: the new export failed validation, {out_dir} was left as it was: {'; '.join(check.problems[:3])}"
            )
        stage.swap_in(owned_files(out_dir, overwrite, targets))
    return ExportResult(
        out_dir=out_dir,
        files={p: e["sha256"] for p, e in files.items()},
        counts=manifest["counts"],
        dropped=dropped,
        manifest=manifest,
        notes=notes,
    )


class _Written:
    """What the writing pass wrote: per dataset records, tokens, split rows, rows holding
    earlier assistant turns, and how the token rows were made."""

    def __init__(self, keep: bool = False, convs: bool = False) -> None:
        self.rows, self.keep = 0, keep  # keep: cut rows are in the SpecForge JSONL
        self.convs = convs  # a SpecForge JSONL is written: count what its route loses
        self.per: dict[str, dict] = {}
        self.earlier: dict[str, int] = {}
        self.stats: dict[str, int] = {}
        self.by_dataset: dict[str, dict] = {}
        self.checks = Checks()  # the sampled checks of the exact token rows
        # dataset -> {"length": {split: cut rows}, "reasoning": rows, "turns": earlier assistant
        # turns in the SpecForge JSONL} (kit.report.trainers)
        self.trainer: dict[str, dict] = {}
        # dataset -> re-tokenized answers compared, differing (kit.report.trainers)
        self.retokenized: dict[str, dict] = {}

    def add(self, frame, split: str) -> None:
        """Count a written batch of a split (dataset, completion_tokens, messages, _cut)."""
        import polars as pl

        in_convs = pl.lit(self.keep) | ~pl.col("_cut")  # the rows of the SpecForge JSONL
        thinks = (pl.col("reasoning").fill_null("") != "") & in_convs
        if "messages" in frame.columns:
            assistant = pl.col("messages").list.eval(
                pl.element().struct.field("role") == "assistant"
            )
            held, turns = assistant.list.any(), assistant.list.sum()
        else:  # read without prompts (kit.run.reader's `earlier`): no SpecForge file to count
            held, turns = pl.col("earlier"), pl.lit(0)
        per = frame.group_by("dataset", maintain_order=True).agg(
            n=pl.len(),
            tokens=pl.col("completion_tokens").sum(),
            held=held.sum(),
            length=pl.col("_cut").sum(),
            thinks=thinks.sum(),
            calls=(pl.col("tool_calls_json").is_not_null() & in_convs).sum(),
            turns=turns.filter(in_convs).sum(),
        )
        for d, n, tokens, earlier, length, thinking, calls, turns in per.iter_rows():
            c = self.per.setdefault(d, {"records": 0, "tokens": 0, "train": 0, "validation": 0})
            c["records"] += n
            c["tokens"] += tokens
            c[split] += n
            self.rows += n
            self.earlier[d] = self.earlier.get(d, 0) + earlier
            t = self.trainer.setdefault(
                d, {"length": dict.fromkeys(SPLITS, 0), "reasoning": 0, "turns": 0, "tool_calls": 0}
            )
            t["turns"] += turns
            t["tool_calls"] += calls
            t["length"][split] += length
            t["reasoning"] += thinking

    def counts(self) -> dict[str, dict]:
        return {d: self.per[d] for d in sorted(self.per)}


def _write(run_dir, out_dir, kept, config, tok, opts, files, dropped, ids=None) -> _Written:
    """Pass 2: read the records again (kit.run.reader, prompts checked), a batch at a time,
    and write the kept ones to their split's files: SpecForge lines rendered by polars, token
    rows from the batch's dicts (those the template cannot split are dropped from every
    format, counted as template_mismatch), tables by polars. One writer thread takes the
    JSONL writes in order, a few batches queued, while the next batch is read and rendered."""
    import functools
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    from kit.run.reader import record_batches

    tokens = "token_ids" in opts.formats
    if tokens:
        dropped["template_mismatch"] = 0
    done, pending = (
        _Written(opts.keep_truncated_conversations, "specforge" in opts.formats),
        deque(),
    )
    splits = {s: Split(out_dir, s, opts, tokens and kept.height > 0) for s in SPLITS[:1]}
    columns = _READ + (
        ["prompt_ids", "output_ids"] if tokens else ["output_ids"] if ids is not None else []
    )
    # token-id rows from the server's ids use no prompt text: with no other format, a batch
    # comes without its prompts, and the rows that use one read it by key (_with_prompts)
    text = bool({"specforge", "parquet", "hf"} & set(opts.formats)) or config.turns == "all_turns"
    batches = record_batches(
        run_dir, columns=columns, prompts=True if text else "earlier", batch_size=BATCH
    )
    fetch = None if text else functools.partial(_with_prompts, run_dir)
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
            frame = _prepared(frame, config, tok, tokens, done, dropped, fetch)
            if problems := _problems(frame, opts, tok, config):
                raise ExportInvalid(
                    f"export: rows of {run_dir} break the export's format, nothing was swapped in: {'; '.join(problems[:3])}"
                )
            for split in SPLITS:
                part = frame.filter(frame["split"] == split)
                if not part.height:
                    continue
                if split not in splits:
                    splits[split] = Split(out_dir, split, opts, tokens)
                splits[split].write(part, later)
                done.add(part, split)
        while pending:
            pending.popleft().result()
    if found != kept.height:
        raise RuntimeError(
            f"export: {kept.height - found} records of {run_dir} were not found again when writing"
        )
    for split in SPLITS:
        if split in splits:
            splits[split].close(files)
    return done


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


def _problems(frame, opts, tok, config) -> list[str]:
    """A batch's rows against kit.validate's rules for the JSONL formats, checked as the typed
    columns they are rendered from (kit.validate of the staged folder then reads no row)."""
    from kit.report.convo import conversation_problems
    from kit.report.exactrows import token_problems

    out = conversation_problems(frame) if "specforge" in opts.formats else []
    if "token_ids" in opts.formats:
        out += token_problems(frame, len(tok), config.turns == "last_turn")
    return out


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
        raise RuntimeError("export: the run's records changed order while they were exported")
    return batch.with_columns(window["split"])


def _prepared(frame, config, tok, tokens: bool, done: _Written, dropped: dict, fetch=None):
    """A batch ready to write (messages as the reader gives them: as the runner sent them),
    `tools_json` (when it has its prompts) and `tool_calls_json`, and with token ids the
    token-id columns (kit.report.exactrows; `fetch`: _with_prompts, for a batch read without
    its prompts); rows the template cannot split are left out."""
    import polars as pl

    from kit.report.convo import cut_rows, tools_json
    from kit.report.trainers import count_retokenized

    if "tools" in frame.columns:  # messages come as sent already (kit.run.reader)
        frame = frame.with_columns(
            tools_json=pl.Series(tools_json(frame["tools"].to_list()), dtype=pl.String)
        )
    frame = frame.with_columns(
        tool_calls_json=pl.Series(tools_json(frame["tool_calls"].to_list()), dtype=pl.String),
        _cut=cut_rows(),  # a generated turn stopped at max_tokens (kit.report.convo)
    )
    if not tokens:
        return frame
    kwargs_for = lambda d: config.sampling_for(d).chat_template_kwargs  # noqa: E731
    frame, lost = token_columns(
        tok,
        frame,
        done.stats,
        done.by_dataset,
        done.checks,
        turns=config.turns,
        kwargs_for=kwargs_for,
        fetch=fetch,
    )
    dropped["template_mismatch"] += lost
    if frame.height and done.convs:
        count_retokenized(tok, frame, done.retokenized, done.keep)
    return frame


def _with_prompts(run_dir, rows):
    """rows of records read without their prompts, with `messages` and `tools` read by key
    (kit.run.reader.prompts_frame: each checked against its hash)."""
    import polars as pl

    from kit.run.reader import prompts_frame, record_schema

    cols = ["dataset", "prompt_id", "messages", "tools"]
    parts = [
        prompts_frame(run_dir, datasets=[d], ids=g["prompt_id"].unique().to_list()).select(cols)
        for (d,), g in rows.group_by("dataset")
    ]
    schema = record_schema()
    found = pl.concat(parts) if parts else pl.DataFrame(schema={c: schema[c] for c in cols})
    return rows.join(found, on=["dataset", "prompt_id"], how="left", maintain_order="left")


def _draft_vocab(out_dir, counts, k, config, target_config, files) -> dict | None:
    """draft_vocab/ of the kept records' counts (kit.report.draftvocab); its manifest section."""
    if counts is None:
        return None
    from kit.plan.hidden import shape_for

    shape = shape_for(target_config, config.tokenizer)
    if shape is None or shape.vocab_size is None:
        raise ValueError(
            "draft_vocab needs the target's vocab_size: pass target_config= (its config.json or folder)"
        )
    return draftvocab.write(out_dir, counts, k, shape.vocab_size, files)


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
