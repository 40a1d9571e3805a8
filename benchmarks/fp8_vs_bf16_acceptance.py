"""Does the compact hidden-state format cost acceptance? Two drafters finetuned from the same
warm start on the same samples for the same steps, one on bf16+bf16 shards and one on the
default fp8+fp8, each then served by real vLLM (CPU build) as target-v2's eagle3 speculator
on the held-out prompts; the warm start itself is measured too. Goal: fp8 costs no more than
2% of mean acceptance length.

    .venv/bin/python benchmarks/fp8_vs_bf16_acceptance.py   # ~8 min on 2 cores
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
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
from eagle3_assets.lib.hidden_states.token_sequences import TokenSequence, build_sequences
from eagle3_assets.lib.serving.vllm_launcher import start, stop, wait_ready, with_eagle3_drafter
from eagle3_assets.lib.training.train_drafter import RunConfig, train
from eagle3_assets.localdev.greedy import greedy_generation_rows
from eagle3_assets.localdev.hub import train_world_drafter
from eagle3_assets.localdev.miniature import SERVED_TARGET_NAME, miniature_server
from eagle3_assets.localdev.world import World, build_world

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


@dataclass(frozen=True)
class Story:
    """The finetuning story in miniature: the demo world, its K2 drafter (the warm start),
    target-v2's greedy answers to train on and the held-out prompts to serve."""

    world: World
    warm: Path
    sequences: list[TokenSequence]
    prompts: list[list[dict]]

    @classmethod
    def build(cls) -> Story:
        world = build_world(REPO / "data" / "world", "demo", log=print)
        warm = train_world_drafter(world, draft_vocab_size=1024)
        rows = greedy_generation_rows(world.target_v2, world.prompts, SAMPLES, MAX_NEW_TOKENS)
        sequences = build_sequences(rows, AutoTokenizer.from_pretrained(world.target_v2))
        prompts = [list(c.messages) for c in load_conversations(world.heldout_prompts)]
        return cls(world, warm, sequences, prompts)

    def warm_start_export(self, out_dir: Path) -> Path:
        """The warm start as vLLM loads it, at the layers it was trained on."""
        checkpoint = read_drafter(self.warm, TargetShape.from_config(self.world.target_v2))
        return write_vllm_drafter(out_dir, checkpoint.config, checkpoint.tensors, LAYERS.aux)

    def hidden_states(self, out_dir: Path, shard_format: str) -> Path:
        """target-v2's states of the answers, extracted with the hf backend (fp32)."""
        target = self.world.target_v2
        extract_batch(
            self.sequences,
            out_dir,
            lambda: HFTarget(target, LAYERS.ids, dtype="float32", device="cpu"),
            LAYERS,
            128,
            ExtractionSettings(ShardFormat.parse(shard_format)),
            {"target": "target-v2"},
        )
        return out_dir

    def finetuning(self, batch_dir: Path, out_dir: Path) -> RunConfig:
        """From the warm start, STEPS steps at lr 1e-3 (warmup 5%, cosine), batch 4, TTT 7."""
        return RunConfig(
            batch_dirs=[str(batch_dir)],
            warm_start=str(self.warm),
            target=str(self.world.target_v2),
            out_dir=str(out_dir),
            steps=STEPS,
            lr=1e-3,
            warmup_ratio=0.05,
        )


def main() -> None:
    story = Story.build()
    results: dict[str, Acceptance] = {}
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        drafters = {"warm start (the world's K2 drafter)": story.warm_start_export(work / "warm")}
        for name in ("bf16+bf16", "fp8+fp8"):
            states = story.hidden_states(work / name / "hidden_states", name)
            run = story.finetuning(states, work / name / "run")
            drafters[f"finetuned on {name} shards"] = train(run).export
        for index, (name, drafter) in enumerate(drafters.items()):
            results[name] = serve_and_measure(
                story.world, drafter, work / f"server-{index}", 8200 + index, story.prompts
            )
    print(report(results, len(story.sequences), len(story.prompts)))


def acceptance_cells(result: Acceptance) -> str:
    """mean acceptance length | per position | accepted / drafted, as table cells."""
    positions = ", ".join(f"{p:.3f}" for p in result.per_position)
    return (
        f"{result.mean_length:.3f} | {positions} | "
        f"{result.accepted:.0f} / {result.draft_tokens:.0f}"
    )


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
        lines.append(f"| {name} | {acceptance_cells(result)} |")
    bf16 = results["finetuned on bf16+bf16 shards"].mean_length
    fp8 = results["finetuned on fp8+fp8 shards"].mean_length
    lines += ["", f"fp8 vs bf16: {(fp8 - bf16) / bf16:+.2%} of mean acceptance length."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
