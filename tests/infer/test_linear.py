"""DecodeLinear: oneDNN-prepacked projections compute what F.linear computes."""
import pytest
import torch
import torch.nn.functional as F

from specdec.infer.models.linear import DecodeLinear, _can_pack


@pytest.mark.skipif(not _can_pack(torch.zeros(1, dtype=torch.bfloat16)),
                    reason="needs a CPU with oneDNN bf16 (AVX512-BF16)")
@pytest.mark.parametrize("rows", [(1, 1), (2, 7), (3, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_bf16_matches_f_linear(rows, with_bias):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).bfloat16()                  # [out, in]
    b = torch.randn(96, generator=g).bfloat16() if with_bias else None
    x = torch.randn(*rows, 64, generator=g).bfloat16()               # [B, N, in]
    lin = DecodeLinear(w, b)
    assert lin.packed is not None
    got, want = lin(x), F.linear(x, w, b)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not _can_pack(torch.zeros(1)), reason="needs oneDNN (mkldnn) on the CPU")
@pytest.mark.parametrize("rows", [1, 16])
def test_fp32_is_packed_and_equal_up_to_rounding(rows):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    x = torch.randn(2, rows, 64, generator=g)
    lin = DecodeLinear(w, b)
    assert lin.packed is not None
    got = lin(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_emulated_bf16_is_not_packed(monkeypatch):
    """Without AVX512-BF16, oneDNN's packed bf16 path is missing or slow: keep F.linear."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    w, x = torch.randn(8, 4).bfloat16(), torch.randn(2, 3, 4).bfloat16()
    lin = DecodeLinear(w)
    assert lin.packed is None
    assert torch.equal(lin(x), F.linear(x, w))


@pytest.mark.skipif(not _can_pack(torch.zeros(1, dtype=torch.bfloat16)),
                    reason="needs a CPU with oneDNN bf16 (AVX512-BF16)")
def test_pack_linears_keeps_outputs_and_state_dict():
    from specdec.infer.models.linear import pack_linears

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 16, bias=False)).bfloat16()
    x = torch.randn(2, 5, 32).bfloat16()
    with torch.no_grad():
        want = net(x)
        keys = list(net.state_dict())
        assert pack_linears(net) == 2
        got = net(x)
    assert list(net.state_dict()) == keys
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not _can_pack(torch.zeros(1, dtype=torch.bfloat16)),
                    reason="needs a CPU with oneDNN bf16 (AVX512-BF16)")
def test_pack_linears_leaves_the_vocabulary_sized_layers_to_the_drafter():
    from specdec.infer.models.linear import DecodeLinear, pack_linears

    net = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 100)).bfloat16()
    assert pack_linears(net, skip_out_features=100) == 1
    assert isinstance(net[0].forward, DecodeLinear) and not isinstance(net[1].forward, DecodeLinear)
