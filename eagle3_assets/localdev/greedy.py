"""Generation rows made by a miniature target itself (greedy, in transformers): the rows a
vLLM server's batch would hold, token ids included, and their hidden states, for tests,
benchmarks and the world's warm-start drafter, without starting a server."""

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle3_assets.lib.core.target import TargetShape
from eagle3_assets.lib.generation.conversations import load_conversations
from eagle3_assets.lib.hidden_states.token_sequences import build_sequences, render_prompt_ids

if TYPE_CHECKING:
    from eagle3_assets.lib.hidden_states.extract import LayerSelection

BATCH = 16  # prompts per generate call, left-padded


def greedy_generation_rows(
    target: Path,
    prompts: Path,
    count: int,
    max_new_tokens: int,
    *,
    chat_template_kwargs: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
) -> list[dict]:
    """Greedy answers to the first `count` prompts, rendered with `chat_template_kwargs` as a
    server would be asked to (a world's spec says which, and whether its tokenizer needs
    `trust_remote_code`)."""
    tokenizer = AutoTokenizer.from_pretrained(target, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    conversations = load_conversations(prompts)[:count]
    rows = []
    for start in range(0, len(conversations), BATCH):
        chunk = conversations[start : start + BATCH]
        messages = [[dict(m) for m in c.messages] for c in chunk]
        prompt_ids = [render_prompt_ids(tokenizer, m, chat_template_kwargs or {}) for m in messages]
        longest = max(len(ids) for ids in prompt_ids)
        ids = torch.full((len(chunk), longest), tokenizer.pad_token_id)
        mask = torch.zeros(len(chunk), longest, dtype=torch.long)
        for row, prompt in enumerate(prompt_ids):
            ids[row, longest - len(prompt) :] = torch.tensor(prompt)
            mask[row, longest - len(prompt) :] = 1
        with torch.inference_mode():
            output = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        for conversation, message, prompt, generated in zip(
            chunk, messages, prompt_ids, output[:, longest:].tolist(), strict=True
        ):
            end = (
                generated.index(tokenizer.eos_token_id) + 1
                if tokenizer.eos_token_id in generated
                else len(generated)
            )
            response_ids = generated[:end]
            rows.append(
                {
                    "sample_id": f"{conversation.prompt_id}-greedy",
                    "prompt_id": conversation.prompt_id,
                    "messages": json.dumps(message),
                    "response": tokenizer.decode(response_ids, skip_special_tokens=True),
                    "prompt_token_ids": prompt,
                    "token_ids": response_ids,
                }
            )
    return rows


def greedy_hidden_states(
    target: Path,
    prompts: Path,
    count: int,
    max_new_tokens: int,
    layers: "LayerSelection",
    out_dir: Path,
    identity: dict[str, Any],
    *,
    chat_template_kwargs: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
) -> Path:
    """Shards of the target's greedy answers to the first `count` prompts at `layers`, as a
    batch's would be (rendered with `chat_template_kwargs`, the hf backend in fp32, stored
    bf16 + bf16)."""
    from eagle3_assets.lib.hidden_states.extract import ExtractionSettings, extract_batch
    from eagle3_assets.lib.hidden_states.hf_backend import HFTarget
    from eagle3_assets.lib.hidden_states.shard_format import ShardFormat

    rows = greedy_generation_rows(
        target,
        prompts,
        count,
        max_new_tokens,
        chat_template_kwargs=chat_template_kwargs,
        trust_remote_code=trust_remote_code,
    )
    tokenizer = AutoTokenizer.from_pretrained(target, trust_remote_code=trust_remote_code)
    extract_batch(
        build_sequences(rows, tokenizer, chat_template_kwargs),
        out_dir,
        lambda: HFTarget(target, layers.ids, dtype="float32", device="cpu"),
        layers,
        TargetShape.from_config(Path(target)).hidden_size,
        ExtractionSettings(ShardFormat("bf16", "bf16")),
        identity,
    )
    return out_dir
