"""The code location: every domain under defs/, one executor, the shared resources."""

from pathlib import Path

import dagster as dg

from eagle3_assets.resources import resources_from_env


@dg.definitions
def defs() -> dg.Definitions:
    return dg.Definitions.merge(
        dg.load_from_defs_folder(path_within_project=Path(__file__).parent),
        dg.Definitions(
            # Independent steps (the drafter download, a generation batch) run side by side.
            executor=dg.multiprocess_executor.configured({"max_concurrent": 4}),
            resources=resources_from_env(),
        ),
    )
