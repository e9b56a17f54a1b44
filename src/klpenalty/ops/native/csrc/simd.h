// The kernels' vector arithmetic on at::vec::Vectorized<float> (VF), whatever the instruction set
// (AVX-512, AVX2, or the portable DEFAULT): a polynomial exp2, loads of float32 / bfloat16 /
// float16 rows as float vectors and stores back, prefetches, sums of float vectors kept in double
// lanes (WideSum), the terms of Σ e^u·f(u) with the 0·log 0 rule, and lane masks (LaneMask: the
// AVX-512 mask registers, else all-ones lanes) with the operations the walks and the sampler
// threshold build on them.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

namespace klpenalty_native {
namespace {  // each source its own copies (internal linkage), inlined freely

using VF = at::vec::Vectorized<float>;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kLog2e = 1.4426950408889634;
constexpr int64_t kBlock = 2 * VF::size();  // elements per inner step: two float vectors
constexpr int64_t kChunk = 2048;            // elements of a row per chunk (kept in L1 for a redo)

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

// Elements ahead that the one-pass walk asks memory for, for 4-byte inputs (twice the bytes
// per element pair of bf16/fp16, whose walk is bound by its arithmetic and gets none; measured
// in benchmarks/README.md).
constexpr int64_t kAhead = 512;

// Requests bytes [at, at + n) of another region into L2 (a row read next), nothing where it is
// null.
inline void request_l2(const void* region, int64_t at, int64_t n) {
  if (!region) return;
  const char* p = static_cast<const char*>(region) + at;
  for (int64_t b = 0; b < n; b += 64) __builtin_prefetch(p + b, 0, 2);
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

// ------------------------------------------------------------------------------ sums and maxima
// max(acc, v) in one instruction: a NaN in v is kept, a NaN in acc is not (the walks that use it
// find NaN in their sums).
inline VF max_fast(const VF& acc, const VF& v) { return at::vec::clamp_min(v, acc); }

inline double finite_or_zero(double v) { return std::isfinite(v) ? v : 0.0; }

// max that propagates NaN (like torch.amax)
inline double max_nan(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return kNaN;
  return a > b ? a : b;
}

// min that propagates NaN (like torch.amin)
template <typename C>
inline C min_nan(C a, C b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<C>::quiet_NaN();
  return b < a ? b : a;
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

// ------------------------------------------------------------------------------ lane masks
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
// min(v, acc) / max(v, acc) in the lanes of m, acc elsewhere; a NaN in v leaves acc
inline VF min_where(const VF& acc, LaneMask m, const VF& v) { return _mm512_mask_min_ps(acc, m, v, acc); }
inline VF max_where(const VF& acc, LaneMask m, const VF& v) { return _mm512_mask_max_ps(acc, m, v, acc); }
inline int64_t compress_store(float* dst, LaneMask m, const VF& v) {
  _mm512_storeu_ps(dst, _mm512_maskz_compress_ps(m, v));
  return __builtin_popcount(static_cast<unsigned>(m));
}
inline int64_t lanes_count(LaneMask m) { return __builtin_popcount(static_cast<unsigned>(m)); }
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
// the number of set lanes
inline int64_t lanes_count(const LaneMask& m) {
#if defined(CPU_CAPABILITY_AVX2)
  return __builtin_popcount(static_cast<unsigned>(_mm256_movemask_ps(m)));
#else
  float f[VF::size()];
  m.store(f);
  int64_t n = 0;
  for (int k = 0; k < VF::size(); ++k) {
    uint32_t u;
    std::memcpy(&u, &f[k], sizeof(u));
    n += u != 0;
  }
  return n;
#endif
}
inline VF add_where(const VF& acc, const LaneMask& m, const VF& v) { return acc + (v & m); }
inline LaneMask lanes_nan(const VF& v) { return v != v; }
inline LaneMask lanes_or(const LaneMask& a, const LaneMask& b) { return a | b; }
inline LaneMask lanes_empty() { return VF(0.0f); }
inline LaneMask lanes_all() { return VF(0.0f) == VF(0.0f); }
inline VF select(const LaneMask& m, const VF& a, const VF& b) { return VF::blendv(b, a, m); }
// min(v, acc) / max(v, acc) in the lanes of m, acc elsewhere; a NaN in v leaves acc
inline VF min_where(const VF& acc, const LaneMask& m, const VF& v) {
  return select(m, at::vec::clamp_max(acc, v), acc);
}
inline VF max_where(const VF& acc, const LaneMask& m, const VF& v) {
  return select(m, at::vec::clamp_min(acc, v), acc);
}
#if defined(CPU_CAPABILITY_AVX2)
// For each 8-lane mask, the indices of its set lanes in order, one per byte from the lowest.
constexpr std::array<uint64_t, 256> compress_indices() {
  std::array<uint64_t, 256> t{};
  for (unsigned m = 0; m < 256; ++m) {
    uint64_t packed = 0;
    int n = 0;
    for (unsigned k = 0; k < 8; ++k) {
      if (m >> k & 1u) packed |= static_cast<uint64_t>(k) << (8 * n++);
    }
    t[m] = packed;
  }
  return t;
}
constexpr std::array<uint64_t, 256> kCompressIndices = compress_indices();
#endif
// The lanes of v where m is set, stored in order at dst (a whole vector is written: dst must have
// room for VF::size() floats); their number.
inline int64_t compress_store(float* dst, const LaneMask& m, const VF& v) {
#if defined(CPU_CAPABILITY_AVX2)
  const int bits = _mm256_movemask_ps(m);
  const __m256i idx = _mm256_cvtepu8_epi32(
      _mm_cvtsi64_si128(static_cast<long long>(kCompressIndices[bits])));
  _mm256_storeu_ps(dst, _mm256_permutevar8x32_ps(v, idx));
  return __builtin_popcount(static_cast<unsigned>(bits));
#else
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
#endif
}
#endif

// The compute type of logits of type T: double for double, else float.
template <typename T>
using Compute = std::conditional_t<std::is_same_v<T, double>, double, float>;

// One vector of the compute type of a row (float, bfloat16, float16 or double memory), in memory
// order.
template <typename T>
inline at::vec::Vectorized<Compute<T>> load1(const T* p) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    return at::vec::Vectorized<T>::loadu(p);
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

}  // namespace
}  // namespace klpenalty_native
