"""IBM's MLPSpeculator (Wertheimer et al., 2024, "Accelerating Production LLMs with Combined
Token/Embedding Speculators"; fms-extras `MLPSpeculator`, vLLM `mlp_speculator.py`).

`n_predict` stages, each a tiny recurrent step over the base model's last hidden state:

    s_0 = h_t                                   (LN0(h_t)/sqrt(2) when scale_input)
    s_i = GELU(LN_i(proj_i(s_{i-1}) · w_state + emb_i(tok_i) · w_emb))
    logits_i = head_i(s_i)                      stage i predicts token t+i+2

with tok_0 = the pending root x_{t+1} and tok_i the token drafted by stage i-1;
w_state = 0.5^(0.5/n_predict), w_emb = sqrt((1 - w_state²) · inner_dim/2). LN_i is IBM's
mean-free (RMS) norm with a learned scale and shift. Tensor names (`emb.{i}.weight`,
`proj.{i}.weight`, `head.{i}.weight`, `ln.{i}.weight/bias`) and config fields are
`MLPSpeculatorConfig`'s, so an exported folder loads in vLLM / TGI / fms-extras as is.

Training follows IBM's two-stage schedule (`stage`): stage 1 teacher-forces the dataset's tokens;
stage 2 trains on the target's own continuation — the greedy argmax of the target's logits at each
position (captured top-k or lm_head(hidden)) replaces both the inputs and the labels.
Drafting: every stage keeps its top-k (`top_k_tokens_per_head`) per candidate, the best
`n_candidates` chains by cumulative log-prob are kept and merged into a prefix tree
(`tree_from_paths`, IBM's `flatten_batch`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import (DraftHead, FeatureSpec, chunked_logit_loss, frozen_linear, shift_left,
                   target_argmax)
from .common import (DRAFT_VOCAB, LastHiddenDrafter, add_depth_loss, chain_acceptance, check_drafter_opts,
                     label_mask, top1_of)
from .tree import DraftTree, TreeBudget, tree_from_paths


class MLPSpeculatorLayerNorm(nn.Module):
    """IBM's LayerNormParameterized as the speculator uses it: x / rms(x) (no mean), then an
    optional learned scale and shift."""

    def __init__(self, dim: int, eps: float = 1e-6, affine: bool = True):
        super().__init__()
        self.eps = eps
        if affine:
            self.weight = nn.Parameter(torch.ones(dim))
            self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return y * self.weight + self.bias if hasattr(self, "weight") else y


def _default_topk(n: int) -> list[int]:
    return ([5, 4, 3] + [3] * max(n - 3, 0))[:n]


@dataclass
class MLPSpeculatorConfig:
    emb_dim: int = 0                 # the target's hidden size (set by from_target)
    vocab_size: int = 0              # the target's
    inner_dim: int = 0               # state width; 0 means emb_dim
    n_predict: int = 3               # stages = tokens drafted per step
    top_k_tokens_per_head: list[int] | None = None   # default [5, 4, 3] (+3 per extra stage)
    n_candidates: int = 8            # chains kept for the tree (IBM's default is 5)
    tie_weights: bool = False        # one emb / head / ln for all stages, one proj after the first
    scale_input: bool = False        # LN0(h)/sqrt(2) before stage 0
    stage: int = 1                   # 1: dataset tokens; 2: the target's greedy continuation

    def __post_init__(self):
        if self.top_k_tokens_per_head is None:
            self.top_k_tokens_per_head = _default_topk(self.n_predict)
        self.top_k_tokens_per_head = [int(k) for k in self.top_k_tokens_per_head]
        if len(self.top_k_tokens_per_head) != self.n_predict:
            raise ValueError(f"top_k_tokens_per_head has {len(self.top_k_tokens_per_head)} "
                             f"entries, n_predict is {self.n_predict}")
        if self.stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2, got {self.stage}")


class MLPSpeculatorHead(DraftHead):
    METHOD = "mlp"  # speculative-decoding name users type (--method mlp)
    Config = MLPSpeculatorConfig
    TARGET_FIELDS = ("emb_dim", "vocab_size")
    FROZEN_PARTS = {"target_lm_head": "lm_head"}

    def __init__(self, config: MLPSpeculatorConfig):
        super().__init__(config)
        H, V, n = config.emb_dim, config.vocab_size, config.n_predict
        if H <= 0 or V <= 0:
            raise ValueError("MLPSpeculatorConfig needs emb_dim and vocab_size (use from_target)")
        if n < 1 or (config.tie_weights and n < 2):
            raise ValueError(f"n_predict must be >= 1 (>= 2 with tie_weights), got {n}")
        I = config.inner_dim or H
        self.inner = I
        if config.tie_weights:   # vLLM's tying: shared modules, so every stage name still exists
            emb, proj, head, ln = (nn.Embedding(V, I), nn.Linear(I, I, bias=False),
                                   nn.Linear(I, V, bias=False), MLPSpeculatorLayerNorm(I))
            self.emb = nn.ModuleList([emb] * n)
            self.proj = nn.ModuleList([nn.Linear(H, I, bias=False)] + [proj] * (n - 1))
            self.head = nn.ModuleList([head] * n)
            self.ln = nn.ModuleList([ln] * n)
        else:
            self.emb = nn.ModuleList(nn.Embedding(V, I) for _ in range(n))
            self.proj = nn.ModuleList(nn.Linear(H if i == 0 else I, I, bias=False)
                                      for i in range(n))
            self.head = nn.ModuleList(nn.Linear(I, V, bias=False) for _ in range(n))
            self.ln = nn.ModuleList(MLPSpeculatorLayerNorm(I) for _ in range(n))
        self.ln0 = MLPSpeculatorLayerNorm(H, affine=False) if config.scale_input else None
        self.state_weight = 0.5 ** (0.5 / n)
        self.emb_weight = math.sqrt((1 - self.state_weight ** 2) * (I / 2))
        self.target_lm_head = frozen_linear(H, V)
        with torch.no_grad():   # IBM's reset_parameters
            for m in (*self.emb, *self.proj, *self.head):
                nn.init.trunc_normal_(m.weight, 0.0, 1 / math.sqrt(I))

    @classmethod
    def target_config(cls, target) -> dict:
        return {"emb_dim": target.hidden_size, "vocab_size": target.vocab_size}

    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(hidden=True)

    def saved_state_dict(self) -> dict[str, Tensor]:
        # Tied stages share tensors; safetensors refuses aliases, so write each name its own copy
        # (IBM/vLLM loaders accept every stage's name).
        sd = super().saved_state_dict()
        return {k: v.clone() for k, v in sd.items()} if self.config.tie_weights else sd

    # --- the stages -------------------------------------------------------------------------
    def initial_state(self, h: Tensor) -> Tensor:
        return self.ln0(h) / math.sqrt(2) if self.ln0 is not None else h

    def step(self, i: int, state: Tensor, tokens: Tensor) -> Tensor:
        """Stage i: state [..., H or I], tokens [...] -> new state [..., I]."""
        z = self.emb[i](tokens) * self.emb_weight
        return F.gelu(self.ln[i](self.proj[i](state) * self.state_weight + z))

    def training_tokens(self, batch: dict[str, Tensor]) -> Tensor:
        """[B, T]: tok[t] = the token at t+1 the stages condition on and predict (stage 1: the
        dataset's; stage 2: the target's greedy prediction of it from position t)."""
        if self.config.stage == 1:
            return shift_left(batch["input_ids"].long(), 1)
        return target_argmax(batch, self.target_lm_head.weight).long()

    # --- training ---------------------------------------------------------------------------
    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
        self.require_target_parts()
        h = batch["hidden"].to(self.target_lm_head.weight.dtype)            # [B, T, H]
        tok = self.training_tokens(batch)                                    # [B, T]
        state = self.initial_state(h)
        total, metrics = h.new_zeros(()), {}
        for i in range(self.config.n_predict):
            state = self.step(i, state, shift_left(tok, i))                  # [B, T, I]
            valid = label_mask(batch, i + 2)
            r = chunked_logit_loss(state[valid], self.head[i].weight,
                                   teacher_ids=shift_left(tok, i + 1)[valid])
            total = add_depth_loss(total, metrics, i, 1.0, r, state)   # stages weigh the same
        metrics["loss"] = float(total.detach())
        return total, metrics

    @torch.no_grad()
    def acceptance(self, batch: dict[str, Tensor], depth: int) -> dict:
        self.require_target_parts()
        h = batch["hidden"].to(self.target_lm_head.weight.dtype)
        tok = shift_left(batch["input_ids"].long(), 1)
        states = [self.initial_state(h)]
        for i in range(min(depth, self.config.n_predict)):
            states.append(self.step(i, states[-1], shift_left(tok, i)))

        def predict(d: int, rows: Tensor):
            if d > self.config.n_predict:
                return None
            return top1_of(states[d][rows], self.head[d - 1].weight)

        return chain_acceptance(batch, depth, self.target_lm_head.weight, predict)

    # --- drafting ---------------------------------------------------------------------------
    def new_drafter(self, target=None, **opts) -> "MLPSpeculatorDrafter":
        check_drafter_opts(opts, ["n_candidates"], self.head_type())
        return MLPSpeculatorDrafter(self, opts.get("n_candidates", self.config.n_candidates),
                                    opts.get("draft_vocab", DRAFT_VOCAB))

    # --- export (heads/export_common.py) ----------------------------------------------------------
    def _write_ibm_layout(self, out_dir, target, fmt: str):
        """IBM's layout, read by vLLM (model_executor/models/mlp_speculator.py strips
        "speculator.") and TGI (layers/mlp.py requires it): speculator.{emb,proj,head,ln}.{i}.*,
        config MLPSpeculatorConfig's fields with inner_dim resolved (TGI reads it literally)."""
        from . import export_common as ex

        c = self.config
        tensors = {f"speculator.{k}": v for k, v in self.saved_state_dict().items()}
        config = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
                  "vocab_size": c.vocab_size, "emb_dim": c.emb_dim, "inner_dim": self.inner,
                  "n_predict": c.n_predict, "top_k_tokens_per_head": list(c.top_k_tokens_per_head),
                  "n_candidates": c.n_candidates, "tie_weights": c.tie_weights,
                  "scale_input": c.scale_input,
                  "base_model_name_or_path": ex.verifier_ref(target, self.target_identity),
                  "torch_dtype": ex.dtype_name(tensors)}
        if fmt == "tgi":
            usage = f"text-generation-launcher --model-id <draft> --speculate {c.n_predict}"
            # TGI weighs the stages by --speculate, not n_predict (layers/mlp.py state_weight)
            notes = ["TGI loads the verifier from base_model_name_or_path in config.json.",
                     f"Keep --speculate at {c.n_predict}: TGI weighs each stage's state by it."]
            if c.scale_input:   # layers/mlp.py simple_norm, added with tied weights in TGI 2.3
                notes.append("Needs TGI >= 2.3: earlier releases ignore scale_input and draft "
                             "from unscaled hidden states.")
        else:
            usage = ("vllm serve <verifier> --speculative-config \\\n"
                     f"  '{{\"model\": \"<draft>\", \"num_speculative_tokens\": {c.n_predict}}}'")
            notes = ["vLLM's V1 engine lists MLPSpeculatorPreTrainedModel as disabled "
                     "(model_executor/models/registry.py): serve it with a vLLM release that still "
                     "runs the V0 engine."]
        # TGI's router loads the tokenizer from --model-id, this folder (router/src/server.rs); its
        # fallback to base_model_name_or_path only covers configs without a model_type, so an
        # MLPSpeculator folder without a tokenizer stops TGI at startup.
        return ex.write_export(out_dir, self, target, fmt, config, tensors, usage=usage, notes=notes,
                               tokenizer=fmt == "tgi")

    def _export_vllm(self, out_dir, target):
        return self._write_ibm_layout(out_dir, target, "vllm")

    def _export_tgi(self, out_dir, target):
        from . import export_common as ex

        if not self.config.tie_weights:
            # TGI >= 2.3 (layers/mlp.py MLPSpeculatorModel.__init__) runs `self.emb.weight *= ...`
            # on its nn.ModuleList of stage embeddings: AttributeError, so it loads no untied head.
            raise ex.ExportError("TGI's MLPSpeculator loads only heads trained with tie_weights=True "
                                 "(its untied loader fails with AttributeError: 'ModuleList' object "
                                 "has no attribute 'weight'): export this head as 'vllm', or train "
                                 "with tie_weights: true for TGI")
        return self._write_ibm_layout(out_dir, target, "tgi")


class MLPSpeculatorDrafter(LastHiddenDrafter):
    """IBM's generate_suffixes: all top-k expansions per stage, best `n_candidates` chains,
    merged into a prefix tree within the budget."""

    def __init__(self, head: MLPSpeculatorHead, n_candidates: int, draft_vocab: int | None = DRAFT_VOCAB):
        super().__init__(head, draft_vocab)
        if n_candidates < 1:
            raise ValueError(f"n_candidates must be >= 1, got {n_candidates}")
        self.n_candidates = n_candidates

    @torch.no_grad()
    def propose(self, slots: Tensor, roots: Tensor, budget: TreeBudget) -> DraftTree:
        head: MLPSpeculatorHead = self.head
        roots = roots.to(self.device).long()
        B = roots.shape[0]
        D = min(head.config.n_predict, budget.max_depth)
        state = head.initial_state(self.hidden(slots))[:, None]             # [B, 1, H]
        last = roots[:, None]                                                # [B, n]
        paths = torch.zeros(B, 1, 0, dtype=torch.long, device=self.device)  # [B, n, d]
        prefix_lp = torch.zeros(B, 1, 0, device=self.device)                 # [B, n, d]
        cum = torch.zeros(B, 1, device=self.device)                          # [B, n]
        for i in range(D):
            k = min(head.config.top_k_tokens_per_head[i], budget.topk)
            state = head.step(i, state, last)                                # [B, n, I]
            lp = self.logits(state, head.head[i]).float().log_softmax(-1)    # [B, n, V]
            top_lp, top_id = lp.topk(k, dim=-1)                              # [B, n, k]
            n = top_id.shape[1]
            cum = (cum[:, :, None] + top_lp).reshape(B, n * k)
            paths = torch.cat([paths.repeat_interleave(k, 1), top_id.reshape(B, n * k, 1)], -1)
            prefix_lp = torch.cat([prefix_lp.repeat_interleave(k, 1), cum[..., None]], -1)
            state = state.repeat_interleave(k, 1)
            last = top_id.reshape(B, n * k)
        best = cum.topk(min(self.n_candidates, cum.shape[1]), dim=1).indices  # [B, P] best first
        paths = paths.gather(1, best[..., None].expand(-1, -1, D))
        scores = prefix_lp.gather(1, best[..., None].expand(-1, -1, D)).exp()
        return tree_from_paths(roots, paths, scores, budget.max_nodes)


HEAD = MLPSpeculatorHead
