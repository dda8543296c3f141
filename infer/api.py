"""Offline generation in the spirit of vLLM's ``LLM``.

    from specdec.infer.api import LLM, SamplingParams
    llm = LLM(target="smollm2-135m", method="eagle3", head="runs/.../final")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=64), chat=True)[0]
    out.text, out.token_ids, out.stats["tau"], out.stats["tokens_per_s"]
"""
from __future__ import annotations

import numbers
from typing import Callable, Sequence

import torch

from specdec.infer.cache import CacheFullError
from specdec.infer.requests import RequestOutput, SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def _preview(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class LLM:
    """A target, an optional drafter (``method`` + ``head``) and an engine around them.

    ``target``: a name or folder for ``load_target`` or an already loaded ``Target``.
    ``method`` None: the head's own (``eagle3`` for an EAGLE-3 head folder), ``plain`` without one;
    a ``head`` that is no head folder (a typo, a config without a head type) is reported as such.
    ``drafter_opts`` go to the drafter's factory (e.g. a head drafter's tree options).
    ``dtype`` None: an already loaded target runs in its own dtype, a name loads in float32;
    ``auto``: bfloat16 where the device decodes faster in it (``dtypes.fast_bf16_decoding``), else float32.
    ``device`` ``auto``: a loaded target's own device, else cuda where a GPU is visible, else cpu.
    ``prefix_cache_mb`` > 0: prompts sharing a prefix with earlier ones reuse its K/V (off by default).
    """

    def __init__(self, target="smollm2-135m", method: str | None = None, head=None, dtype: str | None = None,
                 max_batch: int = 8, max_len: int | None = None, device: str = "auto",
                 prefill_chunk: int | None = None, prefix_cache_mb: float = 0, **drafter_opts):
        from specdec.infer.drafters import default_method, make_drafter
        from specdec.infer.dtypes import dtype_name
        from specdec.infer.engine import Engine
        from specdec.infer.target import Target, load_target, resolve_device

        if device == "auto" and isinstance(target, Target):  # a loaded target runs where it already is
            device = str(target.model.device)
        device = resolve_device(device)
        if dtype is not None:
            dtype = dtype_name(dtype, device, decoding=True)  # one concrete dtype for the target and the engine
        if not isinstance(target, Target):
            target = load_target(target, dtype=dtype or "float32", device=device)
        if method is None:  # a head drafts with its own method (a folder: its config's head type)
            method = default_method(head)
        self.target = target
        self.method = method
        self.drafter = make_drafter(method, self.target, head=head, **drafter_opts)
        self.engine = Engine(self.target, self.drafter, max_batch=max_batch, max_len=max_len, dtype=dtype,
                             device=device, prefill_chunk=prefill_chunk,
                             prefix_cache_bytes=int(prefix_cache_mb * 2**20))
        self._next_id = 0

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def encode(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Token ids of a prompt; ``chat`` wraps a string as one user turn of the chat template."""
        if not isinstance(prompt, str):
            if torch.is_tensor(prompt):
                prompt = prompt.tolist()
            if not isinstance(prompt, Sequence) or not all(
                    isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
                raise TypeError(f"a prompt is a string or a list of token ids (ints), got {_preview(prompt)}")
            return [int(t) for t in prompt]
        tok = self.tokenizer
        if not chat:
            return tok(prompt)["input_ids"]
        if not self.target.chat_template:
            raise ValueError(f"target {self.target.name!r} has no chat template; use chat=False")
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 chat: bool = False, budget=None,
                 on_output: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (continuous batching up to ``max_batch``); outputs in prompt
        order. ``prompts``: a string, a list of token ids (or a 1-D tensor), or a list of those;
        ``params``: one SamplingParams for all or a list with one per prompt. A prompt that is
        empty, too long for ``max_len`` or not token ids raises before anything runs, naming its
        index. ``on_output`` sees every per-step delta (streaming); ``budget``: one ``TreeBudget``
        for every request's draft trees (None: the drafter's default)."""
        if torch.is_tensor(prompts):  # 1-D: one prompt's ids, 2-D: one row per prompt
            prompts = prompts.tolist()
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and len(prompts)
                                        and isinstance(prompts[0], numbers.Number)):
            prompts = [prompts]
        if not isinstance(prompts, Sequence):
            raise TypeError("prompts: a string, a list of token ids, or a list of those; "
                            f"got {type(prompts).__name__}")
        from specdec.heads.tree import TreeBudget

        if budget is not None and not isinstance(budget, TreeBudget):  # the ids a step's dict takes are ours
            raise TypeError(f"budget: a TreeBudget for every prompt's draft trees, or None; got {type(budget).__name__}")
        for sp in (params if isinstance(params, (list, tuple)) else [params]):
            if sp is not None and not isinstance(sp, SamplingParams):
                raise TypeError(f"params: a SamplingParams or a list of them, got {type(sp).__name__}")
        params = params or SamplingParams()
        per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        ids: list[str] = []
        final: dict[str, RequestOutput] = {}
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, per_prompt)):
                rid = f"gen-{self._next_id}"
                self._next_id += 1
                try:
                    self.engine.add_request(rid, self.encode(prompt, chat), sp)
                except (TypeError, ValueError, CacheFullError) as e:  # name the prompt, not our request id
                    raise type(e)(f"prompt {i}: " + str(e).replace(f"request {rid!r}: ", "")) from None
                ids.append(rid)
            while any(rid not in final for rid in ids):
                for out in self.engine.step(budget):
                    if on_output is not None:
                        on_output(out)
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:  # a rejected prompt, an error, Ctrl-C: the next call starts clean
            for rid in ids:
                if rid not in final:
                    self.engine.abort(rid)
            raise
        return [final[rid] for rid in ids]
