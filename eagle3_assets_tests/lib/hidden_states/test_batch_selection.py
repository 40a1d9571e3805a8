"""Which batches a consumer may read: only those whose every check's latest evaluation passed
and whose files are there; each other one named with its checks and what to do."""

import json

import pytest

from eagle3_assets.lib.checkpoint.drafter_io import DrafterValidationError
from eagle3_assets.lib.hidden_states.backends import drafter_layers
from eagle3_assets.lib.hidden_states.batch_selection import Exclusion, select_batches
from eagle3_assets.localdev.hub import make_untrained_drafter

CHECKS = ("manifest_complete", "values_finite")


def test_only_batches_whose_every_check_passed_are_usable():
    statuses = {
        "batch-00002": {"manifest_complete": "passed", "values_finite": "passed"},
        "batch-00000": {"manifest_complete": "passed", "values_finite": "passed"},
        "batch-00001": {"manifest_complete": "passed", "values_finite": "failed"},
        "batch-00003": {"manifest_complete": "not evaluated", "values_finite": "planned"},
    }
    on_disk = ["batch-00000", "batch-00001", "batch-00003"]  # batch-00002's files are gone
    selection = select_batches(statuses, on_disk)
    assert selection.usable == ["batch-00000"]
    assert selection.excluded == [
        Exclusion("batch-00001", {"values_finite": "failed"}),
        Exclusion("batch-00002", {"manifest.json": "missing"}),
        Exclusion(
            "batch-00003", {"manifest_complete": "not evaluated", "values_finite": "planned"}
        ),
    ]
    assert select_batches({}, []).usable == []


def test_an_exclusion_names_the_batch_the_check_and_the_fix():
    fixes = {"values_finite": "fixing the NaN/Inf states", "manifest_complete": "finding why"}
    message = Exclusion("batch-00003", {"values_finite": "failed"}).message("hidden_states", fixes)
    assert message == (
        "hidden_states[batch-00003] left out: values_finite failed (latest evaluation); "
        "re-materialize hidden_states[batch-00003] after fixing the NaN/Inf states"
    )
    gone = Exclusion("batch-00004", {"manifest.json": "missing"}).message("hidden_states", fixes)
    assert gone == (
        "hidden_states[batch-00004] left out: manifest.json missing (latest evaluation); "
        "re-materialize hidden_states[batch-00004]"
    )


def test_drafter_layers_read_the_warm_start_config(test_world, tmp_path):
    warm_start = make_untrained_drafter(test_world.target_v1, tmp_path / "drafter", 256, seed=0)
    config = json.loads((warm_start / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang
    layers = drafter_layers(warm_start, 8)
    assert (layers.aux, layers.final, layers.ids) == ((2, 4, 5), 8, (2, 4, 5, 8))  # SGLang + 1
    assert "SGLang" in layers.source
    with pytest.raises(FileNotFoundError, match="materialize drafter_checkpoint first"):
        drafter_layers(tmp_path / "missing", 8)
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [4, 1, 8]  # 9: past the target
    (warm_start / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterValidationError, match="eagle_aux_hidden_state_layer_ids"):
        drafter_layers(warm_start, 8)
