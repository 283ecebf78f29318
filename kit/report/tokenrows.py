"""Token ids of records: rows with loss masks for training, and checks of ids and counts.

Rows: the chat template applied to prompt + completion.

input_ids = the prompt (the server's prompt_ids when they decode to the rendered prompt,
else the rendered prompt tokenized) + the completion (the target's own output_ids, without
a trailing end-of-turn / EOS, when they decode to the stored text, else the text
tokenized) + the template's tail after the completion (SmolLM2: "<|im_end|>\\n").

loss_mask is 1 exactly on the completion tokens, plus the end-of-turn token when the model
emitted it (finish_reason "stop"): the target generated it, and SpecForge's GeneralParser
(sgl-project/SpecForge specforge/data/parse.py) also counts end_of_turn_token inside the
assistant span. After a "length" finish the model never closed the turn, so the template's
end-of-turn token stays 0; text after it (the "\\n") is template, never generated: 0.

Checks (kit.report.audit's flag columns): whether output_ids decode to the stored text, and
whether a server's completion_tokens is far below the text's own (re-tokenized) count.
"""

from __future__ import annotations


def conversation(messages, completion: str) -> list[dict]:
    prompt = [{"role": m["role"], "content": m["content"]} for m in messages]
    return prompt + [{"role": "assistant", "content": completion}]


def row_id(r: dict) -> str:
    return f"{r['dataset']}-{r['prompt_id']}-{r['sample']}"


def end_of_turn(tok) -> tuple[int | None, str]:
    """(id of the special token that closes an assistant turn, its text) from the template."""
    from kit.tokens import render

    mark = "\ue000kit\ue000"
    full = render(tok, [[{"role": "user", "content": "x"}, {"role": "assistant", "content": mark}]], False)[0]  # fmt: skip
    ids = tok.encode(full[full.index(mark) + len(mark) :], add_special_tokens=False)
    if ids and ids[0] in set(tok.all_special_ids):
        return ids[0], tok.convert_ids_to_tokens(ids[0])
    return None, ""


def token_rows(tok, rows: list[dict], stats: dict) -> list[dict | None]:
    """{"id", "input_ids", "loss_mask"} per record (None when the template cannot split it).

    See the module docstring for how ids and the mask are built. `stats` counts where ids came
    from: output_ids / completion_retokenized / prompt_ids / prompt_tokenized / skipped.

    Example (`tok` the SmolLM2 tokenizer: "Hello!" is 2 tokens, then <|im_end|> and "\n"):
        >>> r = {"dataset": "d", "prompt_id": "p1", "sample": 0, "completion": "Hello!",
        ...      "messages": [{"role": "user", "content": "Hi"}], "finish_reason": "stop",
        ...      "prompt_ids": None, "output_ids": None}
        >>> stats = {}
        >>> row = token_rows(tok, [r], stats)[0]
        >>> row["id"], row["loss_mask"][-4:], stats
        ('d-p1-0', [1, 1, 1, 0], {'prompt_tokenized': 1, 'completion_retokenized': 1})
    """
    from kit.tokens import render

    eot, _ = end_of_turn(tok)
    convs = [conversation(r["messages"], r["completion"]) for r in rows]
    prompts = render(tok, [c[:-1] for c in convs], True, on_error="skip")
    fulls = render(tok, convs, False, on_error="skip")
    out = []
    for r, p_text, f_text in zip(rows, prompts, fulls, strict=True):
        head = (p_text or "") + r["completion"]
        if p_text is None or f_text is None or not f_text.startswith(head):
            stats["skipped"] = stats.get("skipped", 0) + 1
            out.append(None)
            continue
        p_ids = _pick(r["prompt_ids"], p_text, tok, stats, "prompt_ids")
        gen = strip_end_ids(tok, r["output_ids"]) if r["output_ids"] else None
        c_ids = _pick(gen, r["completion"], tok, stats, "output_ids")
        tail = tok.encode(f_text[len(head) :], add_special_tokens=False)
        closed = r["finish_reason"] == "stop" and eot is not None and tail[:1] == [eot]
        mask = (
            [0] * len(p_ids) + [1] * len(c_ids) + [int(closed and i == 0) for i in range(len(tail))]
        )
        out.append({"id": row_id(r), "input_ids": p_ids + c_ids + tail, "loss_mask": mask})
    return out


def _pick(ids, text: str, tok, stats: dict, name: str) -> list[int]:
    """The server's ids when they decode to text, else text tokenized; counted in stats."""
    if ids and tok.decode(ids, skip_special_tokens=False) == text:
        stats[name] = stats.get(name, 0) + 1
        return list(ids)
    key = "completion_retokenized" if name == "output_ids" else "prompt_tokenized"
    stats[key] = stats.get(key, 0) + 1
    return tok.encode(text, add_special_tokens=False)


def load_tokenizer_for(tokenizer, config=None):
    """The tokenizer given (object or local path), else the run's config.tokenizer, else None."""
    from kit.tokens import load_tokenizer

    return load_tokenizer(
        tokenizer if tokenizer is not None else getattr(config, "tokenizer", None)
    )


def strip_end_ids(tokenizer, ids: list[int]) -> list[int]:
    """Drop trailing special ids (the EOS / end-of-turn a server may include in output ids)."""
    special = set(tokenizer.all_special_ids)
    end = len(ids)
    while end and ids[end - 1] in special:
        end -= 1
    return list(ids[:end])


def ids_match_text(tokenizer, ids: list[int], text: str) -> bool:
    """True when the ids decode to the text (a trailing EOS / end-of-turn is allowed)."""
    if tokenizer.decode(strip_end_ids(tokenizer, ids), skip_special_tokens=False) == text:
        return True
    return tokenizer.decode(ids, skip_special_tokens=True) == text


def ids_text_flags(recs, tokenizer):
    """ids_text_mismatch as a Series: null where there are no ids or no tokenizer."""
    import polars as pl

    values = [None] * recs.height
    if tokenizer is not None:
        pairs = zip(recs["output_ids"].to_list(), recs["completion"].to_list(), strict=True)
        for i, (ids, text) in enumerate(pairs):
            if ids is not None:
                values[i] = not ids_match_text(tokenizer, ids, text)
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
