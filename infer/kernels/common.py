"""What the verification kernels share: the result type, the backend choice, the jit
decorator, and the tree checks the references run.

Backend choice (``resolve_impl``): ``SPECDEC_KERNELS=triton|reference|auto`` (default ``auto``:
Triton for CUDA tensors, the plain-PyTorch reference otherwise, or, for a kernel that has one, a
*host* version of the reference in Python lists on CPU tensors: small trees are all per-op
overhead there). An explicit ``impl=`` argument wins over the environment.

The CPU interpreter (tests): ``TRITON_INTERPRET=1`` must be set before ``triton`` is first
imported in the process, because ``triton.jit`` picks compiled vs interpreted at decoration time,
and Triton's own standard library (``tl.sum``, ``tl.zeros``, ...) is decorated when ``triton``
is imported. Tests therefore run the kernels in a subprocess (tests/infer/test_kernels.py).
"""
from __future__ import annotations

import os
from typing import Callable, NamedTuple

import torch
from torch import Tensor

try:  # Triton is a declared dependency, but a platform without wheels still gets the references
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

KERNELS_ENV = "SPECDEC_KERNELS"
IMPLS = ("auto", "triton", "reference")


class Accepted(NamedTuple):
    """What a verification returns (a tuple: ``n, path, bonus = greedy_accept(...)`` works)."""

    n_accepted: Tensor  # [B] long, accepted DRAFT nodes (the root is not counted)
    path: Tensor        # [B, D+1] long, node indices of the accepted path from the root 0, padded -1
    bonus: Tensor       # [B] long, the target's token after the last accepted node


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    if triton is None:
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def resolve_impl(device: torch.device, impl: str | None = None, host: bool = False) -> str:
    """'triton', 'reference' or ('host' when the caller has one) for tensors on `device`; see
    the module docstring."""
    choice = (impl or os.environ.get(KERNELS_ENV) or "auto").strip().lower()
    if choice not in IMPLS:
        raise ValueError(f"{KERNELS_ENV}/impl must be one of {IMPLS}, got {choice!r}")
    if choice == "auto":
        if device.type == "cuda" and triton is not None:
            return "triton"
        return "host" if host and device.type == "cpu" else "reference"
    if choice == "triton":
        if triton is None:
            raise RuntimeError("Triton kernels were requested but `triton` is not installed")
        if device.type != "cuda" and not interpreting():
            raise RuntimeError(f"Triton kernels need CUDA tensors (got {device}) or TRITON_INTERPRET=1 "
                               f"for the CPU interpreter; set {KERNELS_ENV}=reference or auto")
    return choice


def jit(fn: Callable) -> Callable:
    """`triton.jit`, or the plain function where Triton is missing (its launcher then refuses)."""
    return triton.jit(fn) if triton is not None else fn


def next_pow2(n: int, minimum: int = 2) -> int:
    """`tl.arange` sizes must be powers of two."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def check_tree_shapes(name: str, tokens: Tensor, parents: Tensor, valid: Tensor,
                      per_node: dict[str, Tensor | None]) -> tuple[int, int]:
    """Shape/dtype checks that need no device sync; returns (B, N)."""
    if tokens.dim() != 2:
        raise ValueError(f"{name}: tokens must be [B, N], got {tuple(tokens.shape)}")
    B, N = tokens.shape
    if N < 1:
        raise ValueError(f"{name}: a tree needs at least its root node (N >= 1)")
    for label, t in (("parents", parents), ("valid", valid)):
        if t.shape != (B, N):
            raise ValueError(f"{name}: {label} must be [B, N] = {(B, N)}, got {tuple(t.shape)}")
    for label, t in (("tokens", tokens), ("parents", parents)):
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{name}: {label} must be an integer tensor, got {t.dtype}")
    for label, t in per_node.items():
        if t is not None and tuple(t.shape[:2]) != (B, N):
            raise ValueError(f"{name}: {label} must start with [B, N] = {(B, N)}, got {tuple(t.shape)}")
    devices = {t.device for t in (tokens, parents, valid, *per_node.values()) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"{name}: all tensors must be on one device, got {sorted(map(str, devices))}")
    return B, N


def check_tree_values(name: str, parents: Tensor, valid: Tensor) -> None:
    """Data checks (they sync on a GPU, so only the references run them): node 0 is a valid
    root with parent -1, and every valid node's parent is a valid node with a smaller index."""
    B, N = parents.shape
    if not bool(valid[:, 0].all()):
        raise ValueError(f"{name}: node 0 (the root) must be valid in every row")
    if bool((parents[:, 0] != -1).any()):
        raise ValueError(f"{name}: parents[:, 0] must be -1 (node 0 is the root)")
    idx = torch.arange(N, device=parents.device)
    bad = valid[:, 1:] & ((parents[:, 1:] < 0) | (parents[:, 1:] >= idx[1:]))
    if bool(bad.any()):
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"{name}: node {i + 1} of row {b} has parent {int(parents[b, i + 1])}; "
                         f"a valid node's parent must be in [0, {i + 1})")
    par_valid = valid.gather(1, parents[:, 1:].clamp(min=0))
    orphan = valid[:, 1:] & ~par_valid
    if bool(orphan.any()):
        b, i = (int(v) for v in orphan.nonzero()[0])
        raise ValueError(f"{name}: valid node {i + 1} of row {b} hangs under invalid node "
                         f"{int(parents[b, i + 1])}")


def tree_depths_checked(name: str, parents: list[list[int]], valid: list[list[bool]]) -> list[list[int]]:
    """``check_tree_values`` on host lists (the same errors; a tensor pass costs ~15 ops, ~50 us a
    step on the 2-core CPU), returning each node's depth (root and invalid nodes 0)."""
    depths = []
    for b, (par, val) in enumerate(zip(parents, valid)):
        if not val[0]:
            raise ValueError(f"{name}: node 0 (the root) must be valid in every row")
        if par[0] != -1:
            raise ValueError(f"{name}: parents[:, 0] must be -1 (node 0 is the root)")
        depth = [0] * len(par)
        for i in range(1, len(par)):
            if not val[i]:
                continue
            p = par[i]
            if not 0 <= p < i:
                raise ValueError(f"{name}: node {i} of row {b} has parent {p}; "
                                 f"a valid node's parent must be in [0, {i})")
            if not val[p]:
                raise ValueError(f"{name}: valid node {i} of row {b} hangs under invalid node {p}")
            depth[i] = depth[p] + 1
        depths.append(depth)
    return depths


def node_depths(parents: Tensor, valid: Tensor) -> Tensor:
    """depth [B, N] long of every node (root 0; invalid nodes 0), in O(log N) tensor ops.

    Pointer jumping: hop[i] starts as i's parent and dist[i] as 1; each round adds the distance
    of the node hop[i] points to and jumps twice as far, so after ceil(log2 N) rounds every
    node points at the root. Example: parents [-1, 0, 1, 2] -> depth [0, 1, 2, 3].
    """
    B, N = parents.shape
    idx = torch.arange(N, device=parents.device).expand(B, N)
    ok = valid & (parents >= 0) & (parents < idx)          # [B, N] edges we trust
    hop = torch.where(ok, parents, torch.zeros_like(parents)).long()
    dist = ok.long()
    for _ in range(max(1, (N - 1).bit_length())):
        dist = dist + dist.gather(1, hop)
        hop = hop.gather(1, hop)
    return dist


def path_width(parents: Tensor, valid: Tensor, max_depth: int | None) -> int:
    """D + 1 columns of the path: `max_depth` + 1 if given, else the tree's depth + 1
    (one device sync; pass `max_depth`, e.g. the TreeBudget's, to avoid it)."""
    if max_depth is None:
        max_depth = int(node_depths(parents, valid).max()) if parents.numel() else 0
    if max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    return int(max_depth) + 1
