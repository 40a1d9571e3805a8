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

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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


def columns_linear(x: torch.Tensor, weight: torch.Tensor, start: int = 0) -> torch.Tensor:
    """x [..., n] times the weight's columns start..start + n (x @ weight[:, cols].T)."""
    return F.linear(x, weight[:, start : start + x.shape[-1]])


class _ChainedWeight(torch.autograd.Function):
    """The weight as every step of one chain reads it (an alias). Its backward runs once all
    the steps' have: the weight's gradient as one product over every step's rows per block
    of columns, written in place, from the (output gradient, input, first column) triples
    that `_ChainedLinear` kept."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, uses: list) -> torch.Tensor:
        ctx.uses, ctx.dtype, ctx.shape = uses, weight.dtype, weight.shape
        ctx.set_materialize_grads(False)  # the steps pass none: no weight-sized zeros
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, unused: torch.Tensor | None):
        uses = list(ctx.uses)
        ctx.uses.clear()  # every step's pair is here: free them now
        if not uses:  # no step's output reached the loss
            return None, None
        first = uses[0][0]
        widths = {start: x.shape[-1] for _, x, start in uses}  # blocks of columns read
        out, width = first.shape[-1], ctx.shape[1]
        whole = sum(widths.values()) == width  # else zeros where no step read
        grad = first.new_empty(out, width) if whole else first.new_zeros(out, width)
        for start, columns in sorted(widths.items()):
            block = [(g, x) for g, x, s in uses if s == start]
            grads = torch.cat([g.reshape(-1, out) for g, _ in block])
            inputs = torch.cat([x.reshape(-1, columns) for _, x in block])
            torch.mm(grads.T, inputs, out=grad[:, start : start + columns])
        return grad.to(ctx.dtype), None


class _ChainedLinear(torch.autograd.Function):
    """F.linear of x over the weight's columns start..start + x's width. Its backward gives
    x's gradient and keeps the rest for the weight's `_ChainedWeight`; in the autocast
    dtype when autocast is on (the output's)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, uses: list, start: int):
        ctx.save_for_backward(x, weight)
        ctx.uses, ctx.start = uses, start
        return columns_linear(x, weight, start)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        # detached: a kept input with its graph would tie the list to it in a cycle
        ctx.uses.append((grad, x.detach().to(grad.dtype), ctx.start))
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        columns = weight[:, ctx.start : ctx.start + x.shape[-1]]
        return grad @ columns.to(grad.dtype), None, None, None


class StepWeights:
    """Multiplies by the weights that every TTT step reads (q, k, v, o_proj, the MLP,
    lm_head). Plain autograd computes such a weight's gradient once per step, a [out, S] x
    [S, in] product that is memory-bound at short S, and adds the steps' weight-sized
    results; here it is one product over all steps' rows, written into one new tensor when
    backward reaches the weight: the same sums, fewer and larger matmuls, no weight-sized
    temporaries. One per chain; without autograd (no_grad) it is F.linear."""

    def __init__(self) -> None:
        self._aliases: dict[torch.Tensor, tuple[torch.Tensor, list]] = {}  # by identity

    def linear(self, x: torch.Tensor, weight: torch.Tensor, start: int = 0) -> torch.Tensor:
        """`columns_linear`, its weight gradient chained."""
        if not torch.is_grad_enabled():
            return columns_linear(x, weight, start)
        if weight not in self._aliases:
            uses: list = []
            self._aliases[weight] = (_ChainedWeight.apply(weight, uses), uses)
        alias, uses = self._aliases[weight]
        return _ChainedLinear.apply(x, alias, uses, start)


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
    reads the tokens k..k+S-1): `token_projections` runs it once for the whole chain, and
    `project` adds only the hidden half at each step, the same sums in another order."""

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

    def qkv_weights(self) -> list[torch.Tensor]:
        return [p.weight for p in (self.q_proj, self.k_proj, self.v_proj)]

    def token_projections(self, embeds: torch.Tensor, chain: StepWeights) -> list[torch.Tensor]:
        """The token half of q, k, v for every index of the chain: embeds [B, L, H] (normed)."""
        return [chain.linear(embeds, weight) for weight in self.qkv_weights()]

    def project(
        self,
        tokens: list[torch.Tensor],
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        chain: StepWeights,
    ):
        """q [B, heads, S, D], k and v [B, heads, S, D] (kv heads repeated), rotated: the
        token halves [B, S, ·] (this step's slice) plus the hidden half of hidden [B, S, H]."""
        B, S, _ = hidden.shape
        H = self.hidden_size
        q, k, v = (
            t + chain.linear(hidden, w, start=H)
            for t, w in zip(tokens, self.qkv_weights(), strict=True)
        )
        q = q.view(B, S, self.heads, self.dim).transpose(1, 2)
        k = k.view(B, S, self.kv_heads, self.dim).transpose(1, 2)
        v = v.view(B, S, self.kv_heads, self.dim).transpose(1, 2)
        repeat = self.heads // self.kv_heads
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        return Rotary.rotate(q, cos, sin), Rotary.rotate(k, cos, sin), v


class MLP(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, chain: StepWeights) -> torch.Tensor:
        gate = chain.linear(x, self.gate_proj.weight)
        up = chain.linear(x, self.up_proj.weight)
        return chain.linear(F.silu(gate) * up, self.down_proj.weight)


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
        # the target's, frozen and not part of the checkpoint (vLLM shares the target's); the
        # caller's tensor itself, never a copy: 4.7 GB of fp32 at Kimi's vocab
        self.register_buffer("embed_tokens", embed_tokens.detach(), persistent=False)

    def logits(self, pre: torch.Tensor, chain: StepWeights | None = None) -> torch.Tensor:
        """Draft-vocab logits of `pre`; `chain`: the one `ttt` produced `pre` in."""
        return (chain or StepWeights()).linear(self.norm(pre), self.lm_head.weight)

    def ttt(
        self,
        aux: torch.Tensor,
        input_ids: torch.Tensor,
        steps: int,
        key_mask: torch.Tensor | None = None,
        chain: StepWeights | None = None,
    ) -> list[torch.Tensor]:
        """Training-time test: the pre-norm outputs of `steps` chained draft steps, [B, S, H]
        each. Step 0 reads fc(aux) [B, S, aux_width] with tokens `input_ids[:, k : k + S]`
        (the caller passes S + steps - 1 ids: the token after each position and the steps'
        further tokens); step k reads step k-1's output at the same index, the token k
        further on, at rope position index + k. Attention is vLLM's at inference: step k's query at
        index i sees step 0's keys 0..i and its own chain's keys of steps 1..k (index i), so
        the cost is one S x S score matrix plus S x k, never (S k) x (S k). `key_mask`
        [B, S] hides padding keys; `chain` (new if None) multiplies by the weights every
        step reads: pass the same one to `logits`."""
        chain = StepWeights() if chain is None else chain
        layer = self.midlayer
        attention = layer.self_attn
        B, S = aux.shape[:2]
        length = S + steps - 1  # the token indices the chain reads, all steps together
        token_parts = attention.token_projections(
            layer.input_layernorm(self.embed_tokens[input_ids[:, :length]]), chain
        )
        cos, sin = attention.rotary.table(length)
        hidden = self.fc(aux)
        causal = torch.ones(S, S, dtype=torch.bool, device=aux.device).tril()
        if key_mask is None:
            visible = causal
        else:  # a padding query still sees itself: no all -inf row, no NaN
            own = torch.eye(S, dtype=torch.bool, device=aux.device)
            visible = causal & (key_mask[:, None, None, :].bool() | own)
        scale = attention.dim**-0.5
        chain_keys: list[torch.Tensor] = []
        chain_values: list[torch.Tensor] = []
        outputs = []
        for k in range(steps):
            normed = layer.hidden_norm(hidden)
            tokens = [part[:, k : k + S] for part in token_parts]
            q, key, value = attention.project(tokens, normed, cos[k : k + S], sin[k : k + S], chain)
            if k == 0:
                base_keys, base_values = key, value
            else:
                chain_keys.append(key)
                chain_values.append(value)
            # [B, heads, S, S] over step 0's keys, then [B, heads, S, k] over the chain
            scores = (q @ base_keys.transpose(-1, -2)) * scale
            scores = scores.masked_fill(~visible, float("-inf"))
            diagonal = [(q * ck).sum(-1, keepdim=True) * scale for ck in chain_keys]
            weights = torch.softmax(torch.cat([scores, *diagonal], dim=-1).float(), dim=-1)
            weights = weights.to(value.dtype)
            mixed = weights[..., :S] @ base_values
            for j, cv in enumerate(chain_values):
                mixed = mixed + weights[..., S + j : S + j + 1] * cv
            mixed = mixed.transpose(1, 2).reshape(B, S, -1)
            residual = normed if layer.norm_before_residual else hidden
            residual = chain.linear(mixed, attention.o_proj.weight) + residual
            pre = layer.mlp(layer.post_attention_layernorm(residual), chain) + residual
            outputs.append(pre)
            hidden = pre
        return outputs
