"""How the drafter is trained, and on how many ranks: one typed recipe, each default once.

Defaults are for continued training from a warm start (use lr ~1e-4 from scratch).
"""

from typing import Literal

from pydantic import BaseModel, Field


class TrainingSettings(BaseModel):
    steps: int = Field(1000, ge=1)
    batch_size: int = Field(4, ge=1)  # samples per rank per step, at most
    # padded tokens (samples x longest sample) per rank per step, at most: memory is bounded
    # by tokens, not samples (lib/training/memory.py); None: batch_size alone
    tokens_per_rank: int | None = Field(None, ge=1)
    # backward recomputes each TTT step from its input: less memory, ~1/3 more compute
    activation_checkpointing: bool = False
    # the exported drafter's weights: vLLM casts them to the target's dtype when it loads them,
    # so float32 doubles the file (4.8 GB at Kimi's width) for nothing a bf16 target serves
    export_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    lr: float = Field(2e-5, gt=0)
    ttt_length: int = Field(7, ge=1)
    warmup_ratio: float = Field(0.015, ge=0, lt=1)
    checkpoint_every: int = Field(100, ge=1)
    seed: int = 0
    holdout_fraction: float = Field(0.02, ge=0, lt=1)  # samples never trained on, by id
    # after a promotion: the share of the promoted drafter's batches trained on again, by id,
    # beside every new batch (against forgetting)
    replay_share: float = Field(0.5, ge=0, le=1)
    nproc: int = Field(1, ge=1)  # torchrun ranks per node: GPUs on a GPU node
    nnodes: int = Field(1, ge=1)  # the node Dagster launches is node 0, the others join it
    rdzv_endpoint: str | None = None  # "host:port" on node 0, reachable from every node

    def run_settings(self) -> dict:
        """The fields a training run's RunConfig takes (the ranks are torchrun's business)."""
        return self.model_dump(exclude={"nproc", "nnodes", "rdzv_endpoint", "replay_share"})


DEFAULTS = TrainingSettings()
