"""EAGLE and EAGLE-3 heads on the tiny target: training, save/load, the drafter."""
from __future__ import annotations

import pytest
import torch

from specdec.heads import Drafter, TreeBudget, get_head_class, load_head

HEADS = {"eagle": {}, "eagle3": {"ttt_steps": 3}}


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny-model ops are far too small to split: a second thread only adds sync cost (10x+
    slower when the 2 cores are shared)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", HEADS)
def test_loss_decreases_and_frozen_parts_stay(tiny_target, kit, name):
    torch.manual_seed(0)
    head = get_head_class(name).from_target(tiny_target, **HEADS[name])
    frozen = {n: p.clone() for n, p in head.named_parameters() if not p.requires_grad}
    assert "embed_tokens.weight" in frozen
    seq = torch.randint(0, 256, (2, 24))
    mask = torch.ones_like(seq, dtype=torch.bool)
    mask[:, :6] = False                                              # a "prompt" without loss
    batch = kit.batch(tiny_target, seq, mask, aux_layers=head.feature_spec().aux_layers)
    _, losses = kit.train(head, batch, 30, lr=3e-3)
    assert losses[-1] < 0.9 * losses[0]
    for n, p in head.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"{n} changed"


def test_eagle3_soft_labels_once_equal_per_step_chunks(tiny_target, kit, monkeypatch):
    """EAGLE-3's loss computes the target's soft labels once for all unrolled steps when they
    fit in memory; the loss and gradients equal the chunked path that recomputes them per step."""
    from specdec.heads import base

    torch.manual_seed(1)
    head = get_head_class("eagle3").from_target(tiny_target, draft_vocab_size=64, ttt_steps=3)
    seq = torch.randint(0, 256, (3, 20))
    mask = torch.ones_like(seq, dtype=torch.bool)
    mask[:, :5] = False
    mask[2, 14:] = False
    batch = kit.batch(tiny_target, seq, mask, aux_layers=head.feature_spec().aux_layers)

    def loss_and_grads():
        head.zero_grad()
        loss, metrics = head.loss(batch)
        loss.backward()
        return loss.detach(), metrics, [p.grad.clone() for p in head.parameters() if p.requires_grad]

    once = loss_and_grads()
    monkeypatch.setattr(base, "KEEP_LOGITS_ELEMS", 0)   # soft_labels declines: chunked path
    assert base.soft_labels(torch.zeros(1, 4), torch.zeros(2, 4)) is None
    chunked = loss_and_grads()
    torch.testing.assert_close(once[0], chunked[0])
    assert once[1] == pytest.approx(chunked[1])
    for a, b in zip(once[2], chunked[2]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", HEADS)
def test_save_load_roundtrip_is_exact(tiny_target, kit, tmp_path, name):
    torch.manual_seed(1)
    head = get_head_class(name).from_target(tiny_target, **HEADS[name])
    if name == "eagle3":
        head.set_draft_vocab(torch.arange(tiny_target.vocab_size).flip(0))  # ids 0..Vd-1 are the most frequent
    batch = kit.batch(tiny_target, torch.randint(0, 256, (1, 16)),
                      aux_layers=head.feature_spec().aux_layers)
    head, _ = kit.train(head, batch, 3, lr=3e-3)
    head.save_pretrained(tmp_path / "h")
    mode = lambda f: (tmp_path / "h" / f).stat().st_mode & 0o777  # noqa: E731
    assert mode("model.safetensors") == mode("config.json")  # readable as the config (not 0600)
    loaded = load_head(tmp_path / "h", tiny_target)
    assert type(loaded) is type(head) and loaded.config == head.config
    with torch.no_grad():
        a, b = head.unroll(batch, 2), loaded.unroll(batch, 2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(head.loss(batch)[0], loaded.loss(batch)[0])


@pytest.mark.parametrize("name", HEADS)
def test_drafter_proposes_valid_trees_for_a_batch(tiny_target, kit, name):
    torch.manual_seed(2)
    head = get_head_class(name).from_target(tiny_target, **HEADS[name])
    spec = head.feature_spec()
    # grow every level (a random head's flat drafts would stop the CPU default at depth 1)
    drafter = head.new_drafter(tiny_target, max_batch=3, max_len=64, min_frontier_mass=0.0)
    assert isinstance(drafter, Drafter) and drafter.feature_spec == head.draft_feature_spec()
    # drafting reads raw_feature's input only: EAGLE-3 the aux layers, not the teacher's hidden
    assert drafter.feature_spec.aux_layers == spec.aux_layers and drafter.feature_spec.topk_logits == 0
    assert drafter.feature_spec.hidden == (name == "eagle")
    seqs = [torch.randint(0, 256, (n,)) for n in (9, 17)]
    for slot, s in zip((2, 0), seqs):
        f = kit.features(tiny_target, s[None], aux_layers=spec.aux_layers)
        drafter.prefill(slot, s, {k: v[0] for k, v in f.items()})
    budget = TreeBudget(max_nodes=12, max_depth=4, topk=4)
    roots = torch.tensor([5, 6])
    tree = drafter.propose(torch.tensor([2, 0]), roots, budget)
    tree.validate(vocab_size=tiny_target.vocab_size)
    assert tree.num_nodes == budget.max_nodes + 1 and tree.draft_probs is None
    assert tree.tokens[:, 0].tolist() == roots.tolist()
    assert (tree.scores[:, 1:] <= 1).all() and (tree.scores[:, 1:] > 0).all()
    # Batched proposals equal one-slot proposals (padding and per-slot lengths are handled).
    single = drafter.propose(torch.tensor([0]), roots[1:], budget)
    assert torch.equal(single.tokens[0], tree.tokens[1])
    assert torch.allclose(single.scores[0], tree.scores[1], rtol=1e-4)


def test_eagle3_drafts_in_target_ids_from_its_draft_vocab(tiny_target, kit):
    torch.manual_seed(3)
    head = get_head_class("eagle3").from_target(tiny_target, draft_vocab_size=40, ttt_steps=2)
    counts = torch.zeros(tiny_target.vocab_size)
    counts[200:240] = torch.arange(40, 0, -1).float()                # the 40 ids 200..239
    head.set_draft_vocab(counts)
    assert head.token_map.tolist() == list(range(200, 240))
    assert head.t2d.sum() == 40 and head.t2d[200:240].all()
    seq = torch.randint(0, 256, (10,))
    drafter = head.new_drafter(tiny_target, max_batch=1, max_len=32)
    f = kit.features(tiny_target, seq[None], aux_layers=head.feature_spec().aux_layers)
    drafter.prefill(0, seq, {k: v[0] for k, v in f.items()})
    tree = drafter.propose(torch.tensor([0]), torch.tensor([7]), TreeBudget(10, 3, 4))
    assert ((tree.tokens[0, 1:] >= 200) & (tree.tokens[0, 1:] < 240)).all()


@pytest.mark.parametrize("name", HEADS)
def test_drafter_matches_training_time_test(tiny_target, kit, name):
    """The drafter's tree attention (own cache + in-tree ancestors) computes exactly what the
    training unroll computes for the same chain: cumulative scores agree at every depth."""
    torch.manual_seed(4)
    head = get_head_class(name).from_target(tiny_target, **HEADS[name])
    spec = head.feature_spec()
    prompt = torch.randint(0, 256, (14,))
    n = 13
    drafter = head.new_drafter(tiny_target, max_batch=1, max_len=64, min_frontier_mass=0.0)
    f = kit.features(tiny_target, prompt[None, :n], aux_layers=spec.aux_layers)
    drafter.prefill(0, prompt[:n], {k: v[0] for k, v in f.items()})
    tree = drafter.propose(torch.tensor([0]), prompt[n:n + 1], TreeBudget(3, 3, 1))  # a chain
    chain = tree.tokens[0, 1:]
    seq = torch.cat([prompt, chain])[None]
    with torch.no_grad():
        outs = head.unroll(kit.batch(tiny_target, seq, aux_layers=spec.aux_layers), 3)
    tmap = head.token_map
    cum = 1.0
    for k in range(3):
        probs = (head.logit_input(outs[k][0, n - 1]) @ head.draft_head_weight().T).softmax(-1)
        draft_id = int(chain[k]) if tmap is None else int((tmap == chain[k]).nonzero()[0])
        cum *= float(probs[draft_id].detach())
        assert abs(cum - float(tree.scores[0, k + 1])) < 1e-5 * max(cum, 1e-3)


@pytest.mark.parametrize("name", HEADS)
def test_commit_equals_prefilling_everything(tiny_target, kit, name):
    torch.manual_seed(5)
    head = get_head_class(name).from_target(tiny_target, **HEADS[name])
    spec = head.feature_spec()
    seq = torch.randint(0, 256, (20,))
    f = {k: v[0] for k, v in
         kit.features(tiny_target, seq[None], aux_layers=spec.aux_layers).items()}
    budget = TreeBudget(8, 3, 3)
    a = head.new_drafter(tiny_target, max_batch=1, max_len=64)
    a.prefill(0, seq[:12], {k: v[:12] for k, v in f.items()})
    a.propose(torch.tensor([0]), seq[12:13], budget)                 # root 12 proposed...
    a.commit(0, seq[12:15], {k: v[12:15] for k, v in f.items()})     # ...and 2 drafts accepted
    a.commit(0, seq[15:16], {k: v[15:16] for k, v in f.items()})     # a plain step, no propose
    b = head.new_drafter(tiny_target, max_batch=1, max_len=64)
    b.prefill(0, seq[:16], {k: v[:16] for k, v in f.items()})
    ta = a.propose(torch.tensor([0]), seq[16:17], budget)
    tb = b.propose(torch.tensor([0]), seq[16:17], budget)
    assert torch.equal(ta.tokens, tb.tokens) and torch.equal(ta.parents, tb.parents)
    assert torch.allclose(ta.scores, tb.scores, rtol=1e-4)
    a.release(0)
    assert int(a.cache.lens[0]) == 0


@pytest.mark.parametrize("name", HEADS)
def test_a_long_backlog_is_cut_to_its_last_pairs(tiny_target, kit, name):
    """catchup_pairs bounds what one propose runs through the head, shared by its rows: a row
    keeps its last max(16, catchup_pairs // rows) pending pairs and attends to nothing older.
    Rotary attention depends on distances only, so it drafts as a drafter that saw the tail alone."""
    from specdec.heads.eagle import MIN_CATCHUP_WINDOW

    torch.manual_seed(7)
    head = get_head_class(name).from_target(tiny_target, **HEADS[name])
    seq = torch.randint(0, 256, (48,))
    f = {k: v[0] for k, v in kit.features(tiny_target, seq[None],
                                          aux_layers=head.feature_spec().aux_layers).items()}
    budget, n = TreeBudget(8, 3, 3), 40                               # 39 pending pairs
    for rows, pairs in ((1, 4), (2, 40)):
        window = max(MIN_CATCHUP_WINDOW, pairs // rows)                # 16, then 20
        cut = head.new_drafter(tiny_target, max_batch=2, max_len=64, catchup_pairs=pairs,
                                  min_frontier_mass=0.0)
        tail = head.new_drafter(tiny_target, max_batch=2, max_len=64, catchup_pairs=None,
                                   min_frontier_mass=0.0)
        skip = n - 1 - window
        for s in range(rows):
            cut.prefill(s, seq[:n], {k: v[:n] for k, v in f.items()})
            tail.prefill(s, seq[skip:n], {k: v[skip:n] for k, v in f.items()})
        slots, roots = torch.arange(rows), seq[n:n + 1].repeat(rows)
        ta, tb = cut.propose(slots, roots, budget), tail.propose(slots, roots, budget)
        assert torch.equal(ta.tokens, tb.tokens) and torch.equal(ta.parents, tb.parents)
        assert torch.allclose(ta.scores, tb.scores, rtol=1e-4, atol=1e-6)
        assert cut.start[:rows].tolist() == [skip] * rows
        assert cut.cache.lens[:rows].tolist() == [n - 1] * rows       # positions stay absolute
        cut.commit(0, seq[n:n + 2], {k: v[n:n + 2] for k, v in f.items()})
        assert int(cut.cache.lens[0]) == n and int(cut.start[0]) == skip
        cut.release(0)
        assert int(cut.start[0]) == 0 == int(cut.cache.lens[0])
    whole = head.new_drafter(tiny_target, max_batch=1, max_len=64, catchup_pairs=None)
    whole.prefill(0, seq[:n], {k: v[:n] for k, v in f.items()})
    whole.propose(torch.tensor([0]), seq[n:n + 1], budget)
    assert int(whole.start[0]) == 0 and int(whole.cache.lens[0]) == n - 1
    for bad in (0, "many", 2.5):
        with pytest.raises(ValueError, match=f"catchup_pairs={bad!r}"):
            head.new_drafter(tiny_target, catchup_pairs=bad)


@pytest.mark.parametrize("name", HEADS)
def test_a_prompt_with_features_of_its_last_tokens_only_drafts_as_a_cut_catchup(tiny_target, kit, name):
    """A prefix-cache hit hands the drafter features of the prompt's last m tokens only: its
    context then starts at n - m, exactly as a catch-up cut to the last m - 1 pairs."""
    torch.manual_seed(8)
    head = get_head_class(name).from_target(tiny_target, **HEADS[name])
    seq = torch.randint(0, 256, (48,))
    f = {k: v[0] for k, v in kit.features(tiny_target, seq[None],
                                          aux_layers=head.feature_spec().aux_layers).items()}
    n, m, budget = 40, 20, TreeBudget(8, 3, 3)
    part = head.new_drafter(tiny_target, max_len=64, catchup_pairs=None, min_frontier_mass=0.0)
    cut = head.new_drafter(tiny_target, max_len=64, catchup_pairs=m - 1, min_frontier_mass=0.0)
    part.prefill(0, seq[:n], {k: v[n - m:n] for k, v in f.items()})
    cut.prefill(0, seq[:n], {k: v[:n] for k, v in f.items()})
    assert int(part.start[0]) == n - m == int(part.cache.lens[0])
    ta, tb = (d.propose(torch.tensor([0]), seq[n:n + 1], budget) for d in (part, cut))
    assert torch.equal(ta.tokens, tb.tokens) and torch.equal(ta.parents, tb.parents)
    assert torch.allclose(ta.scores, tb.scores, rtol=1e-4, atol=1e-6)
    assert int(part.start[0]) == int(cut.start[0]) and int(part.cache.lens[0]) == n - 1
    with pytest.raises(ValueError, match="features of 41 tokens for a prompt of 40"):
        part.prefill(0, seq[:n], {k: v[:n + 1] for k, v in f.items()})
    assert head.new_drafter(tiny_target, catchup_pairs=512).feature_tail == 64
    assert head.new_drafter(tiny_target, catchup_pairs=None).feature_tail is None


@pytest.mark.parametrize("name", HEADS)
def test_overfitted_head_drafts_the_continuation(tiny_target, kit, greedy_seq, name):
    torch.manual_seed(6)
    head = get_head_class(name).from_target(tiny_target, **HEADS[name])
    spec = head.feature_spec()
    batch = kit.batch(tiny_target, greedy_seq, aux_layers=spec.aux_layers)
    head, _ = kit.train(head, batch, 100, lr=3e-3)
    acc = head.acceptance(batch, 3)
    assert acc["count"][0] == greedy_seq.shape[1] - 1
    assert acc["correct"][0] >= 0.9 * acc["count"][0]
    assert len(acc["confidence"]) == len(acc["hit"]) == len(acc["depth"])
    drafter = head.new_drafter(tiny_target, max_batch=1, max_len=64, min_frontier_mass=0.0)
    f = {k: v[0] for k, v in batch.items() if k in ("hidden", "aux")}
    seq = greedy_seq[0]
    hits = 0
    for n in (16, 22, 28, 34):
        drafter.prefill(0, seq[:n], {k: v[:n] for k, v in f.items()})
        tree = drafter.propose(torch.tensor([0]), seq[n:n + 1], TreeBudget(3, 3, 1))
        hits += tree.top_path(0) == seq[n:n + 4].tolist()
    assert hits >= 3


def test_eagle3_can_start_from_a_target_layer(tiny_target, kit, tmp_path):
    """init_layer copies one target decoder layer into the draft layer (q/k/v split over the
    [embed ; feature] halves) and starts fc passing the highest aux feature through; the head
    still trains from there, keeps init_layer in its saved config, and loads its trained weights
    (loading does not copy the target's layer again)."""
    torch.manual_seed(0)
    head = get_head_class("eagle3").from_target(tiny_target, init_layer=-1, ttt_steps=2)
    src, mine = tiny_target.model.model.layers[-1], head.layers[0]
    w = src.self_attn.q_proj.weight
    assert torch.allclose(mine.self_attn.q_proj.weight, torch.cat([w, w], 1) / 2 ** 0.5)
    assert torch.equal(mine.mlp.down_proj.weight, src.mlp.down_proj.weight)
    assert torch.equal(mine.post_attention_layernorm.weight, src.post_attention_layernorm.weight)
    H = head.config.hidden_size
    aux = torch.randn(2, 5, 3 * H)
    assert torch.allclose(head.fuse_feature(aux), aux[..., -H:])
    seq = torch.randint(0, 256, (2, 24))
    batch = kit.batch(tiny_target, seq, torch.ones_like(seq, dtype=torch.bool),
                      aux_layers=head.feature_spec().aux_layers)
    _, losses = kit.train(head, batch, 20, lr=3e-3)
    assert losses[-1] < 0.9 * losses[0]
    head.save_pretrained(tmp_path / "h")
    loaded = load_head(tmp_path / "h", tiny_target)
    assert loaded.config.init_layer == -1
    assert torch.equal(loaded.layers[0].mlp.down_proj.weight, head.layers[0].mlp.down_proj.weight)
    assert not torch.equal(loaded.layers[0].mlp.down_proj.weight, src.mlp.down_proj.weight)
    with pytest.raises(ValueError, match="init_layer=99"):
        get_head_class("eagle3").from_target(tiny_target, init_layer=99)


def test_eagle3_init_layer_names_a_shape_mismatch(tiny_target):
    """A draft layer shaped unlike the target's layer is refused with the tensor named."""
    from specdec.heads import HeadShapeError

    wider = tiny_target.config.intermediate_size + 8
    with pytest.raises(HeadShapeError, match=r"init_layer=-1: layers\.0\.mlp\.\w+_proj\.weight"):
        get_head_class("eagle3").from_target(tiny_target, intermediate_size=wider, init_layer=-1)
    get_head_class("eagle3").from_target(tiny_target, intermediate_size=wider)  # random init: fine
