"""Partitions shared across domains: synthetic generations and hidden states are cut into the
same sample batches, registered as the prompt pool grows."""

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
