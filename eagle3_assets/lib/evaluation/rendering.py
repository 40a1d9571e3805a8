"""The evaluation's servers render its prompts as the drafter's training data was rendered.

Extraction checks the generation server's prompt ids against the local chat template with the
generation's kwargs (lib/hidden_states/token_sequences.py). The evaluation starts servers of
its own, which could render otherwise (another --chat-template in its vLLM arguments, another
tokenizer revision): before measuring, each prompt is rendered by the server through vLLM's
/tokenize (the chat endpoint's renderer, same template and kwargs, no generation) and checked
against the same local rendering, with the same error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from eagle3_assets.lib.hidden_states.token_sequences import check_rendering
from eagle3_assets.lib.serving.vllm_probe import post_json


def served_prompt_ids(
    base_url: str,
    model: str,
    messages: list[dict[str, str]],
    chat_template_kwargs: Mapping[str, Any] | None,
    api_key: str | None = None,
    timeout_s: float = 60.0,
) -> list[int]:
    """The prompt ids vLLM's chat endpoint would build for `messages` (generation prompt
    added, no extra special tokens, as a chat completion does)."""
    payload: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "add_generation_prompt": True,
        "add_special_tokens": False,
    }
    if chat_template_kwargs is not None:
        payload["chat_template_kwargs"] = dict(chat_template_kwargs)
    return list(post_json(base_url, "/tokenize", payload, api_key, timeout_s)["tokens"])


def check_served_rendering(
    base_url: str,
    model: str,
    prompt_sets: Mapping[str, list[list[dict[str, str]]]],
    tokenizer: Any,
    chat_template_kwargs: Mapping[str, Any] | None,
    api_key: str | None = None,
) -> None:
    """Raise TemplateMismatchError unless the server at `base_url` renders every prompt with
    `chat_template_kwargs` exactly as `tokenizer`'s chat template does with them."""
    check_rendering(
        (
            (
                f"{name} #{index}",
                messages,
                served_prompt_ids(base_url, model, messages, chat_template_kwargs, api_key),
            )
            for name, conversations in prompt_sets.items()
            for index, messages in enumerate(conversations)
        ),
        tokenizer,
        chat_template_kwargs or {},
        server=f"the evaluation's vLLM ({base_url})",
    )
