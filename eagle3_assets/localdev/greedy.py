"""Generation rows made by a miniature target itself (greedy, in transformers): the rows a
vLLM server's batch would hold, token ids included, for tests and benchmarks that need
realistic sequences without starting a server."""

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle3_assets.lib.conversations import load_conversations
from eagle3_assets.lib.token_sequences import render_prompt_ids


def greedy_generation_rows(
    target: Path, prompts: Path, count: int, max_new_tokens: int
) -> list[dict]:
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    rows = []
    for conversation in load_conversations(prompts)[:count]:
        messages = [dict(m) for m in conversation.messages]
        prompt_ids = render_prompt_ids(tokenizer, messages, {})
        with torch.inference_mode():
            output = model.generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        response_ids = output[0, len(prompt_ids) :].tolist()
        rows.append(
            {
                "sample_id": f"{conversation.prompt_id}-test",
                "prompt_id": conversation.prompt_id,
                "messages": json.dumps(messages),
                "response": tokenizer.decode(response_ids, skip_special_tokens=True),
                "prompt_token_ids": prompt_ids,
                "token_ids": response_ids,
            }
        )
    return rows
