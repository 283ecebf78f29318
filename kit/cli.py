"""The `kit` command: prepare, serve, plan, generate, watch, audit, export, demo.

Every subcommand is a thin wrapper over the package. `kit plan` builds one kit.RunConfig
from its flags, pilots and writes plan.json (which stores that config); `kit generate`
reads it back, applies only the flags given, and runs or resumes. `kit demo` executes
the four notebooks (plan -> generate -> audit -> export) on data/samples against the
embedded server, with its parameters injected the way papermill does.

A user error is one line on stderr (`kit: error: <what and the fix>`, exit 2); a run
that stops early says why and exits 1; anything unexpected keeps its traceback.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import math
import os
import shutil
import signal
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "data" / "samples"
NOTEBOOKS = ("01_plan", "02_generate", "03_audit", "04_export")

# `kit demo`'s own parameters (injected into the notebooks): a few minutes on 2 cores
DEMO_BUDGETS = {  # dataset -> completion tokens: long-form sets get more
    "alpaca_tasks": 800,
    "chat_general": 500,
    "code_instruct": 1200,
    "code_problems": 1500,
    "essays": 1500,
    "math_word": 800,
    "multi_turn": 800,
    "sharegpt_chat": 800,
}
DEMO_PARAMETERS = {"budgets": DEMO_BUDGETS, "max_tokens": 128, "pilot_per_dataset": 30}
DEMO_MARK = ".kit-demo"  # in a run directory `kit demo` made, and may therefore clear


# ----------------------------------------------------------------------------- flags


def parse_budgets(values: list[str]) -> int | dict[str, int]:
    """["1e7"] -> 10000000 (every dataset); ["a=5000", "b=2000"] -> {"a": 5000, "b": 2000}."""
    if len(values) == 1 and "=" not in values[0]:
        return _tokens("--budget", values[0])
    out = {}
    for item in values:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(
                f"--budget takes TOKENS (one number for every dataset) or NAME=TOKENS ..., got {item!r}"
            )
        out[name] = _tokens(f"--budget {name}", value)
    return out


def _tokens(flag: str, value: str) -> int:
    """A positive token count from '5000' or '1e7'."""
    try:
        tokens = float(value)
    except ValueError:
        tokens = math.nan
    if not (math.isfinite(tokens) and tokens >= 1):
        raise ValueError(f"{flag}: expected a positive number of tokens, got {value!r}")
    return int(tokens)


def _merged_budgets(planned, given):
    """The plan's budgets with --budget applied: one number replaces all, NAME=TOKENS one each."""
    if isinstance(given, int) or not isinstance(planned, dict):
        return given
    if unknown := sorted(set(given) - set(planned)):
        raise ValueError(
            f"--budget names datasets {unknown} that the plan does not have (it has {sorted(planned)})"
        )
    return {**planned, **given}


def _run_changes(args) -> dict:
    """RunConfig fields from the flags the user gave (None: not given, keep the plan's)."""
    names = ("model", "tokenizer", "api", "api_key_env", "concurrency", "policy", "timeout")
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
def _embedded(config, *, start: bool):
    """Yield config, pointed at a freshly started embedded server when `start`."""
    if not start:
        yield config
        return
    from kit import serve

    model_dir = config.model if _is_embedded(config.model) else None
    print("starting the embedded server ...", file=sys.stderr, flush=True)
    s = config.sampling
    with serve.start(model_dir, temperature=s.temperature, top_p=s.top_p) as server:
        print(f"embedded server at {server.base_url}", file=sys.stderr, flush=True)
        yield replace(
            config,
            endpoints=[server.base_url],
            model=server.model,
            tokenizer=config.tokenizer or server.tokenizer_path,
        )


def _counter(label: str):
    """A progress callback printing `label: done/total` in place on a terminal's stderr."""
    last = [-1]

    def show(done: int, total: int) -> None:
        if done != last[0] and sys.stderr.isatty():
            print(f"\r{label}: {done}/{total} requests", end="", file=sys.stderr, flush=True)
        last[0] = done

    return show


# ------------------------------------------------------------------------------ plan


def plan_run(loaded, config, run_dir, *, per_dataset=30, throughput=None, sample_cap=None):
    """Profile prompts, pilot, plan the budgets and write plan.json (storing `config`)."""
    from kit import plan
    from kit.report.widgets import summary_text

    frame = loaded.frame
    names = sorted(frame["dataset"].unique().to_list())
    budgets = config.budgets_for(names)
    if config.tokenizer:
        print(plan.profile_prompts(frame, config.tokenizer))
    print(f"pilot: up to {per_dataset} prompts per dataset ...", file=sys.stderr, flush=True)
    result = plan.pilot_sync(frame, config, per_dataset=per_dataset, progress=_counter("pilot"))
    print(file=sys.stderr)
    if result.errors:
        print(f"pilot: {len(result.errors)} requests failed, first: {result.errors[0]}")
    if missing := sorted(set(names) - set(result.frame["dataset"].unique().to_list())):
        raise ValueError(
            f"the pilot got no completion for datasets {missing} ({len(result.errors)} requests "
            "failed, see above): check the server (--base-url, --model), or raise --timeout"
        )
    print(result.profile())
    table = plan.budget(
        budgets,
        result,
        prompts_available=frame,
        throughput=throughput or result.tokens_per_s,
        sample_cap=sample_cap,
    )
    print(summary_text(table))
    path = plan.write_plan(run_dir, table, config, pilot=result)
    print(f"plan written: {path}")
    return path


def _cmd_plan(args) -> int:
    import kit

    if bool(args.base_url) != bool(args.model):
        raise ValueError(
            "--base-url and --model go together (the server and the model name it expects); "
            "give neither to start the embedded server"
        )
    budgets = parse_budgets(args.budget)
    loaded = kit.load([str(Path(p).resolve()) for p in args.samples])
    print(loaded)
    # the server flags may be missing (embedded server): placeholders until it has started
    config = kit.RunConfig(
        model=args.model or "embedded",
        endpoints=args.base_url or ["embedded"],
        budgets=budgets,
        sampling=kit.Sampling(max_tokens=args.max_tokens, temperature=args.temperature),
        tokenizer=args.tokenizer,
        api=args.api,
        api_key_env=args.api_key_env,
        concurrency=args.concurrency,
        policy=args.policy,
        timeout=args.timeout,
        seed=args.seed,
        datasets=loaded.paths,
    )
    config.budgets_for(sorted(loaded.frame["dataset"].unique().to_list()))  # before the pilot
    with _embedded(config, start=not args.base_url) as config:
        plan_run(
            loaded, config, args.run_dir, per_dataset=args.pilot_per_dataset,
            throughput=args.throughput, sample_cap=args.sample_cap,
        )  # fmt: skip
    return 0


# -------------------------------------------------------------------------- generate


def _plan_prompts(config):
    """The plan's prompt sources, loaded again (config.datasets: dataset -> path)."""
    import kit

    if not config.datasets or not all(config.datasets.values()):
        raise ValueError(
            "plan.json records no source file for some datasets (loaded in memory?): "
            "make the plan with `kit plan --samples PATH ...`"
        )
    return kit.load(dict(config.datasets))


def generate_run(run_dir, args):
    """Run (or resume) the plan in run_dir with a console monitor; return the Run."""
    import kit
    from kit import plan
    from kit.report.monitor import ConsoleMonitor

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(
            f"--run-dir {run_dir} does not exist: make a plan there first (kit plan --run-dir {run_dir} ...)"
        )
    spec = plan.read_plan(run_dir)
    config = replace(spec["config"], **_run_changes(args))
    if args.budget:
        config = replace(
            config, budgets=_merged_budgets(config.budgets, parse_budgets(args.budget))
        )
    resuming = (run_dir / "prompts.parquet").exists()
    prompts = None if resuming else _plan_prompts(config)
    start = not args.base_url and _is_embedded(config.model)
    with _embedded(config, start=start) as config:
        print(f"{'resuming' if resuming else 'starting'} the run in {run_dir}", file=sys.stderr)
        return kit.generate_sync(
            prompts, config, run_dir=run_dir, progress=ConsoleMonitor(),
            expected_tokens=plan.pilot_means(spec), force=args.force,
        )  # fmt: skip


def _cmd_generate(args) -> int:
    run = generate_run(args.run_dir, args)
    print(run.summary())
    if run.stop_reason is not None:
        print(
            f"kit: the run stopped early: {run.stop_reason}\n"
            f"records are kept; run `kit generate --run-dir {args.run_dir}` again to resume",
            file=sys.stderr,
        )
        return 1
    return 0


# ----------------------------------------------------------------- audit, export, ...


def audit_run(run_dir, tokenizer=None):
    """Audit a run directory and print its summary."""
    import kit

    report = kit.audit(run_dir, tokenizer=tokenizer)
    print(report.summary())
    return report


def export_run(run_dir, out_dir, tokenizer=None, **options):
    """Export a run, validate the export against its manifest, print both."""
    import kit

    result = kit.export(run_dir, out_dir, tokenizer=tokenizer, **options)
    check = kit.validate(out_dir)
    print(result)
    print(check)
    return result


def save_charts(run_dir: Path) -> list[Path]:
    """The audit charts of a run as PNG files in run_dir/charts."""
    import kit
    from kit.report import charts

    out = run_dir / "charts"
    out.mkdir(parents=True, exist_ok=True)
    report = kit.audit(run_dir)
    built = {
        "budget_vs_actual": charts.budget_vs_actual(report),
        "token_distributions": charts.token_distributions(report),
        "finish_reasons": charts.finish_reasons(report),
        "throughput": charts.throughput(report),
    }
    paths = []
    for name, chart in built.items():
        chart.save(out / f"{name}.png", scale_factor=1.5)
        paths.append(out / f"{name}.png")
    return paths


def _cmd_watch(args) -> int:
    import kit

    kit.watch(args.run_dir, interval=args.interval)
    return 0


def _cmd_audit(args) -> int:
    audit_run(args.run_dir, args.tokenizer)
    return 0


def _cmd_export(args) -> int:
    export_run(
        args.run_dir, args.out_dir, args.tokenizer, formats=tuple(args.format),
        drop_truncated=args.drop_truncated, drop_duplicates=args.drop_duplicates,
        trim_to_budget=args.trim_to_budget, val_fraction=args.val_fraction, seed=args.seed,
        overwrite=args.overwrite,
    )  # fmt: skip
    return 0


def _cmd_prepare(args) -> int:
    from kit import serve

    print(serve.prepare_model())
    return 0


def _cmd_serve(args) -> int:
    from kit.serve.server import main

    argv = ["--host", args.host, "--temperature", str(args.temperature)]
    argv += ["--top-p", str(args.top_p), "--timeout", str(args.timeout)]
    if args.port is not None:
        argv += ["--port", str(args.port)]
    return main(argv)


# ------------------------------------------------------------------------------ demo


def notebook_parameters(nb) -> list[str]:
    """Names assigned in the cell tagged `parameters` ([] when there is none)."""
    for cell in nb.cells:
        if "parameters" in cell.metadata.get("tags", []):
            tree = ast.parse(cell.source)
            return [t.id for node in tree.body if isinstance(node, ast.Assign)
                    for t in node.targets if isinstance(t, ast.Name)]  # fmt: skip
    return []


def inject_parameters(nb, parameters: dict):
    """Papermill's way: a code cell tagged `injected-parameters` assigning `parameters`, right
    after the cell tagged `parameters` (first when there is none), replacing an earlier one.

    Example: inject_parameters(nb, {"run_dir": "/tmp/r"}) adds "run_dir = '/tmp/r'".
    """
    import nbformat

    lines = [f"{k} = {str(v) if isinstance(v, Path) else v!r}\n" for k, v in parameters.items()]
    cell = nbformat.v4.new_code_cell("# Parameters\n" + "".join(lines).rstrip("\n"))
    cell.id = "injected-parameters"
    cell.metadata["tags"] = ["injected-parameters"]
    cells = [c for c in nb.cells if "injected-parameters" not in c.metadata.get("tags", [])]
    tags = [c.metadata.get("tags", []) for c in cells]
    at = next((i + 1 for i, t in enumerate(tags) if "parameters" in t), 0)
    nb.cells = cells[:at] + [cell] + cells[at:]
    return nb


def parameterized(name: str, parameters: dict):
    """notebooks/<name>.ipynb with those of `parameters` its parameters cell names injected."""
    import nbformat

    nb = nbformat.read(REPO / "notebooks" / f"{name}.ipynb", as_version=4)
    names = notebook_parameters(nb)
    return inject_parameters(nb, {k: v for k, v in parameters.items() if k in names})


def run_notebooks(run_dir: Path, parameters: dict) -> Path:
    """Execute the four notebooks in order, each given the `parameters` its parameters cell
    names (injected after it); executed copies go to run_dir/notebooks."""
    import nbformat
    from nbclient import NotebookClient

    out = run_dir / "notebooks"
    out.mkdir(parents=True, exist_ok=True)
    for name in NOTEBOOKS:
        print(f"running notebooks/{name}.ipynb ...", file=sys.stderr, flush=True)
        nb = parameterized(name, parameters)
        client = NotebookClient(
            nb, timeout=3600, kernel_name="python3",
            resources={"metadata": {"path": str(REPO / "notebooks")}},
        )  # fmt: skip
        try:
            client.execute()
        finally:
            nbformat.write(nb, out / f"{name}.ipynb")  # a failed run is kept for reading
    return out


def _claim_demo_dir(run_dir: Path, keep: bool) -> None:
    """Clear run_dir for the demo (unless `keep`); refuse one that `kit demo` did not make."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--run-dir {run_dir} is a file: give the demo a directory")
    made_by_demo = (run_dir / DEMO_MARK).is_file()
    if run_dir.exists() and any(run_dir.iterdir()) and not made_by_demo:
        raise ValueError(
            f"--run-dir {run_dir} is not empty and was not made by `kit demo` (no {DEMO_MARK} "
            "in it); the demo clears its run directory, so give it a new or empty one"
        )
    if run_dir.exists() and not keep:
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / DEMO_MARK).write_text("made by `kit demo`, which may clear this directory\n")


def _cmd_demo(args) -> int:
    import kit

    run_dir = Path(args.run_dir).resolve()
    if args.base_url and not args.model:
        raise ValueError("--model is required with --base-url (the model name the server expects)")
    _claim_demo_dir(run_dir, keep=args.resume)
    parameters = {
        **DEMO_PARAMETERS, "run_dir": run_dir, "data": SAMPLES, "out_dir": run_dir / "export",
        "overwrite": True,  # the export inside the demo's own run directory
    }  # fmt: skip
    with contextlib.ExitStack() as stack:
        if args.base_url:
            url, model, tok = args.base_url, args.model, args.tokenizer
        else:
            print("starting the embedded server ...", file=sys.stderr, flush=True)
            server = stack.enter_context(kit.serve.start())
            url, model, tok = server.base_url, server.model, server.tokenizer_path
        parameters.update(base_url=url, model=model, tokenizer=args.tokenizer or tok)
        executed = run_notebooks(run_dir, parameters)
    report = audit_run(run_dir, args.tokenizer)
    pngs = save_charts(run_dir)
    print(kit.validate(run_dir / "export"))
    print("\nwritten:")
    print(f"  run directory       {run_dir}")
    print(f"  executed notebooks  {executed}/ ({', '.join(n + '.ipynb' for n in NOTEBOOKS)})")
    print(f"  charts              {run_dir / 'charts'}/ ({', '.join(p.name for p in pngs)})")
    print(f"  export              {run_dir / 'export'}/ (manifest.json inside)")
    return 0 if report.ok else 1


# ---------------------------------------------------------------------------- parser


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `kit: error: <message>; see `kit CMD --help``, exit 2."""

    def error(self, message: str):
        print(f"kit: error: {message}; see `{self.prog} --help`", file=sys.stderr)
        raise SystemExit(2)


def _server_args(p: argparse.ArgumentParser, many: bool = False) -> None:
    p.add_argument(
        "--base-url",
        action="append" if many else "store",
        help="server base URL" + (" (repeat for several)" if many else "")
        + " (default: start the embedded server)",
    )  # fmt: skip
    p.add_argument("--model", help="model name the server expects (required with --base-url)")
    p.add_argument("--tokenizer", help="local path of the target's tokenizer")


def _run_args(p: argparse.ArgumentParser, default) -> None:
    """The RunConfig flags kit plan sets and kit generate may change (default: None there)."""
    d = default
    p.add_argument("--concurrency", type=int, default=d(32), help="requests in flight")
    p.add_argument("--policy", choices=["drain", "cancel"], default=d("drain"))
    p.add_argument("--api", choices=["openai", "vllm", "sglang"], default=d("openai"))
    p.add_argument("--api-key-env", help="NAME of the environment variable holding the API key")
    p.add_argument(
        "--timeout", type=float, help="read timeout per request in s (default: 120 + 0.5/token)"
    )


BUDGET_HELP = "TOKENS for every dataset, or NAME=TOKENS ... (completion tokens)"


def parser() -> argparse.ArgumentParser:
    """The argument parser of the `kit` command."""
    p = _Parser(prog="kit", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare", help="convert the embedded model once").set_defaults(fn=_cmd_prepare)

    s = sub.add_parser("serve", help="run the embedded server until interrupted")
    s.add_argument("--host", default="127.0.0.1", help="listen address")
    s.add_argument("--port", type=int, help="TCP port (default: a free one)")
    s.add_argument("--temperature", type=float, default=0.7, help="server-wide sampling")
    s.add_argument("--top-p", type=float, default=1.0, help="server-wide nucleus sampling")
    s.add_argument("--timeout", type=float, default=300, help="seconds to wait for start-up")
    s.set_defaults(fn=_cmd_serve)

    d = sub.add_parser(
        "demo", help="run the four notebooks (plan -> generate -> audit -> export) on the samples"
    )
    d.add_argument("--run-dir", default=str(REPO / "data" / "runs" / "demo"))
    d.add_argument("--resume", action="store_true", help="keep the demo's run directory")
    _server_args(d)
    d.set_defaults(fn=_cmd_demo)

    pl_ = sub.add_parser("plan", help="pilot and plan per-dataset token budgets -> plan.json")
    pl_.add_argument("--samples", nargs="+", default=[str(SAMPLES)], help="files or folders")
    pl_.add_argument("--run-dir", required=True)
    pl_.add_argument("--budget", nargs="+", required=True, help=BUDGET_HELP)
    pl_.add_argument("--max-tokens", type=int, default=512)
    pl_.add_argument("--temperature", type=float, default=0.7)
    pl_.add_argument("--seed", type=int, default=0, help="prompt order and pilot sample")
    pl_.add_argument(
        "--pilot-per-dataset", type=int, default=30, help="pilot prompts per dataset (all if fewer)"
    )
    pl_.add_argument("--throughput", type=float, help="tokens/s of the real run (default: pilot's)")
    pl_.add_argument("--sample-cap", type=int, help="naive samples-per-dataset cap to compare")
    _server_args(pl_, many=True)
    _run_args(pl_, lambda v: v)
    pl_.set_defaults(fn=_cmd_plan)

    g = sub.add_parser(
        "generate", help="run or resume the plan in RUN_DIR (flags given replace the plan's)"
    )
    g.add_argument("--run-dir", required=True)
    g.add_argument("--budget", nargs="+", help=f"{BUDGET_HELP} (default: the plan's)")
    g.add_argument("--force", action="store_true", help="resume despite a changed fingerprint")
    _server_args(g, many=True)
    _run_args(g, lambda v: None)
    g.set_defaults(fn=_cmd_generate)

    w = sub.add_parser("watch", help="follow a run started elsewhere")
    w.add_argument("run_dir")
    w.add_argument("--interval", type=float, default=1.0)
    w.set_defaults(fn=_cmd_watch)

    a = sub.add_parser("audit", help="audit a run directory")
    a.add_argument("run_dir")
    a.add_argument("--tokenizer")
    a.set_defaults(fn=_cmd_audit)

    e = sub.add_parser("export", help="export a run to trainer formats with a manifest")
    e.add_argument("run_dir")
    e.add_argument("out_dir")
    e.add_argument("--format", nargs="+", default=["specforge", "token_ids", "parquet"])
    e.add_argument("--tokenizer")
    e.add_argument("--drop-truncated", action="store_true")
    e.add_argument("--drop-duplicates", action="store_true")
    e.add_argument("--trim-to-budget", action="store_true")
    e.add_argument("--val-fraction", type=float, default=0.0)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--overwrite", action="store_true", help="replace an export in OUT_DIR")
    e.set_defaults(fn=_cmd_export)
    return p


# ------------------------------------------------------------------------------ main


def _interrupt(signum, frame) -> None:
    """SIGTERM -> KeyboardInterrupt: runs stop cleanly, servers are stopped, records flushed."""
    raise KeyboardInterrupt


def _user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "fix your input", shown as one line without a traceback."""
    from kit.serve import ServerError

    return (ValueError, FileNotFoundError, FileExistsError, ServerError)


def error_line(exc: BaseException) -> str:
    """`kit: error: <message>`; a multi-line message (a fingerprint diff) keeps its lines."""
    from kit.run.store import FingerprintMismatch

    message = str(exc).strip() or type(exc).__name__
    if isinstance(exc, FingerprintMismatch):  # the library's advice, in flags
        message = message.replace("pass force=True", "pass --force")
    return f"kit: error: {message}"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kit` console script."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill PID` stops as cleanly as Ctrl-C
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except _user_errors() as exc:
        print(error_line(exc), file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
