"""Shared by the deployment tests: a small prompt pool and the project's own definitions."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest


def write_pool(path: Path, count: int) -> Path:
    """`count` single-turn prompts; prompt i's text is `q<i>` (the stub keys requests by it)."""
    lines = [
        json.dumps({"prompt_id": f"p{i:03d}", "messages": [{"role": "user", "content": f"q{i}"}]})
        for i in range(count)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def pipeline_env(base_url: str, pool: Path, data_root: Path, batch_size: int) -> dict[str, str]:
    """EAGLE3_* settings for generation against a stub server (see resources_from_env)."""
    return {
        "EAGLE3_VLLM_URLS": base_url,
        "EAGLE3_TARGET_MODEL": "tiny-target",
        "EAGLE3_PROMPTS": str(pool),
        "EAGLE3_DATA_ROOT": str(data_root),
        "EAGLE3_BATCH_SIZE": str(batch_size),
        "EAGLE3_MAX_TOKENS": "32",
        "EAGLE3_CONCURRENCY": "2",
    }


def project_defs(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> dg.Definitions:
    """The code location as deployed: resources are read from the environment at load."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    from eagle3_assets.definitions import defs

    return defs()
