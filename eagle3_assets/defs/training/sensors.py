"""Extraction, training and evaluation on their own: each batch's hidden states once its
generations exist, the drafter once every registered batch is extracted, its evaluation once
it is exported. Opt-in (EAGLE3_AUTOMATION=1), because on a node where the serving vLLM holds
every GPU these steps have nowhere to run until serving stops."""

import dagster as dg


def drafter_automation(
    running: bool, streamed: bool = False
) -> dg.AutomationConditionSensorDefinition:
    """The sensor, running from the start when the deployment says so (EAGLE3_AUTOMATION).
    With streamed hidden states it never requests hidden_states: nothing is stored."""
    steps = ("eagle3_drafter", "drafter_evaluation")
    return dg.AutomationConditionSensorDefinition(
        "drafter_automation",
        target=dg.AssetSelection.assets(*steps if streamed else ("hidden_states", *steps)),
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
