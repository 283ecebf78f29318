"""plan.json: the hand-over from the planning stage to the generate stage.

The plan stores the run's RunConfig with the planned budgets and, given the prompts, the
load spec of each dataset (path, format, mapping: plan.json "sources") with the prompts
themselves in the run database (run_dir/run.sqlite), so generate needs nothing else:
not the source files, not the format or mapping they were read with, not data that only
ever lived in memory. Re-exported as kit.plan.write_plan / read_plan / plan_prompts /
run_started / pilot_means.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from kit.data.sources import LoadResult, reload
from kit.plan.estimate import TOTAL, plan_schema
from kit.plan.pilots import PilotResult
from kit.types import RunConfig

if TYPE_CHECKING:
    import polars as pl


def write_plan(
    run_dir: str | Path,
    plan_frame: pl.DataFrame,
    config: RunConfig,
    *,
    budgets: dict[str, float] | None = None,
    pilot: PilotResult | None = None,
    prompts: pl.DataFrame | LoadResult | None = None,
    server: dict | None = None,
) -> Path:
    """Write run_dir/plan.json: the planned budgets and the run's RunConfig, which the
    generate stage (02_generate, `kit generate`) reads back with read_plan().

    Args:
        run_dir: the run directory (created if missing).
        plan_frame: the table from budget() (or allocate()), stored as records.
        config: the run's settings; its budgets are replaced by the planned ones.
        budgets: dataset -> tokens; default: the plan's `budget` (or `tokens`) column.
        pilot: the PilotResult the plan came from (its summary is stored).
        prompts: the prompts to run (a prompt frame or a LoadResult). Written to
            the run database, with each dataset's load spec in plan.json
            ("sources"; config.datasets from it): kit.generate(None, config, run_dir=...)
            then runs the plan from the run directory alone. The planned budgets must
            name exactly its datasets.
        server: what the plan's endpoints are, {"embedded": bool, "engine": str | None}:
            `kit generate` starts a fresh embedded server only for a plan made on one
            (config.endpoints is then a server that is gone), else it uses the endpoints.

    Returns:
        The path of plan.json.

    Example:
        >>> import tempfile
        >>> config = kit.RunConfig(model="m", endpoints="http://127.0.0.1:8000/v1", budgets=1)
        >>> t = kit.plan.budget({"a": 4000}, {"a": [10, 64, 30, 64]}, prompts_available={"a": 100})
        >>> with tempfile.TemporaryDirectory() as run_dir:
        ...     path = write_plan(run_dir, t, config)
        ...     back = read_plan(run_dir)
        >>> path.name, back["budgets"], back["config"].budgets
        ('plan.json', {'a': 4000}, {'a': 4000})
    """
    if budgets is None:
        budgets = _plan_budgets(plan_frame)
    config = replace(config, budgets={name: int(math.ceil(v)) for name, v in budgets.items()})
    run_dir = Path(run_dir)
    specs = None
    if prompts is not None:
        frame, specs = _prompt_specs(prompts)
        config.budgets_for(list(specs))  # a plan that cannot run is refused now, not later
        config = replace(config, datasets={name: s["path"] for name, s in specs.items()})
        _write_prompts(run_dir, frame)
    payload = {
        "version": 2,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "budgets": config.budgets,
        "config": config.to_dict(),
        "sources": specs,
        "server": server,
        "pilot": pilot.summary() if pilot is not None else None,
        "table": plan_frame.to_dicts(),
    }
    path = run_dir / "plan.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, allow_nan=False, default=str))
    os.replace(tmp, path)
    return path


def _prompt_specs(prompts) -> tuple[pl.DataFrame, dict[str, dict]]:
    """(prompts, dataset -> load spec) of a LoadResult (kept as it is: its prompts are
    stored a part at a time) or a frame (in-memory specs)."""
    import polars as pl

    from kit.data.sources import LoadResult

    frame = prompts.scan() if isinstance(prompts, LoadResult) else prompts
    if not isinstance(frame, pl.DataFrame | pl.LazyFrame):
        raise ValueError(
            f"prompts must be a prompt frame or a LoadResult, got {type(prompts).__name__}"
        )
    found = frame.collect_schema().names()
    if missing := {"dataset", "prompt_id", "messages"} - set(found):
        raise ValueError(
            f"prompts lacks columns {sorted(missing)}; found {found}: pass kit.load(...)"
        )
    names = (
        frame.lazy().select("dataset").unique(maintain_order=True).collect()["dataset"].to_list()
    )
    if not names:
        raise ValueError("prompts holds no prompt: nothing to plan a run for")
    known = getattr(prompts, "specs", {})
    specs = {
        name: dict(known.get(name, {"path": "", "format": None, "mapping": None})) for name in names
    }
    for spec in specs.values():  # absolute: generate may run from another directory
        spec["path"] = str(Path(spec["path"]).absolute()) if spec["path"] else ""
    return prompts, specs


def _write_prompts(run_dir: Path, frame) -> None:
    """The plan's prompts into the run database (kit.run.store.store_prompts, under the
    writer's lock); refused over a started run with other prompts."""
    from kit.run.store import store_prompts

    store_prompts(run_dir, frame)


def _plan_budgets(plan_frame: pl.DataFrame) -> dict[str, float]:
    """dataset -> budget from a budget() or allocate() table, without the TOTAL row."""
    column = "budget" if "budget" in plan_frame.columns else "tokens"
    if column not in plan_frame.columns or "dataset" not in plan_frame.columns:
        raise ValueError(
            f"plan_frame has no dataset/budget columns (columns: {plan_frame.columns}): pass budgets="
        )
    return {d: v for d, v in plan_frame.select("dataset", column).iter_rows() if d != TOTAL}


def read_plan(run_dir: str | Path) -> dict:
    """Read run_dir/plan.json: `budgets`, `config` (a RunConfig), `sources` (dataset -> load
    spec, None when the plan was written without prompts), `server` ({"embedded",
    "engine"}, or None), `pilot`, `table` (a frame).

    A plan.json from before version 2 (no "config") is refused: make it again.

    Example (see write_plan for one that runs):
        plan = read_plan("data/runs/demo")
        plan["config"].budgets == plan["budgets"]   # True: the config carries the plan
    """
    import polars as pl

    path = Path(run_dir) / "plan.json"
    if not path.is_file():
        raise FileNotFoundError(f"no plan at {path}: run the plan stage (kit plan, 01_plan) first")
    try:
        plan = json.loads(path.read_text())
        plan["config"] = RunConfig.from_dict(plan["config"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"{path} is not a valid plan (make it again with kit plan): {exc}"
        ) from exc
    table = plan.get("table")
    plan["table"] = pl.DataFrame(table) if table else pl.DataFrame(schema=plan_schema())
    plan.setdefault("sources", None)
    plan.setdefault("server", None)  # plans made before it say nothing of their server
    return plan


def plan_prompts(run_dir: str | Path, plan: dict | None = None) -> LoadResult | None:
    """The `prompts` argument of kit.generate for the plan in run_dir: None when the run
    directory holds stored prompts (generate runs those: a plan written with prompts=,
    or a run under way), else the plan's datasets loaded again from their specs (or from
    config.datasets for a plan that has none).

    Example (02_generate, `kit generate`):
        plan = kit.plan.read_plan(run_dir)
        prompts = kit.plan.plan_prompts(run_dir, plan)
        run = await kit.generate(prompts, plan["config"], run_dir=run_dir)
    """
    from kit.run.reader import has_prompts

    if has_prompts(run_dir):
        return None
    plan = plan if plan is not None else read_plan(run_dir)
    specs = plan.get("sources") or {
        name: {"path": path, "format": None, "mapping": None}
        for name, path in plan["config"].datasets.items()
    }
    if not specs:
        raise ValueError(
            f"{Path(run_dir) / 'plan.json'} records no prompts and {run_dir} has no "
            "stored prompts: write the plan with prompts= (kit.plan.write_plan)"
        )
    return reload(specs)


def run_started(run_dir: str | Path) -> bool:
    """True when a run has started in run_dir (its database holds the run's config), so
    generate resumes it; False for a plan alone or an empty directory.

    Example: kit.plan.run_started("data/runs/demo") -> True after 02_generate's first run
    """
    from kit.run.reader import read_config

    try:
        read_config(run_dir)
    except FileNotFoundError:
        return False
    return True


def pilot_means(plan: dict) -> dict[str, float] | None:
    """dataset -> mean completion tokens from a read_plan() table: the runner's admission prior.

    Example:
        >>> t = kit.plan.budget({"a": 4000}, {"a": [10, 64, 30, 64]}, prompts_available={"a": 100})
        >>> pilot_means({"table": t})
        {'a': 42.0}
    """
    table = plan.get("table")
    if table is None or table.is_empty() or "mean" not in table.columns:
        return None
    rows = table.select("dataset", "mean").iter_rows()
    return {d: float(m) for d, m in rows if m is not None and d != TOTAL}
