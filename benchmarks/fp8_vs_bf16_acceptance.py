"""Does the compact hidden-state format cost acceptance? Two drafters finetuned from the same
warm start on the same samples for the same steps, one on bf16+bf16 shards and one on the
default fp8+fp8, each then served by real vLLM (CPU build) as target-v2's eagle3 speculator
on the held-out prompts; the warm start itself is measured too. Goal: fp8 costs no more than
2% of mean acceptance length.

    .venv/bin/python benchmarks/fp8_vs_bf16_acceptance.py   # ~8 min on 2 cores
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from eagle3_assets.lib.checkpoint.drafter_io import read_drafter, write_vllm_drafter
from eagle3_assets.lib.core.target import TargetShape
from eagle3_assets.lib.evaluation.acceptance import Acceptance, measure_acceptance
from eagle3_assets.lib.generation.conversations import load_conversations
from eagle3_assets.lib.hidden_states.extract import (
    ExtractionSettings,
    LayerSelection,
    extract_batch,
)
from eagle3_assets.lib.hidden_states.hf_backend import HFTarget
from eagle3_assets.lib.hidden_states.shard_format import ShardFormat
from eagle3_assets.lib.hidden_states.token_sequences import build_sequences
from eagle3_assets.lib.serving.vllm_launcher import start, stop, wait_ready, with_eagle3_drafter
from eagle3_assets.lib.training.train_drafter import RunConfig, train
from eagle3_assets.localdev.greedy import greedy_generation_rows
from eagle3_assets.localdev.hub import train_world_drafter
from eagle3_assets.localdev.miniature import SERVED_TARGET_NAME, miniature_server
from eagle3_assets.localdev.world import build_world

REPO = Path(__file__).resolve().parents[1]
LAYERS = LayerSelection(aux=(3, 5, 6), final=8, source="the world drafter's")
SAMPLES, MAX_NEW_TOKENS, STEPS, DRAFT_TOKENS = 192, 96, 200, 3


def serve_and_measure(world, drafter: Path, run_dir: Path, port: int, prompts) -> Acceptance:
    spec = miniature_server(world.target_v2, run_dir, port, SERVED_TARGET_NAME)
    spec = with_eagle3_drafter(spec, drafter, DRAFT_TOKENS)
    start(spec)
    try:
        wait_ready(spec, timeout_s=600)
        return measure_acceptance(spec.base_url, SERVED_TARGET_NAME, prompts, MAX_NEW_TOKENS)
    finally:
        stop(spec.run_dir, grace_s=30)


def main() -> None:
    world = build_world(REPO / "data" / "world", "demo", log=print)
    warm = train_world_drafter(world, draft_vocab_size=1024)
    rows = greedy_generation_rows(world.target_v2, world.prompts, SAMPLES, MAX_NEW_TOKENS)
    sequences = build_sequences(rows, AutoTokenizer.from_pretrained(world.target_v2))
    prompts = [list(c.messages) for c in load_conversations(world.heldout_prompts)]
    results: dict[str, Acceptance] = {}
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        checkpoint = read_drafter(warm, TargetShape.from_config(world.target_v2))
        drafters = {
            "warm start (the world's K2 drafter)": write_vllm_drafter(
                work / "warm-vllm", checkpoint.config, checkpoint.tensors, LAYERS.aux
            )
        }
        for name in ("bf16+bf16", "fp8+fp8"):
            extract_batch(
                sequences,
                work / name / "hidden_states",
                lambda: HFTarget(world.target_v2, LAYERS.ids, dtype="float32", device="cpu"),
                LAYERS,
                128,
                ExtractionSettings(ShardFormat.parse(name)),
                {"target": "target-v2"},
            )
            run = RunConfig(
                batch_dirs=[str(work / name / "hidden_states")],
                warm_start=str(warm),
                target=str(world.target_v2),
                out_dir=str(work / name / "run"),
                steps=STEPS,
                lr=1e-3,
                warmup_ratio=0.05,
            )
            drafters[f"finetuned on {name} shards"] = train(run).export
        for index, (name, drafter) in enumerate(drafters.items()):
            results[name] = serve_and_measure(
                world, drafter, work / f"server-{index}", 8200 + index, prompts
            )
    print(report(results, len(sequences), len(prompts)))


def report(results: dict[str, Acceptance], samples: int, prompts: int) -> str:
    lines = [
        f"Finetuning: {samples} greedy answers of target-v2, {STEPS} steps, batch 4, TTT 7, "
        f"lr 1e-3, same seed. Serving: target-v2 + drafter, {DRAFT_TOKENS} speculative tokens, "
        f"{prompts} held-out prompts, greedy, max {MAX_NEW_TOKENS} tokens.",
        "",
        "| drafter | mean acceptance length | per position | accepted / drafted |",
        "| --- | --- | --- | --- |",
    ]
    for name, result in results.items():
        positions = ", ".join(f"{p:.3f}" for p in result.per_position)
        lines.append(
            f"| {name} | {result.mean_length:.3f} | {positions} | "
            f"{result.accepted:.0f} / {result.draft_tokens:.0f} |"
        )
    bf16 = results["finetuned on bf16+bf16 shards"].mean_length
    fp8 = results["finetuned on fp8+fp8 shards"].mean_length
    lines += ["", f"fp8 vs bf16: {(fp8 - bf16) / bf16:+.2%} of mean acceptance length."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
