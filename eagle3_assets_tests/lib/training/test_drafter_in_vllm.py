"""Exported drafters in real vLLM (CPU build), serving target-v2: an untrained drafter, and the
world's drafter trained by this project's code (on target-v1's answers, as the public K2
drafter was for K2), each exported through read_drafter -> write_vllm_drafter. vLLM must take
the aux layers from our config (not its default), propose drafts, and, greedy, emit exactly
what the plain target emits: speculative decoding may change speed, never the output. The
trained drafter must be accepted more often than the untrained one, and its bf16 export (the
default) as often as its float32 one.

Each drafter server runs and stops before the next, and before the session's plain server
(`vllm_target`) is asked for, so that one vLLM server is up at a time.
"""

import json
import re
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from eagle3_assets.lib.checkpoint.drafter_io import export_for_vllm, read_drafter
from eagle3_assets.lib.core.layer_ids import default_aux_layers
from eagle3_assets.lib.core.target import TargetShape
from eagle3_assets.lib.evaluation.acceptance import Acceptance, between, snapshot
from eagle3_assets.lib.serving.vllm_launcher import start, stop, wait_ready, with_eagle3_drafter
from eagle3_assets.localdev.hub import make_untrained_drafter, train_world_drafter
from eagle3_assets.localdev.miniature import SERVED_TARGET_NAME, miniature_server
from eagle3_assets_tests.conftest import free_port

pytestmark = pytest.mark.vllm

NUM_PROMPTS = 8
MAX_TOKENS = 48
DRAFT_TOKENS = 3


@dataclass(frozen=True)
class SpeculativeRun:
    outputs: list[list[int]]  # generated token ids per prompt
    counted: Acceptance  # what vLLM's /metrics counted over the run
    log: str


def conversations(prompts_file: Path) -> list[list[dict]]:
    rows = [json.loads(line) for line in prompts_file.read_text().splitlines() if line]
    return [row["messages"] for row in rows[:NUM_PROMPTS]]


def greedy_token_ids(base_url: str, messages: list[dict]) -> list[int]:
    """One temperature-0 chat completion; the generated ids, not text, so that a difference
    hidden by detokenization still shows."""
    payload = {
        "model": SERVED_TARGET_NAME,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        f"{base_url}/v1/chat/completions",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())["choices"][0]["token_ids"]


def export(source: Path, out_dir: Path, target_dir: Path, dtype: torch.dtype | None = None) -> Path:
    target = TargetShape.from_config(target_dir)
    exported = export_for_vllm(source, out_dir, target, dtype)
    assert read_drafter(exported, target).aux_layer_ids.vllm == (3, 5, 6)  # nested SGLang [2, 4, 5]
    return exported


def serve_and_run(test_world, serving_python, drafter: Path, run_dir: Path) -> SpeculativeRun:
    """Start vLLM with the drafter, run the prompts greedy, stop it."""
    spec = miniature_server(test_world.target_v2, run_dir, free_port(), SERVED_TARGET_NAME)
    spec = replace(with_eagle3_drafter(spec, drafter, DRAFT_TOKENS), python=serving_python)
    start(spec)
    try:
        wait_ready(spec, timeout_s=600)
        before = snapshot(spec.base_url)
        started = time.monotonic()
        outputs = [greedy_token_ids(spec.base_url, m) for m in conversations(test_world.prompts)]
        counted = between(before, snapshot(spec.base_url), time.monotonic() - started)
    finally:
        stop(spec.run_dir, grace_s=30)
    return SpeculativeRun(outputs, counted, spec.log_file.read_text(errors="replace"))


@pytest.fixture(scope="module")
def runs(test_world, test_hub, serving_python, tmp_path_factory) -> dict[str, SpeculativeRun]:
    """The three server starts of this file: untrained, trained, trained in bf16."""
    scratch = tmp_path_factory.mktemp("drafters")
    untrained = make_untrained_drafter(
        test_world.target_v2, scratch / "untrained", 256, seed=1, nested_ids=default_aux_layers(8)
    )  # the world drafter's nested ids
    trained = train_world_drafter(test_world, 256)  # what test_hub published
    drafters = (
        ("untrained", untrained, None),
        ("trained", trained, None),  # as trained: float32
        ("trained-bf16", trained, torch.bfloat16),
    )
    return {
        name: serve_and_run(
            test_world,
            serving_python,
            export(source, scratch / f"{name}-vllm", test_world.target_v2, dtype),
            scratch / f"{name}-server",
        )
        for name, source, dtype in drafters
    }


@pytest.mark.parametrize("name", ["untrained", "trained", "trained-bf16"])
def test_vllm_takes_the_aux_layers_from_our_config(runs, name):
    # "from (speculative) config", not "from model": the source in the line proves it read our
    # top-level ids (vLLM's default for 8 layers would be (2, 4, 5)).
    lines = [line for line in runs[name].log.splitlines() if "auxiliary layers" in line]
    assert any(
        re.search(r"auxiliary layers from (speculative )?config: \(3, 5, 6\)", line)
        for line in lines
    ), lines


@pytest.mark.parametrize("name", ["untrained", "trained", "trained-bf16"])
def test_vllm_drafts_with_it(runs, name):
    counted = runs[name].counted
    drafts = counted.drafts
    info = f"{name}: {counted}, mean acceptance length {counted.mean_length:.3f}"
    print(info)  # shown by `pytest -rP`
    assert drafts > 0, info
    assert counted.draft_tokens == DRAFT_TOKENS * drafts, info


def test_the_trained_drafter_is_accepted_more(runs):
    # measured: untrained 1.000 (0 of 465 draft tokens), trained for target-v1 and served
    # with target-v2 (the K2 drafter on K2.5, in miniature) 1.131: low, as that story goes
    untrained, trained = (runs[n].counted.mean_length for n in ("untrained", "trained"))
    assert trained > untrained + 0.05, f"trained {trained:.3f} vs untrained {untrained:.3f}"


def test_the_bf16_export_is_accepted_as_the_float32_one(runs):
    # vLLM builds the drafter in the target's dtype and casts what it loads (measured: 137
    # drafts, 18 tokens accepted, both): the float32 export buys nothing but twice the bytes
    float32, bfloat16 = runs["trained"].counted, runs["trained-bf16"].counted
    print(f"float32 {float32}\nbfloat16 {bfloat16}")
    assert (bfloat16.drafts, bfloat16.accepted) == (float32.drafts, float32.accepted)


def test_greedy_output_is_the_plain_targets(runs, request, test_world):
    # Asked for only now: the drafter servers have stopped (one server at a time).
    plain = request.getfixturevalue("vllm_target")
    expected = [greedy_token_ids(plain.base_url, m) for m in conversations(test_world.prompts)]
    for name, run in runs.items():
        differ = [i for i, (a, b) in enumerate(zip(expected, run.outputs, strict=True)) if a != b]
        assert not differ, (
            f"{name}: prompts {differ} differ: plain {[expected[i] for i in differ]}, "
            f"with drafter {[run.outputs[i] for i in differ]}"
        )
