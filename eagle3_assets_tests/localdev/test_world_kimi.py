"""The Kimi-shaped test world (session fixture `kimi_world`): DeepSeek-V3 targets shaped like
Kimi-K2, a tokenizer that loads only as remote code, Kimi's chat template with its thinking flag.
"""

import dataclasses
import json
import re
import string
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from eagle3_assets.localdev.greedy import greedy_generation_rows
from eagle3_assets.localdev.world import SIZES, World
from eagle3_assets_tests.templates import CONVERSATION

SPECIAL_IDS = {
    "<|im_system|>": 0,
    "<|im_user|>": 1,
    "<|im_assistant|>": 2,
    "<|im_middle|>": 3,
    "<|im_end|>": 4,
    "<think>": 5,
    "</think>": 6,
    "[PAD]": 7,
}
FOLDERS = ("tokenizer", "target_v1", "target_v2")
# Loads each folder's tokenizer without, then with, trust_remote_code; prints what happened.
LOAD_BOTH_WAYS = """
import json, sys
from transformers import AutoTokenizer
outcomes = {}
for folder in sys.argv[1:]:
    outcomes[folder] = []
    for trust in (False, True):
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust)
            outcomes[folder].append(type(tokenizer).__name__)
        except ValueError:
            outcomes[folder].append("ValueError")
print(json.dumps(outcomes))
"""


@pytest.fixture(scope="module")
def tokenizer(kimi_world: World):
    return AutoTokenizer.from_pretrained(kimi_world.tokenizer, trust_remote_code=True)


def test_spec_says_what_a_user_must_set() -> None:
    kimi, llama = SIZES["kimi-test"], SIZES["test"]
    assert (kimi.family, kimi.trust_remote_code, kimi.chat_template_kwargs) == (
        "kimi",
        True,
        {"thinking": False},
    )
    assert (llama.family, llama.trust_remote_code, llama.chat_template_kwargs) == (
        "llama",
        False,
        None,
    )
    kimi.chat_template_kwargs["thinking"] = True  # a copy: the world's rendering is fixed
    assert kimi.chat_template_kwargs == {"thinking": False}
    with pytest.raises(ValueError, match="unknown family 'qwen'; valid: llama, kimi"):
        dataclasses.replace(llama, family="qwen")


@pytest.mark.parametrize("folder", FOLDERS)
def test_tokenizer_loads_only_as_remote_code(kimi_world: World, folder: str) -> None:
    path = getattr(kimi_world, folder)
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        AutoTokenizer.from_pretrained(path)
    loaded = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    assert type(loaded).__name__ == "KimiMiniTokenizer"
    assert loaded.convert_tokens_to_ids(list(SPECIAL_IDS)) == list(SPECIAL_IDS.values())


def test_serving_venv_loads_it_only_as_remote_code(kimi_world: World, serving_python: Path) -> None:
    """vLLM's transformers (5.19) falls back to a built-in class for deepseek_v3 folders when
    remote code is not trusted: the BPE's own file name makes that fallback fail too."""
    folders = [str(getattr(kimi_world, folder)) for folder in FOLDERS]
    result = subprocess.run(
        [str(serving_python), "-c", LOAD_BOTH_WAYS, *folders],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        check=True,
    )
    outcomes = json.loads(result.stdout.splitlines()[-1])
    assert outcomes == {folder: ["ValueError", "KimiMiniTokenizer"] for folder in folders}


def test_special_tokens(tokenizer) -> None:
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_IDS)) == list(SPECIAL_IDS.values())
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == (
        "<|im_end|>",
        "[PAD]",
        None,
    )
    assert len(tokenizer) == SIZES["kimi-test"].vocab_size
    text = "naïve café — 你好 🙂 <think></think>"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_chat_template_renders_thinking_and_instant_mode(tokenizer) -> None:
    messages = CONVERSATION
    history = (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>What is a loop?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>A repeated block.<|im_end|>"
        '<|im_user|>user<|im_middle|>And "for"?<|im_end|>'
    )
    opened = history + "<|im_assistant|>assistant<|im_middle|>"

    def render(**kwargs) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)

    assert render() == history
    assert render(add_generation_prompt=True) == opened + "<think>"  # thinking by default
    assert render(add_generation_prompt=True, thinking=True) == opened + "<think>"
    instant = render(add_generation_prompt=True, **SIZES["kimi-test"].chat_template_kwargs)
    assert instant == opened + "<think></think>"
    ids = tokenizer(instant, add_special_tokens=False)["input_ids"]
    assert ids[0] == SPECIAL_IDS["<|im_system|>"]  # no BOS
    assert ids[-2:] == [SPECIAL_IDS["<think>"], SPECIAL_IDS["</think>"]]  # tags are one token
    assert ids.count(SPECIAL_IDS["<|im_end|>"]) == 4


@pytest.mark.parametrize("name", ["target_v1", "target_v2"])
def test_targets_are_kimi_shaped(kimi_world: World, tokenizer, name: str) -> None:
    model_dir = getattr(kimi_world, name)
    config = json.loads((model_dir / "config.json").read_text())
    assert "auto_map" not in config  # the model is transformers' and vLLM's own: no remote code
    assert (config["model_type"], config["architectures"]) == (
        "deepseek_v3",
        ["DeepseekV3ForCausalLM"],
    )
    loaded = AutoConfig.from_pretrained(model_dir)  # built in: no trust_remote_code
    assert loaded.num_hidden_layers == 8
    mla = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
    assert [getattr(loaded, key) for key in mla] == [64, 512, 64, 32, 32]
    assert loaded.kv_lora_rank + loaded.qk_rope_head_dim == 576  # vLLM CPU_MLA: 320/512/576
    moe = ("n_routed_experts", "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace")
    assert [getattr(loaded, key) for key in moe] == [4, 1, 2, 1]
    assert (config["scoring_func"], config["topk_method"]) == ("sigmoid", "noaux_tc")
    assert loaded.rope_parameters == {
        "rope_type": "yarn",
        "rope_theta": 50000.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    assert loaded.hidden_size % 32 == 0 and loaded.moe_intermediate_size % 32 == 0
    assert loaded.tie_word_embeddings is False
    assert loaded.vocab_size == len(tokenizer)
    assert loaded.eos_token_id == SPECIAL_IDS["<|im_end|>"]
    assert GenerationConfig.from_pretrained(model_dir).eos_token_id == SPECIAL_IDS["<|im_end|>"]
    with safe_open(model_dir / "model.safetensors", "pt") as weights:
        names = list(weights.keys())
        assert {weights.get_tensor(n).dtype for n in names} == {torch.float32}
    assert "lm_head.weight" in names
    for file in kimi_world.tokenizer.iterdir():  # the remote code travels with the model
        assert (model_dir / file.name).read_bytes() == file.read_bytes()


@pytest.mark.parametrize("name", ["target_v1", "target_v2"])
def test_greedy_answers_in_instant_mode_are_text_and_end(kimi_world: World, name: str) -> None:
    """Answers to the pool's prompts, rendered as generation renders them: short and odd at
    this size (as the Llama test world's), but words, closed by <|im_end|>. Counted over the
    answers, not required of each: the world's bytes differ by CPU (AVX-512 or AVX2 kernels),
    and on some builds one answer in eight is a grammar line ('   ::=') or runs past 100
    tokens; a target that has learnt nothing (looping on a quote mark) fails every count."""
    spec = kimi_world.spec
    rows = greedy_generation_rows(
        getattr(kimi_world, name),
        kimi_world.prompts,
        8,
        max_new_tokens=100,
        chat_template_kwargs=spec.chat_template_kwargs,
        trust_remote_code=spec.trust_remote_code,
    )
    assert len(rows) == 8
    instant = [SPECIAL_IDS["<think>"], SPECIAL_IDS["</think>"]]
    assert all(row["prompt_token_ids"][-2:] == instant for row in rows)  # instant mode
    responses = [row["response"] for row in rows]
    words = [len(re.findall(r"[A-Za-z]{2,}", text)) for text in responses]
    textlike = [
        row["token_ids"][-1] == SPECIAL_IDS["<|im_end|>"]
        and set(row["response"]) <= set(string.printable)
        and found >= 1
        for row, found in zip(rows, words, strict=True)
    ]
    assert sum(textlike) >= 6, responses
    assert sum(words) >= len(rows), responses
