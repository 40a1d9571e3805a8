"""The extraction backend and layers of a batch, from plain settings: what the hidden_states
asset would otherwise assemble itself (launch specs, config parsing)."""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3_assets.lib.core.layer_ids import aux_layer_ids
from eagle3_assets.lib.hidden_states.extract import LayerSelection

if TYPE_CHECKING:
    from eagle3_assets.lib.hidden_states.extract import StateSource

BACKENDS = ("hf", "vllm")


@dataclass(frozen=True)
class VLLMExtraction:
    """Where and how the `vllm` backend starts its own extraction server."""

    python: Path  # the serving venv's interpreter
    run_dir: Path
    port: int
    max_model_len: int
    load_timeout_s: float
    tensor_parallel_size: int = 1
    extra_args: tuple[str, ...] = ()


def drafter_layers(drafter_dir: Path, num_layers: int) -> LayerSelection:
    """The warm-start drafter's aux ids (either convention, as its config declares them), then
    the final id N: the states a batch must hold for that drafter."""
    config = drafter_dir / "config.json"
    if not config.exists():
        raise FileNotFoundError(f"no {config}: materialize drafter_checkpoint first")
    ids = aux_layer_ids(json.loads(config.read_text()), num_layers)
    return LayerSelection(aux=ids.fc_order, final=num_layers, source=str(ids.source))


def open_backend(
    backend: str,
    target: str,
    layer_ids: tuple[int, ...],
    hidden_size: int,
    dtype: str,
    device: str,
    trust_remote_code: bool,
    vllm: VLLMExtraction,
) -> AbstractContextManager[StateSource]:
    """The backend as a context manager (a server it starts is stopped on exit); loading it
    takes minutes for a big target, so extract_batch calls this only when a shard is missing.
    `vllm` is used by the vllm backend only; `device` cpu picks vLLM's CPU-build connector."""
    from eagle3_assets.lib.hidden_states.hf_backend import HFTarget, resolve_device

    if backend == "hf":
        return HFTarget(Path(target), layer_ids, dtype, device, trust_remote_code)
    if backend != "vllm":
        raise ValueError(f"backend: expected one of {BACKENDS}, found {backend!r}")
    from eagle3_assets.lib.hidden_states.vllm_backend import extraction_server
    from eagle3_assets.lib.serving.vllm_launcher import VLLMLaunchSpec

    cpu = resolve_device(device) == "cpu"
    serving = VLLMLaunchSpec(
        model=target,
        python=vllm.python,
        run_dir=vllm.run_dir,
        port=vllm.port,
        tensor_parallel_size=vllm.tensor_parallel_size,
        max_model_len=vllm.max_model_len,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        cpu_kvcache_gib=1 if cpu else None,
        extra_args=vllm.extra_args,
    )
    return extraction_server(serving, layer_ids, hidden_size, cpu, vllm.load_timeout_s)
