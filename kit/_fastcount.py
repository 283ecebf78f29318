"""Prompt token counts without rendering or re-encoding what every prompt shares.

A tokenizer splits its input at added (special) tokens and encodes the text between them
independently. A conversation rendered by shape (kit._template) is literal pieces with
contents in between, so its count is a per-shape constant (the pieces' text between their
first and last special token, counted once) plus the counts of the few variable segments:
a content with the piece text that joins it up to the nearest special token on each side
(for SmolLM2, "user\\n" + content). A shape is taken only when no special token could
straddle a content boundary; everything else is rendered and counted whole.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from kit._template import ShapeRenderer

Counter = Callable[[list[str]], list[int]]  # texts -> token counts


class ShapeCounter:
    """Per-shape constants and segment layouts over a ShapeRenderer."""

    def __init__(self, renderer: ShapeRenderer, count: Counter, specials: list[str]) -> None:
        self._renderer = renderer
        self._count = count
        self._specials = sorted(set(specials), key=len, reverse=True)
        self._split = (
            re.compile("|".join(re.escape(s) for s in self._specials)) if specials else None
        )
        self._layouts: dict[tuple, tuple | None] = {}  # shape -> (constant, segments) or None

    def layout(self, messages: list) -> tuple | None:
        """(constant tokens, segment parts) of this conversation's shape; None: count it whole."""
        plan = self._renderer.plan(messages)
        if plan is None:
            return None
        shape, pieces, order = plan
        layout = self._layouts.get(shape, 0)
        if layout == 0:
            layout = self._layouts[shape] = self._layout(pieces, order)
        return layout

    def _layout(self, pieces: tuple, order: tuple) -> tuple | None:
        """The shape's constant count and its segments as parts (str literal or content index)."""
        spans = [self._special_spans(p) for p in pieces]
        if not self._safe(pieces, spans):
            return None
        constant_texts: list[str] = []
        segments: list[list] = []
        current: list = []
        for k, (piece, found) in enumerate(zip(pieces, spans, strict=True)):
            if k:
                current.append(order[k - 1])
            if not found:
                current.append(piece)
                continue
            first, last = found[0][0], found[-1][1]
            current.append(piece[:first])
            segments.append(current)
            constant_texts.append(piece[first:last])
            current = [piece[last:]]
        segments.append(current)
        segments = [[p for p in s if p != ""] for s in segments]
        constant = sum(self._count(constant_texts)) if constant_texts else 0
        fixed = ["".join(s) for s in segments if all(type(p) is str for p in s)]
        constant += sum(self._count(fixed)) if fixed else 0
        variable = [s for s in segments if any(type(p) is int for p in s)]
        return constant, variable

    def _special_spans(self, piece: str) -> list[tuple[int, int]]:
        """(start, end) of each special token in a literal piece."""
        if self._split is None:
            return []
        return [m.span() for m in self._split.finditer(piece)]

    def _safe(self, pieces: tuple, spans: list) -> bool:
        """No special token can start in a content and end in a piece's special, or the reverse."""
        for k in range(1, len(pieces)):
            before, after = pieces[k - 1], pieces[k]
            if spans[k] and self._straddles_into(after, spans[k][0][0]):
                return False
            if spans[k - 1] and self._straddles_out_of(before, spans[k - 1][-1][1]):
                return False
        return True

    def _straddles_into(self, piece: str, first: int) -> bool:
        """Some special = (end of a content) + (a prefix of piece reaching its first special)."""
        return any(
            piece.startswith(s[i:]) and len(s) - i > first
            for s in self._specials
            for i in range(1, len(s))
        )

    def _straddles_out_of(self, piece: str, last: int) -> bool:
        """Some special = (a suffix of piece from inside its last special) + (start of a content)."""
        return any(
            piece.endswith(s[:i]) and len(piece) - i < last
            for s in self._specials
            for i in range(1, len(s))
        )


def specials_of(tokenizer: Any) -> list[str]:
    """The text of every added token (special or not): where the tokenizer splits first."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return [t.content for t in decoder.values()]


def frame_counts(
    counter: ShapeCounter, count: Counter, frame: Any, column: str
) -> tuple[list[int | None], list[int]] | None:
    """Prompt counts of a polars column of list[struct{role, content}], and the rows left.

    Returns (counts, with None for the rows left; the indices of those rows), or None when
    the column's type is not that. Segment texts are concatenated column-wise per shape,
    so no conversation becomes Python dicts. Rows with a null role or content, a role with
    the separator, any other non-null field, or no messages are left for the per-row path.
    """
    import polars as pl

    dtype = frame.schema[column]
    if not (isinstance(dtype, pl.List) and isinstance(dtype.inner, pl.Struct)):
        return None
    fields = {f.name: f.dtype for f in dtype.inner.fields}
    if fields.get("role") != pl.String or fields.get("content") != pl.String:
        return None
    el = pl.element().struct
    odd = el.field("role").is_null() | el.field("content").is_null()
    odd = odd | el.field("role").str.contains(_SEP, literal=True)
    for name in fields.keys() - {"role", "content"}:
        odd = odd | el.field(name).is_not_null()
    msgs = pl.col(column)
    keyed = frame.select(
        pl.int_range(pl.len()).alias("_i"),
        msgs.list.eval(el.field("role")).list.join(_SEP).alias("_shape"),
        (msgs.list.eval(odd).list.any() | (msgs.list.len() == 0)).fill_null(True).alias("_odd"),
        msgs,
    )
    counts: list[int | None] = [None] * frame.height
    left = keyed.filter(pl.col("_odd"))["_i"].to_list()
    for (shape,), rows in keyed.filter(~pl.col("_odd")).group_by("_shape"):
        roles = shape.split(_SEP) if shape else []
        layout = counter.layout([{"role": r, "content": ""} for r in roles])
        index = rows["_i"].to_list()
        if layout is None:
            left.extend(index)
            continue
        constant, templates = layout
        totals = [constant] * len(index)
        for parts in templates:
            text = rows.select(pl.concat_str([_part(p, column) for p in parts]))
            for j, n in enumerate(count(text.to_series().to_list())):
                totals[j] += n
        for i, n in zip(index, totals, strict=True):
            counts[i] = n
    return counts, sorted(left)


_SEP = "\x1f"  # joins a conversation's roles into its shape key


def _part(part: str | int, column: str) -> Any:
    """A segment part as a polars expression: a literal, or message `part`'s content."""
    import polars as pl

    if type(part) is str:
        return pl.lit(part)
    return pl.col(column).list.get(part).struct.field("content")
