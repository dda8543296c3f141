"""IBM's MLPSpeculator on the tiny target: IBM's names and maths, the two training stages,
tied weights, save/load, and the candidate-chain prefix tree."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specdec.heads import HeadShapeError, TreeBudget, get_head_class, load_head
from specdec.heads.tree import tree_from_paths

MLP = get_head_class("mlp_speculator")


@pytest.mark.parametrize("stage", [1, 2])
def test_loss_decreases_in_both_stages(tiny_target, kit, stage):
    torch.manual_seed(0)
    head = MLP.from_target(tiny_target, stage=stage)
    seq = torch.randint(0, 256, (2, 24))
    mask = torch.ones_like(seq, dtype=torch.bool)
    mask[:, :6] = False
    _, losses = kit.train(head, kit.batch(tiny_target, seq, mask), 30)
    assert losses[-1] < 0.5 * losses[0]


def test_stage2_trains_on_the_targets_greedy_continuation(tiny_target, kit):
    """Stage 2 conditions on and predicts the target's argmax tokens, whichever source gives them
    (lm_head(hidden) or captured top-k); stage 1 uses the dataset's tokens."""
    torch.manual_seed(1)
    seq = torch.randint(0, 256, (1, 12))
    batch = kit.batch(tiny_target, seq, topk=3)
    s2 = MLP.from_target(tiny_target, stage=2)
    with torch.no_grad():
        greedy = tiny_target.model(seq).logits.argmax(-1)
    assert torch.equal(s2.training_tokens(batch), greedy)
    no_topk = {k: v for k, v in batch.items() if not k.startswith("topk")}
    assert torch.equal(s2.training_tokens(no_topk), greedy)
    s1 = MLP.from_target(tiny_target, stage=1)
    assert torch.equal(s1.training_tokens(batch)[0, :-1], seq[0, 1:])
    # a stage-2 batch whose tokens ARE the greedy continuation gives the stage-1 loss
    s2.load_state_dict(s1.state_dict())
    forced = dict(batch, input_ids=torch.cat([seq[:, :1], greedy[:, :-1]], 1))
    assert torch.allclose(s2.loss(batch)[0], s1.loss(forced)[0])


def test_names_config_and_stage_maths_are_ibms(tiny_target):
    torch.manual_seed(2)
    head = MLP.from_target(tiny_target, n_predict=3, inner_dim=32)
    names = set(head.saved_state_dict())
    assert names == {f"{m}.{i}.weight" for m in ("emb", "proj", "head", "ln") for i in range(3)} | \
        {f"ln.{i}.bias" for i in range(3)}
    c = head.config
    H, V = tiny_target.hidden_size, tiny_target.vocab_size
    assert (c.emb_dim, c.vocab_size, c.inner_dim, c.n_predict) == (H, V, 32, 3)
    assert c.top_k_tokens_per_head == [5, 4, 3]
    # one stage by hand: LN(proj(s) * w_s + emb(tok) * w_e) then GELU (LN without the mean)
    s, tok = torch.randn(2, H), torch.tensor([3, 7])
    w_s = 0.5 ** (0.5 / 3)
    w_e = math.sqrt((1 - w_s ** 2) * 32 / 2)
    x = head.proj[0](s) * w_s + head.emb[0](tok) * w_e
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    x = x * head.ln[0].weight + head.ln[0].bias
    assert torch.allclose(head.step(0, s, tok), F.gelu(x), atol=1e-6)
    with pytest.raises(ValueError, match="top_k_tokens_per_head"):
        MLP.from_target(tiny_target, n_predict=2, top_k_tokens_per_head=[4, 3, 2])


def test_save_load_roundtrip_is_exact_also_with_tied_weights(tiny_target, kit, tmp_path):
    torch.manual_seed(3)
    batch = kit.batch(tiny_target, torch.randint(0, 256, (1, 16)))
    for i, fields in enumerate([{}, {"tie_weights": True, "scale_input": True, "n_predict": 4}]):
        head = MLP.from_target(tiny_target, **fields)
        head, _ = kit.train(head, batch, 3)
        if fields:   # tied: one module per kind after the first projection
            assert head.emb[0] is head.emb[3] and head.proj[1] is head.proj[3]
            assert head.proj[0] is not head.proj[1]
        head.save_pretrained(tmp_path / f"h{i}")
        loaded = load_head(tmp_path / f"h{i}", tiny_target)
        assert loaded.config == head.config
        assert torch.equal(head.loss(batch)[0], loaded.loss(batch)[0])
        if fields:
            assert loaded.head[0] is loaded.head[2]


def test_wrong_shaped_checkpoint_names_the_tensor(tiny_target, tmp_path):
    MLP.from_target(tiny_target).save_pretrained(tmp_path / "h")
    path = tmp_path / "h" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["head.1.weight"] = torch.zeros(300, tiny_target.hidden_size)
    save_file(tensors, str(path))
    with pytest.raises(HeadShapeError, match=r"head\.1\.weight"):
        load_head(tmp_path / "h", tiny_target)


def test_tree_from_paths_merges_shared_prefixes():
    paths = torch.tensor([[[1, 2, 3], [1, 2, 4], [1, 5, 6]]])
    scores = torch.tensor([[[0.9, 0.8, 0.7], [0.9, 0.8, 0.1], [0.9, 0.05, 0.01]]])
    tree = tree_from_paths(torch.tensor([7]), paths, scores, max_nodes=10)
    assert tree.tokens[0].tolist() == [7, 1, 2, 3, 4, 5, 6]
    assert tree.parents[0].tolist() == [-1, 0, 1, 2, 2, 1, 5]
    assert torch.allclose(tree.scores[0], torch.tensor([1, 0.9, 0.8, 0.7, 0.1, 0.05, 0.01]))
    cut = tree_from_paths(torch.tensor([7]), paths, scores, max_nodes=5)   # last path cut short
    assert cut.tokens[0].tolist() == [7, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("budget", [TreeBudget(24, 6, 8), TreeBudget(5, 2, 2), TreeBudget(1, 1, 1)])
def test_drafter_merges_candidate_chains_within_budget(tiny_target, kit, budget):
    torch.manual_seed(4)
    head = MLP.from_target(tiny_target)
    drafter = head.new_drafter(tiny_target)
    tree, seqs = kit.propose_two_slots(tiny_target, drafter, budget)
    depth, _ = tree.masks()
    assert int(depth[tree.valid].max()) == min(budget.max_depth, head.config.n_predict)
    # the best chain (highest cumulative probability) is merged first: nodes 1..D
    b, D = 1, min(budget.max_depth, head.config.n_predict)
    v = tree.valid[b]
    assert tree.parents[b, 1:D + 1].tolist() == list(range(D))
    assert tree.scores[b, D] == tree.scores[b][v & (depth[b] == D)].max()
    # depth-1 nodes come from stage 0's top-k after the root
    h = kit.features(tiny_target, seqs[1][None])["hidden"][0, -1]
    state = head.step(0, head.initial_state(h), torch.tensor(6))
    top = head.head[0](state).topk(min(5, budget.topk)).indices.tolist()
    assert set(tree.tokens[b][v & (depth[b] == 1)].tolist()) <= set(top)


def test_overfitted_speculator_drafts_the_continuation(tiny_target, kit, greedy_seq):
    torch.manual_seed(5)
    head = MLP.from_target(tiny_target)
    batch = kit.batch(tiny_target, greedy_seq, kit.reply_mask(greedy_seq))
    head, _ = kit.train(head, batch, 100)
    acc = head.acceptance(batch, 4)
    assert acc["count"][3] == 0 and acc["correct"][0] >= 0.9 * acc["count"][0] > 0
    kit.drafts_the_continuation(tiny_target, head.new_drafter(tiny_target), batch, greedy_seq[0])
