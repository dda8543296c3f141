"""The lossless property of stochastic tree verification, tested statistically.

A small Markov "target" T (V = 8, T[a] = p(next | current token a), with exact zeros as top-k
would leave) and a different Markov "draft" Q. Each trial starts from the same root token r and
generates the first two tokens with speculative steps (a second step only when the first emitted
a single token). Lossless means t1 ~ T[r] and (t1, t2) ~ T[r](t1) T[t1](t2), whatever the tree:
  (a) a chain whose tokens are sampled from Q            (min(1, p/q) rule)
  (b) a tree of deterministic, distinct top-k children   (point-mass rule, draft_probs None)
  (c) a tree with i.i.d. sampled siblings               (SpecInfer's multi-round rule)
Pearson chi-square on the counts; a fixed seed makes each p-value deterministic, and the bar
p > 1e-3 is the significance of the test. Power checks show the same test rejects a wrong
distribution (the draft's own tokens; the sampled-q rule misapplied to a deterministic tree).
"""
from __future__ import annotations

import pytest
import torch

from specdec.infer.kernels import stochastic_accept_reference
from specdec.infer.sampling import sample
from specdec.infer.verify import emitted_tokens

V, ROOT, TRIALS, ALPHA = 8, 3, 100_000, 1e-3


def markov(gen: torch.Generator, scale: float, zeros: int) -> torch.Tensor:
    """[V, V] rows are distributions; `zeros` entries per row set to exactly 0."""
    logits = scale * torch.randn(V, V, generator=gen, dtype=torch.float64)
    if zeros:
        drop = torch.rand(V, V, generator=gen).argsort(-1)[:, :zeros]
        logits.scatter_(1, drop, float("-inf"))
    return torch.softmax(logits, -1).float()


GEN = torch.Generator().manual_seed(2024)
TARGET = markov(GEN, 1.0, zeros=2)   # T
DRAFT = markov(GEN, 1.0, zeros=0)    # Q: full support, so drafts do propose zero-p tokens


def build_tree(kind: str, roots: torch.Tensor, gen: torch.Generator):
    """tokens/parents/valid [B, N] and draft_probs [B, N, V] | None for the given roots [B]."""
    B = roots.shape[0]
    if kind == "chain":
        parents = [-1, 0, 1, 2, 3]
    else:  # 3 children of the root, 2 children under each
        parents = [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]
    N = len(parents)
    tokens = torch.zeros(B, N, dtype=torch.long)
    tokens[:, 0] = roots
    draft_probs = torch.zeros(B, N, V)
    for i in range(1, N):
        par = parents[i]
        q = DRAFT[tokens[:, par]]                                         # [B, V] q(. | parent)
        draft_probs[:, i] = q
        if kind == "topk":  # the rank-th best token of q, rank = index among the siblings
            rank = parents[:i].count(par)
            tokens[:, i] = q.argsort(dim=-1, descending=True, stable=True)[:, rank]
        else:
            tokens[:, i] = sample(q, generator=gen)
    parents_t = torch.tensor(parents).expand(B, N).clone()
    valid = torch.ones(B, N, dtype=torch.bool)
    return tokens, parents_t, valid, None if kind == "topk" else draft_probs


def speculative_step(kind: str, roots: torch.Tensor, gen: torch.Generator, rule: str | None = None):
    """One verification step from `roots` [B] -> (emitted [B, D+1] padded -1, count [B])."""
    tokens, parents, valid, draft_probs = build_tree(kind, roots, gen)
    if rule == "sampled":  # misuse: the sampled-q rule on deterministic children
        draft_probs = DRAFT[tokens.gather(1, parents.clamp(min=0))]
    target_probs = TARGET[tokens]                                         # [B, N, V] p(. | node)
    uniforms = torch.rand(tokens.shape, generator=gen)
    acc = stochastic_accept_reference(tokens, parents, valid, target_probs, draft_probs, uniforms)
    return emitted_tokens(tokens, acc)


def first_two_tokens(kind: str, seed: int, rule: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    roots = torch.full((TRIALS,), ROOT)
    out, count = speculative_step(kind, roots, gen, rule)
    first, second = out[:, 0], out[:, 1].clone()
    again = count < 2                      # one token only: a second step from it
    out2, _ = speculative_step(kind, first[again], gen, rule)
    second[again] = out2[:, 0]
    return first, second


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of counts [K] against probs [K]; cells expecting < 5 are pooled.
    Any count in a cell of probability 0 refutes the distribution outright (p = 0)."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2.0))


def first_token_p(first: torch.Tensor) -> float:
    return chi_square_p(torch.bincount(first, minlength=V), TARGET[ROOT])


def pair_p(first: torch.Tensor, second: torch.Tensor) -> float:
    joint = TARGET[ROOT][:, None] * TARGET                                 # [V, V] p(t1) p(t2 | t1)
    return chi_square_p(torch.bincount(first * V + second, minlength=V * V), joint)


@pytest.mark.parametrize("kind", ["chain", "topk", "iid"])
def test_emitted_tokens_follow_the_target(kind):
    first, second = first_two_tokens(kind, seed=11)
    assert (TARGET[ROOT][first] > 0).all() and (TARGET[first, second] > 0).all()
    assert first_token_p(first) > ALPHA
    assert pair_p(first, second) > ALPHA


def test_chi_square_has_power():
    gen = torch.Generator().manual_seed(5)
    tokens, *_ = build_tree("chain", torch.full((TRIALS,), ROOT), gen)
    assert first_token_p(tokens[:, 1]) < ALPHA  # the draft's own proposals are not the target's
    first, second = first_two_tokens("topk", seed=11, rule="sampled")
    assert min(first_token_p(first), pair_p(first, second)) < ALPHA
