"""Hydra heads (Ankner et al., 2024): sequentially dependent Medusa heads.

Head k (0-based) reads the final hidden state h_t together with the embeddings of every token
already on its path — the pending root x_{t+1} and the drafts before it — and predicts token
t+k+2 (Hydra's "prefix MLP" form):

    z_k = Blocks_k(concat(h_t, emb(x_{t+1}), ..., emb(x_{t+k+1})))      # [(k+2)·H] -> [H]
    logits_k = hydra_lm_head_k(z_k)

The first block of head k is Hydra's conditioned residual block, `res_connection(x) +
SiLU(linear(x))` with both linears reading the (k+2)·H input; the other `num_layers - 1` blocks
are Medusa ResBlocks, each head owning its own. Names follow the reference implementation
(`hydra_mlp.{k}.{j}.linear/res_connection`, `hydra_lm_head.{k}.weight/bias`). Unlike the
reference's random init, `res_connection` starts as "take h_t" and the LM heads as copies of
the target's, so an untrained head starts from the target's next-token distribution, as Medusa's.

Loss: Medusa's (sum_k 0.8^k CE vs token t+k+2) with teacher forcing on the true tokens.
Drafter: EAGLE-2-style dynamic tree (`expand_dynamic_tree`): every node's children come from the
head of its depth applied to its own path.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import (DraftHead, FeatureSpec, chunked_logit_loss, frozen_embedding, frozen_linear,
                   shift_left)
from .layers import ResBlock
from .common import (DRAFT_VOCAB, LastHiddenDrafter, add_depth_loss, chain_acceptance, check_drafter_opts,
                     label_mask, logits_with_bias, top1_of, zero_block_biases_)
from .tree import DraftTree, Frontier, TreeBudget, expand_dynamic_tree


class PrefixResBlock(nn.Module):
    """Hydra's first block: res_connection(x) + SiLU(linear(x)), x = [h ; n token embeddings]."""

    def __init__(self, hidden: int, num_condition: int):
        super().__init__()
        d_in = hidden * (num_condition + 1)
        self.linear = nn.Linear(d_in, hidden)
        self.res_connection = nn.Linear(d_in, hidden)
        with torch.no_grad():
            nn.init.zeros_(self.linear.weight)
            nn.init.zeros_(self.linear.bias)
            self.res_connection.weight.zero_()
            self.res_connection.weight[:, :hidden] = torch.eye(hidden)   # starts as x -> h_t
            self.res_connection.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        return self.res_connection(x) + F.silu(self.linear(x))


@dataclass
class HydraConfig:
    hidden_size: int = 0        # the target's (set by from_target)
    vocab_size: int = 0         # the target's
    num_heads: int = 4          # head k predicts the token k+2 positions ahead
    num_layers: int = 1         # blocks per head, the first being the prefix block
    loss_decay: float = 0.8     # head k's loss weight is loss_decay**k


class HydraHead(DraftHead):
    Config = HydraConfig
    FROZEN_PARTS = {"embed_tokens": "embed_tokens", "target_lm_head": "lm_head"}

    def __init__(self, config: HydraConfig):
        super().__init__(config)
        H, V, K, L = config.hidden_size, config.vocab_size, config.num_heads, config.num_layers
        if H <= 0 or V <= 0:
            raise ValueError("HydraConfig needs hidden_size and vocab_size (use from_target)")
        if K < 1 or L < 1:
            raise ValueError(f"Hydra needs num_heads >= 1 and num_layers >= 1, got {K}, {L}")
        self.hydra_mlp = nn.ModuleList(
            nn.Sequential(PrefixResBlock(H, k + 1), *[ResBlock(H) for _ in range(L - 1)])
            for k in range(K))
        # uninitialised: from_target copies the target's LM head (zero bias), load_head the saved
        self.hydra_lm_head = nn.ModuleList(nn.utils.skip_init(nn.Linear, H, V) for _ in range(K))
        self.embed_tokens = frozen_embedding(V, H)
        self.target_lm_head = frozen_linear(H, V)
        zero_block_biases_(self.hydra_mlp)

    @classmethod
    def target_config(cls, target) -> dict:
        return {"hidden_size": target.hidden_size, "vocab_size": target.vocab_size}

    @classmethod
    def from_target(cls, target, **fields) -> "HydraHead":
        head = super().from_target(target, **fields)
        with torch.no_grad():
            for lm in head.hydra_lm_head:
                lm.weight.copy_(head.target_lm_head.weight)
                lm.bias.zero_()
        return head

    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(hidden=True)

    def prefix_inputs(self, k: int, h: Tensor, emb: Tensor, rows: Tensor) -> Tensor:
        """Head k's teacher-forced input at the positions `rows` [B, T]: concat(h_t,
        emb(x_{t+1}), ..., emb(x_{t+k+1})) -> [N, (k+2)·H]. h / emb [B, T, H]."""
        parts = [h[rows]] + [shift_left(emb, j)[rows] for j in range(1, k + 2)]
        return torch.cat(parts, -1)

    # --- training ---------------------------------------------------------------------------
    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
        self.require_target_parts()
        h = batch["hidden"].to(self.embed_tokens.weight.dtype)             # [B, T, H]
        ids = batch["input_ids"].long()
        emb = self.embed_tokens(ids)                                        # [B, T, H] frozen
        total, metrics = h.new_zeros(()), {}
        for k in range(self.config.num_heads):
            valid = label_mask(batch, k + 2)                                # [B, T]
            z = self.hydra_mlp[k](self.prefix_inputs(k, h, emb, valid))     # [N, H]
            x, w = logits_with_bias(z, self.hydra_lm_head[k])
            r = chunked_logit_loss(x, w, teacher_ids=shift_left(ids, k + 2)[valid])
            total = add_depth_loss(total, metrics, k, self.config.loss_decay ** k, r, z)
        metrics["loss"] = float(total.detach())
        return total, metrics

    @torch.no_grad()
    def acceptance(self, batch: dict[str, Tensor], depth: int) -> dict:
        self.require_target_parts()
        h = batch["hidden"].to(self.embed_tokens.weight.dtype)
        emb = self.embed_tokens(batch["input_ids"].long())

        def predict(d: int, rows: Tensor):
            if d > self.config.num_heads:
                return None
            z = self.hydra_mlp[d - 1](self.prefix_inputs(d - 1, h, emb, rows))
            return top1_of(*logits_with_bias(z, self.hydra_lm_head[d - 1]))

        return chain_acceptance(batch, depth, self.target_lm_head.weight, predict)

    # --- drafting ---------------------------------------------------------------------------
    def new_drafter(self, target=None, **opts) -> "HydraDrafter":
        check_drafter_opts(opts, [], self.head_type())
        return HydraDrafter(self, opts.get("draft_vocab", DRAFT_VOCAB))


class HydraDrafter(LastHiddenDrafter):
    """Dynamic tree: the frontier at depth d runs head d on [h ; embeddings of its path]."""

    @torch.no_grad()
    def propose(self, slots: Tensor, roots: Tensor, budget: TreeBudget) -> DraftTree:
        head: HydraHead = self.head
        h = self.hidden(slots)                                              # [B, H]
        budget = dataclasses.replace(budget, max_depth=min(budget.max_depth, head.config.num_heads))
        inputs: list[Tensor] = []   # the previous frontier's inputs [B, F, (d+1)·H]

        def step(fr: Frontier) -> Tensor:
            e = head.embed_tokens(fr.tokens)                                # [B, F, H]
            if fr.depth == 0:
                x = torch.cat([h[:, None], e], -1)                          # [B, 1, 2H]
            else:   # a node's path input = its parent's input + its own token's embedding
                prev = inputs[-1]
                idx = fr.parent_slot[..., None].expand(-1, -1, prev.shape[-1])
                x = torch.cat([prev.gather(1, idx), e], -1)                 # [B, F, (d+2)·H]
            inputs.append(x)
            z = head.hydra_mlp[fr.depth](x)
            return self.logits(z, head.hydra_lm_head[fr.depth]).float().log_softmax(-1)  # [B, F, V]

        return expand_dynamic_tree(step, roots.to(self.device).long(), budget)


HEAD = HydraHead
