"""Target backends for the runner: one small file per architecture family.

``build_backend(model, dtype, device, impl)`` picks the lean fused path (``llama.py``: Llama,
Mistral, Qwen2, Qwen3, Gemma) when the HF config is one it implements exactly, else the generic
path (``generic.py``: any HF causal LM through its own modules, slower). Both expose:

    kv_shapes: list[(kv_heads, head_dim)]      one per layer, to size the static cache
    forward(tokens [B,N], positions [B,N], access: StepAccess, tree_mask [B,N,N] bool,
            aux_layers: tuple[int, ...], logits_rows: Tensor | None)
        -> logits [B,N,V] or [B,V] (rows picked by logits_rows [B]), hidden [B,N,H] (post-norm),
           aux [B,N,A*H] or None
"""
from __future__ import annotations

import torch
from torch import Tensor


def build_backend(model, dtype: torch.dtype, device, impl: str = "auto"):
    from . import generic, llama

    if impl not in ("auto", "lean", "generic"):
        raise ValueError(f"impl must be auto, lean or generic, not {impl!r}")
    why_not = llama.unsupported_reason(model)
    if impl == "lean" and why_not:
        raise ValueError(f"the lean path cannot run this target: {why_not}")
    if impl == "lean" or (impl == "auto" and not why_not):
        return llama.LeanCausalLM(model, dtype, device)
    return generic.GenericCausalLM(model, dtype, device)


def tree_attention_mask(base_lens: Tensor, tree_mask: Tensor, kv_len: int, tree_start: Tensor | None = None,
                        positions: Tensor | None = None, window: int | None = None) -> Tensor:
    """Boolean attention mask [B, 1, N, kv_len] (True = attend) for N tree nodes per sequence.

    A node attends to its sequence's committed prefix (cache columns ``0 .. base_lens[b]-1``) and
    to its ancestors including itself (``tree_mask[b, i, j]``), whose K/V sit in columns
    ``tree_start[b] + j`` (default ``base_lens[b]``: the lean layout). With a sliding ``window``
    a key at rope position p is visible from rope position q only while ``p > q - window`` (HF's rule).

    Example, base_lens [2], chain of 2 nodes, kv_len 5:  row 0 -> 1 1 1 0 0,  row 1 -> 1 1 1 1 0.
    """
    bsz, n, _ = tree_mask.shape
    cols = torch.arange(kv_len, device=tree_mask.device)              # [L]
    start = base_lens if tree_start is None else tree_start            # [B]
    prefix = (cols[None, :] < base_lens[:, None])[:, None, :]          # [B, 1, L]
    if window is not None:  # the window counts rope positions, for prefix and tree keys alike
        prefix = prefix & (cols[None, None, :] > positions[:, :, None] - window)  # [B, N, L]
        tree_mask = tree_mask & (positions[:, None, :] > positions[:, :, None] - window)
    rel = cols[None, :] - start[:, None]                               # [B, L] node index per column
    in_tree = (rel >= 0) & (rel < n)
    gathered = torch.gather(tree_mask, 2, rel.clamp(0, n - 1)[:, None, :].expand(bsz, n, kv_len))
    return (prefix | (gathered & in_tree[:, None, :]))[:, None]       # [B, 1, N, L]
