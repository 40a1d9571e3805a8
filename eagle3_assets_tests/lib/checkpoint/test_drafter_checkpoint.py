"""The drafter download against a real hub cache read by the real client, offline, and the
validation it is followed by (drafter_io's, the one training and export run), field by field.
Targets and drafters here are tiny and built per module."""

import json
import pickle
import pydoc_data.topics
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import httpx2
import pytest
import torch
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from eagle3_assets.lib.checkpoint import drafter_checkpoint
from eagle3_assets.lib.checkpoint.drafter_checkpoint import DrafterDownloadError, download_drafter
from eagle3_assets.lib.checkpoint.drafter_io import (
    SPECFORGE,
    SPECULATORS,
    DrafterValidationError,
    validate_drafter,
)
from eagle3_assets.lib.core.layer_ids import LayerIdSource
from eagle3_assets.lib.core.target import TargetShape
from eagle3_assets.localdev.hub import make_untrained_drafter, publish_to_hub_cache
from eagle3_assets_tests.lib.checkpoint.layouts import speculators_dir

REPO_ID = "tiny-org/tiny-target-eagle3"
TARGET = TargetShape(hidden_size=64, vocab_size=512, num_hidden_layers=8)
DRAFT_VOCAB = 128


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """A Llama config (hidden 64, vocab 512, 8 layers) and a byte-level BPE tokenizer."""
    path = tmp_path_factory.mktemp("target")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "vocab_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "intermediate_size": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=512, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(pydoc_data.topics.topics.values(), trainer=trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def drafter_dir(target_dir, tmp_path_factory) -> Path:
    return make_untrained_drafter(target_dir, tmp_path_factory.mktemp("drafter"), DRAFT_VOCAB, 0)


@pytest.fixture
def hub(drafter_dir, tmp_path, monkeypatch) -> tuple[Path, str]:
    """The drafter published to a fresh hub cache that the environment points at, offline."""
    cache = tmp_path / "hf_home" / "hub"
    sha = publish_to_hub_cache(drafter_dir, cache, REPO_ID)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache, sha


def edited_copy(
    drafter_dir: Path,
    out_dir: Path,
    config_edit: Callable[[dict], None] = lambda config: None,
    tensors_edit: Callable[[dict[str, torch.Tensor]], None] = lambda tensors: None,
) -> Path:
    """config.json and model.safetensors of the drafter, edited; the pickle stays behind."""
    out_dir.mkdir()
    config = json.loads((drafter_dir / "config.json").read_text())
    config_edit(config)
    (out_dir / "config.json").write_text(json.dumps(config))
    tensors = load_file(drafter_dir / "model.safetensors")
    tensors_edit(tensors)
    save_file(tensors, out_dir / "model.safetensors")
    return out_dir


def test_offline_download_gets_config_and_weights_only_and_validates(hub, tmp_path):
    cache, sha = hub
    snapshot = cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / sha
    assert (snapshot / "training_state.pt").exists()  # on the "hub", as in a SpecForge repo

    path, resolved = download_drafter(REPO_ID, "main", tmp_path / "drafter")

    assert (path, resolved) == (tmp_path / "drafter", sha)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    info = validate_drafter(path, TARGET)
    assert info.source_format == SPECFORGE
    assert info.architectures == ["LlamaForCausalLMEagle3"]
    assert (info.config.hidden_size, info.config.vocab_size, info.config.draft_vocab_size) == (
        64,
        512,
        DRAFT_VOCAB,
    )
    assert info.aux_layer_ids.vllm == (2, 4, 5)
    assert info.aux_layer_ids.sglang == (1, 3, 4)
    assert info.aux_layer_ids.source is LayerIdSource.NESTED
    config = info.config
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (2, 1, 32)
    assert info.tensors["fc.weight"] == ("F32", (64, 192))
    assert info.tensors["d2t"] == ("I64", (DRAFT_VOCAB,))
    weights = load_file(path / "model.safetensors")
    assert info.num_parameters == sum(
        t.numel() for name, t in weights.items() if name not in ("d2t", "t2d")
    )
    assert info.bytes_on_disk == sum(p.stat().st_size for p in path.iterdir())

    # A pinned commit sha resolves to the same snapshot, and replaces the previous download.
    path, resolved = download_drafter(REPO_ID, sha, tmp_path / "drafter")
    assert resolved == sha
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize(
    ("repo_id", "revision"),
    [(REPO_ID, "v9"), (REPO_ID, "0" * 40), ("tiny-org/no-such-drafter", "main")],
)
def test_missing_repo_or_revision_fails_at_once(hub, tmp_path, repo_id, revision):
    started = time.monotonic()
    with pytest.raises(DrafterDownloadError) as error:
        download_drafter(repo_id, revision, tmp_path / "drafter", retries=3, backoff_s=10)
    assert time.monotonic() - started < 5  # a single retry would have slept 10 s
    assert f"drafter {repo_id!r} at revision {revision!r} is not in the hub cache" in str(
        error.value
    )
    assert not (tmp_path / "drafter").exists()


def _response(status: int) -> httpx2.Response:
    return httpx2.Response(status, request=httpx2.Request("GET", "https://huggingface.co/api"))


def _wrapped_timeout() -> Exception:
    """What snapshot_download raises when the hub times out and the cache lacks the files."""
    error = LocalEntryNotFoundError("cannot find the requested files")
    error.__cause__ = httpx2.ReadTimeout("timed out")
    return error


TRANSIENT_ERRORS = {
    "connect": lambda: httpx2.ConnectError("connection refused"),
    "builtin-connection": lambda: ConnectionError("connection reset"),
    "503": lambda: HfHubHTTPError("service unavailable", response=_response(503)),
    "wrapped-timeout": _wrapped_timeout,
}


@pytest.mark.parametrize("make_error", TRANSIENT_ERRORS.values(), ids=TRANSIENT_ERRORS.keys())
def test_transient_errors_are_retried(hub, tmp_path, monkeypatch, make_error):
    real = drafter_checkpoint.snapshot_download
    calls = []

    def flaky(*args, **kwargs):
        calls.append(kwargs)
        if len(calls) <= 2:
            raise make_error()
        return real(*args, **kwargs)

    monkeypatch.setattr(drafter_checkpoint, "snapshot_download", flaky)
    path, sha = download_drafter(REPO_ID, "main", tmp_path / "drafter", backoff_s=0.01)
    assert len(calls) == 3
    assert sha == hub[1]
    assert (path / "model.safetensors").exists()


def test_gives_up_after_the_last_retry(hub, tmp_path, monkeypatch):
    def down(*args, **kwargs):
        raise HfHubHTTPError("bad gateway", response=_response(502))

    monkeypatch.setattr(drafter_checkpoint, "snapshot_download", down)
    with pytest.raises(DrafterDownloadError, match="gave up after 3 attempts: bad gateway"):
        download_drafter(REPO_ID, "main", tmp_path / "drafter", retries=2, backoff_s=0.01)


def test_a_client_error_is_not_retried(hub, tmp_path, monkeypatch):
    calls = []

    def forbidden(*args, **kwargs):
        calls.append(kwargs)
        raise HfHubHTTPError("forbidden", response=_response(403))

    monkeypatch.setattr(drafter_checkpoint, "snapshot_download", forbidden)
    with pytest.raises(DrafterDownloadError, match="forbidden"):
        download_drafter(REPO_ID, "main", tmp_path / "drafter", backoff_s=10)
    assert len(calls) == 1


def test_a_speculators_drafter_downloads_and_validates(drafter_dir, tmp_path, monkeypatch):
    """speculators 0.9.0's layout (layers.0.*, transformer_layer_config, embed_tokens saved):
    the download's validator refused it with 17 problems while training read it bit-exactly."""
    cache = tmp_path / "hub"
    repo = speculators_dir(drafter_dir, tmp_path / "repo")
    sha = publish_to_hub_cache(repo, cache, "tiny-org/tiny-target-speculators")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path, resolved = download_drafter(
        "tiny-org/tiny-target-speculators", "main", tmp_path / "drafter", cache_dir=cache
    )
    assert resolved == sha
    info = validate_drafter(path, TARGET)
    assert info.source_format == SPECULATORS
    assert info.architectures == ["Eagle3DraftModel"]
    assert (info.config.hidden_size, info.config.vocab_size, info.config.draft_vocab_size) == (
        64,
        512,
        DRAFT_VOCAB,
    )
    assert info.aux_layer_ids.vllm == (2, 4, 5)
    assert info.aux_layer_ids.source is LayerIdSource.TOP_LEVEL
    assert info.num_parameters == validate_drafter(drafter_dir, TARGET).num_parameters


def test_a_pickle_beside_the_weights_is_never_opened(drafter_dir, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a pickle was opened")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    assert (drafter_dir / "training_state.pt").exists()
    assert validate_drafter(drafter_dir, TARGET).aux_layer_ids.vllm == (2, 4, 5)


def _bump(name: str, index: int) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name][index] += 1

    return edit


def _flip_t2d(tensors: dict[str, torch.Tensor]) -> None:
    tensors["t2d"][tensors["t2d"].logical_not().nonzero()[0]] = True


def _set(name: str, value: object) -> Callable[[dict], None]:
    return lambda mapping: mapping.__setitem__(name, value)


VALIDATION_FAILURES = {
    "hidden-size": (
        TargetShape(96, 512, 8),
        {},
        ["hidden_size: expected 96 (target), found 64"],
    ),
    "vocab": (
        TargetShape(64, 1024, 8),
        {},
        ["vocab_size: expected 1024 (target), found 512"],
    ),
    "fc-shape": (
        TARGET,
        {"tensors_edit": _set("fc.weight", torch.zeros(64, 128))},
        ["fc.weight: expected shape [64, 192], found [64, 128]"],
    ),
    "d2t-inconsistent": (
        TARGET,
        {"tensors_edit": _bump("d2t", 3)},
        [
            "d2t: expected draft id + d2t to be the ids where t2d is true, in increasing order; "
            "found 1 draft ids off, first draft id 3"
        ],
    ),
    "t2d-count": (
        TARGET,
        {"tensors_edit": _flip_t2d},
        [f"t2d: expected {DRAFT_VOCAB} true entries (draft_vocab_size), found {DRAFT_VOCAB + 1}"],
    ),
    "d2t-dtype": (
        TARGET,
        {"tensors_edit": lambda t: t.__setitem__("d2t", t["d2t"].int())},
        ["d2t: expected dtype torch.int64, found torch.int32"],
    ),
    "missing-tensor": (
        TARGET,
        {"tensors_edit": lambda t: t.pop("lm_head.weight")},
        ["tensors: expected ['lm_head.weight'], found none of them"],
    ),
    "draft-vocab": (
        TARGET,
        {"config_edit": _set("draft_vocab_size", 100)},
        [
            "lm_head.weight: expected shape [100, 64], found [128, 64]",
            "d2t: expected shape [100], found [128]",
        ],
    ),
    "architecture": (
        TARGET,
        {"config_edit": _set("architectures", ["LlamaForCausalLM"])},
        [
            "architectures: expected one of ['LlamaForCausalLMEagle3', 'Eagle3LlamaForCausalLM'], "
            "found ['LlamaForCausalLM']"
        ],
    ),
    "layer-ids-out-of-range": (
        TargetShape(64, 512, 4),
        {},
        [
            "eagle_aux_hidden_state_layer_ids [5]: expected vLLM ids in [1, 4] (the target has 4 "
            "layers;",
            "found [2, 4, 5] (vLLM ids) from eagle_config.eagle_aux_hidden_state_layer_ids "
            "(SGLang convention)",
        ],
    ),
    "layer-ids-contradict": (
        TARGET,
        {"config_edit": _set("eagle_aux_hidden_state_layer_ids", [1, 3, 4])},
        [
            "eagle_aux_hidden_state_layer_ids: expected the top-level ids (vLLM) to equal "
            "eagle_config's (SGLang) plus one, found top-level [1, 3, 4] and nested [1, 3, 4]"
        ],
    ),
    "everything-at-once": (
        TargetShape(96, 512, 8),
        {"tensors_edit": lambda t: t.pop("norm.weight"), "config_edit": _set("vocab_size", 9)},
        [
            "hidden_size: expected 96 (target), found 64",
            "vocab_size: expected 512 (target), found 9",
            "tensors: expected ['norm.weight'], found none of them",
            "t2d: expected shape [9], found [512]",
        ],
    ),
}


@pytest.mark.parametrize(
    ("target", "edits", "messages"), VALIDATION_FAILURES.values(), ids=VALIDATION_FAILURES.keys()
)
def test_validation_names_field_expected_and_found(drafter_dir, tmp_path, target, edits, messages):
    path = edited_copy(drafter_dir, tmp_path / "drafter", **edits)
    with pytest.raises(DrafterValidationError) as error:
        validate_drafter(path, target)
    for message in messages:
        assert message in str(error.value)


def test_top_level_vllm_ids_validate_like_nested_sglang_ids(drafter_dir, tmp_path):
    def to_top_level(config: dict) -> None:
        del config["eagle_config"]
        config["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]

    info = validate_drafter(edited_copy(drafter_dir, tmp_path / "top", to_top_level), TARGET)
    assert info.aux_layer_ids.vllm == (2, 4, 5)
    assert info.aux_layer_ids.source is LayerIdSource.TOP_LEVEL


def test_publishing_the_same_files_gives_the_same_sha(drafter_dir, tmp_path):
    first = publish_to_hub_cache(drafter_dir, tmp_path / "a", REPO_ID)
    assert publish_to_hub_cache(drafter_dir, tmp_path / "b", REPO_ID) == first
    other = tmp_path / "other"
    shutil.copytree(drafter_dir, other)
    (other / "config.json").write_text("{}")
    assert publish_to_hub_cache(other, tmp_path / "a", REPO_ID) != first
