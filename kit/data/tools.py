"""Tool-call datasets behind kit.load: tool definitions carried, tool turns reported.

A row's `tools` (or mapping={"tools": column}, or the legacy `functions`) is read in the
shapes real datasets use: OpenAI tool dicts, the list as a JSON string (or a list of JSON
strings), or bare {"name", "description", "parameters"} definitions (glaive, xLAM), wrapped
as OpenAI tools and stored as compact JSON in the frame's `tools` column. Tools that
cannot be sent are a counted `bad_tools` skip; in a columnar source a null is a missing
key (drop_nulls). Tool turns (tool results, `tool_calls`) cannot be carried by {role,
content} messages: a prompt holding one is a counted `tool_turns` skip.
"""

from __future__ import annotations

import json

import orjson

from kit.errors import Skip

_TOOL_ROLES = frozenset(  # tool results and calls as turns (OpenAI, Hermes, LLaMA-Factory, Llama 3)
    ("tool", "function", "function_call", "observation", "ipython", "tool_call", "tool_response")
)
_TOOL_TURNS = "tool-call turns in the history are not supported yet"
_MAX_DEPTH = 254  # of tool definitions: kit's JSON encoder (orjson) nests at most 255 levels


def tool_turn(obj: dict, raw_role) -> Skip | None:
    """The tool_turns skip for a turn that is a tool call or a tool result, else None.

    Example:
        >>> tool_turn({"role": "tool", "content": "42"}, "tool").detail
        "role 'tool': tool-call turns in the history are not supported yet"
        >>> tool_turn({"role": "user", "content": "Hi"}, "user") is None
        True
    """
    if isinstance(raw_role, str) and raw_role.lower() in _TOOL_ROLES:
        return Skip("tool_turns", f"role {raw_role!r}: {_TOOL_TURNS}")
    for key in ("tool_calls", "function_call"):
        if obj.get(key):  # null or [] carries nothing
            return Skip("tool_turns", f"{raw_role!r} turn with {key!r}: {_TOOL_TURNS}")
    return None


def row_tools(row: dict, mapping: dict | None, columnar: bool = False) -> str | None:
    """A row's tool definitions as a compact JSON array of OpenAI tools, or None for none.

    Args:
        row: one source row.
        mapping: load()'s mapping; its "tools" entry names the column (default `tools`,
            then the legacy `functions`).
        columnar: the row comes from a columnar source (Parquet, a frame, a
            datasets.Dataset): null values inside tools held as structs are dropped.

    Raises Skip (bad_tools, conflicting_fields) naming what is wrong.

    Example:
        >>> row_tools({"tools": '[{"name": "add", "parameters": {"type": "object"}}]'}, None)
        '[{"type":"function","function":{"name":"add","parameters":{"type":"object"}}}]'
        >>> row_tools({"tools": "[]"}, None) is None
        True
    """
    if mapping and "tools" in mapping:
        return _tools(row.get(mapping["tools"]), repr(mapping["tools"]), columnar)
    tools, functions = _value(row.get("tools")), _value(row.get("functions"))
    if tools is not None and functions is not None:
        raise Skip("conflicting_fields", "both 'tools' and 'functions' hold a value: keep one")
    if functions is not None:
        return _tools(functions, "'functions'", columnar)
    return _tools(tools, "'tools'", columnar)


def _value(value):
    """A tools field's value, None when it holds nothing (null, a blank string, [])."""
    if isinstance(value, str):
        return value if value.strip() else None
    if isinstance(value, list):
        return value or None
    return value


def drop_nulls(value):
    """Null-valued keys removed at every depth (a struct column's absent keys).

    Example:
        >>> drop_nulls([{"name": "f", "parameters": {"x": None, "y": {"type": "int"}}}])
        [{'name': 'f', 'parameters': {'y': {'type': 'int'}}}]
    """
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


def _tools(value, where: str, columnar: bool) -> str | None:
    """Parse, check and normalize one tools value (the row_tools rules)."""
    value = _value(value)
    if columnar and isinstance(value, list):
        try:
            value = drop_nulls(value)
        except RecursionError:
            raise Skip("bad_tools", f"{where} is nested too deep to read") from None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise Skip("bad_tools", f"{where} is not valid JSON ({exc})") from None
        except RecursionError:
            raise Skip("bad_tools", f"{where} is nested too deep for the JSON parser") from None
        value = _value(value)
    if value is None:
        return None
    if not isinstance(value, list):
        raise Skip("bad_tools", f"{where} is a {type(value).__name__}, not a list of tools")
    tools = [_tool(t, f"{where} tool {i}") for i, t in enumerate(value)]
    try:
        text = json.dumps(tools, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (ValueError, RecursionError) as exc:
        raise Skip("bad_tools", f"{where} cannot be sent as JSON ({exc})") from None
    try:  # a request body holds them one level down; kit's JSON encoder stops at 255
        orjson.dumps({"tools": tools})
    except orjson.JSONEncodeError:
        msg = f"{where} is nested deeper than {_MAX_DEPTH} levels: no request could carry it"
        raise Skip("bad_tools", msg) from None
    return text


def _tool(tool, where: str) -> dict:
    """One tool definition (an object, or one as a JSON string) -> an OpenAI tool."""
    if isinstance(tool, str):
        try:
            tool = json.loads(tool)
        except (ValueError, RecursionError):
            raise Skip("bad_tools", f"{where} is a string that is not a JSON object") from None
    if not isinstance(tool, dict):
        raise Skip("bad_tools", f"{where} is a {type(tool).__name__}, not an object")
    if "function" not in tool and "type" not in tool:
        tool = {"type": "function", "function": tool}  # a bare function definition
    kind = tool.get("type", "function")
    if kind != "function":
        raise Skip("bad_tools", f"{where} has type {kind!r}; only 'function' tools can be sent")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise Skip("bad_tools", f"{where} has no 'function' object")
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        raise Skip("bad_tools", f"{where} has no function name")
    for key, kinds in (("description", str), ("parameters", dict)):
        if function.get(key) is not None and not isinstance(function[key], kinds):
            found = type(function[key]).__name__
            raise Skip("bad_tools", f"{where} ({name}) {key!r} is a {found}")
    return tool
