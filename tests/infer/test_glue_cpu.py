"""The layer-glue kernels (infer/models/glue_cpu.cpp) compute what their PyTorch references
compute: bit for bit where the order of operations is the same (the residual add, RoPE, SiLU(gate)
* up in bf16, the argmax), within one rounding step where it is not (the norm's sum of squares); a row's
result does not depend on the other rows; bad inputs name the problem; and the lean decoder
scores the same with and without them."""
from __future__ import annotations

import pytest
import torch

from specdec.infer.models import glue_cpu

needs_kernel = pytest.mark.skipif(glue_cpu.unavailable_reason() is not None,
                                  reason=f"no CPU glue kernel here: {glue_cpu.unavailable_reason()}")
DTYPES = [torch.float32, torch.bfloat16]


def ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference in units of the dtype's rounding step at the reference's magnitude."""
    eps = torch.finfo(want.dtype).eps
    step = want.float().abs().clamp_min(1e-30) * eps
    return float(((got.float() - want.float()).abs() / step).max())


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 576), (2, 13, 576), (3, 70, 100), (1, 7)])  # decode, tree, prefill, odd width
def test_norms_match_the_reference(dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=gen) * 4).to(dtype)
    delta = torch.randn(*shape, generator=gen).to(dtype)
    w = (1 + 0.3 * torch.randn(shape[-1], generator=gen)).to(dtype)
    got = glue_cpu.rms_norm(x, w, 1e-5)
    assert got.shape == x.shape and got.dtype == dtype
    assert ulps(got, glue_cpu.reference_rms_norm(x, w, 1e-5)) <= 4.0  # only the sum's order differs
    s, n = glue_cpu.add_rms_norm(x, delta, w, 1e-5)
    want_s, want_n = glue_cpu.reference_add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(s, want_s)  # one rounded add, as PyTorch's
    assert ulps(n, want_n) <= 4.0


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,n,head_dim,heads,kv", [(1, 1, 64, 9, 3), (2, 13, 64, 9, 3), (3, 5, 128, 4, 2),
                                                       (1, 40, 48, 2, 1)])  # 48: a scalar tail per half
def test_rope_rotates_q_and_k_in_place_exactly(dtype, batch, n, head_dim, heads, kv):
    gen = torch.Generator().manual_seed(batch * 100 + n)
    qkv = torch.randn(batch, n, (heads + 2 * kv) * head_dim, generator=gen).to(dtype)
    cos = torch.randn(batch, n, head_dim, generator=gen).to(dtype)
    sin = torch.randn(batch, n, head_dim, generator=gen).to(dtype)
    got, want = qkv.clone(), qkv.clone()
    glue_cpu.rope_(got, cos, sin, heads + kv)
    glue_cpu.reference_rope_(want, cos, sin, heads + kv)
    assert torch.equal(got, want)
    v = (heads + kv) * head_dim
    assert torch.equal(got[..., v:], qkv[..., v:])  # the v heads are left alone
    assert not torch.equal(got[..., :v], qkv[..., :v])


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 3072), (2, 13, 3072), (4, 9, 20)])  # 20: gate/up of 10, a tail of 2
def test_silu_mul_matches_the_reference(dtype, shape):
    gen = torch.Generator().manual_seed(shape[-1])
    gate_up = (torch.randn(*shape, generator=gen) * 4).to(dtype)
    gate_up[..., 0] = 100.0  # far in both tails of the exp
    gate_up[..., 1] = -100.0
    got, want = glue_cpu.silu_mul(gate_up), glue_cpu.reference_silu_mul(gate_up)
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype
    if dtype == torch.bfloat16:  # fp32 arithmetic rounded once to bf16: the exp's last bits do not show
        torch.testing.assert_close(got, want, atol=0, rtol=torch.finfo(dtype).eps)
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_is_torchs_max_indices_with_ties_nans_and_infinities(dtype):
    """Greedy decoding's token: the first index of the largest logit, the first NaN if there is
    one, as ``max(-1).indices``. Small integers force ties inside and across the kernel's lanes;
    widths 1-70 cover the scalar path, the vector loop and its tail."""
    gen = torch.Generator().manual_seed(7)
    for width in list(range(1, 71)) + [8192, 49152]:
        x = torch.randint(-3, 3, (4, width), generator=gen).float()
        u = torch.rand(4, width, generator=gen)
        x[u < 0.02] = float("nan")
        x[(u >= 0.02) & (u < 0.06)] = float("inf")
        x[(u >= 0.06) & (u < 0.10)] = -float("inf")
        x[0] = -float("inf")            # nothing above the first: index 0
        x[1, width // 2:] = 2.5         # a tie from the middle on (if nothing larger came before)
        x = x.to(dtype)
        got = glue_cpu.argmax_last(x)
        assert got.dtype == torch.long and torch.equal(got, x.max(-1).indices), width
    logits = torch.randn(3, 9, 49152, generator=gen).to(dtype)   # a verification's [B, N, V]
    assert torch.equal(glue_cpu.argmax_last(logits), logits.max(-1).indices)
    assert torch.equal(glue_cpu.argmax_last(logits[:, 2]), logits[:, 2].max(-1).indices)  # strided view


@needs_kernel
def test_a_row_does_not_depend_on_the_rows_beside_it():
    """Decoding (1 row) and verification (many rows, one call split over threads) must score a
    row alike: the lossless guarantee rests on it."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(300, 576, generator=gen).bfloat16()
    w = torch.randn(576, generator=gen).bfloat16()
    gate_up = torch.randn(300, 3072, generator=gen).bfloat16()
    many, one = glue_cpu.rms_norm(x, w, 1e-6), glue_cpu.rms_norm(x[123:124].clone(), w, 1e-6)
    assert torch.equal(many[123:124], one)
    assert torch.equal(glue_cpu.silu_mul(gate_up)[7:8], glue_cpu.silu_mul(gate_up[7:8].clone()))


@needs_kernel
def test_bad_inputs_name_the_problem():
    x = torch.randn(2, 8).bfloat16()
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        glue_cpu.rms_norm(x.double(), x[0].double(), 1e-6)
    with pytest.raises(RuntimeError, match="against weight"):
        glue_cpu.rms_norm(x, torch.ones(7).bfloat16(), 1e-6)
    with pytest.raises(RuntimeError, match="weight"):
        glue_cpu.rms_norm(x, torch.ones(8), 1e-6)  # fp32 weight for bf16 x
    with pytest.raises(RuntimeError, match="delta"):
        glue_cpu.add_rms_norm(x, x[:1], torch.ones(8).bfloat16(), 1e-6)
    with pytest.raises(RuntimeError, match="do not fit"):
        glue_cpu.rope_(torch.zeros(1, 1, 64).bfloat16(), torch.zeros(1, 1, 32).bfloat16(),
                       torch.zeros(1, 1, 32).bfloat16(), 3)
    with pytest.raises(RuntimeError, match="contiguous"):
        glue_cpu.silu_mul(torch.zeros(4, 6).bfloat16().t())
    with pytest.raises(RuntimeError, match="0 < V"):
        glue_cpu.argmax_last(torch.zeros(3, 0))
    cache, one = torch.zeros(2, 3, 8, 4), torch.tensor([1])
    with pytest.raises(RuntimeError, match="outside"):  # a position past max_len moves nothing
        glue_cpu.move_positions_([cache], one, torch.tensor([8]), one)
    with pytest.raises(RuntimeError, match="contiguous CPU"):
        glue_cpu.move_positions_([cache.transpose(1, 2)], one, one, one)


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_lean_decoder_scores_alike_with_and_without_the_kernels(tmp_path, dtype):
    """A Llama-shaped target's prefill and tree verification: the same logits and features with
    the kernels as with the PyTorch ops (fp32 to rounding, bf16 within its own drift), and the
    kernels did serve it."""
    from specdec.heads.base import FeatureSpec
    from specdec.heads.tree import DraftTree
    from specdec.infer.runner import TargetRunner
    from specdec.infer.target import load_target
    from specdec.infer.tiny import build_tiny_target

    folder = build_tiny_target(tmp_path / "t", seed=2, hidden_size=128, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=256, num_hidden_layers=3)
    target = load_target(str(folder), dtype=dtype)
    spec = FeatureSpec(hidden=True, aux_layers=(0, 1, 3))
    prompt = torch.randint(256, (21,), generator=torch.Generator().manual_seed(5))
    results = []
    for fused in (True, False):
        gen = torch.Generator().manual_seed(6)
        runner = TargetRunner(target, max_batch=1, max_len=64, feature_spec=spec, impl="lean")
        layers = runner.backend.layers
        assert layers[0].fused_rope and layers[0].fused_silu and layers[0].ln1.fused  # built with them
        for layer in layers:
            layer.fused_rope = layer.fused_silu = layer.ln1.fused = layer.ln2.fused = fused
        runner.backend.norm.fused = fused
        logits, feats = runner.prefill(0, prompt)
        tree = DraftTree(tokens=torch.cat([logits.argmax().view(1, 1), torch.randint(256, (1, 8), generator=gen)], 1),
                         parents=torch.tensor([[-1, 0, 0, 1, 1, 2, 3, 3, 5]]), valid=torch.ones(1, 9, dtype=torch.bool))
        tree_logits, tree_feats = runner.verify([0], tree, [21])
        results.append([logits, feats["aux"], tree_logits, tree_feats["hidden"]])
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == "float32" else dict(atol=0.1, rtol=0.05)
    for got, want in zip(*results):
        torch.testing.assert_close(got.float(), want.float(), **tol)
