"""Drafter formats in and out: the SpecForge v0.2 layout (as the miniature hub publishes it) and
the speculators layout read into the same tensors; the vLLM export reads back identically and
passes the download validator; every refused config names its field, expected and found."""

import json
import pickle
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3_assets.lib.checkpoint.drafter_checkpoint import (
    DrafterValidationError,
    validate_drafter,
)
from eagle3_assets.lib.checkpoint.drafter_io import (
    SPECFORGE,
    SPECULATORS,
    DrafterCheckpoint,
    check_fits_target,
    read_drafter,
    write_vllm_drafter,
)
from eagle3_assets.lib.core.layer_ids import KEY, LayerIdSource
from eagle3_assets.lib.core.target import TargetShape
from eagle3_assets.lib.training.eagle3_model import Eagle3Drafter
from eagle3_assets.localdev.hub import make_untrained_drafter

DRAFT_VOCAB = 256


@pytest.fixture(scope="module")
def target(test_world) -> TargetShape:
    return TargetShape.from_config(test_world.target_v1)


@pytest.fixture(scope="module")
def specforge_dir(test_world, tmp_path_factory) -> Path:
    """target-v1's untrained drafter as the hub holds it: nested SGLang ids [1, 3, 4], a
    pickled training_state.pt beside the weights."""
    path = tmp_path_factory.mktemp("specforge") / "drafter"
    return make_untrained_drafter(test_world.target_v1, path, DRAFT_VOCAB, seed=0)


@pytest.fixture(scope="module")
def checkpoint(specforge_dir, target) -> DrafterCheckpoint:
    return read_drafter(specforge_dir, target.num_hidden_layers)


def assert_same_tensors(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]):
    assert sorted(found) == sorted(expected)
    for name, tensor in expected.items():
        assert found[name].dtype == tensor.dtype, name
        assert torch.equal(found[name], tensor), name  # bit for bit: no cast, no copy error


def edited_copy(
    source: Path,
    dest: Path,
    config: Callable[[dict], object] = lambda c: None,
    tensors: Callable[[dict[str, torch.Tensor]], object] = lambda t: None,
) -> Path:
    """A copy of a drafter directory with its config and tensors edited in place."""
    shutil.copytree(source, dest)
    raw = json.loads((dest / "config.json").read_text())
    config(raw)
    (dest / "config.json").write_text(json.dumps(raw))
    weights = load_file(dest / "model.safetensors")
    tensors(weights)
    save_file(weights, dest / "model.safetensors")
    return dest


# ------------------------------------------------------------------------------- SpecForge


def test_reads_the_specforge_layout(specforge_dir, checkpoint, monkeypatch, target):
    def refuse(*args, **kwargs):
        raise AssertionError("a pickle was opened")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    assert (specforge_dir / "training_state.pt").exists()
    checkpoint = read_drafter(specforge_dir, target.num_hidden_layers)

    assert checkpoint.source_format == SPECFORGE
    assert checkpoint.aux_layer_ids.vllm == (2, 4, 5)  # nested SGLang [1, 3, 4] + 1
    assert checkpoint.aux_layer_ids.source is LayerIdSource.NESTED
    assert_same_tensors(checkpoint.tensors, load_file(specforge_dir / "model.safetensors"))
    assert checkpoint.tensors["d2t"].dtype == torch.int64
    assert checkpoint.tensors["t2d"].dtype == torch.bool

    config = checkpoint.config
    assert (config.hidden_size, config.vocab_size, config.draft_vocab_size) == (64, 1024, 256)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (2, 1, 32)
    assert config.intermediate_size == 128
    assert config.rope_theta == 10000.0  # transformers 5 keeps it in rope_parameters
    assert config.max_position_embeddings == 2048
    assert config.num_aux_hidden_states == 3
    assert config.target_hidden_size is None
    assert config.norm_before_residual is False


def test_loads_into_the_model_strictly(checkpoint, test_world):
    embed = load_file(test_world.target_v1 / "model.safetensors")["model.embed_tokens.weight"]
    model = Eagle3Drafter(checkpoint.config, embed)
    model.load_state_dict(checkpoint.tensors, strict=True)  # embed_tokens is not persistent
    assert torch.equal(model.fc.weight, checkpoint.tensors["fc.weight"])
    aux = torch.randn(1, 5, checkpoint.config.aux_width)
    outputs = model.ttt(aux, torch.arange(7)[None], steps=3)
    assert [tuple(o.shape) for o in outputs] == [(1, 5, 64)] * 3


def test_reads_sharded_safetensors(specforge_dir, checkpoint, tmp_path, target):
    drafter = tmp_path / "sharded"
    shutil.copytree(specforge_dir, drafter)
    tensors = load_file(drafter / "model.safetensors")
    (drafter / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[:5],
        "model-00002-of-00002.safetensors": names[5:],
    }
    for file, part in shards.items():
        save_file({name: tensors[name] for name in part}, drafter / file)
    weight_map = {name: file for file, part in shards.items() for name in part}
    (drafter / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    assert_same_tensors(read_drafter(drafter, target.num_hidden_layers).tensors, tensors)


def test_fits_its_target(checkpoint, target):
    check_fits_target(checkpoint, target.hidden_size, target.vocab_size)


# ---------------------------------------------------------------------------- vLLM export


def test_vllm_export_reads_back_identically(checkpoint, tmp_path, target):
    out = write_vllm_drafter(
        tmp_path / "vllm-drafter",
        checkpoint.config,
        checkpoint.tensors,
        checkpoint.aux_layer_ids.vllm,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vllm-drafter"]  # no temp dir left
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1
    assert config[KEY] == [2, 4, 5]  # vLLM reads only this one
    assert config["eagle_config"][KEY] == [1, 3, 4]  # SGLang convention, for SpecForge/SGLang
    assert config["norm_before_residual"] is False
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert "embed_tokens.weight" not in f.keys()  # noqa: SIM118
        assert f.get_tensor("d2t").dtype == torch.int64
        assert f.get_tensor("t2d").dtype == torch.bool

    again = read_drafter(out, target.num_hidden_layers)
    assert again.config == checkpoint.config
    assert again.aux_layer_ids.vllm == (2, 4, 5)
    assert again.aux_layer_ids.source is LayerIdSource.TOP_LEVEL
    assert_same_tensors(again.tensors, checkpoint.tensors)
    # The download step's validator accepts what we export.
    info = validate_drafter(out, target)
    assert info.aux_layer_ids_vllm == (2, 4, 5)

    # Writing again replaces the directory whole.
    write_vllm_drafter(out, checkpoint.config, checkpoint.tensors, (2, 4, 5))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vllm-drafter"]


def test_export_refuses_what_vllm_would_misread(checkpoint, tmp_path):
    def error(ids, tensors=checkpoint.tensors) -> str:
        with pytest.raises(DrafterValidationError) as raised:
            write_vllm_drafter(tmp_path / "out", checkpoint.config, tensors, ids)
        assert not (tmp_path / "out").exists()
        return str(raised.value)

    assert f"{KEY}: expected ascending unique ids (vLLM sorts them), found [4, 2, 5]" in error(
        (4, 2, 5)
    )
    assert f"{KEY}: expected 3 ids (num_aux_hidden_states), found [2, 4]" in error((2, 4))
    with_embed = {**checkpoint.tensors, "embed_tokens.weight": torch.zeros(1024, 64)}
    assert "found ['embed_tokens.weight']" in error((2, 4, 5), with_embed)


# ---------------------------------------------------------------------------- speculators


def speculators_dir(specforge_dir: Path, dest: Path, norm_before_residual: bool | None) -> Path:
    """The same weights in the speculators layout: layers.0.* names, the Llama fields in
    transformer_layer_config, top-level vLLM ids, embeddings and verifier head saved too."""
    source = json.loads((specforge_dir / "config.json").read_text())
    layer_fields = (
        "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "intermediate_size", "vocab_size", "rms_norm_eps", "max_position_embeddings",
        "rope_parameters", "hidden_act", "num_hidden_layers",
    )  # fmt: skip
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": "target-v1", "architectures": ["LlamaForCausalLM"]},
        },
        "transformer_layer_config": {
            "model_type": "llama",
            **{field: source[field] for field in layer_fields},
        },
        "draft_vocab_size": source["draft_vocab_size"],
        "norm_before_fc": False,
        "target_hidden_size": None,
        KEY: [2, 4, 5],
    }
    if norm_before_residual is not None:
        config["norm_before_residual"] = norm_before_residual
    dest.mkdir()
    (dest / "config.json").write_text(json.dumps(config))
    tensors = load_file(specforge_dir / "model.safetensors")
    renamed = {name.replace("midlayer.", "layers.0."): t for name, t in tensors.items()}
    renamed["embed_tokens.weight"] = torch.zeros(source["vocab_size"], source["hidden_size"])
    renamed["verifier_lm_head.weight"] = torch.zeros(source["vocab_size"], source["hidden_size"])
    save_file(renamed, dest / "model.safetensors")
    return dest


@pytest.mark.parametrize(
    ("written", "read"),
    [(None, True), (False, False), (True, True)],
    ids=["absent-means-true-as-in-vllm", "false", "true"],
)
def test_reads_the_speculators_layout(specforge_dir, checkpoint, tmp_path, target, written, read):
    path = speculators_dir(specforge_dir, tmp_path / "speculators", written)
    found = read_drafter(path, target.num_hidden_layers)

    assert found.source_format == SPECULATORS
    assert found.aux_layer_ids.vllm == (2, 4, 5)
    assert found.aux_layer_ids.source is LayerIdSource.TOP_LEVEL
    assert_same_tensors(found.tensors, checkpoint.tensors)  # midlayer.*, no embed/verifier
    assert found.config.norm_before_residual is read
    assert found.config == replace(checkpoint.config, norm_before_residual=read)

    # The export carries the flag explicitly, so vLLM serves the same residual.
    out = write_vllm_drafter(tmp_path / "out", found.config, found.tensors, (2, 4, 5))
    assert json.loads((out / "config.json").read_text())["norm_before_residual"] is read
    assert read_drafter(out, target.num_hidden_layers).config.norm_before_residual is read


# ------------------------------------------------------------------------------- vocab maps


def test_identity_vocab_maps_when_the_draft_vocab_is_the_target_vocab(test_world, tmp_path):
    full = make_untrained_drafter(test_world.target_v1, tmp_path / "full", 1024, seed=0)
    path = edited_copy(
        full,
        tmp_path / "no-maps",
        config=lambda c: c.pop("draft_vocab_size"),
        tensors=lambda t: (t.pop("d2t"), t.pop("t2d")),
    )
    found = read_drafter(path, 8)
    assert found.config.draft_vocab_size == 1024
    assert torch.equal(found.tensors["d2t"], torch.zeros(1024, dtype=torch.int64))
    assert torch.equal(found.tensors["t2d"], torch.ones(1024, dtype=torch.bool))


def test_a_missing_t2d_is_derived_from_d2t(specforge_dir, checkpoint, tmp_path):
    path = edited_copy(specforge_dir, tmp_path / "no-t2d", tensors=lambda t: t.pop("t2d"))
    assert torch.equal(read_drafter(path, 8).tensors["t2d"], checkpoint.tensors["t2d"])


# ------------------------------------------------------------------------------ bad inputs


def test_check_fits_target_names_the_mismatch(checkpoint):
    with pytest.raises(DrafterValidationError) as raised:
        check_fits_target(checkpoint, target_hidden_size=128, target_vocab_size=1024)
    message = str(raised.value)
    assert "hidden_size: expected 128 (target), found 64" in message
    assert "fc.weight: expected 3 x 128 = 384 input columns" in message
    assert "found 192" in message

    with pytest.raises(DrafterValidationError) as raised:
        check_fits_target(checkpoint, target_hidden_size=64, target_vocab_size=2048)
    message = str(raised.value)
    assert "vocab_size: expected 2048 (target), found 1024" in message
    assert "t2d: expected 2048 entries (target), found 1024" in message


def set_in(*keys: str, value: object) -> Callable[[dict], None]:
    def edit(config: dict) -> None:
        for key in keys[:-1]:
            config = config.setdefault(key, {})
        config[keys[-1]] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (set_in("norm_before_fc", value=True), "norm_before_fc: expected False, found True"),
        (
            set_in("eagle_config", "norm_before_fc", value=True),
            "norm_before_fc: expected False, found True",
        ),
        (set_in("num_hidden_layers", value=2), "num_hidden_layers: expected 1, found 2"),
        (set_in("fc_norm", value=True), "fc_norm: expected False, found True"),
        (set_in("norm_output", value=True), "norm_output: expected False, found True"),
        (
            set_in("eagle_config", "use_aux_hidden_state", value=False),
            "eagle_config.use_aux_hidden_state: expected True, found False",
        ),
        (
            set_in("rope_parameters", value={"rope_type": "yarn", "factor": 4.0}),
            "rope type: expected none or 'default' (no scaling), found 'yarn'",
        ),
        (
            set_in("rope_scaling", value={"type": "linear", "factor": 2.0}),
            "rope type: expected none or 'default' (no scaling), found 'linear'",
        ),
        (set_in("attention_bias", value=True), "attention_bias: expected False, found True"),
        (
            set_in("architectures", value=["LlamaForCausalLM"]),
            "architectures: expected one of ['LlamaForCausalLMEagle3', 'Eagle3LlamaForCausalLM'], "
            "found ['LlamaForCausalLM']",
        ),
        (
            set_in("eagle_config", KEY, value=[4, 1, 3]),
            f"{KEY}: expected ascending unique ids (vLLM sorts them), found [5, 2, 4]",
        ),
        (
            set_in("eagle_config", KEY, value=[1, 3, 8]),
            f"{KEY}: expected vLLM ids in [0, 8] (the target has 8 layers), found [2, 4, 9]",
        ),
        (
            set_in("hidden_size", value=128),
            "fc.weight: expected shape [128, 384], found [64, 192]",
        ),
        (set_in("vocab_size", value=2048), "t2d: expected shape [2048], found [1024]"),
    ],
    ids=[
        "norm_before_fc",
        "eagle_config.norm_before_fc",
        "two-layers",
        "fc_norm",
        "norm_output",
        "no-aux-states",
        "yarn-rope",
        "linear-rope-scaling",
        "attention_bias",
        "not-eagle3",
        "unsorted-ids",
        "id-past-the-target",
        "hidden-size-vs-tensors",
        "vocab-size-vs-tensors",
    ],
)
def test_refuses_configs_our_model_does_not_implement(specforge_dir, tmp_path, edit, expected):
    path = edited_copy(specforge_dir, tmp_path / "bad", config=edit)
    with pytest.raises(DrafterValidationError) as raised:
        read_drafter(path, 8)
    assert expected in str(raised.value)


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda t: t.update(d2t=t["d2t"].flip(0)),
            "d2t: expected draft id + d2t to be the ids where t2d is true",
        ),
        (lambda t: t.update(d2t=t["d2t"].int()), "d2t: expected dtype torch.int64, found"),
        (lambda t: t.pop("fc.weight"), "tensors: expected ['fc.weight'], found none of them"),
        (
            lambda t: t.update({"input_norm.weight": torch.ones(192)}),
            "tensors: expected only EAGLE-3 drafter names, found ['input_norm.weight']",
        ),
    ],
    ids=["d2t-order", "d2t-dtype", "missing-fc", "extra-input-norm"],
)
def test_refuses_inconsistent_tensors(specforge_dir, tmp_path, edit, expected):
    path = edited_copy(specforge_dir, tmp_path / "bad", tensors=edit)
    with pytest.raises(DrafterValidationError) as raised:
        read_drafter(path, 8)
    assert expected in str(raised.value)


def test_refuses_a_directory_without_safetensors(specforge_dir, tmp_path):
    path = tmp_path / "pickles-only"
    path.mkdir()
    shutil.copy(specforge_dir / "config.json", path)
    shutil.copy(specforge_dir / "training_state.pt", path)
    with pytest.raises(DrafterValidationError, match=r"expected model\.safetensors or"):
        read_drafter(path, 8)
