"""Prompt files named by hf:// paths, fetched by the real hub client from an offline cache."""

import json

import pytest
from huggingface_hub.errors import LocalEntryNotFoundError

from eagle3_assets.lib.core.hub_files import local_file
from eagle3_assets.lib.generation.conversations import load_conversations
from eagle3_assets.localdev.hub import publish_to_hub_cache


@pytest.fixture
def dataset_cache(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    record = {"messages": [{"role": "user", "content": "What is a list?"},
                           {"role": "assistant", "content": "old answer"}]}  # fmt: skip
    (repo / "data" / "train.jsonl").write_text(json.dumps(record) + "\n")
    cache = tmp_path / "cache"
    sha = publish_to_hub_cache(repo, cache, "local/prompts", repo_type="dataset")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache, sha


def test_hf_dataset_file_is_fetched_and_parsed(dataset_cache):
    cache, sha = dataset_cache
    for source in ("hf://datasets/local/prompts/data/train.jsonl",
                   f"hf://datasets/local/prompts/data/train.jsonl@{sha}"):  # fmt: skip
        path = local_file(source, cache_dir=str(cache))
        assert path.is_file() and str(path).startswith(str(cache))
        (conversation,) = load_conversations(path)
        assert conversation.messages == [{"role": "user", "content": "What is a list?"}]


def test_local_paths_pass_through(tmp_path):
    assert local_file(str(tmp_path / "pool.jsonl")) == tmp_path / "pool.jsonl"


def test_missing_file_and_bad_spec_fail_clearly(dataset_cache):
    cache, _ = dataset_cache
    with pytest.raises(LocalEntryNotFoundError):
        local_file("hf://datasets/local/prompts/nope.jsonl", cache_dir=str(cache))
    with pytest.raises(ValueError, match="expected hf://datasets/<org>/<name>/<file>"):
        local_file("hf://datasets/just-a-name")
