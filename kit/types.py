"""The dataclasses every stage shares.

The run directory (written by kit.store, read by monitor/audit/export) holds:

    run_dir/
      config.json            {"fingerprint": str, "config": RunConfig as dict}  (no secrets)
      plan.json              written by 01_plan (kit.plan.write_plan), read by generate
      prompts.parquet        the prompt frame the run draws from (sources.load output)
      records/<dataset>.jsonl  one Record per line (dataclasses.asdict), append-only
      errors.jsonl           one ErrorRecord per line: requests that failed every attempt
      skipped.jsonl          prompts never sent (too long for the context; kit._guard), one per line

A prompt frame (kit.sources.load) has the columns:
    dataset: str, prompt_id: str, messages: list[struct{role: str, content: str}],
    n_turns: int, row: int (index of the row in its source file)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Protocol

CountSource = Literal["server_ids", "usage", "retokenized"]
FinishReason = str  # "stop" | "length" | "cancelled" | server-specific
Message = dict  # {"role": "system"|"user"|"assistant", "content": str}


@dataclass(slots=True)
class Sampling:
    """Sampling parameters sent with every request; part of the run fingerprint."""

    max_tokens: int = 512
    temperature: float = 0.7
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1  # samples per prompt

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"Sampling.max_tokens must be a positive int, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature <= 10):
            raise ValueError(f"Sampling.temperature must be in [0, 10], got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"Sampling.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"Sampling.n must be an int >= 1, got {self.n!r}")


@dataclass(slots=True)
class Completion:
    """What a backend returns for one request."""

    text: str
    finish_reason: FinishReason
    completion_tokens: int
    count_source: CountSource
    prompt_tokens: int | None = None
    output_ids: list[int] | None = None  # exact ids from the server, when it gives them
    prompt_ids: list[int] | None = None


@dataclass(slots=True)
class Record:
    """One generated sample, keyed by (dataset, prompt_id, sample)."""

    dataset: str
    prompt_id: str
    sample: int
    messages: list[Message]  # the prompt only
    completion: str
    finish_reason: FinishReason
    completion_tokens: int
    count_source: CountSource
    prompt_tokens: int | None = None
    output_ids: list[int] | None = None
    prompt_ids: list[int] | None = None
    endpoint: str = ""
    latency_s: float = 0.0
    attempts: int = 1
    t_done: float = 0.0  # unix time the response arrived

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.dataset, self.prompt_id, self.sample)


@dataclass(slots=True)
class ErrorRecord:
    """A request that failed every attempt; retried on the next resume."""

    dataset: str
    prompt_id: str
    sample: int
    error: str  # kind and message, never a secret
    attempts: int
    t: float


class BackendError(Exception):
    """A failed request. `retryable` says whether another attempt may succeed."""

    def __init__(
        self,
        kind: str,
        message: str,
        *,
        status: int | None = None,
        retryable: bool = True,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(f"{kind}: {message}")
        # "http_429" | "http_5xx" | "http_4xx" | "connect" | "timeout" | "malformed" | ...
        self.kind = kind
        self.status = status
        self.retryable = retryable
        self.retry_after = retry_after


class Backend(Protocol):
    """One server endpoint. Implementations live in kit.backends."""

    url: str

    async def complete(
        self, messages: list[Message], sampling: Sampling, *, timeout: float
    ) -> Completion:
        """Send one request; raise BackendError on failure."""
        ...

    async def health(self) -> bool:
        """True when the endpoint answers its health check."""
        ...

    async def aclose(self) -> None: ...


@dataclass(slots=True)
class Budget:
    """Completion-token budget per dataset."""

    tokens: dict[str, int] = field(default_factory=dict)  # dataset -> completion tokens

    def __post_init__(self) -> None:
        for name, value in self.tokens.items():
            bad = not isinstance(value, (int, float)) or isinstance(value, bool)
            if bad or (isinstance(value, float) and math.isnan(value)) or value <= 0:
                raise ValueError(
                    f"budget for dataset {name!r} must be a positive number, got {value!r}"
                )


@dataclass(slots=True)
class RunConfig:
    """Everything a run needs; stored in run_dir/config.json (never an API key, only its env var name).

    The fingerprint (kit.store.fingerprint) covers what changes outputs: model, sampling,
    chat_template_hash, source_hashes. Budgets, endpoints and concurrency may change on resume.
    """

    model: str
    # base URLs, e.g. "http://127.0.0.1:8000/v1" (openai/vllm) or "http://host:30000" (sglang)
    endpoints: list[str]
    sampling: Sampling
    budgets: dict[str, int]  # dataset -> completion-token budget
    # dataset -> hash of its sorted prompt_ids
    source_hashes: dict[str, str] = field(default_factory=dict)
    # dataset -> source path ("" for in-memory)
    datasets: dict[str, str] = field(default_factory=dict)
    chat_template_hash: str | None = None
    # local path of the target's tokenizer (re-tokenizing, chat template)
    tokenizer: str | None = None
    api: Literal["openai", "vllm", "sglang"] = "openai"
    api_key_env: str | None = None  # NAME of the environment variable holding the key
    concurrency: int = 32  # requests in flight, all endpoints together
    per_endpoint_concurrency: int | None = None
    policy: Literal["drain", "cancel"] = "drain"
    seed: int = 0  # prompt order
    max_attempts: int = 5
    max_context: int | None = None  # skip prompt + max_tokens > this (None: from the tokenizer)


@dataclass(slots=True)
class DatasetProgress:
    """Where one dataset stands; what the monitor draws. Built by the runner live and by
    kit.monitor from a run directory (kit.watch)."""

    dataset: str
    budget: int  # completion tokens
    tokens_done: int = 0  # completion tokens of records written
    samples_done: int = 0
    in_flight: int = 0
    prompts_total: int = 0  # samples available (prompts x n)
    errors: int = 0  # requests that failed every attempt
    retries: int = 0
    truncated: int = 0  # records with finish_reason "length"
    skipped: int = 0  # samples never sent: their prompt + max_tokens exceeds the context
    tokens_per_s: float = 0.0  # recent rate
    state: Literal["waiting", "running", "budget_reached", "exhausted", "stopped"] = "waiting"

    @property
    def mean_completion(self) -> float:
        return self.tokens_done / self.samples_done if self.samples_done else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds to the budget at the recent rate; None when unknown or done."""
        left = self.budget - self.tokens_done
        if left <= 0 or self.tokens_per_s <= 0:
            return None
        return left / self.tokens_per_s

    @property
    def truncation_share(self) -> float:
        return self.truncated / self.samples_done if self.samples_done else 0.0


ProgressCallback = "Callable[[list[DatasetProgress]], None]"  # called at most once a second
