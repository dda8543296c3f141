"""Verification kernels: each has a Triton kernel (`*_triton`) and a plain-PyTorch reference
(`*_reference`, the specification) beside it; the public function dispatches between them
(SPECDEC_KERNELS=triton|reference|auto; auto = Triton on CUDA tensors, otherwise the reference
or, for greedy_accept and compact_kv, its `*_host` twin on CPU tensors: the same algorithm over
Python lists, without the reference's per-op overhead on small trees).

  greedy_accept(tokens, parents, valid, target_argmax)            -> Accepted(n_accepted, path, bonus)
  stochastic_accept(tokens, parents, valid, target_probs, draft_probs, uniforms) -> Accepted
  compact_kv(cache_k, cache_v, slots, base_lens, path)            -> None (in place)
"""
from specdec.infer.kernels.common import KERNELS_ENV, Accepted, resolve_impl
from specdec.infer.kernels.compact_kv import compact_kv, compact_kv_host, compact_kv_reference, compact_kv_triton
from specdec.infer.kernels.greedy_accept import (greedy_accept, greedy_accept_host, greedy_accept_reference,
                                                 greedy_accept_triton)
from specdec.infer.kernels.stochastic_accept import (draw_uniforms, stochastic_accept,
                                                     stochastic_accept_reference, stochastic_accept_triton)

__all__ = [
    "KERNELS_ENV", "Accepted", "resolve_impl", "draw_uniforms",
    "greedy_accept", "greedy_accept_host", "greedy_accept_reference", "greedy_accept_triton",
    "stochastic_accept", "stochastic_accept_reference", "stochastic_accept_triton",
    "compact_kv", "compact_kv_host", "compact_kv_reference", "compact_kv_triton",
]
