"""How every batch's hidden states are extracted and stored."""

from typing import TYPE_CHECKING

import dagster as dg

from eagle3_assets.env_settings import EnvSettings
from eagle3_assets.lib.hidden_states.settings import HiddenStatesSettings

if TYPE_CHECKING:  # torch: imported where used
    from eagle3_assets.lib.hidden_states.extract import ExtractionSettings


class HiddenStatesRecipe(dg.ConfigurableResource, HiddenStatesSettings, EnvSettings):
    """lib/hidden_states/settings.py, as a resource: one setting for all batches."""

    env = {
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

    def settings(self) -> "ExtractionSettings":
        """What extraction needs, checked against the backend before any forward."""
        from eagle3_assets.lib.hidden_states.extract import ExtractionSettings
        from eagle3_assets.lib.hidden_states.shard_format import ShardFormat

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
