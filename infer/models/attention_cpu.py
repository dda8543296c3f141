"""Decode attention on AVX-512 CPUs: a small C++ kernel (``attention_cpu.cpp``) beside SDPA.

PyTorch's CPU flash-attention kernel is built for long query blocks. A decode step has a few
query rows per kv head (SmolLM2's 9 heads over 3 kv heads: 3 rows a token, 39 for a 13-node
tree), and there it read the cached keys at well under the memory bandwidth of the 2-core
AVX-512 machine. The kernel reads each key and value once, in bf16, prefetched, with an fp32
softmax. Per layer call, K/V cold in cache as in a real step (30 layers in turn), bf16,
3 kv heads, head_dim 64:

    sequences x keys, query rows    SDPA      kernel
    1 x 1,000, 3                     135 us     50 us
    8 x 600, 3                       481 us    235 us
    32 x 600, 3                    2,100 us    892 us
    1 x 700, 39 (a 13-node tree)     240 us    177 us
    4 x 700, 39                    1,332 us    767 us
    16 x 400, 12                     958 us    758 us

Since session 49 a batch too small to keep both threads busy splits its rows between them (batch
1: 3 kv heads on 2 threads), and the softmax compresses its kept weights in a register (Zen 4
microcodes the memory form of ``vcompressps``): batch 1, 400 keys, 30 layer calls, 4-node tree
1.81 -> 1.24 ms, 13 nodes 4.64 -> 3.09; a prompt's row blocks spread over the threads too (a
2,000-token prefill 2.83 -> 2.25 s). The decoder calls it once a layer (``attend_tokens``): the
kernel writes the new tokens' K/V, reads q from the qkv projection and converts it itself, and
takes one mask row per token. None of this changes a bit.

The kernel also reads each sequence's own keys in place in the static cache (its slot, its
length), so a batch of uneven contexts neither pads to the longest nor gathers copies (batch 16
of Spec-Bench contexts: a decode step 36.0 ms with SDPA, 31.2 with the kernel over the padded
batch, 26.3 reading each row's own keys). The lean decoder calls it where ``takes`` says: bf16
on a CPU with AVX-512, head_dim 64 or 128, for every step, prefill included. Each row's result is
the same bits whatever rows sit beside it, so a prompt prefilled whole, in chunks, in a padded
batch or after a prefix-cache hit gives its tokens the same K/V and logits, and greedy output does
not depend on the batch or the cache (with SDPA's causal kernel for whole prompts, 7 of 10
load-generator replies changed after a prefix-cache hit, and 3 of 4 at batch 4). Rows go 48 at a time,
each block reading keys only up to the last one its mask leaves present, so a causal prefill
skips the masked half. Everywhere else, and wherever the kernel cannot be
built (no C++ compiler; ``SPECDEC_CPU_ATTENTION=0`` turns it off), the decoder keeps SDPA;
``reference`` is what the tests hold the kernel to. The kernel is compiled once per machine by
``torch.utils.cpp_extension`` (~15 s, cached under ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .cpp_kernels import CppKernel

NAME = "specdec_cpu_attention"
# -fopenmp: without it ATen's parallel_for (over batch x kv heads) compiles to a serial loop.
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-ffp-contract=off", "-fopenmp"]


def _cpu_reason() -> str | None:
    return None if torch.backends.cpu.get_cpu_capability() == "AVX512" else "the CPU lacks AVX-512"


KERNEL = CppKernel(NAME, Path(__file__).with_suffix(".cpp"), FLAGS, "specdec_cpu.decode_attention",
                   "decode-attention", "SPECDEC_CPU_ATTENTION", _cpu_reason)


def kernel():
    """The compiled op, building it on first use; None where it cannot be had (the reason is in
    ``unavailable_reason()``)."""
    return KERNEL.get()


def unavailable_reason() -> str | None:
    return KERNEL.unavailable_reason()


def takes(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether the kernel serves this attention: bf16 on an AVX-512 CPU, head_dim 64 or 128. It
    then serves every step, prefill included, so that a token's bits never depend on how its
    prompt was split or batched (see the module docstring)."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and head_dim in (64, 128)
            and kernel() is not None)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
           slots: Tensor | None = None, lengths: Tensor | None = None) -> Tensor:
    """Attention of q [B, H, R, D] over k, v [S, H, L, D] (a layer's static cache): row b reads
    cache row ``slots[b]`` (default b), keys ``0 .. lengths[b]-1`` (default all L), under the
    additive ``mask`` [B|1, 1, R, >= lengths]. The same as ``reference`` computes; the caller
    checked ``takes`` first. (Each row is a token of ``attend_tokens`` with one query per kv head.)"""
    return attend_tokens(q.transpose(1, 2), k, v, mask, scale, slots, lengths).transpose(1, 2)


def attend_tokens(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
                  slots: Tensor | None = None, lengths: Tensor | None = None, k_new: Tensor | None = None,
                  v_new: Tensor | None = None, positions: Tensor | None = None,
                  valid: Tensor | None = None) -> Tensor:
    """A decoder layer's attention in one call, for q [B, N, H, D] (N tokens, H query heads; a view
    of the fused qkv projection is fine) over the static cache k, v [S, KV, L, D], query head
    kvh * g + j reading kv head kvh (g = H / KV). First, if given, the new tokens' k_new, v_new
    [B, N, KV, D] are written at positions ``positions[b] + t`` of cache row ``slots[b]`` (the
    tokens ``valid[b, t]`` only); then sequence b attends over keys ``0 .. lengths[b]-1`` under the
    additive ``mask`` [B|1, 1, N, >= lengths], one row per token. -> [B, N, H, D]. One call instead
    of the cache writes, the query fold and the output unfold around it (~30 us a layer, profiled)."""
    return KERNEL.get()(q, k, v, mask, scale, slots, lengths, k_new, v_new, positions, valid)


def reference(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
              slots: Tensor | None = None, lengths: Tensor | None = None) -> Tensor:
    """What ``attend`` computes, with SDPA one row at a time (for the tests)."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        slot = b if slots is None else int(slots[b])
        n = k.shape[2] if lengths is None else int(lengths[b])
        m = None if mask is None else mask[b if mask.shape[0] > 1 else 0, :, :, :n][None]
        out[b] = F.scaled_dot_product_attention(q[b:b + 1], k[slot:slot + 1, :, :n], v[slot:slot + 1, :, :n],
                                                attn_mask=m, scale=scale)[0]
    return out
