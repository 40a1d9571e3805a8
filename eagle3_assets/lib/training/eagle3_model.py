"""The EAGLE-3 draft model, as vLLM serves it (vllm/model_executor/models/llama_eagle3.py).

One Llama decoder layer that reads two things at each position p: the target's aux states at p
(three layers, concatenated, mapped to H by `fc`) and the embedding of the token at p + 1
(the target's embedding, frozen, never saved). It predicts the token at p + 2 over a smaller
draft vocab; `d2t` maps a draft id to its target id (target = draft + d2t[draft]), `t2d` marks
the target ids the draft vocab holds.

    x   = input_layernorm(embed(token))          hn  = hidden_norm(h)
    a   = o_proj(attention(cat[x, hn]))          (q, k, v read 2H)
    r   = a + (hn if norm_before_residual else h)
    pre = mlp(post_attention_layernorm(r)) + r   logits = lm_head(norm(pre))

`pre` is the hidden the next draft step reads (vLLM feeds it back, with the next token, one
position further on). State-dict names are vLLM's and SpecForge's: `fc.weight`, `midlayer.*`,
`norm.weight`, `lm_head.weight`, `d2t`, `t2d`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    num_aux_hidden_states: int = 3
    target_hidden_size: int | None = None  # when the target is wider than the drafter
    norm_before_residual: bool = False  # speculators' variant: the residual is hidden_norm(h)

    @property
    def aux_width(self) -> int:
        return self.num_aux_hidden_states * (self.target_hidden_size or self.hidden_size)


def scratch_config(target: dict, draft_vocab_size: int) -> DrafterConfig:
    """A drafter shaped like the target's layers (the usual EAGLE-3 choice), from its
    config.json fields (the language model's, for multimodal configs)."""
    hidden, heads = target["hidden_size"], target["num_attention_heads"]
    rope = target.get("rope_parameters") or target.get("rope_scaling") or {}
    return DrafterConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=target.get("num_key_value_heads") or heads,
        head_dim=target.get("head_dim") or hidden // heads,
        intermediate_size=target["intermediate_size"],
        vocab_size=target["vocab_size"],
        draft_vocab_size=min(draft_vocab_size, target["vocab_size"]),
        rms_norm_eps=target.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", target.get("rope_theta", 10000.0)),
        max_position_embeddings=target.get("max_position_embeddings", 4096),
    )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Rotary(nn.Module):
    """Llama's rotary embedding (no scaling)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inverse = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inverse_frequency", inverse, persistent=False)

    def table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [length, D] of positions 0..length-1: computed once per chain, sliced
        per step (step k's positions are k..k+S-1)."""
        positions = torch.arange(length, device=self.inverse_frequency.device)
        angles = positions[:, None].float() * self.inverse_frequency
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, heads, S, D] rotated by cos and sin [S, D]."""
        return (x.float() * cos + rotate_half(x.float()) * sin).to(x.dtype)


class Attention(nn.Module):
    """q, k and v read cat[input_layernorm(embed(token)), hidden_norm(h)] (2H, vLLM's order).
    Their token half depends only on the token's index, the same at every TTT step (step k
    reads the tokens k..k+S-1): it is projected once for the whole chain, and `project` adds
    only the hidden half at each step, the same sums in another order."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        heads, kv_heads, dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.hidden_size = config.hidden_size
        self.q_proj = nn.Linear(2 * config.hidden_size, heads * dim, bias=False)
        self.k_proj = nn.Linear(2 * config.hidden_size, kv_heads * dim, bias=False)
        self.v_proj = nn.Linear(2 * config.hidden_size, kv_heads * dim, bias=False)
        self.o_proj = nn.Linear(heads * dim, config.hidden_size, bias=False)
        self.rotary = Rotary(dim, config.rope_theta)

    def split_weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """q, k and v's weights as (token columns, hidden columns): split once per chain, so
        autograd sums each half's gradient over the steps and writes each weight's once."""
        halves = [
            p.weight.split(self.hidden_size, dim=1) for p in (self.q_proj, self.k_proj, self.v_proj)
        ]
        return [token for token, _ in halves], [hidden for _, hidden in halves]

    def project(
        self,
        tokens: list[torch.Tensor],
        hidden: torch.Tensor,
        hidden_weights: list[torch.Tensor],
        cos: torch.Tensor,
        sin: torch.Tensor,
    ):
        """q [B, heads, S, D], k and v [B, heads, S, D] (kv heads repeated), rotated: the
        token halves [B, S, ·] (this step's slice) plus hidden [B, S, H] times the weights'
        hidden columns."""
        B, S, _ = hidden.shape
        q, k, v = (t + F.linear(hidden, w) for t, w in zip(tokens, hidden_weights, strict=True))
        q = q.view(B, S, self.heads, self.dim).transpose(1, 2)
        k = k.view(B, S, self.kv_heads, self.dim).transpose(1, 2)
        v = v.view(B, S, self.kv_heads, self.dim).transpose(1, 2)
        repeat = self.heads // self.kv_heads
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        return Rotary.rotate(q, cos, sin), Rotary.rotate(k, cos, sin), v


def _causal_flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(out, lse, kernel_state) of causal attention by the fused flash kernel, which creates
    no S x S tensor and returns the log-sum-exp `_TTTAttention` merges with; kernel_state:
    what its backward takes besides q, k, v, out and lse."""
    if q.device.type == "cpu":  # float64, float32, bfloat16 and float16
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, True, scale=scale
        )
        return out, lse, ()
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
            torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, True, False, scale=scale
            )
        )
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    raise ValueError(
        f"TTT attention: no flash kernel for {q.dtype} on {q.device.type} "
        "(CUDA needs float16 or bfloat16: train under autocast)"
    )


def _causal_flash_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    kernel_state: tuple,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of the keys `_causal_flash` saw, for the softmax whose output and
    log-sum-exp are `out` and `lse`: the kernel recomputes P = exp(s - lse) and
    D = rowsum(grad * out) from them, so passing a wider softmax's gives that softmax's."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, True, scale=scale
        )
    cum_q, cum_k, max_q, max_k, seed, offset = kernel_state
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale
    )


class _TTTAttention(torch.autograd.Function):
    """Attention over step 0's keys 0..i (causal, the flash kernel) and one extra key per
    chain step at index i itself: the causal part's log-sum-exp merged with the k diagonal
    scores, in float32 at least. Its backward runs the flash backward with the merged
    output and log-sum-exp, and adds the diagonal keys' terms by hand. Saves and creates
    only [B, heads, S, ·] tensors: memory linear in S."""

    @staticmethod
    def forward(ctx, scale: float, q: torch.Tensor, *keys_values: torch.Tensor):
        base_k, base_v, *chain = keys_values
        chain_k, chain_v = chain[: len(chain) // 2], chain[len(chain) // 2 :]
        base_out, base_lse, kernel_state = _causal_flash(q, base_k, base_v, scale)
        exact = base_lse.dtype  # float32, or float64 for float64 inputs
        qx = q.to(exact)
        diagonal = [(qx * ck.to(exact)).sum(-1) * scale for ck in chain_k]
        lse = torch.stack([base_lse, *diagonal], dim=-1).logsumexp(-1)
        mixed = (base_lse - lse).exp()[..., None] * base_out.to(exact)
        for score, cv in zip(diagonal, chain_v, strict=True):
            mixed = mixed + (score - lse).exp()[..., None] * cv.to(exact)
        out = torch.empty_like(base_out).copy_(mixed)  # the layouts the kernel gave
        lse = torch.empty_like(base_lse).copy_(lse)
        ctx.save_for_backward(q, base_k, base_v, out, lse, *chain_k, *chain_v)
        ctx.scale, ctx.kernel_state = scale, kernel_state
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, base_k, base_v, out, lse, *chain = ctx.saved_tensors
        chain_k, chain_v = chain[: len(chain) // 2], chain[len(chain) // 2 :]
        scale = ctx.scale
        dq, dk, dv = _causal_flash_backward(
            grad, q, base_k, base_v, out, lse, ctx.kernel_state, scale
        )
        exact = lse.dtype
        gx, qx = grad.to(exact), q.to(exact)
        rowsum = (gx * out.to(exact)).sum(-1)  # D, as the kernel computed it
        dq = dq.to(exact)
        dchain_k, dchain_v = [], []
        for ck, cv in zip(chain_k, chain_v, strict=True):
            ckx = ck.to(exact)
            p = ((qx * ckx).sum(-1) * scale - lse).exp()
            dscore = p * ((gx * cv.to(exact)).sum(-1) - rowsum) * scale
            dq = dq + dscore[..., None] * ckx
            dchain_k.append((dscore[..., None] * qx).to(ck.dtype))
            dchain_v.append((p[..., None] * gx).to(cv.dtype))
        return None, dq.to(q.dtype), dk, dv, *dchain_k, *dchain_v


def ttt_attention(
    q: torch.Tensor,
    base_keys: torch.Tensor,
    base_values: torch.Tensor,
    chain_keys: Sequence[torch.Tensor],
    chain_values: Sequence[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """Step k's attention, all [B, heads, S, D]: the query at index i over step 0's keys
    0..i and the chain's keys of steps 1..k at index i (`chain_keys`, k of them)."""
    return _TTTAttention.apply(scale, q, base_keys, base_values, *chain_keys, *chain_values)


class MLP(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = MLP(config)
        self.norm_before_residual = config.norm_before_residual


class Eagle3Drafter(nn.Module):
    def __init__(self, config: DrafterConfig, embed_tokens: torch.Tensor) -> None:
        super().__init__()
        if tuple(embed_tokens.shape) != (config.vocab_size, config.hidden_size):
            raise ValueError(
                f"embed_tokens: expected the target's [{config.vocab_size}, "
                f"{config.hidden_size}], found {list(embed_tokens.shape)}"
            )
        self.config = config
        self.fc = nn.Linear(config.aux_width, config.hidden_size, bias=False)
        self.midlayer = MidLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        # the target's, frozen: the caller's tensor itself on the caller's device (4.7 GB of
        # fp32 at Kimi's vocab), not a buffer, so that neither the checkpoint (vLLM shares the
        # target's), nor `.to()`, nor DistributedDataParallel's start copies it
        self.embed_tokens = embed_tokens.detach()
        self.checkpoint_steps = False  # recompute each TTT step in backward (`ttt`)

    def forward(
        self,
        aux: torch.Tensor,
        input_ids: torch.Tensor,
        steps: int,
        key_mask: torch.Tensor | None = None,
        readout: Callable[[int, torch.Tensor], Any] | None = None,
    ) -> list:
        """Per TTT step k, `readout(k, logits)` of its draft-vocab logits [B, S, draft vocab]
        (`ttt`), or the logits themselves. Training reads its loss out inside the step, so
        that `checkpoint_steps` can recompute the logits with the layer."""

        def head(k: int, pre: torch.Tensor) -> Any:
            logits = self.logits(pre)
            return logits if readout is None else readout(k, logits)

        return self.ttt(aux, input_ids, steps, key_mask, head)

    def logits(self, pre: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(pre))

    def ttt(
        self,
        aux: torch.Tensor,
        input_ids: torch.Tensor,
        steps: int,
        key_mask: torch.Tensor | None = None,
        readout: Callable[[int, torch.Tensor], Any] | None = None,
    ) -> list:
        """Training-time test: per chained draft step k, `readout(k, pre)` of its pre-norm
        output [B, S, H] (None: `pre` itself). Step 0 reads fc(aux) [B, S, aux_width] with
        tokens `input_ids[:, k : k + S]` (the caller passes S + steps - 1 ids: the token after
        each position and the steps' further tokens); step k reads step k-1's output at the
        same index, the token k further on, at rope position index + k. Attention is vLLM's at
        inference: step k's query at index i sees step 0's keys 0..i and its own chain's keys
        of steps 1..k (index i), by `ttt_attention`: no S x S tensor, memory linear in S.
        `key_mask` [B, S] marks the real positions, padding on the right (checked), where
        causality already hides it from every real query (a padding query's output is finite
        and never supervised). With `checkpoint_steps`, backward recomputes each step (layer
        and readout) from its input: a step keeps only that input, its keys and values and
        what the readout returns."""
        attention = self.midlayer.self_attn
        S = aux.shape[1]
        length = S + steps - 1  # the token indices the chain reads, all steps together
        token_weights, hidden_weights = attention.split_weights()
        embeds = self.midlayer.input_layernorm(self.embed_tokens[input_ids[:, :length]])
        token_parts = [F.linear(embeds, weight) for weight in token_weights]
        cos, sin = attention.rotary.table(length)
        if key_mask is not None:
            real = key_mask.bool()
            if bool((real[:, 1:] & ~real[:, :-1]).any()):  # a real key after a padding one
                raise ValueError("key_mask: padding must be on the right of each row")
        hidden = self.fc(aux)
        keys: tuple[torch.Tensor, ...] = ()  # tuples: a recomputed step sees what it saw
        values: tuple[torch.Tensor, ...] = ()
        results = []
        for k in range(steps):
            tokens = [part[:, k : k + S] for part in token_parts]
            step = partial(
                self._step, tokens, hidden_weights, cos[k : k + S], sin[k : k + S], readout
            )
            if self.checkpoint_steps and torch.is_grad_enabled():
                hidden, key, value, result = checkpoint(
                    step, k, hidden, keys, values, use_reentrant=False
                )
            else:
                hidden, key, value, result = step(k, hidden, keys, values)
            keys, values = (*keys, key), (*values, value)
            results.append(result)
        return results

    def _step(
        self,
        tokens: list[torch.Tensor],
        hidden_weights: list[torch.Tensor],
        cos: torch.Tensor,
        sin: torch.Tensor,
        readout: Callable[[int, torch.Tensor], Any] | None,
        k: int,
        hidden: torch.Tensor,
        keys: tuple[torch.Tensor, ...],
        values: tuple[torch.Tensor, ...],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """TTT step k: (pre, its keys, its values, readout(k, pre)); `keys` and `values`:
        the earlier steps'."""
        layer = self.midlayer
        attention = layer.self_attn
        B, S, _ = hidden.shape
        normed = layer.hidden_norm(hidden)
        q, key, value = attention.project(tokens, normed, hidden_weights, cos, sin)
        keys, values = (*keys, key), (*values, value)
        mixed = ttt_attention(q, keys[0], values[0], keys[1:], values[1:], attention.dim**-0.5)
        mixed = mixed.transpose(1, 2).reshape(B, S, -1)
        residual = normed if layer.norm_before_residual else hidden
        residual = attention.o_proj(mixed) + residual
        pre = layer.mlp(layer.post_attention_layernorm(residual)) + residual
        return pre, key, value, pre if readout is None else readout(k, pre)
