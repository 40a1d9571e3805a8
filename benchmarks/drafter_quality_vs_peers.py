"""Drafter quality from the same data: ours against SpecForge's and speculators' step.

The story of benchmarks/fp8_vs_bf16_acceptance.py (the demo world's K2 drafter as the warm
start, target-v2's greedy answers, their hidden states), finetuned three times: by our
`train()`, and by each peer's own step (benchmarks/peer_training.py in the peers' venv: their
model, loss, optimizer and clipping) driven over the same samples in the same steps, the ones
our run consumed (its `consumed/rank-0.jsonl`), at the same learning rate and schedule. Each
drafter, and the warm start, is then served by real vLLM (CPU build) as target-v2's eagle3
speculator on the held-out prompts (never trained on): mean acceptance length from /metrics.
Goal: ours >= the better peer's.

    make bench-peers-quality   # creates .venv-peers; ~12 min on 2 cores (demo world built)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_vs_bf16_acceptance import LAYERS, STEPS, Story, acceptance_cells, serve_and_measure
from training_vs_peers import PEERS_PYTHON, THREADS

from eagle3_assets.lib.checkpoint.drafter_io import (
    DrafterCheckpoint,
    read_drafter,
    write_vllm_drafter,
)
from eagle3_assets.lib.core.target import TargetShape
from eagle3_assets.lib.evaluation.acceptance import Acceptance
from eagle3_assets.lib.hidden_states.shard_reader import ShardReader
from eagle3_assets.lib.training.train_drafter import RunConfig, train
from eagle3_assets.lib.training.ttt import TargetHead, cosine_with_warmup

PEERS = ("specforge", "speculators")
SHARD_FORMAT = "bf16+bf16"


def peer_inputs(warm: DrafterCheckpoint, run: RunConfig, work: Path) -> None:
    """run.json and inputs.safetensors for peer_training.py: the warm start in our names,
    the target's head, and every sample our run trained on, indexed in its steps."""
    target = Path(run.target)
    config = warm.config
    head = TargetHead(target)
    consumed = Path(run.out_dir) / "consumed" / "rank-0.jsonl"
    steps_by_id = [
        [sample_id for _, sample_id in json.loads(line)["samples"]]
        for line in consumed.read_text().splitlines()
    ]
    trained = sorted({sample_id for step in steps_by_id for sample_id in step})
    index = {sample_id: n for n, sample_id in enumerate(trained)}
    tensors = {f"warm.{name}": tensor for name, tensor in warm.tensors.items()}
    tensors |= {
        "target_lm_head": head.lm_head,
        "target_norm": head.norm_weight,
        "embed_tokens": head.embed,
    }
    for sample in ShardReader([Path(d) for d in run.batch_dirs], shuffle_buffer=1).samples():
        if sample.sample_id not in index:
            continue
        n, T = index[sample.sample_id], len(sample.input_ids)
        final = torch.zeros(T, config.hidden_size)
        final[sample.loss_mask[1:].nonzero().squeeze(-1)] = sample.final.float()
        tensors |= {
            f"sample.{n}.input_ids": sample.input_ids,
            f"sample.{n}.loss_mask": sample.loss_mask,
            f"sample.{n}.aux": sample.aux.float().reshape(T, -1),
            f"sample.{n}.final": final,
        }
    save_file({k: v.contiguous() for k, v in tensors.items()}, work / "inputs.safetensors")
    warmup = max(1, round(run.warmup_ratio * run.steps))  # as train() sets its schedule
    shape = {
        "name": "the demo world's drafter",
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "length": 0,
        "ttt": run.ttt_length,
        "optimizer_step": True,
    }
    description = {
        "shape": shape,
        "ttt": run.ttt_length,
        "lr": run.lr,
        "warmup_ratio": run.warmup_ratio,
        "lr_multipliers": [cosine_with_warmup(s, run.steps, warmup) for s in range(run.steps)],
        "rms_norm_eps": head.eps,
        "steps": [[index[i] for i in step] for step in steps_by_id],
    }
    (work / "run.json").write_text(json.dumps(description))


def peer_drafter(
    warm: DrafterCheckpoint, peer: str, work: Path, out_dir: Path
) -> tuple[Path, float]:
    """The drafter the peer's step trained, exported as ours is, and its training seconds."""
    started = time.perf_counter()
    command = [str(PEERS_PYTHON), str(Path(__file__).with_name("peer_training.py")), peer]
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
    done = subprocess.run([*command, str(work)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{peer} training failed:\n{done.stderr[-4000:]}")
    seconds = time.perf_counter() - started
    tensors = load_file(work / f"{peer}.safetensors")
    return write_vllm_drafter(out_dir, warm.config, tensors, LAYERS.aux), seconds


def main() -> None:
    if not PEERS_PYTHON.exists():
        sys.exit(f"{PEERS_PYTHON} not found: `make bench-peers-quality` creates the peers' venv")
    story = Story.build()
    results: dict[str, Acceptance] = {}
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        states = story.hidden_states(work / "hidden_states", SHARD_FORMAT)
        run = story.finetuning(states, work / "ours")
        started = time.perf_counter()
        drafters = {"warm start": story.warm_start_export(work / "warm"), "ours": train(run).export}
        seconds["ours"] = time.perf_counter() - started
        warm = read_drafter(story.warm, TargetShape.from_config(story.world.target_v2))
        peer_inputs(warm, run, work)
        for peer in PEERS:
            drafters[peer], seconds[peer] = peer_drafter(warm, peer, work, work / f"{peer}-vllm")
        for number, (name, drafter) in enumerate(drafters.items()):
            results[name] = serve_and_measure(
                story.world, drafter, work / f"server-{number}", 8300 + number, story.prompts
            )
            print(f"{name}: mean acceptance length {results[name].mean_length:.3f}", flush=True)
    print(report(results, seconds, len(story.sequences), len(story.prompts)))


def report(results: dict[str, Acceptance], seconds: dict[str, float], samples, prompts) -> str:
    lines = [
        f"Finetuning from the demo world's K2 drafter: {samples} greedy answers of target-v2 "
        f"({SHARD_FORMAT} shards), {STEPS} steps of 4 samples (the same samples in the same "
        "steps for every trainer), TTT 7, lr 1e-3 (warmup 5%, cosine), each trainer's own loss, "
        f"optimizer and clipping; {THREADS} threads. Serving: target-v2 + drafter, 3 "
        f"speculative tokens, {prompts} held-out prompts, greedy.",
        "",
        "| drafter | mean acceptance length | per position | accepted / drafted | training s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, result in results.items():
        took = f"{seconds[name]:.0f}" if name in seconds else "-"
        lines.append(f"| {name} | {acceptance_cells(result)} | {took} |")
    best = max(PEERS, key=lambda peer: results[peer].mean_length)
    ratio = results["ours"].mean_length / results[best].mean_length
    lines += ["", f"Ours: {ratio:.3f}x the better peer's ({best}) mean acceptance length."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
