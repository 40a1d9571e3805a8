"""Read EAGLE-3 drafters into our model's names, and write the directory vLLM serves.

Two layouts come in. SpecForge v0.2 (the AQ-MedAI Kimi-K2 drafter): a LlamaForCausalLMEagle3
config with the aux ids nested in `eagle_config` (SGLang convention) and `midlayer.*` tensors.
speculators: `speculators_config` + `transformer_layer_config`, top-level ids (vLLM
convention) and `layers.0.*` tensors. Both become one `DrafterCheckpoint`: a `DrafterConfig`,
tensors named as `Eagle3Drafter`'s state dict, and the ids in vLLM convention.

Anything in a config that changes the math and that our model does not implement is refused
by name, because a warm start that silently drops it trains a different model than the one
that was published. Only safetensors are opened: a SpecForge repo's `training_state.pt` is a
pickle and is never read.

One layout goes out (`write_vllm_drafter`): SpecForge names, vLLM's top-level ids AND the
nested SGLang ids, so vLLM, SpecForge and SGLang readers all see the same layers.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3_assets.lib.checkpoint.drafter_checkpoint import (
    ARCHITECTURE,
    DrafterValidationError,
    check_vocab_maps,
)
from eagle3_assets.lib.core.layer_ids import KEY, AuxLayerIds, aux_layer_ids, vllm_to_sglang
from eagle3_assets.lib.training.eagle3_model import DrafterConfig, Eagle3Drafter

SPECFORGE = "specforge"
SPECULATORS = "speculators"
# vLLM's registry maps both names to its Eagle3 Llama drafter (registry.py:660-662).
EAGLE3_ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")
SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"
# Defaults of transformers' LlamaConfig: vLLM builds the drafter's config from it, so an
# absent field means this value when served.
LLAMA_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048}
# Tensors a drafter file may hold that our checkpoint leaves out: vLLM shares the target's
# embeddings when the drafter has none; speculators' verifier_* are the target's own head.
DROPPED = ("embed_tokens.weight",)
DROPPED_PREFIXES = ("verifier_",)


@dataclass(frozen=True)
class DrafterCheckpoint:
    """A drafter in our names: `tensors` load into `Eagle3Drafter(config, embed)` strictly."""

    config: DrafterConfig
    tensors: dict[str, torch.Tensor]
    aux_layer_ids: AuxLayerIds  # vLLM convention, and where the config said so
    source_format: str  # SPECFORGE or SPECULATORS


# ------------------------------------------------------------------------------------ reading


def _flat_fields(config: dict) -> tuple[dict, str, list[str]]:
    """The drafter's Llama fields plus EAGLE-3 flags in one dict, as vLLM sees them, and the
    layout's name. speculators nests the layer's fields in `transformer_layer_config` and
    keeps the EAGLE-3 ones at the top level; vLLM merges them (speculators/algos.py)."""
    problems: list[str] = []
    if "speculators_config" not in config:
        architectures = config.get("architectures") or []
        if not set(architectures) & set(EAGLE3_ARCHITECTURES):
            problems.append(
                f"architectures: expected one of {list(EAGLE3_ARCHITECTURES)}, "
                f"found {architectures}"
            )
        return config, SPECFORGE, problems

    if config.get("speculators_model_type") != "eagle3":
        problems.append(
            f"speculators_model_type: expected 'eagle3', "
            f"found {config.get('speculators_model_type')!r}"
        )
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        problems.append(f"transformer_layer_config: expected a dict, found {layer!r}")
        layer = {}
    # qwen3 layers (Eagle3Qwen3ForCausalLM) add q/k norms our model does not have.
    if layer.get("model_type", "llama") != "llama":
        problems.append(
            f"transformer_layer_config.model_type: expected 'llama', found {layer['model_type']!r}"
        )
    # As vLLM's update_eagle3 does: top-level flags win, absent ones are False.
    fields = dict(layer)
    fields["draft_vocab_size"] = config.get("draft_vocab_size")
    if config.get("target_hidden_size") is not None:
        fields["target_hidden_size"] = config["target_hidden_size"]
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):
        fields[flag] = config.get(flag, False)
    # vLLM reads an absent norm_before_residual as True for speculators configs
    # (speculators/algos.py update_eagle3), though speculators' own class default is False.
    # vLLM is what serves the drafter, so its reading is the one the weights must match.
    fields["norm_before_residual"] = config.get("norm_before_residual", True)
    if config.get(KEY):  # vLLM copies the ids only when the list is non-empty
        fields[KEY] = config[KEY]
    return fields, SPECULATORS, problems


def _rope(fields: dict, problems: list[str]) -> float:
    """rope_theta wherever the config keeps it: transformers 4 at the top level (scaling in
    `rope_scaling`), transformers 5 inside `rope_parameters`. Only unscaled rope is ours."""
    rope = fields.get("rope_scaling") or fields.get("rope_parameters") or {}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        problems.append(f"rope_parameters: expected one flat dict, found {rope!r}")
        return LLAMA_DEFAULTS["rope_theta"]
    kind = rope.get("rope_type", rope.get("type"))
    if kind not in (None, "default"):
        problems.append(f"rope type: expected none or 'default' (no scaling), found {kind!r}")
    partial = rope.get("partial_rotary_factor", fields.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        problems.append(f"partial_rotary_factor: expected 1.0, found {partial!r}")
    theta = rope.get("rope_theta", fields.get("rope_theta"))
    return float(LLAMA_DEFAULTS["rope_theta"] if theta is None else theta)


def _refuse_other_math(fields: dict, problems: list[str]) -> None:
    """Flags vLLM honours that `Eagle3Drafter` does not implement (spec §1.7)."""
    eagle_config = fields.get("eagle_config") or {}
    flags = {
        "num_hidden_layers": (fields.get("num_hidden_layers"), 1),
        "eagle_config.use_aux_hidden_state": (eagle_config.get("use_aux_hidden_state", True), True),
        "norm_before_fc": (
            bool(eagle_config.get("norm_before_fc", fields.get("norm_before_fc", False))),
            False,
        ),
        "fc_norm": (bool(fields.get("fc_norm", False)), False),
        "norm_output": (bool(fields.get("norm_output", False)), False),
        "attention_bias": (bool(fields.get("attention_bias", False)), False),
        "mlp_bias": (bool(fields.get("mlp_bias", False)), False),
        "hidden_act": (fields.get("hidden_act", "silu"), "silu"),
        "logit_scale": (fields.get("logit_scale", 1.0), 1.0),
    }
    for field, (found, expected) in flags.items():
        if found != expected:
            problems.append(f"{field}: expected {expected!r}, found {found!r}")


def _int(fields: dict, field: str, problems: list[str], default: int | None = None) -> int:
    value = fields.get(field)
    value = default if value is None else value
    if type(value) is not int:
        problems.append(f"{field}: expected an int, found {value!r}")
        return 1
    return value


def _drafter_config(fields: dict, ids: AuxLayerIds, problems: list[str]) -> DrafterConfig:
    hidden = _int(fields, "hidden_size", problems)
    heads = _int(fields, "num_attention_heads", problems)
    vocab = _int(fields, "vocab_size", problems)
    target_hidden = fields.get("target_hidden_size")
    n_aux = fields.get("num_aux_hidden_states")
    if n_aux is not None and n_aux != len(ids.vllm):
        problems.append(
            f"num_aux_hidden_states: expected {len(ids.vllm)} (the aux layer ids "
            f"{list(ids.vllm)}), found {n_aux}"
        )
    return DrafterConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=_int(fields, "num_key_value_heads", problems, heads),
        head_dim=_int(fields, "head_dim", problems, hidden // max(heads, 1)),
        intermediate_size=_int(fields, "intermediate_size", problems),
        vocab_size=vocab,
        draft_vocab_size=_int(fields, "draft_vocab_size", problems, vocab),
        rms_norm_eps=float(fields.get("rms_norm_eps") or LLAMA_DEFAULTS["rms_norm_eps"]),
        rope_theta=_rope(fields, problems),
        max_position_embeddings=_int(
            fields, "max_position_embeddings", problems, LLAMA_DEFAULTS["max_position_embeddings"]
        ),
        num_aux_hidden_states=len(ids.vllm),
        # None when equal: the model reads None as "same as hidden_size"
        target_hidden_size=None if target_hidden in (None, hidden) else target_hidden,
        norm_before_residual=bool(fields.get("norm_before_residual", False)),
    )


def _check_ids(ids: Sequence[int], target_num_layers: int | None, where: str = "") -> list[str]:
    """vLLM sorts and deduplicates the ids and feeds fc the states in ascending order, so a
    list in any other order would pair fc's column blocks with the wrong layers."""
    problems = []
    if list(ids) != sorted(set(ids)):
        problems.append(
            f"{KEY}: expected ascending unique ids (vLLM sorts them), found {list(ids)}{where}"
        )
    # vLLM's Llama captures ids 0 (the embeddings) .. N (the final stream) (llama.py:428-441)
    if target_num_layers is not None and not all(0 <= i <= target_num_layers for i in ids):
        problems.append(
            f"{KEY}: expected vLLM ids in [0, {target_num_layers}] (the target has "
            f"{target_num_layers} layers), found {list(ids)}{where}"
        )
    return problems


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors, or of the shards its index names. Nothing else in
    the directory is opened (a .pt/.bin there is a pickle)."""
    if (path / SHARD_INDEX).exists():
        weight_map = json.loads((path / SHARD_INDEX).read_text())["weight_map"]
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            tensors.update(load_file(path / shard))
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise DrafterValidationError(
                f"{SHARD_INDEX}: expected its shards to hold every tensor it names, "
                f"found {missing} missing"
            )
        return tensors
    if (path / SINGLE_FILE).exists():
        return load_file(path / SINGLE_FILE)
    raise DrafterValidationError(
        f"tensors: expected {SINGLE_FILE} or {SHARD_INDEX} in {path}, found neither"
    )


def _our_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """speculators' `layers.0.*` is SpecForge's `midlayer.*` (vLLM loads both the same way);
    embeddings and verifier tensors are not part of the drafter we train."""
    renamed = {}
    for name, tensor in tensors.items():
        if name in DROPPED or name.startswith(DROPPED_PREFIXES):
            continue
        if name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")
        renamed[name] = tensor
    return renamed


def _fill_vocab_maps(config: DrafterConfig, tensors: dict[str, torch.Tensor]) -> None:
    """d2t and t2d say the same thing; vLLM ignores t2d and needs d2t only when the vocabs
    differ, so a file may hold one or neither. Derive what is missing."""
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is None and t2d is None and config.draft_vocab_size == config.vocab_size:
        tensors["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.int64)
        tensors["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    elif t2d is None and d2t is not None and d2t.dtype == torch.int64:
        targets = torch.arange(len(d2t)) + d2t
        if targets.min() >= 0 and targets.max() < config.vocab_size:
            t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
            t2d[targets] = True
            tensors["t2d"] = t2d
    elif d2t is None and t2d is not None and t2d.dtype == torch.bool:
        used = torch.nonzero(t2d).flatten()
        tensors["d2t"] = used - torch.arange(len(used))


def expected_tensors(config: DrafterConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of `Eagle3Drafter`'s state dict for `config`, taken from the
    model itself (built on the meta device: no memory) so that the two never disagree.
    Weight dtypes are whatever the file holds; only d2t (int64) and t2d (bool) are fixed."""
    with torch.device("meta"):
        embed = torch.empty(config.vocab_size, config.hidden_size)
        model = Eagle3Drafter(config, embed)
    return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}


def check_tensors(config: DrafterConfig, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Problems with `tensors` as the state dict of `config`'s drafter: names, shapes, the
    dtypes of d2t/t2d, and whether d2t and t2d describe the same sorted draft vocab."""
    problems = []
    expected = expected_tensors(config)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        problems.append(f"tensors: expected {missing}, found none of them")
    if unexpected:
        problems.append(
            f"tensors: expected only EAGLE-3 drafter names, found {unexpected} (a variant "
            f"our model does not implement?)"
        )
    for name, (shape, dtype) in expected.items():
        if name not in tensors:
            continue
        found = tensors[name]
        if tuple(found.shape) != shape:
            problems.append(f"{name}: expected shape {list(shape)}, found {list(found.shape)}")
        if name in ("d2t", "t2d") and found.dtype != dtype:
            problems.append(f"{name}: expected dtype {dtype}, found {found.dtype}")
        elif name not in ("d2t", "t2d") and not found.is_floating_point():
            problems.append(f"{name}: expected a floating-point dtype, found {found.dtype}")
    if not problems:
        d2t, t2d = (tensors[name].detach().cpu().numpy() for name in ("d2t", "t2d"))
        problems += check_vocab_maps(d2t, t2d, config.draft_vocab_size)
    return problems


def read_drafter(path: Path, target_num_layers: int) -> DrafterCheckpoint:
    """Read the drafter in `path` (SpecForge v0.2 or speculators layout) into our names and
    config. `target_num_layers` resolves vLLM's default ids when the config names none and
    bounds the ids it names. Raise DrafterValidationError listing every problem."""
    path = Path(path)
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise DrafterValidationError(f"config.json: expected a JSON file, found {error}") from error
    fields, source_format, problems = _flat_fields(raw)
    _refuse_other_math(fields, problems)
    try:
        ids = aux_layer_ids(fields, target_num_layers)
    except ValueError as error:
        raise DrafterValidationError(f"drafter in {path}:\n{error}") from error
    problems += _check_ids(ids.vllm, target_num_layers, f" (vLLM ids) from {ids.source.value}")
    config = _drafter_config(fields, ids, problems)
    if problems:  # a wrong config makes every tensor look wrong: report the cause alone
        raise DrafterValidationError(f"drafter in {path}:\n" + "\n".join(problems))

    tensors = _our_names(_read_tensors(path))
    _fill_vocab_maps(config, tensors)
    problems = check_tensors(config, tensors)
    if problems:
        raise DrafterValidationError(f"drafter in {path}:\n" + "\n".join(problems))
    return DrafterCheckpoint(config, tensors, ids, source_format)


def check_fits_target(
    checkpoint: DrafterCheckpoint, target_hidden_size: int, target_vocab_size: int
) -> None:
    """Raise DrafterValidationError unless the drafter reads this target: its embeddings are
    the target's ([vocab, hidden]), d2t/t2d index its vocab, and fc reads one target hidden
    state per aux layer."""
    config = checkpoint.config
    problems = []
    if config.hidden_size != target_hidden_size:
        problems.append(
            f"hidden_size: expected {target_hidden_size} (target), found {config.hidden_size}"
        )
    if config.target_hidden_size not in (None, target_hidden_size):
        problems.append(
            f"target_hidden_size: expected {target_hidden_size} (target), "
            f"found {config.target_hidden_size}"
        )
    if config.vocab_size != target_vocab_size:
        problems.append(
            f"vocab_size: expected {target_vocab_size} (target), found {config.vocab_size}"
        )
    t2d = checkpoint.tensors.get("t2d")
    if t2d is not None and len(t2d) != target_vocab_size:
        problems.append(f"t2d: expected {target_vocab_size} entries (target), found {len(t2d)}")
    fc = checkpoint.tensors.get("fc.weight")
    n_aux = len(checkpoint.aux_layer_ids.vllm)
    if fc is not None and fc.shape[-1] != n_aux * target_hidden_size:
        problems.append(
            f"fc.weight: expected {n_aux} x {target_hidden_size} = "
            f"{n_aux * target_hidden_size} input columns ({n_aux} aux states of the target's "
            f"hidden size), found {fc.shape[-1]}"
        )
    if problems:
        raise DrafterValidationError("drafter does not fit the target:\n" + "\n".join(problems))


# ------------------------------------------------------------------------------------ writing


def vllm_config(
    config: DrafterConfig, aux_layer_ids_vllm: Sequence[int], dtype: torch.dtype
) -> dict:
    """config.json of a LlamaForCausalLMEagle3 drafter: every field vLLM reads, every
    math-changing flag explicit, and the ids both top-level (vLLM reads only these) and in
    `eagle_config` (SGLang convention, what SpecForge and SGLang read)."""
    ids = list(aux_layer_ids_vllm)
    result = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "num_hidden_layers": 1,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": config.rms_norm_eps,
        # both spellings: transformers 4 reads rope_theta, transformers 5 rope_parameters
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "num_aux_hidden_states": config.num_aux_hidden_states,
        "norm_before_residual": config.norm_before_residual,
        "norm_before_fc": False,
        "tie_word_embeddings": False,
        "dtype": str(dtype).removeprefix("torch."),
        KEY: ids,
        "eagle_config": {KEY: list(vllm_to_sglang(ids)), "use_aux_hidden_state": True},
    }
    if config.target_hidden_size is not None:
        result["target_hidden_size"] = config.target_hidden_size
    return result


def write_vllm_drafter(
    out_dir: Path,
    config: DrafterConfig,
    tensors: dict[str, torch.Tensor],
    aux_layer_ids_vllm: Sequence[int],
) -> Path:
    """Write the drafter vLLM serves with `--speculative-config '{"method": "eagle3",
    "model": out_dir, ...}'`: config.json and model.safetensors in our (SpecForge) names.
    The directory is built beside `out_dir` and renamed into place, so a reader never sees
    half of it; an existing `out_dir` is replaced. Returns `out_dir`."""
    out_dir = Path(out_dir)
    ids = tuple(aux_layer_ids_vllm)
    problems = _check_ids(ids, None) + check_tensors(config, tensors)
    if len(ids) != config.num_aux_hidden_states:
        problems.append(
            f"{KEY}: expected {config.num_aux_hidden_states} ids (num_aux_hidden_states), "
            f"found {list(ids)}"
        )
    if problems:
        raise DrafterValidationError(f"drafter for {out_dir}:\n" + "\n".join(problems))

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        dtype = tensors["fc.weight"].dtype
        text = json.dumps(vllm_config(config, ids, dtype), indent=2) + "\n"
        (partial / "config.json").write_text(text)
        save_file(
            {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()},
            partial / SINGLE_FILE,
            metadata={"format": "pt"},
        )
        os.chmod(partial, 0o755)  # mkdtemp's 0700 would hide it from a server run as another user
        old = None
        if out_dir.exists():  # rename cannot replace a non-empty directory: move it aside first
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
            out_dir.rename(old / out_dir.name)
        partial.rename(out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out_dir


def export_for_vllm(source: Path, out_dir: Path, target_num_layers: int) -> Path:
    """Any drafter we read (SpecForge, speculators), rewritten as vLLM loads it, with the aux
    layer ids its config declares translated to vLLM's convention."""
    checkpoint = read_drafter(source, target_num_layers)
    return write_vllm_drafter(
        out_dir, checkpoint.config, checkpoint.tensors, checkpoint.aux_layer_ids.vllm
    )
