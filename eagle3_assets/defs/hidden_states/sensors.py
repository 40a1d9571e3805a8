"""Extract each batch as soon as its generations exist: opt-in, because on a node where the
serving vLLM holds every GPU the extraction has nowhere to run until serving stops."""

import dagster as dg

hidden_states_automation = dg.AutomationConditionSensorDefinition(
    "hidden_states_automation",
    target=dg.AssetSelection.assets("hidden_states"),
    minimum_interval_seconds=30,
    default_status=dg.DefaultSensorStatus.STOPPED,
    description="Requests hidden_states[batch] once synthetic_generations[batch] and the "
    "drafter checkpoint are materialized (or updated). Turn it on where a GPU (or, in the "
    "miniature, the CPU) is free while the server generates.",
)
