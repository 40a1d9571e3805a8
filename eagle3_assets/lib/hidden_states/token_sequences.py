"""The exact token sequences the target saw, and which of their tokens the drafter learns.

A drafter trained on a sequence the server never produces learns the wrong thing (SpecForge
#296: templates that differ between generation and training; #885: masks off by one). So the
sequence is the prompt's token ids as vLLM rendered them plus the response's ids as vLLM
generated them, never a re-tokenization of the response text (a BPE does not round-trip every
generated sequence). The chat template is still rendered here, with the generation's template
kwargs, and compared with vLLM's prompt ids: a difference means the local tokenizer or the
kwargs drifted from the server's, and is reported per sample.

`loss_mask[t]` is True when token t is a response token (the end-of-turn token the target
emitted included). The prediction of token t is made at position t - 1, so the positions that
train the drafter ("teacher positions") are those t with `loss_mask[t + 1]`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from eagle3_assets.lib.hidden_states.settings import DEFAULTS


@dataclass(frozen=True)
class TokenSequence:
    sample_id: str
    input_ids: np.ndarray  # int64 [T]: rendered prompt, then the generated response
    loss_mask: np.ndarray  # bool [T]: True on response tokens
    truncated: bool  # cut at max_length

    @property
    def teacher_positions(self) -> np.ndarray:
        """Positions whose next token is a response token: where the drafter is trained."""
        return np.flatnonzero(self.loss_mask[1:])

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class TemplateMismatch:
    """The local chat template rendered a prompt other than the one vLLM saw."""

    sample_id: str
    position: int  # first differing token
    rendered: list[int]  # a few ids from there on
    served: list[int]

    def __str__(self) -> str:
        return (
            f"{self.sample_id}: the chat template renders {self.rendered} at token "
            f"{self.position}, vLLM saw {self.served}"
        )


def render_prompt_ids(
    tokenizer: Any, messages: list[dict[str, str]], template_kwargs: Mapping[str, Any]
) -> list[int]:
    """The prompt as vLLM's chat endpoint builds it: template text, then tokens without
    special-token insertion (templates that want a BOS write it into the text)."""
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **template_kwargs
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _first_difference(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def build_sequences(
    rows: Iterable[Mapping[str, Any]],
    tokenizer: Any,
    template_kwargs: Mapping[str, Any] | None = None,
    max_length: int = DEFAULTS.max_length,
) -> tuple[list[TokenSequence], list[TemplateMismatch]]:
    """Sequences for generation rows (sample_id, messages JSON, prompt_token_ids, token_ids).

    Rows without token ids are refused: re-tokenizing response text is exactly the bug this
    module exists to avoid, and vLLM returns the ids when asked (`return_token_ids`)."""
    if max_length < 2:
        raise ValueError(f"max_length: expected at least 2, found {max_length}")
    kwargs = dict(template_kwargs or {})
    sequences: list[TokenSequence] = []
    mismatches: list[TemplateMismatch] = []
    for row in rows:
        sample_id = row["sample_id"]
        prompt_ids, response_ids = row.get("prompt_token_ids"), row.get("token_ids")
        if prompt_ids is None or response_ids is None:
            raise ValueError(
                f"{sample_id}: the generation has no token ids (prompt_token_ids, token_ids); "
                "regenerate the batch with return_token_ids on (the recipe's default)"
            )
        rendered = render_prompt_ids(tokenizer, json.loads(row["messages"]), kwargs)
        if rendered != list(prompt_ids):
            at = _first_difference(rendered, list(prompt_ids))
            mismatches.append(
                TemplateMismatch(
                    sample_id, at, rendered[at : at + 8], list(prompt_ids[at : at + 8])
                )
            )
        input_ids = np.asarray([*prompt_ids, *response_ids], dtype=np.int64)
        loss_mask = np.zeros(len(input_ids), dtype=bool)
        loss_mask[len(prompt_ids) :] = True
        truncated = len(input_ids) > max_length
        sequences.append(
            TokenSequence(sample_id, input_ids[:max_length], loss_mask[:max_length], truncated)
        )
    return sequences, mismatches
