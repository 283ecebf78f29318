"""The runner behind kit.generate: scheduling, budget accounting, retries, clean stops.

Budget rule (see kit.generate): a dataset is fed while tokens_done + in_flight * expected
< budget; with policy "drain" also while tokens_done + (in_flight + 1) * max_tokens <=
budget + max(1% of budget, max_tokens), which bounds the final overshoot whatever the
completions turn out to be. Failures are told apart by class (kit.errors), each with its
rule: answers that cannot succeed fail their dataset (_judge); requests no endpoint
answered stop the run (_fail); attempts all failing for stall_timeout stop the run or fail
a dataset (_check_stalls); a 429 never counts (a server asking to wait is alive). Whatever
a request raises is a server error (a BackendError, or _server_error's reading of it) or
kit's own bug, which stops the run with its traceback. A prompt is used up only by a record
kept or a server's refusal of it (a 4xx); a request that failed otherwise goes back to the
end of its queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import random
import time
import warnings
from dataclasses import fields, replace

from kit.data.sources import source_hashes
from kit.errors import (
    BackendConfigError,
    BackendError,
    ConfigError,
    ConnectError,
    HTTPStatusError,
    MalformedAnswer,
    NoEndpoint,
    RequestTimeout,
    UnusableFinish,
)
from kit.run import guard as _guard
from kit.run import turns as _turns
from kit.run.pool import EndpointPool, unanswered
from kit.run.queues import DatasetQueue, Stall, dataset_paths, dataset_queues, prompt_frame
from kit.run.store import RunStore
from kit.secrets import redact
from kit.types import STOPS, Completion, DatasetProgress, ErrorRecord, Record, RunConfig

ID_LIMIT = 2**32  # token ids are stored as uint32 (kit.run.db)
DATA_FINISHES = frozenset({*STOPS, "length"})  # kept as data


def _server_error(exc: Exception, url: str) -> BackendError | None:
    """What a backend request raised that is no BackendError, as the server error it is: a
    timeout, a transport's failure (aiohttp's, an OSError) or data kit could not read (a
    ValueError, LookupError, UnicodeError or ArithmeticError: a bad status line or header,
    too many redirects, an invalid URL, an overflow); None for anything else, kit's own bug."""
    import aiohttp

    what = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, asyncio.TimeoutError):
        return RequestTimeout(f"no answer from {url}: {what}")
    if isinstance(exc, (aiohttp.ClientConnectionError, OSError)):
        return ConnectError(f"{what} talking to {url}")
    if isinstance(
        exc, (aiohttp.ClientError, ValueError, LookupError, UnicodeError, ArithmeticError)
    ):
        return MalformedAnswer(f"broken answer from {url}: {what}")
    return None


def _refused(exc: BaseException) -> bool:
    """A server's refusal of the prompt itself (a 4xx no retry can change): it uses the
    prompt up; every other failure leaves it due."""
    return isinstance(exc, HTTPStatusError) and not exc.retryable


def _dead(exc: BaseException) -> bool:
    """A request that failed every attempt so, max(8, concurrency) in a row: the endpoints
    are dead (a gateway with no live worker answers 503 to everything, at once); NoEndpoint
    (none healthy for no_endpoint_timeout) stops the run at once."""
    return isinstance(exc, BackendError) and (isinstance(exc, NoEndpoint) or unanswered(exc))


class Runner:
    """Scheduling, budget accounting, retries and clean stops for one run."""

    clock = staticmethod(time.monotonic)  # paces progress reports (a test injects a fake one)
    retry_after_cap = 300.0  # s: the longest a server's Retry-After is obeyed

    @classmethod
    def create(cls, prompts, config: RunConfig, *, run_dir, force: bool, expected_tokens) -> Runner:
        """Check the prompts against the config, open the store, build the queues."""
        from kit.data.sources import LoadResult

        frame = prompt_frame(prompts, run_dir)
        if config.turns != "all_turns":
            _refuse_user_runs(prompts.scan() if isinstance(prompts, LoadResult) else frame.lazy())
        names = frame["dataset"].unique(maintain_order=True).to_list()
        _guard.check(config.max_context, config.tokenizer, config.sampling.max_tokens)
        # kept in the guard's cache while the tokenizer's files are unchanged: no load
        template = _guard.template_hash(config.tokenizer, run_dir) if config.tokenizer else None
        config = replace(
            config,
            budgets=config.budgets_for(names),
            source_hashes=source_hashes(frame),
            datasets=dataset_paths(prompts, run_dir) or dict(config.datasets),
            chat_template_hash=template,
        )
        # one commit per wave of in-flight results at most (a kill -9 loses in-flight work
        # anyway); committing every 32 cost ~30% of requests/s at 256 in flight (bench_client)
        store = RunStore(run_dir, flush_every=max(32, config.concurrency))
        store.init(config, prompts, force=force)
        self = cls()
        self.config, self.store = config, store
        self.timeout = config.timeout or 120.0 + 0.5 * config.sampling.max_tokens
        self.retry_base, self.no_endpoint_timeout = config.retry_base, config.no_endpoint_timeout
        try:  # a failure here must release the run directory's lock
            done = store.done()  # a frame of keys, no text
            skips, rows = _guard.apply(frame, config, run_dir, done)  # too long for the context
            store.write_skips(rows)
            self.datasets = dataset_queues(
                frame, config, done, expected_tokens or {}, skips, run_dir, store.totals()
            )
        except BaseException:
            store.close()
            raise
        self.callback, self.stop_reason = None, None
        self._stop_requested = False
        self._last_progress = 0.0
        self._dead = 0  # requests in a row that failed every attempt as _dead() says
        self._stall = Stall()  # attempts failing, over every dataset
        self._attempts: dict = {}  # task -> (dataset, monotonic start) of attempts running
        self._warned_retry_after = False
        self._vocab: dict = {}  # id(backend) -> its tokenizer's vocabulary size (None: unknown)
        self.internal: BaseException | None = None  # kit's own bug, raised when the run ends
        return self

    # -- public-ish
    def short(self) -> dict[str, str]:
        """dataset -> why it ends short of its budget, for every dataset that does for any
        reason but its prompts running out (failed, stopped, prompts refused by the server)."""
        out = {}
        for d in self.datasets.values():
            state = d.state()
            if state == "failed":
                out[d.name] = f"failed: {d.failed}"
            elif state == "exhausted" and d.refused:
                out[d.name] = (
                    f"ended short of its budget ({d.tokens_done} of {d.budget} tokens): "
                    f"{d.refused} of its prompts were refused by the server (the run's errors)"
                )
            elif state not in ("budget_reached", "exhausted"):
                why = d.note or state
                out[d.name] = f"ended short of its budget ({d.tokens_done} of {d.budget}): {why}"
        return out

    def progress(self) -> list[DatasetProgress]:
        now = time.time()
        return [d.progress(now) for d in self.datasets.values()]

    def request_stop(self, reason: str) -> None:
        """Stop the run: stop_reason is one line, each unfinished dataset's note says "run
        stopped: <reason>" (kit generate exits 1); run.stop(), Ctrl-C and the rules call it."""
        if not self._stop_requested:
            self._stop_requested = True
            self.stop_reason = " ".join(reason.split())  # one line
            for d in self.datasets.values():
                if d.state() not in ("budget_reached", "exhausted", "failed"):
                    d.note = f"run stopped: {self.stop_reason}"
        if self._wake is not None:
            self._wake.set()

    _wake: asyncio.Event | None = None

    # -- main loop
    async def run(self) -> None:
        """Refuse endpoints serving other models (kit.run.served), then schedule until done."""
        from kit.run.backends import make_backend
        from kit.run.served import check_models

        cfg = self.config
        backends = [
            make_backend(
                cfg.api,
                url,
                cfg.model,
                api_key_env=cfg.api_key_env,
                tokenizer=cfg.tokenizer,
                max_body_bytes=cfg.max_body_bytes,
            )
            for url in cfg.endpoints
        ]
        self.pool = EndpointPool(
            backends,
            per_endpoint_concurrency=cfg.per_endpoint_concurrency,
            no_endpoint_timeout=self.no_endpoint_timeout,
        )
        self._wake, self._done = asyncio.Event(), []
        try:
            with _frozen_heap():
                await check_models(self.pool.backends)
                await self.pool.start()
                await self._schedule()
        except BaseException as e:
            self.request_stop(f"interrupted ({type(e).__name__})")
            raise
        finally:
            await self._shutdown()
        if self.internal is not None:
            raise self.internal  # with its traceback: a bug in kit, no server's fault

    async def _schedule(self) -> None:
        """Admit, wait for completions (O(1) each, via done callbacks), write, repeat."""
        while not self._stop_requested:
            self._admit()
            if not any(d.tasks for d in self.datasets.values()):
                break
            if not self._done:
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.store.flush_interval)
            done, self._done = self._done, []
            for task in done:
                self._finish(task)
            self._check_stalls()
            self.store.maybe_flush()
            self._report()

    def _admit(self) -> None:
        """Start requests while slots are free, always for the least-committed dataset."""
        in_flight = sum(len(d.tasks) for d in self.datasets.values())
        while in_flight < self.config.concurrency:
            ds = [d for d in self.datasets.values() if self._admissible(d)]
            if not ds:
                return
            d = min(ds, key=lambda d: d.committed / d.budget)
            prompt_id, sample, messages = d.queue.popleft()
            task = asyncio.ensure_future(self._request(d, prompt_id, sample, messages))
            task.meta = (d, prompt_id, sample, messages)
            task.add_done_callback(self._on_done)
            d.hold(task, self._most(messages))
            in_flight += 1

    def _on_done(self, task: asyncio.Task) -> None:
        self._done.append(task)
        self._wake.set()

    def _admissible(self, d: DatasetQueue) -> bool:
        """Whether one more request for d keeps the budget promise."""
        if not d.queue or d.stopped or d.failed or d.committed >= d.budget:
            return False
        if self.config.policy == "cancel":
            return True
        # the most the next sample can add: max_tokens, or one per generated turn (all_turns)
        most = self._most(d.queue[0][2])
        slack = max(0.01 * d.budget, most)
        return d.tokens_done + d.most_in_flight + most <= d.budget + slack

    def _most(self, messages) -> int:
        """The most completion tokens one sample of these messages can add."""
        k = _turns.slots(messages) if self.config.turns == "all_turns" else 1
        return k * self.config.sampling.max_tokens

    async def _request(
        self, d: DatasetQueue, prompt_id: str, sample: int, messages: list
    ) -> Record:
        """One sample (every turn of it with all_turns); raises when a request failed."""
        sampling = d.sampling
        if sampling.seed is not None:
            sampling = replace(sampling, seed=sampling.seed + sample)
        tools, t0, used = d.tools.get(prompt_id), time.monotonic(), {}

        async def complete(conversation: list) -> Completion:
            comp, used["backend"], used["attempt"] = await self._complete(
                d, conversation, sampling, tools
            )
            return comp

        turns, total = None, None
        if self.config.turns == "all_turns" and _turns.slots(messages) > 1:
            messages, turns, comp, total = await _turns.regenerate(complete, messages)
        else:
            comp = await complete(messages)
        record = _record(
            d.name, prompt_id, sample, messages, comp, used["backend"], t0, used["attempt"]
        )
        record.tools, record.turns = tools, turns
        if total is not None:
            record.completion_tokens = total
        return record

    async def _complete(self, d: DatasetQueue, messages: list, sampling, tools):
        """One request with retries -> (Completion, backend, attempt); raises the last error."""
        task = asyncio.current_task()
        for attempt in itertools.count(1):  # ends in a return or a raise
            backend = None
            self._attempts[task] = (d, time.monotonic())
            try:
                try:
                    async with self.pool.acquire() as backend:
                        comp = await backend.complete(
                            messages, sampling, timeout=self.timeout, tools=tools
                        )
                except BackendError:
                    raise
                except Exception as exc:
                    err = None if backend is None else _server_error(exc, backend.url)
                    if err is None:
                        raise  # kit's own bug: _finish stops the run with it
                    raise err.with_text(redact(str(err), self._secrets())[:500]) from exc
                self._check(comp, backend)  # outside: loading the tokenizer is kit's side
                self.pool.report(backend, True)
                d.streak = 0
                d.stall.ok()
                self._stall.ok()
                return comp, backend, attempt
            except BackendError as e:
                if backend is not None:
                    self.pool.report(backend, False, e)
                e.attempts = attempt
                if isinstance(e, UnusableFinish):
                    self.store.count_finish(d.name, e.finish)
                self._judge(d, e, backend)
                elsewhere = isinstance(e, BackendConfigError) and self.pool.elsewhere(backend)
                if (
                    not (e.retryable or elsewhere)
                    or attempt == self.config.max_attempts
                    or isinstance(e, NoEndpoint)
                    or self._stop_requested
                ):
                    raise
                d.retries += 1
                wait = self._backoff(attempt, e.retry_after)
            finally:
                self._attempts.pop(task, None)
            await asyncio.sleep(wait)

    def _check(self, comp: Completion, backend) -> None:
        """An answer kit can keep, else a BackendError: a finish that is data (DATA_FINISHES),
        token ids in 0..2**32 - 1 and inside the tokenizer's vocabulary when known, a prompt
        count that fits, and no empty answer (no content, thinking nor calls) counting
        more than an end token."""
        url = backend.url
        if comp.finish_reason not in DATA_FINISHES:
            msg = (
                f"the answer from {url} ended with finish_reason {comp.finish_reason!r}: no "
                "data (kit keeps stop, length and tool-call finishes)"
            )
            raise UnusableFinish(msg, comp.finish_reason)
        if id(backend) not in self._vocab:
            tok = backend.tokenizer if self.config.tokenizer else None
            self._vocab[id(backend)] = len(tok) if tok is not None else None
        limit = min(self._vocab[id(backend)] or ID_LIMIT, ID_LIMIT)
        for what, ids in (("token ids", comp.output_ids), ("prompt token ids", comp.prompt_ids)):
            if ids and (min(ids) < 0 or max(ids) >= limit):
                bad = next(i for i in ids if not 0 <= i < limit)
                raise MalformedAnswer(f"{what} from {url} hold {bad}, not an id in 0..{limit - 1}")
        if comp.prompt_tokens is not None and comp.prompt_tokens >= ID_LIMIT:
            raise MalformedAnswer(f"prompt_tokens={comp.prompt_tokens} from {url} is out of range")
        if not (comp.text or comp.reasoning or comp.tool_calls) and comp.completion_tokens > 1:
            msg = f"no content from {url} but {comp.completion_tokens} completion tokens counted"
            raise MalformedAnswer(msg)

    def _judge(self, d: DatasetQueue, e: BackendError, backend) -> None:
        """Count failed attempts (the stall rules; a 429 never counts) and answers that cannot
        succeed (MalformedAnswer, or not retryable: a 4xx such as tools refused, no usage and
        no tokenizer): max_consecutive_failures of them in a row, none succeeding in between,
        fail the dataset. A Retry-After over retry_after_cap is waited for only that long,
        noted on the dataset and warned about once per run."""
        if not (isinstance(e, HTTPStatusError) and e.status == 429):  # asking to wait: alive
            now = time.monotonic()
            d.stall.fail(now, str(e))
            self._stall.fail(now, str(e))
        unusable = isinstance(e, (MalformedAnswer, UnusableFinish))
        if unusable or not (e.retryable or isinstance(e, NoEndpoint)):
            d.streak += 1
            if d.streak >= self.config.max_consecutive_failures:
                self._fail_dataset(
                    d,
                    f"{d.streak} answers in a row failed and none succeeded "
                    f"(malformed or not retryable), so none can; last error: {e}",
                )
        if e.retry_after is not None and e.retry_after > self.retry_after_cap:
            url, cap = getattr(backend, "url", "the server"), self.retry_after_cap
            d.note = d.note or (
                f"server asks Retry-After {e.retry_after:g}s, over the {cap:g}s cap: "
                f"retries wait {cap:g}s"
            )
            if not self._warned_retry_after:
                self._warned_retry_after = True
                warnings.warn(
                    f"kit: {url} asks to wait Retry-After {e.retry_after:g}s; kit waits at most "
                    f"{cap:g}s between retries (said once per run)",
                    stacklevel=2,
                )

    def _fail_dataset(self, d: DatasetQueue, reason: str) -> None:
        """Feed d no more (state "failed", the reason in its note); stop the run when every
        dataset failed."""
        if d.failed:
            return
        d.failed = " ".join(reason.split())[:600]
        d.note = f"failed: {d.failed}"
        if all(x.failed for x in self.datasets.values()):
            why = "; ".join(f"dataset {x.name!r}: {x.failed}" for x in self.datasets.values())
            self.request_stop(f"every dataset failed: {why}")

    def _check_stalls(self) -> None:
        """Nothing can succeed (a server answering 5xx while its /health says 200): when every
        attempt failed for stall_timeout s, at least max(8, concurrency) of them (8 of one
        dataset), and none that started earlier is still running, stop the run (or fail
        that dataset). The stop comes within stall_timeout + 1 s of the first failure, or
        one request timeout if they hang."""
        failing = [d for d in self.datasets.values() if d.stall.since is not None]
        if not failing:  # the run's stall implies a dataset's (the hot path: no failures)
            return
        now, window = time.monotonic(), self.config.stall_timeout
        starts = list(self._attempts.values())
        oldest = min((t for _, t in starts), default=None)
        s = self._stall
        if s.stalled(now, window, max(8, self.config.concurrency), oldest):
            self.request_stop(
                f"no request succeeded for {now - s.since:.0f}s (stall_timeout {window:g}s): "
                f"{s.failed} attempts in a row failed, so nothing can; last error: {s.last}"
            )
            return
        for d in failing:
            mine = min((t for x, t in starts if x is d), default=None)
            if not d.failed and d.stall.stalled(now, window, 8, mine):
                self._fail_dataset(
                    d,
                    f"no request succeeded for {now - d.stall.since:.0f}s (stall_timeout "
                    f"{window:g}s): {d.stall.failed} attempts in a row failed; last error: "
                    f"{d.stall.last}",
                )

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        """Exponential backoff with jitter; a server's Retry-After wins when given (capped)."""
        if retry_after is not None and retry_after >= 0:
            return min(retry_after, self.retry_after_cap)
        return min(self.retry_base * 2 ** (attempt - 1), 60.0) * random.uniform(0.5, 1.5)

    def _secrets(self) -> list[str]:
        """The key and URL credentials of every endpoint (kept out of every message)."""
        pool = getattr(self, "pool", None)
        return [s for b in (pool.backends if pool else []) for s in getattr(b, "secrets", list)()]

    def _finish(self, task: asyncio.Task) -> None:
        """Write the record (or error) of a finished request and update the accounting."""
        d = task.meta[0]
        d.release(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            return self._fail(d, task.meta[1:], exc)
        record = task.result()
        if self.config.policy == "cancel" and d.tokens_done >= d.budget:
            return  # budget reached while this one ran: cancelled results are not written
        self._dead = 0
        self.store.append(record)
        d.tokens_done += record.completion_tokens
        d.samples_done += 1
        d.succeeded += 1
        d.truncated += record.finish_reason == "length"
        d.recent.append((record.t_done, record.completion_tokens))
        if self.config.policy == "cancel" and d.tokens_done >= d.budget:
            for t in list(d.tasks):
                t.cancel()
                d.release(t)
                d.queue.appendleft(t.meta[1:])

    def _fail(self, d: DatasetQueue, item: tuple, exc: BaseException) -> None:
        """Log a request that failed every attempt; its prompt is due again (the end of the
        queue) unless the server refused it. The endpoints are dead, so the run stops,
        after max(8, concurrency) in a row failed unanswered or with a 5xx (a success or
        another answer ends the streak), or at once on NoEndpoint; a dataset whose prompts
        ran out with every request failed and no record written fails. Anything not a
        BackendError is kit's own bug (or Ctrl-C inside a request): no error row, the prompt
        stays due, the run stops (and re-raises a bug when it has stopped)."""
        prompt_id, sample, _ = item
        if not isinstance(exc, BackendError):
            d.queue.appendleft(item)
            if isinstance(exc, Exception) and self.internal is None:
                self.internal = exc
            self.request_stop(
                f"internal error (a bug in kit): {type(exc).__name__}: {exc}"
                if isinstance(exc, Exception)
                else f"interrupted ({type(exc).__name__})"
            )
            return
        message = redact(str(exc), self._secrets())
        attempts = getattr(exc, "attempts", 1)
        error = ErrorRecord(d.name, prompt_id, sample, message[:500], attempts, time.time())
        self.store.append_error(error)
        d.errors += 1
        if _refused(exc):
            d.refused += 1
        else:
            d.queue.append(item)
        self._dead = self._dead + 1 if _dead(exc) else 0  # another answer: alive
        if self._dead >= max(8, self.config.concurrency) or isinstance(exc, NoEndpoint):
            self.request_stop(f"{self._dead} requests in a row failed, last: {message[:200]}")
        elif not d.queue and not d.tasks and d.samples_done == 0:
            self._fail_dataset(
                d, f"all {d.errors} requests failed and none succeeded; last error: {message[:300]}"
            )

    def _report(self, final: bool = False) -> None:
        """Progress callback + the status row, at most once a second (and once at the end)."""
        now = self.clock()
        if not final and now - self._last_progress < 1.0:
            return
        self._last_progress = now
        progress = self.progress()
        self.store.write_status(progress, finished=final, stop_reason=self.stop_reason)
        if self.callback is not None:
            try:
                self.callback(progress)
            except Exception as e:  # noqa: BLE001 - a bad callback must not end the run
                warnings.warn(f"progress callback failed: {e!r}", stacklevel=1)

    async def _shutdown(self) -> None:
        """Keep finished results, cancel the rest, flush + fsync, close the pool."""
        finished = [t for d in self.datasets.values() for t in d.tasks if t.done()]
        try:
            for task in dict.fromkeys(self._done + finished):
                self._finish(task)
        except OSError:
            pass  # the store failed (e.g. full disk); close() below reports nothing new
        self._done = []
        tasks = [t for d in self.datasets.values() for t in d.tasks]
        for t in tasks:
            t.cancel()
            d, prompt_id, sample, messages = t.meta
            d.queue.appendleft((prompt_id, sample, messages))  # not done: due on resume
        for d in self.datasets.values():
            d.stopped = d.stopped or self._stop_requested or bool(d.tasks)
            for t in list(d.tasks):
                d.release(t)
        try:
            self.store.flush()
        finally:
            try:
                self._report(final=True)  # the final status, committed before the store closes
            finally:
                self.store.close()
                await asyncio.gather(*tasks, return_exceptions=True)
                await self.pool.aclose()


@contextlib.contextmanager
def _frozen_heap():
    """Freeze (gc.freeze) what existed before the run, so the full collections its requests
    trigger scan what the run made, not the whole heap (modules, a notebook's state, the
    queued prompts) again; only when nothing is frozen yet (a concurrent run may have)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _refuse_user_runs(prompts) -> None:
    """Prompts (a LazyFrame) with user turns in a row (a list of user turns: the turns
    format) are answered turn by turn only with turns="all_turns"; sent whole they are no chat."""
    import polars as pl

    if "messages" not in prompts.collect_schema().names():  # a resume: the fingerprint holds it
        return
    user = pl.element().struct.field("role") == "user"
    runs = pl.col("messages").list.eval(user & user.shift(1)).list.any().fill_null(False)
    found = prompts.filter(runs).select("dataset").unique(maintain_order=True).collect()
    names = found["dataset"].to_list()
    if names:
        raise ConfigError(
            f"datasets {names} hold lists of user turns (the turns format, e.g. MT-bench): "
            "each turn must be answered by the target in turn, so run them with "
            "RunConfig(turns='all_turns') (kit plan --turns all_turns)"
        )


def _record(dataset, prompt_id, sample, messages, comp, backend, t0, attempt) -> Record:
    """Completion -> Record: the fields they share, its text as the completion."""
    shared = {f: getattr(comp, f) for f in _SHARED}
    return Record(
        dataset=dataset,
        prompt_id=prompt_id,
        sample=sample,
        messages=messages,
        completion=comp.text,
        endpoint=getattr(backend, "url", ""),
        latency_s=round(time.monotonic() - t0, 4),
        attempts=attempt,
        t_done=time.time(),
        **shared,
    )


_SHARED = [f.name for f in fields(Completion) if f.name in {g.name for g in fields(Record)}]
