"""The exact token sequences the target saw, and which of their tokens the drafter learns.

A drafter trained on a sequence the server never produces learns the wrong thing (SpecForge
#296: templates that differ between generation and training; #885: masks off by one). So the
sequence is the prompt's token ids as vLLM rendered them plus the response's ids as vLLM
generated them, never a re-tokenization of the response text (a BPE does not round-trip every
generated sequence). The chat template is still rendered here, with the generation's template
kwargs, and compared with vLLM's prompt ids: a difference means the local tokenizer, its
template or the kwargs drifted from the server's, and the data would train the drafter on
another rendering than extraction, training and evaluation assume. It is an error naming both
renderings (`check_rendering`, also used by the evaluation against its own servers).

`loss_mask[t]` is True when token t is a response token (the end-of-turn token the target
emitted included). The prediction of token t is made at position t - 1, so the positions that
train the drafter ("teacher positions") are those t with `loss_mask[t + 1]`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
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


CONTEXT_TOKENS = 12  # decoded on each side of the first differing token in a mismatch


@dataclass(frozen=True)
class TemplateMismatch:
    """A prompt the local chat template renders other than the server did: the text around
    the first differing token, decoded, as each rendered it."""

    sample_id: str
    position: int  # first differing token
    before: str  # what both rendered just before it
    served: str  # the server's text from there on
    rendered: str  # the local template's text from there on

    def describe(self, server: str) -> str:
        return (
            f"{self.sample_id}, from token {self.position} on (after {self.before!r}):\n"
            f"  {server + ' rendered:':<28} {self.served!r}\n"
            f"  the local template rendered: {self.rendered!r}"
        )


class TemplateMismatchError(ValueError):
    """Prompts render differently with the local tokenizer and kwargs than on the server."""

    def __init__(
        self,
        mismatches: list[TemplateMismatch],
        total: int,
        template_kwargs: Mapping[str, Any],
        server: str,
    ) -> None:
        self.mismatches = mismatches
        self.total = total
        super().__init__(
            f"{len(mismatches)} of {total} prompts render differently with the local chat "
            f"template and chat_template_kwargs {json.dumps(dict(template_kwargs))} than "
            f"{server} rendered them; first, {mismatches[0].describe(server)}\n"
            "Every place that renders a prompt (generation, extraction, evaluation) must use "
            "the same template and kwargs: a drafter trained or measured on another rendering "
            "is trained or measured on another distribution."
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


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def check_rendering(
    prompts: Iterable[tuple[str, list[dict[str, str]], Sequence[int]]],
    tokenizer: Any,
    template_kwargs: Mapping[str, Any],
    server: str = "vLLM",
) -> None:
    """Render each (id, messages, the server's prompt ids) with `tokenizer`'s chat template and
    `template_kwargs`; raise TemplateMismatchError naming both renderings of the first prompt
    that differs (and how many do) unless every one equals the server's ids."""
    mismatches: list[TemplateMismatch] = []
    total = 0
    for sample_id, messages, served_ids in prompts:
        total += 1
        rendered, served = render_prompt_ids(tokenizer, messages, template_kwargs), list(served_ids)
        if rendered == served:
            continue
        at = _first_difference(rendered, served)
        end = at + CONTEXT_TOKENS
        mismatches.append(
            TemplateMismatch(
                sample_id,
                at,
                tokenizer.decode(served[max(at - CONTEXT_TOKENS, 0) : at]),
                tokenizer.decode(served[at:end]),
                tokenizer.decode(rendered[at:end]),
            )
        )
    if mismatches:
        raise TemplateMismatchError(mismatches, total, template_kwargs, server)


def build_sequences(
    rows: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    template_kwargs: Mapping[str, Any] | None = None,
    max_length: int = DEFAULTS.max_length,
) -> list[TokenSequence]:
    """Sequences for generation rows (sample_id, messages JSON, prompt_token_ids, token_ids),
    once every prompt renders here, with `template_kwargs`, exactly as vLLM rendered it
    (TemplateMismatchError otherwise).

    Rows without token ids are refused: re-tokenizing response text is exactly the bug this
    module exists to avoid, and vLLM returns the ids when asked (`return_token_ids`)."""
    if max_length < 2:
        raise ValueError(f"max_length: expected at least 2, found {max_length}")
    for row in rows:
        if row.get("prompt_token_ids") is None or row.get("token_ids") is None:
            raise ValueError(
                f"{row['sample_id']}: the generation has no token ids (prompt_token_ids, "
                "token_ids); regenerate the batch with return_token_ids on (the recipe's "
                "default)"
            )
    check_rendering(
        ((r["sample_id"], json.loads(r["messages"]), r["prompt_token_ids"]) for r in rows),
        tokenizer,
        dict(template_kwargs or {}),
    )
    sequences: list[TokenSequence] = []
    for row in rows:
        prompt_ids, response_ids = row["prompt_token_ids"], row["token_ids"]
        input_ids = np.asarray([*prompt_ids, *response_ids], dtype=np.int64)
        loss_mask = np.zeros(len(input_ids), dtype=bool)
        loss_mask[len(prompt_ids) :] = True
        truncated = len(input_ids) > max_length
        sequences.append(
            TokenSequence(
                row["sample_id"], input_ids[:max_length], loss_mask[:max_length], truncated
            )
        )
    return sequences
