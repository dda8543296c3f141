"""Generic backend: any HF causal LM through its own modules (slower than the lean path).

Each forward hands the model a ``DynamicCache`` pre-filled with the batch's committed prefix
(read from the static cache, padded to the longest prefix), a 4D additive attention mask that
encodes the tree (prefix columns visible up to each row's own length, tree columns by ancestry)
and explicit ``position_ids``; the new tokens' K/V that the model appended are then written back
into the static cache at ``base_len + node_index``. The prefix copy per step is the price of
running code we do not control.
"""
from __future__ import annotations

import inspect

import torch
from torch import Tensor

from . import tree_attention_mask


class GenericCausalLM:
    def __init__(self, model, dtype: torch.dtype, device):
        from transformers import DynamicCache

        param, want = next(model.parameters()), torch.device(device)
        same_device = param.device.type == want.type and want.index in (None, param.device.index)
        if param.dtype != dtype or not same_device:
            raise ValueError(
                f"the generic path runs the HF model as loaded ({param.dtype} on {param.device}); "
                f"load the target with dtype={dtype} on {device} instead")
        self.model, self.dtype, self.device = model, dtype, param.device
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.has_logits_to_keep = "logits_to_keep" in params
        self._new_cache = DynamicCache
        cfg = model.config
        layer_types = set(getattr(cfg, "layer_types", None) or [])
        window = getattr(cfg, "sliding_window", None)
        # Alternating sliding/full layers take a per-kind mask mapping; a model with a window and
        # no layer kinds (Mistral) slides everywhere; a 4D mask is otherwise used as given.
        self.window = window if (not layer_types or "sliding_attention" in layer_types) else None
        self.mixed = self.window is not None and "full_attention" in layer_types
        self.kv_shapes = self._probe_kv_shapes()
        self.num_layers = len(self.kv_shapes)

    @torch.inference_mode()
    def _probe_kv_shapes(self) -> list[tuple[int, int]]:
        """(kv_heads, head_dim) per cached layer, read from a one-token forward."""
        cache = self._new_cache()
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self.model(input_ids=ids, use_cache=True, **{self.cache_kw: cache})
        layers = getattr(cache, "layers", None)
        if not layers or any(getattr(layer, "keys", None) is None for layer in layers):
            raise ValueError(f"{type(self.model).__name__} does not keep a per-layer K/V cache; "
                             "the generic runner cannot serve it")
        return [(layer.keys.shape[1], layer.keys.shape[-1]) for layer in layers]

    @torch.inference_mode()
    def forward(self, tokens: Tensor, positions: Tensor, access, tree_mask: Tensor,
                aux_layers: tuple[int, ...] = (), logits_rows: Tensor | None = None, causal: bool = False):
        bsz, n = tokens.shape
        prefix = max(access.base_list)
        cache = self._new_cache()
        if prefix > 0:
            cache = self._new_cache(ddp_cache_data=[access.read(layer, prefix) for layer in range(self.num_layers)])
        start = torch.full((bsz,), prefix, dtype=torch.long, device=self.device)
        full = self._additive(tree_attention_mask(access.base_lens, tree_mask, prefix + n, tree_start=start))
        mask = full
        if self.window is not None:
            mask = self._additive(tree_attention_mask(access.base_lens, tree_mask, prefix + n, tree_start=start,
                                                      positions=positions, window=self.window))
            if self.mixed:
                mask = {"full_attention": full, "sliding_attention": mask}
        kwargs = {self.cache_kw: cache}
        if logits_rows is not None and self.has_logits_to_keep:
            kwargs["logits_to_keep"] = logits_rows  # -> logits [B, B, V]: row b's pick is [b, b]
        out = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True,
                         output_hidden_states=True, **kwargs)
        for i, layer in enumerate(cache.layers):  # the N tokens the model just appended
            access.write(i, layer.keys[:, :, prefix:].transpose(1, 2), layer.values[:, :, prefix:].transpose(1, 2))
        rows = torch.arange(bsz, device=self.device)
        logits = out.logits
        if logits_rows is not None:
            logits = logits[rows, rows] if self.has_logits_to_keep else logits[rows, logits_rows]
        hidden_states = out.hidden_states  # HF convention: [-1] is the post-norm output
        aux = torch.cat([hidden_states[i] for i in aux_layers], dim=-1) if aux_layers else None
        return logits, hidden_states[-1], aux

    def _additive(self, allowed: Tensor) -> Tensor:
        """Bool mask -> additive float mask (eager attention adds it, SDPA accepts it too)."""
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
