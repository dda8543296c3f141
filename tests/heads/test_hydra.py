"""Hydra heads on the tiny target: prefix inputs, loss, names, save/load, dynamic-tree drafting."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.heads import HeadShapeError, TreeBudget, get_head_class, load_head

Hydra = get_head_class("hydra")


def test_loss_decreases_and_target_parts_stay_frozen(tiny_target, kit):
    torch.manual_seed(0)
    head = Hydra.from_target(tiny_target, num_layers=2)
    frozen = {n: p.clone() for n, p in head.named_parameters() if not p.requires_grad}
    assert set(frozen) == {"embed_tokens.weight", "target_lm_head.weight"}
    seq = torch.randint(0, 256, (2, 24))
    mask = torch.ones_like(seq, dtype=torch.bool)
    mask[:, :6] = False
    _, losses = kit.train(head, kit.batch(tiny_target, seq, mask), 30)
    assert losses[-1] < 0.5 * losses[0]
    for n, p in head.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"{n} changed"


def test_head_k_reads_hidden_and_the_k_plus_1_path_embeddings(tiny_target, kit):
    """Teacher forcing: head k at t sees [h_t ; emb(x_{t+1}) ; ... ; emb(x_{t+k+1})]; changing a
    later token changes only deeper heads' inputs."""
    torch.manual_seed(1)
    head = Hydra.from_target(tiny_target, num_heads=3)
    seq = torch.randint(0, 256, (1, 10))
    h = kit.features(tiny_target, seq)["hidden"]
    emb = head.embed_tokens(seq)
    rows = torch.zeros(1, 10, dtype=torch.bool)
    rows[0, 2] = True
    x = head.prefix_inputs(2, h, emb, rows)                          # head 2 at t = 2
    want = torch.cat([h[0, 2], emb[0, 3], emb[0, 4], emb[0, 5]])
    assert torch.equal(x[0], want)
    H = tiny_target.hidden_size
    assert [m[0].linear.in_features for m in head.hydra_mlp] == [2 * H, 3 * H, 4 * H]
    # an untrained head starts as the target's LM head on h_t (identity blocks, copied head)
    z = head.hydra_mlp[1](head.prefix_inputs(1, h, emb, rows))
    assert torch.allclose(head.hydra_lm_head[1](z), tiny_target.model.lm_head(h[0, 2:3]), atol=1e-5)


def test_weight_names_follow_the_reference(tiny_target):
    head = Hydra.from_target(tiny_target, num_heads=2, num_layers=2)
    names = set(head.saved_state_dict())
    expected = set()
    for k in range(2):
        expected |= {f"hydra_mlp.{k}.0.{m}.{w}" for m in ("linear", "res_connection")
                     for w in ("weight", "bias")}
        expected |= {f"hydra_mlp.{k}.1.linear.{w}" for w in ("weight", "bias")}
        expected |= {f"hydra_lm_head.{k}.{w}" for w in ("weight", "bias")}
    assert names == expected


def test_save_load_roundtrip_is_exact(tiny_target, kit, tmp_path):
    torch.manual_seed(2)
    head = Hydra.from_target(tiny_target)
    loaded, head, batch = kit.roundtrip(tiny_target, head, tmp_path / "h")
    drafters = [h.new_drafter(tiny_target) for h in (head, loaded)]
    trees = []
    for d in drafters:
        d.prefill(0, batch["input_ids"][0], {"hidden": batch["hidden"][0]})
        trees.append(d.propose(torch.tensor([0]), torch.tensor([9]), TreeBudget(10, 3, 3)))
    assert torch.equal(trees[0].tokens, trees[1].tokens)
    assert torch.equal(trees[0].scores, trees[1].scores)


def test_wrong_shaped_checkpoint_names_the_tensor(tiny_target, tmp_path):
    Hydra.from_target(tiny_target).save_pretrained(tmp_path / "h")
    path = tmp_path / "h" / "model.safetensors"
    tensors = load_file(str(path))
    H = tiny_target.hidden_size
    tensors["hydra_mlp.1.0.res_connection.weight"] = torch.zeros(H, H)     # should be [H, 3H]
    save_file(tensors, str(path))
    with pytest.raises(HeadShapeError, match=r"hydra_mlp\.1\.0\.res_connection\.weight"):
        load_head(tmp_path / "h", tiny_target)


@pytest.mark.parametrize("budget", [TreeBudget(24, 6, 8), TreeBudget(5, 2, 2), TreeBudget(1, 1, 1)])
def test_drafter_expands_a_dynamic_tree_within_budget(tiny_target, kit, budget):
    torch.manual_seed(3)
    head = Hydra.from_target(tiny_target)
    drafter = head.new_drafter(tiny_target)
    tree, seqs = kit.propose_two_slots(tiny_target, drafter, budget)
    depth, _ = tree.masks()
    assert int(depth.max()) <= min(budget.max_depth, head.config.num_heads)
    assert tree.num_nodes == budget.max_nodes + 1 and tree.draft_probs is None
    # the best depth-1 child is head 0's argmax on [h ; emb(root)]
    h = kit.features(tiny_target, seqs[1][None])["hidden"][0, -1]
    z = head.hydra_mlp[0](torch.cat([h, head.embed_tokens.weight[6]]))
    assert int(tree.tokens[1][depth[1] == 1][0]) == int(head.hydra_lm_head[0](z).argmax())


def test_overfitted_heads_draft_the_continuation(tiny_target, kit, greedy_seq):
    torch.manual_seed(4)
    head = Hydra.from_target(tiny_target)
    batch = kit.batch(tiny_target, greedy_seq, kit.reply_mask(greedy_seq))
    head, _ = kit.train(head, batch, 100)
    acc = head.acceptance(batch, 3)
    assert (acc["correct"] >= 0.85 * acc["count"]).all() and acc["count"][2] > 0
    kit.drafts_the_continuation(tiny_target, head.new_drafter(tiny_target), batch, greedy_seq[0])
