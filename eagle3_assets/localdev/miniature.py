"""The settings that point the pipeline and its vLLM servers at a miniature world: used by the
demo, the tests and the benchmarks alike."""

import json
import os
from pathlib import Path

from eagle3_assets.lib.core.target import TargetShape, target_config
from eagle3_assets.lib.serving.vllm_launcher import VLLMLaunchSpec
from eagle3_assets.localdev.hub import LOCAL_DRAFTER_REPO, published_aux_layers
from eagle3_assets.localdev.world import World

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SERVED_TARGET_NAME = "target-v2"


def cpu_attention_args(model_dir: Path) -> tuple[str, ...]:
    """vLLM's CPU build serves an MLA target with AMX_MLA where the CPU has AMX tiles, and that
    backend takes only bf16/int8/fp8 weights ("expect weight to be bfloat16..."): a float32
    miniature asks for the reference CPU_MLA backend, the one every other CPU gets."""
    return ("--attention-backend", "CPU_MLA") if "kv_lora_rank" in target_config(model_dir) else ()


def miniature_server(
    model_dir: Path,
    run_dir: Path,
    port: int,
    served_model_name: str,
    trust_remote_code: bool = False,
) -> VLLMLaunchSpec:
    """The vLLM settings that suit the CPU build and a tiny target (a Kimi world's tokenizer
    needs `trust_remote_code`, as Kimi's does)."""
    return VLLMLaunchSpec(
        model=str(model_dir),
        python=Path(
            os.environ.get("EAGLE3_SERVING_PYTHON", PROJECT_ROOT / ".venv-vllm/bin/python")
        ),
        run_dir=run_dir,
        port=port,
        served_model_name=served_model_name,
        max_model_len=1024,
        enforce_eager=True,  # skips torch.compile: a minute less on 2 cores
        cpu_kvcache_gib=1,
        trust_remote_code=trust_remote_code,
        extra_args=cpu_attention_args(model_dir),
    )


def miniature_env(
    world: World, hub_cache: Path, base_url: str, data_root: Path, served_model_name: str
) -> dict[str, str]:
    """The EAGLE3_* settings (see resources_from_env) that point the pipeline at a world,
    including what its tokenizer and chat template ask of a user (Kimi: remote code, instant
    mode)."""
    spec = world.spec
    layers = TargetShape.from_config(world.target_v2).num_hidden_layers
    user_settings = {}
    if attention := cpu_attention_args(world.target_v2):  # the vllm extraction backend's server
        user_settings["EAGLE3_EXTRACT_VLLM_ARGS"] = " ".join(attention)
    if spec.trust_remote_code:
        user_settings["EAGLE3_TRUST_REMOTE_CODE"] = "1"
    if spec.chat_template_kwargs is not None:
        user_settings["EAGLE3_CHAT_TEMPLATE_KWARGS"] = json.dumps(spec.chat_template_kwargs)
    return user_settings | {
        "EAGLE3_VLLM_URLS": base_url,
        "EAGLE3_TARGET_MODEL": served_model_name,
        "EAGLE3_TARGET_PATH": str(world.target_v2),
        "EAGLE3_PROMPTS": str(world.prompts),
        "EAGLE3_DATA_ROOT": str(data_root),
        "EAGLE3_DRAFTER_REPO": LOCAL_DRAFTER_REPO,
        # the layers the world's drafter was trained on, as a user who knows its history sets
        # them: trained briefly, it is too far from rest on unseen answers for the layer
        # probe to tell the two readings of its nested ids apart reliably
        "EAGLE3_AUX_LAYER_IDS": ",".join(map(str, published_aux_layers(layers))),
        "EAGLE3_HF_CACHE": str(hub_cache),
        "HF_HUB_OFFLINE": "1",  # the miniature world never reaches a hub
        "EAGLE3_BATCH_SIZE": "16",
        "EAGLE3_MAX_TOKENS": "96",
        "EAGLE3_CONCURRENCY": "16",
        "EAGLE3_HELDOUT_PROMPTS": str(world.heldout_prompts),
        # drafter_evaluation's servers: miniature_server's settings, on their own port
        "EAGLE3_EVAL_VLLM_ARGS": " ".join(
            ("--enforce-eager", *cpu_attention_args(world.target_v2))
        ),
        "EAGLE3_EVAL_MAX_MODEL_LEN": "1024",
        "EAGLE3_EVAL_CPU_KVCACHE_GIB": "1",
        "EAGLE3_EVAL_MAX_TOKENS": "96",
    }
