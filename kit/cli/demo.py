"""`kit demo`: the four notebooks (plan -> generate -> audit -> export) on data/samples
against one embedded server, their parameters injected the way papermill does (a code
cell tagged `injected-parameters` right after the cell tagged `parameters`).

The demo clears its run directory, so it refuses one it did not make (no DEMO_MARK).
"""

from __future__ import annotations

import ast
import contextlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

from kit.cli.commands import REPO, SAMPLES, audit_run
from kit.errors import NotebookFailed, UsageError

NOTEBOOKS = ("01_plan", "02_generate", "03_audit", "04_export")

# `kit demo`'s own parameters (injected into the notebooks), its only settings that are not
# kit's defaults (kit.Sampling, kit.RunConfig), chosen to run in minutes on 2 CPU cores: a
# max_tokens of 512 (the samples' answers are mostly 20-500 tokens), budgets of 8-12 of it a
# dataset, so one max_tokens, the budget rule's allowance, is a small share of each; two
# samples a prompt, as the short-answer sets (alpaca_tasks: about 40 tokens an answer, 74
# prompts) hold under 8 max_tokens of answers with one; a pilot of 15 prompts (30 answers) a
# dataset; a frequency penalty of 0.3 (-0.3 on a token's logit per use in the answer) that
# ends SmolLM2-135M's loops, one line repeated until max_tokens (30-50% of its long answers
# without it), a setting for this small model, not for a real target
DEMO_MAX_TOKENS = 512
DEMO_BUDGETS = {  # dataset -> completion tokens, in max_tokens
    "alpaca_tasks": 8 * DEMO_MAX_TOKENS,
    "chat_general": 8 * DEMO_MAX_TOKENS,
    "code_instruct": 10 * DEMO_MAX_TOKENS,
    "code_problems": 10 * DEMO_MAX_TOKENS,
    "essays": 12 * DEMO_MAX_TOKENS,
    "math_word": 10 * DEMO_MAX_TOKENS,
    "multi_turn": 8 * DEMO_MAX_TOKENS,
    "sharegpt_chat": 10 * DEMO_MAX_TOKENS,
}
DEMO_PARAMETERS = {
    "budgets": DEMO_BUDGETS,
    "max_tokens": DEMO_MAX_TOKENS,
    "frequency_penalty": 0.3,
    "n": 2,
    "pilot_per_dataset": 15,
}
DEMO_MARK = ".kit-demo"  # in a run directory `kit demo` made, and may therefore clear


def save_charts(run_dir: Path) -> list[Path]:
    """The audit charts of a run as PNG files in run_dir/charts."""
    import kit
    from kit.report import charts

    out = run_dir / "charts"
    out.mkdir(parents=True, exist_ok=True)
    report = kit.audit(run_dir)
    names = ("budget_vs_actual", "token_distributions", "finish_reasons", "throughput")
    for name in names:
        getattr(charts, name)(report).save(out / f"{name}.png", scale_factor=1.5)
    return [out / f"{name}.png" for name in names]


def notebook_parameters(nb) -> list[str]:
    """Names assigned in the cell tagged `parameters` ([] when there is none)."""
    for cell in nb.cells:
        if "parameters" in cell.metadata.get("tags", []):
            tree = ast.parse(cell.source)
            return [
                t.id
                for node in tree.body
                if isinstance(node, ast.Assign)
                for t in node.targets
                if isinstance(t, ast.Name)
            ]
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


def poll_in_slices(channel, step: float = 1.0) -> None:
    """Make a kernel client channel's get_msg poll in `step`-second slices up to its timeout:
    zmq.asyncio can miss a socket's wake-up (pyzmq #1558) and leave the kernel's reply unread
    for a cell's whole timeout (tests/test_cli.py); a poll that starts after it arrived sees it.
    """
    from queue import Empty

    get = channel.get_msg

    async def get_msg(timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = step if deadline is None else deadline - time.monotonic()
            try:
                return await get(timeout=max(0.0, min(step, left)))
            except Empty:
                if deadline is not None and left <= step:
                    raise

    channel.get_msg = get_msg


def failure(notebook: str, nb, exc, copy: Path) -> str:
    """Why a notebook failed, its last line naming the notebook and the cell (its number
    among the notebook's cells and its first line) whose output is the error.

    Example: failure("notebooks/01_plan.ipynb", nb, exc, copy) ->
        "notebooks/01_plan.ipynb failed: ValueError: no pilot (cell 4 `pilot = ...`; ...)"
    """
    cells = [
        (i, c.source.strip().splitlines()[0] if c.source.strip() else "")
        for i, c in enumerate(nb.cells, 1)
        if any(o.get("output_type") == "error" for o in c.get("outputs", []))
    ]
    where = f"cell {cells[0][0]} `{cells[0][1][:60]}`; " if cells else ""
    why = f"{exc.ename}: {exc.evalue}".strip().splitlines() or [exc.ename]
    lines = [f"{notebook} failed: {why[0]}", *why[1:]]
    tail = f"({where}its executed copy, traceback included: {copy})"
    if len(lines) == 1:
        return f"{lines[0]} {tail}"
    return "\n".join([*lines, f"{notebook} raised {exc.ename} {tail}"])  # a last line that says it


def run_notebooks(run_dir: Path, parameters: dict) -> Path:
    """Execute the four notebooks in order, each given the `parameters` its parameters cell
    names (injected after it); executed copies go to run_dir/notebooks."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
    from traitlets.config import Config

    class Client(NotebookClient):
        async def async_start_new_kernel_client(self):
            kc = await super().async_start_new_kernel_client()
            for channel in (kc.shell_channel, kc.iopub_channel):
                poll_in_slices(channel)
            return kc

    out = run_dir / "notebooks"
    out.mkdir(parents=True, exist_ok=True)
    for name in NOTEBOOKS:
        print(f"running notebooks/{name}.ipynb ...", file=sys.stderr, flush=True)
        nb = parameterized(name, parameters)
        # the kernel over local IPC sockets in a private folder, not TCP: no port is opened,
        # and ipykernel has no "running over TCP without encryption" warning to print
        with tempfile.TemporaryDirectory(prefix="kit-kernel-") as sockets:
            ipc = Config({"KernelManager": {"transport": "ipc", "ip": f"{sockets}/ipc"}})
            client = Client(  # its own kernel manager: shut down after the notebook
                nb,
                timeout=3600,
                kernel_name="python3",
                config=ipc,
                resources={"metadata": {"path": str(REPO / "notebooks")}},
            )
            try:
                client.execute()
            except CellExecutionError as exc:
                copy = out / f"{name}.ipynb"
                raise NotebookFailed(failure(f"notebooks/{name}.ipynb", nb, exc, copy)) from None
            finally:
                nbformat.write(nb, out / f"{name}.ipynb")  # a failed run is kept for reading
    return out


def _claim_demo_dir(run_dir: Path, keep: bool) -> None:
    """Clear run_dir for the demo (unless `keep`); refuse one that `kit demo` did not make."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"--run-dir {run_dir} is a file: give the demo a directory")
    made_by_demo = (run_dir / DEMO_MARK).is_file()
    if run_dir.exists() and any(run_dir.iterdir()) and not made_by_demo:
        raise UsageError(
            f"--run-dir {run_dir} is not empty and was not made by `kit demo` (no {DEMO_MARK} "
            "in it); the demo clears its run directory, so give it a new or empty one"
        )
    if run_dir.exists() and not keep:
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / DEMO_MARK).write_text("made by `kit demo`, which may clear this directory\n")


def cmd_demo(args) -> int:
    """`kit demo`: the notebooks, then the audit summary, PNG charts and the export check."""
    import kit

    run_dir = Path(args.run_dir).resolve()
    if args.base_url and not args.model:
        raise UsageError("--model is required with --base-url (the model name the server expects)")
    _claim_demo_dir(run_dir, keep=args.resume)
    parameters = {
        **DEMO_PARAMETERS,
        "run_dir": run_dir,
        "data": SAMPLES,
        "out_dir": run_dir / "export",
        "overwrite": True,  # the export inside the demo's own run directory
    }
    with contextlib.ExitStack() as stack:
        if args.base_url:
            url, model, tok = args.base_url, args.model, args.tokenizer
        else:
            engine = args.engine or kit.serve.DEFAULT_ENGINE
            print(f"starting the embedded server ({engine}) ...", file=sys.stderr, flush=True)
            server = stack.enter_context(kit.serve.start(engine=engine))
            url, model, tok = server.base_url, server.model, server.tokenizer_path
            parameters["api"] = server.api
        parameters.update(base_url=url, model=model, tokenizer=args.tokenizer or tok)
        executed = run_notebooks(run_dir, parameters)
    report = audit_run(run_dir, args.tokenizer)
    pngs = save_charts(run_dir)
    print(kit.validate(run_dir / "export").summary())
    print("\nwritten:")
    print(f"  run directory       {run_dir}")
    print(f"  executed notebooks  {executed}/ ({', '.join(n + '.ipynb' for n in NOTEBOOKS)})")
    print(f"  charts              {run_dir / 'charts'}/ ({', '.join(p.name for p in pngs)})")
    print(f"  export              {run_dir / 'export'}/ (manifest.json inside)", flush=True)
    from kit.run.progress import stop_reason

    if (stopped := stop_reason(run_dir)) is not None:  # the run's own word, after the audit's
        print(f"kit demo: the run stopped early: {stopped}", file=sys.stderr)
        return 1
    if report.ok:
        return 0
    print(audit_failure(report), file=sys.stderr)
    return 1


def audit_failure(report) -> str:
    """The demo's last line when the audit found errors: how many, and the first.

    Example: "kit demo: the audit found 1 error: [error] d ids_text_mismatch: 1 record ..."
    """
    errors = report.findings.filter(report.findings["severity"] == "error")
    first, n = errors.row(0, named=True), errors.height
    message = " ".join(str(first["message"]).split())  # one line, whatever the finding says
    more = f" (and {n - 1} more, in the audit summary above)" if n > 1 else ""
    return (
        f"kit demo: the audit found {n} error{'s' if n > 1 else ''}: "
        f"[error] {first['dataset']} {first['check']}: {message}{more}"
    )
