"""Linear layers for the decode hot path: oneDNN-prepacked bf16 weights on CPU.

On CPU, ``F.linear`` with bf16 weights reorders the weight into oneDNN's blocked layout on
every call; for decoding (a handful of rows per step) that reorder costs about as much as the
matmul. Packing once (``mkldnn._reorder_linear_weight``) and calling
``mkldnn._linear_pointwise`` measured 1.7-2x faster per projection on the 2-core AVX-512-BF16
machine (SmolLM2 shapes, 1 row), the same trick inductor's CPU backend uses. fp32 and every
other device keep ``F.linear``: packing measured no gain there, and fp32 stays bit-exact with
HF (the greedy-equality tests run fp32).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _can_pack(weight: Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.cpu._is_avx512_bf16_supported())


class DecodeLinear:
    """``y = x @ weight.T + bias`` for x [..., in]; packed for oneDNN when that is faster."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        self.weight, self.bias = weight, bias                                # [out, in], [out]
        self.packed = None
        if _can_pack(weight):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
            except RuntimeError:  # an oneDNN build without this layout: the plain call works
                pass

    def __call__(self, x: Tensor) -> Tensor:
        if self.packed is not None and x.dtype == self.weight.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def pack_linears(module: torch.nn.Module) -> int:
    """Route every bf16 ``nn.Linear`` of an inference-only module (a loaded draft head) through a
    packed DecodeLinear. The packed copy is a snapshot: do not train the module afterwards.
    Parameters and state_dict are untouched. Returns how many layers were packed."""
    n = 0
    for m in module.modules():
        if not isinstance(m, torch.nn.Linear):
            continue
        fast = DecodeLinear(m.weight.detach(), None if m.bias is None else m.bias.detach())
        if fast.packed is not None:  # fp32 / GPU layers keep their own forward
            m.forward = fast  # an instance attribute: nn.Module.__call__ dispatches to it
            n += 1
    return n
