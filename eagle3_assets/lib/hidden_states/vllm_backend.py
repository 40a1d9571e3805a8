"""The `vllm` extraction backend: the target's states from vLLM's own forward.

vLLM's `extract_hidden_states` speculative method captures the residual stream at the layer
ids it is given (vLLM convention; the final id N is the last layer's output before the norm,
including DeepSeek/Kimi since vLLM PR #46973) and its hidden-states connector writes one
safetensors file per request: `hidden_states` [T, n_ids, H] with the ids in ascending order,
and `token_ids` [T]. The path comes back in the response's `kv_transfer_params`. So the source
sends each sequence's exact ids as a `max_tokens=1` completion, checks the ids and the rows in
the file, reorders the columns to the manifest's order and deletes the raw file; the shard
writer does the rest, as for the `hf` backend. Prefix caching is off on the extraction server:
a cached prefix is not recomputed, so its states would be missing from the file (vLLM issue
44485), and every prompt shares the chat template's prefix.

The stock connector needs CUDA; on the CPU build the server loads
`vllm_plugins/cpu_hidden_states_connector.py` instead, so CI runs this path for real.
"""

from __future__ import annotations

import fcntl
import json
import os
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle3_assets.lib.hidden_states.token_sequences import TokenSequence
from eagle3_assets.lib.serving.vllm_launcher import VLLMLaunchSpec, start, stop, wait_ready

PLUGINS_DIR = Path(__file__).resolve().parents[2] / "vllm_plugins"  # eagle3_assets/vllm_plugins


def extraction_spec(
    serving: VLLMLaunchSpec, layer_ids: Sequence[int], out_dir: Path, cpu_build: bool
) -> VLLMLaunchSpec:
    """`serving`'s target and settings, turned into a server that writes hidden states."""
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": sorted(set(layer_ids))}
        },
    }
    connector = {
        "kv_connector": "CpuHiddenStatesConnector" if cpu_build else "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(out_dir)},
    }
    extra_env = dict(serving.extra_env)
    if cpu_build:
        connector["kv_connector_module_path"] = "cpu_hidden_states_connector"
        extra_env["PYTHONPATH"] = str(PLUGINS_DIR)
    return replace(
        serving,
        speculative_config=speculative,
        extra_args=(
            *serving.extra_args,
            "--no-enable-prefix-caching",
            "--kv-transfer-config",
            json.dumps(connector),
        ),
        extra_env=extra_env,
    )


def read_connector_file(path: Path, expected_ids: Sequence[int]) -> torch.Tensor:
    """The file's `hidden_states` once the connector's writer has released it, checked
    against the ids sent (one row per token); the file and its lock are removed after reading."""
    lock = Path(f"{path}.lock")
    with open(lock, "a+b") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_SH)  # the writer holds LOCK_EX until the file is whole
        tensors = load_file(path)
    token_ids = tensors["token_ids"].tolist()
    if token_ids != list(expected_ids):
        raise ValueError(
            f"{path.name}: token_ids differ from the ids sent ({len(token_ids)} vs "
            f"{len(expected_ids)} tokens); the server did not see the sequence as given"
        )
    rows = tensors["hidden_states"].shape[0]
    if rows != len(token_ids):
        raise ValueError(
            f"{path.name}: hidden_states has {rows} rows for {len(token_ids)} tokens; a server "
            "with prefix caching on returns no states for a cached prefix (vLLM issue 44485)"
        )
    path.unlink()
    lock.unlink(missing_ok=True)
    return tensors["hidden_states"]


class VLLMStateSource:
    """Captures through a running extraction server at `base_url`."""

    def __init__(
        self,
        base_url: str,
        model: str,
        layer_ids: Sequence[int],
        hidden_size: int,
        concurrency: int = 16,
        api_key: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.base_url, self.model, self.hidden_size = base_url, model, hidden_size
        served = sorted(set(layer_ids))  # the connector writes the ids in ascending order
        self.columns = [served.index(i) for i in layer_ids]
        self.concurrency, self.api_key, self.timeout_s = concurrency, api_key, timeout_s

    def _states(self, sequence: TokenSequence) -> torch.Tensor:
        ids = sequence.input_ids.tolist()
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0}
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(
            f"{self.base_url}/v1/completions", json.dumps(body).encode(), headers
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:500]
            message = f"{sequence.sample_id}: vLLM answered {error.code}: {detail}"
            raise RuntimeError(message) from None
        path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise RuntimeError(
                f"{sequence.sample_id}: no kv_transfer_params.hidden_states_path in vLLM's "
                "answer; is the server running with the hidden-states connector?"
            )
        return read_connector_file(Path(path), ids)[:, self.columns]

    def capture(
        self, sequences: Sequence[TokenSequence], batch_tokens: int
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """(index, [T, n_ids, H]) per sequence; vLLM batches the concurrent requests itself."""
        with ThreadPoolExecutor(self.concurrency) as pool:
            yield from enumerate(pool.map(self._states, sequences))

    def top_logits(self, final: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise ValueError(
            "the vllm backend returns states, not logits: choose a format that keeps the final "
            "state (bf16 or fp8), or the hf backend for top-k logits"
        )


@contextmanager
def extraction_server(
    serving: VLLMLaunchSpec,
    layer_ids: Sequence[int],
    hidden_size: int,
    cpu_build: bool,
    load_timeout_s: float,
    api_key: str | None = None,
    log: Callable[[str], None] = print,
) -> Iterator[VLLMStateSource]:
    """Start an extraction server (or reuse the identical one a killed attempt left running),
    yield a source reading from it, stop it whatever happens."""
    spec = extraction_spec(serving, layer_ids, serving.run_dir / "hidden_states", cpu_build)
    (spec.run_dir / "hidden_states").mkdir(parents=True, exist_ok=True)
    start(spec, log)
    try:
        wait_ready(spec, timeout_s=load_timeout_s)
        yield VLLMStateSource(
            spec.base_url,
            spec.served_model_name or spec.model,
            layer_ids,
            hidden_size,
            api_key=api_key or os.environ.get("VLLM_API_KEY"),
        )
    finally:
        stop(spec.run_dir)
