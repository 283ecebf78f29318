"""The async runner: interleaved datasets, per-dataset token budgets, retries, resume.

`await kit.generate(prompts, run_dir=..., model=..., endpoints=..., budgets=...)` sends
every dataset's prompts (seeded random order) to the endpoints, interleaved by the lowest
share of budget committed, and stops feeding a dataset before it crosses its budget:

- admission counts tokens done + the expected tokens of requests in flight (running mean
  per dataset; before any record, `expected_tokens` or max_tokens / 2);
- policy "drain" lets in-flight requests finish and also caps in-flight so that
  tokens_done + in_flight * max_tokens <= budget + max(1% of budget, max_tokens): the final
  count lands in [budget, budget + that slack] whenever the prompts suffice;
- policy "cancel" aborts a dataset's in-flight requests once its budget is reached.

With a tokenizer, prompts too long for the context (prompt tokens + max_tokens >
max_context) are never sent: counted per dataset (`skipped_context`) and listed in
run_dir/skipped.jsonl (kit._guard). Results go through kit.store (crash-safe); a stop (run.stop(), a cancelled task, Ctrl-C)
cancels in-flight requests and flushes. Resume = the same call again.
"""

from __future__ import annotations

import asyncio
import threading
from typing import NamedTuple

from kit._callable import make_callable
from kit._runner import _Runner
from kit.types import DatasetProgress, RunConfig, Sampling


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
                "dataset": p.dataset, "state": p.state, "budget": p.budget,
                "tokens_done": p.tokens_done, "share": p.tokens_done / p.budget if p.budget else 0.0,
                "overshoot": max(0, p.tokens_done - p.budget), "shortfall": max(0, p.budget - p.tokens_done),
                "samples_done": p.samples_done, "prompts_total": p.prompts_total,
                "in_flight": p.in_flight, "retries": p.retries, "errors": p.errors,
                "truncated": p.truncated, "skipped_context": p.skipped,
                "tokens_per_s": round(p.tokens_per_s, 1),
            }
        )  # fmt: skip
    return pl.DataFrame(rows)


class Run:
    """A run: finished (foreground) or running as a task on the current loop (background).

    Example:
        run = await kit.generate(prompts, ..., background=True)
        run.status().frame      # one row per dataset
        run.stop(); await run.wait()
        run.summary()           # budget, tokens_done, overshoot, shortfall, errors per dataset
    """

    def __init__(self, runner: _Runner, task: asyncio.Task | None = None) -> None:
        self.run_dir = runner.store.run_dir
        self._runner = runner
        self.task = task

    @property
    def done(self) -> bool:
        return self.task is None or self.task.done()

    @property
    def stop_reason(self) -> str | None:
        """Why the run stopped early (None when it ran to the end)."""
        return self._runner.stop_reason

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
    *,
    run_dir,
    model: str,
    endpoints,
    budgets,
    sampling: Sampling | None = None,
    api: str = "openai",
    api_key_env: str | None = None,
    tokenizer: str | None = None,
    concurrency: int = 32,
    per_endpoint_concurrency: int | None = None,
    policy: str = "drain",
    seed: int = 0,
    max_attempts: int = 5,
    max_context: int | None = None,
    progress=None,
    background: bool = False,
    force: bool = False,
    expected_tokens: dict | None = None,
    timeout: float | None = None,
    retry_base: float = 0.5,
    no_endpoint_timeout: float = 120.0,
) -> Run:
    """Run prompts through the endpoints under per-dataset completion-token budgets.

    Args:
        prompts: a prompt frame (kit.sources.load(...).frame or the LoadResult), or None to
            resume from run_dir/prompts.parquet.
        run_dir: the run directory (created; resumed when it exists).
        model: model name sent to the server. endpoints: a base URL or a list of them.
        budgets: {dataset: completion tokens} (or a kit.Budget); every dataset needs one.
        sampling: kit.Sampling (max_tokens, temperature, top_p, seed, n samples per prompt).
        api: "openai" | "vllm" | "sglang". api_key_env: NAME of the env var with the key.
        tokenizer: local tokenizer path (re-tokenizing; part of the fingerprint via its template).
        concurrency: requests in flight overall; per_endpoint_concurrency: per endpoint.
        policy: "drain" (in-flight finish) or "cancel" (aborted once the budget is reached).
        seed: prompt order. max_attempts: tries per request (429/5xx/timeouts/resets retried).
        max_context: the target's context in tokens; prompts with prompt tokens (chat template
            applied) + sampling.max_tokens above it are skipped, never sent, and reported
            (summary column `skipped_context`, run_dir/skipped.jsonl). Default: from the
            tokenizer (max_position_embeddings in its folder's config.json, else its
            model_max_length). Needs `tokenizer`: without one there is no guard.
        progress: callback(list[DatasetProgress]), at most once a second and once at the end.
        background: return at once; the run is a task on the current loop.
        force: resume even when the fingerprint changed.
        expected_tokens: {dataset: mean completion tokens} from a pilot (admission prior).
        timeout: read timeout per request (default 120 s + 0.5 s per max_token).
        retry_base: first backoff delay in seconds (doubles per attempt, with jitter).
        no_endpoint_timeout: seconds with no healthy endpoint before the run stops cleanly.
    Returns:
        Run (run.summary() -> per dataset: budget, tokens_done, overshoot, errors,
            skipped_context).

    Example:
        run = await kit.generate(kit.load("data/samples/alpaca.jsonl").frame,
                                 run_dir="data/runs/demo", model="smol",
                                 endpoints="http://127.0.0.1:8000/v1",
                                 budgets={"alpaca": 4000}, sampling=kit.Sampling(max_tokens=64))
        run.summary()  # alpaca: budget 4000, tokens_done 4031, overshoot 31, state budget_reached
    """
    sampling = Sampling() if sampling is None else sampling
    runner = _Runner.create(
        prompts, run_dir=run_dir, model=model, endpoints=endpoints, budgets=budgets,
        sampling=sampling, api=api, api_key_env=api_key_env, tokenizer=tokenizer,
        concurrency=concurrency, per_endpoint_concurrency=per_endpoint_concurrency,
        policy=policy, seed=seed, max_attempts=max_attempts, max_context=max_context,
        force=force, expected_tokens=expected_tokens, timeout=timeout, retry_base=retry_base,
        no_endpoint_timeout=no_endpoint_timeout,
    )  # fmt: skip
    runner.callback = progress
    if background:
        return Run(runner, asyncio.get_running_loop().create_task(runner.run()))
    await runner.run()
    return Run(runner)


async def from_config(config: RunConfig, prompts, *, run_dir, **kwargs) -> Run:
    """generate() with the settings of a RunConfig (e.g. kit.store.read_config(run_dir))."""
    return await generate(
        prompts, run_dir=run_dir, model=config.model, endpoints=config.endpoints,
        budgets=config.budgets, sampling=config.sampling, api=config.api,
        api_key_env=config.api_key_env, tokenizer=config.tokenizer,
        concurrency=config.concurrency, per_endpoint_concurrency=config.per_endpoint_concurrency,
        policy=config.policy, seed=config.seed, max_attempts=config.max_attempts,
        max_context=config.max_context, **kwargs,
    )  # fmt: skip


def generate_sync(*args, **kwargs) -> Run:
    """generate() for scripts and running kernels: blocks until the run ends.

    With no running loop it uses asyncio.run (Ctrl-C stops the run cleanly); inside a
    running loop (Jupyter) it runs the run on a worker thread with its own loop.

    Example: kit.generate_sync(frame, run_dir="data/runs/x", model="smol",
                               endpoints=url, budgets={"alpaca": 2000}).summary()
    """
    if kwargs.get("background"):
        raise ValueError("generate_sync: background=True needs `await kit.generate(...)`")
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


def main(argv: list[str] | None = None) -> int:
    """`python -m kit.generate RUN_DIR`: resume (or continue) a run from its config.json.

    Example: python -m kit.generate data/runs/demo --concurrency 64
    """
    import argparse

    from kit.store import read_config

    p = argparse.ArgumentParser(description="Resume a run from run_dir/config.json")
    p.add_argument("run_dir")
    p.add_argument("--concurrency", type=int, default=None)
    p.add_argument("--retry-base", type=float, default=0.5)
    p.add_argument("--timeout", type=float, default=None, help="read timeout per request (s)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    config = read_config(args.run_dir)
    if args.concurrency:
        config.concurrency = args.concurrency
    run = asyncio.run(from_config(config, None, run_dir=args.run_dir, retry_base=args.retry_base))
    if not args.quiet:
        print(run.summary())
    return 0 if run.stop_reason is None else 2


make_callable(__name__, generate)

if __name__ == "__main__":
    raise SystemExit(main())
