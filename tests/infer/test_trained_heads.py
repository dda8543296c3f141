"""Trained heads on the embedded target (SmolLM2-135M-Instruct, fp32): speculative greedy decoding
through the runtime API reproduces plain greedy decoding token for token, batch 1 and a ragged
batch 4, while the head's drafts are actually accepted.

A randomly initialised head (tests/infer/test_engine.py) proposes tokens the target almost never
accepts, so verification rarely goes past the root. Here every registered head type is *trained*
(Adam on ``head.loss``) on the target's own greedy replies to the test prompts: overfitted to them,
it drafts tokens the target accepts, so each step commits several tokens and the runner compacts
the accepted path's K/V in place. The acceptance rate (tau) is asserted, so a head that silently
stopped drafting cannot pass the equality check by degenerating to plain decoding.

Kept lean for 2 shared cores (~80 s): short replies, one plain reference for all heads, small
head settings (fewer drafted depths, narrow vocabulary-sized layers where the config allows) and
only as many Adam steps as each type needs to clear MIN_TAU with a wide margin (tau 1.75-3.4).
"""
from __future__ import annotations

import pytest
import torch

from specdec.heads import TreeBudget, get_head_class, head_types
from specdec.infer.api import LLM, SamplingParams

NEW_TOKENS = 24
QUESTIONS = ["Write a short story about a robot who learns to paint.",
             "Explain photosynthesis to a child.",
             "List five fruits and their colors.",
             "hi"]                                     # chat prompts of 4 different lengths
BUDGET = TreeBudget(max_nodes=8, max_depth=4, topk=2)
MIN_TAU = 1.3        # mean tokens committed per target forward; 1.0 = no draft ever accepted

# Per head type: (from_target fields, Adam steps, learning rate). Small where the config allows:
# fewer drafted depths, a narrow MLPSpeculator state / ReDrafter exit (their vocabulary-sized
# matrices shrink with it), one draft_lm layer, a small EAGLE-3 draft vocabulary. A head type
# missing here still runs, with its defaults.
HEADS = {
    "medusa": (dict(num_heads=2), 4, 3e-3),
    "hydra": (dict(num_heads=2), 4, 3e-3),
    "eagle": ({}, 12, 1e-3),
    "eagle3": (dict(draft_vocab_size=256, ttt_steps=3), 14, 3e-3),
    "mlp_speculator": (dict(n_predict=2, inner_dim=128), 12, 3e-3),
    "draft_lm": (dict(num_layers=1), 4, 3e-3),
    "redrafter": (dict(next_n=2, exit_dim=128), 10, 3e-3),
}
DEFAULT = ({}, 20, 1e-3)


def _tau(outputs) -> float:
    """Tokens committed per decode step over all outputs: (accepted drafts + 1) / steps."""
    accepted = [a for out in outputs for a in out.stats["accepted_per_step"]]
    return sum(a + 1 for a in accepted) / max(len(accepted), 1)


@pytest.fixture(scope="module")
def reference(smollm2):
    """The chat prompts (token ids, ragged) and each one's plain greedy reply, decoded alone."""
    plain = LLM(smollm2, method="plain", max_batch=1, max_len=256)
    prompts = [plain.encode(q, chat=True) for q in QUESTIONS]
    assert len({len(p) for p in prompts}) == len(prompts), "the prompts must be ragged"
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    replies = [plain.generate([p], params)[0].token_ids for p in prompts]
    assert all(len(r) == NEW_TOKENS for r in replies)
    return prompts, replies


@pytest.fixture(scope="module")
def training_batch(smollm2, reference):
    """Capture-format batch of prompt + plain reply for the 4 prompts (right padded, loss on
    the reply tokens only), with every hidden state so any head's aux layers can be taken."""
    prompts, replies = reference
    seqs = [p + r for p, r in zip(prompts, replies)]
    B, T = len(seqs), max(map(len, seqs))
    ids = torch.zeros(B, T, dtype=torch.long)                       # [B, T]
    attn = torch.zeros(B, T, dtype=torch.bool)
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    for b, (p, s) in enumerate(zip(prompts, seqs)):
        ids[b, :len(s)] = torch.tensor(s)
        attn[b, :len(s)] = True
        loss_mask[b, len(p):len(s)] = True
    with torch.no_grad():
        states = smollm2.model(ids, attention_mask=attn, output_hidden_states=True).hidden_states
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask,
            "hidden": states[-1]}, states                        # hidden: final, post-norm


@pytest.fixture(scope="module")
def trained_heads(smollm2, training_batch, train_head):
    """head type -> (head overfitted on the reference replies, its losses); trained on first use
    and shared by the batch-1 and batch-4 tests."""
    batch, states = training_batch
    cache = {}

    def get(head_type: str):
        if head_type not in cache:
            fields, steps, lr = HEADS.get(head_type, DEFAULT)
            torch.manual_seed(0)
            head = get_head_class(head_type).from_target(smollm2, **fields)
            spec = head.feature_spec()
            b = dict(batch)
            if spec.aux_layers:
                b["aux"] = torch.cat([states[i] for i in spec.aux_layers], dim=-1)  # [B, T, A*H]
            counts = torch.bincount(b["input_ids"][b["loss_mask"]], minlength=smollm2.vocab_size)
            head.set_draft_vocab(counts)         # EAGLE-3: the reply tokens; others: no-op
            cache[head_type] = train_head(head, b, steps, lr, fused=True)
        return cache[head_type]

    return get


@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("head_type", head_types())
def test_trained_head_is_lossless_and_accepted(smollm2, reference, trained_heads, head_type, batch_size):
    """A head of this type, trained on the target's own greedy replies, drives speculative greedy
    decoding (batch 1, or all 4 ragged chat prompts in one engine run, fp32) to exactly the plain
    greedy tokens, with mean accepted length tau >= MIN_TAU: multi-token acceptance and in-place
    K/V compaction are exercised, not just the root-only path."""
    head, losses = trained_heads(head_type)
    assert losses[-1] < losses[0], f"{head_type}: training did not lower the loss: {losses}"
    prompts, replies = reference
    which = [1] if batch_size == 1 else list(range(len(prompts)))
    llm = LLM(smollm2, method=head.method_name(), head=head, max_batch=batch_size, max_len=256)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([prompts[i] for i in which], params, budget=BUDGET)
    for i, out in zip(which, outs):
        got, want = out.token_ids, replies[i]
        first = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        assert got == want, (f"{head_type} batch {batch_size} prompt {i}: first difference at "
                             f"generated position {first}: {got[first:first + 4]} != {want[first:first + 4]}")
    tau = _tau(outs)
    print(f"{head_type} batch {batch_size}: tau {tau:.2f}, loss {losses[0]:.2f} -> {losses[-1]:.2f}")
    assert tau >= MIN_TAU, (f"{head_type} batch {batch_size}: tau {tau:.2f} < {MIN_TAU}: "
                            "the trained head's drafts are barely accepted")


@pytest.mark.parametrize("head_type", ["eagle", "eagle3", "draft_lm"])
def test_a_fused_trained_head_is_lossless_and_accepted(smollm2, reference, trained_heads, head_type):
    """The same heads with their blocks in the fused decoding form that ``load_draft_head`` gives
    a loaded head (infer/models/head_fusion.py): still exact, still accepted (ragged batch 4)."""
    import copy

    from specdec.infer.models.head_fusion import fuse_for_decoding

    head = copy.deepcopy(trained_heads(head_type)[0])
    assert fuse_for_decoding(head) > 0
    prompts, replies = reference
    llm = LLM(smollm2, method=head.method_name(), head=head, max_batch=len(prompts), max_len=256)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), budget=BUDGET)
    assert [out.token_ids for out in outs] == replies
    assert _tau(outs) >= MIN_TAU, f"{head_type} fused: tau {_tau(outs):.2f} < {MIN_TAU}"
