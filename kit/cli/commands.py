"""The `kit` subcommands over the package: plan, generate, audit, records, export, watch,
prepare, serve.

`kit plan` builds one kit.RunConfig from its flags, pilots and stores the plan (with that
config) in the run database; `kit generate` runs or resumes it through planned_run, the one
resume path (also kit.resume and 02_generate), with only the flags given changed. A user
error raises ValueError / FileNotFoundError with the fix in its message.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

from kit.errors import MissingPath, UsageError

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "data" / "samples"


# ----------------------------------------------------------------------------- flags


def parse_budgets(values: list[str]) -> int | dict[str, int]:
    """["1e7"] -> 10000000 (every dataset); ["a=5000", "b=2000"] -> {"a": 5000, "b": 2000}."""
    tokens, hidden = parse_plan_budgets(values)
    if hidden:
        raise UsageError(
            f"--budget: {values} holds bytes of hidden states; only kit plan converts them to "
            "tokens (from its pilot's prompt and completion lengths): give tokens here"
        )
    return tokens


def parse_plan_budgets(values: list[str]) -> tuple[int | dict[str, int], int | dict[str, int]]:
    """(token budgets, hidden-state byte budgets) of kit plan's --budget: a value with a byte
    unit ("2TB", "500GiB") is bytes of hidden states; the token side holds 1 for those until
    the pilot converts them. ["2TB"] -> (1, 2000000000000); ["a=1e6", "b=1GB"] -> ({"a":
    1000000, "b": 1}, {"b": 1000000000})."""
    from kit.plan.hidden import parse_bytes

    if len(values) == 1 and "=" not in values[0]:
        hidden = parse_bytes(values[0])
        return (1, hidden) if hidden else (_tokens("--budget", values[0]), {})
    tokens, hidden = {}, {}
    for item in values:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise UsageError(
                f"--budget takes TOKENS (one number for every dataset) or NAME=TOKENS ..., got {item!r}"
            )
        if size := parse_bytes(value):
            tokens[name], hidden[name] = 1, size
        else:
            tokens[name] = _tokens(f"--budget {name}", value)
    return tokens, hidden


def parse_mapping(text: str | None) -> dict | None:
    """--mapping JSON -> the `mapping=` of kit.load (None when not given)."""
    if text is None:
        return None
    try:
        mapping = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--mapping must be a JSON object, got {text!r} ({e.msg})") from None
    if not isinstance(mapping, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()
    ):
        raise UsageError(
            f'--mapping must map field names to column names, e.g. {{"prompt": "question"}}; got {text!r}'
        )
    return mapping


def _named(item: str) -> tuple[str | None, str]:
    """'NAME=VALUE' -> (NAME, VALUE); a value alone (JSON, a format) -> (None, it)."""
    name, sep, value = item.partition("=")
    if sep and name and not name.lstrip().startswith(("{", "[")):
        return name.strip(), value
    return None, item


def parse_mappings(values: list[str] | None) -> dict | None:
    """--mapping values -> kit.load's mapping=: one JSON mapping for every source, or
    NAME=JSON for each dataset (a dataset is named by its file's stem).

    Example:
        >>> parse_mappings(['gsm8k={"prompt": "question"}', 'humaneval={"prompt": "prompt"}'])
        {'gsm8k': {'prompt': 'question'}, 'humaneval': {'prompt': 'prompt'}}
    """
    return _one_or_each("--mapping", "JSON", values, parse_mapping)


def parse_formats(values: list[str] | None) -> str | dict | None:
    """--format values -> kit.load's format=: FORMAT for every source, or NAME=FORMAT each."""
    from kit.data.formats import FORMATS

    def check(fmt: str) -> str:
        if fmt not in FORMATS:
            raise UsageError(f"--format takes one of {FORMATS} (or NAME=FORMAT), got {fmt!r}")
        return fmt

    return _one_or_each("--format", "FORMAT", values, check)


def _one_or_each(flag: str, what: str, values: list[str] | None, parse):
    """parse(VALUE) of a flag's one VALUE for every source, or {NAME: parse(VALUE)} of its
    NAME=VALUE for each dataset; None when not given."""
    if not values:
        return None
    pairs = [_named(v) for v in values]
    if len(pairs) == 1 and pairs[0][0] is None:
        return parse(pairs[0][1])
    if any(name is None for name, _ in pairs):
        raise UsageError(
            f"{flag} takes one {what} for every source, or NAME={what} for each dataset, "
            f"not both; got {values}"
        )
    return {name: parse(value) for name, value in pairs}


def _tokens(flag: str, value: str) -> int:
    """A positive token count from '5000' or '1e7'."""
    try:
        tokens = float(value)
    except ValueError:
        tokens = math.nan
    if not (math.isfinite(tokens) and tokens >= 1):
        raise UsageError(
            f"{flag}: expected a positive number of tokens (or, for kit plan, bytes of hidden "
            f"states such as 2TB), got {value!r}"
        )
    return int(tokens)


def known_names(flag: str, given, known, where: str = "") -> None:
    """UsageError naming the flag, each name of `given` not in `known` and the closest known
    one: `--budget: no dataset 'mbp' (did you mean 'mbpp'?)`."""
    known = sorted(known)
    lines = []
    for name in [n for n in given if n not in known]:
        close = difflib.get_close_matches(name, known, n=1)
        listed = ", ".join(known[:12]) + (", ..." if len(known) > 12 else "")
        hint = f"did you mean {close[0]!r}?" if close else f"the datasets are: {listed}"
        lines.append(f"no dataset {name!r}{where} ({hint})")
    if lines:
        raise UsageError(f"{flag}: " + "; ".join(lines))


def _budget_names(budgets, names: list[str]) -> None:
    """--budget NAME=TOKENS must name exactly the datasets loaded (one number: all of them)."""
    if not isinstance(budgets, dict):
        return
    known_names("--budget", budgets, names)
    if missing := [n for n in names if n not in budgets]:
        raise UsageError(
            f"--budget gives no budget for datasets {missing}: give NAME=TOKENS for each "
            "dataset, or one number for all"
        )


def _merged_budgets(planned, given):
    """The plan's budgets with --budget applied: one number replaces all, NAME=TOKENS one each."""
    if isinstance(given, int) or not isinstance(planned, dict):
        return given
    known_names("--budget", given, planned, " in the plan")
    return {**planned, **given}


def _sample_names(samples: list[str], formats, mappings, args) -> None:
    """Before any loading: every --samples path exists, and the NAMEs of --format and
    --mapping NAME=... are datasets of them (a dataset is named by its file's stem)."""
    from kit.data.inputs import sources

    for path in samples:
        if not Path(path).exists() and not Path(path).is_symlink():  # the loader names a bad link
            raise MissingPath(f"--samples: {path} does not exist")
    names = [name for name, _ in sources(samples, None)[0]]
    if isinstance(formats, dict):
        known_names("--format", formats, names)
    if args.mapping and _named(args.mapping[0])[0] is not None:
        known_names("--mapping", mappings, names)


def _run_changes(args) -> dict:
    """RunConfig fields from the flags the user gave (None: not given, keep the plan's)."""
    names = ("model", "tokenizer", "api", "api_key_env", "concurrency", "policy", "timeout")
    names += ("max_body_bytes",)
    changes = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.base_url:
        changes["endpoints"] = list(args.base_url)
    return changes


# ---------------------------------------------------------------------------- server


def _is_embedded(model: str) -> bool:
    """True when `model` is a model folder under data/models (the embedded server's name)."""
    from kit.serve import models_root

    try:
        return Path(model).resolve().is_relative_to(models_root().resolve())
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _embedded(config, *, start: bool, engine: str | None = None):
    """Yield config, pointed at a freshly started embedded server when `start`.

    engine: "transformers" or "vllm"; None: the engine the plan was made on, which its api
    says (the embedded vLLM gives api "vllm", `transformers serve` api "openai").
    """
    if not start:
        yield config
        return
    from kit import serve

    if engine is None:
        engine = "vllm" if config.api == "vllm" else "transformers"
    model_dir = config.model if _is_embedded(config.model) else None
    print(f"starting the embedded server ({engine}) ...", file=sys.stderr, flush=True)
    s = config.sampling
    with serve.start(model_dir, temperature=s.temperature, top_p=s.top_p, engine=engine) as server:
        print(f"embedded server at {server.base_url}", file=sys.stderr, flush=True)
        yield replace(
            config,
            endpoints=[server.base_url],
            model=server.model,
            api=server.api,
            tokenizer=config.tokenizer or server.tokenizer_path,
        )


def _table(frame) -> str:
    """A polars frame as text: every row and column, no shape line."""
    import polars as pl

    with pl.Config(tbl_rows=100, tbl_cols=-1, tbl_width_chars=200, tbl_hide_dataframe_shape=True):
        return str(frame)


# ------------------------------------------------------------------------------ plan


def plan_run(
    loaded,
    config,
    run_dir,
    *,
    per_dataset=30,
    throughput=None,
    sample_cap=None,
    server=None,
    servers=None,
    hidden=None,
    target_config=None,
    pilot=None,
):
    """Profile prompts, pilot (unless `pilot`, a stored one, is given), plan the budgets
    (timed on `servers` endpoints) and store the plan (with `config` and `server`: whether
    its endpoints are an embedded server this command started). `hidden`: dataset -> bytes
    of hidden states (or one number for all), converted to completion tokens from the
    pilot; `target_config`: the target's config.json or folder (default: the tokenizer's
    folder when it holds one)."""
    from kit import plan
    from kit.plan import hidden as hs
    from kit.report.monitor import ConsoleMonitor
    from kit.report.widgets import summary_text

    shape = hs.shape_for(target_config, config.tokenizer, needed=bool(hidden))

    names = sorted(name for name, n in loaded.prompts.items() if n)
    budgets = config.budgets_for(names)
    if config.tokenizer:  # the prompts are read a part at a time, here and below
        print(_table(plan.profile_prompts(loaded, config.tokenizer)))
    result = pilot
    if result is None:
        print(f"pilot: up to {per_dataset} prompts per dataset ...", file=sys.stderr, flush=True)
        with ConsoleMonitor() as progress:
            result = plan.pilot_sync(loaded, config, per_dataset=per_dataset, progress=progress)
    if result.errors:
        print(f"pilot: {len(result.errors)} requests failed, first: {result.errors[0]}")
    _pilot_answered(result, names)
    print(_table(result.profile()))
    if result.value is not None:
        from kit.plan.value import value_text

        print(value_text(result.value))
    for url, measured in result.per_endpoint.items():
        print(
            f"pilot throughput at {url}: {measured.tokens_per_s:,.1f} tok/s "
            f"({measured.concurrency} in flight)"
        )
    if hidden:
        budgets, lines = hs.convert_budgets(budgets, hidden, result, shape)
        print("\n".join(lines))
        config = replace(config, budgets=budgets)
    table = plan.budget(
        budgets,
        result,
        prompts_available=loaded,
        throughput=throughput or result.throughput,
        concurrency=config.concurrency,
        sample_cap=sample_cap,
        servers=servers,
    )
    print(summary_text(table))
    if shape is not None:
        print(hs.hidden_text(hs.hidden_states(table, result, shape), shape))
    else:
        print(
            "hidden states: no target config.json known (give --target-config PATH to see "
            "the disk an offline EAGLE-3 dump of this plan takes)"
        )
    path = plan.write_plan(run_dir, table, config, pilot=result, prompts=loaded, server=server)
    print(f"plan written: {path}")
    return path


def _pilot_answered(result, names: list[str]) -> None:
    """UsageError when a dataset got no completion: how many of its requests failed, the
    first error (stored redacted), why the pilot's run stopped."""
    if not (missing := sorted(set(names) - set(result.frame["dataset"].unique().to_list()))):
        return
    failed = [e for e in result.errors if e.split("/", 1)[0] in missing]
    sent = sum(result.chosen.get(d, 0) for d in missing) * result.sampling.n
    of = f" of {sent}" if sent else ""
    if failed:
        why = f"; first: {failed[0]}"
    else:  # nothing failed: the run stopped first, or every prompt was skipped
        why = f"; the pilot stopped: {result.stop_reason}" if result.stop_reason else ""
    raise UsageError(
        f"the pilot got no completion for datasets {missing}: {len(failed)}{of} requests "
        f"failed{why}; check the server (--base-url, --model), or raise --timeout"
    )


def cmd_plan(args) -> int:
    import kit
    from kit import plan
    from kit.run.store import replan_refusal

    if args.show:
        print(plan.show_plan(args.show))
        return 0
    if missing := [f for f, v in (("--run-dir", args.run_dir), ("--budget", args.budget)) if not v]:
        raise UsageError(
            f"kit plan needs {' and '.join(missing)} (or --show RUN_DIR); see `kit plan --help`"
        )
    if bool(args.base_url) != bool(args.model):
        raise UsageError(
            "--base-url and --model go together (the server and the model name it expects); "
            "give neither to start the embedded server"
        )
    budgets, hidden = parse_plan_budgets(args.budget)
    if args.target_config or (hidden and args.base_url):  # a bad or missing one: before any work
        plan.hidden.shape_for(args.target_config, args.tokenizer, needed=bool(hidden))
    formats, mappings = parse_formats(args.format), parse_mappings(args.mapping)
    samples = [str(Path(p).resolve()) for p in args.samples]
    _sample_names(samples, formats, mappings, args)
    loaded = kit.load(samples, format=formats, mapping=mappings, strip=args.strip)
    print(loaded)
    if why := replan_refusal(args.run_dir, loaded.source_hashes()):  # before the pilot
        raise UsageError(why)
    # the server flags may be missing (embedded server): placeholders until it has started
    config = kit.RunConfig(
        model=args.model or "embedded",
        endpoints=args.base_url or ["http://embedded/v1"],  # the embedded server replaces it
        budgets=budgets,
        sampling=kit.Sampling(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            frequency_penalty=args.frequency_penalty,
            presence_penalty=args.presence_penalty,
        ),
        tokenizer=args.tokenizer,
        api=args.api,
        api_key_env=args.api_key_env,
        concurrency=args.concurrency,
        policy=args.policy,
        timeout=args.timeout,
        max_body_bytes=args.max_body_bytes,
        seed=args.seed,
        turns=args.turns,
        datasets=loaded.paths,
    )
    names = sorted(name for name, n in loaded.prompts.items() if n)
    _budget_names(budgets, names)
    config.budgets_for(names)  # before the pilot
    from kit.serve import DEFAULT_ENGINE

    engine = args.engine or DEFAULT_ENGINE
    embedded = not args.base_url
    server = {"embedded": embedded, "engine": engine if embedded else None}
    stored, why = None, "a new one (--new-pilot)"
    if not args.new_pilot:
        stored, config, why = plan.stored_pilot(
            args.run_dir, loaded, config, per_dataset=args.pilot_per_dataset, server=server
        )
    print(f"pilot: {why}", file=sys.stderr, flush=True)
    with _embedded(config, start=embedded and stored is None, engine=engine) as config:
        plan_run(
            loaded,
            config,
            args.run_dir,
            per_dataset=args.pilot_per_dataset,
            throughput=args.throughput,
            sample_cap=args.sample_cap,
            server=server,
            servers=args.servers,
            hidden=hidden,
            target_config=args.target_config,
            pilot=stored,
        )
    return 0


# -------------------------------------------------------------------------- generate


@contextlib.contextmanager
def planned_run(run_dir, *, engine: str | None = None, **changes):
    """Yield (prompts, config, options) of kit.generate for the plan (or the run) in run_dir,
    on the plan's server: the one resume path (kit.resume, `kit generate`, 02_generate).

    The server: `endpoints` in changes -> those; `engine` given -> a fresh embedded server
    of that engine; else a fresh embedded server only for a plan made on one (a plan that
    does not say: when its model is the embedded model), else the stored endpoints (a
    remote server; its API key from the environment variable config.api_key_env names,
    never stored). `changes` replace RunConfig fields; budgets NAME=TOKENS are merged over
    the plan's. A run started by kit.generate without a plan resumes from its config."""
    from kit import plan
    from kit.run import db

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise MissingPath(
            f"--run-dir {run_dir} does not exist: make a plan there first (kit plan --run-dir {run_dir} ...)"
        )
    db.check_writable(run_dir)
    try:
        spec = plan.read_plan(run_dir)
    except FileNotFoundError:
        if not plan.run_started(run_dir):
            raise
        from kit.run.reader import read_config

        server = {"embedded": False}  # kit.generate's own run: its endpoints as stored
        spec = {"config": read_config(run_dir), "server": server, "sources": None, "table": None}
    config = spec["config"]
    if "budgets" in changes:
        changes["budgets"] = _merged_budgets(config.budgets, changes["budgets"])
    config = replace(config, **changes)
    start, engine = _start_embedded(spec["server"], config, "endpoints" in changes, engine)
    resuming = plan.run_started(run_dir)
    prompts = plan.plan_prompts(run_dir, spec)
    with _embedded(config, start=start, engine=engine) as config:
        print(f"{'resuming' if resuming else 'starting'} the run in {run_dir}", file=sys.stderr)
        yield prompts, config, {"run_dir": run_dir, "expected_tokens": plan.pilot_means(spec)}


async def resume(run_dir, *, engine=None, progress=None, force: bool = False, **changes):
    """Run, or resume, the plan in run_dir on the plan's server (planned_run).

    Args:
        run_dir: a run directory holding a plan (kit plan, 01_plan) or a started run.
        engine: start a fresh embedded server of this engine whatever the plan says.
        progress: kit.generate's progress callback. force: resume despite a changed fingerprint.
        changes: RunConfig fields to change (endpoints, budgets, concurrency, model ...).

    Returns:
        kit.run.generate.Run; an embedded server started for it is stopped when it ends.

    Example (a notebook cell; a script: asyncio.run(kit.resume(...))):
        run = await kit.resume("data/runs/demo", concurrency=64)
        run.summary()
    """
    from kit.run.generate import generate

    with planned_run(run_dir, engine=engine, **changes) as (prompts, config, options):
        return await generate(prompts, config, **options, progress=progress, force=force)


def _start_embedded(
    server: dict | None, config, endpoints: bool, engine
) -> tuple[bool, str | None]:
    """(start an embedded server?, its engine): never with endpoints given; with an engine,
    always; else only when the plan was made on an embedded server (a plan without that
    record: when its model is the embedded model)."""
    if endpoints:
        return False, None
    if engine is not None:
        return True, engine
    if server is None:
        return _is_embedded(config.model), None
    return bool(server.get("embedded")), server.get("engine")


SUMMARY = ["dataset", "state", "budget", "tokens_done", "overshoot", "shortfall", "errors"]


def cmd_generate(args) -> int:
    import kit
    from kit.report.monitor import ConsoleMonitor

    changes = _run_changes(args)
    if args.budget:
        changes["budgets"] = parse_budgets(args.budget)
    with planned_run(args.run_dir, engine=args.engine, **changes) as (prompts, config, options):
        run = kit.generate_sync(
            prompts, config, **options, progress=ConsoleMonitor(), force=args.force
        )
    print(_table(run.summary().select(*SUMMARY, "skipped_context")))
    if run.stop_reason is not None:
        print(
            f"kit: the run stopped early: {run.stop_reason}\n"
            f"records are kept; run `kit generate --run-dir {args.run_dir}` again to resume",
            file=sys.stderr,
        )
        return 1
    for name, why in run.short.items():  # "failed: ...", "ended short of its budget: ..."
        print(f"kit: dataset {name!r} {why}", file=sys.stderr)
    return 1 if run.short else 0


# ----------------------------------------------------------------- audit, export, ...


def audit_run(run_dir, tokenizer=None):
    """Audit a run directory and print its summary; a database that fails SQLite's integrity
    check is raised as DatabaseDamaged after the summary (one line, exit 2)."""
    import kit
    from kit.errors import DatabaseDamaged

    report = kit.audit(run_dir, tokenizer=tokenizer)
    print(report.summary())
    damage = report.findings.filter(report.findings["check"] == "database_integrity")
    if damage.height:
        raise DatabaseDamaged(damage["message"][0])
    return report


def export_run(run_dir, out_dir, tokenizer=None, **options):
    """Export a run, validate the export against its manifest, print both."""
    import kit

    result = kit.export(run_dir, out_dir, tokenizer=tokenizer, **options)
    check = kit.validate(out_dir)
    print(result.summary())
    print(check.summary())
    return result, check


def cmd_watch(args) -> int:
    """The progress table on stdout (a redirect keeps it): redrawn on a terminal, a block
    every 30 s in a file, and the final table."""
    import kit
    from kit.report.monitor import ConsoleMonitor

    monitor = ConsoleMonitor(sys.stdout)
    kit.watch(
        args.run_dir, interval=args.interval, monitor=monitor, stall_timeout=args.stall_timeout
    )
    return 0


def cmd_audit(args) -> int:
    audit_run(args.run_dir, args.tokenizer)
    return 0


def cmd_records(args) -> int:
    """The run's records as JSONL on stdout, in commit order: one kit.types.Record a line."""
    import dataclasses
    import os

    from kit.run.progress import progress
    from kit.run.reader import records

    if args.dataset:
        known = [p.dataset for p in progress(args.run_dir)]
        known_names("--dataset", args.dataset, known, f" in {args.run_dir}")
    try:
        for rec in records(args.run_dir, args.dataset):
            sys.stdout.write(json.dumps(dataclasses.asdict(rec), ensure_ascii=False) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:  # `kit records RUN | head`: the reader left, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def cmd_export(args) -> int:
    _, check = export_run(
        args.run_dir,
        args.out_dir,
        args.tokenizer,
        formats=tuple(args.format),
        drop_truncated=args.drop_truncated,
        drop_duplicates=args.drop_duplicates,
        keep_truncated_conversations=args.keep_truncated_conversations,
        trim_to_budget=args.trim_to_budget,
        val_fraction=args.val_fraction,
        seed=args.seed,
        overwrite=args.overwrite,
        draft_vocab=args.draft_vocab,
        target_config=args.target_config,
    )
    return 0 if check.ok else 1


def cmd_validate(args) -> int:
    """Check an export against its manifest and format; exit 1 when it fails."""
    import kit

    check = kit.validate(args.export_dir)
    print(check.summary())
    return 0 if check.ok else 1


def cmd_prepare(args) -> int:
    from kit import serve

    print(serve.prepare_model())
    return 0


def cmd_serve(args) -> int:
    from kit.serve.server import engine_flags, serve_forever

    flags = args.engine_args
    if flags and flags[0] != "--":
        raise UsageError(f"engine flags go after `--`: kit serve [options] -- {' '.join(flags)}")
    return serve_forever(
        engine_args=engine_flags(flags[1:]),
        port=args.port,
        host=args.host,
        temperature=args.temperature,
        top_p=args.top_p,
        timeout=args.timeout,
        engine=args.engine,
    )
