"""The target runner: prefill, tree verification and in-place KV compaction over a static cache.

Timeline of one sequence in slot s (see docs/ARCHITECTURE.md, drafter protocol):
  prefill(s, prompt)                 K/V of the prompt at 0..n-1; logits of the last token
  verify([s], tree, [n])             K/V of tree node i at n+i; logits [B, N, V] of every node
  commit([s], [n], path, n_acc)      path node path[j] moves to n+j (j = 0..n_acc); the rest is
                                     garbage past the new length n+n_acc+1 and is overwritten later
Nothing is recomputed: the accepted nodes' K/V are exactly those computed during verification,
because a node's attention saw precisely its committed prefix and its ancestors.

Features (what a drafter's ``feature_spec`` asks for) come back per token: ``hidden`` [.., H] is the
final post-norm hidden state, ``aux`` [.., A*H] the HF ``hidden_states[l]`` for l in
``aux_layers`` concatenated (hidden_states[l] = input of decoder layer l).
"""
from __future__ import annotations

import torch
from torch import Tensor

from specdec.heads.tree import DraftTree, tree_masks

from .cache import KVCache, StepAccess
from .dtypes import torch_dtype
from .models import build_backend

class TargetRunner:
    """Runs a frozen target over a preallocated ``[max_batch, max_len]`` KV cache.

    ``impl``: "auto" (lean fused path when the architecture allows, else generic), "lean" or
    "generic". ``feature_spec`` (settable later) says which features each call returns.
    """

    def __init__(self, target, max_batch: int = 8, max_len: int = 2048, dtype=None, device=None,
                 feature_spec=None, impl: str = "auto"):
        param = next(target.model.parameters())
        self.target = target
        self.device = torch.device(device) if device is not None else param.device
        self.dtype = param.dtype if dtype is None else torch_dtype(dtype, self.device)
        self.backend = build_backend(target.model, self.dtype, self.device, impl)
        self.cache = KVCache(self.backend.kv_shapes, max_batch, max_len, self.dtype, self.device)
        self.max_batch, self.max_len = max_batch, max_len
        self.feature_spec = feature_spec

    @property
    def impl(self) -> str:
        return "lean" if type(self.backend).__name__.startswith("Lean") else "generic"

    @property
    def aux_layers(self) -> tuple[int, ...]:
        layers = tuple(getattr(self.feature_spec, "aux_layers", ()) or ())
        bad = [l for l in layers if not 0 <= l <= self.backend.num_layers]
        if bad:
            raise ValueError(f"aux_layers {bad} outside 0..{self.backend.num_layers} (HF hidden_states indices)")
        return layers

    def _features(self, hidden: Tensor, aux: Tensor | None) -> dict[str, Tensor]:
        feats = {}
        if self.feature_spec is None or getattr(self.feature_spec, "hidden", True):
            feats["hidden"] = hidden
        if aux is not None:
            feats["aux"] = aux
        return feats

    # ------------------------------------------------------------------ prefill
    def prefill(self, slot: int, ids, start: int = 0) -> tuple[Tensor, dict[str, Tensor]]:
        """Run ``ids`` [n] at positions ``start..start+n-1`` of ``slot`` (start > 0 continues a
        chunked prefill, or decodes one token at a time). -> logits of the last token [V],
        features {name: [n, ...]}."""
        logits, feats = self.prefill_batch([slot], [ids], [start])
        return logits[0], feats[0]

    def prefill_batch(self, slots: list[int], ids_list, starts: list[int] | None = None):
        """Several prompts (or prompt chunks) in one padded forward: each is a chain "tree";
        right padding is computed but never written to the cache. -> (logits of each last token [B, V],
        list of per-sequence feature dicts {name: [n_b, ...]})."""
        ids_list = [torch.as_tensor(ids, dtype=torch.long).flatten() for ids in ids_list]
        lens = [int(ids.numel()) for ids in ids_list]
        if min(lens, default=0) < 1:
            raise ValueError("prefill needs at least one token per sequence")
        starts = [0] * len(slots) if starts is None else list(starts)
        piece = getattr(self.backend, "prefill_piece", None)
        if piece is not None and max(lens) > piece:
            return self._prefill_in_pieces(slots, ids_list, starts, piece)
        n, dev = max(lens), self.device
        tokens = torch.zeros(len(slots), n, dtype=torch.long, device=dev)   # [B, N]
        for b, ids in enumerate(ids_list):
            tokens[b, :lens[b]] = ids.to(dev)
        lens_t = torch.tensor(lens, device=dev)
        valid = torch.arange(n, device=dev)[None, :] < lens_t[:, None]      # [B, N]
        causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        eye = torch.eye(n, dtype=torch.bool, device=dev)
        mask = (causal[None] & valid[:, None, :]) | eye[None]               # [B, N, N]
        access = StepAccess(self.cache, list(slots), starts, n, valid)
        positions = access.write_pos                                        # [B, N]
        logits, hidden, aux = self.backend.forward(tokens, positions, access, mask, self.aux_layers,
                                                   logits_rows=lens_t - 1, causal=True)
        feats = [self._features(hidden[b, :lens[b]], None if aux is None else aux[b, :lens[b]])
                 for b in range(len(slots))]
        return logits, feats

    def _prefill_in_pieces(self, slots, ids_list, starts, piece: int):
        """``prefill_batch`` as forwards of at most ``piece`` tokens a sequence (the backend's
        bound): each sequence's logits from the piece holding its last token, its features joined."""
        logits, feats = [None] * len(slots), [[] for _ in slots]
        for at in range(0, max(len(ids) for ids in ids_list), piece):
            rows = [b for b, ids in enumerate(ids_list) if len(ids) > at]
            lg, ft = self.prefill_batch([slots[b] for b in rows], [ids_list[b][at:at + piece] for b in rows],
                                        [starts[b] + at for b in rows])
            for j, b in enumerate(rows):
                logits[b] = lg[j]
                feats[b].append(ft[j])
        joined = [{k: torch.cat([f[k] for f in parts]) for k in parts[0]} for parts in feats]
        return torch.stack(logits), joined

    # ------------------------------------------------------------------ verify / commit
    def verify(self, slots, tree: DraftTree, base_lens) -> tuple[Tensor, dict[str, Tensor]]:
        """Score every node of ``tree`` (node i of sequence b at cache position base_lens[b]+i,
        rope position base_lens[b]+depth). -> logits [B, N, V], features {name: [B, N, ...]}.
        The logits at node i are the target's distribution of the token *after* node i."""
        slots, base_lens = _as_list(slots), _as_list(base_lens)
        tokens = tree.tokens.to(self.device)                                # [B, N]
        depth, ancestors = tree_masks(tree.parents.to(self.device))         # [B, N], [B, N, N]
        access = StepAccess(self.cache, slots, base_lens, tokens.shape[1], tree.valid.to(self.device))
        positions = access.base_lens[:, None] + depth                       # [B, N]
        logits, hidden, aux = self.backend.forward(tokens, positions, access, ancestors, self.aux_layers)
        return logits, self._features(hidden, aux)

    def commit(self, slots, base_lens, path_nodes: Tensor, n_accepted: Tensor) -> None:
        """Keep the accepted path's K/V: node ``path_nodes[b, j]`` moves to ``base_lens[b] + j``
        for j = 0..n_accepted[b] (the root, at j = 0, is already in place). In place, no recompute."""
        from specdec.infer.verify import compact_kv

        dev = self.device
        path = path_nodes.to(dev).clone()                                   # [B, D+1], -1 padded
        n_acc = torch.as_tensor(n_accepted, device=dev).view(-1, 1)
        path[torch.arange(path.shape[1], device=dev)[None, :] > n_acc] = -1  # keep j <= n_accepted
        slots_t = torch.as_tensor(_as_list(slots), dtype=torch.long, device=dev)
        base_t = torch.as_tensor(_as_list(base_lens), dtype=torch.long, device=dev)
        compact_kv(self.cache.k, self.cache.v, slots_t, base_t, path)


def _as_list(x) -> list[int]:
    return x.tolist() if isinstance(x, Tensor) else [int(v) for v in x]
