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

``attend`` also reads each sequence's own keys in place in the static cache (its slot, its
length), so a batch of uneven contexts neither pads to the longest nor gathers copies (batch 16
of Spec-Bench contexts: a decode step 36.0 ms with SDPA, 31.2 with the kernel over the padded
batch, 26.3 reading each row's own keys). The lean decoder calls it where ``takes`` says: bf16
on a CPU with AVX-512, head_dim 64 or 128, up to ``KERNEL_MAX_ROWS`` query rows. Everywhere else, and wherever the kernel cannot be
built (no C++ compiler; ``SPECDEC_CPU_ATTENTION=0`` turns it off), the decoder keeps SDPA;
``reference`` is what the tests hold the kernel to. The kernel is compiled once per machine by
``torch.utils.cpp_extension`` (~15 s, cached under ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``).
"""
from __future__ import annotations

import os
import sys
import threading
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

ENV = "SPECDEC_CPU_ATTENTION"
SOURCE = Path(__file__).with_suffix(".cpp")
NAME = "specdec_cpu_attention"
# Query rows per kv head up to which the kernel measured at least SDPA's speed (1 x 700 keys,
# 192 rows: 799 vs 870 us; a 512-token prefill chunk, 1,536 rows: 9.5 vs 8.5 ms).
KERNEL_MAX_ROWS = 192
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"]

_lock = threading.Lock()
_op = None          # torch.ops.specdec_cpu.decode_attention once built
_failed: str | None = None  # why the kernel is unavailable, once known


def _supported_cpu() -> bool:
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def kernel():
    """The compiled op, building it on first use; None where it cannot be had (the reason is in
    ``unavailable_reason()``, and a warning said it once)."""
    global _op, _failed
    if _op is not None or _failed is not None:
        return _op
    with _lock:
        if _op is not None or _failed is not None:
            return _op
        if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "off", "no"):
            _failed = f"{ENV}=0"
            return None
        if not _supported_cpu():
            _failed = "the CPU lacks AVX-512"
            return None
        try:
            _op = _build()
        except Exception as err:  # no compiler, no headers ...: SDPA still computes the same thing
            last_line = (str(err).strip().splitlines() or [""])[-1]  # a build error ends with its cause
            _failed = f"{type(err).__name__}: {last_line}"
            warnings.warn(f"specdec: the CPU decode-attention kernel is unavailable ({_failed}); using SDPA",
                          RuntimeWarning, stacklevel=2)
        return _op


def unavailable_reason() -> str | None:
    kernel()
    return _failed


def _build():
    from torch.utils import cpp_extension
    try:  # the ninja that pip installed may not be on PATH when the venv is not activated
        import ninja
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    try:  # a private helper: only for the notice
        built = any(Path(cpp_extension._get_build_directory(NAME, verbose=False)).glob(f"{NAME}*.so"))
    except Exception:
        built = False
    if not built:
        print("specdec: compiling the CPU decode-attention kernel once (~15 s)", file=sys.stderr, flush=True)
    cpp_extension.load(NAME, sources=[str(SOURCE)], extra_cflags=FLAGS, is_python_module=False, verbose=False)
    return torch.ops.specdec_cpu.decode_attention


def takes(dtype: torch.dtype, device: torch.device, head_dim: int, rows: int) -> bool:
    """Whether the kernel serves this attention: bf16 on an AVX-512 CPU, head_dim 64 or 128, at
    most ``KERNEL_MAX_ROWS`` query rows per kv head (decode and verification steps; a prefill
    chunk keeps SDPA's flash kernel)."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and head_dim in (64, 128)
            and rows <= KERNEL_MAX_ROWS and kernel() is not None)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
           slots: Tensor | None = None, lengths: Tensor | None = None) -> Tensor:
    """Attention of q [B, H, R, D] over k, v [S, H, L, D] (a layer's static cache): row b reads
    cache row ``slots[b]`` (default b), keys ``0 .. lengths[b]-1`` (default all L), under the
    additive ``mask`` [B|1, H|1, R, >= lengths]. The same as ``reference`` computes; the caller
    checked ``takes`` first."""
    return _op(q, k, v, mask, scale, slots, lengths)


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
