"""Building blocks shared by the draft heads: Llama-style norm, RoPE, attention, MLP, decoder
layer, Medusa's residual block, and a small per-slot KV cache for drafters.

Parameter names follow Hugging Face Llama (`self_attn.q_proj`, `mlp.gate_proj`,
`input_layernorm`, ...) because EAGLE, EAGLE-3 (vLLM / speculators) and SpecForge checkpoints use
them: a head built from these blocks exports without renames.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """RoPE tables from a transformers-5 style `rope_parameters` dict (rope_type, rope_theta, ...).

    Non-default rope types (llama3, yarn, linear, ...) reuse transformers' own init functions, so a
    head sees exactly the target's rotary frequencies.
    """

    def __init__(self, head_dim: int, rope_parameters: dict | None, max_position: int = 4096,
                 hidden_size: int | None = None, num_heads: int | None = None):
        super().__init__()
        rope = dict(rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            inv_freq = 1.0 / (rope.get("rope_theta", 10000.0)
                              ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            from transformers import LlamaConfig
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            num_heads = num_heads or 1
            cfg = LlamaConfig(hidden_size=hidden_size or head_dim * num_heads, head_dim=head_dim,
                              num_attention_heads=num_heads, max_position_embeddings=max_position,
                              rope_parameters=rope)
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, None)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.scaling = float(scaling)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [B, T] long -> cos, sin [B, T, head_dim]."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, heads, T, D]; cos/sin [B, T, D] (HF's rotate_half convention)."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """GQA self-attention; `in_dim` may differ from `hidden` (EAGLE-3 attends over 2H inputs)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int | None = None,
                 in_dim: int | None = None, bias: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = head_dim or hidden // num_heads
        in_dim = in_dim or hidden
        self.q_proj = nn.Linear(in_dim, num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden, bias=False)

    def project_kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [B, T, in] -> rotated k, v [B, kv_heads, T, head_dim]."""
        B, T, _ = x.shape
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(k, cos, sin), v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None,
                past_kv: tuple[Tensor, Tensor] | None = None,
                ttt_prev: list[tuple[Tensor, Tensor]] | None = None
                ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x [B, T, in]; cos/sin [B, T, D]. Returns out [B, T, hidden] and this call's rotated
        (k, v) [B, kv_heads, T, D].

        Regular call: keys = past_kv (P) + these T tokens; mask [B, T, P + T] bool (True = may
        attend), None = plain causal over the T tokens with no past.
        Training-time test (EAGLE-3) when `ttt_prev` is a list: keys = past_kv (the unroll's
        step-0 keys, P = T) under `mask` [B, T, P], plus one private key per query and earlier
        unroll step: ttt_prev[i] (k, v) [B, kv, T, D] and this step's own, all at the query's
        position (the chain's own ancestors, SpecForge's "diagonal").
        """
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k, v = self.project_kv(x, cos, sin)
        return self.attend(q, k, v, mask, past_kv, ttt_prev), (k, v)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
               past_kv: tuple[Tensor, Tensor] | None = None,
               ttt_prev: list[tuple[Tensor, Tensor]] | None = None) -> Tensor:
        """The attention of ``forward`` from rotated q [B, heads, T, D] and k, v [B, kv, T, D],
        through o_proj -> [B, T, hidden]."""
        B, T = q.shape[0], q.shape[2]
        if ttt_prev is not None:
            diag = ttt_prev + [(k, v)]
            out = self._attend_with_diagonal(q, *past_kv, mask, torch.stack([d[0] for d in diag], 3),
                                             torch.stack([d[1] for d in diag], 3))
        else:
            keys, vals = k, v
            if past_kv is not None:
                keys, vals = torch.cat([past_kv[0], k], 2), torch.cat([past_kv[1], v], 2)
            attn_mask = None if mask is None else mask[:, None]
            out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=attn_mask,
                                                 is_causal=mask is None, enable_gqa=True)
        out = out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)
        return self.o_proj(out)

    def _attend_with_diagonal(self, q, keys, vals, mask, ek, ev):
        """Softmax over [regular keys (masked) ; E per-query keys]. q [B, h, T, D];
        keys/vals [B, kv, S, D]; mask [B, T, S]; ek/ev [B, kv, T, E, D]."""
        rep = self.num_heads // self.num_kv_heads
        keys, vals = keys.repeat_interleave(rep, 1), vals.repeat_interleave(rep, 1)
        ek, ev = ek.repeat_interleave(rep, 1), ev.repeat_interleave(rep, 1)
        scale = 1.0 / math.sqrt(self.head_dim)
        s_main = (q @ keys.transpose(-1, -2)) * scale                    # [B, h, T, S]
        s_main = s_main.masked_fill(~mask[:, None], float("-inf"))
        s_diag = (q[:, :, :, None, :] * ek).sum(-1) * scale               # [B, h, T, E]
        probs = torch.cat([s_main, s_diag], -1).float().softmax(-1).to(q.dtype)
        S = s_main.shape[-1]
        return probs[..., :S] @ vals + (probs[..., S:, None] * ev).sum(-2)


class MLP(nn.Module):
    """SwiGLU feed-forward (Llama)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A Llama decoder layer. `input_norm=False` drops `input_layernorm` (EAGLE-1's layer 0,
    whose input is the fc output); `attn_in` lets attention read a wider input (EAGLE-3)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, intermediate: int,
                 head_dim: int | None = None, eps: float = 1e-6, input_norm: bool = True,
                 attn_in: int | None = None, attn_bias: bool = False):
        super().__init__()
        if input_norm:
            self.input_layernorm = RMSNorm(attn_in or hidden, eps)
        self.self_attn = Attention(hidden, num_heads, num_kv_heads, head_dim, attn_in, attn_bias)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(hidden, intermediate)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None,
                past_kv=None, ttt_prev=None, residual: Tensor | None = None):
        """x [B, T, in]; residual [B, T, hidden] (defaults to x); attention arguments as in
        `Attention.forward`. Returns (out [B, T, hidden], (k, v))."""
        residual = x if residual is None else residual
        h = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        a, kv = self.self_attn(h, cos, sin, mask, past_kv, ttt_prev)
        h = residual + a
        return h + self.mlp(self.post_attention_layernorm(h)), kv


class ResBlock(nn.Module):
    """Medusa's block: x + SiLU(Linear(x)), initialised to the identity (zero weight)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


class SlotKVCache:
    """A drafter's own K/V for one attention layer: [max_batch, kv_heads, max_len, head_dim],
    allocated once in `reset`; `lens[slot]` entries of each slot are committed."""

    def __init__(self, max_batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (max_batch, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lens = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.max_len = max_len

    def write(self, slots: Tensor, starts: Tensor, k: Tensor, v: Tensor, counts: Tensor) -> None:
        """Write k/v [B, kv, T, D] rows 0..counts[b]-1 at positions starts[b].. of slot slots[b]."""
        B, _, T, _ = k.shape
        t = torch.arange(T, device=k.device)
        keep = t[None] < counts[:, None]                                 # [B, T]
        pos = starts[:, None] + t[None]
        if (pos[keep] >= self.max_len).any():
            raise RuntimeError(f"draft KV cache full (max_len={self.max_len})")
        b_idx, t_idx = keep.nonzero(as_tuple=True)
        self.k[slots[b_idx], :, pos[b_idx, t_idx]] = k[b_idx, :, t_idx]
        self.v[slots[b_idx], :, pos[b_idx, t_idx]] = v[b_idx, :, t_idx]

    def read(self, slots: Tensor, length: int) -> tuple[Tensor, Tensor]:
        """k, v [B, kv, length, D] of the given slots (positions past a slot's length are stale):
        views where the slots are consecutive (a drafter decoding alone), copies otherwise. Read
        them before writing past a slot's length: a view sees the write."""
        first = int(slots[0]) if slots.numel() else 0
        if slots.numel() and bool((slots == torch.arange(first, first + slots.numel(), device=slots.device)).all()):
            end = first + slots.numel()
            return self.k[first:end, :, :length], self.v[first:end, :, :length]
        return self.k[slots, :, :length], self.v[slots, :, :length]


@dataclass
class CacheAppend:
    """An attention call that writes its tokens' K/V into a SlotKVCache and reads them back there,
    passed as ``past_kv``. Only a head fused for decoding on a CPU takes it
    (``infer/models/head_fusion.py``: one kernel call does both); see ``appends_to_cache``.
    Token t of row b goes to position ``positions[b] + t`` of slot ``slots[b]`` (where ``valid[b, t]``,
    default all), then reads keys ``0 .. lengths[b] - 1`` under ``mask`` [B, 1, T, >= lengths]
    (additive, the cache's dtype)."""

    cache: SlotKVCache
    slots: Tensor
    positions: Tensor
    lengths: Tensor
    mask: Tensor
    valid: Tensor | None = None


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """bool ``allowed`` -> 0 where True, -inf where False, in ``dtype``."""
    return torch.full(allowed.shape, float("-inf"), dtype=dtype, device=allowed.device).masked_fill_(allowed, 0)


def appends_to_cache(head: nn.Module) -> bool:
    """Whether every attention block of ``head`` takes a ``CacheAppend`` (fused for decoding, where
    the CPU attention kernel serves it)."""
    blocks = [m for m in head.modules() if isinstance(m, Attention)]
    return bool(blocks) and all(getattr(m.forward, "appends_to_cache", False) for m in blocks)
