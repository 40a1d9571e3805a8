"""The resources every domain shares: the target model, the platform and the data volume. Each
domain's own
resources live in defs/<domain>/resources.py; definitions.py reads them all from the
environment."""

from pathlib import Path
from typing import Any

import dagster as dg

from eagle3_assets.env_settings import EnvSettings
from eagle3_assets.lib.core.platform import DEFAULT_PLATFORM, Platform, PlatformError, require
from eagle3_assets.lib.core.target import TargetShape


class TargetModel(dg.ConfigurableResource, EnvSettings):
    """The served target's local folder (config.json, tokenizer, safetensors): the shape every
    drafter must fit, and the weights and template that hidden-state extraction uses."""

    path: str = "data/world/demo/target-v2"
    revision: str | None = None  # recorded in the hidden states' manifests
    trust_remote_code: bool = False  # Kimi's tokenizer needs it; only when the user says so

    env = {
        "path": "EAGLE3_TARGET_PATH",
        "revision": "EAGLE3_TARGET_REVISION",
        "trust_remote_code": "EAGLE3_TRUST_REMOTE_CODE",
    }

    def shape(self) -> TargetShape:
        return TargetShape.from_config(Path(self.path))

    def tokenizer(self) -> Any:
        """The target's tokenizer and chat template, loaded as every step that renders or
        tokenizes prompts loads them: code shipped with the target (Kimi's tokenizer) runs
        only when the user set trust_remote_code."""
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(
                self.path, trust_remote_code=self.trust_remote_code
            )
        except ValueError as error:
            if self.trust_remote_code or "trust_remote_code" not in str(error):
                raise
            raise ValueError(
                f"EAGLE3_TRUST_REMOTE_CODE: expected 1 to load the target's tokenizer in "
                f"{self.path}, which is code shipped with the target (auto_map), found it off; "
                "set it only if you trust that code"
            ) from error


class Compute(dg.ConfigurableResource, EnvSettings):
    """Where extraction, training and evaluation run: chosen, never guessed (a CPU torch in the
    orchestration image would otherwise train on the CPU of a GPU node). `cuda` fails a step
    at once when its interpreter sees too few GPUs (lib/core/platform.py)."""

    platform: Platform = DEFAULT_PLATFORM

    env = {"platform": "EAGLE3_PLATFORM"}

    def require(self, python: str, devices: int, step: str) -> None:
        """Before `step` starts: a dg.Failure naming what `python` has when it lacks the GPUs."""
        try:
            require(self.platform, python, devices, step)
        except PlatformError as error:
            raise dg.Failure(str(error)) from None


class Storage(dg.ConfigurableResource, EnvSettings):
    """The data volume: checkpoints, generations and hidden states live under one root."""

    root: str = "data"

    env = {"root": "EAGLE3_DATA_ROOT"}

    def path(self, *parts: str) -> Path:
        return Path(self.root, *parts)
