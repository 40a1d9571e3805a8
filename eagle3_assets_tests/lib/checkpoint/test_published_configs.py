"""The motivating pair, as published: AQ-MedAI/Kimi-K2-Instruct-eagle3 (a SpecForge v0.2
drafter for Kimi-K2) and Kimi-K2.5's config. Validation reads only config.json, the
safetensors headers and d2t/t2d, so files of the real shapes (weights left as holes in sparse
files) show what the download step concludes about the real pair, in seconds: the pair fits,
its parameter count and tensor table, which aux layers each convention reads, and that wrong
pairings fail naming the field."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from eagle3_assets.lib.checkpoint.drafter_io import (
    SPECFORGE,
    DrafterValidationError,
    validate_drafter,
    vllm_config,
)
from eagle3_assets.lib.core.layer_ids import (
    KEY,
    AuxLayerIds,
    LayerIdSource,
    Reading,
    aux_layer_ids,
    default_aux_layers,
    nested_readings,
)
from eagle3_assets.lib.core.target import TargetShape
from eagle3_assets.lib.training.ttt import TargetHead
from eagle3_assets_tests.lib.checkpoint.layouts import sparse_safetensors

H, VOCAB, DRAFT_VOCAB, LAYERS = 7168, 163840, 32000, 61
BF16 = torch.bfloat16

# config.json of AQ-MedAI/Kimi-K2-Instruct-eagle3 as SpecForge v0.2 writes it: a Llama config
# with the ids nested in eagle_config (SGLang convention), none at the top level.
K2_DRAFTER_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "pad_token_id": 0,
    "hidden_act": "silu",
    "hidden_size": H,
    "intermediate_size": 18432,
    "num_hidden_layers": 1,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "head_dim": 128,
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.52.3",
    "use_cache": True,
    "vocab_size": VOCAB,
    "draft_vocab_size": DRAFT_VOCAB,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58], "use_aux_hidden_state": True},
}

# The drafter's tensors as stored, with their published shapes: fc reads 3 aux states, the
# attention's input is [embedding, hidden] (2H), 64 heads x 128.
K2_DRAFTER_TENSORS = {
    "fc.weight": ("BF16", (7168, 21504)),
    "midlayer.self_attn.q_proj.weight": ("BF16", (8192, 14336)),
    "midlayer.self_attn.k_proj.weight": ("BF16", (8192, 14336)),
    "midlayer.self_attn.v_proj.weight": ("BF16", (8192, 14336)),
    "midlayer.self_attn.o_proj.weight": ("BF16", (7168, 8192)),
    "midlayer.mlp.gate_proj.weight": ("BF16", (18432, 7168)),
    "midlayer.mlp.up_proj.weight": ("BF16", (18432, 7168)),
    "midlayer.mlp.down_proj.weight": ("BF16", (7168, 18432)),
    "midlayer.input_layernorm.weight": ("BF16", (7168,)),
    "midlayer.hidden_norm.weight": ("BF16", (7168,)),
    "midlayer.post_attention_layernorm.weight": ("BF16", (7168,)),
    "norm.weight": ("BF16", (7168,)),
    "lm_head.weight": ("BF16", (32000, 7168)),
    "d2t": ("I64", (32000,)),
    "t2d": ("BOOL", (163840,)),
}
# fc 154,140,672 + q/k/v 3 x 117,440,512 + o 58,720,256 + mlp 3 x 132,120,576
# + 4 norms x 7,168 + lm_head 229,376,000 (d2t/t2d are not weights)
K2_DRAFTER_PARAMETERS = 1_190_948_864

# config.json of Kimi-K2.5: a multimodal wrapper whose language model (DeepSeek-V3
# architecture, MLA, 384 routed experts) sits in text_config.
KIMI_K25_CONFIG = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "auto_map": {
        "AutoConfig": "configuration_kimi_k25.KimiK25Config",
        "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
    },
    "media_placeholder_token_id": 163605,
    "vision_config": {"model_type": "kimi_k25_vision", "hidden_size": 1152},
    "text_config": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": VOCAB,
        "hidden_size": H,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": LAYERS,
        "num_nextn_predict_layers": 0,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.827,
        "hidden_act": "silu",
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-05,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 64.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "bos_token_id": 163584,
        "eos_token_id": 163585,
        "pad_token_id": 163839,
        "tie_word_embeddings": False,
    },
}
# The target tensors the trainer reads (TargetHead: the teacher's norm and lm_head, the
# drafter's embedding), under Kimi-K2.5's language_model. prefix
KIMI_K25_HEAD = {
    "language_model.model.embed_tokens.weight": ((VOCAB, H), BF16),
    "language_model.model.norm.weight": ((H,), BF16),
    "language_model.lm_head.weight": ((VOCAB, H), BF16),
}


def vocab_maps(draft_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """d2t and t2d of a draft vocab (sorted target ids): target id = draft id + d2t[draft id]."""
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[draft_ids] = True
    return {"d2t": draft_ids - torch.arange(len(draft_ids)), "t2d": t2d}


def write_drafter(path: Path, config: dict, maps: dict[str, torch.Tensor]) -> Path:
    """A drafter directory as published: config.json and model.safetensors (weights sparse)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config, indent=2))
    weights = {
        name: (shape, BF16)
        for name, (dtype, shape) in K2_DRAFTER_TENSORS.items()
        if dtype == "BF16"
    }
    sparse_safetensors(path / "model.safetensors", weights, maps)
    return path


def write_target(path: Path, config: dict) -> Path:
    """A target folder as the pipeline reads it: config.json and the head's safetensors."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config, indent=2))
    sparse_safetensors(path / "model-00064-of-000064.safetensors", KIMI_K25_HEAD, {})
    return path


@pytest.fixture(scope="module")
def draft_ids() -> torch.Tensor:
    """32000 target ids, sorted, spread over the whole vocab (the last id among them)."""
    ids = torch.randperm(VOCAB - 1, generator=torch.Generator().manual_seed(0))[: DRAFT_VOCAB - 1]
    return torch.cat([ids.sort().values, torch.tensor([VOCAB - 1])])


@pytest.fixture(scope="module")
def k2_drafter(tmp_path_factory, draft_ids) -> Path:
    root = tmp_path_factory.mktemp("hub")
    return write_drafter(root / "Kimi-K2-Instruct-eagle3", K2_DRAFTER_CONFIG, vocab_maps(draft_ids))


@pytest.fixture(scope="module")
def kimi_k25(tmp_path_factory) -> Path:
    return write_target(tmp_path_factory.mktemp("target") / "Kimi-K2.5", KIMI_K25_CONFIG)


def test_the_files_are_sparse_and_the_shapes_real(k2_drafter, kimi_k25):
    """2.4 GB of bf16 weights, then d2t (int64) and t2d (bool), on under a MiB of disk."""
    weights = k2_drafter / "model.safetensors"
    with open(weights, "rb") as f:
        header = 8 + int.from_bytes(f.read(8), "little")
    data = 2 * K2_DRAFTER_PARAMETERS + 8 * DRAFT_VOCAB + VOCAB
    assert weights.stat().st_size == header + data
    assert weights.stat().st_blocks * 512 < 2**20
    head = kimi_k25 / "model-00064-of-000064.safetensors"
    assert head.stat().st_blocks * 512 < 2**20


def test_the_published_drafter_fits_kimi_k25_from_headers_alone(k2_drafter, kimi_k25, draft_ids):
    target = TargetShape.from_config(kimi_k25)  # text_config, not the wrapper's fields
    assert target == TargetShape(hidden_size=H, vocab_size=VOCAB, num_hidden_layers=LAYERS)

    info = validate_drafter(k2_drafter, target)

    assert info.source_format == SPECFORGE
    assert info.architectures == ["LlamaForCausalLMEagle3"]
    assert info.num_parameters == K2_DRAFTER_PARAMETERS
    assert info.tensors == {
        name: (dtype, shape) for name, (dtype, shape) in K2_DRAFTER_TENSORS.items()
    }
    config = info.config
    assert (config.hidden_size, config.intermediate_size, config.vocab_size) == (H, 18432, VOCAB)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        64,
        64,
        128,
    )
    assert (config.draft_vocab_size, config.rope_theta, config.rms_norm_eps) == (
        DRAFT_VOCAB,
        1e6,
        1e-5,
    )
    assert config.max_position_embeddings == 131072
    assert config.num_aux_hidden_states == 3
    assert config.target_hidden_size is None  # reads the target's own hidden size

    # The nested ids read as SGLang's: vLLM ids [3, 31, 59], what the export serves
    assert info.aux_layer_ids.vllm == (3, 31, 59)
    assert info.aux_layer_ids.source == LayerIdSource.NESTED
    assert info.aux_layer_ids.sglang == (2, 30, 58)
    exported = vllm_config(config, info.aux_layer_ids.vllm, BF16)
    assert exported[KEY] == [3, 31, 59]
    assert exported["eagle_config"][KEY] == [2, 30, 58]
    assert aux_layer_ids(exported, LAYERS) == AuxLayerIds((3, 31, 59), LayerIdSource.TOP_LEVEL)
    # The other reading, [2, 30, 58] as vLLM ids, is vLLM's own default for 61 layers: what a
    # vLLM serving the config as published uses (it ignores nested ids). Both are in range for
    # 61 layers, so only a measurement tells them apart: the pipeline sees two readings.
    assert default_aux_layers(LAYERS) == (2, 30, 58)
    assert nested_readings(info.aux_layer_ids, LAYERS) == {
        Reading.SGLANG: (3, 31, 59),
        Reading.VLLM: (2, 30, 58),
    }


def test_kimi_k25_head_names_are_the_ones_the_trainer_reads(kimi_k25):
    """TargetHead finds the embedding, final norm and lm_head under language_model. (its
    candidates in order, the first present wins), at the shapes the drafter needs."""
    with safe_open(kimi_k25 / "model-00064-of-000064.safetensors", framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    found = {
        key: next(name for name in candidates if name in shapes)
        for key, candidates in TargetHead.NAMES.items()
    }
    assert found == {
        "embed": "language_model.model.embed_tokens.weight",
        "norm": "language_model.model.norm.weight",
        "lm_head": "language_model.lm_head.weight",
    }
    assert [shapes[found[key]] for key in ("embed", "norm", "lm_head")] == [
        (VOCAB, H),
        (H,),
        (VOCAB, H),
    ]


@pytest.mark.parametrize(
    ("target", "message"),
    [
        # DeepSeek-V3 itself: hidden 7168, 61 layers, but its own 129280-token vocab
        (
            TargetShape(hidden_size=H, vocab_size=129280, num_hidden_layers=LAYERS),
            "vocab_size: expected 129280 (target), found 163840",
        ),
        # Qwen3-235B-A22B: another hidden size and vocab, 94 layers
        (
            TargetShape(hidden_size=4096, vocab_size=151936, num_hidden_layers=94),
            "hidden_size: expected 4096 (target), found 7168",
        ),
        # Moonlight-16B-A3B (Kimi's tokenizer, hidden 2048, 27 layers): ids 31 and 59 out of range
        (
            TargetShape(hidden_size=2048, vocab_size=VOCAB, num_hidden_layers=27),
            f"{KEY} [31, 59]: expected vLLM ids in [1, 27]",
        ),
    ],
)
def test_the_published_drafter_refuses_wrong_targets(k2_drafter, target, message):
    with pytest.raises(DrafterValidationError, match=f"(?m)^{re.escape(message)}") as refused:
        validate_drafter(k2_drafter, target)
    assert str(k2_drafter) in str(refused.value)


def test_inconsistent_vocab_maps_fail_naming_d2t(tmp_path, draft_ids):
    """d2t and t2d are the only values validation reads: a d2t that points one draft id at a
    target id t2d does not mark fails, naming the draft id and both target ids."""
    maps = vocab_maps(draft_ids)
    maps["d2t"][100] += 1
    assert not maps["t2d"][draft_ids[100] + 1]  # the id it now points at is not in t2d
    drafter = write_drafter(tmp_path / "drafter", K2_DRAFTER_CONFIG, maps)
    with pytest.raises(DrafterValidationError) as refused:
        validate_drafter(drafter, TargetShape(H, VOCAB, LAYERS))
    assert (
        "d2t: expected draft id + d2t to be the ids where t2d is true, in increasing order; "
        f"found 1 draft ids off, first draft id 100: expected target id {int(draft_ids[100])}, "
        f"found {int(draft_ids[100]) + 1}"
    ) in str(refused.value)


def test_a_top_level_list_disagreeing_with_the_nested_one_is_refused(tmp_path, draft_ids):
    """Kimi's config with vLLM's default written on top: vLLM would feed [2, 30, 58] while
    SpecForge trained on [3, 31, 59] (vLLM ids). Refused, naming both."""
    config = {**K2_DRAFTER_CONFIG, KEY: [2, 30, 58]}
    drafter = write_drafter(tmp_path / "drafter", config, vocab_maps(draft_ids))
    with pytest.raises(DrafterValidationError) as refused:
        validate_drafter(drafter, TargetShape(H, VOCAB, LAYERS))
    assert (
        f"{KEY}: expected the top-level ids (vLLM) to equal eagle_config's (SGLang) plus one, "
        "found top-level [2, 30, 58] and nested [2, 30, 58] (= [3, 31, 59] in vLLM ids)"
    ) in str(refused.value)
