"""Chat-template rendering by conversation shape, for templates that only paste content in.

Most chat templates branch on roles, positions and flags, and copy each message's
`content` into the output unchanged. For those, the rendering of a conversation is fixed
by its shape (the roles and other non-content fields of its messages); the template is
rendered once per shape with marker contents, and every conversation of that shape is the
literal pieces between the markers with its own contents put back. Whether a template
qualifies is read from its syntax tree: `content` may appear only inside an output
expression, alone or joined with `+`/`~`; any filter, test, comparison, call, loop or
assignment on it (`| trim`, `is string`, `'</think>' in content`) sends the template down
the ordinary path (jinja per row).
"""

from __future__ import annotations

import re
from typing import Any

_MARK = "\x1ekit-content-{}\x1f"
_MARK_RE = re.compile("\x1ekit-content-(\\d+)\x1f")
_REASONING_KEYS = frozenset(("reasoning_content", "thinking", "reasoning"))
_FALLBACK = None  # a shape the template can't render with markers: the ordinary path decides


def content_is_pasted(compiled: Any, source: str) -> bool:
    """True when every use of `content` in the template pastes it into the output as is.

    Example:
        >>> content_is_pasted(compiled, "{{ m['role'] + ': ' + m['content'] }}")
        True
        >>> content_is_pasted(compiled, "{{ m['content'] | trim }}")
        False
    """
    from jinja2 import nodes

    tree = compiled.environment.parse(source)
    parents: dict[int, Any] = {}
    uses = []
    for node in _walk(tree, parents):
        if isinstance(node, nodes.Getattr) and node.attr == "content":
            uses.append(node)
        elif isinstance(node, nodes.Const) and node.value == "content":
            parent = parents.get(id(node))
            if not isinstance(parent, nodes.Getitem) or parent.arg is not node:
                return False  # 'content' in m, m.get('content'), ...
            uses.append(parent)
    return all(_pasted(use, parents, nodes) for use in uses)


def _walk(node: Any, parents: dict[int, Any]):
    """Every node under node (itself included), recording each child's parent."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        for child in current.iter_child_nodes():
            parents[id(child)] = current
            stack.append(child)


def _pasted(use: Any, parents: dict[int, Any], nodes: Any) -> bool:
    """The content access reaches an Output node through string joins only."""
    node = use
    while True:
        parent = parents.get(id(node))
        if isinstance(parent, nodes.Output):
            return True
        if isinstance(parent, nodes.Add) or isinstance(parent, nodes.Concat):
            node = parent
            continue
        return False


def shape_of(messages: Any) -> tuple | None:
    """A conversation's shape (everything but contents), or None when the fast path can't take it.

    Messages must be dicts of strings; None values are dropped (polars fills absent struct
    fields with None); reasoning fields go the ordinary way.
    """
    if not messages:
        return None  # the ordinary path refuses it, as apply_chat_template does
    shape = []
    for m in messages:
        if type(m) is not dict:
            return None
        if len(m) == 2 and type(m.get("role")) is str and type(m.get("content")) is str:
            shape.append(m["role"])
            continue
        rest = []
        for k, v in m.items():
            if v is None:
                continue
            if type(v) is not str or k in _REASONING_KEYS:
                return None
            if k != "content":
                rest.append((k, v))
        shape.append((tuple(sorted(rest)), m.get("content") is not None))
    return tuple(shape)


class ShapeRenderer:
    """Renders conversations through per-shape pieces; `render` returns None for rows it leaves."""

    def __init__(self, compiled: Any, kwargs: dict, add_generation_prompt: bool) -> None:
        self._compiled = compiled
        self._kwargs = kwargs
        self._gen = add_generation_prompt
        self._pieces: dict[tuple, tuple | None] = {}  # shape -> (pieces, content order) or None

    def plan(self, messages: list) -> tuple | None:
        """(shape, pieces, content order) for this conversation, or None for the ordinary path."""
        shape = shape_of(messages)
        if shape is None:
            return None
        plan = self._pieces.get(shape, 0)
        if plan == 0:
            plan = self._pieces[shape] = self._learn(messages)
        return None if plan is None else (shape, *plan)

    def render(self, messages: list) -> str | None:
        """The rendered conversation, or None when this row needs the ordinary path."""
        plan = self.plan(messages)
        if plan is None:
            return None
        _, pieces, order = plan
        contents = [m.get("content") for m in messages]
        out = [pieces[0]]
        for index, piece in zip(order, pieces[1:], strict=True):
            out.append(contents[index])
            out.append(piece)
        return "".join(out)

    def _learn(self, messages: list) -> tuple | None:
        """Render the shape once with markers; the literal pieces and which content goes where."""
        probe = []
        for i, m in enumerate(messages):
            clean = {k: v for k, v in m.items() if v is not None}
            if "content" in clean:
                clean["content"] = _MARK.format(i)
            probe.append(clean)
        try:
            text = self._compiled.render(messages=probe, tools=None, documents=None,
                                         add_generation_prompt=self._gen, **self._kwargs)  # fmt: skip
        except Exception:  # raise_exception in the template, etc.: the ordinary path reports it
            return _FALLBACK
        parts = _MARK_RE.split(text)
        pieces, order = tuple(parts[0::2]), tuple(int(i) for i in parts[1::2])
        if any(i >= len(messages) or "content" not in probe[i] for i in order):
            return _FALLBACK
        return pieces, order
