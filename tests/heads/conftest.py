"""Shared pieces of the draft-head tests (medusa, hydra, mlp_speculator, draft_lm, redrafter):
capture-format batches from the tiny target, a short training loop, a DraftTree budget check, and
a greedy speculative-decoding loop that drives a Drafter through the protocol the way the engine
does (prefill -> propose -> verify with the target -> commit the accepted path)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Sequence

import pytest
import torch

from specdec.heads import Drafter, TreeBudget, load_head


def features(target, seq: torch.Tensor, topk: int = 0,
             aux_layers: Sequence[int] = ()) -> dict[str, torch.Tensor]:
    """The capture format for seq [B, T]: hidden [B, T, H] (post-norm), optional top-k, and
    with aux_layers the concatenated hidden_states aux [B, T, A*H] (EAGLE-3's input)."""
    with torch.no_grad():
        out = target.model(seq, output_hidden_states=True)
    f = {"hidden": out.hidden_states[-1]}
    if aux_layers:
        f["aux"] = torch.cat([out.hidden_states[i] for i in aux_layers], dim=-1)
    if topk:
        f["topk_values"], f["topk_indices"] = out.logits.topk(topk, dim=-1)
    return f


def make_batch(target, seq: torch.Tensor, loss_mask=None, topk: int = 0, hidden: bool = True,
               aux_layers: Sequence[int] = ()):
    ones = torch.ones_like(seq, dtype=torch.bool)
    batch = {"input_ids": seq, "attention_mask": ones,
             "loss_mask": ones if loss_mask is None else loss_mask,
             **features(target, seq, topk, aux_layers)}
    if not hidden:
        del batch["hidden"]
    return batch


def reply_mask(seq: torch.Tensor, prompt_len: int = 8) -> torch.Tensor:
    """loss_mask of a greedy_seq: the prompt has no loss, the target's own reply has."""
    mask = torch.ones_like(seq, dtype=torch.bool)
    mask[:, :prompt_len] = False
    return mask


def check_tree(tree, budget, roots: torch.Tensor, vocab_size: int) -> None:
    """The DraftTree contract plus the budget: <= max_nodes draft nodes, <= max_depth levels,
    <= topk children per node, roots first, scores (if any) cumulative probabilities."""
    tree.validate(vocab_size=vocab_size)
    assert tree.tokens[:, 0].tolist() == roots.tolist()
    depth, _ = tree.masks()
    for b in range(tree.batch_size):
        v = tree.valid[b]
        assert int(v.sum()) - 1 <= budget.max_nodes
        assert int(depth[b][v].max()) <= budget.max_depth
        kids = torch.bincount(tree.parents[b][v][1:], minlength=tree.num_nodes)
        assert int(kids.max()) <= budget.topk
    if tree.scores is not None:
        s = tree.scores[tree.valid]
        assert (s > 0).all() and (s <= 1 + 1e-6).all()
        par = tree.parents.clamp(min=0)
        child, parent = tree.scores[:, 1:], tree.scores.gather(1, par)[:, 1:]
        assert (child <= parent + 1e-6)[tree.valid[:, 1:]].all()   # a path's probability shrinks


@torch.no_grad()
def speculate(target, drafter, prompt: torch.Tensor, n_new: int, budget, slot: int = 1):
    """Greedy speculative decoding of one sequence with `drafter`, verified by the target
    (no cache: every check is a fresh forward). -> (generated tokens, accepted drafts per step)."""
    model = target.model
    drafter.reset(4, 256)
    ids = prompt.tolist()
    out = model(torch.tensor([ids]), output_hidden_states=True)
    drafter.prefill(slot, prompt, {"hidden": out.hidden_states[-1][0]})
    root = int(out.logits[0, -1].argmax())
    gen, accepted = [root], []
    while len(gen) < n_new:
        tree = drafter.propose(torch.tensor([slot]), torch.tensor([root]), budget)
        check_tree(tree, budget, torch.tensor([root]), target.vocab_size)
        node, path = 0, [root]
        while True:   # walk down the tree while the target's greedy token is a child
            nxt = int(model(torch.tensor([ids + path])).logits[0, -1].argmax())
            kids = ((tree.parents[0] == node) & tree.valid[0] & (tree.tokens[0] == nxt)).nonzero()
            if kids.numel() == 0:
                break
            node = int(kids[0])
            path.append(nxt)
        hs = model(torch.tensor([ids + path]), output_hidden_states=True).hidden_states[-1]
        drafter.commit(slot, torch.tensor(path), {"hidden": hs[0, len(ids):]})
        ids += path
        gen += path[1:] + [nxt]
        accepted.append(len(path) - 1)
        root = nxt
    return gen[:n_new], accepted


def roundtrip(target, head, folder, train):
    """Train `head` 3 steps (with the `train_head` loop) on a random batch, save it to `folder`
    and load it back: the loaded head has the same type, config and loss.
    -> (loaded head, trained head, batch)."""
    batch = make_batch(target, torch.randint(0, 256, (1, 16)))
    head, _ = train(head, batch, 3)
    head.save_pretrained(folder)
    loaded = load_head(folder, target)
    assert type(loaded) is type(head) and loaded.config == head.config
    assert torch.equal(head.loss(batch)[0], loaded.loss(batch)[0])
    return loaded, head, batch


def propose_two_slots(target, drafter, budget):
    """Prefill slots 3 and 0 with random sequences of 9 and 17 tokens, propose roots 5 and 6 and
    check the tree against the budget. -> (tree, the two sequences)."""
    assert isinstance(drafter, Drafter)
    seqs = [torch.randint(0, 256, (n,)) for n in (9, 17)]
    for slot, s in zip((3, 0), seqs):
        drafter.prefill(slot, s, {"hidden": features(target, s[None])["hidden"][0]})
    roots = torch.tensor([5, 6])
    tree = drafter.propose(torch.tensor([3, 0]), roots, budget)
    check_tree(tree, budget, roots, target.vocab_size)
    return tree, seqs


def drafts_the_continuation(target, drafter, batch, seq: torch.Tensor) -> None:
    """A drafter overfitted on the greedy sequence seq [T] (batch: its capture) drafts its next
    3 tokens as the top path, and speculative decoding from its first 16 tokens reproduces it
    losslessly with >= 2.5 drafts accepted per step."""
    budget = TreeBudget(12, 3, 3)
    for n in (12, 20, 30):
        drafter.prefill(0, seq[:n], {"hidden": batch["hidden"][0, :n]})
        tree = drafter.propose(torch.tensor([0]), seq[n:n + 1], budget)
        assert tree.top_path(0) == seq[n:n + 4].tolist()
    gen, accepted = speculate(target, drafter, seq[:16], 28, budget)
    assert gen == seq[16:16 + 28].tolist()                            # lossless, and ...
    assert sum(accepted) / len(accepted) >= 2.5                      # ... nearly all accepted


@pytest.fixture
def kit(train_head):
    return SimpleNamespace(features=features, batch=make_batch, train=train_head, reply_mask=reply_mask,
                           check_tree=check_tree, speculate=speculate,
                           roundtrip=lambda target, head, folder: roundtrip(target, head, folder, train_head),
                           propose_two_slots=propose_two_slots,
                           drafts_the_continuation=drafts_the_continuation)


@pytest.fixture(scope="session")
def greedy_seq(tiny_target):
    """A sequence the tiny target generates greedily: [1, 48], its own continuation."""
    prompt = torch.tensor([[72, 101, 108, 108, 111, 44, 32, 119]])
    return tiny_target.model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                      max_new_tokens=40, do_sample=False)
