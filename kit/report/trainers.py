"""The hand-off to the trainers: for SpecForge and speculators, the route that trains an
export's rows (config keys, command line), the chat template SpecForge needs registered for
the conversation route, and what that route cannot carry, counted per dataset.

The token-id route is exact in both (SpecForge 0.2.0, speculators 0.9.0; tests/test_trainers.py
runs their own data code on real exports). The conversation route re-renders text and loses
what it does not hold: SpecForge's GeneralParser drops reasoning_content and its ChatML
templates add their own system prompt (kit names a template made from the tokenizer's);
speculators trains one row per assistant turn to the end of the render; both train an
end-of-turn after a `length` answer, so the conversation export leaves those out by default."""

from __future__ import annotations

_MARK = "\ue000kit-mark\ue000"
# rows per dataset compared: re-tokenizing every answer costs ~1 s of CPU a million ids
RETOKENIZE_SAMPLE = 500


def chatml_parts(tok) -> dict | None:
    """The pieces SpecForge's ChatTemplate needs, read off the tokenizer's own template:
    the text before an assistant message's content and before a user message's, and the
    end-of-turn token. None when the template does not render them plainly.

    Example: SmolLM2 -> {"assistant_header": "<|im_start|>assistant\\n",
                         "user_header": "<|im_start|>user\\n", "end_of_turn_token": "<|im_end|>"}
    """
    from kit.report.tokenrows import end_of_turn
    from kit.tokens import render

    user = [{"role": "user", "content": _MARK}]
    asked = render(tok, [user], False, on_error="skip")[0]
    answered = render(
        tok, [[*user, {"role": "assistant", "content": _MARK + "a"}]], False, on_error="skip"
    )[0]
    _, eot = end_of_turn(tok)
    if not (asked and answered and eot and answered.startswith(asked)):
        return None
    head = asked[: asked.index(_MARK)]
    user_header = head[head.rfind(eot) + len(eot) :].lstrip("\n") if eot in head else None
    tail = answered[len(asked) :]
    if _MARK + "a" not in tail:
        return None
    assistant_header = tail[: tail.index(_MARK + "a")]
    return {
        "assistant_header": assistant_header,
        "user_header": user_header,
        "end_of_turn_token": eot,
    }


def _after_end_of_turn(tok) -> str | None:
    """The text the chat template writes after an assistant turn's end-of-turn (SmolLM2:
    "\n"): speculators trains it, kit's rows (the model's own ids) end at the end-of-turn."""
    from kit.report.tokenrows import end_of_turn

    _, eot = end_of_turn(tok)
    text = _answered(tok, {"content": _MARK})
    end = text.find(_MARK + eot) if eot else -1
    return text[end + len(_MARK + eot) :] if end >= 0 else None


def renders_reasoning(tok) -> bool:
    """Whether the chat template writes an assistant message's reasoning_content."""
    return _MARK in _answered(tok, {"content": "a", "reasoning_content": _MARK})


def renders_tool_calls(tok) -> bool:
    """Whether the chat template writes an assistant message's tool_calls (the conversation
    route trains them only then; token-id rows hold the server's ids either way)."""
    call = {"type": "function", "function": {"name": "kit_mark_fn", "arguments": "{}"}}
    return "kit_mark_fn" in _answered(tok, {"content": "", "tool_calls": [call]})


def _answered(tok, answer: dict) -> str:
    """The template's render of a question and this assistant message ("" when it fails)."""
    from kit.tokens import render

    conv = [{"role": "user", "content": "q"}, {"role": "assistant", **answer}]
    return render(tok, [conv], False, on_error="skip")[0] or ""


def _specforge_template(tok, name: str, thinking: bool) -> dict | None:
    """The ChatTemplate to register for the conversation route (its fields and a name):
    no system_prompt (the tokenizer's template adds its own default, as the server did),
    parser "thinking" when rows have reasoning and the template renders it."""
    parts = chatml_parts(tok)
    if parts is None:
        return None
    parser = "thinking" if thinking and renders_reasoning(tok) else "general"
    return {"name": name, **parts, "system_prompt": None, "parser_type": parser}


def section(config, tok, trainer: dict, retokenized: dict, opts) -> dict:
    """The manifest's "trainers": each trainer's route and what the conversation route loses.
    `trainer`: dataset -> {"length": {split: cut rows}, "bare": {split: {held: rows}} (the
    answers without text left out, by what they hold), "reasoning": rows, "turns": earlier
    assistant turns} (reasoning and turns: of the SpecForge JSONL's rows);
    `retokenized`: dataset -> rows compared and differing (count_retokenized) (kit.report.export)."""
    from kit.tokens import chat_template_hash

    thinking = {d: t["reasoning"] for d, t in sorted(trainer.items()) if t["reasoning"]}
    name = f"kit-{chat_template_hash(tok)[:12]}" if tok is not None else None
    template = _specforge_template(tok, name, bool(thinking)) if tok is not None else None
    model = config.tokenizer or config.model
    only_last = config.turns == "last_turn"
    keep = opts.keep_truncated_conversations
    return {
        "token_ids": {
            "specforge": {"data.prompts_path": "token_ids/train.jsonl"},
            "speculators": f"speculators prepare-data --model {model} --data token_ids/train.jsonl --output <dir>",
            "note": "exact: both trainers train these rows verbatim (input_ids and loss_mask as written)",
        },
        "specforge": {
            "data.train_data_path": "specforge/train.jsonl",
            "data.chat_template": name,
            "data.train_only_last_turn": only_last,
            "template": template,
            "register": register_code(template),
            "train_only_last_turn": only_last,
            "retokenized_differently": {
                d: r["differ"] for d, r in sorted(retokenized.items()) if r["differ"]
            },
            "retokenized_compared": {
                d: {k: r[k] for k in ("rows", "compared", "compared_all")}
                for d, r in sorted(retokenized.items())
            },
            "note": _RETOKENIZED_NOTE,
        },
        "speculators": {
            "command": f"speculators prepare-data --model {model} --data specforge/train.jsonl "
            "--render-endpoint <the target's vLLM, served with --enable-scale-out; no /v1> "
            "--seq-length <its max_model_len or less> --output <dir>",
            "trains_after_end_of_turn": _after_end_of_turn(tok) if tok is not None else None,
            "earlier_turn_rows": {
                d: t["turns"] for d, t in sorted(trainer.items()) if t.get("turns")
            },
            "note": _SPECULATORS_NOTE if only_last else _SPECULATORS_NOTE.split(";")[0],
        },
        "reasoning": {d: {"rows": n, **_reasoning_fate(template)} for d, n in thinking.items()},
        "tool_calls": {
            d: {
                "rows": t["tool_calls"],
                "template_renders_them": renders_tool_calls(tok) if tok is not None else None,
            }
            for d, t in sorted(trainer.items())
            if t.get("tool_calls")
        },
        "no_text": {
            "conversations": "left_out",
            "rows": {
                d: {s: dict(sorted(n.items())) for s, n in t["bare"].items()}
                for d, t in sorted(trainer.items())
                if any(t.get("bare", {}).values())
            },
            "note": _NO_TEXT_NOTE,
        },
        "length": {
            "conversations": "kept" if keep else "left_out",
            "rows": {
                d: t["length"] for d, t in sorted(trainer.items()) if any(t["length"].values())
            },
            "note": _LENGTH_NOTE[keep],
        },
    }


_SPECULATORS_NOTE = (
    "one training row per assistant turn (earlier_turn_rows more rows than "
    "conversations), each trained to the end of the render: the template's text "
    "after the end-of-turn too (trains_after_end_of_turn), on every row; no "
    "last-turn switch: on a last_turn export it trains the dataset's earlier "
    "answers, so use the token-id route"
)
_RETOKENIZED_NOTE = (
    "with the named template, SpecForge trains kit's token-id rows' tokens on "
    "every stop row but the retokenized_differently ones (the answer's text "
    "re-tokenizes to other ids than the server's), the reasoning rows and the "
    "tool_calls rows when the template does not render them; retokenized_compared: of each "
    f"dataset's plain server-id rows, the first {RETOKENIZE_SAMPLE} (a seeded random draw) "
    "are compared, and all rows after one differs (compared_all)"
)
_NO_TEXT_NOTE = (
    "rows whose answer has no text (tool_calls: tool calls only; reasoning: reasoning only; "
    "empty: nothing, though tokens were counted), per split, are left out of the SpecForge "
    "JSONL: SpecForge's preprocessing would train a lone end-of-turn right after the "
    "assistant header, not the target's tokens; the token-id rows keep them (the server's ids)"
)
_LENGTH_NOTE = {  # keep_truncated_conversations -> what became of the `length` rows
    False: "left out of the SpecForge JSONL; the token-id rows keep them, the end-of-turn untrained",
    True: "kept in the SpecForge JSONL (keep_truncated_conversations): both trainers train an "
    "end-of-turn after these cut answers, which the model never emitted",
}


def _reasoning_fate(template: dict | None) -> dict:
    """What becomes of a row's reasoning_content on SpecForge's conversation route."""
    if template is None:
        return {"specforge": "no template could be named: use the token-id route"}
    if template["parser_type"] == "thinking":
        return {
            "specforge": "kept: the named template uses parser_type 'thinking' (ThinkingParser), "
            "and the chat template renders reasoning_content"
        }
    return {
        "specforge": "dropped: GeneralParser keeps role/content/tool_calls only, and this chat "
        "template does not render reasoning_content either (ThinkingParser would "
        "pass it, the template would still drop it): use the token-id route",
        "speculators": "passed to the template as reasoning_content; dropped by this template",
    }


def register_code(template: dict | None) -> str | None:
    """The Python that registers the template with SpecForge before training."""
    if template is None:
        return None
    fields = {k: v for k, v in template.items() if k != "name"}
    args = ", ".join(f"{k}={v!r}" for k, v in fields.items())
    return (
        "from specforge.data.template import TEMPLATE_REGISTRY, ChatTemplate; "
        f"TEMPLATE_REGISTRY.register(name={template['name']!r}, template=ChatTemplate({args}))"
    )


def count_retokenized(tok, frame, out: dict, keep: bool) -> None:
    """Count the server-id rows of the SpecForge JSONL whose answer re-tokenized from its text
    is not the server's ids: the conversation route trains other ids there (a model may emit
    a non-canonical split of a text). Compared: the first RETOKENIZE_SAMPLE rows of each
    dataset (commit order, a seeded random draw), then, once one differs, all its later
    rows (exactrows.widening_sample). `out`: dataset -> {"rows", "compared", "differ",
    "compared_all"}, updated. Rows with reasoning or tool calls are counted elsewhere; cut
    rows are in the JSONL only if `keep`."""
    import polars as pl

    from kit.report.convo import cut_rows
    from kit.report.exactrows import widening_sample
    from kit.report.flags import blank

    c = pl.col
    plain = (c("reasoning").fill_null("") == "") & c("tool_calls_json").is_null()
    plain &= (c("ids_source") == "server") & (pl.lit(keep) | ~cut_rows())
    plain &= ~blank(c("completion"))  # not in the JSONL (the manifest's no_text)
    picked = frame.filter(plain)
    for d, n in picked["dataset"].value_counts().iter_rows():
        entry = out.setdefault(d, {"rows": 0, "compared": 0, "differ": 0, "compared_all": False})
        entry["rows"] += n
    seen = {d: o["compared"] for d, o in out.items()}
    full = {d for d, o in out.items() if o["compared_all"]}
    differ = widening_sample(
        picked, seen, full, RETOKENIZE_SAMPLE, lambda rows: _differs(tok, rows).to_numpy()
    )
    for d, n in picked.filter(pl.Series(differ))["dataset"].value_counts().iter_rows():
        out[d]["differ"] += n
    for d, o in out.items():
        o["compared"], o["compared_all"] = seen.get(d, 0), d in full


def _differs(tok, rows):
    """Per row: whether its trained ids (the mask's last run of 1s) are not its answer's text
    re-tokenized (+ the end-of-turn id after a stop), compared as polars lists."""
    import polars as pl

    from kit.report.tokenrows import end_of_turn
    from kit.tokens import encode_many

    c = pl.col
    eot, _ = end_of_turn(tok)
    answers = pl.Series(encode_many(tok, rows["completion"].to_list()), dtype=pl.List(pl.Int64))
    from kit.types import STOPS

    stop = c("finish_reason").is_in(STOPS)
    at, one = pl.int_range(pl.len()), pl.element() == 1
    end = at.filter(one).max() + 1  # the mask's last run of ones: [start, end)
    start = at.filter(~one & (at < end)).max() + 1
    end, start = (c("loss_mask").list.eval(e).list.first().fill_null(0) for e in (end, start))
    span = c("input_ids").list.slice(start, end - start)
    tail = pl.lit(eot if eot is not None else 0, pl.Int64).repeat_by(stop.cast(pl.UInt32))
    no_eot = stop & pl.lit(eot is None)  # no end-of-turn id: a stop never matches
    return rows.select((span != pl.concat_list(answers, tail)) | no_eot).to_series()
