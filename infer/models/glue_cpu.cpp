// The element-wise glue of a Llama decoder layer, one op each, for fp32 and bf16 on AVX2 CPUs:
// RMSNorm (alone, or after the residual add), RoPE over the q and k heads of a fused qkv output
// in place, SiLU(gate) * up; and two more small pieces of a decode step, the argmax of the logits
// and a commit's K/V moves. In PyTorch each is 3-8 ops (the moves 60 per commit); at decode sizes
// (1-40 rows of 576) an op costs its dispatch, not its arithmetic, and a 30-layer step paid
// ~1,000 of them. Each op rounds where PyTorch's op sequence rounds (to the dtype after every
// element-wise op, the norm in fp32), so the results are the PyTorch path's but for the order of
// the norm's sum of squares and the exp inside SiLU (within one rounding step of the dtype). Rows
// are independent: a row's result does not depend on the other rows of the call. See glue_cpu.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>

namespace {

// Rows per parallel_for task, for rows of `width` elements: a decode step's few rows stay on the
// calling thread (waking the other one costs more than they do); a prefill chunk is split.
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

// -- 8 lanes of float from / to the storage dtype; `round` is what storing and reloading does ----
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline __m256 round8(const float*, __m256 v) { return v; }

inline __m256 load8(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
// round to nearest even on the upper 16 bits (torch's conversion; NaN stays NaN), bits in 32-bit lanes
inline __m256i bf16_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(_mm256_srli_epi32(rounded, 16), _mm256_set1_epi32(0x7fc0), nan);
}
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i b = bf16_bits(v);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline __m256 round8(const at::BFloat16*, __m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16));
}
template <typename T>
inline float round1(float v) { return static_cast<float>(static_cast<T>(v)); }

// exp(x), Cephes' polynomial (as attention_cpu.cpp); +inf past the float range as std::exp (so
// silu(-100) is -0 as PyTorch has it), and below -87.3 exp(-87.3), whose 1 + exp(...) is 1 anyway
inline __m256 exp8(__m256 x) {
  const __m256 overflow = _mm256_cmp_ps(x, _mm256_set1_ps(88.72283935546875f), _CMP_GT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_blendv_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), _mm256_set1_ps(INFINITY), overflow);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// f(float{}) or f(at::BFloat16{}): the two dtypes the ops take (check_dtype ran first)
template <typename Fn>
void dispatch(at::ScalarType t, Fn fn) {
  if (t == at::kFloat)
    fn(float{});
  else
    fn(at::BFloat16{});
}

void check_dtype(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16), op,
              ": float32 or bfloat16 CPU tensors only, got ", t.scalar_type(), " on ", t.device());
}

// -- RMSNorm, HF's form: weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), the statistics in fp32 --
template <typename T>
void norm_rows(const T* x, const T* delta, const T* w, float eps, int64_t rows, int64_t H, T* sum, T* out) {
  const int64_t H8 = H - H % 8;
  at::parallel_for(0, rows, grain(H), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* xi = x + i * H;
      const T* src = xi;
      if (delta) {  // x + delta, rounded to the dtype as PyTorch's add is; the norm reads that
        const T* di = delta + i * H;
        T* si = sum + i * H;
        for (int64_t j = 0; j < H8; j += 8) store8(si + j, _mm256_add_ps(load8(xi + j), load8(di + j)));
        for (int64_t j = H8; j < H; ++j) si[j] = T(float(xi[j]) + float(di[j]));
        src = si;
      }
      __m256 acc = _mm256_setzero_ps();
      for (int64_t j = 0; j < H8; j += 8) {
        const __m256 v = load8(src + j);
        acc = _mm256_fmadd_ps(v, v, acc);
      }
      float ss = hsum(acc);
      for (int64_t j = H8; j < H; ++j) ss += float(src[j]) * float(src[j]);
      const float inv = 1.f / std::sqrt(ss / float(H) + eps);
      const __m256 vinv = _mm256_set1_ps(inv);
      T* oi = out + i * H;
      for (int64_t j = 0; j < H8; j += 8)
        store8(oi + j, _mm256_mul_ps(load8(w + j), round8(oi, _mm256_mul_ps(load8(src + j), vinv))));
      for (int64_t j = H8; j < H; ++j) oi[j] = T(float(w[j]) * round1<T>(float(src[j]) * inv));
    }
  });
}

void check_norm(const at::Tensor& x, const at::Tensor& w, const char* op) {
  check_dtype(x, op);
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), op, ": x and weight must be contiguous");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), op, ": x is ", x.scalar_type(), ", weight ", w.scalar_type());
  TORCH_CHECK(w.dim() == 1 && x.size(-1) == w.size(0), op, ": x [..., ", x.size(-1), "] against weight ", w.sizes());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_norm(x, w, "rms_norm");
  auto out = at::empty_like(x);
  const int64_t H = x.size(-1), rows = x.numel() / H;
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), nullptr, w.data_ptr<scalar_t>(), float(eps), rows, H, nullptr,
                        out.data_ptr<scalar_t>());
  });
  return out;
}

// (x + delta, rms_norm(x + delta)): a residual add and the norm after it in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w,
                                                double eps) {
  check_norm(x, w, "add_rms_norm");
  TORCH_CHECK(delta.is_contiguous() && delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type(),
              "add_rms_norm: delta ", delta.sizes(), " ", delta.scalar_type(), " against x ", x.sizes(), " ",
              x.scalar_type());
  auto sum = at::empty_like(x), out = at::empty_like(x);
  const int64_t H = x.size(-1), rows = x.numel() / H;
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), float(eps),
                        rows, H, sum.data_ptr<scalar_t>(), out.data_ptr<scalar_t>());
  });
  return {sum, out};
}

// -- RoPE in place on the first `heads` heads of each row of qkv [B, N, F] (the q heads, then the
// k heads; v after them is left alone), cos/sin [B, N, head_dim] in qkv's dtype: HF's
// x * cos + rotate_half(x) * sin, each product and the sum rounded to the dtype --
template <typename T>
void rope_rows(T* p, const T* c, const T* s, int64_t rows, int64_t F, int64_t D, int64_t heads) {
  const int64_t half = D / 2, half8 = half - half % 8;
  at::parallel_for(0, rows, grain(heads * D), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T *ci = c + i * D, *si = s + i * D;
      for (int64_t h = 0; h < heads; ++h) {
        T* x = p + i * F + h * D;
        for (int64_t j = 0; j < half8; j += 8) {
          const __m256 a = load8(x + j), b = load8(x + j + half);
          const __m256 lo = _mm256_sub_ps(round8(x, _mm256_mul_ps(a, load8(ci + j))),
                                          round8(x, _mm256_mul_ps(b, load8(si + j))));
          const __m256 hi = _mm256_add_ps(round8(x, _mm256_mul_ps(b, load8(ci + j + half))),
                                          round8(x, _mm256_mul_ps(a, load8(si + j + half))));
          store8(x + j, lo);
          store8(x + j + half, hi);
        }
        for (int64_t j = half8; j < half; ++j) {
          const float a = float(x[j]), b = float(x[j + half]);
          x[j] = T(round1<T>(a * float(ci[j])) - round1<T>(b * float(si[j])));
          x[j + half] = T(round1<T>(b * float(ci[j + half])) + round1<T>(a * float(si[j + half])));
        }
      }
    }
  });
}

void rope_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  check_dtype(qkv, "rope_");
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous(), "rope_: qkv must be a contiguous [B, N, F], got ", qkv.sizes());
  TORCH_CHECK(cos.dim() == 3 && cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes(),
              "rope_: cos and sin must be contiguous [B, N, head_dim] of one shape");
  TORCH_CHECK(cos.size(0) == qkv.size(0) && cos.size(1) == qkv.size(1), "rope_: cos ", cos.sizes(), " against qkv ",
              qkv.sizes());
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "rope_: cos and sin must be ", qkv.scalar_type(), " like qkv");
  const int64_t D = cos.size(2), F = qkv.size(2), rows = qkv.size(0) * qkv.size(1);
  TORCH_CHECK(D % 2 == 0 && heads >= 0 && heads * D <= F, "rope_: ", heads, " heads of ", D, " do not fit rows of ", F);
  dispatch(qkv.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    rope_rows<scalar_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), rows, F, D,
                        heads);
  });
}

// -- silu(gate) * up for gate_up [..., 2I] (gate first, as the fused projection stores them) -----
template <typename T>
void silu_mul_rows(const T* g, T* o, int64_t rows, int64_t I) {
  const int64_t I8 = I - I % 8;
  at::parallel_for(0, rows, grain(I), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T *gi = g + i * 2 * I, *ui = gi + I;
      T* oi = o + i * I;
      for (int64_t j = 0; j < I8; j += 8) {
        const __m256 x = load8(gi + j);
        const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
        store8(oi + j, _mm256_mul_ps(round8(oi, silu), load8(ui + j)));
      }
      for (int64_t j = I8; j < I; ++j) {
        const float x = float(gi[j]);
        oi[j] = T(round1<T>(x / (1.f + std::exp(-x))) * float(ui[j]));
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_dtype(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "silu_mul: gate_up must be a contiguous [..., 2I], got ", gate_up.sizes());
  auto shape = gate_up.sizes().vec();
  const int64_t I = shape.back() / 2, rows = I ? gate_up.numel() / (2 * I) : 0;
  shape.back() = I;
  auto out = at::empty(shape, gate_up.options());
  dispatch(gate_up.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, I);
  });
  return out;
}

// -- argmax over the last axis: the first index of the largest value, the first NaN if any (as
// torch's max(-1).indices); bf16 max(-1) on CPU costs ~35 us a 49k row, which a greedy step pays
template <typename T>
int64_t argmax_row(const T* x, int64_t V) {
  int64_t best = 0;
  int64_t j = 0;
  if (V >= 16) {
    __m256 vmax = load8(x);
    __m256i vidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i cur = vidx;
    __m256 nan = _mm256_cmp_ps(vmax, vmax, _CMP_UNORD_Q);
    const __m256i eight = _mm256_set1_epi32(8);
    for (j = 8; j + 8 <= V; j += 8) {
      cur = _mm256_add_epi32(cur, eight);
      const __m256 v = load8(x + j);
      const __m256 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);  // strict: a lane keeps its first max
      vmax = _mm256_blendv_ps(vmax, v, gt);
      vidx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vidx), _mm256_castsi256_ps(cur), gt));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(nan)) {  // rare: find the first NaN the plain way
      for (int64_t i = 0; i < V; ++i)
        if (std::isnan(float(x[i]))) return i;
    }
    alignas(32) float m[8];
    alignas(32) int32_t id[8];
    _mm256_store_ps(m, vmax);
    _mm256_store_si256(reinterpret_cast<__m256i*>(id), vidx);
    best = id[0];
    float bv = m[0];
    for (int l = 1; l < 8; ++l)
      if (m[l] > bv || (m[l] == bv && id[l] < best)) bv = m[l], best = id[l];
  } else {
    j = 1;
    if (std::isnan(float(x[0]))) return 0;
  }
  float bv = float(x[best]);
  for (; j < V; ++j) {
    const float v = float(x[j]);
    if (std::isnan(v)) return j;
    if (v > bv) bv = v, best = j;
  }
  return best;
}

at::Tensor argmax_last(const at::Tensor& x) {
  check_dtype(x, "argmax_last");
  TORCH_CHECK(x.is_contiguous() && x.dim() >= 1 && x.size(-1) > 0 && x.size(-1) < (int64_t(1) << 31),
              "argmax_last: x must be a contiguous [..., V] with 0 < V < 2^31, got ", x.sizes());
  auto shape = x.sizes().vec();
  const int64_t V = shape.back(), rows = x.numel() / V;
  shape.pop_back();
  auto out = at::empty(shape, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* p = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 131072 / V), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) o[i] = argmax_row(p + i * V, V);
    });
  });
  return out;
}

// -- a commit's K/V moves: cache[rows[m], :, dst[m]] <- cache[rows[m], :, src[m]] for every cache
// tensor [max_batch, heads, max_len, head_dim], m in order (compact_kv's host path lists them so
// that a move never reads a position an earlier one wrote); one call instead of 60 index ops --
void move_positions_(at::TensorList caches, const at::Tensor& rows, const at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(rows.scalar_type() == at::kLong && dst.scalar_type() == at::kLong && src.scalar_type() == at::kLong &&
                  rows.is_contiguous() && dst.is_contiguous() && src.is_contiguous() && rows.dim() == 1 &&
                  dst.sizes() == rows.sizes() && src.sizes() == rows.sizes(),
              "move_positions_: rows, dst and src must be contiguous int64 [M] of one length");
  const int64_t M = rows.numel();
  const int64_t *r = rows.data_ptr<int64_t>(), *d = dst.data_ptr<int64_t>(), *s = src.data_ptr<int64_t>();
  for (const at::Tensor& t : caches) {
    TORCH_CHECK(t.device().is_cpu() && t.dim() == 4 && t.is_contiguous(),
                "move_positions_: caches must be contiguous CPU [max_batch, heads, max_len, head_dim], got ",
                t.sizes());
    const int64_t B = t.size(0), H = t.size(1), L = t.size(2);
    for (int64_t m = 0; m < M; ++m)
      TORCH_CHECK(0 <= r[m] && r[m] < B && 0 <= d[m] && d[m] < L && 0 <= s[m] && s[m] < L,
                  "move_positions_: move ", m, " (row ", r[m], ", ", s[m], " -> ", d[m], ") is outside ", t.sizes());
    const int64_t row_bytes = t.size(3) * t.element_size();
    char* base = static_cast<char*>(t.data_ptr());
    for (int64_t m = 0; m < M; ++m)
      for (int64_t h = 0; h < H; ++h) {
        char* head = base + ((r[m] * H + h) * L) * row_bytes;
        std::memmove(head + d[m] * row_bytes, head + s[m] * row_bytes, row_bytes);
      }
  }
}

}  // namespace

TORCH_LIBRARY(specdec_cpu_glue, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rope_(Tensor(a!) qkv, Tensor cos, Tensor sin, int heads) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_last(Tensor x) -> Tensor");
  m.def("move_positions_(Tensor(a!)[] caches, Tensor rows, Tensor dst, Tensor src) -> ()");
}

TORCH_LIBRARY_IMPL(specdec_cpu_glue, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_mul", &silu_mul);
  m.impl("argmax_last", &argmax_last);
  m.impl("move_positions_", &move_positions_);
}
