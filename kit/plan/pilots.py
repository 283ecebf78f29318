"""The pilot: a seeded random sample of prompts per dataset, sent to the target, lengths measured.

The requests go through the generation engine (kit.run.generate), so a pilot has the run's
retries, endpoint pool, concurrency and crash-safe records. A plan can trust two defaults:
at least PILOT_PER_DATASET completions per dataset (fewer warns), and the throughput
measured while the run's concurrency was in flight (PilotResult.throughput says at how many).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from kit.errors import ConfigError, ConnectError, Interrupted
from kit.types import DatasetProgress, RunConfig, Sampling

if TYPE_CHECKING:
    import polars as pl

    from kit.data.sources import LoadResult

_COLUMNS = """dataset:String prompt_id:String completion_tokens:Int64 finish_reason:String
    count_source:String prompt_tokens:Int64 latency_s:Float64 t_done:Float64 endpoint:String"""  # name:polars dtype

# completions per dataset a pilot takes by default, and below which it warns: the t bound on
# a mean needs ~30 to be near its nominal level for skewed lengths
PILOT_PER_DATASET = 30


@dataclass(frozen=True, slots=True)
class Throughput:
    """Completion tokens/s, and the requests in flight while it was measured."""

    tokens_per_s: float
    concurrency: int  # requests in flight during the measured window
    window_s: float  # seconds measured
    endpoints: int = 1  # the endpoints those requests were spread over (a gateway is one)

    @property
    def per_endpoint(self) -> float:
        """Tokens/s one endpoint gave."""
        return self.tokens_per_s / self.endpoints

    def servers(self, n: int) -> Throughput:
        """What n endpoints like these would give: per_endpoint x n, with as many requests in
        flight per endpoint. Assumes servers add linearly (same model, hardware and prompts;
        the client is not the bottleneck: bench/bench_client.py).

        Example:
            >>> Throughput(200.0, 16, 30.0, endpoints=2).servers(8)
            Throughput(tokens_per_s=800.0, concurrency=64, window_s=30.0, endpoints=8)
        """
        k = max(1, round(self.concurrency * n / self.endpoints))
        return Throughput(self.per_endpoint * n, k, self.window_s, n)

    def __str__(self) -> str:
        """E.g. "212.3 tok/s with 16 requests in flight (measured over 20.1 s)"."""
        where = f" on {self.endpoints} endpoints" if self.endpoints > 1 else ""
        return (
            f"{self.tokens_per_s:,.1f} tok/s with {self.concurrency} requests in flight{where} "
            f"(measured over {self.window_s:,.1f} s)"
        )


@dataclass(slots=True)
class PilotResult:
    """What a pilot measured."""

    frame: pl.DataFrame  # the _COLUMNS, a row per completion
    wall_s: float
    sampling: Sampling
    errors: list[str] = field(default_factory=list)  # "dataset/prompt_id[#sample]: kind: message"
    concurrency: int | None = None  # the run's RunConfig.concurrency, which the pilot ran with
    chosen: dict[str, int] = field(default_factory=dict)  # dataset -> prompts sent (n times each)
    stop_reason: str | None = None  # why the pilot's run stopped early (kit.generate's Run)
    # regeneration value per dataset (kit.plan.value.SCHEMA), scored after the completions
    value: pl.DataFrame | None = None
    value_s: float = 0.0  # seconds the scoring after the completions took (not in wall_s)

    @property
    def tokens_per_s(self) -> float:
        """Completion tokens per second of wall time, all datasets together (ramp-up and
        tail included: not the run's rate; see `throughput`)."""
        return (
            float(self.frame["completion_tokens"].sum()) / self.wall_s if self.wall_s > 0 else 0.0
        )

    @property
    def throughput(self) -> Throughput | None:
        """Tokens/s while the most requests (up to the run's concurrency) were in flight.

        Its `concurrency` is below the run's when the pilot had fewer requests than
        that: budget() then says the time estimate is extrapolated. Without per-request
        times (a frame lacking t_done) it is the wall-clock rate at the mean number in
        flight (sum of latency_s / wall_s); None without latency_s either.
        """
        measured = measure_throughput(self.frame, self.concurrency)
        k = self.frame["endpoint"].n_unique() if "endpoint" in self.frame.columns else 1
        if measured is not None or "latency_s" not in self.frame.columns or self.wall_s <= 0:
            return measured if measured is None else replace(measured, endpoints=k)
        busy = float(self.frame["latency_s"].fill_null(0).sum())
        in_flight = max(1, round(busy / self.wall_s))
        return Throughput(self.tokens_per_s, in_flight, self.wall_s, k) if busy > 0 else None

    @property
    def per_endpoint(self) -> dict[str, Throughput]:
        """Each endpoint's own throughput (its records alone, its share of the concurrency):
        url -> Throughput; {} without an endpoint column."""
        if "endpoint" not in self.frame.columns:
            return {}
        groups = self.frame.partition_by("endpoint", as_dict=True)
        share = max(1, round((self.concurrency or 0) / len(groups))) if self.concurrency else None
        out = {key[0]: measure_throughput(part, share) for key, part in sorted(groups.items())}
        return {url: m for url, m in out.items() if m is not None}

    def profile(self) -> pl.DataFrame:
        """Completion-length profile per dataset (kit.plan.profile)."""
        from kit.plan.lengths import profile

        return profile(self.frame, max_tokens=self.sampling.max_tokens)

    def __repr__(self) -> str:
        """E.g. "PilotResult: 240 completions of 8 datasets in 95.2 s, 0 failed; ..."."""
        import polars as pl

        f = self.frame
        datasets = f["dataset"].n_unique() if f.height else 0
        cut = f.filter(pl.col("finish_reason") == "length").height if f.height else 0
        share = f" ({cut / f.height:.0%})" if f.height else ""
        return (
            f"PilotResult: {f.height} completions of {datasets} datasets in {self.wall_s:,.1f} s, "
            f"{len(self.errors)} failed; {cut} stopped at max_tokens={self.sampling.max_tokens}"
            f"{share}; throughput {self.throughput}"
        )

    def summary(self) -> dict:
        """A JSON-able summary (stored with the plan in run.sqlite)."""
        measured = self.throughput
        return {
            "requests": self.frame.height + len(self.errors),
            "completions": self.frame.height,
            "errors": len(self.errors),
            "wall_s": round(self.wall_s, 3),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "concurrency": self.concurrency,
            "throughput": None
            if measured is None
            else {
                "tokens_per_s": round(measured.tokens_per_s, 2),
                "concurrency": measured.concurrency,
                "window_s": round(measured.window_s, 3),
            },
            "per_endpoint": {url: round(m.tokens_per_s, 2) for url, m in self.per_endpoint.items()},
            "sampling": asdict(self.sampling),
            "chosen": self.chosen,
            "stop_reason": self.stop_reason,
            "value": None if self.value is None else self.value.to_dicts(),
        }


def pilot_frame(rows: pl.DataFrame | dict | None = None) -> pl.DataFrame:
    """A PilotResult.frame (its columns, their types) from records or column -> values."""
    import polars as pl

    schema = {n: getattr(pl, t) for n, t in (c.split(":") for c in _COLUMNS.split())}
    if rows is None:
        return pl.DataFrame(schema=schema)
    return pl.DataFrame(rows).cast(schema) if isinstance(rows, dict) else rows.cast(schema)


def measure_throughput(frame: pl.DataFrame, concurrency: int | None = None) -> Throughput | None:
    """Completion tokens/s over the time the pipe was full: at least `level` requests in
    flight, level = min(concurrency, the most ever in flight).

    Each row held a request slot from t_done - latency_s to t_done, its tokens spread
    evenly over that time; the rate at a moment is the sum over the requests then in flight.

    Args:
        frame: records or a pilot frame with completion_tokens, latency_s, t_done.
        concurrency: the run's requests in flight (default: the most the frame had).

    Returns:
        A Throughput (tokens_per_s, concurrency = level, window_s); None when the frame
        has no per-request times.

    Example:
        >>> f = pl.DataFrame({"completion_tokens": [100, 100, 100, 100, 100],
        ...     "latency_s": [1.0, 1.0, 1.0, 1.0, 2.0], "t_done": [1.0, 1.0, 2.0, 2.0, 4.0]})
        >>> measure_throughput(f, concurrency=2)  # 2 in flight for 2 s, then 1 for 2 s
        Throughput(tokens_per_s=200.0, concurrency=2, window_s=2.0, endpoints=1)
    """
    need = ("completion_tokens", "latency_s", "t_done")
    if any(name not in frame.columns for name in need):
        return None
    events = []  # (time, +-1, +-rate)
    for tokens, latency, end in frame.select(need).drop_nulls().rows():
        if latency > 0:
            events += [(end - latency, 1, tokens / latency), (end, -1, -tokens / latency)]
    events.sort(key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    spans, k, rate = [], 0, 0.0  # (seconds, in flight, tokens/s)
    for (t, step, change), (t_next, _, _) in pairwise(events):
        k, rate = k + step, rate + change
        if t_next > t:
            spans.append((t_next - t, k, rate))
    if not spans:
        return None
    level = max(k for _, k, _ in spans)
    level = min(level, concurrency) if concurrency else level
    full = [(dt, r) for dt, k, r in spans if k >= level]
    window = sum(dt for dt, _ in full)
    return Throughput(sum(dt * r for dt, r in full) / window, level, window)


def pilot_sample(
    prompts: pl.DataFrame | LoadResult,
    per_dataset: int | float | dict[str, int] = PILOT_PER_DATASET,
    *,
    seed: int = 0,
) -> pl.DataFrame:
    """A seeded random sample of prompts per dataset, independent of the file's row order.

    Args:
        prompts: a prompt frame (dataset, prompt_id, messages, ...), or a LoadResult (the
            sample is chosen from its keys, as from its frame, and only its rows are read).
        per_dataset: rows per dataset (int, capped at what exists; default 30), a
            fraction in (0, 1) of each dataset (rounded up), or a dict dataset -> rows.
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

    from kit.data.sources import LoadResult

    loaded = prompts if isinstance(prompts, LoadResult) else None  # sampled by key
    if loaded is not None:
        prompts = loaded.scan().select("dataset", "prompt_id").collect()
    for name in ("dataset", "prompt_id", "messages"):
        if name not in prompts.columns and (loaded is None or name != "messages"):
            raise ConfigError(f"prompts has no {name!r} column (columns: {prompts.columns})")
    if prompts.height == 0:
        raise ConfigError("prompts is empty: nothing to pilot")
    if isinstance(per_dataset, dict):
        unknown = sorted(set(per_dataset) - set(prompts["dataset"].unique()))
        if unknown:
            raise ConfigError(f"per_dataset names datasets not in prompts: {unknown}")
    parts = []
    for (name,), group in prompts.sort("dataset", "prompt_id").group_by(
        "dataset", maintain_order=True
    ):
        k = pilot_size(per_dataset, name, group.height)
        if k:
            parts.append(group.sample(n=k, seed=seed, shuffle=True))
    chosen = pl.concat(parts) if parts else prompts.head(0)
    if loaded is None:
        return chosen
    keys = chosen.select("dataset", "prompt_id")  # their rows read from the parts, in this order
    found = loaded.scan().join(keys.lazy(), on=["dataset", "prompt_id"], how="semi").collect()
    return keys.join(found, on=["dataset", "prompt_id"], how="left", maintain_order="left")


def pilot_size(per_dataset: Any, name: str, available: int) -> int:
    """Prompts a pilot of `per_dataset` sends of a dataset of `available` (validates it)."""
    if isinstance(per_dataset, dict):
        value = per_dataset.get(name, 0)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return min(value, available)
        raise ConfigError(f"per_dataset[{name!r}] must be an int >= 0, got {value!r}")
    if isinstance(per_dataset, int) and not isinstance(per_dataset, bool) and per_dataset >= 1:
        return min(per_dataset, available)
    if isinstance(per_dataset, float) and 0 < per_dataset < 1:
        return math.ceil(per_dataset * available)
    raise ConfigError(
        f"per_dataset must be an int >= 1, a fraction in (0, 1) or a dict dataset -> int, got {per_dataset!r}"
    )


async def pilot(
    prompts: pl.DataFrame,
    config: RunConfig,
    *,
    per_dataset: int | float | dict[str, int] = PILOT_PER_DATASET,
    progress: Callable[[list[DatasetProgress]], None] | None = None,
    run_dir: Any = None,
    value: bool = True,
) -> PilotResult:
    """Send a seeded random sample of each dataset's prompts to the target; measure lengths.

    The requests go through the generation engine (kit.run.generate) with the run's own
    settings: retries with backoff, the endpoint pool, records written to a run directory.
    With `run_dir`, a pilot that is stopped or crashes resumes where it was, and its
    records stay there.

    Args:
        prompts: a prompt frame or a LoadResult (kit.load(...): only the sample is read).
        config: the run's kit.RunConfig (model, endpoints, sampling, api, concurrency,
            seed, timeouts); its budgets are not used: a pilot sends every chosen prompt.
            `sampling.n` is samples per prompt, as in a run, so a pilot can take more
            than one of each when a dataset has few prompts.
        per_dataset: rows per dataset, a fraction of each, or a dict (see pilot_sample);
            default 30 (all of a dataset's prompts when it has fewer). Fewer than 30
            completions for a dataset (rows x sampling.n) warns: a weak estimate.
        progress: kit.generate's progress callback, e.g. kit.report.monitor.auto() (a widget
            in a notebook, a console table elsewhere), at most once a second and once at
            the end; each dataset's row has budget 0 (a pilot sends every chosen prompt),
            so the monitor counts its requests done of prompts_total.
        run_dir: the pilot's own run directory (default: a temporary one, removed after).
        value: score each dataset's own answers after the completions, the pilot's own
            from the logprobs the server returns with them (kit.plan.value:
            PilotResult.value; False skips it). The sampling, the completions and their
            records are the same either way.

    Returns:
        A PilotResult: per-request frame, wall time, failed requests, and `throughput`
        measured with config.concurrency requests in flight (fewer when the pilot has
        fewer requests than that: its Throughput.concurrency says how many).

    Raises:
        ConnectError: at once when every endpoint refuses the connection (a dead port would
            otherwise hold the pilot no_endpoint_timeout s before a request fails).
        Interrupted: the pilot was stopped by a signal (SIGTERM); its records stay in run_dir.

    Example (needs a server; `config` holds its url and model, e.g. kit.serve.start()'s):
        res = await kit.plan.pilot(prompts, config)
        res.frame.columns[:3], res.errors   # (['dataset', 'prompt_id', 'completion_tokens'], [])
    """
    chosen = pilot_sample(prompts, per_dataset, seed=config.seed)
    if chosen.height == 0:
        raise ConfigError(f"per_dataset={per_dataset!r} picks no prompts: nothing to pilot")
    sizes = dict(chosen.group_by("dataset").len().iter_rows())
    n, max_tokens = config.sampling.n, config.sampling.max_tokens
    from kit.data.sources import LoadResult

    available = (
        prompts.prompts
        if isinstance(prompts, LoadResult)
        else dict(prompts.group_by("dataset").len().iter_rows())
    )
    _warn_weak(sizes, n, available)
    # budgets no pilot can reach: every chosen prompt is sent n times, then its dataset is exhausted
    budgets = {d: k * n * (max_tokens + 64) + 1 for d, k in sizes.items()}
    config = replace(config, budgets=budgets)
    report = _progress_adapter(progress)
    await _refuse_dead(config.endpoints)
    if run_dir is not None:
        result = await _run(chosen, Path(run_dir), config, report, value)
    else:
        with tempfile.TemporaryDirectory(prefix="kit-pilot-") as tmp:
            result = await _run(chosen, Path(tmp) / "pilot", config, report, value)
    result.chosen = sizes
    _raise_if_interrupted(result, chosen.height * n)
    return result


async def _refuse_dead(endpoints: list[str], timeout: float = 5.0) -> None:
    """Raise ConnectError when no endpoint accepts a TCP connection (refused, no route, no
    such host: said in the error); a slow handshake is left to the run's own rules."""

    async def why_not(url: str) -> str | None:
        try:
            parts = urlsplit(url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            connecting = asyncio.open_connection(parts.hostname, port)
            _, writer = await asyncio.wait_for(connecting, timeout)
        except asyncio.TimeoutError:
            return None
        except (OSError, ValueError) as exc:  # ValueError: a port out of range
            code = getattr(exc, "errno", None)
            return f"{url}: {os.strerror(code) if code and code > 0 else exc}"
        writer.close()
        return None

    refused = await asyncio.gather(*map(why_not, endpoints))
    if all(refused):
        raise ConnectError(
            f"the pilot cannot reach its server: {'; '.join(refused)}: check --base-url "
            "(RunConfig.endpoints) and that the server runs"
        )


def _raise_if_interrupted(result: PilotResult, total: int) -> None:
    """Interrupted (exit 128 + the signal's number) when a signal stopped the pilot's run."""
    reason = result.stop_reason or ""
    name = reason.removeprefix("stopped by ")
    if name == reason or name not in signal.Signals.__members__:
        return
    failed = f", {len(result.errors)} failed" if result.errors else ""
    raise Interrupted(
        f"the pilot was interrupted ({reason}) after {result.frame.height} of {total} requests "
        f"answered{failed}: nothing was planned; run it again",
        exit_code=128 + signal.Signals[name],
    )


async def _run(
    chosen: pl.DataFrame, run_dir: Path, config: RunConfig, report, value: bool
) -> PilotResult:
    """kit.run.generate over the chosen prompts; its records and failures as a PilotResult."""
    import polars as pl

    from kit.run.backends import own_logprobs
    from kit.run.generate import generate
    from kit.run.reader import errors_frame, record_batches

    start = time.perf_counter()
    with own_logprobs() if value else contextlib.nullcontext() as own:
        run = await generate(chosen, config, run_dir=run_dir, progress=report)
    wall = time.perf_counter() - start
    parts = list(record_batches(run_dir, columns=list(pilot_frame().columns)))
    frame = pilot_frame(pl.concat(parts) if parts else None).sort("dataset", "prompt_id")
    failed = errors_frame(run_dir).filter(~pl.col("resolved"))
    failed = failed.unique(subset=["dataset", "prompt_id", "sample"], keep="last")
    errors = [
        f"{d}/{p}{f'#{k}' if k else ''}: {e}"
        for d, p, k, e in failed.select("dataset", "prompt_id", "sample", "error").rows()
    ]
    result = PilotResult(
        frame=frame,
        wall_s=wall,
        sampling=config.sampling,
        errors=sorted(errors),
        concurrency=config.concurrency,
        stop_reason=run.stop_reason,
    )
    if value:
        from kit.plan.value import measure

        start = time.perf_counter()
        result.value = await measure(chosen, run_dir, config, own)
        result.value_s = time.perf_counter() - start
    return result


def _warn_weak(sizes: dict[str, int], n: int, available: dict[str, int]) -> None:
    """Warn when a dataset gets fewer than PILOT_PER_DATASET pilot completions."""
    weak = {d: k * n for d, k in sorted(sizes.items()) if k * n < PILOT_PER_DATASET}
    if not weak:
        return
    listed = ", ".join(
        f"{d}: {m}" + (f" (all its {sizes[d]} prompts)" if sizes[d] == available[d] else "")
        for d, m in weak.items()
    )
    warnings.warn(
        f"weak pilot: {listed} completions per dataset, fewer than {PILOT_PER_DATASET}: the mean "
        f"length (and so samples_needed) may be far off (a pilot of 4 was +127.5% off on real "
        f"data); pilot at least {PILOT_PER_DATASET} per dataset",
        UserWarning,
        stacklevel=2,
    )


def _progress_adapter(progress: Callable[[list[DatasetProgress]], None] | None):
    """The runner's per-dataset progress without the pilot's unreachable budgets (budget 0:
    the monitor then counts requests, not tokens against a budget)."""
    if progress is None:
        return None

    def report(datasets: list[DatasetProgress]) -> None:
        progress([replace(d, budget=0) for d in datasets])

    return report


def pilot_sync(*args: Any, **kwargs: Any) -> PilotResult:
    """pilot() for scripts: runs the coroutine (in a worker thread when a loop is already running).

    Example: kit.plan.pilot_sync(prompts, config, per_dataset=32).summary()["errors"] -> 0
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(pilot(*args, **kwargs))
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, pilot(*args, **kwargs)).result()
