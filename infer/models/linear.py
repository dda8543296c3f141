"""Linear layers for the decode hot path: oneDNN-prepacked weights on CPU.

On CPU, ``F.linear`` with bf16 weights reorders the weight into oneDNN's blocked layout on
every call; for decoding (a handful of rows per step) that reorder costs about as much as the
matmul. Packing once (``mkldnn._reorder_linear_weight``) and calling
``mkldnn._linear_pointwise`` measured 1.7-2x faster per projection on the 2-core AVX-512-BF16
machine (SmolLM2 shapes, 1 row), the same trick inductor's CPU backend uses. fp32 is packed
too: on that machine it measured no gain, but on a 2-core AMD CPU without AVX-512 (where
``F.linear`` runs MKL's fp32 GEMM) a whole SmolLM2 step measured ~1.3x faster at 1 token and
~1.5x at 16 (tree verification). Packed fp32 differs from ``F.linear`` by rounding only
(~1e-6 relative); neither is bitwise invariant to the number of rows, so greedy equality
between speculative and plain decoding stands on the same ground as before. bf16 is packed only
where the CPU computes it natively (AVX512-BF16). Elsewhere on an AVX2 CPU bf16 runs in
``linear_cpu.cpp`` from two rows on (PyTorch's emulated bf16 matmul there grew with the rows:
a 16-token verification cost 5.7-7x a decode step, 2.2x with the kernel; a single row keeps
PyTorch's GEMV, the faster one there). On a CPU with AVX512-BF16, bf16 runs in
``linear_bf16_cpu.cpp`` at every row count: oneDNN's call overhead (~18 us, 121 calls a SmolLM2
step) and its read rate cost a decode step ~30% more, and the kernel gives each row the same bits
whatever the rows beside it. Prefill takes it too (on par with oneDNN up to 4,096 rows, ~10% slower
at 8,192; SmolLM2 shapes, 2-core EPYC), so that with the attention kernel a token's bits do not
depend on how its prompt was chunked, batched or taken from the prefix cache. Other devices keep
``F.linear``.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec.infer.dtypes import native_bf16

from .cpp_kernels import CppKernel


def _emulated_bf16_reason() -> str | None:
    """Why ``linear_cpu.cpp`` is not for this CPU: it serves AVX2 CPUs that emulate bf16."""
    if native_bf16("cpu"):
        return "the CPU computes bf16 natively (oneDNN serves it)"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return "the CPU lacks AVX2"
    return None


# bf16 weights on a CPU without native bf16 (see linear_cpu.cpp); SPECDEC_CPU_LINEAR=0: F.linear.
BF16_KERNEL = CppKernel("specdec_cpu_linear", Path(__file__).with_name("linear_cpu.cpp"),
                        ["-O3", "-mavx2", "-mfma", "-fopenmp"], "specdec_cpu_linear.bf16_linear",
                        "bf16 linear", "SPECDEC_CPU_LINEAR", _emulated_bf16_reason)


def _native_bf16_reason() -> str | None:
    """Why ``linear_bf16_cpu.cpp`` is not for this CPU: it needs AVX512-BF16."""
    return None if torch.cpu._is_avx512_bf16_supported() else "the CPU lacks AVX512-BF16"


# bf16 weights on a CPU with AVX512-BF16 (see linear_bf16_cpu.cpp); SPECDEC_CPU_LINEAR=0: oneDNN.
NATIVE_BF16_KERNEL = CppKernel("specdec_cpu_linear_bf16", Path(__file__).with_name("linear_bf16_cpu.cpp"),
                               ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp"],
                               "specdec_cpu_linear_bf16.linear", "native bf16 linear", "SPECDEC_CPU_LINEAR",
                               _native_bf16_reason)
GROUP = 64  # output rows per packed group (kGroup in the kernel)


def pack_rows(weight: Tensor) -> Tensor:
    """``weight`` [N, K] (K even) in the kernel's layout [ceil(N/64), K/2, 64, 2]: for each group
    of 64 output rows, the pair (k, k+1) of all 64 rows in one run; padding rows are zero."""
    n, k = weight.shape
    groups = -(-n // GROUP)
    padded = weight.new_zeros(groups * GROUP, k)
    padded[:n] = weight
    return padded.view(groups, GROUP, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def _can_pack(weight: Tensor) -> bool:
    native = weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and native_bf16("cpu"))
    return (weight.device.type == "cpu" and native and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _on_rows(op, x: Tensor, *args) -> Tensor:
    """A kernel over rows (``op(x [rows, in], *args) -> [rows, out]``) applied to x [..., in]."""
    y = op(x.reshape(-1, x.shape[-1]), *args)
    return y.reshape(*x.shape[:-1], y.shape[-1])


class DecodeLinear:
    """``y = x @ weight.T + bias`` for x [..., in]; packed for oneDNN when that is faster."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        self.weight, self.bias = weight, bias                                # [out, in], [out]
        self.packed = None
        self.kernel = None  # linear_cpu.cpp, for bf16 where the CPU emulates it
        self.native = None  # linear_bf16_cpu.cpp: (op, weight in its layout, fp32 bias)
        bf16_cpu = weight.device.type == "cpu" and weight.dtype == torch.bfloat16
        native = NATIVE_BF16_KERNEL.get() if bf16_cpu and weight.dim() == 2 and weight.shape[1] % 2 == 0 else None
        if native is not None:
            self.native = (native, pack_rows(weight), None if bias is None else bias.float())
        elif _can_pack(weight):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
            except RuntimeError:  # an oneDNN build without this layout: the plain call works
                pass
        elif bf16_cpu and weight.is_contiguous():
            self.kernel = BF16_KERNEL.get()

    def __call__(self, x: Tensor) -> Tensor:
        if self.native is not None and x.dtype == torch.bfloat16:
            op, packed, bias = self.native  # takes x [..., in] as it is (~2 us a call less)
            return op(x, packed, bias, self.weight.shape[0])
        if self.packed is not None and x.dtype == self.weight.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        # one row (a batch-1 decode step): PyTorch's bf16 GEMV measured ~13% faster a step than
        # the kernel's; from two rows on the kernel is 2-7x faster than the emulated matmul
        if self.kernel is not None and x.dtype == torch.bfloat16 and x.numel() > x.shape[-1]:
            return _on_rows(self.kernel, x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    @property
    def accelerated(self) -> bool:
        """Whether a CPU fast path (a kernel or oneDNN's packed weight) serves this layer."""
        return self.native is not None or self.packed is not None or self.kernel is not None


def pack_linears(module: torch.nn.Module, skip_out_features: int | None = None) -> int:
    """Route every bf16 ``nn.Linear`` of an inference-only module (a loaded draft head) through a
    packed DecodeLinear, except those with ``skip_out_features`` outputs. The packed copy is a
    snapshot: do not train the module afterwards. Parameters and state_dict are untouched.
    Returns how many layers were packed."""
    n = 0
    for m in module.modules():
        if not isinstance(m, torch.nn.Linear) or m.out_features == skip_out_features:
            continue
        fast = DecodeLinear(m.weight.detach(), None if m.bias is None else m.bias.detach())
        if fast.accelerated:  # GPU layers keep their own forward
            m.forward = fast  # an instance attribute: nn.Module.__call__ dispatches to it
            n += 1
    return n


class FrequentVocabLinear:
    """A vocabulary-sized output layer that scores only ``keep`` (the head's most frequent
    training tokens) and gives every other token the dtype's lowest logit, so probabilities
    there are exactly 0. For drafting only: a draft is any guess (the target verifies it), and a
    token sampled from these probabilities is checked against them, so output stays lossless.
    On the 2-core CPU an [8192, 576] bf16 head costs 0.31 ms a row against 1.87 ms for SmolLM2's
    49,152 rows: Medusa's drafting fell from 9.5 to 2.7 ms a step (docs/ARCHITECTURE.md)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, keep: Tensor):
        keep = keep.to(weight.device)
        self.vocab, self.keep = weight.shape[0], keep
        self.linear = DecodeLinear(weight[keep].contiguous(), None if bias is None else bias[keep].contiguous())

    def __call__(self, x: Tensor) -> Tensor:
        y = self.linear(x)                                                   # [..., K]
        out = torch.full((*y.shape[:-1], self.vocab), torch.finfo(y.dtype).min, dtype=y.dtype, device=y.device)
        return out.index_copy_(-1, self.keep, y)                             # [..., V]


def vocab_linear(weight: Tensor, bias: Tensor | None = None, keep: Tensor | None = None):
    """A drafter's output layer over the vocabulary: FrequentVocabLinear over ``keep``, or the
    whole (prepacked) DecodeLinear when ``keep`` is None."""
    return DecodeLinear(weight, bias) if keep is None else FrequentVocabLinear(weight, bias, keep)
