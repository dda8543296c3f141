"""Verify a draft tree against the target's logits: greedy or lossless sampling.

The engine's one call per step is `verify_tree(tree, logits, temperature, top_k, top_p)`:
  * every row greedy (temperature 0): `greedy_accept` on the argmax (no [B, N, V] probabilities);
  * otherwise: `process_logits` -> target probabilities, then `stochastic_accept` with the
    tree's draft_probs (None -> point-mass rule). Greedy rows of a mixed batch get one-hot
    probabilities, for which stochastic acceptance is exactly greedy acceptance (it follows the
    first matching child where `greedy_accept` takes the longest match; the two differ only when
    siblings repeat a token, and both emit the target's greedy tokens).
Then `emitted_tokens` lists each row's new tokens (accepted drafts + bonus) and
`compact_kv(...)` keeps the accepted path's K/V. Acceptance does not stop at an end-of-sequence
token: the engine truncates what it commits.

Backends: SPECDEC_KERNELS=triton|reference|auto (default auto: Triton kernels on CUDA tensors,
the PyTorch references on CPU); `impl=` overrides per call.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from specdec.infer.kernels import (KERNELS_ENV, Accepted, compact_kv, draw_uniforms, greedy_accept,
                                   resolve_impl, stochastic_accept)
from specdec.infer.sampling import greedy_tokens, process_logits

__all__ = ["KERNELS_ENV", "Accepted", "kernel_backend", "verify_tree", "emitted_tokens",
           "row_uniforms", "compact_kv", "greedy_accept", "stochastic_accept"]


def kernel_backend(device: torch.device | str, impl: str | None = None) -> str:
    """'triton' or 'reference': what the kernels will run on tensors of `device`."""
    return resolve_impl(torch.device(device), impl)


def verify_tree(tree, logits: Tensor, temperature: Tensor | float = 0.0, top_k: Tensor | int = 0,
                top_p: Tensor | float = 1.0, *, uniforms: Tensor | None = None,
                generator: torch.Generator | None = None, max_depth: int | None = None,
                impl: str | None = None) -> Accepted:
    """tree: a DraftTree (tokens/parents/valid [B, N], draft_probs [B, N, V] | None);
    logits [B, N, V]: the target's logits after reading each node; sampling params per row [B]
    (or one number). uniforms [B, N] (see `stochastic_accept`) or drawn from `generator`."""
    B, N = tree.tokens.shape
    if logits.shape[:2] != (B, N):
        raise ValueError(f"verify_tree: logits {tuple(logits.shape)} must be [B, N, V] for a tree of {(B, N)}")
    temp = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device)
    if bool((temp <= 0).all()):
        return greedy_accept(tree.tokens, tree.parents, tree.valid, greedy_tokens(logits),
                             max_depth=max_depth, impl=impl)
    probs = process_logits(logits, temperature, top_k, top_p)             # [B, N, V]
    if uniforms is None:
        uniforms = draw_uniforms(B, N, generator, logits.device)
    return stochastic_accept(tree.tokens, tree.parents, tree.valid, probs,
                             getattr(tree, "draft_probs", None), uniforms,
                             max_depth=max_depth, impl=impl)


def row_uniforms(generators: Sequence[torch.Generator | None], N: int, device: torch.device | str,
                 default: torch.Generator | None = None) -> Tensor:
    """uniforms [B, N]: row b from generators[b] (a request's own seed) or from `default`.
    Seeded requests thus get the same random stream whatever else shares their batch."""
    rows = [torch.rand(N, generator=g if g is not None else default, device=device) for g in generators]
    if not rows:
        return torch.empty(0, N, device=device)
    return torch.stack(rows)


def emitted_tokens(tokens: Tensor, accepted: Accepted) -> tuple[Tensor, Tensor]:
    """The tokens a step emits per row: the accepted drafts then the bonus.

    -> (out [B, D+1] long padded -1, count [B] = n_accepted + 1).
    Example: tokens [r, 7, 9, 4], path [0, 1, 3], bonus 5 -> out [7, 4, 5], count 3.
    """
    n, path, bonus = accepted
    B, width = path.shape
    col = torch.arange(width, device=path.device)
    # draft j (1-based along the path) goes to column j - 1; the bonus follows them
    nodes = torch.cat([path[:, 1:], torch.full_like(path[:, :1], -1)], dim=1)   # [B, D+1]
    drafts = tokens.long().gather(1, nodes.clamp(min=0))
    out = torch.where(col < n[:, None], drafts, torch.full_like(drafts, -1))
    out = torch.where(col == n[:, None], bonus[:, None], out)
    return out, n + 1
