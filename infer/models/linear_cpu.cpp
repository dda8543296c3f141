// y = x @ w.T + bias for bf16 x [M, K], w [N, K] on CPUs with AVX2 + FMA but no native bf16.
//
// There PyTorch's bf16 matmul is emulated and grows with the rows: a SmolLM2 step over 16
// tokens cost 5.7x one token, so tree verification never paid. Here each weight row is read
// once per step in bf16, widened to fp32 in registers (a bf16 is the top half of an fp32) and
// multiplied into up to 3 rows of x at a time, fp32 accumulation, one rounding to bf16 at the
// end: the cost stays that of reading the weights until the FMAs catch up (~16 rows on 2 cores).
// DecodeLinear sends single rows to PyTorch's bf16 GEMV (~13% faster a decode step there), so a
// single row here simply takes the general path.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kRowsN = 4;  // weight rows per tile
constexpr int64_t kRowsM = 3;  // x rows per tile: 4 x 3 accumulators + 7 operands fit 16 ymm registers

inline __m256 load_bf16x8(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// One tile: x rows x0..x2 (fp32) times weight rows w0..w3, as fp32 sums over k in the same
// order for every (row, weight row) pair, wherever the row sits in a tile: a row of x gets the same bits
// alone or in a batch. Accumulators are named variables: kept in an array, GCC spilled all 12 to
// the stack on every step of k.
inline void finish(__m256 acc, const float* x, const uint16_t* w, int64_t K8, int64_t K, float* out) {
  float s = hsum(acc);
  for (int64_t k = K8; k < K; ++k) s += x[k] * bf16_to_float(w[k]);
  *out = s;
}

// 3 x 4 from weight rows already widened to fp32 (wf, [4, K], in L1: several row blocks read them).
void tile3x4(const float* const x[3], const float* wf, const uint16_t* const w[4], int64_t K, float out[3][4]) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
  __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00;
  const int64_t K8 = K - K % 8;
  for (int64_t k = 0; k < K8; k += 8) {
    const __m256 w0 = _mm256_loadu_ps(wf + k), w1 = _mm256_loadu_ps(wf + K + k);
    const __m256 w2 = _mm256_loadu_ps(wf + 2 * K + k), w3 = _mm256_loadu_ps(wf + 3 * K + k);
    __m256 xv = _mm256_loadu_ps(x[0] + k);
    a00 = _mm256_fmadd_ps(xv, w0, a00); a01 = _mm256_fmadd_ps(xv, w1, a01);
    a02 = _mm256_fmadd_ps(xv, w2, a02); a03 = _mm256_fmadd_ps(xv, w3, a03);
    xv = _mm256_loadu_ps(x[1] + k);
    a10 = _mm256_fmadd_ps(xv, w0, a10); a11 = _mm256_fmadd_ps(xv, w1, a11);
    a12 = _mm256_fmadd_ps(xv, w2, a12); a13 = _mm256_fmadd_ps(xv, w3, a13);
    xv = _mm256_loadu_ps(x[2] + k);
    a20 = _mm256_fmadd_ps(xv, w0, a20); a21 = _mm256_fmadd_ps(xv, w1, a21);
    a22 = _mm256_fmadd_ps(xv, w2, a22); a23 = _mm256_fmadd_ps(xv, w3, a23);
  }
  const __m256 acc[3][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}};
  for (int m = 0; m < 3; ++m)
    for (int n = 0; n < 4; ++n) finish(acc[m][n], x[m], w[n], K8, K, &out[m][n]);
}

void widen(const uint16_t* src, float* dst, int64_t count) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(dst + i, load_bf16x8(src + i));
  for (; i < count; ++i) dst[i] = bf16_to_float(src[i]);
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "bf16_linear: x [M, K] and w [N, K], got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "bf16_linear: x and w must be bfloat16, got ", x.scalar_type(), " and ", w.scalar_type());
  TORCH_CHECK(x.size(1) == w.size(1), "bf16_linear: x has ", x.size(1), " columns, w ", w.size(1));
  TORCH_CHECK(w.is_contiguous(), "bf16_linear: w must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor xf = x.to(at::kFloat).contiguous();  // [M, K]: small, read once per weight tile
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bf16_linear: bias must be [", N, "], got ", bias->sizes());
    b = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t tiles = (N + kRowsN - 1) / kRowsN;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> wf(kRowsN * K);
    for (int64_t t = begin; t < end; ++t) {
      // a last tile of fewer than 4 weight rows repeats its first row; the extra sums are dropped
      const int64_t n0 = t * kRowsN, nb = std::min(kRowsN, N - n0);
      const uint16_t* w[kRowsN];
      for (int64_t n = 0; n < kRowsN; ++n) w[n] = wp + (n0 + (n < nb ? n : 0)) * K;
      float acc[kRowsM][kRowsN];
      for (int64_t n = 0; n < kRowsN; ++n) widen(w[n], wf.data() + n * K, K);
      for (int64_t m0 = 0; m0 < M; m0 += kRowsM) {
        const int64_t mb = std::min(kRowsM, M - m0);
        const float* x[kRowsM];  // likewise a last block of fewer than 3 rows of x repeats its first row
        for (int64_t m = 0; m < kRowsM; ++m) x[m] = xp + (m0 + (m < mb ? m : 0)) * K;
        tile3x4(x, wf.data(), w, K, acc);
        for (int64_t m = 0; m < mb; ++m)
          for (int64_t n = 0; n < nb; ++n) op[(m0 + m) * N + n0 + n] = acc[m][n] + (bp ? bp[n0 + n] : 0.f);
      }
    }
  });
  return out.to(at::kBFloat16);
}

}  // namespace

TORCH_LIBRARY(specdec_cpu_linear, m) {
  m.def("bf16_linear(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec_cpu_linear, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
}
