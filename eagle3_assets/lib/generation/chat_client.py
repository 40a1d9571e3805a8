"""An async client for vLLM's OpenAI-compatible chat API, made for hours at 200 concurrent
requests.

Hours of generation meet every transport problem, so the client:
- lifts aiohttp's defaults that hurt: connector limit 100 (would cap concurrency at ~99),
  300 s total timeout (long generations), 15 s keep-alive (vLLM closes idle connections at 5 s);
- retries 408/409/425/429/5xx and connection errors (ServerDisconnected on a reused connection
  included) with exponential backoff and jitter; other 4xx are the request's fault, not the
  server's, so they fail at once with the server's message;
- trips a breaker after many consecutive failures on every replica: a dead server fails the
  run in seconds instead of retrying every sample for minutes;
- spreads requests over several replicas (least in flight), resting one that just failed.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from eagle3_assets.lib.generation.settings import GenerationConfig

RETRYABLE_STATUSES = frozenset({408, 409, 425, 429})  # and every 5xx
KEEPALIVE_S = 4.0  # below vLLM's 5 s idle close, so we close idle connections first
REPLICA_REST_S = 5.0  # a replica that just failed gets no new requests while others can


class GenerationError(RuntimeError):
    """The run or one sample could not be generated; the message says why."""


class RequestRejected(GenerationError):
    """A 4xx that retrying cannot fix (bad field, unknown model, prompt too long...)."""


class RetriesExhausted(GenerationError):
    """A sample failed on every attempt."""


class ServerLooksDead(GenerationError):
    """The breaker tripped: the run stops instead of hammering a dead server."""


class _Transient(Exception):
    """A failure worth retrying; its message says what happened."""


@dataclass(frozen=True)
class Completion:
    response: str
    reasoning: str | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    prompt_token_ids: list[int] | None
    token_ids: list[int] | None
    latency_s: float  # of the successful attempt, from sending to the parsed answer


class ChatClient:
    """Chat completions against one or several vLLM replicas; use as `async with`.

    `retries` and `errors` (failed attempts, retried or not) count over the client's life.
    """

    def __init__(
        self,
        base_urls: Sequence[str],
        model: str,
        config: GenerationConfig,
        api_key: str | None = None,
    ) -> None:
        if not base_urls:
            raise ValueError("at least one base URL is needed")
        self.base_urls = [url.rstrip("/") for url in base_urls]
        self.model = model
        self.config = config
        self.retries = 0
        self.errors = 0
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._in_flight = dict.fromkeys(self.base_urls, 0)
        self._resting_until = dict.fromkeys(self.base_urls, 0.0)
        self._turn = 0
        self._consecutive_failures = dict.fromkeys(self.base_urls, 0)
        self._slots = asyncio.Semaphore(config.concurrency)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ChatClient:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=timeout, headers=self._headers
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._session.close()

    @property
    def in_flight(self) -> int:
        return sum(self._in_flight.values())

    def _payload(self, messages: list[dict[str, str]], seed: int) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.config.max_tokens,
            "temperature": self.config.temperature,
            "top_p": self.config.top_p,
            "seed": seed,
        }
        if self.config.chat_template_kwargs is not None:
            payload["chat_template_kwargs"] = self.config.chat_template_kwargs
        if self.config.return_token_ids:
            payload["return_token_ids"] = True
        return payload

    async def complete(self, messages: list[dict[str, str]], seed: int) -> Completion:
        """One chat completion, retried; raises RequestRejected, RetriesExhausted or
        ServerLooksDead. Backoff waits happen outside the concurrency slots."""
        payload = self._payload(messages, seed)
        last_error = ""
        for attempt in range(1, self.config.max_attempts + 1):
            async with self._slots:
                base_url = self._pick()
                self._in_flight[base_url] += 1
                try:
                    completion = await self._post(base_url, payload)
                except _Transient as error:
                    last_error = str(error)
                    self._failed(base_url, last_error)
                except RequestRejected as error:
                    self._failed(base_url, str(error), rest=False)
                    raise
                else:
                    self._consecutive_failures[base_url] = 0
                    return completion
                finally:
                    self._in_flight[base_url] -= 1
            if attempt < self.config.max_attempts:
                self.retries += 1
                await asyncio.sleep(self._backoff(attempt))
        raise RetriesExhausted(f"{self.config.max_attempts} attempts failed; last: {last_error}")

    async def _post(self, base_url: str, payload: dict[str, Any]) -> Completion:
        url = f"{base_url}/v1/chat/completions"
        started = time.perf_counter()
        try:
            async with self._session.post(url, json=payload) as response:
                status, body = response.status, await response.read()
        except (aiohttp.ClientError, TimeoutError) as error:
            raise _Transient(f"POST {url}: {type(error).__name__}: {error}") from error
        if status != 200:
            failure = f"POST {url} answered {status}: {_server_message(body)}"
            if status in RETRYABLE_STATUSES or status >= 500:
                raise _Transient(failure)
            raise RequestRejected(failure)
        try:
            return _parse(json.loads(body), time.perf_counter() - started)
        except (ValueError, KeyError, IndexError, TypeError) as error:
            raise _Transient(f"POST {url}: malformed answer ({error!r}): {body[:200]!r}") from error

    def _pick(self) -> str:
        """Least in flight among replicas not resting (all if all are); ties rotate."""
        self._turn += 1
        count = len(self.base_urls)
        rotated = [self.base_urls[(self._turn + i) % count] for i in range(count)]
        now = time.monotonic()
        awake = [url for url in rotated if self._resting_until[url] <= now] or rotated
        return min(awake, key=self._in_flight.__getitem__)

    def _failed(self, base_url: str, error: str, rest: bool = True) -> None:
        """Count a failure; trip the breaker once every replica failed its last N requests
        (one dead replica among live ones only rests)."""
        self.errors += 1
        self._consecutive_failures[base_url] += 1
        if rest:
            self._resting_until[base_url] = time.monotonic() + REPLICA_REST_S
        threshold = self.config.breaker_threshold
        if min(self._consecutive_failures.values()) >= threshold:
            raise ServerLooksDead(
                f"breaker tripped after {threshold} consecutive failed requests to each of "
                f"{', '.join(self.base_urls)}: the server(s) look dead or reject every request. "
                f"Last error: {error}"
            )

    def _backoff(self, attempt: int) -> float:
        """Exponential with jitter, so 200 failed requests do not come back in lockstep."""
        delay = min(self.config.backoff_max_s, self.config.backoff_base_s * 2 ** (attempt - 1))
        return delay / 2 + random.uniform(0, delay / 2)


def _parse(body: dict[str, Any], latency_s: float) -> Completion:
    choice = body["choices"][0]
    message = choice["message"]
    usage = body.get("usage") or {}
    return Completion(
        response=message.get("content") or "",
        reasoning=message.get("reasoning") or message.get("reasoning_content"),
        finish_reason=choice.get("finish_reason"),
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        prompt_token_ids=body.get("prompt_token_ids"),  # top level in vLLM's answer
        token_ids=choice.get("token_ids"),
        latency_s=latency_s,
    )


def _server_message(body: bytes) -> str:
    """vLLM's error text from `{"error": {"message"}}` or `{"message"}`, else the raw body."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict):
        error = data.get("error")
        message = error.get("message") if isinstance(error, dict) else data.get("message")
        if message:
            return str(message)[:1000]
    return body[:1000].decode(errors="replace")
