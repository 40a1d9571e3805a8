"""The layer probe on real warm starts of the Kimi world: two drafters with one config, whose
nested ids are vLLM's default for target-v1's 8 layers ([2, 4, 5], AQ-MedAI's trap), one
trained on each reading, scored on target-v1's greedy answers to 48 prompts neither was
trained on, their states extracted (hf) at both readings' layers, as the probe does.

What it shows (measured, not wished): the warm start trained on the SGLang reading [3, 5, 6]
is told apart and pinned to it, by its step-0 loss per sample (paired t 3.31) where its
accuracy differs by 0.003 both ways; the one trained on the vLLM reading [2, 4, 5] scores
within noise both ways (t 0.38 its way: the miniature's adjacent layers are nearly collinear)
and is refused, naming both scores, instead of being guessed."""

import json
import shutil

import pytest

from eagle3_assets.lib.checkpoint.drafter_io import drafter_aux_layer_ids
from eagle3_assets.lib.checkpoint.layer_probe import (
    PIN_FIELD,
    LayerIdsUnclear,
    score_readings,
    settle_layer_ids,
    union_layers,
)
from eagle3_assets.lib.core.layer_ids import KEY, Reading
from eagle3_assets.lib.core.target import TargetShape
from eagle3_assets.lib.hidden_states.extract import LayerSelection
from eagle3_assets.localdev.greedy import greedy_hidden_states
from eagle3_assets.localdev.hub import train_world_drafter
from eagle3_assets.localdev.prompts import write_unasked_prompts

READINGS = {Reading.SGLANG: (3, 5, 6), Reading.VLLM: (2, 4, 5)}
PROBE_PROMPTS = 48


@pytest.fixture(scope="module")
def probe_states(kimi_world, tmp_path_factory):
    """target-v1's states at both readings' layers, on answers no world drafter trained on."""
    root = tmp_path_factory.mktemp("probe")
    spec = kimi_world.spec
    unasked = write_unasked_prompts(spec.num_prompts, spec.topic_keys(), root / "unasked.jsonl")
    assert unasked >= PROBE_PROMPTS
    layers = TargetShape.from_config(kimi_world.target_v1).num_hidden_layers
    return greedy_hidden_states(
        kimi_world.target_v1,
        root / "unasked.jsonl",
        PROBE_PROMPTS,
        max_new_tokens=64,
        layers=LayerSelection(union_layers(READINGS), layers, "both readings"),
        out_dir=root / "hidden_states",
        identity={"target": "target-v1"},
        chat_template_kwargs=spec.chat_template_kwargs,
        trust_remote_code=spec.trust_remote_code,
    )


def probe(kimi_world, probe_states, trained_on: Reading, tmp_path, logs: list[str]):
    """settle_layer_ids on a copy of the world drafter trained on `trained_on`."""
    drafter = shutil.copytree(train_world_drafter(kimi_world, 256, reading=trained_on), tmp_path)
    target = kimi_world.target_v1
    shape = TargetShape.from_config(target)
    current = drafter_aux_layer_ids(drafter, shape.num_hidden_layers)
    assert current.vllm == READINGS[Reading.SGLANG]  # as the file says, SpecForge's way

    def measure(readings):
        assert readings == READINGS
        return score_readings(drafter, target, probe_states, readings)

    decision = settle_layer_ids(
        drafter, current, shape, None, tmp_path / "scores.json", measure, logs.append
    )
    return drafter, decision


def test_the_warm_start_trained_on_the_sglang_reading_is_pinned_to_it(
    kimi_world, probe_states, tmp_path
):
    logs: list[str] = []
    drafter, decision = probe(kimi_world, probe_states, Reading.SGLANG, tmp_path / "d", logs)
    assert (decision.reading, decision.vllm, decision.how) == (Reading.SGLANG, (3, 5, 6), "probe")
    meta = decision.metadata()
    assert meta["layer_probe_paired_t"] == pytest.approx(3.31, abs=0.01)
    assert meta["layer_probe_samples"] == PROBE_PROMPTS
    assert meta["layer_probe_sglang_step0_loss"] < meta["layer_probe_vllm_step0_loss"]
    config = json.loads((drafter / "config.json").read_text())
    assert config[KEY] == [3, 5, 6]
    assert config[PIN_FIELD]["reading"] == "sglang"
    assert logs[-1] == "layer probe: chose the sglang reading, aux layers [3, 5, 6] (vLLM ids)"


def test_the_warm_start_trained_on_the_vllm_reading_is_refused_not_guessed(
    kimi_world, probe_states, tmp_path
):
    with pytest.raises(LayerIdsUnclear) as refused:
        probe(kimi_world, probe_states, Reading.VLLM, tmp_path / "d", [])
    message = str(refused.value)
    # the right way round, by a third of a standard error
    assert "neither scores clearly better: the vllm reading's loss is lower by 0.38 " in message
    assert "sglang reading [3, 5, 6]: step-0 loss" in message
    assert "vllm reading [2, 4, 5]: step-0 loss" in message
    assert f"of {PROBE_PROMPTS} samples supervised" in message
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert KEY not in config and PIN_FIELD not in config  # nothing pinned: the user decides
