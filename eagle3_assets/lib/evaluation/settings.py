"""How drafters are measured in vLLM: the decoding every contender gets, each default once."""

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Decoding(BaseModel):
    """Part of every measurement's key: a measurement under other settings is never reused."""

    model_config = ConfigDict(frozen=True)

    max_tokens: int = Field(256, ge=1)  # greedy answer length
    concurrency: int = Field(16, ge=1)
    num_speculative_tokens: int = Field(3, ge=1)
    load_timeout_s: float = Field(1800.0, gt=0)


class EvaluationSettings(Decoding):
    # The generation recipe's, sent with every request: acceptance is measured on exactly the
    # rendering the drafter was trained for. Set from it, never on its own.
    chat_template_kwargs: dict[str, Any] | None = None
