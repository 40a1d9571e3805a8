"""A batch that failed a blocking check goes no further: the blocking check stops only its own
run, so the automation must not request the consumer on the next tick, and a consumer started
by hand must leave the batch out (or refuse) and say which batch, which check, what to do.

On a real instance with the session's vLLM: two batches extracted, one then re-materialized
from a shard holding NaNs (an extraction that wrote them and recorded their checksum); later
a batch of generations that fails its own check."""

import json
from pathlib import Path

import dagster as dg
import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3_assets.definitions import resources_from_env
from eagle3_assets.defs.checkpoint.assets import drafter_checkpoint
from eagle3_assets.defs.generation.assets import synthetic_generations
from eagle3_assets.defs.hidden_states.assets import hidden_states
from eagle3_assets.defs.training.assets import eagle3_drafter
from eagle3_assets.lib.core.atomic_files import file_sha256

pytestmark = pytest.mark.vllm
GOOD, BAD, UNCHECKED = "batch-00000", "batch-00001", "batch-00002"
DRAFTER, HIDDEN = dg.AssetKey("eagle3_drafter"), dg.AssetKey("hidden_states")


def poison_first_shard(batch_dir: Path) -> None:
    """NaN in the first shard's aux scales, its checksum recorded as the extraction would."""
    manifest = json.loads((batch_dir / "manifest.json").read_text())
    name = next(iter(manifest["shards"]))
    path = batch_dir / name
    with safe_open(str(path), framework="pt") as shard:
        header = shard.metadata()
    tensors = load_file(path)
    tensors["aux_scale"][0] = float("nan")
    save_file(tensors, path, metadata=header)
    manifest["shards"][name]["sha256"] = file_sha256(path)
    (batch_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def test_a_batch_that_failed_its_checks_is_never_trained_on(pipeline_env, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    env = {**pipeline_env, "EAGLE3_TRAIN_STEPS": "2", "EAGLE3_TRAIN_NPROC": "1"}
    env |= {"EAGLE3_TTT_LENGTH": "2", "EAGLE3_TRAIN_BATCH_SIZE": "2"}
    resources = resources_from_env(env)
    data = Path(env["EAGLE3_DATA_ROOT"])
    instance = dg.DagsterInstance.ephemeral()
    graph = dg.Definitions(
        assets=[drafter_checkpoint, synthetic_generations, hidden_states, eagle3_drafter],
        resources=resources,
    )

    def run(asset: dg.AssetsDefinition, partition: str | None = None, **overrides):
        return dg.materialize(
            [asset],
            partition_key=partition,
            resources={**resources, **overrides},
            instance=instance,
            raise_on_error=False,
        )

    assert run(drafter_checkpoint).success
    instance.add_dynamic_partitions("sample_batches", [GOOD, BAD])
    cursor = dg.evaluate_automation_conditions(defs=graph, instance=instance).cursor  # daemon on
    for batch in (GOOD, BAD):
        assert run(synthetic_generations, batch).success and run(hidden_states, batch).success
    clean = {p.name: p.read_bytes() for p in (data / "hidden_states" / BAD).iterdir()}

    poison_first_shard(data / "hidden_states" / BAD)
    failed = run(hidden_states, BAD)  # the shard is reused (its checksum matches), then checked
    assert not failed.success
    checks = {c.check_name: c.passed for c in failed.get_asset_check_evaluations()}
    assert checks == {
        "manifest_complete": True,
        "values_finite": False,
        "token_ids_match_generations": True,
        "loss_mask_fraction": True,
    }
    assert instance.get_materialized_partitions(HIDDEN) == {GOOD, BAD}  # on disk, materialized

    # the daemon's next tick: every batch is materialized and one was updated, yet no training
    tick = dg.evaluate_automation_conditions(defs=graph, instance=instance, cursor=cursor)
    cursor = tick.cursor
    assert tick.get_requested_partitions(DRAFTER) == set()
    assert tick.total_requested == 0

    # started by hand (the UI's Materialize): trains on the good batch only, and says why
    trained = run(eagle3_drafter)
    assert trained.success
    (event,) = trained.get_asset_materialization_events()
    meta = {k: v.value for k, v in event.materialization.metadata.items()}
    expected = (
        f"hidden_states[{BAD}] left out: values_finite failed (latest evaluation); "
        f"re-materialize hidden_states[{BAD}] after fixing the NaN/Inf states"
    )
    assert meta["batches"] == GOOD and meta["excluded_batches"].startswith(expected)
    assert meta["steps"] == 2
    run_file = json.loads((Path(meta["export"]).parent / "run.json").read_text())
    assert run_file["batch_dirs"] == [str(data / "hidden_states" / GOOD)]
    logs = [r.user_message for r in instance.all_logs(trained.run_id)]
    assert sum(m.startswith(expected) for m in logs) == 1

    tick = dg.evaluate_automation_conditions(defs=graph, instance=instance, cursor=cursor)
    cursor = tick.cursor
    assert tick.total_requested == 0  # the drafter was just materialized by hand

    # the batch re-extracted clean passes, and the next tick asks for the drafter again
    for name, payload in clean.items():
        (data / "hidden_states" / BAD / name).write_bytes(payload)
    assert run(hidden_states, BAD).success
    tick = dg.evaluate_automation_conditions(defs=graph, instance=instance, cursor=cursor)
    cursor = tick.cursor
    assert tick.get_requested_partitions(DRAFTER) == {None}

    # generations that fail their own check (every answer cut at 4 tokens) are not extracted
    instance.add_dynamic_partitions("sample_batches", [UNCHECKED])
    short = resources_from_env({**env, "EAGLE3_MAX_TOKENS": "4"})["generation"]
    generated = run(synthetic_generations, UNCHECKED, generation=short)
    assert not generated.success
    quality = {c.check_name: c.passed for c in generated.get_asset_check_evaluations()}
    assert quality == {"one_row_per_prompt": True, "response_quality": False}
    tick = dg.evaluate_automation_conditions(defs=graph, instance=instance, cursor=cursor)
    assert tick.get_requested_partitions(HIDDEN) == set()
    refused = run(hidden_states, UNCHECKED)
    assert not refused.success
    (failure,) = [e for e in refused.all_events if e.is_step_failure]
    assert (
        f"synthetic_generations[{UNCHECKED}] left out: response_quality failed (latest "
        f"evaluation); re-materialize synthetic_generations[{UNCHECKED}], then "
        f"hidden_states[{UNCHECKED}]"
    ) in failure.step_failure_data.error.message
    assert not (data / "hidden_states" / UNCHECKED).exists()
