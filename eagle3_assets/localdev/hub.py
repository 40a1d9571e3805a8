"""The miniature world's hub: an EAGLE-3 drafter for target-v1 in the SpecForge v0.2 layout,
and a Hugging Face hub cache holding it, so that the real client downloads it offline.

The drafter looks like AQ-MedAI's: ids nested in `eagle_config`, no `embed_tokens`, and a
pickled `training_state.pt` beside the weights that must never be downloaded or unpickled.
Like AQ-MedAI's [2, 30, 58] for 61 layers, its nested list is vLLM's default for the target,
so the file cannot say which convention it is in: the world drafter can be trained on either
reading of that same list, and the published one is trained on the SGLang reading
(SpecForge's convention). For a DeepSeek-V3 (Kimi) target the config has AQ-MedAI's fields.
"""

import hashlib
import json
import os
import pydoc_data.topics
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from huggingface_hub.file_download import repo_folder_name
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from eagle3_assets.lib.core.atomic_files import held_alone
from eagle3_assets.lib.core.layer_ids import (
    KEY,
    Reading,
    default_aux_layers,
    sglang_to_vllm,
    vllm_to_sglang,
)
from eagle3_assets.lib.core.target import target_config
from eagle3_assets.localdev.tokenization_kimi_mini import BPE_FILE
from eagle3_assets.localdev.world import World, isolated_torch

# Target config fields the drafter's single decoder layer shares, when the target has them.
SHARED_FIELDS = (
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "dtype",
)
# What AQ-MedAI/Kimi-K2-Instruct-eagle3's config says beyond the shapes: its own plain rope
# (no YaRN: the target's rope_scaling is not the drafter's), its window, its norm epsilon.
KIMI_DRAFTER_FIELDS = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "max_position_embeddings": 131072,
    "initializer_range": 0.02,
    "use_cache": True,
}
KIMI_MODEL_TYPES = ("deepseek_v3", "kimi_k2")  # the targets whose drafters AQ-MedAI's plays


def draft_vocab(tokenizer_file: Path, vocab_size: int, draft_vocab_size: int) -> list[int]:
    """The `draft_vocab_size` target token ids most frequent in the topic corpus, sorted by id;
    ties (and ids the corpus never produces) go to the lower id."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    texts = [pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics)]
    ids = np.concatenate([e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)])
    counts = np.bincount(ids, minlength=vocab_size)
    return sorted(np.argsort(-counts, kind="stable")[:draft_vocab_size].tolist())


def make_untrained_drafter(
    target_dir: Path,
    out_dir: Path,
    draft_vocab_size: int,
    seed: int,
    nested_ids: Sequence[int] | None = None,
) -> Path:
    """Write a randomly initialised EAGLE-3 drafter for the target in `target_dir` (config.json
    and its BPE file) to `out_dir`: config.json, model.safetensors, training_state.pt.
    `nested_ids` is the list written to `eagle_config` (default: vLLM's default ids in SGLang
    convention, which only the SGLang reading keeps in range)."""
    target = target_config(target_dir)
    H, vocab = target["hidden_size"], target["vocab_size"]
    heads = target["num_attention_heads"]
    kimi = target.get("model_type") in KIMI_MODEL_TYPES
    # AQ-MedAI's drafter: as many KV heads as heads (64/64), and head_dim its own (128).
    kv_heads = heads if kimi else target.get("num_key_value_heads") or heads
    head_dim = H // heads if kimi else target.get("head_dim") or H // heads
    intermediate = target["intermediate_size"]
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} not in [1, {vocab}]")
    dtype = getattr(torch, target.get("dtype") or target.get("torch_dtype") or "float32")
    if nested_ids is None:
        nested_ids = vllm_to_sglang(default_aux_layers(target["num_hidden_layers"]))

    bpe = target_dir / "tokenizer.json"
    if not bpe.exists():  # the Kimi world's remote-code tokenizer keeps its BPE elsewhere
        bpe = target_dir / BPE_FILE
    ids = torch.tensor(draft_vocab(bpe, vocab, draft_vocab_size))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    d2t = ids - torch.arange(draft_vocab_size)  # target id = draft id + d2t[draft id]

    generator = torch.Generator().manual_seed(seed)

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return (torch.randn(out_features, in_features, generator=generator) * 0.02).to(dtype)

    def norm() -> torch.Tensor:
        return torch.ones(H, dtype=dtype)

    tensors = {
        "fc.weight": linear(H, 3 * H),  # the 3 concatenated aux states -> H
        "midlayer.self_attn.q_proj.weight": linear(heads * head_dim, 2 * H),  # [embed, hidden]
        "midlayer.self_attn.k_proj.weight": linear(kv_heads * head_dim, 2 * H),
        "midlayer.self_attn.v_proj.weight": linear(kv_heads * head_dim, 2 * H),
        "midlayer.self_attn.o_proj.weight": linear(H, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": linear(intermediate, H),
        "midlayer.mlp.up_proj.weight": linear(intermediate, H),
        "midlayer.mlp.down_proj.weight": linear(H, intermediate),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "norm.weight": norm(),
        "lm_head.weight": linear(draft_vocab_size, H),
        "d2t": d2t,
        "t2d": t2d,
    }
    if kimi:
        tokens = ("bos_token_id", "eos_token_id", "pad_token_id")
        shared = {**{f: target[f] for f in tokens if f in target}, **KIMI_DRAFTER_FIELDS}
        shared["torch_dtype"] = str(dtype).removeprefix("torch.")
    else:
        shared = {field: target[field] for field in SHARED_FIELDS if field in target}
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab_size,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "tie_word_embeddings": False,
        **shared,
        "eagle_config": {KEY: list(nested_ids), "use_aux_hidden_state": True},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    torch.save({"step": 0, "seed": seed}, out_dir / "training_state.pt")
    return out_dir


def publish_to_hub_cache(
    repo_dir: Path, cache_dir: Path, repo_id: str, repo_type: str = "model"
) -> str:
    """Lay out every file of `repo_dir` as revision `main` of model `repo_id` in a Hugging Face
    hub cache (blobs/, snapshots/<sha>/ symlinks, refs/main) and return the commit sha, a
    hash of the files' names and contents, so republishing the same files is a no-op."""
    digests = {}
    for path in sorted(p for p in repo_dir.rglob("*") if p.is_file()):
        with open(path, "rb") as f:
            digests[path.relative_to(repo_dir).as_posix()] = hashlib.file_digest(f, "sha256")
    listing = "".join(f"{name}\0{digest.hexdigest()}\n" for name, digest in digests.items())
    sha = hashlib.sha1(listing.encode()).hexdigest()

    repo = cache_dir / repo_folder_name(repo_id=repo_id, repo_type=repo_type)
    with held_alone(repo):  # parallel tests: one publishes at a time
        for name, digest in digests.items():
            blob = repo / "blobs" / digest.hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            if not blob.exists():
                shutil.copyfile(repo_dir / name, blob)
            link = repo / "snapshots" / sha / name
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.is_symlink():
                link.symlink_to(os.path.relpath(blob, link.parent))
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(sha)  # no newline: the client reads it verbatim
    return sha


LOCAL_DRAFTER_REPO = "local/target-v1-eagle3"  # plays AQ-MedAI/Kimi-K2-Instruct-eagle3


DRAFTER_RECIPE_VERSION = 2  # bump when the world drafter's recipe changes: a new cache entry
DRAFTER_THREADS = 2  # its bytes depend on torch's thread count: those of a 2-core machine
PUBLISHED_READING = Reading.SGLANG  # the world's published drafter, as SpecForge writes ids


def trained_layers(nested_ids: Sequence[int], reading: Reading) -> tuple[int, ...]:
    """The vLLM ids a drafter whose config nests `nested_ids` was trained on, per reading."""
    return sglang_to_vllm(nested_ids) if reading is Reading.SGLANG else tuple(nested_ids)


def published_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The vLLM ids the world's published drafter was trained on: what a user who knows its
    history sets as EAGLE3_AUX_LAYER_IDS (trained briefly, it is too far from rest for the
    layer probe to tell its two readings apart reliably)."""
    return trained_layers(default_aux_layers(num_layers), PUBLISHED_READING)


def train_world_drafter(
    world: World, draft_vocab_size: int, steps: int = 100, reading: Reading = PUBLISHED_READING
) -> Path:
    """The world's "K2 drafter": EAGLE-3 trained with this project's code on target-v1's own
    greedy answers, saved in the SpecForge v0.2 layout (ids nested, a pickle beside it), as
    AQ-MedAI's drafter was trained for Kimi-K2. Its nested list is vLLM's default for the
    target, and it is trained on that list's `reading`: the two drafters of the two readings
    have the same config and differ only in the layers their weights learned. Built once per
    world, vocab size, steps and reading (in a temp dir renamed into place, by one process at
    a time), so republishing is a no-op."""
    reading = Reading(reading)
    name = f"k2-drafter-{draft_vocab_size}-{reading}-{steps}-v{DRAFTER_RECIPE_VERSION}"
    out_dir = world.root / name
    with held_alone(out_dir):  # parallel tests: one trains
        if not (out_dir / "model.safetensors").exists():
            with isolated_torch(DRAFTER_THREADS):  # the same bytes whoever trains it
                _train_world_drafter(world, out_dir, draft_vocab_size, steps, reading)
    return out_dir


def _train_world_drafter(
    world: World, out_dir: Path, draft_vocab_size: int, steps: int, reading: Reading
) -> None:
    from eagle3_assets.lib.checkpoint.layer_probe import LayerIdDecision, pin_layer_ids
    from eagle3_assets.lib.hidden_states.extract import LayerSelection
    from eagle3_assets.lib.training.train_drafter import RunConfig, train
    from eagle3_assets.localdev.greedy import greedy_hidden_states

    target = world.target_v1
    config = target_config(target)
    nested = default_aux_layers(config["num_hidden_layers"])  # the trap: vLLM's default
    layers = LayerSelection(
        aux=trained_layers(nested, reading),
        final=config["num_hidden_layers"],
        source=f"nested {list(nested)} read as {reading} ids",
    )
    with tempfile.TemporaryDirectory(dir=world.root) as scratch:
        work = Path(scratch)
        untrained = make_untrained_drafter(
            target, work / "drafter", draft_vocab_size, seed=0, nested_ids=nested
        )
        greedy_hidden_states(
            target,
            world.prompts,
            count=64,
            max_new_tokens=64,
            layers=layers,
            out_dir=work / "hidden_states",
            identity={"target": "target-v1"},
            chat_template_kwargs=world.spec.chat_template_kwargs,
            trust_remote_code=world.spec.trust_remote_code,  # Kimi's tokenizer: remote code
        )
        # trained from a copy whose config pins the reading's layers; published with the
        # untrained drafter's config, which names only the nested list
        warm = work / "warm"
        shutil.copytree(untrained, warm)
        pin_layer_ids(warm, LayerIdDecision(layers.aux, f"{reading} reading", list(nested)))
        run = RunConfig(
            batch_dirs=[str(work / "hidden_states")],
            warm_start=str(warm),
            target=str(target),
            out_dir=str(work / "run"),
            steps=steps,
            lr=3e-3,  # from scratch, on a tiny model
            warmup_ratio=0.05,
        )
        trained = load_file(train(run).checkpoint / "model.safetensors")
        save_file(trained, untrained / "model.safetensors", metadata={"format": "pt"})
        os.replace(untrained, out_dir)


def publish_local_drafter(
    world: World, cache_dir: Path, draft_vocab_size: int, repo_id: str = LOCAL_DRAFTER_REPO
) -> str:
    """The world's warm-start drafter (trained for target-v1, as the public drafter was for
    K2), published in a hub cache. Returns the commit sha."""
    return publish_to_hub_cache(train_world_drafter(world, draft_vocab_size), cache_dir, repo_id)
