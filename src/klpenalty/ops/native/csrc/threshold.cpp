// The sampler threshold (threshold.h): row_threshold, instantiated for the row types the other
// sources call it with, and the op native_sampling_threshold(x, top_k, top_p, min_p,
// temperature) -> tau (...), its rows in parallel.
#include "threshold.h"

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "rows.h"
#include "select.h"
#include "simd.h"

namespace klpenalty_native {

ThresholdScratch& scratch() {
  thread_local ThresholdScratch s;
  return s;
}

namespace {

constexpr int64_t kSmallRow = 256;  // candidates sorted and walked directly

// ------------------------------------------------------------------------------ passes over a row
// (max, min) of a row; max NaN if the row holds NaN. The first read of the row: four
// independent vectors per step and the lines kAhead elements ahead requested meanwhile. For float
// rows, lane_max (if given) receives the lane maxima of each block of kLaneBlock elements
// (kLaneBlock/VF::size() elements each, distinct elements of the row), *lanes their number;
// kSecond: lane_max2 the second largest of each lane (with multiplicity: a tied maximum is also
// the second), so that a lane whose second is below a bound holds one logit at least that bound
// at most, its maximum.
constexpr int64_t kLaneBlock = 256;
template <bool kSecond = false, typename T>
std::pair<double, double> row_max_min(const T* x, int64_t V, float* lane_max = nullptr,
                                      int64_t* lanes = nullptr, float* lane_max2 = nullptr) {
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
    [[maybe_unused]] VF sx[U];
    for (int k = 0; k < U; ++k) mn[k] = VF(finf);
    LaneMask nan = lanes_empty();
    int64_t i = 0, nl = 0;
    while (i + kLaneBlock <= V) {
      for (int k = 0; k < U; ++k) mx[k] = VF(-finf);
      if constexpr (kSecond) {
        for (int k = 0; k < U; ++k) sx[k] = VF(-finf);
      }
      for (int64_t e = i + kLaneBlock; i < e; i += kStep) {
        const char* ahead = reinterpret_cast<const char*>(x + i + kAhead);
        for (int64_t b = 0; b < kBytes; b += 64) __builtin_prefetch(ahead + b);
#pragma GCC unroll 4
        for (int k = 0; k < U; ++k) {
          const VF v = load1(x + i + k * VF::size());
          if constexpr (kSecond) sx[k] = max_fast(sx[k], at::vec::clamp_max(mx[k], v));
          mx[k] = max_fast(mx[k], v);
          mn[k] = at::vec::clamp_max(mn[k], v);
          nan = lanes_or(nan, lanes_nan(v));
        }
      }
      if constexpr (kSecond) {  // (max, second) of two pairs: the larger max, and the second
        auto merge = [](VF& m1, VF& s1, const VF& m2, const VF& s2) {
          s1 = max_fast(max_fast(s1, s2), at::vec::clamp_max(m1, m2));
          m1 = max_fast(m1, m2);
        };
        merge(mx[0], sx[0], mx[1], sx[1]);
        merge(mx[2], sx[2], mx[3], sx[3]);
        merge(mx[0], sx[0], mx[2], sx[2]);
        sx[0].store(lane_max2 + nl);
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

// top-p over the candidates c[0, n) alone (index order) of a float (f32) or double row: Z of their
// keys in float64 in that order. The candidates hold every logit of the last kept group.
inline double top_p_small(double* c, int64_t n, const Sampler& s, bool f32) {
  double m = -kInf;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, key_of(c[j], s, f32));
  if (m == -kInf) return -kInf;
  double z = 0.0;
  for (int64_t j = 0; j < n; ++j) z += std::exp(key_of(c[j], s, f32) - m);
  return top_p_walk(c, n, s, f32, 0.0, m + std::log(z));
}

// The same for a float row whose lane maxima lm (row_max_min's, `lanes` of them) are known and
// tau > −inf: only the kLaneBlock-logit blocks with a lane maximum >= tau (and the tail after the
// last whole block) can hold such logits, so only they are read (the same logits, same order).
template <typename T>
void gather_at_least_blocks(const T* x, int64_t V, double tau, const float* lm, int64_t lanes,
                            ThresholdScratch& w) {
  const float ft = static_cast<float>(tau);  // one of the (float) logits
  float* b = room(w.kbuf, V + VF::size());
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

// The same logits (not in index order) where the second lane maxima lm2 are known too: a block
// whose lanes' seconds are all below tau holds no logit >= tau but its lane maxima >= tau, which
// are taken from lm without reading the block.
template <typename T>
void gather_at_least_lanes(const T* x, int64_t V, double tau, const float* lm, const float* lm2,
                           int64_t lanes, ThresholdScratch& w) {
  const float ft = static_cast<float>(tau);  // one of the (float) logits
  float* b = room(w.kbuf, V + VF::size());
  const VF vt(ft);
  int64_t n = 0;
  const int64_t blocks = lanes / VF::size();
  for (int64_t k = 0; k < blocks; ++k) {
    const VF m1 = VF::loadu(lm + k * VF::size());
    const LaneMask top = lanes_ge(m1, vt);
    if (lanes_none(top)) continue;
    if (lanes_none(lanes_ge(VF::loadu(lm2 + k * VF::size()), vt))) {
      n += compress_store(b + n, top, m1);
    } else {
      n = gather_range(x, k * kLaneBlock, (k + 1) * kLaneBlock, ft, b, n);
    }
  }
  n = gather_range(x, blocks * kLaneBlock, V, ft, b, n);
  w.cand.assign(b, b + n);
}

// ------------------------------------------------------------------------------ top-k, min-p
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
      // with the second lane maxima (top-k alone: the candidates' order does not matter) the
      // blocks whose lanes hold one logit >= th0 at most are not read again
      const bool seconds = th0 > -kInf && !s.cut_p;
      if (seconds) {
        gather_at_least_lanes(x, V, th0, w.lm.data(), w.lm2.data(), lanes, w);
      } else if (th0 > -kInf) {
        gather_at_least_blocks(x, V, th0, w.lm.data(), lanes, w);
      } else {
        gather_at_least(x, V, th0, w);
      }
      const int64_t n = static_cast<int64_t>(w.cand.size());
      if (n >= s.top_k && n <= 64 * s.top_k + 4096) {
        if (!seconds) w.survivors = n;  // w.kbuf[0, n): the logits >= th0, in index order
        std::nth_element(w.cand.begin(), w.cand.begin() + (s.top_k - 1), w.cand.end(),
                         std::greater<>());
        return w.cand[s.top_k - 1];
      }
    }
    if (V > kSmallRow) return select_large<true>(x, V, M, row_min, -kInf, s, w);
  }
  w.cand.assign(x, x + V);
  std::nth_element(w.cand.begin(), w.cand.begin() + (s.top_k - 1), w.cand.end(), std::greater<>());
  return w.cand[s.top_k - 1];
}

// The smallest logit with key_of(x) − key_of(M) >= log(min_p) in double (M finite: the max, always
// kept). Outside x = c ± δ the exact quotients decide as the keys do (δ: 1e-6 relative, the keys'
// rounding is 6e-8).
template <typename T>
double min_p_threshold(const T* x, int64_t V, double M, const Sampler& s) {
  const double log_min_p = std::log(s.min_p);
  const double c = M + s.T * log_min_p;
  const double delta = 1e-6 * (std::fabs(M) + std::fabs(c) + s.T);
  constexpr bool f32 = !std::is_same_v<T, double>;
  const double key_max = key_of(M, s, f32);
  auto rule = [&](double v) { return key_of(v, s, f32) - key_max >= log_min_p; };
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

}  // namespace

// τ_s of one row (threshold.h); s.cuts() holds.
template <typename T>
double row_threshold(const T* x, int64_t V, const Sampler& s, ThresholdScratch& w,
                     const void* side) {
  int64_t lanes = 0;
  float* lane_max = nullptr;
  double M, row_min;
  if (!std::is_same_v<T, double> && s.cut_k) {
    const int64_t nl = V / kLaneBlock * VF::size() + VF::size();
    lane_max = room(w.lm, nl);
    if (s.cut_p) {  // (top-k's candidates then kept in index order: no second maxima)
      std::tie(M, row_min) = row_max_min(x, V, lane_max, &lanes);
    } else {
      std::tie(M, row_min) = row_max_min<true>(x, V, lane_max, &lanes, room(w.lm2, nl));
    }
  } else {
    std::tie(M, row_min) = row_max_min(x, V);
  }
  w.masses_of = nullptr;
  if (std::isnan(M)) return kNaN;  // a row holding NaN keeps nothing
  if (M == -kInf) return -kInf;    // every logit −inf: every step keeps them all
  double tau = -kInf;
  w.survivors = -1;
  if (s.cut_k) {
    const double kth = kth_largest(x, V, M, row_min, s, w, lanes);
    tau = group_floor(x, V, kth, s);
    if (tau != kth) w.survivors = -1;  // (they may miss the group's logits below th0)
  }
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
      tp = top_p_small(w.cand.data(), static_cast<int64_t>(w.cand.size()), s,
                       !std::is_same_v<T, double>);
    } else {
      const double lo = s.cut_k ? std::nextafter(static_cast<float>(tau), -std::numeric_limits<float>::infinity())
                                : -kInf;
      if constexpr (std::is_same_v<T, double>) {
        tp = -kInf;  // (float64 rows take the branch above)
      } else {
        tp = select_large<false>(x, V, M, row_min, lo, s, w, side);
        w.masses_of = x, w.masses_max = M;  // (select_large stored them all in w.es)
      }
    }
    tau = std::max(tau, tp);
  }
  if (s.cut_min) tau = std::max(tau, min_p_threshold(x, V, M, s));
  return tau;
}

// the instances that the forward (token_stats.cpp) and the op below call
#define KLPENALTY_ROW_THRESHOLD(T) \
  template double row_threshold<T>(const T*, int64_t, const Sampler&, ThresholdScratch&, \
                                   const void*);
KLPENALTY_ROW_THRESHOLD(float)
KLPENALTY_ROW_THRESHOLD(double)
KLPENALTY_ROW_THRESHOLD(c10::BFloat16)
KLPENALTY_ROW_THRESHOLD(c10::Half)
#undef KLPENALTY_ROW_THRESHOLD

namespace {

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

}  // namespace

TORCH_LIBRARY_IMPL(klpenalty, CPU, m) {
  m.impl("native_sampling_threshold", &sampling_threshold);
}

}  // namespace klpenalty_native
