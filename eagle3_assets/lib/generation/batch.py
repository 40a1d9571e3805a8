"""`run_batch`: the resumable loop that regenerates one batch of conversations with the
target, the loop an asset calls.

A sample that still fails (retries exhausted, or a 4xx) is reported in the summary and not
written, so the batch has no final file and the next run retries exactly those samples.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from eagle3_assets.lib.generation.chat_client import ChatClient, RequestRejected, RetriesExhausted
from eagle3_assets.lib.generation.conversations import Conversation
from eagle3_assets.lib.generation.settings import GenerationConfig, Sampling
from eagle3_assets.lib.generation.store import GenerationStore


def sample_seed(base_seed: int, prompt_id: str) -> int:
    """Stable per prompt and independent of batch order, so a resumed sample is the same."""
    offset = int.from_bytes(hashlib.sha256(prompt_id.encode()).digest()[:4], "big")
    return (base_seed + offset) % 2**31


def settings_fingerprint(model: str, config: GenerationConfig) -> str:
    """A hash of everything that shapes a sample; part of the sample id, so rows generated
    under other settings are never resumed into this batch."""
    shaping = {"model": model, **config.model_dump(include=set(Sampling.model_fields))}
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
