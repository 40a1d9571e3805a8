"""The code location: every domain under defs/, one executor, the resources and the automation
switches read from the environment (a bad value fails the load, naming the variable)."""

import os
from collections.abc import Mapping
from pathlib import Path

import dagster as dg
from pydantic import Field

from eagle3_assets.defs.checkpoint.resources import DrafterHub
from eagle3_assets.defs.evaluation.promotion import promotion_automation
from eagle3_assets.defs.evaluation.resources import EvaluationRecipe
from eagle3_assets.defs.generation.resources import GenerationRecipe, PromptPool
from eagle3_assets.defs.generation.sensors import batch_backfill_schedule
from eagle3_assets.defs.hidden_states.resources import HiddenStatesRecipe
from eagle3_assets.defs.serving.resources import ServingReplicas, VLLMServer
from eagle3_assets.defs.serving.rollout import maintenance_schedule
from eagle3_assets.defs.training.resources import TrainingLauncher, TrainingRecipe
from eagle3_assets.defs.training.sensors import drafter_automation
from eagle3_assets.env_settings import EnvSettings
from eagle3_assets.resources import Compute, Storage, TargetModel

RESOURCES = {
    "vllm": VLLMServer,
    "target": TargetModel,
    "compute": Compute,
    "storage": Storage,
    "prompt_pool": PromptPool,
    "generation": GenerationRecipe,
    "hidden": HiddenStatesRecipe,
    "training": TrainingRecipe,
    "evaluation": EvaluationRecipe,
    "training_launcher": TrainingLauncher,
    "drafter_hub": DrafterHub,
    "serving": ServingReplicas,
}


class Automation(EnvSettings):
    """What runs by itself. Extraction, training, evaluation and promotion are off by default:
    on a node where serving holds every GPU they have nowhere to run until serving stops."""

    drafter_automation: bool = False
    backfill_cron: str = Field("*/15 * * * *", min_length=9)
    maintenance_cron: str = Field("0 3 * * *", min_length=9)  # serving restarts: at night

    env = {
        "drafter_automation": "EAGLE3_AUTOMATION",
        "backfill_cron": "EAGLE3_BACKFILL_CRON",
        "maintenance_cron": "EAGLE3_MAINTENANCE_CRON",
    }


def resources_from_env(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """Every resource, configured from EAGLE3_* variables (defaults: the demo world)."""
    environ = os.environ if environ is None else environ
    return {key: settings.from_env(environ) for key, settings in RESOURCES.items()}


@dg.definitions
def defs() -> dg.Definitions:
    automation = Automation.from_env()
    resources = resources_from_env()
    streamed = resources["hidden"].mode == "streamed"
    return dg.Definitions.merge(
        dg.load_from_defs_folder(path_within_project=Path(__file__).parent),
        dg.Definitions(
            sensors=[
                drafter_automation(automation.drafter_automation, streamed),
                promotion_automation(automation.drafter_automation),
            ],
            schedules=[
                batch_backfill_schedule(automation.backfill_cron),
                maintenance_schedule(automation.maintenance_cron),
            ],
            # Independent steps (the drafter download, a generation batch) run side by side.
            executor=dg.multiprocess_executor.configured({"max_concurrent": 4}),
            resources=resources,
        ),
    )
