"""The target model as every domain sees it: its language model's config, and its shape."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def target_config(path: Path) -> dict[str, Any]:
    """The language model's fields of a target's config.json (or the folder holding it).

    Multimodal configs such as Kimi-K2.5's nest them in `text_config`.
    """
    path = path / "config.json" if path.is_dir() else path
    config = json.loads(path.read_text())
    return config.get("text_config", config)


@dataclass(frozen=True)
class TargetShape:
    """What a drafter must agree with: the target's hidden size, vocab and layer count."""

    hidden_size: int
    vocab_size: int
    num_hidden_layers: int

    @classmethod
    def from_config(cls, path: Path) -> TargetShape:
        return cls.from_fields(target_config(path))

    @classmethod
    def from_fields(cls, config: dict[str, Any]) -> TargetShape:
        """The shape from fields `target_config` returned."""
        return cls(config["hidden_size"], config["vocab_size"], config["num_hidden_layers"])
