"""The prompts to regenerate and how every batch is sampled."""

from collections.abc import Callable
from pathlib import Path

import dagster as dg
from pydantic import Field

from eagle3_assets.env_settings import EnvSettings
from eagle3_assets.lib.core.hub_files import (
    HF_DATASETS,
    HF_TOKEN_ENV,
    dataset_snapshot,
    local_file,
)
from eagle3_assets.lib.generation.conversations import (
    Conversation,
    batch_slice,
    load_conversations,
    parse_batch_key,
)
from eagle3_assets.lib.generation.inbox import SUFFIXES, Inbox, InboxFile
from eagle3_assets.lib.generation.settings import GenerationConfig
from eagle3_assets.resources import Storage


class PromptPool(dg.ConfigurableResource, EnvSettings):
    """The conversations to regenerate, cut into fixed batches (batch k = items k*size...):
    the pool file's, then what each file dropped in the inbox added, in arrival order.

    `path`: a local JSONL/Parquet file, or `hf://datasets/<org>/<name>/<file>[@<revision>]`.
    `inbox`: a folder (local or a mounted volume) where a gateway drops JSONL/Parquet files,
    or `hf://datasets/<org>/<name>[@<branch>]`, whose new revisions bring new or grown files;
    its ledger and snapshots live on the data volume (lib/generation/inbox.py).
    """

    path: str = "data/world/demo/prompts.jsonl"
    batch_size: int = Field(1000, ge=1)
    cache_dir: str | None = None  # hub cache for hf:// paths
    token: str | None = None
    inbox: str | None = None
    inbox_heldout_fraction: float = Field(0.1, ge=0, lt=1)

    env = {
        "path": "EAGLE3_PROMPTS",
        "batch_size": "EAGLE3_BATCH_SIZE",
        "cache_dir": "EAGLE3_HF_CACHE",
        "inbox": "EAGLE3_INBOX",
        "inbox_heldout_fraction": "EAGLE3_INBOX_HELDOUT_FRACTION",
    }
    secrets = {"token": HF_TOKEN_ENV}

    def pool_file(self) -> list[Conversation]:
        return load_conversations(local_file(self.path, self.cache_dir, self.token))

    def open_inbox(self, storage: Storage, newest: bool = False) -> Inbox | None:
        """The inbox's state; with `newest`, its files too: a hub dataset's newest revision,
        fetched (what registering needs; the state alone never reaches the hub)."""
        if not self.inbox:
            return None
        folder, revision = Path(self.inbox), None
        if newest and self.inbox.startswith(HF_DATASETS):
            patterns = [f"*{suffix}" for suffix in SUFFIXES]
            folder, revision = dataset_snapshot(self.inbox, patterns, self.cache_dir, self.token)
        return Inbox(folder, storage.path("inbox"), self.inbox_heldout_fraction, revision)

    def conversations(
        self, storage: Storage, registered: Callable[[InboxFile], None] | None = None
    ) -> list[Conversation]:
        """The pool, read once. With `registered` (the sensor), files new in the inbox are
        registered first, each reported to it."""
        pool = self.pool_file()
        inbox = self.open_inbox(storage, newest=registered is not None)
        if inbox is None:
            return pool
        if registered is not None:
            for entry in inbox.register([c.prompt_id for c in pool]):
                registered(entry)
        return pool + inbox.conversations(len(pool))

    def batch(self, key: str, storage: Storage) -> list[Conversation]:
        return batch_slice(self.conversations(storage), parse_batch_key(key), self.batch_size)

    def describe(self) -> str:
        return self.path + (f" + inbox {self.inbox}" if self.inbox else "")


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
