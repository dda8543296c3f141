"""Hybrid drafting: a trained head's tree and retrieval candidates (PLD + REST) in one tree.

Each step every source proposes under the same TreeBudget: the head (EAGLE-3 or any head
drafter) its dynamic tree, PLD its prompt-lookup matches, REST its datastore continuations. The
candidates are merged into one trie (a token path proposed by several sources is one node) and
the best ``max_nodes`` nodes by *estimated acceptance* are kept:

  head node at depth d         its own score: the cumulative draft probability (EAGLE-2's rerank)
  retrieval node at depth d    alpha_s ** d * w, alpha_s = the source's online per-token
                               acceptance rate, w = the node's weight inside its source
                               (PLD: 1/rank of its match, REST: relative frequency);
                               PLD's flowing copies (drafted deeper after a fully accepted
                               step) count as a source of their own, with their own alpha

alpha_s is learned while decoding: after each step, for every node on the committed path, each
source that proposed a child of it counts one trial, and a success if the committed token was
among its children (only nodes the merged cut kept count, see below; a Beta(2, 2)-smoothed
rate over all steps and slots). So a copy-heavy prompt
(summaries, code edits, RAG) soon ranks PLD/REST paths above the head's, and an open-ended one
leaves the budget to the head. All scores are non-increasing along paths, so the kept nodes form
a tree. A row for which PLD alone drafted (the gates skipped the head and REST) verifies PLD's own
tree, uncut: those scores only weigh sources against each other (its rates still learn from the cut).

Cost: PLD is nearly free, the head and REST are not (on the 2-core CPU the head ~10 ms a step,
a REST lookup ~2.5 ms, each verified node ~0.5-1 ms, next to a ~30-40 ms verification), so each
of those two drafts only where it pays (``SourceGate``; off with ``adaptive=False``): per regime
of how much PLD already offers, paired samples from the steps the source drafted compare
tokens/s with it against what the other sources alone would have given on the same step; and
neither is asked while PLD offers a trusted copy (``TRUSTED_COPY``). The
head drafts under the heads' default budget while retrieval may fill the deeper lookup budget
(PLD's on CPU: long copies). The merged tree is deterministic
(``draft_probs`` None): even if the head sampled its children, treating the final candidate set
as fixed is lossless under the point-mass rule.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from specdec.heads.base import FeatureSpec
from specdec.heads.tree import DraftTree, TreeBudget, default_budget, pack_nodes

from .pld import BASE_DRAFT_LEN, CPU_LOOKUP_BUDGET, NO_FEATURES, CandidateTrie, PLDDrafter, token_list
from .rest import RESTDrafter
from .rest import make_drafter as make_rest

# Nodes estimated below this acceptance are left out on CPU. Not priced online (p > one node's
# seconds x tokens/s): that cut copies short, because alpha ** depth underestimates how a copy
# that has run d tokens goes on (Spec-Bench extraction, same answers: tau 3.80 vs PLD's 5.08;
# 26 questions: 2.04x vs PLD's 2.06x, runs/bench-s14-priced).
CPU_MIN_SCORE = 0.05
# What verifying one more tree node costs on the 2-core CPU in bf16 (24 -> 29 ms from 1 to 12
# nodes at a 100-token context, 26 -> 37 ms at 1,000; float32 ~2-3 ms): charged to a gated
# source for the nodes only it proposed, until ``NodeCost`` has measured it on the running machine.
CPU_NODE_SECONDS = 0.0005
# The head gate's regimes, by retrieval's expected accepted length (``expected_length``):
# nothing useful / a short or doubtful match / a trusted copy.
REGIME_EDGES = (0.5, 1.5)
# In a trusted copy neither the head nor REST is asked: there the head's paired samples said
# 116 vs 143 tok/s without it (Spec-Bench extraction + RAG, bf16), and its gate's exploration
# runs, each catching up on the tokens it skipped (~7 ms for 100), cost 1.2 ms a step for nothing.
TRUSTED_COPY = len(REGIME_EDGES)
# What `hybrid=VALUE` in a method spec means (specdec-bench): the trained head's folder.
VALUE_OPTION = "draft_head"
HEAD = "head"
FLOWING = "pld-flowing"  # PLD's nodes while its copy flows (PLDDrafter.flowing)


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


class SourceGate:
    """Does a costly source (the head, REST) pay in a regime? Decided from *paired* samples, one
    per step the source drafts: the tokens the step committed against the tokens the other
    sources' nodes would have committed (the accepted path's prefix they proposed too), and the
    step's time against that time less the source's drafting and the verification of the nodes
    only it proposed. Both halves of a pair share the prompt and the context, so a few dozen
    pairs decide where unpaired rates (accepted lengths vary from 1 to 7 from step to step)
    need hundreds.

    While the source loses in a regime it still drafts ``run`` steps every ``explore`` decisions
    there; the first step of such a run is not sampled (the head catches up on the tokens it
    skipped, which is not its steady cost).
    """

    def __init__(self, decay: float = 0.95, min_samples: int = 4, explore: int = 24, run: int = 2,
                 node_seconds: float = CPU_NODE_SECONDS, clock=time.perf_counter):
        self.decay, self.min_samples, self.explore, self.run = decay, min_samples, explore, run
        self.node_seconds, self.clock = node_seconds, clock
        self.sums: dict[int, np.ndarray] = {}  # regime -> decayed [tokens on, tokens off, s on, s off, n]
        self.decisions: dict[int, int] = {}
        self._ran_last = False  # did the head draft on the previous step (steady state)?

    def pays(self, regime: int) -> bool:
        n = self.decisions[regime] = self.decisions.get(regime, 0) + 1
        on, off = self.rates(regime)
        if on is None or on >= off:
            return True
        return n % self.explore >= self.explore - self.run

    def rates(self, regime: int) -> tuple[float | None, float | None]:
        """(tokens/s with the head, tokens/s without) in a regime; None before min_samples."""
        s = self.sums.get(regime)
        if s is None or s[4] < self.min_samples - 1e-9:
            return None, None
        return s[0] / s[2], s[1] / s[3]

    def record(self, regime: int, ran: bool, tokens_on: int, tokens_off: int, seconds: float,
               source_seconds: float, only_nodes: int) -> None:
        """One step's pair (ran: the source drafted this step; otherwise nothing is learnt)."""
        steady, self._ran_last = self._ran_last, ran
        if not ran or not steady or seconds <= 0:
            return
        off_seconds = max(seconds - source_seconds - only_nodes * self.node_seconds, 1e-6)
        s = self.sums.setdefault(regime, np.zeros(5))
        s *= self.decay
        s += (tokens_on, tokens_off, seconds, off_seconds, 1.0)


class NodeCost:
    """Seconds one more verified node adds to a step, measured online: the decayed least-squares
    slope of the steps' verification time (step time less drafting) over their verified nodes.
    ``prior`` until the steps seen differ enough in size to fit a slope."""

    def __init__(self, prior: float = CPU_NODE_SECONDS, decay: float = 0.98, min_steps: int = 8,
                 min_variance: float = 2.0):
        self.prior, self.decay, self.min_steps, self.min_variance = prior, decay, min_steps, min_variance
        self.sums = np.zeros(5)  # decayed [steps, sum n, sum t, sum n^2, sum n*t]

    def add(self, nodes: int, seconds: float) -> None:
        self.sums *= self.decay
        self.sums += (1.0, nodes, seconds, nodes * nodes, nodes * seconds)

    @property
    def seconds(self) -> float:
        k, n, t, nn, nt = self.sums
        if k < self.min_steps:
            return self.prior
        variance = nn / k - (n / k) ** 2
        if variance < self.min_variance:
            return self.prior
        return max((nt / k - (n / k) * (t / k)) / variance, 0.0)


@dataclass
class _TimedStep:
    """The step the gates are pairing, from ``propose`` until all its slots commit; per gated
    source: did it draft, its drafting time, what the step would have committed without it,
    the verified nodes only it proposed."""

    regime: int
    slots: set[int]
    start: float
    tokens_on: int = 0  # committed
    nodes: int = 0  # verified, roots included
    seconds: dict[str, float] = field(default_factory=dict)  # only sources that drafted
    tokens_off: dict[str, int] = field(default_factory=dict)
    only_nodes: dict[str, int] = field(default_factory=dict)


class HybridDrafter:
    """Merge a head drafter (optional) with PLD and REST drafters; see the module docstring."""

    def __init__(self, head_drafter=None, pld: PLDDrafter | None = None,
                 rest: RESTDrafter | None = None, adaptive: bool = True, min_score: float | None = None,
                 head_depth: int | None = None, clock=time.perf_counter):
        if head_drafter is None and pld is None and rest is None:
            raise ValueError("hybrid needs at least one source (a head, pld or rest)")
        if head_depth is not None and head_depth < 1:
            raise ValueError(f"hybrid head_depth must be >= 1 (or None: the device's), got {head_depth}")
        self.head, self.pld, self.rest = head_drafter, pld, rest
        self.retrieval = {name: d for name, d in (("pld", pld), ("rest", rest)) if d is not None}
        self.feature_spec: FeatureSpec = head_drafter.feature_spec if head_drafter else NO_FEATURES
        self.feature_tail = getattr(head_drafter, "feature_tail", None)  # the prefix cache's cut
        self.estimate = AcceptanceEstimate()
        self.min_score, self.head_depth = min_score, head_depth
        self.clock = clock
        costly = [name for name, d in ((HEAD, head_drafter), ("rest", rest)) if d is not None]
        self.gates = {name: SourceGate(clock=clock) for name in costly} if adaptive else {}
        self.node_cost = NodeCost()
        self.head_steps = self.rest_steps = self.steps = 0  # how often each drafted (tests, bench notes)
        self.last_trie: dict[int, CandidateTrie] = {}  # slot -> the merged trie it last cut (rates learn from it)
        self.last_nodes: dict[int, int] = {}  # slot -> nodes it last verified, root included
        self._step: _TimedStep | None = None

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
        self.last_nodes.clear()

    def prefill(self, slot: int, token_ids: Tensor, features: dict[str, Tensor]) -> None:
        for d in self._all():
            d.prefill(slot, token_ids, features)
        self.last_trie.pop(slot, None)
        self.last_nodes.pop(slot, None)
        self._step = None

    def commit(self, slot: int, token_ids: Tensor, features: dict[str, Tensor]) -> None:
        committed = token_list(token_ids)
        trie = self.last_trie.get(slot)
        without = self.learn(slot, committed)
        for d in self._all():
            d.commit(slot, token_ids, features)
        step = self._step
        if step is not None and slot in step.slots:  # the gates' pair: propose -> verify -> commit
            step.slots.discard(slot)
            step.tokens_on += len(committed)
            step.nodes += self.last_nodes.pop(slot, 1)
            for name in self.gates:
                step.tokens_off[name] = step.tokens_off.get(name, 0) + 1 + without.get(name, 0)
                if name in step.seconds:
                    step.only_nodes[name] = step.only_nodes.get(name, 0) + _only_nodes(trie, name)
            if not step.slots:
                self._step = None
                seconds = self.clock() - step.start
                self.node_cost.add(step.nodes, seconds - sum(step.seconds.values()))
                for name, gate in self.gates.items():
                    gate.node_seconds = self.node_cost.seconds
                    gate.record(step.regime, name in step.seconds, step.tokens_on, step.tokens_off[name],
                                seconds, step.seconds.get(name, 0.0), step.only_nodes.get(name, 0))

    def release(self, slot: int) -> None:
        for d in self._all():
            d.release(slot)
        self.last_trie.pop(slot, None)
        self.last_nodes.pop(slot, None)

    def propose(self, slots: Tensor, roots: Tensor, budget: TreeBudget) -> DraftTree:
        slot_list, root_list = [int(s) for s in slots.tolist()], [int(r) for r in roots.tolist()]
        tries = [CandidateTrie(root) for root in root_list]
        lookups = [None] * len(tries)  # PLD's own trie per row, as PLD alone would rank it
        if self.pld is not None:
            floor = self.pld.floor(roots.device)
            for b, (slot, root, trie) in enumerate(zip(slot_list, root_list, tries)):
                # a flowing copy (PLD drafts it deeper) is its own source: its tokens are
                # accepted far more often than PLD's guesses, and alpha ** depth must say so
                name = FLOWING if self.pld.flowing(slot) else "pld"
                lookups[b] = self.pld.trie(slot, root, budget, source=name, floor=floor)
                self._add_retrieval(trie, lookups[b], name)
        offered = [expected_length(t) for t in tries]  # what PLD offers each row
        regime = regime_of(sum(offered) / max(len(offered), 1))  # the gates' regime: the batch mean
        self._step = _TimedStep(regime, set(slot_list), self.clock()) if self.gates else None
        self.steps += 1
        # A trusted copy from the prompt: the datastore would add nodes, not tokens.
        wants_rest = [regime_of(offer) < TRUSTED_COPY for offer in offered]
        merged = [False] * len(tries)  # rows where REST or the head proposed too
        if self.rest is not None and any(wants_rest) and self._pays("rest", regime):
            merged = wants_rest
            start = self.clock()
            shallow = TreeBudget(budget.max_nodes, min(budget.max_depth, BASE_DRAFT_LEN), budget.topk)
            for slot, root, trie, wants in zip(slot_list, root_list, tries, wants_rest):
                if wants:
                    self._add_retrieval(trie, self.rest.trie(slot, root, shallow, source="rest"), "rest")
            self._drafted("rest", start)
        if self.head is not None and regime < TRUSTED_COPY and self._pays(HEAD, regime):
            start = self.clock()
            head_tree = self.head.propose(slots, roots, _head_budget(budget, roots.device, self.head_depth))
            for b, trie in enumerate(tries):
                self._add_head(trie, head_tree, b)
            self._drafted(HEAD, start)
            merged = [True] * len(tries)
        # A row only PLD drafted for verifies PLD's own tree: its best match first, as deep as
        # PLD alone drafts it. alpha ** depth and the score floor exist to weigh sources against
        # each other; alone they cut long copies short and spread the budget over other matches
        # (Spec-Bench RAG first turns, 8 questions, bf16: the head was asked 55 of 385 steps and
        # tau was 2.43 against PLD's 2.91). The rates still learn from the merged cut (``kept``):
        # learnt from PLD's deeper chains they rise, and the head, asked by what PLD offers at
        # those rates, would be asked less where it pays (26 Spec-Bench questions: tau 3.02 -> 2.73).
        floor = self._min_score(roots.device)
        picked = [t.select(budget.max_nodes, floor) for t in tries]
        verified = [(t, p) if m or lookup is None else (lookup, lookup.select(budget.max_nodes))
                    for t, p, m, lookup in zip(tries, picked, merged, lookups)]
        self.last_trie.update(zip(slot_list, tries))
        self.last_nodes.update((slot, len(p)) for slot, (_, p) in zip(slot_list, verified))
        tree = pack_nodes([t for t, _ in verified], [p for _, p in verified], roots.device)
        if self.pld is not None:  # PLD's copy flows on what survived the cut, not on what it drafted
            for slot, (trie, _) in zip(slot_list, verified):
                self.pld.proposed(slot, trie)
        return tree

    def _pays(self, source: str, regime: int) -> bool:
        gate = self.gates.get(source)
        return gate is None or gate.pays(regime)

    def _drafted(self, source: str, start: float) -> None:
        """Count a source's drafting and time it for its gate."""
        if source == HEAD:
            self.head_steps += 1
        else:
            self.rest_steps += 1
        if self._step is not None:
            self._step.seconds[source] = self.clock() - start

    def _min_score(self, device) -> float:
        """Nodes estimated below this acceptance are left out: on CPU each verified node costs
        ~0.5-1.5 ms of a ~30-40 ms step (measured: 45.7 vs 44.0 tok/s over 13 Spec-Bench prompts
        with 0.05 vs none); on a GPU a wider tree is nearly free."""
        if self.min_score is not None:
            return self.min_score
        return CPU_MIN_SCORE if torch.device(device).type == "cpu" else 0.0

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

    def learn(self, slot: int, committed: list[int]) -> dict[str, int]:
        """Update each source's acceptance rate from the committed path of the last tree.
        -> per gated source, how many of the accepted drafts the other sources had proposed too,
        from the root on (what the step would have accepted without that source)."""
        trie = self.last_trie.pop(slot, None)
        if trie is None or not committed or committed[0] != trie.tokens[0]:
            return {}
        proposed = trie.kept if trie.kept is not None else set(range(len(trie.tokens)))
        node, without = 0, dict.fromkeys(self.gates, 0)
        others_path = dict.fromkeys(self.gates, True)  # the path so far had other proposers
        for tok in committed[1:] + [None]:  # None: the path ended; its last node's children failed
            kids = [i for i in proposed if i and trie.parents[i] == node]
            proposers = set().union(*(trie.sources[i] for i in kids)) if kids else set()
            nxt = trie.child(node, tok) if tok is not None else None
            for src in proposers:
                self.estimate.update(src, nxt is not None and src in trie.sources[nxt])
            if nxt is None:
                return without
            for name in without:
                others_path[name] = others_path[name] and bool(trie.sources[nxt] - {name})
                without[name] += others_path[name]
            node = nxt
        return without


def _only_nodes(trie: CandidateTrie | None, source: str) -> int:
    """Verified nodes that only ``source`` proposed."""
    if trie is None:
        return 0
    kept = trie.kept if trie.kept is not None else range(1, len(trie.tokens))
    return sum(1 for i in kept if i and trie.sources[i] == {source})


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
    the head and REST draft every step (no gates) outside a trusted copy. min_score: drop merged
    nodes estimated below it (None: 0.05 on CPU, 0 elsewhere).
    head_depth: cap the head's draft levels.
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
