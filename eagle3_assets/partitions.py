"""Partitions shared across domains: synthetic generations and hidden states are cut into the
same sample batches, registered as the prompt pool grows; and whether a batch's checks let
the steps after it consume it."""

from collections.abc import Sequence

import dagster as dg

from eagle3_assets.lib.generation.conversations import batch_key

sample_batches = dg.DynamicPartitionsDefinition(name="sample_batches")


def pending_batches(instance: dg.DagsterInstance) -> list[str]:
    """Registered batches without a synthetic_generations materialization, in batch order."""
    registered = sorted(instance.get_dynamic_partitions(sample_batches.name))
    done = instance.get_materialized_partitions(dg.AssetKey("synthetic_generations"))
    return [key for key in registered if key not in done]


ACTIVE = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
]


def batches_in_flight(instance: dg.DagsterInstance) -> set[str]:
    """Batches some queued or running run is generating already (any job)."""
    runs = instance.get_runs(filters=dg.RunsFilter(statuses=ACTIVE))
    return {run.tags["dagster/partition"] for run in runs if "dagster/partition" in run.tags}


def next_batch(
    instance: dg.DagsterInstance,
) -> tuple[str | None, list[dg.AddDynamicPartitionsRequest]]:
    """The batch to generate next, registering batch-00000 if nothing is registered yet; never
    one a run is generating already (after a crash, the dead run's retry resumes it)."""
    if not instance.get_dynamic_partitions(sample_batches.name):
        return batch_key(0), [sample_batches.build_add_request([batch_key(0)])]
    busy = batches_in_flight(instance)
    pending = [key for key in pending_batches(instance) if key not in busy]
    return (pending[0] if pending else None), []


def latest_check_statuses(
    instance: dg.DagsterInstance, asset: str, checks: Sequence[str], batches: Sequence[str]
) -> dict[str, dict[str, str]]:
    """batch -> check -> "passed", "failed" or "not evaluated": the checks evaluated with the
    batch's latest materialization. Our assets emit their checks in the step that materializes
    the batch (one batch per run), so that run's evaluations are the batch's, whatever the run
    was launched by (the daemon, a backfill, the UI)."""
    statuses = {batch: dict.fromkeys(checks, "not evaluated") for batch in batches}
    key = dg.AssetKey(asset)
    for batch in batches:
        latest = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=key, asset_partitions=[batch]), limit=1
        ).records
        if not latest:
            continue
        evaluations = instance.all_logs(
            latest[0].run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION
        )
        for entry in evaluations:
            evaluation = entry.dagster_event.event_specific_data
            if evaluation.asset_key == key and evaluation.check_name in statuses[batch]:
                statuses[batch][evaluation.check_name] = "passed" if evaluation.passed else "failed"
    return statuses


def eager_on_checked_inputs() -> dg.AutomationCondition:
    """`eager()`, except while a dependency's latest blocking check evaluation failed: a run's
    blocking checks only stop that run, so without this the next automated run would consume
    the bad data. Per batch where the dependency's checks are partitioned (hidden_states,
    synthetic_generations); eagle3_drafter, reading every batch, waits until the failed batch
    is re-materialized and passes. The assets also refuse failed batches when run by hand."""
    failed = dg.AutomationCondition.any_checks_match(
        dg.AutomationCondition.check_failed(), blocking_only=True
    )
    # eager() never asks again for a step whose run failed for good (its retries spent): it
    # is asked once more on the first evaluation after `request_failed_steps_again`
    again = (
        dg.AutomationCondition.execution_failed()
        & dg.AutomationCondition.initial_evaluation()
        & ~dg.AutomationCondition.any_deps_missing()
        & ~dg.AutomationCondition.any_deps_in_progress()
        & ~dg.AutomationCondition.in_progress()
    ).with_label("failed, asked again")
    return (dg.AutomationCondition.eager() | again) & ~dg.AutomationCondition.any_deps_match(
        failed
    ).with_label("any_deps_blocking_check_failed")


def request_failed_steps_again(instance: dg.DagsterInstance) -> list[str]:
    """The user's request to go on (`make demo` again, or `dagster sensor cursor --delete` on
    each automation sensor): every automation sensor starts afresh, so its next tick asks once
    more for each step whose latest run failed, through the sensor's own request (its tags,
    pools and run retries). Returns the sensors' names."""
    from dagster._core.definitions.sensor_definition import SensorType
    from dagster._core.scheduler.instigation import InstigatorType

    automation = {SensorType.AUTO_MATERIALIZE, SensorType.AUTOMATION}  # by where it evaluates
    states = instance.all_instigator_state(instigator_type=InstigatorType.SENSOR)
    cleared = [s for s in states if s.instigator_data.sensor_type in automation]
    for state in cleared:
        instance.update_instigator_state(
            state.with_data(state.instigator_data._replace(cursor=None))
        )
    return sorted(state.name for state in cleared)
