"""Fast token counts for byte-level BPE tokenizers (GPT-2, SmolLM, Llama 3, Qwen): tiktoken.

The target's own `tokenizer.json` (vocab, merges, pre-tokenizer regex, added tokens) is
rebuilt as a tiktoken `Encoding` whose merge ranks are the merge order, so it splits text
the same way the Hugging Face tokenizer does, several times faster. Only lengths are used
(its ids are ranks, not the target's ids). Tokenizers outside what this module can mirror
(normalizers, byte fallback, prefix spaces, added tokens with strip flags) get None and
are counted by the Hugging Face tokenizer. `kit.tokens.encode_lengths` also compares the
two on a spread of every batch and falls back on any difference.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import lru_cache
from typing import Any

# The GPT-2 / ByteLevel(use_regex=True) pre-tokenizer split, as in tokenizers' byte_level.rs.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_THREADS = 2  # texts are split in this many chunks; tiktoken releases the GIL while encoding
_MIN_PARALLEL = 4096  # below this many texts one thread is faster
# Texts are counted joined by this extra special token (one call, no per-text overhead) and
# split at it again; a batch in which some text contains it is counted text by text.
_SEP = "\x00kit-count-separator\x00"


def _bytes_to_unicode() -> dict[str, int]:
    """The byte-level alphabet: printable stand-in character -> the byte it encodes."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _split_pattern(pre: dict | None) -> str | None:
    """The pre-tokenizer's regex when it is one tiktoken can mirror, else None."""
    if not pre:
        return None
    if pre.get("type") == "ByteLevel":
        return (
            GPT2_PATTERN if pre.get("use_regex", True) and not pre.get("add_prefix_space") else None
        )
    if pre.get("type") != "Sequence":
        return None
    steps = pre.get("pretokenizers") or []
    if len(steps) != 2:
        return None
    split, level = steps
    ok_split = (
        split.get("type") == "Split"
        and "Regex" in (split.get("pattern") or {})
        and split.get("behavior") == "Isolated"
        and not split.get("invert")
    )
    ok_level = (
        level.get("type") == "ByteLevel"
        and not level.get("use_regex", True)
        and not level.get("add_prefix_space")
    )
    return split["pattern"]["Regex"] if ok_split and ok_level else None


def _unsupported(spec: dict) -> str | None:
    """Why this tokenizer.json cannot be mirrored, or None when it can."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return f"model type {model.get('type')!r}"
    if model.get("byte_fallback") or model.get("dropout"):
        return "byte fallback or dropout"
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return "subword prefix/suffix"
    if spec.get("normalizer"):
        return "a normalizer"
    if _split_pattern(spec.get("pre_tokenizer")) is None:
        return f"pre-tokenizer {json.dumps(spec.get('pre_tokenizer'))[:80]}"
    added = [a["content"] for a in spec.get("added_tokens") or []]
    for a in spec.get("added_tokens") or []:
        if a.get("lstrip") or a.get("rstrip") or a.get("single_word"):
            return f"added token {a['content']!r} with strip/single-word flags"
    if any(x != y and y.startswith(x) for x in added for y in added):
        return "one added token is a prefix of another"
    return None


def _merge(pair: Any) -> tuple[str, str]:
    """A merge as (left, right): tokenizers writes ["a", "b"] or (older files) "a b"."""
    return tuple(pair) if isinstance(pair, list) else tuple(pair.split(" ", 1))


def encoding_from_spec(spec: dict) -> Any | None:
    """A tiktoken Encoding that splits like this tokenizer.json, or None when it can't."""
    if _unsupported(spec) is not None:
        return None
    import tiktoken

    to_byte = _bytes_to_unicode()
    ranks = {bytes([b]): b for b in range(256)}
    try:
        for i, pair in enumerate(spec["model"]["merges"]):
            left, right = _merge(pair)
            merged = bytes(to_byte[c] for c in left + right)
            if merged in ranks:  # two merges make the same token: ranks can't say which
                return None
            ranks[merged] = 256 + i
    except KeyError:  # a character outside the byte-level alphabet
        return None
    added = [a["content"] for a in spec.get("added_tokens") or []]
    base = len(ranks)
    specials = {text: base + i for i, text in enumerate([*added, _SEP])}
    pattern = _split_pattern(spec["pre_tokenizer"])
    return tiktoken.Encoding("kit-count", pat_str=pattern, mergeable_ranks=ranks,
                             special_tokens=specials)  # fmt: skip


@lru_cache(maxsize=8)
def _encoding_for(spec_text: str) -> Any | None:
    """encoding_from_spec, cached by the tokenizer.json text, if whole words agree.

    tiktoken emits a pre-token that is itself in the vocabulary as one token; the BPE
    merges must then give that token too. Checked for every vocabulary entry (0.1 s).
    """
    spec = json.loads(spec_text)
    encoding = encoding_from_spec(spec)
    if encoding is None:
        return None
    from tokenizers import Tokenizer

    model = Tokenizer.from_str(spec_text).model
    added = {a["content"] for a in spec.get("added_tokens") or []}
    if any(len(model.tokenize(word)) != 1 for word in spec["model"]["vocab"] if word not in added):
        return None
    return encoding


def fast_counter(tokenizer: Any) -> Callable[[list[str]], list[int]] | None:
    """A function texts -> token counts (no special tokens added), or None if unsupported.

    Example:
        >>> count = fast_counter(tok)  # SmolLM2-135M-Instruct
        >>> count(["hello world", "<|im_start|>user\\nhi<|im_end|>"])
        [2, 5]
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        return None
    encoding = _encoding_for(backend.to_str())
    if encoding is None:
        return None
    encode, sep_id = encoding.encode, encoding.encode_single_token(_SEP)
    real = encoding.special_tokens_set - {_SEP}

    def lengths(texts: list[str]) -> list[int]:
        joined = _SEP.join(texts)
        if texts and joined.count(_SEP) == len(texts) - 1:
            try:
                return _split_counts(
                    encoding.encode_to_numpy(joined, allowed_special="all"), sep_id
                )
            except UnicodeEncodeError:  # lone surrogates: encode() below repairs them
                pass
        return [len(encode(t, allowed_special=real)) for t in texts]

    def count(texts: list[str]) -> list[int]:
        if len(texts) < _MIN_PARALLEL:
            return lengths(texts)
        from concurrent.futures import ThreadPoolExecutor

        step = -(-len(texts) // _THREADS)
        chunks = [texts[i : i + step] for i in range(0, len(texts), step)]
        with ThreadPoolExecutor(_THREADS) as pool:
            return [n for part in pool.map(lengths, chunks) for n in part]

    return count


def _split_counts(ids: Any, sep_id: int) -> list[int]:
    """Per-text counts of texts encoded as one, split at the separator token."""
    import numpy as np

    bounds = np.flatnonzero(ids == sep_id)
    edges = np.concatenate(([-1], bounds, [len(ids)]))
    return (np.diff(edges) - 1).tolist()


def why_not(tokenizer: Any) -> str | None:
    """Why fast_counter gives None for this tokenizer (None when it doesn't)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "not a fast (Rust) tokenizer"
    return _unsupported(json.loads(backend.to_str()))
