"""Hugging Face hub settings read at call time, and dataset files named by `hf://` paths.

huggingface_hub reads HF_HUB_OFFLINE and HF_HUB_CACHE once, at import; a pipeline (and a
test) that sets them later must pass them explicitly, which these helpers do.
"""

from __future__ import annotations

import os
from pathlib import Path

HF_DATASETS = "hf://datasets/"
HF_TOKEN_ENV = "HF_TOKEN"  # the hub token: only ever read from the environment


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as set now."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}


def hub_cache_dir() -> str | None:
    """HF_HUB_CACHE or HF_HOME/hub as set now; None lets huggingface_hub use its default."""
    if "HF_HUB_CACHE" in os.environ:
        return os.environ["HF_HUB_CACHE"]
    if "HF_HOME" in os.environ:
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None


def local_file(source: str, cache_dir: str | None = None, token: str | None = None) -> Path:
    """A local path as it is; `hf://datasets/<org>/<name>/<file>[@<revision>]` downloaded with
    `hf_hub_download` (one file, into the hub cache) and returned as its local path."""
    if not source.startswith(HF_DATASETS):
        return Path(source)
    from huggingface_hub import hf_hub_download

    (org, name, filename), revision = _dataset_path(
        source, 3, "hf://datasets/<org>/<name>/<file>[@<revision>]"
    )
    return Path(
        hf_hub_download(
            f"{org}/{name}",
            filename,
            repo_type="dataset",
            revision=revision,
            cache_dir=cache_dir or hub_cache_dir(),
            token=token,
            local_files_only=hub_offline(),
        )
    )


def dataset_snapshot(
    source: str, patterns: list[str], cache_dir: str | None = None, token: str | None = None
) -> tuple[Path, str]:
    """The newest revision of dataset `hf://datasets/<org>/<name>[@<branch>]`: its files
    matching `patterns`, downloaded with `snapshot_download` (what an earlier revision
    shares is not fetched again), as a local snapshot folder, and that revision's commit sha."""
    from huggingface_hub import snapshot_download

    (org, name), revision = _dataset_path(source, 2, "hf://datasets/<org>/<name>[@<branch>]")
    folder = Path(
        snapshot_download(
            f"{org}/{name}",
            repo_type="dataset",
            revision=revision,
            allow_patterns=patterns,
            cache_dir=cache_dir or hub_cache_dir(),
            token=token,
            local_files_only=hub_offline(),
        )
    )
    return folder, folder.name  # <cache>/datasets--org--name/snapshots/<commit sha>


def _dataset_path(source: str, parts: int, form: str) -> tuple[list[str], str | None]:
    """`source` cut into its path after hf://datasets/ (`parts` parts: org, name and, with
    3, the file, which keeps its slashes) and its revision; a ValueError naming `form`."""
    spec, _, revision = source.removeprefix(HF_DATASETS).partition("@")
    split = spec.split("/", 2)
    if not source.startswith(HF_DATASETS) or not all(split) or len(split) != parts:
        raise ValueError(f"{source!r}: expected {form}")
    return split, revision or None
