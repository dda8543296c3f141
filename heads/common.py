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
# the cache sizes a drafter with its own KV cache (draft_lm) allocates up front, and how many
# of the most frequent tokens a full-vocabulary head scores (DraftLogits).
COMMON_OPTS = frozenset({"temperature", "top_p", "top_k", "seed", "max_batch", "max_len", "draft_vocab"})
# Tokens a full-vocabulary head scores while drafting, as EAGLE-3's reduced vocabulary (8,192 of
# SmolLM2's 49,152 cover ~98% of the training replies' tokens); 0 scores them all.
DRAFT_VOCAB = 8192


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


class DraftLogits:
    """A drafter's output layers over the target vocabulary. When the head carries its training
    data's token counts (``DraftHead.token_counts``) a vocabulary-sized layer scores only the
    ``draft_vocab`` most frequent tokens (``FrequentVocabLinear``: every other token gets
    probability 0); layers of another width (EAGLE-3's own reduced vocabulary), heads without
    counts or ``draft_vocab=0`` score every row. Each layer is prepacked here (bf16 on CPU;
    ``load_draft_head`` leaves vocabulary-sized layers to it) and rebuilt whenever its weight
    changes (moved, cast or trained in place)."""

    def __init__(self, head: DraftHead, draft_vocab: int | None = DRAFT_VOCAB):
        if draft_vocab is not None and (isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int)
                                        or draft_vocab < 0):
            raise ValueError(f"draft_vocab must be an integer >= 0 (0: the whole vocabulary), got {draft_vocab!r}")
        self.vocab = getattr(head.config, "vocab_size", 0)
        self.keep = head.frequent_tokens(draft_vocab) if draft_vocab else None
        self._layers: dict[int, tuple] = {}  # id(weight) -> (weight's version key, layer)

    def __call__(self, x: Tensor, layer: nn.Linear | Tensor) -> Tensor:
        """Logits of x [..., H] through ``layer`` (an nn.Linear, or a weight [V, H])."""
        weight, bias = (layer.weight, layer.bias) if isinstance(layer, nn.Linear) else (layer, None)
        key = (weight.data_ptr(), weight.dtype, weight._version)
        hit = self._layers.get(id(weight))
        if hit is None or hit[0] != key:
            from specdec.infer.models.linear import vocab_linear

            keep = self.keep if weight.shape[0] == self.vocab else None
            hit = self._layers[id(weight)] = (key, vocab_linear(
                weight.detach(), None if bias is None else bias.detach(), keep))
        return hit[1](x)


class LastHiddenDrafter:
    """Drafter state for heads that read only the target's final hidden state at the last
    committed token (Medusa, Hydra, MLPSpeculator, ReDrafter): one [H] vector per slot.
    ``self.logits(x, linear)`` is the head's vocabulary layer (DraftLogits)."""

    def __init__(self, head: DraftHead, draft_vocab: int | None = DRAFT_VOCAB):
        head.require_target_parts()
        self.head = head.eval()
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.logits = DraftLogits(head, draft_vocab)
        self.feature_spec = FeatureSpec(hidden=True)
        self.feature_tail = 1  # a prefix cache keeps only what _keep reads: the last hidden state
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
