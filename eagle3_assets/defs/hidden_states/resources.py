"""How every batch's hidden states are extracted and stored."""

import dagster as dg

from eagle3_assets.env_settings import EnvSettings
from eagle3_assets.lib.hidden_states.settings import HiddenStatesSettings


class HiddenStatesRecipe(dg.ConfigurableResource, HiddenStatesSettings, EnvSettings):
    """lib/hidden_states/settings.py, as a resource: one setting for all batches."""

    env = {
        "mode": "EAGLE3_HIDDEN_STATES_MODE",
        "stream_window_mb": "EAGLE3_STREAM_WINDOW_MB",
        "backend": "EAGLE3_HIDDEN_BACKEND",
        "format": "EAGLE3_HIDDEN_FORMAT",
        "max_length": "EAGLE3_MAX_LENGTH",
        "shard_mb": "EAGLE3_SHARD_MB",
        "dtype": "EAGLE3_EXTRACT_DTYPE",
        "device": "EAGLE3_EXTRACT_DEVICE",
        "cap_gb": "EAGLE3_HIDDEN_CAP_GB",
        "serving_python": "EAGLE3_SERVING_PYTHON",
        "vllm_tensor_parallel_size": "EAGLE3_EXTRACT_TP",
        "vllm_args": "EAGLE3_EXTRACT_VLLM_ARGS",
    }
