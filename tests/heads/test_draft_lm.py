"""The draft LM (classic speculative sampling) on the tiny target: distillation, HF-compatible
weights, save/load, and its drafter (own KV cache; greedy chain, sampled chain, top-k tree)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.heads import (Drafter, FeatureSpec, HeadShapeError, TreeBudget, get_head_class,
                           load_head)

DraftLM = get_head_class("draft_lm")


@pytest.fixture(scope="module")
def full_copy(tiny_target):
    """A draft with every target layer copied: it IS the target, so it must agree with it."""
    return DraftLM.from_target(tiny_target, num_layers=tiny_target.num_layers).eval()


@pytest.mark.parametrize("teacher", ["hidden", "topk"])
def test_distillation_loss_decreases(tiny_target, kit, teacher):
    torch.manual_seed(0)
    topk = 16 if teacher == "topk" else 0
    head = DraftLM.from_target(tiny_target, num_layers=1, teacher_topk=topk)
    assert head.feature_spec() == (FeatureSpec(hidden=False, topk_logits=16) if topk
                                   else FeatureSpec(hidden=True))
    frozen = head.target_lm_head.weight.clone()
    seq = torch.randint(0, 256, (2, 24))
    mask = torch.ones_like(seq, dtype=torch.bool)
    mask[:, :6] = False
    batch = kit.batch(tiny_target, seq, mask, topk=topk, hidden=not topk)
    _, losses = kit.train(head, batch, 30, lr=3e-3)
    # the soft cross-entropy keeps the teacher's entropy: compare the KL parts
    with torch.no_grad():
        full = kit.batch(tiny_target, seq, mask, topk=topk)
        if topk:
            p = full["topk_values"].softmax(-1)
        else:
            p = (full["hidden"] @ tiny_target.model.lm_head.weight.T).softmax(-1)
        valid = torch.zeros_like(mask)
        valid[:, :-1] = mask[:, 1:]
        entropy = float(-(p * p.clamp_min(1e-30).log()).sum(-1)[valid].mean())
    assert losses[-1] - entropy < 0.5 * (losses[0] - entropy)
    assert torch.equal(head.target_lm_head.weight, frozen)


def test_full_copy_reproduces_the_target_and_exports_as_hf_llama(tiny_target, kit, full_copy):
    from transformers import LlamaConfig, LlamaForCausalLM

    seq = torch.randint(0, 256, (2, 20))
    batch = kit.batch(tiny_target, seq)
    with torch.no_grad():
        mine = full_copy.draft_hidden(batch) @ full_copy.lm_weight().T
        theirs = tiny_target.model(seq).logits
        assert torch.allclose(mine, theirs, atol=1e-4)
        # the saved tensors are a LlamaForCausalLM checkpoint, names and all
        c = full_copy.config
        hf = LlamaForCausalLM(LlamaConfig(
            vocab_size=c.vocab_size, hidden_size=c.draft_hidden_size,
            num_hidden_layers=c.num_layers, intermediate_size=c.intermediate_size,
            num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            rms_norm_eps=c.rms_norm_eps, rope_parameters=c.rope_parameters,
            tie_word_embeddings=c.tie_word_embeddings)).eval()
        hf.load_state_dict(full_copy.saved_state_dict(), strict=True)
        assert torch.allclose(hf(seq).logits, theirs, atol=1e-4)
    # ... and its distillation loss is the teacher's entropy (KL 0)
    assert full_copy.loss(batch)[1]["top1_0"] == 1.0


def test_init_from_target_copies_the_first_layers(tiny_target):
    head = DraftLM.from_target(tiny_target, num_layers=2)
    assert head.copy_from_target(tiny_target) == ["embed_tokens", "norm", "lm_head", "layers.0",
                                                  "layers.1"]
    t_layer = tiny_target.model.model.layers[1]
    assert torch.equal(head.model.layers[1].mlp.down_proj.weight, t_layer.mlp.down_proj.weight)
    narrow = DraftLM.from_target(tiny_target, num_layers=1, draft_hidden_size=32,
                                 intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                                 head_dim=16)
    assert narrow.copy_from_target(tiny_target) == []               # nothing fits: random init
    batch = {"input_ids": torch.randint(0, 256, (1, 8)),
             "loss_mask": torch.ones(1, 8, dtype=torch.bool),
             "hidden": torch.randn(1, 8, tiny_target.hidden_size)}
    assert torch.isfinite(narrow.loss(batch)[0])


def test_save_load_roundtrip_is_exact(tiny_target, kit, tmp_path):
    torch.manual_seed(2)
    head = DraftLM.from_target(tiny_target, num_layers=1)
    kit.roundtrip(tiny_target, head, tmp_path / "h")


def test_wrong_shaped_checkpoint_names_the_tensor(tiny_target, tmp_path):
    DraftLM.from_target(tiny_target).save_pretrained(tmp_path / "h")
    path = tmp_path / "h" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(8, 8)
    save_file(tensors, str(path))
    with pytest.raises(HeadShapeError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        load_head(tmp_path / "h", tiny_target)


@pytest.mark.parametrize("mode", ["chain", "tree", "sample"])
def test_drafter_trees_are_valid_for_a_batch(tiny_target, kit, mode):
    torch.manual_seed(3)
    head = DraftLM.from_target(tiny_target, num_layers=1)
    opts = {"tree": {"tree": True}, "sample": {"temperature": 0.8, "seed": 0}}.get(mode, {})
    drafter = head.new_drafter(tiny_target, max_batch=4, max_len=64, **opts)
    assert isinstance(drafter, Drafter) and drafter.feature_spec == FeatureSpec(hidden=False)
    for slot, n in ((3, 9), (0, 17)):
        drafter.prefill(slot, torch.randint(0, 256, (n,)), {})
    roots = torch.tensor([5, 6])
    for budget in (TreeBudget(24, 6, 8), TreeBudget(5, 2, 2), TreeBudget(1, 1, 1)):
        tree = drafter.propose(torch.tensor([3, 0]), roots, budget)
        kit.check_tree(tree, budget, roots, tiny_target.vocab_size)
        if mode == "sample":
            q = tree.draft_probs                                       # [B, N, V]
            assert q.shape == (2, tree.num_nodes, tiny_target.vocab_size)
            assert torch.allclose(q[:, 1:].sum(-1), torch.ones(2, tree.num_nodes - 1))
            assert (q[:, 1:].gather(2, tree.tokens[:, 1:, None]) > 0).all()
        else:
            assert tree.draft_probs is None
        if mode == "tree":
            assert tree.num_nodes == budget.max_nodes + 1
        else:
            assert tree.num_nodes == min(budget.max_depth, budget.max_nodes) + 1
        for slot in (3, 0):   # nothing accepted: the root alone is committed
            drafter.commit(slot, roots[:1] if slot == 3 else roots[1:], {})


@pytest.mark.parametrize("tree", [False, True])
def test_full_copy_drafts_exactly_the_targets_greedy_continuation(tiny_target, kit, full_copy,
                                                                  tree):
    prompt = torch.randint(0, 256, (12,))
    ones = torch.ones(1, 12, dtype=torch.long)
    want = tiny_target.model.generate(prompt[None], attention_mask=ones, max_new_tokens=25,
                                      do_sample=False)[0, 12:].tolist()
    budget = TreeBudget(10, 4, 3)
    gen, accepted = kit.speculate(tiny_target, full_copy.new_drafter(tiny_target, tree=tree),
                                  prompt, 25, budget)
    assert gen == want
    if tree:   # EAGLE-2's rerank may cut the greedy path short, never below its first child
        assert min(accepted[:-1]) >= 1
    else:
        assert accepted[:-1] == [4] * (len(accepted) - 1)             # every draft is accepted


@torch.no_grad()
def test_full_copy_tree_scores_are_the_targets_path_probabilities(tiny_target, full_copy):
    """Tree attention over the drafter's cache + in-tree ancestors: every node's cumulative
    score is the target's probability of that node's path."""
    prompt = torch.randint(0, 256, (12,))
    drafter = full_copy.new_drafter(tiny_target, tree=True, max_batch=2, max_len=64)
    drafter.prefill(1, prompt, {})
    tree = drafter.propose(torch.tensor([1]), torch.tensor([42]), TreeBudget(10, 4, 3))
    toks, par = tree.tokens[0].tolist(), tree.parents[0].tolist()
    for i in range(1, len(toks)):
        path, j = [], i
        while j >= 0:
            path.insert(0, toks[j])
            j = par[j]
        logits = tiny_target.model(torch.cat([prompt, torch.tensor(path[:-1])])[None]).logits[0]
        probs = logits[-len(path) + 1:].softmax(-1)                   # after root .. parent
        want = probs.gather(1, torch.tensor(path[1:])[:, None]).prod()
        assert abs(float(tree.scores[0, i]) - float(want)) < 1e-4 * float(want)


def test_sampled_chain_carries_the_distributions_it_was_drawn_from(tiny_target, full_copy):
    prompt = torch.randint(0, 256, (10,))
    drafter = full_copy.new_drafter(tiny_target, temperature=0.7, seed=1, max_batch=1, max_len=64)
    drafter.prefill(0, prompt, {})
    tree = drafter.propose(torch.tensor([0]), torch.tensor([42]), TreeBudget(3, 3, 1))
    path = [42] + tree.tokens[0, 1:].tolist()
    with torch.no_grad():
        for d in range(1, 4):   # node d was drawn from softmax(target logits / 0.7) after its path
            ids = torch.cat([prompt, torch.tensor(path[:d])])[None]
            logits = tiny_target.model(ids).logits[0, -1]
            assert torch.allclose(tree.draft_probs[0, d], (logits / 0.7).softmax(-1), atol=1e-4)
    again = full_copy.new_drafter(tiny_target, temperature=0.7, seed=1, max_batch=1, max_len=64)
    again.prefill(0, prompt, {})
    again_tree = again.propose(torch.tensor([0]), torch.tensor([42]), TreeBudget(3, 3, 1))
    assert torch.equal(again_tree.tokens, tree.tokens)


def test_commit_equals_prefilling_everything(tiny_target):
    torch.manual_seed(5)
    head = DraftLM.from_target(tiny_target, num_layers=2)
    seq = torch.randint(0, 256, (20,))
    budget = TreeBudget(4, 4, 1)
    a = head.new_drafter(tiny_target, max_batch=2, max_len=64)
    a.prefill(1, seq[:12], {})
    a.propose(torch.tensor([1]), seq[12:13], budget)                  # root 12 proposed...
    a.commit(1, seq[12:15], {})                                       # ...2 drafts accepted
    a.commit(1, seq[15:16], {})                                       # a plain step, no propose
    b = head.new_drafter(tiny_target, max_batch=2, max_len=64)
    b.prefill(1, seq[:16], {})
    ta = a.propose(torch.tensor([1]), seq[16:17], budget)
    tb = b.propose(torch.tensor([1]), seq[16:17], budget)
    assert torch.equal(ta.tokens, tb.tokens) and torch.allclose(ta.scores, tb.scores, rtol=1e-4)
    a.release(1)
    assert int(a.lens[1]) == 0


def test_overfitted_draft_drafts_the_continuation(tiny_target, kit, greedy_seq):
    torch.manual_seed(6)
    head = DraftLM.from_target(tiny_target, num_layers=1)
    batch = kit.batch(tiny_target, greedy_seq, kit.reply_mask(greedy_seq))
    head, _ = kit.train(head, batch, 100, lr=3e-3)
    acc = head.acceptance(batch, 3)
    assert (acc["correct"] >= 0.85 * acc["count"]).all() and acc["count"][2] > 0
    seq = greedy_seq[0]
    budget = TreeBudget(3, 3, 1)
    gen, accepted = kit.speculate(tiny_target, head.new_drafter(tiny_target), seq[:16], 28, budget)
    assert gen == seq[16:16 + 28].tolist()
    assert sum(accepted) / len(accepted) >= 2.5
