"""Token-id rows of records with loss masks, for training (kit.export's token_ids format).

An exact row is the server's prompt_ids + output_ids, nothing re-tokenized (_server_row);
the ids are believed only when counted as the record's tokens and they spell its text
(kit.tokens.ids_spell), else the row is re-tokenized and counted ("ids_text_differ"). A
re-tokenized row is the chat template applied to prompt + completion (_text_row). With
RunConfig.turns "all_turns" the prompt's earlier target turns are found in the row and
trained too (_mask_earlier). exactrows.py builds an export's last_turn exact rows in polars;
this module makes every other row.
"""

from __future__ import annotations

from kit.report.convo import (
    conversation,
    earlier_turns,
    find_ids,
    parsed,
    row_id,
    tools_of,
    with_tool_calls,
)
from kit.tokens import ids_spell, ids_spell_batch, render, strip_end_ids
from kit.types import STOPS

_MARK = "\ue000kit-answer\ue000"  # stands in for the answer to find where the template puts it


def end_of_turn(tok) -> tuple[int | None, str]:
    """(id of the special token that closes an assistant turn, its text) from the template."""
    mark = "\ue000kit\ue000"
    full = render(
        tok, [[{"role": "user", "content": "x"}, {"role": "assistant", "content": mark}]], False
    )[0]
    ids = tok.encode(full[full.index(mark) + len(mark) :], add_special_tokens=False)
    if ids and ids[0] in set(tok.all_special_ids):
        return ids[0], tok.convert_ids_to_tokens(ids[0])
    return None, ""


class _Encoding:
    """A tokenizer whose encode(text, add_special_tokens=False) answers from texts encoded
    ahead in one batch (kit.tokens.encode_many: every core), else encodes and remembers;
    everything else is the tokenizer's."""

    def __init__(self, tok) -> None:
        self._tok, self._ids = tok, {}

    def prefill(self, texts: list[str]) -> None:
        from kit.tokens import encode_many

        todo = list(dict.fromkeys(t for t in texts if t not in self._ids))
        self._ids.update(zip(todo, encode_many(self._tok, todo), strict=True))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        assert not add_special_tokens, "token rows never add special tokens"
        ids = self._ids.get(text)
        if ids is None:
            ids = self._ids[text] = self._tok.encode(text, add_special_tokens=False)
        return list(ids)

    def __getattr__(self, name: str):
        return getattr(self._tok, name)


def _count(d: dict, key: str, n: int = 1) -> None:
    d[key] = d.get(key, 0) + n


def token_rows(
    tok,
    rows: list[dict],
    stats: dict,
    by_dataset: dict | None = None,
    *,
    turns: str = "last_turn",
    kwargs_for=None,
) -> list[dict | None]:
    """{"id", "input_ids", "loss_mask", "ids_source"} per record (None when the template
    cannot split it); see _server_row and _text_row for how ids and the mask are built.

    Args:
        tok: the target's tokenizer.
        rows: records as dicts (rows of records_frame).
        stats: counts where ids came from: output_ids / completion_retokenized / prompt_ids /
            prompt_tokenized / skipped (updated in place).
        by_dataset: dataset -> counts (updated in place): exact, retokenized, skipped,
            ids_text_differ, prompt_render_differs, end_of_turn_appended, reasoning_not_rendered,
            tool_calls_not_rendered,
            earlier_turns_trained, earlier_turns_rendered, earlier_turns_fallback,
            earlier_turns_missing.
        turns: RunConfig.turns ("all_turns" trains the prompt's earlier assistant turns).
        kwargs_for: dataset -> chat_template_kwargs (None: none).

    Example (`tok` the SmolLM2 tokenizer: "Hello!" is 2 tokens, then <|im_end|> and "\n"):
        >>> r = {"dataset": "d", "prompt_id": "p1", "sample": 0, "completion": "Hello!",
        ...      "messages": [{"role": "user", "content": "Hi"}], "finish_reason": "stop",
        ...      "prompt_ids": None, "output_ids": None}
        >>> stats = {}
        >>> row = token_rows(tok, [r], stats)[0]
        >>> row["id"], row["loss_mask"][-4:], row["ids_source"], stats
        ('d-p1-0', [1, 1, 1, 0], 'retokenized', {'prompt_tokenized': 1, 'completion_retokenized': 1})
    """
    by_dataset = {} if by_dataset is None else by_dataset
    eot, _ = end_of_turn(tok)
    special = set(tok.all_special_ids)
    kw = [(kwargs_for(r["dataset"]) if kwargs_for else None) or {} for r in rows]
    tools = [tools_of(r) for r in rows]
    convs = [
        with_tool_calls(conversation(r["messages"], r["completion"], r.get("reasoning")), r)
        for r in rows
    ]
    prompts = render(
        tok, [c[:-1] for c in convs], True, on_error="skip", tools=tools, template_kwargs=kw
    )
    fulls = render(tok, convs, False, on_error="skip", tools=tools, template_kwargs=kw)
    tok = _Encoding(tok)  # the texts most rows encode, encoded in one batch
    texts = [r["completion"] for r in rows if not (r.get("prompt_ids") and r.get("output_ids"))]
    tok.prefill([p for p in prompts if p is not None] + texts)
    believed = _believed(tok, rows)
    out = []
    for i, r in enumerate(rows):
        ds = by_dataset.setdefault(r["dataset"], {})
        earlier = earlier_turns(r) if turns == "all_turns" else []
        row = None
        if r.get("prompt_ids") and r.get("output_ids") and not believed[i]:
            _count(ds, "ids_text_differ")
        elif r.get("prompt_ids") and r.get("output_ids"):
            row = _server_row(tok, r, prompts[i], earlier, eot, special, stats, ds)
        if row is None:
            ctx = (convs[i], prompts[i], fulls[i], tools[i], kw[i])
            row = _text_row(tok, r, ctx, earlier, eot, stats, ds)
        if row is None:
            _count(stats, "skipped")
            _count(ds, "skipped")
        out.append(row)
    return out


def _believed(tok, rows: list[dict]) -> list[bool]:
    """Per row: whether its output_ids may be the exact row (True without ids): counted by
    the server's ids at generation (count_source "server_ids", or no count_source) and
    spelling its text (kit.tokens.ids_spell)."""
    todo = [r for r in rows if r.get("output_ids")]
    cols = [[r.get(k) for r in todo] for k in ("completion", "reasoning", "tool_calls")]
    ends = [r["finish_reason"] for r in todo]
    spelled = iter(ids_spell_batch(tok, [list(r["output_ids"]) for r in todo], *cols, ends))
    return [
        not r.get("output_ids") or (next(spelled) and r.get("count_source") in (None, "server_ids"))
        for r in rows
    ]


def _server_row(tok, r, p_text, earlier, eot, special, stats, ds) -> dict | None:
    """The exact row: loss_mask 1 on output_ids, plus the template's end-of-turn id (trained:
    the model emitted it, the server left it out) after a "stop" whose ids do not end with a
    special id. The prompt rendered by kit that differs from prompt_ids is counted
    ("prompt_render_differs"); the server's ids stay the row. None when an earlier turn is
    not found in them."""
    p, o = list(r["prompt_ids"]), list(r["output_ids"])
    ids, mask = p + o, [0] * len(p) + [1] * len(o)
    appended = r["finish_reason"] in STOPS and eot is not None and o[-1] not in special
    if appended:
        ids, mask = ids + [eot], mask + [1]
    if earlier and not _mask_earlier(
        tok, ids, mask, len(p), earlier, eot, ds, "earlier_turns_fallback"
    ):
        return None
    _count(stats, "prompt_ids")
    _count(stats, "output_ids")
    _count(ds, "exact")
    if appended:
        _count(ds, "end_of_turn_appended")
    if p_text is None or tok.encode(p_text, add_special_tokens=False) != p:
        _count(ds, "prompt_render_differs")
    return {"id": row_id(r), "input_ids": ids, "loss_mask": mask, "ids_source": "server"}


def _mask_earlier(tok, ids, mask, start, earlier, eot, ds, failure: str) -> bool:
    """Mask 1 each earlier generated turn in ids, found by its server output_ids verbatim, else
    by its text's tokens (plus the end-of-turn after a "stop"); False (counted as `failure`:
    an exact row falls back to re-tokenizing, a re-tokenized one is skipped) when one is not
    found."""
    spans, rendered = _earlier_spans(tok, ids, start, earlier, eot)
    if spans is None:
        _count(ds, failure)
        return False
    _mark(mask, spans, rendered, ds)
    return True


def _text_row(tok, r, ctx, earlier, eot, stats, ds) -> dict | None:
    """The re-tokenized row: the prompt (the server's prompt_ids when they decode to kit's
    rendering, else it tokenized) + the assistant text as the template writes it (reasoning
    as `reasoning_content`: "reasoning_not_rendered" when the template drops it; the
    server's output_ids when they spell it) + the template's tail. loss_mask 1 on the
    assistant text, the tool calls the template renders ("tool_calls_not_rendered" when it
    does not) and, after a "stop", the end-of-turn (SpecForge's GeneralParser trains it:
    specforge/data/parse.py); the rest is 0. None when the template cannot be split."""
    conv, p_text, f_text, tools, kw = ctx
    if p_text is None or f_text is None:
        return None
    lead = _lead(tok, r, conv, p_text, f_text, tools, kw)
    head = p_text + (lead or "") + r["completion"]
    if lead is None or not f_text.startswith(head):
        return None
    p_ids = _pick(r.get("prompt_ids"), p_text, tok, stats, "prompt_ids")
    gen = strip_end_ids(tok, r["output_ids"]) if r.get("output_ids") else None
    c_ids = _pick(gen, lead + r["completion"], tok, stats, "output_ids", r["finish_reason"])
    tail = tok.encode(f_text[len(head) :], add_special_tokens=False)
    calls = _rendered_calls(r, f_text[len(head) :], tail, eot, ds)  # tail tokens that are calls
    closed = r["finish_reason"] in STOPS and eot is not None and tail[calls : calls + 1] == [eot]
    ids = p_ids + c_ids + tail
    mask = (
        [0] * len(p_ids)
        + [1] * len(c_ids)
        + [int(i < calls or (closed and i == calls)) for i in range(len(tail))]
    )
    if earlier and not _mask_earlier(
        tok, ids, mask, len(p_ids), earlier, eot, ds, "earlier_turns_missing"
    ):
        return None
    _count(ds, "retokenized")
    if r.get("reasoning") and r["reasoning"].strip() not in lead:
        _count(ds, "reasoning_not_rendered")
    return {"id": row_id(r), "input_ids": ids, "loss_mask": mask, "ids_source": "retokenized"}


def _rendered_calls(r, tail_text: str, tail: list[int], eot, ds) -> int:
    """How many tokens at the head of the tail are the record's tool calls as the template
    rendered them (those before its end-of-turn); 0, counted as tool_calls_not_rendered,
    when the template left a call out."""
    calls = parsed(r.get("tool_calls"))
    if not calls:
        return 0
    if not all(c["function"]["name"] in tail_text for c in calls) or eot not in tail:
        _count(ds, "tool_calls_not_rendered")
        return 0
    return tail.index(eot)


def _lead(tok, r, conv, p_text, f_text, tools, kw) -> str | None:
    """What the template writes between the prompt and the answer (the rendered reasoning,
    or "" for a plain answer); None when the template's rendering cannot be split there."""
    if not r.get("reasoning") and f_text.startswith(p_text + r["completion"]):
        return ""
    conv = conv[:-1] + [{**conv[-1], "content": _MARK}]
    marked = render(tok, [conv], False, on_error="skip", tools=[tools], template_kwargs=kw)[0]
    if marked is None or _MARK not in marked or not marked.startswith(p_text):
        return None
    return marked[len(p_text) : marked.index(_MARK)]


def _earlier_spans(tok, ids, limit, earlier, eot) -> tuple[list | None, bool]:
    """([(start, end)] of each earlier assistant turn inside ids[:limit], in order; None
    when one with text is not found) and whether any was found by its rendered text."""
    spans, cursor, rendered = [], 0, False
    for t in earlier:
        span = None
        if t["output_ids"]:
            s = find_ids(ids, list(t["output_ids"]), cursor, limit)
            span = None if s is None else (s, s + len(t["output_ids"]))
        if span is None and t["content"]:
            c = tok.encode(t["content"], add_special_tokens=False)
            s = find_ids(ids, c, cursor, limit)
            if s is not None:
                end = s + len(c)
                if t["finish_reason"] in STOPS and end < limit and ids[end] == eot:
                    end += 1
                span, rendered = (s, end), True
        if span is None:
            if t["content"]:
                return None, rendered
            continue  # an empty turn: nothing to train
        spans.append(span)
        cursor = span[1]
    return spans, rendered


def _mark(mask: list[int], spans: list, rendered: bool, ds: dict) -> None:
    for s, e in spans:
        mask[s:e] = [1] * (e - s)
    if spans:
        _count(ds, "earlier_turns_trained")
    if rendered:
        _count(ds, "earlier_turns_rendered")


def _pick(ids, text: str, tok, stats: dict, name: str, finish: str | None = None) -> list[int]:
    """The server's ids when they spell text (output ids: kit.tokens.ids_spell; prompt ids:
    decoded exactly), else text tokenized; counted in stats."""
    if name == "output_ids":
        ok = bool(ids) and ids_spell(tok, ids, text, finish_reason=finish)
    else:
        ok = bool(ids) and tok.decode(ids, skip_special_tokens=False) == text
    if ok:
        _count(stats, name)
        return list(ids)
    _count(stats, "completion_retokenized" if name == "output_ids" else "prompt_tokenized")
    return tok.encode(text, add_special_tokens=False)


def load_tokenizer_for(tokenizer, config=None):
    """The tokenizer given (object or local path), else the run's config.tokenizer, else None."""
    from kit.tokens import load_tokenizer

    return load_tokenizer(
        tokenizer if tokenizer is not None else getattr(config, "tokenizer", None)
    )
