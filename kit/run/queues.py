"""A run's per-dataset queues and live state: what the runner schedules from.

prompt_frame(prompts, run_dir)   the prompt frame given, or the run's stored prompts (no text)
seeded_order(ids, dataset, seed) the order a dataset's (prompt_id, sample) pairs go in
dataset_queues(frame, config, ...) one DatasetQueue per dataset: its queue of samples
                                 not yet done nor skipped, its done totals, sampling and tools
PromptQueue                      that queue; on a resume it reads texts as its head reaches them
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections import deque
from dataclasses import dataclass, field, replace

import orjson

from kit.errors import ConfigError
from kit.run.reader import is_run_dir, prompts_frame, read_config
from kit.types import DatasetProgress, RunConfig


@dataclass
class Stall:
    """Attempts failing with none succeeding: since when, and how many (a success resets)."""

    since: float | None = None  # monotonic time of the first failure after the last success
    failed: int = 0
    last: str = ""  # the last failure's message

    def ok(self) -> None:
        self.since, self.failed, self.last = None, 0, ""

    def fail(self, now: float, message: str) -> None:
        self.since = now if self.since is None else self.since
        self.failed, self.last = self.failed + 1, message

    def stalled(self, now: float, window: float, least: int, oldest: float | None) -> bool:
        """Every attempt failed for `window` s, at least `least` of them, and no attempt still
        running started before the first failure (`oldest`: the oldest running attempt's start)."""
        if self.since is None or self.failed < least or now - self.since < window:
            return False
        return oldest is None or oldest >= self.since


class PromptQueue:
    """A dataset's samples not yet sent, (prompt_id, sample, messages) like a deque. On a
    resume the messages and tools are read from the run database (checked against their
    hashes) a batch at a time as the head reaches them: a restart reads no text up front.

    Example:
        >>> q = PromptQueue([("a", 0), ("b", 0)], {"a": ["hi"], "b": ["yo"]})
        >>> q.popleft(), q[0], len(q)
        (('a', 0, ['hi']), ('b', 0, ['yo']), 1)
    """

    BATCH = 4_096  # prompts read per database lookup, at most (the first reads are small)

    def __init__(self, todo, messages: dict, tools: dict | None = None, load=None) -> None:
        self.todo = deque(todo)  # (prompt_id, sample)
        self.messages = messages  # prompt_id -> messages, of those read so far
        self.tools = {} if tools is None else tools  # prompt_id -> tools: filled as read
        self.load = load  # load(ids=[prompt ids]) -> frame of prompt_id, messages, tools
        self.batch = min(64, self.BATCH)  # doubles with each read: a first request waits little

    def __len__(self) -> int:
        return len(self.todo)

    def __getitem__(self, i: int) -> tuple:
        pid, sample = self.todo[i]
        if pid not in self.messages:
            self._read(i)
        return pid, sample, self.messages[pid]

    def popleft(self) -> tuple:
        item = self[0]
        self.todo.popleft()
        return item

    def appendleft(self, item: tuple) -> None:
        pid, sample, messages = item
        self.messages[pid] = messages
        self.todo.appendleft((pid, sample))

    def append(self, item: tuple) -> None:
        """Due again after every other (a request that failed, not refused)."""
        pid, sample, messages = item
        self.messages[pid] = messages
        self.todo.append((pid, sample))

    def _read(self, i: int) -> None:
        pids: dict = {}
        for pid, _ in itertools.islice(self.todo, i, None):
            if pid not in self.messages:
                pids[pid] = None
                if len(pids) == self.batch:
                    break
        self.batch = min(2 * self.batch, self.BATCH)
        part = self.load(ids=list(pids))
        self.messages.update(
            zip(part["prompt_id"].to_list(), part["messages"].to_list(), strict=True)
        )
        self.tools.update(_tools(part))


@dataclass
class DatasetQueue:
    """Live state of one dataset in a run."""

    name: str
    budget: int
    queue: PromptQueue  # (prompt_id, sample, messages) not yet sent
    total: int  # samples available (prompts x n)
    prior: float  # expected completion tokens before any record
    tokens_done: int = 0
    samples_done: int = 0
    truncated: int = 0
    retries: int = 0
    errors: int = 0
    refused: int = 0  # prompts the server refused (a 4xx): used up without a record
    tasks: set = field(default_factory=set)
    recent: deque = field(default_factory=lambda: deque(maxlen=256))  # (t_done, tokens)
    stopped: bool = False
    skipped: int = 0  # samples never sent (prompt too long for the context)
    streak: int = 0  # answers in a row that were malformed or not retryable
    succeeded: int = 0  # requests that succeeded in this run (samples_done counts earlier runs)
    failed: str = ""  # why none of its requests can succeed (then it is fed no more)
    stall: Stall = field(default_factory=lambda: Stall())
    note: str = ""  # shown next to the dataset (stop reason, Retry-After over the cap)
    sampling: object = None  # its Sampling (RunConfig.sampling_for), n=1: what a request sends
    tools: dict = field(default_factory=dict)  # prompt_id -> tool definitions (list) sent with it
    slots: dict = field(default_factory=dict)  # in-flight task -> its most completion tokens
    most_in_flight: int = 0  # sum of slots' values, kept as they change (admission is hot)

    def hold(self, task, most: int) -> None:
        """A request started that can add at most `most` completion tokens."""
        self.tasks.add(task)
        self.slots[task] = most
        self.most_in_flight += most

    def release(self, task) -> None:
        """A request ended (done, failed or cancelled)."""
        self.tasks.discard(task)
        self.most_in_flight -= self.slots.pop(task, 0)

    @property
    def expected(self) -> float:
        """Running mean of completion tokens, pulled toward the prior for the first few."""
        return (self.tokens_done + 2 * self.prior) / (self.samples_done + 2)

    @property
    def committed(self) -> float:
        return self.tokens_done + len(self.tasks) * self.expected

    def state(self) -> str:
        if self.tokens_done >= self.budget:
            return "budget_reached"
        if self.failed:
            return "failed"
        if not self.queue and not self.tasks:
            return "exhausted"
        if self.stopped:
            return "stopped"
        return "running" if self.tasks or self.samples_done else "waiting"

    def progress(self, now: float) -> DatasetProgress:
        window = [(t, c) for t, c in self.recent if now - t <= 30.0]
        rate = sum(c for _, c in window) / max(now - window[0][0], 1.0) if len(window) > 1 else 0.0
        return DatasetProgress(
            dataset=self.name,
            budget=self.budget,
            tokens_done=self.tokens_done,
            samples_done=self.samples_done,
            in_flight=len(self.tasks),
            prompts_total=self.total,
            errors=self.errors,
            retries=self.retries,
            truncated=self.truncated,
            skipped=self.skipped,
            tokens_per_s=rate,
            state=self.state(),
            note=self.note,
        )


def dataset_paths(prompts, run_dir) -> dict[str, str]:
    """dataset -> source path: from a LoadResult, or the run's recorded ones on resume."""
    if prompts is None and is_run_dir(run_dir):
        try:
            return read_config(run_dir).datasets
        except FileNotFoundError:  # prompts stored by a plan, no run yet
            return {}
    return dict(getattr(prompts, "paths", None) or {})


def prompt_frame(prompts, run_dir):
    """The prompt frame to run: given, or without text (that of prompts with work left is
    read from the store later, prompt_text) the keys of a LoadResult, whose prompts the store
    takes a part at a time, or of the run's stored prompts on resume."""
    import polars as pl

    from kit.data.sources import LoadResult

    if prompts is None:
        frame = prompts_frame(run_dir, text=False) if is_run_dir(run_dir) else None
        if frame is None or frame.height == 0:
            raise ConfigError(
                f"prompts=None but {run_dir} holds no stored prompts: pass the prompt frame"
            )
        return frame
    if isinstance(prompts, LoadResult):  # its keys; the prompts stream into the store
        if prompts.height == 0:
            raise ConfigError("the LoadResult holds no prompts")
        return prompts.scan().select("dataset", "prompt_id").collect()
    frame = prompts
    if not isinstance(frame, pl.DataFrame):
        raise ConfigError(
            f"prompts must be a polars DataFrame or a LoadResult, got {type(prompts).__name__}"
        )
    if missing := {"dataset", "prompt_id", "messages"} - set(frame.columns):
        raise ConfigError(f"prompt frame lacks columns {sorted(missing)}; found {frame.columns}")
    if frame.height == 0:
        raise ConfigError("the prompt frame is empty")
    return frame


def seeded_order(prompt_ids, dataset: str, seed: int, n: int = 1) -> list[tuple[str, int]]:
    """The order a run sends one dataset's (prompt_id, sample) pairs in.

    Prompts are shuffled by a seed of their own (independent of file order); with n samples
    per prompt, every prompt's sample 0 comes before any sample 1, so a dataset its budget
    cuts short is still spread over as many distinct prompts as it can be.

    Example:
        >>> seeded_order(["a", "b", "c"], "d", 0, n=2)
        [('c', 0), ('a', 0), ('b', 0), ('c', 1), ('a', 1), ('b', 1)]
    """
    ids = sorted(prompt_ids)
    ids = [ids[i] for i in _permutation(len(ids), dataset, seed)]
    return [(pid, s) for s in range(n) for pid in ids]


def _permutation(size: int, dataset: str, seed: int):
    """seeded_order's shuffle as positions into the sorted ids (numpy's generator, seeded by
    a hash of seed and dataset): dataset_queues gathers a polars column with it, no str per prompt."""
    import numpy as np

    key = hashlib.blake2b(f"{seed}:{dataset}".encode(), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(key, "little")).permutation(size)


def dataset_queues(
    frame, config: RunConfig, done, priors: dict, skips: dict, run_dir=None, totals=None
) -> dict[str, DatasetQueue]:
    """Per dataset: the seeded order of (prompt_id, sample) not yet done nor skipped, done totals.

    `done`: the records already written, as RunStore.done()'s frame (one row per key);
    read once, not once per dataset. `totals`: RunStore.totals() (none: nothing done).
    Messages and tools are taken out of the frame only for prompts with a sample to send;
    on a resume they are read from the database as the queue reaches them (PromptQueue).
    """
    import polars as pl

    n = config.sampling.n
    done_ids = _done_ids(done)
    totals = totals or {}
    skipped: dict[str, int] = {}
    skip_ids: dict[str, list] = {}
    for (ds, pid), (_, samples) in skips.items():
        skipped[ds] = skipped.get(ds, 0) + samples
        skip_ids.setdefault(ds, []).append(pid)
    out = {}
    for (name,), part in frame.group_by("dataset", maintain_order=True):
        ids = _sorted_unique(part["prompt_id"])
        order = ids.gather(_permutation(len(ids), name, config.seed))
        order = order.filter(
            ~order.is_in(pl.Series(skip_ids.get(name, []), dtype=pl.String).implode())
        )
        todo = []
        for s in range(n):
            gone = done_ids.get((name, s))
            left = order if gone is None else order.filter(~order.is_in(gone.implode()))
            todo += [(pid, s) for pid in left.to_list()]
        if "messages" not in part.columns:  # a resume: texts read as the queue reaches them
            load = functools.partial(prompts_frame, run_dir, datasets=[name])  # by key, checked
            queue = PromptQueue(todo, {}, load=load)
        else:  # messages and tools of the prompts still to send only
            wanted = list(dict.fromkeys(pid for pid, _ in todo))
            if len(wanted) < len(ids):
                part = part.filter(pl.col("prompt_id").is_in(wanted))
            part = part.unique(subset="prompt_id", keep="first")
            messages = dict(
                zip(part["prompt_id"].to_list(), part["messages"].to_list(), strict=True)
            )
            queue = PromptQueue(todo, messages, _tools(part))
        prior = float(priors.get(name, config.sampling.max_tokens / 2))
        d = DatasetQueue(
            name=name,
            budget=config.budgets[name],
            queue=queue,
            total=len(ids) * n,
            prior=prior,
            sampling=replace(config.sampling_for(name), n=1),
            tools=queue.tools,
        )
        d.skipped = skipped.get(name, 0)
        d.samples_done, d.tokens_done, d.truncated = totals.get(name, (0, 0, 0))
        out[name] = d
    return out


def _sorted_unique(ids):
    """The ids unique and sorted in bytes order (sorted()'s code point order); as the key
    index gives them on a resume they already are, which one comparison pass confirms."""
    if len(ids) > 1 and not (ids.slice(1) > ids.slice(0, len(ids) - 1)).all():
        return ids.unique().sort()
    return ids


def _done_ids(done) -> dict:
    """(dataset, sample) -> Series of the prompt ids done, of RunStore.done()'s frame."""
    parts = done.select("dataset", "sample", "prompt_id").partition_by(
        "dataset", "sample", as_dict=True
    )
    return {key: part["prompt_id"] for key, part in parts.items()}


def prompt_text(frame, run_dir, dataset: str):
    """`frame`'s prompts of `dataset` with their messages and tools: from the frame when it
    holds them, else from the run database."""
    import polars as pl

    part = frame.filter(pl.col("dataset") == dataset)
    if "messages" in frame.columns:
        return part
    text = prompts_frame(run_dir, datasets=[dataset])
    return part.join(text.select("prompt_id", "messages", "tools"), on="prompt_id", how="left")


def _tools(part) -> dict:
    """prompt_id -> tool definitions (a list) for rows of the frame's `tools` column."""
    if "tools" not in part.columns:
        return {}
    pairs = zip(part["prompt_id"].to_list(), part["tools"].to_list(), strict=True)
    parsed = ((pid, orjson.loads(text)) for pid, text in pairs if text)
    return {pid: tools for pid, tools in parsed if tools}  # [] is no tools (OpenAI refuses [])
