"""Move the accepted path's K/V entries down to consecutive positions, in place.

Verification wrote tree node i of batch row b at position base_lens[b] + i of cache slot
slots[b]. Once path[b] = [0, n1, n2, ..., -1, ...] is accepted, the entry of node path[b, j]
must sit at base_lens[b] + j (the position of the j-th committed token):
    cache[slot, :, base + j] <- cache[slot, :, base + path[b, j]]   for j = 1, 2, ... (path >= 0)
Example: base 10, path [0, 2, 5, -1] -> position 11 <- 12, position 12 <- 15.

Cache layouts accepted for `cache_k` and `cache_v` (each may also be None):
  * one layer, [max_batch, kv_heads, max_len, head_dim] (the runner's per-layer layout,
    `KVCache.k[l]`);
  * a stacked tensor [layers, max_batch, kv_heads, max_len, head_dim];
  * a list/tuple of per-layer tensors (e.g. `KVCache.layers()`, all K and V tensors).
Layers may differ in shape; the Triton path launches once per group of same-shaped tensors,
addressing the group's layers through a table of base pointers.
"""
from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import Tensor

from specdec.infer.kernels.common import jit, next_pow2, resolve_impl, tl

CacheArg = Union[Tensor, Sequence[Tensor], None]


def compact_kv(cache_k: CacheArg, cache_v: CacheArg, slots: Tensor, base_lens: Tensor, path: Tensor,
               impl: str | None = None) -> None:
    """slots [B], base_lens [B], path [B, D+1] (node indices, root 0 first, padded -1)."""
    layers = layer_tensors(cache_k) + layer_tensors(cache_v)
    _check(layers, slots, base_lens, path)
    if not layers or path.shape[0] == 0:
        return
    backend = resolve_impl(layers[0].device, impl, host=True)
    if backend == "triton":
        compact_kv_triton(layers, None, slots, base_lens, path)
    elif backend == "host":
        compact_kv_host(layers, None, slots, base_lens, path)
    else:
        compact_kv_reference(layers, None, slots, base_lens, path)


def layer_tensors(cache: CacheArg) -> list[Tensor]:
    """Every per-layer [max_batch, kv_heads, max_len, head_dim] tensor in `cache` (views)."""
    if cache is None:
        return []
    if isinstance(cache, Tensor):
        if cache.dim() == 4:
            return [cache]
        if cache.dim() == 5:
            return list(cache.unbind(0))
        raise ValueError(f"compact_kv: a cache tensor must be [max_batch, kv_heads, max_len, head_dim] "
                         f"or [layers, max_batch, ...], got {tuple(cache.shape)}")
    out: list[Tensor] = []
    for t in cache:
        out.extend(layer_tensors(t))
    return out


def _check(layers: list[Tensor], slots: Tensor, base_lens: Tensor, path: Tensor) -> None:
    if path.dim() != 2:
        raise ValueError(f"compact_kv: path must be [B, D+1], got {tuple(path.shape)}")
    B = path.shape[0]
    if slots.shape != (B,) or base_lens.shape != (B,):
        raise ValueError(f"compact_kv: slots {tuple(slots.shape)} and base_lens {tuple(base_lens.shape)} "
                         f"must be [B] = [{B}] like path's rows")
    devices = {t.device for t in (*layers, slots, base_lens, path)}
    if len(devices) > 1:
        raise ValueError(f"compact_kv: all tensors must be on one device, got {sorted(map(str, devices))}")


def _check_values(layers: list[Tensor], slots: Tensor, base_lens: Tensor, path: Tensor) -> None:
    """Data checks (device syncs: the reference runs them, the kernel trusts its inputs)."""
    B, P = path.shape
    j = torch.arange(P, device=path.device)
    bad = (path >= 0) & (path < j)
    if bool(bad.any()):
        b, col = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"compact_kv: path[{b}, {col}] = {int(path[b, col])} < {col}; an accepted "
                         f"path's j-th node has index >= j")
    if B > 1 and slots.unique().numel() != B:
        raise ValueError(f"compact_kv: slots must be distinct, got {slots.tolist()}")
    far = int((base_lens + path.max(dim=1).values).max())
    lowest = min(int(slots.min()), int(base_lens.min()))  # once: per layer it cost ~0.4 ms a commit
    top_slot = int(slots.max())
    for t in layers:
        if lowest < 0 or top_slot >= t.shape[0] or far >= t.shape[2]:
            raise ValueError(f"compact_kv: slots {slots.tolist()} / positions up to {far} do not fit "
                             f"a cache of shape {tuple(t.shape)}")


def compact_kv_reference(cache_k: CacheArg, cache_v: CacheArg, slots: Tensor, base_lens: Tensor,
                         path: Tensor) -> None:
    """The specification, in plain PyTorch."""
    layers = layer_tensors(cache_k) + layer_tensors(cache_v)
    _check(layers, slots, base_lens, path)
    _check_values(layers, slots, base_lens, path)
    slots, base_lens, path = slots.long(), base_lens.long(), path.long()
    # Increasing j is safe in place: path[b, j] >= j, so step j writes position base + j, which
    # no later step reads (they read base + path[b, j'] >= base + j' > base + j), and it reads
    # base + path[b, j], which only step path[b, j] >= j writes: later, or now as a no-op.
    for j in range(1, path.shape[1]):
        src = path[:, j]                                       # [B]
        move = (src >= 0) & (src != j)                         # [B]
        if not bool(move.any()):
            continue
        s, base = slots[move], base_lens[move]                 # [M]
        for t in layers:
            t[s, :, base + j] = t[s, :, base + src[move]]      # [M, kv_heads, head_dim]


def compact_kv_host(cache_k: CacheArg, cache_v: CacheArg, slots: Tensor, base_lens: Tensor,
                    path: Tensor) -> None:
    """Same contract as the reference, the runtime's CPU path: the moves of every row are listed
    on the host in increasing j (so, as in the reference, no move reads a position an earlier
    one wrote) and done by the glue kernel's ``move_positions_``, one call for all cache tensors,
    or else as one gather-then-scatter per tensor (the right-hand side is a copy). The
    reference's loop over path columns costs ~2.5 ms a step on the 2-core CPU (60 tensors x each
    moved column), the index ops ~0.6, the kernel ~0.02. Tested equal to the reference."""
    layers = layer_tensors(cache_k) + layer_tensors(cache_v)
    _check(layers, slots, base_lens, path)
    _check_values(layers, slots, base_lens, path)
    rows, dst, src = [], [], []
    for slot, base, nodes in zip(slots.tolist(), base_lens.tolist(), path.tolist()):
        for j, node in enumerate(nodes):
            if node >= 0 and node != j:
                rows.append(slot), dst.append(base + j), src.append(base + node)
    if not rows:
        return
    dev = path.device
    rows_t, dst_t, src_t = (torch.tensor(v, dtype=torch.long, device=dev) for v in (rows, dst, src))
    if dev.type == "cpu" and all(t.is_contiguous() for t in layers):
        from specdec.infer.models import glue_cpu

        if glue_cpu.KERNEL.get() is not None:  # the moves in list order, one call for every tensor
            glue_cpu.move_positions_(layers, rows_t, dst_t, src_t)
            return
    for t in layers:
        t[rows_t, :, dst_t] = t[rows_t, :, src_t]                     # [M, kv_heads, head_dim]


@jit
def _compact_kv_kernel(table_ptr, slots_ptr, base_lens_ptr, path_ptr,
                       P, H, HEAD_DIM,
                       stride_b, stride_h, stride_t, stride_d, stride_path,
                       WORD: tl.constexpr, BLOCK_D: tl.constexpr):
    # grid (B, layers * H): one program per (batch row, layer, head), walking j in increasing
    # order (see the reference for why that order is safe in place). Each program owns a
    # disjoint slice of the cache and maps element i to the same thread at every j, so no
    # barrier is needed.
    row = tl.program_id(0).to(tl.int64)
    gh = tl.program_id(1)
    layer = gh // H
    head = (gh % H).to(tl.int64)
    # Entries are moved as raw words of the element size (any dtype, fp8 included).
    base_addr = tl.load(table_ptr + layer).to(tl.pointer_type(WORD))
    slot = tl.load(slots_ptr + row).to(tl.int64)
    base = tl.load(base_lens_ptr + row).to(tl.int64)
    head_ptr = base_addr + slot * stride_b + head * stride_h
    offs = tl.arange(0, BLOCK_D)
    in_dim = offs < HEAD_DIM
    for j in range(1, P):
        j64 = tl.cast(j, tl.int64)
        # the source node, broadcast to a vector (the CPU interpreter mistypes vector & scalar masks)
        src = tl.load(path_ptr + row * stride_path + j64) + tl.zeros([BLOCK_D], tl.int64)
        move = in_dim & (src >= 0) & (src != j64)
        vals = tl.load(head_ptr + (base + src) * stride_t + offs * stride_d, mask=move)
        tl.store(head_ptr + (base + j64) * stride_t + offs * stride_d, vals, mask=move)


_WORDS = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}
_TABLES: dict[tuple, Tensor] = {}  # pointer tables, keyed by (device, addresses)


def _pointer_table(group: list[Tensor]) -> Tensor:
    """[G] int64 device tensor of the group's base addresses, built once per cache."""
    key = (str(group[0].device), tuple(t.data_ptr() for t in group))
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) > 64:  # caches are long-lived; this only bounds pathological churn
            _TABLES.clear()
        table = torch.tensor(key[1], dtype=torch.int64, device=group[0].device)
        _TABLES[key] = table
    return table


def compact_kv_triton(cache_k: CacheArg, cache_v: CacheArg, slots: Tensor, base_lens: Tensor,
                      path: Tensor) -> None:
    """Same contract as the reference; one launch per group of same-shaped layer tensors."""
    layers = layer_tensors(cache_k) + layer_tensors(cache_v)
    _check(layers, slots, base_lens, path)
    B, P = path.shape
    if not layers or B == 0 or P < 2:
        return
    slots, base_lens, path = (t.long().contiguous() for t in (slots, base_lens, path))
    groups: dict[tuple, list[Tensor]] = {}
    for t in layers:
        if t.element_size() not in _WORDS:
            raise ValueError(f"compact_kv: unsupported element size {t.element_size()} ({t.dtype})")
        groups.setdefault((t.shape, t.stride(), t.element_size()), []).append(t)
    for (shape, stride, size), group in groups.items():
        _, H, _, head_dim = shape
        _compact_kv_kernel[(B, len(group) * H)](
            _pointer_table(group), slots, base_lens, path,
            P, H, head_dim,
            stride[0], stride[1], stride[2], stride[3], path.stride(0),
            WORD=getattr(tl, _WORDS[size]), BLOCK_D=next_pow2(head_dim, 16),
            num_warps=1 if head_dim <= 128 else 2,
        )
