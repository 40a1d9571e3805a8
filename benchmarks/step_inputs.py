"""The shapes and seeded inputs of one drafter training step, and its timing, alike in every
venv.

Imports torch alone: the project's venv (our step) and the peers' venv (SpecForge's and
speculators' steps) both build the same tensors from the same seed, with the same torch.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepShape:
    """A drafter layer and one sample of `length` response tokens (batch 1)."""

    name: str
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    length: int
    ttt: int
    optimizer_step: bool  # False where three fp32 AdamW states would not fit in RAM


# The Kimi demo world's drafter (make_untrained_drafter for kimi-demo: AQ-MedAI's layout).
DEMO = StepShape("demo drafter", 256, 4, 4, 64, 512, 2048, 1024, 128, 7, True)
# One Kimi-K2 drafter layer as AQ-MedAI's config says (hidden 7168, 64 x 128 heads, 64 KV
# heads, intermediate 18432, draft vocab 32000), at a short sequence. The target vocab is
# 32,768, not 163,840: it sizes only the frozen embedding and the teacher's lm_head (the
# same for every trainer), and a full one would not leave room for the step on 24 GB.
KIMI = StepShape("Kimi-K2 drafter layer", 7168, 64, 64, 128, 18432, 32768, 32000, 64, 7, False)
# At the lengths the user trains on: a narrower layer (hidden 1024, 8 x 128 heads, as
# docs/benchmarks.md's chained-weights measurement), where attention is a real share of a step
LONG = {
    f"s{n}": StepShape(f"{n}-token sample", 1024, 8, 8, 128, 2816, 32768, 8000, n, 7, True)
    for n in (1024, 2048)
}
SHAPES = {"demo": DEMO, "kimi": KIMI, **LONG}


def step_inputs(shape: StepShape, seed: int) -> dict[str, torch.Tensor]:
    """What a trainer reads for one step: the aux states of 3 target layers, the token ids,
    the target's last hidden state (before its final norm) and the target's lm_head and
    embedding (frozen), and which target tokens make the draft vocab (sorted ids)."""
    generator = torch.Generator().manual_seed(seed)
    H, V, S = shape.hidden_size, shape.vocab_size, shape.length

    def normal(*size: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(*size, generator=generator) * std

    return {
        "input_ids": torch.randint(0, V, (1, S), generator=generator),
        "aux": normal(1, S, 3 * H),
        "final": normal(1, S, H),
        "target_lm_head": normal(V, H, std=0.02),
        "embed_tokens": normal(V, H, std=0.02),
        "draft_ids": torch.randperm(V, generator=generator)[: shape.draft_vocab_size].sort()[0],
    }


def time_steps(step: Callable[[], float], steps: int) -> dict:
    """One warm-up step (compilation, allocator, first shapes), then `steps` timed ones: their
    seconds, the last loss, and the process's peak RSS."""
    loss = step()
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        loss = step()
        seconds.append(time.perf_counter() - started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "loss": loss, "peak_rss": peak}
