"""A small draft language model (classic speculative sampling, Leviathan et al. / Chen et al.).

A Llama-shaped causal LM — `num_layers` decoder layers, the target's vocabulary and tokenizer,
optionally a narrower width — distilled from the frozen target: the loss is the KL divergence
(as soft cross-entropy) from the target's next-token distribution at every position t with
loss_mask[t+1], the teacher being the captured top-k logits when present, else
softmax(lm_head(hidden)) from the target's frozen LM head, chunked so no [B, T, V] tensor exists.

With `init_from_target` (default) it starts as the target truncated to its first layers: the
embeddings, final norm, LM head and layers 0..num_layers-1 are copied whenever shapes match (a
layer-skip draft). Parameter names are Hugging Face Llama's (`model.embed_tokens.weight`,
`model.layers.{i}.self_attn.q_proj.weight`, ..., `model.norm.weight`, `lm_head.weight`), so the
saved tensors form a LlamaForCausalLM checkpoint as they are.

Drafter: its own per-slot static KV cache (`layers.SlotKVCache`). Greedy: a chain of max_depth
argmax tokens (draft_probs None). Sampling (`temperature > 0`): the chain is sampled from
q = softmax(logits / temperature) and each node's q is returned as draft_probs. `tree=True`:
an EAGLE-2 dynamic top-k tree, every frontier node attending to its own path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .base import (DraftHead, FeatureSpec, chunked_logit_loss, frozen_linear, init_linear_,
                   llama_dims, shift_left, target_part)
from .common import (DRAFT_VOCAB, DraftLogits, chain_acceptance, check_drafter_opts, label_mask, mean_loss,
                     top1_of)
from .layers import DecoderLayer, RMSNorm, Rotary, SlotKVCache
from .tree import DraftTree, Frontier, TreeBudget, expand_dynamic_tree


@dataclass
class DraftLMConfig:
    hidden_size: int = 0              # the target's width (its LM head reads it); from_target
    vocab_size: int = 0               # shared with the target
    num_layers: int = 2
    draft_hidden_size: int = 0        # the draft's width (default: the target's)
    intermediate_size: int = 0        # the rest default to the target's values
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    rope_parameters: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    init_from_target: bool = True     # copy embeddings / norm / LM head / first layers
    teacher_topk: int = 0             # >0: train from captured top-k logits instead of hidden


class DraftModel(nn.Module):
    """The decoder: HF LlamaModel's parameter names, layers.py blocks (shared with EAGLE)."""

    def __init__(self, c: DraftLMConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.draft_hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(c.draft_hidden_size, c.num_attention_heads, c.num_key_value_heads,
                         c.intermediate_size, c.head_dim, c.rms_norm_eps)
            for _ in range(c.num_layers))
        self.norm = RMSNorm(c.draft_hidden_size, c.rms_norm_eps)
        self.rotary = Rotary(c.head_dim, c.rope_parameters, c.max_position_embeddings,
                             c.draft_hidden_size, c.num_attention_heads)

    def forward(self, ids: Tensor, positions: Tensor, mask: Tensor | None = None,
                past: list | None = None, on_kv=None) -> Tensor:
        """ids / positions [B, T]; mask [B, T, S] over past (S - T) + these T keys (None: causal,
        no past); past: per-layer (k, v) [B, kv, S - T, D]; on_kv(layer, k, v) receives each
        layer's new K/V. Returns the post-norm hidden states [B, T, Hd]."""
        x = self.embed_tokens(ids)
        cos, sin = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x, (k, v) = layer(x, cos, sin, mask, None if past is None else past[i])
            if on_kv is not None:
                on_kv(i, k, v)
        return self.norm(x)


class DraftLMHead(DraftHead):
    METHOD = "sps"  # speculative-decoding name users type (--method sps)
    Config = DraftLMConfig
    FROZEN_PARTS = {"target_lm_head": "lm_head"}

    def __init__(self, config: DraftLMConfig):
        super().__init__(config)
        c = config
        needed = ("hidden_size", "vocab_size", "draft_hidden_size", "intermediate_size",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "num_layers")
        bad = [n for n in needed if getattr(c, n) <= 0]
        if bad:
            raise ValueError(f"DraftLMConfig fields {bad} must be > 0 (use from_target)")
        if c.num_attention_heads % c.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        self.model = DraftModel(c)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Linear(c.draft_hidden_size, c.vocab_size, bias=False)
        self.target_lm_head = frozen_linear(c.hidden_size, c.vocab_size)   # the teacher
        init_linear_(self, std=0.02)
        nn.init.normal_(self.model.embed_tokens.weight, std=0.02)

    @classmethod
    def target_config(cls, target) -> dict:
        d = llama_dims(target)
        return dict(hidden_size=d["hidden_size"], vocab_size=d["vocab_size"],
                    draft_hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                    num_attention_heads=d["num_attention_heads"],
                    num_key_value_heads=d["num_key_value_heads"], head_dim=d["head_dim"],
                    rms_norm_eps=d["rms_norm_eps"], rope_parameters=d["rope_parameters"],
                    max_position_embeddings=d["max_position_embeddings"],
                    tie_word_embeddings=bool(getattr(target.config, "tie_word_embeddings", False)))

    @classmethod
    def from_target(cls, target, **fields) -> "DraftLMHead":
        head = super().from_target(target, **fields)
        if head.config.init_from_target:
            head.copy_from_target(target)
        return head

    @torch.no_grad()
    def copy_from_target(self, target) -> list[str]:
        """Copy every target part whose shapes match (embeddings, norm, LM head, layers
        0..num_layers-1); returns the names copied. Layers copy only on an exact name/shape
        match (a Qwen2 layer with q/k/v biases stays randomly initialised)."""
        copied = []

        def copy(dst: nn.Module, src: nn.Module, name: str) -> None:
            mine, theirs = dst.state_dict(), src.state_dict()
            if set(mine) == set(theirs) and all(mine[k].shape == theirs[k].shape for k in mine):
                dst.load_state_dict(theirs)
                copied.append(name)

        copy(self.model.embed_tokens, target_part(target, "embed_tokens"), "embed_tokens")
        copy(self.model.norm, target_part(target, "norm"), "norm")
        if hasattr(self, "lm_head"):
            copy(self.lm_head, target_part(target, "lm_head"), "lm_head")
        model = target.model
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        for i, layer in enumerate(self.model.layers[:len(decoder.layers)]):
            copy(layer, decoder.layers[i], f"layers.{i}")
        return copied

    def lm_weight(self) -> Tensor:
        return self.lm_head.weight if hasattr(self, "lm_head") else self.model.embed_tokens.weight

    def feature_spec(self) -> FeatureSpec:
        if self.config.teacher_topk > 0:
            return FeatureSpec(hidden=False, topk_logits=self.config.teacher_topk)
        return FeatureSpec(hidden=True)

    def draft_hidden(self, batch: dict[str, Tensor]) -> Tensor:
        """The draft's post-norm hidden states over the batch's tokens [B, T, Hd]."""
        ids = batch["input_ids"].long()
        B, T = ids.shape
        positions = torch.arange(T, device=ids.device).expand(B, T)
        mask = None
        am = batch.get("attention_mask")
        if am is not None and not bool(am.all()):
            # causal over real keys; every query also sees itself, so a padding row is never
            # fully masked (a NaN row would leak through 0-weight attention)
            causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
            eye = torch.eye(T, dtype=torch.bool, device=ids.device)
            mask = causal & (am.bool()[:, None, :] | eye)
        return self.model(ids, positions, mask)

    # --- training ---------------------------------------------------------------------------
    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
        self.require_target_parts()
        h = self.draft_hidden(batch)                                         # [B, T, Hd]
        valid = label_mask(batch, 1)                                         # [B, T]
        if "topk_values" in batch:
            teacher = {"topk_values": batch["topk_values"][valid],
                       "topk_indices": batch["topk_indices"][valid]}
        elif "hidden" in batch:
            teacher = {"teacher_h": batch["hidden"][valid].to(h.dtype),
                       "teacher_weight": self.target_lm_head.weight}
        else:
            raise ValueError("draft_lm loss needs the target's 'hidden' or 'topk_values/"
                             "topk_indices' in the batch")
        r = chunked_logit_loss(h[valid], self.lm_weight(), **teacher)
        loss = mean_loss(r.loss, h)
        metrics = {"loss": float(loss.detach())}
        if r.top1.numel():
            metrics["top1_0"] = float((r.top1 == r.teacher_top1).float().mean())
        return loss, metrics

    @torch.no_grad()
    def acceptance(self, batch: dict[str, Tensor], depth: int) -> dict:
        self.require_target_parts()
        h = self.draft_hidden(batch)
        real = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
        top1 = torch.full(real.shape, -1, dtype=torch.long, device=h.device)
        conf = torch.zeros(real.shape, device=h.device)
        top1[real], conf[real] = top1_of(h[real], self.lm_weight())

        def predict(d: int, rows: Tensor):   # depth d at t = the draft reading x_{<=t+d}
            return shift_left(top1, d, -1)[rows], shift_left(conf, d)[rows]

        return chain_acceptance(batch, depth, self.target_lm_head.weight, predict)

    # --- export (heads/export_common.py) --------------------------------------------------------
    # The saved tensors already carry HF Llama's names: both engines load the folder as an ordinary
    # LlamaForCausalLM draft model, and so does transformers (generate(assistant_model=...)).
    def _hf_llama_folder(self, out_dir, target, fmt: str, usage: str):
        from . import export_common as ex

        c, tensors = self.config, self.saved_state_dict()
        config = {**ex.llama_layer_config(c, target, tensors), "architectures": ["LlamaForCausalLM"],
                  "hidden_size": c.draft_hidden_size, "num_hidden_layers": c.num_layers,
                  "tie_word_embeddings": c.tie_word_embeddings}
        return ex.write_export(out_dir, self, target, fmt, config, tensors, usage=usage, tokenizer=True)

    def _export_vllm(self, out_dir, target):
        """vLLM's classic draft model (speculative_config method "draft_model")."""
        usage = ("vllm serve <verifier> --speculative-config \\\n"
                 "  '{\"model\": \"<draft>\", \"method\": \"draft_model\", \"num_speculative_tokens\": 4}'")
        return self._hf_llama_folder(out_dir, target, "vllm", usage)

    def _export_sglang(self, out_dir, target):
        """SGLang's standalone draft model (--speculative-algorithm STANDALONE)."""
        usage = ("python -m sglang.launch_server --model-path <verifier> \\\n"
                 "  --speculative-algorithm STANDALONE --speculative-draft-model-path <draft> \\\n"
                 "  --speculative-num-steps 4 --speculative-eagle-topk 1 --speculative-num-draft-tokens 5")
        return self._hf_llama_folder(out_dir, target, "sglang", usage)

    # --- drafting ---------------------------------------------------------------------------
    def new_drafter(self, target=None, **opts) -> "DraftLMDrafter":
        check_drafter_opts(opts, ["tree"], self.head_type())
        temperature = float(opts.get("temperature") or 0.0)
        tree = bool(opts.get("tree", False))
        if tree and temperature > 0:
            raise ValueError("draft_lm: tree=True drafts deterministic top-k trees; sampling "
                             "(temperature > 0) drafts a chain")
        drafter = DraftLMDrafter(self, temperature=temperature, tree=tree, seed=opts.get("seed"),
                                 draft_vocab=opts.get("draft_vocab", DRAFT_VOCAB))
        if opts.get("max_batch") and opts.get("max_len"):
            drafter.reset(int(opts["max_batch"]), int(opts["max_len"]))
        return drafter


class DraftLMDrafter:
    """Classic SpS drafter with its own KV cache per slot.

    Per slot: `ids` (committed tokens), `lens` (how many of them have K/V in the cache) and
    `spec` (tokens whose K/V were written after them during the last propose: the root and the
    chain's drafts). On commit, the cached prefix of `spec` that matches the committed tokens is
    kept; committed tokens without K/V are fed before the next root.
    """

    def __init__(self, head: DraftLMHead, temperature: float = 0.0, tree: bool = False,
                 seed: int | None = None, draft_vocab: int | None = DRAFT_VOCAB):
        self.head = head.eval()
        self.logits = DraftLogits(head, draft_vocab)
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.feature_spec = FeatureSpec(hidden=False)
        self.temperature, self.tree = temperature, tree
        self.generator = torch.Generator(device=self.device)
        if seed is not None:
            self.generator.manual_seed(int(seed))
        self.caches: list[SlotKVCache] = []
        self._ids: dict[int, list[int]] = {}
        self._spec: dict[int, list[int]] = {}

    def reset(self, max_batch: int, max_len: int) -> None:
        c = self.head.config
        self.caches = [SlotKVCache(max_batch, c.num_key_value_heads, max_len, c.head_dim,
                                   self.dtype, self.device) for _ in range(c.num_layers)]
        self._ids.clear()
        self._spec.clear()

    @property
    def lens(self) -> Tensor:
        return self.caches[0].lens

    def _set_len(self, slots: Tensor, lens: Tensor) -> None:
        for cache in self.caches:
            cache.lens[slots] = lens

    @torch.no_grad()
    def prefill(self, slot: int, token_ids: Tensor, features: dict | None = None) -> None:
        if not self.caches:
            raise RuntimeError("call reset(max_batch, max_len) before prefill")
        slot = int(slot)
        self._ids[slot], self._spec[slot] = [int(t) for t in token_ids.tolist()], []
        slots = torch.tensor([slot], device=self.device)
        self._set_len(slots, torch.zeros(1, dtype=torch.long, device=self.device))
        n = len(self._ids[slot])
        if n:
            self._run(slots, torch.tensor([self._ids[slot]], device=self.device),
                      counts=torch.tensor([n], device=self.device))
            self._set_len(slots, torch.tensor([n], device=self.device))

    def commit(self, slot: int, token_ids: Tensor, features: dict | None = None) -> None:
        slot = int(slot)
        toks, spec = [int(t) for t in token_ids.tolist()], self._spec.get(slot, [])
        m = 0
        while m < min(len(toks), len(spec)) and toks[m] == spec[m]:
            m += 1
        slots = torch.tensor([slot], device=self.device)
        self._set_len(slots, self.lens[slots] + m)
        self._ids[slot] = self._ids[slot] + toks
        self._spec[slot] = []

    def release(self, slot: int) -> None:
        self._ids.pop(int(slot), None)
        self._spec.pop(int(slot), None)
        if self.caches:
            self._set_len(torch.tensor([int(slot)], device=self.device),
                          torch.zeros(1, dtype=torch.long, device=self.device))

    # --- forward over the slot caches -------------------------------------------------------
    def _run(self, slots: Tensor, tokens: Tensor, counts: Tensor, starts: Tensor | None = None
             ) -> Tensor:
        """Feed tokens [B, T] (row b's first counts[b] are real) at positions starts[b]..
        (default: the slot's cached length), writing their K/V. -> hidden [B, T, Hd]."""
        B, T = tokens.shape
        starts = self.lens[slots].clone() if starts is None else starts
        P = int(starts.max())
        positions = starts[:, None] + torch.arange(T, device=self.device)
        new = torch.ones(T, T, dtype=torch.bool, device=self.device).tril().expand(B, T, T)
        past_ok = (torch.arange(P, device=self.device) < starts[:, None])[:, None].expand(B, T, P)
        mask = torch.cat([past_ok, new], -1)
        past = [c.read(slots, P) for c in self.caches] if P else None

        def write(i: int, k: Tensor, v: Tensor) -> None:
            self.caches[i].write(slots, starts, k, v, counts)

        return self.head.model(tokens, positions, mask, past, on_kv=write)

    def _logits(self, h: Tensor) -> Tensor:
        return self.logits(h, self.head.lm_weight()).float()

    # --- proposing --------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, slots: Tensor, roots: Tensor, budget: TreeBudget) -> DraftTree:
        slots, roots = slots.to(self.device).long(), roots.to(self.device).long()
        B = slots.shape[0]
        # 1. committed tokens not cached yet + the root, one block per slot
        blocks = [self._ids[int(s)][int(self.lens[s]):] + [int(r)] for s, r in zip(slots, roots)]
        counts = torch.tensor([len(b) for b in blocks], device=self.device)
        tokens = torch.zeros(B, int(counts.max()), dtype=torch.long, device=self.device)
        for b, blk in enumerate(blocks):
            tokens[b, :len(blk)] = torch.tensor(blk, device=self.device)
        h = self._run(slots, tokens, counts)
        self._set_len(slots, self.lens[slots] + counts - 1)    # the root stays speculative
        for s, r in zip(slots.tolist(), roots.tolist()):
            self._spec[s] = [r]
        logits = self._logits(h[torch.arange(B, device=self.device), counts - 1])   # [B, V]
        if self.tree:
            return self._propose_tree(slots, roots, logits.log_softmax(-1), budget)
        return self._propose_chain(slots, roots, logits, min(budget.max_depth, budget.max_nodes))

    def _propose_chain(self, slots: Tensor, roots: Tensor, logits: Tensor, D: int) -> DraftTree:
        B = roots.shape[0]
        toks, node_p, qs = [roots], [torch.ones(B, device=self.device)], []
        for d in range(1, D + 1):
            if self.temperature > 0:
                q = (logits / self.temperature).softmax(-1)                 # [B, V]
                tok = torch.multinomial(q, 1, generator=self.generator)[:, 0]
                qs.append(q)
            else:
                q = logits.softmax(-1)
                tok = q.argmax(-1)
            toks.append(tok)
            node_p.append(q.gather(1, tok[:, None])[:, 0])
            if d < D:   # feed the draft to get the next distribution
                ones = torch.ones(B, dtype=torch.long, device=self.device)
                starts = self.lens[slots] + d
                h = self._run(slots, tok[:, None], ones, starts=starts)
                for s, t in zip(slots.tolist(), tok.tolist()):
                    self._spec[s].append(t)
                logits = self._logits(h[:, 0])
        tokens = torch.stack(toks, 1)                                        # [B, D+1]
        parents = torch.arange(-1, D, device=self.device).expand(B, -1).clone()
        draft_probs = None
        if qs:
            draft_probs = torch.stack([torch.zeros_like(qs[0])] + qs, 1)     # [B, D+1, V]
        return DraftTree(tokens=tokens, parents=parents,
                         valid=torch.ones_like(tokens, dtype=torch.bool),
                         draft_probs=draft_probs, scores=torch.stack(node_p, 1).cumprod(1))

    def _propose_tree(self, slots: Tensor, roots: Tensor, root_logp: Tensor,
                      budget: TreeBudget) -> DraftTree:
        """Dynamic top-k tree: tree nodes' K/V live in per-candidate buffers; a frontier node
        attends to the committed cache, the root (cached at `rpos`) and its own ancestors."""
        B, c = roots.shape[0], self.head.config
        rpos = self.lens[slots].clone()                                      # root positions
        P = int(rpos.max()) + 1
        past = [cache.read(slots, P) for cache in self.caches]
        tree_kv: list[tuple[Tensor, Tensor]] = []
        rows = torch.arange(B, device=self.device)[:, None]

        def step(fr: Frontier) -> Tensor:
            if fr.depth == 0:
                return root_logp[:, None]                                   # [B, 1, V]
            if not tree_kv:   # [B, C, kv, D] per layer, indexed by candidate
                shape = (B, fr.num_candidates, c.num_key_value_heads, c.head_dim)
                tree_kv.extend((torch.zeros(shape, dtype=self.dtype, device=self.device),
                                torch.zeros(shape, dtype=self.dtype, device=self.device))
                               for _ in range(c.num_layers))
            F_ = fr.tokens.shape[1]
            anc = fr.ancestors.clone()
            anc[..., 0] = False                                              # root: in `past`
            own = torch.arange(F_, device=self.device)[None]
            anc[rows, own, fr.node_index] = False                            # self: new keys
            past_ok = (torch.arange(P, device=self.device) < rpos[:, None] + 1)[:, None]
            eye = torch.eye(F_, dtype=torch.bool, device=self.device).expand(B, F_, F_)
            mask = torch.cat([past_ok.expand(B, F_, P), anc, eye], -1)
            kv = [(torch.cat([pk, tk.transpose(1, 2)], 2), torch.cat([pv, tv.transpose(1, 2)], 2))
                  for (pk, pv), (tk, tv) in zip(past, tree_kv)]

            def write(i: int, k: Tensor, v: Tensor) -> None:
                tree_kv[i][0][rows, fr.node_index] = k.transpose(1, 2)
                tree_kv[i][1][rows, fr.node_index] = v.transpose(1, 2)

            positions = (rpos + fr.depth)[:, None].expand(B, F_)
            h = self.head.model(fr.tokens, positions, mask, kv, on_kv=write)
            return self._logits(h).log_softmax(-1)                           # [B, F, V]

        return expand_dynamic_tree(step, roots, budget)


HEAD = DraftLMHead
