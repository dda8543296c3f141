"""Medusa-1 heads (Cai et al., 2024): K independent heads on the target's last hidden state.

Head k (0-based) reads the final hidden state h_t and predicts token t+k+2, i.e. k+1 tokens past
the target's own next token (the pending root):

    logits_k(h_t) = W_k · ResBlock_k,L(... ResBlock_k,1(h_t)),   ResBlock(x) = x + SiLU(Linear(x))

Every head owns its blocks (never `[ResBlock(h)] * n`, which would share one module). Weight
names are Medusa's own (`medusa_head.{k}.{j}.linear.weight/bias`, `medusa_head.{k}.{L}.weight`),
so checkpoints move between Medusa, TGI and specdec without renames. Each W_k starts as a copy of
the target's LM head and every block as the identity, so an untrained head predicts the target's
next-token distribution.

Loss: sum_k 0.8^k · CE(head k at t, token t+k+2), position t counting iff loss_mask[t+k+2].
`distill=True` is the Medusa-2 recipe's self-distillation ingredient (backbone still frozen): the
label becomes the target's own distribution over that token, softmax(lm_head(h_{t+k+1})) (or the
captured top-k logits at t+k+1).

The helpers it shares with the other "read the last hidden state" heads (label masks, chain
acceptance, `LastHiddenDrafter`, ...) live in heads/common.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor, nn

from .base import DraftHead, FeatureSpec, chunked_logit_loss, frozen_linear, shift_left
from .common import (DRAFT_VOCAB, LastHiddenDrafter, add_depth_loss, chain_acceptance, check_drafter_opts,
                     label_mask, top1_of, zero_block_biases_)
from .layers import ResBlock
from .tree import DraftTree, StaticTree, TreeBudget, static_tree

# Medusa's published tree for Vicuna-7B (medusa/model/medusa_choices.py, `mc_sim_7b_63`): 63
# paths of top-k ranks, listed in the order its greedy search added them (by estimated gain).
MC_SIM_7B_63 = [
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4),
    (2, 0), (0, 5), (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8),
    (0, 0, 2), (3, 0), (0, 9), (8,), (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0),
    (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0), (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3),
    (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0), (1, 4), (7, 0), (0, 1, 2), (2, 0, 0),
    (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1), (9, 0), (0, 6, 0),
    (0, 0, 0, 1), (1, 6), (0, 7, 0)]

# CPU tree: the most valuable nodes of mc_sim_7b_63 in its own order, with the greedy chain
# pulled forward to depth 4 (CPU_TREE_BUDGET keeps the first 4; a larger budget takes more). On a
# 2-core CPU verifying 16-32 tokens costs 1.35-1.8x one step, so a narrow tree that reaches deeper
# is the better trade than the 10-wide fan-out Vicuna-7B's GPU list spends on depth 1.
MEDUSA_CPU_CHOICES = [
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 0, 0, 0), (0, 3),
    (4,), (0, 0, 1), (2, 0), (0, 4), (5,), (0, 1, 0), (1, 1), (0, 0, 0, 1), (0, 5), (0, 0, 2),
    (3, 0), (6,), (1, 0, 0)]

TREES = {"cpu": MEDUSA_CPU_CHOICES, "gpu": MC_SIM_7B_63, "mc_sim_7b_63": MC_SIM_7B_63}


# ----------------------------------------------------------------------------------------------
# The head
# ----------------------------------------------------------------------------------------------
@dataclass
class MedusaConfig:
    hidden_size: int = 0        # the target's (set by from_target)
    vocab_size: int = 0         # the target's
    num_heads: int = 4          # K: head k predicts the token k+2 positions ahead
    num_layers: int = 1         # residual blocks per head
    loss_decay: float = 0.8     # head k's loss weight is loss_decay**k
    distill: bool = False       # soft labels from the target (Medusa-2 self-distillation)


class MedusaHead(DraftHead):
    Config = MedusaConfig
    FROZEN_PARTS = {"target_lm_head": "lm_head"}

    def __init__(self, config: MedusaConfig):
        super().__init__(config)
        H, V, K, L = config.hidden_size, config.vocab_size, config.num_heads, config.num_layers
        if H <= 0 or V <= 0:
            raise ValueError("MedusaConfig needs hidden_size and vocab_size (use from_target)")
        if K < 1 or L < 0:
            raise ValueError(f"Medusa needs num_heads >= 1 and num_layers >= 0, got {K}, {L}")
        # LM heads are left uninitialised: from_target copies the target's, load_head the saved
        self.medusa_head = nn.ModuleList(
            nn.Sequential(*[ResBlock(H) for _ in range(L)],
                          nn.utils.skip_init(nn.Linear, H, V, bias=False))
            for _ in range(K))
        self.target_lm_head = frozen_linear(H, V)   # teacher for distill / acceptance; not saved
        zero_block_biases_(self.medusa_head)

    @classmethod
    def target_config(cls, target) -> dict:
        return {"hidden_size": target.hidden_size, "vocab_size": target.vocab_size}

    @classmethod
    def from_target(cls, target, **fields) -> "MedusaHead":
        head = super().from_target(target, **fields)
        with torch.no_grad():   # Medusa's init: every LM head starts as the target's
            for seq in head.medusa_head:
                seq[-1].weight.copy_(head.target_lm_head.weight)
        return head

    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(hidden=True)

    def features(self, k: int, h: Tensor) -> Tensor:
        """Head k's pre-LM-head features of hidden states h [..., H]."""
        return self.medusa_head[k][:-1](h)

    def head_logits(self, h: Tensor) -> Tensor:
        """h [B, H] -> logits [K, B, V]."""
        return torch.stack([seq(h) for seq in self.medusa_head])

    # --- training ---------------------------------------------------------------------------
    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
        self.require_target_parts()
        h = batch["hidden"].to(self.target_lm_head.weight.dtype)          # [B, T, H]
        ids = batch["input_ids"].long()
        total, metrics = h.new_zeros(()), {}
        for k, seq in enumerate(self.medusa_head):
            valid = label_mask(batch, k + 2)                               # [B, T]
            x = self.features(k, h[valid])                                 # [N, H]
            if not self.config.distill:
                teacher = {"teacher_ids": shift_left(ids, k + 2)[valid]}
            elif "topk_values" in batch:   # the target's top-k at t+k+1 predicts token t+k+2
                teacher = {"topk_values": shift_left(batch["topk_values"], k + 1)[valid],
                           "topk_indices": shift_left(batch["topk_indices"], k + 1, -1)[valid]}
            else:
                teacher = {"teacher_h": shift_left(h, k + 1)[valid],
                           "teacher_weight": self.target_lm_head.weight}
            r = chunked_logit_loss(x, seq[-1].weight, **teacher)
            total = add_depth_loss(total, metrics, k, self.config.loss_decay ** k, r, x)
        metrics["loss"] = float(total.detach())
        return total, metrics

    def acceptance(self, batch: dict[str, Tensor], depth: int) -> dict:
        self.require_target_parts()
        h = batch["hidden"].to(self.target_lm_head.weight.dtype)

        def predict(d: int, rows: Tensor):
            if d > len(self.medusa_head):
                return None
            return top1_of(self.features(d - 1, h[rows]), self.medusa_head[d - 1][-1].weight)

        return chain_acceptance(batch, depth, self.target_lm_head.weight, predict)

    # --- drafting ---------------------------------------------------------------------------
    def new_drafter(self, target=None, **opts) -> "MedusaDrafter":
        check_drafter_opts(opts, ["tree"], self.head_type())
        tree = opts.get("tree")
        if tree is None:
            dev = next(self.parameters()).device
            tree = "gpu" if dev.type == "cuda" else "cpu"
        if isinstance(tree, str):
            if tree not in TREES:
                raise ValueError(f"unknown Medusa tree {tree!r}; named trees: {sorted(TREES)}")
            tree = TREES[tree]
        return MedusaDrafter(self, tree, opts.get("draft_vocab", DRAFT_VOCAB))

    # --- export (heads/export_common.py) ----------------------------------------------------------
    def _export_vllm(self, out_dir, target):
        """vLLM `Medusa` (model_executor/models/medusa.py, transformers_utils/configs/medusa.py):
        blocks.{k}.layers.{j}.weight/bias (biases need medusa_fc_bias) and lm_heads.{k}.weight."""
        from . import export_common as ex

        c, tensors = self.config, {}
        for k, seq in enumerate(self.medusa_head):
            for j in range(c.num_layers):
                tensors[f"blocks.{k}.layers.{j}.weight"] = seq[j].linear.weight
                tensors[f"blocks.{k}.layers.{j}.bias"] = seq[j].linear.bias
            tensors[f"lm_heads.{k}.weight"] = seq[-1].weight
        config = {"architectures": ["MedusaModel"], "model_type": "medusa",
                  "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
                  "truncated_vocab_size": c.vocab_size, "num_heads": c.num_heads,
                  "num_hidden_layers": c.num_layers, "medusa_fc_bias": True,
                  "torch_dtype": ex.dtype_name(tensors)}
        usage = ("vllm serve <verifier> --speculative-config \\\n"
                 f"  '{{\"model\": \"<draft>\", \"method\": \"medusa\", "
                 f"\"num_speculative_tokens\": {c.num_heads}}}'")
        return ex.write_export(out_dir, self, target, "vllm", config, tensors, usage=usage,
                               notes=["vLLM drafts a single chain from the heads' top-1 tokens "
                                      "(no Medusa tree)."])

    def _export_tgi(self, out_dir, target):
        """TGI / Medusa's own layout (server/text_generation_server/layers/medusa.py): config with
        medusa_num_heads / medusa_num_layers / base_model_name_or_path and NO `architectures`
        (TGI takes the Medusa path only then), tensors {k}.{j}.linear.* and {k}.{L}.weight in
        medusa_lm_head.safetensors."""
        from . import export_common as ex

        c = self.config
        tensors = {k.removeprefix("medusa_head."): v for k, v in self.saved_state_dict().items()}
        config = {"medusa_num_heads": c.num_heads, "medusa_num_layers": c.num_layers,
                  "base_model_name_or_path": ex.verifier_ref(target, self.target_identity),
                  "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
                  "torch_dtype": ex.dtype_name(tensors)}
        usage = f"text-generation-launcher --model-id <draft> --speculate {c.num_heads}"
        notes = ["TGI loads the verifier from base_model_name_or_path in config.json."]
        # TGI's router reads the tokenizer and the chat template from --model-id, this folder
        # (router/src/server.rs): without them /v1/chat/completions has no template.
        return ex.write_export(out_dir, self, target, "tgi", config, tensors, usage=usage,
                               weights_file="medusa_lm_head.safetensors", notes=notes,
                               tokenizer=True)


class MedusaDrafter(LastHiddenDrafter):
    """Static tree from a choice list; depth d's tokens are head d-1's top-k at the last
    committed hidden state (the same for every branch: Medusa heads ignore the path)."""

    def __init__(self, head: MedusaHead, choices: Sequence[Sequence[int]], draft_vocab: int | None = DRAFT_VOCAB):
        super().__init__(head, draft_vocab)
        self.choices = [tuple(int(r) for r in c) for c in choices]
        self._trees: dict[TreeBudget, StaticTree] = {}

    def tree_for(self, budget: TreeBudget) -> StaticTree:
        """The choice list cut to the budget: ranks < topk, depth <= min(max_depth, K)."""
        if budget not in self._trees:
            depth = min(budget.max_depth, len(self.head.medusa_head))
            kept = [c for c in self.choices if max(c) < budget.topk]
            self._trees[budget] = static_tree(kept, max_nodes=budget.max_nodes, max_depth=depth)
        return self._trees[budget]

    @torch.no_grad()
    def propose(self, slots: Tensor, roots: Tensor, budget: TreeBudget) -> DraftTree:
        tree = self.tree_for(budget)
        h = self.hidden(slots)                                            # [B, H]
        D = max(tree.max_depth, 1)
        heads = self.head.medusa_head
        probs = torch.stack([self.logits(heads[k][:-1](h), heads[k][-1]) for k in range(D)]).float().softmax(-1)
        p, tok = probs.topk(min(tree.max_rank, probs.shape[-1]), dim=-1)  # [D, B, r]
        return tree.fill(roots.to(self.device).long(), tok.transpose(0, 1), p.transpose(0, 1))


HEAD = MedusaHead
