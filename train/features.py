"""The target features a draft head trains on, computed one way for offline and online use.

`compute_features` is the only place that runs the frozen target to produce head inputs:
`specdec-data capture` stores its output (offline) and the trainer calls it inside the
training loop (online), so both modes see identical features.

Hidden-state convention (docs/ARCHITECTURE.md): HF `output_hidden_states` indices.
`hidden_states[0]` is the embedding output and `hidden_states[i]` the output of decoder
layer i-1, i.e. the residual stream entering layer i (vLLM's EAGLE-3 "aux layer id i").
The *final* feature `hidden` is the last layer's output after the final norm, so that
`lm_head(hidden)` equals the target's logits.

Why `last_hidden_state` and not `hidden_states[-1]`: in transformers 5.24
(`utils/output_capturing.capture_outputs`, `tie_last_hidden_states=True`) the last entry of
`hidden_states` is replaced by `last_hidden_state` and so is post-norm, but in transformers
4.x it was the pre-norm output of the last layer. The base model's `last_hidden_state` is
post-norm in every version, so we read that and never rely on `hidden_states[-1]`.
"""
from __future__ import annotations

import torch

from ..heads.eagle3 import check_aux_layers, default_aux_layers  # noqa: F401 (re-exported)

# lm_head rows are projected this many positions at a time for top-k (50 MB of float32 logits
# at 49k vocab; 64 at a time ran 30% slower on a 2-core CPU), so that a long
# batch never materialises the whole [B, T, V] logits tensor (49k vocab x 16k tokens = 3 GB).
_LOGIT_CHUNK = 256


def _causal_lm(target_model) -> torch.nn.Module:
    # Accept a specdec Target (has .model) or the HF *ForCausalLM itself. An HF model also
    # has a `.model` attribute (its decoder), hence the nn.Module test first.
    if isinstance(target_model, torch.nn.Module):
        return target_model
    return target_model.model


def logits_from_hidden(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The target's logits from its final post-norm hidden states, in float32.

    Applies the post-projection transforms some architectures add in `forward`
    (Gemma-2/3 final logit soft-capping, Cohere's logit scale) so top-k matches `model(...)`.
    """
    logits = model.get_output_embeddings()(hidden).float()
    cfg = model.config
    scale = getattr(cfg, "logit_scale", None)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        logits = logits * scale
    cap = getattr(cfg, "final_logit_softcapping", None)
    if cap:
        logits = cap * torch.tanh(logits / cap)
    return logits


def topk_logprobs(model: torch.nn.Module, hidden: torch.Tensor, k: int):
    """Top-k log-probabilities of the target's next-token distribution at every position.

    hidden [B, T, H] -> (values [B, T, k] in hidden's dtype, indices [B, T, k] long).
    Log-probabilities rather than raw logits: softmax over the k values is the same either
    way, and log-probs also keep how much mass lies outside the top k.
    """
    flat = hidden.reshape(-1, hidden.shape[-1])  # [B*T, H]
    values, indices = [], []
    for start in range(0, flat.shape[0], _LOGIT_CHUNK):
        logprobs = torch.log_softmax(logits_from_hidden(model, flat[start:start + _LOGIT_CHUNK]), -1)
        v, i = logprobs.topk(k, dim=-1)  # [chunk, k]
        values.append(v.to(hidden.dtype))
        indices.append(i)
    shape = (*hidden.shape[:-1], k)
    return torch.cat(values).reshape(shape), torch.cat(indices).reshape(shape)


@torch.no_grad()
def compute_features(target_model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                     hidden: bool = True, aux_layers=(), topk: int = 0) -> dict[str, torch.Tensor]:
    """Run the frozen target once and return the requested per-token features.

    input_ids [B, T], attention_mask [B, T] (1 = real token; right padding keeps the real
    positions exact for a causal model). Returns a dict with, as requested:
      hidden        [B, T, H]    final hidden state after the final norm
      aux           [B, T, A*H]  hidden_states[l] for l in aux_layers, concatenated in order
      topk_values   [B, T, k]    top-k log-probabilities of the next token
      topk_indices  [B, T, k]    their token ids (long)
    Runs under no_grad (not inference_mode) so the trainer may feed the outputs to a head
    that is being trained.
    """
    model = _causal_lm(target_model)
    aux_layers = check_aux_layers(aux_layers, model.config.num_hidden_layers)
    if not (hidden or aux_layers or topk):
        raise ValueError("compute_features: nothing requested (hidden=False, no aux_layers, topk=0)")
    # A list of indices asks transformers >= 5.24 to keep only those hidden states (less
    # memory on big targets); older versions treat any non-empty list as True and return
    # all of them, which indexes the same way.
    states_arg = list(aux_layers) if aux_layers else False
    out = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                           output_hidden_states=states_arg, use_cache=False)
    final = out.last_hidden_state  # [B, T, H], post-norm in every transformers version
    features: dict[str, torch.Tensor] = {}
    if hidden:
        features["hidden"] = final
    if aux_layers:
        states = out.hidden_states
        missing = [layer for layer in aux_layers if states[layer] is None]
        if missing:
            raise RuntimeError(f"the target returned no hidden state for aux layers {missing}")
        features["aux"] = torch.cat([states[layer] for layer in aux_layers], dim=-1)  # [B, T, A*H]
    if topk:
        features["topk_values"], features["topk_indices"] = topk_logprobs(model, final, topk)
    return features
