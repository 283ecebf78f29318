"""The plan in the run database: the hand-over from the planning stage to the generate stage.

write_plan stores the planned budgets, the pilot's summary, the plan table, each dataset's
load spec and the server the plan was made on (run.sqlite's `plan` and `plan_rows`), its
RunConfig as the run's config row (fingerprint '' until a run starts), and the prompts;
generate then needs nothing else. The pilot is stored whole (its rows, failures and what it
was made with), so stored_pilot can hand it to the next plan of the same model, sampling and
server without a request. A plan.json of an older kit is imported once, then renamed
plan.json.imported. Re-exported as kit.plan.write_plan / read_plan / show_plan /
plan_prompts / run_started / pilot_means / stored_pilot.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from kit.data.sources import LoadResult, reload
from kit.errors import ConfigError, MissingPath
from kit.plan.estimate import TOTAL, plan_schema
from kit.plan.pilots import PILOT_PER_DATASET, PilotResult, pilot_frame, pilot_size
from kit.plan.value import join_value, value_text
from kit.plan.value import schema as value_schema
from kit.run import db
from kit.run.reader import config_doc, has_prompts, is_run_dir, open_db
from kit.run.store import store_prompts
from kit.types import RunConfig

if TYPE_CHECKING:
    import polars as pl

_PLAN_FIELDS = ("created", "budgets", "sources", "server", "pilot")


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
    """Store the plan in run_dir's database, which generate (02_generate, `kit generate`,
    kit.resume) reads back with read_plan().

    Args:
        run_dir: the run directory (created if missing).
        plan_frame: the table from budget() (or allocate()), stored row by row.
        config: the run's settings; its budgets are replaced by the planned ones. Over a
            started run it must keep the run's fingerprint (else ValueError).
        budgets: dataset -> tokens; default: the plan's `budget` (or `tokens`) column.
        pilot: the PilotResult the plan came from (its summary is stored).
        prompts: the prompts to run (a prompt frame or a LoadResult), stored with each
            dataset's load spec (config.datasets from it): generate then runs the plan from
            the run directory alone. The planned budgets must name exactly its datasets.
        server: {"embedded": bool, "engine": str | None}: generate starts a fresh embedded
            server only for a plan made on one, else it uses config.endpoints.

    Returns:
        The path of the run database.

    Example:
        >>> import tempfile
        >>> config = kit.RunConfig(model="m", endpoints="http://127.0.0.1:8000/v1", budgets=1)
        >>> t = kit.plan.budget({"a": 4000}, {"a": [10, 64, 30, 64]}, prompts_available={"a": 100})
        >>> with tempfile.TemporaryDirectory() as run_dir:
        ...     path = write_plan(run_dir, t, config)
        ...     back = read_plan(run_dir)
        >>> path.name, back["budgets"], back["config"].budgets
        ('run.sqlite', {'a': 4000}, {'a': 4000})
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
        store_prompts(run_dir, frame)  # under the writer's lock: refused while a run writes
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    plan = [created, config.budgets, specs, server, _pilot_doc(pilot, config, server)]
    rows = join_value(plan_frame, pilot.value if pilot else None)  # the regeneration value
    _store(run_dir, plan, rows.to_dicts(), config)
    return db.db_path(run_dir)


def _store(run_dir: Path, plan: list, rows: list[dict], config: RunConfig | None) -> None:
    """Replace the plan (values in _PLAN_FIELDS order) and its table in one transaction, and
    the config row (None: keep it)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    conn = db.connect(run_dir, write=True)
    try:
        conn.execute("BEGIN IMMEDIATE")
        if config is not None:
            fingerprint, config = _planned_config(conn, config, run_dir)
            conn.execute(
                "INSERT OR REPLACE INTO config VALUES (1, ?, ?)",
                (fingerprint, _json(config.to_dict())),
            )
        conn.execute(
            "INSERT OR REPLACE INTO plan VALUES (1, ?, ?, ?, ?, ?)",
            [plan[0], *(None if v is None else _json(v) for v in plan[1:])],
        )
        conn.execute("DELETE FROM plan_rows")
        conn.executemany("INSERT INTO plan_rows VALUES (?, ?)", enumerate(map(_json, rows)))
        conn.execute("COMMIT")
    finally:
        conn.close()  # a transaction left open is rolled back


def _made_with(sampling, config: RunConfig, server: dict | None) -> dict:
    """What a pilot's lengths depend on: the model (kit's own for an embedded server), the
    server (an embedded engine, or the endpoints and their api), sampling and turns."""
    if server and server.get("embedded"):
        where = {"model": "the embedded model", "server": f"embedded {server.get('engine')}"}
    else:
        urls = config.to_dict()["endpoints"]  # without credentials
        where = {"model": config.model, "server": f"{', '.join(urls)} ({config.api} api)"}
    return {**where, "sampling": asdict(sampling), "turns": config.turns}


def _value_frame(rows: list[dict] | None) -> pl.DataFrame | None:
    """A stored pilot's regeneration value (PilotResult.summary()["value"]) as its frame."""
    import polars as pl

    return pl.DataFrame(rows, schema=value_schema()) if rows else None


def _pilot_doc(pilot: PilotResult | None, config: RunConfig, server: dict | None) -> dict | None:
    """The pilot as stored: its summary, what it was made with, its rows and failures."""
    if pilot is None:
        return None
    return {
        **pilot.summary(),
        "made_with": _made_with(pilot.sampling, config, server),
        "rows": pilot.frame.to_dict(as_series=False),
        "failed": pilot.errors,
    }


def stored_pilot(
    run_dir: str | Path,
    prompts: pl.DataFrame | LoadResult,
    config: RunConfig,
    *,
    per_dataset: int | float | dict[str, int] = PILOT_PER_DATASET,
    server: dict | None = None,
) -> tuple[PilotResult | None, RunConfig, str]:
    """The pilot stored with the plan in run_dir, when it measured what a new pilot would:
    the same model, sampling and turns on the same server (an embedded one of the same
    engine, or the same endpoints and api), at least as many prompts per dataset as
    `per_dataset` picks, and every dataset of `prompts` with completions of its prompts.

    Args:
        run_dir: the run directory of an earlier plan (kit plan, 01_plan).
        prompts: the prompts to plan (a prompt frame or a LoadResult).
        config: the run's settings (for an embedded server, before it starts: its model
            and endpoints are not compared).
        per_dataset: the pilot size asked for (see pilot_sample).
        server: {"embedded": bool, "engine": str | None}, as for write_plan.

    Returns:
        (pilot, config, why): the stored PilotResult or None; config, with the stored plan's
        model, endpoints, api and tokenizer (unless given) when an embedded plan's pilot is
        reused; one line saying why it is reused, or why not.

    Example (kit plan does this before it starts a server):
        pilot, config, why = kit.plan.stored_pilot("data/runs/demo", loaded, config)
        print(why)   # reusing the pilot stored in data/runs/demo (240 completions ...)
    """

    try:
        plan = read_plan(run_dir)
    except FileNotFoundError:
        return None, config, f"no pilot stored in {run_dir}"
    doc = plan["pilot"] or {}
    if "rows" not in doc or "made_with" not in doc:
        return None, config, f"{run_dir} holds no stored pilot (made by an older kit)"
    frame = pilot_frame(doc["rows"])
    why = _why_not(doc, frame, prompts, config, per_dataset, server)
    if why:
        return None, config, f"the pilot stored in {run_dir} is not reused: {why}"
    pilot = PilotResult(
        frame=frame,
        wall_s=doc["wall_s"],
        sampling=config.sampling,
        errors=doc["failed"],
        concurrency=doc["concurrency"],
        chosen=doc["chosen"],
        value=_value_frame(doc.get("value")),
    )
    if server and server.get("embedded"):
        old = plan["config"]
        tokenizer = config.tokenizer or old.tokenizer
        config = replace(
            config, model=old.model, endpoints=old.endpoints, api=old.api, tokenizer=tokenizer
        )
    return (
        pilot,
        config,
        (
            f"reusing the pilot stored in {run_dir} ({frame.height} completions, "
            f"{len(pilot.errors)} failed; made {plan['created']} with the same model, sampling and "
            "server): no request sent"
        ),
    )


def _why_not(doc, frame, prompts, config, per_dataset, server) -> str:
    """Why the stored pilot does not answer for this plan ("" when it does)."""
    then, now = doc["made_with"], _made_with(config.sampling, config, server)
    changed = [
        f"{key} {then.get(key)!r} -> {now[key]!r}"
        for key in ("model", "server", "turns")
        if then.get(key) != now[key]
    ]
    old_s, new_s = then.get("sampling") or {}, now["sampling"]
    changed += [
        f"sampling.{k} {old_s.get(k)!r} -> {new_s[k]!r}" for k in new_s if old_s.get(k) != new_s[k]
    ]
    if changed:
        return "it was made with another " + ", ".join(changed)
    frame_keys = _prompt_keys(prompts)
    available = dict(frame_keys.group_by("dataset").len().iter_rows())
    chosen, got = doc["chosen"], set(frame["dataset"].unique())
    for name, count in sorted(available.items()):
        want = pilot_size(per_dataset, name, count)
        if name not in got:
            return f"it has no completion of dataset {name!r}"
        if want > chosen.get(name, 0):
            return f"{want} prompts of {name!r} asked, it sent {chosen.get(name, 0)}"
    piloted = frame.filter(frame["dataset"].is_in(list(available))).select("dataset", "prompt_id")
    gone = piloted.unique().join(frame_keys, on=["dataset", "prompt_id"], how="anti").height
    if gone:
        return f"{gone} of the prompts it measured are no longer among the prompts"
    return ""


def _prompt_keys(prompts) -> pl.DataFrame:
    """(dataset, prompt_id) of a prompt frame or a LoadResult (read without the texts)."""
    frame = prompts.scan() if isinstance(prompts, LoadResult) else prompts.lazy()
    return frame.select("dataset", "prompt_id").collect()


def _json(value) -> str:
    return json.dumps(value, allow_nan=False, default=str)


def _planned_config(conn, config: RunConfig, run_dir: Path) -> tuple[str, RunConfig]:
    """(fingerprint, config) of the config row: ('', config) before a run; over a started
    run, the run's fingerprint and what the run found (its prompts' and chat template's
    hashes), or ValueError when config would change what the fingerprint covers."""
    row = conn.execute("SELECT fingerprint, doc FROM config").fetchone()
    if not row or not row[0]:
        return "", config
    run = RunConfig.from_dict(json.loads(row[1]))
    config = replace(
        config, source_hashes=run.source_hashes, chat_template_hash=run.chat_template_hash
    )
    old, new = run.fingerprint_parts(), config.fingerprint_parts()
    if changed := sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k)):
        raise ConfigError(
            f"{run_dir} holds a run made with another {', '.join(changed)}: write this plan "
            "into a new run directory"
        )
    return row[0], config


def _prompt_specs(prompts) -> tuple[pl.DataFrame, dict[str, dict]]:
    """(prompts, dataset -> load spec) of a LoadResult (kept as it is: its prompts are
    stored a part at a time) or a frame (in-memory specs)."""
    import polars as pl

    frame = prompts.scan() if isinstance(prompts, LoadResult) else prompts
    if not isinstance(frame, pl.DataFrame | pl.LazyFrame):
        raise ConfigError(
            f"prompts must be a prompt frame or a LoadResult, got {type(prompts).__name__}"
        )
    found = frame.collect_schema().names()
    if missing := {"dataset", "prompt_id", "messages"} - set(found):
        raise ConfigError(
            f"prompts lacks columns {sorted(missing)}; found {found}: pass kit.load(...)"
        )
    names = (
        frame.lazy().select("dataset").unique(maintain_order=True).collect()["dataset"].to_list()
    )
    if not names:
        raise ConfigError("prompts holds no prompt: nothing to plan a run for")
    known = getattr(prompts, "specs", {})
    specs = {
        name: dict(known.get(name, {"path": "", "format": None, "mapping": None})) for name in names
    }
    for spec in specs.values():  # absolute: generate may run from another directory
        spec["path"] = str(Path(spec["path"]).absolute()) if spec["path"] else ""
    return prompts, specs


def _plan_budgets(plan_frame: pl.DataFrame) -> dict[str, float]:
    """dataset -> budget from a budget() or allocate() table, without the TOTAL row."""
    column = "budget" if "budget" in plan_frame.columns else "tokens"
    if column not in plan_frame.columns or "dataset" not in plan_frame.columns:
        raise ConfigError(
            f"plan_frame has no dataset/budget columns (columns: {plan_frame.columns}): pass budgets="
        )
    return {d: v for d, v in plan_frame.select("dataset", column).iter_rows() if d != TOTAL}


def _import_plan_json(run_dir: Path) -> None:
    """Store the plan.json of an older kit in the run database once, then rename it
    plan.json.imported; over a started run the run's config is kept."""
    path = run_dir / "plan.json"
    if not path.is_file():
        return
    try:
        doc = json.loads(path.read_text())
        config = RunConfig.from_dict(doc["config"])
        plan = [doc.get("created") or "", doc["budgets"], *map(doc.get, _PLAN_FIELDS[2:])]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"{path} is not a valid plan (make it again with kit plan): {exc}"
        ) from exc
    _store(run_dir, plan, doc.get("table") or [], None if run_started(run_dir) else config)
    path.rename(path.with_name("plan.json.imported"))


def read_plan(run_dir: str | Path) -> dict:
    """The plan stored in run_dir: `created`, `budgets` (as planned), `config` (the run's
    RunConfig), `sources` (dataset -> load spec, None when the plan was written without
    prompts), `server` ({"embedded", "engine"}, or None), `pilot`, `table` (a frame).

    Example (see write_plan for one that runs):
        plan = read_plan("data/runs/demo")
        plan["config"].budgets == plan["budgets"]   # True until a run changes its budgets
    """
    import polars as pl

    run_dir = Path(run_dir)
    _import_plan_json(run_dir)
    row, rows, doc = None, [], None
    if is_run_dir(run_dir):
        with open_db(run_dir) as conn:
            row = conn.execute(f"SELECT {', '.join(_PLAN_FIELDS)} FROM plan").fetchone()
            rows = [
                json.loads(r)
                for (r,) in conn.execute("SELECT row FROM plan_rows ORDER BY position")
            ]
            doc = config_doc(conn)
    if row is None or doc is None:
        raise MissingPath(f"no plan at {run_dir}: run the plan stage (kit plan, 01_plan) first")
    plan = {
        "created": row[0],
        **{k: json.loads(v) if v else None for k, v in zip(_PLAN_FIELDS[1:], row[1:], strict=True)},
    }
    plan["config"] = RunConfig.from_dict(doc)
    plan["table"] = pl.DataFrame(rows) if rows else pl.DataFrame(schema=plan_schema())
    return plan


def show_plan(run_dir: str | Path) -> str:
    """The stored plan as text (`kit plan --show RUN_DIR`): when it was made, its server,
    each dataset's budget and pilot mean, the regeneration value, the run's config.

    Example: print(kit.plan.show_plan("data/runs/demo"))
    """
    plan = read_plan(run_dir)
    config, server, means = plan["config"], plan["server"], pilot_means(plan) or {}
    if server is None:
        where = "not recorded (embedded when the model is the embedded one)"
    elif server.get("embedded"):
        where = f"embedded ({server.get('engine') or 'the api says which engine'})"
    else:
        where = "remote at " + ", ".join(config.endpoints)
    state = "a run has started" if run_started(run_dir) else "no run yet"
    lines = [f"plan in {run_dir}, made {plan['created']} ({state})", f"server: {where}"]
    lines.append(f"  {'dataset':<28}{'budget':>14}{'pilot mean':>12}")
    for name, tokens in plan["budgets"].items():
        mean = f"{means[name]:.1f}" if name in means else "-"
        lines.append(f"  {name:<28}{tokens:>14,}{mean:>12}")
    if (plan["pilot"] or {}).get("value"):
        import polars as pl

        lines.append(value_text(pl.DataFrame(plan["pilot"]["value"], schema=value_schema())))
    lines.append("config: " + json.dumps(config.to_dict(), indent=2))
    return "\n".join(lines)


def plan_prompts(run_dir: str | Path, plan: dict | None = None) -> LoadResult | None:
    """The `prompts` argument of kit.generate for the plan in run_dir: None when the run
    directory holds stored prompts (generate runs those: a plan written with prompts=,
    or a run under way), else the plan's datasets loaded again from their specs (or from
    config.datasets for a plan that has none).

    Example (kit.resume does this):
        plan = kit.plan.read_plan(run_dir)
        prompts = kit.plan.plan_prompts(run_dir, plan)
        run = await kit.generate(prompts, plan["config"], run_dir=run_dir)
    """
    if has_prompts(run_dir):
        return None
    plan = plan if plan is not None else read_plan(run_dir)
    specs = plan.get("sources") or {
        name: {"path": path, "format": None, "mapping": None}
        for name, path in plan["config"].datasets.items()
    }
    if not specs:
        raise ConfigError(
            f"the plan in {run_dir} records no prompts and {run_dir} has no stored prompts: "
            "write the plan with prompts= (kit.plan.write_plan)"
        )
    return reload(specs)


def run_started(run_dir: str | Path) -> bool:
    """True when a run has started in run_dir (its config row holds the run's fingerprint),
    so generate resumes it; False for a plan alone or an empty directory.

    Example: kit.plan.run_started("data/runs/demo") -> True after 02_generate's first run
    """
    if not is_run_dir(run_dir):
        return False
    with open_db(run_dir) as conn:
        row = conn.execute("SELECT fingerprint FROM config").fetchone()
    return bool(row and row[0])


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
