"""Extraction, training and evaluation on their own: each batch's hidden states once its
generations exist, the drafter once every registered batch is extracted, its evaluation once
it is exported. Opt-in (EAGLE3_AUTOMATION=1), because on a node where the serving vLLM holds
every GPU these steps have nowhere to run until serving stops."""

import dagster as dg


def eager_on_checked_inputs() -> dg.AutomationCondition:
    """`eager()`, except while a dependency's latest blocking check evaluation failed: a run's
    blocking checks only stop that run, so without this the next automated run would consume
    the bad data. Per batch where the dependency's checks are partitioned (hidden_states,
    synthetic_generations); eagle3_drafter, reading every batch, waits until the failed batch
    is re-materialized and passes. The assets also refuse failed batches when run by hand."""
    failed = dg.AutomationCondition.any_checks_match(
        dg.AutomationCondition.check_failed(), blocking_only=True
    )
    return dg.AutomationCondition.eager() & ~dg.AutomationCondition.any_deps_match(
        failed
    ).with_label("any_deps_blocking_check_failed")


def drafter_automation(running: bool) -> dg.AutomationConditionSensorDefinition:
    """The sensor, running from the start when the deployment says so (EAGLE3_AUTOMATION)."""
    return dg.AutomationConditionSensorDefinition(
        "drafter_automation",
        target=dg.AssetSelection.assets("hidden_states", "eagle3_drafter", "drafter_evaluation"),
        minimum_interval_seconds=30,
        default_status=dg.DefaultSensorStatus.RUNNING
        if running
        else dg.DefaultSensorStatus.STOPPED,
        description="Requests hidden_states[batch] when synthetic_generations[batch] and the "
        "drafter checkpoint are materialized, eagle3_drafter when no registered batch lacks "
        "hidden states, drafter_evaluation when eagle3_drafter is updated; never while an "
        "input's latest blocking check failed (re-materialize that batch: the next tick sees "
        "it). Turn it on where an accelerator (or, in the miniature, the CPU) is free while the "
        "server generates.",
    )
