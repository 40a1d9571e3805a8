"""Partitions shared across domains: synthetic generations and hidden states are cut into the
same sample batches, registered as the prompt pool grows."""

from collections.abc import Sequence

import dagster as dg

from eagle3_assets.lib.generation.conversations import batch_key

sample_batches = dg.DynamicPartitionsDefinition(name="sample_batches")


def pending_batches(instance: dg.DagsterInstance) -> list[str]:
    """Registered batches without a synthetic_generations materialization, in batch order."""
    registered = sorted(instance.get_dynamic_partitions(sample_batches.name))
    done = instance.get_materialized_partitions(dg.AssetKey("synthetic_generations"))
    return [key for key in registered if key not in done]


def next_batch(
    instance: dg.DagsterInstance,
) -> tuple[str | None, list[dg.AddDynamicPartitionsRequest]]:
    """The batch to generate next, registering batch-00000 if nothing is registered yet."""
    if not instance.get_dynamic_partitions(sample_batches.name):
        return batch_key(0), [sample_batches.build_add_request([batch_key(0)])]
    pending = pending_batches(instance)
    return (pending[0] if pending else None), []


def latest_check_statuses(
    instance: dg.DagsterInstance, asset: str, checks: Sequence[str], batches: Sequence[str]
) -> dict[str, dict[str, str]]:
    """batch -> check -> its latest evaluation for that batch: "passed", "failed", "not
    evaluated" or "planned" (a run has yet to evaluate it). Our assets emit their checks with
    each materialization, so the latest evaluation is always that of the latest data. The
    checks must be partitioned by sample_batches (a check spec without partitions_def records
    no batch, and every batch reads "not evaluated")."""
    from dagster._core.storage.asset_check_execution_record import (
        AssetCheckExecutionRecordStatus as Status,
    )

    keys = [dg.AssetCheckKey(dg.AssetKey(asset), name) for name in checks]
    statuses = {batch: dict.fromkeys(checks, "not evaluated") for batch in batches}
    if not batches:
        return statuses
    storage = instance.event_log_storage
    for info in storage.get_asset_check_partition_info(keys, partition_keys=list(batches)):
        if info.partition_key not in statuses:
            continue
        status = info.latest_execution_status
        if status == Status.SUCCEEDED:
            found = "passed"
        else:
            found = "failed" if status == Status.FAILED else "planned"
        statuses[info.partition_key][info.check_key.name] = found
    return statuses
