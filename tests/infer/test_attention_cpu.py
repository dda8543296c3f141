"""The CPU decode-attention kernel (infer/models/attention_cpu.cpp) computes what SDPA computes:
random queries, caches, slots, lengths and tree masks against the per-row SDPA reference and an
fp32 ground truth; and the lean decoder's bf16 verification gives the same logits with it as
with SDPA."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.infer.models import attention_cpu, linear

needs_kernel = pytest.mark.skipif(attention_cpu.unavailable_reason() is not None,
                                  reason=f"no CPU attention kernel here: {attention_cpu.unavailable_reason()}")


def random_case(gen, batch, heads, rows, head_dim, slots_total, max_len, masked=True):
    """q [B, H, R, D]; a static cache [S, H, max_len, D]; distinct slots; per-row lengths; an
    additive mask [B, 1, R, width] that hides random keys but never a row's first one."""
    q = torch.randn(batch, heads, rows, head_dim, generator=gen).bfloat16()
    k = torch.randn(slots_total, heads, max_len, head_dim, generator=gen).bfloat16()
    v = torch.randn(slots_total, heads, max_len, head_dim, generator=gen).bfloat16()
    slots = torch.randperm(slots_total, generator=gen)[:batch]
    lengths = torch.randint(1, max_len + 1, (batch,), generator=gen)
    width = int(lengths.max())
    mask = None
    if masked:
        hide = torch.rand(batch, 1, rows, width, generator=gen) < 0.3
        hide[..., 0] = False
        mask = torch.zeros(batch, 1, rows, width).masked_fill_(hide, float("-inf")).bfloat16()
    return q, k, v, mask, slots, lengths


def fp32_truth(q, k, v, mask, scale, slots, lengths):
    out = torch.empty(q.shape)
    for b in range(q.shape[0]):
        n, s = int(lengths[b]), int(slots[b])
        m = None if mask is None else mask[b:b + 1, :, :, :n].float()
        out[b] = F.scaled_dot_product_attention(q[b:b + 1].float(), k[s:s + 1, :, :n].float(),
                                                v[s:s + 1, :, :n].float(), attn_mask=m, scale=scale)[0]
    return out


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("batch,rows,max_len", [(1, 1, 1), (1, 3, 700), (5, 3, 37), (4, 8, 130),
                                                (2, 12, 300), (1, 39, 257)])
@pytest.mark.parametrize("masked", [True, False])
def test_kernel_matches_sdpa(head_dim, batch, rows, max_len, masked):
    gen = torch.Generator().manual_seed(batch * 1000 + rows * 10 + max_len)
    q, k, v, mask, slots, lengths = random_case(gen, batch, 3, rows, head_dim, batch + 2, max_len, masked)
    scale = head_dim ** -0.5
    got = attention_cpu.attend(q, k, v, mask, scale, slots, lengths)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    truth = fp32_truth(q, k, v, mask, scale, slots, lengths)
    want = attention_cpu.reference(q, k, v, mask, scale, slots, lengths)
    # bf16 outputs: each within a rounding step of the fp32 truth, as SDPA's own bf16 result is
    torch.testing.assert_close(got.float(), truth, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("nodes", [2, 7])  # 6 query rows (the direct score path), 21 (the gathered one)
def test_a_tree_node_gets_the_bits_of_the_same_token_decoded_alone(head_dim, nodes):
    """Greedy speculation in bf16 is exact only if a verified node's attention equals the plain
    decode step's bit for bit: its ancestors sit apart in the tree's slots, hidden keys in between,
    more query rows beside it, where plain decoding reads consecutive keys with 3 rows. A sum
    taken in another order shows in a bf16 output only now and then, so many cases are checked."""
    heads, group, ctx = 3, 3, 61
    parents = [-1, 0, 0, 1, 2, 3, 3][:nodes]
    mask = torch.full((1, 1, group * nodes, ctx + nodes), float("-inf"))
    paths = []
    for i in range(nodes):
        path, j = [], i
        while j >= 0:
            path.insert(0, j)
            j = parents[j]
        paths.append(path)
        mask[0, 0, group * i:group * (i + 1), :ctx] = 0
        mask[0, 0, group * i:group * (i + 1), [ctx + j for j in path]] = 0
    mask = mask.bfloat16()
    gen = torch.Generator().manual_seed(nodes * 7 + head_dim)
    differ = 0
    for _ in range(30):
        k = torch.randn(1, heads, ctx + nodes, head_dim, generator=gen).bfloat16()
        v = torch.randn(1, heads, ctx + nodes, head_dim, generator=gen).bfloat16()
        q = (3 * torch.randn(1, heads, group * nodes, head_dim, generator=gen)).bfloat16()  # peaked rows
        tree = attention_cpu.attend(q, k, v, mask, head_dim ** -0.5)
        for i, path in enumerate(paths):  # plain decoding: the context, then the path's keys in a row
            keep = list(range(ctx)) + [ctx + j for j in path]
            rows = slice(group * i, group * (i + 1))
            alone = attention_cpu.attend(q[:, :, rows].contiguous(), k[:, :, keep].contiguous(),
                                         v[:, :, keep].contiguous(), None, head_dim ** -0.5)
            differ += int((tree[:, :, rows] != alone).sum())
    assert differ == 0


@needs_kernel
@pytest.mark.parametrize("rows", [6, 21, 39])
def test_rows_split_over_the_threads_keep_their_bits(rows):
    """At batch 1 the kernel splits a tree's rows into blocks so that two threads share its 3 kv
    heads; at batch 2 it does not. A sequence alone must get the bits it gets beside another."""
    gen = torch.Generator().manual_seed(rows)
    q, k, v, mask, slots, lengths = random_case(gen, 2, 3, rows, 64, 2, 200)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        pair = attention_cpu.attend(q, k, v, mask, 0.125, slots, lengths)
        for b in range(2):
            alone = attention_cpu.attend(q[b:b + 1], k, v, mask[b:b + 1], 0.125, slots[b:b + 1], lengths[b:b + 1])
            assert torch.equal(alone, pair[b:b + 1])
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_attend_tokens_writes_the_new_keys_then_reads_them_like_the_folded_layout():
    """The decoder's one call a layer: the valid new tokens' K/V land at their positions in their
    cache rows (nothing else moves), then query head h of each token reads kv head h // g (GQA), with
    the bits of the folded layout (a kv head's g x N query rows; the mask repeated per group)."""
    gen = torch.Generator().manual_seed(5)
    B, N, KV, g, D, S, L = 2, 4, 2, 3, 64, 3, 40
    q = torch.randn(B, N, KV * g, D, generator=gen).bfloat16()
    k_new, v_new = (torch.randn(B, N, KV, D, generator=gen).bfloat16() for _ in range(2))
    k, v = (torch.randn(S, KV, L, D, generator=gen).bfloat16() for _ in range(2))
    slots, base = torch.tensor([2, 0]), torch.tensor([10, 20])
    valid = torch.tensor([[True, True, True, True], [True, True, True, False]])
    ends = base + valid.sum(1)
    cols = torch.arange(int(ends.max()))
    t = torch.arange(N)
    see = (cols < base[:, None, None] + t[None, :, None])  # the prefix and the chain up to each token
    see &= torch.rand(B, N, len(cols), generator=gen) > 0.2  # a tree hides some
    see |= cols == base[:, None, None] + t[None, :, None]   # ... never the token itself
    mask = torch.zeros(B, 1, N, len(cols)).masked_fill_(~see[:, None], float("-inf")).bfloat16()
    want_k, want_v = k.clone(), v.clone()
    for b in range(B):
        for i in range(N):
            if valid[b, i]:
                want_k[slots[b], :, base[b] + i] = k_new[b, i]
                want_v[slots[b], :, base[b] + i] = v_new[b, i]
    out = attention_cpu.attend_tokens(q, k, v, mask, 0.125, slots, ends, k_new, v_new, base, valid)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    folded = attention_cpu.attend(q.transpose(1, 2).reshape(B, KV, g * N, D), k, v, mask.repeat(1, 1, g, 1),
                                  0.125, slots, ends)
    want = folded.reshape(B, KV * g, N, D).transpose(1, 2)
    assert torch.equal(out[valid], want[valid])
    truth = attention_cpu.reference(q.transpose(1, 2), k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                    mask, 0.125, slots, ends).transpose(1, 2)
    torch.testing.assert_close(out[valid].float(), truth[valid].float(), atol=1e-2, rtol=1e-2)


@needs_kernel
def test_defaults_read_every_row_in_order_and_a_strided_view():
    """No slots/lengths: row b is cache row b with all its keys; a view of a longer cache (rows
    strided by max_len) reads only the viewed keys; a mask broadcast over batch and heads works."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(3, 3, 3, 64, generator=gen).bfloat16()
    cache_k = torch.randn(4, 3, 512, 64, generator=gen).bfloat16()
    cache_v = torch.randn(4, 3, 512, 64, generator=gen).bfloat16()
    k, v = cache_k[:3, :, :100], cache_v[:3, :, :100]
    mask = torch.zeros(1, 1, 3, 100).bfloat16()
    mask[..., 50:] = float("-inf")
    got = attention_cpu.attend(q, k, v, mask, 0.125)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask.float(), scale=0.125)
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)


@needs_kernel
def test_bad_inputs_name_the_problem():
    q = torch.randn(1, 3, 3, 64).bfloat16()
    k = torch.randn(2, 3, 10, 64).bfloat16()
    with pytest.raises(RuntimeError, match="bf16"):
        attention_cpu.attend(q.float(), k.float(), k.float(), None, 0.1)
    with pytest.raises(RuntimeError, match="head_dim 64 or 128"):
        attention_cpu.attend(q[..., :32], k[..., :32], k[..., :32], None, 0.1)
    with pytest.raises(RuntimeError, match="outside the cache"):
        attention_cpu.attend(q, k, k, None, 0.1, torch.tensor([2]))
    with pytest.raises(RuntimeError, match="reads 11 keys of 10"):
        attention_cpu.attend(q, k, k, None, 0.1, None, torch.tensor([11]))
    with pytest.raises(RuntimeError, match="mask"):
        attention_cpu.attend(q, k, k, torch.zeros(1, 1, 3, 4).bfloat16(), 0.1)
    # a write past the cache's end is refused before anything is written
    v, before = k.clone(), k.clone()
    new = torch.randn(1, 2, 3, 64).bfloat16()
    with pytest.raises(RuntimeError, match="writes position 10 outside the cache's 10"):
        attention_cpu.attend_tokens(q[:, :2], k, v, None, 0.1, None, None, new, new, torch.tensor([9]))
    assert torch.equal(k, before) and torch.equal(v, before)


def test_takes_bf16_decode_steps_on_cpu_with_its_head_dims():
    cpu = torch.device("cpu")
    assert not attention_cpu.takes(torch.float32, cpu, 64)  # fp32 stays SDPA (the exact tests)
    assert not attention_cpu.takes(torch.bfloat16, cpu, 32)
    available = attention_cpu.unavailable_reason() is None
    assert attention_cpu.takes(torch.bfloat16, cpu, 64) == available
    assert attention_cpu.takes(torch.bfloat16, cpu, 128) == available


def verify_ragged(target):
    """Logits of a ragged batch of plain rows in scattered slots, then of two 13-node trees."""
    from specdec.heads.tree import DraftTree
    from specdec.infer.runner import TargetRunner

    runner = TargetRunner(target, max_batch=4, max_len=128, impl="lean")
    gen = torch.Generator().manual_seed(0)
    lengths, slots = [60, 5, 33], [3, 0, 2]
    for slot, n in zip(slots, lengths):
        runner.prefill(slot, torch.randint(256, (n,), generator=gen))
    roots = DraftTree(tokens=torch.randint(256, (3, 1), generator=gen), parents=torch.full((3, 1), -1),
                      valid=torch.ones(3, 1, dtype=torch.bool))
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3, 3, 4, 5, 6, 8, 9]] * 2)
    trees = DraftTree(tokens=torch.randint(256, (2, 13), generator=gen), parents=parents,
                      valid=torch.ones(2, 13, dtype=torch.bool))
    return [runner.verify(slots, roots, lengths)[0].float(), runner.verify([3, 0], trees, [60, 5])[0].float()]


@needs_kernel
def test_lean_verification_with_the_kernel_is_as_close_to_fp32_as_sdpa(tmp_path, monkeypatch):
    """bf16, head_dim 64: plain rows and trees in a ragged batch score as close to the fp32 model
    with the kernel as with SDPA (bf16 drifts either way), and the kernel did run."""
    from specdec.infer.target import load_target
    from specdec.infer.tiny import build_tiny_target

    folder = build_tiny_target(tmp_path / "t", seed=1, hidden_size=256, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=256, num_hidden_layers=2)
    exact = verify_ragged(load_target(str(folder), dtype="float32"))
    bf16 = load_target(str(folder), dtype="bfloat16")
    calls = []
    real = attention_cpu.attend_tokens
    monkeypatch.setattr(attention_cpu, "attend_tokens", lambda *a: calls.append(a[0].shape) or real(*a))
    with_kernel = verify_ragged(bf16)
    # the prefills (60, 5, 33 tokens), plain rows (1 token) and the trees (13), 4 query heads each
    assert {tuple(s[1:3]) for s in calls} == {(60, 4), (5, 4), (33, 4), (1, 4), (13, 4)}
    monkeypatch.setattr(attention_cpu, "takes", lambda *a: False)
    with_sdpa = verify_ragged(bf16)
    for want, kern, sdpa in zip(exact, with_kernel, with_sdpa):
        kern_err, sdpa_err = (kern - want).abs().max(), (sdpa - want).abs().max()
        assert kern_err <= 1.5 * sdpa_err + 0.05, (kern_err, sdpa_err)
        assert (kern.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@needs_kernel
def test_a_causal_prefill_row_gets_the_bits_it_gets_alone():
    """A 250-row causal block (six row blocks of 48, each reading keys only up to the last its
    mask leaves present) gives every row exactly what that row computes alone over its own keys:
    what makes a prompt prefilled whole, in chunks or behind a prefix-cache hit the same bits."""
    gen = torch.Generator().manual_seed(7)
    n, scale = 250, 64 ** -0.5
    q, k, v = (torch.randn(1, 2, n, 64, generator=gen).bfloat16() for _ in range(3))
    causal = torch.zeros(1, 1, n, n).masked_fill_(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    whole = attention_cpu.attend(q, k, v, causal.bfloat16(), scale)
    torch.testing.assert_close(whole.float(), attention_cpu.reference(q, k, v, causal, scale).float(),
                               atol=2e-2, rtol=2e-2)
    for i in [0, 1, 47, 48, 95, 96, 240, 249]:
        alone = attention_cpu.attend(q[:, :, i:i + 1], k, v, None, scale, lengths=torch.tensor([i + 1]))
        assert torch.equal(whole[:, :, i:i + 1], alone), i


needs_native_linear = pytest.mark.skipif(
    linear.NATIVE_BF16_KERNEL.unavailable_reason() is not None,
    reason=f"no native bf16 linear kernel here: {linear.NATIVE_BF16_KERNEL.unavailable_reason()}")


@needs_kernel
@needs_native_linear
def test_bf16_logits_do_not_depend_on_chunking_or_batching(tmp_path):
    """With both CPU kernels, a 300-token prompt's bf16 logits and features are the same bits
    prefilled whole, in chunks of 128 (as chunked prefill and a prefix-cache hit run it), or padded
    beside a shorter prompt; and so is the next decoded token's. Before the kernels served prefill,
    SDPA's causal kernel and oneDNN gave each layout its own roundings, and greedy replies drifted
    with the batch and the cache."""
    from specdec.infer.runner import TargetRunner
    from specdec.infer.target import load_target
    from specdec.infer.tiny import build_tiny_target

    folder = build_tiny_target(tmp_path / "t", seed=3, hidden_size=256, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=512, num_hidden_layers=2)
    runner = TargetRunner(load_target(str(folder), dtype="bfloat16"), max_batch=4, max_len=400, impl="lean")
    gen = torch.Generator().manual_seed(0)
    ids, other = torch.randint(256, (300,), generator=gen), torch.randint(256, (37,), generator=gen)
    whole, whole_feats = runner.prefill(0, ids)
    for start in range(0, 300, 128):
        chunked, chunk_feats = runner.prefill(1, ids[start:start + 128], start=start)
    batched, batch_feats = runner.prefill_batch([2, 3], [other, ids])
    assert torch.equal(whole, chunked) and torch.equal(whole, batched[1])
    for name, feat in whole_feats.items():
        assert torch.equal(feat[-44:], chunk_feats[name]) and torch.equal(feat, batch_feats[1][name]), name
    nxt = whole.argmax().view(1)
    after = [runner.prefill(slot, nxt, start=300)[0] for slot in (0, 1, 3)]
    assert torch.equal(after[0], after[1]) and torch.equal(after[0], after[2])
    assert runner.backend.prefill_piece is not None  # the kernel bounds a forward's tokens ...
    runner.backend.prefill_piece = 100                # ... and pieces change no bit either
    pieced, pieced_feats = runner.prefill(2, ids)
    assert torch.equal(whole, pieced) and all(torch.equal(f, pieced_feats[k]) for k, f in whole_feats.items())
