"""A loaded draft head's blocks in their fused decoding form (infer/models/head_fusion.py) compute
what the training forward computes, draft the same trees, and leave the parameters alone."""
from __future__ import annotations

import copy

import pytest
import torch

from specdec.heads import TreeBudget, get_head_class
from specdec.infer.models import glue_cpu
from specdec.infer.models.head_fusion import fuse_for_decoding

needs_kernel = pytest.mark.skipif(glue_cpu.unavailable_reason() is not None,
                                  reason=f"no CPU glue kernel here: {glue_cpu.unavailable_reason()}")


def _layer_inputs(head, dtype, B=2, T=5, P=7, seed=0):
    """Random (features, tokens, cos, sin, mask, past K/V) for one draft layer call."""
    gen = torch.Generator().manual_seed(seed)
    c, attn = head.config, head.layers[0].self_attn
    feature = torch.randn(B, T, c.hidden_size, generator=gen).to(dtype)
    tokens = torch.randint(0, c.vocab_size, (B, T), generator=gen)
    positions = P + torch.arange(T)[None].expand(B, T)
    cos, sin = head.rotary(positions, dtype)
    past = tuple(torch.randn(B, attn.num_kv_heads, P, attn.head_dim, generator=gen).to(dtype) for _ in range(2))
    mask = torch.rand(B, T, P + T, generator=gen) < 0.7
    mask[..., P:] = torch.tril(torch.ones(T, T, dtype=torch.bool))      # each query sees itself
    return feature, tokens, cos, sin, mask, past


@needs_kernel
@pytest.mark.parametrize("head_type", ["eagle3", "eagle"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_step_matches_the_training_forward(tiny_target, head_type, dtype):
    torch.manual_seed(0)
    head = get_head_class(head_type).from_target(tiny_target).to(dtype).eval()
    fused = copy.deepcopy(head)
    state = {k: v.clone() for k, v in fused.state_dict().items()}
    assert fuse_for_decoding(fused) >= 4  # norms, attention, MLP, rotary
    inputs = _layer_inputs(head, dtype)
    with torch.no_grad():
        feature = head.fuse_feature(inputs[0]) if head_type == "eagle" else inputs[0][..., :head.config.hidden_size]
        want_out, (want_k, want_v) = head.layer_step(feature, *inputs[1:])
        got_out, (got_k, got_v) = fused.layer_step(feature, *inputs[1:])
        positions = torch.tensor([[0, 3, 1500]])
        for a, b in zip(head.rotary(positions, dtype), fused.rotary(positions, dtype)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_k, want_k, **tol)
    torch.testing.assert_close(got_v, want_v, **tol)
    torch.testing.assert_close(got_out, want_out, **tol)
    assert all(torch.equal(v, state[k]) for k, v in fused.state_dict().items()), "fusion changed a parameter"


@needs_kernel
def test_fused_drafter_proposes_the_same_tree(tiny_target):
    """fp32 EAGLE-3 drafting, fused or not: the same tokens in the same shape."""
    from specdec.infer.runner import TargetRunner

    torch.manual_seed(1)
    head = get_head_class("eagle3").from_target(tiny_target, draft_vocab_size=64).eval()
    fused = copy.deepcopy(head)
    fuse_for_decoding(fused)
    runner = TargetRunner(tiny_target, max_batch=2, max_len=64, feature_spec=head.feature_spec())
    prompt = torch.randint(0, tiny_target.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    budget = TreeBudget(max_nodes=8, max_depth=3, topk=3)
    trees = []
    for h in (head, fused):
        drafter = h.new_drafter(tiny_target)
        drafter.reset(2, 64)
        for slot in range(2):
            _, feats = runner.prefill_batch([slot], [prompt[slot].tolist()])
            drafter.prefill(slot, prompt[slot], feats[0])
        trees.append(drafter.propose(torch.tensor([0, 1]), torch.tensor([5, 6]), budget))
    assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(trees[0].parents, trees[1].parents)
    torch.testing.assert_close(trees[0].scores, trees[1].scores, rtol=1e-4, atol=1e-5)


def test_a_head_on_a_device_without_the_kernels_is_left_as_it_is(tiny_target, monkeypatch):
    monkeypatch.setattr(glue_cpu, "available", lambda dtype, device: False)
    head = get_head_class("eagle3").from_target(tiny_target)
    assert fuse_for_decoding(head) == 1  # the rotary table alone (no parameters, plain PyTorch)
    assert "forward" not in vars(head.layers[0].self_attn)


@needs_kernel
def test_drafting_in_the_cache_matches_the_copied_tree(tmp_path):
    """bf16, head_dim 64: a fused EAGLE-3 drafter that writes its K/V through the CPU attention
    kernel (committed pairs at their positions, tree levels after the root) computes what the
    drafter that copies its cache and runs SDPA computes, over ragged prompts, a cut catch-up and
    several propose -> commit rounds; it keeps the same cache; and the kernel ran."""
    from specdec.heads.layers import appends_to_cache
    from specdec.infer.models import attention_cpu
    from specdec.infer.target import load_target
    from specdec.infer.tiny import build_tiny_target

    if not attention_cpu.takes(torch.bfloat16, torch.device("cpu"), 64):
        pytest.skip(f"no CPU attention kernel here: {attention_cpu.unavailable_reason()}")
    folder = build_tiny_target(tmp_path / "t", seed=4, hidden_size=128, num_attention_heads=2,
                               num_key_value_heads=1, intermediate_size=256, num_hidden_layers=3)
    target = load_target(str(folder), dtype="bfloat16")
    torch.manual_seed(3)
    head = get_head_class("eagle3").from_target(target, draft_vocab_size=64).to(torch.bfloat16).eval()
    fuse_for_decoding(head)
    assert appends_to_cache(head)
    gen = torch.Generator().manual_seed(5)
    width = head.fc.in_features
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (9, 23)]
    feats = [{"aux": torch.randn(n, width, generator=gen).bfloat16()} for n in (9, 23)]
    # at most 16 catch-up pairs a row: the longer prompt's head context starts at pair 6
    drafters = [head.new_drafter(target, catchup_pairs=16, min_frontier_mass=0) for _ in range(2)]
    for d in drafters:
        d.reset(2, 64)
        d.in_cache = d is drafters[0]
        for slot in range(2):
            d.prefill(slot, prompts[slot], feats[slot])
    # every layer call of a propose: (its tokens, its output); bf16 roundings may send the two
    # drafters' trees apart at a near tie, so outputs are compared where the inputs are the same
    calls, kernel_calls = ([], []), []
    real_step, real_kernel = head.layer_step, attention_cpu.attend_tokens
    budget = TreeBudget(max_nodes=6, max_depth=3, topk=3)
    compared = 0
    try:
        attention_cpu.attend_tokens = lambda *a: kernel_calls.append(a[0].shape) or real_kernel(*a)
        for rnd in range(4):
            roots = torch.randint(0, 256, (2,), generator=gen)
            trees = []
            for d, seen in zip(drafters, calls):
                seen.clear()
                head.layer_step = lambda f, t, *a, seen=seen: (lambda r: seen.append((t, r[0].float())) or r)(
                    real_step(f, t, *a))
                trees.append(d.propose(torch.tensor([0, 1]), roots, budget))
            assert len(calls[0]) == len(calls[1]) == budget.max_depth  # the catch-up + 2 tree levels
            for (tok, got), (tok_ref, want) in zip(*calls):
                if torch.equal(tok, tok_ref):  # bf16 roundings apart (<= 0.6%; the root key missed: ~5%)
                    assert (got - want).abs().max() <= 0.02 * want.abs().max(), rnd
                    compared += 1
            torch.testing.assert_close(trees[0].scores[:, :4], trees[1].scores[:, :4], rtol=0.05, atol=0.02)
            for slot in range(2):  # both accept the root and one draft (or the root alone)
                n = 1 + (rnd + slot) % 2
                committed = torch.cat([roots[slot:slot + 1], trees[0].tokens[slot, 1:n]])
                new_feats = {"aux": torch.randn(n, width, generator=gen).bfloat16()}
                for d in drafters:
                    d.commit(slot, committed, new_feats)
    finally:
        head.layer_step, attention_cpu.attend_tokens = real_step, real_kernel
    assert compared >= 8 and kernel_calls, (compared, len(kernel_calls))
    assert drafters[0].start.tolist() == drafters[1].start.tolist() == [0, 6]
    kern, copied = drafters[0].cache, drafters[1].cache
    assert torch.equal(kern.lens, copied.lens)
    for slot in range(2):  # the same committed K/V (only the attention differs between the paths)
        n = int(kern.lens[slot])
        assert torch.equal(kern.k[slot, :, :n], copied.k[slot, :, :n])
        assert torch.equal(kern.v[slot, :, :n], copied.v[slot, :, :n])
