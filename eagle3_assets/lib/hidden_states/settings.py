"""How every batch's hidden states are extracted, and whether they are stored or streamed
(docs/hidden-states-format.md): one setting for all batches, since training reads them
together."""

import re
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field, field_validator

if TYPE_CHECKING:  # torch: imported where used
    from eagle3_assets.lib.hidden_states.extract import ExtractionSettings

WIDTH = {"bf16": 2, "fp8": 1}  # bytes per stored value
FINAL = re.compile(r"^(bf16|fp8|top(\d+))$")


def check_format(aux: str, final: str) -> None:
    """The shard format's grammar, stated once: `aux` bf16 | fp8, `final` bf16 | fp8 | top<k>."""
    if aux not in WIDTH:
        raise ValueError(f"aux: expected bf16 or fp8, found {aux!r}")
    match = FINAL.match(final)
    if not match or (match.group(2) is not None and int(match.group(2)) < 1):
        raise ValueError(f"final: expected bf16, fp8 or top<k> (k >= 1), found {final!r}")


def split_format(name: str) -> tuple[str, str]:
    aux, plus, final = name.partition("+")
    if not plus:
        raise ValueError(f"hidden-states format: expected '<aux>+<final>', found {name!r}")
    check_format(aux, final)
    return aux, final


class HiddenStatesSettings(BaseModel):
    # stored: shards per batch, reusable across trainings; streamed: extracted while training,
    # each epoch anew, at most stream_window_mb on disk (lib/hidden_states/streaming.py)
    mode: Literal["stored", "streamed"] = "stored"
    stream_window_mb: float = Field(1024.0, gt=0)
    backend: Literal["hf", "vllm"] = "hf"  # hf: transformers + hooks; vllm: extract_hidden_states
    format: str = "fp8+fp8"  # <aux>+<final>: aux bf16|fp8, final bf16|fp8|top<k>
    max_length: int = Field(4096, ge=2)  # tokens per sequence; longer ones are cut
    shard_mb: float = Field(1024.0, gt=0)
    batch_tokens: int = Field(16384, ge=1)  # hf: tokens per forward, padding included
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    device: str = "auto"  # hf: auto (EAGLE3_PLATFORM's) | cpu | cuda[:i]
    cap_gb: float | None = Field(None, gt=0)  # on everything under <data>/hidden_states
    min_loss_fraction: float = Field(0.05, ge=0, le=1)  # blocking check: response share
    max_loss_fraction: float = Field(0.995, ge=0, le=1)
    serving_python: str = ".venv-vllm/bin/python"  # vllm: the serving venv's interpreter
    vllm_port: int = Field(8010, ge=1, le=65535)
    vllm_tensor_parallel_size: int = Field(1, ge=1)
    vllm_args: list[str] = []  # e.g. ["--enforce-eager"]
    vllm_load_timeout_s: float = Field(1800.0, gt=0)

    @property
    def window_bytes(self) -> int:
        return int(self.stream_window_mb * 2**20)

    def extraction(self) -> "ExtractionSettings":
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
            shard_bytes=int(self.shard_mb * 2**20),
            batch_tokens=self.batch_tokens,
            cap_bytes=int(self.cap_gb * 1e9) if self.cap_gb is not None else None,
            max_length=self.max_length,
        )

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        split_format(value)
        return value


DEFAULTS = HiddenStatesSettings()
