"""Finetune a warm-started drafter with a peer's own training step, on our samples.

Runs in the peers' venv (`make bench-peers`), called by benchmarks/drafter_quality_vs_peers.py
as `python peer_training.py PEER WORK`. WORK holds what the project's side wrote: `run.json`
(the drafter's shape, the samples of each step in the order our run consumed them, the
learning rate and its schedule) and `inputs.safetensors` (the warm start in our names, the
target's lm_head, final norm and embedding, each sample's tokens, loss mask, aux states and
final state). The loop is ours (so every trainer sees the same samples in the same steps,
a step's samples as micro-batches of one, the loss divided by their count); the maths of a
step are the peer's: its model, loss, optimizer and clipping. It writes
`WORK/PEER.safetensors`: the trained drafter in our (vLLM's) names.

- SpecForge 0.2.0: `Eagle3TrainStrategy.forward_loss` over its draft model (TTT 7, 0.8^k),
  its `BF16Optimizer` (AdamW on fp32 masters, clipping at 0.5, its cosine schedule with
  warmup).
- speculators 0.9.0: `Eagle3DraftModel.forward` on batches shifted by its own
  `shift_batch` (KL per step, decay 1.0), Muon and AdamW, clipping at 1.0, the run's
  schedule; its lm_head stays frozen, as its trainer keeps it. Its variant switches are all
  off: the warm start is vLLM's plain Llama EAGLE-3 layer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_steps import (
    THREADS,
    specforge_batch,
    specforge_model,
    speculators_loss,
    speculators_model,
    speculators_optimizers,
    target_normed,
)
from step_inputs import StepShape

OURS_ONLY = ("embed_tokens.weight",)  # the target's, never saved with a drafter


class Inputs:
    """What the project's side wrote: the warm start, the target's head, the samples."""

    def __init__(self, work: Path) -> None:
        self.run = json.loads((work / "run.json").read_text())
        self.tensors = load_file(work / "inputs.safetensors")
        self.shape = StepShape(**self.run["shape"])
        self.warm = {
            name.removeprefix("warm."): tensor
            for name, tensor in self.tensors.items()
            if name.startswith("warm.")
        }
        self.draft_ids = self.warm["t2d"].nonzero().squeeze(-1)

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        """input_ids [T], loss_mask [T] (bool), aux [T, 3H], final [T, H] (zeros where the
        shards keep none: positions no loss reads)."""
        names = ("input_ids", "loss_mask", "aux", "final")
        return {name: self.tensors[f"sample.{index}.{name}"] for name in names}

    def normed(self, final: torch.Tensor) -> torch.Tensor:
        """The target's final norm, applied as SpecForge stores the last state."""
        return target_normed(final, self.tensors["target_norm"], self.run["rms_norm_eps"])


def specforge(inputs: Inputs) -> dict[str, torch.Tensor]:
    from specforge.optimizer import BF16Optimizer

    run, steps = inputs.run, inputs.run["steps"]
    draft, strategy = specforge_model(
        inputs.shape,
        inputs.tensors["embed_tokens"],
        inputs.draft_ids,
        inputs.tensors["target_lm_head"],
        run["ttt"],
    )
    missing, unexpected = draft.load_state_dict(inputs.warm, strict=False)
    if unexpected or set(missing) != set(OURS_ONLY):
        raise ValueError(f"warm start does not map by name: missing {missing}, extra {unexpected}")
    # after the warm start: it copies the weights into its fp32 masters when built
    optimizer = BF16Optimizer(
        draft,
        lr=run["lr"],
        max_grad_norm=0.5,
        total_steps=len(steps),
        warmup_ratio=run["warmup_ratio"],
    )
    for number, step in enumerate(steps):
        for index in step:
            sample = inputs.sample(index)
            T = len(sample["input_ids"])
            mask = torch.zeros(1, T, dtype=torch.long)  # ours at i + 2 (specforge_batch)
            mask[0, : T - 2] = sample["loss_mask"][2:].long()
            batch = specforge_batch(
                sample["input_ids"][None],
                sample["aux"][None],
                inputs.normed(sample["final"])[None],
                mask,
            )
            (strategy.forward_loss(batch).loss / len(step)).backward()
        optimizer.step()  # clips, steps, schedules, zeroes the gradients
        report(number, len(steps))
    return {k: v for k, v in draft.state_dict().items() if k not in OURS_ONLY}


def speculators(inputs: Inputs) -> dict[str, torch.Tensor]:
    from speculators.models.eagle3.data import shift_batch

    run, steps = inputs.run, inputs.run["steps"]
    model = speculators_model(
        inputs.shape,
        inputs.tensors["embed_tokens"],
        inputs.tensors["target_lm_head"][inputs.draft_ids],
        norm_before_residual=False,
        norm_before_fc=False,
        norm_output=False,
    )
    theirs = {name.replace("midlayer.", "layers.0."): t for name, t in inputs.warm.items()}
    with torch.no_grad():
        model.verifier_norm.weight.copy_(inputs.tensors["target_norm"])
    missing, unexpected = model.load_state_dict(theirs, strict=False)
    expected = {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    if unexpected or set(missing) != expected:
        raise ValueError(f"warm start does not map by name: missing {missing}, extra {unexpected}")
    optimizers = speculators_optimizers(model, run["lr"])
    multipliers = run["lr_multipliers"]
    schedules = [
        torch.optim.lr_scheduler.LambdaLR(o, lambda n: multipliers[min(n, len(multipliers) - 1)])
        for o in optimizers
    ]
    for number, step in enumerate(steps):
        for index in step:
            sample = inputs.sample(index)
            T = len(sample["input_ids"])
            # the positions whose final state the shards hold (ours: loss_mask[p + 1]): after
            # its shift, its index i is supervised at step k exactly where ours is
            held = torch.zeros(T, dtype=torch.bool)
            held[: T - 1] = sample["loss_mask"][1:]
            shifted = shift_batch(
                {
                    "input_ids": sample["input_ids"],
                    "hidden_states": sample["aux"],
                    "verifier_last_hidden_states": sample["final"],
                    "loss_mask": held,
                    "lengths": torch.tensor([T]),
                    "position_ids": torch.arange(T),
                }
            )
            loss = speculators_loss(
                model,
                shifted["hidden_states"][None],
                shifted["input_ids"][None],
                shifted["loss_mask"][None],
                shifted["verifier_last_hidden_states"][None],
                run["ttt"],
            )
            (loss / len(step)).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for optimizer, schedule in zip(optimizers, schedules, strict=True):
            optimizer.step()
            schedule.step()
        model.zero_grad(set_to_none=True)
        report(number, len(steps))
    ours = {name.replace("layers.0.", "midlayer."): t for name, t in model.state_dict().items()}
    return {name: ours[name] for name in inputs.warm}


def report(number: int, total: int) -> None:
    if (number + 1) % 50 == 0 or number + 1 == total:
        print(f"step {number + 1}/{total}", file=sys.stderr, flush=True)


TRAINERS = {"specforge": specforge, "speculators": speculators}


def main() -> None:
    peer, work = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(THREADS)
    trained = TRAINERS[peer](Inputs(work))
    save_file({k: v.contiguous() for k, v in trained.items()}, work / f"{peer}.safetensors")


if __name__ == "__main__":
    main()
