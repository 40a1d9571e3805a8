"""The evaluation measures the drafter on the rendering it was trained for: a real vLLM server
whose chat template depends on a kwarg (as Kimi's `thinking`) counts, for the evaluation's
requests, exactly the prompt tokens the training side renders with the generation's kwargs;
and a measurement taken under one rendering is never reused for another."""

import dataclasses
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from eagle3_assets.lib.evaluation.evaluate import (
    BASELINE,
    Contender,
    evaluate,
)
from eagle3_assets.lib.evaluation.settings import EvaluationSettings
from eagle3_assets.lib.generation.conversations import load_conversations
from eagle3_assets.lib.hidden_states.token_sequences import render_prompt_ids
from eagle3_assets.lib.serving.vllm_launcher import LaunchError
from eagle3_assets.localdev.miniature import miniature_server
from eagle3_assets.localdev.tokenizer import CHAT_TEMPLATE
from eagle3_assets_tests.conftest import free_port

pytestmark = pytest.mark.vllm

GENERATION_PROMPT = "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
# Kimi-like: instant mode (thinking false opens the answer with an empty think block)
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    GENERATION_PROMPT,
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}"
    "{%- if thinking is defined and not thinking -%}{{ '<think></think>' }}{%- endif -%}"
    "{%- endif -%}",
)
KWARGS = {"thinking": False}


def thinking_target(target: Path, out: Path) -> Path:
    """The target's files, its chat template swapped for one that reads `thinking`."""
    out.mkdir()
    for file in target.iterdir():
        if file.name not in ("tokenizer_config.json", "chat_template.jinja"):
            (out / file.name).symlink_to(file.resolve())
    config = json.loads((target / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": THINKING_TEMPLATE})
    )
    (out / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return out


def test_evaluation_requests_render_with_the_generations_template_kwargs(
    test_world, serving_python, tmp_path
):
    assert THINKING_TEMPLATE != CHAT_TEMPLATE
    target = thinking_target(test_world.target_v2, tmp_path / "target")
    conversations = [c.messages for c in load_conversations(test_world.heldout_prompts)][:4]
    tokenizer = AutoTokenizer.from_pretrained(target)
    trained = [render_prompt_ids(tokenizer, m, KWARGS) for m in conversations]
    plain = [render_prompt_ids(tokenizer, m, {}) for m in conversations]
    assert all(t != p for t, p in zip(trained, plain, strict=True))  # the kwarg changes prompts

    venv = tmp_path / "venv"  # the serving venv; removed below: a server start then fails
    venv.symlink_to(serving_python.parent.parent, target_is_directory=True)
    python = venv / "bin" / serving_python.name
    spec = miniature_server(target, tmp_path / "vllm", free_port(), "thinking-target")
    spec = dataclasses.replace(spec, python=python)
    settings = EvaluationSettings(
        max_tokens=4, concurrency=4, load_timeout_s=600, chat_template_kwargs=KWARGS
    )
    results = tmp_path / "measurements"

    def measure(settings: EvaluationSettings):
        (measured,) = evaluate(
            spec, [Contender(BASELINE, None)], {"held-out": conversations}, settings, results
        )
        return measured

    measured = measure(settings)
    # vLLM counted the prompts the drafter was trained on, not the template's default
    assert measured.acceptance.prompt_tokens == sum(len(ids) for ids in trained)
    assert measured.acceptance.prompt_tokens != sum(len(ids) for ids in plain)

    venv.unlink()
    assert measure(settings) == measured  # same rendering: the saved measurement
    with pytest.raises(LaunchError, match="serving interpreter not found"):
        measure(settings.model_copy(update={"chat_template_kwargs": None}))  # another: a new server
