"""The pilot: a seeded random sample of prompts per dataset, sent to the target, lengths measured.

Re-exported by kit.plan (`kit.plan.pilot`). A minimal asyncio loop with a semaphore over
`backend.complete`; the runner (kit.generate) does the same at scale with retries.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kit.types import BackendError, Sampling

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
    errors: list[str] = field(default_factory=list)  # "dataset/prompt_id: kind: message"

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
    backend: Any,
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
) -> PilotResult:
    """Send a seeded random sample of each dataset's prompts to the target; measure lengths.

    Args:
        prompts: a prompt frame (kit.sources.load(...).frame).
        backend: a kit.backends Backend, or a base URL ("http://127.0.0.1:8000/v1") for
            make_backend(api, url, model).
        model: the model name (needed with a URL).
        per_dataset: rows per dataset, a fraction of each, or a dict (see pilot_sample).
        max_tokens: the completion cap (default 512); or give a full `sampling`.
        sampling: sampling parameters; its max_tokens wins when both are given and agree.
        seed: which prompts are drawn.
        concurrency: requests in flight.
        timeout: seconds per request.
        max_attempts: tries per request; retryable failures (429, 5xx, timeouts, resets)
            are retried with backoff, the rest counted in `errors`.
        api, api_key_env: for a URL backend (see kit.backends.make_backend).
        progress: called as progress(done, total) after each request.

    Returns:
        A PilotResult: per-request frame, wall time, throughput, failed requests.

    Example:
        >>> res = await pilot(prompts, server.base_url, model=server.model, per_dataset=4, max_tokens=64)
        >>> res.frame.columns[:3], res.errors
        (['dataset', 'prompt_id', 'completion_tokens'], [])
    """
    import polars as pl

    sampling = _sampling(sampling, max_tokens)
    for name, value in (("concurrency", concurrency), ("max_attempts", max_attempts)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    chosen = pilot_sample(prompts, per_dataset, seed=seed)
    if chosen.height == 0:
        raise ValueError(f"per_dataset={per_dataset!r} picks no prompts: nothing to pilot")
    owned = isinstance(backend, str)
    if owned:
        from kit.backends import make_backend

        if not model:
            raise ValueError("model must be given with a URL backend, got None")
        backend = make_backend(api, backend, model, api_key_env=api_key_env)
    rows: list[tuple] = []
    errors: list[str] = []
    jobs = chosen.select("dataset", "prompt_id", "messages").rows()
    gate = asyncio.Semaphore(concurrency)

    async def one(dataset: str, prompt_id: str, messages: list) -> None:
        async with gate:
            t0 = time.perf_counter()
            try:
                c = await _complete(backend, messages, sampling, timeout, max_attempts)
            except BackendError as err:
                errors.append(f"{dataset}/{prompt_id}: {err}")
            else:
                lat = time.perf_counter() - t0
                rows.append(
                    (
                        dataset,
                        prompt_id,
                        c.completion_tokens,
                        c.finish_reason,
                        c.count_source,
                        c.prompt_tokens,
                        lat,
                    )
                )
        if progress is not None:
            progress(len(rows) + len(errors), len(jobs))

    start = time.perf_counter()
    try:
        await asyncio.gather(*(one(*job) for job in jobs))
    finally:
        if owned:
            await backend.aclose()
    wall = time.perf_counter() - start
    frame = pl.DataFrame(
        rows,
        schema={n: getattr(pl, t) for n, t in (c.split(":") for c in _COLUMNS.split())},
        orient="row",
    ).sort("dataset", "prompt_id")
    return PilotResult(frame=frame, wall_s=wall, sampling=sampling, errors=sorted(errors))


async def _complete(
    backend: Any, messages: list, sampling: Sampling, timeout: float, attempts: int
):
    """backend.complete with retries of retryable errors (backoff 0.5 s doubling, or Retry-After)."""
    for attempt in range(1, attempts + 1):
        try:
            return await backend.complete(messages, sampling, timeout=timeout)
        except BackendError as err:
            if not err.retryable or attempt == attempts:
                raise
            await asyncio.sleep(
                err.retry_after if err.retry_after is not None else 0.5 * 2 ** (attempt - 1)
            )
    raise AssertionError("unreachable")


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
