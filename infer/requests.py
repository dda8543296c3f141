"""Request-level types of the runtime: sampling parameters, outputs, and one request's state with
its stop rules (eos / stop token ids, max_tokens, stop strings) and incremental detokenisation."""
from __future__ import annotations

import math
import numbers
import random
import time
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """How one request is decoded (the names follow vLLM's).

    temperature 0 -> greedy (lossless w.r.t. the target's argmax); otherwise the target's
    distribution after temperature / top-k / top-p is reproduced exactly by stochastic acceptance.
    stop: strings that end the output (the text is cut before the first one); one string or a list.
    stop_token_ids: token ids that end the output (kept in it, like eos); one id or a list.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        for name in ("max_tokens", "top_k"):  # 5.5 tokens would silently become 6
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"{name} must be a whole number, got {value!r}")
        for name in ("temperature", "top_p"):  # "0.7" from a config file: say so, not "'>=' not supported"
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)):
            raise ValueError(f"seed must be a whole number or None, got {self.seed!r}")  # torch said it at generate
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0 or math.isinf(self.temperature):  # NaN fails every comparison
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        if isinstance(self.stop_token_ids, numbers.Integral):  # one id, as ``stop`` takes one string
            self.stop_token_ids = [self.stop_token_ids]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids (ints), got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RequestOutput:
    """One request's state after a step (``new_*``: what this step added) or at the end."""

    request_id: object                 # as given to add_request (any hashable)
    text: str                          # generated text so far (cut at a stop string)
    token_ids: list[int]               # generated tokens so far (eos included when hit)
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""                 # text delta since the previous output (for streaming)
    finished: bool = False
    finish_reason: str | None = None   # "stop" (eos / stop string / stop token), "length"
    prompt_token_ids: list[int] = field(default_factory=list)
    stats: dict = field(default_factory=dict)  # steps, accepted_per_step, tau, new_tokens, seconds, tokens_per_s


class IncrementalText:
    """The text of a growing token list, decoding only its last few tokens per update.

    Decoding the whole output at every step costs time that grows with the output, per sequence
    and step (SmolLM2's tokenizer: 0.025 ms a call on average over a 256-token answer, 0.005 ms
    incrementally; ~1.6 ms of a batch-32 step near the end of such answers). A window
    ``[prefix:]`` is decoded twice, without and with the new tokens; the difference is the new
    text (the window's shared start gives both the same context, so a tokenizer that drops a
    word's leading space at the start of a decode drops it from both). A tail that ends in an
    incomplete UTF-8 character is kept pending until its other bytes arrive, as vLLM's
    incremental detokenizer does. Where a decoder rewrites text before the window (the window's
    text is no prefix of the longer one), the whole list is decoded once.
    """

    CONTEXT = 6  # tokens of context kept before the read position after a full decode

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.done = ""  # text of tokens[:read]
        self.prefix = self.read = 0
        self.pending = ""  # text of tokens[read:] that ends in an incomplete character

    def _dec(self, tokens) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def update(self, tokens: list[int]) -> str:
        """The text of ``tokens`` (the list seen before, grown at its end)."""
        if len(tokens) > self.read:
            before, after = self._dec(tokens[self.prefix:self.read]), self._dec(tokens[self.prefix:])
            if not after.startswith(before):  # the decoder rewrote earlier text: decode it all
                self.done, self.pending = self._dec(tokens), ""
                self.read, self.prefix = len(tokens), max(len(tokens) - self.CONTEXT, 0)
            elif after.endswith("\ufffd"):
                self.pending = after[len(before):]
            else:
                self.done, self.pending = self.done + after[len(before):], ""
                self.prefix, self.read = self.read, len(tokens)
        return self.done + self.pending


class Request:
    """Engine-side state of one sequence. ``root`` is the pending token: sampled by the target,
    emitted, but not yet run through it (its K/V is written by the next verification)."""

    def __init__(self, request_id, prompt: list[int], params: SamplingParams, tokenizer, device):
        self.id, self.prompt, self.params, self.tokenizer = request_id, prompt, params, tokenizer
        self.slot: int | None = None
        self.prefilled = 0                 # prompt tokens whose K/V are in the cache
        self.cached = 0                    # of which copied from the prefix cache
        self.prompt_features: list[dict] = []  # per prefill chunk, until the drafter gets them
        self.feature_start = 0             # first prompt position with features (a cached prefix may lack them)
        self.unfed: list[tuple] = []       # plain steps not yet committed to the drafter (Engine._feed)
        self.kept_features: list[dict] | None = None  # with a prefix cache: every commit's features
        self.kv_len = 0                    # committed tokens in the cache
        self.root: int | None = None
        self.out: list[int] = []
        self.accepted: list[int] = []      # accepted draft tokens per decode step
        self.finished, self.finish_reason = False, None
        self.stop_at: int | None = None    # text index where a stop string begins
        self.sent_text = ""
        self.text = IncrementalText(tokenizer)
        self.t_start = self.t_end = None
        self.generator = None
        if not params.greedy:  # per-request stream: a fixed seed reproduces the output in any batch
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))

    def uniforms(self, n: int) -> torch.Tensor:
        """n uniforms [n] for one stochastic verification, drawn up front from this request's stream."""
        return torch.rand(n, generator=self.generator, device=self.generator.device)

    # ------------------------------------------------------------------ stop rules
    def append(self, new_tokens: list[int], eos_ids: set[int], reason: str | None = None) -> RequestOutput:
        """Add tokens one by one until a stop rule fires; nothing after eos is ever kept."""
        p, added = self.params, []
        if reason is not None:
            self._finish(reason)
        for tok in new_tokens:
            if self.finished:
                break
            self.out.append(tok)
            added.append(tok)
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in eos_ids):
                self._finish("stop")
            elif p.stop and self._find_stop():
                self._finish("stop")
            elif len(self.out) >= p.max_tokens:
                self._finish("length")
        text = self._visible_text()
        if text.startswith(self.sent_text):  # text only grows (one C call, not a loop over 1k chars)
            keep = len(self.sent_text)
        else:  # but be safe if a decoder rewrote its tail: resend from the first change
            keep = next((i for i, (a, b) in enumerate(zip(text, self.sent_text)) if a != b),
                        min(len(text), len(self.sent_text)))
        new_text, self.sent_text = text[keep:], text
        return RequestOutput(self.id, text, list(self.out), added, new_text, self.finished,
                             self.finish_reason, self.prompt, self.stats() if self.finished else {})

    def _finish(self, reason: str) -> None:
        self.finished, self.finish_reason, self.t_end = True, reason, time.perf_counter()

    def _decode(self) -> str:
        return self.text.update(self.out)

    def _find_stop(self) -> bool:
        text = self._decode()
        hits = [i for i in (text.find(s) for s in self.params.stop) if i >= 0]
        if hits:
            self.stop_at = min(hits)
        return bool(hits)

    def _visible_text(self) -> str:
        text = self._decode()
        if self.stop_at is not None:
            return text[:self.stop_at]
        if self.finished:
            return text
        text = text.rstrip("\ufffd")  # an incomplete UTF-8 character: wait for its other bytes
        hold = 0  # a tail that could still grow into a stop string is not shown yet
        for s in self.params.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return text[:len(text) - hold]

    def stats(self) -> dict:
        end = self.t_end or time.perf_counter()
        seconds = max(end - (self.t_start or end), 1e-9)
        steps = len(self.accepted)
        tau = sum(a + 1 for a in self.accepted) / steps if steps else 1.0
        return {"steps": steps, "accepted_per_step": list(self.accepted), "tau": tau,
                "cached_prompt_tokens": self.cached, "new_tokens": len(self.out), "seconds": seconds,
                "tokens_per_s": len(self.out) / seconds}
