"""The element-wise glue of a decoder layer in one C++ op each (``glue_cpu.cpp``): RMSNorm, the
residual add fused with the norm after it, RoPE over q and k in place, SiLU(gate) * up; and two
more small pieces of a decode step: the argmax of the logits (greedy tokens) and a commit's K/V
moves (``compact_kv``'s host path).

At decode sizes the lean decoder's step was bound by per-op overhead, not arithmetic: its
RMSNorm is 8 PyTorch ops, a RoPE 7 per tensor, the MLP's activation 3, ~1,000 ops of a
30-layer step costing a few microseconds each. These kernels do each piece in one pass (AVX2
lanes, fp32 arithmetic) and round where PyTorch's op sequence rounds, so they compute what the
``reference_*`` functions below compute (the PyTorch path the decoder keeps where the kernel
cannot be built: no AVX2, no C++ compiler, ``SPECDEC_CPU_GLUE=0``), but for the order of the
norm's sum of squares and SiLU's exp: within one rounding step of the dtype, and a row's result
never depends on the other rows in the call. fp32 and bf16, CPU only.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .cpp_kernels import CppKernel


def _cpu_reason() -> str | None:
    return None if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else "the CPU lacks AVX2"


# -ffp-contract=off: a scalar tail must round each product as PyTorch does, not fuse it into an FMA.
KERNEL = CppKernel("specdec_cpu_glue", Path(__file__).with_suffix(".cpp"),
                   ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"], "specdec_cpu_glue.rms_norm",
                   "layer-glue", "SPECDEC_CPU_GLUE", _cpu_reason)


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the ops serve tensors of this dtype on this device (building them on first use)."""
    return (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and KERNEL.get() is not None)


def unavailable_reason() -> str | None:
    return KERNEL.unavailable_reason()


def _ops():
    KERNEL.get()
    return torch.ops.specdec_cpu_glue


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _ops().rms_norm(x, weight, eps)


def add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + delta, rms_norm(x + delta))."""
    return _ops().add_rms_norm(x, delta, weight, eps)


def rope_(qkv: Tensor, cos: Tensor, sin: Tensor, heads: int) -> None:
    """RoPE in place on the first ``heads`` heads of qkv [B, N, F]; cos/sin [B, N, head_dim]."""
    _ops().rope_(qkv, cos, sin, heads)


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up for gate_up [..., 2I] (gate first) -> [..., I]."""
    return _ops().silu_mul(gate_up)


def argmax_last(x: Tensor) -> Tensor:
    """x.max(-1).indices (first index of the largest value; the first NaN if any) for x [..., V]."""
    return _ops().argmax_last(x.contiguous())


def move_positions_(caches: list[Tensor], rows: Tensor, dst: Tensor, src: Tensor) -> None:
    """For each contiguous cache [max_batch, heads, max_len, head_dim] and each move m in order:
    cache[rows[m], :, dst[m]] = cache[rows[m], :, src[m]] (int64 [M] each), bounds checked."""
    _ops().move_positions_(caches, rows, dst, src)


# -- what each op computes, in PyTorch (the tests hold the kernels to these; the decoder's fallback) --
def reference_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def reference_add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    s = x + delta
    return s, reference_rms_norm(s, weight, eps)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on x [B, N, heads, head_dim] with cos/sin [B, N, head_dim] (HF's rotate_half form)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


def reference_rope_(qkv: Tensor, cos: Tensor, sin: Tensor, heads: int) -> None:
    b, n, _ = qkv.shape
    x = qkv[..., :heads * cos.shape[-1]].view(b, n, heads, -1)
    x.copy_(rotate(x, cos, sin))


def reference_silu_mul(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
