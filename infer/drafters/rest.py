"""REST: retrieval-based speculative decoding (He et al., 2023).

Each step, the longest suffix (up to 16 tokens) of the slot's context (committed tokens + the
pending root) is looked up in a datastore's suffix array (``specdec.infer.datastore``); the
tokens that followed its occurrences are counted into a trie, and the most frequent nodes (up to
the budget's ``max_nodes``, ``max_depth`` deep, ``topk`` children per node) are the draft tree.
A node's score is its frequency among the retrieved continuations, which REST also ranks by.

Datastore: ``rest`` alone builds (once, cached under ``cache_dir()/datastores``) a datastore over
the bundled training prompts tokenised with the target's tokenizer; ``rest=DIR`` (the bench's
method spec) or ``datastore=DIR`` names one built by ``specdec-data datastore``.
"""
from __future__ import annotations

from collections import Counter

from specdec.heads.tree import TreeBudget
from specdec.infer.datastore import SEP, Datastore, DatastoreError, default_datastore

from .pld import CandidateTrie, HistoryTrieDrafter, TokenHistory

# What `rest=VALUE` in a method spec means (specdec-bench): the datastore folder.
VALUE_OPTION = "datastore"


class RESTDrafter(HistoryTrieDrafter):
    """Retrieval from a suffix-array datastore (see the module docstring).

    max_suffix: longest context suffix searched (REST uses 16); min_suffix: shortest accepted.
    max_retrieve: continuations counted per step (evenly sampled from the match range).
    """

    def __init__(self, datastore: Datastore, max_suffix: int = 16, min_suffix: int = 1,
                 max_retrieve: int = 256):
        if not 1 <= int(min_suffix) <= int(max_suffix):
            raise ValueError(f"rest needs 1 <= min_suffix <= max_suffix, got {min_suffix}..{max_suffix}")
        self.store = datastore
        self.max_suffix, self.min_suffix = int(max_suffix), int(min_suffix)
        self.max_retrieve = int(max_retrieve)
        self.history = TokenHistory()

    # -- the method --------------------------------------------------------------------------
    def trie(self, slot: int, root: int, budget: TreeBudget, source: str = "rest") -> CandidateTrie:
        """Retrieved continuations after ``root``, merged by frequency."""
        hist = self.history.get(slot)
        context = [*hist[-(self.max_suffix - 1):].tolist(), root] if self.max_suffix > 1 else [root]
        _, cont = self.store.lookup(context, self.max_suffix, self.min_suffix,
                                    depth=budget.max_depth, max_retrieve=self.max_retrieve)
        trie = CandidateTrie(root)
        if len(cont) == 0:
            return trie
        paths = []
        for row in cont.tolist():  # cut each continuation at its document's end
            path = tuple(row[:row.index(SEP)] if SEP in row else row)
            if path:
                paths.append(path)
        counts = Counter(p[:d] for p in paths for d in range(1, len(p) + 1))  # prefix -> frequency
        total = len(cont)
        # At every branching, the more frequent child first, so the per-node child limit
        # (topk) keeps the frequent children.
        ranked = sorted(set(paths), key=lambda p: ([-counts[p[:d]] for d in range(1, len(p) + 1)], p))
        for path in ranked:
            trie.add(path, [counts[path[:d + 1]] / total for d in range(len(path))], source=source,
                     max_depth=budget.max_depth, max_children=budget.topk)
        return trie


def make_drafter(target, datastore=None, **opts) -> RESTDrafter:
    """``rest`` for the drafter registry. ``datastore``: a folder, a loaded Datastore, or None
    for the default one over the bundled prompts (built and cached on first use)."""
    if datastore is None:
        store = default_datastore(target)
    elif isinstance(datastore, Datastore):
        store = datastore
    else:
        store = Datastore.load(datastore, target.tokenizer)
    return RESTDrafter(store, **opts)


__all__ = ["DatastoreError", "RESTDrafter", "make_drafter"]
