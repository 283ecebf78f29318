"""EndpointPool: spread requests over several backends, take dead ones out, bring them back.

The runner acquires the least-loaded healthy endpoint with a free slot, reports each
outcome (failures `unanswered` says are an endpoint's count toward taking it out, and
those `broken` says while another endpoint is healthy: one whose answers are broken is
taken out like a dead one) and a background prober brings taken-out endpoints back when their health check answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any

from kit.errors import (
    BackendConfigError,
    BackendError,
    ConfigError,
    ConnectError,
    HTTPStatusError,
    MalformedAnswer,
    NoEndpoint,
    RequestTimeout,
)
from kit.types import Backend


def unanswered(error: BaseException | None) -> bool:
    """Whether a failure says its endpoint is down: no answer (connect, timeout, or not a
    BackendError at all) or a 5xx."""
    if isinstance(error, HTTPStatusError):
        return error.status >= 500
    return isinstance(error, (ConnectError, RequestTimeout)) or not isinstance(error, BackendError)


def broken(error: BaseException | None) -> bool:
    """Whether a failure says its endpoint's answers are broken: malformed (a bad status
    line or header, bad JSON, impossible counts) or a request it cannot take as configured
    (a redirect)."""
    return isinstance(error, (MalformedAnswer, BackendConfigError))


@dataclass(slots=True)
class _Endpoint:
    backend: Any
    in_flight: int = 0
    healthy: bool = True
    requests: int = 0  # reported outcomes, ok or not
    failures: int = 0
    consecutive: int = 0  # consecutive connect/timeout/5xx failures
    last_ok: float = 0.0  # monotonic time of the last success


class EndpointPool:
    """Least-loaded routing over backends with take-out on failure and health-probed recovery.

    Args:
        backends: one Backend per endpoint (distinct urls).
        per_endpoint_concurrency: max requests in flight per endpoint (None: no limit).
        health_interval: seconds between probes of taken-out (and idle) endpoints.
        fail_threshold: consecutive connect/timeout/5xx (or broken) failures that take an
            endpoint out.
        no_endpoint_timeout: seconds acquire() waits while no endpoint is healthy before it
            raises NoEndpoint.

    Example (inside a coroutine; tests/test_backends.py runs the same against the fault server):
        pool = EndpointPool([OpenAIChat(u, "m") for u in urls], per_endpoint_concurrency=8)
        await pool.start()
        async with pool.acquire() as backend:
            pool.report(backend, True)
        pool.stats()[urls[0]]
        # {'in_flight': 0, 'healthy': True, 'requests': 1, 'failures': 0, 'consecutive': 0}
    """

    def __init__(
        self,
        backends: list[Backend],
        *,
        per_endpoint_concurrency: int | None = None,
        health_interval: float = 5.0,
        fail_threshold: int = 3,
        no_endpoint_timeout: float = 120.0,
    ) -> None:
        backends = list(backends)
        urls = [b.url for b in backends]
        if not backends or len(set(urls)) != len(urls):
            raise ConfigError(
                f"EndpointPool.backends must be non-empty with distinct urls, got {urls}"
            )
        limit = per_endpoint_concurrency
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ConfigError(
                f"EndpointPool.per_endpoint_concurrency must be None or >= 1, got {limit!r}"
            )
        if not isinstance(fail_threshold, int) or fail_threshold < 1:
            raise ConfigError(
                f"EndpointPool.fail_threshold must be an int >= 1, got {fail_threshold!r}"
            )
        for name, v in (
            ("health_interval", health_interval),
            ("no_endpoint_timeout", no_endpoint_timeout),
        ):
            if not isinstance(v, (int, float)) or v <= 0:
                raise ConfigError(f"EndpointPool.{name} must be > 0, got {v!r}")
        self._eps = [_Endpoint(b) for b in backends]
        self._by_backend = {id(ep.backend): ep for ep in self._eps}
        self.limit = limit
        self.health_interval = float(health_interval)
        self.fail_threshold = fail_threshold
        self.no_endpoint_timeout = float(no_endpoint_timeout)
        self._waiters: deque[asyncio.Future] = deque()
        self._task: asyncio.Task | None = None

    @property
    def backends(self) -> list:
        return [ep.backend for ep in self._eps]

    async def start(self) -> None:
        """Check every endpoint's health once, then probe in the background. An endpoint
        that fails this first check is named in a warning at once (with none healthy, the
        run waits no_endpoint_timeout for one before it stops: say so now, not then)."""
        await asyncio.gather(*(self._probe(ep) for ep in self._eps))
        if dead := [ep.backend.url for ep in self._eps if not ep.healthy]:
            warnings.warn(self._dead_message(dead), stacklevel=2)
        self._ensure_task()

    def _dead_message(self, dead: list[str]) -> str:
        which = ", ".join(dead)
        if len(dead) < len(self._eps):
            return f"kit: no answer from {which} (health check): requests go to the other endpoints"
        return (
            f"kit: no answer from {which} (health check: GET /health, then /models): waiting "
            f"up to {self.no_endpoint_timeout:g} s for it to come up before the run stops; "
            "check the URL (--base-url) and that the server runs"
        )

    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._health_loop(), name="kit-pool-health")

    async def aclose(self) -> None:
        """Stop the prober and close every backend."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for fut in self._waiters:
            if not fut.done():
                fut.cancel()
        await asyncio.gather(*(ep.backend.aclose() for ep in self._eps), return_exceptions=True)

    def _pick(self) -> _Endpoint | None:
        """The healthy endpoint with the fewest in flight and a free slot."""
        best = None
        for ep in self._eps:
            if ep.healthy and (self.limit is None or ep.in_flight < self.limit):
                if best is None or ep.in_flight < best.in_flight:
                    best = ep
        return best

    async def _choose(self) -> _Endpoint:
        deadline = None
        while True:
            ep = self._pick()
            if ep is not None:
                return ep
            if any(e.healthy for e in self._eps):
                deadline = None  # all busy: ordinary back-pressure, wait as long as it takes
            elif deadline is None:
                self._ensure_task()
                deadline = time.monotonic() + self.no_endpoint_timeout
            await self._wait(deadline)

    async def _wait(self, deadline: float | None) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        timeout = None if deadline is None else deadline - time.monotonic()
        try:
            await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            self._wake(1)  # pass on a wake-up this waiter may have swallowed
            urls = [ep.backend.url for ep in self._eps]
            msg = f"no healthy endpoint within {self.no_endpoint_timeout:g}s among {urls}"
            raise NoEndpoint(msg) from None
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(fut)

    def _wake(self, n: int | None) -> None:
        """Wake n waiters (None: all)."""
        while self._waiters and (n is None or n > 0):
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                n = None if n is None else n - 1

    @contextlib.asynccontextmanager
    async def acquire(self):
        """Hold a slot on the least-loaded healthy endpoint; yields its backend."""
        ep = await self._choose()
        ep.in_flight += 1
        try:
            yield ep.backend
        finally:
            ep.in_flight -= 1
            if self._waiters:
                self._wake(1)

    def report(self, backend: Backend, ok: bool, error: BaseException | None = None) -> None:
        """Record a request's outcome; enough consecutive connect/timeout/5xx take it out."""
        ep = self._by_backend[id(backend)]
        ep.requests += 1
        if ok:
            ep.consecutive = 0
            ep.last_ok = time.monotonic()
            return
        ep.failures += 1
        if unanswered(error) or (broken(error) and self.elsewhere(backend)):
            ep.consecutive += 1
            if ep.consecutive >= self.fail_threshold:
                ep.healthy = False

    def elsewhere(self, backend: Backend) -> bool:
        """Whether an endpoint other than backend's is healthy (a request can go there)."""
        return any(ep.healthy and ep.backend is not backend for ep in self._eps)

    def stats(self) -> dict[str, dict]:
        """Per endpoint url: in_flight, healthy, requests, failures, consecutive."""
        return {
            ep.backend.url: {
                "in_flight": ep.in_flight,
                "healthy": ep.healthy,
                "requests": ep.requests,
                "failures": ep.failures,
                "consecutive": ep.consecutive,
            }
            for ep in self._eps
        }

    async def _probe(self, ep: _Endpoint) -> None:
        """Health-check one endpoint and set its state."""
        try:
            ok = await ep.backend.health()
        except Exception:  # a broken health check means unhealthy, never a crash
            ok = False
        if ok and not ep.healthy:
            ep.healthy, ep.consecutive = True, 0
            self._wake(None)
        elif not ok:
            ep.healthy = False

    async def _health_loop(self) -> None:
        """Probe taken-out endpoints, and healthy ones with no recent success."""
        while True:
            await asyncio.sleep(self.health_interval)
            now = time.monotonic()
            due = [
                ep for ep in self._eps if not ep.healthy or now - ep.last_ok > self.health_interval
            ]
            await asyncio.gather(*(self._probe(ep) for ep in due))
