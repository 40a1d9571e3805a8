"""A drafter's acceptance as the serving engine measures it: deltas of vLLM's /metrics
counters around a workload of chat completions (chat template applied by the server).

Mean acceptance length = 1 + accepted / drafts (the target's own token plus the accepted
draft tokens per verification step); per-position acceptance = accepted at position k /
drafts. Counters are summed over label sets, so several engines' series add up. The prompt
tokens the engine counted are kept as evidence of the rendering measured: the same prompts
rendered with other chat template kwargs count other tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from eagle3_assets.lib.serving.vllm_probe import ACCEPTED, DRAFTS, fetch_metrics, smoke_chat

DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
GENERATED = "vllm:generation_tokens_total"
PROMPT = "vllm:prompt_tokens_total"


@dataclass(frozen=True)
class Acceptance:
    drafts: float
    draft_tokens: float
    accepted: float
    accepted_per_position: list[float]
    output_tokens: float
    seconds: float
    prompt_tokens: float = 0.0  # 0: a measurement saved before it was counted

    @property
    def mean_length(self) -> float:
        return 1 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def per_position(self) -> list[float]:
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted_per_position]


def snapshot(base_url: str, api_key: str | None = None) -> dict[str, float | dict[int, float]]:
    """The speculative-decoding counters now; acceptance is the difference of two."""
    metrics = fetch_metrics(base_url, api_key=api_key)
    totals: dict[str, float | dict[int, float]] = {
        name: sum(metrics.get(name, {}).values())
        for name in (DRAFTS, DRAFT_TOKENS, ACCEPTED, GENERATED, PROMPT)
    }
    positions: dict[int, float] = {}
    for labels, value in metrics.get(PER_POSITION, {}).items():
        position = int(dict(labels)["position"])
        positions[position] = positions.get(position, 0.0) + value
    totals[PER_POSITION] = positions
    return totals


def measure_acceptance(
    base_url: str,
    model: str,
    conversations: Sequence[list[dict]],
    max_tokens: int,
    concurrency: int = 8,
    api_key: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> Acceptance:
    """Run the conversations greedy, rendered with `chat_template_kwargs` as the drafter's
    training data was, and read what the engine counted meanwhile (nothing else should use
    the server during the measurement)."""
    before = snapshot(base_url, api_key)
    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        list(
            pool.map(
                lambda m: smoke_chat(
                    base_url, model, m, max_tokens, 600.0, api_key, chat_template_kwargs
                ),
                conversations,
            )
        )
    return between(before, snapshot(base_url, api_key), time.monotonic() - started)


def between(before: dict, after: dict, seconds: float) -> Acceptance:
    """What the engine counted from snapshot `before` to snapshot `after`."""
    positions = sorted(after[PER_POSITION])
    return Acceptance(
        drafts=after[DRAFTS] - before[DRAFTS],
        draft_tokens=after[DRAFT_TOKENS] - before[DRAFT_TOKENS],
        accepted=after[ACCEPTED] - before[ACCEPTED],
        accepted_per_position=[
            after[PER_POSITION][p] - before[PER_POSITION].get(p, 0.0) for p in positions
        ],
        output_tokens=after[GENERATED] - before[GENERATED],
        seconds=seconds,
        prompt_tokens=after[PROMPT] - before[PROMPT],
    )
