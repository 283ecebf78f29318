"""Every exception kit raises on purpose, under one base; the CLI shows them in one line.

    KitError                       exit_code 2 (kit: error: <message>)
    ├── InputError (ValueError)    input kit cannot use
    │   ├── ConfigError            a config field or an argument out of range
    │   │   └── ConfigTypeError (TypeError)
    │   ├── DataError              a source or row kit cannot read
    │   │   └── Undetectable       no prompt format fits a source's columns
    │   └── UsageError             a CLI argument
    ├── Skip                       a row kit skips (kit.data counts it by reason)
    ├── MissingPath (FileNotFoundError) · PathExists (FileExistsError)
    ├── StoreError                 the run directory
    │   ├── RunLocked (RuntimeError) · DatabaseDamaged (RuntimeError)
    │   ├── PromptMismatch (ValueError) · FingerprintMismatch (ValueError)
    │   └── StoreWriteError (OSError, exit_code 1)
    │       └── WALDeleted          run.sqlite-wal deleted under the writer
    ├── ServerError (RuntimeError) the embedded server failed to start or died
    ├── Interrupted                a pilot stopped by a signal (exit_code 128 + its number)
    ├── BackendError               a request failed; `retryable`, `kind` (its label)
    │   ├── ConnectError · RequestTimeout · HTTPStatusError (`status`) · UnusableFinish
    │   └── MalformedAnswer · NoEndpoint · BackendConfigError
    │                                  └── Redirected · NoScoring
    ├── ExportError (RuntimeError)
    │   └── ExportBusy · ExportInvalid
    └── NotebookFailed (RuntimeError, exit_code 1)

The builtin beside a class is its second base, so `except ValueError` still catches it.
"""

from __future__ import annotations

RETRYABLE_4XX = (408, 409)  # request timeout, conflict: another attempt may succeed


class KitError(Exception):
    """Base of kit's errors: a message saying what is wrong and how to fix it."""

    exit_code = 2  # of the `kit` command that stops on it


class InputError(KitError, ValueError):
    """Input kit cannot use."""


class ConfigError(InputError):
    """A config field or an argument out of range, naming the field and the value."""


class ConfigTypeError(ConfigError, TypeError):
    """An argument of the wrong type."""


class DataError(InputError):
    """A source, or a row of one, that kit cannot read."""


class Undetectable(DataError):
    """No format fits a source's columns; `columns` are the ones found."""

    def __init__(self, label: str, cols: list[str], formats: tuple[str, ...], advice: str) -> None:
        super().__init__(
            f"cannot detect the prompt format of {label}: columns found {cols}; "
            f"pass format= (one of {formats}) or {advice}"
        )
        self.label, self.columns = label, cols


class Skip(KitError):
    """A row that cannot give a prompt; `reason` is one of kit.data.sources.REASONS. Not
    an InputError: kit.data counts each by reason and goes on, so none leaves it."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail


class UsageError(InputError):
    """A command-line argument kit cannot use."""


class MissingPath(KitError, FileNotFoundError):
    """A file or directory kit needs is not there."""


class PathExists(KitError, FileExistsError):
    """kit will not write over what is there (pass overwrite=True)."""


class StoreError(KitError):
    """The run directory cannot be used as asked."""


class RunLocked(StoreError, RuntimeError):
    """Another writer (named by pid and host) holds the run directory's lock."""


class DatabaseDamaged(StoreError, RuntimeError):
    """The run database is not a readable SQLite database (truncated, overwritten pages)."""


class PromptMismatch(StoreError, ValueError):
    """A stored prompt's text no longer hashes to its prompt_id (edited after the run)."""


class FingerprintMismatch(StoreError, ValueError):
    """A run directory was made with a different output-changing configuration."""


class StoreWriteError(StoreError, OSError):
    """A write to the run directory failed (e.g. full disk); nothing half-written remains."""

    exit_code = 1  # the machine failed, not the input


class WALDeleted(StoreWriteError):
    """run.sqlite-wal was deleted or replaced under the running writer (the run stops)."""


class ServerError(KitError, RuntimeError):
    """The embedded server failed to start or died; `log` holds its last log lines."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(f"{message}\n--- server log (last lines) ---\n{log}" if log else message)
        self.log = log


class Interrupted(KitError):
    """A pilot stopped by a signal before its end: nothing was planned from it."""

    exit_code = 130  # as Ctrl-C

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class BackendError(KitError):
    """A request to a server failed. `retryable`: whether another attempt may succeed;
    `kind`: the label its text starts with ("timeout: no answer from ..."), as stored in
    the run's errors table. Retry and stop rules match on the class, never on `kind`."""

    kind = "backend"
    retryable = True
    status: int | None = None  # the HTTP status (HTTPStatusError)
    retry_after: float | None = None  # s, from a 429's Retry-After

    def __init__(self, message: str) -> None:
        super().__init__(f"{self.kind}: {message}")

    def with_text(self, text: str) -> BackendError:
        """This error with its whole text replaced (redacted, cut), without its traceback."""
        clean = type(self).__new__(type(self))
        clean.args = (text,)
        clean.__dict__.update(vars(self))
        return clean


class ConnectError(BackendError):
    """No connection, or it broke before an answer."""

    kind = "connect"


class RequestTimeout(BackendError):
    """No answer within the request's timeout."""

    kind = "timeout"


class HTTPStatusError(BackendError):
    """An HTTP error status: 429 and 5xx may succeed later, a 4xx only when 408 or 409."""

    def __init__(self, message: str, *, status: int, retry_after: float | None = None) -> None:
        self.status, self.retry_after = status, retry_after
        self.retryable = status == 429 or status >= 500 or status in RETRYABLE_4XX
        super().__init__(message)

    @property
    def kind(self) -> str:
        return {429: "http_429"}.get(self.status, "http_5xx" if self.status >= 500 else "http_4xx")


class MalformedAnswer(BackendError):
    """An answer kit cannot believe: bad JSON, an event stream, a count out of range."""

    kind = "malformed"


class UnusableFinish(BackendError):
    """An answer that ended neither in a stop, a length cut nor tool calls (SGLang's
    `abort`, `content_filter`, ...): no data, so retried, and counted by finish reason."""

    kind = "finish"

    def __init__(self, message: str, finish: str) -> None:
        self.finish = finish
        super().__init__(message)


class NoEndpoint(BackendError):
    """No endpoint was healthy for no_endpoint_timeout."""

    kind = "no_endpoint"


class BackendConfigError(BackendError):
    """The request cannot be sent as configured (no API key, no tokenizer to count with)."""

    kind = "config"
    retryable = False


class Redirected(BackendConfigError):
    """The server redirected a POST: kit follows no redirect (the message names both URLs)."""

    kind = "redirect"


class NoScoring(BackendConfigError):
    """The server cannot score a text (no prompt log-probabilities): regeneration value is
    not measured there."""


class ExportError(KitError, RuntimeError):
    """An export that cannot be made as asked."""


class ExportBusy(ExportError):
    """Another kit export is writing the same target."""


class ExportInvalid(ExportError):
    """A staged export failed kit.validate: it was not swapped in."""


class NotebookFailed(KitError, RuntimeError):
    """A notebook raised: which one, the error, and where its executed copy is."""

    exit_code = 1
