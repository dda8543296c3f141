"""Prompt lookup decoding (PLD): draft by copying what followed the current n-gram earlier.

Saxena (2023), "Prompt Lookup Decoding": the last n tokens of the sequence (prompt + output so
far, ending with the pending root) are searched for earlier in the same sequence; the tokens that
followed an earlier occurrence are the draft. n runs from ``max_ngram`` down to ``min_ngram``
(longer matches are more specific, the 1-gram is the fallback). Unlike the original, which keeps
one match, several matches (most recent first, then shorter n-grams) become a tree: shared
prefixes are merged, and the tree is cut to the TreeBudget.

This module also holds the pieces every retrieval drafter here shares (REST, lookahead,
hybrid): ``TokenHistory`` (per-slot committed tokens), ``HistoryTrieDrafter`` (the drafter
protocol over a TokenHistory) and, re-exported from specdec.heads.tree, ``CandidateTrie`` /
``pack_trees`` (candidate paths merged into one scored tree, cut to a budget, packed into a
``DraftTree``).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from specdec.heads.base import FeatureSpec
from specdec.heads.tree import CandidateTrie, DraftTree, TreeBudget, pack_trees

NO_FEATURES = FeatureSpec(hidden=False, aux_layers=(), topk_logits=0)


# ---------------------------------------------------------------------------- shared pieces


class TokenHistory:
    """Committed token ids per slot (prompt + accepted output), in growable int64 buffers."""

    def __init__(self, initial: int = 256):
        self._buf: dict[int, np.ndarray] = {}
        self._len: dict[int, int] = {}
        self._initial = initial

    def reset(self, max_len: int | None = None) -> None:
        self._buf.clear()
        self._len.clear()
        if max_len:
            self._initial = max(16, min(int(max_len), 4096))

    def set(self, slot: int, ids) -> None:
        self._buf[slot] = np.zeros(max(self._initial, 16), dtype=np.int64)
        self._len[slot] = 0
        self.extend(slot, ids)

    def extend(self, slot: int, ids) -> None:
        ids = token_list(ids)
        if slot not in self._buf:
            self.set(slot, [])
        n, buf = self._len[slot], self._buf[slot]
        if n + len(ids) > len(buf):  # amortised doubling
            grown = np.zeros(max(2 * len(buf), n + len(ids)), dtype=np.int64)
            grown[:n] = buf[:n]
            self._buf[slot] = buf = grown
        buf[n:n + len(ids)] = ids
        self._len[slot] = n + len(ids)

    def get(self, slot: int) -> np.ndarray:
        """The slot's tokens [n] (a view: do not keep it across extend)."""
        if slot not in self._buf:
            return np.zeros(0, dtype=np.int64)
        return self._buf[slot][:self._len[slot]]

    def release(self, slot: int) -> None:
        self._buf.pop(slot, None)
        self._len.pop(slot, None)


def token_list(ids) -> list[int]:
    if isinstance(ids, Tensor):
        return ids.detach().flatten().cpu().tolist()
    return [int(t) for t in ids]


class HistoryTrieDrafter:
    """The drafter protocol for methods that draft from each slot's committed tokens alone:
    subclasses set ``self.history = TokenHistory()`` and define ``trie(slot, root, budget)``."""

    feature_spec = NO_FEATURES
    history: TokenHistory

    def reset(self, max_batch: int, max_len: int) -> None:
        self.history.reset(max_len)

    def prefill(self, slot: int, token_ids: Tensor, features: dict | None = None) -> None:
        self.history.set(slot, token_ids)

    def commit(self, slot: int, token_ids: Tensor, features: dict | None = None) -> None:
        self.history.extend(slot, token_ids)

    def release(self, slot: int) -> None:
        self.history.release(slot)

    def propose(self, slots: Tensor, roots: Tensor, budget: TreeBudget) -> DraftTree:
        tries = [self.trie(int(s), int(r), budget) for s, r in zip(slots.tolist(), roots.tolist())]
        return pack_trees(tries, budget, roots.device)

    def trie(self, slot: int, root: int, budget: TreeBudget, source: str = "") -> CandidateTrie:
        """The slot's candidate continuations after ``root``, merged and scored."""
        raise NotImplementedError


# ---------------------------------------------------------------------------- PLD


def find_matches(seq: np.ndarray, max_ngram: int, min_ngram: int, length: int,
                 max_matches: int) -> list[tuple[int, list[int]]]:
    """Continuations of the n-gram that ends ``seq`` [L], found earlier in ``seq``, each with
    the n of the n-gram that found it: [(n, continuation)], best first.

    Per n (max_ngram..min_ngram), every earlier occurrence of seq[L-n:], most recent first;
    the continuation is up to ``length`` tokens after it (it may run into the suffix itself,
    which is what a repeating pattern needs). Duplicates are dropped; at most ``max_matches``.
    Example: seq = [5 6 7 8 5 6], n = 2 -> [5 6] at 0 -> (2, [7 8 5 6][:length]).
    """
    L, found, seen = len(seq), [], set()
    for n in range(min(max_ngram, L - 1), max(min_ngram, 1) - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[:L - 1], n)  # [L-n, n]
        hits = np.flatnonzero((windows == seq[L - n:]).all(axis=1))[::-1]  # most recent first
        for start in hits:
            cont = seq[start + n:start + n + length].tolist()
            key = tuple(cont)
            if cont and key not in seen:
                seen.add(key)
                found.append((n, cont))
                if len(found) >= max_matches:
                    return found
    return found


# How often a match's tokens are accepted, by the n of the n-gram that found it: measured over
# 38 Spec-Bench first turns (SmolLM2's greedy replies, bf16, every category) the first token of
# the best match is accepted 83% of the time after a 3-gram, 49% after a 2-gram, 23% after a
# 1-gram; each next token, given the previous one, 0.87-0.93 / 0.64-0.85 / 0.57-0.78; each later
# match a little less (0.77 / 0.61 / 0.54 for the 2nd-4th after a 3-gram).
MATCH_FIRST = {1: 0.22, 2: 0.45, 3: 0.8}
MATCH_CONTINUE = {1: 0.6, 2: 0.72, 3: 0.88}
MATCH_RANK_DECAY = 0.85
# On CPU a verified node costs ~1-2 ms of a ~32 ms step at 300-800 tokens of context (the first
# half-dozen together 2-3.5 ms), so a node estimated under 0.1 acceptance costs more than it adds.
# Measured by replaying PLD over those 38 replies with the verification's measured cost: 1-gram
# matches drafted 6 deep were most of the wasted nodes (8.0 -> 5.2 nodes a step, tau 2.20 -> 2.13,
# modelled decode speed +5%, summarisation and RAG +4%); on a GPU a node is nearly free (0: none cut).
CPU_MATCH_FLOOR = 0.1


def match_acceptance(n: int, rank: int, depth: int) -> float:
    """Estimated chance that token ``depth`` (1-based) of the ``rank``-th match (0-based), found
    by an n-gram of n tokens, is accepted (longer n-grams count as 3)."""
    n = max(1, min(n, 3))
    return MATCH_FIRST[n] * MATCH_RANK_DECAY ** rank * MATCH_CONTINUE[n] ** (depth - 1)


# A draft's depth while no copy is flowing; after a step accepted the whole best match, the
# next one drafts twice as deep (up to the budget's depth): on summaries and RAG, 87% of the
# steps that reached depth 5 of a 6-deep draft accepted all 6 (Spec-Bench, bf16), so a fixed
# depth cut long copies short. Measured on 16 of those questions (bf16, 2-core CPU, methods
# interleaved): tau 2.58 -> 2.71-2.74, 1.64x -> 1.71-1.73x over plain decoding (3 probes).
BASE_DRAFT_LEN = 6
CPU_LOOKUP_BUDGET = TreeBudget(max_nodes=12, max_depth=12, topk=4)


class PLDDrafter(HistoryTrieDrafter):
    """Prompt lookup over each slot's own history (see the module docstring).

    max_ngram / min_ngram: n-gram sizes tried, longest first (3..1 by default).
    max_matches: distinct continuations merged into the tree (1 = the original chain).
    draft_len: tokens per continuation while no copy flows (default: BASE_DRAFT_LEN, at most
    the budget's max_depth). A slot whose last step accepted its whole best continuation drafts
    the best one twice as long next step (up to max_depth), until a step rejects part of it.
    Scores: the i-th continuation (0-based) scores 1/(i+1) on all its nodes, so the tree keeps
    the most recent, longest-n-gram matches first when the budget is tight.
    min_score: a match stops at the first token whose estimated acceptance (``match_acceptance``:
    by the n of its n-gram, its rank and the depth) is below it; None: ``CPU_MATCH_FLOOR`` on
    CPU, 0 (nothing cut) on other devices. A flowing copy is never cut.
    """

    def __init__(self, target=None, max_ngram: int = 3, min_ngram: int = 1, max_matches: int = 4,
                 draft_len: int | None = None, min_score: float | None = None):
        if not 1 <= int(min_ngram) <= int(max_ngram):
            raise ValueError(f"pld needs 1 <= min_ngram <= max_ngram, got {min_ngram}..{max_ngram}")
        if int(max_matches) < 1 or (draft_len is not None and int(draft_len) < 1):
            raise ValueError("pld max_matches and draft_len must be >= 1")
        self.max_ngram, self.min_ngram = int(max_ngram), int(min_ngram)
        self.max_matches = int(max_matches)
        self.draft_len = None if draft_len is None else int(draft_len)
        if min_score is not None and not 0.0 <= float(min_score) <= 1.0:
            raise ValueError(f"pld min_score must be within 0..1, got {min_score}")
        self.min_score = None if min_score is None else float(min_score)
        self.history = TokenHistory()
        self.reach: dict[int, int] = {}  # slot -> the best continuation's length next step (flowing)
        self.drafted: dict[int, list[int]] = {}  # slot -> the best continuation it last proposed

    def reset(self, max_batch: int, max_len: int) -> None:
        self.reach.clear()
        self.drafted.clear()
        super().reset(max_batch, max_len)

    def prefill(self, slot: int, token_ids: Tensor, features: dict | None = None) -> None:
        self._forget(slot)
        super().prefill(slot, token_ids, features)

    def commit(self, slot: int, token_ids: Tensor, features: dict | None = None) -> None:
        ids = token_list(token_ids)  # the step's root, then the drafts it accepted
        best = self.drafted.pop(slot, None)  # None: plain steps, nothing was drafted
        if best and ids[1:1 + len(best)] == best:  # the copy flows: draft deeper
            self.reach[slot] = 2 * len(best)
        else:
            self.reach.pop(slot, None)
        self.history.extend(slot, ids)

    def release(self, slot: int) -> None:
        self._forget(slot)
        super().release(slot)

    def proposed(self, slot: int, packed: CandidateTrie) -> None:
        """A merging drafter packed this slot's draft into ``packed`` and cut it there: only the
        part of the best continuation the tree kept was proposed, and accepting that part is
        accepting the whole draft, so the copy still flows."""
        node, kept = 0, 0
        for tok in self.drafted.get(slot, []):
            node = packed.child(node, tok)
            if node is None or (packed.kept is not None and node not in packed.kept):
                break
            kept += 1
        if slot in self.drafted:
            self.drafted[slot] = self.drafted[slot][:kept]

    def flowing(self, slot: int) -> bool:
        """Whether this slot's copy flows: its last draft was accepted whole, so it drafts deeper."""
        return slot in self.reach

    def _forget(self, slot: int) -> None:
        self.reach.pop(slot, None)
        self.drafted.pop(slot, None)

    def default_budget(self, device) -> TreeBudget | None:
        """Lookup drafts cost nothing and copies run long, so on CPU a deeper tree than the heads'
        measured best (46 vs 44 tok/s at 8 nodes over 4 levels, 6 Spec-Bench prompts); elsewhere
        None: the device's default."""
        return CPU_LOOKUP_BUDGET if torch.device(device).type == "cpu" else None

    def floor(self, device) -> float:
        """A match's tokens estimated below this acceptance are not drafted (``min_score``, else
        ``CPU_MATCH_FLOOR`` on CPU and 0 elsewhere)."""
        if self.min_score is not None:
            return self.min_score
        return CPU_MATCH_FLOOR if torch.device(device).type == "cpu" else 0.0

    # -- the method --------------------------------------------------------------------------
    def candidates(self, slot: int, root: int, length: int) -> list[tuple[int, list[int]]]:
        """[(n, continuation)] after ``root`` for this slot, best first (see ``find_matches``)."""
        seq = np.append(self.history.get(slot), np.int64(root))  # [L] history + pending root
        return find_matches(seq, self.max_ngram, self.min_ngram, length, self.max_matches)

    def propose(self, slots: Tensor, roots: Tensor, budget: TreeBudget) -> DraftTree:
        floor = self.floor(roots.device)
        tries = [self.trie(int(s), int(r), budget, floor=floor) for s, r in zip(slots.tolist(), roots.tolist())]
        return pack_trees(tries, budget, roots.device)

    def trie(self, slot: int, root: int, budget: TreeBudget, source: str = "pld",
             floor: float = 0.0) -> CandidateTrie:
        """The slot's matches merged into a trie. Only the best match runs past the base length
        (while its copy flows), and each match stops where ``match_acceptance`` falls under
        ``floor``, except a flowing copy, whose tokens are accepted far more often."""
        base = min(self.draft_len or BASE_DRAFT_LEN, budget.max_depth)
        length = min(max(self.reach.get(slot, base), base), budget.max_depth)
        found = self.candidates(slot, root, length)
        flowing = slot in self.reach
        trie = CandidateTrie(root)
        best: list[int] = []
        for rank, (n, cont) in enumerate(found):
            if rank > 0:
                cont = cont[:base]
            if floor > 0 and not (rank == 0 and flowing):
                worth = 0
                while worth < len(cont) and match_acceptance(n, rank, worth + 1) >= floor:
                    worth += 1
                cont = cont[:worth]
            trie.add(cont, 1.0 / (rank + 1), source=source, max_depth=budget.max_depth,
                     max_children=budget.topk)
            if rank == 0:  # accepting what was drafted of it lets the copy flow
                best = cont
        self.drafted[slot] = best
        return trie


def make_drafter(target=None, **opts) -> PLDDrafter:
    """``pld`` for the drafter registry; opts: max_ngram, min_ngram, max_matches, draft_len, min_score."""
    return PLDDrafter(target, **opts)
