"""The `hf` extraction backend: the target's forward in transformers, with hooks that keep only
the layers the drafter reads.

`output_hidden_states=True` keeps all N + 1 layers of every position alive until the forward
ends (61 x 7168 x 2 B = 875 KB/token for Kimi); a forward hook on each needed layer keeps 4.
The base model runs without the lm_head, whose vocab projection over every position is most of
a small model's forward; the teacher's top-k logits, when the format keeps them, are computed
only at the teacher positions. Ids are in vLLM convention: id i is the residual stream entering
decoder layer i, i.e. the output of layer i - 1, and id N is the last layer's output before the
final norm.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from eagle3_assets.lib.core.layer_ids import check_layer_ids
from eagle3_assets.lib.core.platform import Platform
from eagle3_assets.lib.hidden_states.token_sequences import TokenSequence

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(device: str, platform: Platform) -> str:
    """`auto`: the platform's (on cuda every visible GPU, one model split by transformers'
    device_map); else the device as given."""
    return platform if device == "auto" else device


def length_buckets(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped so that each batch, padded to its longest, holds at most `batch_tokens`
    (a longer sample goes alone). Sorting by length first keeps the padding small."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    for index in order:
        if batches and (len(batches[-1]) + 1) * lengths[index] <= batch_tokens:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


def right_padded(sequences: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), [B, T_max] each, padded on the right with masked zeros."""
    longest = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    mask = torch.zeros(len(sequences), longest, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.from_numpy(sequence)
        mask[row, : len(sequence)] = 1
    return ids, mask


class HFTarget:
    """The target loaded from safetensors (never a pickle), capturing vLLM-convention layers."""

    def __init__(
        self,
        path: Path,
        layer_ids: Sequence[int],
        dtype: str = "bfloat16",
        device: str = "cpu",  # cuda: every visible GPU (transformers' device_map); cuda:i
        trust_remote_code: bool = False,
    ) -> None:
        from transformers import AutoModelForCausalLM

        if dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, found {dtype!r}")
        multi_gpu = device == "cuda" and torch.cuda.device_count() > 1
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=DTYPES[dtype],
            device_map="auto" if multi_gpu else None,
            trust_remote_code=trust_remote_code,
            use_safetensors=True,
        )
        self.model = (model if multi_gpu else model.to(device)).eval()
        self.decoder = self.model.get_decoder()
        layers = self.decoder.layers
        check_layer_ids(layer_ids, len(layers))
        self.layer_ids = tuple(layer_ids)
        self.hidden_size = self.model.config.get_text_config().hidden_size
        self._captured: dict[int, torch.Tensor] = {}
        self.hooks = {  # by layer id; the benchmark lifts them to time the bare forward
            layer_id: layers[layer_id - 1].register_forward_hook(self._keeper(layer_id))
            for layer_id in set(self.layer_ids)
        }

    def __enter__(self) -> HFTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.model = self.decoder = None  # the weights go with the last reference
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _keeper(self, layer_id: int):
        def keep(module: torch.nn.Module, args: object, output: object) -> None:
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return keep

    @property
    def input_device(self) -> torch.device:
        return self.decoder.get_input_embeddings().weight.device

    @torch.inference_mode()
    def states(self, input_ids: list[np.ndarray]) -> torch.Tensor:
        """[B, T_max, len(layer_ids), H] for right-padded sequences (padding is masked out)."""
        ids, mask = right_padded(input_ids)
        self._captured.clear()
        try:
            self.decoder(
                input_ids=ids.to(self.input_device),
                attention_mask=mask.to(self.input_device),
                use_cache=False,
            )
            return torch.stack([self._captured[i].to(ids.device) for i in self.layer_ids], dim=2)
        finally:
            self._captured.clear()

    def capture(
        self, sequences: Sequence[TokenSequence], batch_tokens: int
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """(index into `sequences`, [T, len(layer_ids), H]) for every sequence, in length
        buckets; the order of the pairs is the buckets' order."""
        for bucket in length_buckets([len(s) for s in sequences], batch_tokens):
            states = self.states([sequences[i].input_ids for i in bucket])
            for row, index in enumerate(bucket):
                yield index, states[row, : len(sequences[index])]

    @torch.inference_mode()
    def top_logits(self, final: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's k best (logits, ids) over its whole vocab for final states [P, H]."""
        head = self.model.get_output_embeddings()
        normed = self.decoder.norm(final.to(head.weight.device, head.weight.dtype))
        logits, ids = head(normed).float().topk(min(k, head.weight.shape[0]), dim=-1)
        return logits.cpu(), ids.cpu()
