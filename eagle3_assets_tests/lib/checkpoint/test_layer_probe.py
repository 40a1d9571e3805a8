"""The layer probe's decisions: which nested lists are ambiguous, when a reading scores
clearly better, the refusal, and the pinned config every reader then agrees on."""

import json
import math
import statistics

import pytest

from eagle3_assets.lib.checkpoint.drafter_io import (
    drafter_aux_layer_ids,
    export_for_vllm,
    validate_drafter,
)
from eagle3_assets.lib.checkpoint.layer_probe import (
    CLEARLY_BETTER,
    PIN_FIELD,
    LayerIdDecision,
    LayerIdsUnclear,
    ProbeScores,
    choose_reading,
    pin_layer_ids,
    settle_layer_ids,
    union_layers,
)
from eagle3_assets.lib.core.layer_ids import (
    KEY,
    LayerIdSource,
    Reading,
    aux_layer_ids,
    default_aux_layers,
    nested_readings,
)
from eagle3_assets.lib.core.target import TargetShape
from eagle3_assets.localdev.hub import make_untrained_drafter

TARGET = TargetShape(hidden_size=64, vocab_size=1024, num_hidden_layers=8)


def nested(ids: list[int], layers: int) -> dict | None:
    return nested_readings(aux_layer_ids({"eagle_config": {KEY: ids}}, layers), layers)


def test_aq_medai_nested_ids_read_two_ways():
    assert nested([2, 30, 58], 61) == {Reading.SGLANG: (3, 31, 59), Reading.VLLM: (2, 30, 58)}
    assert default_aux_layers(61) == (2, 30, 58)  # the trap: vLLM's own default


def test_ids_that_read_one_way_only_are_not_ambiguous():
    assert nested([0, 3, 4], 8) is None  # vLLM reading 0: the embeddings, refused
    assert nested([2, 4, 8], 8) is None  # SGLang reading 9: past the last layer
    assert nested_readings(aux_layer_ids({KEY: [2, 4, 5]}, 8), 8) is None  # top-level: vLLM
    assert nested_readings(aux_layer_ids({}, 8), 8) is None  # vLLM's default


CHANCE = math.log(256)


def scores(sglang: list[float], vllm: list[float]) -> ProbeScores:
    """Scores whose step-0 losses per sample are `sglang` and `vllm`."""
    return ProbeScores(
        {Reading.SGLANG: (3, 5, 6), Reading.VLLM: (2, 4, 5)},
        {Reading.SGLANG: [0.45, 0.1], Reading.VLLM: [0.44, 0.1]},
        {Reading.SGLANG: sglang, Reading.VLLM: vllm},
        CHANCE,
        samples=len(sglang) + 1,
        tokens=400,
    )


BASE = [4.0, 3.5, 4.2, 3.9, 4.4, 3.7, 4.1, 3.8]  # 8 samples, the fewest that may decide
# gaps of mean 0.02, sample deviation 0.00756: t = 0.02 / (0.00756 / sqrt(8)) = 7.48
GAPS = [0.01, 0.03, 0.02, 0.01, 0.03, 0.02, 0.02, 0.02]


def shifted(values: list[float], by: list[float]) -> list[float]:
    return [v + b for v, b in zip(values, by, strict=True)]


def test_the_clearly_better_reading_wins_either_way():
    assert choose_reading(scores(BASE, shifted(BASE, GAPS))) is Reading.SGLANG
    assert choose_reading(scores(shifted(BASE, GAPS), BASE)) is Reading.VLLM
    assert scores(BASE, shifted(BASE, GAPS)).paired_t(Reading.SGLANG, Reading.VLLM) == (
        pytest.approx(0.02 / (statistics.stdev(GAPS) / math.sqrt(8)))
    )


def test_exactly_at_the_threshold_still_decides():
    spread = statistics.stdev(GAPS)
    mean = statistics.fmean(GAPS)
    # the same gaps moved down until the mean is CLEARLY_BETTER.t standard errors
    at = [g - mean + CLEARLY_BETTER.t * spread / math.sqrt(8) + 1e-12 for g in GAPS]
    assert choose_reading(scores(BASE, shifted(BASE, at))) is Reading.SGLANG
    below = [g - 2e-3 for g in at]  # t = 3.0 - 2e-3 / (spread / sqrt(8)) = 2.25
    with pytest.raises(LayerIdsUnclear) as refused:
        choose_reading(scores(BASE, shifted(BASE, below)))
    assert "lower by 2.25 standard errors, not 3.0" in str(refused.value)


@pytest.mark.parametrize(
    ("sglang", "vllm", "why"),
    [
        # the miniature's drafters trained on the earlier reading: within noise
        (BASE, shifted(BASE, [0.02, -0.03, 0.01, -0.01, 0.02, -0.02, 0.01, 0.0]), "0.00 standard"),
        # a large, steady gap, but over 7 samples
        (
            BASE[:7],
            shifted(BASE[:7], GAPS[:7]),
            "7 probe samples supervise a position, fewer than 8",
        ),
        # untrained: a steady gap, both above a uniform guess's loss
        ([CHANCE + 0.05] * 8, [CHANCE + 0.06] * 8, "predicts no better than chance either way"),
    ],
)
def test_neither_clearly_better_is_refused_naming_both_scores(sglang, vllm, why):
    with pytest.raises(LayerIdsUnclear) as refused:
        choose_reading(scores(sglang, vllm))
    message = str(refused.value)
    assert why in message
    s, v = statistics.fmean(sglang), statistics.fmean(vllm)
    assert f"sglang reading [3, 5, 6]: step-0 loss {s:.4f}, accuracy 0.450" in message
    assert f"vllm reading [2, 4, 5]: step-0 loss {v:.4f}, accuracy 0.440" in message
    assert "Set EAGLE3_AUX_LAYER_IDS" in message


def test_scores_survive_their_cache_file():
    again = ProbeScores.from_json(json.loads(json.dumps(scores(BASE, BASE).to_json())))
    assert again == scores(BASE, BASE)


def test_union_of_the_readings_is_what_extraction_holds():
    assert union_layers({Reading.SGLANG: (3, 5, 6), Reading.VLLM: (2, 4, 5)}) == (2, 3, 4, 5, 6)


@pytest.fixture
def trap_drafter(test_world, tmp_path):
    """An untrained drafter whose nested list is vLLM's default, as AQ-MedAI's."""
    return make_untrained_drafter(
        test_world.target_v1, tmp_path / "drafter", 256, seed=0, nested_ids=[2, 4, 5]
    )


@pytest.mark.parametrize(
    ("reading", "ids"), [(Reading.VLLM, (2, 4, 5)), (Reading.SGLANG, (3, 5, 6))]
)
def test_pinned_ids_are_what_every_reader_sees(trap_drafter, tmp_path, reading, ids):
    before = drafter_aux_layer_ids(trap_drafter, 8)
    assert (before.vllm, before.source) == ((3, 5, 6), LayerIdSource.NESTED)
    pin_layer_ids(trap_drafter, LayerIdDecision(ids, "probe", [2, 4, 5], reading))
    config = json.loads((trap_drafter / "config.json").read_text())
    assert config[KEY] == list(ids)  # vLLM reads only this one
    assert config["eagle_config"][KEY] == [i - 1 for i in ids]  # consistent, SGLang
    assert config[PIN_FIELD] == {
        "decided_by": "probe",
        "published_eagle_config_ids": [2, 4, 5],
        "reading": str(reading),
    }
    after = drafter_aux_layer_ids(trap_drafter, 8)
    assert (after.vllm, after.source) == (ids, LayerIdSource.TOP_LEVEL)
    assert nested_readings(after, 8) is None  # pinned: nothing left to probe
    assert validate_drafter(trap_drafter, TARGET).aux_layer_ids.vllm == ids
    export = export_for_vllm(trap_drafter, tmp_path / "export", TARGET)
    assert json.loads((export / "config.json").read_text())[KEY] == list(ids)


def unmeasured(readings):
    raise AssertionError(f"no probe was expected, asked to score {readings}")


def test_the_override_is_pinned_without_a_probe(trap_drafter, tmp_path):
    current = drafter_aux_layer_ids(trap_drafter, 8)
    logs: list[str] = []
    decision = settle_layer_ids(
        trap_drafter, current, TARGET, [2, 4, 5], tmp_path / "scores.json", unmeasured, logs.append
    )
    assert decision.how == "EAGLE3_AUX_LAYER_IDS" and decision.vllm == (2, 4, 5)
    assert decision.metadata() == {
        "aux_layer_ids_decided_by": "EAGLE3_AUX_LAYER_IDS",
        "aux_layer_ids_published_nested": [2, 4, 5],
        "aux_layer_ids_reading": "none",
    }
    assert drafter_aux_layer_ids(trap_drafter, 8).vllm == (2, 4, 5)
    assert logs == ["aux layers [2, 4, 5] (vLLM ids) from EAGLE3_AUX_LAYER_IDS: no probe"]
    assert not (tmp_path / "scores.json").exists()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ([2, 4], "EAGLE3_AUX_LAYER_IDS: expected 3 ids (the drafter's fc reads 3 aux states)"),
        ([5, 4, 2], "EAGLE3_AUX_LAYER_IDS: expected ascending unique ids (vLLM sorts them)"),
        ([2, 4, 9], "EAGLE3_AUX_LAYER_IDS [9]: expected vLLM ids in [1, 8]"),
    ],
)
def test_a_bad_override_is_refused_by_name(trap_drafter, tmp_path, override, message):
    current = drafter_aux_layer_ids(trap_drafter, 8)
    with pytest.raises(ValueError) as refused:
        settle_layer_ids(trap_drafter, current, TARGET, override, tmp_path / "s.json", unmeasured)
    assert message in str(refused.value)


def test_cached_scores_decide_without_measuring_again(trap_drafter, tmp_path):
    cache = tmp_path / "probe" / "scores.json"
    measured: list[dict] = []

    def measure(readings):
        measured.append(readings)
        return scores(BASE, shifted(BASE, GAPS))

    current = drafter_aux_layer_ids(trap_drafter, 8)
    first = settle_layer_ids(trap_drafter, current, TARGET, None, cache, measure, print)
    assert (first.reading, first.vllm) == (Reading.SGLANG, (3, 5, 6))
    meta = first.metadata()
    assert meta["layer_probe_sglang_accuracy"] == [0.45, 0.1]
    assert meta["layer_probe_sglang_step0_loss"] == round(statistics.fmean(BASE), 4)
    assert meta["layer_probe_vllm_step0_loss"] == round(statistics.fmean(BASE) + 0.02, 4)
    assert meta["layer_probe_paired_t"] == 7.48
    pinned = (trap_drafter / "config.json").read_bytes()
    # a restart: the download lays the published config down again, the cache decides
    config = json.loads(pinned)
    del config[KEY], config[PIN_FIELD]
    config["eagle_config"][KEY] = [2, 4, 5]
    (trap_drafter / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    again = settle_layer_ids(trap_drafter, current, TARGET, None, cache, measure, print)
    assert again == first and len(measured) == 1
    assert (trap_drafter / "config.json").read_bytes() == pinned  # same bytes, same identity
