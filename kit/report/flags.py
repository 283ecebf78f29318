"""Per-record checks of a run: the flag columns kit.audit counts and kit.export filters on.

`flag_records(records)` adds to a records frame (kit.run.store.records_frame) one column per
check: empty, duplicate (exact, near), echo, server ids and their agreement with the counts
and the text, counts above max_tokens + 1, counts far below the text's own, the finish class
(a "length" finish with an empty answer and non-empty reasoning is "length_in_reasoning": the
model spent every token thinking), and <think> / </think> markers left in the answer (the
server's reasoning parser did not split them off). Multi-turn records (Record.turns) are
checked per generated turn: completion_tokens counts all of them, output_ids the last.
"""

from __future__ import annotations

import difflib
import math
import re
import unicodedata
from dataclasses import dataclass, fields

from kit.report.convo import parsed
from kit.report.tokenrows import strip_end_ids

_PUNCT_DIGITS = re.compile(r"[\d\W_]+", re.UNICODE)
THINK_MARKERS = ("<think>", "</think>")


@dataclass(slots=True)
class AuditThresholds:
    """What counts as a problem. Shares are fractions of a dataset's records (0 = any).

    A dataset is over budget when its tokens exceed the budget by more than
    max(over_budget_share * budget, max_tokens); under budget when below it with prompts left.
    """

    over_budget_share: float = 0.01
    truncation_share: float = 0.05
    empty_share: float = 0.0
    duplicate_share: float = 0.0  # exact duplicates (copies beyond the first)
    near_duplicate_share: float = 0.0  # same normalized text, not exact copies
    echo_share: float = 0.0
    error_rate: float = 0.01  # unresolved errors / (records + unresolved errors)
    other_finish_share: float = 0.0  # finish reasons other than stop/length
    retokenized_share: float = 0.5  # counts estimated by re-tokenizing (not from the server)
    under_report_ratio: float = 0.5  # a server count below this x the re-tokenized text's
    echo_similarity: float = 0.9  # completion "mostly equals" the last user message
    echo_min_chars: int = 16  # shorter user messages are never called echoed
    length_in_reasoning_share: float = 0.0  # "length" with no answer, only reasoning
    think_marker_share: float = 0.0  # answers holding <think> / </think>

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "echo_min_chars":
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            else:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
                ok = ok and not math.isnan(value) and 0 <= value <= 1
            if not ok:
                raise ValueError(f"AuditThresholds.{f.name} has an invalid value {value!r}")


def normalize_text(text: str) -> str:
    """Lowercase, drop punctuation and digits, collapse whitespace (near-duplicate key).

    Example:
        >>> normalize_text("Hello,  World! 42")
        'hello world'
    """
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(_PUNCT_DIGITS.sub(" ", text).split())


def _last_user(messages) -> str:
    for m in reversed(messages or []):
        if m["role"] == "user":
            return m["content"] or ""
    return ""


def _is_echo(user: str, completion: str, th: AuditThresholds) -> bool:
    u, c = normalize_text(user), normalize_text(completion)
    if len(u) < th.echo_min_chars or not c:
        return False
    if c.startswith(u):
        return True
    if 2 * min(len(u), len(c)) / (len(u) + len(c)) < th.echo_similarity:
        return False  # the ratio cannot reach the threshold
    return difflib.SequenceMatcher(None, u, c, autojunk=False).ratio() >= th.echo_similarity


def finish_class(finish: str | None, completion: str, reasoning: str | None) -> str | None:
    """The finish reason, or "length_in_reasoning" for a length finish with an empty answer
    and non-empty reasoning.

    Example:
        >>> finish_class("length", "", "Let me think"), finish_class("length", "Paris", "hm")
        ('length_in_reasoning', 'length')
    """
    if finish == "length" and not completion.strip() and (reasoning or "").strip():
        return "length_in_reasoning"
    return finish


def has_think_marker(text: str) -> bool:
    """True when the answer holds a <think> or </think> marker."""
    return any(m in text for m in THINK_MARKERS)


def _count_flags(recs, max_tokens) -> tuple[list, list]:
    """(ids_len_mismatch, count_over_max) per record, each generated turn checked alone."""
    len_bad, over = [], []
    cols = ("completion_tokens", "output_ids", "turns")
    for count, ids, turns in recs.select(cols).iter_rows():
        turns = parsed(turns) or []
        earlier = [(t.get("completion_tokens") or 0, t.get("output_ids")) for t in turns]
        parts = [(count - sum(n for n, _ in earlier), ids), *earlier]
        len_bad.append(any(i is not None and len(i) != n for n, i in parts))
        over.append(max_tokens is not None and any(n > max_tokens + 1 for n, _ in parts))
    return len_bad, over


def flag_records(
    records, *, tokenizer=None, thresholds: AuditThresholds | None = None, max_tokens=None
):
    """Add flag columns to a records frame (kit.run.store.records_frame).

    Adds: empty, dup_exact (a copy of an earlier completion in its dataset), dup_near (same
    normalized text, not an exact copy), echo, has_ids, ids_len_mismatch (a generated turn's
    count != len(its output_ids)), ids_text_mismatch (null without a tokenizer or ids),
    under_reported (completion_tokens < under_report_ratio x the completion re-tokenized;
    null without a tokenizer or when the count was re-tokenized), count_over_max (a turn's
    count > max_tokens + 1; False without max_tokens), finish_class (finish_reason, or
    "length_in_reasoning"), think_marker (<think> / </think> in the answer), has_reasoning.
    Earlier is by t_done, so the first copy is never flagged.

    Example: flag_records(records_frame(run_dir))["dup_exact"].sum() -> exact repeats in the run
    """
    import polars as pl

    th = thresholds or AuditThresholds()
    for name in ("reasoning", "tools", "turns"):  # frames of kit versions before them
        if name not in records.columns:
            records = records.with_columns(pl.lit(None, pl.String).alias(name))
    recs = records.with_row_index("_row").sort("t_done", maintain_order=True)
    texts = recs["completion"].to_list()
    reasoning = recs["reasoning"].to_list()
    pairs = zip(recs["messages"].to_list(), texts, strict=True)
    len_bad, over = _count_flags(recs, max_tokens)
    fin = zip(recs["finish_reason"].to_list(), texts, reasoning, strict=True)
    recs = recs.with_columns(
        pl.Series("empty", [not t.strip() for t in texts], dtype=pl.Boolean),
        pl.Series("_norm", [normalize_text(t) for t in texts], dtype=pl.String),
        pl.Series("echo", [_is_echo(_last_user(m), c, th) for m, c in pairs], dtype=pl.Boolean),
        pl.Series("ids_len_mismatch", len_bad, dtype=pl.Boolean),
        pl.Series("count_over_max", over, dtype=pl.Boolean),
        pl.Series("finish_class", [finish_class(*x) for x in fin], dtype=pl.String),
        pl.Series("think_marker", [has_think_marker(t) for t in texts], dtype=pl.Boolean),
        has_ids=pl.col("output_ids").is_not_null(),
        has_reasoning=pl.col("reasoning").fill_null("").str.strip_chars() != "",
    )
    first_exact = pl.int_range(pl.len()).over(["dataset", "completion"]) > 0
    first_norm = pl.int_range(pl.len()).over(["dataset", "_norm"]) > 0
    recs = recs.with_columns(
        dup_exact=~pl.col("empty") & first_exact,
        dup_near=~pl.col("empty") & (pl.col("_norm") != "") & first_norm & ~first_exact,
    )
    recs = recs.with_columns(
        ids_text_flags(recs, tokenizer),
        under_reported_flags(recs, tokenizer, th.under_report_ratio),
    )
    return recs.sort("_row").drop("_row", "_norm")


def ids_match_text(tokenizer, ids: list[int], text: str, reasoning: str | None = None) -> bool:
    """True when the ids decode to the text (a trailing EOS / end-of-turn is allowed). With
    reasoning, the ids hold the thinking and then the answer: the decoded text must contain
    the reasoning and end with the answer (the parser's markers and spacing between them
    are not checked).
    """
    decoded = [
        tokenizer.decode(strip_end_ids(tokenizer, ids), skip_special_tokens=False),
        tokenizer.decode(ids, skip_special_tokens=True),
    ]
    if not (reasoning or "").strip():
        return text in decoded
    want = reasoning.strip()
    return any(want in d and d.rstrip().endswith(text.strip()) for d in decoded)


def ids_text_flags(recs, tokenizer):
    """ids_text_mismatch as a Series: null where there are no ids or no tokenizer."""
    import polars as pl

    values = [None] * recs.height
    if tokenizer is not None:
        reasoning = recs["reasoning"] if "reasoning" in recs.columns else [None] * recs.height
        rows = zip(recs["output_ids"].to_list(), recs["completion"].to_list(), reasoning, strict=True)  # fmt: skip
        for i, (ids, text, why) in enumerate(rows):
            if ids is not None:
                values[i] = not ids_match_text(tokenizer, ids, text, why)
    return pl.Series("ids_text_mismatch", values, dtype=pl.Boolean)


def under_reported_flags(recs, tokenizer, ratio: float):
    """under_reported as a Series: the server's count far below the text's own token count."""
    import polars as pl

    values = [None] * recs.height
    if tokenizer is not None and recs.height:
        from kit.tokens import encode_lengths

        lengths = encode_lengths(tokenizer, recs["completion"].to_list())
        rows = zip(recs["completion_tokens"], recs["count_source"], lengths, strict=True)
        values = [None if src == "retokenized" else n < ratio * k for n, src, k in rows]
    return pl.Series("under_reported", values, dtype=pl.Boolean)
