"""The layer probe on real warm starts of the Kimi world: two drafters with one config, whose
nested ids are vLLM's default for target-v1's 8 layers ([2, 4, 5], AQ-MedAI's trap), one
trained on each reading, probed on target-v1's greedy answers to prompts neither was trained
on, their states extracted (hf) at both readings' layers, as the probe does. Neither is ever
pinned to the other reading. The SGLang-trained one is pinned to its own on every build of the
world; the vLLM-trained one is pinned to its own or refused, since the world's bytes differ by
CPU and on the AVX2 build (CI's) it is not clearly nearer rest its way (the earlier reading is
the hard one; the measurements: `layer_probe.CLEARLY_BETTER` and the README's probe paragraph)."""

import json
import shutil

import pytest
import torch

from eagle3_assets.lib.checkpoint.drafter_io import drafter_aux_layer_ids
from eagle3_assets.lib.checkpoint.layer_probe import (
    CLEARLY_BETTER,
    PIN_FIELD,
    LayerIdsUnclear,
    score_readings,
    settle_layer_ids,
    union_layers,
)
from eagle3_assets.lib.core.layer_ids import KEY, Reading
from eagle3_assets.lib.core.target import TargetShape
from eagle3_assets.lib.hidden_states.extract import LayerSelection
from eagle3_assets.lib.training.stationarity import sample_gradients, stationarity
from eagle3_assets.lib.training.train_drafter import open_heldout
from eagle3_assets.localdev.greedy import greedy_hidden_states
from eagle3_assets.localdev.prompts import write_unasked_prompts
from eagle3_assets_tests.conftest import kimi_warm_start

READINGS = {Reading.SGLANG: (3, 5, 6), Reading.VLLM: (2, 4, 5)}


@pytest.fixture(scope="module")
def probe_states(kimi_world, tmp_path_factory):
    """target-v1's states at both readings' layers, on the answers to every prompt of the world
    that no world drafter trained on, and their count."""
    root = tmp_path_factory.mktemp("probe")
    spec = kimi_world.spec
    unasked = write_unasked_prompts(spec.num_prompts, spec.topic_keys(), root / "unasked.jsonl")
    layers = TargetShape.from_config(kimi_world.target_v1).num_hidden_layers
    hidden_dir = greedy_hidden_states(
        kimi_world.target_v1,
        root / "unasked.jsonl",
        unasked,
        max_new_tokens=64,
        layers=LayerSelection(union_layers(READINGS), layers, "both readings"),
        out_dir=root / "hidden_states",
        identity={"target": "target-v1"},
        chat_template_kwargs=spec.chat_template_kwargs,
        trust_remote_code=spec.trust_remote_code,
    )
    return hidden_dir, unasked


@pytest.mark.parametrize("trained_on", [Reading.SGLANG, Reading.VLLM])
def test_each_warm_start_is_pinned_to_its_own_reading_or_refused_never_misread(
    kimi_world, probe_states, trained_on, tmp_path
):
    """Refused only when trained on the earlier (vLLM) reading."""
    hidden_dir, prompts = probe_states
    drafter = shutil.copytree(kimi_warm_start(kimi_world, trained_on), tmp_path / "drafter")
    target = kimi_world.target_v1
    shape = TargetShape.from_config(target)
    current = drafter_aux_layer_ids(drafter, shape.num_hidden_layers)
    assert current.vllm == READINGS[Reading.SGLANG]  # as the file says, SpecForge's way
    measured = []

    def measure(readings):
        assert readings == READINGS
        measured.append(score_readings(drafter, target, hidden_dir, readings))
        return measured[-1]

    logs: list[str] = []
    try:
        decision = settle_layer_ids(
            drafter, current, shape, None, tmp_path / "scores.json", measure, logs.append
        )
    except LayerIdsUnclear as refused:  # not clear enough on this build of the world
        assert trained_on is Reading.VLLM, f"the later reading must be pinned: {refused}"
        nearer, farther = measured[0].ranked()
        t = measured[0].t(nearer, farther)
        assert t < CLEARLY_BETTER.t
        assert f"the {nearer} reading is nearer rest by {t:.2f} standard errors" in str(refused)
        config = json.loads((drafter / "config.json").read_text())
        assert KEY not in config and PIN_FIELD not in config  # nothing pinned: the user decides
        return
    scores = measured[0]
    other = Reading.VLLM if trained_on is Reading.SGLANG else Reading.SGLANG
    assert scores.ranked() == (trained_on, other)
    t = scores.t(trained_on, other)
    assert t >= CLEARLY_BETTER.t, scores.describe()
    assert (decision.reading, decision.vllm, decision.how) == (
        trained_on,
        READINGS[trained_on],
        "probe",
    )
    meta = decision.metadata()
    assert meta["layer_probe_t"] == round(t, 2)
    assert meta["layer_probe_samples"] == scores.samples == prompts
    for reading in READINGS:
        assert meta[f"layer_probe_{reading}_step0_loss"] == round(scores.loss[reading], 4)
    config = json.loads((drafter / "config.json").read_text())
    assert config[KEY] == list(READINGS[trained_on])
    assert config["eagle_config"][KEY] == [i - 1 for i in READINGS[trained_on]]
    assert config[PIN_FIELD]["reading"] == str(trained_on)
    assert logs[-1] == (
        f"layer probe: chose the {trained_on} reading, aux layers "
        f"{list(READINGS[trained_on])} (vLLM ids)"
    )


def test_stationarity_is_the_mean_over_pairs_of_whitened_sample_gradients(kimi_world, probe_states):
    """The two-pass estimate equals the one computed from every sample's gradient at once."""
    hidden_dir, _ = probe_states
    drafter, target = kimi_warm_start(kimi_world, Reading.VLLM), kimi_world.target_v1
    measured = stationarity(drafter, target, [str(hidden_dir)], READINGS)
    head = None
    gradients = {}
    for reading, ids in READINGS.items():
        opened = open_heldout(drafter, target, [str(hidden_dir)], 1.0, ids, head)
        head = opened[1]  # the target's head, read once
        gradients[reading] = torch.stack(list(sample_gradients(opened)))
    n = len(gradients[Reading.VLLM])
    variance = sum(g.double().var(0, unbiased=False) for g in gradients.values()) / 2
    scale = torch.where(variance > 0, 1 / variance, 0.0)

    def pairwise_mean(gram: torch.Tensor, keep: list[int]) -> float:
        kept = gram[keep][:, keep]
        return float((kept.sum() - kept.trace()) / (len(keep) * (len(keep) - 1)))

    for reading, g in gradients.items():
        gram = (g.double() * scale) @ g.double().T
        assert len(measured[reading].leave_one_out) == n
        assert measured[reading].value == pytest.approx(
            pairwise_mean(gram, list(range(n))), rel=1e-4
        )
        for left_out in (0, n // 2, n - 1):
            rest = [i for i in range(n) if i != left_out]
            assert measured[reading].leave_one_out[left_out] == pytest.approx(
                pairwise_mean(gram, rest), rel=1e-4
            )
