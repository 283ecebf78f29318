"""The audit's findings: one row per check a dataset (or the run) fails, with its message.

`findings` turns kit.audit's per-dataset table into rows (dataset, check, value, threshold,
severity, message): the budget, shares over their AuditThresholds, counts that are no counts,
ids that disagree with counts or text, a template that ignored enable_thinking=False, cut
earlier turns (all_turns). `run_findings` adds those of the run as a whole (dataset "(run)"):
SQLite's integrity check, and duplicate records the database refused.
"""

from __future__ import annotations

from kit.report.flags import LOOP_TAIL, AuditThresholds
from kit.report.textchecks import THINK_MARKERS, opens_think_block
from kit.types import STOPS

_COLUMNS = ["dataset", "check", "value", "threshold", "severity", "message", "example"]
RUN = "(run)"  # the dataset column of findings about the run as a whole


def findings(table, th: AuditThresholds, max_tokens: int, run_rows=(), thinking_off=None, extra=()):
    """The findings frame: one row per check a dataset fails, then `run_rows` (the run's)
    and `extra` (those found with the tokenizer: kit.report.textchecks). `thinking_off`:
    dataset -> what the template check found (or "") for datasets sent enable_thinking
    False. A row's `example` is one record it holds (dataset-prompt_id-sample), or null."""
    import polars as pl

    rows, thinking_off = [], thinking_off or {}
    for r in table.iter_rows(named=True):
        if r["records"]:
            rows += _budget_findings(r, th, max_tokens)
        else:
            msg = "no records: nothing was generated for this dataset (or none could be read)"
            rows.append((r["dataset"], "no_records", 0.0, 0.0, "warn", msg))
        ignored = r["dataset"] in thinking_off and r["reasoning"] > 0
        rows += _share_findings(r, th, skip={"reasoning_only"} if ignored else set())
        if ignored:
            rows.append(_thinking_finding(r, thinking_off[r["dataset"]]))
        rows += _earlier_findings(r, th)
        rows += _count_findings(r, th, max_tokens)
        rows += _ids_findings(r)
    rows += [*run_rows, *extra]
    types = [pl.String, pl.String, pl.Float64, pl.Float64, pl.String, pl.String, pl.String]
    schema = dict(zip(_COLUMNS, types, strict=True))
    rows = [(*row, None) if len(row) == 6 else row for row in rows]  # no example record
    return pl.DataFrame(rows, schema=schema, orient="row")


def _ids_findings(r: dict) -> list[tuple]:
    """Server ids that disagree with the count, or (on the checked sample) with the text."""
    out = []
    if n := r["ids_len_mismatch"]:
        msg = f"{n} of {r['with_ids']} records with ids: completion_tokens != len(output_ids)"
        out.append((r["dataset"], "ids_len_mismatch", float(n), 0.0, "error", msg))
    if n := r["ids_text_mismatch"]:
        checked, of = r["ids_text_checked"], r["with_ids"]
        where = f"{of} records with ids"
        if checked < of:
            where = f"{checked} records with ids checked (a seeded sample of {of})"
        msg = f"{n} of {where}: output_ids do not decode to the stored text; e.g. {r['ex_ids_text_mismatch']}"
        out.append(
            (
                r["dataset"],
                "ids_text_mismatch",
                float(n),
                0.0,
                "error",
                msg,
                r["ex_ids_text_mismatch"],
            )
        )
    if n := r["prompt_ids_differ"]:
        checked, ex = r["prompt_checked"], r["ex_prompt_ids_differ"]
        msg = (
            f"{n} of {checked} records with prompt ids checked (a seeded sample of those with "
            "server ids): the server's prompt_ids are not the stored prompt rendered by the chat "
            "template (with its tools and template kwargs) and tokenized: the server ran "
            f"another prompt, or another template; e.g. {ex}"
        )
        out.append((r["dataset"], "prompt_ids_differ", float(n), 0.0, "error", msg, ex))
    return out


def tools_findings(table, dropped: dict[str, str]) -> list[tuple]:
    """Datasets sent tools that the chat template does not render (`dropped`: dataset ->
    the record whose prompt rendered the same with and without its tools)."""
    out = []
    for r in table.iter_rows(named=True):
        if (ex := dropped.get(r["dataset"])) is None:
            continue
        msg = (
            f"{r['tools_sent']} of {r['records']} records were sent tools that the chat "
            "template does not render (a prompt rendered with and without its tools is the "
            f"same text, e.g. {ex}): the model never saw them; {r['tool_calls']} answers "
            "called a tool. Use a template that renders tools (or leave the tools out)"
        )
        share = r["tools_sent"] / max(r["records"], 1)
        out.append((r["dataset"], "tools_not_rendered", share, 0.0, "warn", msg, ex))
    return out


def _budget_findings(r: dict, th: AuditThresholds, max_tokens: int) -> list[tuple]:
    name, tokens, budget = r["dataset"], r["tokens"], r["budget"]
    if not budget:
        if r["records"]:
            return [(name, "no_budget", float(tokens), 0.0, "warn", "records but no budget")]
        return []
    slack, over = max(th.over_budget_share * budget, max_tokens), tokens - budget
    if over > slack:
        msg = f"{tokens:,} tokens vs budget {budget:,}: over by {over:,} (> {slack:,.0f})"
        return [(name, "over_budget", float(over), float(slack), "error", msg)]
    if over > th.overshoot_share * budget:
        msg = (
            f"{tokens:,} tokens vs budget {budget:,}: over by {over:,} (+{over / budget:.1%}, "
            f"> {th.overshoot_share:.0%}), inside the allowance of {slack:,.0f} (one "
            f"max_tokens={max_tokens:,}, a large share of a budget this small)"
        )
        return [(name, "overshoot", over / budget, th.overshoot_share, "warn", msg)]
    left = r["prompts_left"]
    if tokens < budget and left:
        msg = f"{tokens:,} of {budget:,} tokens ({tokens / budget:.0%}) with {left} prompt{'s' * (left != 1)} left"
        return [(name, "under_budget", float(tokens), float(budget), "warn", msg)]
    short = (budget - tokens) / budget
    if left == 0 and short > th.short_share:
        msg = (
            f"ran out of prompts {short:.1%} short of its budget: {tokens:,} of {budget:,} "
            f"tokens after all {r['prompts_total']:,} samples (add prompts, raise n, or lower "
            "the budget)"
        )
        return [(name, "short_of_budget", short, th.short_share, "warn", msg)]
    return []


def _thinking_finding(r: dict, template: str) -> tuple:
    """enable_thinking False was sent, yet records hold reasoning: the template ignored it."""
    share = r["reasoning"] / max(r["records"], 1)
    msg = (
        f"enable_thinking=False was sent, yet {r['reasoning']} of {r['records']} records "
        f"({share:.1%}) hold reasoning ({r['length_in_reasoning']} stopped by length inside "
        "it, with no answer): the chat template ignored the switch and opened a think block "
        "anyway"
        + (f" ({template})" if template else "")
        + "; use a template that honours enable_thinking, or treat these rows as reasoning rows"
    )
    return (r["dataset"], "thinking_not_off", share, 0.0, "warn", msg)


def _earlier_findings(r: dict, th: AuditThresholds) -> list[tuple]:
    """all_turns: earlier generated turns cut at max_tokens (the conversation went on)."""
    n, cut = r["earlier_turns"], r["earlier_length"]
    if not cut or cut / n <= th.truncation_share:
        return []
    msg = (
        f"{cut} of {n} earlier generated turns ({cut / n:.1%}) stopped at max_tokens "
        f"(finish_reason length), and the conversation went on after the cut answer; "
        f"threshold {th.truncation_share:.1%}"
    )
    return [(r["dataset"], "truncation_earlier_turns", cut / n, th.truncation_share, "warn", msg)]


def _count_findings(r: dict, th: AuditThresholds, max_tokens: int) -> list[tuple]:
    """Counts that are no counts; a server that under-reports."""
    name, out = r["dataset"], []
    if over := r["count_over_max"]:
        msg = (
            f"completion_tokens is not a count in 0..{max_tokens + 1} (max_tokens + 1) in "
            f"{over} records: the server mis-reports counts"
        )
        out.append((name, "bad_count", float(over), max_tokens + 1.0, "error", msg))
    if r["under_reported"]:
        msg = (
            f"{r['under_reported']} of {r['count_checked']} records report fewer than "
            f"{th.under_report_ratio:.0%} of their text's own token count (re-tokenized): "
            "the server under-reports completion_tokens, so budgets overshoot"
        )
        if r["count_checked"] < r["countable"]:
            msg += f" (checked on a seeded sample of {r['count_checked']} of {r['countable']})"
        value = float(r["under_reported"])
        out.append((name, "count_under_reported", value, th.under_report_ratio, "error", msg))
    return out


_SHARE_CHECKS = [  # check, count column, threshold field, severity, what
    ("truncation", "length", "truncation_share", "warn", "finish_reason length (truncated)"),
    ("empty", "empty", "empty_share", "warn", "empty responses (no text, tool call or reasoning)"),
    (
        "reasoning_only",
        "reasoning_only",
        "reasoning_only_share",
        "warn",
        "are reasoning only: reasoning stored, no answer text nor tool call",
    ),
    (
        "loop",
        "loop",
        "loop_share",
        "warn",
        "end in a repetition loop",
    ),
    ("duplicate_exact", "dup_exact", "duplicate_share", "warn", "exact duplicate responses"),
    ("duplicate_near", "dup_near", "near_duplicate_share", "warn", "near-duplicate responses"),
    ("echo", "echo", "echo_share", "warn", "responses echoing the prompt"),
    (
        "finish_other",
        "other",
        "other_finish_share",
        "warn",
        f"finish reasons other than {'/'.join(STOPS)} (a stop) or length",
    ),
    (
        "think_markers",
        "think_markers",
        "think_marker_share",
        "warn",
        "answers holding <think> / </think> markers: the reasoning parser did not split them "
        "off (start the server with a reasoning parser matching the model)",
    ),
    ("retokenized", "retokenized", "retokenized_share", "info", "counts from re-tokenizing"),
]


def _share_findings(r: dict, th: AuditThresholds, skip=frozenset()) -> list[tuple]:
    out = []
    n = max(r["records"], 1)
    for check, col, limit_name, severity, what in _SHARE_CHECKS:
        if check in skip:
            continue
        share, limit = r[col] / n, getattr(th, limit_name)
        if r[col] and share > limit:
            msg = f"{r[col]} of {r['records']} records ({share:.1%}) {what}{_detail(check, r, th)}; threshold {limit:.1%}"
            ex = r.get(f"ex_{col}")
            msg += f"; e.g. {ex}" if ex else ""
            out.append((r["dataset"], check, share, float(limit), severity, msg, ex))
    rows = r["tools_sent"]
    if r["call_attempt"] and r["call_attempt"] / max(rows, 1) > th.call_attempt_share:
        share, ex = r["call_attempt"] / rows, r["ex_call_attempt"]
        msg = (
            f"{r['call_attempt']} of {rows} answers to prompts sent tools ({share:.1%}) try a "
            "tool call in their text (a <tool_call> tag, JSON with a name and arguments, or a "
            "tool called by name) but hold no parsed tool_calls: start the server with the "
            "model's tool-call parser (vLLM: --enable-auto-tool-choice --tool-call-parser ...), "
            f"or the model does not follow the tool format; threshold {th.call_attempt_share:.1%}; "
            f"e.g. {ex}"
        )
        out.append((r["dataset"], "call_attempt", share, th.call_attempt_share, "warn", msg, ex))
    if r["errors"] and r["error_rate"] > th.error_rate:
        msg = f"{r['errors']} request{'s' * (r['errors'] != 1)} failed every attempt ({r['error_rate']:.1%}); threshold {th.error_rate:.1%}"
        out.append((r["dataset"], "error_rate", r["error_rate"], th.error_rate, "warn", msg))
    return out


def _detail(check: str, r: dict, th: AuditThresholds) -> str:
    """What a share finding adds to its count: how a loop was measured and how many were cut,
    how reasoning-only answers ended, which finishes were other, the loops among cuts."""
    if check == "loop":
        cut = r["loop_length"]
        return (
            f" (the answer's last {LOOP_TAIL} characters, or its reasoning's when it has no "
            f"text, compress with zlib to {th.loop_ratio:.0%} of their size or less; prose "
            f"and code: 40% or more): {cut} cut at max_tokens, {r['loop'] - cut} ended otherwise"
        )
    if check == "reasoning_only":
        cut = r["reasoning_only_length"]
        return (
            f" ({r['reasoning_only'] - cut} ended the turn after (or inside) the thinking; "
            f"{cut} cut at max_tokens inside it, the think block never closed (finish class "
            "length_in_reasoning: raise max_tokens or limit thinking))"
        )
    if check == "finish_other" and r["other_reasons"]:
        return f": {r['other_reasons']}"
    if check == "truncation" and r["loop_length"]:
        return f" ({r['loop_length']} of them a repetition loop: see loop)"
    return ""


def thinking_off(config, table, tok) -> dict[str, str]:
    """dataset -> what the template says (or "" without a tokenizer), for the datasets
    whose chat_template_kwargs switch thinking off and whose records hold reasoning."""
    out = {}
    for name, reasoning in table.select("dataset", "reasoning").iter_rows():
        kwargs = config.sampling_for(name).chat_template_kwargs or {}
        if kwargs.get("enable_thinking") is False and reasoning:
            opened = tok is not None and opens_think_block(tok, kwargs)
            out[name] = (
                f"its generation prompt opens {THINK_MARKERS[0]} with these kwargs"
                if opened
                else ""
            )
    return out


def run_findings(run_dir, problems: list[str]) -> tuple[list[tuple], list[str]]:
    """(findings, notes) about the run as a whole: SQLite's integrity check (`problems`),
    duplicate records the database refused."""
    from kit.run.db import db_path
    from kit.run.reader import state

    rows, notes = [], []
    if problems:
        path = db_path(run_dir)
        msg = (
            f"run database {path} fails SQLite's integrity check (quick_check: {len(problems)} problem{'s' * (len(problems) != 1)}, "
            f"first: {problems[0]}): what was read from it may be incomplete. Restore it from a "
            f"copy, or inspect it with `sqlite3 {path} 'PRAGMA integrity_check'` (`.recover` "
            "salvages what is left into a new file)"
        )
        rows.append((RUN, "database_integrity", float(len(problems)), 0.0, "error", msg))
    if rejected := int(state(run_dir, "rejected") or 0):
        msg = (
            f"{rejected} record{'s were' if rejected != 1 else ' was'} refused as duplicates of stored ones (the same dataset, "
            "prompt_id and sample written twice: two writers, or a runner bug); the first "
            "copies are kept"
        )
        rows.append((RUN, "rejected_duplicates", float(rejected), 0.0, "warn", msg))
    return rows, notes
