"""What kit believes of a server's answer: its status, its body, its token counts.

Every check raises a kit.errors.BackendError (its text redacted by kit.secrets). Counts
are checked, never trusted: a count must be a plain int in 0..max_tokens + 1 (a server may count the end token), not 0 for a non-empty answer, equal
to the number of ids when the server gives both; with a tokenizer the ids must spell the
text (kit.tokens.ids_spell; else the count is re-tokenized, count_source "retokenized") and a usage count far
below the re-tokenized text is `malformed` (an under-reporting server, or the wrong
tokenizer). `message_parts` reads the answer, the thinking (`reasoning` or
`reasoning_content`) and `tool_calls_of` the tool calls; counts cover all three.
"""

from __future__ import annotations

import email.utils
import json
import time
from typing import Any

import orjson

from kit.errors import HTTPStatusError, MalformedAnswer
from kit.types import Sampling

BODY_CHARS = 2000  # of a server's body kept in a message before redaction (then cut shorter)


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header: "2" -> 2.0, an HTTP date -> seconds from now."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


def status_error(status: int, text: str, retry_after: str | None, url: str) -> HTTPStatusError:
    """The error for an HTTP error status (a 429's Retry-After in seconds)."""
    msg = f"HTTP {status} from {url}: {text[:BODY_CHARS]}"
    after = parse_retry_after(retry_after) if status == 429 else None
    return HTTPStatusError(msg, status=status, retry_after=after)


def normalize_finish(reason: Any) -> str:
    """Normalize a finish reason: SGLang's {"type": "length", ...} -> "length"; None ->
    "unknown"; any other kept as sent ("tool_calls" too: a stop for the budget, the audit and
    the export, kit.types.STOPS).

    Example:
        >>> normalize_finish({"type": "length", "length": 9}), normalize_finish("tool_calls")
        ('length', 'tool_calls')
    """
    if isinstance(reason, dict):
        reason = reason.get("type")
    return str(reason)[:64] if reason else "unknown"


def parse_body(raw: bytes, url: str, stream: bool) -> dict:
    """The JSON object of a 200 answer; `malformed` for an event stream, bad JSON, a non-object
    or an error body without an answer."""
    if stream or raw.lstrip().startswith(b"data:"):
        msg = f"an event stream (SSE) from {url}, not one JSON answer: kit needs a "
        raise MalformedAnswer(msg + "non-streaming endpoint (stream=false)")
    text = raw[:BODY_CHARS].decode("utf-8", "replace")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise MalformedAnswer(f"bad JSON from {url}: {text}") from None
    if not isinstance(data, dict):
        raise MalformedAnswer(f"expected a JSON object from {url}, got {text}")
    if "error" in data and not any(k in data for k in ("choices", "text", "meta_info")):
        error = orjson.dumps(data["error"])[:BODY_CHARS].decode("utf-8", "replace")
        raise MalformedAnswer(f"HTTP 200 with an error from {url}: {error}")
    return data


def plain_int(value: Any) -> bool:
    """True for an int that is not a bool (what a JSON count must be)."""
    return type(value) is int


def ids_ok(ids: Any) -> bool:
    """True for a list of plain ints >= 0."""
    return isinstance(ids, list) and all(type(i) is int and i >= 0 for i in ids)


def optional_count(value: Any) -> int | None:
    """A prompt-token count when it is a plain int >= 0 (informational: else None)."""
    return value if plain_int(value) and value >= 0 else None


def message_parts(data: Any, url: str) -> tuple[dict, str, str | None]:
    """(choices[0], its answer text, its thinking) of a chat answer; else `malformed`.

    The thinking is `message.reasoning`, else `message.reasoning_content` (the first that is
    not null; a value that is neither null nor text is `malformed`). A null content is ""
    (a length stop inside the thinking leaves no answer); a missing content is `malformed`
    unless there is thinking.

    Example:
        >>> msg = {"content": None, "reasoning": "Let me think"}
        >>> message_parts({"choices": [{"message": msg}]}, "http://h/v1")[1:]
        ('', 'Let me think')
    """
    try:
        choice = data["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise MalformedAnswer(f"no choices[0].message from {url}") from None
    if not isinstance(choice, dict) or not isinstance(message, dict):
        raise MalformedAnswer(f"choices[0].message from {url} is not an object")
    for name in ("reasoning", "reasoning_content"):
        value = message.get(name)
        if value is not None and not isinstance(value, str):
            shown = repr(value)[:40]
            raise MalformedAnswer(f"choices[0].message.{name}={shown} from {url} is no text")
    reasoning = message.get("reasoning")
    reasoning = message.get("reasoning_content") if reasoning is None else reasoning
    calls = message.get("tool_calls") or message.get("function_call")
    if "content" not in message and reasoning is None and not calls:
        raise MalformedAnswer(f"no choices[0].message.content from {url}")
    text = message.get("content")
    if text is not None and not isinstance(text, str):
        raise MalformedAnswer(f"choices[0].message.content from {url} is no text")
    return choice, text or "", reasoning


def tool_calls_of(choice: dict, url: str) -> list[dict] | None:
    """The tool calls of a chat answer's message (None without any), as the server gave
    them; OpenAI's legacy `function_call` becomes one {"type": "function", "function": ...}.
    A call without a function name, or whose arguments are not text, is `malformed`.

    Example:
        >>> call = {"id": "c1", "type": "function",
        ...         "function": {"name": "add", "arguments": '{"a": 1}'}}
        >>> tool_calls_of({"message": {"content": None, "tool_calls": [call]}}, "http://h/v1")[0]["id"]
        'c1'
        >>> tool_calls_of({"message": {"content": "Hi", "tool_calls": []}}, "http://h/v1") is None
        True
    """
    message = choice.get("message") or {}
    calls = message.get("tool_calls")
    if not calls and isinstance(message.get("function_call"), dict):
        calls = [{"type": "function", "function": message["function_call"]}]
    if not calls:
        return None
    if not isinstance(calls, list):
        raise MalformedAnswer(f"choices[0].message.tool_calls from {url} is not a list")
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        ok = isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]
        if not ok or not isinstance(fn.get("arguments", ""), str):
            shown = repr(call)[:80]
            msg = f"choices[0].message.tool_calls[{i}]={shown} from {url} is no function call"
            raise MalformedAnswer(msg)
    return calls


def calls_text(calls: list[dict] | None) -> str | None:
    """The calls as the text a model writes them (name and arguments, JSON), to re-tokenize.

    Example:
        >>> calls_text([{"function": {"name": "add", "arguments": '{"a": 1}'}}])
        '[{"name": "add", "arguments": {"a": 1}}]'
    """
    if not calls:
        return None
    out = []
    for call in calls:
        fn = call["function"]
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            args = fn.get("arguments")
        out.append({"name": fn["name"], "arguments": args})
    return json.dumps(out, ensure_ascii=False)


def check_count(value: Any, what: str, url: str, sampling: Sampling) -> int:
    """value when it is a plain int in 0..max_tokens + 1; else `malformed`.

    Example:
        >>> check_count(12, "usage.completion_tokens", "http://h/v1", Sampling(max_tokens=40))
        12
        >>> check_count(True, "usage.completion_tokens", "http://h/v1", Sampling(max_tokens=40))
        Traceback (most recent call last):
        ...
        kit.errors.MalformedAnswer: malformed: usage.completion_tokens=True from http://h/v1 is not an int in 0..41 (max_tokens + 1)
    """
    limit = sampling.max_tokens + 1
    if plain_int(value) and 0 <= value <= limit:
        return value
    msg = f"{what}={repr(value)[:40]} from {url} is not an int in 0..{limit} (max_tokens + 1)"
    raise MalformedAnswer(msg)


def check_ids(ids: Any, count: Any, what: str, url: str, sampling: Sampling, text: str = "") -> int:
    """len(ids) when ids is a list of token ids of a valid length agreeing with the server's
    count (None: no count given), and not empty for a non-empty `text`; else `malformed`."""
    if not ids_ok(ids):
        raise MalformedAnswer(f"{what} from {url} is not a list of token ids")
    n = check_count(len(ids), f"len({what})", url, sampling)
    if count is not None:
        check_count(count, "completion_tokens", url, sampling)
        if count != n:
            msg = f"completion_tokens={count} from {url} disagrees with len({what})={n}"
            raise MalformedAnswer(msg)
    if n == 0 and text.strip():
        raise MalformedAnswer(f"{what} from {url} is empty for a non-empty answer")
    return n


def check_usage(
    value: Any, what: str, url: str, sampling: Sampling, retokenized, text: str = ""
) -> int:
    """A server's count that is valid, not 0 for a non-empty `text` and, when retokenized()
    gives the text's length with the tokenizer (None without one), not below it by more
    than max(4, 25%)."""
    n = check_count(value, what, url, sampling)
    if n == 0 and text.strip():
        raise MalformedAnswer(f"{what}=0 from {url} for a non-empty answer")
    actual = retokenized()
    if actual is not None and n + max(4, actual // 4) < actual:
        msg = (
            f"{what}={n} from {url} under-reports: the text is {actual} tokens with the "
            "tokenizer (or tokenizer= is not the target's)"
        )
        raise MalformedAnswer(msg)
    return n
