"""EAGLE-3: multi-layer feature fusion, direct token prediction, training-time test.

    g_t   = fc(concat(h^{l1}_t, h^{l2}_t, h^{l3}_t))                 3H -> H (aux target layers)
    x     = concat(input_layernorm(embed(x_{t+1})), hidden_norm(g_t))  2H: q/k/v read 2H
    h     = g_t + attn(x);  out = h + mlp(post_attention_layernorm(h))  (out feeds the next step)
    logits= lm_head(norm(out))                                        over a reduced draft vocab

Draft vocab: `d2t[i]` = target_id - draft_id of draft token i (target = i + d2t[i]), `t2d` [V]
bool marks target tokens in the draft vocab, as vLLM / speculators store them. Choose it with
`head.set_draft_vocab(token_counts)` before training (the trainer does, from the training data's
loss-masked token counts; `count_tokens` computes them). Training unrolls `ttt_steps` steps (the
first reads the target's fused features, the rest the head's own outputs) with per-step weight
`step_decay**k`; positions whose target argmax is outside the draft vocab are masked, as EAGLE-3
does. `init_layer` starts the draft layer as a copy of one target decoder layer (the CPU recipe
uses the last: with little data that prior is worth more than the steps, docs/BENCHMARKS.md
session 21). Parameter names are vLLM's / speculators' (`fc.weight`, `layers.0.hidden_norm.weight`,
`layers.0.input_layernorm.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .base import (FeatureSpec, HeadShapeError, chunked_logit_loss, depth_valid_mask, frozen_embedding,
                   frozen_linear, init_linear_, masked_mean, shift_left, soft_labels, target_part)
from .common import mean_loss
from .eagle import EagleFamily, EagleLayerConfig
from .layers import MLP, Attention, RMSNorm

DEFAULT_DRAFT_VOCAB = 8192


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default auxiliary layers, low / middle / high, exactly as vLLM picks them.

    (2, L // 2, L - 3) in HF hidden_states indexing. Small test targets get repeats
    (4 layers: [2, 2, 1]); kept anyway so every part of specdec and vLLM agree.
    """
    if num_layers < 3:
        raise ValueError(f"EAGLE-3's default aux layers need a target with >= 3 layers, got {num_layers}")
    return [2, num_layers // 2, num_layers - 3]


def check_aux_layers(aux_layers, num_layers: int) -> list[int]:
    """Validate aux layer ids: each must be a residual stream *entering* a layer, 0..L-1."""
    layers = [int(layer) for layer in aux_layers]
    bad = [layer for layer in layers if not 0 <= layer < num_layers]
    if bad:
        raise ValueError(
            f"aux layer ids {bad} out of range: this target has {num_layers} layers, so ids run "
            f"0..{num_layers - 1} (id i = the hidden state entering layer i; the final post-norm "
            "state is the separate `hidden` feature)")
    return layers


@dataclass
class Eagle3Config(EagleLayerConfig):
    num_target_layers: int = 0
    aux_layers: list[int] | None = None   # default [2, L//2, L-3]
    draft_vocab_size: int = DEFAULT_DRAFT_VOCAB  # clamped to the target vocab by from_target
    norm_before_residual: bool = False    # speculators/vLLM option: residual = hidden_norm(g)
    ttt_steps: int = 7                    # training-time-test unroll length (EAGLE-3 uses 7)
    step_decay: float = 0.8               # loss weight of step k = step_decay**k
    init_layer: int | None = None         # start the draft layer from this target decoder layer
                                          # (-1: the last; None: random, as EAGLE-3's authors)


class Eagle3Layer(nn.Module):
    """EAGLE-3's first (only) decoder layer: attention over concat(embeds, feature)."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        H = c.hidden_size
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.self_attn = Attention(H, c.num_attention_heads, c.num_key_value_heads, c.head_dim, in_dim=2 * H)
        self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.mlp = MLP(H, c.intermediate_size)
        self.norm_before_residual = c.norm_before_residual

    def forward(self, embeds: Tensor, feature: Tensor, cos, sin, mask=None, past_kv=None, ttt_prev=None):
        """embeds, feature [B, T, H] -> (out [B, T, H] pre-norm, (k, v))."""
        normed = self.hidden_norm(feature)
        residual = normed if self.norm_before_residual else feature
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        a, kv = self.self_attn(x, cos, sin, mask, past_kv, ttt_prev)
        h = residual + a
        return h + self.mlp(self.post_attention_layernorm(h)), kv


class Eagle3Head(EagleFamily):
    Config = Eagle3Config
    # verifier_lm_head: the target's LM head, the teacher during training (never saved).
    FROZEN_PARTS = {"embed_tokens": "embed_tokens", "verifier_lm_head": "lm_head"}

    @classmethod
    def target_config(cls, target) -> dict:
        d = super().target_config(target)
        n = d["num_target_layers"]
        d["aux_layers"] = default_aux_layers(n) if n >= 3 else None  # None: the fields must name them
        d["draft_vocab_size"] = min(DEFAULT_DRAFT_VOCAB, d["vocab_size"])
        return d

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        c = config
        if c.aux_layers is None:
            c.aux_layers = default_aux_layers(c.num_target_layers)
        # a head built for a target checks its ids now, not when capture first reads them
        c.aux_layers = (check_aux_layers(c.aux_layers, c.num_target_layers) if c.num_target_layers
                        else [int(a) for a in c.aux_layers])
        if not 0 < c.draft_vocab_size <= c.vocab_size:
            raise ValueError(f"draft_vocab_size={c.draft_vocab_size} must be in [1, vocab_size={c.vocab_size}]")
        H, Vd = c.hidden_size, c.draft_vocab_size
        self.embed_tokens = frozen_embedding(c.vocab_size, H)
        self.verifier_lm_head = frozen_linear(H, c.vocab_size)
        self.fc = nn.Linear(len(c.aux_layers) * H, H, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(c)])
        self.norm = RMSNorm(H, c.rms_norm_eps)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        # Until a vocab is chosen: the first Vd target ids.
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[:Vd] = True
        self.register_buffer("t2d", t2d)
        self._build_rotary(c)
        init_linear_(self)

    # --- draft vocabulary -----------------------------------------------------------------------
    @property
    def token_map(self) -> Tensor:
        """[Vd] target id of each draft id."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def target_to_draft(self) -> Tensor:
        """[V] draft id of each target id, -1 outside the draft vocab."""
        out = torch.full((self.t2d.numel(),), -1, dtype=torch.long, device=self.d2t.device)
        out[self.token_map] = torch.arange(self.d2t.numel(), device=self.d2t.device)
        return out

    @staticmethod
    def count_tokens(input_ids, loss_masks, vocab_size: int) -> Tensor:
        """token_counts [V] over loss-masked positions of sequences (iterables of 1-D tensors/lists)."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for ids, m in zip(input_ids, loss_masks):
            ids, m = torch.as_tensor(ids).long().flatten(), torch.as_tensor(m).bool().flatten()
            counts += torch.bincount(ids[m], minlength=vocab_size)[:vocab_size]
        return counts

    def set_draft_vocab(self, token_counts: Tensor) -> None:
        """Keep the `draft_vocab_size` most frequent target tokens (ties: lower id first) and,
        when the target's parts are attached, start the draft LM head from the target's rows."""
        counts = torch.as_tensor(token_counts).flatten().to(torch.float64)
        V, Vd = self.config.vocab_size, self.config.draft_vocab_size
        if counts.numel() != V:
            raise ValueError(f"token_counts has {counts.numel()} entries, the target vocab has {V}")
        # Stable sort by -count keeps lower ids first among equal counts.
        chosen = torch.sort(-counts, stable=True).indices[:Vd].sort().values
        dev = self.d2t.device
        self.d2t.copy_((chosen - torch.arange(Vd)).to(dev))
        self.t2d.zero_()
        self.t2d[chosen.to(dev)] = True
        if self.has_target_parts:
            with torch.no_grad():
                self.lm_head.weight.copy_(self.verifier_lm_head.weight[self.token_map])

    @torch.no_grad()
    def init_from_target(self, target) -> None:
        """A new head starts its draft LM head from the target's rows and its norm from the
        target's final norm: lm_head(norm(out)) then begins close to the target's logits."""
        self.lm_head.weight.copy_(self.verifier_lm_head.weight[self.token_map])
        self.norm.weight.copy_(target_part(target, "norm").weight.to(self.norm.weight.dtype))
        if self.config.init_layer is not None:
            self._init_layer_from_target(target, self.config.init_layer)

    @torch.no_grad()
    def _init_layer_from_target(self, target, index: int) -> None:
        """Start the draft layer as a copy of one target decoder layer: its q/k/v read
        [embed ; feature], so each half gets the target's projection / sqrt(2) (the sum of two
        unit-RMS inputs), and fc starts by passing the highest aux feature through. Only weights
        are copied (a target's q/k/v biases, as Qwen2's, are left out: a starting point)."""
        layers = target_part(target, "layers")
        if not -len(layers) <= index < len(layers):
            raise ValueError(f"init_layer={index}, but the target has {len(layers)} decoder layers")
        src, mine = layers[index], self.layers[0]
        try:
            copies = {f"{n}.weight": src.get_submodule(n).weight for n in (
                "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                "post_attention_layernorm", "input_layernorm")}
            for n in ("q_proj", "k_proj", "v_proj"):
                w = src.get_submodule(f"self_attn.{n}").weight
                copies[f"self_attn.{n}.weight"] = torch.cat([w, w], 1) / 2 ** 0.5
        except AttributeError as err:
            raise HeadShapeError(f"init_layer needs a Llama-style target layer (self_attn.q_proj, "
                                 f"mlp.gate_proj, input_layernorm, ...): {err}") from None
        copies["hidden_norm.weight"] = copies["input_layernorm.weight"]
        params = dict(mine.named_parameters())
        for name, w in copies.items():
            if params[name].shape != w.shape:
                raise HeadShapeError(f"init_layer={index}: layers.0.{name} is {tuple(params[name].shape)}, "
                                     f"the target layer gives {tuple(w.shape)}")
            params[name].copy_(w.to(params[name].dtype))
        H = self.config.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, -H:] = torch.eye(H, dtype=self.fc.weight.dtype)

    # --- the EAGLE family hooks -----------------------------------------------------------------
    def feature_spec(self) -> FeatureSpec:
        # hidden: the teacher's final feature (training); aux: the fused input; the target's
        # top-1 (captured once) spares training a 49k-wide LM-head pass per step just to find
        # the target's argmax: measured a third of a CPU step.
        return FeatureSpec(hidden=True, aux_layers=tuple(self.config.aux_layers), topk_logits=1)

    def draft_feature_spec(self) -> FeatureSpec:
        # aux only: the teacher's `hidden` would cost the engine a third more per kept token (a
        # prefix cache of 1 GB then held fewer prompts: the hybrid server at concurrency 32 reused
        # 29k prompt tokens where the plain one reused 47k, docs/BENCHMARKS.md session 37).
        return FeatureSpec(hidden=False, aux_layers=tuple(self.config.aux_layers))

    def raw_feature(self, features: dict[str, Tensor]) -> Tensor:
        aux = features.get("aux")
        if aux is None:
            raise ValueError(f"an EAGLE-3 head reads the target's aux features (hidden_states "
                             f"{self.config.aux_layers}, concatenated); got only {sorted(features)}")
        if aux.shape[-1] != self.fc.in_features:
            raise ValueError(f"aux features have width {aux.shape[-1]}, the head expects "
                             f"{self.fc.in_features} ({len(self.config.aux_layers)} layers x hidden)")
        return aux

    def fuse_feature(self, raw: Tensor) -> Tensor:
        return self.fc(raw.to(self.fc.weight.dtype))

    def layer_step(self, feature, tokens, cos, sin, mask=None, past_kv=None, ttt_prev=None):
        embeds = self.embed_tokens(tokens).to(feature.dtype)
        return self.layers[0](embeds, feature, cos, sin, mask, past_kv, ttt_prev)

    def logit_input(self, out: Tensor) -> Tensor:
        return self.norm(out)

    def draft_head_weight(self) -> Tensor:
        return self.lm_head.weight

    def target_lm_head_weight(self) -> Tensor:
        return self.verifier_lm_head.weight

    # --- training -------------------------------------------------------------------------------
    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
        self.require_target_parts()
        c = self.config
        outs = self.unroll(batch, c.ttt_steps)
        valid = depth_valid_mask(batch, c.ttt_steps)                       # [K, B, T]
        in_vocab = self.t2d[self.target_next(batch)]                       # [B, T] target argmax kept?
        teacher_w = self.verifier_lm_head.weight[self.token_map]           # [Vd, H] target rows
        hidden = batch.get("hidden")
        t2d_idx = self.target_to_draft() if hidden is None else None
        # Step k at position t learns the target's distribution at t+k+1: every step reads the
        # same soft labels, shifted, so compute them once (at the positions some step reads).
        soft = None
        if hidden is not None:
            T = valid.shape[-1]
            reads = torch.zeros_like(valid[0])                             # [B, T]
            for k in range(c.ttt_steps):
                reads[:, k + 1:] |= valid[k][:, :T - k - 1]
            soft = soft_labels(hidden[reads].to(outs[0].dtype), teacher_w)   # [n, Vd] or None
            row_of = torch.full(reads.shape, -1, dtype=torch.long, device=reads.device)
            row_of[reads] = torch.arange(int(reads.sum()), device=reads.device)
        total = outs[0].new_zeros(())
        metrics: dict[str, float] = {}
        for k, out in enumerate(outs):
            v = valid[k] & shift_left(in_vocab, k + 1, fill=False)
            student = self.norm(out)[v]
            if soft is not None:
                b, t = v.nonzero(as_tuple=True)
                teacher = dict(teacher_probs=soft[row_of[b, t + k + 1]])
            elif hidden is not None:  # exact soft labels: target logits restricted to the draft vocab
                teacher = dict(teacher_h=shift_left(hidden.to(out.dtype), k + 1)[v], teacher_weight=teacher_w)
            else:                    # captured top-k logits, mapped into the draft vocab
                idx = shift_left(batch["topk_indices"].long(), k + 1)[v]
                teacher = dict(topk_values=shift_left(batch["topk_values"], k + 1)[v],
                               topk_indices=t2d_idx[idx])
            lt = chunked_logit_loss(student, self.lm_head.weight, **teacher)
            step_loss = mean_loss(lt.loss, out)
            total = total + c.step_decay ** k * step_loss
            metrics[f"token_loss_{k}"] = float(step_loss.detach())
            metrics[f"acc_{k}"] = float((lt.top1 == lt.teacher_top1).float().mean()) if lt.loss.numel() else 0.0
        metrics["loss"] = float(total.detach())
        metrics["draft_vocab_coverage"] = float(masked_mean(in_vocab.float(), valid[0]))
        return total, metrics

    # --- export (heads/export_common.py) ----------------------------------------------------------
    # Our tensor names already are vLLM's / speculators' (fc.weight, layers.0.*, norm.weight,
    # lm_head.weight, d2t [Vd] int64, t2d [V] bool); embeddings stay the target's, never written.
    SPECULATIVE_TOKENS = 3   # proposal length the speculators config suggests (its converter's)

    def _export_speculators(self, out_dir, target, fmt: str = "speculators"):
        """speculators / vLLM format: config.json with `speculators_model_type: eagle3`
        (vLLM: transformers_utils/configs/speculators; speculators: models/eagle3/config.py)."""
        from . import export_common as ex

        c, tensors = self.config, self.saved_state_dict()
        if fmt == "vllm":
            self._require_three_aux_layers("vLLM's Eagle3LlamaForCausalLM", "speculators")
        config = {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "verifier_accept_k": 1,
                                      "speculative_tokens": self.SPECULATIVE_TOKENS,
                                      "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": ex.verifier_ref(target, self.target_identity),
                             "architectures": ex.target_architectures(target)}},
            "transformer_layer_config": ex.llama_layer_config(c, target, tensors),
            "draft_vocab_size": c.draft_vocab_size,
            "norm_before_residual": c.norm_before_residual,
            # HF hidden_states indices = vLLM's aux layer ids (docs/ARCHITECTURE.md)
            "eagle_aux_hidden_state_layer_ids": list(c.aux_layers),
            "torch_dtype": ex.dtype_name(tensors)}
        usage = ("vllm serve <verifier> --speculative-config \\\n"
                 f"  '{{\"model\": \"<draft>\", \"method\": \"eagle3\", \"num_speculative_tokens\": "
                 f"{self.SPECULATIVE_TOKENS}}}'\n"
                 "# or let vLLM read the verifier from this config: vllm serve <draft>")
        notes = [f"Fused input: the target's hidden_states {list(c.aux_layers)} (HF indices, the "
                 "residual stream entering those decoder layers = vLLM's aux layer ids), "
                 "concatenated; engines read them from config.json."]
        return ex.write_export(out_dir, self, target, fmt, config, tensors, usage=usage, notes=notes)

    def _export_vllm(self, out_dir, target):
        """vLLM loads EAGLE-3 drafts in the speculators format (Eagle3LlamaForCausalLM)."""
        return self._export_speculators(out_dir, target, fmt="vllm")

    def _export_sglang(self, out_dir, target):
        """SGLang / EAGLE-3 reference layout: `LlamaForCausalLMEagle3` config, `midlayer.*` tensors
        (sglang/srt/models/llama_eagle3.py; vLLM's llama_eagle3.py also reads it)."""
        from . import export_common as ex

        c = self.config
        self._require_three_aux_layers("SGLang's LlamaForCausalLMEagle3", "speculators")
        if c.norm_before_residual:
            raise ex.ExportError(
                "SGLang's LlamaForCausalLMEagle3 keeps the un-normalised feature as the residual, "
                "but this head was trained with norm_before_residual=True: export it as 'vllm' or "
                "'speculators' instead")
        tensors = {k.replace("layers.0.", "midlayer.", 1): v for k, v in self.saved_state_dict().items()}
        config = {**ex.llama_layer_config(c, target, tensors),
                  "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": c.draft_vocab_size,
                  # SGLang captures the OUTPUT of layer id (it adds 1): HF index a -> id a - 1.
                  "eagle_config": {"use_aux_hidden_state": True,
                                   "eagle_aux_hidden_state_layer_ids": [a - 1 for a in c.aux_layers]},
                  # vLLM reads this top-level field, in HF indices, when it serves this folder.
                  "eagle_aux_hidden_state_layer_ids": list(c.aux_layers)}
        usage = ("python -m sglang.launch_server --model-path <verifier> \\\n"
                 "  --speculative-algorithm EAGLE3 --speculative-draft-model-path <draft> \\\n"
                 "  --speculative-num-steps 5 --speculative-eagle-topk 8 "
                 "--speculative-num-draft-tokens 32")
        notes = ["eagle_config.eagle_aux_hidden_state_layer_ids uses SGLang's numbering (output of "
                 "decoder layer i); the top-level eagle_aux_hidden_state_layer_ids is vLLM's (input "
                 "of layer i): both name the same target features."]
        return ex.write_export(out_dir, self, target, "sglang", config, tensors, usage=usage,
                               notes=notes)

    def _require_three_aux_layers(self, engine: str, instead: str) -> None:
        from .export_common import ExportError

        if len(self.config.aux_layers) != 3:
            raise ExportError(f"{engine} fuses exactly 3 target layers (fc reads 3 x hidden), but "
                              f"this head reads {len(self.config.aux_layers)} "
                              f"(aux_layers={self.config.aux_layers}): export it as {instead!r}")
        if 0 in self.config.aux_layers:
            # Both targets capture `hidden_states + residual` before a layer (vLLM llama.py
            # LlamaModel.forward, SGLang llama.py layers_to_capture); before layer 0 the residual
            # is None, so the target's first forward fails with a TypeError.
            raise ExportError(f"{engine}'s target cannot capture aux layer 0 (the embeddings: "
                              f"its residual stream starts at layer 1), which this head reads "
                              f"(aux_layers={self.config.aux_layers}): retrain with ids >= 1")


HEAD = Eagle3Head
