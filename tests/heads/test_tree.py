"""Tree utilities: masks from parents, static trees from choice lists, EAGLE-2 expansion."""
from __future__ import annotations

import math

import pytest
import torch

from specdec.heads.tree import (CPU_TREE_BUDGET, GPU_TREE_BUDGET, DraftTree, TreeBudget,
                                expand_dynamic_tree, num_dynamic_candidates, static_tree,
                                tree_masks)


def test_tree_masks_hand_made_tree():
    #        0
    #      /   \
    #     1     2
    #     |
    #     3
    #    / \
    #   4   5
    parents = torch.tensor([[-1, 0, 0, 1, 3, 3]])
    depth, mask = tree_masks(parents)
    assert depth.tolist() == [[0, 1, 1, 2, 3, 3]]
    expected = [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 1, 1, 0],
        [1, 1, 0, 1, 0, 1],
    ]
    assert mask[0].int().tolist() == expected


def test_tree_masks_batch_rows_are_independent():
    parents = torch.tensor([[-1, 0, 1, 2], [-1, 0, 0, 0]])
    depth, mask = tree_masks(parents)
    assert depth.tolist() == [[0, 1, 2, 3], [0, 1, 1, 1]]
    assert mask[0].sum().item() == 1 + 2 + 3 + 4
    assert mask[1].sum().item() == 1 + 2 + 2 + 2


def test_static_tree_from_choices():
    choices = [(0,), (0, 0), (1,), (0, 1), (0, 0, 0), (2,)]
    t = static_tree(choices)
    assert t.choices == [(0,), (1,), (2,), (0, 0), (0, 1), (0, 0, 0)]
    assert t.parents.tolist() == [-1, 0, 0, 0, 1, 1, 4]
    assert t.depth.tolist() == [0, 1, 1, 1, 2, 2, 3]
    assert t.rank.tolist() == [0, 0, 1, 2, 0, 1, 0]
    # Fill from per-depth top-k lists: depth d, rank r -> token 100*d + r.
    topk = torch.tensor([[[100 * d + r for r in range(3)] for d in range(1, 4)]])
    probs = torch.tensor([[[0.5, 0.3, 0.2]] * 3])
    tree = t.fill(torch.tensor([7]), topk, probs)
    tree.validate(vocab_size=1000)
    assert tree.tokens.tolist() == [[7, 100, 101, 102, 200, 201, 300]]
    assert torch.allclose(tree.scores[0], torch.tensor([1, .5, .3, .2, .25, .15, .125]))


def test_static_tree_budget_and_errors():
    choices = [(0,), (0, 0), (1,), (0, 1), (0, 0, 0)]
    assert static_tree(choices, max_nodes=3).choices == [(0,), (1,), (0, 0)]
    assert static_tree(choices, max_depth=1).choices == [(0,), (1,)]
    with pytest.raises(ValueError, match=r"\(0, 1\) has no parent \(0,\)"):
        static_tree([(1,), (0, 1)])
    with pytest.raises(ValueError, match="top-3 lists"):
        static_tree([(0,), (2,)]).fill(torch.tensor([1]), torch.zeros(1, 1, 2, dtype=torch.long))


def test_budget_constants():
    for b in (CPU_TREE_BUDGET, GPU_TREE_BUDGET):
        assert num_dynamic_candidates(b) > b.max_nodes and b.max_depth >= 4
    assert CPU_TREE_BUDGET.max_nodes < GPU_TREE_BUDGET.max_nodes
    assert CPU_TREE_BUDGET.max_depth < GPU_TREE_BUDGET.max_depth
    with pytest.raises(ValueError):
        TreeBudget(max_nodes=4, max_depth=0, topk=2)


@pytest.mark.parametrize("native", [True, False])
def test_default_budget_is_a_chain_on_cpus_without_native_bf16(monkeypatch, native):
    from specdec.heads import tree
    from specdec.infer import dtypes

    monkeypatch.setattr(dtypes, "native_bf16", lambda device="cpu": native)
    assert tree.default_budget("cuda") == GPU_TREE_BUDGET
    got = tree.default_budget("cpu")
    assert got == (CPU_TREE_BUDGET if native else tree.CPU_CHAIN_BUDGET)
    assert native or got.topk == 1 and got.max_nodes == got.max_depth  # a chain


def _table(V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, V, generator=g) * 2).log_softmax(-1)  # next-token log-probs by token


def _eagle2_reference(table, root, budget):
    """EAGLE-2 written path by path: expand the top-k children of the k best new nodes per
    depth, then keep the best max_nodes of every candidate (by product of probabilities)."""
    k = budget.topk
    cands = []                    # (path, log score) in creation order
    frontier = [((), 0.0)]
    for _ in range(budget.max_depth):
        new = []
        for path, score in frontier:
            last = path[-1] if path else root
            lp, ids = table[last].topk(k)
            new += [(path + (int(t),), score + float(l)) for l, t in zip(lp, ids)]
        cands += new
        frontier = sorted(new, key=lambda c: -c[1])[:k]
    kept = sorted(cands, key=lambda c: -c[1])[:budget.max_nodes]
    return {path for path, _ in kept}


def _paths(tree: DraftTree, b: int) -> set[tuple[int, ...]]:
    out = set()
    for i in range(1, tree.num_nodes):
        path, j = [], i
        while j > 0:
            path.append(int(tree.tokens[b, j]))
            j = int(tree.parents[b, j])
        out.add(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("budget", [TreeBudget(10, 4, 3), TreeBudget(24, 6, 8), TreeBudget(5, 1, 8)])
def test_dynamic_tree_matches_eagle2(budget):
    V = 40
    table = _table(V, seed=budget.max_nodes)
    calls = []

    def step(frontier):
        calls.append(frontier.tokens.shape)
        return table[frontier.tokens]                                  # [B, F, V]

    roots = torch.tensor([3, 17])
    tree = expand_dynamic_tree(step, roots, budget)
    tree.validate(vocab_size=V)
    assert len(calls) == budget.max_depth
    assert tree.num_nodes == budget.max_nodes + 1 and tree.valid.all()
    assert tree.tokens[:, 0].tolist() == roots.tolist()
    assert (tree.parents[:, 1:] < torch.arange(1, tree.num_nodes)).all()      # topological
    depth, _ = tree.masks()
    for b in range(2):
        for i in range(1, tree.num_nodes):                                    # scores = path products
            p = int(tree.parents[b, i])
            edge = table[int(tree.tokens[b, p]), int(tree.tokens[b, i])].exp()
            assert math.isclose(float(tree.scores[b, i]), float(tree.scores[b, p] * edge), rel_tol=1e-4)
        assert _paths(tree, b) == _eagle2_reference(table, int(roots[b]), budget)
        assert int(depth[b].max()) <= budget.max_depth


def test_dynamic_tree_follows_a_confident_chain_and_maps_tokens():
    V = 12
    table = torch.full((V, V), -8.0)
    for t in range(V):
        table[t, (t + 1) % V] = 0.0                                     # "always the next id"
    table = table.log_softmax(-1)
    token_map = torch.arange(V) + 100                                   # draft id -> target id
    # The step sees target ids; undo the map to index the table.
    tree = expand_dynamic_tree(lambda f: table[f.tokens % 100], torch.tensor([105]),
                               TreeBudget(max_nodes=4, max_depth=4, topk=2), token_map=token_map)
    assert tree.top_path(0) == [105, 106, 107, 108, 109]
    assert tree.parents.tolist() == [[-1, 0, 1, 2, 3]]


def test_dynamic_tree_stops_growing_when_the_frontier_promises_little():
    """A level is drafted only while some row's next frontier holds >= min_frontier_mass of
    cumulative draft probability; what is kept is still the best max_nodes of what was grown."""
    V = 16
    flat = torch.full((V, V), 1.0 / V).log()                           # every child has p = 1/16
    budget = TreeBudget(max_nodes=8, max_depth=4, topk=2)
    calls = []

    def step(frontier):
        calls.append(frontier.depth)
        return flat[frontier.tokens]

    tree = expand_dynamic_tree(step, torch.tensor([1, 2]), budget, min_frontier_mass=0.15)
    # depth-1 frontier: 2 children of mass 1/16 each = 0.125 < 0.15 -> no second level
    assert calls == [0] and tree.num_nodes == 1 + 2
    tree.validate(vocab_size=V)
    calls.clear()
    tree = expand_dynamic_tree(step, torch.tensor([1, 2]), budget, min_frontier_mass=0.1)
    # 0.125 >= 0.1 goes on; the depth-2 frontier holds 2/256 < 0.1 -> stops after two levels
    assert calls == [0, 1]
    assert tree.num_nodes == 1 + 2 + 4 and int(tree.masks()[0].max()) == 2   # all 6 grown kept
    calls.clear()
    peaked = torch.full((V, V), -9.0)
    peaked[torch.arange(V), (torch.arange(V) + 1) % V] = 0.0           # one confident child
    peaked = peaked.log_softmax(-1)
    tree = expand_dynamic_tree(lambda f: (calls.append(f.depth), peaked[f.tokens])[1],
                               torch.tensor([1, 2]), budget, min_frontier_mass=0.5)
    assert calls == [0, 1, 2, 3]                                        # a sure chain is grown fully


def test_a_rows_dynamic_tree_does_not_depend_on_its_batch():
    """A level grown for another row adds nothing to a row that stopped: its tree alone and batched
    has the same valid nodes in the same places (a seeded request then samples the same tokens)."""
    V, budget = 32, TreeBudget(max_nodes=8, max_depth=4, topk=2)
    table = torch.full((V, V), -30.0)
    table[:16, :16] = 0.0                                               # ids < 16: 16 equal children
    table[torch.arange(16, V), torch.arange(16, V) % 15 + 17] = 10.0    # ids >= 16: one sure child
    table = table.log_softmax(-1)

    def grow(roots):
        return expand_dynamic_tree(lambda f: table[f.tokens], torch.tensor(roots), budget, min_frontier_mass=0.15)

    alone, batched = grow([1]), grow([1, 20])
    assert alone.num_nodes == 3 and int(batched.masks()[0][1].max()) == 4      # the sure row grew on
    n = alone.num_nodes
    assert batched.valid[0].tolist() == [True] * n + [False] * (batched.num_nodes - n)
    assert torch.equal(batched.tokens[0, :n], alone.tokens[0]) and torch.equal(batched.parents[0, :n], alone.parents[0])
    assert (batched.parents[0, n:] == 0).all() and (batched.scores[0, n:] == 0).all()
    batched.validate(vocab_size=V)


def test_validate_rejects_bad_trees():
    ok = dict(tokens=torch.tensor([[1, 2, 3]]), valid=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="not an earlier node"):
        DraftTree(parents=torch.tensor([[-1, 2, 0]]), **ok).validate()
    with pytest.raises(ValueError, match="root"):
        DraftTree(parents=torch.tensor([[0, 0, 0]]), **ok).validate()
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        DraftTree(parents=torch.tensor([[-1, 0, 0]]), **ok).validate(vocab_size=3)
