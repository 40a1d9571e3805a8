"""Checkpoint layouts for tests. Drafters in the speculators layout, laid out as speculators
0.9.0's own `save_pretrained` writes them (Eagle3DraftModel, checked against the package:
config fields, their values and the tensor names), built from a SpecForge-layout drafter's
weights. And safetensors files of published models' real shapes that cost no disk: the
header written by hand, the weights left as a hole in a sparse file."""

import json
import struct
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3_assets.lib.core.layer_ids import KEY

# torch dtype -> the safetensors header's name for it
SAFETENSORS_DTYPES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}

# transformer_layer_config fields speculators copies from the SpecForge config
LAYER_FIELDS = (
    "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "vocab_size", "rms_norm_eps", "max_position_embeddings",
    "rope_parameters", "hidden_act", "num_hidden_layers",
)  # fmt: skip


def speculators_config(source: dict, norm_before_residual: bool | None = False) -> dict:
    """The config.json speculators 0.9.0 saves for an Eagle3DraftModel with `source`'s shape:
    the Llama layer in transformer_layer_config (transformers 5 writes every field), every
    EAGLE-3 flag explicit at the top level, the ids top-level in vLLM convention.
    `norm_before_residual=None` leaves the flag out, as older speculators versions did."""
    config = {
        "architectures": ["Eagle3DraftModel"],
        "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "draft_vocab_size": source["draft_vocab_size"],
        "dtype": "float32",
        KEY: [2, 4, 5],
        "embed_requires_grad": False,
        "fc_norm": False,
        "norm_before_fc": False,
        "norm_before_residual": norm_before_residual,
        "norm_output": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "accept_tolerance": 0.0,
                    "proposal_type": "greedy",
                    "speculative_tokens": 3,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "target-v1"},
        },
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "transformer_layer_config": {
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "initializer_range": 0.02,
            "mlp_bias": False,
            "model_type": "llama",
            "pad_token_id": None,
            "pretraining_tp": 1,
            "tie_word_embeddings": False,
            "transformers_version": "5.24.0",
            "use_cache": True,
            **{field: source[field] for field in LAYER_FIELDS},
        },
        "transformers_version": "5.24.0",
    }
    if norm_before_residual is None:
        del config["norm_before_residual"]
    return config


def speculators_dir(
    specforge_dir: Path,
    dest: Path,
    norm_before_residual: bool | None = False,
    verifier_head: bool = False,
) -> Path:
    """`specforge_dir`'s weights in the speculators layout: layers.0.* names, and the target's
    embeddings saved beside them (0.9.0's save keeps embed_tokens and drops verifier_*; older
    versions saved `verifier_head` too)."""
    source = json.loads((specforge_dir / "config.json").read_text())
    dest.mkdir(parents=True)
    config = speculators_config(source, norm_before_residual)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(specforge_dir / "model.safetensors")
    renamed = {name.replace("midlayer.", "layers.0."): t for name, t in tensors.items()}
    target_matrix = (source["vocab_size"], source["hidden_size"])
    renamed["embed_tokens.weight"] = torch.zeros(target_matrix)
    if verifier_head:
        renamed["verifier_lm_head.weight"] = torch.zeros(target_matrix)
    save_file(renamed, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def sparse_safetensors(
    path: Path,
    zeros: dict[str, tuple[tuple[int, ...], torch.dtype]],
    values: dict[str, torch.Tensor],
) -> Path:
    """A valid safetensors file holding `zeros` (name -> shape, dtype) as zeros and `values`
    as given, in that order. The zeros are never written: the file is truncated to its full
    size, so a published model's GBs of weights take no disk and no time, and a reader of the
    header (or of `values`) sees exactly what the real file would show."""
    layout: dict[str, dict] = {}
    offset = 0
    for name, (shape, dtype) in [
        *zeros.items(),
        *((name, (tuple(t.shape), t.dtype)) for name, t in values.items()),
    ]:
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        layout[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header = json.dumps({"__metadata__": {"format": "pt"}, **layout}).encode()
    header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned, as safetensors writes
    start = 8 + len(header)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for name, tensor in values.items():
            f.seek(start + layout[name]["data_offsets"][0])
            f.write(tensor.contiguous().numpy().tobytes())  # little-endian, as on x86/ARM
        f.truncate(start + offset)
    return path
