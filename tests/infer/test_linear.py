"""DecodeLinear: oneDNN-prepacked projections compute what F.linear computes."""
import pytest
import torch
import torch.nn.functional as F

from specdec.infer.models.linear import NATIVE_BF16_KERNEL, DecodeLinear, _can_pack


@pytest.mark.skipif(not _can_pack(torch.zeros(1, dtype=torch.bfloat16)),
                    reason="needs a CPU with oneDNN bf16 (AVX512-BF16)")
@pytest.mark.parametrize("rows", [(1, 1), (2, 7), (3, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_bf16_matches_f_linear(rows, with_bias, monkeypatch):
    """Where the native kernel (below) cannot be had, oneDNN's packed weight serves bf16."""
    monkeypatch.setattr(NATIVE_BF16_KERNEL, "get", lambda: None)
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
    """Without AVX512-BF16, oneDNN's packed bf16 path is missing or slow: the AVX2 kernel
    (below) or F.linear serves it."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(NATIVE_BF16_KERNEL, "get", lambda: None)  # built already on an AVX512-BF16 CPU
    w, x = torch.randn(8, 4).bfloat16(), torch.randn(2, 3, 4).bfloat16()
    lin = DecodeLinear(w)
    assert lin.packed is None and lin.native is None
    torch.testing.assert_close(lin(x).float(), F.linear(x.float(), w.float()), rtol=2 ** -8, atol=1e-4)


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


# ---------------------------------------------------------------------------- linear_cpu.cpp

def random_linear(shape, with_bias):
    """bf16 x [m, k], w [n, k] and an optional bias [n] for a kernel test, seeded by the shape."""
    m, k, n = shape
    g = torch.Generator().manual_seed(m * 1000 + k)
    x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    return x, w, torch.randn(n, generator=g).bfloat16() if with_bias else None


def assert_one_rounding(got, x, w, b):
    """bf16 [m, n] within one rounding of the fp32 sum."""
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-4)


from specdec.infer.models.linear import BF16_KERNEL  # noqa: E402

needs_kernel = pytest.mark.skipif(BF16_KERNEL.unavailable_reason() is not None,
                                  reason=f"no bf16 linear kernel here: {BF16_KERNEL.unavailable_reason()}")


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 64, 96), (2, 13, 7), (3, 576, 3072), (16, 72, 33), (33, 8, 5)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_kernel_matches_fp32_maths(shape, with_bias):
    """One rounding of an fp32 sum: within bf16's half-ulp of the exact product, for any M, K
    (tails past multiples of 8) and N (tails past tiles of 4)."""
    x, w, b = random_linear(shape, with_bias)
    assert_one_rounding(BF16_KERNEL.get()(x, w, b), x, w, b)


@needs_kernel
def test_bf16_kernel_gives_each_row_the_same_bits_at_any_batch():
    """Verification (many rows) computes exactly what one-token decoding (one row) computes."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(21, 200, generator=g).bfloat16(), torch.randn(50, 200, generator=g).bfloat16()
    b = torch.randn(50, generator=g).bfloat16()
    op = BF16_KERNEL.get()
    together = op(x, w, b)
    assert torch.equal(together, torch.cat([op(x[i:i + 1], w, b) for i in range(len(x))]))
    assert torch.equal(together[:7], op(x[:7], w, b))


@needs_kernel
def test_decode_linear_routes_emulated_bf16_through_the_kernel(monkeypatch):
    calls = []
    op = BF16_KERNEL.get()
    monkeypatch.setattr(BF16_KERNEL, "_op", lambda *a: calls.append(a[0].shape) or op(*a))
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(12, 40, generator=g).bfloat16(), torch.randn(2, 3, 40, generator=g).bfloat16()
    lin = DecodeLinear(w)
    assert lin.packed is None and lin.kernel is not None
    got = lin(x)
    assert calls == [(6, 40)] and got.shape == (2, 3, 12)
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float()), rtol=2 ** -8, atol=1e-4)
    assert torch.equal(lin(x[:1, :1]), F.linear(x[:1, :1], w)) and len(calls) == 1  # one row: GEMV


@needs_kernel
def test_bf16_kernel_names_bad_input():
    op = BF16_KERNEL.get()
    x, w = torch.randn(2, 8).bfloat16(), torch.randn(4, 8).bfloat16()
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        op(x.float(), w)
    with pytest.raises(RuntimeError, match="x has 7 columns, w 8"):
        op(x[:, :7], w)
    with pytest.raises(RuntimeError, match=r"bias must be \[4\]"):
        op(x, w, torch.zeros(3).bfloat16())


def test_cpp_kernel_switched_off_by_its_environment_variable(monkeypatch, tmp_path):
    from specdec.infer.models.cpp_kernels import CppKernel

    monkeypatch.setenv("SPECDEC_TEST_KERNEL", "0")
    off = CppKernel("x", tmp_path / "x.cpp", [], "x.y", "test", "SPECDEC_TEST_KERNEL", lambda: None)
    assert off.get() is None and off.unavailable_reason() == "SPECDEC_TEST_KERNEL=0"
    monkeypatch.delenv("SPECDEC_TEST_KERNEL")
    cpu = CppKernel("x", tmp_path / "x.cpp", [], "x.y", "test", "SPECDEC_TEST_KERNEL", lambda: "no AVX2")
    assert cpu.get() is None and cpu.unavailable_reason() == "no AVX2"
    with pytest.warns(RuntimeWarning, match="the CPU test kernel is unavailable"):
        missing = CppKernel("specdec_missing", tmp_path / "missing.cpp", [], "x.y", "test",
                            "SPECDEC_TEST_KERNEL", lambda: None)
        assert missing.get() is None
    assert missing.unavailable_reason()


# ---------------------------------------------------------------------- linear_bf16_cpu.cpp

from specdec.infer.models.linear import pack_rows  # noqa: E402

needs_native = pytest.mark.skipif(NATIVE_BF16_KERNEL.unavailable_reason() is not None,
                                  reason=f"no native bf16 kernel here: {NATIVE_BF16_KERNEL.unavailable_reason()}")


def test_pack_rows_groups_64_rows_by_pairs_of_columns():
    w = torch.arange(70 * 6, dtype=torch.float32).view(70, 6).bfloat16()
    packed = pack_rows(w)
    assert packed.shape == (2, 3, 64, 2)
    for n, k in [(0, 0), (5, 3), (63, 5), (64, 0), (69, 4)]:
        assert packed[n // 64, k // 2, n % 64, k % 2] == w[n, k]
    assert not packed[1, :, 6:].any()  # rows 70-127 pad the last group with zeros


@needs_native
@pytest.mark.parametrize("shape", [(1, 64, 96), (7, 576, 1000), (13, 32, 5), (40, 130, 129), (6, 1536, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_kernel_matches_fp32_maths(shape, with_bias):
    """One rounding of an fp32 sum, for row counts past tiles of 6 and outputs past groups of 64
    and vectors of 16."""
    x, w, b = random_linear(shape, with_bias)
    lin = DecodeLinear(w, b)
    assert lin.native is not None and lin.packed is None
    assert_one_rounding(lin(x), x, w, b)


@needs_native
def test_native_kernel_gives_each_row_the_same_bits_at_any_batch():
    """Verifying a tree (many rows) computes exactly what decoding one token (one row) computes."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(23, 200, generator=g).bfloat16(), torch.randn(150, 200, generator=g).bfloat16()
    lin = DecodeLinear(w, torch.randn(150, generator=g).bfloat16())
    together = lin(x)
    assert torch.equal(together, torch.cat([lin(x[i:i + 1]) for i in range(len(x))]))
    assert torch.equal(together[5:12], lin(x[5:12]))


@needs_native
def test_decode_linear_sends_prefill_sized_calls_to_the_kernel_too():
    """A 600-row prefill call takes the kernel, so a prompt's rows get the bits they get alone
    (chunked prefill and the prefix cache then change nothing)."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 40, generator=g).bfloat16()
    lin = DecodeLinear(w)
    op, packed, bias = lin.native
    calls = []
    lin.native = (lambda *a: calls.append(a[0].shape) or op(*a), packed, bias)
    small, big = torch.randn(2, 3, 40, generator=g).bfloat16(), torch.randn(600, 40, generator=g).bfloat16()
    out = lin(small)  # leading axes go to the kernel as they are, with the rows' own bits
    assert out.shape == (2, 3, 16) and calls == [(2, 3, 40)]
    assert torch.equal(out, lin(small.reshape(6, 40)).reshape(2, 3, 16))
    whole = lin(big)
    assert calls[2] == (600, 40)
    assert torch.equal(whole[:7], lin(big[:7])) and torch.equal(whole[599:], lin(big[599:]))
    assert DecodeLinear(torch.randn(16, 41).bfloat16()).native is None  # an odd width has no pairs


@needs_native
def test_native_kernel_names_bad_input():
    op = NATIVE_BF16_KERNEL.get()
    w = torch.randn(70, 8).bfloat16()
    packed, x = pack_rows(w), torch.randn(2, 8).bfloat16()
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        op(x.float(), packed, None, 70)
    with pytest.raises(RuntimeError, match="x has 6 columns, the packed weight 8"):
        op(x[:, :6], packed, None, 70)
    with pytest.raises(RuntimeError, match="200 outputs do not fit the packed weight's 2 groups"):
        op(x, packed, None, 200)
    with pytest.raises(RuntimeError, match=r"bias must be contiguous float32 \[70\]"):
        op(x, packed, torch.zeros(70).bfloat16(), 70)
