"""Length profiles per dataset: n, mean, std, p50/p90/p99, max, truncated share.

Re-exported as kit.plan.profile, profile_prompts, profile_completions. Counting tokens,
when a frame has none, is kit.tokens' job (imported where used).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kit.errors import ConfigError

if TYPE_CHECKING:
    import polars as pl


def profile(
    frame: pl.DataFrame,
    column: str = "completion_tokens",
    *,
    by: str = "dataset",
    max_tokens: int | None = None,
) -> pl.DataFrame:
    """Length statistics of `column` per `by`, sorted: n, mean, std, p50, p90, p99, max,
    truncated_share (finish_reason "length", or a length >= max_tokens; null when nothing
    tells).

    Example:
        >>> f = pl.DataFrame({"dataset": ["a", "a", "b"], "completion_tokens": [10, 30, 64]})
        >>> profile(f, max_tokens=64).select("dataset", "n", "mean", "truncated_share").rows()
        [('a', 2, 20.0, 0.0), ('b', 1, 64.0, 1.0)]
    """
    import polars as pl

    for name in (by, column):
        if name not in frame.columns:
            raise ConfigError(f"frame has no {name!r} column (columns: {frame.columns})")
    x = pl.col(column)
    truncated = truncated_expr(frame, column, max_tokens)
    share = truncated.mean() if truncated is not None else pl.lit(None, pl.Float64)
    aggs = [
        pl.len().alias("n"),
        x.mean().alias("mean"),
        x.std().alias("std"),
        *[x.quantile(q, "linear").alias(f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)],
        x.max().cast(pl.Int64).alias("max"),
        share.alias("truncated_share"),
    ]
    return frame.filter(x.is_not_null()).group_by(by).agg(aggs).sort(by)


def truncated_expr(frame: pl.DataFrame, column: str, max_tokens: int | None) -> Any:
    """A boolean expression: the completion hit max_tokens; None when nothing tells."""
    import polars as pl

    parts = []
    if "finish_reason" in frame.columns:
        parts.append(pl.col("finish_reason").fill_null("") == "length")
    if max_tokens is not None:
        parts.append(pl.col(column) >= max_tokens)
    if not parts:
        return None
    return pl.any_horizontal(parts).cast(pl.Float64)


def profile_prompts(frame: pl.DataFrame, tokenizer: Any = None) -> pl.DataFrame:
    """Prompt-length profile per dataset (counts `prompt_tokens` with the tokenizer if absent;
    `frame` may be a LoadResult: counted a part at a time).

    Example:
        >>> f = pl.DataFrame({"dataset": ["a", "a"], "prompt_tokens": [31, 45]})
        >>> profile_prompts(f).select("dataset", "n", "mean").rows()
        [('a', 2, 38.0)]
    """
    from kit.data.sources import LoadResult

    loaded = isinstance(frame, LoadResult)
    if loaded or "prompt_tokens" not in frame.columns:
        if tokenizer is None:
            raise ConfigError("frame has no 'prompt_tokens' column: pass tokenizer= to count them")
        import polars as pl

        from kit.tokens import count_prompt_tokens, load_tokenizer

        tokenizer = load_tokenizer(tokenizer)
        parts = frame.batches() if loaded else [frame]  # a LoadResult: a part at a time
        counted = [
            count_prompt_tokens(tokenizer, p).select("dataset", "prompt_tokens") for p in parts
        ]
        frame = pl.concat(counted)
    return profile(frame, "prompt_tokens")


def profile_completions(
    records: Any, *, max_tokens: int | None = None, tokenizer: Any = None
) -> pl.DataFrame:
    """Completion-length profile per dataset, with the share that hit max_tokens.

    `records` is a records frame or a kit.plan.PilotResult (its max_tokens is used).

    Example:
        >>> r = pl.DataFrame({"dataset": ["a"] * 4, "completion_tokens": [10, 64, 30, 64],
        ...                   "finish_reason": ["stop", "length", "stop", "length"]})
        >>> profile_completions(r).select("dataset", "n", "mean", "truncated_share").rows()
        [('a', 4, 42.0, 0.5)]
    """
    if hasattr(records, "sampling") and hasattr(records, "frame"):  # a PilotResult
        max_tokens = max_tokens if max_tokens is not None else records.sampling.max_tokens
        records = records.frame
    if "completion_tokens" not in records.columns or records["completion_tokens"].null_count():
        from kit.tokens import count_completion_tokens

        records = count_completion_tokens(records, tokenizer)
    return profile(records, "completion_tokens", max_tokens=max_tokens)
