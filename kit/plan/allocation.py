"""allocate(): budgets the other way round, from hours and throughput to tokens per dataset.

A dataset never gets more than its prompts can give; what it cannot take goes to the
others (water-filling). Input checks are budget()'s (kit.plan.inputs).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

from kit.errors import ConfigError
from kit.plan import inputs
from kit.plan.estimate import TOTAL
from kit.plan.lengths import profile

if TYPE_CHECKING:
    import polars as pl


def allocate(
    hours: float,
    throughput: float,
    samples: Any,
    prompts_available: dict[str, int] | pl.DataFrame,
    split: Literal["equal", "proportional"] = "equal",
    weights: dict[str, float] | None = None,
) -> pl.DataFrame:
    """Tokens each dataset can get in `hours` at `throughput` tokens/s of the whole run, as
    "equal" shares or "proportional" to `weights` (default: to what each dataset's prompts
    can give, prompts_available x mean); `samples` and `prompts_available` as for budget().
    One row per dataset plus "TOTAL".

    Example:
        >>> allocate(1, 100, {"a": [100], "b": [100]}, {"a": 10, "b": 10_000}).select("dataset", "tokens").rows()
        [('a', 1000), ('b', 359000), ('TOTAL', 360000)]
    """
    import polars as pl

    inputs.positive(hours, "hours", allow_none=False)
    inputs.positive(throughput, "throughput", allow_none=False)
    stats = {r["dataset"]: r for r in profile(inputs.samples_frame(samples)).iter_rows(named=True)}
    available = inputs.counts(prompts_available, "prompts_available")
    inputs.check_known(dict.fromkeys(stats), stats, available)
    caps = {name: available[name] * stats[name]["mean"] for name in stats}
    w = _weights(split, weights, caps)
    given = _water_fill(hours * 3600 * throughput, caps, w)
    rows = []
    for name in sorted(stats):
        tokens, mean = int(given[name]), stats[name]["mean"]
        needed = math.ceil(tokens / mean) if mean > 0 else None
        capped = given[name] >= caps[name] - 1e-6
        row = (name, w[name], tokens, needed, available[name], caps[name], capped)
        rows.append((*row, tokens / throughput / 3600))
    schema = {"dataset": pl.String, "weight": pl.Float64, "tokens": pl.Int64}
    schema |= {"samples_needed": pl.Int64, "prompts_available": pl.Int64}
    schema |= {"max_tokens_available": pl.Float64, "capped": pl.Boolean, "hours": pl.Float64}
    table = pl.DataFrame(rows, schema=schema, orient="row")
    total = table.sum().with_columns(dataset=pl.lit(TOTAL), capped=table["capped"].all())
    return pl.concat([table, total.select(table.columns).cast(schema)])


def _weights(split: str, weights: dict | None, caps: dict[str, float]) -> dict[str, float]:
    """Validated weights per dataset for allocate()."""
    if split not in ("equal", "proportional"):
        raise ConfigError(f"split must be 'equal' or 'proportional', got {split!r}")
    if split == "equal":
        if weights is not None:
            raise ConfigError("weights= needs split='proportional'")
        return dict.fromkeys(caps, 1.0)
    if weights is None:
        return dict(caps)
    for name, value in weights.items():
        if name not in caps:
            raise ConfigError(
                f"weights[{name!r}]: dataset has no completion samples (samples has: {sorted(caps)})"
            )
        inputs.positive(value, f"weights[{name!r}]", allow_none=False)
    return {name: float(weights.get(name, 0.0)) for name in caps}


def _water_fill(
    total: float, caps: dict[str, float], weights: dict[str, float]
) -> dict[str, float]:
    """Split total by weights, never past a cap; what a capped one cannot take goes to the rest."""
    given = dict.fromkeys(caps, 0.0)
    active = {name for name in caps if weights[name] > 0 and caps[name] > 0}
    while active and total > 1e-9:
        scale = total / sum(weights[name] for name in active)
        full = {name for name in active if weights[name] * scale >= caps[name] - given[name]}
        if not full:
            for name in active:
                given[name] += weights[name] * scale
            break
        for name in full:
            total -= caps[name] - given[name]
            given[name] = caps[name]
        active -= full
    return given
