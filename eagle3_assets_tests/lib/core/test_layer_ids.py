import pytest

from eagle3_assets.lib.core.layer_ids import (
    LayerIdSource,
    aux_layer_ids,
    check_layer_ids,
    default_aux_layers,
    sglang_to_vllm,
    vllm_to_sglang,
)


def test_kimi_ids_convert_and_match_vllm_default():
    # Kimi-K2 (61 layers): the AQ-MedAI drafter's SpecForge ids are vLLM's default, minus one.
    assert sglang_to_vllm([1, 29, 57]) == (2, 30, 58)
    assert vllm_to_sglang([2, 30, 58]) == (1, 29, 57)
    assert default_aux_layers(61) == (2, 30, 58)
    assert default_aux_layers(8) == (2, 4, 5)


def test_nested_sglang_and_top_level_vllm_ids_mean_the_same_layers():
    nested = aux_layer_ids({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}, 8)
    top = aux_layer_ids({"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}, 8)
    assert nested.vllm == top.vllm == (2, 4, 5)
    assert nested.sglang == top.sglang == (1, 3, 4)
    assert nested.source is LayerIdSource.NESTED
    assert top.source is LayerIdSource.TOP_LEVEL


def test_absent_ids_fall_back_to_vllm_default_of_the_target():
    ids = aux_layer_ids({"eagle_config": {"use_aux_hidden_state": True}}, 61)
    assert ids.vllm == (2, 30, 58)
    assert ids.source is LayerIdSource.DEFAULT


def test_top_level_wins_when_both_agree():
    config = {
        "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]},
    }
    assert aux_layer_ids(config, 8).source is LayerIdSource.TOP_LEVEL


def test_top_level_and_nested_naming_different_layers_is_an_error():
    # The classic mistake: copying SGLang ids to the top level unconverted.
    config = {
        "eagle_aux_hidden_state_layer_ids": [1, 3, 4],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]},
    }
    with pytest.raises(ValueError, match=r"found top-level \[1, 3, 4\] and nested \[1, 3, 4\]"):
        aux_layer_ids(config, 8)


def test_ids_must_be_a_list_of_ints():
    with pytest.raises(ValueError, match="expected a list of ints"):
        aux_layer_ids({"eagle_aux_hidden_state_layer_ids": "2,4,5"}, 8)


def test_fc_order_is_vllms_sorted_unique_ids():
    ids = aux_layer_ids({"eagle_aux_hidden_state_layer_ids": [30, 2, 58, 30]}, 61)
    assert ids.vllm == (30, 2, 58, 30) and ids.fc_order == (2, 30, 58)


@pytest.mark.parametrize(
    ("ids", "bad"),
    [((1, 4, 8), []), ((0, 4, 5), [0]), ((2, 4, 9), [9]), ((-1, 9), [-1, 9])],
    ids=["first-and-last-layer-outputs", "embeddings", "past-the-target", "both-ends"],
)
def test_one_range_for_vllm_ids(ids, bad):
    """[1, N]: id N (the last layer's output, extraction's final state) is in, id 0 (the
    embeddings, which DeepSeek-V2 targets such as Kimi cannot capture in vLLM) is out."""
    if not bad:
        check_layer_ids(ids, 8)
        return
    with pytest.raises(ValueError) as raised:
        check_layer_ids(ids, 8, "aux")
    message = str(raised.value)
    assert message.startswith(f"aux {bad}: expected vLLM ids in [1, 8] (the target has 8 layers;")
    assert message.endswith(f"found {list(ids)}")
