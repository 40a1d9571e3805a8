"""Hidden-state shards: exactly what EAGLE-3 training reads, packed so that it fits the disk.

Every public EAGLE-3 trainer dumps every position's states in bf16; for Kimi-K2.5 (H 7168) that
is 57,344 B/token and 5.9 TB for 25K x 4K tokens. Here:
- samples are packed back to back (ragged, offsets, no padding);
- the aux states (every position) are bf16, or fp8 e4m3 with one float32 scale per token and
  layer (amax / 448), which bounds each value's error by 2^-4 of itself plus 2^-10 of the scale;
- the final layer's state is kept only at teacher positions (whose next token is a response
  token; see token_sequences) in bf16 or fp8, or replaced by the target's top-k logits there
  (over the whole target vocab: the shards bind to no draft vocab, top-1 is the target's argmax,
  and a trainer drops the entries its draft vocab lacks).

One shard is one safetensors file (memory-mappable; docs/hidden-states-format.md):
  input_ids int32 [T]  loss_mask bool [T]  token_offsets int64 [n+1]  teacher_offsets int64 [n+1]
  aux bf16|f8_e4m3 [T, n_aux, H]  (+ aux_scale f32 [T, n_aux])
  final bf16|f8_e4m3 [P, H] (+ final_scale f32 [P])
    or topk_logits bf16 [P, k] and topk_ids int32 [P, k]
and the header metadata's one key, `eagle3_hidden_states`, holds JSON with the format version,
the format name and the sample ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save

from eagle3_assets.lib.hidden_states.settings import FINAL, WIDTH, check_format, split_format

FORMAT_VERSION = 1
METADATA_KEY = "eagle3_hidden_states"
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_RELATIVE_ERROR = 2.0**-4  # half an ulp of e4m3's 3 mantissa bits
FP8_SUBNORMAL_ERROR = 2.0**-10  # half the subnormal spacing, in units of the scale
KIMI_HIDDEN_SIZE, KIMI_AUX_LAYERS = 7168, 3  # the motivating deployment's storage math


@dataclass(frozen=True)
class ShardFormat:
    """`aux`: bf16 | fp8. `final`: bf16 | fp8 | top<k>. Named "<aux>+<final>", e.g. fp8+fp8."""

    aux: str = "fp8"
    final: str = "fp8"

    def __post_init__(self) -> None:
        check_format(self.aux, self.final)

    @classmethod
    def parse(cls, name: str) -> ShardFormat:
        return cls(*split_format(name))

    @property
    def name(self) -> str:
        return f"{self.aux}+{self.final}"

    @property
    def topk(self) -> int | None:
        match = FINAL.match(self.final)
        return int(match.group(2)) if match and match.group(2) else None

    def token_bytes(self, hidden_size: int, num_aux: int) -> int:
        """Bytes stored for every token: id, mask bit, aux states (and their scales)."""
        scales = 4 * num_aux if self.aux == "fp8" else 0
        return 4 + 1 + num_aux * hidden_size * WIDTH[self.aux] + scales

    def teacher_bytes(self, hidden_size: int) -> int:
        """Bytes stored for every teacher position: the final state, or top-k logits and ids."""
        if self.topk is not None:
            return self.topk * (2 + 4)
        return hidden_size * WIDTH[self.final] + (4 if self.final == "fp8" else 0)

    def bytes_per_token(self, hidden_size: int, num_aux: int, teacher_share: float) -> float:
        """Average bytes per token when `teacher_share` of the tokens are teacher positions."""
        return self.token_bytes(hidden_size, num_aux) + teacher_share * self.teacher_bytes(
            hidden_size
        )

    def estimate(
        self, tokens: int, teacher_positions: int, samples: int, hidden_size: int, num_aux: int
    ) -> int:
        """Tensor bytes of a shard (or a batch) holding this much; headers excluded."""
        return (
            tokens * self.token_bytes(hidden_size, num_aux)
            + teacher_positions * self.teacher_bytes(hidden_size)
            + 2 * 8 * (samples + 1)
        )


def candidate_formats(topk: int = 64) -> list[ShardFormat]:
    """The formats a storage-budget error suggests, most faithful first."""
    return [
        ShardFormat("bf16", "bf16"),
        ShardFormat("fp8", "bf16"),
        ShardFormat("fp8", "fp8"),
        ShardFormat("fp8", f"top{topk}"),
    ]


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and float32 scales over the last dim (one scale per token and layer)."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / FP8_MAX
    return (x / scale).to(FP8), scale.squeeze(-1)


def dequantize_fp8(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (values.float() * scale.unsqueeze(-1)).to(dtype)


def _store(x: torch.Tensor, kind: str, name: str) -> dict[str, torch.Tensor]:
    if kind == "fp8":
        values, scale = quantize_fp8(x)
        return {name: values, f"{name}_scale": scale}
    return {name: x.to(torch.bfloat16)}


def encode_sample(
    input_ids: np.ndarray,
    loss_mask: np.ndarray,
    aux: torch.Tensor,
    teacher: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    fmt: ShardFormat,
) -> dict[str, torch.Tensor]:
    """One sample's tensors. `aux` [T, n_aux, H]; `teacher`: the final states at the teacher
    positions [P, H], or the (logits, ids) of the target's top k there, [P, k] each."""
    tensors = {
        "input_ids": torch.from_numpy(input_ids.astype(np.int32)),
        "loss_mask": torch.from_numpy(loss_mask.astype(bool)),
        **_store(aux, fmt.aux, "aux"),
    }
    if fmt.topk is not None:
        logits, ids = teacher
        return tensors | {"topk_logits": logits.to(torch.bfloat16), "topk_ids": ids.to(torch.int32)}
    return tensors | _store(teacher, fmt.final, "final")


def shard_bytes(
    samples: list[dict[str, torch.Tensor]], sample_ids: list[str], fmt: ShardFormat
) -> bytes:
    """Pack encoded samples into one safetensors payload."""
    token_offsets = np.cumsum([0, *(len(s["input_ids"]) for s in samples)])
    teacher_key = "topk_ids" if fmt.topk is not None else "final"
    teacher_offsets = np.cumsum([0, *(len(s[teacher_key]) for s in samples)])
    packed = {name: torch.cat([s[name] for s in samples]).contiguous() for name in samples[0]} | {
        "token_offsets": torch.from_numpy(token_offsets.astype(np.int64)),
        "teacher_offsets": torch.from_numpy(teacher_offsets.astype(np.int64)),
    }
    # One metadata key: safetensors writes several in hash order, and a resumed shard must be
    # byte-identical to an uninterrupted one.
    header = {"format_version": FORMAT_VERSION, "format": fmt.name, "sample_ids": sample_ids}
    return save(packed, metadata={METADATA_KEY: json.dumps(header, sort_keys=True)})


@dataclass(frozen=True)
class HiddenSample:
    """One sample as a trainer reads it; float tensors in the reader's dtype."""

    sample_id: str
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]
    aux: torch.Tensor  # [T, n_aux, H]
    final: torch.Tensor | None  # [P, H] at the teacher positions, unless the format keeps top-k
    topk_logits: torch.Tensor | None  # [P, k]
    topk_ids: torch.Tensor | None  # int64 [P, k] target token ids, best first


class ShardFile:
    """A memory-mapped shard: reading one sample touches only that sample's bytes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = safe_open(str(path), framework="pt")
        header = json.loads((self._file.metadata() or {}).get(METADATA_KEY, "{}"))
        version = header.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"{path}: format_version expected {FORMAT_VERSION}, found {version}; re-extract it"
            )
        self.format = ShardFormat.parse(header["format"])
        self.sample_ids: list[str] = header["sample_ids"]
        self.token_offsets = self._file.get_tensor("token_offsets").tolist()
        self.teacher_offsets = self._file.get_tensor("teacher_offsets").tolist()

    def __len__(self) -> int:
        return len(self.sample_ids)

    def keys(self) -> list[str]:
        return list(self._file.keys())

    def tensor(self, name: str) -> torch.Tensor:
        """A whole tensor (for checks over a shard; training reads samples)."""
        return self._file.get_tensor(name)

    def count_nonfinite(self, name: str, rows: int = 8192) -> int:
        """NaN/Inf values in a float tensor, read `rows` at a time (a shard is ~1 GiB)."""
        tensor = self._file.get_slice(name)
        total = tensor.get_shape()[0]
        return sum(
            int((~torch.isfinite(tensor[start : start + rows].float())).sum())
            for start in range(0, total, rows)
        )

    def _rows(self, name: str, offsets: list[int], index: int) -> torch.Tensor:
        return self._file.get_slice(name)[offsets[index] : offsets[index + 1]]

    def _states(self, name: str, kind: str, offsets: list[int], i: int, dtype: torch.dtype):
        values = self._rows(name, offsets, i)
        if kind == "fp8":
            return dequantize_fp8(values, self._rows(f"{name}_scale", offsets, i), dtype)
        return values.to(dtype)

    def sample(self, index: int, dtype: torch.dtype = torch.float32) -> HiddenSample:
        tokens, teacher, fmt = self.token_offsets, self.teacher_offsets, self.format
        topk = fmt.topk is not None
        return HiddenSample(
            sample_id=self.sample_ids[index],
            input_ids=self._rows("input_ids", tokens, index).long(),
            loss_mask=self._rows("loss_mask", tokens, index),
            aux=self._states("aux", fmt.aux, tokens, index, dtype),
            final=None if topk else self._states("final", fmt.final, teacher, index, dtype),
            topk_logits=self._rows("topk_logits", teacher, index).to(dtype) if topk else None,
            topk_ids=self._rows("topk_ids", teacher, index).long() if topk else None,
        )
