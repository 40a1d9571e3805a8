"""Training-time test (TTT) for an EAGLE-3 drafter on extracted hidden-state shards.

Alignment (one shift, never two: SpecForge v0.2.0's offline path shifted twice, PR #448):
draft index i reads the aux states at position i and the token at i + 1, and at TTT step k
predicts the token at i + 2 + k. Its teacher is the target's distribution at position
i + 1 + k (which predicts that token), restricted to the draft vocab (t2d) and renormalized;
the position counts only where that token is a response token (the shards keep final states
exactly at such "teacher positions") and the target's argmax over its whole vocab is in the
draft vocab (mask = loss mask x t2d[argmax]). Loss = sum_k w^k soft cross-entropy, each step
averaged over its supervised positions per sample, then over samples (so ranks that each
average their own samples give the single-process gradient).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from eagle3_assets.lib.core.target import target_config
from eagle3_assets.lib.hidden_states.shard_format import HiddenSample
from eagle3_assets.lib.training.eagle3_model import Eagle3Drafter

TEACHER_CHUNK = 512  # positions per lm_head chunk: bounds memory for a 164K-token vocab


class TargetHead:
    """The target's final norm and lm_head (and its embedding, for the drafter), read from
    its safetensors alone: the teacher without loading the target."""

    NAMES = {
        "embed": ("model.embed_tokens.weight", "language_model.model.embed_tokens.weight"),
        "norm": ("model.norm.weight", "language_model.model.norm.weight"),
        "lm_head": ("lm_head.weight", "language_model.lm_head.weight"),
    }

    def __init__(self, target_dir: Path) -> None:
        config = target_config(target_dir)
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        found = self._read(target_dir)
        if "lm_head" not in found and config.get("tie_word_embeddings"):
            found["lm_head"] = found["embed"]
        missing = sorted(set(self.NAMES) - set(found))
        if missing:
            raise ValueError(f"{target_dir}: no {missing} among the target's safetensors")
        self.embed, self.norm_weight, self.lm_head = (
            found["embed"].float(),
            found["norm"].float(),
            found["lm_head"].float(),
        )

    def _read(self, target_dir: Path) -> dict[str, torch.Tensor]:
        found: dict[str, torch.Tensor] = {}
        for path in sorted(target_dir.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                names = set(f.keys())
                for key, candidates in self.NAMES.items():
                    name = next((n for n in candidates if n in names), None)
                    if name is not None:
                        found[key] = f.get_tensor(name)
        return found

    def to(self, device: torch.device) -> TargetHead:
        """The teacher's matmul (P x H x target vocab) belongs on the GPU with the drafter."""
        self.embed = self.embed.to(device)
        self.norm_weight = self.norm_weight.to(device)
        self.lm_head = self.lm_head.to(device)
        return self

    def logits(self, final: torch.Tensor) -> torch.Tensor:
        x = final.to(self.lm_head.device).float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
        return x @ self.lm_head.T


def teacher(
    sample: HiddenSample, head: TargetHead, t2d: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities over the draft vocab [P, Vd], usable [P]) at the sample's teacher
    positions: softmax of the target logits on t2d's columns; usable where the target's
    argmax over its whole vocab is a draft token."""
    draft_columns = t2d.nonzero().squeeze(-1)
    if sample.final is not None:
        probs, usable = [], []
        for chunk in sample.final.split(TEACHER_CHUNK):
            logits = head.logits(chunk)
            usable.append(t2d[logits.argmax(-1)])
            probs.append(torch.softmax(logits[:, draft_columns], dim=-1))
        if not probs:
            empty = torch.zeros(0, len(draft_columns), device=t2d.device)
            return empty, torch.zeros(0, dtype=torch.bool, device=t2d.device)
        return torch.cat(probs), torch.cat(usable)
    # top-k logits over the target vocab: keep the entries the draft vocab holds
    device = t2d.device
    draft_index = torch.full((len(t2d),), -1, dtype=torch.long, device=device)
    draft_index[draft_columns] = torch.arange(len(draft_columns), device=device)
    ids, logits = sample.topk_ids.to(device), sample.topk_logits.to(device).float()
    columns = draft_index[ids]
    dense = torch.full((len(ids), len(draft_columns)), float("-inf"), device=device)
    kept = columns >= 0
    dense[kept.nonzero(as_tuple=True)[0], columns[kept]] = logits[kept]
    usable = t2d[ids[:, 0]] if len(ids) else torch.zeros(0, dtype=torch.bool, device=device)
    probs = torch.softmax(dense, dim=-1).nan_to_num(0.0)
    return probs, usable


@dataclass
class Batch:
    """Padded TTT inputs for samples of one optimizer step (S = longest length - 1)."""

    aux: torch.Tensor  # [B, S, aux_width]
    input_ids: torch.Tensor  # [B, S + steps - 1]
    key_mask: torch.Tensor  # [B, S]
    targets: torch.Tensor  # [B, S + steps, Vd] teacher probabilities at position index + 1
    supervised: torch.Tensor  # [B, S + steps] bool


def make_batch(
    samples: Sequence[HiddenSample],
    head: TargetHead,
    t2d: torch.Tensor,
    steps: int,
    aux_columns: Sequence[int] | None = None,
) -> Batch:
    """On t2d's device (the drafter's). `aux_columns`: which of the samples' aux layers the
    drafter reads, in its fc order (None: all of them)."""
    device = t2d.device
    S = max(len(s.input_ids) for s in samples) - 1
    B, vd = len(samples), int(t2d.sum())
    columns = list(range(samples[0].aux.shape[1])) if aux_columns is None else list(aux_columns)
    width = len(columns) * samples[0].aux.shape[2]
    batch = Batch(
        aux=torch.zeros(B, S, width, device=device),
        input_ids=torch.zeros(B, S + steps - 1, dtype=torch.long, device=device),
        key_mask=torch.zeros(B, S, dtype=torch.bool, device=device),
        targets=torch.zeros(B, S + steps, vd, device=device),
        supervised=torch.zeros(B, S + steps, dtype=torch.bool, device=device),
    )
    for row, sample in enumerate(samples):
        T = len(sample.input_ids)
        aux = sample.aux[: T - 1] if aux_columns is None else sample.aux[: T - 1, columns]
        batch.aux[row, : T - 1] = aux.reshape(T - 1, width).to(device).float()
        batch.input_ids[row, : T - 1] = sample.input_ids[1:].to(device)
        batch.key_mask[row, : T - 1] = True
        # teacher position p (loss_mask[p + 1]) serves draft index p - 1 - k at step k
        positions = sample.loss_mask[1:].nonzero().squeeze(-1).to(device)
        probs, usable = teacher(sample, head, t2d)
        batch.targets[row, positions] = probs
        batch.supervised[row, positions] = usable
    return batch


def step_masks(batch: Batch, steps: int) -> list[torch.Tensor]:
    """Per TTT step k, [B, S]: the draft indices whose teacher position k further on is
    supervised."""
    S = batch.aux.shape[1]
    return [batch.supervised[:, 1 + k : 1 + k + S] & batch.key_mask for k in range(steps)]


def supervised_samples(batch: Batch, steps: int) -> list[int]:
    """Per TTT step, how many of the batch's samples it supervises: what a step's loss
    averages over, summed over the ranks before backward."""
    return [int(mask.any(-1).sum()) for mask in step_masks(batch, steps)]


def ttt_loss(
    model: Eagle3Drafter | torch.nn.Module,
    batch: Batch,
    steps: int,
    decay: float,
    divisors: Sequence[float] | None = None,
) -> tuple[torch.Tensor, list[float], list[int], list[int], list[float]]:
    """(weighted loss, per-step loss, per-step hits, per-step supervised positions, step-0
    loss of each sample that step 0 supervises) for one batch: hits and counts, not their
    ratio, so that ranks and batches add up exactly; the per-sample losses for the layer
    probe (a mean by sample, and which samples a per-sample gradient is taken on). `model`:
    the drafter, or the drafter in DistributedDataParallel. Step k's loss is the sum of its
    samples' losses over `divisors[k]` (None: this batch's count, a mean): ranks whose batches
    hold unequal numbers of samples pass the total over the ranks / world size, so that
    DistributedDataParallel's mean of their gradients is the one-process gradient."""
    masks = step_masks(batch, steps)

    def readout(k: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inside the step (recomputed with it when checkpointed): the per-position soft
        cross-entropy [B, S] and hits; the float32 log-probabilities are what backward keeps."""
        target = batch.targets[:, 1 + k : 1 + k + logits.shape[1]]
        log_probs = F.log_softmax(logits.float(), dim=-1)
        hits = (log_probs.argmax(-1) == target.argmax(-1)) & masks[k]
        return -(target * log_probs).sum(-1), hits

    results = model(batch.aux, batch.input_ids, steps, batch.key_mask, readout)
    total = torch.zeros((), device=batch.aux.device)
    losses, hits, counts, first_samples = [], [], [], []
    for k, ((per_position, step_hits), mask) in enumerate(zip(results, masks, strict=True)):
        supervised = mask.sum(-1)
        has = supervised > 0
        per_sample = (per_position * mask).sum(-1)[has] / supervised[has]
        if divisors is not None:
            step_loss = per_sample.sum() / (divisors[k] or 1)
        elif len(per_sample):
            step_loss = per_sample.mean()
        else:  # zero, but in the graph: every rank's backward reaches every parameter
            step_loss = per_position.sum() * 0.0
        if k == 0:
            first_samples = per_sample.detach().tolist()
        total = total + decay**k * step_loss
        losses.append(float(step_loss.detach()))
        hits.append(int(step_hits.sum()))
        counts.append(int(mask.sum()))
    return total, losses, hits, counts, first_samples


def cosine_with_warmup(step: int, total: int, warmup: int) -> float:
    """LR multiplier: linear warmup, then cosine to zero."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def derive_vocab_maps(
    counts: torch.Tensor, draft_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of the `draft_vocab_size` target tokens most frequent among the response
    tokens (`counts` over the target vocab); ties and, when the corpus has fewer distinct
    tokens, the padding go to the lowest ids; sorted by id, as vLLM expects."""
    order = sorted(range(len(counts)), key=lambda token: (-int(counts[token]), token))
    used = torch.tensor(sorted(order[:draft_vocab_size]), dtype=torch.long)
    t2d = torch.zeros(len(counts), dtype=torch.bool)
    t2d[used] = True
    return used - torch.arange(draft_vocab_size), t2d


def remap_lm_head(lm_head: torch.Tensor, old_d2t: torch.Tensor, new_d2t: torch.Tensor):
    """lm_head rows moved to the new draft ids of the same target tokens; tokens new to the
    draft vocab start from zero rows (no logit preference), never from another token's row."""
    old_targets = (torch.arange(len(old_d2t)) + old_d2t).tolist()
    new_targets = (torch.arange(len(new_d2t)) + new_d2t).tolist()
    row_of = {target: row for row, target in enumerate(old_targets)}
    remapped = torch.zeros(len(new_d2t), lm_head.shape[1], dtype=lm_head.dtype)
    for row, target in enumerate(new_targets):
        if target in row_of:
            remapped[row] = lm_head[row_of[target]]
    return remapped
