"""A code location for test_demo_failed_steps: a step under the project's automation
condition that fails while a file exists, asked for by an automation sensor as the demo's
drafter steps are."""

import os
from pathlib import Path

import dagster as dg

from eagle3_assets.partitions import eager_on_checked_inputs


@dg.asset
def upstream() -> None:
    """Materialized by the test: each update asks for `step`."""


@dg.asset(deps=[upstream], automation_condition=eager_on_checked_inputs())
def step() -> None:
    failure = Path(os.environ["EAGLE3_TEST_FAILURE_FILE"])
    if failure.exists():
        raise RuntimeError(failure.read_text())


defs = dg.Definitions(
    assets=[upstream, step],
    sensors=[
        dg.AutomationConditionSensorDefinition(
            "step_automation",
            target=dg.AssetSelection.assets(step),
            minimum_interval_seconds=5,
            default_status=dg.DefaultSensorStatus.RUNNING,
        )
    ],
)
