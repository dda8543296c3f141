"""EAGLE (EAGLE-1 weights, EAGLE-2 dynamic trees): feature-level autoregression.

One decoder layer reads fc(concat(embed(x_{t+1}), f_t)) at position t and predicts the target's
next feature f_{t+1}; the frozen target LM head turns it into the distribution of x_{t+2}. The
layer has no input norm and the head has no final norm: EAGLE's features are the target's
post-norm final hidden states, so `lm_head(feature)` is directly the target's logits.
Training (EAGLE): smooth-L1 on features (weight 1.0) + soft cross-entropy against
softmax(lm_head(f_{t+1})) (weight 0.1). Weight names are those of EAGLE's checkpoints
(`fc.weight`, `fc.bias`, `layers.0.self_attn.q_proj.weight`, ...).

`EagleFamily` holds what EAGLE and EAGLE-3 share: the training-time-test unroll, acceptance and
the drafter (its own KV cache + EAGLE-2 trees).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import (DraftHead, FeatureSpec, acceptance_stats, chunked_logit_loss, chunked_top1,
                   depth_valid_mask, frozen_embedding, frozen_linear, init_linear_, llama_dims,
                   masked_mean, shift_left, target_argmax)
from .common import DRAFT_VOCAB, DraftLogits, mean_loss
from .layers import CacheAppend, DecoderLayer, Rotary, SlotKVCache, additive_mask, appends_to_cache
from .tree import DraftTree, Frontier, TreeBudget, expand_dynamic_tree, num_dynamic_candidates


class EagleFamily(DraftHead):
    """Shared by EAGLE and EAGLE-3. Subclasses define `raw_feature`, `fuse_feature`,
    `layer_step`, `logit_input`, `draft_head_weight` and `token_map` (see their docstrings)."""

    TARGET_FIELDS = ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads")

    @classmethod
    def target_config(cls, target) -> dict:
        return llama_dims(target)

    def _build_rotary(self, c) -> None:
        self.rotary = Rotary(c.head_dim, c.rope_parameters, c.max_position_embeddings,
                             c.hidden_size, c.num_attention_heads)

    # --- what a subclass defines --------------------------------------------------------------
    def raw_feature(self, features: dict[str, Tensor]) -> Tensor:
        """The target feature [..., D] the head reads (validated), before `fuse_feature`."""
        raise NotImplementedError

    def fuse_feature(self, raw: Tensor) -> Tensor:
        """raw [..., D] -> the step-0 input feature [..., H] (EAGLE-3: fc over 3 layers)."""
        raise NotImplementedError

    def draft_feature_spec(self) -> FeatureSpec:
        """What drafting reads per token: `raw_feature`'s input only (`feature_spec` adds what
        training reads, e.g. EAGLE-3's teacher `hidden`). The engine keeps these per token of every
        running and prefix-cached sequence."""
        return FeatureSpec(hidden=True)

    def input_feature(self, features: dict[str, Tensor]) -> Tensor:
        """Step-0 input feature [..., H] from captured/runtime target features."""
        return self.fuse_feature(self.raw_feature(features))

    def layer_step(self, feature: Tensor, tokens: Tensor, cos, sin, mask=None, past_kv=None,
                   ttt_prev=None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """One pass of the draft layer: feature [B, T, H] paired with tokens [B, T] ->
        (out [B, T, H] = the next step's feature, (k, v))."""
        raise NotImplementedError

    def logit_input(self, out: Tensor) -> Tensor:
        """What the draft LM head reads from a layer output (EAGLE-3 normalises it)."""
        return out

    def draft_head_weight(self) -> Tensor:
        """[V_draft, H] weight of the LM head producing draft logits."""
        raise NotImplementedError

    @property
    def token_map(self) -> Tensor | None:
        """[V_draft] target id of each draft id, or None when the draft vocab is the target's."""
        return None

    # --- training-time test --------------------------------------------------------------------
    def unroll(self, batch: dict[str, Tensor], steps: int, feature: Tensor | None = None) -> list[Tensor]:
        """Run the layer `steps` times over a teacher-forced batch; outputs [steps] x [B, T, H].

        Step k at position t reads (feature, x_{t+k+1}) at rope position t+k and predicts
        x_{t+k+2}; step 0's feature is the target's, later steps read the previous step's output.
        Attention (EAGLE-3's training-time test): the step-0 keys at positions <= t (computed
        from real target features, as the drafter's committed cache) plus, privately, the keys
        of steps 1..k at the same t (the chain's own tree ancestors).
        `feature` overrides the step-0 feature (e.g. with training noise added).
        """
        ids = batch["input_ids"]
        B, T = ids.shape
        attn = batch.get("attention_mask")
        attn = torch.ones_like(ids, dtype=torch.bool) if attn is None else attn.bool()
        pos = (attn.long().cumsum(1) - 1).clamp(min=0)                   # [B, T] (any padding side)
        eye = torch.eye(T, dtype=torch.bool, device=ids.device)
        causal = (torch.ones(T, T, dtype=torch.bool, device=ids.device).tril() & attn[:, None]) | eye
        feat = self.input_feature(batch) if feature is None else feature
        outs, prev, kv0 = [], [], None
        for k in range(steps):
            tokens = shift_left(ids, k + 1)
            cos, sin = self.rotary(pos + k, feat.dtype)
            if k == 0:
                out, kv0 = self.layer_step(feat, tokens, cos, sin, mask=causal)
            else:
                out, kv = self.layer_step(feat, tokens, cos, sin, mask=causal, past_kv=kv0,
                                          ttt_prev=prev)
                prev = prev + [kv]
            outs.append(out)
            feat = out
        return outs

    @torch.no_grad()
    def acceptance(self, batch: dict[str, Tensor], depth: int) -> dict:
        """Greedy acceptance per depth, the draft conditioning on its own features (as at
        inference) and on the data's tokens. See base.acceptance_stats."""
        self.require_target_parts()
        outs = self.unroll(batch, depth)
        tgt_next = self.target_next(batch)                                # [B, T]
        valid = depth_valid_mask(batch, depth)                            # [D, B, T]
        weight, tmap = self.draft_head_weight(), self.token_map
        preds, confs, tgts = [], [], []
        for k, out in enumerate(outs):
            B, T, H = out.shape
            top1, conf = chunked_top1(self.logit_input(out).reshape(B * T, H), weight)
            if tmap is not None:
                top1 = tmap[top1]
            preds.append(top1.view(B, T))
            confs.append(conf.view(B, T))
            tgts.append(shift_left(tgt_next, k + 1, fill=-1))
        return acceptance_stats(torch.stack(preds), torch.stack(confs), torch.stack(tgts), valid)

    def target_next(self, batch: dict[str, Tensor]) -> Tensor:
        """The target's greedy next token at every position [B, T]."""
        return target_argmax(batch, self.target_lm_head_weight())

    def target_lm_head_weight(self) -> Tensor:
        raise NotImplementedError

    def new_drafter(self, target=None, **opts) -> "EagleDrafter":
        self.require_target_parts()
        return EagleDrafter(self, **opts)


@dataclass
class EagleLayerConfig:
    """The draft decoder layer's Llama dimensions (the target's, from `llama_dims`), the fields
    EAGLE's and EAGLE-3's configs start with."""
    hidden_size: int = 0
    vocab_size: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 4096


@dataclass
class EagleConfig(EagleLayerConfig):
    fc_bias: bool = False         # vLLM's EAGLE loader has no fc.bias; EAGLE's own code uses True
    feature_weight: float = 1.0   # smooth-L1 on features (EAGLE's v_w)
    token_weight: float = 0.1     # soft CE through the frozen LM head (EAGLE's p_w)
    ttt_steps: int = 1            # 1 = EAGLE-1 teacher forcing; >1 adds EAGLE-3-style unroll steps
    step_decay: float = 0.8       # weight of unroll step k is step_decay**k
    input_noise: float = 0.0      # uniform noise on input features while training (EAGLE uses ~0.2)


class EagleHead(EagleFamily):
    Config = EagleConfig
    FROZEN_PARTS = {"embed_tokens": "embed_tokens", "lm_head": "lm_head"}

    def __init__(self, config: EagleConfig):
        super().__init__(config)
        c = config
        H = c.hidden_size
        self.embed_tokens = frozen_embedding(c.vocab_size, H)
        self.fc = nn.Linear(2 * H, H, bias=c.fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(H, c.num_attention_heads, c.num_key_value_heads,
                                                  c.intermediate_size, c.head_dim, c.rms_norm_eps,
                                                  input_norm=False)])
        self.lm_head = frozen_linear(H, c.vocab_size)
        self._build_rotary(c)
        init_linear_(self)

    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(hidden=True)

    def raw_feature(self, features: dict[str, Tensor]) -> Tensor:
        return features["hidden"]

    def fuse_feature(self, raw: Tensor) -> Tensor:
        return raw.to(self.fc.weight.dtype)

    def layer_step(self, feature, tokens, cos, sin, mask=None, past_kv=None, ttt_prev=None):
        x = self.fc(torch.cat([self.embed_tokens(tokens).to(feature.dtype), feature], dim=-1))
        return self.layers[0](x, cos, sin, mask, past_kv, ttt_prev)

    def draft_head_weight(self) -> Tensor:
        return self.lm_head.weight

    def target_lm_head_weight(self) -> Tensor:
        return self.lm_head.weight

    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
        self.require_target_parts()
        c = self.config
        hidden = batch["hidden"].to(self.fc.weight.dtype)
        feat = hidden
        if c.input_noise > 0:  # EAGLE's augmentation: the draft later reads its own, noisier features
            feat = hidden + (torch.rand_like(hidden) - 0.5) * c.input_noise
        outs = self.unroll(batch, c.ttt_steps, feature=feat)
        valid = depth_valid_mask(batch, c.ttt_steps)
        total = hidden.new_zeros(())
        metrics: dict[str, float] = {}
        for k, out in enumerate(outs):
            target = shift_left(hidden, k + 1)                        # f_{t+k+1} [B, T, H]
            v = valid[k]
            fl = masked_mean(F.smooth_l1_loss(out, target, reduction="none").mean(-1), v)
            lt = chunked_logit_loss(out[v], self.lm_head.weight, teacher_h=target[v])
            tl = mean_loss(lt.loss, out)
            total = total + c.step_decay ** k * (c.feature_weight * fl + c.token_weight * tl)
            metrics[f"feature_loss_{k}"] = float(fl.detach())
            metrics[f"token_loss_{k}"] = float(tl.detach())
            metrics[f"acc_{k}"] = float((lt.top1 == lt.teacher_top1).float().mean()) if v.any() else 0.0
        metrics["loss"] = float(total.detach())
        return total, metrics

    # --- export (heads/export_common.py) ----------------------------------------------------------
    # Tensors: fc.weight (+ fc.bias), layers.0.{self_attn,post_attention_layernorm,mlp}.* (layer 0
    # has no input_layernorm, as EAGLE's); embeddings and LM head stay the target's.
    def _export_vllm(self, out_dir, target):
        """vLLM EagleLlamaForCausalLM (model_executor/models/llama_eagle.py): a one-layer Llama
        config; vLLM maps architecture LlamaForCausalLM -> EagleLlamaForCausalLM for method eagle."""
        from . import export_common as ex

        if self.config.fc_bias:
            raise ex.ExportError(
                "vLLM's EAGLE draft has no fc bias and would silently drop this head's fc.bias: "
                "export it as 'sglang', or train with fc_bias: false for vLLM")
        tensors = self.saved_state_dict()
        config = {**ex.llama_layer_config(self.config, target, tensors),
                  "architectures": ["LlamaForCausalLM"]}
        usage = ("vllm serve <verifier> --speculative-config \\\n"
                 "  '{\"model\": \"<draft>\", \"method\": \"eagle\", \"num_speculative_tokens\": 3}'")
        return ex.write_export(out_dir, self, target, "vllm", config, tensors, usage=usage,
                               notes=["Pass \"method\": \"eagle\" explicitly: vLLM only guesses "
                                      "EAGLE from folder names containing 'eagle-'."])

    def _export_sglang(self, out_dir, target):
        """SGLang LlamaForCausalLMEagle (sglang/srt/models/llama_eagle.py), whose fc always has a
        bias: a head trained without one exports a zero bias (the same function)."""
        from . import export_common as ex

        tensors = self.saved_state_dict()
        if "fc.bias" not in tensors:
            tensors["fc.bias"] = torch.zeros(self.fc.out_features, dtype=self.fc.weight.dtype)
        config = {**ex.llama_layer_config(self.config, target, tensors),
                  "architectures": ["LlamaForCausalLMEagle"]}
        usage = ("python -m sglang.launch_server --model-path <verifier> \\\n"
                 "  --speculative-algorithm EAGLE --speculative-draft-model-path <draft> \\\n"
                 "  --speculative-num-steps 5 --speculative-eagle-topk 8 "
                 "--speculative-num-draft-tokens 32")
        return ex.write_export(out_dir, self, target, "sglang", config, tensors, usage=usage)


# ----------------------------------------------------------------------------------------------
# Drafter: the head's own KV cache per slot + EAGLE-2 dynamic trees
# ----------------------------------------------------------------------------------------------
# Measured with the EAGLE-3 CPU recipe's head on 6 Spec-Bench prompts (bf16, 2 cores): minimum
# frontier mass 0 / 0.1 / 0.15 / 0.25 -> 35.0 / 38.6 / 41.5 / 42.5 tok/s at the same tau (1.58-1.60).
CPU_MIN_FRONTIER_MASS = 0.25
# Pairs one propose runs through the head at most on a CPU, shared by its rows (each keeps at
# least MIN_CATCHUP_WINDOW): ~70 ms of the 2-core CPU. Only long backlogs are cut (a prompt, or a
# server row that decoded plainly); Spec-Bench tau at batch 1 with the prompt cut to its last
# 64 / 32 / 16 pairs: 1.507 / 1.477 / 1.473 against 1.519 whole (docs/BENCHMARKS.md, session 37).
CPU_CATCHUP_PAIRS = 512
MIN_CATCHUP_WINDOW = 16
# Where the catch-up is bounded, a prefix-cache entry keeps the features of its last 64 tokens
# only (PrefixCache.feature_tail): from batch 8 on a window reads no more, and at batch 1 a prompt
# cut to its last 64 pairs drafted at tau 1.507 against 1.519 whole (24 Spec-Bench first turns,
# session 37). Whole, EAGLE-3's features were 13% of an entry's bytes (docs/BENCHMARKS.md, session 38).
CACHED_FEATURE_PAIRS = 64
# Where the head writes its K/V through the CPU attention kernel (``CacheAppend``), a draft tree's
# nodes go in its cache right after the root, level by level: room for this many past max_len (a
# CPU tree needs depth x top-k = 12; a bigger tree, or a slot too close to the end, drafts as on a GPU).
TREE_SCRATCH = 32


class EagleDrafter:
    """Drafter for EAGLE-family heads (see base.Drafter for the protocol).

    Cache position p of a slot holds the pair (feature_p, token_{p+1}); the last committed
    feature waits (`last`) for the next root. Pairs whose tokens are committed but not yet run
    wait in `pending` and are run, batched, with the roots at the next `propose`. The root pair's
    K/V is written at propose time (a one-layer head's K/V depend only on the pair itself) and
    kept if `commit` confirms that root. Features wait raw (`raw_feature`) and are fused only when
    the layer runs: a step the head does not draft (the hybrid's gate, a server's plain rows)
    then costs no fc (EAGLE-3's 3H -> H: ~0.4 ms of every hybrid step on the 2-core CPU).
    """

    def __init__(self, head: EagleFamily, max_batch: int = 1, max_len: int = 2048,
                 min_frontier_mass: float | None = None, draft_vocab: int | None = DRAFT_VOCAB,
                 catchup_pairs: int | str | None = "auto", **unknown):
        if unknown:
            raise ValueError(f"unknown {head.head_type()} drafter option(s) {sorted(unknown)}; "
                             "known: max_batch, max_len, min_frontier_mass, draft_vocab, catchup_pairs")
        p = next(head.parameters())
        if catchup_pairs == "auto":  # on a GPU a backlog runs in parallel: no limit
            catchup_pairs = CPU_CATCHUP_PAIRS if p.device.type == "cpu" else None
        if catchup_pairs is not None and (not isinstance(catchup_pairs, int) or catchup_pairs < 1):
            raise ValueError(f"catchup_pairs={catchup_pairs!r} must be a whole number of at least 1, "
                             "'auto' (the device's default) or None (no limit)")
        self.catchup_pairs = catchup_pairs
        self.feature_tail = None if catchup_pairs is None else min(catchup_pairs, CACHED_FEATURE_PAIRS)
        self.head = head.eval()
        self.feature_spec = head.draft_feature_spec()
        self.dtype, self.device = p.dtype, p.device
        # Deeper tree levels only while they promise enough (heads.tree.expand_dynamic_tree):
        # a level is a large share of a CPU step, a small one of a GPU step.
        if min_frontier_mass is None:
            min_frontier_mass = CPU_MIN_FRONTIER_MASS if self.device.type == "cpu" else 0.0
        self.min_frontier_mass = float(min_frontier_mass)
        self.logits = DraftLogits(head, draft_vocab)  # the draft LM head (EAGLE-1's: the target's)
        self.reset(max_batch, max_len)

    def _draft_logits(self, x: Tensor) -> Tensor:
        """The draft LM head, which runs at every tree level (DraftLogits: prepacked, rebuilt
        when the weight changes; EAGLE-1's full vocabulary cut to the frequent tokens)."""
        return self.logits(x, self.head.draft_head_weight())

    def reset(self, max_batch: int, max_len: int) -> None:
        attn = self.head.layers[0].self_attn
        self.in_cache = appends_to_cache(self.head)  # K/V written and read in place by the CPU kernel
        self.cache = SlotKVCache(max_batch, attn.num_kv_heads, max_len + (TREE_SCRATCH if self.in_cache else 0),
                                 attn.head_dim, self.dtype, self.device)
        self.last: list[Tensor | None] = [None] * max_batch          # [D] raw feature awaiting a token
        # chunks ([m, D] raw, [m]) of committed pairs not yet run; appended, joined when run
        self.pending: list[list[tuple[Tensor, Tensor]]] = [[] for _ in range(max_batch)]
        self.root_written: list[int | None] = [None] * max_batch
        # first cache position each slot attends to (> 0 once a catch-up skipped older pairs)
        self.start = torch.zeros(max_batch, dtype=torch.long, device=self.device)

    def _features(self, features: dict[str, Tensor]) -> Tensor:
        """The raw feature [m, D] kept per token (fused in `_run_pending`)."""
        return self.head.raw_feature(features).to(self.device, self.dtype)

    @torch.no_grad()
    def prefill(self, slot: int, token_ids: Tensor, features: dict[str, Tensor]) -> None:
        """token_ids [n]; features of its last m <= n tokens (a prefix cache keeps only the last
        ones): the head's context then starts at position n - m, as if a catch-up had cut it."""
        self.release(slot)
        feats = self._features(features)                                 # [m, D]
        ids = token_ids.to(self.device).long()
        skip = ids.numel() - feats.shape[0]
        if feats.shape[0] == 0 or skip < 0:
            raise ValueError(f"{self.head.head_type()} drafter: features of {feats.shape[0]} tokens "
                             f"for a prompt of {ids.numel()} (need 1..{ids.numel()})")
        self.cache.lens[slot] = self.start[slot] = skip
        self.last[slot] = feats[-1]
        if feats.shape[0] > 1:  # run through the head at the first propose: a hybrid may never ask
            self.pending[slot].append((feats[:-1], ids[skip + 1:]))

    @torch.no_grad()
    def commit(self, slot: int, token_ids: Tensor, features: dict[str, Tensor]) -> None:
        if self.last[slot] is None:
            raise RuntimeError(f"slot {slot} has no sequence: call prefill before commit")
        feats = self._features(features)                                 # [m, D]
        ids = token_ids.to(self.device).long()
        # pairs: (the last feature, the first token), then each new feature with the next token
        if self.root_written[slot] is not None and self.root_written[slot] == int(ids[0]):
            self.cache.lens[slot] += 1                                   # the root pair's K/V stand
        else:
            self.pending[slot].append((self.last[slot][None], ids[:1]))
        self.root_written[slot] = None
        if ids.numel() > 1:
            self.pending[slot].append((feats[:-1], ids[1:]))
        self.last[slot] = feats[-1]

    def release(self, slot: int) -> None:
        self.cache.lens[slot] = self.start[slot] = 0
        self.last[slot] = self.root_written[slot] = None
        self.pending[slot] = []

    def _windowed(self, slot: int, window: int | None) -> list[tuple[Tensor, Tensor]]:
        """The slot's pending chunks, cut to their last `window` pairs. A row that decoded plainly
        for long (a server's big batch) would otherwise run its whole backlog through the head
        before its first draft: 16 rows x ~200 pairs took ~0.6 s on the 2-core CPU, the time of
        ~25 plain steps. The skipped pairs' positions stay unwritten and, with everything before
        them, out of the head's attention (`start`); rotary positions stay absolute. Drafts lose
        some context, never correctness: the target verifies every draft."""
        chunks = self.pending[slot]
        n = sum(t.numel() for _, t in chunks)
        if window is None or n <= window:
            return chunks
        skip = n - window
        self.cache.lens[slot] += skip
        self.start[slot] = self.cache.lens[slot]
        return [(torch.cat([f for f, _ in chunks])[skip:], torch.cat([t for _, t in chunks])[skip:])]

    def _run_pending(self, slots: list[int], roots: Tensor | None = None) -> Tensor | None:
        """Run each slot's pending pairs (+ its root pair (last, root) when roots [B] are given)
        in one padded batch, writing their K/V to the cache. Returns the roots' outputs [B, H]."""
        rows = []  # per slot: its chunks of (raw features, tokens), the root pair last
        window = None if self.catchup_pairs is None else max(MIN_CATCHUP_WINDOW, self.catchup_pairs // len(slots))
        for i, s in enumerate(slots):
            if self.last[s] is None:
                raise RuntimeError(f"slot {s} has no sequence: call prefill before propose/commit")
            rows.append(self._windowed(s, window) + ([(self.last[s][None], roots[i:i + 1])] if roots is not None else []))
        sizes = [sum(t.numel() for _, t in chunks) for chunks in rows]
        B, Q = len(slots), max(sizes)
        if Q == 0:
            return None
        flat = [chunk for chunks in rows for chunk in chunks]
        fused = self.head.fuse_feature(torch.cat([f for f, _ in flat]))  # [sum m, H]: one fc call
        flat_tokens = torch.cat([t for _, t in flat])
        if B == 1:  # nothing to pad
            feats, toks = fused[None], flat_tokens[None]
        else:
            feats = torch.zeros(B, Q, fused.shape[-1], device=self.device, dtype=fused.dtype)
            toks = torch.zeros(B, Q, dtype=torch.long, device=self.device)
            start = 0
            for i, n in enumerate(sizes):
                feats[i, :n], toks[i, :n] = fused[start:start + n], flat_tokens[start:start + n]
                start += n
        counts = torch.tensor(sizes, device=self.device)
        slot_t = torch.tensor(slots, device=self.device)
        lens = self.cache.lens[slot_t]                                   # [B]
        start = self.start[slot_t]
        cos, sin = self.head.rotary(lens[:, None] + torch.arange(Q, device=self.device)[None], self.dtype)
        if self.in_cache:  # token t of row b sits at lens + t and reads start .. itself
            ends = lens + counts                                         # [B] keys read
            ar = torch.arange(int(ends.max()), device=self.device)
            last = torch.minimum(lens[:, None] + ar[None, :Q], ends[:, None] - 1)      # [B, Q]
            ok = (ar[None, None] >= start[:, None, None]) & (ar[None, None] <= last[..., None])
            append = CacheAppend(self.cache, slot_t, lens, ends, additive_mask(ok[:, None], self.dtype),
                                 ar[None, :Q] < counts[:, None])
            out, _ = self.head.layer_step(feats, toks, cos, sin, None, append)
        else:
            P = int(lens.max())
            ar = torch.arange(max(P, Q), device=self.device)
            past_ok = (ar[None, None, :P] < lens[:, None, None]) & (ar[None, None, :P] >= start[:, None, None])
            cur_ok = (ar[None, :Q, None] >= ar[None, None, :Q]) & (ar[None, None, :Q] < counts[:, None, None])
            mask = torch.cat([past_ok.expand(B, Q, P), cur_ok | torch.eye(Q, dtype=torch.bool,
                                                                          device=self.device)], -1)
            out, (k, v) = self.head.layer_step(feats, toks, cos, sin, mask, self.cache.read(slot_t, P))
            self.cache.write(slot_t, lens, k, v, counts)
        n_pending = counts - (1 if roots is not None else 0)
        self.cache.lens[slot_t] += n_pending
        for s in slots:
            self.pending[s] = []
        if roots is None:
            return None
        for i, s in enumerate(slots):
            self.root_written[s] = int(roots[i])
        return out[torch.arange(B, device=self.device), counts - 1]     # [B, H]

    @torch.no_grad()
    def propose(self, slots: Tensor, roots: Tensor, budget: TreeBudget) -> DraftTree:
        slot_list = [int(s) for s in slots]
        roots = roots.to(self.device).long()
        B = len(slot_list)
        if budget.max_nodes == 0:
            return DraftTree(tokens=roots[:, None], parents=torch.full((B, 1), -1, device=self.device),
                             valid=torch.ones(B, 1, dtype=torch.bool, device=self.device),
                             scores=torch.ones(B, 1, device=self.device))
        root_out = self._run_pending(slot_list, roots)                    # [B, H]
        slot_t = torch.tensor(slot_list, device=self.device)
        root_pos = self.cache.lens[slot_t]                                # root pair's position
        S = int(root_pos.max()) + 1
        state = {"out": root_out[:, None]}                                # outputs of the last frontier
        head, draft_logits = self.head, self._draft_logits

        def logprobs(out: Tensor) -> Tensor:
            return draft_logits(head.logit_input(out)).float().log_softmax(-1)

        def step(fr: Frontier) -> Tensor:
            if fr.depth == 0:
                return logprobs(state["out"])
            parent_out = state["out"].gather(1, fr.parent_slot[..., None].expand(-1, -1, root_out.shape[-1]))
            cos, sin = head.rotary((root_pos[:, None] + fr.depth).expand_as(fr.tokens), self.dtype)
            mask, past, keep = attend(fr)
            state["out"], kv = head.layer_step(parent_out, fr.tokens, cos, sin, mask, past)
            if keep is not None:
                keep(fr, kv)
            return logprobs(state["out"])

        scratch = budget.max_depth * budget.topk
        in_cache = self.in_cache and S + scratch <= self.cache.max_len
        attend = (self._in_cache_tree(slot_t, root_pos, S, scratch) if in_cache
                  else self._copied_tree(slot_t, root_pos, S, budget))
        return expand_dynamic_tree(step, roots, budget, token_map=head.token_map,
                                   min_frontier_mass=self.min_frontier_mass, ancestors=not in_cache)

    def _copied_tree(self, slot_t: Tensor, root_pos: Tensor, S: int, budget: TreeBudget):
        """fr -> (mask, past_kv, keep) of a tree level whose nodes' K/V go to a tree buffer (by
        candidate index; ``keep(fr, kv)`` stores them) read beside a copy of the slots' cache:
        any device, any dtype. S = max(root_pos) + 1."""
        B = slot_t.numel()
        past_k, past_v = self.cache.read(slot_t, S)
        ar = torch.arange(S, device=self.device)[None]
        prefix_ok = (ar <= root_pos[:, None]) & (ar >= self.start[slot_t][:, None])  # [B, S]
        attn = self.head.layers[0].self_attn
        C = num_dynamic_candidates(budget)
        tree_k = torch.zeros(B, attn.num_kv_heads, C, attn.head_dim, device=self.device, dtype=self.dtype)
        tree_v = torch.zeros_like(tree_k)

        def attend(fr: Frontier):
            F_ = fr.tokens.shape[1]
            in_tree = fr.ancestors.clone()
            in_tree[:, :, 0] = False                                      # the root lives in the cache
            in_tree.scatter_(2, fr.node_index[..., None], False)          # self comes as "current"
            mask = torch.cat([prefix_ok[:, None].expand(B, F_, S), in_tree,
                              torch.eye(F_, dtype=torch.bool, device=self.device).expand(B, F_, F_)], -1)
            return mask, (torch.cat([past_k, tree_k], 2), torch.cat([past_v, tree_v], 2)), keep

        def keep(fr: Frontier, kv: tuple[Tensor, Tensor]) -> None:
            idx = fr.node_index[:, None, :, None].expand(-1, kv[0].shape[1], -1, kv[0].shape[-1])
            tree_k.scatter_(2, idx, kv[0])
            tree_v.scatter_(2, idx, kv[1])

        return attend

    def _in_cache_tree(self, slot_t: Tensor, root_pos: Tensor, S: int, scratch: int):
        """fr -> (None, CacheAppend, None) of a tree level written into the slots' own cache: level d's
        frontier node j at root_pos + 1 + (d - 1) * k + j, read there by the CPU kernel. A node's
        ancestors among those positions are its parent's, plus itself. S = max(root_pos) + 1; the
        levels write at most ``scratch`` nodes."""
        B = slot_t.numel()
        ar = torch.arange(S + scratch, device=self.device)
        prefix_ok = (ar[None] <= root_pos[:, None]) & (ar[None] >= self.start[slot_t][:, None])  # [B, width]
        levels = {"anc": None, "written": 0}        # the frontier's ancestors over the written nodes

        def attend(fr: Frontier):
            F_, n = fr.tokens.shape[1], levels["written"]
            own = torch.eye(F_, dtype=torch.bool, device=self.device).expand(B, F_, F_)
            anc = own if n == 0 else torch.cat(
                [levels["anc"].gather(1, fr.parent_slot[..., None].expand(-1, -1, n)), own], -1)
            levels["anc"], levels["written"] = anc, n + F_
            keys = S + n + F_
            ok = prefix_ok[:, None, :keys].expand(B, F_, keys).clone()
            ok.scatter_(2, (root_pos[:, None, None] + 1 + ar[:n + F_]).expand(B, F_, n + F_), anc)
            return None, CacheAppend(self.cache, slot_t, root_pos + 1 + n, root_pos + 1 + n + F_,
                                     additive_mask(ok[:, None], self.dtype)), None

        return attend


HEAD = EagleHead
