"""The training memory model: its exact terms are the tensors' sizes, and its fit recovers
the activation terms from measured growths."""

import dataclasses

import pytest
import torch

from eagle3_assets.lib.training.eagle3_model import Eagle3Drafter
from eagle3_assets.lib.training.memory import (
    MemoryShape,
    TokenCost,
    fit_token_cost,
    step_growth,
    training_memory,
)
from eagle3_assets_tests.lib.training.test_eagle3_model import CONFIG


def test_the_parameter_counts_are_the_drafters():
    model = Eagle3Drafter(CONFIG, torch.zeros(50, 32))
    shape = MemoryShape.of(CONFIG, tokens=100, ttt_length=7)
    parameters = dict(model.named_parameters())
    assert shape.trainable == sum(p.numel() for p in parameters.values())
    assert shape.matmul_weights == sum(p.numel() for p in parameters.values() if p.dim() == 2)
    assert shape.frozen == model.embed_tokens.numel()


def test_the_fit_recovers_the_terms_it_was_made_from():
    truth = TokenCost(per_step=2e5, per_word=9.0, kept_step=6e4)
    points = []
    for tokens, ttt, intermediate, vocab, checkpointed in [
        (256, 7, 512, 8000, False), (1024, 7, 512, 8000, False), (4096, 7, 512, 8000, False),
        (1024, 3, 512, 8000, False), (1024, 7, 2048, 8000, False), (1024, 7, 512, 32000, False),
        (1024, 7, 512, 8000, True), (4096, 7, 512, 8000, True),
    ]:  # fmt: skip
        config = dataclasses.replace(CONFIG, intermediate_size=intermediate, draft_vocab_size=vocab)
        shape = MemoryShape.of(config, tokens, ttt, checkpointed)
        points.append((shape, step_growth(shape, truth)))
    fitted = fit_token_cost(points)
    for name, value in dataclasses.asdict(truth).items():
        assert getattr(fitted, name) == pytest.approx(value, rel=1e-6), name


def test_the_peak_is_the_resident_state_and_the_larger_of_step_and_optimizer():
    cost = TokenCost(1000.0, 0.0, 0.0)
    shape = MemoryShape.of(CONFIG, tokens=10, ttt_length=1)
    estimate = training_memory(shape, cost)
    assert estimate.resident == 12 * shape.trainable + 8 * 50 * 32
    assert estimate.step == 6 * shape.matmul_weights + 10 * (1000 + 8 * 48 + 4 * 20)
    assert estimate.peak == estimate.resident + max(estimate.step, estimate.optimizer)
    checkpointed = training_memory(
        dataclasses.replace(shape, tokens=10_000, checkpointed=True), cost
    )
    assert checkpointed.peak == checkpointed.resident + checkpointed.step
