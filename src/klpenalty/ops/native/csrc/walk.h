// The row walk that the forward and the state op share: the engine's per-row state
// (klpenalty/ops/engine.py: maxima in logit units, s_x, s_y and the moments a, b, in double) over
// a row of V logits, computed in L1-sized chunks (kChunk elements) of float32 vectors.
//
// An untruncated row is read once (row_fast): every chunk against the row's running maxima (at
// first those of the row's first kPrefix elements) with the chunk's maxima tracked alongside,
// redone in two passes (chunk_step: maxima, then from L1 the exps and sums) if they rose by more
// than kRise. A support (Support: keep mask and/or tau) takes the same walk with lane masks
// folded into the loads (SupLanes; off the support e^u is 0 and the lane leaves the maxima);
// rows whose sums are not finite (−inf logits on the support, the 0·log 0 rule) are redone chunk
// by chunk in two passes (row_vec), the chunk of x copied into an L1 buffer with −inf off the
// support; float64 inputs and rows holding NaN or +inf take a scalar double path (row_scalar).
// A tau alone that keeps few logits (at most V/kFewKept: a sampler's top-k, min-p) is walked
// sparsely (walk_few_kept): y alone over the row, x exponentiated only where kept. A tau given
// with the row's masses (Support::masses: top-p's, computed by its threshold pass against the
// row's max) is walked against that max from the start, e^u read rather than computed.
// walk_row<kY, kB> is the one entry, specialised on what is wanted: the log-sum-exp of x, with
// y's and the KL's Σ e^u·(u − w) (kY), with the entropy's Σ e^u·u (kB).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "simd.h"

namespace klpenalty_native {
namespace {  // each source its own copies (internal linkage), inlined freely

// ------------------------------------------------------------------------------ the support
// The policy's support in one row: kept(v) = (no keep or keep[v]) and (no tau or x_v >= tau),
// the comparison made in tau's dtype (float32 or float64), as autograd.kept_logits.
struct Support {
  const bool* keep = nullptr;  // this row of the (..., V) bool mask, or null
  bool has_tau = false, tau_double = false;
  float tau_f = 0.0f;
  double tau_d = 0.0;
  // the row's masses against its maximum masses_max, as the walk computes e^u (the sampler
  // threshold's, ThresholdScratch), or null; read where the support is a tau alone that keeps
  // that maximum
  const float* masses = nullptr;
  double masses_max = 0.0;

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
    if (s.masses) s.masses += c0;
    return s;
  }
};

// The support with a sampler's threshold tau_s folded in: x >= max(tau, tau_s) (NaN if either
// is NaN), compared in double if tau is or the compute dtype is (tau_s is one of the logits).
inline Support with_threshold(Support s, double tau_s, bool in_double) {
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

// The support of a row as lane masks of the float vectors a walk loads (in memory order for a
// keep mask): keep read as bytes, x >= tau compared in float. NoLanes: no support.
struct NoLanes {
  static constexpr bool kOn = false, kKeep = false, kBounds = false;
  LaneMask at(const VF&, int64_t) const { return LaneMask(); }
  bool kept(float, int64_t) const { return true; }
  NoLanes from(int64_t) const { return *this; }
};

// The smallest kept logit and the largest logit off the support that is not NaN, over the
// elements a walk has visited (a visit repeated by a redo changes neither).
struct KeptBounds {
  float lo = std::numeric_limits<float>::infinity();
  float hi = -std::numeric_limits<float>::infinity();
};

// kBoundsB: the walk records the support's KeptBounds as it goes (a keep mask's: whether it is
// a threshold set {x >= lo}, iff hi < lo, is then known without another pass over the row).
template <bool kKeepB, bool kTauB, bool kBoundsB = false>
struct SupLanes {
  static constexpr bool kOn = true, kKeep = kKeepB, kBounds = kBoundsB;
  const bool* keep = nullptr;  // the walked segment's keep
  VF vtau;
  float tau = 0.0f;
  KeptBounds* bounds = nullptr;  // with kBoundsB
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
  // the bounds of lanes (lo: the kept's minima, hi: the others' maxima) or of one element
  void record(const VF& lo, const VF& hi) const {
    float a[VF::size()], b[VF::size()];
    lo.store(a);
    hi.store(b);
    for (int k = 0; k < VF::size(); ++k) record(a[k], b[k]);
  }
  void record(float lo, float hi) const {
    bounds->lo = lo < bounds->lo ? lo : bounds->lo;
    bounds->hi = hi > bounds->hi ? hi : bounds->hi;
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

// ------------------------------------------------------------------------------ row state
// The engine's state of one row over the columns walked so far: maxima in logit units, s_x, s_y,
// the KL's a = Σ e^u·(u − w) and the entropy's b = Σ e^u·u (0·log 0 = 0), in double.
struct RowState {
  double m_x = -kInf, s_x = 0.0, m_y = -kInf, s_y = 0.0, a = 0.0, b = 0.0;
  bool careful = false;  // the row needed the 0·log 0 arithmetic
  bool bad = false;      // a maximum is NaN or +inf (vector path only): redo it in double
  bool off = false;      // an element lies off the support (its e^u is 0: the 0·log 0 rule)
};

// (delta, alpha) rescaling a state with max m to the max big: delta = (m - big)/T, 0 if equal.
inline std::pair<double, double> scales(double m, double big, double T) {
  double delta = (m == big) ? 0.0 : (m - big) / T;
  return {delta, std::exp(delta)};
}

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
// the maxima alongside; ahead: elements ahead to prefetch (0: none); side: with ahead, n elements'
// bytes of another region requested into L2 alongside (a row that follows: its logits, or its
// kept ids); kGivenE: e^u read from given_e (the chunk's masses against sh_x, computed as here:
// the sampler threshold's) instead of computed, and x's maximum not tracked (sh_x is the row's,
// which no kept logit exceeds: on AVX2's 16 registers that loop then keeps its values in them;
// top-p's walk ~10% faster there). Every exponent is at most 0 with shifts at the
// maxima, and at most the caller's bound otherwise (exp2_scaled).
template <int U, bool kY, bool kB, bool kCareful, bool kTrack, int64_t ahead,
          bool kGivenE = false, typename TX, typename TY, typename Sup = NoLanes>
ChunkSums chunk_sums(const TX* x, const TY* y, int64_t n, float sh_x, float sh_y, float c,
                     const Sup& sup = Sup(), const void* side = nullptr,
                     const float* given_e = nullptr) {
  constexpr int64_t kStep = U * VF::size();
  constexpr int kSteps = U >= 8 ? 1 : 8 / U;  // steps per float partial sum
  const VF vc(c), vsx(sh_x), vsy(sh_y), zero(0.0f), lo(-127.0f / c);
  const VF ninf(-std::numeric_limits<float>::infinity());
  [[maybe_unused]] LaneMask on = lanes_all();  // the lanes kept at every step
  VF mx(-std::numeric_limits<float>::infinity()), my = mx;
  [[maybe_unused]] VF blo(std::numeric_limits<float>::infinity()), bhi = mx;
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
        // the side region, into L2, while this row is computed
        request_l2(side, i * static_cast<int64_t>(sizeof(TX)), kBytesX);
      }
      VF xv[U], yv[U];
      // x from a float buffer, a keep mask or given masses: memory order
      constexpr bool kAnyOrder = std::is_same_v<TX, TY> && !Sup::kKeep && !kGivenE;
      load_lanes<U, kAnyOrder>(x + i, xv);
      if constexpr (kY) load_lanes<U, kAnyOrder>(y + i, yv);
#pragma GCC unroll 8
      for (int k = 0; k < U; ++k) {
        // off the support: e^u = 0 (x itself finite there, so no 0·inf), not in the maximum
        [[maybe_unused]] LaneMask kept;
        if constexpr (Sup::kOn) {
          kept = sup.at(xv[k], i + k * VF::size());
          on = lanes_and(on, kept);
        }
        // (given masses: against the row's maximum, which no kept logit exceeds)
        if constexpr (kTrack && !kGivenE) {
          mx = max_fast(mx, Sup::kOn ? select(kept, xv[k], ninf) : xv[k]);
        }
        if constexpr (Sup::kBounds) {  // a NaN: skipped (kept, it makes the sums NaN)
          blo = min_where(blo, kept, xv[k]);
          bhi = max_where(bhi, lanes_andnot(lanes_all(), kept), xv[k]);
        }
        const VF dx = xv[k] - vsx;
        VF eu = kGivenE ? VF::loadu(given_e + i + k * VF::size()) : exp2_scaled(dx, vc, lo);
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
  if constexpr (Sup::kOn) cs.off = !lanes_none(lanes_andnot(lanes_all(), on));
  if constexpr (Sup::kBounds) sup.record(blo, bhi);
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
    if constexpr (Sup::kBounds) {
      if (kept) {
        sup.record(xf, -std::numeric_limits<float>::infinity());
      } else if (!std::isnan(xf)) {
        sup.record(std::numeric_limits<float>::infinity(), xf);
      }
    }
    const float dx = xf - sh_x;
    const float eu = !kept ? 0.0f : kGivenE ? given_e[i] : std::exp2(dx * c);
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
// double arithmetic). side: V·sizeof(T) bytes requested into L2 during the walk (chunk_sums).
// given_e (with a support): the row's masses against its maximum given_max (the kept maximum),
// e^u read instead of computed where the walk shifts by it (a redo computes them, the same
// floats).
template <bool kY, bool kB, typename T, typename Sup = NoLanes>
RowState row_fast(const T* px, const T* py, int64_t V, double T_, const Sup& sup_row = Sup(),
                  const void* side = nullptr, const float* given_e = nullptr,
                  double given_max = 0.0) {
  RowState row;
  const float c = static_cast<float>(kLog2e / T_);
  if (V > kPrefix) {
    const double m_x = given_e ? given_max : chunk_max_kept(px, kPrefix, sup_row);
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
      const char* side_c0 =
          side ? static_cast<const char*>(side) + c0 * static_cast<int64_t>(sizeof(T)) : nullptr;
      const ChunkSums cs =
          given_e ? chunk_sums<kChains, kY, kB, false, true, ahead, true>(
                        x, y, n, sh_x, sh_y, c, sup, side_c0, given_e + c0)
                  : chunk_sums<kChains, kY, kB, false, true, ahead>(x, y, n, sh_x, sh_y, c, sup,
                                                                    side_c0);
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

// ------------------------------------------------------------------------------ few kept logits
// A support that is a tau alone (a sampler's threshold, whose passes have just read x into L2)
// and keeps at most V/kFewKept logits of a row (top-k with a small k, min-p) is walked
// sparsely: the kept logits and their columns compressed in one pass over x (no exp; not made
// where a sample of the row keeps too many, given up as soon as more are kept); y's state from
// y's own one-pass walk (row_fast, as for an untruncated row), after which y's row lies in L2
// and its kept columns are gathered from there; then the kept pairs' sums against the kept
// maximum (chunk_sums over the compressed buffers, in index order). x is exponentiated only
// where kept, and y read once, in order. (A keep mask's row is not in L2 beforehand: its
// compress pass reads x from memory and saved nothing.)
constexpr int64_t kFewKept = 16;
constexpr int64_t kSampleStride = 16;  // the sample that rules out many kept: every 16th vector

// The kept logits of a row (the support's lane masks, SupLanes) compressed into cx in index
// order and their columns into ci (as floats: exact below 2^24); their number, or −1 as soon as
// it exceeds `most` (cx, ci: room for most + 2·VF::size() floats).
template <typename T, typename Sup>
int64_t compress_kept(const T* x, int64_t V, const Sup& sup, int64_t most, float* cx,
                      float* ci) {
  constexpr int U = 4;
  constexpr int64_t kStep = U * VF::size();
  float lane[VF::size()];
  for (int k = 0; k < VF::size(); ++k) lane[k] = static_cast<float>(k);
  const VF iota = VF::loadu(lane);
  int64_t n = 0, i = 0;
  for (; i + kStep <= V; i += kStep) {
    VF v[U];
    LaneMask m[U];
#pragma GCC unroll 4
    for (int k = 0; k < U; ++k) {
      v[k] = load1(x + i + k * VF::size());
      m[k] = sup.at(v[k], i + k * VF::size());
    }
    if (lanes_none(lanes_or(lanes_or(m[0], m[1]), lanes_or(m[2], m[3])))) continue;
    for (int k = 0; k < U; ++k) {
      if (lanes_none(m[k])) continue;
      compress_store(ci + n, m[k], iota + VF(static_cast<float>(i + k * VF::size())));
      n += compress_store(cx + n, m[k], v[k]);
      if (n > most) return -1;
    }
  }
  for (; i < V; ++i) {
    const float v = static_cast<float>(x[i]);
    if (!sup.kept(v, i)) continue;
    if (n == most) return -1;
    ci[n] = static_cast<float>(i);
    cx[n++] = v;
  }
  return n;
}

// The sparse walk of a float row with a support (its lane masks, SupLanes): true with *out set
// where at most V/kFewKept logits are kept, the kept maximum is finite, y's walk is not bad and
// every sum is finite; false (nothing set) otherwise, and the caller walks the row.
template <bool kY, bool kB, typename T, typename Sup>
bool walk_few_kept(const T* px, const T* py, const Sup& sup, int64_t V, double T_,
                   const void* side, RowState* out) {
  if (V >= (int64_t{1} << 24)) return false;  // (columns as floats)
  thread_local std::vector<float> bx, by, bi;
  const int64_t most = V / kFewKept;
  // every kSampleStride-th vector first: a support that surely keeps more is not scanned
  int64_t sampled = 0;
  for (int64_t i = 0; i + VF::size() <= V; i += kSampleStride * VF::size()) {
    sampled += lanes_count(sup.at(load1(px + i), i));
  }
  if (sampled * kSampleStride > 2 * most) return false;
  const size_t room = static_cast<size_t>(most + 2 * VF::size());
  if (bx.size() < room) bx.resize(room), by.resize(room), bi.resize(room);
  const int64_t n = compress_kept(px, V, sup, most, bx.data(), bi.data());
  if (n <= 0) return false;
  float m_x = bx[0];
  for (int64_t j = 1; j < n; ++j) m_x = std::max(m_x, bx[j]);
  if (!(m_x < std::numeric_limits<float>::infinity())) return false;
  RowState row;
  if constexpr (kY) {
    const RowState ry = row_fast<false, false>(py, py, V, T_, NoLanes(), side);
    if (ry.bad || !std::isfinite(ry.m_x)) return false;
    row.m_y = ry.m_x, row.s_y = ry.s_x;
    for (int64_t j = 0; j < n; ++j) by[j] = static_cast<float>(py[static_cast<int64_t>(bi[j])]);
  }
  const ChunkSums cs = chunk_sums<kChains, kY, kB, false, false, 0>(
      bx.data(), by.data(), n, m_x, static_cast<float>(kY ? row.m_y : 0.0),
      static_cast<float>(kLog2e / T_));
  if (!cs.finite()) return false;
  row.m_x = m_x, row.s_x = cs.s_x;
  if constexpr (kY) row.a = cs.a / T_;
  if constexpr (kB) row.b = cs.b / T_;
  // elements off the support (−inf in the truncated policy) need the 0·log 0 rule
  row.off = row.careful = n < V;
  *out = row;
  return true;
}

// The lane masks of a support's tau alone.
inline SupLanes<false, true> tau_lanes(const Support& sup) {
  SupLanes<false, true> l;
  l.tau = sup.tau_double ? ceil_float(sup.tau_d) : sup.tau_f;
  l.vtau = VF(l.tau);
  return l;
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
  return f(tau_lanes(sup));
}

// THE row walker: the state of one row for what is wanted (kY: y and the KL, kB: the entropy;
// neither: the log-sum-exp of x for its log-probs), with or without a support. Untruncated rows
// take the fast one-pass walk and are redone carefully (0·log 0 = 0) only if a sum is not
// finite; truncated rows take the careful arithmetic (−inf off the support); NaN or +inf, and
// float64 inputs, the scalar double path.
template <bool kY, bool kB, typename T>
RowState walk_row(const T* px, const T* py, const Support& sup, int64_t V, double T_,
                  const void* side) {
  if constexpr (std::is_same_v<T, double>) {
    return row_scalar(px, py, sup, V, T_, kY, kB);
  } else {
    RowState row;
    if (!sup.keep && sup.has_tau &&
        walk_few_kept<kY, kB>(px, py, tau_lanes(sup), V, T_, side, &row)) {
      return row;
    }
    if (sup.any()) {
      // the masses are e^u where the walk shifts by their maximum: a tau alone that keeps it
      if (sup.masses && !sup.keep && V > kPrefix && sup.threshold() <= sup.masses_max) {
        row = row_fast<kY, kB>(px, py, V, T_, tau_lanes(sup), side, sup.masses, sup.masses_max);
      } else {
        row = with_lanes(sup, [&](const auto& lanes) {
          return row_fast<kY, kB>(px, py, V, T_, lanes, side);
        });
      }
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
              bool kB, const void* side = nullptr) {
  if (kY) {
    return kB ? walk_row<true, true>(px, py, sup, V, T_, side)
              : walk_row<true, false>(px, py, sup, V, T_, side);
  }
  return kB ? walk_row<false, true>(px, py, sup, V, T_, side)
            : walk_row<false, false>(px, py, sup, V, T_, side);
}

// A row (float32, bfloat16 or float16) over a keep mask, in the fast one-pass walk alone,
// recording the mask's bounds (KeptBounds) as it goes: the row's state, and row.bad where that
// walk cannot finish it (NaN or +inf in a chunk, a sum that is not finite; the caller decides
// the row another way). Where the mask is {x >= bounds.lo}, the state holds the same sums as
// walk_row's for that threshold (the same lanes; for 16-bit logits, summed in memory order).
template <typename T>
RowState walk_keep_bounds(const T* px, const T* py, const bool* keep, int64_t V, double T_,
                          bool kY, bool kB, KeptBounds& bounds, const void* side = nullptr) {
  SupLanes<true, false, true> lanes;
  lanes.keep = keep;
  lanes.bounds = &bounds;
  RowState row = kY ? (kB ? row_fast<true, true>(px, py, V, T_, lanes, side)
                          : row_fast<true, false>(px, py, V, T_, lanes, side))
                    : (kB ? row_fast<false, true>(px, py, V, T_, lanes, side)
                          : row_fast<false, false>(px, py, V, T_, lanes, side));
  row.careful = row.careful || row.off;  // off the support: the 0·log 0 rule
  return row;
}

}  // namespace
}  // namespace klpenalty_native
