"""Peak memory of one training rank, so that a token budget can be chosen before a GPU is.

    peak      = resident + max(step, optimizer)
    resident  = 12 B x trainable (fp32 weights, AdamW's two moments)
              + 8 B x vocab x hidden (the target's embedding and lm_head in fp32, the teacher)
    step      = 6 B x matmul weights (gradients, autocast's bf16 copies)
              + tokens x (4 B x draft vocab (the teachers)
                          + ttt x (per_step + 8 B x intermediate + per_word x draft vocab))
              checkpointed: tokens x (4 B x draft vocab + ttt x kept_step + one full step)
    optimizer = (4 B + OPTIMIZER_BYTES) x trainable (gradients, AdamW's temporaries)

Tensor sizes are exact, the MLP's term is the four bf16 tensors of the intermediate width it
saves per step; per_step, per_word and kept_step are fitted to CPU measurements under bf16
autocast at Kimi's attention (hidden 7168, 64 x 128 heads) by `benchmarks/training_memory.py`,
which checks the model on points it did not see (docs/scale-out.md, "Training memory"):
trust it at that width; another width needs a rerun. `tokens` is the padded count, batch x
longest sample, as a token budget caps it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from eagle3_assets.lib.training.eagle3_model import DrafterConfig

GIB = 2**30


PER_WEIGHT = 6.0  # a matmul weight's gradient (fp32) and autocast copy (bf16) at the peak
PER_UNIT = 8.0  # the MLP saves gate, up, silu(gate) and their product per step, in bf16
OPTIMIZER_BYTES = 2.64  # per trainable parameter, AdamW's temporaries at its first step


@dataclass(frozen=True)
class TokenCost:
    """The fitted bytes per padded token and TTT step: `per_step` (+ `per_word` x draft
    vocab; the float32 log-probabilities backward keeps) and, checkpointed, `kept_step`
    (what a recomputed step keeps: its input, keys, values, loss)."""

    per_step: float
    per_word: float
    kept_step: float

    def bytes(self, shape: MemoryShape) -> float:
        """Per padded token."""
        step = self.per_step + PER_UNIT * shape.intermediate + self.per_word * shape.vocab
        teachers = 4.0 * shape.vocab  # make_batch's float32 targets
        if shape.checkpointed:  # every step's kept part, and one step recomputed at a time
            return teachers + shape.ttt_length * self.kept_step + step
        return teachers + shape.ttt_length * step


# fitted by benchmarks/training_memory.py (docs/scale-out.md, "Training memory")
ACTIVATIONS = TokenCost(per_step=327_105.0, per_word=4.24, kept_step=125_202.0)


@dataclass(frozen=True)
class MemoryShape:
    """What one rank's peak depends on."""

    trainable: int  # parameters
    matmul_weights: int  # the parameters autocast copies to bf16
    frozen: int  # target vocab x hidden: embedding and teacher lm_head
    tokens: int  # padded tokens per step
    ttt_length: int
    intermediate: int
    vocab: int  # the draft vocab
    checkpointed: bool = False

    @classmethod
    def of(
        cls, config: DrafterConfig, tokens: int, ttt_length: int, checkpointed: bool = False
    ) -> MemoryShape:
        H, A = config.hidden_size, config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        matmul = (
            config.aux_width * H  # fc
            + 2 * H * (A + 2 * kv)  # q, k, v over cat[embedding, hidden]
            + A * H  # o
            + 3 * H * config.intermediate_size  # gate, up, down
            + H * config.draft_vocab_size  # lm_head
        )
        return cls(
            trainable=matmul + 4 * H,  # the four norms
            matmul_weights=matmul,
            frozen=config.vocab_size * H,
            tokens=tokens,
            ttt_length=ttt_length,
            intermediate=config.intermediate_size,
            vocab=config.draft_vocab_size,
            checkpointed=checkpointed,
        )


@dataclass(frozen=True)
class MemoryEstimate:
    resident: float
    step: float
    optimizer: float

    @property
    def peak(self) -> float:
        return self.resident + max(self.step, self.optimizer)

    def gib(self) -> dict[str, float]:
        fields = {"resident": self.resident, "step": self.step, "optimizer": self.optimizer}
        return {
            name: round(value / GIB, 2) for name, value in (fields | {"peak": self.peak}).items()
        }


def step_growth(shape: MemoryShape, cost: TokenCost = ACTIVATIONS) -> float:
    """Bytes a training step adds over the resident weights."""
    return PER_WEIGHT * shape.matmul_weights + shape.tokens * cost.bytes(shape)


def training_memory(shape: MemoryShape, cost: TokenCost = ACTIVATIONS) -> MemoryEstimate:
    return MemoryEstimate(
        resident=12.0 * shape.trainable + 8.0 * shape.frozen,
        step=step_growth(shape, cost),
        optimizer=(4.0 + OPTIMIZER_BYTES) * shape.trainable,
    )


def _least_squares(rows: list[list[float]], values: list[float]) -> list[float]:
    a = torch.tensor(rows, dtype=torch.float64)
    scale = a.abs().amax(0)  # columns from ~1e3 to ~1e9: solve on equal footing
    b = torch.tensor(values, dtype=torch.float64)[:, None]
    return (torch.linalg.lstsq(a / scale, b).solution.squeeze(-1) / scale).tolist()


def fit_token_cost(points: Sequence[tuple[MemoryShape, float]]) -> TokenCost:
    """The fitted terms, by least squares over measured step growths (bytes) less the exact
    terms: the plain points' per_step and per_word, then with those the checkpointed points'
    kept_step."""
    exact = TokenCost(0.0, 0.0, 0.0)
    plain = [(s, g - step_growth(s, exact)) for s, g in points if not s.checkpointed]
    per_step, per_word = _least_squares(
        [[s.tokens * s.ttt_length, s.tokens * s.ttt_length * s.vocab] for s, _ in plain],
        [g for _, g in plain],
    )
    cost = TokenCost(per_step, per_word, 0.0)
    kept = [(s, g - step_growth(dataclasses.replace(s, ttt_length=0), cost))
            for s, g in points if s.checkpointed]  # fmt: skip
    if not kept:
        return cost
    # fitted with an intercept of its own and the intercept dropped: a checkpointed step's
    # peak holds fewer of the weights' copies than PER_WEIGHT says, which is kept as the
    # bound; the slope in tokens is what the budget scales
    _, kept_step = _least_squares(
        [[1.0, s.tokens * s.ttt_length] for s, _ in kept], [g for _, g in kept]
    )
    return dataclasses.replace(cost, kept_step=kept_step)
