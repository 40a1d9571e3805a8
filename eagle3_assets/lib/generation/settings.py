"""How every batch is sampled and how the client behaves: one typed recipe, each default once.

Hidden-state extraction and evaluation render conversations with the same
`chat_template_kwargs` as generation.
"""

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Sampling(BaseModel):
    """What shapes a sample: part of its id, so rows made under other settings never resume."""

    model_config = ConfigDict(frozen=True)

    max_tokens: int = Field(2048, ge=1)
    temperature: float = Field(1.0, ge=0)  # the target's own distribution: what drafts predict
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int = 0  # each sample gets seed + a stable hash of its prompt id
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. Kimi's {"thinking": False}
    return_token_ids: bool = True  # vLLM >= 0.10.2: the exact ids extraction must reproduce


class GenerationConfig(Sampling):
    """The sampling plus how the client behaves."""

    concurrency: int = Field(200, ge=1)
    max_attempts: int = Field(8, ge=1)  # per sample, the first try included
    backoff_base_s: float = Field(0.5, ge=0)
    backoff_max_s: float = Field(30.0, ge=0)
    breaker_threshold: int = Field(20, ge=1)  # consecutive failed requests to every replica
    connect_timeout_s: float = Field(10.0, gt=0)
    flush_every_s: float = Field(0.5, gt=0)  # a kill -9 loses at most this much of completed work
