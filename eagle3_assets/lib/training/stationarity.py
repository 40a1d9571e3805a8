"""How far a saved drafter sits from a stationary point of its loss when fed given target
layers: the layer probe's evidence of which layers a warm start was trained on.

Training leaves a drafter where the expected gradient of its loss vanishes for the features it
learnt on. Fed those layers, held-out samples pull its weights in directions that cancel out;
fed other layers, they share a direction, the one a finetune would take to adapt. Comparing
losses instead favours whichever reading is later, since later layers carry more about the
next token; in the Kimi miniature that lean was as large as the mismatch itself. The gradient
leans far less: a drafter fed richer layers than it learnt on is still not at rest there, if
only a little farther from it than one fed poorer layers (see `layer_probe.CLEARLY_BETTER`).

The measure, per reading: an unbiased estimate of |E[w * g]|^2 (a U-statistic: the mean of
g_i . g_j over pairs of distinct samples), g a sample's gradient of its step-0 loss over the
drafter's trainable weights, w one scale per weight (1 / the standard deviation of its gradient
over samples, pooled over the readings compared, so that both are measured alike and a few
noisy weights do not drown the rest), with the estimate left one sample out each time for a
jackknife standard error. Two passes over the samples per reading keep memory at a few copies
of the weights, whatever the number of samples.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # torch: imported where used, so the layer probe's records load without it
    import torch

    from eagle3_assets.lib.hidden_states.shard_reader import ShardReader
    from eagle3_assets.lib.training.eagle3_model import Eagle3Drafter
    from eagle3_assets.lib.training.ttt import TargetHead

    HeldOut = tuple[Eagle3Drafter, TargetHead, ShardReader, list[int] | None]

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Stationarity:
    """One reading's estimate, and the same estimate without each sample in turn."""

    value: float
    leave_one_out: list[float]


def sample_gradients(opened: HeldOut) -> Iterator[torch.Tensor]:
    """Each sample's gradient of its step-0 loss, flat, in the shards' order, for a drafter
    opened at some layers (`train_drafter.open_heldout`); samples whose step 0 supervises
    nothing are skipped."""
    import torch

    from eagle3_assets.lib.training.ttt import make_batch, ttt_loss

    model, head, reader, columns = opened
    weights = [p for p in model.parameters() if p.requires_grad]
    for sample in reader.samples():
        batch = make_batch([sample], head, model.t2d, 1, columns)
        loss, _, _, _, supervised = ttt_loss(model, batch, 1, decay=1.0)
        if supervised:
            yield torch.cat([g.flatten() for g in torch.autograd.grad(loss, weights)])


def _dot(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() * b.double()).sum())


def stationarity(
    drafter: Path,
    target: Path,
    batch_dirs: Sequence[str],
    readings: dict[K, Sequence[int]],
) -> dict[K, Stationarity]:
    """The drafter's stationarity read each way on the same samples: lower is nearer rest.
    Two passes over each reading's gradients (their sums, then each sample against them),
    with the drafter opened once per reading and the target's head read once."""
    import torch

    from eagle3_assets.lib.training.train_drafter import open_heldout

    opened: dict[K, HeldOut] = {}
    head = None
    for key, ids in readings.items():
        opened[key] = open_heldout(drafter, target, batch_dirs, 1.0, ids, head)
        head = opened[key][1]
    sums: dict[K, tuple[torch.Tensor, torch.Tensor]] = {}
    counts: dict[K, int] = {}
    for key in readings:
        total = squares = None
        counts[key] = 0
        for gradient in sample_gradients(opened[key]):
            total = gradient.clone() if total is None else total.add_(gradient)
            squares = gradient.square() if squares is None else squares.add_(gradient.square())
            counts[key] += 1
        sums[key] = (total, squares)
    if len(set(counts.values())) != 1:  # supervision does not depend on the layers read
        raise ValueError(f"readings supervised different samples: {counts}")
    n = next(iter(counts.values()))
    if n < 3:  # too few for an estimate left one out: nothing to compare
        return {key: Stationarity(math.nan, [math.nan] * n) for key in readings}
    variance = sum(squares / n - (total / n).square() for total, squares in sums.values())
    scale = torch.where(variance > 0, len(sums) / variance, 0.0)  # w^2, pooled over readings
    result = {}
    for key in readings:
        total, _ = sums[key]
        weighted_total = scale * total
        all_pairs = _dot(total, weighted_total)  # sum over i, j of w^2 g_i g_j
        towards_rest, own = [], []
        for gradient in sample_gradients(opened[key]):
            towards_rest.append(_dot(gradient, weighted_total))
            own.append(_dot(gradient.square(), scale))
        distinct = all_pairs - sum(own)
        result[key] = Stationarity(
            distinct / (n * (n - 1)),
            [
                (distinct - 2 * t + 2 * o) / ((n - 1) * (n - 2))
                for t, o in zip(towards_rest, own, strict=True)
            ],
        )
    return result
