"""Helpers shared by the heads that draft from the target's last hidden state (Medusa, Hydra,
MLPSpeculator, ReDrafter, draft_lm): label masks, per-depth losses, teacher-forced chain
acceptance, drafter option checks and the per-slot "last hidden state" drafter.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from .base import (DraftHead, FeatureSpec, LogitLoss, acceptance_stats, chunked_logit_loss,
                   depth_valid_mask, shift_left, target_argmax)
from .layers import ResBlock

# Options any drafter accepts and may ignore: sampling settings the engine passes to every method,
# and the cache sizes a drafter with its own KV cache (draft_lm) allocates up front.
COMMON_OPTS = frozenset({"temperature", "top_p", "top_k", "seed", "max_batch", "max_len"})


def label_mask(batch: dict[str, Tensor], offset: int) -> Tensor:
    """valid [B, T]: position t is trained to predict token t+offset iff that token exists, is
    real and has loss_mask == 1 (offset 1 is the project convention "loss_mask[t+1] gates t")."""
    lm = batch["loss_mask"].bool()
    if "attention_mask" in batch:
        lm = lm & batch["attention_mask"].bool()
    return shift_left(lm, offset, fill=False)


def logits_with_bias(x: Tensor, linear: nn.Linear) -> tuple[Tensor, Tensor]:
    """(x', W') with x' @ W'.T == linear(x), for `chunked_logit_loss` (which takes no bias):
    a ones column on x [N, H] and the bias as an extra column of W [V, H] -> [N, H+1], [V, H+1]."""
    if linear.bias is None:
        return x, linear.weight
    ones = torch.ones(*x.shape[:-1], 1, dtype=x.dtype, device=x.device)
    return torch.cat([x, ones], -1), torch.cat([linear.weight, linear.bias[:, None]], 1)


def mean_loss(rows_loss: Tensor, anchor: Tensor) -> Tensor:
    """Mean of per-row losses; an empty selection gives 0 that still reaches `anchor`'s graph."""
    if rows_loss.numel() == 0:
        return anchor.sum() * 0.0
    return rows_loss.mean()


def add_depth_loss(total: Tensor, metrics: dict[str, float], k: int, weight: float,
                   r: LogitLoss, anchor: Tensor) -> Tensor:
    """total + weight · (mean loss of depth k), logging `loss_{k}` and (when any row counted)
    `top1_{k}`, the draft's agreement with its label, into `metrics`."""
    lk = mean_loss(r.loss, anchor)
    total = total + weight * lk
    metrics[f"loss_{k}"] = float(lk.detach())
    if r.top1.numel():
        metrics[f"top1_{k}"] = float((r.top1 == r.teacher_top1).float().mean())
    return total


PredictFn = Callable[[int, Tensor], "tuple[Tensor, Tensor] | None"]


@torch.no_grad()
def chain_acceptance(batch: dict[str, Tensor], depth: int, lm_head_weight: Tensor,
                     predict: PredictFn) -> dict:
    """Teacher-forced acceptance for any head: `predict(d, rows)` gives the draft's top-1 token
    [N] and its probability [N] at depth d (1-based) for the chains starting at the positions
    `rows` [B, T] bool (the chain at t reads the true tokens up to t+d), or None when the head
    cannot draft that deep. Compared with the target's argmax at position t+d."""
    valid = depth_valid_mask(batch, depth)                                # [D, B, T]
    argmax = target_argmax(batch, lm_head_weight)                         # [B, T]
    pred = torch.full(valid.shape, -1, dtype=torch.long, device=valid.device)
    conf = torch.zeros(valid.shape, device=valid.device)
    for d in range(1, depth + 1):
        rows = valid[d - 1]
        if not rows.any():
            continue
        out = predict(d, rows)
        if out is None:
            valid[d - 1:] = False     # the head cannot draft this deep: not scored
            break
        pred[d - 1][rows] = out[0].to(pred.device)
        conf[d - 1][rows] = out[1].float().to(conf.device)
    target = torch.stack([shift_left(argmax, d, fill=-1) for d in range(1, depth + 1)])
    return acceptance_stats(pred, conf, target, valid)


def top1_of(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """Top-1 token and its probability of logits x @ weight.T, chunked over rows. x [N, H]."""
    r = chunked_logit_loss(x, weight, teacher_ids=torch.zeros(x.shape[0], dtype=torch.long,
                                                                 device=x.device))
    return r.top1, r.conf


def zero_block_biases_(module: nn.Module) -> None:
    """ResBlocks start as the exact identity: Medusa zeroes the weight, and SiLU(0 + b) = 0 needs
    the bias zeroed too."""
    for m in module.modules():
        if isinstance(m, ResBlock):
            nn.init.zeros_(m.linear.bias)


def check_drafter_opts(opts: dict, known: Sequence[str], head_type: str) -> None:
    unknown = sorted(set(opts) - set(known) - COMMON_OPTS)
    if unknown:
        raise ValueError(f"unknown {head_type} drafter option(s) {unknown}; "
                         f"known: {sorted(set(known) | COMMON_OPTS)}")


class LastHiddenDrafter:
    """Drafter state for heads that read only the target's final hidden state at the last
    committed token (Medusa, Hydra, MLPSpeculator, ReDrafter): one [H] vector per slot."""

    def __init__(self, head: DraftHead):
        head.require_target_parts()
        self.head = head.eval()
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.feature_spec = FeatureSpec(hidden=True)
        self._last: dict[int, Tensor] = {}

    def reset(self, max_batch: int, max_len: int) -> None:
        self._last.clear()

    def prefill(self, slot: int, token_ids: Tensor, features: dict[str, Tensor]) -> None:
        self._keep(slot, features)

    def commit(self, slot: int, token_ids: Tensor, features: dict[str, Tensor]) -> None:
        self._keep(slot, features)

    def release(self, slot: int) -> None:
        self._last.pop(int(slot), None)

    def _keep(self, slot: int, features: dict[str, Tensor]) -> None:
        h = features.get("hidden")
        if h is None or h.ndim != 2 or h.shape[0] == 0:
            got = None if h is None else tuple(h.shape)
            raise ValueError(f"{self.head.head_type()} drafter needs features['hidden'] [n, H] "
                             f"with n >= 1, got {got}")
        self._last[int(slot)] = h[-1].detach().to(self.device, self.dtype)

    def hidden(self, slots: Tensor) -> Tensor:
        """[B, H] the last committed hidden state of each slot."""
        ids = [int(s) for s in slots.tolist()]
        missing = [s for s in ids if s not in self._last]
        if missing:
            raise KeyError(f"slot(s) {missing} have no prefilled sequence")
        return torch.stack([self._last[s] for s in ids])
