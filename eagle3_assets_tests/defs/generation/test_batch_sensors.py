"""The new-batch sensor and the backfill schedule against a real (temporary) instance."""

import json

import dagster as dg
import pytest

from eagle3_assets.definitions import defs
from eagle3_assets.defs.generation.resources import PromptPool
from eagle3_assets.defs.generation.sensors import new_batches_sensor
from eagle3_assets.localdev.hub import publish_to_hub_cache
from eagle3_assets.partitions import sample_batches
from eagle3_assets.resources import Storage


def write_pool(path, count: int, start: int = 0) -> None:
    lines = [
        json.dumps({"prompt_id": f"p{i:03d}", "messages": [{"role": "user", "content": f"q{i}"}]})
        for i in range(start, count)
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


def tick(instance, pool: PromptPool, cursor=None, storage: Storage | None = None):
    context = dg.build_sensor_context(
        instance=instance,
        cursor=cursor,
        resources={"prompt_pool": pool, "storage": storage or Storage(root="unused")},
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


def sensor_log(capfd) -> dict[str, list[str]]:
    """The sensor's log lines since the last call, by level, as the daemon's log shows them."""
    lines = capfd.readouterr().err.splitlines()
    levels = {"INFO": [], "WARNING": []}
    for line in lines:
        for level, messages in levels.items():
            if f" - dagster - {level} - " in line:
                messages.append(line.split(f" - dagster - {level} - ", 1)[1])
    return levels


def test_registers_batches_from_files_dropped_in_the_inbox(instance, tmp_path, capfd):
    inbox, storage = tmp_path / "inbox", Storage(root=str(tmp_path / "data"))
    inbox.mkdir()
    write_pool(tmp_path / "pool.jsonl", 10)
    pool = PromptPool(
        path=str(tmp_path / "pool.jsonl"), batch_size=10, inbox=str(inbox),
        inbox_heldout_fraction=0.2,
    )  # fmt: skip
    write_pool(inbox / "0001.jsonl", 40, start=5)  # p005..p009 are the pool's
    (inbox / "0002.jsonl").write_text('{"prompt_id": "x", "messages": \n')
    observe_server(instance, "ready")

    first = tick(instance, pool, storage=storage)

    ledger = pool.open_inbox(storage).ledger()
    assert [(e.name, e.records, e.duplicates) for e in ledger] == [
        ("0001.jsonl", 35, 5),
        ("0002.jsonl", 0, 0),
    ]
    added, held = ledger[0].added, ledger[0].held_out
    assert added + held == 30
    full = (10 + added) // 10
    (request,) = first.dynamic_partitions_requests
    assert list(request.partition_keys) == [f"batch-0000{i}" for i in range(full)]
    assert [r.partition_key for r in first.run_requests] == list(request.partition_keys)
    log = sensor_log(capfd)
    (warning,) = log["WARNING"]
    assert warning.startswith(f"0002.jsonl: skipped, {inbox / '0002.jsonl'}:1: not JSON")
    assert (
        f"0001.jsonl: 35 prompts, {added} added for training, {held} held out for evaluation, "
        "5 duplicates"
    ) in log["INFO"]
    apply(instance, first)
    batched = [c.prompt_id for k in request.partition_keys for c in pool.batch(k, storage)]
    assert batched[:10] == [f"p{i:03d}" for i in range(10)]  # the pool file first
    evaluation = pool.open_inbox(storage).evaluation_sets()
    assert not {c.prompt_id for rows in evaluation.values() for c in rows} & set(batched)

    again = tick(instance, pool, first.cursor, storage=storage)  # the bad file is not retried
    assert isinstance(again, dg.SkipReason)
    assert sensor_log(capfd)["WARNING"] == []


def test_registers_batches_from_new_revisions_of_a_hub_dataset(
    instance, tmp_path, monkeypatch, capfd
):
    """EAGLE3_INBOX=hf://datasets/...: each tick reads the dataset's newest revision (the real
    client, offline, from a local hub cache); a new revision's rows become new batches."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo, cache, storage = tmp_path / "repo", tmp_path / "hub", Storage(root=str(tmp_path / "d"))
    repo.mkdir()
    write_pool(tmp_path / "pool.jsonl", 10)
    pool = PromptPool(
        path=str(tmp_path / "pool.jsonl"), batch_size=10, inbox="hf://datasets/local/traffic",
        cache_dir=str(cache), inbox_heldout_fraction=0.0,
    )  # fmt: skip
    write_pool(repo / "traffic.jsonl", 30, start=10)
    first_sha = publish_to_hub_cache(repo, cache, "local/traffic", repo_type="dataset")
    observe_server(instance, "ready")

    first = tick(instance, pool, storage=storage)
    (request,) = first.dynamic_partitions_requests
    assert list(request.partition_keys) == ["batch-00000", "batch-00001", "batch-00002"]
    assert f"traffic.jsonl@{first_sha[:12]}: 20 prompts" in sensor_log(capfd)["INFO"][0]
    apply(instance, first)
    assert isinstance(tick(instance, pool, first.cursor, storage=storage), dg.SkipReason)

    write_pool(repo / "traffic.jsonl", 45, start=10)  # the next revision: 15 more rows
    second_sha = publish_to_hub_cache(repo, cache, "local/traffic", repo_type="dataset")
    second = tick(instance, pool, first.cursor, storage=storage)
    (request,) = second.dynamic_partitions_requests
    assert list(request.partition_keys) == ["batch-00003"]  # p030..p039; p040..p044 wait
    assert [c.prompt_id for c in pool.batch("batch-00003", storage)] == [
        f"p{i:03d}" for i in range(30, 40)
    ]
    (entry,) = [e for e in pool.open_inbox(storage).ledger() if e.revision == second_sha]
    assert (entry.records, entry.duplicates, entry.added) == (35, 20, 15)


def materialize_batch(instance, key: str) -> None:
    instance.report_runless_asset_event(
        dg.AssetMaterialization(asset_key="synthetic_generations", partition=key)
    )


def schedule_tick(instance):
    """A tick as the daemon evaluates it (its invariants included): the run requests, or a
    SkipReason."""
    repository = defs().get_repository_def()
    with dg.build_schedule_context(instance=instance, repository_def=repository) as context:
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
