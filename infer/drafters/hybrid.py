"""Hybrid drafting: a trained head's tree and retrieval candidates (PLD + REST) in one tree.

Each step every source proposes under the same TreeBudget: the head (EAGLE-3 or any head
drafter) its dynamic tree, PLD its prompt-lookup matches, REST its datastore continuations. The
candidates are merged into one trie (a token path proposed by several sources is one node) and
the best ``max_nodes`` nodes by *estimated acceptance* are kept:

  head node at depth d         its own score: the cumulative draft probability (EAGLE-2's rerank)
  retrieval node at depth d    alpha_s ** d * w, alpha_s = the source's online per-token
                               acceptance rate, w = the node's weight inside its source
                               (PLD: 1/rank of its match, REST: relative frequency)

alpha_s is learned while decoding: after each step, for every node on the committed path, each
source that proposed a child of it counts one trial, and a success if the committed token was
among its children (only nodes that made it into the proposed tree count; a Beta(2, 2)-smoothed
rate over all steps and slots). So a copy-heavy prompt
(summaries, code edits, RAG) soon ranks PLD/REST paths above the head's, and an open-ended one
leaves the budget to the head. All scores are non-increasing along paths, so the kept nodes form
a tree.

Cost: retrieval is nearly free, the head is not, so the head runs only on steps where it pays,
judged by measured tokens per second (``specdec.infer.gate.ThroughputGate``; off with
``adaptive=False``), and it drafts under the heads' default budget while retrieval may fill the
deeper lookup budget (PLD's on CPU: long copies). The merged tree is deterministic
(``draft_probs`` None): even if the head sampled its children, treating the final candidate set
as fixed is lossless under the point-mass rule.
"""
from __future__ import annotations

import torch
from torch import Tensor

from specdec.heads.base import FeatureSpec
from specdec.heads.tree import DraftTree, TreeBudget, default_budget

from specdec.infer.gate import ThroughputGate

from .pld import CPU_LOOKUP_BUDGET, NO_FEATURES, CandidateTrie, PLDDrafter, pack_trees, token_list
from .rest import RESTDrafter
from .rest import make_drafter as make_rest

CPU_MIN_SCORE = 0.05
# The head gate's regimes, by retrieval's expected accepted length (``expected_length``):
# nothing useful / a short or doubtful match / a trusted copy.
REGIME_EDGES = (0.5, 1.5)
# What `hybrid=VALUE` in a method spec means (specdec-bench): the trained head's folder.
VALUE_OPTION = "draft_head"
HEAD = "head"


class AcceptanceEstimate:
    """Per-source per-token acceptance rate, Beta(prior_hits, prior_misses)-smoothed."""

    def __init__(self, prior_hits: float = 2.0, prior_misses: float = 2.0):
        self.hits: dict[str, float] = {}
        self.trials: dict[str, float] = {}
        self.prior = (prior_hits, prior_misses)

    def rate(self, source: str) -> float:
        a, b = self.prior
        return (self.hits.get(source, 0.0) + a) / (self.trials.get(source, 0.0) + a + b)

    def update(self, source: str, hit: bool) -> None:
        self.trials[source] = self.trials.get(source, 0.0) + 1
        self.hits[source] = self.hits.get(source, 0.0) + float(hit)


class HybridDrafter:
    """Merge a head drafter (optional) with PLD and REST drafters; see the module docstring."""

    def __init__(self, head_drafter=None, pld: PLDDrafter | None = None,
                 rest: RESTDrafter | None = None, adaptive: bool = True, min_score: float | None = None,
                 head_depth: int | None = None):
        if head_drafter is None and pld is None and rest is None:
            raise ValueError("hybrid needs at least one source (a head, pld or rest)")
        if head_depth is not None and head_depth < 1:
            raise ValueError(f"hybrid head_depth must be >= 1 (or None: the device's), got {head_depth}")
        self.head, self.pld, self.rest = head_drafter, pld, rest
        self.retrieval = {name: d for name, d in (("pld", pld), ("rest", rest)) if d is not None}
        self.feature_spec: FeatureSpec = head_drafter.feature_spec if head_drafter else NO_FEATURES
        self.estimate = AcceptanceEstimate()
        self.min_score, self.head_depth = min_score, head_depth
        self.gate = ThroughputGate() if head_drafter is not None and adaptive else None
        self.head_steps = self.steps = 0  # how often the head drafted (reported by tests, bench notes)
        self.last_trie: dict[int, CandidateTrie] = {}  # slot -> the merged trie it last proposed
        self._timed: set[int] = set()  # slots of the proposal the gate is timing, until they commit

    def _all(self):
        return ([self.head] if self.head is not None else []) + list(self.retrieval.values())

    # -- protocol ----------------------------------------------------------------------------
    def default_budget(self, device) -> TreeBudget | None:
        """Retrieval's deeper lookup budget on CPU (the head keeps its own, see _head_budget)."""
        return CPU_LOOKUP_BUDGET if self.retrieval and torch.device(device).type == "cpu" else None

    def reset(self, max_batch: int, max_len: int) -> None:
        for d in self._all():
            d.reset(max_batch, max_len)
        self.last_trie.clear()

    def prefill(self, slot: int, token_ids: Tensor, features: dict[str, Tensor]) -> None:
        for d in self._all():
            d.prefill(slot, token_ids, features)
        self.last_trie.pop(slot, None)
        if self.gate is not None:
            self.gate.interrupt()
            self._timed.clear()

    def commit(self, slot: int, token_ids: Tensor, features: dict[str, Tensor]) -> None:
        committed = token_list(token_ids)
        self.learn(slot, committed)
        for d in self._all():
            d.commit(slot, token_ids, features)
        if slot in self._timed:  # the gate times propose -> verify -> commit of drafted slots only:
            self._timed.discard(slot)  # plain steps between two proposals are no arm's cost
            self.gate.add_tokens(len(committed))
            if not self._timed:
                self.gate.close()

    def release(self, slot: int) -> None:
        for d in self._all():
            d.release(slot)
        self.last_trie.pop(slot, None)

    def propose(self, slots: Tensor, roots: Tensor, budget: TreeBudget) -> DraftTree:
        slot_list, root_list = [int(s) for s in slots.tolist()], [int(r) for r in roots.tolist()]
        tries = []
        for slot, root in zip(slot_list, root_list):
            trie = CandidateTrie(root)
            for name, drafter in self.retrieval.items():
                self._add_retrieval(trie, drafter.trie(slot, root, budget, source=name), name)
            self.last_trie[slot] = trie
            tries.append(trie)
        self.steps += 1
        if self.head is not None and self._head_pays(tries, slot_list):
            self.head_steps += 1
            head_tree = self.head.propose(slots, roots, _head_budget(budget, roots.device, self.head_depth))
            for b, trie in enumerate(tries):
                self._add_head(trie, head_tree, b)
        return pack_trees(tries, budget, roots.device, self._min_score(roots.device))

    def _min_score(self, device) -> float:
        """Nodes estimated below this acceptance are left out: on CPU each verified node costs
        ~0.3-1 ms of a ~30 ms step (measured: 45.7 vs 44.0 tok/s over 13 Spec-Bench prompts
        with 0.05 vs none); on a GPU a wider tree is nearly free."""
        if self.min_score is not None:
            return self.min_score
        return CPU_MIN_SCORE if torch.device(device).type == "cpu" else 0.0

    def _head_pays(self, tries: list[CandidateTrie], slots: list[int]) -> bool:
        """The gate's call for this step, in the regime of retrieval's mean expected length."""
        if self.gate is None:
            return True
        expected = sum(expected_length(t) for t in tries) / max(len(tries), 1)
        self._timed = set(slots)
        return self.gate.choose(regime_of(expected))

    # -- merging -----------------------------------------------------------------------------
    def _add_head(self, trie: CandidateTrie, tree: DraftTree, b: int) -> None:
        """Insert the head's valid nodes root-to-leaf (parents come first in a DraftTree)."""
        tokens, parents = tree.tokens[b].tolist(), tree.parents[b].tolist()
        valid = tree.valid[b].tolist()
        if tree.scores is not None:
            scores = tree.scores[b].float().tolist()
        else:  # no confidences: the online rate per depth stands in
            depth = tree.masks()[0][b].tolist()
            scores = [self.estimate.rate(HEAD) ** d for d in depth]
        paths: dict[int, list[int]] = {0: []}
        score_paths: dict[int, list[float]] = {0: []}
        for i in range(1, len(tokens)):
            if not valid[i] or parents[i] not in paths:
                continue
            paths[i] = paths[parents[i]] + [tokens[i]]
            # Keep scores monotone along the path even if a head's scores are not.
            prev = score_paths[parents[i]][-1] if score_paths[parents[i]] else 1.0
            score_paths[i] = score_paths[parents[i]] + [min(scores[i], prev)]
            trie.add(paths[i], score_paths[i], source=HEAD)

    def _add_retrieval(self, trie: CandidateTrie, sub: CandidateTrie, name: str) -> None:
        """Re-score a retrieval source's trie by alpha ** depth * its weight and merge it."""
        alpha = self.estimate.rate(name)
        children: dict[int, list[int]] = {}
        for i in range(1, len(sub.tokens)):
            children.setdefault(sub.parents[i], []).append(i)
        stack = [(0, [], [])]
        while stack:  # every root-to-leaf path of the sub-trie
            node, path, scores = stack.pop()
            kids = children.get(node, [])
            if not kids and path:
                trie.add(path, scores, source=name)
            for k in kids:
                score = alpha ** sub.depth[k] * min(sub.scores[k], 1.0)
                stack.append((k, path + [sub.tokens[k]], scores + [score]))

    def learn(self, slot: int, committed: list[int]) -> None:
        """Update each source's acceptance rate from the committed path of the last tree."""
        trie = self.last_trie.pop(slot, None)
        if trie is None or not committed or committed[0] != trie.tokens[0]:
            return
        proposed = trie.kept if trie.kept is not None else set(range(len(trie.tokens)))
        node = 0
        for tok in committed[1:] + [None]:  # None: the path ended; its last node's children failed
            kids = [i for i in proposed if i and trie.parents[i] == node]
            proposers = set().union(*(trie.sources[i] for i in kids)) if kids else set()
            nxt = trie.child(node, tok) if tok is not None else None
            for src in proposers:
                self.estimate.update(src, nxt is not None and src in trie.sources[nxt])
            if nxt is None:
                return
            node = nxt


def regime_of(expected_len: float) -> int:
    return sum(expected_len >= edge for edge in REGIME_EDGES)


def expected_length(trie: CandidateTrie) -> float:
    """Expected accepted tokens if the trie's nodes are scored by acceptance estimates: the sum
    over depths of the best score there (capped at 1 per depth)."""
    best: dict[int, float] = {}
    for i in range(1, len(trie.tokens)):
        d = trie.depth[i]
        best[d] = max(best.get(d, 0.0), min(trie.scores[i], 1.0))
    return sum(best.values())


def _head_budget(budget: TreeBudget, device, max_depth: int | None = None) -> TreeBudget:
    """The head drafts within the heads' default budget for the device (each level costs a
    forward), however deep the merged tree may go for retrieval; ``max_depth`` caps it further."""
    cap = default_budget(device)
    depth = min(budget.max_depth, cap.max_depth, max_depth or cap.max_depth)
    return TreeBudget(min(budget.max_nodes, cap.max_nodes), depth, min(budget.topk, cap.topk))


def make_drafter(target, draft_head=None, head=None, datastore=None, use_pld: bool = True,
                 use_rest: bool = True, adaptive: bool = True, min_score: float | None = None,
                 head_depth: int | None = None, head_opts: dict | None = None, pld_opts: dict | None = None,
                 rest_opts: dict | None = None) -> HybridDrafter:
    """``hybrid`` for the drafter registry.

    draft_head (or head): a trained head folder, or an already loaded head, e.g. EAGLE-3; None
    drafts from retrieval only. datastore: REST's datastore folder (None: the default one over
    the bundled prompts). use_pld / use_rest switch the retrieval sources off. adaptive False:
    the head drafts every step (no gate). min_score: drop merged nodes estimated below it
    (None: 0.05 on CPU, 0 elsewhere). head_depth: cap the head's draft levels.
    """
    head = draft_head if draft_head is not None else head
    head_drafter = None
    if head is not None:
        from pathlib import Path

        if isinstance(head, (str, Path)):
            from specdec.infer.drafters import load_draft_head

            head = load_draft_head(head, target)
        head_drafter = head.new_drafter(target, **(head_opts or {}))
    pld = PLDDrafter(target, **(pld_opts or {})) if use_pld else None
    rest = make_rest(target, datastore=datastore, **(rest_opts or {})) if use_rest else None
    return HybridDrafter(head_drafter, pld, rest, adaptive=adaptive, min_score=min_score,
                         head_depth=head_depth)


__all__ = ["AcceptanceEstimate", "HybridDrafter", "make_drafter"]
