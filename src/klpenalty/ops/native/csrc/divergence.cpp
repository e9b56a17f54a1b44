// The second walk of the contract in klpenalty/ops/contract.py (schemas defined there):
//   native_divergence(x, y, stats, mask?, keep?, tau?, temperature, kind, param)
//     -> (value (...), gbar (...))
//   native_divergence_backward(grad (...), x, y, stats, gbar, mask?, keep?, tau?, temperature,
//     kind, param) -> grad_x (..., V)
// With the forward's finished statistics (kStShiftX .. kStLogSY) each row's log-probabilities
// are exact, lp = (x − shift_x)/T − log s_x and lq likewise, and the kind's terms
// (klpenalty/ops/divergence.py: divergence_terms, numerics.md "Divergences") are summed per row:
// value = Σ f and ḡ = Σ π·∂f/∂π; the backward writes grad·(π·g − π·ḡ)/T. Masked rows give 0
// (value, ḡ and gradient), as do the gradient rows whose grad is 0, whatever their logits hold.
// A support (keep and/or tau, walk.h's Support: kept(v) = keep[v] and x_v >= tau, as the
// token_stats ops) makes the student π̃: lp = −inf off it and π·g = 0 there (ḡ sums the kept
// entries; the gradient is exactly 0 off the support); the teacher is never truncated.
//
// Per row one vectorised pass reads x and y in their dtype (bf16/fp16 widened in registers),
// float32 arithmetic in log2 units (lp2 = lp·log2 e: the exps are simd.h's exp2, the log-terms
// scaled by ln 2 once per row), float partial sums of kFlush blocks added into double lanes
// (WideSum). The mixtures: M = a·ν + (1 − a)·π from the two exps (exactly π where π = ν), one
// polynomial log2 of M and the log-ratios lp2 − log2 M, lq2 − log2 M (0 where lp = lq:
// identical models give exactly 0), π·ν/M and π²/M by one division. A row whose fast sums (or
// gradient entries) are not finite — a −inf logit in either model (0·log 0), NaN, a KL of +inf —
// is redone with the 0·log 0 rule in the same vectors (a term weighted by a model's mass is 0
// where that model's log-prob is −inf; a truncated row takes this walk at once, its lane masks
// (SupLanes) setting lp = −inf off the support), and if still not finite (NaN, +inf) by the careful
// scalar path, divergence_terms term for term in the compute type (float, or double for float64
// inputs, which take that path for every row). Rows in parallel (rows.h's parallel_rows).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "args.h"
#include "contract.h"
#include "rows.h"
#include "simd.h"

namespace klpenalty_native {
namespace {

// The kinds, as klpenalty.ops.divergence.Divergence.
constexpr int64_t kReverseKL = 0, kForwardKL = 1, kJSD = 2, kSkewForwardKL = 3,
                  kSkewReverseKL = 4, kTVD = 5;
constexpr double kLn2 = 0.6931471805599453;

// The fast path's per-vector functions are inlined into the row loops whatever the compiler's
// size heuristics say: called per vector, each call reloaded its constants (2-4x slower).
#define KLP_VEC_INLINE inline __attribute__((always_inline))

// f(std::integral_constant<int64_t, kind>) for the kind of the call.
template <typename F>
void with_kind(int64_t kind, F&& f) {
  switch (kind) {
    case kReverseKL: return f(std::integral_constant<int64_t, kReverseKL>{});
    case kForwardKL: return f(std::integral_constant<int64_t, kForwardKL>{});
    case kJSD: return f(std::integral_constant<int64_t, kJSD>{});
    case kSkewForwardKL: return f(std::integral_constant<int64_t, kSkewForwardKL>{});
    case kSkewReverseKL: return f(std::integral_constant<int64_t, kSkewReverseKL>{});
    default: return f(std::integral_constant<int64_t, kTVD>{});
  }
}

// The weight a of the teacher in the kind's mixture M = a·ν + (1 − a)·π (mixture kinds only).
inline double teacher_weight(int64_t kind, double param) {
  return kind == kSkewReverseKL ? 1.0 - param : param;  // SRKL: M = λ·π + (1 − λ)·ν
}

// ------------------------------------------------------------------------------ arguments
struct DivArgs {
  at::Tensor x, y, st, mask, keep, tau;
  std::vector<int64_t> leading;
  int64_t V = 0, N = 0;
  at::ScalarType ct = at::kFloat;  // compute dtype
  bool mixed = false;              // x and y of different dtypes, both copied to ct

  DivArgs(const at::Tensor& x_arg, const at::Tensor& y_arg, const at::Tensor& stats,
          const std::optional<at::Tensor>& mask_arg, const std::optional<at::Tensor>& keep_arg,
          const std::optional<at::Tensor>& tau_arg, double T, int64_t kind) {
    check_logits_arg("x", x_arg);
    check_logits_arg("y", y_arg);
    TORCH_CHECK_VALUE(x_arg.sizes() == y_arg.sizes(),
                      "x and y must have the same shape (..., V): x ", describe(x_arg), ", y ",
                      describe(y_arg));
    check_temperature(T);
    TORCH_CHECK_VALUE(kind >= kReverseKL && kind <= kTVD,
                      "kind must be one of ['reverse_kl', 'forward_kl', 'jsd', "
                      "'skew_forward_kl', 'skew_reverse_kl', 'tvd'], got ", kind);
    ct = compute_type(x_arg, &y_arg);
    mixed = unit_stride_pair(x_arg, y_arg, ct, x, y);
    leading = leading_of(x);
    V = x.size(-1);
    N = x.numel() / V;
    std::vector<int64_t> sshape = leading;
    sshape.push_back(kStatsCols);
    TORCH_CHECK_VALUE(stats.sizes() == c10::IntArrayRef(sshape), "stats must have shape ",
                      py_tuple(sshape), ", got ", describe(stats));
    st = stats.to(at::kDouble).contiguous();
    mask = flat_mask(mask_arg, leading);
    support_tensors(keep_arg, tau_arg, x_arg, leading, keep, tau);
  }

  bool masked(int64_t r) const { return mask.defined() && !mask.const_data_ptr<bool>()[r]; }
};

// A (...) per-row tensor (grad, gbar) as N contiguous doubles.
inline at::Tensor per_row(const char* name, const at::Tensor& t, const DivArgs& a) {
  TORCH_CHECK_VALUE(t.sizes() == c10::IntArrayRef(a.leading), name, " must have shape ",
                    py_tuple(a.leading), " (the leading dims of the logits), got ", describe(t));
  return t.to(at::kDouble).contiguous();
}

// ------------------------------------------------------------------------------ careful path
// divergence_terms term for term in the compute type C (float for float32/bf16/fp16 inputs,
// double for float64): 0·(anything) = 0 where the log-prob is −inf, +inf where the log-ratio is
// +inf at a finite log-prob, the mixtures' log-ratios as −log1p((1 − w)·expm1(δ)), δ = lb − la,
// or −δ − log((1 − w) + w·e^−δ) where δ > 1.
template <typename C>
inline C times_careful(C p, C d, C lp) {
  constexpr C inf = std::numeric_limits<C>::infinity();
  if (lp == -inf) return C(0);
  return d == inf ? inf : p * d;
}

template <typename C>
inline C minus_log_mix(C la, C lb, double w) {
  const C d = lb - la;
  if (d > C(1)) {  // −δ − log((1 − w) + w·e^−δ): e^δ would overflow far below the teacher
    return -d - std::log(static_cast<C>(1.0 - w) + static_cast<C>(w) * std::exp(-d));
  }
  return -std::log1p(static_cast<C>(1.0 - w) * std::expm1(d));
}

// (f, π·∂f/∂π) of one entry from the two log-probs.
template <typename C>
inline std::pair<C, C> terms_careful(C lp, C lq, int64_t kind, double param) {
  constexpr C ninf = -std::numeric_limits<C>::infinity();
  const C p = std::exp(lp), q = std::exp(lq);
  switch (kind) {
    case kReverseKL: {
      const C f = times_careful(p, lp - lq, lp);
      return {f, f};
    }
    case kForwardKL:
      return {times_careful(q, lq - lp, lq), -q};
    case kJSD: {
      const C dp = minus_log_mix(lp, lq, 1.0 - param), dq = minus_log_mix(lq, lp, param);
      const C fp = times_careful(p, dp, lp);
      return {static_cast<C>(param) * times_careful(q, dq, lq) + static_cast<C>(1.0 - param) * fp,
              static_cast<C>(1.0 - param) * fp};
    }
    case kSkewForwardKL: {
      const C dp = minus_log_mix(lp, lq, 1.0 - param), dq = minus_log_mix(lq, lp, param);
      const C pg = -static_cast<C>(1.0 - param) * (lq == ninf ? C(0) : q * std::exp(dp));
      return {times_careful(q, dq, lq), pg};
    }
    case kSkewReverseKL: {
      const C dp = minus_log_mix(lp, lq, param);
      const C f = times_careful(p, dp, lp);
      return {f, f - static_cast<C>(param) * (lp == ninf ? C(0) : p * std::exp(dp))};
    }
    default: {  // TVD; sign(NaN) = 0, as torch.sign
      const C diff = p - q;
      const C sign = diff > C(0) ? C(1) : (diff < C(0) ? C(-1) : C(0));
      return {C(0.5) * std::abs(diff), C(0.5) * p * sign};
    }
  }
}

// One row's log-probs in C, as the streaming op forms them.
template <typename C>
struct LogProbs {
  C shx, lsx, shy, lsy, T;
  LogProbs(const double* s, double T_)
      : shx(static_cast<C>(s[kStShiftX])), lsx(static_cast<C>(s[kStLogSX])),
        shy(static_cast<C>(s[kStShiftY])), lsy(static_cast<C>(s[kStLogSY])),
        T(static_cast<C>(T_)) {}
  template <typename TX, typename TY>
  std::pair<C, C> at(const TX* x, const TY* y, int64_t j) const {
    return {(static_cast<C>(x[j]) - shx) / T - lsx, (static_cast<C>(y[j]) - shy) / T - lsy};
  }
};

// (f, π·∂f/∂π) of entry j of a row in C: off the support lp = −inf and π·g = 0.
template <typename C, typename TX, typename TY>
inline std::pair<C, C> entry_careful(const LogProbs<C>& lpq, const TX* x, const TY* y, int64_t j,
                                     const Support& sup, int64_t kind, double param) {
  auto [lp, lq] = lpq.at(x, y, j);
  if (sup.any() && !sup.kept(x, j)) {
    return {terms_careful<C>(-std::numeric_limits<C>::infinity(), lq, kind, param).first, C(0)};
  }
  return terms_careful<C>(lp, lq, kind, param);
}

// (value, ḡ) of a row by the careful path, summed in double.
template <typename C, typename TX, typename TY>
std::pair<double, double> row_careful(const TX* x, const TY* y, int64_t V, const double* s,
                                      double T, int64_t kind, double param, const Support& sup) {
  const LogProbs<C> lpq(s, T);
  double value = 0.0, gbar = 0.0;
  for (int64_t j = 0; j < V; ++j) {
    const auto [f, pg] = entry_careful<C>(lpq, x, y, j, sup, kind, param);
    value += f;
    gbar += pg;
  }
  return {value, gbar};
}

// A gradient row by the careful path: (π·g − π·ḡ)·(grad/T) in C, exactly 0 off the support.
template <typename C, typename TX, typename TY, typename TO>
void grad_careful(const TX* x, const TY* y, int64_t V, const double* s, double T, int64_t kind,
                  double param, double grad, double gbar, const Support& sup, TO* out) {
  const LogProbs<C> lpq(s, T);
  const C gb = static_cast<C>(gbar), gt = static_cast<C>(grad) / static_cast<C>(T);
  for (int64_t j = 0; j < V; ++j) {
    if (sup.any() && !sup.kept(x, j)) {
      out[j] = TO(0);
      continue;
    }
    const C lp = lpq.at(x, y, j).first;
    const C pg = entry_careful<C>(lpq, x, y, j, sup, kind, param).second;
    out[j] = static_cast<TO>((pg - std::exp(lp) * gb) * gt);
  }
}

// ------------------------------------------------------------------------------ fast path
// A row's constants in float vectors: lp2 = (x − shift_x)·c + bx (log2 units), likewise lq2;
// the mixture M = a·ν + (1 − a)·π as base + w·(other − base), the base the model of the larger
// weight (w = min(a, 1 − a) ≤ ½: M is exactly π where π = ν, and rounds once); the backward's
// coefficients of π·g (klog for the log-terms, in nats; kexp for π·ν/M, π²/M or ν).
struct FastRow {
  VF shx, shy, c, bx, by, w, klog, kexp;
  float fshx, fshy;
  bool teacher_base = false;  // M = ν + (1 − a)·(π − ν), else π + a·(ν − π)
  FastRow(const double* s, double T, int64_t kind, double param) {
    fshx = static_cast<float>(s[kStShiftX]);
    fshy = static_cast<float>(s[kStShiftY]);
    shx = VF(fshx), shy = VF(fshy);
    c = VF(static_cast<float>(kLog2e / T));
    bx = VF(static_cast<float>(-s[kStLogSX] * kLog2e));
    by = VF(static_cast<float>(-s[kStLogSY] * kLog2e));
    const double a = teacher_weight(kind, param);
    teacher_base = a > 0.5;
    w = VF(static_cast<float>(teacher_base ? 1.0 - a : a));
    double kl = 0.0, ke = 0.0;
    switch (kind) {
      case kReverseKL: kl = kLn2; break;
      case kForwardKL: ke = -1.0; break;
      case kJSD: kl = (1.0 - param) * kLn2; break;
      case kSkewForwardKL: ke = -(1.0 - param); break;
      case kSkewReverseKL: kl = kLn2, ke = -param; break;
      default: kl = 0.5; break;  // TVD: ½·π·sign
    }
    klog = VF(static_cast<float>(kl));
    kexp = VF(static_cast<float>(ke));
  }
};

// log2(z) for z > 0 normal (a NaN z gives a finite value: the callers' log-ratios lp2 − log2 M
// hold the NaN of lp2 or lq2 that made M NaN): z = m·2^k with m in [√½, √2) from the bits
// (k the exponent field of z/√½), then log(m) = log1p(m − 1) by Cephes' logf polynomial (about
// one ulp), evaluated by Estrin's scheme (a dependency chain of 5 operations, not Horner's 9).
// m − 1 is exact: log2(1) = 0.
KLP_VEC_INLINE VF log2_fast(const VF& z) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i bits = _mm512_castps_si512(z);
  const __m512i ki = _mm512_srai_epi32(_mm512_sub_epi32(bits, _mm512_set1_epi32(0x3F3504F3)), 23);
  const VF m = _mm512_castsi512_ps(_mm512_sub_epi32(bits, _mm512_slli_epi32(ki, 23)));
  const VF k = _mm512_cvtepi32_ps(ki);
#else
  const __m256i bits = _mm256_castps_si256(z);
  const __m256i ki = _mm256_srai_epi32(_mm256_sub_epi32(bits, _mm256_set1_epi32(0x3F3504F3)), 23);
  const VF m = _mm256_castsi256_ps(_mm256_sub_epi32(bits, _mm256_slli_epi32(ki, 23)));
  const VF k = _mm256_cvtepi32_ps(ki);
#endif
  using at::vec::fmadd;
  const VF x = m - VF(1.0f), x2 = x * x, x4 = x2 * x2;
  const VF a0 = fmadd(VF(-2.4999993993e-1f), x, VF(3.3333331174e-1f));
  const VF a1 = fmadd(VF(-1.6668057665e-1f), x, VF(2.0000714765e-1f));
  const VF a2 = fmadd(VF(-1.2420140846e-1f), x, VF(1.4249322787e-1f));
  const VF a3 = fmadd(VF(-1.1514610310e-1f), x, VF(1.1676998740e-1f));
  const VF b0 = fmadd(a1, x2, a0), b1 = fmadd(a3, x2, a2);
  const VF poly = fmadd(fmadd(VF(7.0376836292e-2f), x4, b1), x4, b0);
  const VF ln = x + fmadd(poly * x, x2, VF(-0.5f) * x2);  // log1p(x) = x − x²/2 + x³·poly
  return fmadd(ln, VF(static_cast<float>(kLog2e)), k);
#else
  return z.log2();
#endif
}

// 2^t for a log-prob t in log2 units: t ≤ 0 up to rounding (the stats' shift and log-sum are
// the row's, or the whole vocabulary's in the vocabulary-parallel walk), so without exp2_fast's
// upper clamp; +inf (a +inf logit) gives NaN, which sends the row to the careful path.
KLP_VEC_INLINE VF exp2_lp(const VF& t) { return exp2_fast<false>(t); }

// The mixture of π = 2^lp2 and ν = 2^lq2: M (at least the smallest normal float, so that the
// log is finite where both underflow: those entries' terms are 0 then) and the log-ratios
// dp2 = log2(π/M), dq2 = log2(ν/M), exactly 0 where lp2 = lq2.
KLP_VEC_INLINE void mixture(const VF& lp2, const VF& lq2, const VF& p, const VF& q,
                            const FastRow& k, VF& M, VF& dp2, VF& dq2) {
  const VF zero(0.0f);
  M = k.teacher_base ? at::vec::fmadd(k.w, p - q, q) : at::vec::fmadd(k.w, q - p, p);
  M = at::vec::clamp_min(M, VF(std::numeric_limits<float>::min()));  // keeps NaN
  const VF lm2 = log2_fast(M), same = lp2 == lq2;
  dp2 = VF::blendv(lp2 - lm2, zero, same);
  dq2 = VF::blendv(lq2 - lm2, zero, same);
}

// kCareful: a term weighted by a model's mass, v, is 0 where that model's log-prob l is −inf
// (0·log 0 = 0, the careful rule; the fast path's 0·inf is NaN there, which sends the row on).
template <bool kCareful>
KLP_VEC_INLINE VF massless_zero(const VF& v, const VF& l) {
  if constexpr (kCareful) {
    return VF::blendv(v, VF(0.0f), l == VF(-std::numeric_limits<float>::infinity()));
  } else {
    return v;
  }
}

// The two per-entry sums of kind K (s0, s1; the row's value and ḡ from them in fast_finish).
template <int64_t K, bool kCareful>
KLP_VEC_INLINE void fast_terms(const VF& lp2, const VF& lq2, const FastRow& k, VF& s0, VF& s1) {
  if constexpr (K == kReverseKL) {
    s0 = massless_zero<kCareful>(exp2_lp(lp2) * (lp2 - lq2), lp2);
    s1 = VF(0.0f);
  } else if constexpr (K == kForwardKL) {
    s1 = exp2_lp(lq2);
    s0 = massless_zero<kCareful>(s1 * (lq2 - lp2), lq2);
  } else if constexpr (K == kTVD) {
    const VF p = exp2_lp(lp2), diff = p - exp2_lp(lq2), zero(0.0f);
    s0 = diff.abs();
    s1 = VF::blendv(VF::blendv(zero, p, diff > zero), zero - p, diff < zero);
  } else {
    const VF p = exp2_lp(lp2), q = exp2_lp(lq2);
    VF M, dp2, dq2;
    mixture(lp2, lq2, p, q, k, M, dp2, dq2);
    if constexpr (K == kJSD) {
      s0 = massless_zero<kCareful>(q * dq2, lq2);
      s1 = massless_zero<kCareful>(p * dp2, lp2);
    } else if constexpr (K == kSkewForwardKL) {
      s0 = massless_zero<kCareful>(q * dq2, lq2);
      s1 = q * (p / M);  // ν·π/M
    } else {  // skew reverse KL
      s0 = massless_zero<kCareful>(p * dp2, lp2);
      s1 = p * (p / M);  // π²/M
    }
  }
}

// (value, ḡ) of a row from the double sums S0, S1 of fast_terms.
template <int64_t K>
inline std::pair<double, double> fast_finish(double S0, double S1, double param) {
  if constexpr (K == kReverseKL) return {kLn2 * S0, kLn2 * S0};
  if constexpr (K == kForwardKL) return {kLn2 * S0, -S1};
  if constexpr (K == kJSD) {
    return {kLn2 * (param * S0 + (1.0 - param) * S1), kLn2 * (1.0 - param) * S1};
  }
  if constexpr (K == kSkewForwardKL) return {kLn2 * S0, -(1.0 - param) * S1};
  if constexpr (K == kSkewReverseKL) return {kLn2 * S0, kLn2 * S0 - param * S1};
  return {0.5 * S0, 0.5 * S1};
}

// The gradient entries (π·g − π·ḡ)·(grad/T) of kind K at one vector of entries.
template <int64_t K, bool kCareful>
KLP_VEC_INLINE VF fast_grad(const VF& lp2, const VF& lq2, const FastRow& k, const VF& gb,
                            const VF& gt) {
  const VF p = exp2_lp(lp2);
  VF pg;
  if constexpr (K == kReverseKL) {
    pg = massless_zero<kCareful>(p * (lp2 - lq2), lp2) * k.klog;
  } else if constexpr (K == kForwardKL) {
    pg = exp2_lp(lq2) * k.kexp;
  } else if constexpr (K == kTVD) {
    const VF diff = p - exp2_lp(lq2), zero(0.0f), half = p * k.klog;
    pg = VF::blendv(VF::blendv(zero, half, diff > zero), zero - half, diff < zero);
  } else {
    const VF q = exp2_lp(lq2);
    VF M, dp2, dq2;
    mixture(lp2, lq2, p, q, k, M, dp2, dq2);
    if constexpr (K == kJSD) {
      pg = massless_zero<kCareful>(p * dp2, lp2) * k.klog;
    } else if constexpr (K == kSkewForwardKL) {
      pg = q * (p / M) * k.kexp;
    } else {
      pg = at::vec::fmadd(p * (p / M), k.kexp, massless_zero<kCareful>(p * dp2, lp2) * k.klog);
    }
  }
  return (pg - p * gb) * gt;
}

// The last n < kBlock entries of a row as float buffers, padded with the shifts (finite
// entries whose lanes the caller drops), and the lanes that hold entries.
template <typename TX, typename TY>
KLP_VEC_INLINE void load_tail(const TX* x, const TY* y, int64_t n, const FastRow& k, VF& dx0,
                              VF& dx1, VF& dy0, VF& dy1, VF& in0, VF& in1) {
  float xb[kBlock], yb[kBlock], idx[kBlock];
  for (int64_t j = 0; j < kBlock; ++j) {
    xb[j] = j < n ? static_cast<float>(x[j]) : k.fshx;
    yb[j] = j < n ? static_cast<float>(y[j]) : k.fshy;
    idx[j] = static_cast<float>(j);
  }
  load_shifted(xb, yb, k.shx, k.shy, dx0, dx1, dy0, dy1);
  const VF lim(static_cast<float>(n));
  in0 = VF::loadu(idx) < lim;
  in1 = VF::loadu(idx + VF::size()) < lim;
}

// The kept lanes of a row's last n < kBlock entries (the lanes past n: not kept), x's
// comparison with tau made as SupLanes' (in float).
template <typename TX, typename Sup>
KLP_VEC_INLINE void tail_lanes(const TX* x, int64_t n, const Sup& sup, LaneMask& m0,
                               LaneMask& m1) {
  float kb[kBlock];
  for (int64_t j = 0; j < kBlock; ++j) {
    kb[j] = (j < n && sup.kept(static_cast<float>(x[j]), j)) ? 1.0f : 0.0f;
  }
  m0 = lanes_gt(VF::loadu(kb), VF(0.5f));
  m1 = lanes_gt(VF::loadu(kb + VF::size()), VF(0.5f));
}

// The log-probs in log2 units of one vector of entries (dx, dy: the logits minus the shifts),
// lp2 = −inf off the support (lanes not in m where Sup is on).
template <typename Sup>
KLP_VEC_INLINE void log_probs2(const VF& dx, const VF& dy, const FastRow& k, const LaneMask& m,
                               VF& lp2, VF& lq2) {
  lp2 = at::vec::fmadd(dx, k.c, k.bx);
  lq2 = at::vec::fmadd(dy, k.c, k.by);
  if constexpr (Sup::kOn) lp2 = select(m, lp2, VF(-std::numeric_limits<float>::infinity()));
}

// (value, ḡ) of a row by the fast path (not finite: the row needs the careful path); kCareful:
// with the 0·log 0 rule (rows with −inf logits, and truncated rows). Sup: the support's lane
// masks (NoLanes: none): lp = −inf and π·g = 0 off the support.
template <int64_t K, bool kCareful, typename TX, typename TY, typename Sup = NoLanes>
std::pair<double, double> row_fast(const TX* x, const TY* y, int64_t V, const FastRow& k,
                                   double param, const Sup& sup = Sup()) {
  const VF zero(0.0f);
  WideSum w0, w1;
  VF a0 = zero, a1 = zero;
  int64_t i = 0, blocks = 0;
  // the main loop calls fast_terms directly (no lambda around it: a call per vector where the
  // compiler does not inline one costs the untruncated rows ~20%)
  for (; i + kBlock <= V; i += kBlock) {
    VF dx0, dx1, dy0, dy1;
    load_shifted(x + i, y + i, k.shx, k.shy, dx0, dx1, dy0, dy1);
    VF lp0 = at::vec::fmadd(dx0, k.c, k.bx), lp1 = at::vec::fmadd(dx1, k.c, k.bx);
    LaneMask m0 = lanes_all(), m1 = lanes_all();
    if constexpr (Sup::kOn) {  // the logits again (from L1) for the comparison with tau
      VF xa, xb;
      load2(x + i, xa, xb);
      m0 = sup.at(xa, i);
      m1 = sup.at(xb, i + VF::size());
      const VF ninf(-std::numeric_limits<float>::infinity());
      lp0 = select(m0, lp0, ninf);
      lp1 = select(m1, lp1, ninf);
    }
    VF s0, s1, t0, t1;
    fast_terms<K, kCareful>(lp0, at::vec::fmadd(dy0, k.c, k.by), k, s0, s1);
    fast_terms<K, kCareful>(lp1, at::vec::fmadd(dy1, k.c, k.by), k, t0, t1);
    if constexpr (Sup::kOn) {  // π·g = 0 off the support
      s1 = select(m0, s1, zero);
      t1 = select(m1, t1, zero);
    }
    a0 = a0 + (s0 + t0);
    a1 = a1 + (s1 + t1);
    if (++blocks == kFlush) {
      w0.add(a0);
      w1.add(a1);
      a0 = a1 = zero;
      blocks = 0;
    }
  }
  if (i < V) {
    VF dx0, dx1, dy0, dy1, in0, in1;
    load_tail(x + i, y + i, V - i, k, dx0, dx1, dy0, dy1, in0, in1);
    LaneMask m0 = lanes_all(), m1 = lanes_all();
    if constexpr (Sup::kOn) tail_lanes(x + i, V - i, sup.from(i), m0, m1);
    const VF dx[2] = {dx0, dx1}, dy[2] = {dy0, dy1}, in[2] = {in0, in1};
    const LaneMask m[2] = {m0, m1};
    for (int h = 0; h < 2; ++h) {
      VF lp2, lq2, s0, s1;
      log_probs2<Sup>(dx[h], dy[h], k, m[h], lp2, lq2);
      fast_terms<K, kCareful>(lp2, lq2, k, s0, s1);
      if constexpr (Sup::kOn) s1 = select(m[h], s1, zero);
      a0 = a0 + VF::blendv(zero, s0, in[h]);
      a1 = a1 + VF::blendv(zero, s1, in[h]);
    }
  }
  w0.add(a0);
  w1.add(a1);
  return fast_finish<K>(w0.value(), w1.value(), param);
}

// A gradient row by the fast path; false where an entry is not finite (redo it carefully).
// kCareful: with the 0·log 0 rule; Sup: the support's lane masks (exactly 0 off the support).
template <int64_t K, bool kCareful, typename TX, typename TY, typename TO, typename Sup = NoLanes>
bool grad_fast(const TX* x, const TY* y, int64_t V, const FastRow& k, double grad, double gbar,
               double T, TO* out, const Sup& sup = Sup()) {
  const VF gb(static_cast<float>(gbar));
  const VF gt(static_cast<float>(grad) / static_cast<float>(T));
  const VF zero(0.0f);
  VF bad = zero;  // NaN in a lane once an entry there is ±inf or NaN
  auto grad_of = [&](const VF& dx, const VF& dy, const LaneMask& m) {
    VF lp2, lq2;
    log_probs2<Sup>(dx, dy, k, m, lp2, lq2);
    VF v = fast_grad<K, kCareful>(lp2, lq2, k, gb, gt);
    if constexpr (Sup::kOn) v = select(m, v, zero);
    bad = at::vec::fmadd(v, zero, bad);
    return v;
  };
  int64_t i = 0;
  for (; i + kBlock <= V; i += kBlock) {
    VF dx0, dx1, dy0, dy1;
    load_shifted(x + i, y + i, k.shx, k.shy, dx0, dx1, dy0, dy1);
    LaneMask m0 = lanes_all(), m1 = lanes_all();
    if constexpr (Sup::kOn) {
      VF xa, xb;
      load2(x + i, xa, xb);
      m0 = sup.at(xa, i);
      m1 = sup.at(xb, i + VF::size());
    }
    const VF v0 = grad_of(dx0, dy0, m0), v1 = grad_of(dx1, dy1, m1);
    store2(out + i, v0, v1);
  }
  if (i < V) {
    VF dx0, dx1, dy0, dy1, in0, in1;
    load_tail(x + i, y + i, V - i, k, dx0, dx1, dy0, dy1, in0, in1);
    LaneMask m0 = lanes_all(), m1 = lanes_all();
    if constexpr (Sup::kOn) tail_lanes(x + i, V - i, sup.from(i), m0, m1);
    float buf[kBlock];
    grad_of(dx0, dy0, m0).store(buf);
    grad_of(dx1, dy1, m1).store(buf + VF::size());
    for (int64_t j = 0; i + j < V; ++j) out[i + j] = static_cast<TO>(buf[j]);
    // the padded lanes are finite: the shifts give lp2, lq2 of finite rows' entries
  }
  float b[VF::size()];
  bad.store(b);
  for (int j = 0; j < VF::size(); ++j)
    if (b[j] != 0.0f) return false;
  return true;
}

// ------------------------------------------------------------------------------ the ops
// f(kind constant, r, x row, y row) for every row, in the logits' dtype (x and y share it), rows
// in parallel.
template <typename F>
void for_each_row(const DivArgs& a, int64_t kind, F&& f) {
  const at::ScalarType t = a.x.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, t, "native_divergence", [&] {
    const scalar_t* px = a.x.const_data_ptr<scalar_t>();
    const scalar_t* py = a.y.const_data_ptr<scalar_t>();
    const Rows rx(a.x), ry(a.y);
    with_kind(kind, [&](auto kc) {
      parallel_rows(a.N, a.V, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) f(kc, r, px + rx.offset(r), py + ry.offset(r));
      });
    });
  });
}

// The element type of a row pointer.
template <typename P>
using RowType = std::remove_cv_t<std::remove_pointer_t<P>>;

std::tuple<at::Tensor, at::Tensor> divergence(const at::Tensor& x_arg, const at::Tensor& y_arg,
                                              const at::Tensor& stats,
                                              const std::optional<at::Tensor>& mask,
                                              const std::optional<at::Tensor>& keep,
                                              const std::optional<at::Tensor>& tau, double T,
                                              int64_t kind, double param) {
  const DivArgs a(x_arg, y_arg, stats, mask, keep, tau, T, kind);
  const SupportRows sr(a.keep, a.tau, a.x);
  at::Tensor value = at::empty(a.leading, a.x.options().dtype(a.ct));
  at::Tensor gbar = at::empty(a.leading, a.x.options().dtype(a.ct));
  const double* sp = a.st.const_data_ptr<double>();
  for_each_row(a, kind, [&](auto kc, int64_t r, const auto* xr, const auto* yr) {
    constexpr int64_t K = decltype(kc)::value;
    using C = Compute<RowType<decltype(xr)>>;  // the compute dtype, value's and ḡ's
    C* vp = static_cast<C*>(value.mutable_data_ptr());
    C* gp = static_cast<C*>(gbar.mutable_data_ptr());
    if (a.masked(r)) {
      vp[r] = gp[r] = C(0);
      return;
    }
    const double* s = sp + kStatsCols * r;
    std::pair<double, double> vg{kNaN, kNaN};
    auto finite = [&] { return std::isfinite(vg.first) && std::isfinite(vg.second); };
    const Support sup = sr.at(r);
    if constexpr (!std::is_same_v<C, double>) {
      const FastRow k(s, T, K, param);
      if (sup.any()) {  // −inf off the support: the 0·log 0 rule at once
        with_lanes(sup, [&](const auto& lanes) {
          vg = row_fast<K, true>(xr, yr, a.V, k, param, lanes);
        });
      } else {
        vg = row_fast<K, false>(xr, yr, a.V, k, param);
        if (!finite()) vg = row_fast<K, true>(xr, yr, a.V, k, param);
      }
    }
    if (!finite()) vg = row_careful<C>(xr, yr, a.V, s, T, K, param, sup);
    vp[r] = static_cast<C>(vg.first);
    gp[r] = static_cast<C>(vg.second);
  });
  return {value, gbar};
}

at::Tensor divergence_backward(const at::Tensor& grad, const at::Tensor& x_arg,
                               const at::Tensor& y_arg, const at::Tensor& stats,
                               const at::Tensor& gbar, const std::optional<at::Tensor>& mask,
                               const std::optional<at::Tensor>& keep,
                               const std::optional<at::Tensor>& tau, double T, int64_t kind,
                               double param) {
  const DivArgs a(x_arg, y_arg, stats, mask, keep, tau, T, kind);
  const SupportRows sr(a.keep, a.tau, a.x);
  const at::Tensor g = per_row("grad", grad, a);
  const at::Tensor gb = per_row("gbar", gbar, a);
  at::Tensor gx = at::empty(a.x.sizes(), a.x.options());
  const double* sp = a.st.const_data_ptr<double>();
  const double* gpr = g.const_data_ptr<double>();
  const double* gbp = gb.const_data_ptr<double>();
  for_each_row(a, kind, [&](auto kc, int64_t r, const auto* xr, const auto* yr) {
    constexpr int64_t K = decltype(kc)::value;
    using T_in = RowType<decltype(xr)>;
    using C = Compute<T_in>;
    T_in* o = static_cast<T_in*>(gx.mutable_data_ptr()) + r * a.V;
    // masked, or no upstream gradient: exactly 0 (the row's logits are not read)
    if (a.masked(r) || static_cast<C>(gpr[r]) == C(0)) {
      std::fill(o, o + a.V, T_in(0));
      return;
    }
    const double* s = sp + kStatsCols * r;
    const Support sup = sr.at(r);
    bool done = false;
    if constexpr (!std::is_same_v<C, double>) {
      const FastRow k(s, T, K, param);
      if (sup.any()) {
        with_lanes(sup, [&](const auto& lanes) {
          done = grad_fast<K, true>(xr, yr, a.V, k, gpr[r], gbp[r], T, o, lanes);
        });
      } else {
        done = grad_fast<K, false>(xr, yr, a.V, k, gpr[r], gbp[r], T, o) ||
               grad_fast<K, true>(xr, yr, a.V, k, gpr[r], gbp[r], T, o);
      }
    }
    if (!done) grad_careful<C>(xr, yr, a.V, s, T, K, param, gpr[r], gbp[r], sup, o);
  });
  if (a.mixed) gx = gx.to(x_arg.scalar_type());
  return gx;
}

}  // namespace

TORCH_LIBRARY_IMPL(klpenalty, CPU, m) {
  m.impl("native_divergence", &divergence);
  m.impl("native_divergence_backward", &divergence_backward);
}

}  // namespace klpenalty_native
