"""The dtype names the command-line tools and recipes accept, and what ``auto`` means.

Light on purpose (torch is imported only when a name is resolved), so ``--help`` stays instant.
"""
from __future__ import annotations

DTYPE_CHOICES = ["auto", "float32", "bfloat16", "float16"]  # the --dtype flags' choices
# --help of the runtime's commands (generate, bench, serve)
AUTO_DECODING_HELP = ("auto: bfloat16 where the device decodes faster in it (a GPU or CPU with native "
                      "bf16, or an AVX2 CPU through specdec's bf16 kernel), else float32")
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


def fast_bf16_decoding(device="cpu") -> bool:
    """Whether decoding (a few rows a projection, memory-bound) runs faster in bf16 than in fp32
    on ``device``: where bf16 is native, and on a CPU that runs specdec's AVX2 bf16 linear kernel
    (half the weight bytes a step; measured on a Zen 3 CPU without AVX-512: plain decoding of
    SmolLM2 20.7 tok/s in bf16 against 11.9 in fp32, batched regeneration at batch 32 167 vs 155).
    Training and capture (large GEMMs) follow ``native_bf16`` alone."""
    if native_bf16(device):
        return True
    import torch

    if torch.device(device).type != "cpu":
        return False
    from specdec.infer.models.linear import BF16_KERNEL  # builds it on first use (~15 s, cached)

    return BF16_KERNEL.get() is not None


def dtype_name(name: str, device="cpu", decoding: bool = False) -> str:
    """A concrete dtype name: ``auto`` is bfloat16 where ``device`` has native bf16 (with
    ``decoding``: where it decodes faster in bf16, ``fast_bf16_decoding``), else float32;
    aliases (bf16, fp32, fp16) are spelled out; other names pass through."""
    if name == "auto":
        fast = fast_bf16_decoding(device) if decoding else native_bf16(device)
        return "bfloat16" if fast else "float32"
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
