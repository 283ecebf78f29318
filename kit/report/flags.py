"""Per-record checks of a run: the flag columns kit.audit counts and kit.export filters on.

Empty answers (tool calls are not empty, reasoning-only answers are named apart),
duplicates (exact, and of the normalized text), echoes of the prompt, repetition loops (a
tail that compresses below loop_ratio), call attempts left as text on tool prompts, server
ids against the counts, counts outside 0..max_tokens + 1, the finish class
("length_in_reasoning": every token spent thinking), <think> markers the reasoning parser
left in the answer; multi-turn records per generated turn. The checks
are polars expressions over a batch (kit.audit streams a run), texts kept only as hashes;
only echo candidates reach Python. The tokenizer checks live in kit/report/textchecks.py.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import unicodedata
import zlib
from dataclasses import dataclass, fields

from kit.errors import ConfigError
from kit.report.convo import parsed
from kit.report.textchecks import HASH_SEED, THINK_MARKERS, with_optional

_PUNCT_DIGITS = re.compile(r"[\d\W_]+", re.UNICODE)
# The same class for polars (Rust regex): Python's [\d\W_] is every character that is not a
# letter and not a non-decimal number (checked against every code point of Python's Unicode).
# Runs of it that are one plain space already read as normalize_text writes them, so only the
# other runs are replaced.
_W = r"\p{L}\p{Nl}\p{No}"
_NOT_WORD_RUNS = rf"[^{_W}]*(?:[^{_W} ]|  )[^{_W}]*"
_SPACE = "".join(c for c in map(chr, range(0x3001)) if c.isspace())  # what str.strip() strips
# a loop: the answer's last LOOP_TAIL characters (answers of LOOP_MIN_CHARS or more) compress
# with zlib (raw deflate, a 512-byte window: ~4 us a record) to loop_ratio of their UTF-8
# size or less; prose and code compress to 0.4 or more of theirs (0.68 the median of kit's
# own README and source), "babybaby..." or one line repeated to 0.02-0.08
LOOP_TAIL, LOOP_MIN_CHARS = 600, 200
# text that tries to call a tool: a <tool_call> / <function tag, or JSON naming a function
# with its arguments (either order), or a call of one of the prompt's tools by name
_CALL_TEXT = re.compile(
    r'<tool_call>|<function[=\s>]|"name"\s*:\s*"[^"]+"[^{}]{0,200}"(?:arguments|parameters)"\s*:'
    r'|"(?:arguments|parameters)"\s*:[\s\S]{0,400}?"name"\s*:\s*"[^"]+"'
)


@dataclass(slots=True)
class AuditThresholds:
    """What counts as a problem. Shares are fractions of a dataset's records (0 = any).

    A dataset is over budget (an error) when its tokens exceed the budget by more than
    max(over_budget_share * budget, max_tokens); overshoot (a warning) when over by more than
    overshoot_share of it, inside that allowance (one max_tokens is a large share of a small
    budget); under budget when below it with prompts left; short when its prompts ran out
    more than short_share below it.
    The tokenizer checks (ids decode to the text, counts not under-reported) decode and
    re-encode each record, so kit.audit runs them on a seeded sample of `text_check_sample`
    records per dataset (every record when a dataset has fewer; None: always every record).
    """

    over_budget_share: float = 0.01
    overshoot_share: float = 0.05  # over budget by this share, even inside the allowance
    short_share: float = 0.01  # prompts ran out this far below the budget
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
    reasoning_only_share: float = 0.0  # reasoning but no answer text nor tool call
    loop_share: float = 0.0  # answers whose tail repeats (a loop)
    loop_ratio: float = 0.2  # a tail compressing to this share of its size or less is a loop
    call_attempt_share: float = 0.0  # tool-prompt answers trying a call in text, none parsed
    think_marker_share: float = 0.0  # answers holding <think> / </think>
    text_check_sample: int | None = 500  # records per dataset the tokenizer checks (None: all)

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
                raise ConfigError(f"AuditThresholds.{f.name} has an invalid value {value!r}")


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
    return texts.str.to_lowercase().str.replace_all(_NOT_WORD_RUNS, " ").str.strip_chars(" ")


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


def _count_flags(recs, max_tokens) -> tuple[list, list, list, list]:
    """(ids_len_mismatch, count_over_max, earlier_turns, earlier_length) per record, each
    generated turn checked alone; earlier_length: earlier turns with finish_reason length.
    `recs` holds completion_tokens, turns and output_ids, or _n_ids (their count)."""
    import polars as pl

    if "_n_ids" not in recs.columns:
        recs = recs.with_columns(_n_ids=pl.col("output_ids").list.len())
    len_bad, over, n_earlier, n_length = [], [], [], []
    cols = ("completion_tokens", "_n_ids", "turns")
    for count, n_ids, turns in recs.select(cols).iter_rows():
        turns = parsed(turns) or []
        earlier = [(t.get("completion_tokens") or 0, _len(t.get("output_ids"))) for t in turns]
        parts = [(count - sum(n for n, _ in earlier), n_ids), *earlier]
        len_bad.append(any(k is not None and k != n for n, k in parts))
        over.append(max_tokens is not None and any(not 0 <= n <= max_tokens + 1 for n, _ in parts))
        n_earlier.append(len(turns))
        n_length.append(sum(t.get("finish_reason") == "length" for t in turns))
    return len_bad, over, n_earlier, n_length


def tail_ratio(text: str) -> float | None:
    """zlib's compressed size of the text's last LOOP_TAIL characters over their UTF-8 size
    (None below LOOP_MIN_CHARS): a loop's tail repeats, so it compresses far below prose.

    Example:
        >>> round(tail_ratio("baby" * 100), 2), tail_ratio("short") is None
        (0.03, True)
    """
    if len(text) < LOOP_MIN_CHARS:
        return None
    tail = text[-LOOP_TAIL:].encode()
    deflate = zlib.compressobj(6, zlib.DEFLATED, -9, 1)
    return len(deflate.compress(tail) + deflate.flush()) / len(tail)


def _loops(texts, ratio: float):
    """loop per text (a String Series: the answer, or its reasoning when it has none)."""
    import polars as pl

    long = (texts.fill_null("").str.len_chars() >= LOOP_MIN_CHARS).arg_true()
    out = pl.Series("loop", [False] * len(texts), dtype=pl.Boolean)
    if len(long):
        found = [(tail_ratio(t) or 1.0) <= ratio for t in texts[long].to_list()]
        out = out.scatter(long, pl.Series(found, dtype=pl.Boolean))
    return out


def tool_names(tools) -> list[str]:
    """The function names of a prompt's tool definitions (JSON text or a list)."""
    tools = json.loads(tools) if isinstance(tools, str) and tools.strip() else tools
    names = []
    for t in tools if isinstance(tools, list) else []:
        fn = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]:
            names.append(fn["name"])
    return names


def call_attempt(text: str, tools) -> bool:
    """Whether an answer's text looks like a tool call: a <tool_call> tag, JSON with a name
    and arguments, or one of the prompt's tools called by name (`name(`).

    Example:
        >>> tools = [{"type": "function", "function": {"name": "area", "parameters": {}}}]
        >>> call_attempt("[area(base=10, height=5)]", tools), call_attempt("It is 25.", tools)
        (True, False)
    """
    if _CALL_TEXT.search(text):
        return True
    return any(re.search(rf"(?<![\w.]){re.escape(n)}\s*\(", text) for n in tool_names(tools))


def _call_attempts(frame):
    """call_attempt per row: answers to prompts sent tools, with text and no parsed call."""
    import polars as pl

    c = pl.col
    sent = c("tools").fill_null("").str.strip_chars().is_in(["", "[]"]).not_()
    cand = frame.select(sent & ~blank(c("completion")) & (c("tool_calls").fill_null("") == ""))
    rows = cand.to_series().arg_true()
    out = pl.Series("call_attempt", [False] * frame.height, dtype=pl.Boolean)
    if len(rows):
        pairs = frame[rows].select("completion", "tools").iter_rows()
        found = [call_attempt(t, tools) for t, tools in pairs]
        out = out.scatter(rows, pl.Series(found, dtype=pl.Boolean))
    return out


def _len(ids) -> int | None:
    return None if ids is None else len(ids)


def _mostly_equal(u: str, c: str, similarity: float) -> bool:
    """difflib's ratio >= similarity, after the cheaper bound has not ruled it out: difflib's
    matching blocks are a common subsequence, so 2 * LCS / (len(u) + len(c)), rapidfuzz's
    Indel similarity, bounds its ratio from above (given the cutoff so that it stops early;
    a hair under it against float rounding; tests/test_audit_scale.py)."""
    from rapidfuzz.distance import Indel

    if Indel.normalized_similarity(u, c, score_cutoff=similarity - 1e-9) < similarity - 1e-9:
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
        found = [_mostly_equal(u, n, th.echo_similarity) for u, n in pairs]
        echo = echo.scatter(rows, pl.Series(found, dtype=pl.Boolean))
    return echo.alias("echo")


def record_flags(records, thresholds: AuditThresholds | None = None, max_tokens=None):
    """The per-record flags of one batch of records, computed in polars (the answer's ids
    from output_ids, or their count alone from n_output_ids): the batch plus
    empty (no answer, tool call nor reasoning), reasoning_only, loop (tail_ratio of the
    answer, or of the reasoning of a reasoning-only one, at most loop_ratio), tools_sent,
    call_attempt (a tools_sent answer with a call in its text and no parsed tool_calls),
    has_tool_calls, echo, ids_len_mismatch, count_over_max, finish_class,
    think_marker, has_ids, has_reasoning, text_hash (hash of the completion, and of its tool
    calls when it has any), norm_hash (hash of its normalized text; null when that is
    empty), earlier_turns and earlier_length (all_turns: earlier generated turns, and those
    of them cut at max_tokens). Duplicates need the whole run: see dup_flags.

    Example: record_flags(batch, AuditThresholds(), 1024).select("prompt_id", "echo", "norm_hash")
    """
    import polars as pl

    th = thresholds or AuditThresholds()
    c = pl.col
    recs = with_optional(records)
    n_ids = c("output_ids").list.len() if "output_ids" in recs.columns else c("n_output_ids")
    recs = recs.with_columns(_n_ids=n_ids)
    last_user = c("messages").list.eval(
        pl.element().filter(pl.element().struct.field("role") == "user").struct.field("content")
    )
    recs = recs.with_columns(
        normalized(recs["completion"]).alias("_norm"),
        normalized(recs.select(last_user.list.last()).to_series()).alias("_user"),
    )
    over = pl.lit(False)
    if max_tokens is not None:
        over = ~c("completion_tokens").is_between(0, max_tokens + 1)
    length_only = (c("finish_reason") == "length") & blank(c("completion"))
    calls = c("tool_calls").fill_null("") != ""
    text = pl.when(calls).then(pl.concat_str(c("completion"), pl.lit("\x00"), c("tool_calls")))
    thought = c("reasoning").fill_null("").str.strip_chars() != ""
    answer = recs.select(
        pl.when(blank(c("completion"))).then(c("reasoning")).otherwise(c("completion"))
    ).to_series()
    recs = recs.with_columns(
        _echo(recs, th),
        _loops(answer, th.loop_ratio),
        _call_attempts(recs),
        empty=blank(c("completion")) & ~calls & ~thought,
        reasoning_only=blank(c("completion")) & ~calls & thought,
        tools_sent=c("tools").fill_null("").str.strip_chars().is_in(["", "[]"]).not_(),
        has_tool_calls=calls,
        ids_len_mismatch=(c("_n_ids") != c("completion_tokens")).fill_null(False),
        count_over_max=over,
        finish_class=pl.when(length_only & ~blank(c("reasoning")))
        .then(pl.lit("length_in_reasoning"))
        .otherwise(c("finish_reason")),
        think_marker=pl.any_horizontal(
            c("completion").str.contains(m, literal=True) for m in THINK_MARKERS
        ),
        has_ids=c("_n_ids").is_not_null(),
        has_reasoning=thought,
        text_hash=text.otherwise(c("completion")).hash(HASH_SEED),
        norm_hash=pl.when(c("_norm") != "").then(c("_norm").hash(HASH_SEED)),
        earlier_turns=pl.lit(0, pl.Int64),
        earlier_length=pl.lit(0, pl.Int64),
    ).drop("_norm", "_user")
    turned = recs["turns"].is_not_null() & (recs["turns"] != "")
    rows = turned.arg_true()
    if len(rows):  # multi-turn records: each generated turn's count checked alone, in Python
        names = ("ids_len_mismatch", "count_over_max", "earlier_turns", "earlier_length")
        found = zip(names, _count_flags(recs[rows], max_tokens), strict=True)
        recs = recs.with_columns(
            recs[k].scatter(rows, pl.Series(v, dtype=recs[k].dtype)) for k, v in found
        )
    return recs.drop("_n_ids")


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
