"""Logits processing (temperature, top-k, top-p, greedy), inverse-CDF sampling, and the
verification entry point that ties them to the kernels."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdec.infer.kernels import greedy_accept, stochastic_accept
from specdec.infer.sampling import (inverse_cdf, process_logits, sample, sampling_tensors, top_k_mask,
                                    top_p_mask)
from specdec.infer.verify import emitted_tokens, row_uniforms, verify_tree


def test_top_k_keeps_the_k_largest_per_row():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 5.0], [4.0, 3.0, 2.0, 1.0, 0.0]])
    keep = top_k_mask(logits, torch.tensor([2, 0]))        # row 1: k = 0 disables
    assert keep.tolist() == [[False, True, False, False, True], [True] * 5]
    ties = top_k_mask(torch.tensor([[1.0, 2.0, 2.0, 0.0]]), torch.tensor([1]))
    assert ties.tolist() == [[False, True, True, False]]   # ties at the k-th value are kept


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([[0.2, 0.5, 0.3]] * 4)
    keep = top_p_mask(probs, torch.tensor([0.7, 0.5, 1.0, 1e-6]))
    # mass before each token (sorted 0.5, 0.3, 0.2): 0, 0.5, 0.8 -> kept while < top_p
    assert keep.tolist() == [[False, True, True], [False, True, False], [True] * 3, [False, True, False]]


def test_temperature_and_per_row_params():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 50, generator=gen)           # [B, N, V]: rows share params over N
    temp, top_k, top_p = torch.tensor([0.5, 1.0, 2.0]), torch.tensor([0, 5, 0]), torch.tensor([1.0, 1.0, 0.8])
    probs = process_logits(logits, temp, top_k, top_p)
    assert torch.allclose(probs.sum(-1), torch.ones(3, 4))
    assert torch.allclose(probs[0], torch.softmax(logits[0] / 0.5, -1))
    assert ((probs[1] > 0).sum(-1) == 5).all()
    for b in range(3):  # each row as if processed alone
        alone = process_logits(logits[b : b + 1], temp[b].item(), top_k[b].item(), top_p[b].item())
        assert torch.allclose(alone[0], probs[b])
    sharp, flat = process_logits(logits[:1], 0.5), process_logits(logits[:1], 2.0)
    entropy = lambda p: -(p * p.clamp_min(1e-30).log()).sum(-1)  # noqa: E731
    assert (entropy(sharp) < entropy(flat)).all()


def test_top_k_then_top_p_then_renormalise():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    # top-k 3 -> [0.444, 0.333, 0.222, 0]; top-p 0.7 keeps the first two -> [4/7, 3/7, 0, 0]
    probs = process_logits(logits, 1.0, 3, 0.7)
    assert torch.allclose(probs, torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]))


def test_greedy_rows_are_one_hot_at_the_first_argmax():
    logits = torch.tensor([[1.0, 7.0, 7.0, 0.0], [1.0, 7.0, 7.0, 0.0]])
    probs = process_logits(logits, torch.tensor([0.0, 1.0]), top_k=1)
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert torch.allclose(probs[1], torch.tensor([0.0, 0.5, 0.5, 0.0]))  # top-k 1 keeps both ties


def test_sampling_tensors_validate():
    params = [SimpleNamespace(temperature=0.7, top_k=20, top_p=0.9),
              SimpleNamespace(temperature=0, top_k=0, top_p=1)]
    temp, k, p = sampling_tensors(params)
    assert temp.tolist() == pytest.approx([0.7, 0.0]) and k.tolist() == [20, 0]
    assert p.tolist() == pytest.approx([0.9, 1.0])
    with pytest.raises(ValueError, match="request 0: temperature"):
        sampling_tensors([SimpleNamespace(temperature=-1, top_k=0, top_p=1)])
    with pytest.raises(ValueError, match="top_p must be in"):
        sampling_tensors([SimpleNamespace(temperature=1, top_k=0, top_p=0)])
    with pytest.raises(ValueError, match="temperature must be a number or a \\[B\\]"):
        process_logits(torch.zeros(2, 5), torch.ones(3))


def test_inverse_cdf():
    w = torch.tensor([[1.0, 0.0, 3.0]] * 3)
    assert inverse_cdf(w, torch.tensor([0.0, 0.2, 0.3])).tolist() == [0, 0, 2]   # thresholds 0, 0.8, 1.2
    # rounding can leave no running sum above u * total: the last positive weight is taken
    assert inverse_cdf(w[:1], torch.tensor([0.99]), total=torch.tensor([5.0])).tolist() == [2]
    assert inverse_cdf(torch.zeros(1, 3), torch.tensor([0.5]), fallback=torch.tensor([1])).tolist() == [1]


def test_sample_matches_the_distribution():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3]).expand(200_000, 4)
    draws = sample(probs, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert freq[1] == 0 and torch.allclose(freq, probs[0], atol=5e-3)


# ----------------------------------------------------------------------------- verify_tree
def _tree(gen, B=4, N=7, V=12):
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3]).expand(B, N).clone()
    tokens = torch.stack([torch.randperm(V, generator=gen)[:N] for _ in range(B)])  # distinct siblings
    return SimpleNamespace(tokens=tokens, parents=parents, valid=torch.ones(B, N, dtype=torch.bool),
                           draft_probs=None)


def test_verify_tree_greedy_and_mixed_batches():
    gen = torch.Generator().manual_seed(0)
    tree = _tree(gen)
    logits = torch.randn(4, 7, 12, generator=gen)
    logits.scatter_add_(2, tree.tokens.roll(-1, dims=1)[..., None], torch.full((4, 7, 1), 3.0))  # deep paths
    greedy = greedy_accept(tree.tokens, tree.parents, tree.valid, logits.argmax(-1))
    out = verify_tree(tree, logits, 0.0)
    assert all(torch.equal(a, b) for a, b in zip(out, greedy))
    # mixed: rows 0 and 2 greedy, rows 1 and 3 sampled at temperature 1
    temp = torch.tensor([0.0, 1.0, 0.0, 1.0])
    u = torch.rand(4, 7, generator=gen)
    mixed = verify_tree(tree, logits, temp, uniforms=u)
    for b in (0, 2):
        assert mixed.n_accepted[b] == greedy.n_accepted[b] and mixed.bonus[b] == greedy.bonus[b]
        assert torch.equal(mixed.path[b], greedy.path[b])
    probs = torch.softmax(logits, -1)
    sampled = stochastic_accept(tree.tokens, tree.parents, tree.valid, probs, None, u)
    for b in (1, 3):
        assert mixed.n_accepted[b] == sampled.n_accepted[b] and mixed.bonus[b] == sampled.bonus[b]


def test_emitted_tokens_worked_example():
    tokens = torch.tensor([[10, 7, 9, 4], [10, 7, 9, 4]])
    n = torch.tensor([2, 0])
    path = torch.tensor([[0, 1, 3], [0, -1, -1]])
    out, count = emitted_tokens(tokens, (n, path, torch.tensor([5, 6])))
    assert out.tolist() == [[7, 4, 5], [6, -1, -1]] and count.tolist() == [3, 1]


def test_row_uniforms_follow_each_requests_seed():
    a = row_uniforms([torch.Generator().manual_seed(1), None], 5, "cpu", default=torch.Generator().manual_seed(9))
    b = row_uniforms([None, None, torch.Generator().manual_seed(1)], 5, "cpu")
    assert torch.equal(a[0], b[2]) and a.shape == (2, 5) and ((a >= 0) & (a < 1)).all()
