"""The one redaction point: every text kit writes or prints goes through `redact`.

A secret is the API key (the value of RunConfig.api_key_env's variable) or a credential of
an endpoint URL (user:password@, query values). Backends `remember` theirs when they are
built and at each request; `redact(text)` then replaces every form of each one known to
the process (as is in any case, escaped, URL-encoded, spaced out, reversed, hex, base32,
base64) by "***". The CLI's output goes through `redacted_output()`, the errors table,
stop reasons and notes through the runner, error texts through the backends.

    remember("sk-123"); redact("key SK-123 was 736b2d313233")   # 'key *** was ***'
"""

from __future__ import annotations

import base64
import contextlib
import functools
import re
import sys
from collections.abc import Iterable, Iterator
from urllib.parse import urlsplit

from kit.types import url_credentials, url_query

MIN_QUERY_SECRET = 4  # a base URL's query values this long or longer are redacted as secrets
_KNOWN: set[str] = set()  # every secret met in this process
_GAP = r"\s*"  # a spaced-out secret ("s k - 1 2 3", hex "73 6b 2d")


def remember(*secrets: str | None) -> None:
    """Add secrets to the process's set: every later `redact` removes them."""
    _KNOWN.update(s for s in secrets if s)


def url_secrets(url: str) -> list[str]:
    """The secrets a URL carries: its password and user:password (decoded and as written),
    and the values of its query string ("?api_key=...": decoded and as written)."""
    out = []
    creds = url_credentials(url)
    if creds is not None:
        user, password = creds
        out += [password, f"{user}:{password}", urlsplit(url).netloc.rpartition("@")[0]]
    query = urlsplit(url).query
    values = [v for _, v in url_query(url) if len(v) >= MIN_QUERY_SECRET]
    out += values + ([query] if values else [])
    return [s for s in out if s]


def _char_forms(c: str) -> str:
    """A regex for one character of a secret in any way a server's text may write it: as is,
    backslash-escaped (PHP's "\\/"; any number of backslashes: escaped again), a JSON
    \\u escape (Java's "\\u003d"), an HTML entity, or percent-encoded (once or twice; "+"
    for a space).

    Example:
        >>> bool(re.fullmatch(_char_forms("/"), "\\\\/")), bool(re.fullmatch(_char_forms("="), "%3d"))
        (True, True)
    """
    code = ord(c)
    forms = [re.escape(c), r"\\+" + re.escape(c), rf"&\#(?:x0*{code:x}|0*{code});"]
    if code <= 0xFFFF:
        forms.append(rf"\\+u{code:04x}")
    forms.append("".join(f"%(?:25)?{b:02x}" for b in c.encode()))
    if c == " ":
        forms.append(r"\+")
    return "(?:" + "|".join(forms) + ")"


def _cores(data: bytes, encode, group: int, bits: int) -> set[str]:
    """The encodings of data whole, and the characters data alone fixes at each alignment
    it can have inside a longer encoded string (base64 of "Bearer KEY")."""
    out = {encode(data).decode().rstrip("=")}
    for pad in range(group):
        enc = encode(b"\0" * pad + data).decode()
        core = enc[-(-8 * pad // bits) : 8 * (pad + len(data)) // bits]
        if len(core) >= 6:
            out.add(core)
    return out


def secret_forms(secret: str) -> set[str]:
    """Regexes for how a secret can show up in a server's text: its characters each written
    as is (matched in any case) or escaped or encoded in any mix (see _char_forms: JSON,
    PHP, Java, HTML, URL-encoded), spaced out or reversed; its bytes in hex (any case,
    spaced out); base32 and base64 (standard and URL-safe), whole and at any alignment."""
    forms = {_GAP.join(map(_char_forms, text)) for text in (secret, secret[::-1])}
    data = secret.encode()
    forms.add(_GAP.join(data.hex()))
    encoded = _cores(data, base64.b64encode, 3, 6) | _cores(data, base64.b32encode, 5, 5)
    encoded |= {e.replace("+", "-").replace("/", "_") for e in encoded}
    return forms | {re.escape(e) for e in encoded if e}


@functools.lru_cache(maxsize=64)
def _secrets_pattern(secrets: tuple[str, ...]) -> re.Pattern | None:
    forms = set().union(*(secret_forms(s) for s in secrets))
    if not forms:
        return None
    return re.compile("|".join(sorted(forms, key=len, reverse=True)), re.IGNORECASE)


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """text with every form (see secret_forms) of every secret remembered, and of `secrets`,
    replaced by "***".

    Example:
        >>> redact("denied for Bearer SK-ABC123xyz (c2stYWJjMTIzeHl6)", ["sk-abc123xyz"])
        'denied for Bearer *** (***)'
        >>> redact('{"key": "sk-a\\\\/b\\u002bc%3D"}', ["sk-a/b+c="])
        '{"key": "***"}'
        >>> redact("z y x 3 2 1 - k s, 736B2D31323378797A", ["sk-123xyz"])
        '***, ***'
    """
    pattern = _secrets_pattern(tuple(sorted({s for s in (*_KNOWN, *secrets) if s})))
    return text if pattern is None else pattern.sub("***", text)


class _Redacting:
    """A text stream whose writes are redacted (everything else is the stream's own)."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(redact(text))
        return len(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def redacted_output() -> Iterator[None]:
    """sys.stdout and sys.stderr redacted while inside (the CLI runs every command so)."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Redacting(saved[0]), _Redacting(saved[1])
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


__all__ = ["redact", "redacted_output", "remember", "secret_forms", "url_secrets"]
