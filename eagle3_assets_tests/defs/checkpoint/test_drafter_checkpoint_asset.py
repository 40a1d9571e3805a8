"""drafter_checkpoint through Dagster: the real hub client, offline, reading a local cache."""

import json
import shutil
from pathlib import Path

import dagster as dg
import pytest
from safetensors.torch import load_file

from eagle3_assets.definitions import resources_from_env
from eagle3_assets.defs.checkpoint.assets import drafter_checkpoint
from eagle3_assets.defs.checkpoint.resources import DrafterHub
from eagle3_assets.defs.generation.assets import synthetic_generations
from eagle3_assets.defs.hidden_states.assets import hidden_states
from eagle3_assets.localdev.hub import (
    LOCAL_DRAFTER_REPO,
    make_untrained_drafter,
    publish_to_hub_cache,
)
from eagle3_assets.resources import Storage, TargetModel
from eagle3_assets_tests.lib.checkpoint.layouts import speculators_dir

SPECULATORS_REPO = "local/target-v1-speculators-eagle3"


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


# The world drafter's nested [2, 4, 5] reads two ways; it was trained on the SGLang reading.
# These tests reach no server, so they say so, as a user would (the probe has its own test).
TRAINED_ON = [3, 5, 6]


def resources(test_hub, tmp_path, target_dir, revision="main"):
    return resources_from_env({}) | {
        "drafter_hub": DrafterHub(
            repo_id=LOCAL_DRAFTER_REPO,
            revision=revision,
            cache_dir=str(test_hub),
            aux_layer_ids=TRAINED_ON,
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
    assert meta["aux_layer_ids_vllm"] == TRAINED_ON  # pinned top-level, vLLM convention
    assert meta["aux_layer_ids_sglang"] == [2, 4, 5]
    assert meta["aux_layer_ids_decided_by"] == "EAGLE3_AUX_LAYER_IDS"
    assert meta["aux_layer_ids_published_nested"] == [2, 4, 5]
    warm_start = tmp_path / "drafter" / "warm_start"
    config = json.loads((warm_start / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == TRAINED_ON
    downloaded = sorted(p.name for p in warm_start.iterdir())
    assert downloaded == ["config.json", "model.safetensors"]  # never training_state.pt
    assert meta["bytes"] == sum(p.stat().st_size for p in warm_start.iterdir())
    weights = load_file(warm_start / "model.safetensors")
    trained = [t for name, t in weights.items() if name not in ("d2t", "t2d")]
    assert meta["parameters"] == sum(t.numel() for t in trained)
    rows = {r.data["tensor"]: r.data for r in meta["tensors"].records}
    assert sorted(rows) == sorted(weights)
    assert rows["fc.weight"]["shape"] == str(list(weights["fc.weight"].shape))


def test_a_speculators_drafter_downloads_and_validates(test_world, tmp_path, offline):
    """speculators 0.9.0's layout used to fail here with 17 problems though training read it."""
    specforge = make_untrained_drafter(test_world.target_v1, tmp_path / "specforge", 256, seed=0)
    repo = speculators_dir(specforge, tmp_path / "repo")
    cache = tmp_path / "hub"
    publish_to_hub_cache(repo, cache, SPECULATORS_REPO)
    hub = DrafterHub(repo_id=SPECULATORS_REPO, revision="main", cache_dir=str(cache))
    result = dg.materialize(
        [drafter_checkpoint],
        resources={
            **resources(cache, tmp_path, test_world.target_v2),
            "drafter_hub": hub,
        },
    )
    assert result.success
    (event,) = result.get_asset_materialization_events()
    meta = {k: v.value for k, v in event.materialization.metadata.items()}
    assert meta["layout"] == "speculators"
    assert meta["aux_layer_ids_vllm"] == [2, 4, 5]  # top-level, vLLM convention: no probe
    assert meta["aux_layer_ids_sglang"] == [1, 3, 4]
    assert "aux_layer_ids_decided_by" not in meta
    assert (meta["hidden_size"], meta["vocab_size"], meta["draft_vocab_size"]) == (64, 1024, 256)
    rows = {r.data["tensor"]: r.data for r in meta["tensors"].records}
    assert rows["layers.0.self_attn.q_proj.weight"] == {
        "tensor": "layers.0.self_attn.q_proj.weight",
        "dtype": "F32",
        "shape": "[64, 128]",
    }


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


def test_an_unchanged_revision_is_not_materialized_again(test_world, test_hub, tmp_path, offline):
    """Every serving start requests the checkpoint; the same revision again records nothing,
    so the eager automation re-extracts no batch. A new revision is a new materialization."""
    hub = tmp_path / "hub"
    shutil.copytree(test_hub, hub, symlinks=True)  # the session's hub stays as it is
    resources_ = resources(hub, tmp_path, test_world.target_v2)
    graph = dg.Definitions(
        assets=[drafter_checkpoint, synthetic_generations, hidden_states],
        resources=resources_from_env({}) | resources_,
    )
    key = dg.AssetKey("drafter_checkpoint")
    batch = "batch-00000"
    with dg.instance_for_test() as instance:

        def materialize() -> dg.ExecuteInProcessResult:
            return dg.materialize([drafter_checkpoint], resources=resources_, instance=instance)

        def revisions() -> list[str]:
            records = instance.fetch_materializations(key, limit=10).records
            return [r.asset_materialization.metadata["revision"].value for r in records]

        first = materialize()
        (sha,) = revisions()
        # a batch generated and extracted after it: the automation has nothing to do...
        instance.add_dynamic_partitions("sample_batches", [batch])
        for asset in ("synthetic_generations", "hidden_states"):
            instance.report_runless_asset_event(dg.AssetMaterialization(asset, partition=batch))
        cursor = dg.evaluate_automation_conditions(defs=graph, instance=instance).cursor

        second = materialize()  # ...and a serving restart's launch run changes nothing
        assert second.success and second.get_asset_materialization_events() == []
        assert revisions() == [sha]
        logs = [r.user_message for r in instance.all_logs(second.run_id)]
        unchanged = (
            f"unchanged: {LOCAL_DRAFTER_REPO}@{sha[:12]} already materialized by run "
            f"{first.run_id[:8]}"
        )
        assert sum(m.startswith(unchanged) for m in logs) == 1, logs
        tick = dg.evaluate_automation_conditions(defs=graph, instance=instance, cursor=cursor)
        assert tick.get_requested_partitions(dg.AssetKey("hidden_states")) == set()
        assert tick.total_requested == 0

        # a new revision of the drafter (its config edited) is a new materialization
        repo = tmp_path / "new-revision"
        shutil.copytree(hub_snapshot(hub, sha), repo)  # copies the files the links point to
        config = json.loads((repo / "config.json").read_text())
        (repo / "config.json").write_text(json.dumps({**config, "note": "v2"}))
        new_sha = publish_to_hub_cache(repo, hub, LOCAL_DRAFTER_REPO)
        third = materialize()
        assert len(third.get_asset_materialization_events()) == 1
        assert revisions() == [new_sha, sha] and new_sha != sha
        tick = dg.evaluate_automation_conditions(defs=graph, instance=instance, cursor=tick.cursor)
        assert tick.get_requested_partitions(dg.AssetKey("hidden_states")) == {batch}

        # with a consumer in the same run it records again: a consumer whose dependency
        # records nothing would be skipped
        both = dg.materialize(
            [drafter_checkpoint, consumer], resources=resources_, instance=instance
        )
        materialized = [e.asset_key for e in both.get_asset_materialization_events()]
        assert materialized == [key, dg.AssetKey("consumer")]


@dg.asset(deps=[drafter_checkpoint])
def consumer() -> dg.MaterializeResult:
    """Something that reads the checkpoint, selected in one run with it (as from the UI)."""
    return dg.MaterializeResult()


def hub_snapshot(hub: Path, sha: str) -> Path:
    """The folder of revision `sha` of the local drafter in a hub cache."""
    (snapshot,) = hub.glob(f"models--*/snapshots/{sha}")
    return snapshot
