"""Lossless stochastic tree verification: tree-aware recursive rejection sampling.

Walk from the root u = 0 with the residual r = p_u = target_probs[u] (kept unnormalised, with
its sum S). Try u's valid children c in index order, token x = tokens[c]:
  * draft_probs None (children chosen deterministically, distinct tokens; the point-mass rule):
      accept with probability r(x) / S; on rejection r(x) <- 0 (S -= r(x)).
  * draft_probs given (c's token was sampled from q = draft_probs[c] = q(. | u); SpecInfer's
    multi-round rule): accept with probability min(1, (r(x)/S) / q(x));
      on rejection r <- max(r - S q, 0) (S = its sum; if nothing is left, which happens only
      when r is exactly S q and rejection had probability 0, r <- q).
An accepted child becomes u (r = p_c) and the walk goes on; when every child of u is rejected
(or u is a leaf, or at depth `max_depth`) the bonus token is drawn from r.
Each step emits exactly a sample of p_u, so the output distribution is the target's.

Randomness is explicit: uniforms [B, N] in [0, 1), column c > 0 for the test of node c (each
node is tested at most once) and column 0 for the bonus draw, so the Triton kernel and the
reference consume the same numbers and give the same result. Comparisons are arranged so that
no division happens: u * S < r(x) and u * q(x) * S < r(x). The bonus draw is the inverse CDF
of `specdec.infer.sampling.inverse_cdf` (first index whose running sum exceeds u * S).
"""
from __future__ import annotations

import torch
from torch import Tensor

from specdec.infer.kernels.common import (Accepted, jit, check_tree_shapes, check_tree_values,
                                          next_pow2, path_width, resolve_impl, tl)
from specdec.infer.sampling import inverse_cdf


def stochastic_accept(tokens: Tensor, parents: Tensor, valid: Tensor, target_probs: Tensor,
                      draft_probs: Tensor | None = None, uniforms: Tensor | None = None, *,
                      generator: torch.Generator | None = None, max_depth: int | None = None,
                      impl: str | None = None) -> Accepted:
    """tokens/parents/valid [B, N], target_probs [B, N, V] (processed: temperature, top-k,
    top-p), draft_probs [B, N, V] or None, uniforms [B, N] (or drawn from `generator`)
    -> Accepted(n_accepted [B], path [B, D+1], bonus [B])."""
    B, N = _check(tokens, parents, valid, target_probs, draft_probs, uniforms)
    if uniforms is None:
        uniforms = draw_uniforms(B, N, generator, tokens.device)
    if resolve_impl(tokens.device, impl) == "triton":
        return stochastic_accept_triton(tokens, parents, valid, target_probs, draft_probs, uniforms,
                                        max_depth=max_depth)
    return stochastic_accept_reference(tokens, parents, valid, target_probs, draft_probs, uniforms,
                                       max_depth=max_depth)


def draw_uniforms(B: int, N: int, generator: torch.Generator | None = None,
                  device: torch.device | str = "cpu") -> Tensor:
    """uniforms [B, N] float32 in [0, 1): all the randomness one verification step consumes."""
    return torch.rand(B, N, generator=generator, device=device, dtype=torch.float32)


def _check(tokens, parents, valid, target_probs, draft_probs, uniforms) -> tuple[int, int]:
    B, N = check_tree_shapes("stochastic_accept", tokens, parents, valid,
                             {"target_probs": target_probs, "draft_probs": draft_probs,
                              "uniforms": uniforms})
    if target_probs.dim() != 3:
        raise ValueError(f"stochastic_accept: target_probs must be [B, N, V], got {tuple(target_probs.shape)}")
    if draft_probs is not None and draft_probs.shape != target_probs.shape:
        raise ValueError(f"stochastic_accept: draft_probs {tuple(draft_probs.shape)} must match "
                         f"target_probs {tuple(target_probs.shape)}")
    if uniforms is not None and uniforms.shape != (B, N):
        raise ValueError(f"stochastic_accept: uniforms must be [B, N] = {(B, N)}, got {tuple(uniforms.shape)}")
    return B, N


def stochastic_accept_reference(tokens: Tensor, parents: Tensor, valid: Tensor, target_probs: Tensor,
                                draft_probs: Tensor | None, uniforms: Tensor, *,
                                max_depth: int | None = None) -> Accepted:
    """The specification, in plain PyTorch: every row walks its tree at once (one pass over the
    node index; a row's walk only moves to higher node indices, so one pass visits each node
    in the order the walk needs it)."""
    B, N = _check(tokens, parents, valid, target_probs, draft_probs, uniforms)
    check_tree_values("stochastic_accept", parents, valid)
    V = target_probs.shape[-1]
    bad = valid[:, 1:] & ((tokens[:, 1:] < 0) | (tokens[:, 1:] >= V))
    if bool(bad.any()):
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"stochastic_accept: node {i + 1} of row {b} has token {int(tokens[b, i + 1])} "
                         f"outside the vocabulary [0, {V})")
    width = path_width(parents, valid, max_depth)
    dev = tokens.device
    rows = torch.arange(B, device=dev)
    tokens, parents, uniforms = tokens.long(), parents.long(), uniforms.float()

    node = torch.zeros(B, dtype=torch.long, device=dev)          # [B] where each walk stands
    depth = torch.zeros(B, dtype=torch.long, device=dev)         # [B] accepted drafts so far
    path = torch.full((B, width), -1, dtype=torch.long, device=dev)
    path[:, 0] = 0
    resid = target_probs[:, 0].float().clone()                   # [B, V] r
    total = resid.sum(-1)                                        # [B] S = sum(r)
    for c in range(1, N):
        tried = valid[:, c] & (parents[:, c] == node) & (depth < width - 1)   # [B]
        x = tokens[:, c : c + 1].clamp(0, V - 1)      # [B, 1] (padding may hold any token)
        r_x = resid.gather(1, x)[:, 0]                                        # [B]
        u = uniforms[:, c]
        if draft_probs is None:
            accept = tried & (u * total < r_x)                   # P = r(x) / S
            reject = tried & ~accept
            resid.scatter_(1, x, torch.where(reject, 0.0, r_x)[:, None])
            total = torch.where(reject, total - r_x, total)
        else:
            q = draft_probs[:, c].float()                        # [B, V]
            q_x = q.gather(1, x)[:, 0]
            accept = tried & (u * q_x * total < r_x)             # P = min(1, (r(x)/S) / q(x))
            reject = tried & ~accept
            shrunk = (resid - total[:, None] * q).clamp_min(0.0)  # r - S q, floored at 0
            shrunk_total = shrunk.sum(-1)
            empty = shrunk_total <= 0                            # only when r == S q exactly
            shrunk = torch.where(empty[:, None], q, shrunk)
            shrunk_total = torch.where(empty, q.sum(-1), shrunk_total)
            resid = torch.where(reject[:, None], shrunk, resid)
            total = torch.where(reject, shrunk_total, total)
        # An accepted child becomes the node; its target distribution the new residual.
        depth = depth + accept.long()
        path[rows[accept], depth[accept]] = c
        node = torch.where(accept, c, node)
        p_c = target_probs[:, c].float()
        resid = torch.where(accept[:, None], p_c, resid)
        total = torch.where(accept, p_c.sum(-1), total)

    fallback = target_probs[rows, node].float().argmax(-1)      # unreachable in exact arithmetic
    bonus = inverse_cdf(resid, uniforms[:, 0], total, fallback)
    return Accepted(depth, path, bonus)


@jit
def _stochastic_accept_kernel(tokens_ptr, parents_ptr, valid_ptr, p_ptr, q_ptr, u_ptr, resid_ptr,
                              n_acc_ptr, path_ptr, bonus_ptr,
                              N, V, D,
                              stride_tok, stride_par, stride_val, stride_pb, stride_pn,
                              stride_qb, stride_qn, stride_u, stride_r, stride_path,
                              HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per batch row, walking the tree sequentially like the reference. The residual
    # r lives in a [V] scratch row. Every pass over it maps element i to the same thread, but
    # the scalar read r[x] is done by every warp, so each write to r is fenced by barriers on
    # both sides: before it (no warp may still be about to read r[x]) and after it (every warp
    # must see it).
    b = tl.program_id(0).to(tl.int64)
    tok_row = tokens_ptr + b * stride_tok
    par_row = parents_ptr + b * stride_par
    val_row = valid_ptr + b * stride_val
    u_row = u_ptr + b * stride_u
    r_row = resid_ptr + b * stride_r
    offs_v = tl.arange(0, BLOCK_V)
    offs_d = tl.arange(0, BLOCK_D)

    node = tl.full([], 0, tl.int64)          # the walk's current node
    depth = tl.full([], 0, tl.int32)         # accepted drafts
    total = tl.full([], 0.0, tl.float32)     # S = sum(r)
    need_load = tl.full([], 1, tl.int32)     # r must be (re)loaded from p[node]
    path = tl.where(offs_d == 0, 0, -1).to(tl.int64)
    # c == N is one extra round that only performs a pending load.
    for c in range(1, N + 1):
        if need_load != 0:                   # r <- p[node], S <- sum(r)
            tl.debug_barrier()
            p_row = p_ptr + b * stride_pb + node * stride_pn
            acc = tl.zeros([BLOCK_V], tl.float32)
            for v0 in range(0, V, BLOCK_V):
                idx = v0 + offs_v
                pv = tl.load(p_row + idx, mask=idx < V, other=0.0).to(tl.float32)
                tl.store(r_row + idx, pv, mask=idx < V)
                acc += pv
            total = tl.sum(acc, axis=0)
            need_load = 0
            tl.debug_barrier()
        if c < N:
            c64 = tl.cast(c, tl.int64)
            par = tl.load(par_row + c64)
            vld = tl.load(val_row + c64)
            if (vld != 0) & (par == node) & (depth < D):
                x = tl.load(tok_row + c64)
                x = tl.minimum(tl.maximum(x, 0), V - 1)  # never read outside the row
                u = tl.load(u_row + c64)
                r_x = tl.load(r_row + x)
                if HAS_Q:
                    q_row = q_ptr + b * stride_qb + c64 * stride_qn
                    q_x = tl.load(q_row + x).to(tl.float32)
                    accept = u * q_x * total < r_x
                else:
                    accept = u * total < r_x
                if accept:
                    depth += 1
                    path = tl.where(offs_d == depth, c64, path)
                    node = c64
                    need_load = 1
                else:
                    tl.debug_barrier()
                    if HAS_Q:                # r <- max(r - S q, 0)
                        acc = tl.zeros([BLOCK_V], tl.float32)
                        for v0 in range(0, V, BLOCK_V):
                            idx = v0 + offs_v
                            rv = tl.load(r_row + idx, mask=idx < V, other=0.0)
                            qv = tl.load(q_row + idx, mask=idx < V, other=0.0).to(tl.float32)
                            nr = tl.maximum(rv - total * qv, 0.0)
                            tl.store(r_row + idx, nr, mask=idx < V)
                            acc += nr
                        new_total = tl.sum(acc, axis=0)
                        tl.debug_barrier()
                        if new_total <= 0.0:  # r was exactly S q: continue from q itself
                            acc = tl.zeros([BLOCK_V], tl.float32)
                            for v0 in range(0, V, BLOCK_V):
                                idx = v0 + offs_v
                                qv = tl.load(q_row + idx, mask=idx < V, other=0.0).to(tl.float32)
                                tl.store(r_row + idx, qv, mask=idx < V)
                                acc += qv
                            new_total = tl.sum(acc, axis=0)
                            tl.debug_barrier()
                        total = new_total
                    else:                    # point mass: remove x
                        tl.store(r_row + x, 0.0)
                        total = total - r_x
                        tl.debug_barrier()

    # Bonus: first index whose running sum exceeds u0 * S (see sampling.inverse_cdf).
    thr = tl.load(u_row) * total
    running = tl.full([], 0.0, tl.float32)
    first = tl.full([], -1, tl.int32)
    last_pos = tl.full([], -1, tl.int32)
    for v0 in range(0, V, BLOCK_V):
        idx = v0 + offs_v
        rv = tl.load(r_row + idx, mask=idx < V, other=0.0)
        cs = tl.cumsum(rv, axis=0) + running
        hit = tl.min(tl.where((cs > thr) & (idx < V), idx, V), axis=0)
        first = tl.where((first < 0) & (hit < V), hit, first)
        last_pos = tl.maximum(last_pos, tl.max(tl.where(rv > 0.0, idx, -1), axis=0))
        running += tl.sum(rv, axis=0)
    if first < 0:
        first = last_pos
    if first < 0:                            # no residual mass at all: argmax of p[node]
        p_row = p_ptr + b * stride_pb + node * stride_pn
        best_val = tl.full([], -1.0, tl.float32)
        for v0 in range(0, V, BLOCK_V):
            idx = v0 + offs_v
            pv = tl.load(p_row + idx, mask=idx < V, other=-1.0).to(tl.float32)
            m = tl.max(pv, axis=0)
            at = tl.min(tl.where(pv == m, idx, V), axis=0)
            first = tl.where(m > best_val, at, first)
            best_val = tl.maximum(best_val, m)
    tl.store(path_ptr + b * stride_path + offs_d, path, mask=offs_d < D + 1)
    tl.store(n_acc_ptr + b, depth.to(tl.int64))
    tl.store(bonus_ptr + b, first.to(tl.int64))




def stochastic_accept_triton(tokens: Tensor, parents: Tensor, valid: Tensor, target_probs: Tensor,
                             draft_probs: Tensor | None, uniforms: Tensor, *,
                             max_depth: int | None = None) -> Accepted:
    """Same contract as the reference; one Triton program per row and a [B, V] float32 scratch
    for the residuals. No host sync when `max_depth` is given."""
    B, N = _check(tokens, parents, valid, target_probs, draft_probs, uniforms)
    width = path_width(parents, valid, max_depth)
    dev, V = tokens.device, target_probs.shape[-1]
    # The kernel reads rows with unit stride along nodes and along the vocabulary.
    tokens, parents = tokens.long().contiguous(), parents.long().contiguous()
    valid_u8 = valid.to(torch.uint8).contiguous()
    uniforms = uniforms.float().contiguous()
    target_probs = target_probs.contiguous()
    q = draft_probs.contiguous() if draft_probs is not None else target_probs  # unread if None
    resid = torch.empty(B, V, dtype=torch.float32, device=dev)
    n_accepted = torch.empty(B, dtype=torch.long, device=dev)
    path = torch.empty(B, width, dtype=torch.long, device=dev)
    bonus = torch.empty(B, dtype=torch.long, device=dev)
    if B == 0:
        return Accepted(n_accepted, path, bonus)
    _stochastic_accept_kernel[(B,)](
        tokens, parents, valid_u8, target_probs, q, uniforms, resid, n_accepted, path, bonus,
        N, V, width - 1,
        tokens.stride(0), parents.stride(0), valid_u8.stride(0),
        target_probs.stride(0), target_probs.stride(1), q.stride(0), q.stride(1),
        uniforms.stride(0), resid.stride(0), path.stride(0),
        HAS_Q=draft_probs is not None, BLOCK_V=min(1024, next_pow2(V)), BLOCK_D=next_pow2(width),
        num_warps=4, enable_fp_fusion=False,  # no FMA: r - S q rounds like the reference
    )
    return Accepted(n_accepted, path, bonus)
