"""Where the warm-start drafter is published."""

import dagster as dg

from eagle3_assets.env_settings import EnvSettings
from eagle3_assets.lib.core.hub_files import HF_TOKEN_ENV


class DrafterHub(dg.ConfigurableResource, EnvSettings):
    """A Hugging Face repo at a pinned revision."""

    repo_id: str = "local/target-v1-eagle3"
    revision: str = "main"
    token: str | None = None
    cache_dir: str | None = None  # None: the client's own cache (HF_HUB_CACHE / HF_HOME)

    env = {
        "repo_id": "EAGLE3_DRAFTER_REPO",
        "revision": "EAGLE3_DRAFTER_REVISION",
        "cache_dir": "EAGLE3_HF_CACHE",
    }
    secrets = {"token": HF_TOKEN_ENV}
