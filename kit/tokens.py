"""The target's tokenizer: loading, kit's one chat-template rendering (`render`), its one
token count (`encode_lengths`, behind count_prompt_tokens / count_completion_tokens), its one
check that output ids spell a text (`ids_spell`) and the chat-template hash. Every
`tokenizer` argument is a tokenizer or a path for load_tokenizer.

Prompt counts equal `len(tokenizer.apply_chat_template(m, tokenize=True,
add_generation_prompt=True))`, made by the batched template and the Rust batch encoder
(`python bench/bench_tokens.py` times them against those calls written by hand).

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

from kit.errors import ConfigError, ConfigTypeError, DataError, MissingPath

if TYPE_CHECKING:
    import polars as pl

__all__ = [
    "chat_template_hash",
    "count_completion_tokens",
    "count_prompt_tokens",
    "encode_lengths",
    "encode_many",
    "ids_spell",
    "ids_spell_batch",
    "load_tokenizer",
    "render",
    "strip_end_ids",
]

_CHUNK = 2048  # conversations rendered / texts encoded per call (big batches encode slower)


def load_tokenizer(name_or_path: str | Path | Any) -> Any:
    """A transformers tokenizer from local files only (nothing is downloaded), cached per
    path: a folder with tokenizer files, a `.gguf` file or a Hugging Face id already in the
    local cache; a tokenizer object is returned as it is.

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
    from transformers import AutoTokenizer

    path = Path(key)
    try:
        if path.suffix == ".gguf":
            if not path.is_file():
                raise MissingPath(f"no such GGUF file: {path}")
            return AutoTokenizer.from_pretrained(
                str(path.parent), gguf_file=path.name, local_files_only=True
            )
        return AutoTokenizer.from_pretrained(key, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise MissingPath(
            f"could not load a tokenizer from {key!r} with local files only "
            f"(give a folder with tokenizer files, a .gguf file, or a cached HF id): {exc}"
        ) from exc


def render(
    tokenizer: Any,
    conversations: list[list[dict]],
    add_generation_prompt: bool = True,
    *,
    on_error: str = "raise",
    tools: list | None = None,
    template_kwargs: dict | list | None = None,
    tokenize: bool = False,
) -> list:
    """Render conversations with the tokenizer's chat template: kit's one rendering.

    Equal to `tokenizer.apply_chat_template(m, tools=..., add_generation_prompt=...,
    tokenize=tokenize, **kwargs)` row by row (`tokenize`: the template's own ids instead of
    text); rows sharing tools and template kwargs are rendered by its batched form, a chunk
    at a time (row by row in a chunk that fails).

    Args:
        conversations: each a non-empty list of {"role", "content"} dicts.
        on_error: "raise" (ValueError naming the row) or "skip" (None for that row).
        tools: per conversation, its tool definitions (a list, JSON text, or None), put
            into the prompt by the template as a server would.
        template_kwargs: chat_template_kwargs (e.g. enable_thinking): one dict for every
            conversation, or a list with one dict (or None) per conversation.

    Example:
        >>> render(tok, [[{"role": "user", "content": "hi"}]])[0][-52:]
        '<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n'
    """
    if on_error not in ("raise", "skip"):
        raise ConfigError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    tokenizer = load_tokenizer(tokenizer)
    if hasattr(tokenizer, "get_chat_template"):
        tokenizer.get_chat_template()  # no template at all: ValueError now, not a null per row
    n = len(conversations)
    tools = [None] * n if tools is None else [parsed(t) or None for t in tools]
    per_row = template_kwargs if isinstance(template_kwargs, list) else [template_kwargs] * n
    groups: dict[tuple, list[int]] = {}  # (tools, kwargs) as JSON -> the rows that share them
    for i, (row_tools, kw) in enumerate(zip(tools, per_row, strict=True)):
        groups.setdefault((_key(row_tools), _key(kw or None)), []).append(i)
    out: list = [None] * n
    for rows in groups.values():
        gen = {**(per_row[rows[0]] or {}), "add_generation_prompt": add_generation_prompt}
        gen.update(tools=tools[rows[0]], tokenize=tokenize, return_dict=False)
        for start in range(0, len(rows), _CHUNK):
            chunk = rows[start : start + _CHUNK]
            done = _render_chunk(tokenizer, [conversations[i] for i in chunk], gen) or [
                _render_one(tokenizer, conversations[i], gen, i, on_error) for i in chunk
            ]
            for i, text in zip(chunk, done, strict=True):
                out[i] = text
    return out


def _key(value: Any) -> str | None:
    """A tools list or kwargs dict as a grouping key (JSON), None for none."""
    return None if value is None else json.dumps(value, sort_keys=True, default=str)


def parsed(value: Any) -> Any:
    """A tools / tool-calls cell as Python: JSON text parsed, a list kept, null or "" -> None."""
    if isinstance(value, str):
        return json.loads(value) if value.strip() else None
    return value


def _render_chunk(tokenizer: Any, chunk: list, gen: dict) -> list | None:
    """A chunk of conversations by the template's batched form; None when it fails (or a
    chunk of one: rendered alone)."""
    if len(chunk) < 2 or not all(isinstance(m, (list, tuple)) and m for m in chunk):
        return None
    try:  # any exception (jinja TemplateError, TypeError, ...): rows one by one find it
        return list(tokenizer.apply_chat_template([list(m) for m in chunk], **gen))
    except Exception:
        return None


def _render_one(tokenizer: Any, messages: Any, gen: dict, row: int, on_error: str) -> Any:
    """One conversation's text (or ids); None (on_error="skip") or ValueError naming the row."""
    try:
        if not isinstance(messages, (list, tuple)) or not messages:
            raise DataError("not a non-empty list of messages")
        out = tokenizer.apply_chat_template(list(messages), **gen)
        if gen["tokenize"] and all(type(i) is int for i in out):
            return list(out)
        if not gen["tokenize"] and isinstance(out, str):
            return out
        raise ConfigTypeError("messages must be dicts, not lists")  # a list of lists is a batch
    except Exception as exc:
        if on_error == "raise":
            raise DataError(f"row {row}: the chat template could not render it: {exc}") from exc
        return None


def encode_lengths(tokenizer: Any, texts: list[str]) -> list[int]:
    """Token counts of texts, kit's one count of a text's tokens: each equal to
    `len(tokenizer(t, add_special_tokens=False)["input_ids"])`.

    Example:
        >>> encode_lengths(tok, ["hello world", "<|im_start|>user\\nhi<|im_end|>"])
        [2, 5]
    """
    return _encoded(tokenizer, texts, ids=False)


def encode_many(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of texts (no special tokens added), as encode_lengths counts them.

    Example:
        >>> encode_many(tok, ["hello world"])
        [[28120, 905]]
    """
    return _encoded(tokenizer, texts, ids=True)


def _encoded(tokenizer: Any, texts: list[str], *, ids: bool) -> list:
    """Each text's ids (or count), a chunk at a time by the tokenizer's batch encoder (the
    Rust one, on every core, when it encodes as the tokenizer's call does)."""
    tokenizer = load_tokenizer(tokenizer)
    backend = _plain_backend(tokenizer)
    out: list = []
    for start in range(0, len(texts), _CHUNK):
        chunk = list(texts[start : start + _CHUNK])
        if backend is not None:
            done = backend.encode_batch_fast(chunk, add_special_tokens=False)
            out.extend(e.ids for e in done) if ids else out.extend(map(len, done))
        else:
            done = [tokenizer.encode(t, add_special_tokens=False) for t in chunk]
            out.extend(done if ids else map(len, done))
    return out


def _plain_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer when it encodes as the tokenizer's call does (no truncation or padding set)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation or backend.padding:
        return None
    split = bool(getattr(tokenizer, "split_special_tokens", False))
    return backend if getattr(backend, "encode_special_tokens", split) == split else None


REPLACEMENT = "\ufffd"  # what a decode writes for the bytes of a character cut short


def strip_end_ids(tokenizer: Any, ids: Any) -> Any:
    """ids without their trailing special ids (the EOS / end-of-turn a server may include)."""
    special = set(tokenizer.all_special_ids)
    end = len(ids)
    while end and ids[end - 1] in special:
        end -= 1
    return ids[:end]


def ids_spell(
    tokenizer: Any,
    ids: Any,
    text: str,
    reasoning: str | None = None,
    tool_calls: Any = None,
    finish_reason: str | None = None,
) -> bool:
    """Whether a server's output ids spell its text: kit's one check of that fact, for the
    runner (a lying server), kit.audit (ids_text_mismatch) and kit.export (exact rows).

    Decoded with their special ids (a trailing EOS / end-of-turn dropped) or without any,
    the ids must be the text. With reasoning, the decode must contain it and end with the
    answer (a reasoning parser's markers and spacing aside); with tool calls (a list or its
    JSON text), contain the answer and every call's name. A "length" stop may end inside a
    character: its decode then ends in U+FFFD, which the text leaves out or keeps. Nothing
    else is let through.

    Example:
        >>> ids = tok.encode("春天", add_special_tokens=False)[:3]  # 春 and a byte of 天
        >>> ids_spell(tok, ids, "春", finish_reason="length"), ids_spell(tok, ids, "春")
        (True, False)
    """
    decoded = [
        tokenizer.decode(strip_end_ids(tokenizer, ids), skip_special_tokens=False),
        tokenizer.decode(ids, skip_special_tokens=True),
    ]
    return _spelled(decoded, text, reasoning, tool_calls, finish_reason)


def ids_spell_batch(
    tokenizer: Any, ids: list, texts: list, reasoning=None, tool_calls=None, finish_reasons=None
) -> list[bool]:
    """ids_spell per row (columns as lists or Series; None: none), the ids decoded by the
    tokenizer's batch decoder."""
    n = len(texts)
    kept = tokenizer.batch_decode(
        [strip_end_ids(tokenizer, i) for i in ids], skip_special_tokens=False
    )
    plain = tokenizer.batch_decode(list(ids), skip_special_tokens=True)
    extra = [[None] * n if c is None else c for c in (reasoning, tool_calls, finish_reasons)]
    rows = zip(kept, plain, texts, *extra, strict=True)
    return [_spelled([k, p], t, r, c, f) for k, p, t, r, c, f in rows]


def _spelled(decoded: list[str], text: str, reasoning, tool_calls, finish_reason) -> bool:
    """ids_spell's rule on the ids' two decodes."""
    if finish_reason == "length":  # the last character cut after some of its bytes
        decoded += [d.removesuffix(REPLACEMENT) for d in decoded if d.endswith(REPLACEMENT)]
    names = [str((c.get("function") or {}).get("name")) for c in parsed(tool_calls) or []]
    if names:
        return any(text.strip() in d and all(n in d for n in names) for d in decoded)
    want = (reasoning or "").strip()
    if not want:
        return text in decoded
    return any(want in d and d.rstrip().endswith(text.strip()) for d in decoded)


def count_prompt_tokens(
    tokenizer: Any, frame: pl.DataFrame, *, column: str = "messages"
) -> pl.DataFrame:
    """Add a `prompt_tokens` column: the rendered prompt's length with the target's template.

    `column` holds the conversations (a prompt frame's `messages`, kit.types); rows the
    template refuses get null and are reported in one warning (count + first row).

    Example:
        >>> f = pl.DataFrame({"dataset": ["a"], "messages": [[{"role": "user", "content": "hi"}]]})
        >>> count_prompt_tokens(tok, f)["prompt_tokens"].to_list()
        [31]
    """
    import polars as pl

    if column not in frame.columns:
        raise ConfigError(f"frame has no {column!r} column (columns: {frame.columns})")
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
    `completion` text ("retokenized": only these rows need the tokenizer).

    Example:
        >>> r = pl.DataFrame({"completion": ["Hello there", "ok"], "completion_tokens": [None, 7]})
        >>> count_completion_tokens(r, tok).select("completion_tokens", "count_source").rows()
        [(2, 'retokenized'), (7, 'usage')]
    """
    import polars as pl

    def column(name: str, dtype):
        return (pl.col(name) if name in records.columns else pl.lit(None)).cast(dtype)

    ids = column("output_ids", pl.List(pl.Int64)).list.len().cast(pl.Int64)
    told = column("completion_tokens", pl.Int64)
    counts = records.select(
        completion_tokens=pl.coalesce(ids, told),
        count_source=pl.when(ids.is_not_null())
        .then(pl.lit("server_ids"))
        .when(told.is_not_null())
        .then(column("count_source", pl.String).fill_null("usage"))
        .otherwise(pl.lit("retokenized")),
    )
    missing = counts["completion_tokens"].is_null().arg_true()
    if len(missing) and (tokenizer is None or "completion" not in records.columns):
        need = "pass tokenizer=" if tokenizer is None else "give them a 'completion' column"
        raise ConfigError(
            f"{len(missing)} records have no server token count (first: row {missing[0]}); "
            f"{need} to re-tokenize their text"
        )
    if len(missing):
        texts = records["completion"].gather(missing).fill_null("").to_list()
        lengths = pl.Series(encode_lengths(tokenizer, texts), dtype=pl.Int64)
        counts = counts.with_columns(counts["completion_tokens"].scatter(missing, lengths))
    return records.with_columns(counts)


def chat_template_hash(tokenizer: Any) -> str:
    """16 hex digits of the chat template and the special tokens it sees: they change when
    the template or a special token changes.

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
