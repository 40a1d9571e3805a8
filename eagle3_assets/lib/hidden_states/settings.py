"""How every batch's hidden states are extracted and stored (docs/hidden-states-format.md): one
setting for all batches, since training reads them together."""

import re
from typing import Literal

from pydantic import BaseModel, Field, field_validator

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
    backend: Literal["hf", "vllm"] = "hf"  # hf: transformers + hooks; vllm: extract_hidden_states
    format: str = "fp8+fp8"  # <aux>+<final>: aux bf16|fp8, final bf16|fp8|top<k>
    max_length: int = Field(4096, ge=2)  # tokens per sequence; longer ones are cut
    shard_mb: int = Field(1024, ge=1)
    batch_tokens: int = Field(16384, ge=1)  # hf: tokens per forward, padding included
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    device: str = "auto"  # hf: auto | cpu | cuda[:i]; vllm: cpu picks the CPU-build connector
    cap_gb: float | None = Field(None, gt=0)  # on everything under <data>/hidden_states
    min_loss_fraction: float = Field(0.05, ge=0, le=1)  # blocking check: response share
    max_loss_fraction: float = Field(0.995, ge=0, le=1)
    serving_python: str = ".venv-vllm/bin/python"  # vllm: the serving venv's interpreter
    vllm_port: int = Field(8010, ge=1, le=65535)
    vllm_tensor_parallel_size: int = Field(1, ge=1)
    vllm_args: list[str] = []  # e.g. ["--enforce-eager"]
    vllm_load_timeout_s: float = Field(1800.0, gt=0)

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        split_format(value)
        return value


DEFAULTS = HiddenStatesSettings()
