"""How drafters are measured in vLLM."""

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import Field

from eagle3_assets.env_settings import EnvSettings, named_paths
from eagle3_assets.lib.core.hub_files import HF_TOKEN_ENV, local_file
from eagle3_assets.lib.evaluation.settings import Decoding, EvaluationSettings
from eagle3_assets.lib.generation.conversations import Conversation, load_conversations
from eagle3_assets.lib.serving.vllm_launcher import VLLMLaunchSpec
from eagle3_assets.resources import TargetModel


class EvaluationRecipe(dg.ConfigurableResource, Decoding, EnvSettings):
    """The prompt sets, the decoding (lib/evaluation/settings.py), and the servers the
    evaluation starts for itself (one at a time, on `port`, from the target's folder)."""

    # conversations never batched for training (JSONL/Parquet or hf://)
    heldout_prompts: str = "data/world/demo/prompts-heldout.jsonl"
    prompt_sets: dict[str, str] = {}  # more sets by name, e.g. {"mt-bench": "mt_bench.jsonl"}
    max_prompts: int = Field(200, ge=1)  # per set
    min_acceptance_rate: float = Field(0.05, ge=0, le=1)  # blocking check: below is "near zero"
    # promoted_drafter: a candidate must beat the promoted drafter by this much on every set
    promotion_margin: float = Field(0.02, ge=0)
    serving_python: str = ".venv-vllm/bin/python"
    port: int = Field(8020, ge=1, le=65535)
    tensor_parallel_size: int = Field(1, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    cpu_kvcache_gib: int | None = Field(None, ge=1)  # CPU builds only
    vllm_args: list[str] = []  # e.g. ["--enforce-eager"]
    cache_dir: str | None = None  # hub cache for hf:// prompt sets
    token: str | None = None

    env = {
        "heldout_prompts": "EAGLE3_HELDOUT_PROMPTS",
        "prompt_sets": ("EAGLE3_EVAL_PROMPT_SETS", named_paths),
        "max_prompts": "EAGLE3_EVAL_MAX_PROMPTS",
        "max_tokens": "EAGLE3_EVAL_MAX_TOKENS",
        "concurrency": "EAGLE3_EVAL_CONCURRENCY",
        "num_speculative_tokens": "EAGLE3_SPECULATIVE_TOKENS",
        "min_acceptance_rate": "EAGLE3_MIN_ACCEPTANCE_RATE",
        "promotion_margin": "EAGLE3_PROMOTION_MARGIN",
        "serving_python": "EAGLE3_SERVING_PYTHON",
        "port": "EAGLE3_EVAL_PORT",
        "tensor_parallel_size": "EAGLE3_EVAL_TP",
        "max_model_len": "EAGLE3_EVAL_MAX_MODEL_LEN",
        "cpu_kvcache_gib": "EAGLE3_EVAL_CPU_KVCACHE_GIB",
        "vllm_args": "EAGLE3_EVAL_VLLM_ARGS",
        "cache_dir": "EAGLE3_HF_CACHE",
    }
    secrets = {"token": HF_TOKEN_ENV}

    def conversations(
        self, more: Mapping[str, list[Conversation]] | None = None
    ) -> dict[str, list[list[dict]]]:
        """Each set's first `max_prompts` conversations (messages only), held-out set first,
        then `more` (the inbox's held-out slices)."""
        sets = {"held-out": self.heldout_prompts, **self.prompt_sets}
        loaded = {
            name: load_conversations(local_file(path, self.cache_dir, self.token))
            for name, path in sets.items()
        } | dict(more or {})
        return {
            name: [c.messages for c in rows[: self.max_prompts]] for name, rows in loaded.items()
        }

    def launch_spec(
        self, target: TargetModel, run_dir: Path, served_model_name: str
    ) -> VLLMLaunchSpec:
        """The plain server every contender starts from (lib.evaluation adds the drafter)."""
        return VLLMLaunchSpec(
            model=target.path,
            python=Path(self.serving_python),
            run_dir=run_dir,
            port=self.port,
            served_model_name=served_model_name,
            tensor_parallel_size=self.tensor_parallel_size,
            max_model_len=self.max_model_len,
            trust_remote_code=target.trust_remote_code,
            engine_ready_timeout_s=int(self.load_timeout_s),
            cpu_kvcache_gib=self.cpu_kvcache_gib,
            extra_args=tuple(self.vllm_args),
        )

    def settings(self, chat_template_kwargs: dict[str, Any] | None) -> EvaluationSettings:
        """The decoding, with the generation recipe's template kwargs."""
        decoding = self.model_dump(include=set(Decoding.model_fields))
        return EvaluationSettings(**decoding, chat_template_kwargs=chat_template_kwargs)
