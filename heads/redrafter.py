"""ReDrafter (Cheng et al., 2024, Apple `ml-recurrent-drafter`): a recurrent draft head.

An RNN state runs over the embeddings of the tokens on the draft path (the pending root first),
and one MLP head reads it next to the target's last hidden state h_t:

    s_0 = 0,   s_k = SiLU(rnn_w · emb(tok_k) + rnn_u · s_{k-1})     (tok_1 = root x_{t+1})
    logits_k = lm_head(input_proj?([h_t ; s_k]))                    predicts token t+k+1

`lm_head` is `num_draft_layers` residual blocks of width `exit_dim` plus the vocabulary
projection; `input_proj` exists only when exit_dim != 2·hidden (as in Apple's Drafter). With
`rnn=False` the state is the plain sum of the path's embeddings (Apple's ablation). Names are
Apple's (`lm_head.{j}.linear.*`, `lm_head.{L}.weight`, `rnn_w.weight`, `rnn_u.weight/bias`,
`input_proj.*`).

Loss: sum over the next `next_n` tokens of CE(logits_k at t, x_{t+k+1}), teacher-forced on the
true tokens (Apple's drafter_loss), position t counting iff loss_mask[t+k+1].
Drafter: Apple's beam search (width `beam_width`, length = the budget's depth) whose beams are
merged into a deduplicated prefix tree (their "dynamic tree attention").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import (DraftHead, FeatureSpec, chunked_logit_loss, frozen_embedding, frozen_linear,
                   shift_left)
from .common import (DRAFT_VOCAB, LastHiddenDrafter, add_depth_loss, chain_acceptance, check_drafter_opts,
                     label_mask, top1_of)
from .layers import ResBlock
from .tree import DraftTree, TreeBudget, tree_from_paths

LOG_0 = -50000.0   # "log 0" for the beams that do not exist yet (Apple's constant)


class ExitResBlock(ResBlock):
    """Apple's drafter block: x + SiLU(Linear(x)) with the default (non-zero) init, because the
    drafter's LM head is trained from scratch rather than copied from the target."""

    def __init__(self, dim: int):
        super().__init__(dim)
        self.linear.reset_parameters()


@dataclass
class ReDrafterConfig:
    hidden_size: int = 0        # the target's (set by from_target)
    vocab_size: int = 0         # the target's
    exit_dim: int = 0           # width of the MLP head; 0 means 2 * hidden_size (no input_proj)
    num_draft_layers: int = 2   # residual blocks before the vocabulary projection
    rnn: bool = True            # False: the state is the running sum of embeddings
    next_n: int = 4             # tokens trained ahead (the draft depth it is good for)
    beam_width: int = 4         # beams kept by the drafter's beam search
    loss_decay: float = 1.0     # weight of the k-th token's loss is loss_decay**(k-1)


class ReDrafterHead(DraftHead):
    Config = ReDrafterConfig
    FROZEN_PARTS = {"embed_tokens": "embed_tokens", "target_lm_head": "lm_head"}

    def __init__(self, config: ReDrafterConfig):
        super().__init__(config)
        H, V = config.hidden_size, config.vocab_size
        if H <= 0 or V <= 0:
            raise ValueError("ReDrafterConfig needs hidden_size and vocab_size (use from_target)")
        if config.next_n < 1 or config.beam_width < 1 or config.num_draft_layers < 0:
            raise ValueError(f"bad ReDrafter config {config}")
        E = config.exit_dim or 2 * H
        if E != 2 * H:
            self.input_proj = nn.Linear(2 * H, E, bias=True)
        self.lm_head = nn.Sequential(*[ExitResBlock(E) for _ in range(config.num_draft_layers)],
                                     nn.Linear(E, V, bias=False))
        if config.rnn:
            self.rnn_u = nn.Linear(H, H, bias=True)
            self.rnn_w = nn.Linear(H, H, bias=False)
        self.embed_tokens = frozen_embedding(V, H)
        self.target_lm_head = frozen_linear(H, V)

    @classmethod
    def target_config(cls, target) -> dict:
        return {"hidden_size": target.hidden_size, "vocab_size": target.vocab_size}

    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(hidden=True)

    # --- the recurrence ---------------------------------------------------------------------
    def next_state(self, state: Tensor, emb: Tensor) -> Tensor:
        if self.config.rnn:
            return F.silu(self.rnn_w(emb) + self.rnn_u(state))
        return state + emb

    def exit_features(self, h: Tensor, state: Tensor) -> Tensor:
        """[..., H] x2 -> the input of the vocabulary projection [..., E]."""
        x = torch.cat([h, state], -1)
        if hasattr(self, "input_proj"):
            x = self.input_proj(x)
        return self.lm_head[:-1](x)

    def teacher_forced_states(self, h: Tensor, ids: Tensor, depth: int) -> list[Tensor]:
        """s_1..s_depth at every position [B, T, H], s_k having read x_{t+1}..x_{t+k}."""
        emb = self.embed_tokens(ids)                                       # [B, T, H]
        state, out = torch.zeros_like(h), []
        for k in range(1, depth + 1):
            state = self.next_state(state, shift_left(emb, k))
            out.append(state)
        return out

    # --- training ---------------------------------------------------------------------------
    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
        self.require_target_parts()
        h = batch["hidden"].to(self.embed_tokens.weight.dtype)              # [B, T, H]
        ids = batch["input_ids"].long()
        total, metrics = h.new_zeros(()), {}
        for k, state in enumerate(self.teacher_forced_states(h, ids, self.config.next_n), 1):
            valid = label_mask(batch, k + 1)
            x = self.exit_features(h[valid], state[valid])                  # [N, E]
            r = chunked_logit_loss(x, self.lm_head[-1].weight,
                                   teacher_ids=shift_left(ids, k + 1)[valid])
            total = add_depth_loss(total, metrics, k - 1, self.config.loss_decay ** (k - 1), r, x)
        metrics["loss"] = float(total.detach())
        return total, metrics

    @torch.no_grad()
    def acceptance(self, batch: dict[str, Tensor], depth: int) -> dict:
        self.require_target_parts()
        h = batch["hidden"].to(self.embed_tokens.weight.dtype)
        states = self.teacher_forced_states(h, batch["input_ids"].long(), depth)

        def predict(d: int, rows: Tensor):
            x = self.exit_features(h[rows], states[d - 1][rows])
            return top1_of(x, self.lm_head[-1].weight)

        return chain_acceptance(batch, depth, self.target_lm_head.weight, predict)

    # --- drafting ---------------------------------------------------------------------------
    def new_drafter(self, target=None, **opts) -> "ReDrafterDrafter":
        check_drafter_opts(opts, ["beam_width"], self.head_type())
        width = int(opts.get("beam_width", self.config.beam_width))
        if width < 1:
            raise ValueError(f"beam_width must be >= 1, got {width}")
        return ReDrafterDrafter(self, width, opts.get("draft_vocab", DRAFT_VOCAB))

    # --- export (heads/export_common.py) ----------------------------------------------------------
    def _export_trtllm(self, out_dir, target):
        """Apple's drafter folder, which TensorRT-LLM's examples/redrafter/convert_checkpoint.py
        reads as --drafter_model_dir (config.json: hidden_size, exit_dim, num_draft_layers, rnn;
        model.safetensors: input_proj.* only when exit_dim != 2 * hidden_size, lm_head.{j}.linear.*,
        lm_head.{L}.weight, rnn_u.*, rnn_w.weight) and Apple's recurrent_drafting loads as its
        DrafterConfig / Drafter. The names are already Apple's; exit_dim is written out."""
        from . import export_common as ex

        c = self.config
        tensors = self.saved_state_dict()
        config = {"model_type": "recurrent_drafting_drafter", "vocab_size": c.vocab_size,
                  "hidden_size": c.hidden_size, "exit_dim": c.exit_dim or 2 * c.hidden_size,
                  "num_draft_layers": c.num_draft_layers, "num_lookback_tokens": -1, "rnn": c.rnn,
                  "torch_dtype": ex.dtype_name(tensors)}
        usage = ("python TensorRT-LLM/examples/redrafter/convert_checkpoint.py --model_dir <verifier> \\\n"
                 "  --drafter_model_dir <draft> --output_dir tllm_redrafter --dtype bfloat16 \\\n"
                 f"  --redrafter_num_beams {c.beam_width} --redrafter_draft_len_per_beam {c.next_n}\n"
                 "trtllm-build --checkpoint_dir tllm_redrafter --output_dir redrafter_engine \\\n"
                 "  --speculative_decoding_mode explicit_draft_tokens")
        notes = [f"Draft at most {c.next_n} tokens per beam (redrafter_draft_len_per_beam): the head "
                 "was trained that far ahead.",
                 "TensorRT-LLM's converter builds the verifier as a Llama (LlamaForCausalLM)."]
        return ex.write_export(out_dir, self, target, "trtllm", config, tensors, usage=usage, notes=notes)


class ReDrafterDrafter(LastHiddenDrafter):
    def __init__(self, head: ReDrafterHead, beam_width: int, draft_vocab: int | None = DRAFT_VOCAB):
        super().__init__(head, draft_vocab)
        self.beam_width = beam_width

    @torch.no_grad()
    def propose(self, slots: Tensor, roots: Tensor, budget: TreeBudget) -> DraftTree:
        head: ReDrafterHead = self.head
        roots = roots.to(self.device).long()
        B, W = roots.shape[0], min(self.beam_width, budget.topk)
        D = min(budget.max_depth, budget.max_nodes)
        context = self.hidden(slots)[:, None].expand(-1, W, -1)              # [B, W, H]
        V = head.config.vocab_size
        # Every beam starts at the root; only beam 0 is "alive" (log 1) so the first step grows
        # W distinct tokens out of it instead of W copies of the same ones.
        log_p_beam = torch.full((B, W), LOG_0, device=self.device)
        log_p_beam[:, 0] = 0.0
        beams = roots[:, None, None].expand(B, W, 1)                          # [B, W, 1 + d]
        prefix_lp = torch.zeros(B, W, 0, device=self.device)                  # [B, W, d]
        state = torch.zeros_like(context)
        rows = torch.arange(B, device=self.device)[:, None]
        for _ in range(D):
            state = head.next_state(state, head.embed_tokens(beams[..., -1]))
            lp = self.logits(head.exit_features(context, state), head.lm_head[-1]).float().log_softmax(-1)
            total = (lp + log_p_beam[..., None]).reshape(B, W * V)           # [B, W*V]
            log_p_beam, flat = total.topk(W, dim=-1)                          # best first
            beam, tok = flat // V, flat % V                                   # [B, W]
            beams = torch.cat([beams[rows, beam], tok[..., None]], -1)
            prefix_lp = torch.cat([prefix_lp[rows, beam], log_p_beam[..., None]], -1)
            state = state[rows, beam]
        alive = log_p_beam > LOG_0 / 2        # beams that never left the dummy start (tiny V)
        paths, scores = beams[..., 1:], prefix_lp.exp()
        if not alive.all():
            keep = int(alive.sum(1).min())
            paths, scores = paths[:, :keep], scores[:, :keep]
        return tree_from_paths(roots, paths, scores, budget.max_nodes)


HEAD = ReDrafterHead
