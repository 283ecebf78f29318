"""Clients for one server endpoint, and a pool that spreads requests over several.

Backends (all implement kit.types.Backend; transport: one aiohttp session each, orjson):
    OpenAIChat(base_url, model)      POST {base_url}/chat/completions; counts from usage
    VLLMChat(base_url, model)        same plus "return_token_ids"; counts the returned ids
    SGLangGenerate(base_url, model, tokenizer=...)  renders the chat template itself and
                                     POSTs input_ids to {base_url}/generate
    make_backend(api, url, model, ...) picks one by RunConfig.api.

Every failure is a kit.types.BackendError with `kind`:
    http_429 (retryable, retry_after from Retry-After), http_5xx (retryable),
    http_4xx (not retryable, except 408/409), connect (refused/reset, retryable),
    timeout (retryable), malformed (bad JSON or missing fields, retryable),
    config (missing API-key variable, no way to count tokens: not retryable),
    no_endpoint (EndpointPool: nothing healthy within its wait).

The API key is read from the environment variable named by api_key_env at each request
and sent as "Authorization: Bearer ..."; it is never stored, printed or pickled.

EndpointPool, as the runner uses it:
    pool = EndpointPool([OpenAIChat(u, model) for u in urls], per_endpoint_concurrency=64)
    await pool.start()                       # first health check + background prober
    async with pool.acquire() as backend:    # least-loaded healthy endpoint with a free slot
        try:
            completion = await backend.complete(messages, sampling, timeout=600)
            pool.report(backend, True)
        except BackendError as err:
            pool.report(backend, False, err)  # connect/timeout/5xx count toward take-out
    pool.stats()    # {url: {"in_flight", "healthy", "requests", "failures", "consecutive"}}
    await pool.aclose()                      # stops the prober, closes every backend
"""

from __future__ import annotations

import asyncio
import email.utils
import os
import time
from typing import Any

import aiohttp
import orjson

from kit.run.pool import EndpointPool  # re-exported: kit.backends.EndpointPool
from kit.types import Backend, BackendError, Completion, Message, Sampling

_RETRYABLE_4XX = {408, 409}


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header: "2" -> 2.0, an HTTP date -> seconds from now."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


def status_error(status: int, text: str, retry_after: str | None, url: str) -> BackendError:
    """The BackendError for an HTTP error status."""
    msg = f"HTTP {status} from {url}: {text[:200]}"
    if status == 429:
        return BackendError("http_429", msg, status=429, retry_after=parse_retry_after(retry_after))
    if status >= 500:
        return BackendError("http_5xx", msg, status=status)
    return BackendError("http_4xx", msg, status=status, retryable=status in _RETRYABLE_4XX)


def normalize_finish(reason: Any) -> str:
    """Normalize a finish reason: SGLang's {"type": "length", ...} -> "length"; None -> "unknown"."""
    if isinstance(reason, dict):
        reason = reason.get("type")
    return str(reason) if reason else "unknown"


def _load_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer object from an object or a local path (loaded offline)."""
    from kit.tokens import load_tokenizer

    return load_tokenizer(tokenizer)


class _HTTPBackend:
    """Shared transport: session, POST with error mapping, health, API key headers."""

    path = "/chat/completions"

    def __init__(self, base_url: str, model: str, *, api_key_env: str | None = None,
                 tokenizer: Any = None) -> None:  # fmt: skip
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        if api_key_env is not None and not os.environ.get(api_key_env):
            raise ValueError(f"api_key_env: environment variable {api_key_env!r} is not set")
        self.url = base_url.rstrip("/")
        self.model = model
        self.api_key_env = api_key_env  # the variable's NAME only
        self._tokenizer_src = tokenizer
        self._tokenizer = None
        self._session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r}, model={self.model!r})"

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_session=None, _tokenizer=None)
        return state

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None and self._tokenizer_src is not None:
            self._tokenizer = _load_tokenizer(self._tokenizer_src)
        return self._tokenizer

    def _headers(self) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                msg = f"environment variable {self.api_key_env!r} (api_key_env) is not set"
                raise BackendError("config", msg, retryable=False)
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(
                connector=connector, json_serialize=lambda o: orjson.dumps(o).decode()
            )
        return self._session

    async def _post(self, path: str, body: dict, timeout: float) -> dict:
        """POST body as JSON; the parsed answer or a BackendError."""
        url = self.url + path
        headers = self._headers()
        try:
            async with self._get_session().post(
                url, data=orjson.dumps(body), headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as resp:  # fmt: skip
                raw = await resp.read()
                if resp.status >= 400:
                    text = raw.decode("utf-8", "replace")
                    if "Authorization" in headers:  # a server echoing the key must not leak it
                        text = text.replace(headers["Authorization"][7:], "***")
                    raise status_error(resp.status, text, resp.headers.get("Retry-After"), url)
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as e:
            raise BackendError("timeout", f"no answer from {url} within {timeout}s") from e
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as e:
            raise BackendError("connect", f"{type(e).__name__} talking to {url}: {e}") from e
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise BackendError("malformed", f"bad JSON from {url}: {raw[:120]!r}") from e
        if not isinstance(data, dict):
            raise BackendError("malformed", f"expected a JSON object from {url}, got {raw[:120]!r}")
        return data

    async def _get_ok(self, url: str, timeout: float) -> bool:
        try:
            async with self._get_session().get(
                url, headers=self._headers(), timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                await resp.read()
                return resp.status < 400
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError, BackendError):
            return False

    async def health(self, timeout: float = 5.0) -> bool:
        """True when GET /health at the server root (or {base}/models) answers 2xx."""
        root = self.url.removesuffix("/v1")
        if await self._get_ok(root + "/health", timeout):
            return True
        return root != self.url and await self._get_ok(self.url + "/models", timeout)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _retokenize(self, text: str) -> int:
        if self.tokenizer is None:
            msg = f"{self.url} gave no token counts and no tokenizer was given to re-tokenize"
            raise BackendError("config", msg, retryable=False)
        return len(self.tokenizer.encode(text, add_special_tokens=False))


class OpenAIChat(_HTTPBackend):
    """OpenAI-compatible chat completions (transformers serve, llama.cpp, vLLM, SGLang, APIs).

    Args:
        base_url: up to and including /v1, e.g. "http://127.0.0.1:8000/v1".
        model: model name sent with each request.
        api_key_env: NAME of the environment variable holding the API key, if any.
        extra_body: extra JSON fields merged into each request.
        tokenizer: tokenizer or local path, to count tokens when the server gives no usage.

    Example (against the embedded server; tests/test_backends.py runs it):
        b = OpenAIChat("http://127.0.0.1:8000/v1", "SmolLM2-135M-Instruct")
        c = await b.complete([{"role": "user", "content": "Hi"}], Sampling(max_tokens=8), timeout=60)
        (c.finish_reason, c.completion_tokens, c.count_source)   # ('length', 8, 'usage')
    """

    def __init__(self, base_url: str, model: str, *, api_key_env: str | None = None,
                 extra_body: dict | None = None, tokenizer: Any = None) -> None:  # fmt: skip
        super().__init__(base_url, model, api_key_env=api_key_env, tokenizer=tokenizer)
        self.extra_body = dict(extra_body or {})

    def _body(self, messages: list[Message], sampling: Sampling) -> dict:
        body = {"model": self.model, "messages": messages, "max_tokens": sampling.max_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p}  # fmt: skip
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        body.update(self.extra_body)
        return body

    async def complete(
        self, messages: list[Message], sampling: Sampling, *, timeout: float
    ) -> Completion:
        """One chat completion; raises BackendError (see the module docstring)."""
        data = await self._post(self.path, self._body(messages, sampling), timeout)
        try:
            choice = data["choices"][0]
            text = choice["message"]["content"] or ""
        except (KeyError, IndexError, TypeError) as e:
            raise BackendError("malformed", f"no choices[0].message.content from {self.url}") from e
        return self._completion(data, choice, text)

    def _completion(self, data: dict, choice: dict, text: str) -> Completion:
        usage = data.get("usage") or {}
        finish = normalize_finish(choice.get("finish_reason"))
        prompt_tokens = usage.get("prompt_tokens")
        if isinstance(usage.get("completion_tokens"), int):
            return Completion(text, finish, usage["completion_tokens"], "usage", prompt_tokens)
        return Completion(text, finish, self._retokenize(text), "retokenized", prompt_tokens)


class VLLMChat(OpenAIChat):
    """vLLM chat completions with exact token ids (vLLM >= 0.10.2).

    Sends "return_token_ids": true (vllm/entrypoints/openai/chat_completion/protocol.py,
    ChatCompletionRequest.return_token_ids); reads the top-level "prompt_token_ids"
    (ChatCompletionResponse.prompt_token_ids) and "choices[0].token_ids"
    (ChatCompletionResponseChoice.token_ids). Counts are len(token_ids), count_source
    "server_ids"; an older vLLM without the ids falls back to usage.

    Example (a vLLM server):
        c = await VLLMChat("http://gpu:8000/v1", "Qwen/Qwen3-8B").complete(msgs, Sampling(), timeout=600)
        (c.count_source, len(c.output_ids) == c.completion_tokens)   # ('server_ids', True)
    """

    def _body(self, messages: list[Message], sampling: Sampling) -> dict:
        body = super()._body(messages, sampling)
        body.setdefault("return_token_ids", True)  # extra_body may turn it off
        return body

    def _completion(self, data: dict, choice: dict, text: str) -> Completion:
        ids = choice.get("token_ids")
        if not isinstance(ids, list):
            return super()._completion(data, choice, text)
        prompt_ids = data.get("prompt_token_ids")
        finish = normalize_finish(choice.get("finish_reason"))
        n_prompt = len(prompt_ids) if isinstance(prompt_ids, list) else None
        return Completion(text, finish, len(ids), "server_ids", n_prompt, ids, prompt_ids)


class SGLangGenerate(_HTTPBackend):
    """SGLang's native /generate with client-side chat templating and exact token ids.

    POSTs {"input_ids": [...], "sampling_params": {"max_new_tokens", "temperature",
    "top_p", "sampling_seed"?}} to {base_url}/generate (sglang io_struct GenerateReqInput);
    reads "text", "output_ids" and meta_info {"prompt_tokens", "completion_tokens",
    "finish_reason": {"type": "length", "length": N} | {"type": "stop", "matched": ...}
    | {"type": "abort", ...}} (sglang schedule_batch.py FINISH_*.to_json).

    Args:
        base_url: server root, e.g. "http://127.0.0.1:30000" (no /v1).
        model: the model name (recorded; /generate does not take one).
        tokenizer: the target's tokenizer or its local path (required: renders the prompt).

    Example (an SGLang server):
        b = SGLangGenerate("http://gpu:30000", "Qwen/Qwen3-8B", tokenizer="data/models/qwen3")
        c = await b.complete(msgs, Sampling(max_tokens=64), timeout=600)
        (c.count_source, c.finish_reason)   # ('server_ids', 'length')
    """

    path = "/generate"

    def __init__(self, base_url: str, model: str, *, tokenizer: Any,
                 api_key_env: str | None = None) -> None:  # fmt: skip
        if tokenizer is None:
            raise ValueError("SGLangGenerate needs tokenizer= (it renders the chat template)")
        super().__init__(base_url, model, api_key_env=api_key_env, tokenizer=tokenizer)

    def render(self, messages: list[Message]) -> list[int]:
        """Prompt token ids: the chat template with the generation prompt."""
        out = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(out)

    async def complete(
        self, messages: list[Message], sampling: Sampling, *, timeout: float
    ) -> Completion:
        """One /generate request; raises BackendError (see the module docstring)."""
        ids = self.render(messages)
        params = {"max_new_tokens": sampling.max_tokens, "temperature": sampling.temperature,
                  "top_p": sampling.top_p}  # fmt: skip
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        data = await self._post(self.path, {"input_ids": ids, "sampling_params": params}, timeout)
        meta, out_ids = data.get("meta_info"), data.get("output_ids")
        if not isinstance(meta, dict) or not isinstance(data.get("text"), str):
            raise BackendError(
                "malformed", f"no text/meta_info in /generate answer from {self.url}"
            )
        finish = normalize_finish(meta.get("finish_reason"))
        if isinstance(out_ids, list):
            return Completion(
                data["text"], finish, len(out_ids), "server_ids", len(ids), out_ids, ids
            )
        if isinstance(meta.get("completion_tokens"), int):
            return Completion(
                data["text"], finish, meta["completion_tokens"], "usage", len(ids), None, ids
            )
        return Completion(
            data["text"], finish, self._retokenize(data["text"]), "retokenized", len(ids)
        )


def make_backend(api: str, url: str, model: str, *, api_key_env: str | None = None,
                 tokenizer: Any = None) -> Backend:  # fmt: skip
    """The backend for RunConfig.api.

    Example:
        >>> make_backend("vllm", "http://127.0.0.1:8000/v1", "m")
        VLLMChat(url='http://127.0.0.1:8000/v1', model='m')
    """
    if api == "openai":
        return OpenAIChat(url, model, api_key_env=api_key_env, tokenizer=tokenizer)
    if api == "vllm":
        return VLLMChat(url, model, api_key_env=api_key_env, tokenizer=tokenizer)
    if api == "sglang":
        return SGLangGenerate(url, model, tokenizer=tokenizer, api_key_env=api_key_env)
    raise ValueError(f"api must be one of 'openai', 'vllm', 'sglang', got {api!r}")


__all__ = ["EndpointPool", "OpenAIChat", "SGLangGenerate", "VLLMChat", "make_backend"]
__all__ += ["normalize_finish", "parse_retry_after", "status_error"]
