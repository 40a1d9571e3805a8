"""Tiny Llama targets trained on the topic corpus, shaped to pass vLLM's CPU backend.

They answer templated questions about a topic with that topic's text and close with <|end|>,
so their next-token distributions are text-like and low in entropy: what a drafter can learn.
Training is a plain, seeded torch loop; the caller isolates the global RNG and thread count.
"""

import math
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from eagle3_assets.localdev.prompts import QUESTIONS, body, subject, topics, user_message
from eagle3_assets.localdev.tokenizer import END, PAD

NUM_LAYERS = 8  # >= 7 keeps vLLM's default EAGLE-3 aux layers (2, N//2, N-3) distinct
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128)  # others crash vLLM's CPU attention
SEPARATORS = ("\n\n", "\n", " ")


def target_config(
    tokenizer: PreTrainedTokenizerBase,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
) -> LlamaConfig:
    """A Llama config vLLM's CPU backend serves: allowed head_dim, untied embeddings, and a
    vocabulary covering every token id including the specials."""
    head_dim = hidden_size // num_heads
    if head_dim not in VLLM_CPU_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not one of {VLLM_CPU_HEAD_DIMS}")
    end_id, pad_id = tokenizer.convert_tokens_to_ids([END, PAD])
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        num_hidden_layers=NUM_LAYERS,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=end_id,
        pad_token_id=pad_id,
        dtype="float32",
    )


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
    tokenizer: PreTrainedTokenizerBase, seq_len: int, topic_keys: tuple[str, ...] | None
) -> list[list[int]]:
    """Chat examples (a templated question about a topic, answered by a chunk of its text and
    <|end|>) followed by raw topic text in windows of `seq_len` tokens, in topic order."""

    def count(text: str) -> int:
        return len(tokenizer.encode(text, verbose=False))

    def render(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    chats, raw = [], []
    for index, text in enumerate(topics(topic_keys).values()):
        about = subject(text)
        questions = [template.format(subject=about) for template in QUESTIONS]
        longest = max(
            count(render([user_message(q)], add_generation_prompt=True)) for q in questions
        )
        budget = seq_len - longest - 2  # the answer's closing "<|end|>\n"
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


def new_target(config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    """A freshly initialised float32 target; the seed fixes its weights."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


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
    model: LlamaForCausalLM,
    sequences: list[list[int]],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    log: Callable[[str], None],
) -> float:
    """AdamW with linear warmup and cosine decay to 10%; returns the mean loss of the last 10
    steps. Loss covers every non-pad token: prompts, answers and the closing <|end|>. The seed
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


def save_target(model: LlamaForCausalLM, tokenizer_dir: Path, out_dir: Path) -> None:
    """Save weights (float32; transformers 5 writes safetensors only), config, a generation
    config that stops at <|end|>, and a copy of the tokenizer: vLLM loads the tokenizer from the
    model directory."""
    config = model.config
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(out_dir)
    for file in sorted(tokenizer_dir.iterdir()):
        shutil.copy(file, out_dir / file.name)
