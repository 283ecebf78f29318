"""Tokenizer loading, chat-template rendering, token counting and length profiles.

The target's tokenizer and chat template decide how long a prompt really is. Rendering
compiles the chat template once; a template that only pastes message contents in is
rendered once per conversation shape and filled in (kit._template), any other is called
per row (the same sandboxed Jinja environment `apply_chat_template` uses). Counting goes
through a tiktoken mirror of a byte-level BPE tokenizer (kit._bpe), checked against the
Hugging Face tokenizer on a spread of every batch, else through the fast (Rust)
tokenizer's batch encoder. `python bench/bench_tokens.py` measures both against the
per-row `apply_chat_template` loop.

    tok = load_tokenizer("data/models/SmolLM2-135M-Instruct")
    frame = count_prompt_tokens(tok, kit.load("data/samples/alpaca.json").frame)
"""

from __future__ import annotations

import hashlib
import json
import warnings
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kit._bpe import fast_counter
from kit._fastcount import ShapeCounter, frame_counts, specials_of
from kit._profile import profile, profile_completions, profile_prompts
from kit._template import _REASONING_KEYS, ShapeRenderer, content_is_pasted

if TYPE_CHECKING:
    import polars as pl

__all__ = [  # profiles live in kit._profile and are re-exported here
    "chat_template_hash", "count_completion_tokens", "count_prompt_tokens", "encode_lengths",
    "load_tokenizer", "profile", "profile_completions", "profile_prompts", "render",
]  # fmt: skip

_ENCODE_CHUNK = 8192  # rendered prompts encoded per batch call
_CHECKED = 64  # texts of a batch also counted by the tokenizer itself (kit._bpe check)


def load_tokenizer(name_or_path: str | Path) -> Any:
    """Load a tokenizer from local files only, cached per path.

    Args:
        name_or_path: a folder with tokenizer files, a `.gguf` file (via transformers'
            gguf support), or a Hugging Face id already in the local cache. Nothing is
            downloaded.

    Returns:
        A transformers tokenizer (fast when the files allow it).

    Example:
        >>> tok = load_tokenizer("data/models/SmolLM2-135M-Instruct")
        >>> tok("hello", add_special_tokens=False)["input_ids"]
        [28120]
    """
    path = Path(name_or_path).expanduser()
    key = str(path.resolve()) if path.exists() else str(name_or_path)
    return _load_cached(key)


@lru_cache(maxsize=8)
def _load_cached(key: str) -> Any:
    """Load one tokenizer (see load_tokenizer)."""
    from transformers import AutoTokenizer

    path = Path(key)
    try:
        if path.suffix == ".gguf":
            if not path.is_file():
                raise FileNotFoundError(f"no such GGUF file: {path}")
            return AutoTokenizer.from_pretrained(
                str(path.parent), gguf_file=path.name, local_files_only=True
            )
        return AutoTokenizer.from_pretrained(key, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(
            f"could not load a tokenizer from {key!r} with local files only "
            f"(give a folder with tokenizer files, a .gguf file, or a cached HF id): {exc}"
        ) from exc


def _as_tokenizer(tokenizer_or_path: Any) -> Any:
    """Accept a tokenizer object or anything load_tokenizer accepts."""
    if isinstance(tokenizer_or_path, (str, Path)):
        return load_tokenizer(tokenizer_or_path)
    return tokenizer_or_path


def _template_and_kwargs(tokenizer: Any) -> tuple[Any, dict, bool]:
    """The compiled chat template, the variables apply_chat_template passes it, and whether
    it only pastes contents in (kit._template)."""
    try:
        from transformers.utils.chat_template_utils import (
            _compile_jinja_template,
            _plain_template_data,
        )
    except ImportError:  # a transformers without these helpers: render row by row
        return None, {}, False
    template = tokenizer.get_chat_template()
    compiled = _compile_jinja_template(template)
    kwargs = _plain_template_data(dict(tokenizer.special_tokens_map))
    return compiled, kwargs, _pastes_content(compiled, template)


@lru_cache(maxsize=16)
def _pastes_content(compiled: Any, template: str) -> bool:
    """kit._template.content_is_pasted, once per template."""
    return content_is_pasted(compiled, template)


def _plain_messages(messages: Any) -> list[dict] | None:
    """Messages as plain dicts without None values; None when the fast path cannot take them."""
    out = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        clean = {k: v for k, v in message.items() if v is not None}
        if any(type(v) is not str for v in clean.values()):
            return None
        if any(k in clean for k in _REASONING_KEYS):
            return None
        out.append(clean)
    return out


def render(
    tokenizer: Any,
    messages_list: list[list[dict]],
    add_generation_prompt: bool = True,
    *,
    on_error: str = "raise",
) -> list[str | None]:
    """Render conversations with the tokenizer's chat template, one string each.

    Equal to `tokenizer.apply_chat_template(m, tokenize=False, ...)` row by row, but the
    template is compiled once, and one that only pastes contents in is rendered once per
    conversation shape (kit._template).

    Args:
        tokenizer: a tokenizer or a path for load_tokenizer.
        messages_list: conversations, each a list of {"role", "content"} dicts.
        add_generation_prompt: append the assistant header (what a server does).
        on_error: "raise" (ValueError naming the row) or "skip" (None for that row).

    Returns:
        One rendered string per conversation (None for skipped rows).

    Example:
        >>> render(tok, [[{"role": "user", "content": "hi"}]])[0][-52:]
        '<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n'
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    tokenizer = _as_tokenizer(tokenizer)
    compiled, kwargs, pasted = _template_and_kwargs(tokenizer)
    shapes = ShapeRenderer(compiled, kwargs, add_generation_prompt) if pasted else None
    out: list[str | None] = []
    for i, messages in enumerate(messages_list):
        if shapes is not None and (text := shapes.render(messages)) is not None:
            out.append(text)
            continue
        try:
            if not messages:
                raise ValueError("empty conversation")
            plain = _plain_messages(messages) if compiled is not None else None
            if plain is None:
                text = tokenizer.apply_chat_template(
                    list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
                )
            else:
                text = compiled.render(
                    messages=plain,
                    tools=None,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **kwargs,
                )
        except Exception as exc:  # jinja TemplateError, TypeError on malformed rows
            if on_error == "raise":
                raise ValueError(f"row {i}: the chat template could not render it: {exc}") from exc
            text = None
        out.append(text)
    return out


def encode_lengths(tokenizer: Any, texts: list[str]) -> list[int]:
    """Token counts of texts (no special tokens added), equal to the tokenizer's own.

    Byte-level BPE tokenizers are counted by their tiktoken mirror (kit._bpe); up to 64
    texts spread over the batch are also encoded by the tokenizer itself, and any
    difference sends the whole batch to it (with a warning). Others are batch-encoded by
    the fast (Rust) tokenizer.

    Example:
        >>> encode_lengths(tok, ["hello world", "<|im_start|>user\nhi<|im_end|>"])
        [2, 5]
    """
    tokenizer = _as_tokenizer(tokenizer)
    count = fast_counter(tokenizer)
    if count is not None and texts:
        lengths = count(texts)
        check = range(0, len(texts), max(1, len(texts) // _CHECKED))
        if _hf_lengths(tokenizer, [texts[i] for i in check]) == [lengths[i] for i in check]:
            return lengths
        warnings.warn(
            "the tiktoken mirror of this tokenizer disagreed with it on a checked text; "
            "counting this batch with the tokenizer itself",
            stacklevel=2,
        )
    return _hf_lengths(tokenizer, texts)


def _hf_lengths(tokenizer: Any, texts: list[str]) -> list[int]:
    """Token counts from the tokenizer's own batch encoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    lengths: list[int] = []
    for start in range(0, len(texts), _ENCODE_CHUNK):
        chunk = texts[start : start + _ENCODE_CHUNK]
        if backend is not None:
            lengths.extend(map(len, backend.encode_batch_fast(chunk, add_special_tokens=False)))
        else:
            lengths.extend(
                len(ids) for ids in tokenizer(chunk, add_special_tokens=False)["input_ids"]
            )
    return lengths


def count_prompt_tokens(
    tokenizer: Any, frame: pl.DataFrame, *, column: str = "messages"
) -> pl.DataFrame:
    """Add a `prompt_tokens` column: the rendered prompt's length with the target's template.

    Rows the template refuses get null and are reported in one warning (count + first case).

    Args:
        tokenizer: a tokenizer or a path for load_tokenizer.
        frame: a prompt frame (kit.types) with a `messages` column.
        column: the column holding the conversations.

    Returns:
        The frame with an Int64 `prompt_tokens` column.

    Example:
        >>> f = pl.DataFrame({"dataset": ["a"], "messages": [[{"role": "user", "content": "hi"}]]})
        >>> count_prompt_tokens(tok, f)["prompt_tokens"].to_list()
        [31]
    """
    import polars as pl

    if column not in frame.columns:
        raise ValueError(f"frame has no {column!r} column (columns: {frame.columns})")
    tokenizer = _as_tokenizer(tokenizer)
    counts = _shape_counts(tokenizer, frame, column)
    if counts is None:
        counts = _rendered_counts(tokenizer, frame[column].to_list())
    bad = [i for i, n in enumerate(counts) if n is None]
    if bad:
        where = f"row {bad[0]}" + (
            f" ({frame['prompt_id'][bad[0]]})" if "prompt_id" in frame.columns else ""
        )
        warnings.warn(
            f"{len(bad)} of {len(counts)} prompts could not be rendered by the chat template "
            f"(first: {where}); their prompt_tokens is null",
            stacklevel=2,
        )
    return frame.with_columns(pl.Series("prompt_tokens", counts, dtype=pl.Int64))


def _rendered_counts(tokenizer: Any, messages_list: list) -> list[int | None]:
    """Render every row, count the rendered texts; None where the template refused a row."""
    texts = render(tokenizer, messages_list, on_error="skip")
    it = iter(encode_lengths(tokenizer, [t for t in texts if t is not None]))
    return [None if t is None else next(it) for t in texts]


def _shape_counts(tokenizer: Any, frame: pl.DataFrame, column: str) -> list[int | None] | None:
    """Counts by conversation shape (kit._fastcount), checked against the tokenizer itself on a
    spread of rows; None when the fast path can't take this tokenizer, template or column."""
    count = fast_counter(tokenizer)
    compiled, kwargs, pasted = _template_and_kwargs(tokenizer)
    if count is None or not pasted:
        return None
    shapes = ShapeCounter(ShapeRenderer(compiled, kwargs, True), count, specials_of(tokenizer))
    found = frame_counts(shapes, count, frame, column)
    if found is None:  # not a list[struct{role, content}] column: render every row
        return None
    counts, left = found
    rows = frame[column].gather(left).to_list() if left else []
    for i, n in zip(left, _rendered_counts(tokenizer, rows), strict=True):
        counts[i] = n
    check = range(0, len(counts), max(1, len(counts) // _CHECKED))
    check = [i for i in check if counts[i] is not None]
    texts = render(tokenizer, frame[column].gather(check).to_list())
    if _hf_lengths(tokenizer, texts) != [counts[i] for i in check]:
        warnings.warn(
            "prompt counts by conversation shape disagreed with the tokenizer on a checked "
            "row; counting every rendered prompt instead",
            stacklevel=3,
        )
        return None
    return counts


def count_completion_tokens(records: pl.DataFrame, tokenizer: Any = None) -> pl.DataFrame:
    """Fill `completion_tokens` and `count_source` for every record, preferring server counts.

    Preference per row: len(output_ids) ("server_ids"), then a non-null
    `completion_tokens` (its own `count_source`, else "usage"), then re-tokenizing the
    `completion` text ("retokenized", needs a tokenizer).

    Args:
        records: a frame of records (kit.types.Record columns; `completion` text at least).
        tokenizer: a tokenizer or path, needed only for rows without a server count.

    Returns:
        The frame with Int64 `completion_tokens` and String `count_source` columns.

    Example:
        >>> r = pl.DataFrame({"completion": ["Hello there", "ok"], "completion_tokens": [None, 7]})
        >>> count_completion_tokens(r, tok).select("completion_tokens", "count_source").rows()
        [(2, 'retokenized'), (7, 'usage')]
    """
    import polars as pl

    n = records.height
    counts = _column_or_nulls(records, "completion_tokens", n)
    sources = _column_or_nulls(records, "count_source", n)
    ids = _column_or_nulls(records, "output_ids", n)
    out_counts: list[int | None] = []
    out_sources: list[str | None] = []
    for count, source, row_ids in zip(counts, sources, ids, strict=True):
        if row_ids is not None:
            out_counts.append(len(row_ids))
            out_sources.append("server_ids")
        elif count is not None:
            out_counts.append(int(count))
            out_sources.append(source or "usage")
        else:
            out_counts.append(None)
            out_sources.append("retokenized")
    missing = [i for i, c in enumerate(out_counts) if c is None]
    if missing:
        out_counts = _retokenize(records, missing, out_counts, tokenizer)
    return records.with_columns(
        pl.Series("completion_tokens", out_counts, dtype=pl.Int64),
        pl.Series("count_source", out_sources, dtype=pl.String),
    )


def _column_or_nulls(frame: pl.DataFrame, name: str, n: int) -> list:
    """A column as a list, or n Nones when absent."""
    return frame[name].to_list() if name in frame.columns else [None] * n


def _retokenize(records: pl.DataFrame, missing: list[int], counts: list, tokenizer: Any) -> list:
    """Fill counts[i] for i in missing by encoding the completion text."""
    if tokenizer is None:
        raise ValueError(
            f"{len(missing)} records have no server token count (first: row {missing[0]}); "
            "pass tokenizer= to re-tokenize their text"
        )
    if "completion" not in records.columns:
        raise ValueError(
            f"records have no 'completion' text column to re-tokenize (columns: {records.columns})"
        )
    texts = records["completion"].to_list()
    lengths = encode_lengths(tokenizer, [texts[i] or "" for i in missing])
    counts = list(counts)
    for i, length in zip(missing, lengths, strict=True):
        counts[i] = length
    return counts


def chat_template_hash(tokenizer: Any) -> str:
    """A short stable hash of the chat template and the special tokens it sees.

    Example:
        >>> chat_template_hash(tok)
        '5adf0442e5f7706b'  # SmolLM2-135M-Instruct
    """
    tokenizer = _as_tokenizer(tokenizer)
    payload = json.dumps(
        {"template": tokenizer.get_chat_template(), "special": dict(tokenizer.special_tokens_map)},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]
