"""One drafter training step, ours against SpecForge 0.2.0's and speculators 0.9.0's, on CPU.

Each trainer takes the same step on the same shapes and the same seeded inputs
(step_inputs.py: aux states, token ids, the target's last state, lm_head and embedding,
the draft vocab), each in a fresh process on the same 2 threads, in alternating rounds:
- ours: `make_batch` (the teacher from the target's norm and lm_head over the full vocab)
  and `ttt_loss` (TTT 7, 0.8^k), backward, clipping at RunConfig.grad_clip, AdamW with
  RunConfig's settings: what `train()` does per step on one rank;
- SpecForge and speculators: benchmarks/peer_steps.py in the peers' venv, their own code
  (SpecForge's offline EAGLE-3 step; speculators' step with its trainer's defaults, at TTT 7,
  and at its default TTT 3 as `speculators-ttt3`, shown beside the goals, not in them).
At the demo shape, ours also runs as 2 gloo ranks under torchrun (1 thread each, each rank
its own sample, DistributedDataParallel's bucketed all-reduce overlapped with backward, as
`train()` wraps it): the scaling against one rank on the same 2 cores.
Reported per shape: tokens/s (the samples' tokens over the median step), the process's
peak RSS (the ranks' sum), the step's loss, and our ratios to the faster and to the smaller
peer.

Before the timings, the maths: ours and SpecForge's step on the same weights and inputs,
the loss of every TTT step and the weight gradients compared (`agreement`).

    make bench-peers           # creates .venv-peers, then runs this (19 min, ~16 GB RAM)
    .venv/bin/python benchmarks/training_vs_peers.py --shapes demo --rounds 1   # ~1 min
    .venv/bin/python benchmarks/training_vs_peers.py --shapes s1024 s2048 --rounds 2   # ~16 min

Drafter quality from the same data: benchmarks/drafter_quality_vs_peers.py. Not measured:
GPU bf16 and MFU (no GPU was lent to the task that wrote this).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from drafter_training import cpu_name
from step_inputs import SHAPES, StepShape, step_inputs, time_steps

REPO = Path(__file__).resolve().parents[1]
PEERS_PYTHON = REPO / ".venv-peers" / "bin" / "python"
THREADS = 2
TRAINERS = ("ours", "specforge", "speculators", "speculators-ttt3")
GOAL_PEERS = ("specforge", "speculators")  # at the shape's TTT 7, as ours; the goals' peers
RANKS_2 = "ours, 2 gloo ranks"  # 1 thread each: the same 2 cores as one rank's 2 threads
RANKS_SHAPES = ("demo",)  # two Kimi-shaped steps (13 GB each) do not fit in 24 GB
STEPS = {"demo": 40, "kimi": 1, "s1024": 3, "s2048": 2}  # timed, after one warm-up step


def our_parts(shape: StepShape, inputs: dict[str, torch.Tensor]):
    """(drafter, target head, sample, recipe): what `train()` holds on one rank for a step."""
    from eagle3_assets.lib.hidden_states.shard_format import HiddenSample
    from eagle3_assets.lib.training.eagle3_model import DrafterConfig, Eagle3Drafter
    from eagle3_assets.lib.training.train_drafter import RunConfig
    from eagle3_assets.lib.training.ttt import TargetHead

    recipe = RunConfig(
        batch_dirs=[], warm_start=None, target="", out_dir="", steps=1, ttt_length=shape.ttt
    )
    config = DrafterConfig(
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size,
        vocab_size=shape.vocab_size,
        draft_vocab_size=shape.draft_vocab_size,
    )
    head = TargetHead.__new__(TargetHead)  # the target's head, from tensors, not a folder
    head.eps = config.rms_norm_eps
    head.embed = inputs["embed_tokens"]
    head.norm_weight = torch.ones(shape.hidden_size)
    head.lm_head = inputs["target_lm_head"]
    torch.manual_seed(0)
    model = Eagle3Drafter(config, head.embed)
    model.t2d[inputs["draft_ids"]] = True
    model.d2t.copy_(inputs["draft_ids"] - torch.arange(shape.draft_vocab_size))
    S = shape.length
    loss_mask = torch.ones(S, dtype=torch.bool)
    loss_mask[0] = False  # the first token has no teacher position before it
    sample = HiddenSample(
        "0",
        inputs["input_ids"][0],
        loss_mask,
        inputs["aux"][0].view(S, 3, shape.hidden_size),
        inputs["final"][0, : S - 1],  # the teacher positions: every one but the last
        None,
        None,
    )
    return model, head, sample, recipe


def our_step(shape: StepShape, inputs: dict[str, torch.Tensor], world: int = 1):
    """Our trainer's step (train_drafter.train's loop body, minus the reader): on one rank the
    bare drafter, on several the drafter in DistributedDataParallel (bucketed all-reduce
    overlapped with backward), as `train()` builds it."""
    from eagle3_assets.lib.training.train_drafter import training_objective
    from eagle3_assets.lib.training.ttt import make_batch, ttt_loss

    model, head, sample, recipe = our_parts(shape, inputs)
    objective = training_objective(model, world)
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = (
        torch.optim.AdamW(
            parameters, lr=recipe.lr, weight_decay=recipe.weight_decay, betas=(0.9, 0.95)
        )
        if shape.optimizer_step
        else None
    )

    def step() -> float:
        batch = make_batch([sample], head, model.t2d, shape.ttt)
        loss, *_ = ttt_loss(objective, batch, recipe.ttt_length, recipe.decay)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, recipe.grad_clip)
        if optimizer is not None:
            optimizer.step()
        model.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def agreement(shape_name: str, ttt: int, seed: int, work: Path) -> dict:
    """Ours and SpecForge's step on the same weights and inputs: each TTT step's summed loss
    (SpecForge averages over every row, we over the supervised ones: both times their
    count) and, for the weight gradients, the same rescaling (exact only at TTT 1, where
    one step's count scales the whole loss)."""
    from safetensors.torch import load_file, save_file

    from eagle3_assets.lib.training.ttt import make_batch, ttt_loss

    shape = SHAPES[shape_name]
    inputs = step_inputs(shape, seed)
    model, head, sample, recipe = our_parts(shape, inputs)
    batch = make_batch([sample], head, model.t2d, ttt)
    loss, losses, _, counts, _ = ttt_loss(model, batch, ttt, recipe.decay)
    loss.backward()
    weights, out = work / f"weights-{ttt}.safetensors", work / f"specforge-{ttt}.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, weights)
    command = [str(PEERS_PYTHON), str(Path(__file__).with_name("peer_steps.py"))]
    command += ["specforge-gradients", shape_name, "0", str(seed), str(ttt), str(weights), str(out)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"SpecForge gradients failed:\n{done.stderr[-4000:]}")
    theirs = load_file(out)
    rows = shape.length
    ours_sums = torch.tensor([value * n for value, n in zip(losses, counts, strict=True)])
    their_sums = theirs["step_losses"].double() * rows
    result = {
        "ttt": ttt,
        "supervised": counts,
        "loss_sums_ours": ours_sums.tolist(),
        "loss_sums_specforge": their_sums.tolist(),
        "loss_max_rel_diff": float(((ours_sums - their_sums).abs() / ours_sums.abs()).max()),
    }
    if ttt == 1:
        worst = 0.0
        for name, parameter in model.named_parameters():
            if parameter.grad is None:
                continue
            ours = parameter.grad.double() * counts[0]
            their = theirs[f"grad.{name}"].double() * rows
            worst = max(worst, float((ours - their).abs().max() / ours.abs().max()))
        result["grad_max_rel_diff"] = worst
    return result


def child(shape_name: str, steps: int, seed: int) -> dict:
    """In a fresh process: build, one warm-up step, then `steps` timed steps."""
    torch.set_num_threads(THREADS)
    shape = SHAPES[shape_name]
    return time_steps(our_step(shape, step_inputs(shape, seed)), steps)


def ranks_child(shape_name: str, steps: int, seed: int) -> dict | None:
    """One rank of our step under torchrun (gloo), the cores split between the ranks, each
    rank on its own sample (seed + rank): rank 0 returns the step seconds (the ranks step in
    lockstep) and the ranks' peak RSS summed, the job's memory."""
    import torch.distributed as dist

    from eagle3_assets.lib.training.train_drafter import distributed

    with distributed("cpu"):  # gloo: the CPU benchmark
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.set_num_threads(max(1, THREADS // world))
        shape = SHAPES[shape_name]
        result = time_steps(our_step(shape, step_inputs(shape, seed + rank), world), steps)
        peaks = torch.tensor([result["peak_rss"]], dtype=torch.float64)
        dist.all_reduce(peaks)
        result["peak_rss"] = int(peaks.item())
        result["ranks"] = world
    return result if rank == 0 else None


def run(trainer: str, shape_name: str, seed: int) -> dict:
    """One trainer's process (our 2 ranks: a torchrun job); its last stdout line is the
    result."""
    steps = str(STEPS[shape_name])
    if trainer == "ours":
        command = [sys.executable, __file__, "--child", shape_name, steps, str(seed)]
    elif trainer == RANKS_2:
        from eagle3_assets.lib.training.torchrun import torchrun_command

        entry = [__file__, "--ranks-child", shape_name, steps, str(seed)]
        command = torchrun_command(entry, nproc=2)
    else:
        script = Path(__file__).with_name("peer_steps.py")
        command = [str(PEERS_PYTHON), str(script), trainer, shape_name, steps, str(seed)]
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{trainer} on {shape_name} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def trainers(shape_name: str) -> tuple[str, ...]:
    """Who runs at a shape: our 2 ranks only where two copies of the step fit in RAM."""
    return (*TRAINERS, RANKS_2) if shape_name in RANKS_SHAPES else TRAINERS


def measure(shape_names: list[str], rounds: int, seed: int) -> dict:
    """Every trainer once a round, in a rotating order, so drift hits each alike."""
    results: dict = {name: {t: [] for t in trainers(name)} for name in shape_names}
    for name in shape_names:
        for number in range(rounds):
            everyone = trainers(name)
            turn = number % len(everyone)
            order = everyone[turn:] + everyone[:turn]
            for trainer in order:
                started = time.perf_counter()
                result = run(trainer, name, seed)
                results[name][trainer].append(result)
                print(
                    f"{name} round {number + 1}: {trainer} median step "
                    f"{statistics.median(result['seconds']):.3f} s, peak RSS "
                    f"{result['peak_rss'] / 1e9:.2f} GB ({time.perf_counter() - started:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    return results


def tokens_per_s(value: float) -> str:
    return f"{value:,.1f}" if value >= 100 else f"{value:.3f}"


def report(results: dict, rounds: int, agreed: list[dict]) -> str:
    lines = [
        f"Machine: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, {THREADS} "
        f"threads, fp32; {rounds} rounds, each trainer in a fresh process per round.",
        "",
        "### The maths: ours against SpecForge's step on the same weights (demo shape)",
        "",
        "Per TTT step, the summed soft cross-entropy over the supervised positions (SpecForge "
        "reports it over every row, we over the supervised ones; both are multiplied back), "
        "and at TTT 1 the weight gradients, rescaled alike.",
        "",
        "| TTT | supervised positions per step | max relative difference, loss | "
        "max relative difference, gradients |",
        "| --- | --- | --- | --- |",
    ]
    for row in agreed:
        grads = row.get("grad_max_rel_diff")
        lines.append(
            f"| {row['ttt']} | {', '.join(map(str, row['supervised']))} | "
            f"{row['loss_max_rel_diff']:.1e} | {'-' if grads is None else f'{grads:.1e}'} |"
        )
    lines.append("")
    for name, by_trainer in results.items():
        shape = SHAPES[name]
        rows = {}
        for trainer, runs in by_trainer.items():
            step = statistics.median(s for r in runs for s in r["seconds"])
            rows[trainer] = {  # every rank trains its own sample of shape.length tokens
                "tokens_per_s": runs[0].get("ranks", 1) * shape.length / step,
                "step": step,
                "peak_rss": max(r["peak_rss"] for r in runs),
                "loss": runs[-1]["loss"],
            }
        peers = [rows[peer] for peer in GOAL_PEERS]
        fastest = max(p["tokens_per_s"] for p in peers)
        smallest = min(p["peak_rss"] for p in peers)
        what = (
            "forward, backward, clipping, optimizer step"
            if shape.optimizer_step
            else ("forward, backward, clipping (no optimizer: three fp32 AdamW states do not fit)")
        )
        lines += [
            f"### {shape.name}: hidden {shape.hidden_size}, {shape.num_attention_heads} x "
            f"{shape.head_dim} heads ({shape.num_key_value_heads} KV), intermediate "
            f"{shape.intermediate_size}, target vocab {shape.vocab_size:,}, draft vocab "
            f"{shape.draft_vocab_size:,}; one sample of {shape.length} tokens, TTT "
            f"{shape.ttt}; {what}",
            "",
            "| trainer | tokens/s | median s/step | peak RSS | loss (its own definition) |",
            "| --- | --- | --- | --- | --- |",
        ]
        for trainer, row in rows.items():
            lines.append(
                f"| {trainer} | {tokens_per_s(row['tokens_per_s'])} | {row['step']:.3f} | "
                f"{row['peak_rss'] / 1e9:.2f} GB | {row['loss']:.4f} |"
            )
        ours = rows["ours"]
        lines += [
            "",
            f"Ours: {ours['tokens_per_s'] / fastest:.2f}x the faster peer's tokens/s (goal "
            f">= 1.2x), {ours['peak_rss'] / smallest:.2f}x the smaller peer's peak RSS (goal "
            "<= 0.8x).",
            "",
        ]
        if RANKS_2 in rows:
            scaling = rows[RANKS_2]["tokens_per_s"] / ours["tokens_per_s"]
            lines += [
                f"Scaling: 2 gloo ranks (1 thread each) give {scaling:.2f}x the tokens/s of 1 "
                "rank (2 threads) on the same 2 cores.",
                "",
            ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["demo", "kimi"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", nargs=3, metavar=("SHAPE", "STEPS", "SEED"), help="internal")
    parser.add_argument("--ranks-child", nargs=3, metavar=("SHAPE", "STEPS", "SEED"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), int(args.child[2]))))
        return
    if args.ranks_child:
        shape_name, steps, seed = args.ranks_child
        result = ranks_child(shape_name, int(steps), int(seed))
        if result is not None:
            print(json.dumps(result))
        return
    if not PEERS_PYTHON.exists():
        sys.exit(f"{PEERS_PYTHON} not found: `make bench-peers` creates the peers' venv")
    with tempfile.TemporaryDirectory(prefix="peers-agreement-") as scratch:
        agreed = [agreement("demo", ttt, args.seed, Path(scratch)) for ttt in (1, 7)]
    print(json.dumps(agreed), file=sys.stderr)
    print(report(measure(args.shapes, args.rounds, args.seed), args.rounds, agreed))


if __name__ == "__main__":
    main()
