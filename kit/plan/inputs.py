"""budget() and allocate()'s input checks: samples, counts, budgets, progress, numbers.

Each turns what a caller may pass (a frame, a dict, a PilotResult, one number) into one
shape, or raises a ValueError that names the field and the value.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from kit.errors import ConfigError
from kit.plan.pilots import PilotResult
from kit.types import Budget

if TYPE_CHECKING:
    import polars as pl


def samples_frame(samples: Any) -> pl.DataFrame:
    """Completion-length samples as a frame with dataset, completion_tokens[, finish_reason]."""
    import polars as pl

    if isinstance(samples, PilotResult):
        samples = samples.frame
    if isinstance(samples, dict):
        rows = [(d, int(v)) for d, values in samples.items() for v in values]
        samples = pl.DataFrame(
            rows, schema={"dataset": pl.String, "completion_tokens": pl.Int64}, orient="row"
        )
    if not isinstance(samples, pl.DataFrame):
        raise ConfigError(
            f"samples must be a frame, a dict or a PilotResult, got {type(samples).__name__}"
        )
    for name in ("dataset", "completion_tokens"):
        if name not in samples.columns:
            raise ConfigError(f"samples has no {name!r} column (columns: {samples.columns})")
    samples = samples.filter(pl.col("completion_tokens").is_not_null())
    if samples.height == 0:
        raise ConfigError("samples is empty: the pilot produced no completions to plan from")
    return samples


def counts(value: Any, field: str) -> dict[str, int]:
    """A dataset -> int mapping from a dict, a frame with a dataset column (rows counted) or a
    LoadResult (its prompts per dataset)."""
    import polars as pl

    from kit.data.sources import LoadResult

    if isinstance(value, LoadResult):
        return {name: n for name, n in value.prompts.items() if n}

    if isinstance(value, pl.DataFrame):
        if "dataset" not in value.columns:
            raise ConfigError(f"{field} frame has no 'dataset' column (columns: {value.columns})")
        return dict(value.group_by("dataset").len().iter_rows())
    if not isinstance(value, dict):
        raise ConfigError(
            f"{field} must be a dict dataset -> count or a prompt frame, got {type(value).__name__}"
        )
    for name, count in value.items():
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ConfigError(f"{field}[{name!r}] must be an int >= 0, got {count!r}")
    return dict(value)


def budgets(budgets: Any, names: list[str]) -> dict[str, float]:
    """Validated budgets: a dict, or one number for every dataset in names."""
    if not isinstance(budgets, dict):
        budgets = {name: budgets for name in names}
    Budget(tokens=budgets)  # raises ValueError naming the dataset and the value
    if not budgets:
        raise ConfigError("budgets is empty: give at least one dataset's token budget")
    return budgets


def progress(done: Any) -> dict[str, tuple[int, int]]:
    """Progress so far: dataset -> (samples, tokens), from a dict or a frame."""
    import polars as pl

    if done is None:
        return {}
    if isinstance(done, pl.DataFrame):
        if {"samples_done", "tokens_done"} <= set(done.columns):
            return {
                r[0]: (int(r[1]), int(r[2]))
                for r in done.select("dataset", "samples_done", "tokens_done").rows()
            }
        if "completion_tokens" in done.columns:  # raw records
            agg = done.group_by("dataset").agg(pl.len(), pl.col("completion_tokens").sum())
            return {r[0]: (int(r[1]), int(r[2])) for r in agg.rows()}
        raise ConfigError(
            f"done frame needs samples_done/tokens_done or completion_tokens (columns: {done.columns})"
        )
    out = {}
    for name, pair in done.items():
        if len(pair) != 2 or min(pair) < 0:
            raise ConfigError(f"done[{name!r}] must be (samples, tokens) >= 0, got {pair!r}")
        out[name] = (int(pair[0]), int(pair[1]))
    return out


def positive(value: Any, field: str, allow_none: bool = True) -> None:
    """Raise ValueError unless value is a positive finite number (or None when allowed)."""
    if value is None and allow_none:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and value > 0):
        raise ConfigError(f"{field} must be a positive number, got {value!r}")


def check_known(budgets: dict, stats: dict, available: dict) -> None:
    """Every budgeted dataset must have samples and a prompt count."""
    for name in budgets:
        if name not in stats:
            raise ConfigError(
                f"budgets[{name!r}]: dataset has no completion samples (samples has: {sorted(stats)})"
            )
        if name not in available:
            raise ConfigError(
                f"budgets[{name!r}]: dataset not in prompts_available (has: {sorted(available)})"
            )
