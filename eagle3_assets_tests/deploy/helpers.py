"""Shared by the deployment tests: a small prompt pool and the project's own definitions."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
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


def descendants(root: int) -> list[int]:
    """`root` and every process below it, by parent pid (sessions and groups do not hide a
    child: torchrun and vLLM start their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def wait_for(condition: Callable[[], object], timeout_s: float, what: str, log: Path):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(
        f"no {what} after {timeout_s:.0f}s; daemon log:\n{log.read_text()[-4000:]}"
    )
