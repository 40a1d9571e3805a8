"""TTT attention's memory against sequence length: the fused attention `ttt` runs against the
dense [B, heads, S, S] softmax it replaced (the test suite's copy of it), side by side.

One forward and backward of `Eagle3Drafter.ttt` (7 steps, batch 1, fp32, 2 threads) per point,
each in a fresh process: peak RSS growth over the process before the step (VmHWM reset through
/proc/self/clear_refs after a warm-up at S = 16, every tensor mmapped) and wall seconds per
TTT step. Heads are Kimi's (64 x 128, and 8 x 128 to reach S = 4096 with the dense one in
24 GB); hidden 256, MLP 512 and vocab 1000 stand in for the rest, so the numbers isolate
attention and the activations that scale with S, not the projections' weights.

    .venv/bin/python benchmarks/ttt_attention_memory.py          # ~10 min on 2 cores
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from eagle3_assets.lib.training import eagle3_model
from eagle3_assets.lib.training.eagle3_model import DrafterConfig, Eagle3Drafter

STEPS = 7
# glibc keeps freed blocks below its mmap threshold for reuse, and the RSS peak would count a
# freed step's tensors under the next one's: above 64 KiB every tensor is mapped and unmapped
CHILD_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
# (heads, S, attentions): the dense one only where it fits beside the rest of the machine
POINTS = [
    (64, 256, ("fused", "dense")),
    (64, 512, ("fused", "dense")),
    (64, 1024, ("fused", "dense")),
    (64, 2048, ("fused", "dense")),  # dense: 12.6 GB, with nothing else running
    (8, 1024, ("fused", "dense")),
    (8, 2048, ("fused", "dense")),
    (8, 4096, ("fused", "dense")),
]


def peak_growth(run: Callable[[], object]) -> tuple[int, float]:
    """(peak RSS growth in bytes over the process before `run`, its wall seconds): VmHWM reset
    to VmRSS through /proc/self/clear_refs first (run the child under CHILD_ENV)."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # VmHWM := VmRSS
    before = kib("VmRSS")
    started = time.perf_counter()
    run()
    return (kib("VmHWM") - before) * 1024, time.perf_counter() - started


def kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def measure(attention: str, heads: int, length: int) -> dict:
    """One point, in this process: {"peak_mib", "seconds_per_step"}."""
    torch.set_num_threads(2)
    torch.manual_seed(0)
    config = DrafterConfig(
        hidden_size=256,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=128,
        intermediate_size=512,
        vocab_size=1000,
        draft_vocab_size=256,
    )
    model = Eagle3Drafter(config, torch.randn(1000, 256) * 0.02)
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.02)

    def step(S: int) -> None:
        aux = torch.randn(1, S, config.aux_width)
        ids = torch.randint(0, 1000, (1, S + STEPS - 1))
        mask = torch.ones(1, S, dtype=torch.bool)
        if attention == "dense":
            from eagle3_assets_tests.lib.training.test_eagle3_model import dense_attention

            eagle3_model.ttt_attention = dense_attention(mask)
        sum(logits.square().mean() for logits in model(aux, ids, STEPS, mask)).backward()
        model.zero_grad(set_to_none=True)

    step(16)  # first-call setup of the kernels, outside the measurement
    growth, seconds = peak_growth(lambda: step(length))
    return {"peak_mib": growth / 2**20, "seconds_per_step": seconds / STEPS}


def main() -> None:
    if len(sys.argv) == 4:  # a child: one point
        print(json.dumps(measure(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
        return
    print(f"torch {torch.__version__}, batch 1, {STEPS} TTT steps, fp32, 2 threads")
    print("| heads | S | fused peak MiB | fused s/step | dense peak MiB | dense s/step |")
    print("|---|---|---|---|---|---|")
    fused_peaks: dict[tuple[int, int], float] = {}
    for heads, length, attentions in POINTS:
        cells = []
        for attention in ("fused", "dense"):
            if attention not in attentions:
                cells += ["not run", "-"]
                continue
            argv = [sys.executable, __file__, attention, str(heads), str(length)]
            child = subprocess.run(argv, check=True, capture_output=True, env=CHILD_ENV)
            point = json.loads(child.stdout)
            cells += [f"{point['peak_mib']:.0f}", f"{point['seconds_per_step']:.2f}"]
            if attention == "fused":
                fused_peaks[heads, length] = point["peak_mib"]
        print(f"| {heads} | {length} | " + " | ".join(cells) + " |", flush=True)
    for heads, length in fused_peaks:
        if (heads, 2 * length) in fused_peaks:
            ratio = fused_peaks[heads, 2 * length] / fused_peaks[heads, length]
            print(f"fused, {heads} heads: peak({2 * length}) / peak({length}) = {ratio:.2f}")


if __name__ == "__main__":
    main()
