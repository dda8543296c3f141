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

import numpy as np

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
        for path, scores in ranked_paths(cont):
            trie.add(path, scores, source=source, max_depth=budget.max_depth, max_children=budget.topk)
        return trie


def ranked_paths(cont: np.ndarray) -> list[tuple[list[int], list[float]]]:
    """Distinct continuations (rows of cont [R, D], SEP-padded) with each prefix's frequency,
    most frequent first at every branching (so a per-node child limit keeps the frequent
    children). Vectorised: at ~256 continuations a step, counting in Python cost milliseconds."""
    R, D = cont.shape
    valid = cont != SEP                                              # [R, D] (SEP only at the end)
    freq = np.zeros((R, D))
    for d in range(D):  # rows sharing the prefix [:d + 1]
        _, inverse, counts = np.unique(cont[:, :d + 1], axis=0, return_inverse=True, return_counts=True)
        freq[:, d] = np.where(valid[:, d], counts[inverse.reshape(-1)] / R, 0.0)
    rows, first = np.unique(cont, axis=0, return_index=True)
    freq = freq[first]
    # lexsort: the last key is the primary one -> frequency at depth 1, then 2, ...
    order = np.lexsort([-freq[:, d] for d in reversed(range(D))])
    lengths = valid[first].sum(1)
    return [(rows[i, :lengths[i]].tolist(), freq[i, :lengths[i]].tolist()) for i in order if lengths[i]]


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
