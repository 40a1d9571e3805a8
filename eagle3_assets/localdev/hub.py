"""The miniature world's hub: an EAGLE-3 drafter for target-v1 in the SpecForge v0.2 layout,
and a Hugging Face hub cache holding it, so that the real client downloads it offline.

The drafter looks like AQ-MedAI's: ids nested in `eagle_config` in SGLang convention, no
`embed_tokens`, and a pickled `training_state.pt` beside the weights that must never be
downloaded or unpickled.
"""

import hashlib
import json
import os
import pydoc_data.topics
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from huggingface_hub.file_download import repo_folder_name
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from eagle3_assets.lib.core.layer_ids import default_aux_layers, vllm_to_sglang
from eagle3_assets.localdev.world import World

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


def draft_vocab(tokenizer_file: Path, vocab_size: int, draft_vocab_size: int) -> list[int]:
    """The `draft_vocab_size` target token ids most frequent in the topic corpus, sorted by id;
    ties (and ids the corpus never produces) go to the lower id."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    texts = [pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics)]
    ids = np.concatenate([e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)])
    counts = np.bincount(ids, minlength=vocab_size)
    return sorted(np.argsort(-counts, kind="stable")[:draft_vocab_size].tolist())


def make_untrained_drafter(
    target_dir: Path, out_dir: Path, draft_vocab_size: int, seed: int
) -> Path:
    """Write a randomly initialised EAGLE-3 drafter for the target in `target_dir` (config.json
    and tokenizer.json) to `out_dir`: config.json, model.safetensors, training_state.pt."""
    target = json.loads((target_dir / "config.json").read_text())
    H, vocab = target["hidden_size"], target["vocab_size"]
    heads = target["num_attention_heads"]
    kv_heads = target.get("num_key_value_heads") or heads
    head_dim = target.get("head_dim") or H // heads
    intermediate = target["intermediate_size"]
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} not in [1, {vocab}]")
    dtype = getattr(torch, target.get("dtype") or "float32")

    ids = torch.tensor(draft_vocab(target_dir / "tokenizer.json", vocab, draft_vocab_size))
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
        **{field: target[field] for field in SHARED_FIELDS if field in target},
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(
                vllm_to_sglang(default_aux_layers(target["num_hidden_layers"]))
            ),
            "use_aux_hidden_state": True,
        },
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
    (repo / "refs" / "main").write_text(sha)  # no newline: the client reads the ref verbatim
    return sha


LOCAL_DRAFTER_REPO = "local/target-v1-eagle3"  # plays AQ-MedAI/Kimi-K2-Instruct-eagle3


DRAFTER_RECIPE_VERSION = 1  # bump when the world drafter's recipe changes: a new cache entry


def train_world_drafter(world: World, draft_vocab_size: int, steps: int = 100) -> Path:
    """The world's "K2 drafter": EAGLE-3 trained with this project's code on target-v1's own
    greedy answers, saved in the SpecForge v0.2 layout (ids nested, SGLang convention, a
    pickle beside it), as AQ-MedAI's drafter was trained for Kimi-K2. Built once per world
    and vocab size (in a temp dir renamed into place), so republishing is a no-op."""
    from transformers import AutoTokenizer

    from eagle3_assets.lib.hidden_states.extract import (
        ExtractionSettings,
        LayerSelection,
        extract_batch,
    )
    from eagle3_assets.lib.hidden_states.hf_backend import HFTarget
    from eagle3_assets.lib.hidden_states.shard_format import ShardFormat
    from eagle3_assets.lib.hidden_states.token_sequences import build_sequences
    from eagle3_assets.lib.training.train_drafter import RunConfig, train
    from eagle3_assets.localdev.greedy import greedy_generation_rows

    out_dir = world.root / f"k2-drafter-{draft_vocab_size}-v{DRAFTER_RECIPE_VERSION}"
    if (out_dir / "model.safetensors").exists():
        return out_dir
    target = world.target_v1
    config = json.loads((target / "config.json").read_text())
    layers = LayerSelection(
        aux=default_aux_layers(config["num_hidden_layers"]),
        final=config["num_hidden_layers"],
        source="vLLM default",
    )
    with tempfile.TemporaryDirectory(dir=world.root) as scratch:
        work = Path(scratch)
        untrained = make_untrained_drafter(target, work / "drafter", draft_vocab_size, seed=0)
        rows = greedy_generation_rows(target, world.prompts, count=64, max_new_tokens=64)
        sequences, _ = build_sequences(rows, AutoTokenizer.from_pretrained(target))
        extract_batch(
            sequences,
            work / "hidden_states",
            lambda: HFTarget(target, layers.ids, dtype="float32", device="cpu"),
            layers,
            config["hidden_size"],
            ExtractionSettings(ShardFormat("bf16", "bf16")),
            {"target": "target-v1"},
        )
        run = RunConfig(
            batch_dirs=[str(work / "hidden_states")],
            warm_start=str(untrained),
            target=str(target),
            out_dir=str(work / "run"),
            steps=steps,
            lr=3e-3,  # from scratch, on a tiny model
            warmup_ratio=0.05,
        )
        trained = load_file(train(run).checkpoint / "model.safetensors")
        save_file(trained, untrained / "model.safetensors", metadata={"format": "pt"})
        os.replace(untrained, out_dir)
    return out_dir


def publish_local_drafter(
    world: World, cache_dir: Path, draft_vocab_size: int, repo_id: str = LOCAL_DRAFTER_REPO
) -> str:
    """The world's warm-start drafter (trained for target-v1, as the public drafter was for
    K2), published in a hub cache. Returns the commit sha."""
    return publish_to_hub_cache(train_world_drafter(world, draft_vocab_size), cache_dir, repo_id)
