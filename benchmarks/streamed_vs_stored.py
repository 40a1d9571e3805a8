"""Streamed against stored hidden states on the same batches, side by side in one run: peak
bytes on disk, training tokens/s, and the drafters themselves (weights compared bit for bit,
held-out TTT accuracy, mean acceptance length served by real vLLM).

Two extraction settings: one sample per forward (`batch_tokens=1`, where a streamed drafter
can equal a stored one bit for bit) and the default batching (16,384 tokens per forward),
where the producer's forwards group other samples than the stored shards' and padding moves
the states' last bits. The demo world, hf backend in fp32 on the CPU, fp8+fp8 shards.

    .venv/bin/python benchmarks/streamed_vs_stored.py    # ~25 min on 2 cores
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import torch
from fp8_vs_bf16_acceptance import serve_and_measure
from safetensors.torch import load_file
from transformers import AutoTokenizer

from eagle3_assets.lib.core.atomic_files import file_sha256
from eagle3_assets.lib.generation.conversations import load_conversations
from eagle3_assets.lib.hidden_states.backends import drafter_layers
from eagle3_assets.lib.hidden_states.extract import extract_batch, human_bytes
from eagle3_assets.lib.hidden_states.hf_backend import HFTarget
from eagle3_assets.lib.hidden_states.settings import HiddenStatesSettings
from eagle3_assets.lib.hidden_states.streaming import StreamSpec, write_sequences
from eagle3_assets.lib.hidden_states.token_sequences import build_sequences
from eagle3_assets.lib.training.train_drafter import RunConfig, heldout_accuracy, train
from eagle3_assets.localdev.greedy import greedy_generation_rows
from eagle3_assets.localdev.hub import train_world_drafter
from eagle3_assets.localdev.world import build_world

REPO = Path(__file__).resolve().parents[1]
SAMPLES, MAX_NEW_TOKENS, STEPS, HOLDOUT = 192, 96, 200, 0.1
WINDOW_MB = 2.0
BATCHING = {"one sample per forward": 1, "default batching": HiddenStatesSettings().batch_tokens}


def main() -> None:
    world = build_world(REPO / "data" / "world", "demo", log=print)
    warm = train_world_drafter(world, draft_vocab_size=1024)
    target = world.target_v2
    hidden = json.loads((target / "config.json").read_text())
    layers = drafter_layers(warm, hidden["num_hidden_layers"])
    rows = greedy_generation_rows(target, world.prompts, SAMPLES, MAX_NEW_TOKENS)
    sequences = build_sequences(rows, AutoTokenizer.from_pretrained(target))
    half = len(sequences) // 2
    batches = {"batch-00000": sequences[:half], "batch-00001": sequences[half:]}
    prompts = [list(c.messages) for c in load_conversations(world.heldout_prompts)]
    rows_out, port = [], 8300
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        measured: dict[str, object] = {}
        for label, batch_tokens in BATCHING.items():
            settings = HiddenStatesSettings(
                dtype="float32",
                device="cpu",
                batch_tokens=batch_tokens,
                mode="streamed",
                stream_window_mb=WINDOW_MB,
            )
            root = work / label.replace(" ", "-")
            stored_dirs, extraction_s = {}, 0.0
            for name, part in batches.items():
                extraction_s += extract_batch(
                    part,
                    root / "hidden_states" / name,
                    lambda: HFTarget(target, layers.ids, "float32", "cpu"),
                    layers,
                    hidden["hidden_size"],
                    settings.extraction(),
                    {},
                ).seconds
                stored_dirs[name] = str(root / "hidden_states" / name)
            spec = StreamSpec(
                sequences=str(root / "sequences.safetensors"),
                spool=str(root / "streamed" / "stream" / "spool"),
                settings=settings.model_dump(),
                layers={"aux": list(layers.aux), "final": layers.final, "source": layers.source},
                hidden_size=hidden["hidden_size"],
                target=str(target),
                trust_remote_code=False,
                server_dir=str(root / "server"),
            )
            write_sequences(Path(spec.sequences), batches)
            common = {
                "warm_start": str(warm),
                "target": str(target),
                "steps": STEPS,
                "lr": 1e-3,
                "warmup_ratio": 0.05,
                "holdout_fraction": HOLDOUT,
            }
            stored = train(
                RunConfig(
                    batch_dirs=list(stored_dirs.values()), out_dir=str(root / "stored"), **common
                )
            )
            streamed = train(
                RunConfig(
                    batch_dirs=[],
                    stream=dataclasses.asdict(spec),
                    out_dir=str(root / "streamed"),
                    **common,
                )
            )
            stored_bytes = {
                name: json.loads((Path(d) / "manifest.json").read_text())["totals"]["bytes"]
                for name, d in stored_dirs.items()
            }
            weights = [load_file(r.export / "model.safetensors") for r in (stored, streamed)]
            differences = [
                float((weights[0][n].float() - weights[1][n].float()).abs().max())
                for n in weights[0]
                if weights[0][n].is_floating_point()
            ]
            same_file = file_sha256(stored.export / "model.safetensors") == file_sha256(
                streamed.export / "model.safetensors"
            )
            accuracy = {
                name: heldout_accuracy(
                    result.export, target, list(stored_dirs.values()), HOLDOUT, 7
                )["accuracy"]
                for name, result in (("stored", stored), ("streamed", streamed))
            }
            acceptance = {}
            for name, result in (("stored", stored), ("streamed", streamed)):
                if name == "streamed" and same_file:
                    acceptance[name] = acceptance["stored"]  # the same bytes: served once
                    continue
                acceptance[name] = serve_and_measure(
                    world, result.export, root / f"server-{name}", port, prompts
                )
                port += 1
            last = streamed.history[-1]
            measured[label] = {
                "stored_gb": sum(stored_bytes.values()),
                "stored_first_batch": stored_bytes["batch-00000"],
                "peak": last["spool_peak_bytes"],
                "window": last["spool_window_bytes"],
                "stored_tok_s": stored.tokens / stored.seconds,
                "streamed_tok_s": streamed.tokens / streamed.seconds,
                "trainer_waited_s": last["trainer_waited_s"],
                "producer_waited_s": last["producer_waited_s"],
                "extraction_s": extraction_s,
                "seconds": (stored.seconds, streamed.seconds),
                "bit_identical": all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0]),
                "max_weight_difference": max(differences),
                "accuracy": accuracy,
                "acceptance": {k: (v.mean_length, v.per_position) for k, v in acceptance.items()},
            }
            if label == "default batching":  # streamed peak with half the data: the same bound
                half_spec = dataclasses.replace(
                    spec,
                    sequences=str(root / "half.safetensors"),
                    spool=str(root / "half" / "stream" / "spool"),
                )
                write_sequences(Path(half_spec.sequences), {"batch-00000": batches["batch-00000"]})
                half_run = train(
                    RunConfig(
                        batch_dirs=[],
                        stream=dataclasses.asdict(half_spec),
                        out_dir=str(root / "half"),
                        **(common | {"steps": 50}),
                    )
                )
                measured[label]["half_peak"] = half_run.history[-1]["spool_peak_bytes"]
        rows_out.append(report(measured, len(sequences), len(prompts)))
    print("\n".join(rows_out))


def report(measured: dict, samples: int, prompts: int) -> str:
    lines = [
        f"{samples} greedy answers of demo target-v2 in two batches, fp8+fp8, hf backend fp32 "
        f"on the CPU; {STEPS} steps, batch 4, TTT 7, one rank; streamed window "
        f"{WINDOW_MB:g} MB; acceptance: {prompts} held-out prompts, 3 speculative tokens.",
        "",
        "| extraction | disk: stored (96 / 192 samples) | disk: streamed peak (96 / 192) "
        "| train tokens/s stored / streamed | end to end: stored (extract + train) / streamed "
        "| waited: trainer / producer | weights "
        "| held-out accuracy stored / streamed (pos 0) | acceptance stored / streamed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, m in measured.items():
        half_peak = human_bytes(m["half_peak"]) if "half_peak" in m else "-"
        weights = (
            "bit-identical"
            if m["bit_identical"]
            else f"differ, max {m['max_weight_difference']:.1e}"
        )
        stored_acc, streamed_acc = m["accuracy"]["stored"][0], m["accuracy"]["streamed"][0]
        stored_len, streamed_len = m["acceptance"]["stored"][0], m["acceptance"]["streamed"][0]
        lines.append(
            f"| {label} | {human_bytes(m['stored_first_batch'])} / {human_bytes(m['stored_gb'])} "
            f"| {half_peak} / {human_bytes(m['peak'])} (window {human_bytes(m['window'])}) "
            f"| {m['stored_tok_s']:,.0f} / {m['streamed_tok_s']:,.0f} "
            f"({m['streamed_tok_s'] / m['stored_tok_s']:.2f}x) "
            f"| {m['extraction_s']:.0f} + {m['seconds'][0]:.0f} = "
            f"{m['extraction_s'] + m['seconds'][0]:.0f} s / {m['seconds'][1]:.0f} s "
            f"| {m['trainer_waited_s']:.1f} s / {m['producer_waited_s']:.1f} s | {weights} "
            f"| {stored_acc:.4f} / {streamed_acc:.4f} | {stored_len:.3f} / {streamed_len:.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
