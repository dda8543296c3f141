// y = x @ w.T + bias for bf16 x [..., K] (M rows) on CPUs that compute bf16 natively (AVX512-BF16).
//
// oneDNN's prepacked bf16 linear costs ~18 us a call before any arithmetic, 120 calls in a
// SmolLM2 decode step, and read the weights at 15-30 GB/s there. This kernel reads each weight
// once per call, in a layout packed for it (``pack_rows`` in linear.py: groups of 64 output rows,
// each k-pair of the 64 rows in one 128-byte run), and multiplies it into up to 6 rows of x at a
// time with VDPBF16PS: 64 outputs x 6 rows = 24 fp32 accumulators in registers, one rounding to
// bf16 at the end. Measured on the 2-core AVX-512-BF16 EPYC, the 121 projections of a step with
// cold weights: 1 row 11.2 -> 8.1 ms, 12 rows (a tree) 13-16 -> 9.4-10.5 ms.
//
// Every output sums its k-pairs in the same order whatever the number of rows and wherever its
// row sits in a tile, so a row gets the same bits alone or in a batch: verifying a tree computes
// exactly what decoding one token computes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kGroup = 64;       // output rows per packed group: 4 zmm of 16 fp32 lanes
constexpr int64_t kRowsM = 6;        // rows of x per tile: 4 x 6 accumulators + 4 weights + 1 x of 32 zmm
constexpr int64_t kPrefetch = 1024;  // bf16 elements ahead (8 k-pairs): the hardware prefetcher alone
                                     // left ~20% of the bandwidth of a cold weight unused

template <int MS>
void tile(const uint32_t* __restrict x, int64_t KP, const uint16_t* __restrict w, const float* __restrict bias,
          uint16_t* __restrict y, int64_t N, int64_t n_valid) {
  __m512 acc[4][MS];
  for (int j = 0; j < 4; ++j)
    for (int i = 0; i < MS; ++i) acc[j][i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < KP; ++p) {
    const uint16_t* wp = w + p * kGroup * 2;
    for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetch + 32 * j), _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 64), w3 = (__m512bh)_mm512_loadu_si512(wp + 96);
    for (int i = 0; i < MS; ++i) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i * KP + p]));  // x[i, 2p..2p+1]
      acc[0][i] = _mm512_dpbf16_ps(acc[0][i], w0, xb);
      acc[1][i] = _mm512_dpbf16_ps(acc[1][i], w1, xb);
      acc[2][i] = _mm512_dpbf16_ps(acc[2][i], w2, xb);
      acc[3][i] = _mm512_dpbf16_ps(acc[3][i], w3, xb);
    }
  }
  for (int j = 0; j < 4 && 16 * j < n_valid; ++j) {  // the last group may hold padding rows
    const int64_t left = n_valid - 16 * j;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();
    for (int i = 0; i < MS; ++i) {
      const __m256bh r = _mm512_cvtneps_pbh(_mm512_add_ps(acc[j][i], b));  // round to nearest even
      _mm256_mask_storeu_epi16(y + i * N + 16 * j, mask, (__m256i)r);
    }
  }
}

// A tile of `rows` (1..kRowsM) rows of x, with the accumulators sized at compile time.
template <int MS>
void tile_of(int rows, const uint32_t* x, int64_t KP, const uint16_t* w, const float* bias, uint16_t* y,
             int64_t N, int64_t n_valid) {
  if constexpr (MS > 1) {
    if (rows < MS) return tile_of<MS - 1>(rows, x, KP, w, bias, y, N, n_valid);
  }
  tile<MS>(x, KP, w, bias, y, N, n_valid);
}

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                  int64_t N) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.scalar_type() == at::kBFloat16,
              "linear_bf16: x must be bfloat16 [..., K], got ", x_in.scalar_type(), " ", x_in.sizes());
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kGroup && packed.size(3) == 2 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "linear_bf16: packed must be contiguous bfloat16 [groups, K/2, 64, 2], got ", packed.sizes());
  const at::Tensor x = x_in.contiguous();
  // x [..., K] as M rows: the leading axes stay in the output, no reshape around the call
  const int64_t K = x.size(-1), M = K ? x.numel() / K : 0, groups = packed.size(0), KP = packed.size(1);
  TORCH_CHECK(K == 2 * KP, "linear_bf16: x has ", K, " columns, the packed weight ", 2 * KP);
  TORCH_CHECK(N > (groups - 1) * kGroup && N <= groups * kGroup, "linear_bf16: ", N,
              " outputs do not fit the packed weight's ", groups, " groups of ", kGroup);
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "linear_bf16: bias must be contiguous float32 [", N, "], got ", bias->scalar_type(), " ", bias->sizes());
    bp = bias->data_ptr<float>();
  }
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  const auto* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());  // pairs of bf16
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * kGroup;
      for (int64_t m0 = 0; m0 < M; m0 += kRowsM) {
        tile_of<kRowsM>(static_cast<int>(std::min(kRowsM, M - m0)), xp + m0 * KP, KP, wp + g * KP * kGroup * 2,
                        bp ? bp + n0 : nullptr, yp + m0 * N + n0, N, std::min(kGroup, N - n0));
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(specdec_cpu_linear_bf16, m) {
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec_cpu_linear_bf16, CPU, m) {
  m.impl("linear", &linear);
}
