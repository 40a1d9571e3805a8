"""One EAGLE-3 training step as SpecForge 0.2.0's and speculators 0.9.0's own trainers take it.

Runs in the peers' venv (`make bench-peers-venv`: both packages installed from the index with
--no-deps, beside torch 2.13.0 CPU); imports their code from there, never copies it. Called
by benchmarks/training_vs_peers.py as `python peer_steps.py PEER SHAPE ROUNDS SEED`; prints
one JSON line: seconds of each timed step, the loss, and the process's peak RSS.

Where a peer cannot run on a CPU as shipped, the one piece swapped is named:
- SpecForge: its soft cross-entropy is a Triton kernel (`LogSoftmaxLoss`); the step uses the
  same maths in torch (its own reference, `core/loss.py`: -(p * log_softmax(x)) * mask,
  mean over every row). Its `torch.compile`d rope and norms run as compiled (gcc is here).
- speculators: the "eager" KL loss its config offers (`resolve_loss_config("kl_div",
  "eager")`) instead of the fused Triton one, and sdpa attention (with the dense masks it
  builds for that backend) instead of flex attention, which has no backward on CPU.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_inputs import SHAPES, StepShape, step_inputs, time_steps

THREADS = 2
NORM_EPS = 1e-6  # the target's final norm, as step_inputs' target has it


def layer_config(shape: StepShape, **extra):
    """The transformers LlamaConfig of the drafter's one decoder layer, as both peers take it."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=4096,
        hidden_act="silu",
        tie_word_embeddings=False,
        **extra,
    )


def target_normed(final: torch.Tensor, weight: torch.Tensor | float, eps: float) -> torch.Tensor:
    """The target's final RMSNorm of its last state: what SpecForge stores as its target."""
    return final * torch.rsqrt(final.pow(2).mean(-1, keepdim=True) + eps) * weight


def specforge_model(shape: StepShape, embed_tokens, draft_ids, target_lm_head, ttt: int):
    """SpecForge v0.2.0's offline EAGLE-3 pieces: the draft model (the target's frozen
    embedding, the draft vocab `draft_ids`) and Eagle3TrainStrategy over OnlineEagle3Model
    (loss weights 0.8^k) with the target head (the lm_head alone) over the stored state."""
    import specforge.algorithms.eagle3.model as eagle3
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.modeling.target.target_head import TargetHead
    from specforge.training.strategies.base import Eagle3TrainStrategy

    class TorchLogSoftmaxLoss:  # the Triton kernel's maths (specforge/core/loss.py)
        @staticmethod
        def apply(logits, target_p, position_mask):
            log_p = torch.log_softmax(logits.float(), dim=-1)
            return -(position_mask * target_p * log_p).sum(-1).mean()

    eagle3.LogSoftmaxLoss = TorchLogSoftmaxLoss
    config = layer_config(
        shape,
        architectures=["LlamaForCausalLMEagle3"],
        draft_vocab_size=shape.draft_vocab_size,
        pad_token_id=0,
        pretraining_tp=1,
    )
    torch.manual_seed(0)
    draft = LlamaForCausalLMEagle3(config, attention_backend="sdpa").float()
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(embed_tokens)
        draft.t2d.zero_()[draft_ids] = True
        draft.d2t.copy_(draft_ids - torch.arange(shape.draft_vocab_size))
    draft.freeze_embedding()
    model = eagle3.OnlineEagle3Model(draft, length=ttt, attention_backend="sdpa")
    head = TargetHead.__new__(TargetHead)
    nn.Module.__init__(head)
    head.fc = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
    head.fc.weight.data.copy_(target_lm_head)
    head.freeze_weights()
    return draft, Eagle3TrainStrategy(model, target_head=head)


def specforge_batch(input_ids, aux, normed_final, loss_mask):
    """SpecForge's offline batch of one sample [1, T, ...]: it stores the target's normed last
    state (ours keeps it before the norm). Its `loss_mask` at index i is ours at i + 2 (the
    token its draft index i predicts), zero for the last two rows, whose teacher after
    SpecForge's shift is padding."""
    from specforge.runtime.contracts import TrainBatch

    tensors = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "loss_mask": loss_mask,
        "hidden_state": aux,
        "target": normed_final,
    }
    return TrainBatch(["0"], "eagle3", tensors, {"target_repr": "hidden_state"})


def specforge_parts(shape: StepShape, inputs: dict[str, torch.Tensor], ttt: int):
    """The draft model, the strategy and one batch of the seeded inputs (every position a
    response token; the target's norm weight is ones)."""
    draft, strategy = specforge_model(
        shape, inputs["embed_tokens"], inputs["draft_ids"], inputs["target_lm_head"], ttt
    )
    final = inputs["final"]
    normed = target_normed(final, 1.0, NORM_EPS)
    loss_mask = torch.ones(1, shape.length, dtype=torch.long)
    loss_mask[0, -2:] = 0
    return draft, strategy, specforge_batch(inputs["input_ids"], inputs["aux"], normed, loss_mask)


def specforge_step(shape: StepShape, inputs: dict[str, torch.Tensor]):
    """SpecForge's step as its trainer takes it, TTT 7, with its BF16Optimizer (AdamW lr 1e-4
    on fp32 masters, clipping at 0.5; the weights here are fp32)."""
    from specforge.optimizer import BF16Optimizer

    draft, strategy, batch = specforge_parts(shape, inputs, shape.ttt)
    optimizer = (
        BF16Optimizer(draft, lr=1e-4, max_grad_norm=0.5, total_steps=1000)
        if shape.optimizer_step
        else None
    )

    def step() -> float:
        output = strategy.forward_loss(batch)
        output.loss.backward()
        if optimizer is not None:
            optimizer.step()  # clips, steps, zeroes the gradients
        else:
            draft.zero_grad(set_to_none=True)
        return float(output.loss.detach())

    return step


def specforge_gradients(shape: StepShape, inputs, ttt: int, weights: Path, out: Path) -> None:
    """SpecForge's loss per TTT step and gradients for the drafter weights in `weights`
    (ours, by the same names), written to `out`: the maths compared, not the speed."""
    from safetensors.torch import load_file, save_file

    draft, strategy, batch = specforge_parts(shape, inputs, ttt)
    missing, unexpected = draft.load_state_dict(load_file(weights), strict=False)
    if unexpected or set(missing) != {"embed_tokens.weight"}:
        raise ValueError(f"weights do not map by name: missing {missing}, extra {unexpected}")
    output = strategy.forward_loss(batch)
    output.loss.backward()
    tensors = {f"grad.{n}": p.grad for n, p in draft.named_parameters() if p.grad is not None}
    tensors["step_losses"] = torch.stack(output.metrics["plosses"]).float()
    save_file({k: v.contiguous() for k, v in tensors.items()}, out)


def speculators_model(shape: StepShape, embed_tokens, verifier_rows, **variant):
    """speculators 0.9.0's Eagle3DraftModel of one decoder layer: the target's frozen
    embedding and its lm_head rows of the draft vocab (the teacher's and, frozen, the
    draft's own); `variant`: its norm_before_residual / norm_before_fc / norm_output."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    layer = layer_config(shape)
    # its default, flex attention, has no backward on CPU ("FlexAttention does not support
    # backward on CPU"): sdpa with the dense masks it builds for every other backend
    layer._attn_implementation = "sdpa"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=shape.draft_vocab_size, **variant
    )
    torch.manual_seed(0)
    model = Eagle3DraftModel(config).float()
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed_tokens)
        model.verifier_lm_head.weight.copy_(verifier_rows)
        model.lm_head.weight.copy_(verifier_rows)
    return model


def speculators_optimizers(model, lr: float) -> list:
    """Its trainer's default: Muon on the 2-D weights and AdamW on the rest."""
    from speculators.train.optimizers import build_optimizers

    settings = SimpleNamespace(
        optimizer="muon",
        lr=lr,
        weight_decay=0.01,
        muon_lr=lr,
        muon_momentum=0.95,
        muon_weight_decay=0.1,
        muon_ns_steps=5,
        muon_adjust_lr_fn="match_rms_adamw",
    )
    return build_optimizers(model, settings)


def speculators_loss(model, aux, input_ids, loss_mask, final, ttt: int) -> torch.Tensor:
    """Its forward on one packed document [1, T, ...] with the verifier's last state (before
    the norm), KL per step summed with decay 1.0 (its default), the "eager" KL."""
    from speculators.losses.utils import resolve_loss_config

    S = input_ids.shape[1]
    _, loss, _ = model(
        hidden_states=aux,
        input_ids=input_ids,
        document_ids=torch.zeros(1, S, dtype=torch.long),
        loss_mask=loss_mask,
        position_ids=torch.arange(1, S + 1)[None],
        verifier_last_hidden_states=final,
        ttt_steps=ttt,
        ttt_step_loss_decay=1.0,
        loss_config=resolve_loss_config("kl_div", "eager"),
    )
    return loss


def speculators_step(shape: StepShape, inputs: dict[str, torch.Tensor]):
    """speculators 0.9.0's EAGLE-3 step with its trainer's defaults (TTT 3 is its default;
    here `shape.ttt`, its API allows 7): its norms before the residual, the fc and the
    output; clipping at 1.0; Muon and AdamW."""
    model = speculators_model(
        shape,
        inputs["embed_tokens"],
        inputs["target_lm_head"][inputs["draft_ids"]],
        norm_before_residual=True,
        norm_before_fc=True,
        norm_output=True,
    )
    optimizers = speculators_optimizers(model, 1e-3) if shape.optimizer_step else []
    S = shape.length

    def step() -> float:
        loss = speculators_loss(
            model,
            inputs["aux"],
            inputs["input_ids"],
            torch.ones(1, S, dtype=torch.bool),
            inputs["final"],
            shape.ttt,
        )
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for optimizer in optimizers:
            optimizer.step()
        model.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


PEERS = {
    "specforge": specforge_step,
    "speculators": speculators_step,
    # its trainer's default TTT length, beside the shape's 7: what its users run as shipped
    "speculators-ttt3": lambda shape, inputs: speculators_step(replace(shape, ttt=3), inputs),
}


def main() -> None:
    peer, shape_name, rounds, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(THREADS)
    shape = SHAPES[shape_name]
    if peer == "specforge-gradients":  # ... TTT WEIGHTS OUT
        ttt, weights, out = int(sys.argv[5]), Path(sys.argv[6]), Path(sys.argv[7])
        specforge_gradients(shape, step_inputs(shape, seed), ttt, weights, out)
        return
    print(json.dumps(time_steps(PEERS[peer](shape, step_inputs(shape, seed)), rounds)))


if __name__ == "__main__":
    main()
