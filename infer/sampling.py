"""Logits -> probabilities, per row: temperature, then top-k, then top-p (nucleus).

Every parameter is a per-row tensor [B] (or a Python number for all rows), applied to logits
[B, V] or [B, N, V] (the N tree nodes of a row share its parameters). A row with temperature 0
is greedy: its "distribution" is the one-hot of the argmax (first index on ties, as torch.argmax),
so stochastic verification on it reduces to greedy verification.

Order (as Hugging Face and vLLM): logits / T; keep the k largest (ties at the k-th value are
kept); softmax; keep the smallest prefix of tokens sorted by probability whose mass reaches
top_p (the first token always stays); renormalise. top_k <= 0 or >= V and top_p >= 1 disable.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def sampling_tensors(params: Sequence, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor, Tensor]:
    """(temperature [B] float32, top_k [B] long, top_p [B] float32) from objects with
    `.temperature`, `.top_k`, `.top_p` (SamplingParams), validating their ranges."""
    temps, ks, ps = [], [], []
    for i, sp in enumerate(params):
        t, k, p = float(sp.temperature), int(sp.top_k or 0), float(sp.top_p)
        if t < 0:
            raise ValueError(f"request {i}: temperature must be >= 0, got {t}")
        if not 0.0 < p <= 1.0:
            raise ValueError(f"request {i}: top_p must be in (0, 1], got {p}")
        temps.append(t), ks.append(k), ps.append(p)
    return (torch.tensor(temps, dtype=torch.float32, device=device),
            torch.tensor(ks, dtype=torch.long, device=device),
            torch.tensor(ps, dtype=torch.float32, device=device))


def greedy_tokens(logits: Tensor) -> Tensor:
    """argmax over the last axis (first index on ties, like torch.argmax). On CPU the layer-glue
    kernel's one pass (glue_cpu.argmax_last): PyTorch's bf16 ``argmax`` took 0.18 ms for one
    49k row and 0.9 ms for 9 on the 2-core CPU, ``max(-1)`` 0.04 and 0.17 ms, the kernel
    0.01 and 0.05; every greedy step takes it once. Elsewhere ``max(-1).indices``."""
    if logits.device.type == "cpu" and logits.numel():
        from specdec.infer.models import glue_cpu

        if glue_cpu.available(logits.dtype, logits.device):
            return glue_cpu.argmax_last(logits)
    return logits.max(-1).indices


def _per_row(value, B: int, dtype: torch.dtype, device: torch.device, name: str) -> Tensor:
    t = torch.as_tensor(value, dtype=dtype, device=device)
    if t.dim() == 0:
        return t.expand(B)
    if t.shape != (B,):
        raise ValueError(f"{name} must be a number or a [B] = [{B}] tensor, got {tuple(t.shape)}")
    return t


def top_k_mask(logits: Tensor, top_k: Tensor) -> Tensor:
    """keep [B, ..., V] bool: logits >= the row's k-th largest value (all True where k is off)."""
    B, V = logits.shape[0], logits.shape[-1]
    shape = (B,) + (1,) * (logits.dim() - 1)                   # broadcast [B] over the rest
    on = (top_k > 0) & (top_k < V)                              # [B]
    if not bool(on.any()):
        return torch.ones_like(logits, dtype=torch.bool)
    k_max = int(top_k[on].max())
    top = logits.topk(k_max, dim=-1).values                     # [B, ..., k_max] descending
    kth_idx = (top_k.clamp(1, k_max) - 1).view(shape).expand(*logits.shape[:-1], 1)
    kth = top.gather(-1, kth_idx)                               # [B, ..., 1]
    return (logits >= kth) | ~on.view(shape)


def top_p_mask(probs: Tensor, top_p: Tensor) -> Tensor:
    """keep [B, ..., V] bool: the smallest most-probable prefix whose mass reaches top_p.

    Example: probs [0.5, 0.3, 0.2], top_p 0.7 -> mass before each token [0, 0.5, 0.8] -> keep
    the tokens whose preceding mass is < 0.7: [True, True, False].
    """
    B = probs.shape[0]
    shape = (B,) + (1,) * (probs.dim() - 1)
    on = (top_p < 1.0).view(shape)
    if not bool(on.any()):
        return torch.ones_like(probs, dtype=torch.bool)
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    before = sorted_p.cumsum(-1) - sorted_p                     # mass of the better tokens
    keep_sorted = (before < top_p.view(shape)) | ~on
    keep_sorted[..., 0] = True
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def process_logits(logits: Tensor, temperature: Tensor | float, top_k: Tensor | int = 0,
                   top_p: Tensor | float = 1.0) -> Tensor:
    """logits [B, V] or [B, N, V] -> probabilities of the same shape (float32)."""
    B, V, dev = logits.shape[0], logits.shape[-1], logits.device
    temperature = _per_row(temperature, B, torch.float32, dev, "temperature")
    top_k = _per_row(top_k, B, torch.long, dev, "top_k")
    top_p = _per_row(top_p, B, torch.float32, dev, "top_p")
    shape = (B,) + (1,) * (logits.dim() - 1)
    greedy = temperature <= 0                                   # [B]
    scaled = logits.float() / torch.where(greedy, 1.0, temperature).view(shape)
    scaled = scaled.masked_fill(~top_k_mask(scaled, torch.where(greedy, 0, top_k)), float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    keep = top_p_mask(probs, torch.where(greedy, 1.0, top_p))
    probs = probs * keep
    probs = probs / probs.sum(-1, keepdim=True)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, greedy_tokens(logits)[..., None], 1.0)
        probs = torch.where(greedy.view(shape), one_hot, probs)
    return probs


def inverse_cdf(weights: Tensor, uniforms: Tensor, total: Tensor | None = None,
                fallback: Tensor | None = None) -> Tensor:
    """Sample index [...] from unnormalised weights [..., V] >= 0 with uniforms [...] in [0, 1).

    The index is the first one whose running sum exceeds u * total (total defaults to the sum).
    If rounding leaves no such index, the last positive weight is taken, and if no weight is
    positive, `fallback` (default 0). The stochastic verification kernel uses the same rule.
    """
    weights = weights.float()
    if total is None:
        total = weights.sum(-1)
    hit = weights.cumsum(-1) > (uniforms * total).unsqueeze(-1)       # [..., V]
    first = hit.to(torch.int32).argmax(-1)                              # first True
    positive = weights > 0
    last = weights.shape[-1] - 1 - positive.flip(-1).to(torch.int32).argmax(-1)
    if fallback is None:
        fallback = torch.zeros_like(first)
    out = torch.where(positive.any(-1), last, fallback.to(first.dtype))
    return torch.where(hit.any(-1), first, out).long()


def sample(probs: Tensor, uniforms: Tensor | None = None,
           generator: torch.Generator | None = None) -> Tensor:
    """One token per row [...] from probs [..., V] (inverse CDF; greedy rows are one-hot)."""
    if uniforms is None:
        uniforms = torch.rand(probs.shape[:-1], generator=generator, device=probs.device)
    return inverse_cdf(probs, uniforms)
