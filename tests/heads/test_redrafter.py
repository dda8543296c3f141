"""ReDrafter (Apple's recurrent drafter) on the tiny target: the recurrence, Apple's names,
save/load, and beam search merged into a prefix tree."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specdec.heads import Drafter, HeadShapeError, TreeBudget, get_head_class, load_head

ReDrafter = get_head_class("redrafter")


@pytest.mark.parametrize("rnn", [True, False])
def test_loss_decreases(tiny_target, kit, rnn):
    torch.manual_seed(0)
    head = ReDrafter.from_target(tiny_target, rnn=rnn)
    frozen = head.embed_tokens.weight.clone()
    seq = torch.randint(0, 256, (2, 24))
    mask = torch.ones_like(seq, dtype=torch.bool)
    mask[:, :6] = False
    _, losses = kit.train(head, kit.batch(tiny_target, seq, mask), 30)
    assert losses[-1] < 0.5 * losses[0]
    assert torch.equal(head.embed_tokens.weight, frozen)


def test_teacher_forced_recurrence_matches_the_formula(tiny_target, kit):
    """s_k = SiLU(W·emb(x_{t+k}) + U·s_{k-1}), s_0 = 0; logits_k = lm_head([h_t ; s_k])."""
    torch.manual_seed(1)
    head = ReDrafter.from_target(tiny_target, next_n=3)
    seq = torch.randint(0, 256, (1, 10))
    h = kit.features(tiny_target, seq)["hidden"]
    states = head.teacher_forced_states(h, seq, 3)
    e = head.embed_tokens(seq[0])
    s = torch.zeros(tiny_target.hidden_size)
    for k in range(1, 4):                                             # the chain at t = 2
        s = F.silu(head.rnn_w(e[2 + k]) + head.rnn_u(s))
        assert torch.allclose(states[k - 1][0, 2], s, atol=1e-6)
    logits = head.lm_head(torch.cat([h[0, 2], s]))
    assert torch.allclose(head.lm_head[-1](head.exit_features(h[0, 2], s)), logits)


def test_names_are_apples_and_input_proj_only_when_needed(tiny_target):
    H = tiny_target.hidden_size
    head = ReDrafter.from_target(tiny_target, num_draft_layers=2)
    assert set(head.saved_state_dict()) == {
        "lm_head.0.linear.weight", "lm_head.0.linear.bias", "lm_head.1.linear.weight",
        "lm_head.1.linear.bias", "lm_head.2.weight", "rnn_u.weight", "rnn_u.bias", "rnn_w.weight"}
    assert head.lm_head[0].linear.in_features == 2 * H
    narrow = ReDrafter.from_target(tiny_target, exit_dim=48, rnn=False)
    assert narrow.input_proj.weight.shape == (48, 2 * H) and not hasattr(narrow, "rnn_u")


def test_save_load_roundtrip_is_exact(tiny_target, kit, tmp_path):
    torch.manual_seed(2)
    head = ReDrafter.from_target(tiny_target, exit_dim=96)
    kit.roundtrip(tiny_target, head, tmp_path / "h")


def test_wrong_shaped_checkpoint_names_the_tensor(tiny_target, tmp_path):
    ReDrafter.from_target(tiny_target).save_pretrained(tmp_path / "h")
    path = tmp_path / "h" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["rnn_w.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(path))
    with pytest.raises(HeadShapeError, match=r"rnn_w\.weight"):
        load_head(tmp_path / "h", tiny_target)


@pytest.mark.parametrize("budget", [TreeBudget(24, 6, 8), TreeBudget(5, 2, 2), TreeBudget(1, 1, 1)])
def test_beam_search_tree_within_budget(tiny_target, kit, budget):
    torch.manual_seed(3)
    head = ReDrafter.from_target(tiny_target)
    drafter = head.new_drafter(tiny_target)
    tree, _ = kit.propose_two_slots(tiny_target, drafter, budget)
    # beams arrive best first: nodes 1..D are the most probable full-depth beam
    D = min(budget.max_depth, budget.max_nodes)
    depth, _ = tree.masks()
    assert tree.parents[1, 1:D + 1].tolist() == list(range(D))
    assert tree.scores[1, D] == tree.scores[1][tree.valid[1] & (depth[1] == D)].max()


@torch.no_grad()
def test_beam_width_one_is_the_greedy_chain(tiny_target, kit):
    torch.manual_seed(5)
    head = ReDrafter.from_target(tiny_target)
    drafter = head.new_drafter(tiny_target, beam_width=1)
    seq = torch.randint(0, 256, (11,))
    h = kit.features(tiny_target, seq[None])["hidden"][0]
    drafter.prefill(0, seq, {"hidden": h})
    tree = drafter.propose(torch.tensor([0]), torch.tensor([6]), TreeBudget(24, 5, 8))
    s, tok, p, chain = torch.zeros_like(h[-1]), torch.tensor(6), 1.0, []
    for _ in range(5):
        s = head.next_state(s, head.embed_tokens(tok))
        probs = head.lm_head(torch.cat([h[-1], s])).softmax(-1)
        tok = probs.argmax()
        p *= float(probs[tok])
        chain.append(int(tok))
    assert tree.tokens[0].tolist() == [6] + chain
    assert abs(float(tree.scores[0, -1]) - p) < 1e-5 * p


def test_overfitted_drafter_drafts_the_continuation(tiny_target, kit, greedy_seq):
    torch.manual_seed(4)
    head = ReDrafter.from_target(tiny_target, next_n=3)
    batch = kit.batch(tiny_target, greedy_seq, kit.reply_mask(greedy_seq))
    head, _ = kit.train(head, batch, 100)
    acc = head.acceptance(batch, 3)
    assert (acc["correct"] >= 0.85 * acc["count"]).all() and acc["count"][2] > 0
    kit.drafts_the_continuation(tiny_target, head.new_drafter(tiny_target), batch, greedy_seq[0])
