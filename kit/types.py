"""The dataclasses every stage shares, and the record's columns declared once (on Record).

A run directory holds one store, run.sqlite (kit.run.db: written by kit.run.store, read
through kit.run.reader): the config (no secrets; its fingerprint '' until a run starts), the
plan (kit.plan.write_plan), prompts, records, errors, skips, per-dataset totals, state and the
context guard's cache. An older kit's plan.json is imported once (kept as plan.json.imported).
A prompt frame (kit.load) has the columns dataset: str, prompt_id: str,
messages: list[struct{role: str, content: str}], n_turns: int, row: int (its source row).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import warnings
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Literal, Protocol, get_args, get_origin, get_type_hints
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from kit.errors import ConfigError

CountSource = Literal["server_ids", "usage", "retokenized"]
FinishReason = str  # "stop" | "length" | "tool_calls" | "abort" | ..., as the server sent it
# the finishes that end the model's turn (OpenAI's "tool_calls", legacy "function_call");
# with "length" the only ones kept as data (kit.run.runner), counted toward a budget
STOPS = ("stop", "tool_calls", "function_call")
Message = dict  # {"role": "system"|"user"|"assistant", "content": str}


@dataclass(slots=True)
class Sampling:
    """Sampling parameters sent with every request; part of the run fingerprint.

    Example:
        >>> Sampling(max_tokens=256, temperature=0.0).n
        1
        >>> Sampling(top_p=0)
        Traceback (most recent call last):
        ...
        kit.errors.ConfigError: Sampling.top_p must be in (0, 1], got 0
    """

    # kit's one set of defaults (`kit plan` and 01_plan read them: kit.types.default): sampled
    # answers, not greedy ones, and no penalty, so a drafter learns what the target writes as
    # served; the small embedded model loops without one (kit demo sets its own, kit.cli.demo)
    max_tokens: int = 1024
    temperature: float = 0.5
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1  # samples per prompt
    # OpenAI's penalties on tokens already in the answer, by count and by presence, in [-2, 2];
    # sent only when not 0, so a server without them sees the request it always saw
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # sent as the request's chat_template_kwargs and used by kit's own renderings of the
    # template, e.g. {"enable_thinking": False}; RunConfig.template_kwargs adds per dataset
    chat_template_kwargs: dict | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ConfigError(
                f"Sampling.max_tokens must be a positive int, got {self.max_tokens!r}"
            )
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature <= 10):
            raise ConfigError(f"Sampling.temperature must be in [0, 10], got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ConfigError(f"Sampling.top_p must be in (0, 1], got {self.top_p!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and -2 <= value <= 2):
                raise ConfigError(f"Sampling.{name} must be in [-2, 2], got {value!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"Sampling.n must be an int >= 1, got {self.n!r}")
        kw = self.chat_template_kwargs
        if kw is not None and not (isinstance(kw, dict) and all(isinstance(k, str) for k in kw)):
            raise ConfigError(f"Sampling.chat_template_kwargs must be None or a dict, got {kw!r}")


def default(cls, name: str):
    """The default a dataclass of kit declares for its field `name`: the one place kit's
    defaults are stated, read by `kit plan`'s flags and 01_plan's parameters (None there).

    Example:
        >>> default(RunConfig, "concurrency") == RunConfig("m", ["http://h/v1"], 1).concurrency
        True
    """
    f = {f.name: f for f in fields(cls)}[name]
    return f.default_factory() if f.default is MISSING else f.default


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
    # the thinking a reasoning parser split off (`reasoning_content` or `reasoning`); `text`
    # is then the answer only. completion_tokens and output_ids cover both.
    reasoning: str | None = None
    # the calls a tool-call parser split off (message.tool_calls, OpenAI's shape:
    # [{"id", "type": "function", "function": {"name", "arguments": JSON text}}]); counted
    # in completion_tokens and output_ids like the text
    tool_calls: list[dict] | None = None


# kind -> (SQLite type, the polars type a reader gives, from the polars module: named here,
# resolved by the reader, so `import kit` loads no polars)
KINDS = {
    "text": ("TEXT", lambda pl: pl.String),
    "int": ("INTEGER", lambda pl: pl.Int64),
    "real": ("REAL", lambda pl: pl.Float64),
    "ids": ("BLOB", lambda pl: pl.List(pl.Int64)),  # token ids: uint32 little-endian, 4 bytes each
    "json": ("TEXT", lambda pl: pl.String),  # JSON text (a Record holds it decoded)
    # JSON [[role, content], ...] (kit.load's prompt_id hashes it), read as {role, content}
    "messages": ("TEXT", lambda pl: pl.List(pl.Struct({"role": pl.String, "content": pl.String}))),
}


def column(kind: str, default=MISSING, *, exported: bool = True, table: str = "records"):
    """A Record field declaring its column: its kind (a key of KINDS), whether kit.export
    reads it (the token ids aside: only its token-id formats read them) and its table."""
    meta = {"kind": kind, "exported": exported, "table": table}
    return field(default=default, metadata=meta)


@dataclass(slots=True)
class Record:
    """One generated sample, keyed by (dataset, prompt_id, sample).

    Each field declares its column (column(); COLUMNS): a None default makes it nullable;
    messages and tools live in the prompts table (one copy per prompt), the rest in the
    records table. A new field is one line here and a migration in kit.run.db.MIGRATIONS
    (`ALTER TABLE records ADD COLUMN name {COLUMNS[name].sql}`, nullable or with a default).
    """

    dataset: str = column("text")
    prompt_id: str = column("text")
    sample: int = column("int")
    messages: list[Message] = column("messages", table="prompts")  # the prompt only
    completion: str = column("text")
    finish_reason: FinishReason = column("text")
    completion_tokens: int = column("int")
    count_source: CountSource = column("text")
    prompt_tokens: int | None = column("int", None, exported=False)
    output_ids: list[int] | None = column("ids", None, exported=False)
    prompt_ids: list[int] | None = column("ids", None, exported=False)
    endpoint: str = column("text", "", exported=False)
    latency_s: float = column("real", 0.0, exported=False)
    attempts: int = column("int", 1, exported=False)
    t_done: float = column("real", 0.0, exported=False)  # unix time the response arrived
    # the target's thinking (Completion.reasoning), kept apart
    reasoning: str | None = column("text", None)
    # the tool definitions sent with the prompt
    tools: list[dict] | None = column("json", None, table="prompts")
    # the dataset's own answer to the prompt (the prompts table's and kit.load's `answer`):
    # shown beside the completion, never sent
    dataset_answer: str | None = column("text", None, exported=False, table="prompts")
    # RunConfig.turns == "all_turns": the assistant turns the target wrote before the last
    # one, in order, each {"content", "reasoning", "finish_reason", "completion_tokens",
    # "count_source", "output_ids", "prompt_ids", "tool_calls"}; `messages` holds them as the
    # assistant turns (the dataset's own are gone, and a user turn the dataset left
    # unanswered gets one) and completion_tokens counts every generated turn.
    turns: list[dict] | None = column("json", None)
    # the tool calls of the last answer (Completion.tool_calls), kept as the server gave them
    tool_calls: list[dict] | None = column("json", None)

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.dataset, self.prompt_id, self.sample)


@dataclass(frozen=True, slots=True)
class Column:
    """One record column as Record's field declares it."""

    name: str
    kind: str  # a key of KINDS
    nullable: bool  # the field's default is None
    exported: bool
    table: str  # "records" or "prompts"

    @property
    def sql(self) -> str:
        """Its SQLite type, e.g. "TEXT NOT NULL"."""
        return KINDS[self.kind][0] + ("" if self.nullable else " NOT NULL")

    def polars(self, pl):
        """Its polars type as a reader gives it, given the polars module."""
        return KINDS[self.kind][1](pl)


COLUMNS = {f.name: Column(f.name, nullable=f.default is None, **f.metadata) for f in fields(Record)}
KEY = ("dataset", "prompt_id", "sample")  # a record's primary key


def record_columns(*names: str, stored: bool = False, exported: bool = False) -> tuple[str, ...]:
    """Names of record columns: `names`, each checked (ValueError for one Record lacks), or
    every column in Record's order; stored: the records table's only; exported: kit.export's.

    Example:
        >>> record_columns(stored=True, exported=True)[:4]
        ('dataset', 'prompt_id', 'sample', 'completion')
        >>> record_columns("dataset", "text")
        Traceback (most recent call last):
        ...
        kit.errors.ConfigError: not record columns: ['text']
    """
    if bad := [n for n in names if n not in COLUMNS]:
        raise ConfigError(f"not record columns: {bad}")
    cols = [COLUMNS[n] for n in names] or COLUMNS.values()
    return tuple(
        c.name
        for c in cols
        if (not stored or c.table == "records") and (not exported or c.exported)
    )


@dataclass(slots=True)
class ErrorRecord:
    """A request that failed every attempt; retried on the next resume."""

    dataset: str
    prompt_id: str
    sample: int
    error: str  # kind and message, never a secret
    attempts: int
    t: float


class Backend(Protocol):
    """One server endpoint. Implementations live in kit.run.backends."""

    url: str

    async def complete(
        self,
        messages: list[Message],
        sampling: Sampling,
        *,
        timeout: float,
        tools: list[dict] | None = None,
    ) -> Completion:
        """Send one request (with these tool definitions); raise BackendError on failure."""
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
                raise ConfigError(
                    f"budget for dataset {name!r} must be a positive number, got {value!r}"
                )


@dataclass(slots=True)
class RunConfig:
    """The one settings object of a run: what the CLI, the pilot, the notebooks and
    `kit.generate(prompts, config, run_dir=...)` all build. Validates on construction.

    Stored in the run database (kit.run.db), never an API key: only the NAME of its env var,
    and endpoints without the credentials of their URL ("http://user:KEY@host/v1" is sent as
    HTTP Basic, "?api_key=KEY" as that query string), so a resume needs such endpoints again.
    The fingerprint covers what changes outputs (model, sampling, chat template, sources);
    budgets, endpoints, concurrency and timeouts may change on resume.

    Example:
        >>> RunConfig(model="smol", endpoints="http://127.0.0.1:8000/v1", budgets=4000).endpoints
        ['http://127.0.0.1:8000/v1']
        >>> RunConfig(model="smol", endpoints=["http://h/v1"], budgets={"a": 0})
        Traceback (most recent call last):
        ...
        kit.errors.ConfigError: RunConfig.budgets: budget for dataset 'a' must be a positive number, got 0
    """

    model: str
    # base URLs, e.g. "http://127.0.0.1:8000/v1" (openai/vllm) or "http://host:30000" (sglang)
    endpoints: list[str]
    # dataset -> completion-token budget; one int means "this much for every dataset"
    budgets: dict[str, int] | int
    sampling: Sampling = field(default_factory=Sampling)
    tokenizer: str | None = None  # local path of the target's tokenizer (counts, guard, template)
    api: Literal["openai", "vllm", "sglang"] = "openai"
    api_key_env: str | None = None  # NAME of the environment variable holding the key
    concurrency: int = 32  # requests in flight, all endpoints together
    per_endpoint_concurrency: int | None = None
    policy: Literal["drain", "cancel"] = "drain"
    seed: int = 0  # prompt order
    max_attempts: int = 5  # tries per request (429/5xx/timeouts/resets are retried)
    max_context: int | None = None  # skip prompt + max_tokens > this (None: from the tokenizer)
    timeout: float | None = None  # read timeout per request (None: 120 s + 0.5 s per max_token)
    # bytes of an answer read at most (None: 64 KiB + 256 per max_token + 8 per byte sent)
    max_body_bytes: int | None = None
    retry_base: float = 0.5  # first backoff delay (s), doubled per attempt with jitter
    no_endpoint_timeout: float = 120.0  # s with no healthy endpoint before the run stops
    # a dataset's answers failing in a row (non-retryable or malformed) before it fails
    max_consecutive_failures: int = 20
    # s in which every attempt failed (429s aside; none older still running) before the run
    # stops (at least max(8, concurrency) failed), or, while others succeed, a dataset fails (8)
    stall_timeout: float = 60.0
    # multi-turn prompts: "last_turn" generates the last assistant turn only (earlier ones are
    # the dataset's and are never trained on); "all_turns" regenerates every assistant turn in
    # order, each conditioned on the target's own earlier answers
    turns: Literal["last_turn", "all_turns"] = "last_turn"
    # dataset -> chat_template_kwargs merged over sampling.chat_template_kwargs for it
    template_kwargs: dict[str, dict] = field(default_factory=dict)
    # filled in by kit.generate from the prompts and the tokenizer; part of the fingerprint
    source_hashes: dict[str, str] = field(default_factory=dict)  # dataset -> hash of prompt ids
    datasets: dict[str, str] = field(default_factory=dict)  # dataset -> source path ("" in memory)
    chat_template_hash: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.endpoints, str):
            self.endpoints = [self.endpoints]
        if isinstance(self.sampling, dict):
            self.sampling = Sampling(**self.sampling)
        for url in self.endpoints if isinstance(self.endpoints, list) else ():
            if isinstance(url, str) and url and not _url_ok(url):
                shown = re.sub(r"//[^/]*@", "//", url).partition("?")[0]  # no credentials
                raise ConfigError(
                    f"RunConfig.endpoints: {shown!r} is not an http(s) URL with a host and a "
                    "port in 1..65535"
                )
        _warn_url_credentials(self.endpoints)
        for name, (ok, must) in _config_checks(self).items():
            if not ok:
                raise ConfigError(f"RunConfig.{name} must be {must}, got {getattr(self, name)!r}")
        if isinstance(self.budgets, dict):
            try:
                Budget(self.budgets)
            except ValueError as exc:
                raise ConfigError(f"RunConfig.budgets: {exc}") from None
            self.budgets = {name: int(math.ceil(v)) for name, v in self.budgets.items()}

    def budgets_for(self, datasets: list[str]) -> dict[str, int]:
        """dataset -> budget for exactly these datasets; ValueError naming what is missing.

        Example:
            >>> RunConfig(model="m", endpoints="http://h/v1", budgets=4000).budgets_for(["a", "b"])
            {'a': 4000, 'b': 4000}
        """
        if not isinstance(self.budgets, dict):
            return dict.fromkeys(datasets, int(self.budgets))
        if missing := [n for n in datasets if n not in self.budgets]:
            raise ConfigError(
                f"RunConfig.budgets has no entry for datasets {missing}; "
                "give each a budget (or one number for all) or drop their prompts"
            )
        if extra := [n for n in self.budgets if n not in datasets]:
            raise ConfigError(
                f"RunConfig.budgets names datasets {extra} that have no prompts (found {datasets})"
            )
        return dict(self.budgets)

    def fingerprint_parts(self) -> dict:
        """The parts that change outputs: model, sampling, chat template, sources, and the
        turns mode and per-dataset template kwargs when not the defaults."""
        sampling = asdict(self.sampling)
        unset = {"chat_template_kwargs": None, "frequency_penalty": 0, "presence_penalty": 0}
        for name, value in unset.items():
            if sampling[name] == value:
                del sampling[name]  # the fingerprints of runs made before it
        parts = {
            "model": self.model,
            "sampling": sampling,
            "chat_template_hash": self.chat_template_hash,
            "source_hashes": dict(sorted(self.source_hashes.items())),
        }
        if self.turns != "last_turn":
            parts["turns"] = self.turns
        if self.template_kwargs:
            parts["template_kwargs"] = dict(sorted(self.template_kwargs.items()))
        return parts

    def sampling_for(self, dataset: str) -> Sampling:
        """The sampling of one dataset: template_kwargs[dataset] merged over the run's.

        Example:
            >>> c = RunConfig(model="m", endpoints="http://h/v1", budgets=1,
            ...               sampling={"chat_template_kwargs": {"enable_thinking": True}},
            ...               template_kwargs={"math": {"enable_thinking": False}})
            >>> c.sampling_for("math").chat_template_kwargs, c.sampling_for("chat").chat_template_kwargs
            ({'enable_thinking': False}, {'enable_thinking': True})
        """
        extra = self.template_kwargs.get(dataset)
        if not extra:
            return self.sampling
        merged = {**(self.sampling.chat_template_kwargs or {}), **extra}
        return replace(self.sampling, chat_template_kwargs=merged)

    def fingerprint(self) -> str:
        """A short stable hash of fingerprint_parts() (the run's identity)."""
        blob = json.dumps(self.fingerprint_parts(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_dict(self) -> dict:
        """A plain dict for the run database: endpoints without their credentials."""
        return asdict(self) | {"endpoints": [strip_userinfo(u) for u in self.endpoints]}

    def __repr__(self) -> str:  # endpoints shown without credentials
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["endpoints"] = [strip_userinfo(u) for u in self.endpoints]
        return f"RunConfig({', '.join(f'{k}={v!r}' for k, v in d.items())})"

    @classmethod
    def from_dict(cls, d: dict) -> RunConfig:
        """Inverse of to_dict; unknown keys (from other kit versions) are ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _is_int(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_pos(value) -> bool:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return ok and not math.isnan(value) and value > 0


def _url_ok(url) -> bool:
    """An http(s) URL with a host and a port in 1..65535 (or none)."""
    try:
        parts = urlsplit(url) if isinstance(url, str) else None
        return bool(parts and parts.scheme in ("http", "https") and parts.hostname) and (
            parts.port is None or parts.port > 0
        )
    except ValueError:  # a port out of range or not a number, a bad IPv6 host
        return False


_INTS = {"concurrency": 1, "max_attempts": 1, "max_consecutive_failures": 1}  # field -> least
_OPTIONAL_INTS = {"per_endpoint_concurrency": 1, "max_context": 2, "max_body_bytes": 1024}
_SECONDS = ("retry_base", "no_endpoint_timeout", "stall_timeout")


def _config_checks(c: RunConfig) -> dict[str, tuple[bool, str]]:
    """field -> (valid?, what it must be); budgets are checked in detail by Budget, a Literal
    field against its values."""
    checks = {
        "model": (isinstance(c.model, str) and c.model != "", "a non-empty model name"),
        "endpoints": (
            isinstance(c.endpoints, list)
            and bool(c.endpoints)
            and all(isinstance(u, str) and u for u in c.endpoints),
            "a base URL or a non-empty list of them",
        ),
        "budgets": (
            isinstance(c.budgets, dict) or _is_pos(c.budgets),
            "a positive number or a dict dataset -> tokens",
        ),
        "sampling": (isinstance(c.sampling, Sampling), "a kit.Sampling"),
        "api_key_env": (
            c.api_key_env is None or (isinstance(c.api_key_env, str) and c.api_key_env != ""),
            "the NAME of an environment variable (never the key itself)",
        ),
        "seed": (_is_int(c.seed, -(2**63)), "an int"),
        "timeout": (
            c.timeout is None or (_is_pos(c.timeout) and math.isfinite(c.timeout)),
            "None or a finite number of seconds > 0",
        ),
        "template_kwargs": (
            isinstance(c.template_kwargs, dict)
            and all(
                isinstance(k, str) and isinstance(v, dict) for k, v in c.template_kwargs.items()
            ),
            "a dict dataset -> chat_template_kwargs dict",
        ),
        "tokenizer": (c.tokenizer is None or isinstance(c.tokenizer, str), "None or a local path"),
    }
    for name, least in _INTS.items():
        checks[name] = (_is_int(getattr(c, name), least), f"an int >= {least}")
    for name, least in _OPTIONAL_INTS.items():
        value = getattr(c, name)
        checks[name] = (value is None or _is_int(value, least), f"None or an int >= {least}")
    for name in _SECONDS:
        checks[name] = (_is_pos(getattr(c, name)), "seconds > 0")
    for name, hint in get_type_hints(RunConfig).items():
        if get_origin(hint) is Literal:
            checks[name] = (getattr(c, name) in get_args(hint), f"one of {get_args(hint)}")
    return checks


DatasetState = Literal["waiting", "running", "budget_reached", "exhausted", "stopped", "failed"]


@dataclass(slots=True)
class DatasetProgress:
    """Where one dataset stands; what the monitor draws. Built by the runner live and by
    kit.report.monitor from a run directory (kit.watch)."""

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
    # failed: none of its requests can succeed (its note says why); the others went on
    state: DatasetState = "waiting"
    note: str = ""  # for the user: why it failed or the run stopped, a long Retry-After

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


# ------------------------------------------------------------------ secrets


def strip_userinfo(url: str) -> str:
    """The URL without its credentials: user:password@ and the query string (a key passed as
    "?api_key=..."); what kit writes or shows anywhere.

    Example:
        >>> strip_userinfo("http://alice:s3cret@gpu:8000/v1?api_key=sk-1")
        'http://gpu:8000/v1'
    """
    parts = urlsplit(url)
    if "@" not in parts.netloc and not parts.query and not parts.fragment:
        return url
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=netloc, query="", fragment=""))


def url_credentials(url: str) -> tuple[str, str] | None:
    """(user, password) decoded from a URL's user:password@, or None without one."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return None
    user, _, password = parts.netloc.rpartition("@")[0].partition(":")
    return unquote(user), unquote(password)


def url_query(url: str) -> list[tuple[str, str]]:
    """A URL's query parameters, decoded (sent with every request; each value is treated as
    a credential: never written, redacted from every message).

    Example:
        >>> url_query("http://gpu/v1?api_key=sk%2F1&x=")
        [('api_key', 'sk/1'), ('x', '')]
    """
    return parse_qsl(urlsplit(url).query, keep_blank_values=True)


_WARNED_URLS: set[str] = set()


def _warn_url_credentials(endpoints) -> None:
    """Warn once per endpoint that its URL credentials are used but never stored."""
    if not isinstance(endpoints, list):
        return
    for url in endpoints:
        if not isinstance(url, str) or url in _WARNED_URLS:
            continue
        if url_credentials(url) or urlsplit(url).query:
            _WARNED_URLS.add(url)
            warnings.warn(
                f"RunConfig.endpoints: the credentials (user:password@ or query string) of "
                f"{strip_userinfo(url)!r} are sent but never written (the run database keeps the "
                "URL without them), so a resume needs the endpoint again; better: put the key in "
                "an environment variable, pass api_key_env",
                stacklevel=4,
            )
