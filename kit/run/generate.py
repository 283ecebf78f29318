"""kit.generate: every dataset's prompts (seeded random order) sent to the endpoints,
interleaved by the lowest share of budget committed, each dataset stopped at its budget.

A dataset is fed while tokens done + the expected tokens of its requests in flight stay
under its budget; policy "drain" also caps in flight so that the final count lands in
[budget, budget + max(1% of budget, max_tokens)] whenever the prompts suffice, and
"cancel" aborts in-flight requests at the budget. Prompts too long for the context are
skipped and counted (kit.run.guard); results are committed through kit.run.store, so a
stop (run.stop(), Ctrl-C, SIGTERM, SIGHUP) loses nothing and the same call again resumes. A
dataset whose requests cannot succeed fails while the others go on; a run where nothing
can succeed stops with `run.stop_reason` (the exact rules: kit.run.runner).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from kit.errors import ConfigError, ConfigTypeError
from kit.run.runner import Runner
from kit.types import DatasetProgress, RunConfig


class Status(NamedTuple):
    """What `Run.status()` returns: a frame per dataset and the DatasetProgress list."""

    frame: object  # polars.DataFrame
    datasets: list[DatasetProgress]


def _progress_frame(progress: list[DatasetProgress]):
    """DatasetProgress list -> polars frame with overshoot/shortfall columns."""
    import polars as pl

    rows = []
    for p in progress:
        rows.append(
            {
                "dataset": p.dataset,
                "state": p.state,
                "budget": p.budget,
                "tokens_done": p.tokens_done,
                "share": p.tokens_done / p.budget if p.budget else 0.0,
                "overshoot": max(0, p.tokens_done - p.budget),
                "shortfall": max(0, p.budget - p.tokens_done),
                "samples_done": p.samples_done,
                "prompts_total": p.prompts_total,
                "in_flight": p.in_flight,
                "retries": p.retries,
                "errors": p.errors,
                "truncated": p.truncated,
                "skipped_context": p.skipped,
                "tokens_per_s": round(p.tokens_per_s, 1),
            }
        )
    return pl.DataFrame(rows)


class Run:
    """A run: finished (foreground) or running as a task on the current loop (background).

    Example:
        run = await kit.generate(prompts, ..., background=True)
        run.status().frame      # one row per dataset
        run.stop(); await run.wait()
        run.summary()           # budget, tokens_done, overshoot, shortfall, errors per dataset
    """

    def __init__(self, runner: Runner, task: asyncio.Task | None = None) -> None:
        self.run_dir = runner.store.run_dir
        self._runner = runner
        self.task = task

    @property
    def done(self) -> bool:
        return self.task is None or self.task.done()

    @property
    def stop_reason(self) -> str | None:
        """Why the run stopped early, one line (None when it ran to the end): every dataset
        failed (each with its reason, see `failed`), no attempt succeeded for stall_timeout s
        (with the last error), dead endpoints, "stopped by user", "interrupted (...)".
        Also each unfinished dataset's note in the run's status ("run stopped: <reason>")."""
        return self._runner.stop_reason

    @property
    def failed(self) -> dict[str, str]:
        """dataset -> why it failed (none of its requests can succeed), for the datasets that
        did; the others went on. The CLI exits 1 naming them."""
        return {d.name: d.failed for d in self._runner.datasets.values() if d.failed}

    @property
    def short(self) -> dict[str, str]:
        """dataset -> why it ended short of its budget, for each that did for any reason but
        its prompts running out (failed, stopped, prompts refused). The CLI exits 1 naming them."""
        return self._runner.short()

    def status(self) -> Status:
        """The live (or final) state per dataset."""
        progress = self._runner.progress()
        return Status(_progress_frame(progress), progress)

    def stop(self) -> None:
        """Ask for a clean stop: in-flight requests are cancelled, records flushed."""
        self._runner.request_stop("stopped by user")

    async def wait(self) -> Run:
        """Wait for the run to end; re-raise what ended it (e.g. a full disk)."""
        if self.task is not None:
            await self.task
        return self

    def summary(self):
        """Per-dataset budget adherence of the run as a polars frame."""
        return self.status().frame

    def __repr__(self) -> str:
        state = "done" if self.done else "running"
        return f"Run({str(self.run_dir)!r}, {state})\n{self.summary()}"


async def generate(
    prompts,
    config: RunConfig,
    *,
    run_dir: str | Path,
    progress: Callable[[list[DatasetProgress]], None] | None = None,
    background: bool = False,
    force: bool = False,
    expected_tokens: dict[str, float] | None = None,
) -> Run:
    """Run prompts through the endpoints under per-dataset completion-token budgets.

    Args:
        prompts: a prompt frame (`kit.load(...).frame` or the LoadResult), or None to resume
            from the prompts stored in run_dir.
        config: the run's settings (kit.RunConfig: model, endpoints, budgets, sampling,
            tokenizer, api, concurrency, policy, timeouts ...). With a tokenizer, prompts whose
            prompt tokens + sampling.max_tokens exceed the context are skipped, counted
            (summary column `skipped_context`) and listed in the run database (its skips table).
        run_dir: the run directory (created; resumed when it exists).
        progress: callback(list[DatasetProgress]), at most once a second and once at the end.
        background: return at once; the run is a task on the current loop.
        force: resume even when the fingerprint changed.
        expected_tokens: {dataset: mean completion tokens} from a pilot (admission prior).

    Returns:
        Run: `run.summary()` is one row per dataset (budget, tokens_done, overshoot,
        shortfall, errors, skipped_context); `run.stop_reason` says why it stopped early.

    Example (a notebook cell; the embedded server at `url`):
        config = kit.RunConfig(model="SmolLM2-135M-Instruct", endpoints=url,
                               budgets={"alpaca_tasks": 4000}, sampling=kit.Sampling(max_tokens=64))
        run = await kit.generate(kit.load("data/samples/alpaca_tasks.jsonl"), config,
                                 run_dir="data/runs/demo")
        run.summary()  # alpaca_tasks: budget 4000, tokens_done 4031, state budget_reached
    """
    if not isinstance(config, RunConfig):
        raise ConfigTypeError(
            f"generate: config must be a kit.RunConfig, got {type(config).__name__}"
        )
    runner = Runner.create(
        prompts, config, run_dir=run_dir, force=force, expected_tokens=expected_tokens
    )
    runner.callback = progress
    if background:
        return Run(runner, asyncio.get_running_loop().create_task(runner.run()))
    with _stop_on_sigterm(runner):
        await runner.run()
    return Run(runner)


@contextlib.contextmanager
def _stop_on_sigterm(runner: Runner):
    """While a foreground run lasts, SIGTERM (`kill PID`) and SIGHUP (a closed terminal) ask
    for the clean stop Ctrl-C gets.

    The handler runs on the event loop, between awaits: never inside a write or an fsync.
    Only on the main thread (signals go nowhere else); the previous handler comes back after.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    signals = [signal.SIGTERM, signal.SIGHUP]
    previous = {sig: signal.getsignal(sig) for sig in signals}
    try:
        for sig in signals:
            loop.add_signal_handler(sig, runner.request_stop, f"stopped by {sig.name}")
    except (NotImplementedError, RuntimeError, ValueError):  # no signals on this loop
        yield
        return
    try:
        yield
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
            signal.signal(sig, previous[sig] if previous[sig] is not None else signal.SIG_DFL)


def generate_sync(*args, **kwargs) -> Run:
    """generate() for scripts and running kernels: blocks until the run ends.

    With no running loop it uses asyncio.run (Ctrl-C stops the run cleanly); inside a
    running loop (Jupyter) it runs the run on a worker thread with its own loop.

    Example: kit.generate_sync(frame, config, run_dir="data/runs/x").summary()
    """
    if kwargs.get("background"):
        raise ConfigError("generate_sync: background=True needs `await kit.generate(...)`")
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(generate(*args, **kwargs))
    return _run_in_thread(args, kwargs)


def _run_in_thread(args, kwargs) -> Run:
    """Run generate() on a worker thread's loop; Ctrl-C in the caller stops it cleanly."""
    box: dict = {}

    def target() -> None:
        async def main():
            box["loop"] = asyncio.get_running_loop()
            box["run"] = await generate(*args, **kwargs, background=True)
            return await box["run"].wait()

        try:
            box["result"] = asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, name="kit-generate", daemon=True)
    thread.start()
    while thread.is_alive():
        try:
            thread.join(0.2)
        except KeyboardInterrupt:
            if "run" in box:
                box["loop"].call_soon_threadsafe(box["run"].stop)
    if "error" in box:
        raise box["error"]
    return box["result"]
