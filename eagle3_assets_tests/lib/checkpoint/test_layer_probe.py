"""The layer probe's decisions: which nested lists are ambiguous, when a reading is clearly
nearer rest, the refusal, and the pinned config every reader then agrees on."""

import json
import math

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
from eagle3_assets.lib.training.stationarity import Stationarity
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
# leave-one-out spread of the gap between the readings over 8 samples, the fewest that may
# decide: its jackknife standard error is sqrt(7 / 8 * 0.00105) = 0.0303
SPREAD = [0.01, -0.01, 0.02, -0.02, 0.005, -0.005, 0.0, 0.0]
ERROR = math.sqrt(7 / 8 * sum(d * d for d in SPREAD))


def rest(farther: float = 0.0, spread: list[float] = SPREAD) -> Stationarity:
    """A reading `farther` from rest than 1.0, its leave-one-out values spread by `spread`
    (around the nearer reading's, which do not spread)."""
    return Stationarity(1.0 + farther, [1.0 + farther + d for d in spread])


NEAREST = rest(spread=[0.0] * 8)


def scores(
    sglang: Stationarity, vllm: Stationarity, loss: tuple[float, float] = (3.9, 3.92)
) -> ProbeScores:
    return ProbeScores(
        {Reading.SGLANG: (3, 5, 6), Reading.VLLM: (2, 4, 5)},
        {Reading.SGLANG: sglang, Reading.VLLM: vllm},
        {Reading.SGLANG: [0.45, 0.1], Reading.VLLM: [0.44, 0.1]},
        {Reading.SGLANG: loss[0], Reading.VLLM: loss[1]},
        CHANCE,
        samples=len(sglang.leave_one_out) + 1,
        tokens=400,
    )


def test_the_reading_clearly_nearer_rest_wins_either_way():
    assert choose_reading(scores(NEAREST, rest(0.2))) is Reading.SGLANG
    assert choose_reading(scores(rest(0.2), NEAREST)) is Reading.VLLM
    assert scores(NEAREST, rest(0.2)).t(Reading.SGLANG, Reading.VLLM) == pytest.approx(0.2 / ERROR)
    # the loss does not decide: lower read the other way, which later layers alone can make
    assert choose_reading(scores(NEAREST, rest(0.2), loss=(3.95, 3.9))) is Reading.SGLANG


def test_exactly_at_the_threshold_still_decides():
    at = CLEARLY_BETTER.t * ERROR + 1e-12
    assert choose_reading(scores(NEAREST, rest(at))) is Reading.SGLANG
    with pytest.raises(LayerIdsUnclear) as refused:
        choose_reading(scores(NEAREST, rest(at - 0.75 * ERROR)))
    assert "the sglang reading is nearer rest by 2.25 standard errors, not 3.0" in str(
        refused.value
    )


@pytest.mark.parametrize(
    ("sglang", "vllm", "loss", "why"),
    [
        # a drafter indifferent to the reading, or not trained near rest: within noise
        (NEAREST, rest(0.01), (3.9, 3.92), "nearer rest by 0.33 standard errors"),
        # a large, steady gap, but over 7 samples
        (
            rest(spread=[0.0] * 7),
            rest(0.2, SPREAD[:7]),
            (3.9, 3.92),
            "7 probe samples supervise a position, fewer than 8",
        ),
        # untrained: clearly nearer rest one way, but no better than a uniform guess there
        (
            NEAREST,
            rest(0.2),
            (CHANCE + 0.05, CHANCE + 0.06),
            "predicts no better than chance read the sglang way",
        ),
    ],
)
def test_neither_clearly_better_is_refused_naming_both_scores(sglang, vllm, loss, why):
    with pytest.raises(LayerIdsUnclear) as refused:
        choose_reading(scores(sglang, vllm, loss))
    message = str(refused.value)
    assert why in message
    for reading, ids, at_rest, step0, accuracy in (
        ("sglang", [3, 5, 6], sglang, loss[0], "0.450"),
        ("vllm", [2, 4, 5], vllm, loss[1], "0.440"),
    ):
        assert (
            f"{reading} reading {ids}: stationarity {at_rest.value:.4g}, step-0 loss "
            f"{step0:.4f}, accuracy {accuracy}"
        ) in message
    assert f"{len(sglang.leave_one_out)} of {len(sglang.leave_one_out) + 1} samples" in message
    assert "Set EAGLE3_AUX_LAYER_IDS" in message


def test_scores_survive_their_cache_file():
    measured = scores(NEAREST, rest(0.2))
    assert ProbeScores.from_json(json.loads(json.dumps(measured.to_json()))) == measured


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
        return scores(NEAREST, rest(0.2))

    current = drafter_aux_layer_ids(trap_drafter, 8)
    first = settle_layer_ids(trap_drafter, current, TARGET, None, cache, measure, print)
    assert (first.reading, first.vllm) == (Reading.SGLANG, (3, 5, 6))
    meta = first.metadata()
    assert meta["layer_probe_sglang_accuracy"] == [0.45, 0.1]
    assert meta["layer_probe_sglang_stationarity"] == 1.0
    assert meta["layer_probe_vllm_stationarity"] == 1.2
    assert meta["layer_probe_sglang_step0_loss"] == 3.9
    assert meta["layer_probe_vllm_step0_loss"] == 3.92
    assert meta["layer_probe_t"] == 6.6  # 0.2 / 0.0303
    pinned = (trap_drafter / "config.json").read_bytes()
    # a restart: the download lays the published config down again, the cache decides
    config = json.loads(pinned)
    del config[KEY], config[PIN_FIELD]
    config["eagle_config"][KEY] = [2, 4, 5]
    (trap_drafter / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    again = settle_layer_ids(trap_drafter, current, TARGET, None, cache, measure, print)
    assert again == first and len(measured) == 1
    assert (trap_drafter / "config.json").read_bytes() == pinned  # same bytes, same identity
