"""The evaluation measures the drafter on the rendering it was trained for: a real vLLM server
whose chat template depends on a kwarg (as Kimi's `thinking`) counts, for the evaluation's
requests, exactly the prompt tokens the training side renders with the generation's kwargs;
a server that renders otherwise is an error naming both renderings; and a measurement taken
under one rendering is never reused for another."""

import dataclasses

import pytest
from transformers import AutoTokenizer

from eagle3_assets.lib.evaluation.evaluate import (
    BASELINE,
    Contender,
    evaluate,
)
from eagle3_assets.lib.evaluation.rendering import check_served_rendering
from eagle3_assets.lib.evaluation.settings import EvaluationSettings
from eagle3_assets.lib.generation.conversations import load_conversations
from eagle3_assets.lib.hidden_states.token_sequences import (
    TemplateMismatchError,
    render_prompt_ids,
)
from eagle3_assets.lib.serving.vllm_launcher import LaunchError
from eagle3_assets.localdev.miniature import miniature_server
from eagle3_assets_tests.conftest import free_port
from eagle3_assets_tests.templates import KWARGS, thinking_target

pytestmark = pytest.mark.vllm


def test_evaluation_requests_render_with_the_generations_template_kwargs(
    test_world, serving_python, tmp_path
):
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
            spec,
            [Contender(BASELINE, None)],
            {"held-out": conversations},
            settings,
            results,
            tokenizer,  # renders as the server does: the check before measuring passes
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


def test_a_server_rendering_otherwise_is_an_error_naming_both_renderings(
    test_world, vllm_target, tmp_path
):
    """The session's server renders target-v2's own template, which has no `thinking`. Checked
    against a local template that reads it, instant mode is an error showing where the two
    renderings part; against its own template, or without the kwarg, there is none."""
    conversations = [c.messages for c in load_conversations(test_world.heldout_prompts)][:4]
    sets = {"held-out": conversations}
    plain = AutoTokenizer.from_pretrained(test_world.target_v2)
    thinking = AutoTokenizer.from_pretrained(
        thinking_target(test_world.target_v2, tmp_path / "target")
    )
    url, model = vllm_target.base_url, vllm_target.served_model_name
    check_served_rendering(url, model, sets, plain, KWARGS)  # the template ignores the kwarg
    check_served_rendering(url, model, sets, thinking, None)  # `thinking` undefined: as served

    with pytest.raises(TemplateMismatchError) as mismatch:
        check_served_rendering(url, model, sets, thinking, KWARGS)
    served = render_prompt_ids(plain, conversations[0], {})
    server = f"the evaluation's vLLM ({url})"
    assert str(mismatch.value).splitlines()[:3] == [
        f"4 of 4 prompts render differently with the local chat template and "
        f'chat_template_kwargs {{"thinking": false}} than {server} rendered them; first, '
        f"held-out #0, from token {len(served)} on (after {plain.decode(served[-12:])!r}):",
        f"  {server} rendered: ''",
        "  the local template rendered: '<think></think>'",
    ]
