// klpenalty native CPU kernel: the engine of klpenalty/ops/engine.py in one fused pass per row.
//
// Implements the four ops of the contract in klpenalty/ops/contract.py, whose schemas are
// defined there (this file only registers CPU implementations):
//   native_token_stats(x, y?, tokens?, mask?, keep?, tau?, temperature, ignore_index, want,
//                      check, tile_rows, tile_cols, top_k, top_p, min_p)
//     -> (out (..., 4), stats (..., 10))
//     out: KL(π̃‖ρ), log π̃(token), log ρ(token), H(π̃), 0 where not in `want`; where the
//     sampler settings cut (1 <= top_k < V, top_p < 1, min_p > 0) each row's threshold τ_s is
//     computed from x first (row_threshold) and the support is keep ∧ x >= max(tau, τ_s);
//     stats[..., 9] (ST_TAU) is the threshold used (−inf: none), the backward's tau
//   native_sampling_threshold(x, top_k, top_p, min_p, temperature) -> tau (...): τ_s per row
//   native_token_stats_backward(grad (..., 4), x, y?, tokens?, owned?, stats, mask?, keep?, tau?,
//                               temperature, ignore_index, want, need_x, need_y, tile_rows,
//                               tile_cols) -> (grad_x (..., V) or empty, grad_y (..., V) or empty)
//   native_token_stats_state(x, y?, keep?, tau?, temperature, want, tile_rows, tile_cols)
//     -> (state (N, 6): m_x, s_x, m_y, s_y, a, b unfinalized; careful (N,) bool)
// π̃ is the policy restricted to its support: kept(v) = keep[v] and x_v >= tau (either optional).
// `owned` (bool, optional): where false the row's token is not in these columns: its own entry
// is not added (the dense terms of the log-prob columns are). tile_rows/tile_cols are accepted
// for the common signature and ignored: a row is walked in L1-sized chunks (kChunk elements).
//
// Per row, in one read of the row from memory, ONE row walker (walk_row) computes whatever is
// wanted, specialised at compile time: the log-sum-exp of x (log-probs), with the entropy's
// Σ e^u·u, with y's log-sum-exp and the KL's Σ e^u·(u − w). An untruncated row is read once:
// every chunk against the row's running maxima (at first those of the row's first 256 elements)
// with the chunk's maxima tracked alongside, redone in two passes (maxima, then from L1 the exps
// and sums) if they rose by more than a bound. A support takes the same walk with lane masks
// folded into the loads (keep read as bytes, x >= tau compared per lane; off the support e^u is
// 0 and the lane leaves the maxima); rows whose sums are not finite (−inf logits on the support,
// the 0·log 0 rule) are redone chunk by chunk in two passes, the chunk of x copied into an L1
// buffer with −inf off the support. With the sampler, the next row's logits are requested into
// L2 during each walk (its threshold passes then read L2, not memory). The row state (maxima in logit units, sums; engine.py) is kept in double and
// rescaled when a maximum rises. float32/bfloat16/float16 inputs are read directly and computed
// in float32 vectors (at::vec::Vectorized<float>) with a polynomial exp2, several independent
// vectors in flight; float64 inputs, and rows holding NaN or +inf, take a scalar double path with
// the engine's rules. The backward is one walk per row writing ∂/∂x and ∂/∂y for all wanted
// outputs. One parallel region per call, its threads taking blocks of rows from a shared counter.
// A fifth op, native_compute_floor, times the forward's inner loop alone (the benchmark's).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace klpenalty_native {
namespace {

using VF = at::vec::Vectorized<float>;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kLog2e = 1.4426950408889634;
constexpr int64_t kBlock = 2 * VF::size();  // elements per inner step: two float vectors
constexpr int64_t kChunk = 2048;            // elements of a row per chunk (kept in L1 for a redo)
constexpr int64_t kGrainElements = 1 << 16; // work per parallel task, in elements

// the want bits and the out / stats / state columns of klpenalty/ops/contract.py
constexpr int64_t kWantKL = 1, kWantLogp = 2, kWantRefLogp = 4, kWantEntropy = 8;
constexpr int64_t kOutCols = 4, kStatsCols = 10;
enum StatsCol : int {
  kShiftX, kLogSX, kShiftY, kLogSY, kMeanD, kCareful, kMeanU, kLogpT, kRefLogpT, kTau
};
constexpr int64_t kStateCols = 6;  // m_x, s_x, m_y, s_y, a, b

// ------------------------------------------------------------------------------ fast exp2
// Bits of a float vector shifted left by 23 (the exponent field), as floats.
inline VF shift_to_exponent(const VF& v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(v), 23));
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(v), 23));
#else
  float f[VF::size()];
  v.store(f);
  for (int k = 0; k < VF::size(); ++k) {
    uint32_t u;
    std::memcpy(&u, &f[k], sizeof(u));
    u <<= 23;
    std::memcpy(&f[k], &u, sizeof(u));
  }
  return VF::loadu(f);
#endif
}

// 2^t = 2^n · 2^f, n = round(t), f in [-1/2, 1/2]; 2^f by a degree-6 polynomial fitted for
// relative error (9.6e-8 in float32 Horner, about one ulp). n comes from one addition: t + M,
// M = 1.5·2^23 + 127, is an integer (float spacing 1 there) whose low mantissa bits hold n + 127,
// which shifted into the exponent field are the bits of 2^n; (t + M) − M = n exactly. t is
// clamped below at −127 (n = −127 builds the bit pattern 0, so the result is exactly 0 below about
// −126.5, also for t = −inf, where the exact value is below 1e-38); kClampHigh clamps above at
// 127, else t must not exceed 127 (larger t gives a wrong finite value or NaN: callers that allow
// it check their maxima and redo). NaN stays NaN.
constexpr float kMagic = 12582912.0f + 127.0f;

// 2^f · 2^n from f and k = n + kMagic
inline VF exp2_parts(const VF& f, const VF& k) {
  VF p(1.5345812e-4f);
  p = at::vec::fmadd(p, f, VF(1.3399931e-3f));
  p = at::vec::fmadd(p, f, VF(9.6184891e-3f));
  p = at::vec::fmadd(p, f, VF(5.5503286e-2f));
  p = at::vec::fmadd(p, f, VF(2.4022646e-1f));
  p = at::vec::fmadd(p, f, VF(6.9314718e-1f));
  p = at::vec::fmadd(p, f, VF(1.0f));
  return p * shift_to_exponent(k);
}

template <bool kClampHigh = true>
inline VF exp2_fast(const VF& t) {
  const VF magic(kMagic);
  VF tc = at::vec::clamp_min(t, VF(-127.0f));  // max(−127, t): keeps a NaN t
  if constexpr (kClampHigh) tc = at::vec::clamp_max(tc, VF(127.0f));
  const VF k = tc + magic;
  return exp2_parts(tc - (k - magic), k);
}

// 2^(d·c) for the forward (no upper clamp: d·c must not exceed 127, see exp2_fast), d clamped
// below at lo = −127/c; n and f from the exact product d·c by two FMAs (one operation fewer
// than forming t = d·c first, and f rounded once).
inline VF exp2_scaled(const VF& d, const VF& c, const VF& lo) {
  const VF magic(kMagic);
  const VF dc = at::vec::clamp_min(d, lo);
  const VF k = at::vec::fmadd(dc, c, magic);
  return exp2_parts(at::vec::fmsub(dc, c, k - magic), k);
}

// ------------------------------------------------------------------------------ loads/stores
// Two float vectors (kBlock elements) from float, bfloat16 or float16 memory, and back.
inline void load2(const float* p, VF& a, VF& b) {
  a = VF::loadu(p);
  b = VF::loadu(p + VF::size());
}
template <typename T>
inline void load2(const T* p, VF& a, VF& b) {
  at::vec::load_to_float<T>(p, a, b);
}
inline void store2(float* p, const VF& a, const VF& b) {
  a.store(p);
  b.store(p + VF::size());
}
template <typename T>
inline void store2(T* p, const VF& a, const VF& b) {
  at::vec::convert_from_float<T>(a, b).store(p);
}

// Ask for the lines of the next chunk while this one is computed from L1, so that memory and
// arithmetic overlap (prefetches never fault, also past the end of a row).
template <typename T>
inline void prefetch_block(const T* p) {
  constexpr int64_t kBytes = kBlock * static_cast<int64_t>(sizeof(T));
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < kBytes; b += 64) __builtin_prefetch(c + b);
}

// f(c0, n) for the L1-sized chunks [c0, c0 + n) of a row of V elements, in order; false as soon
// as f returns false (a chunk holding NaN or +inf).
template <typename F>
inline bool for_each_chunk(int64_t V, F&& f) {
  for (int64_t c0 = 0; c0 < V; c0 += kChunk) {
    if (!f(c0, std::min(kChunk, V - c0))) return false;
  }
  return true;
}

// The next kBlock elements of a row of x and of y, minus their shifts, as two float vectors each;
// the same elements of the next chunk are requested meanwhile.
template <typename TX, typename TY>
inline void load_shifted(const TX* x, const TY* y, const VF& shx, const VF& shy, VF& dx0, VF& dx1,
                         VF& dy0, VF& dy1) {
  prefetch_block(x + kChunk);
  prefetch_block(y + kChunk);
  VF x0, x1, y0, y1;
  load2(x, x0, x1);
  load2(y, y0, y1);
  dx0 = x0 - shx;
  dx1 = x1 - shx;
  dy0 = y0 - shy;
  dy1 = y1 - shy;
}

// U float vectors (U·VF::size() elements) from float, bfloat16 or float16 memory, for sums and
// maxima only. kAnyOrder: the lanes may hold the elements in another order than memory's, the
// same order for every pointer of this dtype (so x and y of one dtype stay paired): bfloat16
// pairs of vectors widen by interleaving zero words below the data (one instruction per vector
// instead of a widening and a shift).
template <int U, bool kAnyOrder, typename T>
inline void load_lanes(const T* p, VF* v) {
  int k = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; k < U; ++k) v[k] = VF::loadu(p + k * VF::size());
  } else {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    if constexpr (kAnyOrder && std::is_same_v<T, at::BFloat16>) {
      for (; k + 2 <= U; k += 2) {
#if defined(CPU_CAPABILITY_AVX512)
        const __m512i raw = _mm512_loadu_si512(reinterpret_cast<const void*>(p + k * VF::size()));
        const __m512i zero = _mm512_setzero_si512();
        v[k] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, raw));
        v[k + 1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, raw));
#else
        const __m256i raw =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + k * VF::size()));
        const __m256i zero = _mm256_setzero_si256();
        v[k] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));
        v[k + 1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw));
#endif
      }
    }
#endif
    for (; k + 2 <= U; k += 2) at::vec::load_to_float<T>(p + k * VF::size(), v[k], v[k + 1]);
    for (; k < U; ++k) at::vec::load_to_float<T>(p + k * VF::size(), v[k]);
  }
}

// max(acc, v) in one instruction: a NaN in v is kept, a NaN in acc is not (the walks that use it
// find NaN in their sums).
inline VF max_fast(const VF& acc, const VF& v) { return at::vec::clamp_min(v, acc); }

inline double finite_or_zero(double v) { return std::isfinite(v) ? v : 0.0; }

// max that propagates NaN (like torch.amax)
inline double max_nan(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return kNaN;
  return a > b ? a : b;
}

// (delta, alpha) rescaling a state with max m to the max big: delta = (m - big)/T, 0 if equal.
inline std::pair<double, double> scales(double m, double big, double T) {
  double delta = (m == big) ? 0.0 : (m - big) / T;
  return {delta, std::exp(delta)};
}

// A sum of float vectors kept in double lanes. The kernels add float partial sums of kFlush
// blocks: a float lane summing a whole chunk (64 terms) lost ~1e-6 nats of a KL of 7.
using VD = at::vec::Vectorized<double>;
static_assert(VF::size() == 2 * VD::size(), "a float vector widens to two double vectors");
constexpr int64_t kFlush = 4;  // blocks per float partial sum

struct WideSum {
  VD lo = VD(0.0), hi = VD(0.0);
  void add(const VF& v) {
#if defined(CPU_CAPABILITY_AVX512)
    const __m512 f = v;
    lo = lo + VD(_mm512_cvtps_pd(_mm512_castps512_ps256(f)));
    hi = hi + VD(_mm512_cvtps_pd(_mm512_extractf32x8_ps(f, 1)));
#elif defined(CPU_CAPABILITY_AVX2)
    const __m256 f = v;
    lo = lo + VD(_mm256_cvtps_pd(_mm256_castps256_ps128(f)));
    hi = hi + VD(_mm256_cvtps_pd(_mm256_extractf128_ps(f, 1)));
#else
    float f[VF::size()];
    double d[VF::size()];
    v.store(f);
    for (int k = 0; k < VF::size(); ++k) d[k] = f[k];
    lo = lo + VD::loadu(d);
    hi = hi + VD::loadu(d + VD::size());
#endif
  }
  double value() const {
    double d[VD::size()];
    (lo + hi).store(d);
    double s = 0.0;
    for (int k = 0; k < VD::size(); ++k) s += d[k];
    return s;
  }
};

// e·d, a term of Σ e^u·f(u); kCareful: 0 where e = 0 (0·log 0 = 0, also for d = −inf or NaN),
// except d = +inf (a finite policy logit where y = −inf: e^u > 0 exactly, the term is +inf).
template <bool kCareful>
inline VF moment_term(const VF& e, const VF& d) {
  if constexpr (kCareful) {
    const VF zero(0.0f), inf(std::numeric_limits<float>::infinity());
    return VF::blendv(e * d, VF::blendv(zero, inf, d == inf), e == zero);
  } else {
    return e * d;
  }
}

// The same for one scalar term, in double.
inline double careful_term(double e, double d) { return e != 0.0 ? e * d : (d == kInf ? kInf : 0.0); }

template <typename T>
inline double chunk_max(const T* p, int64_t n) {
  VF m0(-std::numeric_limits<float>::infinity()), m1 = m0;
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    VF a, b;
    load2(p + i, a, b);
    m0 = at::vec::maximum(m0, a);
    m1 = at::vec::maximum(m1, b);
  }
  float buf[VF::size()];
  at::vec::maximum(m0, m1).store(buf);
  double m = -kInf;
  for (int k = 0; k < VF::size(); ++k) m = max_nan(m, buf[k]);
  for (; i < n; ++i) m = max_nan(m, static_cast<double>(static_cast<float>(p[i])));
  return m;
}

// ------------------------------------------------------------------------------ support lanes
// Lane masks of float vectors: AVX-512 mask registers, else all-ones lanes.
#if defined(CPU_CAPABILITY_AVX512)
using LaneMask = __mmask16;
inline LaneMask lanes_gt(const VF& a, const VF& b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline LaneMask lanes_ge(const VF& a, const VF& b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
inline LaneMask lanes_and(LaneMask a, LaneMask b) { return a & b; }
inline LaneMask lanes_andnot(LaneMask a, LaneMask b) { return a & ~b; }  // a and not b
inline bool lanes_none(LaneMask m) { return m == 0; }
inline VF add_where(const VF& acc, LaneMask m, const VF& v) { return _mm512_mask_add_ps(acc, m, acc, v); }
inline VF select(LaneMask m, const VF& a, const VF& b) { return _mm512_mask_blend_ps(m, b, a); }
inline LaneMask lanes_nan(const VF& v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
inline LaneMask lanes_or(LaneMask a, LaneMask b) { return a | b; }
inline LaneMask lanes_empty() { return 0; }
inline LaneMask lanes_all() { return static_cast<LaneMask>(0xFFFF); }
inline int64_t compress_store(float* dst, LaneMask m, const VF& v) {
  _mm512_storeu_ps(dst, _mm512_maskz_compress_ps(m, v));
  return __builtin_popcount(static_cast<unsigned>(m));
}
#else
using LaneMask = VF;
inline LaneMask lanes_gt(const VF& a, const VF& b) { return a > b; }
inline LaneMask lanes_ge(const VF& a, const VF& b) { return a >= b; }
inline LaneMask lanes_and(const LaneMask& a, const LaneMask& b) { return a & b; }
inline LaneMask lanes_andnot(const LaneMask& a, const LaneMask& b) {  // a and not b
#if defined(CPU_CAPABILITY_AVX2)
  return _mm256_andnot_ps(b, a);
#else
  float fa[VF::size()], fb[VF::size()];
  a.store(fa);
  b.store(fb);
  for (int k = 0; k < VF::size(); ++k) {
    uint32_t ua, ub;
    std::memcpy(&ua, &fa[k], sizeof(ua));
    std::memcpy(&ub, &fb[k], sizeof(ub));
    ua &= ~ub;
    std::memcpy(&fa[k], &ua, sizeof(ua));
  }
  return VF::loadu(fa);
#endif
}
inline bool lanes_none(const LaneMask& m) {
#if defined(CPU_CAPABILITY_AVX2)
  return _mm256_movemask_ps(m) == 0;
#else
  float f[VF::size()];
  m.store(f);
  for (int k = 0; k < VF::size(); ++k) {
    uint32_t u;
    std::memcpy(&u, &f[k], sizeof(u));
    if (u) return false;
  }
  return true;
#endif
}
inline VF add_where(const VF& acc, const LaneMask& m, const VF& v) { return acc + (v & m); }
inline LaneMask lanes_nan(const VF& v) { return v != v; }
inline LaneMask lanes_or(const LaneMask& a, const LaneMask& b) { return a | b; }
inline LaneMask lanes_empty() { return VF(0.0f); }
inline LaneMask lanes_all() { return VF(0.0f) == VF(0.0f); }
inline VF select(const LaneMask& m, const VF& a, const VF& b) { return VF::blendv(b, a, m); }
inline int64_t compress_store(float* dst, const LaneMask& m, const VF& v) {
  float f[VF::size()], mk[VF::size()];
  v.store(f);
  m.store(mk);
  int64_t n = 0;
  for (int k = 0; k < VF::size(); ++k) {
    uint32_t u;
    std::memcpy(&u, &mk[k], sizeof(u));
    if (u) dst[n++] = f[k];
  }
  return n;
}
#endif

// One float vector of a row (float, bfloat16 or float16 memory), in memory order.
template <typename T>
inline VF load1(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return VF::loadu(p);
  } else {
    VF v;
    at::vec::load_to_float<T>(p, v);
    return v;
  }
}

// The lanes of 16 (AVX-512) or 8 (AVX2) bool bytes that are true.
inline LaneMask keep_lanes(const bool* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm_test_epi8_mask(b, b);
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(w, _mm256_setzero_si256()));
#else
  float f[VF::size()];
  for (int k = 0; k < VF::size(); ++k) {
    const uint32_t u = p[k] ? 0xFFFFFFFFu : 0u;
    std::memcpy(&f[k], &u, sizeof(u));
  }
  return VF::loadu(f);
#endif
}

// The smallest float >= t (x >= t ⟺ x >= ceil_float(t) for float x; NaN stays NaN).
inline float ceil_float(double t) {
  float f = static_cast<float>(t);
  if (static_cast<double>(f) < t) f = std::nextafter(f, std::numeric_limits<float>::infinity());
  return f;
}

// The support of a row as lane masks of the float vectors a walk loads (in memory order for a
// keep mask): keep read as bytes, x >= tau compared in float. NoLanes: no support.
struct NoLanes {
  static constexpr bool kOn = false, kKeep = false;
  LaneMask at(const VF&, int64_t) const { return LaneMask(); }
  bool kept(float, int64_t) const { return true; }
  NoLanes from(int64_t) const { return *this; }
};

template <bool kKeepB, bool kTauB>
struct SupLanes {
  static constexpr bool kOn = true, kKeep = kKeepB;
  const bool* keep = nullptr;  // the walked segment's keep
  VF vtau;
  float tau = 0.0f;
  // the kept lanes of the elements [i, i + VF::size()) of the segment, x their logits
  LaneMask at(const VF& x, int64_t i) const {
    if constexpr (kKeepB && kTauB) {
      return lanes_and(keep_lanes(keep + i), lanes_ge(x, vtau));
    } else if constexpr (kKeepB) {
      return keep_lanes(keep + i);
    } else {
      return lanes_ge(x, vtau);
    }
  }
  bool kept(float x, int64_t i) const { return (!kKeepB || keep[i]) && (!kTauB || x >= tau); }
  SupLanes from(int64_t c0) const {
    SupLanes s = *this;
    if constexpr (kKeepB) s.keep += c0;
    return s;
  }
};

// The maximum of the kept elements [0, n) (NaN propagates; −inf if none is kept).
template <typename T, typename Sup>
double chunk_max_kept(const T* p, int64_t n, const Sup& sup) {
  if constexpr (!Sup::kOn) {
    return chunk_max(p, n);
  } else {
    const VF ninf(-std::numeric_limits<float>::infinity());
    VF m = ninf;
    int64_t i = 0;
    for (; i + VF::size() <= n; i += VF::size()) {
      const VF v = load1(p + i);
      m = at::vec::maximum(m, select(sup.at(v, i), v, ninf));
    }
    float buf[VF::size()];
    m.store(buf);
    double r = -kInf;
    for (int k = 0; k < VF::size(); ++k) r = max_nan(r, buf[k]);
    for (; i < n; ++i) {
      const float v = static_cast<float>(p[i]);
      if (sup.kept(v, i)) r = max_nan(r, v);
    }
    return r;
  }
}

// ------------------------------------------------------------------------------ row addressing
// Element offset of row r of a tensor whose last dimension has stride 1 (any leading strides).
struct Rows {
  std::vector<int64_t> sizes, strides;
  Rows(const at::Tensor& t) {
    for (int64_t d = 0; d + 1 < t.dim(); ++d) {
      if (t.size(d) == 1) continue;
      sizes.push_back(t.size(d));
      strides.push_back(t.stride(d));
    }
  }
  int64_t offset(int64_t r) const {
    int64_t off = 0;
    for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0 && r; --d) {
      off += (r % sizes[d]) * strides[d];
      r /= sizes[d];
    }
    return off;
  }
};

// The tensor itself if its last dimension is contiguous, else a contiguous copy.
at::Tensor unit_last_stride(const at::Tensor& t) {
  if (t.dim() == 0 || t.size(-1) <= 1 || t.stride(-1) == 1) return t;
  return t.contiguous();
}

// ------------------------------------------------------------------------------ messages
// Python spellings, so that errors read exactly like klpenalty._validation's.
std::string py_tuple(const std::vector<int64_t>& v) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
  if (v.size() == 1) s << ",";
  s << ")";
  return s.str();
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kLong: return "torch.int64";
    case at::kInt: return "torch.int32";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kUInt16: return "torch.uint16";
    case at::kUInt32: return "torch.uint32";
    case at::kUInt64: return "torch.uint64";
    default: return std::string("torch.") + c10::toString(t);
  }
}

std::string describe(const at::Tensor& t) {
  return "shape=" + py_tuple(t.sizes().vec()) + ", dtype=" + dtype_name(t.scalar_type());
}

std::vector<int64_t> unravel(int64_t flat, c10::IntArrayRef shape) {
  std::vector<int64_t> idx(shape.size());
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    idx[d] = shape[d] ? flat % shape[d] : 0;
    flat = shape[d] ? flat / shape[d] : 0;
  }
  return idx;
}

template <typename T>
bool rows_hold_nan(const at::Tensor& t, const std::vector<int64_t>& rows) {
  const T* p = t.const_data_ptr<T>();
  const int64_t V = t.size(-1);
  Rows ix(t);
  for (int64_t r : rows) {
    const T* row = p + ix.offset(r);
    for (int64_t j = 0; j < V; ++j)
      if (std::isnan(static_cast<double>(row[j]))) return true;
  }
  return false;
}

bool any_nan_in_rows(const at::Tensor& t, const std::vector<int64_t>& rows) {
  bool found = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, t.scalar_type(), "rows_hold_nan", [&] {
    found = rows_hold_nan<scalar_t>(t, rows);
  });
  return found;
}

// klpenalty._validation.check_token_range; tok (N,) int64 contiguous, tokens the caller's.
void check_token_range(const at::Tensor& tokens, const int64_t* tok, int64_t n, int64_t vocab,
                       int64_t ignore_index) {
  int64_t bad = 0, first = -1;
  for (int64_t r = 0; r < n; ++r) {
    if ((tok[r] < 0 || tok[r] >= vocab) && tok[r] != ignore_index) {
      if (first < 0) first = r;
      ++bad;
    }
  }
  TORCH_CHECK_VALUE(bad == 0, "tokens must lie in [0, ", vocab,
                    ") (the vocabulary size) or equal ignore_index=", ignore_index, "; ", bad,
                    " do not, the first ", (first < 0 ? 0 : tok[first]), " at index ",
                    py_tuple(unravel(first < 0 ? 0 : first, tokens.sizes())), " (",
                    describe(tokens), ")");
}


// Rows r with a NaN in one of the wanted columns of out (N, 4) (want: a mask of the columns).
template <typename O>
std::vector<int64_t> nan_rows(const O* out, int64_t n, int64_t want) {
  std::vector<int64_t> rows;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < kOutCols; ++c) {
      if ((want >> c & 1) && std::isnan(static_cast<double>(out[kOutCols * r + c]))) {
        rows.push_back(r);
        break;
      }
    }
  }
  return rows;
}

// klpenalty._validation.raise_if_nan on the wanted columns of out (..., 4) (float or double);
// named inputs (..., V).
void raise_if_nan(const at::Tensor& out, int64_t want, c10::IntArrayRef leading,
                  const std::vector<std::pair<std::string, at::Tensor>>& named) {
  const int64_t n = out.numel() / kOutCols;
  const std::vector<int64_t> rows = out.scalar_type() == at::kDouble
                                        ? nan_rows(out.const_data_ptr<double>(), n, want)
                                        : nan_rows(out.const_data_ptr<float>(), n, want);
  if (rows.empty()) return;
  const std::string first = py_tuple(unravel(rows[0], leading));
  for (const auto& [name, t] : named) {
    TORCH_CHECK_VALUE(!any_nan_in_rows(unit_last_stride(t), rows), name, " contains NaN (",
                      describe(t), ") in ", rows.size(), " counted position(s), the first at index ",
                      first);
  }
  TORCH_CHECK_VALUE(false, "the result is NaN in ", rows.size(),
                    " counted position(s), the first at index ", first,
                    ", although the inputs hold no NaN there: a row whose logits are all -inf (or "
                    "hold +inf) defines no distribution; mask such positions out");
}

// ------------------------------------------------------------------------------ the support
// The policy's support in one row: kept(v) = (no keep or keep[v]) and (no tau or x_v >= tau),
// the comparison made in tau's dtype (float32 or float64), as autograd.kept_logits.
struct Support {
  const bool* keep = nullptr;  // this row of the (..., V) bool mask, or null
  bool has_tau = false, tau_double = false;
  float tau_f = 0.0f;
  double tau_d = 0.0;

  bool any() const { return keep != nullptr || has_tau; }
  template <typename T>
  bool kept(const T* x, int64_t j) const {
    if (keep && !keep[j]) return false;
    if (!has_tau) return true;
    return tau_double ? static_cast<double>(x[j]) >= tau_d : static_cast<float>(x[j]) >= tau_f;
  }
  // logit j in double, −inf off the support
  template <typename T>
  double value(const T* x, int64_t j) const {
    return kept(x, j) ? static_cast<double>(x[j]) : -kInf;
  }
  // the threshold compared with (−inf: none)
  double threshold() const { return has_tau ? (tau_double ? tau_d : tau_f) : -kInf; }
  // the same support from column c0 on
  Support from(int64_t c0) const {
    Support s = *this;
    if (s.keep) s.keep += c0;
    return s;
  }
};

// The support with a sampler's threshold tau_s folded in: x >= max(tau, tau_s) (NaN if either
// is NaN), compared in double if tau is or the compute dtype is (tau_s is one of the logits).
Support with_threshold(Support s, double tau_s, bool in_double) {
  if (!s.has_tau) {
    s.has_tau = true;
    s.tau_double = in_double;
    s.tau_d = tau_s;
    s.tau_f = static_cast<float>(tau_s);
  } else if (s.tau_double) {
    s.tau_d = max_nan(s.tau_d, tau_s);
  } else {
    s.tau_f = static_cast<float>(max_nan(s.tau_f, tau_s));
  }
  return s;
}

// Elements [0, n) of a row of x (float32/bfloat16/float16) into buf as float, −inf off the
// support: the chunk of the truncated policy, read once from memory.
template <typename T>
void load_support(const T* x, const Support& sup, int64_t n, float* buf) {
  constexpr float ninf = -std::numeric_limits<float>::infinity();
  if (sup.keep && !sup.has_tau) {
    for (int64_t j = 0; j < n; ++j) buf[j] = sup.keep[j] ? static_cast<float>(x[j]) : ninf;
  } else if (!sup.keep && sup.has_tau && !sup.tau_double) {
    const float tau = sup.tau_f;
    for (int64_t j = 0; j < n; ++j) {
      const float v = static_cast<float>(x[j]);
      buf[j] = v >= tau ? v : ninf;
    }
  } else {
    for (int64_t j = 0; j < n; ++j) buf[j] = sup.kept(x, j) ? static_cast<float>(x[j]) : ninf;
  }
}

// ------------------------------------------------------------------------------ row state
// The engine's state of one row over the columns walked so far: maxima in logit units, s_x, s_y,
// the KL's a = Σ e^u·(u − w) and the entropy's b = Σ e^u·u (0·log 0 = 0), in double.
struct RowState {
  double m_x = -kInf, s_x = 0.0, m_y = -kInf, s_y = 0.0, a = 0.0, b = 0.0;
  bool careful = false;  // the row needed the 0·log 0 arithmetic
  bool bad = false;      // a maximum is NaN or +inf (vector path only): redo it in double
  bool off = false;      // an element lies off the support (its e^u is 0: the 0·log 0 rule)
};

// engine._rescale_moment: α·(a + shift·s), a sum Σ e^u·f(u) after u ← u + δ (the KL's a with
// shift δ_x − δ_y, the entropy's b with δ_x); 0 where the slice has no mass.
inline double rescale_moment(double s, double a, double shift, double alpha) {
  if (a == kInf) return kInf;  // KL = +inf whatever α (α may underflow to 0)
  const double shift_term = s > 0 ? shift * s : 0.0;
  return alpha > 0 ? alpha * (a + shift_term) : 0.0;
}

// The engine's merge of a chunk's sums (computed against the new maxima m_x, m_y) into the row
// state (kl_rescale / entropy_rescale + add), in double. ca, cb: already divided by T.
template <bool kY, bool kB>
inline void merge_chunk(RowState& row, double m_x, double m_y, double T, double cs_x,
                        double cs_y, double ca, double cb) {
  const auto [dx, alpha] = scales(row.m_x, m_x, T);
  if constexpr (kY) {
    const auto [dy, beta] = scales(row.m_y, m_y, T);
    row.a = rescale_moment(row.s_x, row.a, dx - dy, alpha) + ca;
    row.s_y = row.s_y * beta + cs_y;
    row.m_y = m_y;
  }
  if constexpr (kB) row.b = rescale_moment(row.s_x, row.b, dx, alpha) + cb;
  row.s_x = row.s_x * alpha + cs_x;
  row.m_x = m_x;
}

// One row, scalar double, the whole row as one tile with the engine's rules (float64 inputs,
// and rows with NaN or +inf). kY: y's state and the KL's a; kB: the entropy's b.
template <typename T>
RowState row_scalar(const T* px, const T* py, const Support& sup, int64_t V, double T_, bool kY,
                    bool kB) {
  RowState row;
  const bool truncated = sup.any();
  auto xv = [&](int64_t j) { return truncated ? sup.value(px, j) : static_cast<double>(px[j]); };
  for (int64_t j = 0; j < V; ++j) {
    row.m_x = max_nan(row.m_x, xv(j));
    if (kY) row.m_y = max_nan(row.m_y, static_cast<double>(py[j]));
  }
  const double shx = finite_or_zero(row.m_x), shy = finite_or_zero(row.m_y);
  double a = 0.0, b = 0.0;
  for (int64_t j = 0; j < V; ++j) {
    const double dx = xv(j) - shx, eu = std::exp(dx / T_);
    row.s_x += eu;
    if (eu == 0.0 && !std::isfinite(dx)) row.careful = true;  // 0·log 0 = 0
    if (kY) {
      const double dy = static_cast<double>(py[j]) - shy, ew = std::exp(dy / T_);
      row.s_y += ew;
      if (eu == 0.0 && !std::isfinite(dx - dy)) row.careful = true;
      a += careful_term(eu, dx - dy);  // 0·log 0 = 0; +inf where y = −inf at a finite x
    }
    if (kB && eu != 0.0) b += eu * dx;
  }
  row.a = a / T_;
  row.b = b / T_;
  return row;
}

// ------------------------------------------------------------------------------ chunk sums
// Float vectors per input in flight in the forward's inner loop: independent exps enough to hide
// the polynomial's latency behind the other chains (`klpenalty bench` measures 1, 2, 4 and 8).
constexpr int kChains = 4;
// Elements ahead that the one-pass walk asks memory for, for 4-byte inputs (twice the bytes
// per element pair of bf16/fp16, whose walk is bound by its arithmetic and gets none; measured
// in benchmarks/README.md).
constexpr int64_t kAhead = 512;

// The sums of the elements [0, n) of a chunk against shifts sh_x, sh_y, in double: s_x = Σ e^u,
// s_y = Σ e^w, a = Σ e^u·(d_x − d_y), b = Σ e^u·d_x with d = logit − shift and e^u = 2^(d_x·c),
// c = log2(e)/T (a and b not yet divided by T); with kTrack the chunk's maxima (NaN not kept: a
// NaN logit makes the sums NaN).
struct ChunkSums {
  double s_x = 0.0, s_y = 0.0, a = 0.0, b = 0.0;
  double max_x = -kInf, max_y = -kInf;
  bool off = false;  // an element off the support
  bool finite() const {
    return std::isfinite(s_x) && std::isfinite(s_y) && std::isfinite(a) && std::isfinite(b);
  }
};

// The inner loop of every forward walk: U vectors of x and of y per step (their lanes in any
// order when both have one dtype, load_lanes), whose 2·U exps are independent; one accumulator per sum (and per maximum),
// each added to U times per step (16 registers on AVX2 hold no more), its float lanes summing 8
// terms before they are added into double lanes (a float lane summing a whole chunk, 64 terms,
// lost ~1e-6 nats of a KL of 7); the tail in scalar code. kY: y's sums and a; kB: b; kCareful:
// e^u = 0 terms of a and b are dropped (0·log 0 = 0), without it such a term gives NaN; kTrack:
// the maxima alongside; ahead: elements ahead to prefetch (0: none). Every exponent is at most 0
// with shifts at the maxima, and at most the caller's bound otherwise (exp2_scaled).
template <int U, bool kY, bool kB, bool kCareful, bool kTrack, int64_t ahead, typename TX,
          typename TY, typename Sup = NoLanes>
ChunkSums chunk_sums(const TX* x, const TY* y, int64_t n, float sh_x, float sh_y, float c,
                     const Sup& sup = Sup(), const TX* side = nullptr) {
  constexpr int64_t kStep = U * VF::size();
  constexpr int kSteps = U >= 8 ? 1 : 8 / U;  // steps per float partial sum
  const VF vc(c), vsx(sh_x), vsy(sh_y), zero(0.0f), lo(-127.0f / c);
  const VF ninf(-std::numeric_limits<float>::infinity());
  [[maybe_unused]] const LaneMask all = lanes_all();
  [[maybe_unused]] LaneMask off = lanes_empty();
  VF mx(-std::numeric_limits<float>::infinity()), my = mx;
  WideSum ws_x, ws_y, wa, wb;
  int64_t i = 0;
  while (i + kStep <= n) {
    VF sx = zero, sy = zero, sa = zero, sb = zero;
    for (int s = 0; s < kSteps && i + kStep <= n; ++s, i += kStep) {
      if constexpr (ahead > 0) {
        constexpr int64_t kBytesX = kStep * static_cast<int64_t>(sizeof(TX));
        constexpr int64_t kBytesY = kStep * static_cast<int64_t>(sizeof(TY));
        const char* cx = reinterpret_cast<const char*>(x + i + ahead);
        for (int64_t b = 0; b < kBytesX; b += 64) __builtin_prefetch(cx + b);
        if constexpr (kY) {
          const char* cy = reinterpret_cast<const char*>(y + i + ahead);
          for (int64_t b = 0; b < kBytesY; b += 64) __builtin_prefetch(cy + b);
        }
        if (side) {  // the next row's logits, into L2, while this one is computed
          const char* cs = reinterpret_cast<const char*>(side + i);
          for (int64_t b = 0; b < kBytesX; b += 64) __builtin_prefetch(cs + b, 0, 2);
        }
      }
      VF xv[U], yv[U];
      // x from a float buffer, or a keep mask: memory order
      constexpr bool kAnyOrder = std::is_same_v<TX, TY> && !Sup::kKeep;
      load_lanes<U, kAnyOrder>(x + i, xv);
      if constexpr (kY) load_lanes<U, kAnyOrder>(y + i, yv);
#pragma GCC unroll 8
      for (int k = 0; k < U; ++k) {
        // off the support: e^u = 0 (x itself finite there, so no 0·inf), not in the maximum
        [[maybe_unused]] LaneMask kept;
        if constexpr (Sup::kOn) {
          kept = sup.at(xv[k], i + k * VF::size());
          off = lanes_or(off, lanes_andnot(all, kept));
        }
        if constexpr (kTrack) mx = max_fast(mx, Sup::kOn ? select(kept, xv[k], ninf) : xv[k]);
        const VF dx = xv[k] - vsx;
        VF eu = exp2_scaled(dx, vc, lo);
        if constexpr (Sup::kOn) eu = select(kept, eu, zero);
        sx = sx + eu;
        if constexpr (kY) {
          if constexpr (kTrack) my = max_fast(my, yv[k]);
          const VF dy = yv[k] - vsy;
          sy = sy + exp2_scaled(dy, vc, lo);
          if constexpr (kCareful) {
            sa = sa + moment_term<true>(eu, dx - dy);
          } else {
            sa = at::vec::fmadd(eu, dx - dy, sa);
          }
        }
        if constexpr (kB) {
          if constexpr (kCareful) {
            sb = sb + moment_term<true>(eu, dx);
          } else {
            sb = at::vec::fmadd(eu, dx, sb);
          }
        }
      }
    }
    ws_x.add(sx);
    if constexpr (kY) {
      ws_y.add(sy);
      wa.add(sa);
    }
    if constexpr (kB) wb.add(sb);
  }
  ChunkSums cs;
  if constexpr (Sup::kOn) cs.off = !lanes_none(off);
  cs.s_x = ws_x.value();
  if constexpr (kY) cs.s_y = ws_y.value(), cs.a = wa.value();
  if constexpr (kB) cs.b = wb.value();
  if constexpr (kTrack) {
    float buf[VF::size()];
    mx.store(buf);
    for (int k = 0; k < VF::size(); ++k) cs.max_x = std::max<double>(cs.max_x, buf[k]);
    if constexpr (kY) {
      my.store(buf);
      for (int k = 0; k < VF::size(); ++k) cs.max_y = std::max<double>(cs.max_y, buf[k]);
    }
  }
  for (; i < n; ++i) {
    const float xf = static_cast<float>(x[i]);
    const bool kept = sup.kept(xf, i);
    cs.off = cs.off || !kept;
    const float dx = xf - sh_x, eu = kept ? std::exp2(dx * c) : 0.0f;
    cs.s_x += eu;
    if constexpr (kTrack) {
      if (kept) cs.max_x = std::max<double>(cs.max_x, xf);
    }
    if constexpr (kY) {
      const float yf = static_cast<float>(y[i]);
      const float dy = yf - sh_y;
      if constexpr (kTrack) cs.max_y = std::max<double>(cs.max_y, yf);
      cs.s_y += std::exp2(dy * c);
      cs.a += kCareful ? careful_term(eu, static_cast<double>(dx - dy))
                       : static_cast<double>(eu * (dx - dy));
    }
    if constexpr (kB) {
      if (!kCareful || eu != 0.0f) cs.b += static_cast<double>(eu * dx);
    }
  }
  return cs;
}

// One chunk [0, n) of a row in two passes: its maxima, then from L1 (the next chunk requested
// meanwhile) the exps and sums against the row's new maxima, merged into the row state; false
// for a chunk holding NaN or +inf (the caller redoes the row in double) and, without kCareful,
// for a sum that is not finite (the caller redoes the row carefully: a later rescale by 0 would
// hide it, e.g. behind a first chunk of −inf in both rows, and the backward needs the flag).
template <bool kY, bool kB, bool kCareful, typename TX, typename TY, typename Sup = NoLanes>
bool chunk_step(RowState& row, const TX* x, const TY* y, int64_t n, double T_,
                const Sup& sup = Sup()) {
  const double cm_x = chunk_max_kept(x, n, sup);
  if (std::isnan(cm_x) || cm_x == kInf) return false;
  double m_y = -kInf;
  if constexpr (kY) {
    const double cm_y = chunk_max(y, n);
    if (std::isnan(cm_y) || cm_y == kInf) return false;
    m_y = std::max(row.m_y, cm_y);
  }
  const double m_x = std::max(row.m_x, cm_x);
  const ChunkSums cs = chunk_sums<kChains, kY, kB, kCareful, false, kChunk>(
      x, y, n, static_cast<float>(finite_or_zero(m_x)), static_cast<float>(finite_or_zero(m_y)),
      static_cast<float>(kLog2e / T_), sup);
  if (!kCareful && !cs.finite()) return false;
  row.off = row.off || cs.off;
  merge_chunk<kY, kB>(row, m_x, m_y, T_, cs.s_x, cs.s_y, cs.a / T_, cs.b / T_);
  return true;
}

// The one-pass walk's bound: a chunk whose maximum exceeds the row's running maximum (its
// shift) by more than kRise, in log2 units of e^u, is redone in two passes against its own
// maximum; below it every term is at most 2^kRise and its rounding about as small as against
// the maximum.
constexpr double kRise = 4.0;

// Elements at the start of a row whose maxima are the running maxima its first chunk is walked
// against (a first chunk whose maximum lies higher than the bound above them is redone).
constexpr int64_t kPrefix = 256;

// One untruncated row, float32 vectors, each chunk read once against the row's running maxima
// (at first those of its first kPrefix elements) with its own maxima alongside, merged without a
// rescale (and the state rescaled when the maxima rose); a chunk is walked in two passes where
// there are no finite running maxima or its maxima rose by more than the bound. bad: a chunk
// holds NaN or +inf, or a sum is not finite (the caller redoes the row with the careful or the
// double arithmetic).
template <bool kY, bool kB, typename T, typename Sup = NoLanes>
RowState row_fast(const T* px, const T* py, int64_t V, double T_, const Sup& sup_row = Sup(),
                  const T* side = nullptr) {
  RowState row;
  const float c = static_cast<float>(kLog2e / T_);
  if (V > kPrefix) {
    const double m_x = chunk_max_kept(px, kPrefix, sup_row);
    const double m_y = kY ? chunk_max(py, kPrefix) : -kInf;
    if (std::isnan(m_x) || m_x == kInf || std::isnan(m_y) || m_y == kInf) {
      row.bad = true;
      return row;
    }
    row.m_x = m_x, row.m_y = m_y;  // an empty state (all sums 0) at these maxima
  }
  for (int64_t c0 = 0; c0 < V; c0 += kChunk) {
    const int64_t n = std::min(kChunk, V - c0);
    const T* x = px + c0;
    const T* y = kY ? py + c0 : nullptr;
    const Sup sup = sup_row.from(c0);
    const bool shifted = std::isfinite(row.m_x) && (!kY || std::isfinite(row.m_y));
    if (shifted) {
      const float sh_x = static_cast<float>(row.m_x), sh_y = static_cast<float>(row.m_y);
      constexpr int64_t ahead = sizeof(T) >= 4 ? kAhead : 0;
      const ChunkSums cs =
          chunk_sums<kChains, kY, kB, false, true, ahead>(x, y, n, sh_x, sh_y, c, sup,
                                                          side ? side + c0 : side);
      const bool within = (cs.max_x - row.m_x) * c <= kRise &&
                          (!kY || (cs.max_y - row.m_y) * c <= kRise);
      if (within) {
        if (!cs.finite()) {
          row.bad = true;
          return row;
        }
        row.off = row.off || cs.off;
        row.s_x += cs.s_x;
        if constexpr (kY) row.s_y += cs.s_y, row.a += cs.a / T_;
        if constexpr (kB) row.b += cs.b / T_;
        const double m_x = std::max(row.m_x, cs.max_x);
        const double m_y = kY ? std::max(row.m_y, cs.max_y) : -kInf;
        if (m_x > row.m_x || (kY && m_y > row.m_y)) {
          merge_chunk<kY, kB>(row, m_x, m_y, T_, 0.0, 0.0, 0.0, 0.0);
        }
        continue;
      }
    }
    if (!chunk_step<kY, kB, false>(row, x, y, n, T_, sup)) {
      row.bad = true;
      return row;
    }
  }
  row.bad = !(std::isfinite(row.s_x) && std::isfinite(row.s_y) && std::isfinite(row.a) &&
              std::isfinite(row.b));
  return row;
}

// One row, float32 vectors, chunk by chunk in two passes; kSupport: each chunk of x is first
// copied into an L1 buffer with −inf off the support (and walked with the careful arithmetic).
template <bool kY, bool kB, bool kCareful, bool kSupport, typename T>
RowState row_vec(const T* px, const T* py, const Support& sup, int64_t V, double T_) {
  RowState row;
  alignas(64) float buf[kSupport ? kChunk : 1];
  row.bad = !for_each_chunk(V, [&](int64_t c0, int64_t n) {
    const T* y = kY ? py + c0 : nullptr;
    if constexpr (kSupport) {
      load_support(px + c0, sup.from(c0), n, buf);
      return chunk_step<kY, kB, kCareful>(row, static_cast<const float*>(buf), y, n, T_);
    } else {
      return chunk_step<kY, kB, kCareful>(row, px + c0, y, n, T_);
    }
  });
  row.careful = kCareful;
  return row;
}

// f(lanes) with the support's lane masks (SupLanes) for its kind: keep, tau or both.
template <typename F>
auto with_lanes(const Support& sup, F&& f) {
  const float tau = sup.tau_double ? ceil_float(sup.tau_d) : sup.tau_f;
  if (sup.keep && sup.has_tau) {
    SupLanes<true, true> l;
    l.keep = sup.keep, l.tau = tau, l.vtau = VF(tau);
    return f(l);
  }
  if (sup.keep) {
    SupLanes<true, false> l;
    l.keep = sup.keep;
    return f(l);
  }
  SupLanes<false, true> l;
  l.tau = tau, l.vtau = VF(tau);
  return f(l);
}

// THE row walker: the state of one row for what is wanted (kY: y and the KL, kB: the entropy;
// neither: the log-sum-exp of x for its log-probs), with or without a support. Untruncated rows
// take the fast one-pass walk and are redone carefully (0·log 0 = 0) only if a sum is not
// finite; truncated rows take the careful arithmetic (−inf off the support); NaN or +inf, and
// float64 inputs, the scalar double path.
template <bool kY, bool kB, typename T>
RowState walk_row(const T* px, const T* py, const Support& sup, int64_t V, double T_,
                  const T* side) {
  if constexpr (std::is_same_v<T, double>) {
    return row_scalar(px, py, sup, V, T_, kY, kB);
  } else {
    RowState row;
    if (sup.any()) {
      row = with_lanes(sup, [&](const auto& lanes) {
        return row_fast<kY, kB>(px, py, V, T_, lanes, side);
      });
      if (row.bad) row = row_vec<kY, kB, true, true>(px, py, sup, V, T_);
      // elements off the support (−inf in the truncated policy) need the 0·log 0 rule
      row.careful = row.careful || row.off;
    } else {
      row = row_fast<kY, kB>(px, py, V, T_, NoLanes(), side);
      if (row.bad) row = row_vec<kY, kB, true, false>(px, py, sup, V, T_);
    }
    if (row.bad) row = row_scalar(px, py, sup, V, T_, kY, kB);
    return row;
  }
}

template <typename T>
RowState walk(const T* px, const T* py, const Support& sup, int64_t V, double T_, bool kY,
              bool kB, const T* side = nullptr) {
  if (kY) {
    return kB ? walk_row<true, true>(px, py, sup, V, T_, side)
              : walk_row<true, false>(px, py, sup, V, T_, side);
  }
  return kB ? walk_row<false, true>(px, py, sup, V, T_, side)
            : walk_row<false, false>(px, py, sup, V, T_, side);
}

int64_t grain_rows(int64_t V) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(V, 1)); }

// f(r0, r1) over blocks of rows, in one parallel region whose threads take the next block from
// a shared counter: on a busy machine a descheduled thread delays only the block it holds,
// where a static split would make every other thread wait for its whole share.
template <typename F>
void parallel_rows(int64_t N, int64_t V, const F& f) {
  const int64_t block = grain_rows(V);
  const int64_t blocks = (N + block - 1) / block;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), blocks);
  if (workers <= 1) {
    if (N > 0) f(0, N);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t b = next.fetch_add(1); b < blocks; b = next.fetch_add(1)) {
      f(b * block, std::min(N, (b + 1) * block));
    }
  });
}

// ------------------------------------------------------------------------------ sampler threshold
// τ_s of top-k → top-p → min-p sampling for one row (klpenalty.sampling's rule: temperature first,
// ties at a boundary kept, at least one token kept): kept(v) iff x_v >= τ_s, τ_s one of the
// row's logits (−inf where nothing is cut, NaN for a row holding NaN, +inf for a row holding
// +inf under top-p / min-p). One function, row_threshold, serves the threshold op (rows in
// parallel) and the forward (each row's τ_s computed just before its walk, the row still in L2).
//
// - top-k: the k-th largest logit (counted with multiplicity). k ≤ V/8: one vectorised pass
//   keeping a running threshold th (the k-th largest seen so far, −inf at first) and compressing
//   the lanes > th into a buffer of 4k (at least 512) values; when it fills, nth_element finds
//   the k-th largest of it, th rises to it and the buffer keeps its k largest (exact: a value ≤
//   th never changes the k-th largest). Larger k: nth_element over a copy of the row.
// - top-p on the top-k distribution: masses e_v = exp(s_v − m), s = x/T, m = max s, Z = Σ e_v,
//   token j (decreasing order) kept iff the mass strictly before it is < p. Few candidates
//   (top-k with a small k, rows of at most kSmallRow, float64 rows): gathered in index order,
//   Z = Σ exp(s − m) in float64 in that order, then sorted and walked with the masses
//   exp(s_j − log Z') (log Z' = m + log Z) in float64, as torch's cumsum would. Large float rows:
//   one pass stores e_v (float32 exp2 polynomial) and sums Z in double lanes; then levels narrow
//   a bracket (lo, hi] of logits that holds the crossing: kLevelCuts thresholds evenly spaced in
//   the bracket, the mass above each (float lanes: a guide only), the sub-bracket that must hold
//   the crossing (a margin of kMargin·Z either side), its members and their masses compressed and
//   the mass above it added in double; until at most kWalkRow candidates are left (or no
//   progress: ties), which are sorted and walked from the mass above the bracket (a level over
//   a few hundred members costs less than sorting them).
// - min-p: π_v ≥ min_p·π_max ⟺ exp((x_v − max)/T) ≥ min_p, i.e. x_v ≥ c = max + T·log(min_p):
//   a vectorised pass takes the minimum over x ≥ c + δ (surely kept) and decides the few logits
//   within δ of c by the rule itself in double.
// τ_s is the largest of the three (each keeps an upper set of the logits).

constexpr int64_t kSmallRow = 256;   // candidates sorted and walked directly
constexpr int64_t kWalkRow = 32;     // the narrowing levels of a large row stop at this many
constexpr int kLevelCuts = 7;        // thresholds per narrowing level (8 sub-brackets)
constexpr double kSpan = 32.0;       // the guide's first thresholds: within 32·T of the max
constexpr int64_t kSampleRow = 4096;  // top-p rows from which a sample places pass 1's guide
constexpr int64_t kSampleEvery = 8;   // the sample: every 8th vector
constexpr double kMargin = 1e-4;     // relative to Z: the guide sums' error is below 1e-6

struct Sampler {
  int64_t top_k = 0;
  double top_p = 1.0, min_p = 0.0, T = 1.0;
  bool cut_k = false, cut_p = false, cut_min = false;
  Sampler() = default;
  Sampler(int64_t V, int64_t k, double p, double mp, double temperature)
      : top_k(k), top_p(p), min_p(mp), T(temperature) {
    cut_k = k >= 1 && k < V;
    cut_p = p < 1.0;
    cut_min = mp > 0.0;
  }
  bool cuts() const { return cut_k || cut_p || cut_min; }
};

// The op arguments checked as klpenalty.sampling checks the public ones (0, 1, 0: unused).
void check_sampler_args(int64_t top_k, double top_p, double min_p) {
  TORCH_CHECK_VALUE(top_k >= 0, "top_k must be >= 1 (or 0: unused), got ", top_k);
  TORCH_CHECK_VALUE(top_p > 0.0 && top_p <= 1.0, "top_p must lie in (0, 1], got ", top_p);
  TORCH_CHECK_VALUE(min_p >= 0.0 && min_p <= 1.0, "min_p must lie in [0, 1], got ", min_p);
}

// Per-thread buffers of the threshold (reused across rows and calls).
struct ThresholdScratch {
  std::vector<float> xs, es, cx0, ce0, cx1, ce1, kbuf, lm;
  std::vector<double> cand;
  int64_t survivors = -1;  // kth_largest's: the logits >= its lower bound, kept in kbuf
};

ThresholdScratch& scratch() {
  thread_local ThresholdScratch s;
  return s;
}

// (max, min) of a row; max NaN if the row holds NaN. The first read of the row: four
// independent vectors per step and the lines kAhead elements ahead requested meanwhile. For float
// rows, lane_max (if given) receives the lane maxima of each block of kLaneBlock elements
// (kLaneBlock/VF::size() elements each, distinct elements of the row), *lanes their number.
constexpr int64_t kLaneBlock = 256;
template <typename T>
std::pair<double, double> row_max_min(const T* x, int64_t V, float* lane_max = nullptr,
                                      int64_t* lanes = nullptr) {
  if constexpr (std::is_same_v<T, double>) {
    double mx = -kInf, mn = kInf;
    for (int64_t j = 0; j < V; ++j) {
      mx = max_nan(mx, x[j]);
      mn = std::min(mn, x[j]);
    }
    return {mx, mn};
  } else {
    constexpr int U = 4;
    constexpr int64_t kStep = U * VF::size();
    constexpr int64_t kBytes = kStep * static_cast<int64_t>(sizeof(T));
    constexpr float finf = std::numeric_limits<float>::infinity();
    static_assert(kLaneBlock % kStep == 0, "a lane block is whole steps");
    VF mx[U], mn[U], gmax(-finf);
    for (int k = 0; k < U; ++k) mn[k] = VF(finf);
    LaneMask nan = lanes_empty();
    int64_t i = 0, nl = 0;
    while (i + kLaneBlock <= V) {
      for (int k = 0; k < U; ++k) mx[k] = VF(-finf);
      for (int64_t e = i + kLaneBlock; i < e; i += kStep) {
        const char* ahead = reinterpret_cast<const char*>(x + i + kAhead);
        for (int64_t b = 0; b < kBytes; b += 64) __builtin_prefetch(ahead + b);
#pragma GCC unroll 4
        for (int k = 0; k < U; ++k) {
          const VF v = load1(x + i + k * VF::size());
          mx[k] = max_fast(mx[k], v);
          mn[k] = at::vec::clamp_max(mn[k], v);
          nan = lanes_or(nan, lanes_nan(v));
        }
      }
      const VF bm = max_fast(max_fast(mx[0], mx[1]), max_fast(mx[2], mx[3]));
      if (lane_max) bm.store(lane_max + nl);
      nl += VF::size();
      gmax = max_fast(gmax, bm);
    }
    if (lanes) *lanes = nl;
    for (int k = 0; k < U; ++k) mx[k] = VF(-finf);
    mx[0] = gmax;
    for (; i + kStep <= V; i += kStep) {
#pragma GCC unroll 4
      for (int k = 0; k < U; ++k) {
        const VF v = load1(x + i + k * VF::size());
        mx[k] = max_fast(mx[k], v);
        mn[k] = at::vec::clamp_max(mn[k], v);
        nan = lanes_or(nan, lanes_nan(v));
      }
    }
    double m1 = -kInf, m0 = kInf;
    if (!lanes_none(nan)) return {kNaN, kNaN};
    float bx[VF::size()], bn[VF::size()];
    for (int k = 0; k < U; ++k) {
      mx[k].store(bx);
      mn[k].store(bn);
      for (int l = 0; l < VF::size(); ++l) {
        m1 = std::max<double>(m1, bx[l]);
        m0 = std::min<double>(m0, bn[l]);
      }
    }
    for (; i < V; ++i) {
      const double v = static_cast<float>(x[i]);
      m1 = max_nan(m1, v);
      m0 = std::min(m0, v);
    }
    return {m1, m0};
  }
}

// The top-p walk over candidates c[0, n) (in any order): sorted decreasing, token j kept iff
// before_j < p, before_0 = above (the mass above the candidates, normalised), before_{j+1} =
// before_j + exp(c_j/T − log_z); the smallest kept candidate (at least the first; −inf never).
inline double top_p_walk(double* c, int64_t n, double p, double T, double above, double log_z) {
  std::sort(c, c + n, std::greater<>());
  double before = above, last = n ? c[0] : -kInf;
  for (int64_t j = 0; j < n && before < p && c[j] > -kInf; ++j) {
    last = c[j];
    before += std::exp(c[j] / T - log_z);
  }
  return last;
}

// top-p over the candidates c[0, n) alone (index order): Z in float64 in that order.
inline double top_p_small(double* c, int64_t n, double p, double T) {
  double m = -kInf;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, c[j] / T);
  if (m == -kInf) return -kInf;
  double z = 0.0;
  for (int64_t j = 0; j < n; ++j) z += std::exp(c[j] / T - m);
  return top_p_walk(c, n, p, T, 0.0, m + std::log(z));
}

// Appends the logits x[i0, i1) >= ft of a float row to b[n...] in index order; returns the new n.
template <typename T>
inline int64_t gather_range(const T* x, int64_t i0, int64_t i1, float ft, float* b, int64_t n) {
  const VF vt(ft);
  int64_t i = i0;
  for (; i + VF::size() <= i1; i += VF::size()) {
    const VF v = load1(x + i);
    const LaneMask m = lanes_ge(v, vt);
    if (!lanes_none(m)) n += compress_store(b + n, m, v);
  }
  for (; i < i1; ++i) {
    const float v = static_cast<float>(x[i]);
    if (v >= ft) b[n++] = v;
  }
  return n;
}

// w.cand = the logits x >= tau (and > −inf) of a row, in index order.
template <typename T>
void gather_at_least(const T* x, int64_t V, double tau, ThresholdScratch& w) {
  w.cand.clear();
  if constexpr (std::is_same_v<T, double>) {
    for (int64_t j = 0; j < V; ++j) {
      if (x[j] >= tau && x[j] > -kInf) w.cand.push_back(x[j]);
    }
  } else {
    // tau is −inf or one of the (float) logits
    const float ft = tau == -kInf ? std::numeric_limits<float>::lowest() : static_cast<float>(tau);
    w.kbuf.resize(V + VF::size());
    float* b = w.kbuf.data();
    w.cand.assign(b, b + gather_range(x, 0, V, ft, b, 0));
  }
}

// The same for a float row whose lane maxima lm (row_max_min's, `lanes` of them) are known and
// tau > −inf: only the kLaneBlock-logit blocks with a lane maximum >= tau (and the tail after the
// last whole block) can hold such logits, so only they are read (the same logits, same order).
template <typename T>
void gather_at_least_blocks(const T* x, int64_t V, double tau, const float* lm, int64_t lanes,
                            ThresholdScratch& w) {
  const float ft = static_cast<float>(tau);  // one of the (float) logits
  w.kbuf.resize(V + VF::size());
  float* b = w.kbuf.data();
  const VF vt(ft);
  int64_t n = 0;
  auto scan = [&](int64_t i0, int64_t i1) { n = gather_range(x, i0, i1, ft, b, n); };
  const int64_t blocks = lanes / VF::size();
  for (int64_t k = 0; k < blocks; ++k) {
    if (!lanes_none(lanes_ge(VF::loadu(lm + k * VF::size()), vt))) {
      scan(k * kLaneBlock, (k + 1) * kLaneBlock);
    }
  }
  scan(blocks * kLaneBlock, V);
  w.cand.assign(b, b + n);
}

// The bracket's next bounds from the guide g (the mass above each threshold t, which increase):
// the mass above hi' surely < P, above lo' surely >= P (kMargin·Z either side).
inline void narrow(const float* t, const double* g, double above, double P, double margin,
                   double& lo, double& hi) {
  double nhi = hi, nlo = lo;
  for (int b = kLevelCuts - 1; b >= 0 && above + g[b] < P - margin; --b) nhi = t[b];
  for (int b = 0; b < kLevelCuts && above + g[b] >= P + margin; ++b) nlo = t[b];
  lo = nlo, hi = nhi;
}

// Guide thresholds evenly spaced in (lo_t, hi).
inline void guide_cuts(double lo_t, double hi, float* t, VF* vt) {
  for (int b = 0; b < kLevelCuts; ++b) {
    t[b] = static_cast<float>(lo_t + (hi - lo_t) * (b + 1) / (kLevelCuts + 1));
    vt[b] = VF(t[b]);
  }
}

// The guide's float lanes added into g (double), every 64 vectors.
inline void flush_guide(VF* acc, double* g) {
  for (int b = 0; b < kLevelCuts; ++b) {
    float f[VF::size()];
    acc[b].store(f);
    double sum = 0.0;
    for (int l = 0; l < VF::size(); ++l) sum += f[l];
    g[b] += sum;
    acc[b] = VF(0.0f);
  }
}

// top-p of a large float row. Pass 1 over the row: e = exp((x − M)/T) where x > lo (0 elsewhere;
// lo just below τ_k under top-k), stored; Z in double lanes; the first level's guide alongside.
// Then per level: the members of the new bracket compressed (their logits and masses e) and the
// mass above it added in double; the next guide over the members and their stored e.
template <bool kCount, typename T>
double select_large(const T* x, int64_t V, double M, double row_min, double lo, const Sampler& s,
                    ThresholdScratch& w) {
  const float c = static_cast<float>(kLog2e / s.T);
  const VF vc(c), vM(static_cast<float>(M)), vlo_exp(-127.0f / c), zero(0.0f), one(1.0f);
  // the weight of a member: its mass e (top-p) or 1 (top-k)
  auto weight = [&](const VF& v) { return kCount ? one : exp2_scaled(v - vM, vc, vlo_exp); };
  auto weight1 = [&](float v) {
    return kCount ? 1.0f : std::exp2((v - static_cast<float>(M)) * c);
  };
  const VF vlo(static_cast<float>(lo));
  // the weight of a logit of the row (0 at or below lo); top-p without a lower bound skips the
  // comparison (exp2_scaled gives 0 at −inf already; a count must still leave −inf out)
  const bool has_lo = kCount || lo > -kInf;
  auto row_weight = [&](const VF& v) {
    return has_lo ? select(lanes_gt(v, vlo), weight(v), zero) : weight(v);
  };
  if constexpr (!kCount) w.es.resize(V + VF::size());
  float* es = w.es.data();
  double hi = M, above = 0.0;  // the bracket (lo, hi]; above: the mass of x > hi
  // the guide's thresholds start above M − kSpan·T (lower logits hold below 1e-9 of Z)
  double lo_t = std::max({lo, row_min, M - kSpan * s.T});
  float t[kLevelCuts];
  VF vt[kLevelCuts], acc[kLevelCuts];
  double g[kLevelCuts] = {};
  double cut_lo = lo_t, cut_hi = hi;  // where pass 1 places its guide's thresholds
  double z = 0.0, P = 0.0, margin = 0.0;
  int64_t n = V;
  const float* cx = nullptr;  // the members after the first level
  const float* ce = nullptr;  // their masses (top-p; counts weigh 1)
  int flip = 0;
  bool direct = false;  // the sample's bracket held the crossing: its members, in one pass
  if (!kCount && V >= kSampleRow) {
    // a sample (every kSampleEvery-th vector) places them: the bracket that the sample's guide
    // gives (a margin of 2% of its Z); only where the thresholds lie depends on it, so a poor
    // sample costs a level, never the result
    guide_cuts(lo_t, hi, t, vt);
    for (int b = 0; b < kLevelCuts; ++b) acc[b] = zero;
    const int64_t ns = (V / VF::size() + kSampleEvery - 1) / kSampleEvery * VF::size();
    w.xs.resize(ns + VF::size());
    w.ce0.resize(ns + VF::size());
    float* sx = w.xs.data();
    float* se = w.ce0.data();
    VF za = zero;
    int64_t j = 0;
    for (int64_t i = 0; i + VF::size() <= V; i += kSampleEvery * VF::size(), j += VF::size()) {
      const VF v = load1(x + i);
      const VF e = row_weight(v);
      v.store(sx + j);
      e.store(se + j);
      za = za + e;
#pragma GCC unroll 16
      for (int b = 0; b < kLevelCuts; ++b) acc[b] = add_where(acc[b], lanes_gt(v, vt[b]), e);
    }
    flush_guide(acc, g);
    WideSum zsum;
    zsum.add(za);
    const double zs0 = zsum.value();
    double a = lo_t, b = hi;
    narrow(t, g, 0.0, s.top_p * zs0, 0.02 * zs0, a, b);
    // a second, finer look at the same sample (its stored masses)
    if (b > std::max(lo_t, a)) {
      for (int k = 0; k < kLevelCuts; ++k) g[k] = 0.0;
      guide_cuts(std::max(lo_t, a), b, t, vt);
      for (int64_t q = 0; q < j; q += VF::size()) {
        const VF v = VF::loadu(sx + q), e = VF::loadu(se + q);
#pragma GCC unroll 16
        for (int k = 0; k < kLevelCuts; ++k) acc[k] = add_where(acc[k], lanes_gt(v, vt[k]), e);
        if ((q / VF::size()) % 64 == 63) flush_guide(acc, g);
      }
      flush_guide(acc, g);
      narrow(t, g, 0.0, s.top_p * zs0, 0.02 * zs0, a, b);
    }
    cut_lo = std::max(lo_t, a), cut_hi = b;
    for (int k = 0; k < kLevelCuts; ++k) g[k] = 0.0;
    // one pass: Z, the mass above the sample's bracket (fa, fb] and its members, in double;
    // kept if the crossing surely lies inside (else pass 1 below, its guide placed there)
    const float fa = static_cast<float>(cut_lo), fb = static_cast<float>(cut_hi);
    if (fb > fa) {
      w.cx0.resize(V + VF::size());
      w.ce0.resize(V + VF::size());  // (the sample's masses are no longer needed)
      float* od = w.cx0.data();
      float* oe = w.ce0.data();
      const VF va(fa), vb(fb);
      WideSum zw, uw, mw;
      int64_t m = 0, i = 0;
      VF z8, u8, m8;
      auto step = [&](int64_t at) {
        const VF v = load1(x + at);
        const VF e = row_weight(v);
        z8 = z8 + e;
        const LaneMask upper = lanes_gt(v, vb);
        u8 = add_where(u8, upper, e);
        const LaneMask in = lanes_andnot(lanes_gt(v, va), upper);
        m8 = add_where(m8, in, e);
        compress_store(oe + m, in, e);
        m += compress_store(od + m, in, v);
      };
      // groups of 8 vectors (whole groups unrolled), each group's float sums added in double
      for (; i + 8 * VF::size() <= V; i += 8 * VF::size()) {
        z8 = zero, u8 = zero, m8 = zero;
#pragma GCC unroll 8
        for (int f = 0; f < 8; ++f) step(i + f * VF::size());
        zw.add(z8), uw.add(u8), mw.add(m8);
      }
      if (i + VF::size() <= V) {
        z8 = zero, u8 = zero, m8 = zero;
        for (; i + VF::size() <= V; i += VF::size()) step(i);
        zw.add(z8), uw.add(u8), mw.add(m8);
      }
      double zz = zw.value(), up = uw.value(), mm = mw.value();
      for (; i < V; ++i) {
        const float v = static_cast<float>(x[i]);
        const float e = v > lo ? weight1(v) : 0.0f;
        zz += e;
        if (v > fb) {
          up += e;
        } else if (v > fa) {
          mm += e;
          oe[m] = e;
          od[m++] = v;
        }
      }
      const double Pz = s.top_p * zz, mz = kMargin * zz;
      if (up < Pz - mz && up + mm >= Pz + mz) {
        direct = true;
        z = zz, P = Pz, margin = mz, above = up, n = m, cx = od, ce = oe;
        lo = fa, hi = fb, lo_t = std::max(lo_t, static_cast<double>(fa));
      }
    }
  }
  if (!direct) {
  guide_cuts(cut_lo, cut_hi, t, vt);
  for (int b = 0; b < kLevelCuts; ++b) acc[b] = zero;
  WideSum zs;
  int64_t i = 0;
  while (i + VF::size() <= V) {
    VF za = zero;
    for (int f = 0; f < 64 && i + VF::size() <= V; ++f, i += VF::size()) {
      const VF v = load1(x + i);
      const VF e = row_weight(v);
      if constexpr (!kCount) e.store(es + i);
      za = za + e;
#pragma GCC unroll 16
      for (int b = 0; b < kLevelCuts; ++b) acc[b] = add_where(acc[b], lanes_gt(v, vt[b]), e);
    }
    zs.add(za);
    flush_guide(acc, g);
  }
  z = zs.value();
  for (; i < V; ++i) {
    const float v = static_cast<float>(x[i]);
    const float e = v > lo ? weight1(v) : 0.0f;
    if constexpr (!kCount) es[i] = e;
    z += e;
    for (int b = 0; b < kLevelCuts; ++b) g[b] += v > t[b] ? e : 0.0f;
  }
  if (kCount && z < s.top_k) return -kInf;  // fewer than k logits above −inf
  // counts are exact (integers below 2^24 in float lanes): no margin
  P = kCount ? static_cast<double>(s.top_k) : s.top_p * z;
  margin = kCount ? 0.0 : kMargin * z;
  }
  for (bool first = !direct; n > kWalkRow; first = false) {
    if (!first) {  // the guide over the members
      for (int b = 0; b < kLevelCuts; ++b) g[b] = 0.0, acc[b] = zero;
      guide_cuts(lo_t, hi, t, vt);
      int64_t j = 0;
      while (j + VF::size() <= n) {
        for (int f = 0; f < 64 && j + VF::size() <= n; ++f, j += VF::size()) {
          const VF v = VF::loadu(cx + j);
          const VF e = kCount ? one : VF::loadu(ce + j);
#pragma GCC unroll 16
          for (int b = 0; b < kLevelCuts; ++b) acc[b] = add_where(acc[b], lanes_gt(v, vt[b]), e);
        }
        flush_guide(acc, g);
      }
      for (; j < n; ++j) {
        const float e = kCount ? 1.0f : ce[j];
        for (int b = 0; b < kLevelCuts; ++b) g[b] += cx[j] > t[b] ? e : 0.0f;
      }
    }
    double nlo = lo, nhi = hi;
    narrow(t, g, above, P, margin, nlo, nhi);
    if (nhi <= nlo) break;  // (not reached: the guide is monotone up to its rounding)
    flip ^= 1;
    std::vector<float>& ox = flip ? w.cx1 : w.cx0;
    std::vector<float>& oxe = flip ? w.ce1 : w.ce0;
    ox.resize(n + VF::size());
    if constexpr (!kCount) oxe.resize(n + VF::size());
    const VF vnlo(static_cast<float>(nlo)), vnhi(static_cast<float>(nhi));
    WideSum up;
    int64_t m = 0, j = 0;
    float* od = ox.data();
    float* oe = kCount ? nullptr : oxe.data();
    // members keep their masses (computed once, in pass 1 or the sample's pass)
    auto member = [&](const VF& v, const VF& e, VF& a) {
      const LaneMask upper = lanes_gt(v, vnhi);
      a = add_where(a, upper, e);
      const LaneMask in = lanes_andnot(lanes_gt(v, vnlo), upper);
      if constexpr (!kCount) compress_store(oe + m, in, e);
      m += compress_store(od + m, in, v);
    };
    if (first) {
      while (j + VF::size() <= n) {
        VF a = zero;
        for (int f = 0; f < 8 && j + VF::size() <= n; ++f, j += VF::size()) {
          const VF v = load1(x + j);
          member(v, kCount ? one : VF::loadu(es + j), a);
        }
        up.add(a);
      }
    } else {
      while (j + VF::size() <= n) {
        VF a = zero;
        for (int f = 0; f < 8 && j + VF::size() <= n; ++f, j += VF::size()) {
          const VF v = VF::loadu(cx + j);
          member(v, kCount ? one : VF::loadu(ce + j), a);
        }
        up.add(a);
      }
    }
    double add = up.value();
    for (; j < n; ++j) {
      const float v = first ? static_cast<float>(x[j]) : cx[j];
      const float e = kCount ? 1.0f : (first ? es[j] : ce[j]);
      if (v > nhi) {
        add += e;
      } else if (v > nlo) {
        if constexpr (!kCount) oe[m] = e;
        ox[m++] = v;
      }
    }
    const bool progress = m < n;
    above += add, hi = nhi, lo = nlo, n = m, cx = ox.data(), ce = oe;
    lo_t = std::max(lo_t, nlo);
    if (!progress) break;  // ties: the walk sorts what is left
  }
  if (cx == nullptr) {  // (rows of more than kSmallRow logits always narrow at least once)
    gather_at_least(x, V, std::nextafter(lo, kInf), w);
  } else {
    w.cand.assign(cx, cx + n);
  }
  double* cand = w.cand.data();
  const int64_t nc = static_cast<int64_t>(w.cand.size());
  if constexpr (kCount) {  // the (k − above)-th largest member
    const int64_t at = std::min<int64_t>(nc - 1, std::max<int64_t>(0, s.top_k - 1 - static_cast<int64_t>(above)));
    std::nth_element(cand, cand + at, cand + nc, std::greater<>());
    return cand[at];
  } else {
    return top_p_walk(cand, nc, s.top_p, s.T, above / z, M / s.T + std::log(z));
  }
}

// The k-th largest logit of a row without NaN (1 ≤ k < V), counted with multiplicity: the
// smallest logit g with fewer than k logits > g, narrowed as top-p's crossing with unit weights
// (float rows of more than kSmallRow logits), else nth_element over a copy.
template <typename T>
double kth_largest(const T* x, int64_t V, double M, double row_min, const Sampler& s,
                   ThresholdScratch& w, int64_t lanes) {
  w.survivors = -1;
  if constexpr (!std::is_same_v<T, double>) {
    // a small k: th0 = the k-th largest lane maximum (k distinct logits >= th0, so the k-th
    // largest logit is the k-th largest of the logits >= th0, a few times k of them)
    if (4 * s.top_k <= lanes) {
      const double th0 = select_large<true>(w.lm.data(), lanes, M, row_min, -kInf, s, w);
      if (th0 > -kInf) {
        gather_at_least_blocks(x, V, th0, w.lm.data(), lanes, w);
      } else {
        gather_at_least(x, V, th0, w);
      }
      const int64_t n = static_cast<int64_t>(w.cand.size());
      if (n >= s.top_k && n <= 64 * s.top_k + 4096) {
        w.survivors = n;  // w.kbuf[0, n): the logits >= th0, in index order
        std::nth_element(w.cand.begin(), w.cand.begin() + (s.top_k - 1), w.cand.end(),
                         std::greater<>());
        return w.cand[s.top_k - 1];
      }
    }
    if (V > kSmallRow) return select_large<true>(x, V, M, row_min, -kInf, s, w);
  }
  w.cand.resize(V);
  for (int64_t j = 0; j < V; ++j) w.cand[j] = static_cast<double>(x[j]);
  std::nth_element(w.cand.begin(), w.cand.begin() + (s.top_k - 1), w.cand.end(), std::greater<>());
  return w.cand[s.top_k - 1];
}

// The smallest logit with exp((x − M)/T) >= min_p (M finite: the max, always kept).
template <typename T>
double min_p_threshold(const T* x, int64_t V, double M, const Sampler& s) {
  const double c = M + s.T * std::log(s.min_p);
  const double delta = 1e-9 * (std::fabs(M) + std::fabs(c) + s.T);
  auto rule = [&](double v) { return std::exp((v - M) / s.T) >= s.min_p; };
  double best = M;
  if constexpr (std::is_same_v<T, double>) {
    for (int64_t j = 0; j < V; ++j) {
      const double v = x[j];
      if (v < best && v >= c - delta && (v >= c + delta || rule(v))) best = v;
    }
    return best;
  } else {
    // float bounds: above fhi surely kept, below flo surely not
    const float fhi = std::nextafter(static_cast<float>(c + delta), std::numeric_limits<float>::infinity());
    const float flo = std::nextafter(static_cast<float>(c - delta), -std::numeric_limits<float>::infinity());
    constexpr float finf = std::numeric_limits<float>::infinity();
    const VF vhi(fhi), vlo(flo), vinf(finf);
    constexpr int U = 4;
    VF mn[U];
    for (int k = 0; k < U; ++k) mn[k] = vinf;
    auto one = [&](const VF& v, VF& acc) {
      const LaneMask sure = lanes_ge(v, vhi);
      acc = at::vec::clamp_max(acc, select(sure, v, vinf));
      const LaneMask band = lanes_andnot(lanes_ge(v, vlo), sure);
      if (!lanes_none(band)) {
        float f[VF::size()];
        v.store(f);
        for (int k = 0; k < VF::size(); ++k) {
          if (f[k] >= flo && f[k] < fhi && f[k] < best && rule(f[k])) best = f[k];
        }
      }
    };
    int64_t i = 0;
    for (; i + U * VF::size() <= V; i += U * VF::size()) {
#pragma GCC unroll 4
      for (int k = 0; k < U; ++k) one(load1(x + i + k * VF::size()), mn[k]);
    }
    for (; i + VF::size() <= V; i += VF::size()) one(load1(x + i), mn[0]);
    for (int k = 0; k < U; ++k) {
      float f[VF::size()];
      mn[k].store(f);
      for (int l = 0; l < VF::size(); ++l) best = std::min<double>(best, f[l]);
    }
    for (; i < V; ++i) {
      const float v = static_cast<float>(x[i]);
      if (v < best && v >= flo && (v >= fhi || rule(v))) best = v;
    }
    return best;
  }
}

// τ_s of one row (see above); s.cuts() holds.
template <typename T>
double row_threshold(const T* x, int64_t V, const Sampler& s, ThresholdScratch& w) {
  int64_t lanes = 0;
  float* lane_max = nullptr;
  if (!std::is_same_v<T, double> && s.cut_k) {
    w.lm.resize(V / kLaneBlock * VF::size() + VF::size());
    lane_max = w.lm.data();
  }
  const auto [M, row_min] = row_max_min(x, V, lane_max, &lanes);
  if (std::isnan(M)) return kNaN;  // a row holding NaN keeps nothing
  if (M == -kInf) return -kInf;    // every logit −inf: every step keeps them all
  double tau = -kInf;
  w.survivors = -1;
  if (s.cut_k) tau = kth_largest(x, V, M, row_min, s, w, lanes);
  if ((s.cut_p || s.cut_min) && M == kInf) return kInf;  // only the +inf logits
  if (s.cut_p) {
    double tp;
    const bool few = s.cut_k && 8 * s.top_k <= V;
    if (std::is_same_v<T, double> || few || V <= kSmallRow) {
      if (w.survivors >= 0) {  // the candidates x >= τ_k among top-k's survivors, in order
        w.cand.clear();
        for (int64_t j = 0; j < w.survivors; ++j) {
          if (w.kbuf[j] >= tau) w.cand.push_back(w.kbuf[j]);
        }
      } else {
        gather_at_least(x, V, tau, w);  // the candidates x >= τ_k, in index order
      }
      tp = top_p_small(w.cand.data(), static_cast<int64_t>(w.cand.size()), s.top_p, s.T);
    } else {
      const double lo = s.cut_k ? std::nextafter(static_cast<float>(tau), -std::numeric_limits<float>::infinity())
                                : -kInf;
      if constexpr (std::is_same_v<T, double>) {
        tp = -kInf;  // (float64 rows take the branch above)
      } else {
        tp = select_large<false>(x, V, M, row_min, lo, s, w);
      }
    }
    tau = std::max(tau, tp);
  }
  if (s.cut_min) tau = std::max(tau, min_p_threshold(x, V, M, s));
  return tau;
}

// ------------------------------------------------------------------------------ arguments
void check_logits_arg(const char* name, const at::Tensor& t) {
  TORCH_CHECK_TYPE(t.is_floating_point(), name, " must be a floating-point tensor (..., V), got ",
                   describe(t));
  TORCH_CHECK_VALUE(t.dim() >= 1 && t.size(-1) >= 1, name,
                    " must have shape (..., V) with V >= 1, got ", describe(t));
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor for the native backend, got ",
                    t.device());
}

void check_temperature(double T) {
  TORCH_CHECK_VALUE(std::isfinite(T) && T > 0, "temperature must be finite and > 0, got ", T);
}

std::vector<int64_t> leading_of(const at::Tensor& t) {
  auto s = t.sizes().vec();
  s.pop_back();
  return s;
}

// A (...) bool mask as a flat contiguous tensor, checked against the leading dims.
at::Tensor flat_mask(const std::optional<at::Tensor>& mask, c10::IntArrayRef leading) {
  if (!mask.has_value()) return at::Tensor();
  const at::Tensor& m = *mask;
  TORCH_CHECK_TYPE(m.scalar_type() == at::kBool,
                   "mask must be a bool tensor (True = position counts), got ", describe(m));
  TORCH_CHECK_VALUE(m.sizes() == leading, "mask must have shape ", py_tuple(leading.vec()),
                    " (the leading dims of the logits), got ", describe(m));
  return m.contiguous();
}

at::Tensor flat_tokens(const at::Tensor& tokens, c10::IntArrayRef leading) {
  TORCH_CHECK_TYPE(!tokens.is_floating_point() && !tokens.is_complex() &&
                       tokens.scalar_type() != at::kBool,
                   "tokens must be an integer tensor, got ", describe(tokens));
  TORCH_CHECK_VALUE(tokens.sizes() == leading, "tokens must have shape ", py_tuple(leading.vec()),
                    " (the leading dims of the logits), got ", describe(tokens));
  return tokens.to(at::kLong).contiguous();
}

// The checked arguments of both ops: logits with a unit last stride (both in the compute dtype
// when their dtypes differ, a rare case), flat contiguous per-position tensors, and the support.
struct StatsArgs {
  at::Tensor x_in, y_in, tokens_in;  // the caller's, for messages
  at::Tensor x, y, tok, mask, keep, tau;
  std::vector<int64_t> leading;
  int64_t V = 0, N = 0, want = 0;
  at::ScalarType ct = at::kFloat;  // compute dtype
  bool mixed = false;
  bool need_x_state = false, need_y_state = false;  // which logits the forward walks

  StatsArgs(const at::Tensor& x_arg, const std::optional<at::Tensor>& y_arg,
            const std::optional<at::Tensor>& tokens_arg, const std::optional<at::Tensor>& mask_arg,
            const std::optional<at::Tensor>& keep_arg, const std::optional<at::Tensor>& tau_arg,
            double T, int64_t want_arg)
      : x_in(x_arg), want(want_arg) {
    const bool has_y = y_arg.has_value();
    check_logits_arg(has_y ? "policy_logits" : "logits", x_in);
    if (has_y) {
      y_in = *y_arg;
      check_logits_arg("ref_logits", y_in);
      TORCH_CHECK_VALUE(x_in.sizes() == y_in.sizes(),
                        "policy_logits and ref_logits must have the same shape (..., V): "
                        "policy_logits ", describe(x_in), ", ref_logits ", describe(y_in));
    }
    check_temperature(T);
    TORCH_CHECK_VALUE(want > 0 && want < 16,
                      "want must be a nonzero sum of WANT_KL=1, WANT_LOGP=2, WANT_REF_LOGP=4 and "
                      "WANT_ENTROPY=8, got ", want);
    TORCH_CHECK_VALUE(has_y || !(want & (kWantKL | kWantRefLogp)),
                      "want asks for the KL or the reference log-probs (", want,
                      ") but ref_logits is None");
    TORCH_CHECK_VALUE(tokens_arg.has_value() || !(want & (kWantLogp | kWantRefLogp)),
                      "want asks for token log-probs (", want, ") but tokens is None");
    ct = (x_in.scalar_type() == at::kDouble || (has_y && y_in.scalar_type() == at::kDouble))
             ? at::kDouble
             : at::kFloat;
    x = unit_last_stride(x_in);
    if (has_y) {
      y = unit_last_stride(y_in);
      mixed = x.scalar_type() != y.scalar_type();
      if (mixed) {
        x = x.to(ct);
        y = y.to(ct);
      }
    }
    leading = leading_of(x);
    V = x.size(-1);
    N = x.numel() / V;
    mask = flat_mask(mask_arg, leading);
    if (tokens_arg.has_value()) {
      tokens_in = *tokens_arg;
      tok = flat_tokens(tokens_in, leading);
    }
    if (keep_arg.has_value()) {
      const at::Tensor& k = *keep_arg;
      TORCH_CHECK_TYPE(k.scalar_type() == at::kBool,
                       "keep must be a bool tensor (True = kept), got ", describe(k));
      TORCH_CHECK_VALUE(k.sizes() == x_in.sizes(), "keep must have the shape of the logits ",
                        py_tuple(x_in.sizes().vec()), ", got ", describe(k));
      keep = unit_last_stride(k);
    }
    if (tau_arg.has_value()) {
      const at::Tensor& t = *tau_arg;
      TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble,
                       "tau must be a float32 or float64 tensor, got ", describe(t));
      TORCH_CHECK_VALUE(t.sizes() == c10::IntArrayRef(leading), "tau must have shape ",
                        py_tuple(leading), " (the leading dims of the logits), got ", describe(t));
      tau = t.contiguous();
    }
    need_x_state = want & (kWantKL | kWantLogp | kWantEntropy);
    need_y_state = want & (kWantKL | kWantRefLogp);
  }

  bool truncated() const { return keep.defined() || tau.defined(); }
};

// Per-row pointers and flags shared by the forward and backward loops.
struct RowAccess {
  const StatsArgs& a;
  Rows rx, ry, rk;
  const bool* mp;
  const int64_t* tp;
  const bool* kp;
  const float* tau_f;
  const double* tau_d;

  explicit RowAccess(const StatsArgs& args)
      : a(args),
        rx(args.x),
        ry(args.y.defined() ? args.y : args.x),
        rk(args.keep.defined() ? args.keep : args.x),
        mp(args.mask.defined() ? args.mask.const_data_ptr<bool>() : nullptr),
        tp(args.tok.defined() ? args.tok.const_data_ptr<int64_t>() : nullptr),
        kp(args.keep.defined() ? args.keep.const_data_ptr<bool>() : nullptr),
        tau_f(args.tau.defined() && args.tau.scalar_type() == at::kFloat
                  ? args.tau.const_data_ptr<float>()
                  : nullptr),
        tau_d(args.tau.defined() && args.tau.scalar_type() == at::kDouble
                  ? args.tau.const_data_ptr<double>()
                  : nullptr) {}

  bool masked(int64_t r) const { return mp && !mp[r]; }
  // the row's token, or -1 where there is none or it is ignored
  int64_t token(int64_t r, int64_t ignore_index) const {
    return (tp && tp[r] != ignore_index) ? tp[r] : -1;
  }
  Support support(int64_t r) const {
    Support s;
    if (kp) s.keep = kp + rk.offset(r);
    if (tau_f) {
      s.has_tau = true;
      s.tau_f = tau_f[r];
    } else if (tau_d) {
      s.has_tau = true;
      s.tau_double = true;
      s.tau_d = tau_d[r];
    }
    return s;
  }
};

// Tokens of counted rows that are read must lie in the row (also with check=False).
void check_tokens_inside_rows(const StatsArgs& a, const RowAccess& ra, int64_t ignore_index) {
  if (!ra.tp || !(a.want & (kWantLogp | kWantRefLogp))) return;
  for (int64_t r = 0; r < a.N; ++r) {
    const int64_t t = ra.tp[r];
    TORCH_CHECK_INDEX(ra.masked(r) || t == ignore_index || (t >= 0 && t < a.V), "token ", t,
                      " at flat position ", r, " is out of range for a vocabulary of ", a.V);
  }
}

// ------------------------------------------------------------------------------ forward
// engine.kl_finalize / entropy_finalize / the log-prob finish for one row: out (4) and stats (9);
// columns not wanted hold 0. tok: the row's token or -1.
template <typename O, typename T>
void finalize_row(const RowState& row, int64_t want, bool x_state, bool y_state, const T* xr,
                  const T* yr, const Support& sup, int64_t tok, double T_, O* out, O* st) {
  std::fill(out, out + kOutCols, O(0));
  std::fill(st, st + kStatsCols, O(0));
  st[kTau] = static_cast<O>(sup.threshold());
  const double lsx = std::log(row.s_x), lsy = std::log(row.s_y);
  const double shx = finite_or_zero(row.m_x), shy = finite_or_zero(row.m_y);
  const bool valid_x = row.s_x > 0 && std::isfinite(row.s_x);
  const bool valid_y = row.s_y > 0 && std::isfinite(row.s_y);
  bool careful = row.careful;
  if (x_state) {
    st[kShiftX] = static_cast<O>(shx);
    st[kLogSX] = static_cast<O>(finite_or_zero(lsx));
    careful = careful || !valid_x;
  }
  if (y_state) {
    st[kShiftY] = static_cast<O>(shy);
    st[kLogSY] = static_cast<O>(finite_or_zero(lsy));
    careful = careful || !valid_y;
  }
  if (want & kWantKL) {
    const double mean_d = row.a / row.s_x;
    double v = mean_d - lsx + lsy;
    v = v < 0.0 ? 0.0 : v;  // NaN stays NaN
    out[0] = static_cast<O>(valid_x && valid_y ? v : kNaN);
    st[kMeanD] = static_cast<O>(mean_d);
    careful = careful || !std::isfinite(mean_d);
  }
  if (want & kWantEntropy) {
    const double mean_u = row.b / row.s_x;
    double v = lsx - mean_u;
    v = v < 0.0 ? 0.0 : v;  // NaN stays NaN
    out[3] = static_cast<O>(valid_x ? v : kNaN);
    st[kMeanU] = static_cast<O>(mean_u);
  }
  if (tok >= 0 && (want & kWantLogp)) {
    // (x_t − m)/T − log s: exact for nearby logits at any offset; −inf off the support;
    // no distribution: NaN
    const double xt = sup.any() ? sup.value(xr, tok) : static_cast<double>(xr[tok]);
    const double v = row.s_x == 0.0 ? kNaN : (xt - shx) / T_ - lsx;
    out[1] = st[kLogpT] = static_cast<O>(v);
  }
  if (tok >= 0 && (want & kWantRefLogp)) {
    const double v = row.s_y == 0.0 ? kNaN : (static_cast<double>(yr[tok]) - shy) / T_ - lsy;
    out[2] = st[kRefLogpT] = static_cast<O>(v);
  }
  st[kCareful] = static_cast<O>(careful ? 1.0 : 0.0);
}

// With a support and WANT_LOGP: a counted, non-ignored token with log π̃(t) = −inf raises.
template <typename O>
void check_tokens_in_support(const StatsArgs& a, const RowAccess& ra, const O* out,
                             int64_t ignore_index) {
  int64_t bad = 0, first = -1;
  for (int64_t r = 0; r < a.N; ++r) {
    if (ra.masked(r) || ra.token(r, ignore_index) < 0) continue;
    if (out[kOutCols * r + 1] == -std::numeric_limits<O>::infinity()) {
      if (first < 0) first = r;
      ++bad;
    }
  }
  if (bad == 0) return;
  TORCH_CHECK_VALUE(false, "sampled token ", ra.tp[first], " at position ",
                    py_tuple(unravel(first, a.leading)),
                    " is outside the support (log-prob -inf under the truncated policy; ", bad,
                    " position(s) in all): the support must contain the token that was sampled; "
                    "build it with the sampler's own top_k/top_p/min_p and temperature, or pass "
                    "the sampler's kept set");
}

std::tuple<at::Tensor, at::Tensor> token_stats(
    const at::Tensor& x_arg, const std::optional<at::Tensor>& y_arg,
    const std::optional<at::Tensor>& tokens, const std::optional<at::Tensor>& mask,
    const std::optional<at::Tensor>& keep, const std::optional<at::Tensor>& tau, double T,
    int64_t ignore_index, int64_t want, bool check, int64_t /*tile_rows*/,
    int64_t /*tile_cols*/, int64_t top_k, double top_p, double min_p) {
  const StatsArgs a(x_arg, y_arg, tokens, mask, keep, tau, T, want);
  const RowAccess ra(a);
  check_sampler_args(top_k, top_p, min_p);
  const Sampler sampler(a.V, top_k, top_p, min_p, T);
  const bool cuts = sampler.cuts();
  if (check && a.tok.defined()) {
    check_token_range(a.tokens_in, ra.tp, a.N, a.V, ignore_index);
  }
  check_tokens_inside_rows(a, ra, ignore_index);
  std::vector<int64_t> out_shape = a.leading, stats_shape = a.leading;
  out_shape.push_back(kOutCols);
  stats_shape.push_back(kStatsCols);
  at::Tensor out = at::empty(out_shape, a.x.options().dtype(a.ct));
  at::Tensor stats = at::empty(stats_shape, a.x.options().dtype(a.ct));
  // Only y is needed (the reference log-probs alone): y is walked as "x" without a support.
  const bool y_only = !a.need_x_state;
  const bool kY = a.need_x_state && a.need_y_state, kB = want & kWantEntropy;
  // an ignored token leaves nothing to compute in a row that wants only token log-probs
  const bool tokens_only = !(want & (kWantKL | kWantEntropy));
  const int64_t V = a.V;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.x.scalar_type(), "native_token_stats", [&] {
    using T_in = scalar_t;
    const T_in* px = a.x.const_data_ptr<T_in>();
    const T_in* py = a.y.defined() ? a.y.const_data_ptr<T_in>() : nullptr;
    auto run = [&](auto* res, auto* stp) {
      using O = std::remove_pointer_t<decltype(res)>;
      parallel_rows(a.N, V, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          O* o = res + kOutCols * r;
          O* s = stp + kStatsCols * r;
          const int64_t t = ra.token(r, ignore_index);
          if (ra.masked(r) || (tokens_only && t < 0)) {  // not computed: 0 whatever it holds
            std::fill(o, o + kOutCols, O(0));
            std::fill(s, s + kStatsCols, O(0));
            continue;
          }
          const T_in* xr = px + ra.rx.offset(r);
          const T_in* yr = py ? py + ra.ry.offset(r) : nullptr;
          if (y_only) {
            RowState row = walk(yr, yr, Support(), V, T, false, false);
            std::swap(row.m_x, row.m_y);
            std::swap(row.s_x, row.s_y);
            finalize_row(row, want, false, true, xr, yr, Support(), t, T, o, s);
          } else {
            Support sup = ra.support(r);
            if (cuts) sup = with_threshold(sup, row_threshold(xr, V, sampler, scratch()),
                                           a.ct == at::kDouble);
            // with the sampler, the next row's logits are read into L2 during this walk
            const T_in* side = cuts && r + 1 < r1 ? px + ra.rx.offset(r + 1) : nullptr;
            const RowState row = walk(xr, yr, sup, V, T, kY, kB, side);
            finalize_row(row, want, true, a.need_y_state, xr, yr, sup, t, T, o, s);
          }
        }
      });
    };
    if (a.ct == at::kDouble) {
      run(out.mutable_data_ptr<double>(), stats.mutable_data_ptr<double>());
    } else {
      run(out.mutable_data_ptr<float>(), stats.mutable_data_ptr<float>());
    }
  });
  if (check) {
    if (a.y.defined()) {
      raise_if_nan(out, want, a.leading, {{"policy_logits", a.x_in}, {"ref_logits", a.y_in}});
    } else {
      raise_if_nan(out, want, a.leading, {{"logits", a.x_in}});
    }
    if ((a.truncated() || cuts) && (want & kWantLogp)) {
      if (a.ct == at::kDouble) {
        check_tokens_in_support(a, ra, out.const_data_ptr<double>(), ignore_index);
      } else {
        check_tokens_in_support(a, ra, out.const_data_ptr<float>(), ignore_index);
      }
    }
  }
  return {out, stats};
}

// The unfinalized state of every row over these columns (the vocabulary-parallel merge):
// (N, 6) m_x, s_x, m_y, s_y, a, b in the compute dtype (0 in the fields not wanted), and the
// rows that needed the 0·log 0 arithmetic.
std::tuple<at::Tensor, at::Tensor> token_stats_state(
    const at::Tensor& x_arg, const std::optional<at::Tensor>& y_arg,
    const std::optional<at::Tensor>& keep, const std::optional<at::Tensor>& tau, double T,
    int64_t want, int64_t /*tile_rows*/, int64_t /*tile_cols*/) {
  const std::optional<at::Tensor> none;
  // the tokens are not read here: the state does not depend on them
  const StatsArgs a(x_arg, y_arg, none, none, keep, tau, T, want & (kWantKL | kWantEntropy)
                                                            ? want & (kWantKL | kWantEntropy)
                                                            : kWantEntropy);
  const RowAccess ra(a);
  const bool kY = a.y.defined() && (want & (kWantKL | kWantRefLogp));
  const bool kB = want & kWantEntropy;
  at::Tensor state = at::zeros({a.N, kStateCols}, a.x.options().dtype(a.ct));
  at::Tensor careful = at::zeros({a.N}, a.x.options().dtype(at::kBool));
  bool* cp = careful.mutable_data_ptr<bool>();
  const int64_t V = a.V;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.x.scalar_type(), "native_token_stats_state", [&] {
    using T_in = scalar_t;
    const T_in* px = a.x.const_data_ptr<T_in>();
    const T_in* py = a.y.defined() ? a.y.const_data_ptr<T_in>() : nullptr;
    auto run = [&](auto* stp) {
      using O = std::remove_pointer_t<decltype(stp)>;
      parallel_rows(a.N, V, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const T_in* xr = px + ra.rx.offset(r);
          const T_in* yr = py ? py + ra.ry.offset(r) : nullptr;
          const RowState row = walk(xr, kY ? yr : xr, ra.support(r), V, T, kY, kB);
          O* s = stp + kStateCols * r;
          s[0] = static_cast<O>(row.m_x), s[1] = static_cast<O>(row.s_x);
          if (kY) {
            s[2] = static_cast<O>(row.m_y), s[3] = static_cast<O>(row.s_y);
            if (want & kWantKL) s[4] = static_cast<O>(row.a);
          }
          if (kB) s[5] = static_cast<O>(row.b);
          cp[r] = row.careful;
        }
      });
    };
    if (a.ct == at::kDouble) {
      run(state.mutable_data_ptr<double>());
    } else {
      run(state.mutable_data_ptr<float>());
    }
  });
  return {state, careful};
}

// ------------------------------------------------------------------------------ backward
// The per-row coefficients of the gradient, with d_x = x − shift_x = T·u, d_y = y − shift_y:
//   ∂/∂x_v = p·((d_x − d_y)·ckl + d_x·ch + c0) (+ the token's term), p = π̃_v,
//   ∂/∂y_v = (q − p)·cy1 + q·cy2 (+ the token's term), q = ρ_v.
struct GradRow {
  double g_kl = 0, g_lp = 0, g_rl = 0, g_h = 0;  // upstream, 0 where not wanted or ignored
  double shx = 0, lsx = 0, shy = 0, lsy = 0, md = 0, mu = 0, lpt = 0, lqt = 0;
  bool careful = false;

  bool zero() const { return g_kl == 0 && g_lp == 0 && g_rl == 0 && g_h == 0; }
};

// g·v, 0 where g = 0 (a column without upstream gradient adds nothing, even if v = ±inf)
inline double times(double g, double v) { return g == 0.0 ? 0.0 : g * v; }

struct GradCoef {
  VF vsx, vsy, vc, vbx, vby, vckl, vch, vc0, vcy1, vcy2;
  float shx, shy, c, bx, by, ckl, ch, c0, cy1, cy2;
  GradCoef(const GradRow& g, double T) {
    shx = static_cast<float>(g.shx);
    shy = static_cast<float>(g.shy);
    c = static_cast<float>(kLog2e / T);
    bx = static_cast<float>(-g.lsx * kLog2e);
    by = static_cast<float>(-g.lsy * kLog2e);
    ckl = static_cast<float>(g.g_kl / (T * T));
    ch = static_cast<float>(-g.g_h / (T * T));
    c0 = static_cast<float>((times(g.g_h, g.mu) - times(g.g_kl, g.md) - g.g_lp) / T);
    cy1 = static_cast<float>(g.g_kl / T);
    cy2 = static_cast<float>(-g.g_rl / T);
    vsx = VF(shx), vsy = VF(shy), vc = VF(c), vbx = VF(bx), vby = VF(by);
    vckl = VF(ckl), vch = VF(ch), vc0 = VF(c0), vcy1 = VF(cy1), vcy2 = VF(cy2);
  }
};

// Elements [0, n) of the gradient rows, float32 vectors. kDy: y is read (the KL, or ∂/∂y);
// kKL, kH: the KL's and the entropy's d-dependent terms of ∂/∂x (each only where its upstream
// gradient is nonzero: a KL of +inf gives no NaN to the other columns' gradients); kCareful:
// 0 where p = 0 (−inf logits, off the support) and where ∂/∂y is NaN.
// Sup: the support's lane masks (p = 0 off it; the logits read in memory order).
template <bool kDy, bool kKL, bool kH, bool kCareful, typename TX, typename TY, typename TO,
          typename Sup = NoLanes>
void grad_segment(const TX* px, const TY* py, int64_t n, const GradCoef& k, TO* gx, TO* gy,
                  const Sup& sup = Sup()) {
  const VF zero(0.0f);
  auto gx_of = [&](const VF& p, const VF& dx, const VF& dy) {
    VF inner = k.vc0;
    if constexpr (kH) inner = at::vec::fmadd(dx, k.vch, inner);
    if constexpr (kKL) inner = at::vec::fmadd(dx - dy, k.vckl, inner);
    VF v = p * inner;
    if constexpr (kCareful) v = VF::blendv(v, zero, p == zero);
    return v;
  };
  auto gy_of = [&](const VF& p, const VF& dy) {
    const VF q = exp2_fast(at::vec::fmadd(dy, k.vc, k.vby));
    VF v = at::vec::fmadd(q - p, k.vcy1, q * k.vcy2);
    if constexpr (kCareful) v = VF::blendv(v, zero, v != v);
    return v;
  };
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    VF dx0, dx1, dy0, dy1;
    if constexpr (kDy) {
      load_shifted(px + i, py + i, k.vsx, k.vsy, dx0, dx1, dy0, dy1);
    } else {
      prefetch_block(px + kChunk + i);
      VF x0, x1;
      load2(px + i, x0, x1);
      dx0 = x0 - k.vsx;
      dx1 = x1 - k.vsx;
    }
    VF p0 = exp2_fast(at::vec::fmadd(dx0, k.vc, k.vbx));
    VF p1 = exp2_fast(at::vec::fmadd(dx1, k.vc, k.vbx));
    if constexpr (Sup::kOn) {  // the logits again (from L1) for the comparison with tau
      VF xa, xb;
      load2(px + i, xa, xb);
      p0 = select(sup.at(xa, i), p0, zero);
      p1 = select(sup.at(xb, i + VF::size()), p1, zero);
    }
    if (gx) store2(gx + i, gx_of(p0, dx0, dy0), gx_of(p1, dx1, dy1));
    if constexpr (kDy) {
      if (gy) store2(gy + i, gy_of(p0, dy0), gy_of(p1, dy1));
    }
  }
  for (; i < n; ++i) {
    const float dx = static_cast<float>(px[i]) - k.shx;
    const float dy = kDy ? static_cast<float>(py[i]) - k.shy : 0.0f;
    const float p = sup.kept(static_cast<float>(px[i]), i) ? std::exp2(dx * k.c + k.bx) : 0.0f;
    if (gx) {
      float inner = k.c0;
      if (kH) inner += dx * k.ch;
      if (kKL) inner += (dx - dy) * k.ckl;
      const float v = p * inner;
      gx[i] = static_cast<TO>((kCareful && p == 0.0f) ? 0.0f : v);
    }
    if (kDy && gy) {
      const float q = std::exp2(dy * k.c + k.by);
      const float v = (q - p) * k.cy1 + q * k.cy2;
      gy[i] = static_cast<TO>((kCareful && std::isnan(v)) ? 0.0f : v);
    }
  }
}

// A whole gradient row in float32 vectors: chunk by chunk through the support buffer when
// truncated (the careful arithmetic), else in one sweep.
template <bool kDy, bool kKL, bool kH, typename T>
void grad_row_vec(const T* xr, const T* yr, const Support& sup, const GradRow& g, double T_,
                  T* gx, T* gy, int64_t V) {
  const GradCoef k(g, T_);
  if (sup.any()) {  // p = 0 off the support by the lane masks; careful: −inf logits kept
    with_lanes(sup, [&](const auto& lanes) {
      grad_segment<kDy, kKL, kH, true>(xr, yr, V, k, gx, gy, lanes);
      return 0;
    });
  } else if (g.careful) {
    grad_segment<kDy, kKL, kH, true>(xr, yr, V, k, gx, gy);
  } else {
    grad_segment<kDy, kKL, kH, false>(xr, yr, V, k, gx, gy);
  }
}

// A whole gradient row, scalar double with the careful rules (float64 inputs).
template <typename T>
void grad_row_scalar(const T* xr, const T* yr, const Support& sup, const GradRow& g, double T_,
                     T* gx, T* gy, int64_t V) {
  const bool dy_needed = g.g_kl != 0.0 || gy != nullptr;
  for (int64_t j = 0; j < V; ++j) {
    const double xv = sup.any() ? sup.value(xr, j) : static_cast<double>(xr[j]);
    const double dx = xv - g.shx;
    const double dy = dy_needed ? static_cast<double>(yr[j]) - g.shy : 0.0;
    const double p = std::exp(dx / T_ - g.lsx);
    if (gx) {
      double inner = -g.g_lp;
      if (g.g_kl != 0.0) inner += g.g_kl * ((dx - dy) / T_ - g.md);
      if (g.g_h != 0.0) inner -= g.g_h * (dx / T_ - g.mu);
      gx[j] = static_cast<T>(p == 0.0 ? 0.0 : p * inner / T_);
    }
    if (gy) {
      const double q = std::exp(dy / T_ - g.lsy);
      const double v = (g.g_kl * (q - p) - g.g_rl * q) / T_;
      gy[j] = static_cast<T>(std::isnan(v) ? 0.0 : v);
    }
  }
}

// The token's entries, in double: the one-hot terms with (1 − π̃_t) = −expm1(log π̃_t) (and
// likewise for ρ), exact for a token of probability near 1.
template <typename T>
void grad_token(const T* xr, const T* yr, const Support& sup, const GradRow& g, double T_,
                int64_t t, T* gx, T* gy) {
  if (gx && g.g_lp != 0.0) {
    const double xt = sup.any() ? sup.value(xr, t) : static_cast<double>(xr[t]);
    const double dx = xt - g.shx, p = std::exp(g.lpt);
    double inner = 0.0;
    if (g.g_kl != 0.0) inner += g.g_kl * ((dx - (static_cast<double>(yr[t]) - g.shy)) / T_ - g.md);
    if (g.g_h != 0.0) inner -= g.g_h * (dx / T_ - g.mu);
    // a token off the support (or at a −inf logit; check=False): 0, as every entry there
    const double own = xt == -kInf ? 0.0 : -std::expm1(g.lpt) * g.g_lp / T_;
    gx[t] = static_cast<T>((p == 0.0 ? 0.0 : p * inner / T_) + own);
  }
  if (gy && g.g_rl != 0.0) {
    const double q = std::exp(g.lqt);
    double v = -std::expm1(g.lqt) * g.g_rl;
    if (g.g_kl != 0.0) {
      const double xt = sup.any() ? sup.value(xr, t) : static_cast<double>(xr[t]);
      const double d = g.g_kl * (q - std::exp((xt - g.shx) / T_ - g.lsx));
      v += std::isnan(d) ? 0.0 : d;
    }
    gy[t] = static_cast<T>(v / T_);
  }
}

std::tuple<at::Tensor, at::Tensor> token_stats_backward(
    const at::Tensor& grad, const at::Tensor& x_arg, const std::optional<at::Tensor>& y_arg,
    const std::optional<at::Tensor>& tokens, const std::optional<at::Tensor>& owned,
    const at::Tensor& stats, const std::optional<at::Tensor>& mask,
    const std::optional<at::Tensor>& keep, const std::optional<at::Tensor>& tau, double T,
    int64_t ignore_index, int64_t want, bool need_x, bool need_y_arg, int64_t /*tile_rows*/,
    int64_t /*tile_cols*/) {
  const StatsArgs a(x_arg, y_arg, tokens, mask, keep, tau, T, want);
  const RowAccess ra(a);
  const at::Tensor own = flat_mask(owned, a.leading);  // where false: no token entry here
  const bool* op = own.defined() ? own.const_data_ptr<bool>() : nullptr;
  const bool need_y = need_y_arg && a.y.defined();
  const int64_t V = a.V, N = a.N;
  std::vector<int64_t> gshape = a.leading, sshape = a.leading;
  gshape.push_back(kOutCols);
  sshape.push_back(kStatsCols);
  TORCH_CHECK_VALUE(grad.sizes() == c10::IntArrayRef(gshape), "grad must have shape ",
                    py_tuple(gshape), ", got ", describe(grad));
  TORCH_CHECK_VALUE(stats.sizes() == c10::IntArrayRef(sshape), "stats must have shape ",
                    py_tuple(sshape), ", got ", describe(stats));
  check_tokens_inside_rows(a, ra, ignore_index);
  const at::Tensor g = grad.to(at::kDouble).contiguous();
  const at::Tensor st = stats.to(at::kDouble).contiguous();
  at::Tensor gx = need_x ? at::empty(a.x.sizes(), a.x.options()) : at::empty({0}, x_arg.options());
  at::Tensor gy = need_y ? at::empty(a.y.sizes(), a.y.options())
                         : at::empty({0}, x_arg.options());
  const double* gp = g.const_data_ptr<double>();
  const double* sp = st.const_data_ptr<double>();
  if (need_x || need_y) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.x.scalar_type(), "native_token_stats_bwd", [&] {
      using T_in = scalar_t;
      const T_in* px = a.x.const_data_ptr<T_in>();
      const T_in* py = a.y.defined() ? a.y.const_data_ptr<T_in>() : nullptr;
      T_in* gxp = need_x ? gx.mutable_data_ptr<T_in>() : nullptr;
      T_in* gyp = need_y ? gy.mutable_data_ptr<T_in>() : nullptr;
      parallel_rows(N, V, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          T_in* gxr = gxp ? gxp + r * V : nullptr;
          T_in* gyr = gyp ? gyp + r * V : nullptr;
          const double* gr = gp + kOutCols * r;
          const double* s = sp + kStatsCols * r;
          const int64_t t = ra.token(r, ignore_index);
          GradRow row;
          if (!ra.masked(r)) {
            row.g_kl = (want & kWantKL) ? gr[0] : 0.0;
            row.g_lp = (want & kWantLogp) && t >= 0 ? gr[1] : 0.0;
            row.g_rl = (want & kWantRefLogp) && t >= 0 ? gr[2] : 0.0;
            row.g_h = (want & kWantEntropy) ? gr[3] : 0.0;
          }
          if (row.zero()) {  // masked (garbage allowed), ignored or no upstream gradient: 0
            if (gxr) std::fill(gxr, gxr + V, T_in(0));
            if (gyr) std::fill(gyr, gyr + V, T_in(0));
            continue;
          }
          row.shx = s[kShiftX], row.lsx = s[kLogSX], row.shy = s[kShiftY], row.lsy = s[kLogSY];
          row.md = s[kMeanD], row.mu = s[kMeanU], row.lpt = s[kLogpT], row.lqt = s[kRefLogpT];
          row.careful = s[kCareful] != 0.0;
          const T_in* xr = px + ra.rx.offset(r);
          const T_in* yr = py ? py + ra.ry.offset(r) : nullptr;
          const Support sup = ra.support(r);
          if (!a.need_x_state) {  // the reference log-probs alone: ∂/∂y = (onehot − q)·g/T
            row.shx = 0.0, row.lsx = kInf;  // p = 0 everywhere
          }
          if constexpr (std::is_same_v<T_in, double>) {
            grad_row_scalar(xr, yr, sup, row, T, gxr, gyr, V);
          } else {
            const bool kl = row.g_kl != 0.0, h = row.g_h != 0.0;
            if (!a.need_x_state) {  // x unread: walk y as both (p = 0 by lsx = inf)
              grad_row_vec<true, false, false>(yr, yr, Support(), row, T, gxr, gyr, V);
            } else if (kl) {
              h ? grad_row_vec<true, true, true>(xr, yr, sup, row, T, gxr, gyr, V)
                : grad_row_vec<true, true, false>(xr, yr, sup, row, T, gxr, gyr, V);
            } else if (gyr) {
              h ? grad_row_vec<true, false, true>(xr, yr, sup, row, T, gxr, gyr, V)
                : grad_row_vec<true, false, false>(xr, yr, sup, row, T, gxr, gyr, V);
            } else {
              h ? grad_row_vec<false, false, true>(xr, yr, sup, row, T, gxr, gyr, V)
                : grad_row_vec<false, false, false>(xr, yr, sup, row, T, gxr, gyr, V);
            }
          }
          if (t >= 0 && (!op || op[r])) grad_token(xr, yr, sup, row, T, t, gxr, gyr);
        }
      });
    });
  }
  if (a.mixed) {
    if (need_x) gx = gx.to(x_arg.scalar_type());
    if (need_y) gy = gy.to(a.y_in.scalar_type());
  }
  return {gx, gy};
}

// ------------------------------------------------------------------------------ threshold op
// τ (...) of top-k → top-p → min-p sampling per row (row_threshold), in the compute dtype:
// −inf where nothing is cut, NaN for a row holding NaN.
at::Tensor sampling_threshold(const at::Tensor& x_arg, int64_t top_k, double top_p, double min_p,
                              double T) {
  check_logits_arg("logits", x_arg);
  check_temperature(T);
  check_sampler_args(top_k, top_p, min_p);
  const at::Tensor x = unit_last_stride(x_arg);
  const std::vector<int64_t> leading = leading_of(x);
  const int64_t V = x.size(-1), N = x.numel() / V;
  const at::ScalarType ct = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor tau = at::empty(leading, x.options().dtype(ct));
  tau.fill_(-kInf);
  const Sampler sampler(V, top_k, top_p, min_p, T);
  if (!sampler.cuts() || N == 0) return tau;
  const Rows rx(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "native_sampling_threshold", [&] {
    const scalar_t* px = x.const_data_ptr<scalar_t>();
    auto run = [&](auto* out) {
      using O = std::remove_pointer_t<decltype(out)>;
      parallel_rows(N, V, [&](int64_t r0, int64_t r1) {
        ThresholdScratch& w = scratch();
        for (int64_t r = r0; r < r1; ++r) {
          out[r] = static_cast<O>(row_threshold(px + rx.offset(r), V, sampler, w));
        }
      });
    };
    if (ct == at::kDouble) {
      run(tau.mutable_data_ptr<double>());
    } else {
      run(tau.mutable_data_ptr<float>());
    }
  });
  return tau;
}

// ------------------------------------------------------------------------------ compute floor
// The forward's arithmetic without its memory traffic: the one-pass walk's chunk sums of the KL
// (two exps, three sums and both maxima per element pair, U vectors per input in flight) over
// one L1-resident tile x, y (n elements each, a chunk), repeated until `pairs` element pairs are
// done, each walk's sums added in double as the walk merges a chunk. Returns their total, which
// keeps the work observable; `klpenalty bench` times it.
template <int U, typename T>
double floor_walks(const T* x, const T* y, int64_t n, int64_t walks, float c) {
  const float sh_x = static_cast<float>(chunk_max(x, n)), sh_y = static_cast<float>(chunk_max(y, n));
  double total = 0.0;
  for (int64_t w = 0; w < walks; ++w) {
    asm volatile("" ::: "memory");  // every walk reads the tile again
    const ChunkSums cs = chunk_sums<U, true, false, false, true, 0>(x, y, n, sh_x, sh_y, c);
    total += cs.s_x + cs.s_y + cs.a + cs.max_x + cs.max_y;
  }
  return total;
}

double compute_floor(const at::Tensor& x, const at::Tensor& y, int64_t pairs, int64_t chains) {
  const auto st = x.scalar_type();
  TORCH_CHECK_TYPE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf,
                   "x must be a float32, bfloat16 or float16 tensor, got ", describe(x));
  TORCH_CHECK_TYPE(y.scalar_type() == st, "y must have the dtype of x (", dtype_name(st),
                   "), got ", describe(y));
  TORCH_CHECK_VALUE(x.dim() == 1 && x.numel() >= 1 && x.is_contiguous() && x.device().is_cpu(),
                    "x must be a contiguous 1-D CPU tensor with at least one element, got ",
                    describe(x));
  TORCH_CHECK_VALUE(y.sizes() == x.sizes() && y.is_contiguous() && y.device().is_cpu(),
                    "y must be a contiguous CPU tensor of the shape of x ", py_tuple(x.sizes().vec()),
                    ", got ", describe(y));
  TORCH_CHECK_VALUE(pairs >= 0, "pairs must be >= 0, got ", pairs);
  TORCH_CHECK_VALUE(chains == 1 || chains == 2 || chains == 4 || chains == 8,
                    "chains must be 1, 2, 4 or 8, got ", chains);
  const int64_t n = x.numel(), walks = (pairs + n - 1) / n;
  const float c = static_cast<float>(kLog2e);
  double total = 0.0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, st, "native_compute_floor", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      const scalar_t* px = x.const_data_ptr<scalar_t>();
      const scalar_t* py = y.const_data_ptr<scalar_t>();
      switch (chains) {
        case 1: total = floor_walks<1>(px, py, n, walks, c); break;
        case 2: total = floor_walks<2>(px, py, n, walks, c); break;
        case 4: total = floor_walks<4>(px, py, n, walks, c); break;
        default: total = floor_walks<8>(px, py, n, walks, c); break;
      }
    }
  });
  return total;
}

}  // namespace

TORCH_LIBRARY_IMPL(klpenalty, CPU, m) {
  m.impl("native_token_stats", &token_stats);
  m.impl("native_token_stats_backward", &token_stats_backward);
  m.impl("native_token_stats_state", &token_stats_state);
  m.impl("native_sampling_threshold", &sampling_threshold);
  m.impl("native_compute_floor", &compute_floor);  // the benchmark's (schema in native.py)
}

}  // namespace klpenalty_native
