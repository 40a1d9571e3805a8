"""The batch a new server start generates: the first registered one not done and not in flight,
so a launch after a crash never generates what the dead run's retry is resuming."""

import dagster as dg
from dagster._core.storage.tags import PARTITION_NAME_TAG

from eagle3_assets.partitions import next_batch

BATCHES = ["batch-00000", "batch-00001", "batch-00002"]


def run_on(instance: dg.DagsterInstance, batch: str, status: dg.DagsterRunStatus) -> None:
    instance.add_run(
        dg.DagsterRun(job_name="generate_batch", status=status, tags={PARTITION_NAME_TAG: batch})
    )


def test_a_batch_a_run_is_generating_is_not_launched_again() -> None:
    with dg.instance_for_test() as instance:
        assert next_batch(instance) == (
            "batch-00000",
            [dg.AddDynamicPartitionsRequest("sample_batches", ["batch-00000"])],
        )
        instance.add_dynamic_partitions("sample_batches", BATCHES)
        assert next_batch(instance) == ("batch-00000", [])
        run_on(instance, "batch-00000", dg.DagsterRunStatus.NOT_STARTED)  # a retry, say
        run_on(instance, "batch-00001", dg.DagsterRunStatus.STARTED)
        run_on(instance, "batch-00002", dg.DagsterRunStatus.FAILURE)  # failed for good: free
        assert next_batch(instance) == ("batch-00002", [])
        run_on(instance, "batch-00002", dg.DagsterRunStatus.STARTING)
        assert next_batch(instance) == (None, [])  # the launch run downloads the drafter only
