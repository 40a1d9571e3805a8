"""The extraction backend and layers of a batch, from plain settings: what the hidden_states
asset would otherwise assemble itself (launch specs, config parsing)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3_assets.lib.core.platform import Platform, require
from eagle3_assets.lib.hidden_states.extract import LayerSelection
from eagle3_assets.lib.hidden_states.settings import HiddenStatesSettings

if TYPE_CHECKING:
    from eagle3_assets.lib.hidden_states.extract import StateSource
    from eagle3_assets.lib.serving.vllm_launcher import VLLMLaunchSpec


def drafter_layers(drafter_dir: Path, num_layers: int) -> LayerSelection:
    """The warm-start drafter's aux ids (either layout and convention, read and checked by the
    one drafter reader), then the final id N: the states a batch must hold for that drafter."""
    from eagle3_assets.lib.checkpoint.drafter_io import drafter_aux_layer_ids

    if not (drafter_dir / "config.json").exists():
        raise FileNotFoundError(
            f"no {drafter_dir / 'config.json'}: materialize drafter_checkpoint first"
        )
    ids = drafter_aux_layer_ids(drafter_dir, num_layers)
    return LayerSelection(aux=ids.fc_order, final=num_layers, source=str(ids.source))


def extraction_spec(
    settings: HiddenStatesSettings,
    platform: Platform,
    target: str,
    trust_remote_code: bool,
    server_dir: Path,
) -> VLLMLaunchSpec:
    """The vllm backend's server: the target at the extraction's dtype and length, its code
    trusted exactly when the user trusts it."""
    from eagle3_assets.lib.serving.vllm_launcher import VLLMLaunchSpec

    return VLLMLaunchSpec(
        model=target,
        python=Path(settings.serving_python),
        run_dir=server_dir,
        port=settings.vllm_port,
        tensor_parallel_size=settings.vllm_tensor_parallel_size,
        max_model_len=settings.max_length + 1,
        dtype=settings.dtype,
        trust_remote_code=trust_remote_code,
        cpu_kvcache_gib=1 if platform == "cpu" else None,
        extra_args=tuple(settings.vllm_args),
    )


def open_backend(
    settings: HiddenStatesSettings,
    platform: Platform,
    target: str,
    trust_remote_code: bool,
    layer_ids: tuple[int, ...],
    hidden_size: int,
    server_dir: Path,
    log: Callable[[str], None] = print,
) -> AbstractContextManager[StateSource]:
    """The configured backend as a context manager (a server it starts, from `server_dir`, is
    stopped on exit; one a killed attempt left there is reused or replaced, said to `log`);
    loading it takes minutes for a big target, so extract_batch calls this only when a shard
    is missing. On cuda the interpreter that extracts (this one for hf, the serving venv's for
    vllm) must see the GPUs first; on the CPU the vllm backend uses the CPU-build connector."""
    from eagle3_assets.lib.hidden_states.hf_backend import HFTarget, resolve_device

    if settings.backend == "hf":
        device = resolve_device(settings.device, platform)
        if device.startswith("cuda"):
            require("cuda", sys.executable, 1, "extraction (hf)")
        return HFTarget(Path(target), layer_ids, settings.dtype, device, trust_remote_code)
    from eagle3_assets.lib.hidden_states.vllm_backend import extraction_server

    devices = settings.vllm_tensor_parallel_size
    require(platform, settings.serving_python, devices, "extraction (vllm)")
    serving = extraction_spec(settings, platform, target, trust_remote_code, server_dir)
    return extraction_server(
        serving, layer_ids, hidden_size, platform == "cpu", settings.vllm_load_timeout_s, log=log
    )
