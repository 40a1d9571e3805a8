"""Drafter formats in and out: the SpecForge v0.2 layout (as the miniature hub publishes it) and
the speculators layout (as speculators 0.9.0 saves it) read into the same tensors and pass the
same validation; the vLLM export reads back identically and passes it too; every refused config
names its field, expected and found; aux layer ids obey one rule everywhere."""

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

from eagle3_assets.lib.checkpoint.drafter_io import (
    SPECFORGE,
    SPECULATORS,
    DrafterCheckpoint,
    DrafterValidationError,
    drafter_aux_layer_ids,
    export_for_vllm,
    read_drafter,
    validate_drafter,
    write_vllm_drafter,
)
from eagle3_assets.lib.core.layer_ids import KEY, LayerIdSource, check_layer_ids
from eagle3_assets.lib.core.target import TargetShape
from eagle3_assets.lib.hidden_states.hf_backend import HFTarget
from eagle3_assets.lib.training.eagle3_model import Eagle3Drafter
from eagle3_assets.localdev.hub import make_untrained_drafter
from eagle3_assets_tests.lib.checkpoint.layouts import speculators_dir

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
    return read_drafter(specforge_dir, target)


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
    checkpoint = read_drafter(specforge_dir, target)

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

    assert_same_tensors(read_drafter(drafter, target).tensors, tensors)


def test_validates_against_its_target_without_loading_weights(
    specforge_dir, checkpoint, target, monkeypatch
):
    def refuse(*args, **kwargs):
        raise AssertionError("a weight was loaded")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    with safe_open(specforge_dir / "model.safetensors", framework="pt") as f:
        handle = type(f)
    real_get_tensor = handle.get_tensor

    def only_vocab_maps(self, name):
        assert name in ("d2t", "t2d"), f"{name} was loaded"
        return real_get_tensor(self, name)

    monkeypatch.setattr(handle, "get_tensor", only_vocab_maps)
    info = validate_drafter(specforge_dir, target)

    assert info.config == checkpoint.config
    assert info.source_format == SPECFORGE
    assert info.architectures == ["LlamaForCausalLMEagle3"]
    assert (info.aux_layer_ids.vllm, info.aux_layer_ids.sglang) == ((2, 4, 5), (1, 3, 4))
    assert info.aux_layer_ids.source is LayerIdSource.NESTED
    assert info.tensors["fc.weight"] == ("F32", (64, 192))
    assert info.tensors["d2t"] == ("I64", (DRAFT_VOCAB,))
    assert info.num_parameters == sum(
        t.numel() for name, t in checkpoint.tensors.items() if name not in ("d2t", "t2d")
    )
    assert info.bytes_on_disk == sum(p.stat().st_size for p in specforge_dir.iterdir())


def test_a_drafter_for_another_target_names_the_mismatch(specforge_dir):
    with pytest.raises(DrafterValidationError) as raised:
        read_drafter(specforge_dir, TargetShape(128, 2048, 8))
    message = str(raised.value)
    assert "hidden_size: expected 128 (target), found 64" in message
    assert "vocab_size: expected 2048 (target), found 1024" in message


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

    again = read_drafter(out, target)
    assert again.config == checkpoint.config
    assert again.aux_layer_ids.vllm == (2, 4, 5)
    assert again.aux_layer_ids.source is LayerIdSource.TOP_LEVEL
    assert_same_tensors(again.tensors, checkpoint.tensors)
    # The download step's validator accepts what we export.
    info = validate_drafter(out, target)
    assert info.aux_layer_ids.vllm == (2, 4, 5)

    # Writing again replaces the directory whole.
    write_vllm_drafter(out, checkpoint.config, checkpoint.tensors, (2, 4, 5))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vllm-drafter"]


def test_the_export_casts_the_weights_and_keeps_the_vocab_maps(checkpoint, tmp_path, target):
    ids = checkpoint.aux_layer_ids.vllm
    out = write_vllm_drafter(
        tmp_path / "bf16", checkpoint.config, checkpoint.tensors, ids, target, torch.bfloat16
    )
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    written = read_drafter(out, target).tensors
    assert sorted(written) == sorted(checkpoint.tensors)
    for name, tensor in checkpoint.tensors.items():
        expected = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert written[name].dtype == expected.dtype and torch.equal(written[name], expected), name
    assert {t.dtype for t in checkpoint.tensors.values() if t.is_floating_point()} == {
        torch.float32
    }  # so the cast above was one


def test_export_refuses_what_vllm_would_misread(checkpoint, tmp_path, target):
    def error(ids, tensors=checkpoint.tensors, shape=None) -> str:
        with pytest.raises(DrafterValidationError) as raised:
            write_vllm_drafter(tmp_path / "out", checkpoint.config, tensors, ids, shape)
        assert not (tmp_path / "out").exists()
        return str(raised.value)

    assert f"{KEY}: expected ascending unique ids (vLLM sorts them), found [4, 2, 5]" in error(
        (4, 2, 5)
    )
    assert f"{KEY}: expected 3 ids (num_aux_hidden_states), found [2, 4]" in error((2, 4))
    with_embed = {**checkpoint.tensors, "embed_tokens.weight": torch.zeros(1024, 64)}
    assert "found ['embed_tokens.weight']" in error((2, 4, 5), with_embed)
    # Given the target, the export checks what the validator will: the ids' range, the fit.
    assert f"{KEY} [9]: expected vLLM ids in [1, 8]" in error((2, 4, 9), shape=target)
    wider = TargetShape(128, 1024, 8)
    assert "hidden_size: expected 128 (target), found 64" in error((2, 4, 5), shape=wider)


# ---------------------------------------------------------------------------- speculators


@pytest.mark.parametrize(
    ("written", "read"),
    [(None, True), (False, False), (True, True)],
    ids=["absent-means-true-as-in-vllm", "false", "true"],
)
def test_reads_the_speculators_layout(specforge_dir, checkpoint, tmp_path, target, written, read):
    path = speculators_dir(specforge_dir, tmp_path / "speculators", written, verifier_head=True)
    found = read_drafter(path, target)

    assert found.source_format == SPECULATORS
    assert found.aux_layer_ids.vllm == (2, 4, 5)
    assert found.aux_layer_ids.source is LayerIdSource.TOP_LEVEL
    assert_same_tensors(found.tensors, checkpoint.tensors)  # midlayer.*, no embed/verifier
    assert found.config.norm_before_residual is read
    assert found.config == replace(checkpoint.config, norm_before_residual=read)

    # The export carries the flag explicitly, so vLLM serves the same residual.
    out = write_vllm_drafter(tmp_path / "out", found.config, found.tensors, (2, 4, 5))
    assert json.loads((out / "config.json").read_text())["norm_before_residual"] is read
    assert read_drafter(out, target).config.norm_before_residual is read


def test_a_speculators_drafter_passes_the_validation_training_passes(
    specforge_dir, checkpoint, tmp_path, target
):
    """Laid out as speculators 0.9.0 saves it, it used to fail the download's validator with
    17 problems (SpecForge names expected) while training read it bit-exactly."""
    path = speculators_dir(specforge_dir, tmp_path / "speculators")
    info = validate_drafter(path, target)
    assert info.source_format == SPECULATORS
    assert info.architectures == ["Eagle3DraftModel"]
    assert info.config == checkpoint.config
    assert (info.aux_layer_ids.vllm, info.aux_layer_ids.sglang) == ((2, 4, 5), (1, 3, 4))
    assert info.tensors["layers.0.self_attn.q_proj.weight"] == ("F32", (64, 128))
    assert info.tensors["embed_tokens.weight"] == ("F32", (1024, 64))  # on disk, not trained
    assert info.num_parameters == validate_drafter(specforge_dir, target).num_parameters
    assert_same_tensors(read_drafter(path, target).tensors, checkpoint.tensors)
    assert drafter_aux_layer_ids(path, 8) == info.aux_layer_ids


# ------------------------------------------------------------------------------- vocab maps


def test_identity_vocab_maps_when_the_draft_vocab_is_the_target_vocab(test_world, tmp_path, target):
    full = make_untrained_drafter(test_world.target_v1, tmp_path / "full", 1024, seed=0)
    path = edited_copy(
        full,
        tmp_path / "no-maps",
        config=lambda c: c.pop("draft_vocab_size"),
        tensors=lambda t: (t.pop("d2t"), t.pop("t2d")),
    )
    assert validate_drafter(path, target).config.draft_vocab_size == 1024
    found = read_drafter(path, target)
    assert found.config.draft_vocab_size == 1024
    assert torch.equal(found.tensors["d2t"], torch.zeros(1024, dtype=torch.int64))
    assert torch.equal(found.tensors["t2d"], torch.ones(1024, dtype=torch.bool))
    # exported without them: vLLM 0.32 makes no draft_id_to_target_id for a full vocab
    # (llama_eagle3.py) and fails on a d2t in the file
    out = write_vllm_drafter(
        tmp_path / "vllm", found.config, found.tensors, found.aux_layer_ids.vllm, target
    )
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert not set(f.keys()) & {"d2t", "t2d"}
    assert_same_tensors(read_drafter(out, target).tensors, found.tensors)


def test_a_missing_t2d_is_derived_from_d2t(specforge_dir, checkpoint, tmp_path, target):
    path = edited_copy(specforge_dir, tmp_path / "no-t2d", tensors=lambda t: t.pop("t2d"))
    assert torch.equal(read_drafter(path, target).tensors["t2d"], checkpoint.tensors["t2d"])


# ------------------------------------------------------------------------------ layer ids


def nested_ids(*sglang: int) -> Callable[[dict], None]:
    def edit(config: dict) -> None:
        config["eagle_config"][KEY] = list(sglang)

    return edit


@pytest.mark.parametrize(
    ("sglang", "vllm", "valid"),
    [((1, 3, 7), (2, 4, 8), True), ((-1, 3, 4), (0, 4, 5), False), ((1, 3, 8), (2, 4, 9), False)],
    ids=["last-layer-output", "embeddings", "past-the-target"],
)
def test_one_rule_for_aux_layer_ids_everywhere(
    specforge_dir, tmp_path, test_world, target, sglang, vllm, valid
):
    """Id N (the last layer's output) was exported and extracted but refused at download; id 0
    (the embeddings) was read and exported but refused at download and by extraction. Now
    the rule, the reader, the validator, the exporter and the hf backend agree."""
    path = edited_copy(specforge_dir, tmp_path / "drafter", config=nested_ids(*sglang))
    expected = f"{KEY} {[i for i in vllm if not 1 <= i <= 8]}: expected vLLM ids in [1, 8]"

    def verdict(check: Callable[[], object]) -> str:
        try:
            check()
        except ValueError as error:  # DrafterValidationError is one
            assert expected.removeprefix(KEY) in str(error), str(error)
            return "refused"
        return "accepted"

    out = tmp_path / "export"
    verdicts = {
        "rule": verdict(lambda: check_layer_ids(vllm, 8, KEY)),
        "validate_drafter": verdict(lambda: validate_drafter(path, target)),
        "read_drafter": verdict(lambda: read_drafter(path, target)),
        "export_for_vllm": verdict(lambda: export_for_vllm(path, out, target)),
        "hf backend": verdict(
            lambda: HFTarget(test_world.target_v1, vllm, dtype="float32", device="cpu")
        ),
    }
    assert verdicts == dict.fromkeys(verdicts, "accepted" if valid else "refused")
    if valid:  # what the exporter writes, the validator accepts, at the same layers
        assert validate_drafter(out, target).aux_layer_ids.vllm == vllm
        assert json.loads((out / "config.json").read_text())[KEY] == list(vllm)
    else:
        assert not out.exists()


# ------------------------------------------------------------------------------ bad inputs


def set_in(*keys: str, value: object) -> Callable[[dict], None]:
    def edit(config: dict) -> None:
        for key in keys[:-1]:
            config = config.setdefault(key, {})
        config[keys[-1]] = value

    return edit


SLIDING = {"layer_types": ["sliding_attention"], "sliding_window": 2048}
SLIDING_REFUSED = (
    "layer_types: expected ['full_attention'] (attention over every earlier position), "
    "found ['sliding_attention'] with sliding_window 2048"
)


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
        (
            set_in("rope_parameters", value={"rope_theta": 1e4, "partial_rotary_factor": 0.5}),
            "partial_rotary_factor: expected 1.0, found 0.5",
        ),
        (set_in("attention_bias", value=True), "attention_bias: expected False, found True"),
        (set_in("mlp_bias", value=True), "mlp_bias: expected False, found True"),
        (set_in("hidden_act", value="gelu"), "hidden_act: expected 'silu', found 'gelu'"),
        (set_in("logit_scale", value=0.5), "logit_scale: expected 1.0, found 0.5"),
        (lambda c: c.update(SLIDING), SLIDING_REFUSED),
        (
            set_in("embed_requires_grad", value=True),
            "embed_requires_grad: expected False, found True",
        ),
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
            f"{KEY} [9]: expected vLLM ids in [1, 8] (the target has 8 layers;",
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
        "partial-rotary",
        "attention_bias",
        "mlp_bias",
        "hidden_act",
        "logit_scale",
        "sliding-window",
        "embed_requires_grad",
        "not-eagle3",
        "unsorted-ids",
        "id-past-the-target",
        "hidden-size-vs-tensors",
        "vocab-size-vs-tensors",
    ],
)
def test_refuses_configs_our_model_does_not_implement(
    specforge_dir, tmp_path, target, edit, expected
):
    path = edited_copy(specforge_dir, tmp_path / "bad", config=edit)
    for check in (validate_drafter, read_drafter):  # at download, as at training and export
        with pytest.raises(DrafterValidationError) as raised:
            check(path, target)
        assert expected in str(raised.value)


def in_layer(**fields: object) -> Callable[[dict], None]:
    return lambda config: config["transformer_layer_config"].update(fields)


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (in_layer(**SLIDING, use_sliding_window=True), SLIDING_REFUSED),
        (set_in("norm_output", value=True), "norm_output: expected False, found True"),
        (set_in("norm_before_fc", value=True), "norm_before_fc: expected False, found True"),
        (set_in("fc_norm", value=True), "fc_norm: expected False, found True"),
        (
            set_in("embed_requires_grad", value=True),
            "embed_requires_grad: expected False, found True",
        ),
        (
            in_layer(model_type="qwen3"),
            "transformer_layer_config.model_type: expected 'llama', found 'qwen3'",
        ),
        (in_layer(num_hidden_layers=2), "num_hidden_layers: expected 1, found 2"),
        (in_layer(attention_bias=True), "attention_bias: expected False, found True"),
        (in_layer(mlp_bias=True), "mlp_bias: expected False, found True"),
        (in_layer(hidden_act="gelu"), "hidden_act: expected 'silu', found 'gelu'"),
        (
            in_layer(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
            "rope type: expected none or 'default' (no scaling), found 'llama3'",
        ),
        (
            set_in("speculators_model_type", value="peagle"),
            "speculators_model_type: expected 'eagle3', found 'peagle'",
        ),
    ],
    ids=[
        "sliding-window-trainer-default",
        "norm_output-eagle-3.1",
        "norm_before_fc",
        "fc_norm",
        "embed_requires_grad",
        "qwen3-layer",
        "two-layers",
        "attention_bias",
        "mlp_bias",
        "hidden_act",
        "llama3-rope",
        "peagle",
    ],
)
def test_refuses_speculators_configs_our_model_does_not_implement(
    specforge_dir, tmp_path, target, edit, expected
):
    path = speculators_dir(specforge_dir, tmp_path / "speculators")
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    for check in (validate_drafter, read_drafter):
        with pytest.raises(DrafterValidationError) as raised:
            check(path, target)
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
        (
            lambda t: t.update({"fc.weight": t["fc.weight"].to(torch.int8)}),
            "fc.weight: expected a floating-point dtype, found torch.int8",
        ),
    ],
    ids=["d2t-order", "d2t-dtype", "missing-fc", "extra-input-norm", "integer-weight"],
)
def test_refuses_inconsistent_tensors(specforge_dir, tmp_path, target, edit, expected):
    path = edited_copy(specforge_dir, tmp_path / "bad", tensors=edit)
    for check in (validate_drafter, read_drafter):
        with pytest.raises(DrafterValidationError) as raised:
            check(path, target)
        assert expected in str(raised.value)


def test_refuses_a_directory_without_safetensors(specforge_dir, tmp_path, target):
    path = tmp_path / "pickles-only"
    path.mkdir()
    shutil.copy(specforge_dir / "config.json", path)
    shutil.copy(specforge_dir / "training_state.pt", path)
    with pytest.raises(DrafterValidationError, match=r"expected model\.safetensors \(or shards"):
        validate_drafter(path, target)
