"""The dtype names the command-line tools and recipes accept, and what ``auto`` means.

Light on purpose (torch is imported only when a name is resolved), so ``--help`` stays instant.
"""
from __future__ import annotations

DTYPE_CHOICES = ["auto", "float32", "bfloat16", "float16"]  # the --dtype flags' choices
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def native_bf16(device="cpu") -> bool:
    """Whether ``device`` computes bf16 matmuls natively: a CUDA GPU with bf16, or a CPU with
    AVX512-BF16 or AMX. Elsewhere oneDNN emulates them: a training GEMM ran 4.7x slower than in
    fp32 on a Zen 3 CPU without AVX-512 (measured), so there fp32 is the fast choice."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return device.type == "cpu" and (torch.cpu._is_avx512_bf16_supported()
                                     or torch.cpu._is_amx_tile_supported())


def dtype_name(name: str, device="cpu") -> str:
    """A concrete dtype name: ``auto`` is bfloat16 where ``device`` has native bf16, else
    float32; aliases (bf16, fp32, fp16) are spelled out; other names pass through."""
    if name == "auto":
        return "bfloat16" if native_bf16(device) else "float32"
    return ALIASES.get(name, name)


def torch_dtype(dtype, device="cpu"):
    """The torch dtype for a torch dtype or any accepted name (``auto`` resolved for ``device``);
    an unknown name raises ValueError listing the choices."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype_name(dtype, device)
    if name not in DTYPE_CHOICES[1:]:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_CHOICES + list(ALIASES))}")
    return getattr(torch, name)
