"""Where the warm-start drafter is published, and which layers it reads when its config
cannot say."""

import dagster as dg
from pydantic import Field

from eagle3_assets.env_settings import EnvSettings, comma_list
from eagle3_assets.lib.core.hub_files import HF_TOKEN_ENV


def int_list(value: str) -> list[int]:
    """`3,31,59`."""
    try:
        return [int(item) for item in comma_list(value)]
    except ValueError:
        raise ValueError("expected comma-separated integers") from None


class DrafterHub(dg.ConfigurableResource, EnvSettings):
    """A Hugging Face repo at a pinned revision. `aux_layer_ids` (vLLM ids) says which target
    layers the drafter was trained on; unset, ids nested in its config that can be read two
    ways are decided by the layer probe (lib/checkpoint/layer_probe.py): the served target
    answers `probe_prompts` held-out prompts (at most `probe_max_tokens` tokens each)."""

    repo_id: str = "local/target-v1-eagle3"
    revision: str = "main"
    token: str | None = None
    cache_dir: str | None = None  # None: the client's own cache (HF_HUB_CACHE / HF_HOME)
    aux_layer_ids: list[int] | None = None
    probe_prompts: int = Field(16, ge=1)
    probe_max_tokens: int = Field(256, ge=1)

    env = {
        "repo_id": "EAGLE3_DRAFTER_REPO",
        "revision": "EAGLE3_DRAFTER_REVISION",
        "cache_dir": "EAGLE3_HF_CACHE",
        "aux_layer_ids": ("EAGLE3_AUX_LAYER_IDS", int_list),
    }
    secrets = {"token": HF_TOKEN_ENV}
