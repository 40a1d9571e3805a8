"""Read, validate and write EAGLE-3 drafters: the one place that knows their layouts.

Two layouts come in. SpecForge v0.2 (the AQ-MedAI Kimi-K2 drafter): a LlamaForCausalLMEagle3
config with the aux ids nested in `eagle_config` (SGLang convention) and `midlayer.*` tensors.
speculators: `speculators_config` + `transformer_layer_config`, top-level ids (vLLM
convention) and `layers.0.*` tensors. Both are read into our names: a `DrafterConfig`,
tensors named as `Eagle3Drafter`'s state dict, and the ids in vLLM convention.

`validate_drafter` checks a directory against the target from config.json and the safetensors
headers (plus the small d2t/t2d), loading no weight: the download step runs it. `read_drafter`
runs the same validation, then loads the weights: training and `export_for_vllm` run it. So a
drafter passes at download exactly when training and export can use it.

Anything in a config that changes the math and that our model does not implement is refused
by name, because a warm start that silently drops it trains a different model than the one
that was published. Only safetensors are opened: a SpecForge repo's `training_state.pt` is a
pickle and is never read.

One layout goes out (`write_vllm_drafter`): SpecForge names, vLLM's top-level ids AND the
nested SGLang ids, so vLLM, SpecForge and SGLang readers all see the same layers.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3_assets.lib.core.layer_ids import (
    KEY,
    AuxLayerIds,
    aux_layer_ids,
    check_layer_ids,
    vllm_to_sglang,
)
from eagle3_assets.lib.core.target import TargetShape
from eagle3_assets.lib.training.eagle3_model import DrafterConfig, Eagle3Drafter

SPECFORGE = "specforge"
SPECULATORS = "speculators"
ARCHITECTURE = "LlamaForCausalLMEagle3"  # vLLM's and SpecForge's name for the drafter
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
VOCAB_MAPS = ("d2t", "t2d")
# safetensors header dtypes -> torch's (the ones a drafter can hold)
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class DrafterValidationError(ValueError):
    """The drafter cannot be used with the target; one line per problem."""


@dataclass(frozen=True)
class DrafterInfo:
    """A drafter directory validated against a target, described without its weights: what
    training and export read it as, and what the download asset reports."""

    config: DrafterConfig
    aux_layer_ids: AuxLayerIds  # vLLM convention, and where the config said so
    source_format: str  # SPECFORGE or SPECULATORS
    architectures: list[str]
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # as stored: name -> (dtype, shape)
    num_parameters: int  # the drafter's weights in our names: no d2t/t2d, embeddings, verifier
    bytes_on_disk: int


@dataclass(frozen=True)
class DrafterCheckpoint:
    """A drafter in our names: `tensors` load into `Eagle3Drafter(config, embed)` strictly."""

    info: DrafterInfo
    tensors: dict[str, torch.Tensor]

    @property
    def config(self) -> DrafterConfig:
        return self.info.config

    @property
    def aux_layer_ids(self) -> AuxLayerIds:
        return self.info.aux_layer_ids

    @property
    def source_format(self) -> str:
        return self.info.source_format


def _raise(path: Path, problems: list[str]) -> None:
    if problems:
        raise DrafterValidationError(f"drafter in {path}:\n" + "\n".join(problems))


# ------------------------------------------------------------------------------------- config


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
    for flag in ("norm_before_fc", "fc_norm", "norm_output", "embed_requires_grad"):
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
    """Fields whose non-default value makes vLLM (or the trainer that wrote the drafter)
    compute something `Eagle3Drafter` does not: each is refused with the value found and the
    one we support. Rope scaling is `_rope`'s; the layer's model_type is `_flat_fields`'."""
    eagle_config = fields.get("eagle_config") or {}
    flags = {
        "num_hidden_layers": (fields.get("num_hidden_layers"), 1),
        "eagle_config.use_aux_hidden_state": (eagle_config.get("use_aux_hidden_state", True), True),
        # a norm over the concatenated aux states before fc (gpt-oss style)
        "norm_before_fc": (
            bool(eagle_config.get("norm_before_fc", fields.get("norm_before_fc", False))),
            False,
        ),
        "fc_norm": (bool(fields.get("fc_norm", False)), False),  # a norm per aux state
        "norm_output": (bool(fields.get("norm_output", False)), False),  # normed state fed back
        "attention_bias": (bool(fields.get("attention_bias", False)), False),
        "mlp_bias": (bool(fields.get("mlp_bias", False)), False),
        "hidden_act": (fields.get("hidden_act", "silu"), "silu"),
        "logit_scale": (fields.get("logit_scale", 1.0), 1.0),
        # trained embeddings: ours are the target's, frozen and never saved (vLLM shares them)
        "embed_requires_grad": (bool(fields.get("embed_requires_grad", False)), False),
    }
    for field, (found, expected) in flags.items():
        if found != expected:
            problems.append(f"{field}: expected {expected!r}, found {found!r}")
    # vLLM's Llama layer attends within `sliding_window` where layer_types says
    # "sliding_attention" (speculators' trainer default); ours attends to every position.
    layer_types = fields.get("layer_types")
    if layer_types is not None and (
        not isinstance(layer_types, list) or set(layer_types) != {"full_attention"}
    ):
        problems.append(
            f"layer_types: expected ['full_attention'] (attention over every earlier "
            f"position), found {layer_types!r} with sliding_window "
            f"{fields.get('sliding_window')!r}"
        )


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


def _order_problems(ids: Sequence[int], where: str = "") -> list[str]:
    """vLLM sorts and deduplicates the ids and feeds fc the states in ascending order, so a
    list in any other order would pair fc's column blocks with the wrong layers."""
    if list(ids) == sorted(set(ids)):
        return []
    return [f"{KEY}: expected ascending unique ids (vLLM sorts them), found {list(ids)}{where}"]


@dataclass(frozen=True)
class _Config:
    config: DrafterConfig
    aux_layer_ids: AuxLayerIds
    source_format: str
    architectures: list[str]


def _read_config(path: Path, target_num_layers: int) -> _Config:
    """config.json in either layout, every math-changing field checked, the ids in vLLM
    convention and in range for the target. A wrong config makes every tensor look wrong, so
    its problems are raised alone, before any tensor is looked at."""
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
    where = f" (vLLM ids) from {ids.source.value}"
    problems += _order_problems(ids.vllm, where)
    try:
        check_layer_ids(ids.vllm, target_num_layers, KEY)
    except ValueError as error:
        problems.append(f"{error}{where}")
    config = _drafter_config(fields, ids, problems)
    _raise(path, problems)
    return _Config(config, ids, source_format, list(raw.get("architectures") or []))


def drafter_aux_layer_ids(path: Path, target_num_layers: int) -> AuxLayerIds:
    """The aux layer ids the drafter in `path` reads, in vLLM convention, from its config
    alone (either layout), checked like `validate_drafter` checks them."""
    return _read_config(Path(path), target_num_layers).aux_layer_ids


# ------------------------------------------------------------------------------------ tensors


def _safetensors_files(path: Path) -> list[Path]:
    """The files vLLM loads: the shards the index names, else every *.safetensors. Nothing
    else in the directory is opened (a .pt/.bin there is a pickle)."""
    if (path / SHARD_INDEX).exists():
        weight_map = json.loads((path / SHARD_INDEX).read_text())["weight_map"]
        return [path / shard for shard in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DrafterValidationError(
            f"tensors: expected {SINGLE_FILE} (or shards and {SHARD_INDEX}) in {path}, "
            f"found no safetensors"
        )
    return files


def _headers(path: Path, problems: list[str]) -> dict[str, tuple[str, tuple[int, ...], Path]]:
    """name -> (safetensors dtype, shape, file) from the headers alone: no weight is read."""
    headers: dict[str, tuple[str, tuple[int, ...], Path]] = {}
    for file in _safetensors_files(path):
        if not file.exists():
            problems.append(f"{SHARD_INDEX}: expected the shard {file.name}, found none")
            continue
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in headers:
                    problems.append(
                        f"{name}: expected in one file, found in {headers[name][2].name} "
                        f"and {file.name}"
                    )
                part = f.get_slice(name)
                headers[name] = (part.get_dtype(), tuple(part.get_shape()), file)
    if (path / SHARD_INDEX).exists():
        named = json.loads((path / SHARD_INDEX).read_text())["weight_map"]
        missing = sorted(set(named) - set(headers))
        if missing:
            problems.append(
                f"{SHARD_INDEX}: expected its shards to hold every tensor it names, "
                f"found {missing} missing"
            )
    return headers


def _our_name(name: str) -> str | None:
    """speculators' `layers.0.*` is SpecForge's `midlayer.*` (vLLM loads both the same way);
    embeddings and verifier tensors are not part of the drafter we train (None)."""
    if name in DROPPED or name.startswith(DROPPED_PREFIXES):
        return None
    if name.startswith("layers.0."):
        return "midlayer." + name.removeprefix("layers.0.")
    return name


def _fill_vocab_maps(config: DrafterConfig, tensors: dict[str, torch.Tensor]) -> None:
    """d2t and t2d say the same thing; vLLM ignores t2d and needs d2t only when the vocabs
    differ, so a file may hold one or neither. Derive what is missing."""
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is None and t2d is None and config.draft_vocab_size == config.vocab_size:
        tensors["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.int64)
        tensors["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    elif t2d is None and d2t is not None and d2t.dtype == torch.int64 and d2t.dim() == 1:
        targets = torch.arange(len(d2t)) + d2t
        if len(targets) and targets.min() >= 0 and targets.max() < config.vocab_size:
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


def check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor, draft_vocab: int) -> list[str]:
    """t2d marks draft_vocab target ids; draft id i maps to the i-th of them in increasing
    order (target id = i + d2t[i]), the order lm_head's rows were trained in."""
    if int(t2d.sum()) != draft_vocab:
        return [
            f"t2d: expected {draft_vocab} true entries (draft_vocab_size), found {int(t2d.sum())}"
        ]
    expected = torch.nonzero(t2d).flatten()
    found = torch.arange(draft_vocab) + d2t.cpu()
    wrong = torch.nonzero(found != expected.cpu()).flatten()
    if len(wrong) == 0:
        return []
    i = int(wrong[0])
    return [
        f"d2t: expected draft id + d2t to be the ids where t2d is true, in increasing order; "
        f"found {len(wrong)} draft ids off, first draft id {i}: expected target id "
        f"{int(expected[i])}, found {int(found[i])}"
    ]


def check_tensors(
    config: DrafterConfig,
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype | str]],
    vocab_maps: dict[str, torch.Tensor],
) -> list[str]:
    """Problems with tensors of these (shape, dtype) as the state dict of `config`'s drafter:
    names, shapes, the dtypes of d2t/t2d (values in `vocab_maps`), and whether d2t and t2d
    describe the same sorted draft vocab. A dtype torch has no name for stays a string."""
    problems = []
    expected = expected_tensors(config)
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    if missing:
        problems.append(f"tensors: expected {missing}, found none of them")
    if unexpected:
        problems.append(
            f"tensors: expected only EAGLE-3 drafter names, found {unexpected} (a variant "
            f"our model does not implement?)"
        )
    for name, (shape, dtype) in expected.items():
        if name not in shapes:
            continue
        found_shape, found_dtype = shapes[name]
        if tuple(found_shape) != shape:
            problems.append(f"{name}: expected shape {list(shape)}, found {list(found_shape)}")
        if name in VOCAB_MAPS and found_dtype != dtype:
            problems.append(f"{name}: expected dtype {dtype}, found {found_dtype}")
        elif name not in VOCAB_MAPS and not (
            isinstance(found_dtype, torch.dtype) and found_dtype.is_floating_point
        ):
            problems.append(f"{name}: expected a floating-point dtype, found {found_dtype}")
    if not problems:
        d2t, t2d = (vocab_maps[name] for name in VOCAB_MAPS)
        problems += check_vocab_maps(d2t, t2d, config.draft_vocab_size)
    return problems


def _fit_problems(config: DrafterConfig, target: TargetShape) -> list[str]:
    """The drafter reads this target: its embeddings are the target's ([vocab, hidden]), d2t
    and t2d index its vocab, and fc reads one target hidden state per aux layer."""
    problems = []
    if config.hidden_size != target.hidden_size:
        problems.append(
            f"hidden_size: expected {target.hidden_size} (target), found {config.hidden_size}"
        )
    if config.target_hidden_size not in (None, target.hidden_size):
        problems.append(
            f"target_hidden_size: expected {target.hidden_size} (target), "
            f"found {config.target_hidden_size}"
        )
    if config.vocab_size != target.vocab_size:
        problems.append(
            f"vocab_size: expected {target.vocab_size} (target), found {config.vocab_size}"
        )
    return problems


def _inspect(
    path: Path, target: TargetShape
) -> tuple[DrafterInfo, dict[str, tuple[str, tuple[int, ...], Path]], dict[str, torch.Tensor]]:
    """The validation: the config, then the target fit and every tensor from the headers,
    with only d2t/t2d (vocab-sized) read. Returns the info, the headers and the vocab maps."""
    path = Path(path)
    read = _read_config(path, target.num_hidden_layers)
    config = read.config
    problems = _fit_problems(config, target)
    headers = _headers(path, problems)
    ours: dict[str, str] = {}
    for stored in headers:
        name = _our_name(stored)
        if name in ours:
            problems.append(f"{name}: expected once, found as {ours[name]} and {stored}")
        elif name is not None:
            ours[name] = stored
    vocab_maps = {}
    for name in VOCAB_MAPS:
        if name in ours:
            with safe_open(headers[ours[name]][2], framework="pt") as f:
                vocab_maps[name] = f.get_tensor(ours[name])
    _fill_vocab_maps(config, vocab_maps)
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype | str]] = {
        name: (headers[stored][1], DTYPES.get(headers[stored][0], headers[stored][0]))
        for name, stored in ours.items()
    }
    shapes.update({name: (tuple(t.shape), t.dtype) for name, t in vocab_maps.items()})
    problems += check_tensors(config, shapes, vocab_maps)
    _raise(path, problems)
    info = DrafterInfo(
        config=config,
        aux_layer_ids=read.aux_layer_ids,
        source_format=read.source_format,
        architectures=read.architectures,
        tensors={name: (dtype, shape) for name, (dtype, shape, _) in headers.items()},
        num_parameters=sum(
            math.prod(shape) for name, (shape, _) in shapes.items() if name not in VOCAB_MAPS
        ),
        bytes_on_disk=sum(p.stat().st_size for p in path.rglob("*") if p.is_file()),
    )
    return info, headers, vocab_maps


def validate_drafter(path: Path, target: TargetShape) -> DrafterInfo:
    """Check that the drafter in `path` (SpecForge or speculators layout) is one our model
    implements and vLLM serves for `target`: config fields, aux ids, every tensor's name,
    shape and dtype, d2t/t2d. No weight is loaded. Raise DrafterValidationError listing every
    problem."""
    return _inspect(path, target)[0]


def read_drafter(path: Path, target: TargetShape) -> DrafterCheckpoint:
    """The drafter in `path`, validated as `validate_drafter` does, with its weights in our
    names. Raise DrafterValidationError listing every problem."""
    info, headers, vocab_maps = _inspect(path, target)
    tensors = dict(vocab_maps)
    for file in sorted({file for _, _, file in headers.values()}):
        with safe_open(file, framework="pt") as f:
            for stored in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                name = _our_name(stored)
                if name is not None and name not in VOCAB_MAPS:
                    tensors[name] = f.get_tensor(stored)
    return DrafterCheckpoint(info, tensors)


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
    target: TargetShape | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the drafter vLLM serves with `--speculative-config '{"method": "eagle3",
    "model": out_dir, ...}'`: config.json and model.safetensors in our (SpecForge) names,
    the weights in `dtype` (None: as held; d2t and t2d keep theirs, and a full draft vocab
    has none).
    Checked first as `validate_drafter` would check the result (against `target` when given:
    the ids' range and the shape fit). The directory is built beside `out_dir` and renamed
    into place, so a reader never sees half of it; an existing `out_dir` is replaced."""
    out_dir = Path(out_dir)
    ids = tuple(aux_layer_ids_vllm)
    if dtype is not None:
        tensors = {
            name: tensor.to(dtype) if tensor.is_floating_point() else tensor
            for name, tensor in tensors.items()
        }
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    vocab_maps = {name: tensors[name] for name in VOCAB_MAPS if name in tensors}
    problems = _order_problems(ids) + check_tensors(config, shapes, vocab_maps)
    if len(ids) != config.num_aux_hidden_states:
        problems.append(
            f"{KEY}: expected {config.num_aux_hidden_states} ids (num_aux_hidden_states), "
            f"found {list(ids)}"
        )
    if target is not None:
        problems += _fit_problems(config, target)
        try:
            check_layer_ids(ids, target.num_hidden_layers, KEY)
        except ValueError as error:
            problems.append(str(error))
    if problems:
        raise DrafterValidationError(f"drafter for {out_dir}:\n" + "\n".join(problems))

    if config.draft_vocab_size == config.vocab_size:  # identity maps (checked above): vLLM
        # builds no d2t for a full draft vocab and refuses one in the file
        tensors = {name: t for name, t in tensors.items() if name not in VOCAB_MAPS}
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


def export_for_vllm(
    source: Path, out_dir: Path, target: TargetShape, dtype: torch.dtype | None = None
) -> Path:
    """Any drafter we read (SpecForge, speculators), validated for `target` and rewritten as
    vLLM loads it, with the aux layer ids its config declares translated to vLLM's convention."""
    checkpoint = read_drafter(source, target)
    ids = checkpoint.aux_layer_ids.vllm
    return write_vllm_drafter(out_dir, checkpoint.config, checkpoint.tensors, ids, target, dtype)
