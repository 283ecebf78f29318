"""The context guard of kit.generate: prompts too long for the target are skipped, never sent.

A prompt is skipped when prompt_tokens + sampling.max_tokens > max_context, where
prompt_tokens is the length of the prompt rendered with the target's chat template
(generation prompt added). A server handed such a prompt errors out or, like the
embedded `transformers serve`, accepts it and stalls for minutes.

Skipped prompts are counted per dataset (DatasetProgress.skipped, the `skipped_context`
column of run.summary()) and listed in run_dir/skipped.jsonl, one line per prompt:
    {"dataset", "prompt_id", "prompt_tokens", "max_tokens", "max_context", "samples", "reason"}
The file is rewritten at each start of the run, so it always describes the current
guard (a resume with a larger max_context sends what an earlier start skipped).
"""

from __future__ import annotations

import json
from pathlib import Path

import orjson

from kit.run.lines import write_atomic

SKIPPED_FILE = "skipped.jsonl"
REASON = "context"  # prompt_tokens + max_tokens > max_context
_SANE_MAX = 10_000_000  # tokenizers without a known limit report int(1e30)

Skips = dict  # (dataset, prompt_id) -> (prompt_tokens, samples not yet done)


def check(max_context, tokenizer, max_tokens: int) -> None:
    """ValueError naming the field and the value for a bad max_context setting."""
    if max_context is None:
        return
    if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 1:
        raise ValueError(f"generate: bad max_context={max_context!r} (a positive int or None)")
    if not tokenizer:
        raise ValueError(
            f"generate: max_context={max_context} needs tokenizer=... "
            "(prompts are counted with its chat template)"
        )
    if max_tokens >= max_context:
        raise ValueError(
            f"generate: max_context={max_context} leaves no room for the prompt with "
            f"sampling.max_tokens={max_tokens}"
        )


def model_context(tokenizer: str) -> int | None:
    """The target's context: max_position_embeddings in the tokenizer folder's config.json,
    else the tokenizer's model_max_length when it is a real limit; None when unknown.

    Example: model_context("data/models/SmolLM2-135M-Instruct") -> 8192
    """
    folder = Path(tokenizer)
    cfg = folder / "config.json"
    if folder.is_dir() and cfg.is_file():
        try:
            doc = json.loads(cfg.read_text())
        except (OSError, ValueError):
            doc = {}
        for part in (doc, doc.get("text_config") or {}):
            value = part.get("max_position_embeddings") if isinstance(part, dict) else None
            if isinstance(value, int) and value > 0:
                return value
    from kit.tokens import load_tokenizer

    value = getattr(load_tokenizer(tokenizer), "model_max_length", None)
    return int(value) if isinstance(value, int) and 0 < value <= _SANE_MAX else None


def too_long(
    frame, tokenizer, max_context: int, max_tokens: int, template_kwargs: dict | None = None
) -> dict[tuple, int]:
    """(dataset, prompt_id) -> prompt_tokens for prompts with prompt_tokens + max_tokens > max_context.

    Prompts are rendered with the chat template (kit.tokens.render); only those whose
    rendered text has more UTF-8 bytes than half the room are tokenized (a token covers
    at least one byte of text; the factor 2 allows for normalizers that expand text), so
    a million short prompts cost a render, not a tokenization. Prompts the template
    refuses are left to the server. A `tools` column's definitions are rendered with their
    prompt, and template_kwargs (e.g. enable_thinking) passed to the template.

    Example: too_long(frame, "data/models/SmolLM2-135M-Instruct", 8192, 512)
             -> {("sharegpt", "9f2c..."): 8301}
    """
    from kit.tokens import encode_lengths, render

    room = max_context - max_tokens
    tools = frame["tools"].to_list() if "tools" in frame.columns else None
    texts = render(
        tokenizer, frame["messages"].to_list(), on_error="skip", tools=tools,
        template_kwargs=template_kwargs,
    )  # fmt: skip
    candidates = [i for i, t in enumerate(texts) if t is not None and 2 * len(t.encode()) > room]
    lengths = encode_lengths(tokenizer, [texts[i] for i in candidates])
    datasets, ids = frame["dataset"].to_list(), frame["prompt_id"].to_list()
    return {(datasets[i], ids[i]): n for i, n in zip(candidates, lengths, strict=True) if n > room}


def apply(frame, config, run_dir, done) -> Skips:
    """The prompts this run skips (none without a tokenizer); rewrites run_dir/skipped.jsonl.

    Args:
        frame: the prompt frame; config: the RunConfig (tokenizer, max_context, sampling).
        run_dir: the run directory. done: {(dataset, prompt_id, sample): ...} already written.
    Returns:
        {(dataset, prompt_id): (prompt_tokens, samples not yet done)} for prompts with at
        least one sample still to do.
    """
    path = Path(run_dir) / SKIPPED_FILE
    limit = config.max_context
    if config.tokenizer and limit is None:
        limit = model_context(config.tokenizer)
    if not config.tokenizer or not limit:
        path.unlink(missing_ok=True)  # nothing is skipped now: no stale list for audit
        return {}
    max_tokens, n = config.sampling.max_tokens, config.sampling.n
    check(limit, config.tokenizer, max_tokens)
    unique = frame.unique(subset=["dataset", "prompt_id"], keep="first", maintain_order=True)
    found: dict[tuple, int] = {}
    for (name,), part in unique.group_by("dataset", maintain_order=True):
        kwargs = config.sampling_for(name).chat_template_kwargs
        found |= too_long(part, config.tokenizer, limit, max_tokens, kwargs)
    skips: Skips = {}
    for (ds, pid), tokens in found.items():
        todo = sum((ds, pid, s) not in done for s in range(n))
        if todo:
            skips[(ds, pid)] = (tokens, todo)
    if skips or path.exists():
        write_atomic(path, _lines(skips, max_tokens, limit))
    return skips


def _lines(skips: Skips, max_tokens: int, max_context: int) -> bytes:
    """skipped.jsonl content, sorted by dataset and prompt_id."""
    rows = [
        {"dataset": ds, "prompt_id": pid, "prompt_tokens": tokens, "max_tokens": max_tokens,
         "max_context": max_context, "samples": samples, "reason": REASON}
        for (ds, pid), (tokens, samples) in sorted(skips.items())
    ]  # fmt: skip
    return b"".join(orjson.dumps(r) + b"\n" for r in rows)
