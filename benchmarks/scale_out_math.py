"""The storage and time arithmetic of docs/scale-out.md, from the project's own code.

Not a measurement: bytes per token come from `ShardFormat.bytes_per_token` (what the
hidden_states asset checks against the volume), training FLOPs from the drafter benchmark's
`step_flops` with its Kimi-K2-shaped layer, and the rest from the ASSUMED_* rates below,
which are stated assumptions to replace with measurements on the real hardware.

    .venv/bin/python benchmarks/scale_out_math.py    # prints the tables, a few seconds
"""

from __future__ import annotations

from drafter_training import KIMI_LAYER, step_flops

from eagle3_assets.lib.hidden_states.shard_format import (
    KIMI_AUX_LAYERS,
    KIMI_HIDDEN_SIZE,
    ShardFormat,
)

SAMPLES, SAMPLE_TOKENS, TEACHER_SHARE = 25_000, 4096, 0.8  # DESIGN.md's run (upper bound)
VOLUME_BYTES = 2.9e12
FORMATS = ("bf16+bf16", "fp8+bf16", "fp8+fp8", "fp8+top64")
DEFAULT_FORMAT = "fp8+fp8"
KIMI_VOCAB = 163_840
# Trainable parameters of the Kimi-shaped drafter, as built and counted by
# benchmarks/drafter_training.py (docs/benchmarks.md): fc, then everything.
DRAFTER_FC_PARAMS, DRAFTER_PARAMS = 154_140_672, 963_407_872
TTT = 7

H200_BF16_FLOPS = 989e12  # dense bf16 peak per GPU (NVIDIA's H200 SXM datasheet)
KIMI_ACTIVE_PARAMS = 32e9  # parameters activated per token (Moonshot's model card)
ASSUMED_REPLICA_OUTPUT_TOK_S = 4_000  # one TP8 Kimi replica at 200 concurrent requests
ASSUMED_EXTRACTION_MFU = 0.30  # prefill-only forward, INT4 experts
ASSUMED_TRAINING_MFU = 0.35  # drafter layer under bf16 autocast, DDP
ASSUMED_INTERNODE_BYTES_S = 50e9  # per GPU: one 400 Gb/s NIC per GPU (HGX H200 + CX-7)
LOAD_S = 22 * 60  # one Kimi load by vLLM (DESIGN.md), paid by serving and by extraction
BATCH_PER_RANK = 4

TOKENS = SAMPLES * SAMPLE_TOKENS
RESPONSE_TOKENS = TOKENS * TEACHER_SHARE


def bytes_per_token(name: str) -> float:
    return ShardFormat.parse(name).bytes_per_token(KIMI_HIDDEN_SIZE, KIMI_AUX_LAYERS, TEACHER_SHARE)


def training_flops_per_token() -> float:
    """The drafter's forward + backward over TTT steps at full length, plus the frozen
    teacher (final norm + lm_head over the target vocab) at every teacher position."""
    rest = DRAFTER_PARAMS - DRAFTER_FC_PARAMS
    drafter = step_flops(KIMI_LAYER, DRAFTER_FC_PARAMS, rest, SAMPLE_TOKENS, TTT) / SAMPLE_TOKENS
    return drafter + TEACHER_SHARE * 2 * KIMI_HIDDEN_SIZE * KIMI_VOCAB


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def main() -> None:
    print(f"{SAMPLES:,} samples x {SAMPLE_TOKENS:,} tokens = {TOKENS / 1e6:,.1f}M tokens,")
    print(f"{RESPONSE_TOKENS / 1e6:,.1f}M response tokens (share {TEACHER_SHARE})\n")
    print("| format | B/token | 25K x 4K | fits 2.9 TB |")
    print("| --- | ---: | ---: | --- |")
    for name in FORMATS:
        total = bytes_per_token(name) * TOKENS
        fits = "yes" if total <= VOLUME_BYTES else "no"
        print(f"| {name} | {bytes_per_token(name):,.0f} | {total / 1e12:.2f} TB | {fits} |")

    train_flops = training_flops_per_token()
    per_gpu_tok_s = H200_BF16_FLOPS * ASSUMED_TRAINING_MFU / train_flops
    extraction_flops = 2 * KIMI_ACTIVE_PARAMS * TOKENS
    shard_bytes = bytes_per_token(DEFAULT_FORMAT)
    print(f"\ntraining: {train_flops / 1e9:.1f} GFLOP/token -> {per_gpu_tok_s:,.0f} tokens/s/GPU")
    print(f"extraction: {extraction_flops:.2e} FLOP for the whole run")
    step_s = BATCH_PER_RANK * SAMPLE_TOKENS / per_gpu_tok_s
    # DDP all-reduces fp32 gradients after backward (not overlapped); a ring moves 2x the
    # gradient bytes through each GPU's link, and across nodes the NIC is the narrow link.
    allreduce_s = 2 * 4 * DRAFTER_PARAMS / ASSUMED_INTERNODE_BYTES_S
    print(
        f"one step at batch {BATCH_PER_RANK}: {step_s:.2f} s compute, across nodes "
        f"+{allreduce_s:.2f} s gradient all-reduce ({allreduce_s / step_s:.0%})\n"
    )
    print(
        "| GPUs | serving replicas (TP8) | generation | extraction | training ranks "
        "| one epoch | steps/epoch at batch 4 | shard reads | shard writes "
        "| end to end, 1 epoch |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for gpus in (8, 16, 64):
        nodes = gpus // 8
        generation_s = RESPONSE_TOKENS / (nodes * ASSUMED_REPLICA_OUTPUT_TOK_S)
        extraction_s = extraction_flops / (gpus * H200_BF16_FLOPS * ASSUMED_EXTRACTION_MFU)
        epoch_s = TOKENS / (gpus * per_gpu_tok_s)
        if nodes > 1:
            epoch_s *= 1 + allreduce_s / step_s
        total_s = 2 * LOAD_S + generation_s + extraction_s + epoch_s
        reads = gpus * per_gpu_tok_s * shard_bytes
        writes = shard_bytes * TOKENS / extraction_s
        print(
            f"| {gpus} | {nodes} | {hours(generation_s)} | {hours(extraction_s)} | "
            f"{gpus} ({nodes} node{'s' if nodes > 1 else ''}) | {hours(epoch_s)} | "
            f"{SAMPLES // (BATCH_PER_RANK * gpus):,} | {reads / 1e9:.1f} GB/s | "
            f"{writes / 1e9:.1f} GB/s | {hours(total_s)} |"
        )


if __name__ == "__main__":
    main()
