"""drafter_checkpoint through Dagster: the real hub client, offline, reading a local cache."""

import dagster as dg
import pytest

from eagle3_assets.defs.checkpoint.assets import drafter_checkpoint
from eagle3_assets.localdev.hub import LOCAL_DRAFTER_REPO
from eagle3_assets.resources import DrafterHub, Storage, TargetModel


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def resources(test_hub, tmp_path, target_dir, revision="main"):
    return {
        "drafter_hub": DrafterHub(
            repo_id=LOCAL_DRAFTER_REPO, revision=revision, cache_dir=str(test_hub)
        ),
        "target": TargetModel(path=str(target_dir)),
        "storage": Storage(root=str(tmp_path)),
    }


def test_downloads_and_validates(test_world, test_hub, tmp_path, offline):
    result = dg.materialize(
        [drafter_checkpoint],
        resources=resources(test_hub, tmp_path, test_world.target_v2),
    )
    assert result.success
    (event,) = result.get_asset_materialization_events()
    meta = {k: v.value for k, v in event.materialization.metadata.items()}
    assert meta["repo_id"] == LOCAL_DRAFTER_REPO and len(meta["revision"]) == 40
    assert meta["hidden_size"] == 64 and meta["vocab_size"] == 1024
    assert meta["draft_vocab_size"] == 256
    assert meta["aux_layer_ids_vllm"] == "[2, 4, 5]"  # nested SGLang [1, 3, 4], converted
    assert meta["aux_layer_ids_sglang"] == "[1, 3, 4]"
    assert meta["parameters"] > 0 and meta["bytes"] > 0
    downloaded = sorted(p.name for p in (tmp_path / "drafter" / "warm_start").iterdir())
    assert downloaded == ["config.json", "model.safetensors"]  # never training_state.pt


def test_unknown_revision_fails_with_repo_and_revision(test_world, test_hub, tmp_path, offline):
    result = dg.materialize(
        [drafter_checkpoint],
        resources=resources(test_hub, tmp_path, test_world.target_v2, "v9"),
        raise_on_error=False,
    )
    assert not result.success
    message = str(result.get_step_failure_events()[0].event_specific_data.error)
    assert LOCAL_DRAFTER_REPO in message and "'v9'" in message


def test_shape_mismatch_names_field_expected_and_found(test_world, test_hub, tmp_path, offline):
    wrong_target = tmp_path / "wrong"
    wrong_target.mkdir()
    config = (test_world.target_v2 / "config.json").read_text()
    (wrong_target / "config.json").write_text(
        config.replace('"hidden_size": 64', '"hidden_size": 128')
    )
    result = dg.materialize(
        [drafter_checkpoint],
        resources=resources(test_hub, tmp_path, wrong_target),
        raise_on_error=False,
    )
    assert not result.success
    message = str(result.get_step_failure_events()[0].event_specific_data.error)
    assert "hidden_size: expected 128 (target), found 64" in message
