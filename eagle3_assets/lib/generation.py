"""Regenerate a batch of conversations with the target: an async client for vLLM's
OpenAI-compatible chat API, and `run_batch`, the resumable loop an asset calls.

Hours of generation at 200 concurrent requests meet every transport problem, so the client:
- lifts aiohttp's defaults that hurt: connector limit 100 (would cap concurrency at ~99),
  300 s total timeout (long generations), 15 s keep-alive (vLLM closes idle connections at 5 s);
- retries 408/409/425/429/5xx and connection errors (ServerDisconnected on a reused connection
  included) with exponential backoff and jitter; other 4xx are the request's fault, not the
  server's, so they fail at once with the server's message;
- trips a breaker after many consecutive failures on every replica: a dead server fails the
  run in seconds instead of retrying every sample for minutes;
- spreads requests over several replicas (least in flight), resting one that just failed.

A sample that still fails (retries exhausted, or a 4xx) is reported in the summary and not
written, so the batch has no final file and the next run retries exactly those samples.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pyarrow.compute as pc

from eagle3_assets.lib.conversations import Conversation
from eagle3_assets.lib.generation_store import GenerationStore

RETRYABLE_STATUSES = frozenset({408, 409, 425, 429})  # and every 5xx
KEEPALIVE_S = 4.0  # below vLLM's 5 s idle close, so we close idle connections first
REPLICA_REST_S = 5.0  # a replica that just failed gets no new requests while others can


@dataclass(frozen=True)
class GenerationConfig:
    """What shapes the samples (first group) and how the client behaves (second group)."""

    max_tokens: int = 2048
    temperature: float = 1.0  # the target's own distribution: what the drafter must predict
    top_p: float = 1.0
    seed: int = 0  # each sample gets seed + a stable hash of its prompt id
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. Kimi's {"thinking": False}
    return_token_ids: bool = False  # vLLM >= 0.10.2 returns prompt and output token ids

    concurrency: int = 200
    max_attempts: int = 8  # per sample, the first try included
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    breaker_threshold: int = 20  # consecutive failed requests to every replica
    connect_timeout_s: float = 10.0
    flush_every_s: float = 0.5  # a kill -9 loses at most this much of completed work

    def __post_init__(self) -> None:
        for name in ("max_tokens", "concurrency", "max_attempts", "breaker_threshold"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


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


def sample_seed(base_seed: int, prompt_id: str) -> int:
    """Stable per prompt and independent of batch order, so a resumed sample is the same."""
    offset = int.from_bytes(hashlib.sha256(prompt_id.encode()).digest()[:4], "big")
    return (base_seed + offset) % 2**31


def settings_fingerprint(model: str, config: GenerationConfig) -> str:
    """A hash of everything that shapes a sample; part of the sample id, so rows generated
    under other settings are never resumed into this batch."""
    shaping = {
        "model": model,
        "max_tokens": config.max_tokens,
        "temperature": config.temperature,
        "top_p": config.top_p,
        "seed": config.seed,
        "chat_template_kwargs": config.chat_template_kwargs,
        "return_token_ids": config.return_token_ids,
    }
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:8]


@dataclass(frozen=True)
class ProgressReport:
    done: int  # samples persisted or completed, resumed ones included
    total: int
    resumed: int
    failed: int  # samples given up on in this run
    in_flight: int
    errors: int  # failed requests, retried or not
    retries: int
    elapsed_s: float
    requests_per_s: float  # completions per second in this run
    output_tokens_per_s: float
    eta_s: float | None  # None until something completed

    def __str__(self) -> str:
        eta = "?" if self.eta_s is None else f"{self.eta_s:.0f} s"
        return (
            f"{self.done}/{self.total} done ({self.resumed} resumed), {self.in_flight} in flight, "
            f"{self.requests_per_s:.1f} req/s, {self.output_tokens_per_s:.0f} output tok/s, "
            f"{self.failed} failed, {self.errors} errors, {self.retries} retries, ETA {eta}"
        )


@dataclass(frozen=True)
class BatchSummary:
    total: int  # samples in the batch
    resumed: int  # already persisted before this run
    requested: int  # samples this run set out to generate
    completed: int  # of those, generated and persisted
    failed: int  # of those, given up on (not written; the next run retries them)
    failures: dict[str, str]  # prompt id -> last error
    prompt_tokens: int  # over the batch's persisted rows
    completion_tokens: int
    finish_reasons: dict[str, int]
    seconds: float  # this run
    requests_per_s: float
    output_tokens_per_s: float
    errors: int
    retries: int
    final_path: Path | None  # None unless every sample has a row


class _BatchRun:
    """State of one run over one batch: what is done, what is buffered, the counters."""

    def __init__(
        self,
        conversations: Sequence[Conversation],
        store: GenerationStore,
        client: ChatClient,
        progress: Callable[[ProgressReport], None] | None,
    ) -> None:
        fingerprint = settings_fingerprint(client.model, client.config)
        self.samples = {f"{c.prompt_id}-{fingerprint}": c for c in conversations}
        if len(self.samples) != len(conversations):
            raise ValueError("the batch holds a prompt id twice; rows are keyed by prompt id")
        self.store = store
        self.client = client
        self.progress = progress
        done = store.completed_ids() & self.samples.keys()
        self.missing = [sample_id for sample_id in self.samples if sample_id not in done]
        self.resumed = len(done)
        self.completed = 0
        self.output_tokens = 0
        self.failures: dict[str, str] = {}
        self.buffer: list[dict[str, Any]] = []
        self.started = time.monotonic()

    async def run(self, flush_every_s: float, progress_every_s: float) -> None:
        """Generate every missing sample; on any exit (cancel included) persist what finished."""
        tasks = {asyncio.create_task(self.generate(sample_id)) for sample_id in self.missing}
        next_report = time.monotonic() + progress_every_s
        self.report()
        try:
            while tasks:
                finished, tasks = await asyncio.wait(
                    tasks, timeout=flush_every_s, return_when=asyncio.FIRST_EXCEPTION
                )
                for task in finished:
                    task.result()  # the breaker's ServerLooksDead stops the run here
                self.flush()
                if tasks and time.monotonic() >= next_report:
                    self.report()
                    next_report = time.monotonic() + progress_every_s
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.flush()
        self.report()

    async def generate(self, sample_id: str) -> None:
        conversation = self.samples[sample_id]
        seed = sample_seed(self.client.config.seed, conversation.prompt_id)
        try:
            completion = await self.client.complete(conversation.messages, seed)
        except (RequestRejected, RetriesExhausted) as error:
            self.failures[conversation.prompt_id] = str(error)
            return
        self.buffer.append(
            {
                "sample_id": sample_id,
                "prompt_id": conversation.prompt_id,
                "messages": json.dumps(conversation.messages, ensure_ascii=False),
                "model": self.client.model,
                "seed": seed,
                **vars(completion),  # no deep copy of the token id lists
            }
        )
        self.completed += 1
        self.output_tokens += completion.completion_tokens

    def flush(self) -> None:
        if self.buffer:
            self.store.write_part(self.buffer)
            self.buffer = []

    def elapsed(self) -> float:
        return max(time.monotonic() - self.started, 1e-9)

    def report(self) -> None:
        if self.progress is None:
            return
        rate = self.completed / self.elapsed()
        remaining = len(self.samples) - self.resumed - self.completed - len(self.failures)
        self.progress(
            ProgressReport(
                done=self.resumed + self.completed,
                total=len(self.samples),
                resumed=self.resumed,
                failed=len(self.failures),
                in_flight=self.client.in_flight,
                errors=self.client.errors,
                retries=self.client.retries,
                elapsed_s=self.elapsed(),
                requests_per_s=rate,
                output_tokens_per_s=self.output_tokens / self.elapsed(),
                eta_s=remaining / rate if rate > 0 else None,
            )
        )

    def summary(self, final_path: Path | None) -> BatchSummary:
        rows = self.store.select(
            list(self.samples), columns=["prompt_tokens", "completion_tokens", "finish_reason"]
        )
        elapsed = self.elapsed()
        return BatchSummary(
            total=len(self.samples),
            resumed=self.resumed,
            requested=len(self.missing),
            completed=self.completed,
            failed=len(self.failures),
            failures=dict(self.failures),
            prompt_tokens=pc.sum(rows["prompt_tokens"]).as_py() or 0,
            completion_tokens=pc.sum(rows["completion_tokens"]).as_py() or 0,
            finish_reasons=dict(Counter(r or "unknown" for r in rows["finish_reason"].to_pylist())),
            seconds=elapsed,
            requests_per_s=self.completed / elapsed,
            output_tokens_per_s=self.output_tokens / elapsed,
            errors=self.client.errors,
            retries=self.client.retries,
            final_path=final_path,
        )


async def generate_batch(
    conversations: Sequence[Conversation],
    out_dir: str | Path,
    base_urls: Sequence[str],
    model: str,
    config: GenerationConfig | None = None,
    api_key: str | None = None,
    progress: Callable[[ProgressReport], None] | None = None,
    progress_every_s: float = 5.0,
) -> BatchSummary:
    """The async core of run_batch; cancelling it persists what completed, then re-raises."""
    config = config or GenerationConfig()
    store = GenerationStore(out_dir)
    async with ChatClient(base_urls, model, config, api_key) as client:
        batch = _BatchRun(conversations, store, client, progress)
        await batch.run(config.flush_every_s, progress_every_s)
    final_path = None if batch.failures else store.finalize(list(batch.samples))
    return batch.summary(final_path)


def run_batch(
    conversations: Sequence[Conversation],
    out_dir: str | Path,
    base_urls: Sequence[str],
    model: str,
    config: GenerationConfig | None = None,
    api_key: str | None = None,
    progress: Callable[[ProgressReport], None] | None = None,
    progress_every_s: float = 5.0,
) -> BatchSummary:
    """Generate the batch's missing samples under `out_dir` and write its final Parquet.

    Resumes from earlier runs' part files; reports progress every `progress_every_s`; returns
    a summary whose `failed` > 0 means no final file (raise on it). ServerLooksDead propagates.
    """
    return asyncio.run(
        generate_batch(
            conversations, out_dir, base_urls, model, config, api_key, progress, progress_every_s
        )
    )
