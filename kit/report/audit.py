"""Checks over a run directory -> polars frames and a findings table (`kit.audit(run_dir)`).

Per dataset, against stated thresholds: budget, length distribution, finish reasons and
truncation, empty, duplicate and echoed answers, errors, where counts came from and whether
they are counts, whether server ids decode to the stored text; thinking and tool-call
answers are classed apart. Per run: SQLite's quick_check, refused duplicates, import losses.
Records stream batch by batch (kit.run.reader.record_batches), keeping one light row each
(no text); the tokenizer checks run on a seeded sample per dataset. The per-record checks
are kit/report/flags.py and textchecks.py, the findings kit/report/findings.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kit.errors import ConfigError
from kit.report.convo import row_id
from kit.report.draftvocab import TokenCounts, coverage, coverage_text
from kit.report.findings import findings, run_findings, thinking_off, tools_findings
from kit.report.flags import (  # noqa: F401 - re-exported for callers of kit.report.audit
    AuditThresholds,
    dup_flags,
    finish_class,
    normalize_text,
    record_flags,
)
from kit.report.textchecks import TextSample, drops_tools
from kit.report.tokenrows import load_tokenizer_for
from kit.run.reader import (
    PROMPT_COLUMNS,
    change_lines,
    ids_by_key,
    owned,
    record_batches,
    record_schema,
)
from kit.types import KEY, STOPS, record_columns

KEYS = list(KEY)
# the audit's check of the database file: PRAGMA quick_check (every page and record) not
# integrity_check, whose index-vs-table cross-check alone took 13 of its 17 CPU-s at 1M records
CHECK_NOTE = (
    "checked with SQLite's PRAGMA quick_check (pages and records; `sqlite3 run.sqlite "
    "'PRAGMA integrity_check'` also cross-checks every index against its table)"
)
# the flags the tokenizer checks set on their sample (null elsewhere)
SAMPLED = ("ids_text_mismatch", "prompt_ids_differ", "under_reported")
BATCH_SIZE = 5_000  # records read and flagged at once (memory: a batch of rows as Python objects)
# what the checks read from each record: not these; the answer's ids counted by SQL
# (n_output_ids), read only for the draft-vocabulary table
_UNREAD = record_columns("prompt_ids", "endpoint", "attempts")
READ_COLUMNS = [
    "n_output_ids" if c == "output_ids" else c for c in record_columns() if c not in _UNREAD
]
# AuditReport.records: one light row per record (keys, counts, finish, timing; flags)
LIGHT_COLUMNS = [
    *record_columns(*KEYS, "completion_tokens", "prompt_tokens", "finish_reason"),
    "finish_class",
    *record_columns("count_source", "t_done", "latency_s"),
    *("empty", "echo", "think_marker", "has_reasoning", "has_ids", "ids_len_mismatch"),
    *("count_over_max", "has_tool_calls", "earlier_turns", "earlier_length"),
    *("reasoning_only", "loop", "tools_sent", "call_attempt"),
    *("text_hash", "norm_hash"),
]


@dataclass
class AuditReport:
    """The audit of one run: per-dataset tables, flagged records and the findings.

    Frames: datasets (one row per dataset), lengths (completion-length distribution),
    finish (dataset x finish class counts: the finish_reason, or "length_in_reasoning" for a
    length finish with only reasoning), findings (dataset, check, value, threshold,
    severity, message, example: one record's row id or null; empty when clean), and
    records: one light row per record, no text (LIGHT_COLUMNS: keys, counts, finish,
    timing, the flags of kit.report.flags with SAMPLED's null outside the tokenizer
    checks' sample, and
    text_hash and norm_hash, the duplicate keys). `texts(keys)` reads chosen records' text.

    Example:
        echoed = report.records.filter(pl.col("echo"))
        report.texts(echoed).select("prompt_id", "completion")
    """

    run_dir: str
    datasets: object  # pl.DataFrame
    lengths: object
    finish: object
    records: object
    findings: object
    thresholds: AuditThresholds
    notes: list[str] = field(default_factory=list)  # checks that could not run, and why
    draft_vocab: object = None  # kit.report.draftvocab.coverage(): the top-K share per dataset
    draft_k: int | None = None  # its K

    @property
    def ok(self) -> bool:
        """True when no finding has severity "error"."""
        return self.findings.filter(self.findings["severity"] == "error").height == 0

    def summary(self) -> str:
        """Plain text: one line per dataset, then every finding and note."""
        lines = [f"audit of {self.run_dir}"]
        for r in self.datasets.iter_rows(named=True):
            budget = f"{r['budget']:,}" if r["budget"] else "none"
            line = f"  {r['dataset']}: {r['records']} records, {r['tokens']:,} tokens of {budget}"
            if r["records"]:
                line += (
                    f" | mean {r['mean']:.0f} p90 {r['p90']:.0f} max {r['max']}"
                    f" | truncated {r['truncation_share']:.1%}"
                )
            lines.append(line + f" | errors {r['errors']}")
        if self.findings.height == 0:
            lines.append("no findings")
        for f in self.findings.iter_rows(named=True):
            lines.append(f"  [{f['severity']}] {f['dataset']} {f['check']}: {f['message']}")
        if self.draft_vocab is not None:
            lines.append(f"draft vocabulary (top {self.draft_k:,} of the server ids):")
            lines += coverage_text(self.draft_vocab, self.draft_k)
        lines += [f"  note: {n}" for n in self.notes]
        lines.append(f"  database: {CHECK_NOTE}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        findings = self.findings._repr_html_() if self.findings.height else "<p>no findings</p>"
        notes = "".join(f"<li>{n}</li>" for n in self.notes)
        return (
            f"<h4>audit of {self.run_dir}</h4>{self.datasets._repr_html_()}"
            f"<h4>findings</h4>{findings}" + (f"<ul>{notes}</ul>" if notes else "")
        )

    def __repr__(self) -> str:
        return self.summary()

    def texts(self, keys, columns=("messages", "completion", "reasoning")):
        """The text of some records, read back from the run (streamed): see record_texts."""
        return record_texts(self.run_dir, keys, columns)


def record_texts(run_dir, keys, columns=("messages", "completion", "reasoning")):
    """Read chosen records' text columns back from a run, batch by batch.

    Args:
        run_dir: the run directory.
        keys: a frame with dataset, prompt_id, sample (e.g. flagged rows of
            AuditReport.records), or a list of (dataset, prompt_id, sample) tuples.
        columns: record columns to read besides the keys.
    Returns:
        A frame: the keys plus `columns`, one row per key found, in run order.

    Example: record_texts(run_dir, report.records.filter(pl.col("dup_near")).head(20))
    """
    import polars as pl

    if isinstance(keys, pl.DataFrame):
        want = keys.select(KEYS)
    else:
        schema = {k: record_schema()[k] for k in KEYS}
        want = pl.DataFrame(list(keys), schema=schema, orient="row")
    want = want.unique()
    names = want["dataset"].unique().to_list()
    parts = [
        batch.join(want, on=KEYS, how="semi", maintain_order="left")
        for batch in _batches(run_dir, [*KEYS, *columns], datasets=names)
    ]
    return pl.concat(parts, how="vertical_relaxed") if parts else want.clear()


def _run_counts(run_dir) -> tuple[dict[str, int], dict[str, int]]:
    """(dataset -> samples available (prompts x n), dataset -> records committed), from the
    run database's prompts and totals (kit.run.progress: a few small queries)."""
    from kit.run.progress import progress

    rows = progress(run_dir)
    available = {p.dataset: p.prompts_total for p in rows if p.prompts_total}
    return available, {p.dataset: p.samples_done for p in rows}


def _dataset_table(flags, config, errors, totals: dict[str, int]):
    """One row per dataset: counts, shares, budget and the length distribution."""
    import polars as pl

    c, n = pl.col, pl.col("completion_tokens")
    summed = lambda *names: {x: c(x).sum() for x in names}  # noqa: E731
    agg = flags.group_by("dataset").agg(
        records=pl.len(),
        tokens=n.clip(lower_bound=0).sum(),  # a negative count: 0, flagged
        mean=n.mean(),
        **{f"p{q}": n.quantile(q / 100, "nearest") for q in (50, 90, 99)},
        max=n.max(),
        stop=c("finish_reason").is_in(STOPS).sum(),
        length=(c("finish_reason") == "length").sum(),
        other_reasons=c("finish_reason").filter(~c("finish_reason").is_in([*STOPS, "length"])),
        length_in_reasoning=(c("finish_class") == "length_in_reasoning").sum(),
        think_markers=c("think_marker").sum(),
        reasoning=c("has_reasoning").sum(),
        tool_calls=c("has_tool_calls").sum(),
        **summed("reasoning_only", "loop", "tools_sent", "call_attempt"),
        loop_length=(c("loop") & (c("finish_reason") == "length")).sum(),
        reasoning_only_length=(c("reasoning_only") & (c("finish_reason") == "length")).sum(),
        **{f"ex_{f}": _example(c(f)) for f in EXAMPLED},
        **summed("earlier_turns", "earlier_length", "empty", "dup_exact", "dup_near", "echo"),
        **{s: (c("count_source") == s).sum() for s in ("server_ids", "usage", "retokenized")},
        with_ids=c("has_ids").sum(),
        **summed("ids_len_mismatch", "ids_text_mismatch", "prompt_ids_differ"),
        ids_text_checked=c("ids_text_mismatch").is_not_null().sum(),
        prompt_checked=c("prompt_ids_differ").is_not_null().sum(),
        **summed("count_over_max", "under_reported"),
        count_checked=c("under_reported").is_not_null().sum(),
        countable=c("count_source").ne_missing("retokenized").sum(),
    )
    err = errors.filter(~c("resolved")).unique(KEYS)
    err = err.group_by("dataset").agg(errors=pl.len())
    names = list(dict.fromkeys([*config.budgets, *totals, *agg["dataset"], *err["dataset"]]))
    base = pl.DataFrame(
        {
            "dataset": names,
            "budget": [config.budgets.get(n) for n in names],
            "prompts_total": [totals.get(n) for n in names],
        },
        schema={"dataset": pl.String, "budget": pl.Int64, "prompts_total": pl.Int64},
    )
    table = base.join(agg, on="dataset", how="left").join(err, on="dataset", how="left")
    counts = [col for col in table.columns if col not in ("dataset", "budget", "prompts_total")]
    kept = ("mean", "p50", "p90", "p99", "max", "other_reasons", *(f"ex_{f}" for f in EXAMPLED))
    table = table.with_columns([c(x).fill_null(0) for x in counts if x not in kept])
    table = table.with_columns(other_reasons=_reason_counts(c("other_reasons")))
    return table.with_columns(
        other=c("records") - c("stop") - c("length"),
        budget_share=c("tokens") / c("budget"),
        prompts_left=c("prompts_total") - c("records") if totals else pl.lit(None, pl.Int64),
        truncation_share=_share("length"),
        error_rate=c("errors") / pl.max_horizontal(c("records") + c("errors"), 1),
        retokenized_share=_share("retokenized"),
    )


# flag columns whose finding names one example record (dataset-prompt_id-sample, the
# export's row id): the dataset table's ex_<flag>
EXAMPLED = (
    *("empty", "reasoning_only", "loop", "call_attempt", "echo", "dup_exact", "dup_near"),
    *("ids_text_mismatch", "prompt_ids_differ"),
)


def _example(flag):
    """The row id of the first record (in run order) where `flag` holds, or null."""
    import polars as pl

    from kit.report.convo import row_ids

    return row_ids().filter(flag).first().cast(pl.String)


def _reason_counts(reasons):
    """A list of finish reasons -> "abort 3, content_filter 1" (most first; "" for none)."""
    import polars as pl

    counted = reasons.list.eval(
        pl.element().value_counts(sort=True).struct.rename_fields(["r", "n"])
    )
    text = counted.list.eval(
        pl.concat_str(pl.element().struct.field("r"), pl.element().struct.field("n"), separator=" ")
    )
    return text.list.join(", ").fill_null("")


def _share(name: str):
    import polars as pl

    return pl.col(name) / pl.max_horizontal(pl.col("records"), 1)


def _finish_table(flags):
    import polars as pl

    out = flags.group_by("dataset", pl.col("finish_class").alias("finish_reason")).agg(
        count=pl.len()
    )
    out = out.with_columns(share=pl.col("count") / pl.col("count").sum().over("dataset"))
    return out.sort("dataset", "count", "finish_reason", descending=[False, True, False])


def _batches(run_dir, columns, datasets=None):
    """kit.run.reader.record_batches of the run, only `columns` (messages and tools: the
    records' prompts, each checked against its prompt_id)."""
    wanted = list(columns)
    prompts = any(c in PROMPT_COLUMNS for c in wanted)
    cols = [c for c in wanted if c not in PROMPT_COLUMNS]
    for batch in record_batches(
        run_dir, datasets=datasets, columns=cols, prompts=prompts, batch_size=BATCH_SIZE
    ):
        yield batch.select(wanted)


def _light_records(
    run_dir, th: AuditThresholds, max_tokens, tok, counts, ids, tool_prompts, kwargs_for
):
    """Stream the records: the light per-record frame (flags, no text) and the text sample.
    `tool_prompts`: dataset -> its first record sent tools, filled in; `kwargs_for`:
    dataset -> its chat template kwargs.
    A worker thread flags one batch (polars, outside the GIL) while the next one is read;
    a dataset's sample is checked once its `counts` records (the totals) have been read.
    `ids`: count the server ids into it (read only then; else their count alone)."""
    from concurrent.futures import ThreadPoolExecutor
    from functools import partial

    import polars as pl

    sample = (
        TextSample(
            th.text_check_sample, ids_for=partial(ids_by_key, run_dir), kwargs_for=kwargs_for
        )
        if tok is not None
        else None
    )
    columns = [c if ids is None or c != "n_output_ids" else "output_ids" for c in READ_COLUMNS]

    def flag(batch, finished):
        for row in (
            batch.filter(~pl.col("dataset").is_in(list(tool_prompts)))
            .filter(pl.col("tools").fill_null("").str.strip_chars().is_in(["", "[]"]).not_())
            .unique("dataset", keep="first", maintain_order=True)
            .iter_rows(named=True)
        ):
            tool_prompts[row["dataset"]] = row  # one prompt per dataset sent tools
        if ids is not None:
            ids.add(batch)
        if sample is not None:
            sample.add(batch)
            if finished:  # datasets read to their end: check their sample while others are read
                sample.check(tok, th.under_report_ratio, finished)
        return owned(record_flags(batch, th, max_tokens).select(LIGHT_COLUMNS))

    parts, pending, seen = [], None, dict.fromkeys(counts, 0)
    with ThreadPoolExecutor(1, thread_name_prefix="kit-audit") as pool:
        for batch in _batches(run_dir, columns):
            finished = set()
            for name, n in batch["dataset"].value_counts().iter_rows():
                seen[name] = seen.get(name, 0) + n
                if seen[name] == counts.get(name):
                    finished.add(name)
            if pending is not None:
                parts.append(pending.result())
            pending = pool.submit(flag, batch, finished)
        if pending is not None:
            parts.append(pending.result())
    if not parts:  # no records: the same columns, no rows
        empty = pl.DataFrame(schema={k: record_schema().get(k, pl.Int64) for k in columns})
        parts = [record_flags(empty, th, max_tokens).select(LIGHT_COLUMNS)]
    light = pl.concat(parts, how="vertical_relaxed")
    light = light.with_columns(dup_flags(light))
    if sample is None:
        return light.with_columns(pl.lit(None, pl.Boolean).alias(f) for f in SAMPLED)
    checks = sample.checks(tok, th.under_report_ratio)
    found = light.select(KEYS).join(checks, on=KEYS, how="left", maintain_order="left")
    return light.with_columns(found[f] for f in SAMPLED)


def _sample_notes(table) -> list[str]:
    """One note per dataset whose tokenizer checks ran on a sample, not on every record."""
    notes = []
    for r in table.iter_rows(named=True):
        parts = []
        if r["ids_text_checked"] < r["with_ids"]:
            parts.append(
                f"ids decoded on {r['ids_text_checked']:,} of {r['with_ids']:,} records with ids"
            )
        if r["count_checked"] < r["countable"]:
            parts.append(
                f"counts re-tokenized on {r['count_checked']:,} of {r['countable']:,} records"
            )
        if parts:
            notes.append(f"{r['dataset']}: tokenizer checks on a seeded sample: {'; '.join(parts)}")
    return notes


def audit(
    run_dir,
    *,
    tokenizer=None,
    thresholds: AuditThresholds | None = None,
    draft_vocab: int | None = None,
) -> AuditReport:
    """Check a run directory against thresholds.

    Args:
        run_dir: a run directory (its database, run.sqlite).
        tokenizer: a tokenizer object or local path; default the run's config.tokenizer.
            Needed only to check that output_ids decode to the stored text and that counts
            are not far below the text's own (on thresholds.text_check_sample records per
            dataset).
        thresholds: AuditThresholds (defaults when None).
        draft_vocab: K of the draft-vocabulary table (report.draft_vocab: per dataset the
            share of its server-id tokens inside the run's top K and the ids it adds),
            capped at the target's vocab_size when the tokenizer folder's config.json says;
            None (default): no table, and no record's ids are read but the sample's.
    Returns:
        AuditReport; `report.findings` is empty for a clean run, `report.summary()` is text.

    Example:
        report = kit.audit("data/runs/demo")
        report.findings.select("dataset", "check", "severity")
        # -> e.g. ("alpaca", "truncation", "warn"), ("sharegpt", "over_budget", "error")
    """
    from concurrent.futures import ThreadPoolExecutor

    from kit.run.db import integrity
    from kit.run.reader import errors_frame, read_config

    th = thresholds or AuditThresholds()
    if not isinstance(th, AuditThresholds):
        raise ConfigError(f"thresholds must be an AuditThresholds, got {type(th).__name__}")
    config = read_config(run_dir)
    tok = load_tokenizer_for(tokenizer, config)
    max_tokens = config.sampling.max_tokens
    totals, counts = _run_counts(run_dir)
    tool_prompts: dict = {}  # dataset -> its first record sent tools

    def kwargs_for(name):
        return config.sampling_for(name).chat_template_kwargs

    with ThreadPoolExecutor(1, thread_name_prefix="kit-integrity") as pool:
        checked = pool.submit(integrity, run_dir, quick=True)  # every page: alongside the records
        ids = TokenCounts() if draft_vocab is not None else None
        flags = _light_records(run_dir, th, max_tokens, tok, counts, ids, tool_prompts, kwargs_for)
        problems = checked.result()
    dropped = {  # dataset -> the record whose prompt renders the same without its tools
        d: row_id(r)
        for d, r in tool_prompts.items()
        if tok is not None and drops_tools(tok, r["messages"], r["tools"], kwargs_for(d))
    }
    notes = [] if flags.height else [f"no records in {run_dir}"]
    if tok is None and flags["has_ids"].any():
        notes.append("output_ids not decoded: no tokenizer given and none in config.tokenizer")
    if not totals:
        notes.append("no prompts stored: prompts left unknown, under-budget not checked")
    if tok is None and flags.height:
        notes.append("counts not checked against the text: no tokenizer given or in config")
    table = _dataset_table(flags, config, errors_frame(run_dir), totals)
    if tok is not None:
        notes += _sample_notes(table)
    run_rows, run_notes = run_findings(run_dir, problems)
    notes += [f"changed at a start or resume, in force since: {c}" for c in change_lines(run_dir)]
    off = thinking_off(config, table, tok)
    return AuditReport(
        run_dir=str(run_dir),
        datasets=table,
        lengths=table.select("dataset", "records", "mean", "p50", "p90", "p99", "max"),
        finish=_finish_table(flags),
        records=flags,
        findings=findings(table, th, max_tokens, run_rows, off, tools_findings(table, dropped)),
        thresholds=th,
        notes=notes + run_notes,
        draft_vocab=None if ids is None else coverage(ids, k := _draft_k(draft_vocab, config)),
        draft_k=None if ids is None else k,
    )


def _draft_k(k: int, config) -> int:
    """K capped at the target's vocab_size (its config.json beside the run's tokenizer)."""
    from kit.plan.hidden import shape_for

    try:
        shape = shape_for(None, config.tokenizer)
    except (OSError, ValueError):
        shape = None
    return min(k, shape.vocab_size) if shape is not None and shape.vocab_size else k
