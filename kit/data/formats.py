"""Per-format row parsers behind kit.load: which format a source is, and its rows' prompts.

    sharegpt          {"conversations": [{"from": "human"|"gpt"|"system", "value": str}, ...]}
    openai            {"messages": [{"role": ..., "content": str}, ...]}
    ultrachat         {"data": [user, assistant, user, ...]}  (alternating strings)
    alpaca            {"instruction", "input"} -> instruction + "\n\n" + input, or
                      {"instruction", "instances": [{"input"}, ...]}: a prompt per instance;
                      dolly's {"instruction", "context"}: context read as the input
    magicoder         {"problem": str} or {"instruction": str}
    opencodeinstruct  {"input": str}
    turns             {"turns": [user turn, ...]} (MT-bench; runs with turns="all_turns")
    transcript        a text column of "\n\nHuman: ... \n\nAssistant: ..." (hh-rlhf's
                      `chosen`): detected by its text, or mapping={"transcript": column}
    mapping           mapping={"prompt": column, "system": column} or {"messages": column}

A valid prompt: at most one system turn, first, then user/assistant alternating from user;
a prompt field the format does not read that holds a value is a conflicting_fields skip.
A column of message lists ([[{role, content}, ...], ...], BFCL's `question`) is read as
its first list (Nested counts the rest). The dataset's own answer is the assistant turn
right after the prompt's last user turn: a conversation's next turn, a transcript's last
Assistant turn, or the ANSWERS column of a single-prompt format (mapping "answer").
"""

from __future__ import annotations

import re

import polars as pl

from kit.data.tools import tool_turn
from kit.errors import Skip, Undetectable

FORMATS = ("sharegpt", "openai", "ultrachat", "alpaca", "magicoder", "opencodeinstruct", "turns")
FORMATS += ("transcript", "mapping")
DETECT_ROWS = 200  # rows whose keys decide the format
_ROLES = {"user": "user", "human": "user", "system": "system"}  # a turn's role -> kit's
_ROLES |= dict.fromkeys(("assistant", "gpt", "chatgpt", "model", "bot"), "assistant")


def columns(rows: list | pl.DataFrame) -> list[str]:
    """Keys with a non-null value in the first DETECT_ROWS object rows."""
    if isinstance(rows, pl.DataFrame):
        head = rows.head(DETECT_ROWS)
        return [c for c in head.columns if head.height == 0 or head[c].null_count() < head.height]
    keys: dict[str, None] = {}
    for row in [r for r in rows if isinstance(r, dict)][:DETECT_ROWS]:
        keys.update((k, None) for k, v in row.items() if v is not None)
    return list(keys)


def detect(rows: list | pl.DataFrame, label: str) -> str | None:
    """Pick the format from the columns found; raise Undetectable naming the source and its
    columns. None when no row has a column with a value (every row is skipped by reason).

    Example:
        >>> detect([{"instruction": "Name a colour.", "input": ""}], "tasks.jsonl")
        'alpaca'
        >>> detect([{"instruction": "Name a colour.", "instances": [{"input": ""}]}], "seed.jsonl")
        'alpaca'
    """
    cols = set(columns(rows))
    if not cols:
        return None
    for fmt, needs in (
        ("sharegpt", {"conversations"}),
        ("openai", {"messages"}),
        ("ultrachat", {"data"}),
        ("alpaca", {"instruction", "input"}),
        ("alpaca", {"instruction", "context"}),  # databricks-dolly-15k
        ("alpaca", {"instruction", "instances"}),  # self-instruct seed tasks
        ("magicoder", {"problem"}),
        ("magicoder", {"instruction"}),
        ("opencodeinstruct", {"input"}),
        ("turns", {"turns"}),  # MT-bench: user turns only
    ):
        if needs <= cols:
            return fmt
    if transcript_column(rows) is not None:
        return "transcript"
    raise Undetectable(label, sorted(cols), FORMATS, _advice(rows))


_HUMAN = re.compile(r"(?:\A|\n\n)Human:")
_TRANSCRIPT_TURN = re.compile(r"(?:\A|\n\n)(Human|Assistant): ?")


def _is_transcript(value) -> bool:
    return isinstance(value, str) and bool(_HUMAN.search(value)) and "\n\nAssistant:" in value


def _head(rows) -> list[dict]:
    if isinstance(rows, pl.DataFrame):
        return rows.head(DETECT_ROWS).to_dicts()
    return [r for r in rows if isinstance(r, dict)][:DETECT_ROWS]


def transcript_column(rows) -> str | None:
    """The column of Human:/Assistant: transcripts in the first DETECT_ROWS rows (most of its
    texts are ones): `chosen` first (hh-rlhf's preferred answer), else the first found."""
    texts: dict[str, list[bool]] = {}
    for row in _head(rows):
        for k, v in row.items():
            if isinstance(v, str) and v.strip():
                texts.setdefault(k, []).append(_is_transcript(v))
    found = [k for k, flags in texts.items() if 2 * sum(flags) > len(flags)]
    return "chosen" if "chosen" in found else next(iter(found), None)


def _advice(rows) -> str:
    """How to load an undetected source: its message-list columns as messages, else its text
    columns as the prompt (a transcript column is never offered as one turn)."""
    lists, texts, transcripts = [], [], set()
    for row in _head(rows):
        for k, v in row.items():
            if isinstance(v, list) and v and isinstance(v[0], (dict, list)) and k not in lists:
                lists.append(k)
            elif isinstance(v, str) and v.strip() and k not in texts:
                texts.append(k)
            if _is_transcript(v):
                transcripts.add(k)
    texts = [k for k in texts if k not in transcripts]
    if lists:
        return f"mapping={{'messages': {lists[0]!r}}} (a column of message lists)"
    text = f"<one of {texts}>" if texts else "<column>"
    advice = f"mapping={{'prompt': {text}}} (add 'answer': <column> for the dataset's own answer)"
    if transcripts:
        advice += f", or mapping={{'transcript': <one of {sorted(transcripts)}>}} (Human:/Assistant: text)"
    return advice


_PROMPT_FIELDS = ("instruction", "input", "context", "instances", "problem")  # single-prompt
_READS = {  # single-prompt format -> the prompt fields it reads (others must be empty)
    "alpaca": {"instruction", "input", "context", "instances"},
    "magicoder": {"problem", "instruction"},
    "opencodeinstruct": {"input"},
}
ANSWERS = {  # single-prompt format -> its answer columns (the first holding text is used)
    "alpaca": ("output", "response"),  # alpaca, CodeAlpaca; dolly's response
    "magicoder": ("solution", "response"),  # OSS-Instruct; Evol-Instruct
    "opencodeinstruct": ("output",),
}
_FIELDS = {  # format -> the columns its rows are read from (and checked)
    "sharegpt": ["conversations"],
    "openai": ["messages"],
    "ultrachat": ["data"],
    "turns": ["turns"],
    **{f: [*_PROMPT_FIELDS, *a] for f, a in ANSWERS.items()},
}


def read_columns(fmt: str | None, mapping: dict | None) -> list[str]:
    """The columns a format reads into a prompt or its answer (tools included)."""
    cols = list((mapping or {}).values()) if fmt in ("mapping", "transcript") else _FIELDS[fmt]
    return [*cols, "tools", "functions"]


def frame_rows(df: pl.DataFrame, fmt: str, mapping: dict | None) -> list[dict]:
    """Rows of a columnar source: only the needed columns, turn lists cut after the turn that
    follows the last user turn (the answer)."""
    if fmt is None:
        return df.to_dicts()
    wanted = read_columns(fmt, mapping)
    df = df.select([c for c in df.columns if c in wanted])
    trims = [_trim_turns(c, df.schema[c]) for c in df.columns]
    return df.with_columns([t for t in trims if t is not None]).to_dicts()


def _trim_turns(col: str, dtype) -> pl.Expr | None:
    """Drop turns after the last user turn in polars (they are never read; saves converting them)."""
    if not (isinstance(dtype, pl.List) and isinstance(dtype.inner, pl.Struct)):
        return None
    fields = {f.name: f.dtype for f in dtype.inner.fields}
    keys = [k for k in ("from", "role") if fields.get(k) == pl.String]
    if not keys:
        return None
    role = pl.coalesce([pl.element().struct.field(k) for k in keys]).str.to_lowercase()
    user_at_or_after = role.is_in(["user", "human"]).reverse().cum_sum().reverse() > 0
    keep = user_at_or_after | user_at_or_after.shift(1).fill_null(False)  # and the answer
    cut = pl.col(col).list.eval(pl.element().filter(keep))
    return pl.when(cut.list.len() > 0).then(cut).otherwise(pl.col(col)).alias(col)


def _field(row: dict, key: str):
    """row[key], or a missing_field skip when absent or null."""
    value = row.get(key)
    if value is None:
        raise Skip("missing_field", f"no {key!r}")
    return value


def _list(row: dict, key: str) -> list:
    """row[key] as a list, or a skip (missing_field, bad_type)."""
    value = _field(row, key)
    if not isinstance(value, list):
        raise Skip("bad_type", f"{key!r} is a {type(value).__name__}, not a list")
    return value


def _turn(obj) -> tuple:
    """One turn object (role/content or from/value) -> (role, content); a problem is a Skip in its slot.

    The role stays readable when only the content is broken, so the last user turn is found
    by role alone: a broken last user turn skips the row instead of cutting before it. A tool
    call or tool result turn has a tool_turns Skip as its role.
    """
    if not isinstance(obj, dict):
        return (Skip("bad_type", f"turn is a {type(obj).__name__}, not an object"), None)
    from_value = obj.get("from") is not None  # ShareGPT's keys
    role_key, content_key = ("from", "value") if from_value else ("role", "content")
    raw, content = obj.get(role_key), obj.get(content_key)
    role = _ROLES.get(raw.lower()) if isinstance(raw, str) else None
    if (role is None or len(obj) > 2) and (skip := tool_turn(obj, raw)) is not None:
        role = skip  # a tool call or result: kit.data.tools says why it is a skip
    elif role is None:
        missing = Skip("missing_field", "turn without a role")
        role = missing if raw is None else Skip("bad_role", f"role {raw!r}")
    if content is None:
        content = Skip("missing_field", f"turn without {content_key!r}")
    return (role, content)


class Nested(list):
    """The turns of a column of message lists: its first list; `rest` lists not read."""

    rest = 0


def _turn_list(row: dict, key: str) -> list:
    """A conversation field -> list of (role, content) per turn; a list of message lists
    (BFCL's `question`) is its first list, a Nested counting the others."""
    value = _list(row, key)
    if not (value and all(isinstance(t, list) for t in value)):
        return [_turn(t) for t in value]
    turns = Nested(_turn(t) for t in value[0])
    turns.rest = len(value) - 1
    return turns


def _single(row: dict, prompt_key: str, system_key: str | None = None, answers=()) -> list:
    """A single-prompt row -> [(system)?, (user, prompt), (assistant, answer)?]; a blank or
    null system is no system; the answer: the first of `answers` holding text."""
    turns = [("user", _field(row, prompt_key)), *_answer_turn(row, answers)]
    return _system(row, system_key, turns)


def _answer_turn(row: dict, keys) -> list:
    """[(assistant, text)] of the first column of `keys` holding text, else []."""
    value = next((v for k in keys if isinstance(v := row.get(k), str) and v.strip()), None)
    return [] if value is None else [("assistant", value)]


def _system(row: dict, key: str | None, turns: list) -> list:
    """turns with the optional system column as a leading turn, unless absent, null or blank
    (inserted in place: a Nested stays one)."""
    value = row.get(key) if key else None
    if not (value is None or (isinstance(value, str) and not value.strip())):
        turns.insert(0, ("system", value))
    return turns


def _transcript(row: dict, key: str) -> list:
    r"""A "\n\nHuman: ... \n\nAssistant: ..." text -> [(role, text), ...]; text before its
    first turn is a bad_role skip.

    Example:
        >>> _transcript({"chosen": "\n\nHuman: Hi\n\nAssistant: Hello"}, "chosen")
        [('user', 'Hi'), ('assistant', 'Hello')]
    """
    text = _field(row, key)
    if not isinstance(text, str):
        raise Skip("non_string_content", f"{key!r} is a {type(text).__name__}, not a string")
    head, *parts = _TRANSCRIPT_TURN.split(text)
    if head.strip() or not parts:
        raise Skip("bad_role", f"{key!r}: text before its first 'Human:' or 'Assistant:' turn")
    role = {"Human": "user", "Assistant": "assistant"}
    return [(role[parts[i]], parts[i + 1]) for i in range(0, len(parts), 2)]


def _alpaca(row: dict) -> list:
    """instruction + "\\n\\n" + input (input optional) -> [turns]; a seed-task row
    ({instruction, instances: [{input, output}]}) gives one prompt per instance, a broken
    instance a Skip in its place, no instance the instruction alone."""
    instruction = _field(row, "instruction")
    if not isinstance(instruction, str):
        raise Skip("non_string_content", f"'instruction' is a {type(instruction).__name__}")
    instances = row.get("instances")
    key = "context" if _holds(row.get("context")) else "input"  # dolly's name for the input
    if key == "context" and _holds(row.get("input")):
        raise Skip("conflicting_fields", "both 'input' and 'context' hold a value: keep one")
    if instances is None:
        answer = _answer_turn(row, ANSWERS["alpaca"])
        return [_joined(instruction, row.get(key), f"{key!r}") + answer]
    if row.get(key) is not None:
        raise Skip("conflicting_fields", f"both {key!r} and 'instances' hold a value: keep one")
    prompts = [_instance(instruction, x, k) for k, x in enumerate(_list(row, "instances"))]
    return prompts or [[("user", instruction)]]


def _holds(value) -> bool:
    """A field holds a value: not null, not a blank string."""
    return value is not None and not (isinstance(value, str) and not value.strip())


def _instance(instruction: str, instance, k: int) -> list | Skip:
    """One seed-task instance -> its turns, or the Skip saying why it cannot be a prompt."""
    if not isinstance(instance, dict):
        return Skip("bad_type", f"instance {k} is a {type(instance).__name__}, not an object")
    try:
        turns = _joined(instruction, instance.get("input"), f"instance {k} 'input'")
        return turns + _answer_turn(instance, ("output",))
    except Skip as skip:
        return skip


def _joined(instruction: str, extra, where: str) -> list:
    """[(user, instruction + "\\n\\n" + extra)], or the instruction alone for a blank extra."""
    if extra is not None and not isinstance(extra, str):
        raise Skip("non_string_content", f"{where} is a {type(extra).__name__}, not a string")
    if extra and extra.strip():
        instruction = instruction.strip() + "\n\n" + extra.strip()
    return [("user", instruction)]


def _magicoder(row: dict) -> list:
    """problem (OSS-Instruct) or instruction (Evol-Instruct); a row with both is ambiguous."""
    if row.get("problem") is not None and row.get("instruction") is not None:
        raise Skip("conflicting_fields", "both 'problem' and 'instruction' hold a value: keep one")
    key = "problem" if row.get("problem") is not None else "instruction"
    return _single(row, key, answers=ANSWERS["magicoder"])


def _unread(row: dict, fmt: str) -> None:
    """A prompt field the format does not read, holding a value: a skip, never dropped unsaid."""
    if extra := [k for k in _PROMPT_FIELDS if k not in _READS[fmt] and _holds(row.get(k))]:
        raise Skip(
            "conflicting_fields",
            f"{extra[0]!r} holds a value the {fmt} format does not read (load with mapping=)",
        )


def _ultrachat(row: dict) -> list:
    """data: [user, assistant, user, ...] -> turns."""
    return [("user" if i % 2 == 0 else "assistant", t) for i, t in enumerate(_list(row, "data"))]


def _user_turns(row: dict, key: str) -> list:
    """A list of user turns (MT-bench `turns`: ["first question", "second question"]) ->
    [(user, text), ...]; an element that is a turn object is read as one."""
    return [_turn(t) if isinstance(t, dict) else ("user", t) for t in _list(row, key)]


def user_runs(fmt: str | None, mapping: dict | None) -> bool:
    """True when the format's prompts are user turns the target answers in turn (no
    assistant turns between them): the turns format or mapping={"turns": column}."""
    return fmt == "turns" or (fmt == "mapping" and "turns" in (mapping or {}))


def raw_prompts(row: dict, fmt: str, mapping: dict | None) -> list:
    """Row -> the raw turn lists of its prompts: one, or one per instance of an Alpaca seed
    task (a broken instance is a Skip in its place). A broken row raises Skip.

    Example:
        >>> row = {"instruction": "Classify.", "instances": [{"input": "a"}, {"input": "b"}]}
        >>> raw_prompts(row, "alpaca", None)
        [[('user', 'Classify.\\n\\na')], [('user', 'Classify.\\n\\nb')]]
    """
    if fmt in _READS:
        _unread(row, fmt)
    if fmt == "alpaca":
        return _alpaca(row)
    return [_raw_turns(row, fmt, mapping)]


def _raw_turns(row: dict, fmt: str, mapping: dict | None) -> list:
    """Row -> [(role, content), ...] (either may be a Skip) before the prompt is cut and checked.
    Alpaca rows may hold several prompts: raw_prompts() reads them.

    Example:
        >>> _raw_turns({"data": ["Hi", "Hello!", "Bye"]}, "ultrachat", None)
        [('user', 'Hi'), ('assistant', 'Hello!'), ('user', 'Bye')]
    """
    if fmt == "sharegpt":
        return _turn_list(row, "conversations")
    if fmt == "openai":
        return _turn_list(row, "messages")
    if fmt == "ultrachat":
        return _ultrachat(row)
    if fmt == "magicoder":
        return _magicoder(row)
    if fmt == "opencodeinstruct":
        return _single(row, "input", answers=ANSWERS["opencodeinstruct"])
    if fmt == "turns":
        return _user_turns(row, "turns")
    system = mapping.get("system")
    if "transcript" in mapping:
        return _system(row, system, _transcript(row, mapping["transcript"]))
    if "turns" in mapping:
        return _system(row, system, _user_turns(row, mapping["turns"]))
    if "messages" in mapping:
        return _system(row, system, _turn_list(row, mapping["messages"]))
    answer = (mapping["answer"],) if "answer" in mapping else ()
    return _single(row, mapping["prompt"], system, answer)


def prompt(turns: list, *, strip: bool = False, user_runs: bool = False) -> list[dict]:
    """Raw turns -> the prompt: cut at the last user turn, check what is kept (a Skip says
    why not), return the messages with their content as given (str.strip()-ed with strip).

    user_runs: user turns may follow each other (a list of user turns, each answered by the
    target in turn with RunConfig.turns "all_turns").

    Example:
        >>> prompt([("user", " Hi "), ("assistant", "Hello!")])
        [{'role': 'user', 'content': ' Hi '}]
        >>> prompt([("user", " Hi ")], strip=True)
        [{'role': 'user', 'content': 'Hi'}]
    """
    last = next((i for i in range(len(turns) - 1, -1, -1) if turns[i][0] == "user"), -1)
    if last < 0:
        raise next((t[0] for t in turns if isinstance(t[0], Skip)), Skip("no_user_turn"))
    messages = []
    for i, (role, content) in enumerate(turns[: last + 1]):
        for part in (role, content):
            if isinstance(part, Skip):
                raise Skip(part.reason, f"turn {i}: {part.detail}")
        if not isinstance(content, str):
            raise Skip("non_string_content", f"turn {i} content is a {type(content).__name__}")
        if not content.strip():
            raise Skip("empty_content", f"turn {i} ({role}) is empty")
        messages.append({"role": role, "content": content.strip() if strip else content})
    _check_order([m["role"] for m in messages], user_runs)
    return messages


def answer(turns: list) -> str | None:
    """The dataset's own answer to the prompt of raw turns: the text of the assistant turn
    right after the last user turn, else None.

    Example:
        >>> answer([("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye")]) is None
        True
    """
    last = next((i for i in range(len(turns) - 1, -1, -1) if turns[i][0] == "user"), -1)
    if last < 0 or last + 1 >= len(turns) or turns[last + 1][0] != "assistant":
        return None
    text = turns[last + 1][1]
    return text if isinstance(text, str) and text.strip() else None


def _check_order(roles: list[str], user_runs: bool = False) -> None:
    """One optional system turn first, then user/assistant alternating from user (with
    user_runs, a user turn may also follow a user turn)."""
    body = roles[1:] if roles[0] == "system" else roles
    expected = "user"
    for i, role in enumerate(body):
        if role != expected and not (user_runs and role == "user" and i and body[i - 1] == "user"):
            raise Skip(
                "bad_order", f"{role} at turn {i + len(roles) - len(body)}, {expected} expected"
            )
        expected = "assistant" if role == "user" else "user"
