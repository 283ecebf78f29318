"""Which records an export keeps, and in which split (kit.report.export's first pass).

light_frame(run_dir, opts) reads every record's key, count and finish reason from the run's
key index through kit.run.reader, in commit order, with `_pos` (its place in that order) and,
with drop_duplicates, 64-bit hashes of its completion (with its tool calls) and of its
normalized text, read once more. select() applies the drop / trim / mix options to it,
split_by_prompt() adds the validation split. The writing pass then reads the records again in the same
order and writes the kept ones, so memory holds one batch of text and one small row per
record, however large the run.
"""

from __future__ import annotations

import itertools
import random

from kit.errors import ConfigError
from kit.types import record_columns


def select(light, budgets: dict, opts) -> tuple[object, dict[str, int]]:
    """Apply the drop / trim / mix options in that order to the light frame (one row per
    record in commit order, no text); returns (the rows kept, dropped counts)."""
    import polars as pl

    from kit.types import STOPS

    frame = light
    dropped = {}
    steps = [
        ("errors", opts.drop_errors, ~pl.col("finish_reason").is_in([*STOPS, "length"])),
        ("truncated", opts.drop_truncated, pl.col("finish_reason") == "length"),
        ("duplicates", opts.drop_duplicates, pl.col("dup_exact") | pl.col("dup_near")),
    ]
    for reason, on, cond in steps:
        if on:
            cond = cond.fill_null(True) if reason == "errors" else cond.fill_null(False)
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


_LIGHT = list(
    record_columns("dataset", "prompt_id", "sample", "finish_reason", "completion_tokens")
)
_TEXT = ["completion", "tool_calls"]  # what drop_duplicates hashes


def light_frame(run_dir, opts):
    """Every record's key, count and finish reason in commit order, with `_pos` its place in
    that order, from the run's key index (kit.run.reader.done_records: no record page read);
    with drop_duplicates, the duplicate flags, from hashes of the records' text read once."""
    import polars as pl

    from kit.report.flags import dup_flags
    from kit.run.reader import done_records, owned, record_batches, record_schema

    light = done_records(run_dir).select(_LIGHT).with_row_index("_pos")
    if not opts.drop_duplicates:
        return light
    schema = record_schema()
    empty = pl.DataFrame(schema={c: schema[c] for c in _TEXT})  # a run without records
    parts = []
    for batch in itertools.chain([empty], record_batches(run_dir, columns=_TEXT)):
        parts.append(owned(_duplicate_keys(batch["completion"], batch["tool_calls"])))
    hashes = pl.concat(parts).head(light.height)  # records committed since come after
    light = pl.concat([light, hashes], how="horizontal")
    by_commit = light.with_columns(t_done=pl.col("_pos"))  # the first committed stays
    return light.with_columns(dup_flags(by_commit))


def _duplicate_keys(text, calls):
    """The columns kit.report.flags.dup_flags reads, of completions (a String series) and
    their tool calls (JSON text), as the audit computes them: empty (an answer of tool calls
    is not), text_hash (of the text, with its calls when it has any), norm_hash (of its
    normalized text; null when that is empty)."""
    import polars as pl

    from kit.report.flags import blank, normalized

    c = pl.col
    has_calls = c("calls").fill_null("") != ""
    exact = pl.when(has_calls).then(pl.concat_str(c("text"), pl.lit("\x00"), c("calls")))
    frame = pl.DataFrame({"text": text, "calls": calls, "norm": normalized(text)})
    return frame.select(
        empty=blank(c("text")) & ~has_calls,
        text_hash=exact.otherwise(c("text")).hash(),
        norm_hash=pl.when(c("norm") != "").then(c("norm").hash()),
    )


def _keep_prefix(frame, limits: dict[str, float]):
    """Per dataset, keep records in commit order while cumulative tokens <= its limit."""
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
        raise ConfigError(
            f"mix names datasets with no records to export: {missing}; have {sorted(avail)}"
        )
    total = sum(mix.values())
    shares = {d: s / total for d, s in mix.items()}
    t = min(avail[d] / s for d, s in shares.items())
    frame = frame.filter(pl.col("dataset").is_in(list(mix)))
    return _keep_prefix(frame, {d: s * t for d, s in shares.items()})


def split_by_prompt(frame, val_fraction: float, seed: int):
    """Add `split`: per dataset a seeded shuffle of prompt ids; the first round(f*n) validate.

    Samples of one prompt stay together, so no prompt is in both splits.
    """
    import polars as pl

    if not val_fraction:  # no prompt validates: nothing to shuffle
        return frame.with_columns(split=pl.lit("train"))
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
