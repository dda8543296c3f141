"""Automatic prefix caching: a new prompt that starts like one prefilled before reuses its K/V.

vLLM and SGLang do this by default (block hashes, a radix tree): chat traffic repeats system
prompts, few-shot examples and whole conversations (turn 2 re-sends turn 1). Our KV cache gives
every sequence its own preallocated row, so the cache here keeps *copies*: when a prompt's
prefill ends, its K/V (and the drafter's features of its tokens, when the drafter takes any)
are copied out, and when the sequence finishes, its prompt + output replace them (the next turn
of a chat re-sends both); a later prompt with the longest common prefix of at least
``min_tokens`` gets that prefix copied into its row and is prefilled from there.

At least the prompt's last token is always prefilled: its logits pick the first output token.
Entries are evicted least recently used first, to stay under ``max_bytes``. A finished sequence
supersedes every earlier entry of the same prompt (the prompt alone, or with another reply): the
same question asked again, or a reply regenerated, would otherwise keep one copy of the prompt per
distinct reply. Under a load generator's repeated prompts those copies filled the cache (bf16
replies vary with the batch; a speculating server's more so) and LRU then evicted the entries the
next requests wanted: 128 Spec-Bench prompts, sent twice at concurrency 32 into 1 GB, found
77% (plain) and 70% (with EAGLE-3's features) of their second round's prompt tokens cached;
with one entry per prompt they all fit, and 99%.

An entry keeps the drafter's features of its prompt's last ``feature_tail`` tokens only (and, for
a finished sequence, of its reply's last ones), where the drafter reads no further back:
Medusa-like heads read the last hidden state alone, and an EAGLE drafter on a CPU catches up on a
window of recent pairs anyway. Whole, EAGLE-3's 1,728 aux values a token were 13% of an entry's
bytes next to its K/V (23 KB a token), and a drafter server cached that many fewer prompts.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np
from torch import Tensor

# Prompts are indexed by their first KEY_TOKENS tokens: a shorter common prefix is not worth a copy.
KEY_TOKENS = 16


@dataclass
class FeatureSpan:
    start: int                      # the first token position it covers
    features: dict[str, Tensor]     # the drafter's features of tokens start, start + 1, ... [m, ...]

    @property
    def end(self) -> int:
        return self.start + len(next(iter(self.features.values())))


@dataclass
class PrefixEntry:
    name: tuple                     # the prompt, as the cache's key
    tokens: np.ndarray              # [n] the same, for fast comparison
    keys: list[Tensor]              # per layer [kv_heads, n, head_dim]
    values: list[Tensor]
    spans: list[FeatureSpan]        # the drafter's features of some runs of its tokens (or none)
    nbytes: int
    prompt_len: int                 # where its prompt ends (its reply, if any, follows)

    def cached_features(self, length: int) -> tuple[int, dict[str, Tensor] | None]:
        """(first position, features up to ``length``) for the prefix ``length`` tokens long, from
        the span that reaches into it and on to its end; (``length``, None) when none does."""
        for span in self.spans:
            if span.start < length <= span.end:
                return span.start, {k: v[:length - span.start] for k, v in span.features.items()}
        return length, None


@dataclass
class PrefixHit:
    entry: PrefixEntry
    length: int  # prompt tokens whose K/V (and features) come from the entry


class PrefixCache:
    """Copies of prefilled prompts' K/V, found by longest common prefix (see the module docstring)."""

    def __init__(self, max_bytes: int, min_tokens: int = KEY_TOKENS, feature_tail: int | None = None):
        if max_bytes <= 0:
            raise ValueError(f"the prefix cache needs max_bytes > 0, got {max_bytes}")
        if feature_tail is not None and feature_tail < 1:
            raise ValueError(f"feature_tail must be >= 1 or None (every token's), got {feature_tail}")
        self.max_bytes, self.min_tokens = int(max_bytes), max(int(min_tokens), KEY_TOKENS)
        self.feature_tail = feature_tail
        self.entries: OrderedDict[tuple, PrefixEntry] = OrderedDict()  # the whole prompt -> entry, LRU order
        self.by_key: dict[tuple, list[tuple]] = {}  # first KEY_TOKENS tokens -> prompts
        self.nbytes = 0
        self.hits = self.hit_tokens = self.lookups = 0

    def lookup(self, prompt: list[int]) -> PrefixHit | None:
        """The entry sharing the longest prefix with ``prompt`` (at most all but its last token)."""
        self.lookups += 1
        if len(prompt) <= self.min_tokens:
            return None
        tokens = np.asarray(prompt, dtype=np.int64)
        best: PrefixHit | None = None
        for entry in self._candidates(prompt):
            common = _common_prefix(entry, tokens, min(len(entry.tokens), len(prompt) - 1))
            if common >= self.min_tokens and (best is None or common > best.length):
                best = PrefixHit(entry, common)
        if best is not None:
            self.entries.move_to_end(best.entry.name)
            self.hits += 1
            self.hit_tokens += best.length
        return best

    def store(self, prompt: list[int], kv: Callable[[], tuple[list[Tensor], list[Tensor]]],
              features: dict[str, Tensor] | None = None, reply_from: int | None = None) -> bool:
        """Keep a prefilled prompt with the K/V ``kv()`` returns (per layer [kv_heads, n, head_dim],
        copies the caller will not touch again; called only when the prompt is kept) and the
        features of its last tokens ({name: [m, ...]}, m <= n). A finished sequence (prompt +
        reply) gives ``reply_from``, where its reply starts: the same first turn sent again
        matches up to there, the next turn past its end, and ``feature_tail`` features are kept
        before each (``_spans``). -> False
        when an entry already holds the whole prompt (that entry counts as used), when it is too
        short, or larger than the cache."""
        if len(prompt) <= self.min_tokens:
            return False
        tokens = np.asarray(prompt, dtype=np.int64)
        prompt_len = len(prompt) if reply_from is None else reply_from
        superseded = []  # the same prompt alone or with another reply (see the module docstring)
        for entry in self._candidates(prompt):
            if len(entry.tokens) >= len(tokens) and _common_prefix(entry, tokens, len(tokens)) == len(tokens):
                self.entries.move_to_end(entry.name)
                return False
            if entry.prompt_len == prompt_len and _common_prefix(entry, tokens, prompt_len) == prompt_len:
                superseded.append(entry.name)
        keys, values = kv()
        spans = self._spans(len(prompt), features, prompt_len)
        nbytes = sum(t.numel() * t.element_size() for t in
                     [*keys, *values, *(v for span in spans for v in span.features.values())])
        if nbytes > self.max_bytes:
            return False
        for name in superseded:
            self._remove(name)
        while self.nbytes + nbytes > self.max_bytes:
            self._evict()
        name = tuple(prompt)
        self.entries[name] = PrefixEntry(name, tokens, keys, values, spans, nbytes, prompt_len)
        self.by_key.setdefault(name[:KEY_TOKENS], []).append(name)
        self.nbytes += nbytes
        return True

    def _spans(self, n: int, features: dict[str, Tensor] | None, prompt_end: int) -> list[FeatureSpan]:
        """What an entry of n tokens keeps of ``features`` (those of its last tokens): with a
        ``feature_tail``, the last that many before where the prompt ended and, for a finished
        sequence, before its end (one span where they meet)."""
        if not features:
            return []
        first = n - len(next(iter(features.values())))  # the features' first position
        tail = self.feature_tail
        if tail is None:
            return [FeatureSpan(first, features)]
        if n - tail <= prompt_end:  # the two tails meet (or there is no reply): one run
            runs = [(prompt_end - tail, n)]
        else:
            runs = [(prompt_end - tail, prompt_end), (n - tail, n)]
        runs = [(max(lo, first), end) for lo, end in runs]
        # copies: a view would keep the whole tensor alive
        return [FeatureSpan(lo, {k: v[lo - first:end - first].clone() for k, v in features.items()})
                for lo, end in runs if lo < end]

    def _candidates(self, prompt: list[int]) -> list[PrefixEntry]:
        """The entries starting with the same KEY_TOKENS tokens as ``prompt``."""
        return [self.entries[name] for name in self.by_key.get(tuple(prompt[:KEY_TOKENS]), [])]

    def _evict(self) -> None:
        self._remove(next(iter(self.entries)))

    def _remove(self, name: tuple) -> None:
        entry = self.entries.pop(name)
        self.nbytes -= entry.nbytes
        siblings = self.by_key[name[:KEY_TOKENS]]
        siblings.remove(name)
        if not siblings:
            del self.by_key[name[:KEY_TOKENS]]

    def __len__(self) -> int:
        return len(self.entries)


def _common_prefix(entry: PrefixEntry, tokens: np.ndarray, n: int) -> int:
    """How many of the first ``n`` tokens ``entry`` shares with ``tokens``."""
    differ = np.flatnonzero(entry.tokens[:n] != tokens[:n])
    return int(differ[0]) if len(differ) else n
