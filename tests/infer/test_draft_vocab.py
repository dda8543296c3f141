"""Full-vocabulary heads draft over their most frequent training tokens (DraftLogits): the
trainer's token counts travel with the head, the drafters score only those rows, and output
stays exactly plain greedy (fp32, tiny target)."""
from __future__ import annotations

import pytest
import torch

from specdec.heads import get_head_class, load_head
from specdec.heads.base import TOKEN_COUNTS_FILE, HeadShapeError
from specdec.heads.tree import TreeBudget
from specdec.infer.engine import Engine
from specdec.infer.models.linear import FrequentVocabLinear
from specdec.infer.requests import SamplingParams

from .test_engine import plain_outputs, prompts_of, run  # noqa: F401  (plain_outputs: a fixture)

# Heads whose drafting layer spans the target's whole vocabulary (EAGLE-3 has its own reduced one).
FULL_VOCAB_HEADS = ["medusa", "hydra", "mlp_speculator", "redrafter", "draft_lm", "eagle"]


def _counts(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1000, (vocab,), generator=torch.Generator().manual_seed(seed))


def test_counts_pick_the_most_frequent_tokens_and_travel_with_the_head(tiny_target, tmp_path):
    torch.manual_seed(0)
    head = get_head_class("medusa").from_target(tiny_target)
    V = head.config.vocab_size
    assert head.frequent_tokens(4) is None                      # no counts yet: full vocabulary
    counts = torch.zeros(V, dtype=torch.long)
    counts[[7, 3, 9, 5]] = torch.tensor([50, 20, 20, 10])       # 3 and 9 tie: the lower id first
    head.set_draft_vocab(counts)
    assert head.frequent_tokens(3).tolist() == [3, 7, 9]
    assert head.frequent_tokens(0) is None and head.frequent_tokens(V) is None
    for bad in (-1, "many", 2.5):
        with pytest.raises(ValueError, match="draft_vocab must be an integer"):
            head.new_drafter(tiny_target, draft_vocab=bad)
    head.save_pretrained(tmp_path / "h")
    loaded = load_head(tmp_path / "h", tiny_target)
    assert torch.equal(loaded.token_counts, counts)
    # EAGLE-3 chooses its own reduced vocabulary from the counts and keeps no second copy
    e3 = get_head_class("eagle3").from_target(tiny_target)
    e3.set_draft_vocab(counts)
    e3.save_pretrained(tmp_path / "e3")
    assert not (tmp_path / "e3" / TOKEN_COUNTS_FILE).exists()


def test_wrong_shaped_counts_name_the_file_and_shapes(tiny_target, tmp_path):
    from safetensors.torch import save_file

    head = get_head_class("medusa").from_target(tiny_target)
    head.save_pretrained(tmp_path / "h")
    save_file({"token_counts": torch.zeros(5, dtype=torch.long)}, str(tmp_path / "h" / TOKEN_COUNTS_FILE))
    with pytest.raises(HeadShapeError, match=rf"{TOKEN_COUNTS_FILE}.*\[{head.config.vocab_size}\].*\(5,\)"):
        load_head(tmp_path / "h", tiny_target)


def test_frequent_vocab_linear_scores_the_kept_rows_exactly():
    torch.manual_seed(0)
    weight, bias, x = torch.randn(40, 8), torch.randn(40), torch.randn(3, 8)
    keep = torch.tensor([1, 4, 5, 30])
    out = FrequentVocabLinear(weight, bias, keep)(x)
    full = torch.nn.functional.linear(x, weight, bias)
    assert out.shape == full.shape
    torch.testing.assert_close(out[:, keep], full[:, keep])
    others = torch.ones(40, dtype=torch.bool)
    others[keep] = False
    assert (out[:, others] == torch.finfo(out.dtype).min).all()
    probs = out.softmax(-1)
    assert (probs[:, others] == 0).all() and torch.allclose(probs.sum(-1), torch.ones(3))


@pytest.mark.parametrize("head_type", FULL_VOCAB_HEADS)
def test_pruned_heads_draft_only_frequent_tokens_and_stay_lossless(tiny_target, plain_outputs, head_type):
    torch.manual_seed(0)
    head = get_head_class(head_type).from_target(tiny_target).eval()
    V = head.config.vocab_size
    head.set_draft_vocab(_counts(V))
    keep = set(head.frequent_tokens(V // 4).tolist())

    def drafted_tokens(draft_vocab: int) -> tuple[set, dict]:
        drafter = head.new_drafter(tiny_target, draft_vocab=draft_vocab)
        seen, propose = set(), drafter.propose

        def spy(slots, roots, budget):
            tree = propose(slots, roots, budget)
            seen.update(tree.tokens[:, 1:][tree.valid[:, 1:]].tolist())
            return tree

        drafter.propose = spy
        engine = Engine(tiny_target, drafter, max_batch=4, max_len=256)
        final = run(engine, prompts_of(tiny_target.tokenizer, 4), SamplingParams(max_tokens=24, ignore_eos=True),
                    budget=TreeBudget(8, 4, 2))
        return seen, final

    seen, final = drafted_tokens(V // 4)
    assert seen and seen <= keep, sorted(seen - keep)[:10]
    for rid, out in final.items():
        assert out.token_ids == plain_outputs[rid].token_ids[:24], (head_type, rid)
    unpruned, _ = drafted_tokens(0)     # the same head over its whole vocabulary drafts others too
    assert unpruned - keep


def test_a_sampled_pruned_chain_carries_distributions_over_the_kept_tokens(tiny_target):
    """Sampling stays lossless only if each drafted token was drawn from the q it reports: q is 0
    outside the kept tokens and sums to 1 over them."""
    torch.manual_seed(0)
    head = get_head_class("draft_lm").from_target(tiny_target).eval()
    V = head.config.vocab_size
    head.set_draft_vocab(_counts(V, seed=1))
    keep = head.frequent_tokens(V // 4)
    drafter = head.new_drafter(tiny_target, temperature=1.0, seed=0, draft_vocab=V // 4)
    engine = Engine(tiny_target, drafter, max_batch=1, max_len=128)
    trees, propose = [], drafter.propose
    drafter.propose = lambda *a: trees.append(propose(*a)) or trees[-1]
    run(engine, prompts_of(tiny_target.tokenizer, 1), SamplingParams(max_tokens=16, temperature=1.0, seed=0,
                                                                       ignore_eos=True))
    assert any(tree.valid[:, 1:].any() for tree in trees)
    outside = torch.ones(V, dtype=torch.bool)
    outside[keep] = False
    for tree in trees:
        q = tree.draft_probs[tree.valid][1:].float()                  # the drafted nodes' q(. | parent)
        assert (q[:, outside] == 0).all()
        torch.testing.assert_close(q.sum(-1), torch.ones(q.shape[0]))
        assert not outside[tree.tokens[tree.valid][1:]].any()
