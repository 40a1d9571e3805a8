"""The draft model's math against a slow reference written position by position, the way vLLM
runs it at inference: step k of the chain that starts at index i sees the prefill keys 0..i
and its own chain's keys, at rope position i + k."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from eagle3_assets.lib.training import eagle3_model
from eagle3_assets.lib.training.eagle3_model import (
    DrafterConfig,
    Eagle3Drafter,
)
from eagle3_assets.lib.training.ttt import Batch, supervised_samples, ttt_loss

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


def dense_attention(key_mask):
    """`ttt`'s attention as it was before `ttt_attention`, copied: a [B, heads, S, S] masked
    softmax. The reference the fused one must equal; its softmax runs in float64 for
    float64 inputs (the original's `.float()` would cap the comparison at float32's)."""

    def attention(q, base_keys, base_values, chain_keys, chain_values, scale):
        S = q.shape[-2]
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        own = torch.eye(S, dtype=torch.bool)
        visible = causal & (key_mask[:, None, None, :].bool() | own)
        scores = (q @ base_keys.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        diagonal = [(q * ck).sum(-1, keepdim=True) * scale for ck in chain_keys]
        exact = torch.promote_types(q.dtype, torch.float32)
        weights = torch.softmax(torch.cat([scores, *diagonal], dim=-1).to(exact), dim=-1)
        weights = weights.to(base_values.dtype)
        mixed = weights[..., :S] @ base_values
        for j, cv in enumerate(chain_values):
            mixed = mixed + weights[..., S + j : S + j + 1] * cv
        return mixed

    return attention


def padded_chain(dtype, steps, lengths, S, seed=4):
    """A model (weights of std 0.3) and right-padded inputs: rows of `lengths` real
    positions out of S, the loss's weights zero at padding (the training loss's mask)."""
    torch.manual_seed(seed)
    model = Eagle3Drafter(CONFIG, torch.randn(50, 32)).to(dtype)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    B = len(lengths)
    aux = torch.randn(B, S, 96, dtype=dtype)
    ids = torch.randint(0, 50, (B, S + steps - 1))
    mask = torch.arange(S) < torch.tensor(lengths)[:, None]
    weights = torch.randn(steps, B, S, CONFIG.draft_vocab_size, dtype=dtype) * mask[..., None]
    return model, aux, ids, mask, weights


def run_chain(model, aux, ids, mask, weights, autocast=False):
    """(outputs, every parameter's gradient) of one forward and backward of `ttt`."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        outputs = model.ttt(aux, ids, len(weights), key_mask=mask)
        loss = sum((model.logits(pre) * w).sum() for pre, w in zip(outputs, weights, strict=True))
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return [pre.detach() for pre in outputs], grads


@pytest.mark.parametrize("steps", [1, 3, 7])
def test_fused_attention_equals_the_dense_one_and_the_chain_with_padding(monkeypatch, steps):
    lengths = [9, 6, 3]
    model, aux, ids, mask, weights = padded_chain(torch.float64, steps, lengths, S=9)
    outputs, grads = run_chain(model, aux, ids, mask, weights)
    monkeypatch.setattr(eagle3_model, "ttt_attention", dense_attention(mask))
    dense_outputs, dense_grads = run_chain(model, aux, ids, mask, weights)
    exact = {"rtol": 0.0, "atol": 1e-10}
    for k in range(steps):
        assert torch.isfinite(outputs[k]).all()  # padding queries too
        for row, length in enumerate(lengths):
            torch.testing.assert_close(
                outputs[k][row, :length], dense_outputs[k][row, :length], **exact
            )
    assert set(grads) == {name for name, _ in model.named_parameters()}
    for name, grad in dense_grads.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(grads[name], grad, **exact, msg=name)
    for row, length in enumerate(lengths):
        for start in range(length):
            expected = reference_chain(model, aux[row], ids[row], start, steps)
            for k in range(steps):
                # rope and norms run in float32 inside the model, both attentions alike
                torch.testing.assert_close(
                    outputs[k][row, start], expected[k], rtol=1e-5, atol=1e-5
                )


def test_bf16_autocast_runs_the_fused_attention_in_bf16(monkeypatch):
    """The GPU recipe's dtype, on the CPU's bf16 flash kernel: its outputs and gradients
    within bf16's precision of float32's."""
    model, aux, ids, mask, weights = padded_chain(torch.float32, 3, [8, 5], S=8)
    fused = eagle3_model.ttt_attention
    dtypes = set()

    def recording(q, *args):
        dtypes.add(q.dtype)
        return fused(q, *args)

    monkeypatch.setattr(eagle3_model, "ttt_attention", recording)
    outputs, grads = run_chain(model, aux, ids, mask, weights, autocast=True)
    assert dtypes == {torch.bfloat16}
    dtypes.clear()
    expected_outputs, expected_grads = run_chain(model, aux, ids, mask, weights)
    assert dtypes == {torch.float32}
    # bf16 keeps 8 significant bits (2**-8 = 0.4% per rounding), and a step rounds a dozen
    # times (projections, attention, o_proj, MLP): over seeds 0-4 the errors are <= 1% of an
    # output's largest entry and <= 2% of a gradient's, as large as the dense attention's
    # under the same autocast; 4% leaves twice that
    for k, (pre, expected) in enumerate(zip(outputs, expected_outputs, strict=True)):
        for row, length in enumerate([8, 5]):
            error = (pre[row, :length] - expected[row, :length]).abs().max()
            assert error <= 0.04 * expected[row, :length].abs().max(), k
    for name, expected in expected_grads.items():
        assert grads[name].dtype == torch.float32, name
        assert (grads[name] - expected).abs().max() <= 0.04 * expected.abs().max(), name


class _CreatedShapes(TorchDispatchMode):
    """Records the shape of every tensor any op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.shapes |= {tuple(t.shape) for t in tree_leaves(result) if isinstance(t, torch.Tensor)}
        return result


@pytest.mark.parametrize("attention", ["fused", "dense"])
def test_no_tensor_is_sequence_by_sequence(monkeypatch, attention):
    """Memory linear in S: no tensor with two dimensions of S to S + steps (an S x S score
    matrix, with or without the chain's columns) is saved for backward or created, forward or
    backward (S = 80, none of the model's widths); the dense attention, which has them, shows
    the check can fail."""
    S, steps = 80, 3
    model, aux, ids, mask, weights = padded_chain(torch.float32, steps, [S, 50], S=S)
    if attention == "dense":
        monkeypatch.setattr(eagle3_model, "ttt_attention", dense_attention(mask))
    saved: set[tuple[int, ...]] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.add(tuple(tensor.shape))
        return tensor

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
        _CreatedShapes() as created,
    ):
        run_chain(model, aux, ids, mask, weights)

    def quadratic(shapes: set[tuple[int, ...]]) -> set[tuple[int, ...]]:
        return {shape for shape in shapes if sum(S <= d <= S + steps for d in shape) >= 2}

    if attention == "fused":
        assert quadratic(saved) == quadratic(created.shapes) == set()
    else:
        assert {(2, 4, S, S), (2, 4, S, S + steps - 1)} <= quadratic(saved) & quadratic(
            created.shapes
        )


def test_padding_on_the_left_is_refused():
    """Causality hides padding keys from the real queries only when the padding is last."""
    model = Eagle3Drafter(CONFIG, torch.randn(50, 32))
    aux, ids = torch.randn(2, 5, 96), torch.randint(0, 50, (2, 7))
    mask = torch.tensor([[True] * 5, [False, False, True, True, True]])
    with pytest.raises(ValueError, match="key_mask: padding must be on the right"):
        model.ttt(aux, ids, 3, key_mask=mask)


def synthetic_batch(lengths, S, steps, seed=5) -> Batch:
    """Right-padded rows of `lengths` real positions out of S, random teachers, a few
    positions unsupervised."""
    generator = torch.Generator().manual_seed(seed)
    B = len(lengths)
    real = torch.arange(S) < torch.tensor(lengths)[:, None]
    supervised = torch.rand(B, S + steps, generator=generator) > 0.2
    supervised[:, :S] &= real
    supervised[:, S:] = False
    logits = torch.randn(B, S + steps, CONFIG.draft_vocab_size, generator=generator)
    return Batch(
        aux=torch.randn(B, S, 96, generator=generator, dtype=torch.float64),
        input_ids=torch.randint(0, 50, (B, S + steps - 1), generator=generator),
        key_mask=real,
        targets=logits.double().softmax(-1),
        supervised=supervised,
    )


def loss_and_grads(model, batch, steps, divisors=None, autocast=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        loss, losses, hits, counts, _ = ttt_loss(model, batch, steps, 0.8, divisors)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return (float(loss), losses, hits, counts), grads


@pytest.mark.parametrize("autocast", [False, True])
def test_checkpointed_steps_give_the_same_loss_and_gradients(autocast):
    """Backward recomputes each step (layer, logits, loss) under the forward's autocast:
    the same numbers, bit for bit."""
    dtype = torch.float32 if autocast else torch.float64
    model, *_ = padded_chain(dtype, 3, [9], S=9)
    batch = synthetic_batch([9, 6, 3], S=9, steps=3)
    batch.aux, batch.targets = batch.aux.to(dtype), batch.targets.to(dtype)
    plain, plain_grads = loss_and_grads(model, batch, 3, autocast=autocast)
    model.checkpoint_steps = True
    checkpointed, checkpointed_grads = loss_and_grads(model, batch, 3, autocast=autocast)
    assert checkpointed == plain
    for name, grad in plain_grads.items():
        assert grad.abs().max() > 0, name
        assert torch.equal(checkpointed_grads[name], grad), name


def test_ranks_with_unequal_batches_average_to_the_one_process_gradient():
    """A token budget gives ranks different sample counts: each step's loss divided by the
    total over the ranks / world size makes the ranks' mean gradient the one of all their
    samples in one batch (each rank padded only to its own longest)."""
    steps, lengths = 3, [9, 4, 7]
    model, *_ = padded_chain(torch.float64, steps, [9], S=9)
    union = synthetic_batch(lengths, S=9, steps=steps)
    (_, union_losses, union_hits, _), union_grads = loss_and_grads(model, union, steps)

    def rows(picked, S):
        cut = {"aux": S, "input_ids": S + steps - 1, "key_mask": S, "targets": S + steps}
        fields = {name: getattr(union, name)[picked, : cut.get(name, S + steps)] for name in
                  ("aux", "input_ids", "key_mask", "targets", "supervised")}  # fmt: skip
        return Batch(**fields)

    ranks = [rows([0], 9), rows([1, 2], 7)]
    totals = [
        sum(counts) for counts in zip(*(supervised_samples(r, steps) for r in ranks), strict=True)
    ]
    assert totals == supervised_samples(union, steps) and totals[0] == 3
    divisors = [total / len(ranks) for total in totals]
    results = [loss_and_grads(model, rank, steps, divisors) for rank in ranks]
    for name, grad in union_grads.items():
        mean = sum(grads[name] for _, grads in results) / len(ranks)
        torch.testing.assert_close(mean, grad, rtol=0.0, atol=1e-12, msg=name)
    reported = [
        sum(values) / len(ranks) for values in zip(*(r[0][1] for r in results), strict=True)
    ]
    assert reported == pytest.approx(union_losses, rel=1e-12)  # the mean of the ranks' losses
    assert [sum(hits) for hits in zip(*(r[0][2] for r in results), strict=True)] == union_hits
