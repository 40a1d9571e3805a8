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

from eagle3_assets.lib.core.splits import held_out
from eagle3_assets.lib.hidden_states.extract import (
    ExtractionSettings,
    LayerSelection,
    extract_batch,
)
from eagle3_assets.lib.hidden_states.hf_backend import HFTarget
from eagle3_assets.lib.hidden_states.shard_format import ShardFormat
from eagle3_assets.lib.hidden_states.shard_reader import ShardReader
from eagle3_assets.lib.hidden_states.token_sequences import build_sequences
from eagle3_assets.lib.training.train_drafter import Interrupted, RunConfig, heldout_accuracy, train
from eagle3_assets.lib.training.ttt import TargetHead, derive_vocab_maps, teacher
from eagle3_assets.localdev.greedy import greedy_generation_rows
from eagle3_assets.localdev.hub import make_untrained_drafter

REPO = Path(__file__).resolve().parents[2]
LAYERS = LayerSelection(aux=(2, 4, 5), final=8, source="test")


@pytest.fixture(scope="module")
def corpus(test_world, tmp_path_factory) -> dict[str, Path]:
    """Two batches of hidden states (24 greedy answers of target-v2) and an untrained drafter."""
    root = tmp_path_factory.mktemp("training")
    rows = greedy_generation_rows(test_world.target_v2, test_world.prompts, 24, max_new_tokens=40)
    sequences = build_sequences(rows, AutoTokenizer.from_pretrained(test_world.target_v2))
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
    # served in bf16 by default (vLLM casts to the target's dtype): half the bytes of fp32
    assert exported_config["dtype"] == "bfloat16"
    assert {t.dtype for n, t in exported.items() if n not in ("d2t", "t2d")} == {torch.bfloat16}


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


def torchrun(run: RunConfig, run_file: Path, **popen) -> subprocess.Popen:
    """Two gloo ranks of the training entry point, as the eagle3_drafter asset starts them."""
    run_file.write_text(json.dumps(dataclasses.asdict(run)))
    command = [str(Path(sys.executable).parent / "torchrun"), "--standalone"]
    command += [
        "--nproc-per-node",
        "2",
        "-m",
        "eagle3_assets.lib.training.train_drafter",
        str(run_file),
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, cwd=REPO, text=True, env=environment, **popen)


def test_two_gloo_ranks_match_one_process(corpus, tmp_path):
    single = train(config(corpus, tmp_path / "single", steps=5, shuffle_buffer=1))
    two = config(corpus, tmp_path / "ranks", steps=5, shuffle_buffer=1, batch_size=2)
    ranks = torchrun(two, tmp_path / "run.json", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = ranks.communicate(timeout=600)
    assert ranks.returncode == 0, stderr[-3000:]
    reported = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    steps = [m for m in reported if "step" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5]
    for ours, theirs in zip(steps, single.history, strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-4)
        assert ours["step_losses"] == pytest.approx(theirs["step_losses"], rel=1e-4)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)  # averaged
        assert ours["accuracy"] == theirs["accuracy"]  # hits and counts summed over ranks
        assert ours["tokens"] == theirs["tokens"]
    # the averaged gradients moved every weight as one process did; the checkpoint and the
    # export hold the drafter's own tensor names, never a data-parallel wrapper's
    checkpoint = tmp_path / "ranks" / "checkpoints" / "step-0000005"
    alone = tmp_path / "single" / "checkpoints" / "step-0000005"
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert sorted(load_file(checkpoint / name)) == sorted(load_file(alone / name))
    exported = load_file(tmp_path / "ranks" / "export" / "model.safetensors")
    assert sorted(exported) == sorted(load_file(single.export / "model.safetensors"))
    # gloo sums the gradients in another order than one process; AdamW's m / sqrt(v) turns
    # that rounding into a visible move only where a gradient is near zero (1.2e-5 seen on
    # an AMD EPYC, 1 element of 16,384; lr 1e-2). The fp32 weights: the bf16 export rounds
    # such a move to a whole bf16 step where it crosses a rounding boundary.
    weights = load_file(checkpoint / "model.safetensors")
    for name, tensor in load_file(alone / "model.safetensors").items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-4, atol=5e-5, msg=name)
    assert not torch.equal(
        weights["fc.weight"], load_file(corpus["drafter"] / "model.safetensors")["fc.weight"]
    )


def test_sigint_to_torchrun_checkpoints_every_rank_then_resumes(corpus, tmp_path):
    """What a Dagster cancel does: SIGINT to torchrun, which passes a signal to its ranks."""
    run = config(corpus, tmp_path / "out", steps=400, batch_size=2, checkpoint_every=1000)
    ranks = torchrun(run, tmp_path / "run.json", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for line in ranks.stdout:
        if line.startswith("{") and json.loads(line).get("step", 0) >= 3:
            break
    ranks.send_signal(signal.SIGINT)
    _, stderr = ranks.communicate(timeout=120)
    assert ranks.returncode != 0
    latest = tmp_path / "out" / "checkpoints" / "latest"
    assert latest.exists(), stderr[-3000:]
    state = json.loads((latest.parent / latest.read_text() / "state.json").read_text())
    assert 3 <= state["step"] < 400 and len(state["ranks"]) == 2  # both ranks' positions
    again = dataclasses.replace(run, steps=state["step"] + 2)
    resumed = torchrun(again, tmp_path / "run.json", stdout=subprocess.PIPE)
    stdout, _ = resumed.communicate(timeout=600)
    steps = [json.loads(line)["step"] for line in stdout.splitlines() if line.startswith('{"step"')]
    assert resumed.returncode == 0 and steps == [state["step"] + 1, state["step"] + 2]


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


def test_rederiving_the_vocab_is_explicit_and_moves_lm_head_rows(corpus, tmp_path):
    run = config(corpus, tmp_path, steps=2, lr=1e-9, rederive_vocab=True, export_dtype="float32")
    result = train(run)
    exported = load_file(result.export / "model.safetensors")
    warm = load_file(corpus["drafter"] / "model.safetensors")
    reader = ShardReader([Path(d) for d in config(corpus, tmp_path).batch_dirs])
    d2t, t2d = derive_vocab_maps(reader.response_token_counts(1024), 256)
    assert torch.equal(exported["d2t"], d2t) and torch.equal(exported["t2d"], t2d)
    assert not torch.equal(exported["t2d"], warm["t2d"])
    # a target token in both vocabs keeps its lm_head row (lr ~0: the rows barely move)
    old = {int(t): r for r, t in enumerate(torch.arange(256) + warm["d2t"])}
    for row, token in enumerate((torch.arange(256) + d2t).tolist()):
        if token in old:
            torch.testing.assert_close(
                exported["lm_head.weight"][row],
                warm["lm_head.weight"][old[token]],
                atol=1e-6,
                rtol=0,
            )
        else:
            assert exported["lm_head.weight"][row].abs().max() < 1e-6


def test_vocab_maps_from_counts():
    counts = torch.tensor([0, 5, 5, 9, 0, 1, 0, 0])
    d2t, t2d = derive_vocab_maps(counts, 3)
    assert t2d.nonzero().flatten().tolist() == [1, 2, 3]  # most frequent, ties to lower ids
    assert (torch.arange(3) + d2t).tolist() == [1, 2, 3]
    _, padded = derive_vocab_maps(counts, 6)  # only 4 distinct tokens: padded with low ids
    assert padded.nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5]


def test_top_k_teacher_over_the_whole_vocab_equals_the_state_teacher(corpus):
    head = TargetHead(corpus["target"])
    batch_dir = sorted((corpus["root"] / "hidden_states").iterdir())[0]
    sample = next(ShardReader([batch_dir]).samples())
    t2d = load_file(corpus["drafter"] / "model.safetensors")["t2d"]
    logits = head.logits(sample.final)
    values, ids = logits.sort(dim=-1, descending=True)
    as_topk = dataclasses.replace(sample, final=None, topk_logits=values, topk_ids=ids)
    probs, usable = teacher(sample, head, t2d)
    top_probs, top_usable = teacher(as_topk, head, t2d)
    torch.testing.assert_close(top_probs, probs, rtol=1e-5, atol=1e-6)
    assert torch.equal(top_usable, usable) and usable.any()
    # a short top-k keeps fewer draft entries, renormalized, and the same argmax mask
    short_probs, short_usable = teacher(
        dataclasses.replace(as_topk, topk_logits=values[:, :8], topk_ids=ids[:, :8]), head, t2d
    )
    assert torch.equal(short_usable, usable)
    assert ((short_probs > 0).sum(-1) <= 8).all()
    torch.testing.assert_close(short_probs.sum(-1), torch.ones(len(short_probs)))


def test_from_scratch_the_vocab_comes_from_the_responses(corpus, tmp_path):
    run = config(corpus, tmp_path, warm_start=None, draft_vocab_size=256, steps=30)
    result = train(run)
    history = [m["loss"] for m in result.history]
    assert sum(history[-5:]) < 0.8 * sum(history[:5])
    exported = load_file(result.export / "model.safetensors")
    reader = ShardReader([Path(d) for d in run.batch_dirs])
    d2t, t2d = derive_vocab_maps(reader.response_token_counts(1024), 256)
    assert torch.equal(exported["d2t"], d2t) and torch.equal(exported["t2d"], t2d)
    exported_config = json.loads((result.export / "config.json").read_text())
    assert exported_config["hidden_size"] == 64 and exported_config["draft_vocab_size"] == 256
    assert exported_config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # the shards'


def test_held_out_samples_are_never_trained_on_and_score_the_drafter(corpus, tmp_path):
    batch_dirs = [Path(d) for d in config(corpus, tmp_path).batch_dirs]
    every = {s.sample_id for s in ShardReader(batch_dirs, shuffle_buffer=1).samples()}
    fraction = 0.25
    held = {s for s in every if held_out(s, fraction)}
    assert 0 < len(held) < len(every)  # 24 samples: both splits non-empty
    trained = ShardReader(batch_dirs, select=lambda s: not held_out(s, fraction))
    assert {s.sample_id for s in trained.samples()} == every - held

    untrained = heldout_accuracy(
        corpus["drafter"], corpus["target"], [str(d) for d in batch_dirs], fraction, 3
    )
    assert untrained["samples"] == len(held) and untrained["tokens"] > 0
    result = train(config(corpus, tmp_path, steps=40, holdout_fraction=fraction))
    finetuned = heldout_accuracy(
        result.export, corpus["target"], [str(d) for d in batch_dirs], fraction, 3
    )
    assert finetuned["tokens"] == untrained["tokens"]  # the same held-out positions
    assert len(finetuned["accuracy"]) == 3
    assert finetuned["accuracy"][0] > untrained["accuracy"][0] + 0.2, (untrained, finetuned)
