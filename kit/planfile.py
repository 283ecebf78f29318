"""plan.json: the hand-over from the planning stage to the generate stage.

Re-exported as kit.plan.write_plan / read_plan / pilot_means.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from kit.pilot import PilotResult
from kit.plan import TOTAL, plan_schema
from kit.types import Budget, Sampling

if TYPE_CHECKING:
    import polars as pl


def write_plan(
    run_dir: str | Path,
    plan_frame: pl.DataFrame,
    *,
    budgets: dict[str, float] | None = None,
    sampling: Sampling | dict,
    model: str,
    sources: dict[str, str] | None = None,
    tokenizer: str | None = None,
    chat_template_hash: str | None = None,
    pilot: PilotResult | None = None,
) -> Path:
    """Write run_dir/plan.json, which the generate stage reads its budgets and settings from.

    Args:
        run_dir: the run directory (created if missing).
        plan_frame: the table from budget() (or allocate()), stored as records.
        budgets: dataset -> tokens; default: the plan's `budget` (or `tokens`) column.
        sampling: the Sampling the run will use (max_tokens included).
        model: the model name sent with requests.
        sources: dataset -> source path.
        tokenizer: local path of the target's tokenizer.
        chat_template_hash: kit.tokens.chat_template_hash of it.
        pilot: the PilotResult the plan came from (its summary is stored).

    Returns:
        The path of plan.json.

    Example:
        >>> t = budget({"a": 4000}, {"a": [10, 64, 30, 64]}, prompts_available={"a": 100})
        >>> write_plan("data/runs/demo", t, sampling=Sampling(max_tokens=64), model="m").name
        'plan.json'
    """
    sampling = sampling if isinstance(sampling, Sampling) else Sampling(**sampling)
    if budgets is None:
        budgets = _plan_budgets(plan_frame)
    budgets = {name: int(math.ceil(value)) for name, value in budgets.items()}
    Budget(tokens=budgets)
    payload = {
        "version": 1,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": model,
        "budgets": budgets,
        "max_tokens": sampling.max_tokens,
        "sampling": asdict(sampling),
        "sources": dict(sources or {}),
        "tokenizer": str(tokenizer) if tokenizer is not None else None,
        "chat_template_hash": chat_template_hash,
        "pilot": pilot.summary() if pilot is not None else None,
        "table": plan_frame.to_dicts(),
    }
    path = Path(run_dir) / "plan.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, allow_nan=False, default=str))
    os.replace(tmp, path)
    return path


def _plan_budgets(plan_frame: pl.DataFrame) -> dict[str, float]:
    """dataset -> budget from a budget() or allocate() table, without the TOTAL row."""
    column = "budget" if "budget" in plan_frame.columns else "tokens"
    if column not in plan_frame.columns or "dataset" not in plan_frame.columns:
        raise ValueError(
            f"plan_frame has no dataset/budget columns (columns: {plan_frame.columns}): pass budgets="
        )
    return {d: v for d, v in plan_frame.select("dataset", column).iter_rows() if d != TOTAL}


def read_plan(run_dir: str | Path) -> dict:
    """Read run_dir/plan.json: the stored dict, with `sampling` a Sampling and `table` a frame.

    Example:
        >>> plan = read_plan("data/runs/demo")
        >>> plan["budgets"], plan["sampling"].max_tokens
        ({'a': 4000}, 64)
    """
    import polars as pl

    path = Path(run_dir) / "plan.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"no plan at {path}: run the plan stage (kit.plan.write_plan) first"
        )
    try:
        plan = json.loads(path.read_text())
        Budget(tokens=plan["budgets"])
        plan["sampling"] = Sampling(**plan["sampling"])
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a valid plan: {exc!r}") from exc
    plan["table"] = pl.DataFrame(
        plan.get("table") or [], schema=plan_schema() if not plan.get("table") else None
    )
    return plan


def pilot_means(plan: dict) -> dict[str, float] | None:
    """dataset -> mean completion tokens from a read_plan() table: the runner's admission prior.

    Example:
        >>> pilot_means(read_plan("data/runs/demo"))
        {'alpaca_tasks': 96.4, 'essays': 241.0}
    """
    table = plan.get("table")
    if table is None or table.is_empty() or "mean" not in table.columns:
        return None
    rows = table.select("dataset", "mean").iter_rows()
    return {d: float(m) for d, m in rows if m is not None and d != TOTAL}
