"""The pilot: a seeded random sample of prompts per dataset, sent to the target, lengths measured.

Re-exported by kit.plan (`kit.plan.pilot`). The requests go through the generation engine
(kit.generate), so a pilot has the run's retries, endpoint pool and crash-safe records.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kit.types import Sampling

if TYPE_CHECKING:
    import polars as pl

_COLUMNS = """dataset:String prompt_id:String completion_tokens:Int64 finish_reason:String
    count_source:String prompt_tokens:Int64 latency_s:Float64"""  # name:polars dtype


@dataclass(slots=True)
class PilotResult:
    """What a pilot measured."""

    frame: pl.DataFrame  # dataset, prompt_id, completion_tokens, finish_reason, count_source, prompt_tokens, latency_s
    wall_s: float
    sampling: Sampling
    errors: list[str] = field(default_factory=list)  # "dataset/prompt_id[#sample]: kind: message"

    @property
    def tokens_per_s(self) -> float:
        """Completion tokens per second of wall time, all datasets together."""
        return (
            float(self.frame["completion_tokens"].sum()) / self.wall_s if self.wall_s > 0 else 0.0
        )

    def profile(self) -> pl.DataFrame:
        """Completion-length profile per dataset (kit.plan.profile)."""
        from kit.plan import profile

        return profile(self.frame, max_tokens=self.sampling.max_tokens)

    def summary(self) -> dict:
        """A JSON-able summary (stored in plan.json)."""
        return {
            "requests": self.frame.height + len(self.errors),
            "completions": self.frame.height,
            "errors": len(self.errors),
            "wall_s": round(self.wall_s, 3),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "sampling": asdict(self.sampling),
        }


def pilot_sample(
    prompts: pl.DataFrame, per_dataset: int | float | dict[str, int], *, seed: int = 0
) -> pl.DataFrame:
    """A seeded random sample of prompts per dataset, independent of the file's row order.

    Args:
        prompts: a prompt frame (dataset, prompt_id, messages, ...).
        per_dataset: rows per dataset (int, capped at what exists), a fraction in (0, 1)
            of each dataset (rounded up), or a dict dataset -> rows.
        seed: the sampling seed.

    Returns:
        The chosen rows, datasets in sorted order.

    Example:
        >>> prompts = pl.DataFrame({"dataset": ["a"] * 40 + ["b"] * 20,
        ...     "prompt_id": [f"p{i:02d}" for i in range(60)],
        ...     "messages": [[{"role": "user", "content": str(i)}] for i in range(60)]})
        >>> pilot_sample(prompts, 0.1, seed=0)["prompt_id"].to_list()
        ['p12', 'p38', 'p14', 'p00', 'p46', 'p47']
    """
    import polars as pl

    for name in ("dataset", "prompt_id", "messages"):
        if name not in prompts.columns:
            raise ValueError(f"prompts has no {name!r} column (columns: {prompts.columns})")
    if prompts.height == 0:
        raise ValueError("prompts is empty: nothing to pilot")
    if isinstance(per_dataset, dict):
        unknown = sorted(set(per_dataset) - set(prompts["dataset"].unique()))
        if unknown:
            raise ValueError(f"per_dataset names datasets not in prompts: {unknown}")
    parts = []
    for (name,), group in prompts.sort("dataset", "prompt_id").group_by(
        "dataset", maintain_order=True
    ):
        k = _how_many(per_dataset, name, group.height)
        if k:
            parts.append(group.sample(n=k, seed=seed, shuffle=True))
    return pl.concat(parts) if parts else prompts.head(0)


def _how_many(per_dataset: Any, name: str, available: int) -> int:
    """Rows to pilot for one dataset (validates per_dataset)."""
    if isinstance(per_dataset, dict):
        value = per_dataset.get(name, 0)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return min(value, available)
        raise ValueError(f"per_dataset[{name!r}] must be an int >= 0, got {value!r}")
    if isinstance(per_dataset, int) and not isinstance(per_dataset, bool) and per_dataset >= 1:
        return min(per_dataset, available)
    if isinstance(per_dataset, float) and 0 < per_dataset < 1:
        return math.ceil(per_dataset * available)
    raise ValueError(
        f"per_dataset must be an int >= 1, a fraction in (0, 1) or a dict dataset -> int, got {per_dataset!r}"
    )


async def pilot(
    prompts: pl.DataFrame,
    endpoints: Any,
    *,
    model: str | None = None,
    per_dataset: int | float | dict[str, int] = 32,
    max_tokens: int | None = None,
    sampling: Sampling | None = None,
    seed: int = 0,
    concurrency: int = 16,
    timeout: float = 300.0,
    max_attempts: int = 3,
    api: str = "openai",
    api_key_env: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    run_dir: Any = None,
    no_endpoint_timeout: float = 30.0,
) -> PilotResult:
    """Send a seeded random sample of each dataset's prompts to the target; measure lengths.

    The requests go through the generation engine (kit.generate): retries with backoff,
    the endpoint pool, records written to a run directory. With `run_dir`, a pilot that is
    stopped or crashes resumes where it was, and its records stay there.

    Args:
        prompts: a prompt frame (kit.sources.load(...).frame).
        endpoints: a base URL ("http://127.0.0.1:8000/v1") or a list of them.
        model: the model name the server expects.
        per_dataset: rows per dataset, a fraction of each, or a dict (see pilot_sample).
        max_tokens: the completion cap (default 512); or give a full `sampling`.
        sampling: sampling parameters; its max_tokens wins when both are given and agree.
            Its `n` is samples per prompt, as in a run: a pilot for a run that needs more
            samples than a dataset has prompts can take more than one of each.
        seed: which prompts are drawn.
        concurrency: requests in flight.
        timeout: seconds per request.
        max_attempts: tries per request; retryable failures (429, 5xx, timeouts, resets)
            are retried with backoff, the rest counted in `errors`.
        api, api_key_env: the server's API and the NAME of the env var holding its key.
        progress: called as progress(done, total) while it runs and once at the end.
        run_dir: the pilot's own run directory (default: a temporary one, removed after).
        no_endpoint_timeout: seconds with no healthy endpoint before the pilot gives up (the
            prompts left are reported in `errors`).

    Returns:
        A PilotResult: per-request frame, wall time, throughput, failed requests.

    Example:
        >>> res = await pilot(prompts, server.base_url, model=server.model, per_dataset=4, max_tokens=64)
        >>> res.frame.columns[:3], res.errors
        (['dataset', 'prompt_id', 'completion_tokens'], [])
    """
    sampling = _sampling(sampling, max_tokens)
    for name, value in (("concurrency", concurrency), ("max_attempts", max_attempts)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not model:
        raise ValueError(f"model must be given, got {model!r}")
    chosen = pilot_sample(prompts, per_dataset, seed=seed)
    if chosen.height == 0:
        raise ValueError(f"per_dataset={per_dataset!r} picks no prompts: nothing to pilot")
    sizes = dict(chosen.group_by("dataset").len().iter_rows())
    # budgets no pilot can reach: every chosen prompt is sent n times, then its dataset is exhausted
    budgets = {d: k * sampling.n * (sampling.max_tokens + 64) + 1 for d, k in sizes.items()}
    kwargs = dict(model=model, endpoints=endpoints, budgets=budgets, sampling=sampling,
                  api=api, api_key_env=api_key_env, concurrency=concurrency, seed=seed,
                  max_attempts=max_attempts, timeout=timeout, no_endpoint_timeout=no_endpoint_timeout,
                  progress=_progress_adapter(progress, chosen.height * sampling.n))  # fmt: skip
    if run_dir is not None:
        return await _run(chosen, Path(run_dir), sampling, kwargs)
    with tempfile.TemporaryDirectory(prefix="kit-pilot-") as tmp:
        return await _run(chosen, Path(tmp) / "pilot", sampling, kwargs)


async def _run(
    chosen: pl.DataFrame, run_dir: Path, sampling: Sampling, kwargs: dict
) -> PilotResult:
    """kit.generate over the chosen prompts; its records and failures as a PilotResult."""
    import polars as pl

    from kit.generate import generate
    from kit.store import read_errors, records_frame

    start = time.perf_counter()
    await generate(chosen, run_dir=run_dir, **kwargs)
    wall = time.perf_counter() - start
    schema = {n: getattr(pl, t) for n, t in (c.split(":") for c in _COLUMNS.split())}
    frame = records_frame(run_dir).select(list(schema)).cast(schema).sort("dataset", "prompt_id")
    failed = read_errors(run_dir).filter(~pl.col("resolved"))
    failed = failed.unique(subset=["dataset", "prompt_id", "sample"], keep="last")
    errors = [
        f"{d}/{p}{f'#{k}' if k else ''}: {e}"
        for d, p, k, e in failed.select("dataset", "prompt_id", "sample", "error").rows()
    ]
    return PilotResult(frame=frame, wall_s=wall, sampling=sampling, errors=sorted(errors))


def _progress_adapter(progress: Callable[[int, int], None] | None, total: int):
    """The runner's per-dataset progress as progress(done, total) calls."""
    if progress is None:
        return None

    def report(datasets: list) -> None:
        progress(sum(d.samples_done + d.errors for d in datasets), total)

    return report


def _sampling(sampling: Sampling | None, max_tokens: int | None) -> Sampling:
    """The pilot's Sampling from either argument."""
    if sampling is None:
        return Sampling(max_tokens=512 if max_tokens is None else max_tokens)
    if max_tokens is not None and max_tokens != sampling.max_tokens:
        raise ValueError(
            f"max_tokens={max_tokens!r} disagrees with sampling.max_tokens={sampling.max_tokens!r}"
        )
    return sampling


def pilot_sync(*args: Any, **kwargs: Any) -> PilotResult:
    """pilot() for scripts: runs the coroutine (in a worker thread when a loop is already running)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(pilot(*args, **kwargs))
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, pilot(*args, **kwargs)).result()
