// Decode attention for bf16 K/V on AVX-512 CPUs: a few query rows per (sequence, kv head)
// against its cached keys, read once each, with an fp32 softmax. PyTorch's CPU flash kernel
// (SDPA) is built for long query blocks; for the 3-39 rows of a decode or verification step it
// ran at about half this kernel's speed on the 2-core AVX-512 machine (batch 32 x 600 keys:
// 2.1 ms a layer, this 0.9 ms). Semantics are SDPA's with an additive mask: see attention_cpu.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

inline __m512 load_bf16(const uint16_t* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Keys ahead to prefetch: the hardware prefetcher alone left the kernel at ~12 GB/s on cold
// caches (a decode step's K/V come from DRAM), against ~30 GB/s for the weights' long streams.
constexpr int64_t kPrefetch = 32;

template <int D>
inline void prefetch_row(const uint16_t* p) {  // a prefetch past the end is harmless: no fault
  for (int b = 0; b < D * 2; b += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + b, _MM_HINT_T0);
}

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
}

// exp(x) for x <= 0 (scores minus their row maximum), Cephes' polynomial; exactly 0 below -87,
// so masked (-inf) keys weigh nothing.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 floor_ = _mm512_set1_ps(-87.0f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, floor_, _CMP_LT_OQ);
  x = _mm512_max_ps(x, floor_);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(~tiny, _mm512_scalef_ps(p, n));
}

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch's conversion does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// The sum of 16 lanes in one fixed order (upper 8 + lower 8, then 4 + 4, 2 + 2, 1 + 1), written
// out rather than left to a compiler's reduce so that the gathered score path below repeats it
// lane for lane.
inline float hsum16(__m512 a) {
  const __m256 h8 = _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)),
                                  _mm512_castps512_ps256(a));
  const __m128 h4 = _mm_add_ps(_mm256_extractf128_ps(h8, 1), _mm256_castps256_ps128(h8));
  const __m128 h2 = _mm_add_ps(_mm_movehl_ps(h4, h4), h4);
  return _mm_cvtss_f32(_mm_add_ss(_mm_shuffle_ps(h2, h2, 1), h2));
}

// softmax over one row of scores in place, after adding the row's bf16 mask (may be null).
// A key masked with -inf is absent: the normaliser sums the present keys in key order, each in
// lane (its rank among them) % 16, so a tree node whose ancestors sit apart in the cache sums
// exactly what the same token decoded alone sums over its consecutive keys (`kept`: L floats).
void softmax_row(float* s, const uint16_t* mask, int64_t L, float* kept) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t l = 0; l < L; l += 16) {
    const __mmask16 m = tail_mask(L - l);
    __m512 x = _mm512_maskz_loadu_ps(m, s + l);
    if (mask != nullptr) {
      __m512i raw = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, mask + l));
      x = _mm512_add_ps(x, _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)));
    }
    _mm512_mask_storeu_ps(s + l, m, x);
    mx = _mm512_mask_max_ps(mx, m, mx, x);
  }
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  const __m512 absent = _mm512_set1_ps(-INFINITY);
  __m512 sum = _mm512_setzero_ps();
  int64_t n = 0;
  for (int64_t l = 0; l < L; l += 16) {
    const __mmask16 m = tail_mask(L - l);
    const __m512 x = _mm512_maskz_loadu_ps(m, s + l);
    __m512 e = _mm512_maskz_mov_ps(m, exp_nonpositive(_mm512_sub_ps(x, top)));
    _mm512_mask_storeu_ps(s + l, m, e);
    if (mask == nullptr) {
      sum = _mm512_add_ps(sum, e);
    } else {
      const __mmask16 present = _mm512_mask_cmp_ps_mask(m, x, absent, _CMP_NEQ_OQ);
      // compress in a register, then a plain store: Zen 4 microcodes the memory form of
      // vcompressps (~140 cycles each); `kept` has 16 floats of slack for the spill-over
      _mm512_storeu_ps(kept + n, _mm512_maskz_compress_ps(present, e));
      n += __builtin_popcount(present);
    }
  }
  for (int64_t l = 0; l < n; l += 16) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(tail_mask(n - l), kept + l));
  const __m512 inv = _mm512_set1_ps(1.0f / hsum16(sum));
  for (int64_t l = 0; l < L; l += 16) {
    const __mmask16 m = tail_mask(L - l);
    _mm512_mask_storeu_ps(s + l, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + l), inv));
  }
}

// One score per lane for RQ rows against the 16 gathered keys kt [D, 16], summed exactly as the
// direct path sums q . k: lane i of a chunk accumulates dims i, 16 + i, ... (a product, then
// FMAs), and the 16 partials combine in hsum16's order. Partials are paired as soon as both
// exist (i and i + 8, then with i + 4's pair) so that few stay live.
template <int D, int RQ>
inline void scores16(const float* q, const float* kt, __m512 out[RQ]) {
  constexpr int C = D / 16;
  auto partial = [&](int i, __m512 p[RQ]) {
    const __m512 k0 = _mm512_load_ps(kt + i * 16);
    for (int r = 0; r < RQ; ++r) p[r] = _mm512_mul_ps(_mm512_set1_ps(q[r * D + i]), k0);
    for (int c = 1; c < C; ++c) {
      const __m512 kc = _mm512_load_ps(kt + (16 * c + i) * 16);
      for (int r = 0; r < RQ; ++r) p[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + 16 * c + i]), kc, p[r]);
    }
  };
  __m512 quad[4][RQ];  // quad[j] = (p[j + 12] + p[j + 4]) + (p[j + 8] + p[j])
  for (int j = 0; j < 4; ++j) {
    __m512 a[RQ], b[RQ], pair_lo[RQ];
    partial(j, a);
    partial(j + 8, b);
    for (int r = 0; r < RQ; ++r) pair_lo[r] = _mm512_add_ps(b[r], a[r]);
    partial(j + 4, a);
    partial(j + 12, b);
    for (int r = 0; r < RQ; ++r) quad[j][r] = _mm512_add_ps(_mm512_add_ps(b[r], a[r]), pair_lo[r]);
  }
  for (int r = 0; r < RQ; ++r)
    out[r] = _mm512_add_ps(_mm512_add_ps(quad[1][r], quad[3][r]), _mm512_add_ps(quad[0][r], quad[2][r]));
}

// Scores for many query rows (a verified tree): 16 keys at a time are gathered into fp32 [D, 16]
// so that each row's scores come from broadcast FMAs with no horizontal sums, with the same bits
// as the direct path's (scores16).
template <int D>
void scores_transposed(const float* q, int64_t R, const uint16_t* k, int64_t sl, int64_t L, float* s, int64_t Lp) {
  constexpr int RQ = 4;
  alignas(64) float kt[D * 16];
  // lane j reads key j's 32-bit word at dims (d, d+1): two bf16, the lower one at the lower address
  const __m512i rows = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(int(sl)));
  const __m512i high = _mm512_set1_epi32(int(0xffff0000u));
  for (int64_t l0 = 0; l0 < L; l0 += 16) {
    const int64_t nl = std::min<int64_t>(16, L - l0);
    const __mmask16 live = tail_mask(nl);  // masked lanes read nothing: no fault past the cache
    for (int64_t j = 0; j < 16; ++j) prefetch_row<D>(k + (l0 + kPrefetch + j) * sl);
    for (int d = 0; d < D; d += 2) {
      const __m512i w = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, rows, k + l0 * sl + d, 2);
      _mm512_store_ps(kt + d * 16, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
      _mm512_store_ps(kt + (d + 1) * 16, _mm512_castsi512_ps(_mm512_and_si512(w, high)));
    }
    int64_t r0 = 0;
    for (; r0 + RQ <= R; r0 += RQ) {
      __m512 acc[RQ];
      scores16<D, RQ>(q + r0 * D, kt, acc);
      for (int r = 0; r < RQ; ++r) _mm512_mask_storeu_ps(s + (r0 + r) * Lp + l0, tail_mask(nl), acc[r]);
    }
    for (; r0 < R; ++r0) {
      __m512 acc[1];
      scores16<D, 1>(q + r0 * D, kt, acc);
      _mm512_mask_storeu_ps(s + r0 * Lp + l0, tail_mask(nl), acc[0]);
    }
  }
}

// Beyond this many query rows the gathered score loop is faster (2-core AVX-512 machine).
constexpr int64_t kTransposeRows = 8;
// Query rows attended at a time (a prefill chunk has thousands): bounds the scores buffer, and a
// block reads keys only up to the last one any of its rows may see (`present_keys`).
constexpr int64_t kRowBlock = 48;
// Where a call has fewer work items than kSplitBelow x threads, each row set splits in blocks of
// at least kSplitRows rows (see decode_attention). Batch 1 on 2 threads, 400 keys, per 30 layer
// calls: 2-node trees 0.90 -> 0.73 ms, 4 nodes 1.49 -> 1.24, 13 nodes 3.77 -> 3.09.
constexpr int64_t kSplitBelow = 2;
constexpr int64_t kSplitRows = 3;

// 1 + the index of the last key that any of `rows` mask rows leaves present (not -inf), searched
// from key L-1 down, 32 at a time; 1 if none. Keys past it weigh exactly 0 in every row, so leaving
// them out changes no bit: under a causal mask the first rows of a prefill chunk read few keys.
int64_t present_keys(const uint16_t* const* mask, int64_t rows, int64_t L) {
  const __m512i absent = _mm512_set1_epi16(static_cast<short>(0xff80));  // bf16 -inf
  for (int64_t hi = L; hi > 0; hi -= 32) {
    const int64_t lo = std::max<int64_t>(0, hi - 32);
    const __mmask32 live = static_cast<__mmask32>((hi - lo == 32 ? 0xffffffffull : (1ull << (hi - lo)) - 1));
    __mmask32 present = 0;  // keys lo..hi-1 that some row sees
    for (int64_t r = 0; r < rows; ++r) {
      const __m512i m = _mm512_maskz_loadu_epi16(live, mask[r] + lo);
      present |= _mm512_mask_cmpneq_epi16_mask(live, m, absent);
    }
    if (present) return lo + 32 - __builtin_clz(present);  // 1 + the highest such key
  }
  return 1;
}

// One (sequence, kv head): R query rows (fp32, pre-scaled) against L keys whose rows are `sl`
// elements apart; row r's mask row is mask[r] (mask may be null) and its output out[r]. Rows go RB
// at a time, so their accumulators stay in registers.
template <int D, int RB>
void attend(const float* q, int64_t R, const uint16_t* k, const uint16_t* v, int64_t sl, int64_t L,
            const uint16_t* const* mask, float* s, int64_t Lp, uint16_t* const* out, float* kept) {
  constexpr int C = D / 16;
  if (R > kTransposeRows) scores_transposed<D>(q, R, k, sl, L, s, Lp);
  else for (int64_t r0 = 0; r0 < R; r0 += RB) {  // scores s[r, l] = q[r] . k[l]
    const int64_t nr = std::min<int64_t>(RB, R - r0);
    __m512 qv[RB][C];
    for (int64_t r = 0; r < nr; ++r)
      for (int c = 0; c < C; ++c) qv[r][c] = _mm512_loadu_ps(q + (r0 + r) * D + 16 * c);
    for (int64_t l = 0; l < L; ++l) {
      prefetch_row<D>(k + (l + kPrefetch) * sl);
      __m512 kf[C];
      for (int c = 0; c < C; ++c) kf[c] = load_bf16(k + l * sl + 16 * c);
      for (int64_t r = 0; r < nr; ++r) {
        __m512 acc = _mm512_mul_ps(qv[r][0], kf[0]);
        for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(qv[r][c], kf[c], acc);
        s[(r0 + r) * Lp + l] = hsum16(acc);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    softmax_row(s + r * Lp, mask == nullptr ? nullptr : mask[r], L, kept);
  for (int64_t r0 = 0; r0 < R; r0 += RB) {  // out[r] = sum_l p[r, l] v[l]
    const int64_t nr = std::min<int64_t>(RB, R - r0);
    __m512 acc[RB][C];
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t l = 0; l < L; ++l) {
      prefetch_row<D>(v + (l + kPrefetch) * sl);
      __m512 vf[C];
      for (int c = 0; c < C; ++c) vf[c] = load_bf16(v + l * sl + 16 * c);
      for (int64_t r = 0; r < nr; ++r) {
        const __m512 p = _mm512_set1_ps(s[(r0 + r) * Lp + l]);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(p, vf[c], acc[r][c]);
      }
    }
    for (int64_t r = 0; r < nr; ++r) {
      float row[D];
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(row + 16 * c, acc[r][c]);
      for (int d = 0; d < D; ++d) out[r0 + r][d] = to_bf16(row[d]);
    }
  }
}

// q [B, N, H, D] bf16, any strides but contiguous rows (a view of the fused qkv projection): N
// tokens of B sequences, H query heads over the cache's KV heads (H = g x KV; query head kvh*g + j
// reads kv head kvh). k, v [S, KV, L, D] bf16, a layer's static cache, with equal strides and
// contiguous rows. Sequence b reads cache row slots[b] (default b) and its keys 0 .. lengths[b]-1
// (default all L). mask: None or additive bf16 [B|1, 1, N, >= its keys] with contiguous rows, one
// row per token (its g query heads share it). k_new, v_new [B, N, KV, D] (optional, contiguous
// rows): written first at cache positions positions[b] + t of row slots[b], the tokens valid[b, t]
// only (default all), so that a token attends to itself. Returns [B, N, H, D].
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& mask, double scale,
                            const c10::optional<at::Tensor>& slots, const c10::optional<at::Tensor>& lengths,
                            const c10::optional<at::Tensor>& k_new, const c10::optional<at::Tensor>& v_new,
                            const c10::optional<at::Tensor>& positions, const c10::optional<at::Tensor>& valid) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q [B, N, H, D] and k, v [S, KV, L, D] must be 4-d");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
              v.scalar_type() == at::kBFloat16, "bf16 q, k, v only");
  const int64_t B = q.size(0), N = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t S = k.size(0), KV = k.size(1), L = k.size(2);
  TORCH_CHECK(D == 64 || D == 128, "head_dim 64 or 128 only, got ", D);
  TORCH_CHECK(q.stride(3) == 1, "q rows must be contiguous");
  TORCH_CHECK(k.sizes() == v.sizes() && k.strides() == v.strides() && k.stride(3) == 1,
              "k and v must share shape and strides, with contiguous rows");
  TORCH_CHECK(k.size(3) == D && KV >= 1 && H % KV == 0, "k/v head_dim must match q's, and q's ", H,
              " heads must be a multiple of the cache's ", KV, " kv heads");
  const int64_t g = H / KV;
  auto long_list = [&](const c10::optional<at::Tensor>& t, const char* what, int64_t fill, bool by_index) {
    std::vector<int64_t> out(B, fill);
    if (by_index) for (int64_t b = 0; b < B; ++b) out[b] = b;
    if (t.has_value() && t->defined()) {
      const at::Tensor c = t->to(at::kLong).contiguous();
      TORCH_CHECK(c.numel() == B, what, " must hold one value per sequence");
      std::copy(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + B, out.begin());
    }
    return out;
  };
  const std::vector<int64_t> row_slot = long_list(slots, "slots", 0, true);
  const std::vector<int64_t> row_len = long_list(lengths, "lengths", L, false);
  int64_t longest = 1;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(0 <= row_slot[b] && row_slot[b] < S, "slot ", row_slot[b], " outside the cache's ", S, " rows");
    TORCH_CHECK(1 <= row_len[b] && row_len[b] <= L, "row ", b, " reads ", row_len[b], " keys of ", L);
    longest = std::max(longest, row_len[b]);
  }
  const uint16_t* mp = nullptr;
  int64_t mb = 0, mr = 0;
  if (mask.has_value() && mask->defined()) {
    const at::Tensor& m = *mask;
    TORCH_CHECK(m.dim() == 4 && m.scalar_type() == at::kBFloat16 && m.stride(3) == 1 && m.size(1) == 1 &&
                m.size(2) == N && m.size(3) >= longest && (m.size(0) == 1 || m.size(0) == B),
                "mask must be additive bf16 [B|1, 1, N, keys] with contiguous rows");
    mp = reinterpret_cast<const uint16_t*>(m.data_ptr<at::BFloat16>());
    mb = m.size(0) == 1 ? 0 : m.stride(0);
    mr = m.stride(2);
  }
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), sl = k.stride(2);
  if (k_new.has_value() && k_new->defined()) {  // the new tokens' K/V into the cache
    TORCH_CHECK(v_new.has_value() && v_new->defined(), "k_new needs v_new");
    const at::Tensor& kn = *k_new;
    const at::Tensor& vn = *v_new;
    TORCH_CHECK(kn.dim() == 4 && kn.sizes() == vn.sizes() && kn.size(0) == B && kn.size(1) == N && kn.size(2) == KV &&
                kn.size(3) == D && kn.stride(3) == 1 && vn.stride(3) == 1 && kn.scalar_type() == at::kBFloat16 &&
                vn.scalar_type() == at::kBFloat16, "k_new, v_new must be bf16 [B, N, KV, D] with contiguous rows");
    const std::vector<int64_t> start = long_list(positions, "positions", 0, false);
    at::Tensor ok;
    if (valid.has_value() && valid->defined()) {
      ok = valid->to(at::kBool).contiguous();
      TORCH_CHECK(ok.numel() == B * N, "valid must be [B, N]");
    }
    auto* kc = reinterpret_cast<uint16_t*>(k.data_ptr<at::BFloat16>());
    auto* vc = reinterpret_cast<uint16_t*>(v.data_ptr<at::BFloat16>());
    const auto* kp = reinterpret_cast<const uint16_t*>(kn.data_ptr<at::BFloat16>());
    const auto* vp = reinterpret_cast<const uint16_t*>(vn.data_ptr<at::BFloat16>());
    const bool* keep = ok.defined() ? ok.data_ptr<bool>() : nullptr;
    for (int64_t b = 0; b < B; ++b)  // every check before the first write: a bad call changes nothing
      for (int64_t t = 0; t < N; ++t)
        TORCH_CHECK((keep && !keep[b * N + t]) || (0 <= start[b] + t && start[b] + t < L), "sequence ", b,
                    " writes position ", start[b] + t, " outside the cache's ", L);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < N; ++t) {
        if (keep && !keep[b * N + t]) continue;
        const int64_t pos = start[b] + t;
        for (int64_t h = 0; h < KV; ++h) {
          const int64_t at = row_slot[b] * ks0 + h * ks1 + pos * sl;
          std::memcpy(kc + at, kp + b * kn.stride(0) + t * kn.stride(1) + h * kn.stride(2), D * 2);
          std::memcpy(vc + at, vp + b * vn.stride(0) + t * vn.stride(1) + h * vn.stride(2), D * 2);
        }
      }
  }
  at::Tensor out = at::empty({B, N, H, D}, q.options());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const int64_t Lp = (longest + 15) / 16 * 16;
  // Each (sequence, kv head) attends R = N x g query rows, token-major: row r is token r / g, query
  // head kvh*g + r % g. Work items are (sequence, kv head, block of rows): a prompt's row blocks
  // spread over the threads, and where the batch has too few (sequence, kv head) pairs to keep
  // every thread busy (batch 1: 3 kv heads on 2 threads, one idle a third of the time) a tree's
  // rows split in blocks. A row's result does not depend on the rows beside it: no bit changes.
  const int64_t R = N * g, threads = at::get_num_threads();
  int64_t blocks = (R + kRowBlock - 1) / kRowBlock;
  if (B * KV * blocks < kSplitBelow * threads)
    blocks = std::max(blocks, std::min(R / kSplitRows, (kSplitBelow * threads + B * KV - 1) / (B * KV)));
  const int64_t block = (R + blocks - 1) / blocks;
  blocks = (R + block - 1) / block;
  at::parallel_for(0, B * KV * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(block * Lp), kept(Lp + 16), qrows(block * D);
    std::vector<const uint16_t*> mrows(block);
    std::vector<uint16_t*> orows(block);
    const __m512 scale16 = _mm512_set1_ps(static_cast<float>(scale));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t pair = i / blocks, r0 = i % blocks * block;
      const int64_t b = pair / KV, kvh = pair % KV, nr = std::min(block, R - r0);
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t t = (r0 + r) / g, h = kvh * g + (r0 + r) % g;
        // the queries in fp32, scaled: the bits of q.float() * scale
        const uint16_t* qrow = qp + b * qs0 + t * qs1 + h * qs2;
        for (int64_t d = 0; d < D; d += 16)
          _mm512_storeu_ps(qrows.data() + r * D + d, _mm512_mul_ps(load_bf16(qrow + d), scale16));
        mrows[r] = mp == nullptr ? nullptr : mp + b * mb + t * mr;
        orows[r] = op + ((b * N + t) * H + h) * D;
      }
      const uint16_t* const* mask_rows = mp == nullptr ? nullptr : mrows.data();
      const int64_t keys = mp == nullptr ? row_len[b] : present_keys(mask_rows, nr, row_len[b]);
      const int64_t off = row_slot[b] * ks0 + kvh * ks1;
      if (D == 64)
        attend<64, 4>(qrows.data(), nr, kp + off, vp + off, sl, keys, mask_rows, scores.data(), Lp, orows.data(),
                      kept.data());
      else
        attend<128, 2>(qrows.data(), nr, kp + off, vp + off, sl, keys, mask_rows, scores.data(), Lp, orows.data(),
                       kept.data());
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(specdec_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor(a!) k, Tensor(b!) v, Tensor? mask, float scale, Tensor? slots=None, "
        "Tensor? lengths=None, Tensor? k_new=None, Tensor? v_new=None, Tensor? positions=None, "
        "Tensor? valid=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}
