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
# streamed mode on one node: the extraction server (TP8) and 8 training ranks share the GPUs
H200_BYTES = 141e9
ASSUMED_KIMI_INT4_BYTES = 594e9  # the INT4 checkpoint on disk (Kimi-K2-Thinking's size)
ASSUMED_SERVER_EXTRA_BYTES = 10e9  # per GPU: KV and activations of prefill-only requests
TRAINING_STATE_BYTES = 16 * DRAFTER_PARAMS  # fp32 weights, gradients, two AdamW moments
FROZEN_TARGET_BYTES = 2 * 2 * KIMI_VOCAB * KIMI_HIDDEN_SIZE  # embedding + lm_head, bf16
MEASURED_STEP_PEAK_BYTES = 13.6e9  # a Kimi-shaped layer's step (docs/benchmarks.md)
WINDOW_BYTES = 2**30  # EAGLE3_STREAM_WINDOW_MB's default
SEQUENCE_BYTES_PER_TOKEN = 8 + 1  # the run's sequences file: int64 ids, bool mask
EPOCHS = (1, 3)

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
    streamed(per_gpu_tok_s)


def streamed(per_gpu_tok_s: float) -> None:
    """Stored vs streamed on one 8-GPU node, from the load of the extraction server on (the
    generations exist): time-shared GPUs, so a streamed epoch costs extraction + training."""
    server = ASSUMED_KIMI_INT4_BYTES / 8 + ASSUMED_SERVER_EXTRA_BYTES
    rank = TRAINING_STATE_BYTES + FROZEN_TARGET_BYTES + MEASURED_STEP_PEAK_BYTES
    print(
        f"\nGPU memory per H200 in streamed mode: extraction server {server / 1e9:.0f} GB "
        f"(--gpu-memory-utilization {server / H200_BYTES:.2f}), training rank "
        f"{rank / 1e9:.0f} GB, free {(H200_BYTES - server - rank) / 1e9:.0f} GB\n"
    )
    print(
        "| samples | mode | hidden states on disk | extraction | training per epoch | "
        + " | ".join(f"{e} epoch{'s' if e > 1 else ''}" for e in EPOCHS)
        + " |"
    )
    print("| ---: | --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in EPOCHS) + " |")
    for samples in (SAMPLES, 10 * SAMPLES):
        tokens = samples * SAMPLE_TOKENS
        extraction_s = (
            2 * KIMI_ACTIVE_PARAMS * tokens / (8 * H200_BF16_FLOPS * ASSUMED_EXTRACTION_MFU)
        )
        epoch_s = tokens / (8 * per_gpu_tok_s)
        stored_bytes = bytes_per_token(DEFAULT_FORMAT) * tokens
        fits = "fits" if stored_bytes <= VOLUME_BYTES else "does not fit"
        stored = [LOAD_S + extraction_s + e * epoch_s for e in EPOCHS]
        flowing = [LOAD_S + e * (extraction_s + epoch_s) for e in EPOCHS]
        sequences = SEQUENCE_BYTES_PER_TOKEN * tokens
        print(
            f"| {samples:,} | stored | {stored_bytes / 1e12:.2f} TB ({fits} 2.9 TB) | "
            f"{hours(extraction_s)} once | {hours(epoch_s)} | "
            + " | ".join(hours(t) for t in stored)
            + " |"
        )
        print(
            f"| {samples:,} | streamed | {WINDOW_BYTES / 1e9:.2f} GB window + "
            f"{sequences / 1e9:.1f} GB of token ids | {hours(extraction_s)} every epoch | "
            f"{hours(epoch_s)} | " + " | ".join(hours(t) for t in flowing) + " |"
        )


if __name__ == "__main__":
    main()
