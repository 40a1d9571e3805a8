"""Streamed hidden states (lib/hidden_states/streaming.py) against stored shards of the same
batches: the same order, the same drafter bit for bit (hf backend, fp32, one sample per
forward), a spool that never holds more than its window, a window too small refused by size,
and kill -9 of the producer, a rank or the whole run at seeded random steps resuming to the
uninterrupted run's record and weights."""

import contextlib
import dataclasses
import itertools
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from eagle3_assets.lib.core.splits import held_out
from eagle3_assets.lib.core.target import TargetShape
from eagle3_assets.lib.hidden_states.extract import LayerSelection, extract_batch, human_bytes
from eagle3_assets.lib.hidden_states.hf_backend import HFTarget
from eagle3_assets.lib.hidden_states.settings import HiddenStatesSettings
from eagle3_assets.lib.hidden_states.shard_reader import ShardReader
from eagle3_assets.lib.hidden_states.streaming import (
    StreamedSamples,
    StreamSpec,
    window_error,
    write_sequences,
)
from eagle3_assets.lib.hidden_states.token_sequences import build_sequences
from eagle3_assets.lib.training.train_drafter import RunConfig, train
from eagle3_assets.localdev.greedy import greedy_generation_rows
from eagle3_assets.localdev.hub import make_untrained_drafter
from eagle3_assets_tests.lib.training.test_train_drafter import torchrun

REPO = Path(__file__).resolve().parents[3]
LAYERS = {"aux": [2, 4, 5], "final": 8, "source": "test"}  # both worlds' targets: 8 layers
# fp32 states and one sample per forward (a padded batch changes a state's last bits); each
# world sizes its shards (~2 samples, so each batch plans several) and window (~3 samples)
SETTINGS = HiddenStatesSettings(
    format="bf16+bf16", dtype="float32", device="cpu", batch_tokens=1, mode="streamed"
)


def build_stream_world(world, root: Path) -> dict:
    """Two batches of 12 greedy answers of the world's target-v2: stored as shards, and as a
    streamed run's sequences; an untrained warm start."""
    spec = world.spec
    target, remote = world.target_v2, spec.trust_remote_code
    rows = greedy_generation_rows(
        target,
        world.prompts,
        24,
        max_new_tokens=40,
        chat_template_kwargs=spec.chat_template_kwargs,
        trust_remote_code=remote,
    )
    tokenizer = AutoTokenizer.from_pretrained(target, trust_remote_code=remote)
    sequences = build_sequences(rows, tokenizer, spec.chat_template_kwargs)
    hidden = TargetShape.from_config(target).hidden_size
    fmt = SETTINGS.extraction().format
    largest = max(fmt.estimate(len(s), len(s.teacher_positions), 1, hidden, 3) for s in sequences)
    settings = SETTINGS.model_copy(
        update={"shard_mb": 2.5 * largest / 2**20, "stream_window_mb": 3 * largest / 2**20}
    )
    batches = {"batch-00000": sequences[:12], "batch-00001": sequences[12:]}
    layers = LayerSelection(tuple(LAYERS["aux"]), LAYERS["final"], LAYERS["source"])
    for name, part in batches.items():
        extract_batch(
            part,
            root / "hidden_states" / name,
            lambda: HFTarget(target, layers.ids, "float32", "cpu", trust_remote_code=remote),
            layers,
            hidden,
            settings.extraction(),
            {},
        )
    write_sequences(root / "sequences.safetensors", batches)
    return {
        "root": root,
        "sequences": sequences,
        "drafter": make_untrained_drafter(target, root / "warm", 256, seed=0),
        "target": target,
        "hidden_size": hidden,
        "trust_remote_code": remote,
        "settings": settings,
        "batch_dirs": [str(root / "hidden_states" / name) for name in batches],
    }


@pytest.fixture(scope="module")
def llama_stream(test_world, tmp_path_factory) -> dict:
    return build_stream_world(test_world, tmp_path_factory.mktemp("llama-stream"))


@pytest.fixture(scope="module")
def kimi_stream(kimi_world, tmp_path_factory) -> dict:
    """The Kimi world: a DeepSeek-V3 target (MLA, MoE) behind a remote-code tokenizer."""
    return build_stream_world(kimi_world, tmp_path_factory.mktemp("kimi-stream"))


def spec(world: dict, run_dir: Path) -> dict:
    return dataclasses.asdict(
        StreamSpec(
            sequences=str(world["root"] / "sequences.safetensors"),
            spool=str(run_dir / "stream" / "spool"),
            settings=world["settings"].model_dump(),
            layers=LAYERS,
            hidden_size=world["hidden_size"],
            target=str(world["target"]),
            trust_remote_code=world["trust_remote_code"],
            server_dir=str(run_dir / "vllm-extraction"),
        )
    )


def config(world: dict, out_dir: Path, streamed: bool, **overrides) -> RunConfig:
    settings = {
        "batch_dirs": [] if streamed else world["batch_dirs"],
        "stream": spec(world, out_dir) if streamed else None,
        "warm_start": str(world["drafter"]),
        "target": str(world["target"]),
        "out_dir": str(out_dir),
        "steps": 12,  # ~22 of 24 samples trained on, 4 per step: 2 epochs and a bit
        "batch_size": 4,
        "ttt_length": 3,
        "lr": 1e-2,
        "warmup_ratio": 0.1,
        "checkpoint_every": 100,
        "shuffle_buffer": 4,
        "holdout_fraction": 0.1,
    }
    return RunConfig(**(settings | overrides))


def record(out_dir: Path) -> dict[str, list]:
    return {
        path.name: [json.loads(line) for line in path.read_text().splitlines()]
        for path in sorted((out_dir / "consumed").iterdir())
    }


@pytest.mark.parametrize("world", ["llama", "kimi"])
def test_the_streamed_order_is_the_stored_order(world, request, tmp_path):
    stream_world = request.getfixturevalue(f"{world}_stream")
    for rank in (0, 1):
        stored = ShardReader(
            [Path(d) for d in stream_world["batch_dirs"]], seed=3, rank=rank, world_size=2
        )
        streamed = StreamedSamples(
            StreamSpec(**spec(stream_world, tmp_path)), seed=3, rank=rank, world_size=2
        )
        assert len(stored.shards) == len(streamed.shards) >= 4  # several shards per batch
        assert len(streamed) == len(stored) == 12
        for epoch in (0, 1):
            ids = [stored.shards[s][1] for s, _ in stored.order(epoch)]
            assert streamed.order(epoch) == stored.order(epoch) and ids
            stored_ids = [
                stored._file(stored.shards[s][0]).sample_ids[i] for s, i in stored.order(epoch)
            ]
            assert [streamed.sequence(s, i).sample_id for s, i in streamed.order(epoch)] == (
                stored_ids
            )
        vocab = TargetShape.from_config(stream_world["target"]).vocab_size
        counts = streamed.response_token_counts(vocab)
        assert torch.equal(counts, stored.response_token_counts(vocab)) and counts.sum() > 100


@pytest.mark.parametrize("world", ["llama", "kimi"])
def test_a_streamed_drafter_equals_the_stored_one_bit_for_bit(world, request, tmp_path):
    stream_world = request.getfixturevalue(f"{world}_stream")
    stored = train(config(stream_world, tmp_path / "stored", streamed=False))
    streamed = train(config(stream_world, tmp_path / "streamed", streamed=True))
    weights, expected = (load_file(r.export / "model.safetensors") for r in (streamed, stored))
    assert sorted(weights) == sorted(expected)
    assert all(torch.equal(weights[name], expected[name]) for name in expected)
    assert record(tmp_path / "streamed") == record(tmp_path / "stored")
    trained = [s.sample_id for s in stream_world["sequences"] if not held_out(s.sample_id, 0.1)]
    assert len(trained) < len(stream_world["sequences"])  # a held-out share left out, by id
    consumed = [
        tuple(p) for step in record(tmp_path / "streamed")["rank-0.jsonl"] for p in step["samples"]
    ]
    for epoch in (0, 1):  # each training sample exactly once per epoch
        assert sorted(i for e, i in consumed if e == epoch) == sorted(trained)
    assert len([i for e, i in consumed if e == 2]) == 12 * 4 - 2 * len(trained)
    last = streamed.history[-1]
    window = stream_world["settings"].window_bytes
    stored_bytes = sum(
        json.loads((Path(d) / "manifest.json").read_text())["totals"]["bytes"]
        for d in stream_world["batch_dirs"]
    )
    assert (
        last["spool_window_bytes"] == window and last["spool_peak_bytes"] <= window < stored_bytes
    )
    assert last["producer_tokens"] == last["tokens"]  # every token streamed once, none left
    spool = tmp_path / "streamed" / "stream" / "spool"
    assert list(spool.iterdir()) == []


def budget(stream_world: dict) -> int:
    """Padded tokens per step that fit the longest sample alone and two up to the median."""
    lengths = sorted(len(s) for s in stream_world["sequences"])
    return max(lengths[-1], 2 * lengths[len(lengths) // 2])


def test_a_token_budget_packs_each_step_greedily_streamed_as_stored(llama_stream, tmp_path):
    """Each step takes samples in order while count x longest fits the budget (batch_size
    caps the count); the producer sizes the steps it extracts ahead by the same rule."""
    tokens = budget(llama_stream)
    runs = {
        mode: train(
            config(llama_stream, tmp_path / mode, mode == "streamed", batch_size=3,
                   tokens_per_rank=tokens)
        )
        for mode in ("stored", "streamed")
    }  # fmt: skip
    assert record(tmp_path / "streamed") == record(tmp_path / "stored")
    weights, expected = (load_file(runs[m].export / "model.safetensors") for m in runs)
    assert all(torch.equal(weights[name], expected[name]) for name in expected)
    length = {s.sample_id: len(s) for s in llama_stream["sequences"]}
    steps = [
        [length[i] for _, i in step["samples"]]
        for step in record(tmp_path / "stored")["rank-0.jsonl"]
    ]
    assert all(len(taken) * max(taken) <= tokens for taken in steps)
    for taken, following in itertools.pairwise(steps):
        if len(taken) < 3:  # the cap not reached: the next sample would not have fitted
            assert (len(taken) + 1) * max([*taken, following[0]]) > tokens
    sizes = {len(taken) for taken in steps}
    assert min(sizes) == 1 and max(sizes) == 3  # the budget binds, and so does the cap
    history = runs["stored"].history
    assert [m["samples"] for m in history] == [len(taken) for taken in steps]
    assert [m["padded_tokens"] for m in history] == [len(t) * max(t) for t in steps]


def test_a_sample_longer_than_the_token_budget_fails_before_training(llama_stream, tmp_path):
    longest = max(len(s) for s in llama_stream["sequences"])
    run = config(llama_stream, tmp_path, False, tokens_per_rank=longest - 1)
    with pytest.raises(ValueError, match=f"longest sample's {longest} tokens, found {longest - 1}"):
        train(run)
    assert not (tmp_path / "checkpoints").exists()


def test_a_window_smaller_than_one_sample_is_refused_naming_both_sizes(llama_stream):
    sequences = llama_stream["sequences"]
    fmt = SETTINGS.extraction().format
    sizes = {
        s.sample_id: fmt.estimate(len(s), len(s.teacher_positions), 1, 64, 3) for s in sequences
    }
    largest = max(sizes, key=sizes.get)
    fits = SETTINGS.model_copy(update={"stream_window_mb": sizes[largest] / 2**20})
    assert window_error(fits, sequences, 64, 3) is None
    small = SETTINGS.model_copy(update={"stream_window_mb": (sizes[largest] - 1) / 2**20})
    message = window_error(small, sequences, 64, 3)
    assert message.startswith(
        f"stream_window_mb: the window ({human_bytes(sizes[largest] - 1)}) is smaller than one "
        f"sample: {largest} ("
    )


def processes(torchrun: subprocess.Popen) -> dict[str, psutil.Process]:
    """The run's ranks and producer by role, once all are up."""
    roles: dict[str, psutil.Process] = {}
    for child in psutil.Process(torchrun.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            command = " ".join(child.cmdline())
            if "eagle3_assets.lib.hidden_states.streaming" in command:
                roles["producer"] = child
            elif "eagle3_assets.lib.training.train_drafter" in command:
                roles[f"rank-{child.environ().get('RANK')}"] = child
    return roles


def steps_recorded(out_dir: Path) -> int:
    path = out_dir / "consumed" / "rank-0.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_kill_9_at_random_points_then_resume_trains_each_sample_once(llama_stream, tmp_path):
    stream_world = llama_stream
    """Two gloo ranks and the producer; kill -9 of one of them, or of the whole run, at a
    seeded random step, three times, each time started again as a re-materialization does."""
    sizes = {"steps": 16, "batch_size": 2, "tokens_per_rank": budget(stream_world)}
    run = config(stream_world, tmp_path / "killed", streamed=True, checkpoint_every=3, **sizes)
    straight = config(stream_world, tmp_path / "straight", streamed=True, **sizes)
    done = torchrun(straight, tmp_path / "straight.json", stderr=subprocess.PIPE)
    assert done.wait(timeout=600) == 0, done.stderr.read()[-3000:]
    rng = random.Random(7)
    kills = []
    for victim in rng.sample(["producer", "rank-0", "rank-1", "run"], 3):
        at = steps_recorded(tmp_path / "killed") + rng.randint(1, 3)
        ranks = torchrun(run, tmp_path / "killed.json", start_new_session=True)
        while steps_recorded(tmp_path / "killed") < at and ranks.poll() is None:
            time.sleep(0.02)
        roles = processes(ranks)
        if victim == "run":
            os.killpg(ranks.pid, signal.SIGKILL)
        else:
            roles[victim].send_signal(signal.SIGKILL)
        ranks.wait(timeout=300)
        kills.append((victim, at, ranks.returncode))
        for process in roles.values():  # nothing of the dead run lives on
            assert not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    assert [code != 0 for _, _, code in kills] == [True] * 3, kills
    assert (tmp_path / "killed" / "checkpoints" / "latest").exists()  # resumed, not restarted
    resumed = torchrun(run, tmp_path / "killed.json")
    assert resumed.wait(timeout=600) == 0
    assert record(tmp_path / "killed") == record(tmp_path / "straight")
    counts = [
        [len(step["samples"]) for step in rank] for rank in record(tmp_path / "straight").values()
    ]
    assert counts[0] != counts[1] and {*counts[0], *counts[1]} == {1, 2}  # unequal ranks
    weights = load_file(tmp_path / "killed" / "export" / "model.safetensors")
    expected = load_file(tmp_path / "straight" / "export" / "model.safetensors")
    assert all(torch.equal(weights[name], expected[name]) for name in expected)
    assert list((tmp_path / "killed" / "stream" / "spool").iterdir()) == []
