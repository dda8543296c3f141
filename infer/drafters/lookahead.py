"""Lookahead decoding (Fu et al., 2024, "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding"), mapped onto specdec's Drafter protocol.

The paper, in one step of the target:
  * lookahead branch: a 2-D window of W future positions x N-1 past Jacobi iterations; the target
    runs one Jacobi update on the window (every guess re-predicted from the guesses before it)
    and each diagonal of the trajectory becomes an N-gram added to a pool keyed by its first
    token;
  * verification branch: up to G pool N-grams whose first token is the last committed token,
    verified in the same forward pass.

What this drafter does instead, and why. The protocol's ``commit`` returns only the committed
tokens (root + accepted drafts), never the target's predictions at rejected nodes, so the
target's Jacobi update of the lookahead window is not observable. Therefore:
  * verification branch: as in the paper: up to G continuations of N-1 tokens from the pool
    whose key is the root (most recently seen first), merged into the tree;
  * n-gram pool: filled with the *verified* N-grams of the slot's history (the prompt when it
    is prefilled, then every committed token), not with Jacobi trajectories;
  * lookahead branch: a per-slot window of W guesses for the positions after the root, kept
    across steps. After a step that committed k tokens the window shifts by k (guesses for
    committed positions are consumed); at the next propose, guesses are refreshed by one
    Jacobi-style sweep in which the pool stands in for the target: guess i becomes the pool's
    most recent successor of guess i-1 (guess 0: of the root), and keeps its old value where
    the pool has none. The window is then proposed as one more chain of the tree, so unlike the
    paper's lookahead branch it is itself verified (a free extra candidate), and the positions
    the target rejects are exactly those the next sweep refreshes.
So this is the paper's verification branch with an exact n-gram cache, plus a Jacobi window
driven by that cache rather than by the target; on a memory-bound target it costs the same
one verification pass per step.
"""
from __future__ import annotations

from collections import OrderedDict

from torch import Tensor

from specdec.heads.tree import TreeBudget

from .pld import CandidateTrie, HistoryTrieDrafter, TokenHistory, token_list


class NGramPool:
    """first token -> up to ``guess_set`` continuations of N-1 tokens, most recent last (LRU)."""

    def __init__(self, ngram: int, guess_set: int):
        self.ngram, self.guess_set = ngram, guess_set
        self._pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, gram: tuple[int, ...]) -> None:
        entry = self._pool.setdefault(gram[0], OrderedDict())
        entry.pop(gram[1:], None)
        entry[gram[1:]] = None  # re-seen n-grams move to the most recent end
        while len(entry) > self.guess_set:
            entry.popitem(last=False)

    def add_all(self, seq: list[int], start: int) -> None:
        """Every complete N-gram of ``seq`` that ends at index >= start."""
        n = self.ngram
        for end in range(max(start, n - 1), len(seq)):
            self.add(tuple(seq[end - n + 1:end + 1]))

    def continuations(self, token: int) -> list[tuple[int, ...]]:
        """Most recent first."""
        entry = self._pool.get(int(token))
        return list(reversed(entry)) if entry else []

    def successor(self, token: int) -> int | None:
        entry = self._pool.get(int(token))
        return next(reversed(entry))[0] if entry else None


class LookaheadDrafter(HistoryTrieDrafter):
    """See the module docstring. window W, ngram N (>= 2), guess_set G. `propose` is the
    shared one (HistoryTrieDrafter); the protocol methods below also keep the n-gram pools."""

    def __init__(self, target=None, window: int = 6, ngram: int = 4, guess_set: int = 6):
        if int(ngram) < 2 or int(window) < 1 or int(guess_set) < 1:
            raise ValueError(f"lookahead needs ngram >= 2, window >= 1, guess_set >= 1; got "
                             f"N={ngram}, W={window}, G={guess_set}")
        self.window, self.ngram, self.guess_set = int(window), int(ngram), int(guess_set)
        self.history = TokenHistory()
        self.pools: dict[int, NGramPool] = {}
        self.guesses: dict[int, list[int]] = {}  # slot -> W guesses for the positions after the root

    # -- protocol ----------------------------------------------------------------------------
    def reset(self, max_batch: int, max_len: int) -> None:
        self.history.reset(max_len)
        self.pools.clear()
        self.guesses.clear()

    def prefill(self, slot: int, token_ids: Tensor, features: dict | None = None) -> None:
        ids = token_list(token_ids)
        self.history.set(slot, ids)
        self.pools[slot] = pool = NGramPool(self.ngram, self.guess_set)
        pool.add_all(ids, 0)
        # The paper seeds the window with prompt tokens; take the prompt's most recent ones.
        tail = ids[-self.window:]
        self.guesses[slot] = tail + [tail[-1] if tail else 0] * (self.window - len(tail))

    def commit(self, slot: int, token_ids: Tensor, features: dict | None = None) -> None:
        ids = token_list(token_ids)
        before = len(self.history.get(slot))
        self.history.extend(slot, ids)
        seq = self.history.get(slot)
        # N-grams ending at a new token need the N-1 tokens before it.
        lo = max(0, before - self.ngram + 1)
        pool = self.pools.setdefault(slot, NGramPool(self.ngram, self.guess_set))
        pool.add_all(seq[lo:].tolist(), before - lo)
        # The window guessed the positions after the old root: root + k-1 drafts were committed
        # and the next root fills position k, so guesses from index k on stay ahead of it.
        old = self.guesses.get(slot, [])
        kept = old[len(ids):]
        self.guesses[slot] = kept + [kept[-1] if kept else ids[-1]] * (self.window - len(kept))

    def release(self, slot: int) -> None:
        self.history.release(slot)
        self.pools.pop(slot, None)
        self.guesses.pop(slot, None)

    # -- the method --------------------------------------------------------------------------
    def jacobi_sweep(self, slot: int, root: int) -> list[int]:
        """Refresh the slot's window left to right, the pool standing in for the target."""
        pool = self.pools.get(slot)
        guesses = list(self.guesses.get(slot) or [root] * self.window)
        prev = root
        for i, old in enumerate(guesses):
            nxt = pool.successor(prev) if pool is not None else None
            guesses[i] = old if nxt is None else nxt
            prev = guesses[i]
        self.guesses[slot] = guesses
        return guesses

    def trie(self, slot: int, root: int, budget: TreeBudget, source: str = "lookahead") -> CandidateTrie:
        trie = CandidateTrie(root)
        pool = self.pools.get(slot)
        # Verification branch: pool n-grams that start at the root, most recent first.
        for rank, cont in enumerate(pool.continuations(root) if pool else []):
            trie.add(cont, 1.0 / (rank + 2), source=source, max_depth=budget.max_depth,
                     max_children=budget.topk)
        # Lookahead branch: the Jacobi window, ranked below the pool's candidates.
        window = self.jacobi_sweep(slot, root)
        trie.add(window, 1.0 / (self.guess_set + 2), source=source, max_depth=budget.max_depth,
                 max_children=budget.topk)
        return trie


def make_drafter(target=None, **opts) -> LookaheadDrafter:
    """``lookahead`` for the drafter registry; opts: window (W), ngram (N), guess_set (G)."""
    return LookaheadDrafter(target, **opts)


__all__ = ["LookaheadDrafter", "NGramPool", "make_drafter"]
