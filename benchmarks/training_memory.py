"""Peak training memory of a Kimi-width drafter against padded tokens per step: the measured
points, the fitted model (lib/training/memory.py) and its error on points it did not see.

One training step (batch built on the device, forward and backward through the real
`ttt_loss` under bf16 autocast, as on a GPU) per point, each in a fresh process: peak RSS
growth over the resident fp32 weights (VmHWM reset through /proc/self/clear_refs after a
warm-up step at S = 16, every tensor mmapped: ttt_attention_memory.py's method). The
attention is Kimi's (hidden 7168, 64 x 128 heads, 64 KV heads), TTT 7; what is reduced to fit
24 GB and 2 cores, the model takes as arguments and fits from points that vary it: the MLP
(intermediate 512 and 2048 for 18,432), the draft vocab (8,000 and 32,000) and the frozen
target vocab (4,096 embedding rows: the TTT only gathers rows; its 163,840 rows are an exact
static term). `--results FILE` keeps each measured point, and a rerun reuses them.

    .venv/bin/python benchmarks/training_memory.py            # ~35 min on 2 cores, ~16 GB
    .venv/bin/python benchmarks/training_memory.py --quick    # code path only, ~1 min
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import torch
from drafter_training import cpu_name
from ttt_attention_memory import CHILD_ENV, peak_growth

from eagle3_assets.lib.training.eagle3_model import DrafterConfig, Eagle3Drafter
from eagle3_assets.lib.training.memory import (
    MemoryShape,
    TokenCost,
    fit_token_cost,
    step_growth,
    training_memory,
)
from eagle3_assets.lib.training.ttt import Batch, ttt_loss

STANDIN_VOCAB = 4096
KIMI_ATTENTION = DrafterConfig(
    hidden_size=7168,
    num_attention_heads=64,
    num_key_value_heads=64,
    head_dim=128,
    intermediate_size=2048,
    vocab_size=STANDIN_VOCAB,
    draft_vocab_size=32000,
)
QUICK = dataclasses.replace(
    KIMI_ATTENTION, hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
    intermediate_size=256, draft_vocab_size=512,
)  # fmt: skip
OPTIMIZER_MODEL = dataclasses.replace(KIMI_ATTENTION, hidden_size=2048)  # AdamW per parameter
# The user's drafter: AQ-MedAI's Kimi-K2 layout, the target's 163,840-token vocab
KIMI = dataclasses.replace(
    KIMI_ATTENTION, intermediate_size=18432, vocab_size=163840, draft_vocab_size=32000
)
# GiB each GPU's allocator can hold: total less ~2 GiB for the CUDA context and NCCL buffers
GPUS = {"H100 80 GB": 79.6 - 2.0, "H200 141 GB": 140.4 - 2.0}
MARGIN = 0.10  # of that, kept free for fragmentation and what the model does not see
# (batch, S, TTT, intermediate, draft vocab, checkpointed); `fit` points make the model,
# `check` ones test it. The MLP and draft vocab are shrunk where S grows (a 4,096-token step
# at intermediate 2048 and draft vocab 32,000 was killed at 21 GB, beyond this machine)
FIT = [(1, s, 7, 512, 8000, False) for s in (256, 512, 1024, 2048, 4096)]
FIT += [(1, 1024, 7, 512, 32000, False)]
FIT += [(1, 1024, 7, 512, 8000, True), (1, 4096, 7, 512, 8000, True)]
CHECK = [(2, 1024, 7, 512, 8000, False), (1, 3072, 5, 512, 8000, False)]
CHECK += [(1, 1024, 3, 512, 8000, False), (1, 1024, 7, 2048, 8000, False)]
CHECK += [(1, 2048, 7, 2048, 32000, False), (1, 2048, 5, 512, 8000, True)]


def measure(config: DrafterConfig, batch: int, length: int, ttt: int, checkpointed: bool) -> dict:
    """One point, in this process: {"growth_bytes", "seconds"}; `length` 0: AdamW's first
    step after a backward instead, {"optimizer_bytes_per_parameter"}."""
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = Eagle3Drafter(config, torch.randn(config.vocab_size, config.hidden_size) * 0.02)
    model.checkpoint_steps = checkpointed

    def step(B: int, S: int) -> None:
        teacher = torch.randn(B, S + ttt, config.draft_vocab_size)
        data = Batch(
            aux=torch.randn(B, S, config.aux_width),
            input_ids=torch.randint(0, config.vocab_size, (B, S + ttt - 1)),
            key_mask=torch.ones(B, S, dtype=torch.bool),
            targets=teacher.softmax(-1),
            supervised=torch.ones(B, S + ttt, dtype=torch.bool),
        )
        del teacher
        with torch.autocast("cpu", torch.bfloat16):
            loss, *_ = ttt_loss(model, data, ttt, decay=0.8)
        loss.backward()
        model.zero_grad(set_to_none=True)

    step(1, 16)  # first-call setup of the kernels, outside the measurement
    if length == 0:
        return optimizer_growth(model)
    growth, seconds = peak_growth(lambda: step(batch, length))
    return {"growth_bytes": growth, "seconds": seconds}


def optimizer_growth(model: Eagle3Drafter) -> dict:
    """What AdamW's first step adds beyond its two moments, per trainable parameter."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    for p in parameters:
        p.grad = torch.ones_like(p)
    optimizer = torch.optim.AdamW(parameters, lr=1e-4)
    growth, _ = peak_growth(optimizer.step)
    count = sum(p.numel() for p in parameters)
    temporary = growth - 8 * count  # less the moments it keeps
    return {"optimizer_bytes_per_parameter": temporary / count}


def run_point(config: DrafterConfig, point: tuple, results: Path | None) -> dict:
    """One point in a fresh process; with `results`, points measured there are read back
    and new ones appended (a long run killed midway keeps what it measured)."""
    done = {}
    if results is not None and results.exists():
        done = {tuple(r["point"]): r for r in map(json.loads, results.read_text().splitlines())}
    if tuple(point) in done:
        return done[tuple(point)]
    batch, length, ttt, _, _, checkpointed = point
    spec = dataclasses.asdict(shaped(config, point))
    argv = [sys.executable, __file__, "--child"]
    argv.append(json.dumps([spec, batch, length, ttt, checkpointed]))
    child = subprocess.run(argv, check=True, capture_output=True, env=CHILD_ENV)
    measured = {"point": list(point), **json.loads(child.stdout)}
    if results is not None:
        with results.open("a") as out:
            out.write(json.dumps(measured) + "\n")
    return measured


def shaped(config: DrafterConfig, point: tuple) -> DrafterConfig:
    _, _, _, intermediate, vocab, _ = point
    return dataclasses.replace(config, intermediate_size=intermediate, draft_vocab_size=vocab)


def shape_of(config: DrafterConfig, point: tuple) -> MemoryShape:
    batch, length, ttt, _, _, checkpointed = point
    return MemoryShape.of(shaped(config, point), batch * length, ttt, checkpointed)


def node_table(cost: TokenCost) -> None:
    """The user's rank (Kimi's drafter, TTT 7) by token budget: the model's peak, and whether
    it fits each GPU with MARGIN to spare."""
    print("| tokens per rank | checkpointed | resident GiB | step GiB | optimizer GiB | peak GiB | "
          + " | ".join(GPUS) + " |")  # fmt: skip
    print("|---|---|---|---|---|---|" + "---|" * len(GPUS))
    for tokens in (4096, 8192, 12288, 16384, 24576, 32768, 49152):
        for checkpointed in (False, True):
            estimate = training_memory(MemoryShape.of(KIMI, tokens, 7, checkpointed), cost).gib()
            fits = [
                f"{'fits' if estimate['peak'] <= (1 - MARGIN) * room else 'no'} "
                f"({100 * (1 - estimate['peak'] / room):.0f}% free)"
                for room in GPUS.values()
            ]
            print(
                f"| {tokens:,} | {'yes' if checkpointed else 'no'} | {estimate['resident']} | "
                f"{estimate['step']} | {estimate['optimizer']} | {estimate['peak']} | "
                + " | ".join(fits)
                + " |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shrunken sizes, not results")
    parser.add_argument("--results", type=Path, help="JSON lines of measured points, reused")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec, batch, length, ttt, checkpointed = json.loads(args.child)
        print(json.dumps(measure(DrafterConfig(**spec), batch, length, ttt, checkpointed)))
        return
    config = QUICK if args.quick else KIMI_ATTENTION
    scale = 8 if args.quick else 1
    fit = [(b, s // scale, t, i // scale, v // scale, c) for b, s, t, i, v, c in FIT]
    check = [(b, s // scale, t, i // scale, v // scale, c) for b, s, t, i, v, c in CHECK]
    print(f"{cpu_name()}, torch {torch.__version__}, 2 threads, bf16 autocast")
    optimizer = run_point(OPTIMIZER_MODEL, (1, 0, 1, 1024, 8000, False), args.results)
    print(f"AdamW's first step: {optimizer['optimizer_bytes_per_parameter']:.2f} B/parameter "
          "of temporaries beyond its moments", flush=True)  # fmt: skip
    measured = {point: run_point(config, point, args.results) for point in fit}
    cost = fit_token_cost([(shape_of(config, p), m["growth_bytes"]) for p, m in measured.items()])
    print(f"fitted: {cost}")
    print("| use | batch | S | TTT | MLP | draft vocab | checkpointed | measured GiB | model GiB "
          "| error | s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for point in fit + check:
        if point not in measured:
            measured[point] = run_point(config, point, args.results)
        got = measured[point]["growth_bytes"]
        predicted = step_growth(shape_of(config, point), cost)
        batch, length, ttt, intermediate, vocab, checkpointed = point
        use = "fit" if point in fit else "**check**"
        print(
            f"| {use} | {batch} | {length} | {ttt} | {intermediate} | {vocab} | "
            f"{'yes' if checkpointed else 'no'} | {got / 2**30:.2f} | {predicted / 2**30:.2f} | "
            f"{100 * (predicted - got) / got:+.1f}% | {measured[point]['seconds']:.0f} |",
            flush=True,
        )
    print()
    node_table(cost)


if __name__ == "__main__":
    main()
