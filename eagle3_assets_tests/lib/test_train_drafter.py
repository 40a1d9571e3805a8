"""Training the drafter on real shards of the test-size target: the loss falls, a SIGINT
checkpoints, a resumed run follows the uninterrupted one, two gloo ranks match one process,
the warm start's vocab maps survive bit for bit, and bad inputs fail before training."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from eagle3_assets.lib.hidden_capture import HFTarget
from eagle3_assets.lib.hidden_states import ExtractionSettings, LayerSelection, extract_batch
from eagle3_assets.lib.shard_format import ShardFormat
from eagle3_assets.lib.token_sequences import build_sequences
from eagle3_assets.lib.train_drafter import Interrupted, RunConfig, train
from eagle3_assets.localdev.greedy import greedy_generation_rows
from eagle3_assets.localdev.hub import make_untrained_drafter

REPO = Path(__file__).resolve().parents[2]
LAYERS = LayerSelection(aux=(2, 4, 5), final=8, source="test")


@pytest.fixture(scope="module")
def corpus(test_world, tmp_path_factory) -> dict[str, Path]:
    """Two batches of hidden states (24 greedy answers of target-v2) and an untrained drafter."""
    root = tmp_path_factory.mktemp("training")
    rows = greedy_generation_rows(test_world.target_v2, test_world.prompts, 24, max_new_tokens=40)
    sequences, _ = build_sequences(rows, AutoTokenizer.from_pretrained(test_world.target_v2))
    for name, part in (("batch-00000", sequences[:12]), ("batch-00001", sequences[12:])):
        extract_batch(
            part,
            root / "hidden_states" / name,
            lambda: HFTarget(test_world.target_v2, LAYERS.ids, dtype="float32", device="cpu"),
            LAYERS,
            64,
            ExtractionSettings(ShardFormat("bf16", "bf16"), shard_bytes=20_000),
            {},
        )
    drafter = make_untrained_drafter(test_world.target_v2, root / "warm", 256, seed=0)
    return {"root": root, "drafter": drafter, "target": test_world.target_v2}


def config(corpus, out_dir: Path, **overrides) -> RunConfig:
    settings = {
        "batch_dirs": [str(p) for p in sorted((corpus["root"] / "hidden_states").iterdir())],
        "warm_start": str(corpus["drafter"]),
        "target": str(corpus["target"]),
        "out_dir": str(out_dir),
        "steps": 12,
        "batch_size": 4,
        "ttt_length": 3,
        "lr": 1e-2,
        "warmup_ratio": 0.1,
        "checkpoint_every": 100,
    }
    return RunConfig(**(settings | overrides))


def losses(history: list[dict]) -> list[float]:
    return [round(m["loss"], 5) for m in history]


def test_loss_falls_and_the_warm_start_vocab_survives(corpus, tmp_path):
    result = train(config(corpus, tmp_path, steps=60))
    history = [m["loss"] for m in result.history]
    first, last = sum(history[:5]) / 5, sum(history[-5:]) / 5
    assert last < 0.8 * first, f"loss {first:.3f} -> {last:.3f}"
    accuracy = [m["accuracy"] for m in result.history]  # per TTT position
    assert len(accuracy[0]) == 3 and max(accuracy[0]) < 0.1 and accuracy[-1][0] > 0.4
    exported = load_file(result.export / "model.safetensors")
    warm = load_file(corpus["drafter"] / "model.safetensors")
    assert torch.equal(exported["d2t"], warm["d2t"]) and torch.equal(exported["t2d"], warm["t2d"])
    assert not torch.equal(exported["fc.weight"], warm["fc.weight"])  # it did train
    exported_config = json.loads((result.export / "config.json").read_text())
    assert exported_config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]


def test_sigint_checkpoints_and_the_resumed_run_follows_the_uninterrupted_one(corpus, tmp_path):
    straight = train(config(corpus, tmp_path / "straight", steps=8))

    def interrupt_after_three(metrics: dict) -> None:
        if metrics["step"] == 3:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(Interrupted, match="checkpoint at step 3"):
        train(config(corpus, tmp_path / "resumed", steps=8), report=interrupt_after_three)
    latest = tmp_path / "resumed" / "checkpoints" / "latest"
    assert latest.read_text() == "step-0000003"
    resumed = train(config(corpus, tmp_path / "resumed", steps=8))
    assert [m["step"] for m in resumed.history] == list(range(1, 9))
    assert losses(resumed.history) == losses(straight.history)


def test_two_gloo_ranks_match_one_process(corpus, tmp_path):
    single = train(config(corpus, tmp_path / "single", steps=5, shuffle_buffer=1))
    run_file = tmp_path / "run.json"
    two = config(corpus, tmp_path / "ranks", steps=5, shuffle_buffer=1, batch_size=2)
    run_file.write_text(json.dumps(dataclasses.asdict(two)))
    torchrun = Path(sys.executable).parent / "torchrun"
    output = subprocess.run(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "eagle3_assets.lib.train_drafter",
            str(run_file),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert output.returncode == 0, output.stderr[-3000:]
    reported = [json.loads(line) for line in output.stdout.splitlines() if line.startswith("{")]
    steps = [m for m in reported if "step" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5]
    for ours, theirs in zip(steps, single.history, strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-4)


def test_shards_at_other_layers_fail_before_training(corpus, tmp_path):
    other = tmp_path / "other"
    manifest_dir = corpus["root"] / "hidden_states" / "batch-00000"
    other.mkdir()
    for path in manifest_dir.iterdir():
        (other / path.name).write_bytes(path.read_bytes())
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["layer_ids"]["aux"] = [1, 3, 4]
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"hold aux layers \[1, 3, 4\].*reads \[2, 4, 5\]"):
        train(config(corpus, tmp_path / "out", batch_dirs=[str(other)]))
    assert not (tmp_path / "out" / "checkpoints").exists()
