"""Resources shared by the domains: where the servers, the data, the prompts and the warm-start
drafter are, and the generation recipe. Deployment knobs come from the environment
(`resources_from_env`); secrets only ever through EnvVar, so they never enter config or logs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg

from eagle3_assets.lib.conversations import (
    Conversation,
    batch_slice,
    load_conversations,
    parse_batch_key,
)
from eagle3_assets.lib.hub_files import local_file
from eagle3_assets.lib.vllm_launcher import API_KEY_ENV
from eagle3_assets.lib.vllm_probe import Labels, Probe, fetch_metrics, probe, smoke_chat

if TYPE_CHECKING:  # imported where used: every multiprocess step re-imports this module
    from eagle3_assets.lib.drafter_checkpoint import TargetShape
    from eagle3_assets.lib.generation import GenerationConfig
    from eagle3_assets.lib.hidden_states import ExtractionSettings

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
HF_TOKEN_ENV = "HF_TOKEN"


class VLLMServer(dg.ConfigurableResource):
    """Attaches to running vLLM servers (one or several replicas); never starts one.

    Starting belongs to the launcher: a 22-minute load must not be tied to a Dagster run.
    """

    base_urls: list[str] = [DEFAULT_BASE_URL]
    served_model_name: str
    api_key: str | None = None
    probe_timeout_s: float = 2.0
    load_deadline_s: float = 1800.0

    def probe(self, base_url: str) -> Probe:
        return probe(base_url, timeout_s=self.probe_timeout_s, api_key=self.api_key)

    def metrics(self, base_url: str) -> dict[str, dict[Labels, float]]:
        return fetch_metrics(base_url, api_key=self.api_key)

    def smoke_chat(self, base_url: str, messages: list[dict[str, str]], max_tokens: int) -> dict:
        return smoke_chat(
            base_url, self.served_model_name, messages, max_tokens, api_key=self.api_key
        )


class TargetModel(dg.ConfigurableResource):
    """The served target's local folder (config.json, tokenizer, safetensors): the shape every
    drafter must fit, and the weights and template that hidden-state extraction uses."""

    path: str
    revision: str | None = None  # recorded in the hidden states' manifests
    trust_remote_code: bool = False  # Kimi's tokenizer needs it; only when the user says so

    def shape(self) -> TargetShape:
        from eagle3_assets.lib.drafter_checkpoint import TargetShape

        return TargetShape.from_config(Path(self.path))


class HiddenStatesRecipe(dg.ConfigurableResource):
    """How every batch's hidden states are extracted and stored (docs/hidden-states-format.md).
    One setting for all batches: training reads them together."""

    backend: str = "hf"  # hf: transformers + hooks; vllm: vLLM's extract_hidden_states
    format: str = "fp8+fp8"  # <aux>+<final>: aux bf16|fp8, final bf16|fp8|top<k>
    max_length: int = 4096
    shard_mb: int = 1024
    batch_tokens: int = 16384  # hf: tokens per forward, padding included
    dtype: str = "bfloat16"
    device: str = "auto"  # hf: auto | cpu | cuda; vllm: cpu picks the CPU-build connector
    cap_gb: float | None = None  # on everything under <data>/hidden_states
    min_loss_fraction: float = 0.05  # blocking check: share of response tokens in a batch
    max_loss_fraction: float = 0.995
    serving_python: str = ".venv-vllm/bin/python"  # vllm: the serving venv's interpreter
    vllm_port: int = 8010
    vllm_tensor_parallel_size: int = 1
    vllm_args: list[str] = []  # e.g. ["--enforce-eager"]
    vllm_load_timeout_s: float = 1800.0

    def settings(self) -> ExtractionSettings:
        """Validated, so a bad setting fails before any forward."""
        from eagle3_assets.lib.hidden_states import ExtractionSettings
        from eagle3_assets.lib.shard_format import ShardFormat

        if self.backend not in ("hf", "vllm"):
            raise ValueError(f"backend: expected hf or vllm, found {self.backend!r}")
        fmt = ShardFormat.parse(self.format)
        if self.backend == "vllm" and fmt.topk is not None:
            raise ValueError(
                f"format: {fmt.name} keeps top-k logits, which need the target's lm_head; the "
                "vllm backend returns states: use bf16/fp8 for the final state, or backend hf"
            )
        return ExtractionSettings(
            format=fmt,
            shard_bytes=self.shard_mb * 2**20,
            batch_tokens=self.batch_tokens,
            cap_bytes=int(self.cap_gb * 1e9) if self.cap_gb is not None else None,
            max_length=self.max_length,
        )


class Storage(dg.ConfigurableResource):
    """The data volume: checkpoints, generations and hidden states live under one root."""

    root: str = "data"

    def path(self, *parts: str) -> Path:
        return Path(self.root, *parts)


class PromptPool(dg.ConfigurableResource):
    """The conversations to regenerate, cut into fixed batches (batch k = items k*size...).

    `path`: a local JSONL/Parquet file, or `hf://datasets/<org>/<name>/<file>[@<revision>]`.
    """

    path: str
    batch_size: int = 1000
    cache_dir: str | None = None  # hub cache for hf:// paths
    token: str | None = None

    def conversations(self) -> list[Conversation]:
        return load_conversations(local_file(self.path, self.cache_dir, self.token))

    def batch(self, key: str) -> list[Conversation]:
        return batch_slice(self.conversations(), parse_batch_key(key), self.batch_size)


class GenerationRecipe(dg.ConfigurableResource):
    """How every batch is sampled. A deployment setting, not per-run config: all batches must
    share it, and hidden-state extraction re-renders conversations with the same template
    kwargs (e.g. Kimi's thinking flag)."""

    max_tokens: int = 2048
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    concurrency: int = 200
    chat_template_kwargs_json: str = "{}"
    return_token_ids: bool = True
    max_empty_rate: float = 0.01  # blocking check thresholds
    max_truncated_rate: float = 0.25

    def config(self) -> GenerationConfig:
        from eagle3_assets.lib.generation import GenerationConfig

        return GenerationConfig(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            chat_template_kwargs=json.loads(self.chat_template_kwargs_json) or None,
            return_token_ids=self.return_token_ids,
            concurrency=self.concurrency,
        )


class TrainingRecipe(dg.ConfigurableResource):
    """How the drafter is finetuned (lib/train_drafter.RunConfig); defaults for continued
    training from a warm start (use lr ~1e-4 from scratch)."""

    steps: int = 1000
    batch_size: int = 4  # samples per rank per step
    lr: float = 2e-5
    ttt_length: int = 7
    warmup_ratio: float = 0.015
    checkpoint_every: int = 100
    nproc: int = 1  # torchrun ranks: GPUs on a GPU node
    seed: int = 0

    def run_settings(self) -> dict:
        return {
            "steps": self.steps,
            "batch_size": self.batch_size,
            "lr": self.lr,
            "ttt_length": self.ttt_length,
            "warmup_ratio": self.warmup_ratio,
            "checkpoint_every": self.checkpoint_every,
            "seed": self.seed,
        }


class DrafterHub(dg.ConfigurableResource):
    """Where the warm-start drafter is published (a Hugging Face repo at a pinned revision)."""

    repo_id: str
    revision: str = "main"
    token: str | None = None
    cache_dir: str | None = None  # None: the client's own cache (HF_HUB_CACHE / HF_HOME)


def _secret(name: str) -> dg.EnvVar | None:
    return dg.EnvVar(name) if name in os.environ else None


def resources_from_env(env: dict[str, str] | None = None) -> dict[str, object]:
    """Every resource, configured from EAGLE3_* variables (defaults: the demo world)."""
    env = dict(os.environ if env is None else env)
    world = env.get("EAGLE3_WORLD", "data/world/demo")
    urls = env.get("EAGLE3_VLLM_URLS", DEFAULT_BASE_URL)
    return {
        "vllm": VLLMServer(
            base_urls=[url.strip() for url in urls.split(",") if url.strip()],
            served_model_name=env.get("EAGLE3_TARGET_MODEL", "target-v2"),
            api_key=_secret(API_KEY_ENV),
            load_deadline_s=float(env.get("EAGLE3_VLLM_LOAD_DEADLINE_S", "1800")),
        ),
        "target": TargetModel(
            path=env.get("EAGLE3_TARGET_PATH", f"{world}/target-v2"),
            revision=env.get("EAGLE3_TARGET_REVISION"),
            trust_remote_code=env.get("EAGLE3_TRUST_REMOTE_CODE", "") == "1",
        ),
        "storage": Storage(root=env.get("EAGLE3_DATA_ROOT", "data")),
        "prompt_pool": PromptPool(
            path=env.get("EAGLE3_PROMPTS", f"{world}/prompts.jsonl"),
            batch_size=int(env.get("EAGLE3_BATCH_SIZE", "1000")),
            cache_dir=env.get("EAGLE3_HF_CACHE"),
            token=_secret(HF_TOKEN_ENV),
        ),
        "generation": GenerationRecipe(
            max_tokens=int(env.get("EAGLE3_MAX_TOKENS", "2048")),
            temperature=float(env.get("EAGLE3_TEMPERATURE", "1.0")),
            concurrency=int(env.get("EAGLE3_CONCURRENCY", "200")),
            chat_template_kwargs_json=env.get("EAGLE3_CHAT_TEMPLATE_KWARGS", "{}"),
            max_truncated_rate=float(env.get("EAGLE3_MAX_TRUNCATED_RATE", "0.25")),
        ),
        "hidden": HiddenStatesRecipe(
            backend=env.get("EAGLE3_HIDDEN_BACKEND", "hf"),
            format=env.get("EAGLE3_HIDDEN_FORMAT", "fp8+fp8"),
            max_length=int(env.get("EAGLE3_MAX_LENGTH", "4096")),
            shard_mb=int(env.get("EAGLE3_SHARD_MB", "1024")),
            dtype=env.get("EAGLE3_EXTRACT_DTYPE", "bfloat16"),
            device=env.get("EAGLE3_EXTRACT_DEVICE", "auto"),
            cap_gb=float(env["EAGLE3_HIDDEN_CAP_GB"]) if env.get("EAGLE3_HIDDEN_CAP_GB") else None,
            serving_python=env.get("EAGLE3_SERVING_PYTHON", ".venv-vllm/bin/python"),
            vllm_tensor_parallel_size=int(env.get("EAGLE3_EXTRACT_TP", "1")),
            vllm_args=env.get("EAGLE3_EXTRACT_VLLM_ARGS", "").split(),
        ),
        "training": TrainingRecipe(
            steps=int(env.get("EAGLE3_TRAIN_STEPS", "1000")),
            batch_size=int(env.get("EAGLE3_TRAIN_BATCH_SIZE", "4")),
            lr=float(env.get("EAGLE3_TRAIN_LR", "2e-5")),
            ttt_length=int(env.get("EAGLE3_TTT_LENGTH", "7")),
            nproc=int(env.get("EAGLE3_TRAIN_NPROC", "1")),
        ),
        "pipes_subprocess_client": dg.PipesSubprocessClient(),
        "drafter_hub": DrafterHub(
            repo_id=env.get("EAGLE3_DRAFTER_REPO", "local/target-v1-eagle3"),
            revision=env.get("EAGLE3_DRAFTER_REVISION", "main"),
            token=_secret(HF_TOKEN_ENV),
            cache_dir=env.get("EAGLE3_HF_CACHE"),
        ),
    }
