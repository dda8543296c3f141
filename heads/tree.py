"""Draft trees as data: the budget, the flat tree, and the utilities derived from `parents`.

A tree is a batch of flat node lists; node 0 is the root (the pending token, already known),
every other node is a draft token whose parent has a smaller index, so the node order is a
topological order and one left-to-right pass can compute anything that flows root -> leaves.

Three ways to build one:
  * `static_tree(choices)`: a fixed shape given as Medusa-style choice paths; a drafter fills its
    tokens from per-depth top-k lists (`StaticTree.fill`).
  * `expand_dynamic_tree(step, roots, budget)`: EAGLE-2's expansion + rerank, driven by any
    drafter's `step(frontier) -> log_probs` callback.
  * `CandidateTrie` + `pack_trees` / `tree_from_paths`: whole candidate paths merged on their
    shared prefixes (retrieval drafters by best score, MLPSpeculator / ReDrafter in path order).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class TreeBudget:
    """How big a draft tree may be.

    max_nodes  draft nodes, excluding the root (0 = plain decoding; `propose` is not called)
    max_depth  deepest draft level (the root is depth 0)
    topk       children tried per expanded node (and nodes expanded per level, EAGLE-2)
    """

    max_nodes: int
    max_depth: int
    topk: int

    def __post_init__(self):
        if self.max_nodes < 0 or self.max_depth < 0 or self.topk < 0:
            raise ValueError(f"TreeBudget fields must be >= 0, got {self}")
        if self.max_nodes > 0 and (self.max_depth < 1 or self.topk < 1):
            raise ValueError(f"a non-empty TreeBudget needs max_depth >= 1 and topk >= 1, got {self}")


# Measured on the 2-core AVX512-BF16 CPU (SmolLM2-135M, bf16, 600 keys of context): since one
# token decodes in ~10.5 ms (specdec's bf16 linear kernel, session 34), each verified token costs
# more in proportion: 4-6 tokens ~12 ms, 9 ~15-16.5 ms, 13 ~18-20 ms (the linear kernel takes 6
# rows a tile; attention grows ~0.35 ms a token). EAGLE-3 from its recipe, methods interleaved
# over 3 x 13 Spec-Bench questions: 8 nodes over 4 levels 0.86-0.92x plain decoding, 4 nodes
# (top-3) 1.00-1.05x at tau 1.51-1.54 against 1.60, alike over 2, 3 or 4 levels (a level is drafted
# only while the frontier holds enough mass; session 35). On a GPU verification of ~64 tokens is
# nearly free, so trees can be EAGLE-2's size.
CPU_TREE_BUDGET = TreeBudget(max_nodes=4, max_depth=4, topk=3)
GPU_TREE_BUDGET = TreeBudget(max_nodes=60, max_depth=7, topk=10)
# A CPU without native bf16 (AVX2 only, e.g. AMD Zen 3) pays for every token verified: the
# projections of 8 rows cost ~1.9x one row's, in fp32 and in specdec's bf16 kernel alike, so a
# short chain pays where a tree does not. EAGLE-3 from its recipe, 8 Spec-Bench prompts x 128
# tokens, bf16, on such a CPU: plain 31.0 tok/s; budgets 8/4/4 27.3, 6/3/3 27.3, 4/3/2 30.4,
# 3/3/1 33.5, 2/2/1 33.9 (session 28; one pass each, ~±5%).
CPU_CHAIN_BUDGET = TreeBudget(max_nodes=3, max_depth=3, topk=1)


def default_budget(device: str | torch.device = "cpu") -> TreeBudget:
    """The heads' tree budget for ``device``: EAGLE-2-sized on a GPU, 4 nodes on a CPU with native
    bf16, a 3-token chain on other CPUs."""
    if torch.device(device).type == "cuda":
        return GPU_TREE_BUDGET
    from specdec.infer.dtypes import native_bf16  # light: torch only

    return CPU_TREE_BUDGET if native_bf16("cpu") else CPU_CHAIN_BUDGET


@dataclass
class DraftTree:
    """A batch of flat draft trees (node 0 = root). See docs/ARCHITECTURE.md."""

    tokens: Tensor                     # [B, N] long, tokens[:, 0] = roots
    parents: Tensor                    # [B, N] long, -1 for the root, parents[b, i] < i
    valid: Tensor                      # [B, N] bool, False on padding nodes
    draft_probs: Tensor | None = None  # [B, N, V] q(. | parent) a node was sampled from
    scores: Tensor | None = None       # [B, N] float, cumulative draft probability (root 1)

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def masks(self) -> tuple[Tensor, Tensor]:
        """(depth [B, N], ancestor-or-self mask [B, N, N]); see `tree_masks`."""
        return tree_masks(self.parents)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError if the tree breaks the DraftTree contract."""
        B, N = self.tokens.shape
        if self.parents.shape != (B, N) or self.valid.shape != (B, N):
            raise ValueError(f"tokens {tuple(self.tokens.shape)}, parents {tuple(self.parents.shape)} "
                             f"and valid {tuple(self.valid.shape)} must all be [B, N]")
        if N == 0 or (self.parents[:, 0] != -1).any():
            raise ValueError("node 0 must be the root with parent -1")
        idx = torch.arange(N, device=self.parents.device)
        bad = self.valid[:, 1:] & ((self.parents[:, 1:] < 0) | (self.parents[:, 1:] >= idx[1:]))
        if bad.any():
            b, i = bad.nonzero()[0].tolist()
            raise ValueError(f"tree {b}: node {i + 1} has parent {self.parents[b, i + 1].item()}, "
                             f"which is not an earlier node")
        par_ok = self.valid.gather(1, self.parents.clamp(min=0))
        if (self.valid[:, 1:] & ~par_ok[:, 1:]).any():
            raise ValueError("a valid node has a padding (invalid) parent")
        if vocab_size is not None:
            tok = self.tokens[self.valid]
            if tok.numel() and (tok.min() < 0 or tok.max() >= vocab_size):
                raise ValueError(f"tree tokens must lie in [0, {vocab_size})")

    def top_path(self, b: int = 0) -> list[int]:
        """Tokens of the path that follows the best-scored child from the root (root included)."""
        scores = self.scores[b] if self.scores is not None else -torch.arange(self.num_nodes).float()
        path, node = [int(self.tokens[b, 0])], 0
        while True:
            kids = ((self.parents[b] == node) & self.valid[b]).nonzero().flatten()
            if kids.numel() == 0:
                return path
            node = int(kids[scores[kids].argmax()])
            path.append(int(self.tokens[b, node]))


def tree_masks(parents: Tensor) -> tuple[Tensor, Tensor]:
    """Depth and ancestor mask of flat trees.

    parents [B, N] long (-1 = root; padding nodes may point anywhere earlier or be -1)
    -> depth [B, N] long (root 0), mask [B, N, N] bool with mask[b, i, j] = j is i or an
    ancestor of i. Positions for tree attention are `base_len + depth`.
    Example: parents [-1, 0, 0, 1] -> depth [0, 1, 1, 2]; row 3 of the mask = [1, 1, 0, 1].
    """
    B, N = parents.shape
    dev = parents.device
    mask = torch.eye(N, dtype=torch.bool, device=dev).expand(B, N, N).clone()
    depth = torch.zeros(B, N, dtype=torch.long, device=dev)
    rows = torch.arange(N, device=dev).expand(B, N)
    anc = parents.clone()  # [B, N] current ancestor of each node being walked up
    for _ in range(N):  # each pass climbs one level; a tree of N nodes has depth < N
        live = anc >= 0
        if not live.any():
            break
        b_idx, i_idx = live.nonzero(as_tuple=True)
        mask[b_idx, rows[b_idx, i_idx], anc[b_idx, i_idx]] = True
        depth += live.long()
        anc = torch.where(live, parents.gather(1, anc.clamp(min=0)), anc)
    return depth, mask


# ----------------------------------------------------------------------------------------------
# Static trees (Medusa-style choice lists)
# ----------------------------------------------------------------------------------------------
@dataclass
class StaticTree:
    """A fixed tree shape: node i > 0 is the `rank[i]`-th most likely child of `parents[i]`."""

    choices: list[tuple[int, ...]]  # node i > 0 <-> choices[i - 1], sorted by (depth, path)
    parents: Tensor                 # [N] long, -1 for the root
    depth: Tensor                   # [N] long
    rank: Tensor                    # [N] long, top-k rank of the node among its siblings (root 0)

    @property
    def num_nodes(self) -> int:
        return self.parents.numel()

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    @property
    def max_rank(self) -> int:
        return int(self.rank.max()) + 1

    def fill(self, roots: Tensor, topk_tokens: Tensor, topk_scores: Tensor | None = None) -> DraftTree:
        """Tokens from per-depth top-k lists, as Medusa does.

        roots [B]; topk_tokens [B, D, K] (depth d's candidates, best first; d = 0 is depth 1);
        topk_scores [B, D, K] optional probabilities -> scores = product along the path.
        """
        B, D, K = topk_tokens.shape
        if D < self.max_depth or K < self.max_rank:
            raise ValueError(f"static tree needs top-{self.max_rank} lists for {self.max_depth} "
                             f"depths, got [B, {D}, {K}]")
        dev = topk_tokens.device
        depth, rank = self.depth.to(dev), self.rank.to(dev)
        d_idx = (depth[1:] - 1).expand(B, -1)                      # [B, N-1]
        flat = topk_tokens.reshape(B, D * K)
        tokens = torch.cat([roots.view(B, 1), flat.gather(1, d_idx * K + rank[1:])], dim=1)
        parents = self.parents.to(dev).expand(B, -1).clone()
        scores = None
        if topk_scores is not None:
            node_p = torch.cat([torch.ones(B, 1, device=dev, dtype=topk_scores.dtype),
                                topk_scores.reshape(B, D * K).gather(1, d_idx * K + rank[1:])], 1)
            scores = node_p.clone()
            for i in range(1, self.num_nodes):  # parents come first: one pass suffices
                scores[:, i] = node_p[:, i] * scores[:, int(self.parents[i])]
        valid = torch.ones_like(tokens, dtype=torch.bool)
        return DraftTree(tokens=tokens, parents=parents, valid=valid, scores=scores)


def static_tree(choices: Sequence[Sequence[int]], max_nodes: int | None = None,
                max_depth: int | None = None) -> StaticTree:
    """Build a static tree from choice paths: (0,) = best child of the root, (0, 1) = second-best
    child of that, ... Choices are taken in the given order (Medusa lists them by importance)
    up to `max_nodes` draft nodes and `max_depth` levels; every prefix of a kept path must be kept.
    """
    kept: list[tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()
    for c in choices:
        c = tuple(int(x) for x in c)
        if not c or min(c) < 0:
            raise ValueError(f"bad tree choice {c}: a non-empty path of ranks >= 0")
        if c in seen or (max_depth is not None and len(c) > max_depth):
            continue
        if max_nodes is not None and len(kept) >= max_nodes:
            break
        seen.add(c)
        kept.append(c)
    for c in kept:
        if len(c) > 1 and c[:-1] not in seen:
            raise ValueError(f"tree choice {c} has no parent {c[:-1]} among the kept choices")
    kept.sort(key=lambda c: (len(c), c))
    index = {c: i + 1 for i, c in enumerate(kept)}
    parents = [-1] + [index[c[:-1]] if len(c) > 1 else 0 for c in kept]
    return StaticTree(choices=kept, parents=torch.tensor(parents, dtype=torch.long),
                      depth=torch.tensor([0] + [len(c) for c in kept], dtype=torch.long),
                      rank=torch.tensor([0] + [c[-1] for c in kept], dtype=torch.long))


# ----------------------------------------------------------------------------------------------
# Dynamic trees (EAGLE-2)
# ----------------------------------------------------------------------------------------------
@dataclass
class Frontier:
    """The nodes a drafter must run at one expansion step.

    Candidate indices (`node_index`, `ancestors`' last axis) number every node created so far:
    0 = root, then in creation order; a drafter can keep per-node state (tree K/V) in buffers of
    size `num_candidates` indexed by them.
    """

    depth: int            # depth of these nodes (0 = the root)
    tokens: Tensor        # [B, F] long, target-vocab tokens of the frontier nodes
    node_index: Tensor    # [B, F] long, candidate index of each frontier node
    parent_slot: Tensor   # [B, F] long, position of the parent in the previous frontier (-1 at depth 0)
    ancestors: Tensor | None  # [B, F, C] bool, ancestor-or-self over all C candidate slots (None
                              # where the caller of expand_dynamic_tree said it keeps its own)
    num_candidates: int   # C


def num_dynamic_candidates(budget: TreeBudget) -> int:
    """Nodes `expand_dynamic_tree` creates before the rerank (root included)."""
    k = budget.topk
    return 1 + k + max(budget.max_depth - 1, 0) * k * k


StepFn = Callable[[Frontier], Tensor]  # frontier -> log_probs [B, F, V]


@torch.no_grad()
def expand_dynamic_tree(step: StepFn, roots: Tensor, budget: TreeBudget,
                        token_map: Tensor | None = None, min_frontier_mass: float = 0.0,
                        ancestors: bool = True) -> DraftTree:
    """EAGLE-2: grow by cumulative draft probability, then keep the best `max_nodes` nodes.

    step(frontier) -> log_probs [B, F, V]: the drafter's distribution of the next token after
    each frontier node. token_map [V] optional: maps the step's vocab ids to target ids (EAGLE-3's
    reduced draft vocab). Per depth: every frontier node proposes its top-k children (k*k
    candidates, all kept for the rerank) and the top-k of them by cumulative log-prob form the
    next frontier. Cumulative scores never increase along a path, so the global top-`max_nodes`
    (ties broken towards the earlier, i.e. shallower, node) is closed under ancestors.
    min_frontier_mass: stop growing once every row's next frontier holds less cumulative draft
    probability than this. The nodes of one more level add at most that mass in expected
    accepted tokens (drafts are calibrated; the real gain is smaller), while the level costs a
    full draft pass: on a CPU ~3 ms of a ~40 ms step (EagleDrafter's CPU default: 0.25). The
    level runs for the whole batch until no row wants it, but a row that stopped gets none of
    its nodes (invalid, at the end of the row): a row's tree does not depend on its batch, so a
    seeded sampled request draws the same tokens alone or batched.
    ancestors=False: the frontiers carry no ancestor masks (a step that tracks its own saves their
    upkeep, a few ops a level).
    """
    B, dev = roots.shape[0], roots.device
    k, C = budget.topk, num_dynamic_candidates(budget)
    tokens = torch.zeros(B, C, dtype=torch.long, device=dev)
    parents = torch.full((B, C), -1, dtype=torch.long, device=dev)
    cum = torch.zeros(B, C, device=dev)                      # cumulative log-prob; root 0
    anc = torch.zeros(B, C, C, dtype=torch.bool, device=dev) if ancestors else None  # ancestor-or-self
    tokens[:, 0] = roots
    if anc is not None:
        anc[:, 0, 0] = True
    rows = torch.arange(B, device=dev)[:, None]

    front_idx = torch.zeros(B, 1, dtype=torch.long, device=dev)  # [B, F] candidate indices
    parent_slot = torch.full((B, 1), -1, dtype=torch.long, device=dev)
    n = 1  # candidates created so far
    stopped = torch.zeros(B, 1, dtype=torch.bool, device=dev)  # rows past their own last level
    for depth in range(budget.max_depth):
        frontier = Frontier(depth=depth, tokens=tokens.gather(1, front_idx), node_index=front_idx,
                            parent_slot=parent_slot, ancestors=None if anc is None else anc[rows, front_idx],
                            num_candidates=C)
        logp = step(frontier).float()                        # [B, F, V]
        F, V = logp.shape[1], logp.shape[2]
        if V < k:
            raise ValueError(f"topk={k} exceeds the draft vocabulary ({V})")
        top_lp, top_id = logp.topk(k, dim=-1)                # [B, F, k]
        child_cum = (cum.gather(1, front_idx)[:, :, None] + top_lp).reshape(B, F * k)
        if min_frontier_mass > 0:  # -inf: never kept by the rerank below
            child_cum = child_cum.masked_fill(stopped, float("-inf"))
        child_tok = top_id.reshape(B, F * k)
        if token_map is not None:
            child_tok = token_map[child_tok]
        new = torch.arange(n, n + F * k, device=dev).expand(B, -1)   # [B, F*k]
        par = front_idx.repeat_interleave(k, dim=1)                  # [B, F*k]
        tokens[:, n:n + F * k], parents[:, n:n + F * k], cum[:, n:n + F * k] = child_tok, par, child_cum
        if anc is not None:
            anc[rows, new] = anc[rows, par]
            anc[rows, new, new] = True
        n += F * k
        # Next frontier: the k best new children (stable sort: equal scores keep creation order).
        best = child_cum.sort(dim=1, descending=True, stable=True)
        order = best.indices[:, :k]                                  # [B, k]
        front_idx, parent_slot = new.gather(1, order), order // k
        if min_frontier_mass > 0:
            stopped |= best.values[:, :k].exp().sum(1, keepdim=True) < min_frontier_mass
            if bool(stopped.all()):
                break

    # Rerank every candidate and keep the best max_nodes; sorting the kept indices restores a
    # topological order because parents were always created before their children.
    keep = min(budget.max_nodes, n - 1)
    best = cum[:, 1:n].sort(dim=1, descending=True, stable=True).indices[:, :keep] + 1
    kept = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), best.sort(dim=1).values], 1)
    remap = torch.full((B, C), -1, dtype=torch.long, device=dev)  # old index -> new index
    remap[rows, kept] = torch.arange(keep + 1, device=dev).expand(B, -1)
    kept_cum = cum.gather(1, kept)
    valid = kept_cum > float("-inf")  # a stopped row's later nodes: padding, children of the root
    new_par = remap.gather(1, parents.gather(1, kept).clamp(min=0)).masked_fill(~valid, 0)
    new_par[:, 0] = -1
    assert (new_par[:, 1:] >= 0).all(), "rerank dropped an ancestor of a kept node"
    return DraftTree(tokens=tokens.gather(1, kept), parents=new_par, valid=valid,
                     draft_probs=None, scores=kept_cum.exp())


# ----------------------------------------------------------------------------------------------
# Candidate paths merged into a scored trie (retrieval drafters, MLPSpeculator, ReDrafter)
# ----------------------------------------------------------------------------------------------
class CandidateTrie:
    """Candidate continuations of one root merged into a trie, each node with a score.

    ``add(path, scores)`` inserts tokens after the root; a node reached by several candidates
    keeps the highest score (and the union of their sources). Scores must not increase along a
    path (parents score at least as high as children); ``select`` then keeps the best
    ``max_nodes`` nodes (ties: shallower first, then insertion order), which is closed under
    ancestors, so the kept nodes form a tree.
    Example: root r, add([a, b], [.9, .8]) and add([a, c], [.7, .6]) -> r-a-{b, c}, a scored .9.
    """

    def __init__(self, root: int):
        self.tokens, self.parents, self.depth = [int(root)], [-1], [0]
        self.scores: list[float] = [float("inf")]
        self.sources: list[set[str]] = [set()]
        self._child: dict[tuple[int, int], int] = {}
        self._kids: list[int] = [0]  # number of children per node
        self.kept: set[int] | None = None  # the nodes `select` kept

    def __len__(self) -> int:
        return len(self.tokens) - 1  # draft nodes

    def add(self, path: Sequence[int], scores: Sequence[float] | float = 1.0, source: str = "",
            max_depth: int | None = None, max_children: int | None = None) -> None:
        node = 0
        for d, tok in enumerate(path):
            if max_depth is not None and d >= max_depth:
                return
            score = float(scores if isinstance(scores, (int, float)) else scores[d])
            key = (node, int(tok))
            child = self._child.get(key)
            if child is None:
                if max_children is not None and self._kids[node] >= max_children:
                    return
                child = len(self.tokens)
                self._child[key] = child
                self.tokens.append(int(tok))
                self.parents.append(node)
                self.depth.append(d + 1)
                self.scores.append(score)
                self.sources.append(set())
                self._kids.append(0)
                self._kids[node] += 1
            else:
                self.scores[child] = max(self.scores[child], score)
            if source:
                self.sources[child].add(source)
            node = child

    def child(self, node: int, token: int) -> int | None:
        return self._child.get((node, int(token)))

    def select(self, max_nodes: int, min_score: float = 0.0) -> list[int]:
        """Indices of the kept nodes, root first, parents before children; nodes scoring below
        ``min_score`` are not worth their verification cost and are left out."""
        order = sorted(range(1, len(self.tokens)), key=lambda i: (-self.scores[i], self.depth[i], i))
        kept, chosen = {0}, [0]
        for i in order:
            if len(chosen) > max_nodes or self.scores[i] < min_score:
                break
            if self.parents[i] in kept:  # always true for monotone scores; guards the rest
                kept.add(i)
                chosen.append(i)
        self.kept = set(chosen[:max_nodes + 1])  # what was proposed (hybrid learns from it)
        return sorted(self.kept)


def pack_trees(tries: Sequence[CandidateTrie], budget: TreeBudget, device, min_score: float = 0.0) -> DraftTree:
    """Cut each trie to the budget (best scores first, none below ``min_score``) and pad them
    into one DraftTree [B, N]."""
    return pack_nodes(tries, [t.select(budget.max_nodes, min_score) for t in tries], device)


def pack_nodes(tries: Sequence[CandidateTrie], picked: Sequence[Sequence[int]], device) -> DraftTree:
    """Pad the picked nodes of each trie (root first, parents before children, closed under
    ancestors) into one DraftTree [B, N] (node 0 = root; padding: valid False, parent 0).
    Scores are clamped to 1 (the root's is 1)."""
    B, N = len(tries), max(len(p) for p in picked)
    tokens = torch.zeros(B, N, dtype=torch.long)
    parents = torch.zeros(B, N, dtype=torch.long)
    valid = torch.zeros(B, N, dtype=torch.bool)
    scores = torch.zeros(B, N)
    for b, (trie, nodes) in enumerate(zip(tries, picked)):
        new_index = {old: new for new, old in enumerate(nodes)}
        n = len(nodes)
        tokens[b, :n] = torch.tensor([trie.tokens[i] for i in nodes])
        parents[b, :n] = torch.tensor([new_index.get(trie.parents[i], -1) for i in nodes])
        valid[b, :n] = True
        scores[b, :n] = torch.tensor([min(trie.scores[i], 1.0) for i in nodes])
    parents[:, 0] = -1
    return DraftTree(tokens=tokens.to(device), parents=parents.to(device), valid=valid.to(device),
                     draft_probs=None, scores=scores.to(device))


def tree_from_paths(roots: Tensor, paths: Tensor, scores: Tensor, max_nodes: int) -> DraftTree:
    """Merge candidate continuations into one prefix tree per sequence (dedupe shared prefixes).

    roots [B]; paths [B, P, D] long, candidates best first; scores [B, P, D] float, the
    cumulative probability of each prefix (a prefix's score does not depend on the path it came
    from). Paths are merged in order; nodes are added until `max_nodes` draft nodes exist (a
    path may be cut short: IBM's flatten_batch, unlike `pack_trees`' best-score cut). Rows are
    padded to the longest tree (valid False, parent 0).
    Example: paths [[a b c], [a b d], [a e f]] -> nodes root, a, b, c, d, e, f with parents
    [-1, 0, 1, 2, 2, 1, 5].
    """
    tries = []
    for b in range(paths.shape[0]):
        trie = CandidateTrie(int(roots[b]))
        for row, srow in zip(paths[b].tolist(), scores[b].tolist()):
            trie.add(row, srow)
        tries.append(trie)
    # Trie nodes are numbered in insertion order, so the first max_nodes + 1 form a tree.
    picked = [list(range(min(len(t), max_nodes) + 1)) for t in tries]
    return pack_nodes(tries, picked, paths.device)
