"""Medusa-1 heads on the tiny target: loss, Medusa-2 distillation, names, save/load, drafting."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.heads import HeadShapeError, TreeBudget, get_head_class, load_head
from specdec.heads.medusa import MC_SIM_7B_63, MEDUSA_CPU_CHOICES
from specdec.heads.tree import static_tree

Medusa = get_head_class("medusa")


def _prompt_masked(seq):
    mask = torch.ones_like(seq, dtype=torch.bool)
    mask[:, :6] = False                                               # a "prompt" without loss
    return mask


@pytest.mark.parametrize("distill", [False, True])
def test_loss_decreases_and_target_parts_stay_frozen(tiny_target, kit, distill):
    torch.manual_seed(0)
    head = Medusa.from_target(tiny_target, distill=distill)
    frozen = head.target_lm_head.weight.clone()
    seq = torch.randint(0, 256, (2, 24))
    _, losses = kit.train(head, kit.batch(tiny_target, seq, _prompt_masked(seq)), 30)
    # soft labels keep the teacher's entropy in the loss: only the KL part can vanish
    assert losses[-1] < (0.9 if distill else 0.5) * losses[0]
    assert torch.equal(head.target_lm_head.weight, frozen)
    assert not head.target_lm_head.weight.requires_grad


def test_distill_labels_are_the_targets_distribution(tiny_target, kit):
    """Medusa-2 self-distillation: head k at t is trained towards softmax(lm_head(h_{t+k+1})),
    computed from the hidden states or read from captured top-k logits (all of V here)."""
    torch.manual_seed(1)
    head = Medusa.from_target(tiny_target, distill=True, num_heads=2)
    seq = torch.randint(0, 256, (1, 12))
    full = kit.batch(tiny_target, seq, topk=tiny_target.vocab_size)
    from_hidden = {k: v for k, v in full.items() if not k.startswith("topk")}
    loss_h, metrics = head.loss(from_hidden)
    assert torch.allclose(loss_h, head.loss(full)[0], rtol=1e-5)
    h, W = full["hidden"][0], tiny_target.model.lm_head.weight
    with torch.no_grad():   # head 0 at t predicts token t+2; the target's view of it is at t+1
        want = torch.stack([-(torch.softmax(h[t + 1] @ W.T, -1)
                              * torch.log_softmax(head.medusa_head[0](h[t]), -1)).sum()
                            for t in range(seq.shape[1] - 2)]).mean()
    assert abs(metrics["loss_0"] - float(want)) < 1e-4


def test_weight_names_are_medusas_and_heads_are_independent(tiny_target):
    head = Medusa.from_target(tiny_target, num_heads=3, num_layers=2)
    names = set(head.saved_state_dict())
    expected = {f"medusa_head.{i}.{j}.linear.{w}" for i in range(3) for j in range(2)
                for w in ("weight", "bias")} | {f"medusa_head.{i}.2.weight" for i in range(3)}
    assert names == expected
    ptrs = {p.data_ptr() for n, p in head.named_parameters() if n.startswith("medusa_head")}
    assert len(ptrs) == 3 * (2 * 2 + 1)                               # no shared blocks
    # LM heads start as the target's, blocks as the identity: head k = target's next token
    h = torch.randn(5, tiny_target.hidden_size)
    assert torch.allclose(head.medusa_head[1](h), tiny_target.model.lm_head(h), atol=1e-5)


def test_save_load_roundtrip_is_exact(tiny_target, kit, tmp_path):
    torch.manual_seed(2)
    head = Medusa.from_target(tiny_target, num_layers=2)
    loaded, head, batch = kit.roundtrip(tiny_target, head, tmp_path / "h")
    h = batch["hidden"][0]
    assert torch.equal(head.head_logits(h), loaded.head_logits(h))


def test_wrong_shaped_checkpoint_names_the_tensor(tiny_target, tmp_path):
    head = Medusa.from_target(tiny_target)
    head.save_pretrained(tmp_path / "h")
    path = tmp_path / "h" / "model.safetensors"
    tensors = load_file(str(path))
    name = "medusa_head.2.0.linear.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(path))
    with pytest.raises(HeadShapeError, match=r"medusa_head\.2\.0\.linear\.weight"):
        load_head(tmp_path / "h", tiny_target)


@pytest.mark.parametrize("budget", [TreeBudget(24, 6, 8), TreeBudget(60, 7, 10),
                                    TreeBudget(5, 2, 2), TreeBudget(1, 1, 1)])
def test_drafter_fills_the_static_tree_within_budget(tiny_target, kit, budget):
    torch.manual_seed(3)
    head = Medusa.from_target(tiny_target)
    drafter = head.new_drafter(tiny_target, tree="gpu" if budget.max_nodes > 24 else None)
    tree, seqs = kit.propose_two_slots(tiny_target, drafter, budget)
    assert tree.draft_probs is None
    choices = MC_SIM_7B_63 if budget.max_nodes > 24 else MEDUSA_CPU_CHOICES
    eligible = [c for c in choices if max(c) < budget.topk and len(c) <= min(budget.max_depth, 4)]
    assert tree.num_nodes - 1 == min(budget.max_nodes, len(eligible))
    # Depth-d nodes hold head d-1's top-k at the last committed hidden state, rank-ordered.
    h = kit.features(tiny_target, seqs[1][None])["hidden"][0, -1]
    top = head.medusa_head[0](h).topk(2).indices
    depth, _ = tree.masks()
    first = tree.tokens[1][(depth[1] == 1)]
    assert first[0] == top[0] and (len(first) < 2 or first[1] == top[1])


def test_default_trees_are_prefix_closed_choice_lists():
    cpu, gpu = static_tree(MEDUSA_CPU_CHOICES), static_tree(MC_SIM_7B_63)
    assert (cpu.num_nodes, cpu.max_depth) == (25, 4) and (gpu.num_nodes, gpu.max_depth) == (64, 4)
    assert set(MEDUSA_CPU_CHOICES) <= set(MC_SIM_7B_63)


def test_overfitted_heads_draft_the_continuation(tiny_target, kit, greedy_seq):
    torch.manual_seed(4)
    head = Medusa.from_target(tiny_target)
    batch = kit.batch(tiny_target, greedy_seq, kit.reply_mask(greedy_seq))
    head, _ = kit.train(head, batch, 100)
    acc = head.acceptance(batch, 5)
    assert acc["count"][4] == 0                                       # 4 heads: no depth 5
    assert acc["correct"][0] >= 0.9 * acc["count"][0] > 0
    kit.drafts_the_continuation(tiny_target, head.new_drafter(tiny_target), batch, greedy_seq[0])
