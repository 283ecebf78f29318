"""The `kit` command: prepare, serve, plan, generate, watch, audit, export, demo.

Every subcommand is a thin wrapper over the package; `kit demo` runs the whole chain
(plan -> generate -> audit -> export) on data/samples against the embedded server.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "data" / "samples"
DEMO_BUDGETS = {  # dataset -> completion tokens: long-form sets get more (a few minutes on 2 cores)
    "alpaca_tasks": 800,
    "chat_general": 500,
    "code_instruct": 1200,
    "code_problems": 1500,
    "essays": 1500,
    "math_word": 800,
    "multi_turn": 800,
    "sharegpt_chat": 800,
}


def _budgets(values: list[str] | None, names: list[str]) -> dict[str, int]:
    """["10000"] -> every dataset 10000; ["a=5000", "b=2000"] -> per dataset."""
    if not values:
        return {}
    if len(values) == 1 and "=" not in values[0]:
        return dict.fromkeys(names, _int("--budget", values[0]))
    out = {}
    for item in values:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--budget: expected NAME=TOKENS, got {item!r}")
        out[name] = _int(f"--budget {name}", value)
    return out


def _int(field: str, value: str) -> int:
    try:
        return int(float(value))
    except ValueError:
        raise SystemExit(f"{field}: expected a number, got {value!r}") from None


@contextlib.contextmanager
def _server(base_url: str | None, model: str | None):
    """Yield (base_url, model, tokenizer_dir): the given server, or the embedded one."""
    if base_url:
        if not model:
            raise SystemExit("--model is required with --base-url")
        yield base_url, model, None
        return
    from kit import serve

    print("starting the embedded server ...", file=sys.stderr, flush=True)
    with serve.start() as server:
        print(f"embedded server at {server.base_url}", file=sys.stderr, flush=True)
        yield server.base_url, server.model, str(server.model_dir)


def _counter(label: str):
    """A progress callback printing `label: done/total` in place on stderr."""

    def show(done: int, total: int) -> None:
        print(f"\r{label}: {done}/{total} requests", end="", file=sys.stderr, flush=True)

    return show


def plan_run(
    samples, run_dir, base_url, model, tokenizer, budgets, *, max_tokens, pilot_fraction, throughput
):
    """Load the samples, profile prompts, pilot, plan the budgets and write plan.json."""
    from kit import plan, sources, tokens
    from kit.pilot import pilot_sync
    from kit.types import Sampling

    loaded = sources.load(samples)
    print(loaded.summary())
    frame = loaded.frame
    names = sorted(frame["dataset"].unique().to_list())
    budgets = budgets or {n: DEMO_BUDGETS.get(n, 1500) for n in names}
    if tokenizer:
        tok = tokens.load_tokenizer(tokenizer)
        print(tokens.profile_prompts(frame, tok))
    sampling = Sampling(max_tokens=max_tokens)
    per_dataset = {n: max(4, int(pilot_fraction * budgets[n] / (max_tokens / 2))) for n in budgets}
    result = pilot_sync(
        frame,
        base_url,
        model=model,
        per_dataset=per_dataset,
        sampling=sampling,
        progress=_counter("pilot"),
    )
    print(file=sys.stderr)
    print(result.profile())
    table = plan.budget(
        budgets,
        result,
        prompts_available=frame,
        throughput=throughput or result.tokens_per_s,
        max_tokens=max_tokens,
        sample_cap=None,
    )
    print(table)
    path = plan.write_plan(
        run_dir,
        table,
        budgets=budgets,
        sampling=sampling,
        model=model,
        sources=loaded.paths,
        tokenizer=tokenizer,
        chat_template_hash=tokens.chat_template_hash(tokens.load_tokenizer(tokenizer))
        if tokenizer
        else None,
        pilot=result,
    )
    print(f"plan written: {path}")
    return path


def generate_run(
    run_dir, base_urls, model, tokenizer, *, concurrency, policy, api, api_key_env, force
):
    """Run (or resume) the plan in run_dir with a console monitor; return the Run."""
    from kit import generate, monitor, plan, sources

    spec = plan.read_plan(run_dir)
    prompts = sources.load(spec["sources"]).frame if spec.get("sources") else None
    expected = plan.pilot_means(spec)
    return generate.generate_sync(
        prompts,
        run_dir=run_dir,
        model=model or spec["model"],
        endpoints=base_urls,
        budgets=spec["budgets"],
        sampling=spec["sampling"],
        api=api,
        api_key_env=api_key_env,
        tokenizer=tokenizer or spec.get("tokenizer"),
        concurrency=concurrency,
        policy=policy,
        progress=monitor.ConsoleMonitor(),
        force=force,
        expected_tokens=expected,
    )


def audit_run(run_dir, tokenizer=None):
    """Audit a run directory and print its summary."""
    import kit.audit

    report = kit.audit(run_dir, tokenizer=tokenizer)
    print(report.summary())
    return report


def export_run(run_dir, out_dir, tokenizer=None, **options):
    """Export a run, validate the export against its manifest, print the paths."""
    from kit import export

    result = export.export(run_dir, out_dir, tokenizer=tokenizer, overwrite=True, **options)
    check = export.validate(out_dir)
    print(result)
    print(check)
    return result


NOTEBOOKS = ("01_plan", "02_generate", "03_audit", "04_export")


def run_notebooks(run_dir: Path, base_url: str, model: str, tokenizer: str | None) -> Path:
    """Execute the four notebooks in order against one server; executed copies go to run_dir/notebooks."""
    import nbformat
    from nbclient import NotebookClient

    out = run_dir / "notebooks"
    out.mkdir(parents=True, exist_ok=True)
    env = {"KIT_RUN_DIR": str(run_dir.resolve()), "KIT_BASE_URL": base_url, "KIT_MODEL": model}
    if tokenizer:
        env["KIT_TOKENIZER"] = tokenizer
    os.environ.update(env)  # the kernels inherit it: the notebooks' parameters cells read it
    for name in NOTEBOOKS:
        print(f"running notebooks/{name}.ipynb ...", file=sys.stderr, flush=True)
        nb = nbformat.read(REPO / "notebooks" / f"{name}.ipynb", as_version=4)
        client = NotebookClient(
            nb, timeout=3600, kernel_name="python3",
            resources={"metadata": {"path": str(REPO / "notebooks")}},
        )  # fmt: skip
        try:
            client.execute()
        finally:
            nbformat.write(nb, out / f"{name}.ipynb")  # a failed run is kept for reading
    return out


def save_charts(run_dir: Path) -> list[Path]:
    """The audit charts of a run as PNG files in run_dir/charts."""
    import kit.audit
    from kit import charts, store

    out = run_dir / "charts"
    out.mkdir(parents=True, exist_ok=True)
    records = store.records_frame(run_dir)
    built = {
        "budget_vs_actual": charts.budget_vs_actual(kit.audit(run_dir)),
        "token_distributions": charts.token_distributions(records),
        "finish_reasons": charts.finish_reasons(records),
        "throughput": charts.throughput(records),
    }
    paths = []
    for name, chart in built.items():
        chart.save(out / f"{name}.png", scale_factor=1.5)
        paths.append(out / f"{name}.png")
    return paths


def _cmd_demo(args) -> int:
    run_dir = Path(args.run_dir)
    if run_dir.exists() and not args.resume:
        shutil.rmtree(run_dir)
    with _server(args.base_url, args.model) as (base_url, model, tok):
        executed = run_notebooks(run_dir, base_url, model, args.tokenizer or tok)
    report = audit_run(run_dir, args.tokenizer or tok)
    pngs = save_charts(run_dir)
    from kit import export

    print(export.validate(run_dir / "export"))
    print("\nwritten:")
    print(f"  run directory       {run_dir}")
    print(f"  executed notebooks  {executed}/ ({', '.join(n + '.ipynb' for n in NOTEBOOKS)})")
    print(f"  charts              {run_dir / 'charts'}/ ({', '.join(p.name for p in pngs)})")
    print(f"  export              {run_dir / 'export'}/ (manifest.json inside)")
    return 0 if report is not None else 1


def _cmd_plan(args) -> int:
    from kit import sources

    names = sorted(sources.load(args.samples).frame["dataset"].unique().to_list())
    budgets = _budgets(args.budget, names)
    with _server(args.base_url, args.model) as (base_url, model, tok):
        plan_run(
            args.samples, args.run_dir, base_url, model, args.tokenizer or tok, budgets,
            max_tokens=args.max_tokens, pilot_fraction=args.pilot_fraction,
            throughput=args.throughput,
        )  # fmt: skip
    return 0


def _cmd_generate(args) -> int:
    with _server(args.base_url and args.base_url[0], args.model) as (base_url, model, tok):
        urls = args.base_url or [base_url]
        run = generate_run(
            args.run_dir, urls, args.model or (None if args.base_url else model),
            args.tokenizer or tok, concurrency=args.concurrency, policy=args.policy,
            api=args.api, api_key_env=args.api_key_env, force=args.force,
        )  # fmt: skip
        print(run.summary())
    return 0


def _cmd_watch(args) -> int:
    from kit import monitor

    monitor.watch(args.run_dir, interval=args.interval)
    return 0


def _cmd_audit(args) -> int:
    audit_run(args.run_dir, args.tokenizer)
    return 0


def _cmd_export(args) -> int:
    export_run(
        args.run_dir, args.out_dir, args.tokenizer, formats=tuple(args.format),
        drop_truncated=args.drop_truncated, drop_duplicates=args.drop_duplicates,
        trim_to_budget=args.trim_to_budget, val_fraction=args.val_fraction, seed=args.seed,
    )  # fmt: skip
    return 0


def _cmd_prepare(args) -> int:
    from kit import serve

    print(serve.prepare_model())
    return 0


def _cmd_serve(args) -> int:
    from kit import serve

    return serve.main(args.rest)


def _server_args(p: argparse.ArgumentParser, many: bool = False) -> None:
    p.add_argument(
        "--base-url",
        action="append" if many else "store",
        help="server base URL (default: start the embedded server)",
    )
    p.add_argument("--model", help="model name the server expects (required with --base-url)")
    p.add_argument("--tokenizer", help="local path of the target's tokenizer")


def parser() -> argparse.ArgumentParser:
    """The argument parser of the `kit` command."""
    p = argparse.ArgumentParser(prog="kit", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare", help="convert the embedded model once").set_defaults(fn=_cmd_prepare)
    s = sub.add_parser("serve", help="run the embedded server until interrupted")
    s.add_argument("rest", nargs=argparse.REMAINDER)
    s.set_defaults(fn=_cmd_serve)
    d = sub.add_parser(
        "demo", help="run the four notebooks (plan -> generate -> audit -> export) on the samples"
    )
    d.add_argument("--run-dir", default=str(REPO / "data" / "runs" / "demo"))
    d.add_argument("--resume", action="store_true", help="keep an existing run directory")
    _server_args(d)
    d.set_defaults(fn=_cmd_demo)
    pl_ = sub.add_parser("plan", help="pilot and plan per-dataset token budgets")
    pl_.add_argument("--samples", nargs="+", default=[str(SAMPLES)])
    pl_.add_argument("--run-dir", required=True)
    pl_.add_argument("--budget", nargs="+", help="TOKENS for all, or NAME=TOKENS ...")
    pl_.add_argument("--max-tokens", type=int, default=512)
    pl_.add_argument("--pilot-fraction", type=float, default=0.1)
    pl_.add_argument(
        "--throughput", type=float, help="tokens/s of the real run (default: the pilot's)"
    )
    _server_args(pl_)
    pl_.set_defaults(fn=_cmd_plan)
    g = sub.add_parser("generate", help="run or resume the plan in RUN_DIR")
    g.add_argument("--run-dir", required=True)
    g.add_argument("--concurrency", type=int, default=32)
    g.add_argument("--policy", choices=["drain", "cancel"], default="drain")
    g.add_argument("--api", choices=["openai", "vllm", "sglang"], default="openai")
    g.add_argument("--api-key-env", help="NAME of the environment variable holding the API key")
    g.add_argument("--force", action="store_true", help="resume despite a changed fingerprint")
    _server_args(g, many=True)
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
    e.set_defaults(fn=_cmd_export)
    return p


def _interrupt(signum, frame) -> None:
    """SIGTERM -> KeyboardInterrupt: runs stop cleanly, servers are stopped, records flushed."""
    raise KeyboardInterrupt


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


if __name__ == "__main__":
    raise SystemExit(main())
