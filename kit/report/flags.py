"""Per-record checks of a run: the flag columns kit.audit counts and kit.export filters on.

`flag_records(records)` adds to a records frame (kit.run.reader.records_frame) one column per
check: empty, duplicate (exact, near), echo, server ids and their agreement with the counts
and the text, counts above max_tokens + 1, counts far below the text's own, the finish class
(a "length" finish with an empty answer and non-empty reasoning is "length_in_reasoning": the
model spent every token thinking), and <think> / </think> markers left in the answer (the
server's reasoning parser did not split them off). Multi-turn records (Record.turns) are
checked per generated turn: completion_tokens counts all of them, output_ids the last.

The checks are polars expressions over a whole batch (kit.audit streams a run batch by
batch): `record_flags` flags one batch and hashes its texts (the near-duplicate key is the
hash of the normalized text, so no text is kept), `dup_flags` finds the duplicates over the
hashes of a whole run, and only a few rows ever go through Python: echo candidates (first a
longest-common-subsequence bound, then difflib only where it cannot rule an echo out) and
records with `turns`. The tokenizer checks decode and re-encode each record: kit.audit runs
them on a seeded sample per dataset (TextSample).
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
# The same class for polars (Rust regex): Python's [\d\W_] is every character that is not a
# letter and not a non-decimal number (checked against every code point of Python's Unicode).
# Runs of it that are one plain space already read as normalize_text writes them, so only the
# other runs are replaced (far fewer matches: 4x faster on prose).
_W = r"\p{L}\p{Nl}\p{No}"
_NOT_WORD_RUNS = rf"[^{_W}]*(?:[^{_W} ]|  )[^{_W}]*"
_SPACE = "".join(c for c in map(chr, range(0x3001)) if c.isspace())  # what str.strip() strips
THINK_MARKERS = ("<think>", "</think>")
HASH_SEED = 0x6B6974  # polars .hash() seed of text_hash / norm_hash (stable within a version)


@dataclass(slots=True)
class AuditThresholds:
    """What counts as a problem. Shares are fractions of a dataset's records (0 = any).

    A dataset is over budget when its tokens exceed the budget by more than
    max(over_budget_share * budget, max_tokens); under budget when below it with prompts left.
    The tokenizer checks (ids decode to the text, counts not under-reported) decode and
    re-encode each record, so kit.audit runs them on a seeded sample of `text_check_sample`
    records per dataset (every record when a dataset has fewer; None: always every record).
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
    # records per dataset the tokenizer checks decode / re-encode (None: all). Re-encoding
    # costs ~2-5 us per token: 500 records of 450 tokens x 8 datasets ~ 8 s of CPU
    text_check_sample: int | None = 500

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            is_int = isinstance(value, int) and not isinstance(value, bool)
            if f.name == "echo_min_chars":
                ok = is_int and value >= 0
            elif f.name == "text_check_sample":
                ok = value is None or (is_int and value >= 1)
            else:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
                ok = ok and not math.isnan(value) and 0 <= value <= 1
            if not ok:
                raise ValueError(f"AuditThresholds.{f.name} has an invalid value {value!r}")


def normalize_text(text: str) -> str:
    """Lowercase, drop punctuation and digits, collapse whitespace (near-duplicate key).

    `normalized(expr)` is the same for a polars column.

    Example:
        >>> normalize_text("Hello,  World! 42")
        'hello world'
    """
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(_PUNCT_DIGITS.sub(" ", text).split())


def normalized(texts):
    """normalize_text of every text of a polars String Series (null reads as "").

    NFKC first: ASCII text is its own NFKC, and of the other texts only those that fail
    Python's quick check are normalized (by unicodedata, as normalize_text does); then
    lowercase and punctuation, digits and whitespace runs to one space, in polars.

    Example: normalized(pl.Series(["Hello,  World! 42"])).to_list() -> ["hello world"]
    """
    import polars as pl

    texts = texts.fill_null("")
    rows = (texts.str.len_bytes() != texts.str.len_chars()).arg_true()
    if len(rows):
        odd = [
            (i, unicodedata.normalize("NFKC", t))
            for i, t in zip(rows.to_list(), texts[rows].to_list(), strict=True)
            if not unicodedata.is_normalized("NFKC", t)
        ]
        if odd:
            where, fixed = zip(*odd, strict=True)
            texts = texts.clone().scatter(list(where), pl.Series(fixed, dtype=pl.String))
    out = texts.str.to_lowercase().str.replace_all(_NOT_WORD_RUNS, " ").str.strip_chars(" ")
    return out


def blank(expr):
    """True where the text is null or only whitespace (as Python's str.strip() sees it)."""
    return expr.fill_null("").str.strip_chars(_SPACE) == ""


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


def _count_flags(recs, max_tokens) -> tuple[list, list]:
    """(ids_len_mismatch, count_over_max) per record, each generated turn checked alone."""
    len_bad, over = [], []
    cols = ("completion_tokens", "output_ids", "turns")
    for count, ids, turns in recs.select(cols).iter_rows():
        turns = parsed(turns) or []
        earlier = [(t.get("completion_tokens") or 0, t.get("output_ids")) for t in turns]
        parts = [(count - sum(n for n, _ in earlier), ids), *earlier]
        len_bad.append(any(i is not None and len(i) != n for n, i in parts))
        over.append(max_tokens is not None and any(not 0 <= n <= max_tokens + 1 for n, _ in parts))
    return len_bad, over


def _with_optional(records):
    """Columns of newer kit versions, null in frames written before them."""
    import polars as pl

    for name in ("reasoning", "tools", "turns"):
        if name not in records.columns:
            records = records.with_columns(pl.lit(None, pl.String).alias(name))
    if "messages" not in records.columns:
        msg = pl.List(pl.Struct({"role": pl.String, "content": pl.String}))
        records = records.with_columns(pl.lit(None, msg).alias("messages"))
    return records


def lcs_len(a: str, b: str) -> int:
    """Length of the longest common subsequence of two texts (bit-parallel, Hyyro 2004:
    one big-int step per character of the shorter text).

    difflib's matching blocks are a common subsequence, so 2 * lcs_len / (len(a) + len(b))
    bounds SequenceMatcher.ratio() from above, at ~1/40 of its cost on unrelated texts.

    Example:
        >>> lcs_len("water boils", "water is boiling")
        10
    """
    if len(a) < len(b):
        a, b = b, a
    masks: dict[str, int] = {}
    for i, ch in enumerate(a):
        masks[ch] = masks.get(ch, 0) | (1 << i)
    full = (1 << len(a)) - 1
    v = full
    for ch in b:
        u = v & masks.get(ch, 0)
        v = ((v + u) | (v - u)) & full
    return len(a) - v.bit_count()


def _lcs_function():
    """lcs_len, or the same number from rapidfuzz (C++, ~15x faster) when it is installed."""
    try:
        from rapidfuzz.distance import Indel
    except ImportError:
        return lcs_len
    return lambda a, b: (len(a) + len(b) - Indel.distance(a, b)) // 2


def _mostly_equal(u: str, c: str, similarity: float, lcs=lcs_len) -> bool:
    """difflib's ratio >= similarity, after the cheaper bound has not ruled it out."""
    if 2 * lcs(u, c) / (len(u) + len(c)) < similarity:
        return False
    return difflib.SequenceMatcher(None, u, c, autojunk=False).ratio() >= similarity


def _echo(frame, th: AuditThresholds):
    """echo per row: normalized completion starts with, or (difflib) mostly equals, the
    normalized last user message. Only rows the length ratio lets through reach Python,
    and only those whose common subsequence is long enough reach difflib."""
    import polars as pl

    c = pl.col
    lu, lc = c("_user").str.len_chars(), c("_norm").str.len_chars()
    ok = (lu >= th.echo_min_chars) & (lc > 0)
    ratio = 2 * pl.min_horizontal(lu, lc) / (lu + lc).cast(pl.Float64)
    flags = frame.select(
        ok=ok, starts=ok & c("_norm").str.starts_with(c("_user")), ratio=ratio
    ).with_columns(cand=c("ok") & ~c("starts") & (c("ratio") >= th.echo_similarity))
    echo = flags["starts"]
    rows = flags["cand"].arg_true()
    if len(rows):
        pairs = frame[rows].select("_user", "_norm").iter_rows()
        lcs = _lcs_function()
        found = [_mostly_equal(u, n, th.echo_similarity, lcs) for u, n in pairs]
        echo = echo.scatter(rows, pl.Series(found, dtype=pl.Boolean))
    return echo.alias("echo")


def record_flags(records, thresholds: AuditThresholds | None = None, max_tokens=None):
    """The per-record flags of one batch of records, computed in polars: the batch plus
    empty, echo, ids_len_mismatch, count_over_max, finish_class, think_marker, has_ids,
    has_reasoning, text_hash (hash of the completion) and norm_hash (hash of its normalized
    text; null when that is empty). Duplicates need the whole run: see dup_flags.

    Example: record_flags(batch, AuditThresholds(), 1024).select("prompt_id", "echo", "norm_hash")
    """
    import polars as pl

    th = thresholds or AuditThresholds()
    c = pl.col
    recs = _with_optional(records)
    last_user = c("messages").list.eval(
        pl.element().filter(pl.element().struct.field("role") == "user").struct.field("content")
    )
    recs = recs.with_columns(
        normalized(recs["completion"]).alias("_norm"),
        normalized(recs.select(last_user.list.last()).to_series()).alias("_user"),
    )
    over = ~c("completion_tokens").is_between(0, max_tokens + 1) if max_tokens is not None else pl.lit(False)  # fmt: skip
    length_only = (c("finish_reason") == "length") & blank(c("completion"))
    recs = recs.with_columns(
        _echo(recs, th),
        empty=blank(c("completion")),
        ids_len_mismatch=(c("output_ids").list.len() != c("completion_tokens")).fill_null(False),
        count_over_max=over,
        finish_class=pl.when(length_only & ~blank(c("reasoning")))
        .then(pl.lit("length_in_reasoning"))
        .otherwise(c("finish_reason")),
        think_marker=pl.any_horizontal(
            c("completion").str.contains(m, literal=True) for m in THINK_MARKERS
        ),
        has_ids=c("output_ids").is_not_null(),
        has_reasoning=c("reasoning").fill_null("").str.strip_chars() != "",
        text_hash=c("completion").hash(HASH_SEED),
        norm_hash=pl.when(c("_norm") != "").then(c("_norm").hash(HASH_SEED)),
    ).drop("_norm", "_user")
    turned = recs["turns"].is_not_null() & (recs["turns"] != "")
    rows = turned.arg_true()
    if len(rows):  # multi-turn records: each generated turn's count checked alone, in Python
        len_bad, over_max = _count_flags(recs[rows], max_tokens)
        recs = recs.with_columns(
            recs["ids_len_mismatch"].scatter(rows, pl.Series(len_bad, dtype=pl.Boolean)),
            recs["count_over_max"].scatter(rows, pl.Series(over_max, dtype=pl.Boolean)),
        )
    return recs


def dup_flags(flags) -> list:
    """dup_exact and dup_near (two Series in the frame's row order) over a whole run's
    record_flags: a record is a duplicate when an earlier one (by t_done, ties in row order)
    of its dataset has the same text_hash (exact) or the same norm_hash but another text
    (near). Empty answers are never duplicates; the first copy is never flagged. One
    dataset at a time, so the sort's copies stay a dataset's size. The hashes are 64-bit:
    two different texts taken for copies need a collision (odds ~ n^2 / 2^65 for n records
    of a dataset: 3e-8 at a million).

    Example: light.with_columns(dup_flags(light))
    """
    import polars as pl

    c = pl.col
    later_exact = pl.int_range(pl.len()).over("text_hash") > 0
    later_norm = pl.int_range(pl.len()).over("norm_hash") > 0
    frame = flags.select("dataset", "t_done", "empty", "text_hash", "norm_hash")
    frame = frame.with_row_index("_row")
    parts = [
        frame.filter(c("dataset") == name)
        .sort("t_done", maintain_order=True)
        .select(
            "_row",
            dup_exact=~c("empty") & later_exact,
            dup_near=~c("empty") & c("norm_hash").is_not_null() & later_norm & ~later_exact,
        )
        for name in frame["dataset"].unique(maintain_order=True)
    ]
    schema = {"_row": pl.UInt32, "dup_exact": pl.Boolean, "dup_near": pl.Boolean}
    out = pl.concat(parts).sort("_row") if parts else pl.DataFrame(schema=schema)
    return [out["dup_exact"], out["dup_near"]]


def flag_records(
    records, *, tokenizer=None, thresholds: AuditThresholds | None = None, max_tokens=None
):
    """Add flag columns to a records frame (kit.run.reader.records_frame).

    Adds: empty, dup_exact (a copy of an earlier completion in its dataset), dup_near (same
    normalized text, not an exact copy), echo, has_ids, ids_len_mismatch (a generated turn's
    count != len(its output_ids)), ids_text_mismatch (null without a tokenizer or ids),
    under_reported (completion_tokens < under_report_ratio x the completion re-tokenized;
    null without a tokenizer or when the count was re-tokenized), count_over_max (a turn's
    count outside 0..max_tokens + 1; False without max_tokens), finish_class (finish_reason, or
    "length_in_reasoning"), think_marker (<think> / </think> in the answer), has_reasoning.
    Earlier is by t_done, so the first copy is never flagged. Every record is checked (the
    tokenizer checks too); kit.audit streams a run instead and samples the tokenizer checks.

    Example: flag_records(records_frame(run_dir))["dup_exact"].sum() -> exact repeats in the run
    """
    th = thresholds or AuditThresholds()
    recs = record_flags(records, th, max_tokens)
    recs = recs.with_columns(dup_flags(recs))
    recs = recs.with_columns(
        ids_text_flags(recs, tokenizer),
        under_reported_flags(recs, tokenizer, th.under_report_ratio),
    )
    return recs.drop("text_hash", "norm_hash")


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


class TextSample:
    """A seeded sample, per dataset, of the records the tokenizer checks look at.

    For each check (ids decode to the text: records with output_ids; counts not
    under-reported: records whose count was not re-tokenized) and each dataset, the `size`
    records with the smallest hash of (dataset, prompt_id, sample) are kept: the same records
    whatever the batch order, every record when a dataset has fewer. `size` None keeps every
    record (and so all of their text). Only the kept rows' text stays in memory.

    `check(tok, ratio, datasets)` checks the kept rows of datasets read to their end (so the
    tokenizer works while later files are read); `checks` checks the rest and gives the
    results of the rows the sample ends with (a row checked and later pushed out is dropped).

    Example:
        sample = TextSample(500)
        for batch in batches: sample.add(batch)
        sample.checks(tok, 0.5)  # dataset, prompt_id, sample, ids_text_mismatch, under_reported
    """

    COLUMNS = ["dataset", "prompt_id", "sample", "completion", "reasoning", "output_ids",
               "completion_tokens", "count_source"]  # fmt: skip
    KEYS = ["dataset", "prompt_id", "sample"]

    def __init__(self, size: int | None, seed: int = HASH_SEED) -> None:
        self.size, self.seed = size, seed
        self.kept: dict = {}  # dataset -> its kept rows
        self.bound: dict = {"_ids": {}, "_count": {}}  # check -> dataset -> prio to be under
        self.done = None  # keys + ids_text_mismatch + under_reported of the rows checked

    def _picked(self, check: str):
        import polars as pl

        if self.size is None:
            return pl.col(check)
        rank = pl.when(pl.col(check)).then(pl.col("_prio")).rank("ordinal").over("dataset")
        return (rank <= self.size).fill_null(False)

    def _keep(self, rows):
        return rows.filter(self._picked("_ids") | self._picked("_count"))

    def _may_enter(self, check: str):
        """A row can still enter a full sample only under its size-th smallest hash."""
        import polars as pl

        bound = pl.col("dataset").replace_strict(self.bound[check], default=None, return_dtype=pl.UInt64)  # fmt: skip
        return pl.col(check) & (bound.is_null() | (pl.col("_prio") < bound))

    def add(self, batch) -> None:
        """Offer one batch of records (record columns; reasoning may be missing)."""
        import polars as pl

        c = pl.col
        rows = _with_optional(batch).select(
            *self.COLUMNS,
            _prio=pl.struct(self.KEYS).hash(self.seed),
            _ids=c("output_ids").is_not_null(),
            _count=c("count_source").ne_missing("retokenized"),
        )
        rows = self._keep(rows.filter(self._may_enter("_ids") | self._may_enter("_count")))
        # copy the kept texts out of the batch's buffers (a filtered string column still
        # holds the whole batch's text), so memory stays the sample's, not the run's
        rows = rows.with_columns(
            pl.Series(name, rows[name].to_list(), dtype=pl.String)
            for name in ("completion", "reasoning")
        )
        for (name,), part in rows.partition_by("dataset", as_dict=True).items():
            if name in self.kept:
                part = self._keep(pl.concat([self.kept[name], part]))
            self.kept[name] = part
            for check, bound in self.bound.items():
                prio = part.filter(check)["_prio"]
                if self.size is not None and len(prio) >= self.size:
                    bound[name] = prio.sort()[self.size - 1]

    def check(self, tokenizer, ratio: float, datasets=None) -> None:
        """Check the kept rows (of `datasets`; default all) not checked yet."""
        import polars as pl

        if not self.kept:
            return
        rows = pl.concat(self.kept.values())
        rows = rows.with_columns(_ids=self._picked("_ids"), _count=self._picked("_count"))
        if datasets is not None:
            rows = rows.filter(pl.col("dataset").is_in(list(datasets)))
        if self.done is not None:
            rows = rows.join(self.done, on=self.KEYS, how="anti")
        ids, counts = rows.filter("_ids"), rows.filter("_count")
        ids = ids.select(self.KEYS).with_columns(ids_text_flags(ids, tokenizer))
        counts = counts.select(self.KEYS).with_columns(under_reported_flags(counts, tokenizer, ratio))  # fmt: skip
        new = rows.select(self.KEYS).join(ids, on=self.KEYS, how="left")
        new = new.join(counts, on=self.KEYS, how="left")
        self.done = new if self.done is None else pl.concat([self.done, new])

    def checks(self, tokenizer, ratio: float):
        """The final sample's ids_text_mismatch and under_reported (null: not checked).

        Returns a frame: dataset, prompt_id, sample, ids_text_mismatch, under_reported.
        """
        import polars as pl

        self.check(tokenizer, ratio)
        if not self.kept:
            keys = {"dataset": pl.String, "prompt_id": pl.String, "sample": pl.Int64}
            return pl.DataFrame(schema=keys | dict.fromkeys(["ids_text_mismatch", "under_reported"], pl.Boolean))  # fmt: skip
        rows = pl.concat(self.kept.values())
        rows = rows.select(*self.KEYS, _ids=self._picked("_ids"), _count=self._picked("_count"))
        rows = rows.join(self.done, on=self.KEYS, how="left")
        return rows.select(
            *self.KEYS,
            ids_text_mismatch=pl.when("_ids").then("ids_text_mismatch"),
            under_reported=pl.when("_count").then("under_reported"),
        )
