"""The draft model's math against a slow reference written position by position, the way vLLM
runs it at inference: step k of the chain that starts at index i sees the prefill keys 0..i
and its own chain's keys, at rope position i + k."""

import gc
import math

import pytest
import torch

from eagle3_assets.lib.training.eagle3_model import (
    DrafterConfig,
    Eagle3Drafter,
    StepWeights,
    columns_linear,
)

CONFIG = DrafterConfig(
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=48,
    vocab_size=50,
    draft_vocab_size=20,
)


def rms(x, weight, eps=1e-6):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x, position, theta=10000.0):
    dim = x.shape[-1]
    inverse = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.cat([position * inverse] * 2)
    first, second = x.chunk(2, dim=-1)
    return x * angles.cos() + torch.cat([-second, first], dim=-1) * angles.sin()


def reference_chain(model, aux, ids, start, steps):
    """Pre-norm outputs of the chain starting at index `start`, one query at a time."""
    weight = {name: p.double() for name, p in model.named_parameters()}
    embed = model.embed_tokens.double()

    def inputs(hidden, token):
        normed = rms(hidden, weight["midlayer.hidden_norm.weight"])
        x = torch.cat([rms(embed[token], weight["midlayer.input_layernorm.weight"]), normed])
        return x, normed

    def project(x, position):
        q = (weight["midlayer.self_attn.q_proj.weight"] @ x).view(4, 16)
        k = (weight["midlayer.self_attn.k_proj.weight"] @ x).view(2, 16)
        v = (weight["midlayer.self_attn.v_proj.weight"] @ x).view(2, 16)
        k, v = k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)
        return rope(q, position), rope(k, position), v

    def finish(hidden, mixed):
        r = weight["midlayer.self_attn.o_proj.weight"] @ mixed.reshape(-1) + hidden
        y = rms(r, weight["midlayer.post_attention_layernorm.weight"])
        gate = weight["midlayer.mlp.gate_proj.weight"] @ y
        up = weight["midlayer.mlp.up_proj.weight"] @ y
        return weight["midlayer.mlp.down_proj.weight"] @ (torch.nn.functional.silu(gate) * up) + r

    fc = weight["fc.weight"]
    prefill = [project(inputs(fc @ aux[i], ids[i])[0], i) for i in range(start + 1)]
    keys = [k for _, k, _ in prefill]
    values = [v for _, _, v in prefill]
    hidden = fc @ aux[start]
    outputs = []
    for k in range(steps):
        x, _ = inputs(hidden, ids[start + k])
        q, key, value = project(x, start + k)
        if k > 0:
            keys, values = [*keys, key], [*values, value]
        else:
            q = prefill[start][0]
        scores = torch.stack([(q * kk).sum(-1) for kk in keys], dim=-1) / math.sqrt(16)
        mixed = (scores.softmax(-1)[..., None] * torch.stack(values, dim=1)).sum(1)
        hidden = finish(hidden, mixed)
        outputs.append(hidden)
    return outputs


@pytest.mark.parametrize("steps", [1, 3])
def test_ttt_equals_the_step_by_step_chain(steps):
    torch.manual_seed(0)
    model = Eagle3Drafter(CONFIG, torch.randn(50, 32)).double()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    S = 6
    aux = torch.randn(1, S, 96, dtype=torch.float64)
    ids = torch.randint(0, 50, (1, S + steps - 1))
    outputs = model.ttt(aux, ids, steps)
    for start in range(S):
        expected = reference_chain(model, aux[0], ids[0], start, steps)
        for k in range(steps):
            # norms, rope and softmax run in float32 inside the model: 1e-5, not 1e-12
            torch.testing.assert_close(outputs[k][0, start], expected[k], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("autocast", [False, True], ids=["float64", "bf16-autocast"])
def test_chained_weight_gradients_equal_plain_autograd(monkeypatch, autocast):
    """StepWeights computes each shared weight's gradient as one product over the steps:
    the same gradients as autograd's per-step products, for every parameter; under bf16
    autocast (the GPU recipe, here on the CPU) to bf16's precision, in fp32 weights."""
    dtype = torch.float32 if autocast else torch.float64
    torch.manual_seed(2)
    model = Eagle3Drafter(CONFIG, torch.randn(50, 32)).to(dtype)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    steps, S = 3, 5
    aux, ids = torch.randn(2, S, 96, dtype=dtype), torch.randint(0, 50, (2, S + 2))
    mask = torch.tensor([[True] * S, [True, True, True, False, False]])
    weights = torch.randn(steps, 2, S, CONFIG.draft_vocab_size, dtype=dtype)

    def gradients() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        chain = StepWeights()
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            outputs = model.ttt(aux, ids, steps, key_mask=mask, chain=chain)
            loss = sum(
                (model.logits(pre, chain) * w).sum()
                for pre, w in zip(outputs, weights, strict=True)
            )
        loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    tolerance = {"rtol": 2e-2, "atol": 2e-2} if autocast else {"rtol": 1e-10, "atol": 1e-12}
    chained = gradients()
    monkeypatch.setattr(
        StepWeights, "linear", lambda self, *args, **kw: columns_linear(*args, **kw)
    )
    plain = gradients()
    assert set(chained) == set(plain) == {n for n, p in model.named_parameters()}
    for name, grad in plain.items():
        assert grad.abs().max() > 0, name  # every weight takes part
        assert chained[name].dtype == dtype, name  # the weight's, not the autocast dtype
        torch.testing.assert_close(chained[name], grad, **tolerance, msg=name)


def test_a_chain_leaves_no_tensor_behind():
    """What StepWeights keeps for backward is freed with the step: a kept input still tied to
    its graph would form a cycle through autograd's nodes, which Python's gc cannot see, and
    every step would leak its activations."""
    model = Eagle3Drafter(CONFIG, torch.randn(50, 32))
    aux, ids = torch.randn(2, 5, 96), torch.randint(0, 50, (2, 7))

    def step() -> None:
        chain = StepWeights()
        outputs = model.ttt(aux, ids, 3, chain=chain)
        sum(model.logits(pre, chain).sum() for pre in outputs).backward()
        model.zero_grad(set_to_none=True)

    def live_tensors() -> int:
        gc.collect()
        return sum(type(o) in (torch.Tensor, torch.nn.Parameter) for o in gc.get_objects())

    step()
    before = live_tensors()
    step()
    assert live_tensors() == before


def test_step_weights_columns_read_by_no_step_get_zero_gradient():
    torch.manual_seed(3)
    weight = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 2, dtype=torch.float64)
    chain = StepWeights()
    (chain.linear(x, weight, start=2) * torch.arange(4.0)).sum().backward()
    expected = torch.zeros(4, 6, dtype=torch.float64)
    expected[:, 2:4] = torch.arange(4.0, dtype=torch.float64)[:, None] * x.sum(0)
    torch.testing.assert_close(weight.grad, expected)


def test_padding_keys_are_invisible_and_produce_no_nan():
    torch.manual_seed(1)
    model = Eagle3Drafter(CONFIG, torch.randn(50, 32))
    aux, ids = torch.randn(2, 5, 96), torch.randint(0, 50, (2, 7))
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    padded = model.ttt(aux, ids, 3, key_mask=mask)
    alone = model.ttt(aux[1:, :3], ids[1:, :5], 3)
    for k in range(3):
        assert torch.isfinite(padded[k]).all()
        torch.testing.assert_close(padded[k][1, :3], alone[k][0], rtol=1e-5, atol=1e-5)


def test_embed_tokens_must_be_the_targets_and_is_not_saved():
    with pytest.raises(ValueError, match=r"embed_tokens: expected the target's \[50, 32\]"):
        Eagle3Drafter(CONFIG, torch.zeros(49, 32))
    embed = torch.zeros(50, 32)
    model = Eagle3Drafter(CONFIG, embed)
    # the target's tensor itself, shared with the teacher's head: one copy in memory
    assert model.embed_tokens.data_ptr() == embed.data_ptr()
    names = set(model.state_dict())
    # exactly the names SpecForge saves and vLLM's llama_eagle3 loads: no embedding, no rope
    # table, no wrapper prefix
    layer = [f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm")]
    layer += [f"midlayer.mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
    layer += ["midlayer.post_attention_layernorm.weight"]
    layer += [f"midlayer.self_attn.{n}_proj.weight" for n in ("q", "k", "v", "o")]
    assert names == {"d2t", "t2d", "fc.weight", "norm.weight", "lm_head.weight", *layer}
