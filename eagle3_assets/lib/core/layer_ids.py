"""EAGLE-3 auxiliary layer ids, and the one conversion between their two conventions.

vLLM: id i is the residual stream entering decoder layer i, i.e. HF `output_hidden_states[i]`
(0 is the embeddings). SGLang/SpecForge: id j is the output of decoder layer j, which vLLM calls
j + 1, so Kimi's SpecForge ids [1, 29, 57] are [2, 30, 58] in vLLM. SpecForge v0.2 writes its
ids nested in `eagle_config`, in SGLang convention; vLLM 0.32 reads a top-level
`eagle_aux_hidden_state_layer_ids` first and else takes the nested list AS vLLM ids, with no
conversion (gpu_model_runner.py, `_get_eagle3_aux_layers_from_config`). So a nested list means
one layer lower to vLLM than to its writer, and every reader must say which convention it speaks.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

VLLM_MINUS_SGLANG = 1  # vLLM id = SGLang id + 1
KEY = "eagle_aux_hidden_state_layer_ids"


def sglang_to_vllm(ids: Sequence[int]) -> tuple[int, ...]:
    """SGLang/SpecForge ids (layer outputs) -> vLLM ids (layer inputs)."""
    return tuple(i + VLLM_MINUS_SGLANG for i in ids)


def vllm_to_sglang(ids: Sequence[int]) -> tuple[int, ...]:
    """vLLM ids (layer inputs) -> SGLang/SpecForge ids (layer outputs)."""
    return tuple(i - VLLM_MINUS_SGLANG for i in ids)


def check_layer_ids(ids: Sequence[int], num_layers: int, what: str = "layer ids") -> None:
    """THE rule for vLLM ids, used wherever ids are checked: 1 <= id <= N for an N-layer target.

    Id N is the last layer's output before the final norm, which vLLM captures for every model
    (llama.py after layer N - 1; deepseek_v2.py at end_layer) and extraction keeps as the final
    state. Id 0, the embeddings, is refused: vLLM's Llama captures it, but DeepSeek-V2 (Kimi)
    adds the first layer's residual, None there, and fails, and the hf backend hooks layer
    outputs only, so a drafter reading it could be neither served on Kimi nor trained here.
    Raise ValueError naming `what`, the range and the ids found."""
    bad = [i for i in ids if not 1 <= i <= num_layers]
    if bad:
        raise ValueError(
            f"{what} {bad}: expected vLLM ids in [1, {num_layers}] (the target has {num_layers} "
            f"layers; id i is the residual stream entering layer i, {num_layers} the last "
            f"layer's output; 0, the embeddings, is not captured by every vLLM model), "
            f"found {list(ids)}"
        )


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's default when a drafter config names no ids, in vLLM convention: (2, N//2, N-3)."""
    return (2, num_layers // 2, num_layers - 3)


class LayerIdSource(StrEnum):
    """Where a drafter config's ids came from; the value names the key and its convention."""

    TOP_LEVEL = "top-level eagle_aux_hidden_state_layer_ids (vLLM convention)"
    NESTED = "eagle_config.eagle_aux_hidden_state_layer_ids (SGLang convention)"
    DEFAULT = "absent: vLLM default (2, N//2, N-3) of the target's layer count"


@dataclass(frozen=True)
class AuxLayerIds:
    """Aux layer ids in vLLM convention, and where they were read from."""

    vllm: tuple[int, ...]
    source: LayerIdSource

    @property
    def sglang(self) -> tuple[int, ...]:
        return vllm_to_sglang(self.vllm)

    @property
    def fc_order(self) -> tuple[int, ...]:
        return fc_order(self.vllm)


def fc_order(ids: Sequence[int]) -> tuple[int, ...]:
    """The ids in the order vLLM feeds the drafter's fc: sorted and unique (it sorts them,
    interfaces.py), whatever order a config lists. Extraction and training use this."""
    return tuple(sorted(set(ids)))


class Reading(StrEnum):
    """The two conventions a nested list may have been written in. SpecForge writes SGLang
    ids there, but a list equal to vLLM's default (AQ-MedAI's [2, 30, 58] for 61 layers) may
    as well be vLLM ids: the file cannot say which the drafter was trained on."""

    SGLANG = "sglang"  # layer outputs: vLLM id = nested id + 1
    VLLM = "vllm"  # layer inputs: vLLM id = nested id


def _ids(value: object, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(i) is int for i in value):
        raise ValueError(f"{where}: expected a list of ints, found {value!r}")
    return tuple(value)


def aux_layer_ids(drafter_config: dict, target_num_layers: int) -> AuxLayerIds:
    """The ids a drafter config means, in vLLM convention. A top-level list (vLLM convention)
    wins, as in vLLM; a nested list (SGLang convention) is converted; with neither, vLLM's
    default for the target applies. Both present but naming different layers is an error:
    vLLM would use the top-level ones while SpecForge trained on the nested ones."""
    nested_config = drafter_config.get("eagle_config") or {}
    top = drafter_config.get(KEY)
    nested = nested_config.get(KEY)
    if top is not None:
        ids = _ids(top, KEY)
        if nested is not None:
            nested_vllm = sglang_to_vllm(_ids(nested, f"eagle_config.{KEY}"))
            if nested_vllm != ids:
                raise ValueError(
                    f"{KEY}: expected the top-level ids (vLLM) to equal eagle_config's (SGLang) "
                    f"plus one, found top-level {list(ids)} and nested {nested} "
                    f"(= {list(nested_vllm)} in vLLM ids)"
                )
        return AuxLayerIds(ids, LayerIdSource.TOP_LEVEL)
    if nested is not None:
        return AuxLayerIds(
            sglang_to_vllm(_ids(nested, f"eagle_config.{KEY}")), LayerIdSource.NESTED
        )
    return AuxLayerIds(default_aux_layers(target_num_layers), LayerIdSource.DEFAULT)


def nested_readings(ids: AuxLayerIds, num_layers: int) -> dict[Reading, tuple[int, ...]] | None:
    """Both readings (vLLM ids) of ids that came from the nested list alone, when both are
    valid for the target and name different layers: then only a measurement can choose.
    None when the ids are not ambiguous (top-level or default ids, or one reading invalid)."""
    if ids.source is not LayerIdSource.NESTED:
        return None
    readings = {Reading.SGLANG: ids.vllm, Reading.VLLM: ids.sglang}
    for reading, vllm_ids in readings.items():
        try:
            check_layer_ids(vllm_ids, num_layers, f"{reading} reading")
        except ValueError:
            return None
    return readings if readings[Reading.SGLANG] != readings[Reading.VLLM] else None
