"""kit.errors: one base, the old builtin bases kept, the request errors' labels and rules."""

import inspect

import pytest

from kit import errors
from kit.errors import (
    BackendConfigError,
    BackendError,
    HTTPStatusError,
    KitError,
    MalformedAnswer,
    RequestTimeout,
)

CLASSES = [
    c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__
]


def test_every_class_is_under_the_base():
    assert len(CLASSES) >= 25
    assert all(issubclass(c, KitError) for c in CLASSES)


@pytest.mark.parametrize(
    ("name", "builtin"),
    [
        ("ConfigError", ValueError),
        ("DataError", ValueError),
        ("UsageError", ValueError),
        ("Undetectable", ValueError),
        ("ConfigTypeError", TypeError),
        ("PromptMismatch", ValueError),
        ("FingerprintMismatch", ValueError),
        ("RunLocked", RuntimeError),
        ("DatabaseDamaged", RuntimeError),
        ("StoreWriteError", OSError),
        ("ServerError", RuntimeError),
        ("ExportBusy", RuntimeError),
        ("ExportInvalid", RuntimeError),
        ("NotebookFailed", RuntimeError),
        ("MissingPath", FileNotFoundError),
        ("PathExists", FileExistsError),
    ],
)
def test_old_builtin_bases_hold(name, builtin):
    """`except ValueError` (and the like) written before the tree still catches each."""
    assert issubclass(getattr(errors, name), builtin)


@pytest.mark.parametrize(
    ("status", "kind", "retryable"),
    [
        (429, "http_429", True),
        (503, "http_5xx", True),
        (408, "http_4xx", True),
        (400, "http_4xx", False),
    ],
)
def test_http_status_label_and_retry(status, kind, retryable):
    err = HTTPStatusError(f"HTTP {status} from u: x", status=status)
    assert (str(err), err.kind, err.status, err.retryable) == (
        f"{kind}: HTTP {status} from u: x",
        kind,
        status,
        retryable,
    )


def test_labels_are_the_errors_tables_text():
    assert (
        str(RequestTimeout("no answer from u within 3s")) == "timeout: no answer from u within 3s"
    )
    assert str(BackendConfigError("no key")) == "config: no key"
    assert not BackendConfigError("no key").retryable and MalformedAnswer("x").retryable


def test_with_text_keeps_class_and_attributes():
    err = HTTPStatusError("HTTP 429 from http://u:secret@h: x", status=429, retry_after=2.0)
    err.attempts = 3
    clean = err.with_text("http_429: HTTP 429 from http://***@h: x")
    assert type(clean) is HTTPStatusError and isinstance(clean, BackendError)
    assert (clean.status, clean.retry_after, clean.retryable, clean.attempts) == (429, 2.0, True, 3)
    assert str(clean) == "http_429: HTTP 429 from http://***@h: x" and clean.__traceback__ is None
