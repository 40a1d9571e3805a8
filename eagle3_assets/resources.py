"""Resources shared by the domains: where the servers, the data, the prompts and the warm-start
drafter are, and the generation recipe. Deployment knobs come from the environment
(`resources_from_env`); secrets only ever through EnvVar, so they never enter config or logs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import dagster as dg

from eagle3_assets.lib.core.hub_files import local_file
from eagle3_assets.lib.generation.conversations import (
    Conversation,
    batch_slice,
    load_conversations,
    parse_batch_key,
)
from eagle3_assets.lib.serving.vllm_launcher import API_KEY_ENV, VLLMLaunchSpec
from eagle3_assets.lib.serving.vllm_probe import Labels, Probe, fetch_metrics, probe, smoke_chat

if TYPE_CHECKING:  # imported where used: every multiprocess step re-imports this module
    from eagle3_assets.lib.core.target import TargetShape
    from eagle3_assets.lib.evaluation.evaluate import EvaluationSettings
    from eagle3_assets.lib.generation.chat_client import GenerationConfig
    from eagle3_assets.lib.hidden_states.extract import ExtractionSettings

T = TypeVar("T")
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
        from eagle3_assets.lib.core.target import TargetShape

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
        from eagle3_assets.lib.hidden_states.extract import ExtractionSettings
        from eagle3_assets.lib.hidden_states.shard_format import ShardFormat

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
        from eagle3_assets.lib.generation.chat_client import GenerationConfig

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
    """How the drafter is finetuned (lib/training/train_drafter.RunConfig); defaults for continued
    training from a warm start (use lr ~1e-4 from scratch)."""

    steps: int = 1000
    batch_size: int = 4  # samples per rank per step
    lr: float = 2e-5
    ttt_length: int = 7
    warmup_ratio: float = 0.015
    checkpoint_every: int = 100
    nproc: int = 1  # torchrun ranks per node: GPUs on a GPU node
    nnodes: int = 1  # nodes; the one Dagster launches is node 0, the others join it
    rdzv_endpoint: str | None = None  # "host:port" on node 0, reachable from every node
    seed: int = 0
    holdout_fraction: float = 0.02  # samples never trained on: drafter_evaluation's offline view

    def run_settings(self) -> dict:
        return {
            "steps": self.steps,
            "batch_size": self.batch_size,
            "lr": self.lr,
            "ttt_length": self.ttt_length,
            "warmup_ratio": self.warmup_ratio,
            "checkpoint_every": self.checkpoint_every,
            "seed": self.seed,
            "holdout_fraction": self.holdout_fraction,
        }


class TrainingLauncher(dg.ConfigurableResource):
    """Where the torchrun command runs: a subprocess of the Dagster step (`subprocess`), or a
    Kubernetes pod through dagster-k8s's PipesK8sClient (`k8s`, the `k8s` extra), with the
    node's GPUs in its limits. The command is the same either way; only the launcher differs.
    """

    kind: str = "subprocess"  # subprocess | k8s
    image: str | None = None  # k8s: the project's image with CUDA torch (same interpreter path)
    namespace: str | None = None  # k8s: else the current namespace
    data_claim: str | None = None  # k8s: the PersistentVolumeClaim holding the data root
    secret_name: str | None = None  # k8s: a Secret exposed to the pod as environment variables
    shm_gi: int = 64  # k8s: /dev/shm size
    subdomain: str | None = None  # k8s, several nodes: headless Service that names node 0

    def k8s_run_args(self, command: list[str], gpus: int, data_root: str, working_dir: str) -> dict:
        """The arguments PipesK8sClient.run gets besides the context: offline, so testable."""
        from eagle3_assets.lib.training.k8s_pod import TRAINING_LABELS, training_pod_spec

        if not (self.image and self.data_claim):
            raise ValueError("the k8s training launcher needs an image and a data volume claim")
        spec = training_pod_spec(
            image=self.image,
            gpus=gpus,
            data_root=data_root,
            data_claim=self.data_claim,
            working_dir=working_dir,
            secret_name=self.secret_name,
            shm_gi=self.shm_gi,
            subdomain=self.subdomain,
        )
        return {
            "command": command,
            "namespace": self.namespace,
            "base_pod_meta": {"labels": TRAINING_LABELS},
            "base_pod_spec": spec,
        }

    def run(
        self,
        context: dg.AssetExecutionContext,
        command: list[str],
        gpus: int,
        data_root: str,
    ) -> dg.PipesClientCompletedInvocation:
        if self.kind == "subprocess":
            return dg.PipesSubprocessClient().run(command=command, context=context)
        if self.kind == "k8s":
            from dagster_k8s import PipesK8sClient

            args = self.k8s_run_args(command, gpus, data_root, str(Path.cwd()))
            return PipesK8sClient().run(context=context, **args)
        raise ValueError(f"training launcher: expected subprocess or k8s, found {self.kind!r}")


class EvaluationRecipe(dg.ConfigurableResource):
    """How drafters are measured in vLLM: the prompt sets, the decoding, and the servers the
    evaluation starts for itself (one at a time, on `port`, from the target's folder)."""

    heldout_prompts: str  # conversations never batched for training (JSONL/Parquet or hf://)
    prompt_sets: dict[str, str] = {}  # more sets by name, e.g. {"mt-bench": "mt_bench.jsonl"}
    max_prompts: int = 200  # per set
    max_tokens: int = 256
    concurrency: int = 16
    num_speculative_tokens: int = 3
    min_acceptance_rate: float = 0.05  # blocking check: below it is "near zero"
    serving_python: str = ".venv-vllm/bin/python"
    port: int = 8020
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    cpu_kvcache_gib: int | None = None  # CPU builds only
    vllm_args: list[str] = []  # e.g. ["--enforce-eager"]
    load_timeout_s: float = 1800.0
    cache_dir: str | None = None  # hub cache for hf:// prompt sets
    token: str | None = None

    def conversations(self) -> dict[str, list[list[dict]]]:
        """Each set's first `max_prompts` conversations (messages only), held-out set first."""
        sets = {"held-out": self.heldout_prompts, **self.prompt_sets}
        loaded = {
            name: load_conversations(local_file(path, self.cache_dir, self.token))
            for name, path in sets.items()
        }
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

    def settings(self) -> EvaluationSettings:
        from eagle3_assets.lib.evaluation.evaluate import EvaluationSettings

        return EvaluationSettings(
            max_tokens=self.max_tokens,
            concurrency=self.concurrency,
            num_speculative_tokens=self.num_speculative_tokens,
            load_timeout_s=self.load_timeout_s,
        )


class DrafterHub(dg.ConfigurableResource):
    """Where the warm-start drafter is published (a Hugging Face repo at a pinned revision)."""

    repo_id: str
    revision: str = "main"
    token: str | None = None
    cache_dir: str | None = None  # None: the client's own cache (HF_HUB_CACHE / HF_HOME)


def _secret(name: str) -> dg.EnvVar | None:
    return dg.EnvVar(name) if name in os.environ else None


def _optional(kind: Callable[[str], T], variable: str, env: dict[str, str]) -> T | None:
    """A variable's value as `kind`; None when unset or empty (the setting's "not given")."""
    return kind(env[variable]) if env.get(variable) else None


def _named_paths(variable: str, env: dict[str, str]) -> dict[str, str]:
    """`name=path,name=path` from one variable, with the offending item named if malformed."""
    named = {}
    for item in filter(None, (i.strip() for i in env.get(variable, "").split(","))):
        name, equals, path = item.partition("=")
        if not (name and equals and path):
            raise ValueError(f"{variable}: expected name=path items, found {item!r}")
        named[name] = path
    return named


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
            cap_gb=_optional(float, "EAGLE3_HIDDEN_CAP_GB", env),
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
            nnodes=int(env.get("EAGLE3_TRAIN_NNODES", "1")),
            rdzv_endpoint=env.get("EAGLE3_TRAIN_RDZV_ENDPOINT"),
            holdout_fraction=float(env.get("EAGLE3_HOLDOUT_FRACTION", "0.02")),
        ),
        "evaluation": EvaluationRecipe(
            heldout_prompts=env.get("EAGLE3_HELDOUT_PROMPTS", f"{world}/prompts-heldout.jsonl"),
            prompt_sets=_named_paths("EAGLE3_EVAL_PROMPT_SETS", env),
            max_prompts=int(env.get("EAGLE3_EVAL_MAX_PROMPTS", "200")),
            max_tokens=int(env.get("EAGLE3_EVAL_MAX_TOKENS", "256")),
            concurrency=int(env.get("EAGLE3_EVAL_CONCURRENCY", "16")),
            num_speculative_tokens=int(env.get("EAGLE3_SPECULATIVE_TOKENS", "3")),
            min_acceptance_rate=float(env.get("EAGLE3_MIN_ACCEPTANCE_RATE", "0.05")),
            serving_python=env.get("EAGLE3_SERVING_PYTHON", ".venv-vllm/bin/python"),
            port=int(env.get("EAGLE3_EVAL_PORT", "8020")),
            tensor_parallel_size=int(env.get("EAGLE3_EVAL_TP", "1")),
            max_model_len=_optional(int, "EAGLE3_EVAL_MAX_MODEL_LEN", env),
            cpu_kvcache_gib=_optional(int, "EAGLE3_EVAL_CPU_KVCACHE_GIB", env),
            vllm_args=env.get("EAGLE3_EVAL_VLLM_ARGS", "").split(),
            cache_dir=env.get("EAGLE3_HF_CACHE"),
            token=_secret(HF_TOKEN_ENV),
        ),
        "training_launcher": TrainingLauncher(
            kind=env.get("EAGLE3_TRAINING_LAUNCHER", "subprocess"),
            image=env.get("EAGLE3_K8S_IMAGE"),
            namespace=env.get("EAGLE3_K8S_NAMESPACE"),
            data_claim=env.get("EAGLE3_K8S_DATA_CLAIM"),
            secret_name=env.get("EAGLE3_K8S_SECRET"),
            shm_gi=int(env.get("EAGLE3_K8S_SHM_GI", "64")),
            subdomain=env.get("EAGLE3_K8S_SUBDOMAIN"),
        ),
        "drafter_hub": DrafterHub(
            repo_id=env.get("EAGLE3_DRAFTER_REPO", "local/target-v1-eagle3"),
            revision=env.get("EAGLE3_DRAFTER_REVISION", "main"),
            token=_secret(HF_TOKEN_ENV),
            cache_dir=env.get("EAGLE3_HF_CACHE"),
        ),
    }
