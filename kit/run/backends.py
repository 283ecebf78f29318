"""Clients for one server endpoint (kit.types.Backend); kit.run.pool spreads requests over several.

    OpenAIChat      POST {base_url}/chat/completions; counts from usage
    VLLMChat        the same plus "return_token_ids": the server's own ids, counted
    SGLangGenerate  renders the chat template itself and POSTs input_ids to {base_url}/generate
    make_backend(api, url, model, ...) picks one by RunConfig.api.

`await b.complete(messages, sampling, *, timeout, tools=None) -> Completion`: the answer, the
thinking the server's reasoning parser split off and its tool calls, counted as the server
counts them. Every failure is a kit.errors.BackendError whose class says if a retry can
help (429, 5xx, connect, timeout, malformed: yes; other 4xx, config, a redirect: no): a
broken status line or header, a cut or undecodable body and a body past the bound
(`body_limit`, the connection then closed) included. A redirect is never followed: a
POST's is a `Redirected` error naming both URLs, a GET's is no answer. The API key is read
from the variable api_key_env names at each request and never stored; it and the
credentials in a base URL go only to that URL's own host and port (never to a host a
gateway's /workers lists); every error text is redacted (kit.secrets).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
from contextvars import ContextVar
from typing import Any
from urllib.parse import urljoin, urlsplit

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
    Redirected,
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
    status_error,
    tool_calls_of,
)
from kit.secrets import redact, remember, url_secrets
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
BODY_FLOOR = 64 * 1024  # bytes of an answer body allowed whatever max_tokens is
BODY_PER_TOKEN = 256  # and per max_token (text, escapes, ids, in answer and thinking)
BODY_PER_REQUEST_BYTE = 8  # and per byte sent (prompt ids echoed: one id per byte at most)
ERROR_BODY = 64 * 1024  # bytes of an error status's body read (the message keeps fewer)
_BROKEN = (aiohttp.ClientError, ValueError, UnicodeError, LookupError, OverflowError)
# body bytes allowed per max_token on top of BODY_PER_TOKEN while own_logprobs() asks for
# each token's logprob and top-1 (an entry and two top ones with ids and bytes: ~350 bytes)
LOGPROB_BODY_PER_TOKEN = 768
_OWN_LOGPROBS: ContextVar[dict | None] = ContextVar("kit_own_logprobs", default=None)


@contextlib.contextmanager
def own_logprobs():
    """While open (in this task and the tasks it starts), VLLMChat and SGLangGenerate ask
    for each sampled token's log-probability and the top-1 there, and file them in the
    yielded dict: (prompt ids, output ids) -> (logprobs, top1 flags). The sampling and
    the Completion are unchanged; an answer whose logprobs are missing, do not align with
    its ids, or are not the raw distribution's (SGLang at a temperature other than 0 or
    1 scales them) is not filed. kit.plan.value scores the pilot's answers from it."""
    sink: dict = {}
    token = _OWN_LOGPROBS.set(sink)
    try:
        yield sink
    finally:
        _OWN_LOGPROBS.reset(token)


def _file_logprobs(prompt_ids, output_ids, logprobs: list | None, top1: list | None) -> None:
    """File one answer's logprobs for own_logprobs() when they cover its ids."""
    sink = _OWN_LOGPROBS.get()
    if sink is None or not prompt_ids or not output_ids or logprobs is None:
        return
    if len(logprobs) == len(output_ids) == len(top1):
        sink[(tuple(prompt_ids), tuple(output_ids))] = (logprobs, top1)


def _vllm_own_logprobs(choice: dict, ids: list[int]) -> tuple[list, list] | tuple[None, None]:
    """choices[0].logprobs.content (with return_tokens_as_token_ids: "token_id:N") ->
    (logprob of each sampled id, whether it is the top-1 there); (None, None) when absent
    or not these ids. vLLM lists the sampled token first in top_logprobs, then the top
    ones: with top_logprobs 2 the list holds the top-1 whichever was sampled."""
    lp = choice.get("logprobs")
    content = lp.get("content") if isinstance(lp, dict) else None
    if not isinstance(content, list) or len(content) != len(ids):
        return None, None
    logprobs, top1 = [], []
    for token, entry in zip(ids, content, strict=True):
        entry = entry if isinstance(entry, dict) else {}
        value, tops = entry.get("logprob"), entry.get("top_logprobs")
        if entry.get("token") != f"token_id:{token}" or not isinstance(value, int | float):
            return None, None
        values = [t.get("logprob") for t in tops or () if isinstance(t, dict)]
        if not values or not all(isinstance(v, int | float) for v in values):
            return None, None
        logprobs.append(float(value))
        top1.append(max(values) <= value)
    return logprobs, top1


def body_limit(max_tokens: int, sent: int, override: int | None = None) -> int:
    """Bytes of an answer body kit reads: `override` (RunConfig.max_body_bytes) or
    BODY_FLOOR + BODY_PER_TOKEN per max_token + BODY_PER_REQUEST_BYTE per byte sent.

    Example:
        >>> body_limit(1024, 1000), body_limit(1024, 1000, override=10**6)
        (335680, 1000000)
    """
    if override is not None:
        return override
    return BODY_FLOOR + BODY_PER_TOKEN * max_tokens + BODY_PER_REQUEST_BYTE * sent


async def read_bounded(resp: aiohttp.ClientResponse, limit: int, url: str, cut: bool) -> bytes:
    """The body, at most `limit` bytes: past it the connection is closed and the answer
    is `malformed` (or, with `cut`, what was read is returned: an error status's text)."""
    buf = bytearray()
    async for chunk in resp.content.iter_chunked(64 * 1024):
        buf += chunk
        if len(buf) > limit:
            resp.close()  # the rest is never read: the connection goes, not back to the pool
            if cut:
                return bytes(buf[:limit])
            msg = f"the answer from {url} is over {limit} bytes (body_limit; max_body_bytes)"
            raise MalformedAnswer(msg)
    return bytes(buf)


def penalties(sampling: Sampling) -> dict:
    """The sampling's frequency/presence penalties that are set (not 0), by their OpenAI names.

    Example:
        >>> penalties(Sampling(frequency_penalty=0.5))
        {'frequency_penalty': 0.5}
    """
    names = ("frequency_penalty", "presence_penalty")
    return {n: getattr(sampling, n) for n in names if getattr(sampling, n)}


def _location(url: str, location: str | None) -> str:
    """Where a redirect from url points, absolute and without credentials."""
    try:
        return strip_userinfo(urljoin(url, location)) if location else "(no Location)"
    except ValueError:
        return "(an invalid URL)"


class _HTTPBackend:
    """Shared transport: session, POST with error mapping, health, API key headers."""

    path = "/chat/completions"

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key_env: str | None = None,
        tokenizer: Any = None,
        max_body_bytes: int | None = None,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            shown = strip_userinfo(base_url) if isinstance(base_url, str) else base_url
            raise ConfigError(f"base_url must be an http(s) URL, got {shown!r}")
        if api_key_env is not None and not os.environ.get(api_key_env):
            raise ConfigError(f"api_key_env: environment variable {api_key_env!r} is not set")
        self.url = strip_userinfo(base_url).rstrip("/")  # never the credentials
        self.model = model
        self.api_key_env = api_key_env  # the variable's NAME only
        self.max_body_bytes = max_body_bytes
        creds = url_credentials(base_url)
        basic = creds and base64.b64encode(":".join(creds).encode()).decode()
        self._basic = f"Basic {basic}" if basic else None
        self._url_secrets = url_secrets(base_url)
        secrets = self.secrets()
        remember(*secrets)
        if any(s in str(model) for s in secrets):
            msg = "the model name holds the API key or a URL credential: give the model's name"
            raise ConfigError(msg)
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
            remember(key)
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _own(self, url: str) -> bool:
        """Whether url is on this endpoint's own scheme, host and port (what the user gave:
        the only place its credentials go)."""
        mine, other = urlsplit(self.url), urlsplit(url)
        return (mine.scheme, mine.netloc) == (other.scheme, other.netloc)

    def secrets(self) -> list[str]:
        """What must never appear in a message: the API key, the URL credentials."""
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        return [key, *self._url_secrets] if key else list(self._url_secrets)

    def redacted(self, err: BackendError) -> BackendError:
        """err with its message redacted and cut (what every raised error goes through)."""
        text = " ".join(redact(str(err), self.secrets()).split())  # one line
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

    async def _post(self, path: str, body: dict, timeout: float, max_tokens: int) -> dict:
        """POST body as JSON; the parsed answer or a BackendError (whatever broke)."""
        url, data = self.url + path, orjson.dumps(body)
        limit = body_limit(max_tokens, len(data), self.max_body_bytes)
        headers = self._headers()
        try:
            async with self._get_session().post(
                url,
                data=data,
                headers=headers,
                params=self._params,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as resp:
                if 300 <= resp.status < 400:
                    to = _location(url, resp.headers.get("Location"))
                    msg = (
                        f"HTTP {resp.status} from {url} redirects the POST to {to}: kit follows "
                        "no redirect; give that URL as the endpoint if it is the server"
                    )
                    raise Redirected(msg)
                error = resp.status >= 400
                raw = await read_bounded(resp, ERROR_BODY if error else limit, url, error)
                stream = "event-stream" in resp.headers.get("Content-Type", "")
                if error:
                    text = raw.decode("utf-8", "replace")
                    raise status_error(resp.status, text, resp.headers.get("Retry-After"), url)
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as e:
            raise RequestTimeout(f"no answer from {url} within {timeout}s") from e
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as e:
            raise ConnectError(f"{type(e).__name__} talking to {url}: {e}") from e
        except _BROKEN as e:  # a broken status line or header, an undecodable body
            raise MalformedAnswer(f"broken HTTP answer from {url}: {type(e).__name__}: {e}") from e
        return parse_body(raw, url, stream)

    async def get(self, url: str, timeout: float = 5.0) -> tuple[int, bytes, str | None] | None:
        """GET url -> (status, body, where a redirect points); None when unreachable or
        broken. The credentials go only to this endpoint's own host and port; a redirect is
        not followed."""
        own = self._own(url)
        try:
            async with self._get_session().get(
                url,
                headers=self._headers() if own else None,
                params=self._params if own else None,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as resp:
                body = await read_bounded(resp, ERROR_BODY * 16, url, True)
                where = resp.headers.get("Location") if 300 <= resp.status < 400 else None
                return resp.status, body, where and _location(url, where)
        except (asyncio.TimeoutError, OSError, BackendError, *_BROKEN):
            return None

    async def _get_ok(self, url: str, timeout: float) -> bool:
        got = await self.get(url, timeout)
        return got is not None and 200 <= got[0] < 300

    async def health(self, timeout: float = 5.0) -> bool:
        """True when GET /health at the server root (or {base}/models) answers 2xx."""
        root = self.url.removesuffix("/v1")
        if await self._get_ok(root + "/health", timeout):
            return True
        return root != self.url and await self._get_ok(self.url + "/models", timeout)

    async def get_json(self, url: str, timeout: float = 5.0) -> Any:
        """GET url with this endpoint's credentials -> its JSON on a 200, else None (never raises)."""
        got = await self.get(url, timeout)
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
        max_body_bytes: bytes of an answer read at most (None: body_limit's rule).

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
        max_body_bytes: int | None = None,
    ) -> None:
        super().__init__(
            base_url,
            model,
            api_key_env=api_key_env,
            tokenizer=tokenizer,
            max_body_bytes=max_body_bytes,
        )
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
        body = self._body(messages, sampling, tools)
        data = await self._post(self.path, body, timeout, _room(body, sampling.max_tokens))
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
        if _OWN_LOGPROBS.get() is not None:  # vLLM's default logprobs_mode: raw logprobs
            body |= {"logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}
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
        _file_logprobs(prompt_ids, ids, *_vllm_own_logprobs(choice, ids))
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
        self,
        base_url: str,
        model: str,
        *,
        tokenizer: Any,
        api_key_env: str | None = None,
        max_body_bytes: int | None = None,
    ) -> None:
        if tokenizer is None:
            raise ConfigError("SGLangGenerate needs tokenizer= (it renders the chat template)")
        super().__init__(
            base_url,
            model,
            api_key_env=api_key_env,
            tokenizer=tokenizer,
            max_body_bytes=max_body_bytes,
        )

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
        body = {"input_ids": ids, "sampling_params": params}
        if _OWN_LOGPROBS.get() is not None and sampling.temperature in (0, 1):
            # SGLang's output logprobs are the temperature-scaled ones: raw only at 0 and 1
            body |= {"return_logprob": True, "top_logprobs_num": 1, "logprob_start_len": -1}
        data = await self._post(self.path, body, timeout, _room(body, sampling.max_tokens))
        meta, out_ids, text = data.get("meta_info"), data.get("output_ids"), data.get("text")
        if not isinstance(meta, dict) or not isinstance(text, str):
            msg = f"no text/meta_info in /generate answer from {self.url}"
            raise MalformedAnswer(msg)
        if body.get("return_logprob") and ids_ok(out_ids):
            _file_logprobs(ids, out_ids, *_sglang_output_logprobs(meta, out_ids))
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


def _room(body: dict, max_tokens: int) -> int:
    """max_tokens as body_limit counts it: more room per token when logprobs are asked."""
    asked = body.get("logprobs") or body.get("return_logprob")
    return max_tokens * (1 + LOGPROB_BODY_PER_TOKEN // BODY_PER_TOKEN) if asked else max_tokens


def _sglang_output_logprobs(meta: dict, ids: list[int]) -> tuple[list, list] | tuple[None, None]:
    """meta_info output_token_logprobs [[logprob, id, text], ...] and output_top_logprobs
    [[[logprob, id, text]], ...] -> (logprobs, top1 flags); (None, None) when not these ids."""
    tokens, tops = meta.get("output_token_logprobs"), meta.get("output_top_logprobs")
    if not isinstance(tokens, list) or not isinstance(tops, list):
        return None, None
    if not len(tokens) == len(tops) == len(ids):
        return None, None
    got = _sglang_positions(ids, tokens, tops)
    if got is None:
        return None, None
    return [lp for lp, _ in got], [
        best[1] == t or best[0] <= lp for t, (lp, best) in zip(ids, got, strict=True)
    ]


def _sglang_positions(ids: list[int], tokens: list, tops: list) -> list[tuple] | None:
    """SGLang's per-position logprob lists against `ids`: (each id's logprob, the best
    [logprob, id, ...] listed there); None at the first entry that is not that id's."""
    out = []
    for token, entry, top in zip(ids, tokens, tops, strict=True):
        ok = isinstance(entry, list | tuple) and len(entry) >= 2 and entry[1] == token
        if not ok or not isinstance(entry[0], int | float) or not isinstance(top, list) or not top:
            return None
        out.append((float(entry[0]), max(top, key=lambda t: t[0])))
    return out


def make_backend(
    api: str,
    url: str,
    model: str,
    *,
    api_key_env: str | None = None,
    tokenizer: Any = None,
    max_body_bytes: int | None = None,
) -> Backend:
    """The backend for RunConfig.api (max_body_bytes: RunConfig.max_body_bytes).

    Example:
        >>> make_backend("vllm", "http://127.0.0.1:8000/v1", "m")
        VLLMChat(url='http://127.0.0.1:8000/v1', model='m')
    """
    kwargs = {"api_key_env": api_key_env, "tokenizer": tokenizer, "max_body_bytes": max_body_bytes}
    if api == "openai":
        return OpenAIChat(url, model, **kwargs)
    if api == "vllm":
        return VLLMChat(url, model, **kwargs)
    if api == "sglang":
        return SGLangGenerate(url, model, **kwargs)
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
            data = await _scoring_post(backend, "/generate", body, timeout, len(ids))
            return _sglang_scores(data, ids, n)
        body = {"model": backend.model, "prompt": ids, "max_tokens": 1, "temperature": 0}
        body |= {"prompt_logprobs": 1}
        data = await _scoring_post(backend, "/completions", body, timeout, len(ids))
        return _vllm_scores(data, backend.url, ids, n)
    except BackendError as err:
        raise backend.redacted(err) from None


async def _scoring_post(backend: Any, path: str, body: dict, timeout: float, n: int) -> dict:
    """POST a scoring request of `n` tokens, each scored as a generated one is bounded; a
    refusal (a 4xx that no retry helps) is NoScoring."""
    try:
        return await backend._post(path, body, timeout, n)
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
    answer = ids[len(ids) - n :]
    got = _sglang_positions(answer, tokens[-n:], tops[-n:])
    if got is None:
        raise MalformedAnswer("/generate: input logprob entries are not the answer's tokens")
    return [lp for lp, _ in got], [best[1] == t for t, (_, best) in zip(answer, got, strict=True)]


__all__ = ["OpenAIChat", "SGLangGenerate", "VLLMChat", "make_backend", "own_logprobs", "score"]
