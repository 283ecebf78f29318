"""Clients for one server endpoint (kit.types.Backend); kit.run.pool spreads requests over several.

    OpenAIChat      POST {base_url}/chat/completions; counts from usage
    VLLMChat        the same plus "return_token_ids": the server's own ids, counted
    SGLangGenerate  renders the chat template itself and POSTs input_ids to {base_url}/generate
    make_backend(api, url, model, ...) picks one by RunConfig.api.

`await b.complete(messages, sampling, *, timeout, tools=None) -> Completion`: the answer, the
thinking the server's reasoning parser split off and its tool calls, counted as the server
counts them. A failure is a kit.errors.BackendError whose class says if a retry can help
(429, 5xx, connect, timeout, malformed: yes; other 4xx, config: no). The API key is read
from the variable api_key_env names at each request and never stored; credentials in a base
URL are used but kept out of `backend.url`; every error text is redacted (kit.run.answers).
"""

from __future__ import annotations

import asyncio
import base64
import os
from typing import Any

import aiohttp
import orjson

from kit.errors import (
    BackendConfigError,
    BackendError,
    ConfigError,
    ConnectError,
    HTTPStatusError,
    MalformedAnswer,
    NoScoring,
    RequestTimeout,
)
from kit.run.answers import (
    calls_text,
    check_ids,
    check_usage,
    ids_ok,
    message_parts,
    normalize_finish,
    optional_count,
    parse_body,
    redact,
    status_error,
    tool_calls_of,
    url_secrets,
)
from kit.tokens import encode_lengths, ids_spell, load_tokenizer, render
from kit.types import (
    Backend,
    Completion,
    Message,
    Sampling,
    strip_userinfo,
    url_credentials,
    url_query,
)

MESSAGE_CHARS = 400  # an error message is cut to this, after redaction


def penalties(sampling: Sampling) -> dict:
    """The sampling's frequency/presence penalties that are set (not 0), by their OpenAI names.

    Example:
        >>> penalties(Sampling(frequency_penalty=0.5))
        {'frequency_penalty': 0.5}
    """
    names = ("frequency_penalty", "presence_penalty")
    return {n: getattr(sampling, n) for n in names if getattr(sampling, n)}


class _HTTPBackend:
    """Shared transport: session, POST with error mapping, health, API key headers."""

    path = "/chat/completions"

    def __init__(
        self, base_url: str, model: str, *, api_key_env: str | None = None, tokenizer: Any = None
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            shown = strip_userinfo(base_url) if isinstance(base_url, str) else base_url
            raise ConfigError(f"base_url must be an http(s) URL, got {shown!r}")
        if api_key_env is not None and not os.environ.get(api_key_env):
            raise ConfigError(f"api_key_env: environment variable {api_key_env!r} is not set")
        self.url = strip_userinfo(base_url).rstrip("/")  # never the credentials
        self.model = model
        self.api_key_env = api_key_env  # the variable's NAME only
        creds = url_credentials(base_url)
        basic = creds and base64.b64encode(":".join(creds).encode()).decode()
        self._basic = f"Basic {basic}" if basic else None
        self._url_secrets = url_secrets(base_url)
        self._params = url_query(base_url) or None  # "?api_key=...": sent with every request
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
            self._tokenizer = load_tokenizer(self._tokenizer_src)
        return self._tokenizer

    def _headers(self) -> dict:
        headers = {"Content-Type": "application/json"}
        if self._basic:  # this endpoint's own URL credentials
            headers["Authorization"] = self._basic
        elif self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                msg = f"environment variable {self.api_key_env!r} (api_key_env) is not set"
                raise BackendConfigError(msg)
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def secrets(self) -> list[str]:
        """What must never appear in a message: the API key, the URL credentials."""
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        return [key, *self._url_secrets] if key else list(self._url_secrets)

    def redacted(self, err: BackendError) -> BackendError:
        """err with its message redacted and cut (what every raised error goes through)."""
        text = redact(str(err), self.secrets())
        if len(text) > MESSAGE_CHARS:
            text = text[: MESSAGE_CHARS - 3] + "..."
        return err.with_text(text)

    async def complete(
        self,
        messages: list[Message],
        sampling: Sampling,
        *,
        timeout: float,
        tools: list[dict] | None = None,
    ) -> Completion:
        """One request; raises BackendError (see the module docstring), redacted.

        Args:
            messages: the chat so far, ending with the turn to answer.
            sampling: sampling parameters, with the dataset's chat_template_kwargs.
            timeout: seconds for the whole request.
            tools: OpenAI tool definitions sent with the prompt (None: no "tools").
        """
        try:
            if tools is not None and not (
                isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
            ):
                msg = f"tools must be a list of tool dicts, got {repr(tools)[:80]}"
                raise BackendConfigError(msg)
            return await self._complete(messages, sampling, timeout, tools)
        except BackendError as err:
            raise self.redacted(err) from None

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
                url,
                data=orjson.dumps(body),
                headers=headers,
                params=self._params,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as resp:
                raw = await resp.read()
                stream = "event-stream" in resp.headers.get("Content-Type", "")
                if resp.status >= 400:
                    text = raw.decode("utf-8", "replace")
                    raise status_error(resp.status, text, resp.headers.get("Retry-After"), url)
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as e:
            raise RequestTimeout(f"no answer from {url} within {timeout}s") from e
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as e:
            raise ConnectError(f"{type(e).__name__} talking to {url}: {e}") from e
        return parse_body(raw, url, stream)

    async def _get(self, url: str, timeout: float) -> tuple[int, bytes] | None:
        """GET url with this endpoint's credentials -> (status, body); None when unreachable."""
        try:
            async with self._get_session().get(
                url,
                headers=self._headers(),
                params=self._params,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as resp:
                return resp.status, await resp.read()
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError, BackendError):
            return None

    async def _get_ok(self, url: str, timeout: float) -> bool:
        got = await self._get(url, timeout)
        return got is not None and got[0] < 400

    async def health(self, timeout: float = 5.0) -> bool:
        """True when GET /health at the server root (or {base}/models) answers 2xx."""
        root = self.url.removesuffix("/v1")
        if await self._get_ok(root + "/health", timeout):
            return True
        return root != self.url and await self._get_ok(self.url + "/models", timeout)

    async def get_json(self, url: str, timeout: float = 5.0) -> Any:
        """GET url with this endpoint's credentials -> its JSON on a 200, else None (never raises)."""
        got = await self._get(url, timeout)
        try:
            return orjson.loads(got[1]) if got is not None and got[0] == 200 else None
        except ValueError:
            return None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _retokenize(self, *parts: str | None) -> int:
        """Tokens of the text parts (thinking, answer, tool calls), each encoded alone and summed.

        Approximate for a split answer: the markers the reasoning parser took out (such as
        "<think>" and "</think>") are not in either part, so this is what count_source
        "retokenized" means: a count kit made, not the server's.
        """
        if self.tokenizer is None:
            msg = (
                f"{self.url} gave no token counts and no tokenizer was given to re-tokenize: "
                "pass tokenizer= (the target's local path)"
            )
            raise BackendConfigError(msg)
        return sum(encode_lengths(self.tokenizer, [p for p in parts if p]))

    def _usage(self, value: Any, what: str, parts: tuple, sampling: Sampling) -> int:
        """The server's count, checked (and against the text parts when there is a tokenizer)."""
        has_tokenizer = self._tokenizer_src is not None
        retokenized = (lambda: self._retokenize(*parts)) if has_tokenizer else (lambda: None)
        text = "".join(p for p in parts if p)
        return check_usage(value, what, self.url, sampling, retokenized, text)

    def _with_ids(self, comp: Completion, calls: list[dict] | None = None) -> Completion:
        """comp (count_source "server_ids") as it is when its ids spell its text, thinking
        and tool calls (kit.tokens.ids_spell) or no tokenizer is at hand; else the ids kept
        but not believed: the count is the text's, the thinking's and the calls' (calls_text),
        re-tokenized, count_source "retokenized" (the export re-tokenizes such a row)."""
        if self._tokenizer_src is None or not hasattr(self.tokenizer, "decode"):
            return comp
        if not comp.output_ids or ids_spell(
            self.tokenizer, comp.output_ids, comp.text, comp.reasoning, calls, comp.finish_reason
        ):
            return comp
        parts = (comp.reasoning, comp.text, calls_text(calls))
        comp.completion_tokens, comp.count_source = self._retokenize(*parts), "retokenized"
        return comp


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

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key_env: str | None = None,
        extra_body: dict | None = None,
        tokenizer: Any = None,
    ) -> None:
        super().__init__(base_url, model, api_key_env=api_key_env, tokenizer=tokenizer)
        self.extra_body = dict(extra_body or {})

    def _body(
        self, messages: list[Message], sampling: Sampling, tools: list[dict] | None = None
    ) -> dict:
        """The request body; extra_body wins, except that sampling's chat_template_kwargs
        are merged over extra_body's (the run's settings are what its records claim)."""
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        body.update(penalties(sampling))
        if tools is not None:
            body["tools"] = tools
        body.update(self.extra_body)
        kwargs = sampling.chat_template_kwargs
        if kwargs is not None:
            extra = body.get("chat_template_kwargs")
            body["chat_template_kwargs"] = {**(extra if isinstance(extra, dict) else {}), **kwargs}
        return body

    async def _complete(
        self,
        messages: list[Message],
        sampling: Sampling,
        timeout: float,
        tools: list[dict] | None = None,
    ) -> Completion:
        data = await self._post(self.path, self._body(messages, sampling, tools), timeout)
        choice, text, reasoning = message_parts(data, self.url)
        comp = self._completion(data, choice, text, reasoning, sampling)
        comp.tool_calls = tool_calls_of(choice, self.url)
        return comp

    def _completion(
        self, data: dict, choice: dict, text: str, reasoning: str | None, sampling: Sampling
    ) -> Completion:
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        finish = normalize_finish(choice.get("finish_reason"))
        prompt_tokens = optional_count(usage.get("prompt_tokens"))
        count = usage.get("completion_tokens")
        parts = (reasoning, text, calls_text(tool_calls_of(choice, self.url)))
        if count is not None:
            n = self._usage(count, "usage.completion_tokens", parts, sampling)
            return Completion(text, finish, n, "usage", prompt_tokens, reasoning=reasoning)
        n = self._retokenize(*parts)
        return Completion(text, finish, n, "retokenized", prompt_tokens, reasoning=reasoning)


class VLLMChat(OpenAIChat):
    """vLLM chat completions with exact token ids (vLLM >= 0.10.2).

    Sends "return_token_ids": true (vllm/entrypoints/openai/chat_completion/protocol.py,
    ChatCompletionRequest.return_token_ids); reads the top-level "prompt_token_ids"
    (ChatCompletionResponse.prompt_token_ids) and "choices[0].token_ids"
    (ChatCompletionResponseChoice.token_ids). Counts are len(token_ids), count_source
    "server_ids"; an older vLLM without the ids falls back to usage. With a reasoning
    parser (vllm serve --reasoning-parser ...) the thinking is ChatMessage.reasoning
    (0.3x; older: reasoning_content): Completion.reasoning, and token_ids cover it too.

    Example (a vLLM server):
        c = await VLLMChat("http://gpu:8000/v1", "Qwen/Qwen3-8B").complete(msgs, Sampling(), timeout=600)
        (c.count_source, len(c.output_ids) == c.completion_tokens)   # ('server_ids', True)
    """

    def _body(
        self, messages: list[Message], sampling: Sampling, tools: list[dict] | None = None
    ) -> dict:
        body = super()._body(messages, sampling, tools)
        body.setdefault("return_token_ids", True)  # extra_body may turn it off
        return body

    def _completion(
        self, data: dict, choice: dict, text: str, reasoning: str | None, sampling: Sampling
    ) -> Completion:
        ids = choice.get("token_ids")
        if ids is None:
            return super()._completion(data, choice, text, reasoning, sampling)
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        count = usage.get("completion_tokens")
        n = check_ids(
            ids, count, "choices[0].token_ids", self.url, sampling, (reasoning or "") + text
        )
        prompt_ids = data.get("prompt_token_ids")
        prompt_ids = prompt_ids if ids_ok(prompt_ids) else None
        finish = normalize_finish(choice.get("finish_reason"))
        n_prompt = len(prompt_ids) if prompt_ids is not None else None
        comp = Completion(text, finish, n, "server_ids", n_prompt, ids, prompt_ids, reasoning)
        return self._with_ids(comp, tool_calls_of(choice, self.url))


_RENDER_OWN = {"conversation", "tools", "add_generation_prompt", "tokenize", "return_dict"}


class SGLangGenerate(_HTTPBackend):
    """SGLang's native /generate with client-side chat templating and exact token ids.

    Renders the prompt with kit.tokens.render and POSTs {"input_ids", "sampling_params":
    {"max_new_tokens", "temperature", "top_p", "sampling_seed"?}} to {base_url}/generate
    (sglang io_struct GenerateReqInput); reads "text", "output_ids" and meta_info
    {"prompt_tokens", "completion_tokens", "finish_reason": {"type": "length" | "stop" |
    "abort", ...}} (sglang schedule_batch.py FINISH_*.to_json). /generate has no reasoning
    parser (SGLang docs, advanced_features/separate_reasoning.md): Completion.text is the
    raw text, thinking inline, and reasoning None; output_ids hold thinking and answer. Use
    api="openai" against SGLang's /v1 (--reasoning-parser) to get the split.

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

    def __init__(
        self, base_url: str, model: str, *, tokenizer: Any, api_key_env: str | None = None
    ) -> None:
        if tokenizer is None:
            raise ConfigError("SGLangGenerate needs tokenizer= (it renders the chat template)")
        super().__init__(base_url, model, api_key_env=api_key_env, tokenizer=tokenizer)

    def render(
        self,
        messages: list[Message],
        *,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[int]:
        """Prompt token ids: the chat template with the generation prompt (kit.tokens.render).

        Args:
            messages: the chat to render.
            tools: tool definitions, passed as apply_chat_template(tools=...).
            chat_template_kwargs: extra template variables, e.g. {"enable_thinking": False},
                passed as **kwargs (the names render sets itself are a `config` error).

        Example:
            b.render([{"role": "user", "content": "Hi"}], chat_template_kwargs={"enable_thinking": False})
        """
        kwargs = dict(chat_template_kwargs or {})
        clash = sorted(kwargs.keys() & _RENDER_OWN)
        if clash:
            msg = f"chat_template_kwargs may not set {clash}: SGLangGenerate.render sets them"
            raise BackendConfigError(msg)
        tokenizer = self.tokenizer  # loaded here: a load error is not a template error
        try:
            ids = render(
                tokenizer, [messages], tools=[tools], template_kwargs=kwargs, tokenize=True
            )
        except Exception as e:  # a template that rejects these messages/tools/kwargs
            msg = f"the chat template failed for {self.url}: {type(e).__name__}: {e}"
            raise BackendConfigError(msg) from e
        return ids[0]

    async def _complete(
        self,
        messages: list[Message],
        sampling: Sampling,
        timeout: float,
        tools: list[dict] | None = None,
    ) -> Completion:
        ids = self.render(messages, tools=tools, chat_template_kwargs=sampling.chat_template_kwargs)
        params = {
            "max_new_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
        }
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        params.update(penalties(sampling))  # SGLang's SamplingParams has both, same names
        data = await self._post(self.path, {"input_ids": ids, "sampling_params": params}, timeout)
        meta, out_ids, text = data.get("meta_info"), data.get("output_ids"), data.get("text")
        if not isinstance(meta, dict) or not isinstance(text, str):
            msg = f"no text/meta_info in /generate answer from {self.url}"
            raise MalformedAnswer(msg)
        finish = normalize_finish(meta.get("finish_reason"))
        count = meta.get("completion_tokens")
        if out_ids is not None:
            n = check_ids(out_ids, count, "output_ids", self.url, sampling, text)
            comp = Completion(text, finish, n, "server_ids", len(ids), out_ids, ids)
            return self._with_ids(comp)
        if count is not None:
            n = self._usage(count, "meta_info.completion_tokens", (text,), sampling)
            return Completion(text, finish, n, "usage", len(ids), None, ids)
        return Completion(text, finish, self._retokenize(text), "retokenized", len(ids))


def make_backend(
    api: str, url: str, model: str, *, api_key_env: str | None = None, tokenizer: Any = None
) -> Backend:
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
    raise ConfigError(f"api must be one of 'openai', 'vllm', 'sglang', got {api!r}")


async def score(
    backend: Backend, prompt_ids: list[int], answer_ids: list[int], *, timeout: float
) -> tuple[list[float], list[bool]]:
    """The target's log-probability of each answer token after the prompt, and whether it
    is the target's top-1 there: one prefill, one token generated (kit.plan.value).

    vLLM (and any server of the OpenAI family): POST {base}/completions with prompt =
    the ids, "prompt_logprobs": 1 (each entry {id: {"logprob", "rank"}}, rank 1 = top-1).
    SGLang: POST /generate with "return_logprob", "logprob_start_len" and
    "top_logprobs_num": 1 (meta_info "input_token_logprobs" [[logprob, id, text], ...] and
    "input_top_logprobs" [[[logprob, id, text]], ...]). A server that gives no prompt
    log-probabilities, or refuses the request (a 4xx), raises NoScoring.
    """
    ids, n = list(prompt_ids) + list(answer_ids), len(answer_ids)
    try:
        if isinstance(backend, SGLangGenerate):
            body = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                "return_logprob": True,
                "logprob_start_len": max(0, len(prompt_ids) - 1),
                "top_logprobs_num": 1,
            }
            return _sglang_scores(await _scoring_post(backend, "/generate", body, timeout), ids, n)
        body = {"model": backend.model, "prompt": ids, "max_tokens": 1, "temperature": 0}
        data = await _scoring_post(backend, "/completions", body | {"prompt_logprobs": 1}, timeout)
        return _vllm_scores(data, backend.url, ids, n)
    except BackendError as err:
        raise backend.redacted(err) from None


async def _scoring_post(backend: Any, path: str, body: dict, timeout: float) -> dict:
    """POST a scoring request; a refusal (a 4xx that no retry helps) is NoScoring."""
    try:
        return await backend._post(path, body, timeout)
    except HTTPStatusError as err:
        if err.retryable:
            raise
        raise NoScoring(f"{backend.url}{path} refused a scoring request: {err}") from None


def _vllm_scores(data: dict, url: str, ids: list[int], n: int) -> tuple[list, list]:
    choices = data.get("choices")
    entries = (
        choices[0].get("prompt_logprobs") if choices and isinstance(choices[0], dict) else None
    )
    if not isinstance(entries, list):
        raise NoScoring(f"{url}/completions gave no prompt_logprobs: it cannot score text")
    if len(entries) != len(ids):
        msg = f"{url}: {len(entries)} prompt_logprobs for {len(ids)} prompt tokens"
        raise MalformedAnswer(msg)
    logprobs, top1 = [], []
    for token, entry in zip(ids[len(ids) - n :], entries[len(ids) - n :], strict=True):
        got = entry.get(str(token)) if isinstance(entry, dict) else None
        if not isinstance(got, dict) or not isinstance(got.get("logprob"), int | float):
            raise MalformedAnswer(f"{url}: no prompt_logprobs entry for token {token}")
        logprobs.append(float(got["logprob"]))
        top1.append(got.get("rank") == 1)
    return logprobs, top1


def _sglang_scores(data: dict, ids: list[int], n: int) -> tuple[list, list]:
    meta = data.get("meta_info") if isinstance(data, dict) else None
    tokens = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    tops = meta.get("input_top_logprobs") if isinstance(meta, dict) else None
    if not isinstance(tokens, list) or not isinstance(tops, list):
        raise NoScoring("/generate gave no input_token_logprobs/input_top_logprobs")
    if len(tokens) < n or len(tops) != len(tokens):
        msg = (
            f"/generate: {len(tokens)} input logprobs, {len(tops)} top lists for {n} answer tokens"
        )
        raise MalformedAnswer(msg)
    logprobs, top1 = [], []
    for token, entry, top in zip(ids[len(ids) - n :], tokens[-n:], tops[-n:], strict=True):
        ok = isinstance(entry, list | tuple) and len(entry) >= 2 and entry[1] == token
        if not ok or not isinstance(entry[0], int | float) or not isinstance(top, list) or not top:
            raise MalformedAnswer(f"/generate: input logprob entry {entry!r} is not token {token}")
        logprobs.append(float(entry[0]))
        top1.append(max(top, key=lambda t: t[0])[1] == token)
    return logprobs, top1


__all__ = ["OpenAIChat", "SGLangGenerate", "VLLMChat", "make_backend", "score"]
