"""A loaded draft head's Llama-style blocks (heads/layers.py) in their decoding form on the CPU.

The blocks are written for training: separate q/k/v and gate/up projections, RMSNorm in six
PyTorch ops, RoPE in seven per tensor, the rotary table recomputed per call. A draft level at
decode sizes (1-16 rows) pays for those ops, not for their arithmetic: an EAGLE-3 step spent
~4 ms drafting beside a ~13 ms verification on the 2-core CPU. ``fuse_for_decoding`` reroutes
each block's forward through one fused projection per group (``DecodeLinear``) and the target
decoder's layer-glue kernels (``glue_cpu``: RMSNorm, RoPE in place, SiLU(gate) * up), and reads
the rotary tables from a per-dtype cache. The results are those of the training forward but for
the norm's sum order and SiLU's exp (within one rounding step of the dtype; see glue_cpu). Like
``pack_linears`` it patches instance forwards only: parameters and state_dict are untouched, and
the fused weights are a snapshot, so a fused head must not be trained afterwards.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.heads.layers import CacheAppend

from . import attention_cpu, glue_cpu
from .linear import DecodeLinear


def fuse_for_decoding(head: nn.Module) -> int:
    """Fuse every RMSNorm, Attention, MLP and Rotary of ``head`` (an inference-only draft head)
    whose parameters sit on a CPU in a dtype the glue kernels serve; returns how many."""
    from specdec.heads.layers import MLP, Attention, RMSNorm, Rotary

    n = 0
    for m in head.modules():
        p = next(m.parameters(), None)
        if p is not None and not glue_cpu.available(p.dtype, p.device):
            continue
        if isinstance(m, RMSNorm):
            m.forward = _FusedNorm(m)
        elif isinstance(m, Attention):
            m.forward = _FusedAttention(m)
        elif isinstance(m, MLP):
            m.forward = _FusedMLP(m)
        elif isinstance(m, Rotary) and m.inv_freq.device.type == "cpu":
            m.forward = _TableRotary(m)
        else:
            continue
        n += 1
    return n


def _fused_linear(linears: list[nn.Linear]) -> DecodeLinear:
    """One DecodeLinear computing the given projections of one input side by side."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    if all(lin.bias is None for lin in linears):
        return DecodeLinear(weight)
    bias = torch.cat([lin.bias.detach() if lin.bias is not None else weight.new_zeros(lin.out_features)
                      for lin in linears])
    return DecodeLinear(weight, bias)


class _FusedNorm:
    def __init__(self, norm):
        self.weight, self.eps, self.reference = norm.weight.detach(), norm.eps, norm.forward

    def __call__(self, x: Tensor) -> Tensor:
        if x.dtype != self.weight.dtype:
            return self.reference(x)
        return glue_cpu.rms_norm(x.contiguous(), self.weight, self.eps)


class _FusedMLP:
    def __init__(self, mlp):
        self.gate_up, self.down = _fused_linear([mlp.gate_proj, mlp.up_proj]), mlp.down_proj
        self.reference = mlp.forward

    def __call__(self, x: Tensor) -> Tensor:
        if x.dtype != self.gate_up.weight.dtype:
            return self.reference(x)
        return self.down(glue_cpu.silu_mul(self.gate_up(x)))


class _FusedAttention:
    """q, k and v in one projection, RoPE on q and k in place; the attention itself is the
    block's own (``Attention.attend``), or, given a ``CacheAppend`` as ``past_kv`` where the CPU
    attention kernel serves the dtype, one kernel call that writes the new K/V into the drafter's
    cache and attends there (no K/V concatenation, scatter or SDPA mask conversion: ~0.2 ms of a
    4-node EAGLE-3 draft on the 2-core CPU). Training-time-test calls take the block's forward."""

    def __init__(self, attn):
        self.attn, self.reference = attn, attn.forward
        self.qkv = _fused_linear([attn.q_proj, attn.k_proj, attn.v_proj])
        h, kv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.splits, self.rotated = [h * d, kv * d, kv * d], h + kv
        self.appends_to_cache = attention_cpu.takes(self.qkv.weight.dtype, self.qkv.weight.device, d)

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None,
                 past_kv: tuple[Tensor, Tensor] | None = None, ttt_prev=None):
        a = self.attn
        if ttt_prev is not None or x.dtype != self.qkv.weight.dtype or cos.dtype != x.dtype:
            return self.reference(x, cos, sin, mask, past_kv, ttt_prev)
        B, T, _ = x.shape
        qkv = self.qkv(x).contiguous()                                          # [B, T, (h + 2kv) D]
        glue_cpu.rope_(qkv, cos.contiguous(), sin.contiguous(), self.rotated)
        if isinstance(past_kv, CacheAppend):
            return self._append_and_attend(qkv, past_kv), None
        q, k, v = (t.view(B, T, -1, a.head_dim).transpose(1, 2) for t in qkv.split(self.splits, -1))
        return a.attend(q, k, v, mask, past_kv), (k, v)

    def _append_and_attend(self, qkv: Tensor, c: CacheAppend) -> Tensor:
        a = self.attn
        B, T, _ = qkv.shape
        h, kv = a.num_heads, a.num_kv_heads
        heads = qkv.view(B, T, h + 2 * kv, a.head_dim)                          # views, as the decoder's
        q, k, v = heads[:, :, :h], heads[:, :, h:h + kv], heads[:, :, h + kv:]
        out = attention_cpu.attend_tokens(q, c.cache.k, c.cache.v, c.mask, a.head_dim ** -0.5, c.slots,
                                          c.lengths, k, v, c.positions, c.valid)
        return a.o_proj(out.reshape(B, T, h * a.head_dim))


class _TableRotary:
    """cos/sin read from a table per dtype, grown on demand: each entry is computed as
    ``Rotary.forward`` computes it, element by element, so the values are the same."""

    def __init__(self, rotary):
        self.rotary, self.reference = rotary, rotary.forward
        self.tables: dict[torch.dtype, tuple[Tensor, Tensor]] = {}

    def __call__(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        need = int(positions.max()) + 1 if positions.numel() else 0
        cos, sin = self.tables.get(dtype, (None, None))
        if cos is None or cos.shape[0] < need:
            length = max(need, 2 * (0 if cos is None else cos.shape[0]), 1024)
            cos, sin = self.reference(torch.arange(length, device=positions.device)[None], dtype)
            cos, sin = self.tables[dtype] = cos[0], sin[0]
        return F.embedding(positions, cos), F.embedding(positions, sin)
