"""Lean fused decoder for the Llama family: Llama, Mistral, Qwen2, Qwen3, Gemma.

Plain eager PyTorch with no HF wrapper on the hot path: q/k/v and gate/up weights are
concatenated once (one matmul each), attention is one SDPA call over the static cache with a
boolean tree mask (GQA by folding query groups, no K/V repeat), and the cache is written in
place (``StepAccess``); in bf16 on an AVX-512 CPU one C++ kernel call a layer does both
(``attention_cpu.attend_tokens``). Every
detail that differs inside the family is read from the HF modules themselves, so this file
computes exactly what HF computes:

  * RoPE: the HF rotary module's ``inv_freq`` and ``attention_scaling`` (default, linear,
    llama3, yarn ... scaling all land there), tabulated per position like HF's forward;
  * attention / MLP biases when the projections have them (Qwen2 q/k/v, ``attention_bias``);
  * Qwen3's per-head q/k RMSNorm before RoPE; ``head_dim`` and ``scaling`` from the module;
  * Gemma: embeddings times ``embed_scale``, RMSNorm as ``x * (1 + w)`` in float32, gelu-tanh
    (the activation is the HF module's own ``act_fn``);
  * sliding-window layers (Mistral, Qwen2 with ``use_sliding_window``) via the mask;
  * tied embeddings (the LM head is whatever ``lm_head.weight`` is).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec.heads.layers import additive_mask

from . import attention_cpu, glue_cpu, tree_attention_mask
from .linear import DecodeLinear

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma")
# RoPE types whose frequencies change with the sequence length: left to the generic path.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def unsupported_reason(model) -> str | None:
    """Why the lean path cannot run ``model`` exactly, or None when it can."""
    cfg = model.config
    if cfg.model_type not in FAMILIES:
        return f"model_type {cfg.model_type!r} is not one of {', '.join(FAMILIES)}"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in LENGTH_DEPENDENT_ROPE:
        return f"rope_type {rope_type!r} depends on the sequence length"
    base = getattr(model, "model", None)
    if base is None or not hasattr(getattr(base, "rotary_emb", None), "inv_freq"):
        return "no model.rotary_emb.inv_freq to read RoPE frequencies from"
    layer = base.layers[0]
    needed = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")
    missing = [n for n in needed if not _has_submodule(layer, n)]
    return f"decoder layer lacks {missing}" if missing else None


def _has_submodule(module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


class _Norm:
    """RMSNorm as HF computes it: Llama ``w * x_normed.to(dtype)``, Gemma ``(x_normed * (1 + w)).to(dtype)``."""

    def __init__(self, module, unit_offset: bool, dtype, device):
        self.eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
        self.unit_offset = unit_offset
        w = module.weight.detach()
        self.weight = (1.0 + w.float()).to(device) if unit_offset else w.to(device=device, dtype=dtype)
        # glue_cpu's kernels compute HF's Llama form (Gemma's keeps PyTorch)
        self.fused = not unit_offset and glue_cpu.available(dtype, device)

    def add(self, x: Tensor, delta: Tensor | None) -> tuple[Tensor, Tensor]:
        """(x + delta, this norm of it); delta None: (x, norm(x)). One kernel pass where fused."""
        if delta is None:
            return x, self(x)
        if self.fused and x.is_contiguous() and delta.is_contiguous():
            return glue_cpu.add_rms_norm(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self(x)

    def __call__(self, x: Tensor) -> Tensor:
        if self.fused and x.is_contiguous():  # (Qwen3's per-head q/k norms get strided views)
            return glue_cpu.rms_norm(x, self.weight, self.eps)
        if not self.unit_offset:
            return glue_cpu.reference_rms_norm(x, self.weight, self.eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


def _fuse(linears, dtype, device) -> tuple[Tensor, Tensor | None]:
    """One weight [sum(out), in] (and bias) for several Linear layers sharing their input.

    When no cast or move is needed the HF layers are re-pointed at views of the fused tensor,
    so the target's weights are not held twice.
    """
    weight = torch.cat([lin.weight.detach() for lin in linears]).to(device=device, dtype=dtype)
    has_bias = [lin.bias is not None for lin in linears]
    bias = None
    if any(has_bias):
        bias = torch.cat([lin.bias.detach() if lin.bias is not None else
                          torch.zeros(lin.out_features, dtype=lin.weight.dtype, device=lin.weight.device)
                          for lin in linears]).to(device=device, dtype=dtype)
    if all(lin.weight.dtype == dtype and lin.weight.device == weight.device for lin in linears):
        row = 0
        for lin in linears:
            rows = lin.weight.shape[0]
            lin.weight.data = weight[row:row + rows]
            row += rows
    return weight, bias


def _cast(t: Tensor | None, dtype, device) -> Tensor | None:
    return None if t is None else t.detach().to(device=device, dtype=dtype)


class _Layer:
    def __init__(self, hf_layer, config, unit_offset: bool, dtype, device):
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.head_dim = attn.head_dim
        self.n_heads = attn.q_proj.out_features // self.head_dim
        self.n_kv = attn.k_proj.out_features // self.head_dim
        self.scaling = attn.scaling
        # Qwen2/3 store the window per layer (None on full layers); Mistral passes the config's.
        self.window = getattr(attn, "sliding_window", getattr(config, "sliding_window", None))
        self.qkv = DecodeLinear(*_fuse([attn.q_proj, attn.k_proj, attn.v_proj], dtype, device))
        self.o = DecodeLinear(_cast(attn.o_proj.weight, dtype, device), _cast(attn.o_proj.bias, dtype, device))
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.q_norm = _Norm(q_norm, unit_offset, dtype, device) if q_norm is not None else None
        self.k_norm = _Norm(k_norm, unit_offset, dtype, device) if k_norm is not None else None
        self.ln1 = _Norm(hf_layer.input_layernorm, unit_offset, dtype, device)
        self.ln2 = _Norm(hf_layer.post_attention_layernorm, unit_offset, dtype, device)
        self.gate_up = DecodeLinear(*_fuse([mlp.gate_proj, mlp.up_proj], dtype, device))
        self.down = DecodeLinear(_cast(mlp.down_proj.weight, dtype, device), _cast(mlp.down_proj.bias, dtype, device))
        self.act = mlp.act_fn
        fused = glue_cpu.available(dtype, device)
        self.fused_silu = fused and type(self.act).__name__ in ("SiLU", "SiLUActivation")
        self.fused_rope = fused and q_norm is None  # Qwen3 normalises q and k per head before RoPE
        self.group = self.n_heads // self.n_kv  # query heads per kv head
        self.splits = [self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim]


class LeanCausalLM:
    """The fused forward over a static cache; see the package docstring for the interface."""

    def __init__(self, model, dtype: torch.dtype, device):
        cfg, base = model.config, model.model
        self.config, self.dtype, self.device = cfg, dtype, torch.device(device)
        unit_offset = cfg.model_type == "gemma"
        emb = base.embed_tokens
        self.embed = _cast(emb.weight, dtype, device)                                # [V, H]
        scale = getattr(emb, "embed_scale", None)  # Gemma: sqrt(hidden), applied in weight dtype
        self.embed_scale = None if scale is None else torch.as_tensor(scale).to(device=device, dtype=dtype)
        self.layers = [_Layer(layer, cfg, unit_offset, dtype, device) for layer in base.layers]
        self.norm = _Norm(base.norm, unit_offset, dtype, device)
        self.lm_head = DecodeLinear(_cast(model.get_output_embeddings().weight, dtype, device))  # [V, H]
        rope = base.rotary_emb
        self.inv_freq = rope.inv_freq.detach().float().to(device)                   # [head_dim/2]
        self.rope_scale = float(getattr(rope, "attention_scaling", 1.0))
        self.cos = self.sin = torch.empty(0, device=device)
        self.kv_shapes = [(layer.n_kv, layer.head_dim) for layer in self.layers]
        if self.device.type == "cpu" and dtype == torch.bfloat16:
            attention_cpu.kernel()  # compile (once per machine) while loading, not in the first step
        self.num_layers = len(self.layers)
        # Where the CPU kernel serves prefill it reads an additive mask of [tokens, keys] (a whole
        # 8k-token prompt: 134 MB; 400 MB before session 49 gave it one row per token rather than per
        # query head), so the runner prefills at most this many tokens a forward. The kernel gives the same bits in pieces, and as fast: SmolLM2, bf16,
        # 2,000 / 4,000 tokens whole 3.02 / 9.27 s, in pieces of 1,024 2.89 / 9.09 s.
        self.prefill_piece = 1024 if attention_cpu.takes(dtype, self.device, self.layers[0].head_dim) else None

    def _rope_table(self, length: int) -> None:
        """cos/sin [length, head_dim] exactly as HF's rotary forward computes them per position."""
        if self.cos.shape[0] >= length:
            return
        length = max(length, 2 * self.cos.shape[0], 256)
        pos = torch.arange(length, device=self.device).float()
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * self.rope_scale).to(self.dtype)
        self.sin = (emb.sin() * self.rope_scale).to(self.dtype)

    @torch.inference_mode()
    def forward(self, tokens: Tensor, positions: Tensor, access, tree_mask: Tensor,
                aux_layers: tuple[int, ...] = (), logits_rows: Tensor | None = None, causal: bool = False):
        """causal: tree_mask is the plain causal chain (a prefill); when, besides, every row starts
        at position 0, attention needs no mask and takes SDPA's causal kernel (a 1,000-token
        prompt: 12 instead of 20 ms per layer on the 2-core CPU). Right padding does not stop it:
        a real token never sees the later padding columns under the causal rule, and what the
        padding tokens compute is dropped (32 Spec-Bench prompts in padded groups: 790 -> 830-870 tok/s).
        Where the CPU attention kernel serves bf16, prefill takes it with the mask instead, so that
        a token's bits do not depend on the chunking, the batch or the prefix cache (session 48: 0-4%
        slower than SDPA up to 1,000 tokens, 18% at 2,000; session 49 spread the kernel's row blocks
        over the threads: 2,000 tokens 2.83 -> 2.25 s back to back; see attention_cpu)."""
        bsz, n = tokens.shape
        x = F.embedding(tokens, self.embed)                                  # [B, N, H]
        plain_causal = (causal and max(access.base_list) == 0
                        and not attention_cpu.takes(x.dtype, x.device, self.layers[0].head_dim))
        if self.embed_scale is not None:
            x = x * self.embed_scale
        self._rope_table(max(access.base_list) + n)  # bounds every position, no device sync
        cos, sin = self.cos[positions], self.sin[positions]                  # [B, N, hd]
        # (window, group) -> None (causal), the CPU kernel's mask, or one per read group; built once
        masks: dict[tuple, Tensor | list | None] = {}
        keep = {}
        # Each layer hands back its residual stream and its MLP output unadded: the add is done
        # with the next norm (one kernel pass where glue_cpu serves).
        x, h = self.layers[0].ln1.add(x, None)
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                keep[i] = x
            key = (layer.window, layer.group)
            if plain_causal and (layer.window is None or layer.window >= n):
                masks[key] = None
            elif key not in masks:
                mask = tree_attention_mask(access.base_lens, tree_mask, access.kv_len,
                                           positions=positions, window=layer.window)   # [B, 1, N, L]
                # Additive once per forward: SDPA would turn a bool mask into this in every layer
                # (~9% of a 13-node verification's attention at a 673-token context).
                additive = additive_mask(mask, x.dtype)
                if attention_cpu.takes(x.dtype, x.device, layer.head_dim):
                    masks[key] = additive  # one kernel call a layer, each row reading its own keys
                else:
                    additive = additive.repeat(1, 1, layer.group, 1)                 # [B, 1, g*N, L]
                    masks[key] = [additive if g.rows is None else additive[g.rows, :, :, :g.length]
                                  for g in access.read_groups()]
            x, mlp_out = self._layer(i, layer, x, h, cos, sin, access, masks[key])
            after = self.layers[i + 1].ln1 if i + 1 < self.num_layers else self.norm
            x, h = after.add(x, mlp_out)
        x = h                                                                # [B, N, H] post-norm
        keep[self.num_layers] = x  # HF's hidden_states[-1] is the post-norm output
        rows = x if logits_rows is None else x[torch.arange(bsz, device=x.device), logits_rows]
        logits = self.lm_head(rows)                                          # [B, N, V] or [B, V]
        aux = torch.cat([keep[i] for i in aux_layers], dim=-1) if aux_layers else None
        return logits, x, aux

    def _layer(self, i: int, layer: _Layer, x: Tensor, h: Tensor, cos: Tensor, sin: Tensor, access,
               masks: Tensor | list | None) -> tuple[Tensor, Tensor]:
        """Layer i on the residual stream x and its input norm h = ln1(x): (x after attention,
        the MLP's output), the latter not yet added to x."""
        bsz, n, _ = x.shape
        qkv = layer.qkv(h)
        fused_rope = layer.fused_rope and qkv.is_contiguous()
        if fused_rope:  # RoPE on the q and k heads in place, one kernel pass
            glue_cpu.rope_(qkv, cos, sin, layer.n_heads + layer.n_kv)
        q, k, v = qkv.split(layer.splits, dim=-1)
        q = q.view(bsz, n, layer.n_heads, layer.head_dim)
        k = k.view(bsz, n, layer.n_kv, layer.head_dim)
        v = v.view(bsz, n, layer.n_kv, layer.head_dim)
        if not fused_rope:
            if layer.q_norm is not None:  # Qwen3: per-head RMSNorm before RoPE
                q, k = layer.q_norm(q), layer.k_norm(k)
            q, k = glue_cpu.rotate(q, cos, sin), glue_cpu.rotate(k, cos, sin)
        if isinstance(masks, Tensor):  # the CPU kernel (forward chose it): cache write + attention, one call
            out = attention_cpu.attend_tokens(q, access.cache.k[i], access.cache.v[i], masks, layer.scaling,
                                              access.slots, access.ends, k, v, access.base_lens, access.valid)
            return self._after_attention(layer, x, out.view(bsz, n, -1))
        access.write(i, k, v)
        # GQA by folding each kv head's query group into the query axis: head h = kv*g + j reads
        # kv head h // g (HF's repeat_kv), so [B, h, N, hd] -> [B, kv, g*N, hd]. Same maths as
        # enable_gqa, but ~3x faster for bf16 decoding on CPU (one kernel call per kv head).
        if masks is None:  # a causal prefill from position 0 (see forward)
            keys, values = access.read(i)                                    # [B, kv, L, hd]
            q = q.transpose(1, 2)                                            # [B, h, N, hd]
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=layer.scaling,
                                                 enable_gqa=layer.group > 1)
        else:
            q = q.transpose(1, 2).reshape(bsz, layer.n_kv, layer.group * n, layer.head_dim)
            out = self._grouped_attention(i, layer, q, access, masks)
        out = out.view(bsz, layer.n_heads, n, layer.head_dim).transpose(1, 2).reshape(bsz, n, -1)
        return self._after_attention(layer, x, out)

    @staticmethod
    def _after_attention(layer: _Layer, x: Tensor, out: Tensor) -> tuple[Tensor, Tensor]:
        """The rest of a layer after attention's output out [B, N, heads x head_dim]: (x after
        attention, the MLP's output, not yet added to x)."""
        x, h = layer.ln2.add(x, layer.o(out))
        gate_up = layer.gate_up(h)
        if layer.fused_silu:
            return x, layer.down(glue_cpu.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return x, layer.down(layer.act(gate) * up)

    @staticmethod
    def _grouped_attention(i: int, layer: _Layer, q: Tensor, access, masks: list[Tensor]) -> Tensor:
        """Masked attention of q [B, kv, g*N, hd], one SDPA call per ``access.read_groups()``
        group, each over the keys its rows need (batch 32 of Spec-Bench contexts: 3.0 instead of
        8.0 ms per layer on the 2-core CPU)."""
        groups = access.read_groups()
        if len(groups) == 1:
            keys, values = access.read_group(i, groups[0])
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=masks[0], scale=layer.scaling)
        out = torch.empty_like(q)
        for group, mask in zip(groups, masks):
            keys, values = access.read_group(i, group)
            out[group.rows] = F.scaled_dot_product_attention(q[group.rows], keys, values, attn_mask=mask,
                                                             scale=layer.scaling)
        return out
