"""An export's manifest.json (how it was made, what it holds) and the summary lines read
from it: counts per dataset, where token ids came from, which assistant turns are trained.

Sections besides the run's settings and the files: `counts` (dataset -> records, tokens,
train, validation), `token_rows` (dataset -> how its token-id rows were made: "exact" from
the server's prompt_ids + output_ids, "retokenized" from rendered text, and the exceptions
counted by kit.report.tokenrows), `turns` (which assistant turns are trained, and per
dataset how many rows hold earlier ones), `specforge` (the trainer setting the rows need),
`thinking` (for datasets sent {"enable_thinking": False}: whether the chat template ignores
the switch and opens a think block anyway, so their rows hold the target's thinking).
"""

from __future__ import annotations

import dataclasses
import time

from kit.types import strip_userinfo

TOKEN_SOURCES = {
    "exact": "the server's prompt_ids + output_ids, verbatim",
    "retokenized": "approximate: re-tokenized text (the chat template's rendering)",
}
_EXCEPTIONS = {  # token_rows count -> what the summary says about those rows
    "ids_text_differ": "the server's output ids do not spell its text: re-tokenized, not exact",
    "prompt_render_differs": "the server's prompt ids differ from kit's rendering; the server's ids are used",
    "end_of_turn_appended": "stop without an end-of-turn id in output_ids: the template's end-of-turn id was appended",
    "reasoning_not_rendered": "re-tokenized, and the chat template drops reasoning_content: their thinking is not in the token row",
    "tool_calls_not_rendered": "re-tokenized, and the chat template drops tool_calls: the target's tool calls are not in the token row",
    "earlier_turns_fallback": "an earlier turn's tokens were not found in the server's prompt ids: re-tokenized instead",
    "earlier_turns_missing": "an earlier turn could not be located in the rendering: left out of every format",
}


def turns_section(earlier: dict[str, int], mode: str) -> dict:
    """Which assistant turns the rows train, and per dataset the rows with earlier ones
    (`earlier`: dataset -> rows whose prompt holds an assistant turn)."""
    rows = {d: earlier[d] for d in sorted(earlier)}
    if mode == "all_turns":
        note = (
            "earlier assistant turns are the target's own (RunConfig.turns all_turns): "
            "trained in every format, like the last one"
        )
    else:
        note = (
            "earlier assistant turns are the dataset's, not the target's: never trained "
            "(token rows mask them; SpecForge needs train_only_last_turn)"
        )
    return {
        "mode": mode,
        "rows_with_earlier_turns": rows,
        "earlier_trained": mode == "all_turns",
        "note": note,
    }


def specforge_section(mode: str) -> dict:
    """The SpecForge setting these rows need: train_only_last_turn is one switch for a whole
    dataset (sgl-project/SpecForge PR #419), so last_turn exports need it on, all_turns off."""
    on = mode == "last_turn"
    how = (
        "--train-only-last-turn (data.train_only_last_turn: true): each row trains its last "
        "assistant turn only; without it SpecForge also trains the dataset's earlier turns"
        if on
        else "leave train_only_last_turn off: every assistant turn is the target's and is trained"
    )
    return {"train_only_last_turn": on, "how": how}


def thinking_section(config, tok, names) -> dict:
    """dataset -> {"enable_thinking": False, "template_opens_think", "note"} for the datasets
    whose chat_template_kwargs switch thinking off (template checked with the run's
    tokenizer; null when there is none)."""
    from kit.report.textchecks import opens_think_block
    from kit.report.tokenrows import load_tokenizer_for

    off = {
        n: k
        for n in names
        if (k := config.sampling_for(n).chat_template_kwargs or {}).get("enable_thinking") is False
    }
    if off and tok is None:
        try:
            tok = load_tokenizer_for(None, config)
        except (OSError, ValueError):
            tok = None
    out = {}
    for name, kwargs in off.items():
        opens = opens_think_block(tok, kwargs) if tok is not None else None
        note = {
            True: "the chat template ignores enable_thinking=False and opens a think block "
            "anyway: these rows hold the target's thinking",
            False: "the chat template honours enable_thinking=False",
            None: "not checked: no tokenizer",
        }[opens]
        out[name] = {"enable_thinking": False, "template_opens_think": opens, "note": note}
    return out


def build(run_dir, config, tok, counts, earlier, dropped, opts, files) -> dict:
    """The manifest of one export (written last, as manifest.json), before each format's
    writer adds its sections (kit.report.formats). `counts`: dataset -> {"records",
    "tokens", "train", "validation"}; `earlier`: dataset -> rows holding earlier assistant
    turns."""
    import kit
    from kit.report.tokenrows import end_of_turn
    from kit.tokens import chat_template_hash

    eot_id, eot_text = end_of_turn(tok) if tok is not None else (None, "")
    sampling = config.fingerprint_parts()["sampling"]  # unset kwargs/penalties left out, as there
    return {
        "kit_version": kit.__version__,
        "created_unix": time.time(),
        "run_dir": str(run_dir),
        "run_fingerprint": config.fingerprint(),
        "model": config.model,
        "servers": {"api": config.api, "endpoints": [strip_userinfo(u) for u in config.endpoints]},
        "sampling": sampling,
        "template_kwargs": dict(config.template_kwargs),
        "tokenizer": {
            "path": str(config.tokenizer or getattr(tok, "name_or_path", "") or ""),
            "chat_template_hash": chat_template_hash(tok) if tok is not None else None,
            "vocab_size": len(tok) if tok is not None else None,  # token ids are below it
            "run_chat_template_hash": config.chat_template_hash,
            "end_of_turn": {
                "id": eot_id,
                "token": eot_text,
                "in_loss_mask": "when finish_reason == 'stop'",
            },
        },
        "budgets": dict(config.budgets),
        "counts": counts,
        "dropped": dropped,
        "token_id_sources": {},  # filled by the token-id writer
        "token_rows": {},
        "token_rows_sources": TOKEN_SOURCES,
        "turns": turns_section(earlier, config.turns),
        "thinking": thinking_section(config, tok, list(counts)),
        "options": dict(dataclasses.asdict(opts)) | {"formats": list(opts.formats)},
        "files": files,
    }


def _rows(n: int, what: str = "row") -> str:
    """'1 row', '2 rows': counts as a person writes them."""
    return f"{n} {what}{'s' * (n != 1)}"


def summary_lines(manifest: dict) -> list[str]:
    """What the manifest says about token sources and trained turns, one line a point."""
    lines = []
    for name, c in manifest.get("token_rows", {}).items():
        lines.append(
            f"  {name}: token rows {c.get('exact', 0)} exact (server ids), "
            f"{c.get('retokenized', 0)} {TOKEN_SOURCES['retokenized']}"
        )
        lines += [f"  {name}: {_rows(c[k])}: {what}" for k, what in _EXCEPTIONS.items() if c.get(k)]
    for name, t in manifest.get("thinking", {}).items():
        if t.get("template_opens_think"):
            lines.append(
                f"  {name}: enable_thinking=False was sent, but {t['note'].removeprefix('the ')}"
            )
    turns = manifest.get("turns", {})
    for name, n in turns.get("rows_with_earlier_turns", {}).items():
        if n and turns.get("earlier_trained"):
            lines.append(f"  {name}: {_rows(n)} with earlier target turns, trained in every format")
        elif n:
            lines.append(f"  {name}: {_rows(n)} with earlier dataset turns, not trained")
    sf = manifest.get("specforge")
    if sf and any(turns.get("rows_with_earlier_turns", {}).values()):
        lines.append(f"  SpecForge: {sf['how']}")
    return lines + trainer_lines(manifest.get("trainers"))


def trainer_lines(t: dict | None) -> list[str]:
    """The conversation export's losses (kit.report.trainers), one line a dataset."""
    if not t:
        return []
    lines = [
        f"  {name}: {_rows(r['rows'])} with reasoning: SpecForge {r['specforge']}"
        for name, r in t["reasoning"].items()
    ]
    lines += [
        f"  {name}: {_rows(c['rows'])} with tool calls, which the chat template does not render: the SpecForge conversation route does not train them"
        for name, c in t.get("tool_calls", {}).items()
        if c["template_renders_them"] is False
    ]
    for name, splits in t.get("no_text", {}).get("rows", {}).items():
        held: dict = {}  # what the answers hold -> rows, over the splits
        for n in splits.values():
            for k, v in n.items():
                held[k] = held.get(k, 0) + v
        what = ", ".join(f"{k} only {v}" if k != "empty" else f"empty {v}" for k, v in held.items())
        lines.append(
            f"  {name}: {_rows(sum(held.values()))} with no answer text ({what}) left out of the "
            "SpecForge JSONL (it would train a lone end-of-turn after the assistant header); "
            "the token-id rows keep them"
        )
    sp = t.get("speculators", {})
    if t["specforge"].get("train_only_last_turn"):  # the earlier turns are the dataset's
        lines += [
            f"  {name}: {_rows(n, 'earlier assistant turn')} of the dataset's own (few-shot) answers become training rows of the speculators conversation route (one row per assistant turn, no last-turn switch): use the token-id route"
            for name, n in sp.get("earlier_turn_rows", {}).items()
            if n
        ]
    how = {"left_out": "left out of", "kept": "kept in"}[t["length"]["conversations"]]
    lines += [
        f"  {name}: {_rows(sum(n.values()), '`length` row')} {how} the SpecForge JSONL"
        for name, n in t["length"]["rows"].items()
    ]
    sf = t["specforge"]
    seen = sf.get("retokenized_compared", {})
    lines += [
        f"  {name}: {_rows(n)} (of {seen.get(name, {}).get('compared', '?')} compared) whose answer re-tokenizes to other ids than the server's: the SpecForge conversation route trains those ids"
        for name, n in sf.get("retokenized_differently", {}).items()
    ]
    if sf["template"]:
        lines.append(
            f"  SpecForge conversation route: data.chat_template {sf['data.chat_template']}, registered first (manifest trainers.specforge.register); exact route: data.prompts_path token_ids/train.jsonl"
        )
    return lines


def empty_note(run_dir, n_records: int) -> str:
    if n_records:
        return f"every one of the {n_records} records was dropped: the export is empty"
    return f"no records in {run_dir}: the export is empty"
