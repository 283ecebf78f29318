"""What one record is in an export: its conversation, tools and earlier turns, and the
SpecForge JSONL lines and checks rendered from them by polars.

A row is one record as a dict (a row of kit.run.reader.record_batches with prompts): `tools`,
`turns` and `tool_calls` are JSON text (or lists, or null); `reasoning` is the thinking the
server's reasoning parser split off. The last assistant message carries it as
`reasoning_content` and the calls as `tool_calls` (OpenAI's shape), the fields SpecForge
0.2.0 reads (scripts/regenerate_train_data.py `--reasoning save` writes them so;
specforge/data/preprocessing.py passes a row's `tools` to the template); what its parsers
keep of them is in kit/report/trainers.py.
"""

from __future__ import annotations

import json

from kit.tokens import parsed


def row_id(r: dict) -> str:
    return f"{r['dataset']}-{r['prompt_id']}-{r['sample']}"


def conversation(messages, completion: str, reasoning: str | None = None) -> list[dict]:
    """The prompt's messages plus the completion as the last assistant turn, with its
    thinking as `reasoning_content` when there is any (SpecForge's field).

    Example:
        >>> conversation([{"role": "user", "content": "2+2?"}], "4", "add them")[-1]
        {'role': 'assistant', 'content': '4', 'reasoning_content': 'add them'}
    """
    prompt = [{"role": m["role"], "content": m["content"]} for m in messages]
    last = {"role": "assistant", "content": completion}
    if reasoning:
        last["reasoning_content"] = reasoning
    return prompt + [last]


def with_tool_calls(conv: list[dict], r: dict) -> list[dict]:
    """conv with the record's tool calls on its last (assistant) message, if it has any;
    conv itself is not changed.

    Example:
        >>> calls = [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]
        >>> with_tool_calls([{"role": "assistant", "content": ""}], {"tool_calls": calls})[-1]["tool_calls"][0]["function"]["name"]
        'f'
    """
    calls = parsed(r.get("tool_calls"))
    if not calls:
        return conv
    return conv[:-1] + [{**conv[-1], "tool_calls": calls}]


def tools_of(r: dict) -> list[dict] | None:
    """The record's tool definitions (None without)."""
    return parsed(r.get("tools")) or None


def earlier_turns(r: dict) -> list[dict]:
    """all_turns: each earlier assistant turn of the prompt, in order, as
    {"content", "finish_reason", "output_ids"} (ids and finish from Record.turns when it has
    one entry per assistant message, else None and "stop")."""
    contents = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
    turns = parsed(r.get("turns")) or []
    if len(turns) != len(contents):
        turns = [{}] * len(contents)
    return [
        {
            "content": c,
            "finish_reason": t.get("finish_reason") or "stop",
            "output_ids": t.get("output_ids") or None,
        }
        for c, t in zip(contents, turns, strict=True)
    ]


def find_ids(haystack: list[int], needle: list[int], start: int, stop: int) -> int | None:
    """First index >= start where needle occurs inside haystack[:stop] (None if nowhere).

    Example:
        >>> find_ids([5, 1, 2, 3, 1, 2], [1, 2], 2, 6)
        4
    """
    n = len(needle)
    if not n:
        return None
    first = needle[0]
    for i in range(start, stop - n + 1):
        if haystack[i] == first and haystack[i : i + n] == needle:
            return i
    return None


def json_text(expr):
    """A polars string expression as JSON text, exactly json.dumps(value, ensure_ascii=False)
    (null -> "null"): polars' JSON writer escapes strings as Python's json does."""
    import polars as pl

    return (
        pl.struct(expr.alias("v"))
        .struct.json_encode()
        .str.strip_prefix('{"v":')
        .str.strip_suffix("}")
    )


def messages_text():
    """The messages column as the SpecForge conversation's first part: each {role, content}
    as json.dumps writes it, joined by ", " ("" for none). Each message is encoded by
    polars, compact, then its two separators spaced: `{"role":"` and `","content":"` hold
    an unescaped quote after `{` or `,`, which no encoded string can hold."""
    import polars as pl

    compact, spaced = ['{"role":"', '","content":"'], ['{"role": "', '", "content": "']
    message = pl.element().struct.json_encode().str.replace_many(compact, spaced)
    return pl.col("messages").list.eval(message).list.join(", ").fill_null("")


def tools_json(texts) -> list[str | None]:
    """Stored tools or tool calls (JSON text, or null) as SpecForge writes them,
    json.dumps(value, ensure_ascii=False); None where there are none ("[]" is none). One
    parse per distinct text.

    Example:
        >>> tools_json(['[{"a":1}]', None, "[]"])
        ['[{"a": 1}]', None, None]
    """
    done: dict = {}
    for t in texts:
        if t not in done:
            done[t] = json.dumps(tools, ensure_ascii=False) if (tools := parsed(t)) else None
    return [done[t] for t in texts]


def specforge_lines(frame):
    """The SpecForge JSONL lines of a records frame (dataset, prompt_id, sample, messages,
    completion, reasoning, and `tools_json`: tools_json() of its tools, null where none;
    optionally `tool_calls_json`: tools_json() of its tool calls), rendered by polars, each
    with its newline: exactly json.dumps(row, ensure_ascii=False) of row = {"id": row_id,
    "conversations": with_tool_calls(conversation(...))} plus "tools" when it has any.

    Example: specforge_lines(frame)[0] -> '{"id": "alpaca-9f2c-0", "conversations": [...]}\\n'
    """
    import polars as pl

    c = pl.col
    prompt = messages_text()
    reasoning = pl.when(c("reasoning").fill_null("") != "")
    calls = c("tool_calls_json") if "tool_calls_json" in frame.columns else pl.lit(None, pl.String)
    last = pl.concat_str(
        pl.lit('{"role": "assistant", "content": '),
        json_text(c("completion")),
        reasoning.then(
            pl.concat_str(pl.lit(', "reasoning_content": '), json_text(c("reasoning")))
        ).otherwise(pl.lit("")),
        pl.when(calls.is_not_null())
        .then(pl.concat_str(pl.lit(', "tool_calls": '), calls))
        .otherwise(pl.lit("")),
        pl.lit("}"),
    )
    sep = pl.when(prompt != "").then(pl.lit(", ")).otherwise(pl.lit(""))
    tools = c("tools_json")
    line = pl.concat_str(
        pl.lit('{"id": '),
        json_text(row_ids()),
        pl.lit(', "conversations": ['),
        prompt,
        sep,
        last,
        pl.lit("]"),
        pl.when(tools.is_not_null())
        .then(pl.concat_str(pl.lit(', "tools": '), tools))
        .otherwise(pl.lit("")),
        pl.lit("}\n"),
    )
    return frame.select(line.alias("line")).to_series()


def conversation_problems(frame) -> list[str]:
    """What breaks kit.validate's SpecForge rules (kit.report.checks) in the frame
    specforge_lines renders, one line per rule naming its first row (first_breaks):
    the id, the last assistant turn, reasoning_content and the JSON of tools and tool calls
    are made so by specforge_lines and tools_json; the prompt's messages are checked here."""
    import polars as pl

    from kit.report.checks import ROLES

    e = pl.element()
    roles = pl.col("messages").list.eval(e.struct.field("role"))
    contents = pl.col("messages").list.eval(e.struct.field("content").is_null()).list.any()
    return first_breaks(
        frame,
        {
            f"a message's role is not one of {ROLES}": roles.list.eval(~e.is_in(ROLES)).list.any(),
            "a message's content is not a string": contents | pl.col("completion").is_null(),
            "a system message after the first turn": roles.list.eval(
                (e == "system") & (pl.int_range(pl.len()) > 0)
            ).list.any(),
            "'tools' must be a list of tool definitions (dicts)": _breaks(
                frame, "tools_json", _bad_tools
            ),
            "tool_calls must be a non-empty list of tool calls": _breaks(
                frame, "tool_calls_json", _bad_calls
            ),
        },
    )


def _breaks(frame, column: str, bad):
    """Rows whose JSON text in `column` breaks the rule `bad`, each distinct text parsed once."""
    import polars as pl

    texts = frame[column].drop_nulls().unique().to_list()
    return pl.col(column).is_in([t for t in texts if bad(t)]).fill_null(False)


def _bad_tools(text: str) -> bool:
    tools = json.loads(text)
    return not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools))


def _bad_calls(text: str) -> bool:
    calls = json.loads(text)
    return not (
        isinstance(calls, list)
        and calls
        and all(isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls)
    )


def row_ids():
    """row_id() as a polars expression over dataset, prompt_id, sample."""
    import polars as pl

    return pl.concat_str(
        pl.col("dataset"), pl.col("prompt_id"), pl.col("sample").cast(pl.String), separator="-"
    )


def rendered(lines) -> tuple[memoryview, list[int]]:
    """A polars String Series -> (its values' bytes, joined, as a memoryview of the Arrow
    buffer; the offsets of each value): one copy, from polars' string views to Arrow's
    large_string, none per line."""
    import numpy as np
    import polars as pl

    arr = lines.rechunk().to_arrow(compat_level=pl.CompatLevel.oldest())  # large_string
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int64)[
        arr.offset : arr.offset + len(arr) + 1
    ]
    start, end = int(offsets[0]), int(offsets[-1])
    data = arr.buffers()[2]
    view = memoryview(data.slice(start, end - start) if data is not None else b"").cast("B")
    return view, (offsets - start).tolist()


def cut_rows():
    """Rows ending a generated turn at max_tokens: the answer (finish `length`) or, with
    all_turns, an earlier turn (Record.turns). A trainer reading their conversation trains
    an end-of-turn after the cut text, which the model never emitted."""
    import polars as pl

    turns = pl.col("turns").fill_null("").replace("", "[]")
    finishes = turns.str.json_decode(pl.List(pl.Struct({"finish_reason": pl.String})))
    earlier = finishes.list.eval(pl.element().struct.field("finish_reason") == "length").list.any()
    return (pl.col("finish_reason") == "length") | earlier.fill_null(False)


def first_breaks(frame, rules: dict) -> list[str]:
    """For each rule (what it says -> a polars expression, True or null where a row breaks
    it): "row <id>: what" of its first row that breaks it, and how many do."""
    import polars as pl

    breaks = [e.fill_null(True).alias(f"r{i}") for i, e in enumerate(rules.values())]
    if not frame.select(pl.any_horizontal(b.any() for b in breaks)).item():
        return []  # the common case: no row breaks a rule, no id is made
    found = frame.select(row_ids().alias("id"), *breaks)
    out = []
    for i, what in enumerate(rules):
        bad = found.filter(pl.col(f"r{i}"))
        if bad.height:
            out.append(
                f"row {bad['id'][0]}: {what}"
                + (f" (and {bad.height - 1} more rows)" if bad.height > 1 else "")
            )
    return out
