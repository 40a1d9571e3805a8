"""The new-batch sensor and the backfill schedule against a real (temporary) instance."""

import json

import dagster as dg
import pytest

from eagle3_assets.definitions import defs
from eagle3_assets.defs.generation.resources import PromptPool
from eagle3_assets.defs.generation.sensors import new_batches_sensor
from eagle3_assets.partitions import sample_batches


def write_pool(path, count: int) -> None:
    lines = [
        json.dumps({"prompt_id": f"p{i:03d}", "messages": [{"role": "user", "content": f"q{i}"}]})
        for i in range(count)
    ]
    path.write_text("\n".join(lines) + "\n")


def observe_server(instance: dg.DagsterInstance, state: str) -> None:
    """What the readiness sensor records; the batch sensors read it instead of probing."""
    instance.report_runless_asset_event(
        dg.AssetObservation(asset_key="vllm_server", metadata={"state": state})
    )


def apply(instance: dg.DagsterInstance, result: dg.SensorResult) -> None:
    """What the daemon does with a sensor's partition requests."""
    for request in result.dynamic_partitions_requests:
        instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))


@pytest.fixture
def instance():
    with dg.instance_for_test() as instance:
        yield instance


def tick(instance, pool: PromptPool, cursor=None):
    context = dg.build_sensor_context(
        instance=instance, cursor=cursor, resources={"prompt_pool": pool}
    )
    return new_batches_sensor(context)


def test_registers_full_batches_as_the_pool_grows(instance, tmp_path):
    pool = PromptPool(path=str(tmp_path / "pool.jsonl"), batch_size=10)
    write_pool(tmp_path / "pool.jsonl", 25)
    first = tick(instance, pool)
    (request,) = first.dynamic_partitions_requests
    assert list(request.partition_keys) == ["batch-00000", "batch-00001"]  # 5 left: not full
    assert first.cursor == "20"
    assert first.run_requests == []  # server not observed ready: register only
    apply(instance, first)

    assert isinstance(tick(instance, pool, first.cursor), dg.SkipReason)  # idempotent

    write_pool(tmp_path / "pool.jsonl", 41)
    observe_server(instance, "ready")
    grown = tick(instance, pool, first.cursor)
    assert [list(r.partition_keys) for r in grown.dynamic_partitions_requests] == [
        ["batch-00002", "batch-00003"]
    ]
    assert [r.partition_key for r in grown.run_requests] == ["batch-00002", "batch-00003"]
    assert grown.cursor == "40"
    apply(instance, grown)
    assert sorted(instance.get_dynamic_partitions(sample_batches.name)) == [
        f"batch-0000{i}" for i in range(4)
    ]
    # A lost cursor re-reads the registered partitions: nothing is registered twice.
    again = tick(instance, pool, cursor=None)
    assert again.dynamic_partitions_requests == [] and again.run_requests == []


def materialize_batch(instance, key: str) -> None:
    instance.report_runless_asset_event(
        dg.AssetMaterialization(asset_key="synthetic_generations", partition=key)
    )


def schedule_tick(instance):
    """A tick as the daemon evaluates it (its invariants included): the run requests, or a
    SkipReason."""
    repository = defs().get_repository_def()
    context = dg.build_schedule_context(instance=instance, repository_def=repository)
    data = repository.get_schedule_def("batch_backfill_schedule").evaluate_tick(context)
    return dg.SkipReason(data.skip_message) if data.skip_message else data.run_requests


def test_backfill_schedule_requests_registered_unmaterialized_batches(instance):
    instance.add_dynamic_partitions(
        sample_batches.name, ["batch-00000", "batch-00001", "batch-00002"]
    )
    materialize_batch(instance, "batch-00001")
    assert isinstance(schedule_tick(instance), dg.SkipReason)  # no ready server: no runs

    observe_server(instance, "ready")
    requests = schedule_tick(instance)
    assert [r.partition_key for r in requests] == ["batch-00000", "batch-00002"]

    running = dg.DagsterRun(
        job_name="generate_batch",
        status=dg.DagsterRunStatus.STARTED,
        tags={"dagster/partition": "batch-00002"},
    )
    instance.add_run(running)
    assert [r.partition_key for r in schedule_tick(instance)] == ["batch-00000"]  # not twice

    materialize_batch(instance, "batch-00000")
    materialize_batch(instance, "batch-00002")
    assert isinstance(schedule_tick(instance), dg.SkipReason)  # all done: idempotent

    observe_server(instance, "dead")
    instance.add_dynamic_partitions(sample_batches.name, ["batch-00003"])
    assert isinstance(schedule_tick(instance), dg.SkipReason)
