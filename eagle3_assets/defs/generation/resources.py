"""The prompts to regenerate and how every batch is sampled."""

import dagster as dg
from pydantic import Field

from eagle3_assets.env_settings import EnvSettings
from eagle3_assets.lib.core.hub_files import HF_TOKEN_ENV, local_file
from eagle3_assets.lib.generation.conversations import (
    Conversation,
    batch_slice,
    load_conversations,
    parse_batch_key,
)
from eagle3_assets.lib.generation.settings import GenerationConfig


class PromptPool(dg.ConfigurableResource, EnvSettings):
    """The conversations to regenerate, cut into fixed batches (batch k = items k*size...).

    `path`: a local JSONL/Parquet file, or `hf://datasets/<org>/<name>/<file>[@<revision>]`.
    """

    path: str = "data/world/demo/prompts.jsonl"
    batch_size: int = Field(1000, ge=1)
    cache_dir: str | None = None  # hub cache for hf:// paths
    token: str | None = None

    env = {
        "path": "EAGLE3_PROMPTS",
        "batch_size": "EAGLE3_BATCH_SIZE",
        "cache_dir": "EAGLE3_HF_CACHE",
    }
    secrets = {"token": HF_TOKEN_ENV}

    def conversations(self) -> list[Conversation]:
        return load_conversations(local_file(self.path, self.cache_dir, self.token))

    def batch(self, key: str) -> list[Conversation]:
        return batch_slice(self.conversations(), parse_batch_key(key), self.batch_size)


class GenerationRecipe(dg.ConfigurableResource, GenerationConfig, EnvSettings):
    """How every batch is sampled (lib/generation/settings.py). A deployment setting, not per-run
    config: all batches must share it, and extraction and evaluation render conversations with
    the same template kwargs (e.g. Kimi's thinking flag)."""

    max_empty_rate: float = Field(0.01, ge=0, le=1)  # blocking check thresholds
    max_truncated_rate: float = Field(0.25, ge=0, le=1)

    env = {
        "max_tokens": "EAGLE3_MAX_TOKENS",
        "temperature": "EAGLE3_TEMPERATURE",
        "top_p": "EAGLE3_TOP_P",
        "seed": "EAGLE3_SEED",
        "concurrency": "EAGLE3_CONCURRENCY",
        "chat_template_kwargs": "EAGLE3_CHAT_TEMPLATE_KWARGS",
        "max_truncated_rate": "EAGLE3_MAX_TRUNCATED_RATE",
    }

    def config(self) -> GenerationConfig:
        return GenerationConfig(**self.model_dump(include=set(GenerationConfig.model_fields)))
