"""The GPU node path on one GPU, with only what a GPU machine without the pipeline has (torch,
transformers, safetensors, numpy, pydantic; no vLLM, nothing downloaded): what the CPU build
cannot check.

1. **Extraction** (`hf` backend, bf16) of the Kimi test world's target (DeepSeek-V3 layers,
   its remote-code tokenizer) on the platform's device, against the same states in float32 on
   the CPU; tokens/s.
2. **Training** a Kimi-width drafter (hidden 7168, 64 x 128 heads, MLP 18,432, target vocab
   163,840, draft vocab 32,000) through the real `train()` with `platform` cuda, the shipped
   recipe (deploy/kimi-k2.5.env: 16,384 tokens per rank, recomputed TTT steps, TTT 7, bf16
   autocast), on synthetic 4,096-token samples (random states: memory and speed do not depend
   on the values). Peak GPU memory against lib/training/memory.py's prediction, tokens/s and
   MFU (model FLOPs: the step's matmuls and causal attention, forward and backward, and the
   teacher's forward).
3. **The export**: bf16, read back and validated against the target as vLLM will load it.

    python benchmarks/gpu_check.py --world data/test-cache/kimi-test     # one GPU, ~5 min
    .venv/bin/python benchmarks/gpu_check.py --world data/test-cache/kimi-test --quick \\
        --platform cpu                                 # the same path at tiny widths, ~1 min

The world is built by the test suite (or `eagle3-world`); only its target-v2 folder is read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eagle3_assets.lib.checkpoint.drafter_io import read_drafter
from eagle3_assets.lib.core.target import TargetShape
from eagle3_assets.lib.hidden_states.extract import (
    ExtractionSettings,
    LayerSelection,
    extract_batch,
)
from eagle3_assets.lib.hidden_states.hf_backend import HFTarget
from eagle3_assets.lib.hidden_states.shard_format import ShardFormat
from eagle3_assets.lib.hidden_states.token_sequences import TokenSequence, render_prompt_ids
from eagle3_assets.lib.training.eagle3_model import DrafterConfig, scratch_config
from eagle3_assets.lib.training.memory import MemoryShape, training_memory
from eagle3_assets.lib.training.train_drafter import RunConfig, train

GIB = 2**30
PEAK_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12}  # dense, SXM
AUX = (2, 30, 58)  # AQ-MedAI's Kimi drafter's layers (vLLM ids); 61 layers, final id 61


@dataclasses.dataclass(frozen=True)
class Width:
    hidden: int
    heads: int
    intermediate: int
    vocab: int
    draft_vocab: int
    length: int  # tokens per sample
    tokens_per_rank: int
    samples: int
    steps: int


KIMI = Width(7168, 64, 18432, 163840, 32000, 4096, 16384, 16, 6)
QUICK = Width(256, 4, 512, 2048, 512, 256, 1024, 8, 2)


def extraction(world: Path, device: str, samples: int) -> dict:
    """The world's target-v2 states in bf16 on `device` against float32 on the CPU."""
    from transformers import AutoTokenizer

    target = world / "target-v2"
    tokenizer = AutoTokenizer.from_pretrained(target, trust_remote_code=True)  # the world's own
    rows = [json.loads(line) for line in (world / "prompts.jsonl").read_text().splitlines()]
    sequences = []
    for i, row in enumerate(rows[:samples]):
        ids = np.asarray(render_prompt_ids(tokenizer, row["messages"], {}), dtype=np.int64)
        sequences.append(TokenSequence(f"s{i}", ids, np.ones(len(ids), dtype=bool), False))
    layers = (1, 2, 3)
    tokens = sum(len(s) for s in sequences)

    def states(dtype: str, on: str) -> tuple[dict[int, torch.Tensor], float]:
        with HFTarget(target, layers, dtype, on, trust_remote_code=True) as source:
            started = time.perf_counter()
            found = {i: s.float().cpu() for i, s in source.capture(sequences, 4096)}
            return found, time.perf_counter() - started

    reference, _ = states("float32", "cpu")
    states("bfloat16", device)  # warm-up: kernels, allocator
    measured, seconds = states("bfloat16", device)
    error = max(
        float((measured[i] - reference[i]).abs().max() / reference[i].abs().max())
        for i in reference
    )
    return {"samples": len(sequences), "tokens": tokens, "tokens_per_s": tokens / seconds,
            "max_error_vs_cpu_fp32": error}  # fmt: skip


def wide_target(root: Path, width: Width) -> Path:
    """A target folder of Kimi's width with what training reads: config, embedding, final
    norm, lm_head (random: the teacher's values do not change memory or speed)."""
    root.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": width.hidden,
        "num_attention_heads": width.heads,
        "num_key_value_heads": width.heads,
        "head_dim": 128 if width.hidden >= 1024 else width.hidden // width.heads,
        "intermediate_size": width.intermediate,
        "vocab_size": width.vocab,
        "num_hidden_layers": 61,
        "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0,
        "max_position_embeddings": 8192,
    }
    (root / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(0)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    weights = {
        "model.embed_tokens.weight": normal(width.vocab, width.hidden),
        "model.norm.weight": torch.ones(width.hidden, dtype=torch.bfloat16),
        "lm_head.weight": normal(width.vocab, width.hidden),
    }
    save_file(weights, root / "model.safetensors")
    return root


class RandomStates:
    """A state source of random aux and final states (the extraction backends' protocol)."""

    def __init__(self, hidden: int, columns: int) -> None:
        self.hidden_size, self.columns = hidden, columns

    def __enter__(self) -> RandomStates:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def capture(self, sequences, batch_tokens):
        for index, sequence in enumerate(sequences):
            generator = torch.Generator().manual_seed(index)
            shape = (len(sequence), self.columns, self.hidden_size)
            yield index, torch.randn(*shape, generator=generator).to(torch.bfloat16)

    def top_logits(self, final, k):
        raise ValueError("bf16 final states only")


def model_flops_per_token(config: DrafterConfig, length: int, ttt: int) -> float:
    """Forward + backward of every TTT step's matmuls and causal attention, fc once, and the
    teacher's lm_head forward: the FLOPs the recipe needs (not what recomputation adds)."""
    H, A = config.hidden_size, config.num_attention_heads * config.head_dim
    KV = config.num_key_value_heads * config.head_dim
    layer = 2 * H * A + 2 * (2 * H * KV) + A * H + 3 * H * config.intermediate_size
    per_step = 6 * (layer + config.draft_vocab_size * H) + 6 * 2 * A * length  # causal: S / 2
    return ttt * per_step + 6 * 3 * H * H + 2 * H * config.vocab_size


def training(width: Width, platform: str, work: Path) -> dict:
    target = wide_target(work / "target", width)
    sequences = []
    generator = np.random.default_rng(0)
    for i in range(width.samples):
        ids = generator.integers(0, width.vocab, width.length, dtype=np.int64)
        mask = np.arange(width.length) >= width.length // 8  # the answer after a prompt
        sequences.append(TokenSequence(f"s{i:03d}", ids, mask, False))
    layers = LayerSelection(aux=AUX, final=61, source="gpu check")
    settings = ExtractionSettings(ShardFormat("bf16", "bf16"), shard_bytes=2**30)
    extract_batch(
        sequences,
        work / "hidden_states",
        lambda: RandomStates(width.hidden, len(layers.ids)),
        layers,
        width.hidden,
        settings,
        {"target": "gpu check"},
    )
    run = RunConfig(
        batch_dirs=[str(work / "hidden_states")],
        warm_start=None,
        target=str(target),
        out_dir=str(work / "run"),
        steps=width.steps,
        batch_size=min(32, width.samples),  # the shipped cap; the budget binds first
        tokens_per_rank=width.tokens_per_rank,
        activation_checkpointing=True,
        ttt_length=7,
        draft_vocab_size=width.draft_vocab,
        holdout_fraction=0.0,
        checkpoint_every=10_000,
        platform=platform,
    )
    if platform == "cuda":
        torch.cuda.reset_peak_memory_stats()
    result = train(run, lambda metrics: print(json.dumps(metrics), flush=True))
    config = scratch_config(json.loads((target / "config.json").read_text()), width.draft_vocab)
    predicted = training_memory(MemoryShape.of(config, width.tokens_per_rank, 7, True))
    # the first step compiles kernels and warms the allocator: the rate of the later steps
    first, last = result.history[0], result.history[-1]
    later = (last["tokens"] - first["tokens"]) / max(
        last["tokens"] / last["tokens_per_s"] - first["tokens"] / first["tokens_per_s"], 1e-9
    )
    flops = model_flops_per_token(config, width.length, 7) * later
    name = torch.cuda.get_device_name() if platform == "cuda" else "cpu"
    peak_flops = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
    exported = read_drafter(result.export, TargetShape.from_config(target))
    return {
        "device": name,
        "steps": result.steps,
        "tokens_per_s": later,
        "model_tflops": flops / 1e12,
        "mfu": flops / peak_flops if peak_flops else None,
        "peak_gib": torch.cuda.max_memory_allocated() / GIB if platform == "cuda" else None,
        "predicted_gib": predicted.gib(),
        "export_dtype": sorted({str(t.dtype) for t in exported.tensors.values()}),
        "export_gb": sum(p.stat().st_size for p in result.export.iterdir()) / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=Path, required=True, help="a built Kimi test world")
    parser.add_argument("--platform", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny widths: the code path only")
    args = parser.parse_args()
    width = QUICK if args.quick else KIMI
    device = "cuda" if args.platform == "cuda" else "cpu"
    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda}), flush=True)
    print(json.dumps({"extraction": extraction(args.world, device, 8)}), flush=True)
    with tempfile.TemporaryDirectory() as work:
        print(json.dumps({"training": training(width, args.platform, Path(work))}), flush=True)


if __name__ == "__main__":
    main()
