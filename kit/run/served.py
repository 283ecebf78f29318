"""What the endpoints serve, checked before a run's first request.

An endpoint's GET {base}/models (OpenAI shape) names its models; a gateway that lists its
workers (the SGLang Model Gateway's GET /workers) has each worker asked too, because with
`--backend openai` it forwards any model name and lists none itself. An endpoint or worker
that lists models without the run's is refused, named with what it serves; one that lists
nothing, or that kit cannot reach, is not judged. Workers are asked without credentials
(they go only to the endpoints the user gave); what servers list is redacted before it is
shown (kit.secrets).

    await check_models(pool.backends)   # ConfigError: "... serves ['other'], not 'm'"
"""

from __future__ import annotations

import asyncio

from kit.errors import ConfigError
from kit.secrets import redact


async def served_models(backend, base: str | None = None) -> list[str] | None:
    """The model ids GET {base}/models lists (base: the backend's /v1); None when none.
    A base on another host or port than the backend's is asked without its credentials."""
    base = base or (backend.url + "/v1" if backend.path == "/generate" else backend.url)
    data = await backend.get_json(base + "/models")
    rows = data.get("data") if isinstance(data, dict) else None
    ids = [r["id"] for r in rows or () if isinstance(r, dict) and isinstance(r.get("id"), str)]
    return ids or None


async def gateway_workers(backend) -> list[str]:
    """The worker root URLs a gateway at this endpoint lists (GET /workers); [] otherwise."""
    data = await backend.get_json(backend.url.removesuffix("/v1") + "/workers")
    rows = data.get("workers") if isinstance(data, dict) else None
    return [r["url"] for r in rows or () if isinstance(r, dict) and isinstance(r.get("url"), str)]


async def _redirected(backend) -> str | None:
    """The refusal of an endpoint whose /models redirects (kit follows no redirect)."""
    url = (backend.url + "/v1" if backend.path == "/generate" else backend.url) + "/models"
    got = await backend.get(url)
    if got is None or not 300 <= got[0] < 400:
        return None
    return (
        f"{url} redirects to {got[2]} (HTTP {got[0]}): kit follows no redirect, "
        "give the server's own URL as the endpoint"
    )


async def _wrong(backend) -> list[str]:
    """What is wrong with one endpoint (and the workers behind it), one line each."""
    if moved := await _redirected(backend):
        return [moved]
    model, found = backend.model, []
    advice = ": give --model (RunConfig.model) the name the server lists, or drop that endpoint"
    models = await served_models(backend)
    if models and model not in models:
        found.append(f"{backend.url} serves {models}, not {model!r}{advice}")
    for worker in await gateway_workers(backend):
        models = await served_models(backend, worker.rstrip("/") + "/v1")
        if models and model not in models:
            line = f"worker {worker} behind {backend.url} serves {models}, not {model!r}"
            found.append(line + advice)
    return found


async def check_models(backends: list) -> None:
    """Refuse endpoints (or gateway workers) that list models without the run's, and
    endpoints that redirect; the text redacted (a server may echo the key in its list).

    Raises:
        ConfigError: "http://h:8001/v1 serves ['other'], not 'm': give --model ...".
    """
    wrong = [line for lines in await asyncio.gather(*map(_wrong, backends)) for line in lines]
    if wrong:
        raise ConfigError(" ".join(redact("; ".join(wrong)).split()))
