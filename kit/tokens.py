"""Tokenizer loading, chat-template rendering, token counts and the chat-template hash.

Counting goes through the target's tokenizer only: the public
`tokenizer.apply_chat_template(..., tokenize=False)` renders chunks of conversations
(row by row in a chunk the template refuses a row of) and the tokenizer's Rust batch
encoder counts the texts, so each count equals
`len(tokenizer.apply_chat_template(m, tokenize=True, add_generation_prompt=True))`.
`python bench/bench_tokens.py` times it against those two calls written by hand.

    >>> tok = load_tokenizer("data/models/SmolLM2-135M-Instruct")
    >>> count_prompt_tokens(tok, kit.load("data/samples").frame)["prompt_tokens"][:3].to_list()
    [111, 98, 89]
"""

from __future__ import annotations

import hashlib
import json
import warnings
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import polars as pl

__all__ = [
    "chat_template_hash",
    "count_completion_tokens",
    "count_prompt_tokens",
    "encode_lengths",
    "load_tokenizer",
    "render",
]

_CHUNK = 2048  # conversations rendered / texts encoded per call (big batches encode slower)


def load_tokenizer(name_or_path: str | Path | Any) -> Any:
    """Load a tokenizer from local files only, cached per path.

    Args:
        name_or_path: a folder with tokenizer files, a `.gguf` file (via transformers'
            gguf support), or a Hugging Face id already in the local cache; nothing is
            downloaded. A tokenizer object is returned as it is.

    Returns:
        A transformers tokenizer (fast when the files allow it).

    Example:
        >>> tok = load_tokenizer("data/models/SmolLM2-135M-Instruct")
        >>> tok("hello", add_special_tokens=False)["input_ids"]
        [28120]
    """
    if not isinstance(name_or_path, (str, Path)):
        return name_or_path
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


def render(
    tokenizer: Any,
    messages_list: list[list[dict]],
    add_generation_prompt: bool = True,
    *,
    on_error: str = "raise",
    tools: list | None = None,
    template_kwargs: dict | None = None,
) -> list[str | None]:
    """Render conversations with the tokenizer's chat template, one string each.

    Equal to `tokenizer.apply_chat_template(m, tokenize=False, ...)` row by row; rendered
    by its batched form over chunks of conversations, row by row in a chunk that fails.

    Args:
        tokenizer: a tokenizer or a path for load_tokenizer.
        messages_list: conversations, each a non-empty list of {"role", "content"} dicts.
        add_generation_prompt: append the assistant header (what a server does).
        on_error: "raise" (ValueError naming the row) or "skip" (None for that row).
        tools: per conversation, its tool definitions (a list, JSON text, or None); the
            template puts them into the prompt as a server would.
        template_kwargs: chat_template_kwargs for every conversation (e.g. enable_thinking).

    Returns:
        One rendered string per conversation (None for skipped rows).

    Example:
        >>> render(tok, [[{"role": "user", "content": "hi"}]])[0][-52:]
        '<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n'
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    tokenizer = load_tokenizer(tokenizer)
    tokenizer.get_chat_template()  # no template at all: ValueError now, not a null per row
    gen = {**(template_kwargs or {}), "add_generation_prompt": add_generation_prompt}
    if tools is not None and any(tools):  # one tools list per call: those rows one by one
        return _render_with_tools(tokenizer, messages_list, tools, gen, on_error)
    out: list[str | None] = []
    for start in range(0, len(messages_list), _CHUNK):
        chunk = list(messages_list[start : start + _CHUNK])
        if all(isinstance(m, (list, tuple)) and m for m in chunk):
            try:  # any exception (jinja TemplateError, TypeError, ...): find the row below
                out.extend(tokenizer.apply_chat_template(chunk, tokenize=False, **gen))
                continue
            except Exception:
                pass
        for i, messages in enumerate(chunk, start):
            out.append(_render_one(tokenizer, messages, gen, i, on_error))
    return out


def _render_with_tools(tokenizer, messages_list, tools, gen, on_error) -> list[str | None]:
    """render() for conversations of which some carry tool definitions."""
    import json

    out: list[str | None] = []
    for i, (messages, row_tools) in enumerate(zip(messages_list, tools, strict=True)):
        if isinstance(row_tools, str):
            row_tools = json.loads(row_tools) if row_tools else None
        extra = {**gen, "tools": row_tools} if row_tools else gen
        out.append(_render_one(tokenizer, messages, extra, i, on_error))
    return out


def _render_one(tokenizer: Any, messages: Any, gen: dict, row: int, on_error: str) -> str | None:
    """One conversation's text; None (on_error="skip") or ValueError naming the row if refused."""
    try:
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("not a non-empty list of messages")
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, **gen)
        if not isinstance(text, str):  # a list of lists is read as a batch
            raise TypeError("messages must be dicts, not lists")
        return text
    except Exception as exc:
        if on_error == "raise":
            raise ValueError(f"row {row}: the chat template could not render it: {exc}") from exc
        return None


def encode_lengths(tokenizer: Any, texts: list[str]) -> list[int]:
    """Token counts of texts (no special tokens added), by the tokenizer's own batch encoder.

    Args:
        tokenizer: a tokenizer or a path for load_tokenizer.
        texts: the texts, e.g. rendered prompts.

    Returns:
        One count per text, equal to `len(tokenizer(t, add_special_tokens=False)["input_ids"])`.

    Example:
        >>> encode_lengths(tok, ["hello world", "<|im_start|>user\\nhi<|im_end|>"])
        [2, 5]
    """
    tokenizer = load_tokenizer(tokenizer)
    backend = _plain_backend(tokenizer)
    lengths: list[int] = []
    for start in range(0, len(texts), _CHUNK):
        chunk = list(texts[start : start + _CHUNK])
        if backend is not None:
            lengths.extend(map(len, backend.encode_batch_fast(chunk, add_special_tokens=False)))
        else:
            lengths.extend(map(len, tokenizer(chunk, add_special_tokens=False)["input_ids"]))
    return lengths


def encode_many(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of texts (no special tokens added), by the tokenizer's batch encoder (the
    Rust one, on every core, when it encodes as the tokenizer's call does).

    Example:
        >>> encode_many(tok, ["hello world"])
        [[28120, 905]]
    """
    tokenizer = load_tokenizer(tokenizer)
    backend = _plain_backend(tokenizer)
    out: list[list[int]] = []
    for start in range(0, len(texts), _CHUNK):
        chunk = list(texts[start : start + _CHUNK])
        if backend is not None:
            out.extend(e.ids for e in backend.encode_batch_fast(chunk, add_special_tokens=False))
        else:
            out.extend(tokenizer(chunk, add_special_tokens=False)["input_ids"])
    return out


def _plain_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer when it encodes as the tokenizer's call does (no truncation or padding set)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation or backend.padding:
        return None
    split = bool(getattr(tokenizer, "split_special_tokens", False))
    return backend if getattr(backend, "encode_special_tokens", split) == split else None


def count_prompt_tokens(
    tokenizer: Any, frame: pl.DataFrame, *, column: str = "messages"
) -> pl.DataFrame:
    """Add a `prompt_tokens` column: the rendered prompt's length with the target's template.

    Rows the template refuses get null and are reported in one warning (count + first row).

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
    tokenizer = load_tokenizer(tokenizer)
    counts: list[int | None] = []
    for start in range(0, frame.height, _CHUNK):  # a chunk at a time: memory stays flat
        tools = frame["tools"].slice(start, _CHUNK).to_list() if "tools" in frame.columns else None
        texts = render(
            tokenizer, frame[column].slice(start, _CHUNK).to_list(), on_error="skip", tools=tools
        )
        lengths = iter(encode_lengths(tokenizer, [t for t in texts if t is not None]))
        counts.extend(None if t is None else next(lengths) for t in texts)
    bad = [i for i, n in enumerate(counts) if n is None]
    if bad:
        pid = f" ({frame['prompt_id'][bad[0]]})" if "prompt_id" in frame.columns else ""
        warnings.warn(
            f"{len(bad)} of {len(counts)} prompts could not be rendered by the chat template "
            f"(first: row {bad[0]}{pid}); their prompt_tokens is null",
            stacklevel=2,
        )
    return frame.with_columns(pl.Series("prompt_tokens", counts, dtype=pl.Int64))


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
    for i, row_ids in enumerate(_column_or_nulls(records, "output_ids", n)):
        if row_ids is not None:
            counts[i], sources[i] = len(row_ids), "server_ids"
        elif counts[i] is not None:
            counts[i], sources[i] = int(counts[i]), sources[i] or "usage"
        else:
            sources[i] = "retokenized"
    missing = [i for i, c in enumerate(counts) if c is None]
    if missing and (tokenizer is None or "completion" not in records.columns):
        need = "pass tokenizer=" if tokenizer is None else "give them a 'completion' column"
        raise ValueError(
            f"{len(missing)} records have no server token count (first: row {missing[0]}); "
            f"{need} to re-tokenize their text"
        )
    if missing:
        texts = records["completion"].to_list()
        lengths = encode_lengths(tokenizer, [texts[i] or "" for i in missing])
        for i, length in zip(missing, lengths, strict=True):
            counts[i] = length
    return records.with_columns(
        pl.Series("completion_tokens", counts, dtype=pl.Int64),
        pl.Series("count_source", sources, dtype=pl.String),
    )


def _column_or_nulls(frame: pl.DataFrame, name: str, n: int) -> list:
    """A column as a (new) list, or n Nones when absent."""
    return frame[name].to_list() if name in frame.columns else [None] * n


def chat_template_hash(tokenizer: Any) -> str:
    """A short stable hash of the chat template and the special tokens it sees.

    Args:
        tokenizer: a tokenizer or a path for load_tokenizer.

    Returns:
        16 hex digits; they change when the template or a special token changes.

    Example:
        >>> chat_template_hash(tok)
        '5adf0442e5f7706b'
    """
    tokenizer = load_tokenizer(tokenizer)
    payload = json.dumps(
        {"template": tokenizer.get_chat_template(), "special": dict(tokenizer.special_tokens_map)},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]
