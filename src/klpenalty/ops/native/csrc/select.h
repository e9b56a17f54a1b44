// The crossing of a large float row's weights for the sampler threshold (threshold.cpp, its one
// includer): select_large narrows a bracket (lo, hi] of logits that holds the crossing, level by
// level, by a guide of kLevelCuts thresholds evenly spaced in it (the weight above each, in float
// lanes: a guide only), the sub-bracket that surely holds the crossing (margins of kMargin·Z, 0
// for counts) compressed while the weight above it is added in double; top-p with the masses,
// top-k with unit weights. Also the candidates of a row: their gather in index order and the
// top-p walk over them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "simd.h"
#include "threshold.h"

namespace klpenalty_native {
namespace {  // each source its own copies (internal linkage), inlined freely

// The top-p walk over candidates c[0, n) (in any order) of a float (f32) or double row: sorted
// decreasing (their keys key_of then non-increasing), a tie group of keys kept whole iff
// before < p at its first member, before_0 = above (the mass above the candidates, normalised),
// before += exp(key_j − log_z) per candidate; the smallest kept candidate (at least the first;
// −inf never).
inline double top_p_walk(double* c, int64_t n, const Sampler& s, bool f32, double above,
                         double log_z) {
  std::sort(c, c + n, std::greater<>());
  double before = above, last = n ? c[0] : -kInf, last_key = kNaN;
  for (int64_t j = 0; j < n && c[j] > -kInf; ++j) {
    const double k = key_of(c[j], s, f32);
    if (!(before < s.top_p) && k != last_key) break;  // (the first member: last_key is NaN)
    last = c[j], last_key = k;
    before += std::exp(k - log_z);
  }
  return last;
}

// The smallest logit of a row whose key is at least that of t (one of its logits, or ±inf): t
// itself where the value just below t (in float, or in double for a double row) has another key
// (the keys are non-decreasing: no lower logit has t's), else one pass over the row (the
// vectorised quotients of a float, bf16 or fp16 row).
template <typename T>
double group_floor(const T* x, int64_t V, double t, const Sampler& s) {
  if (s.T == 1.0 || !(t > -kInf && t < kInf)) return t;
  constexpr bool f32 = !std::is_same_v<T, double>;
  const double key = key_of(t, s, f32);
  const double below = f32 ? static_cast<double>(std::nextafter(static_cast<float>(t), -HUGE_VALF))
                           : std::nextafter(t, -kInf);
  if (key_of(below, s, f32) != key) return t;
  double best = t;
  int64_t i = 0;
  if constexpr (f32) {
    constexpr float finf = std::numeric_limits<float>::infinity();
    const VF vk(static_cast<float>(key)), vT(s.Tf), vinf(finf);
    VF acc(finf);
    for (; i + VF::size() <= V; i += VF::size()) {
      const VF v = load1(x + i);
      acc = at::vec::clamp_max(acc, select(lanes_ge(v / vT, vk), v, vinf));
    }
    float f[VF::size()];
    acc.store(f);
    for (int l = 0; l < VF::size(); ++l) best = std::min<double>(best, f[l]);
  }
  for (; i < V; ++i) {
    double v;
    if constexpr (f32) {
      v = static_cast<float>(x[i]);
    } else {
      v = x[i];
    }
    if (v < best && key_of(v, s, f32) >= key) best = v;
  }
  return best;
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
    float* b = room(w.kbuf, V + VF::size());
    w.cand.assign(b, b + gather_range(x, 0, V, ft, b, 0));
  }
}

// ------------------------------------------------------------------------------ the narrowing
constexpr int64_t kWalkRow = 32;     // the narrowing levels of a large row stop at this many
constexpr int kLevelCuts = 7;        // thresholds per narrowing level (8 sub-brackets)
constexpr double kSpan = 32.0;       // the guide's first thresholds: within 32·T of the max
constexpr int64_t kSampleRow = 4096;  // top-p rows from which a sample places pass 1's guide
constexpr int64_t kSampleEvery = 16;  // the sample: every 16th vector
constexpr double kMargin = 1e-4;     // relative to Z: the guide sums' error is below 1e-6

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

// The weight of a logit in select_large: its mass e = exp((x − M)/T) (top-p) or 1 (top-k), 0 at or
// below lo.
template <bool kCount>
struct Weights {
  float c;       // log2(e)/T
  double M, lo;  // the row's max; the lower bound
  // top-p without a lower bound skips the comparison (exp2_scaled gives 0 at −inf already; a
  // count must still leave −inf out)
  bool has_lo;
  VF vc, vM, vlo_exp, vlo;
  Weights(double max, double lower, double T)
      : c(static_cast<float>(kLog2e / T)), M(max), lo(lower), has_lo(kCount || lower > -kInf),
        vc(c), vM(static_cast<float>(max)), vlo_exp(-127.0f / c),
        vlo(static_cast<float>(lower)) {}
  // the weight of a member
  VF member(const VF& v) const {
    return kCount ? VF(1.0f) : exp2_scaled(v - vM, vc, vlo_exp);
  }
  // the weight of a logit of the row
  VF row(const VF& v) const {
    return has_lo ? select(lanes_gt(v, vlo), member(v), VF(0.0f)) : member(v);
  }
  // the same for one logit (a row's tail)
  float row1(float v) const {
    return v > lo ? (kCount ? 1.0f : std::exp2((v - static_cast<float>(M)) * c)) : 0.0f;
  }
};

// A level's guide: kLevelCuts thresholds t (vt as vectors) and the weight above each, g.
struct Guide {
  float t[kLevelCuts];
  VF vt[kLevelCuts];
  double g[kLevelCuts] = {};
  // thresholds evenly spaced in (lo_t, hi), no weight yet
  void place(double lo_t, double hi) {
    for (int b = 0; b < kLevelCuts; ++b) g[b] = 0.0;
    guide_cuts(lo_t, hi, t, vt);
  }
  // acc[b] += e in the lanes where v > t[b]
  void add(VF* acc, const VF& v, const VF& e) const {
#pragma GCC unroll 16
    for (int b = 0; b < kLevelCuts; ++b) acc[b] = add_where(acc[b], lanes_gt(v, vt[b]), e);
  }
  // the same for one logit, into g
  void add1(float v, float e) {
    for (int b = 0; b < kLevelCuts; ++b) g[b] += v > t[b] ? e : 0.0f;
  }
  void flush(VF* acc) { flush_guide(acc, g); }
};

// The bracket (lo, hi] of logits that holds the crossing, and its members.
struct Bracket {
  double lo, hi;
  double lo_t;         // where the guide's thresholds start
  int64_t n;           // the members: the row x[0, n) until the first level, then cx, ce
  double above = 0.0;  // the weight of the logits > hi
  double z = 0.0, P = 0.0, margin = 0.0;  // the row's weight, the target, the guide's margin
  const float* cx = nullptr;  // the members' logits
  const float* ce = nullptr;  // their masses (top-p; counts weigh 1)
};

// top-p's sample of a row (every kSampleEvery-th vector, its masses kept) narrowed twice from
// (br.lo_t, br.hi] with a margin of 2% of its Z: the bracket (returned) where the full passes
// place their thresholds. Only where those lie depends on it, so a poor sample costs a level,
// never the result. It and sample_members are functions of their own (not inlined into
// select_large), so that their loops get the registers to themselves.
template <typename T>
[[gnu::noinline]] std::pair<double, double> sample_bracket(const T* x, int64_t V,
                                                           const Weights<false>& wt,
                                                           const Bracket& br, double p,
                                                           Guide& gd, ThresholdScratch& w) {
  const double lo_t = br.lo_t, hi = br.hi;
  const VF zero(0.0f);
  VF acc[kLevelCuts];
  gd.place(lo_t, hi);
  for (int b = 0; b < kLevelCuts; ++b) acc[b] = zero;
  const int64_t ns = (V / VF::size() + kSampleEvery - 1) / kSampleEvery * VF::size();
  float* sx = room(w.xs, ns + VF::size());
  float* se = room(w.ce0, ns + VF::size());
  VF za = zero;
  int64_t j = 0;
  for (int64_t i = 0; i + VF::size() <= V; i += kSampleEvery * VF::size(), j += VF::size()) {
    const VF v = load1(x + i);
    const VF e = wt.row(v);
    v.store(sx + j);
    e.store(se + j);
    za = za + e;
    gd.add(acc, v, e);
  }
  gd.flush(acc);
  WideSum zsum;
  zsum.add(za);
  const double zs0 = zsum.value();
  double a = lo_t, b = hi;
  narrow(gd.t, gd.g, 0.0, p * zs0, 0.02 * zs0, a, b);
  // a second, finer look at the same sample (its stored masses)
  if (b > std::max(lo_t, a)) {
    gd.place(std::max(lo_t, a), b);
    for (int64_t q = 0; q < j; q += VF::size()) {
      const VF v = VF::loadu(sx + q), e = VF::loadu(se + q);
      gd.add(acc, v, e);
      if ((q / VF::size()) % 64 == 63) gd.flush(acc);
    }
    gd.flush(acc);
    narrow(gd.t, gd.g, 0.0, p * zs0, 0.02 * zs0, a, b);
  }
  return {std::max(lo_t, a), b};
}

// Where the members' pass found the crossing against the sample's bracket (cut_lo, cut_hi]:
// no pass (an empty bracket), inside it, surely above its upper end (the mass above cut_hi
// reaches the target), surely above its lower end (the mass above cut_lo does), surely at most
// its upper end (the mass above cut_hi is below the target), or neither sure.
enum class Sampled { kNone, kInside, kAboveHi, kAboveLo, kBelow, kEither };

// One pass over a row: Z, the mass above the sample's bracket (cut_lo, cut_hi] and that of its
// members, in double, the members' logits compressed, every mass stored in w.es, side's bytes
// requested into L2 alongside; br.z = Z. kInside, with br set to that bracket (and the members'
// masses computed again from their logits), if the crossing surely lies inside (margins of
// kMargin·Z); else where it lies (Sampled).
template <typename T>
[[gnu::noinline]] Sampled sample_members(const T* x, int64_t V, const Weights<false>& weights,
                                         double cut_lo, double cut_hi, double p,
                                         ThresholdScratch& w, Bracket& br, const void* side) {
  const Weights<false> wt = weights;  // a local copy: the members' stores cannot alias it
  const float fa = static_cast<float>(cut_lo), fb = static_cast<float>(cut_hi);
  if (!(fb > fa)) return Sampled::kNone;
  float* od = room(w.cx0, V + VF::size());
  float* es = room(w.es, V + VF::size());
  const VF va(fa), vb(fb), zero(0.0f);
  WideSum zw, uw, mw;
  int64_t m = 0, i = 0;
  VF z8, u8, m8;
  request_l2(side, 0, kAhead * static_cast<int64_t>(sizeof(T)));
  auto step = [&](int64_t at) {
    const VF v = load1(x + at);
    const VF e = wt.row(v);
    e.store(es + at);
    z8 = z8 + e;
    const LaneMask upper = lanes_gt(v, vb);
    u8 = add_where(u8, upper, e);
    const LaneMask in = lanes_andnot(lanes_gt(v, va), upper);
    m8 = add_where(m8, in, e);
    m += compress_store(od + m, in, v);
  };
  // groups of 8 vectors (whole groups unrolled), each group's float sums added in double
  for (; i + 8 * VF::size() <= V; i += 8 * VF::size()) {
    request_l2(side, (i + kAhead) * static_cast<int64_t>(sizeof(T)),
               8 * VF::size() * static_cast<int64_t>(sizeof(T)));
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
  const int64_t m_vec = m;  // the members from whole vectors; then the tail's
  for (; i < V; ++i) {
    const float v = static_cast<float>(x[i]);
    const float e = wt.row1(v);
    es[i] = e;
    zz += e;
    if (v > fb) {
      up += e;
    } else if (v > fa) {
      mm += e;
      od[m++] = v;
    }
  }
  const double Pz = p * zz, mz = kMargin * zz;
  br.z = zz;
  const bool at_most_hi = up < Pz - mz, above_lo = up + mm >= Pz + mz;
  if (!at_most_hi || !above_lo) {
    if (up >= Pz + mz) return Sampled::kAboveHi;
    return above_lo ? Sampled::kAboveLo : at_most_hi ? Sampled::kBelow : Sampled::kEither;
  }
  // the members' masses, computed again from their logits as the pass computed them (lane-wise
  // vector arithmetic for those from whole vectors, the scalar exp2 for the tail's)
  float* oe = room(w.ce0, m + VF::size());
  int64_t j = 0;
  for (; j < m_vec; j += VF::size()) wt.member(VF::loadu(od + j)).store(oe + j);
  for (j = m_vec; j < m; ++j) oe[j] = wt.row1(od[j]);
  br.P = Pz, br.margin = mz, br.above = up, br.n = m, br.cx = od, br.ce = oe;
  br.lo = fa, br.hi = fb, br.lo_t = std::max(br.lo_t, static_cast<double>(fa));
  return Sampled::kInside;
}

// Pass 1 over a row: the weights e (stored in es for top-p; kGiven: read from es, stored there
// by the members' pass), their sum Z in double lanes (returned) and the first level's guide
// alongside, its thresholds in (cut_lo, cut_hi); side's bytes requested into L2 alongside.
template <bool kCount, bool kGiven = false, typename T>
double first_pass(const T* x, int64_t V, const Weights<kCount>& wt, double cut_lo,
                  double cut_hi, float* es, Guide& gd, const void* side) {
  const VF zero(0.0f);
  VF acc[kLevelCuts];
  gd.place(cut_lo, cut_hi);
  for (int b = 0; b < kLevelCuts; ++b) acc[b] = zero;
  WideSum zs;
  int64_t i = 0;
  while (i + VF::size() <= V) {
    VF za = zero;
    for (int f = 0; f < 64 && i + VF::size() <= V; ++f, i += VF::size()) {
      request_l2(side, (i + kAhead) * static_cast<int64_t>(sizeof(T)),
                 VF::size() * static_cast<int64_t>(sizeof(T)));
      const VF v = load1(x + i);
      const VF e = kGiven ? VF::loadu(es + i) : wt.row(v);
      if constexpr (!kCount && !kGiven) e.store(es + i);
      za = za + e;
      gd.add(acc, v, e);
    }
    zs.add(za);
    gd.flush(acc);
  }
  double z = zs.value();
  for (; i < V; ++i) {
    const float v = static_cast<float>(x[i]);
    const float e = kGiven ? es[i] : wt.row1(v);
    if constexpr (!kCount && !kGiven) es[i] = e;
    z += e;
    gd.add1(v, e);
  }
  return z;
}

// The guide over the members (their stored logits and masses), its thresholds in
// (br.lo_t, br.hi).
template <bool kCount>
void guide_members(const Bracket& br, Guide& gd) {
  const VF zero(0.0f), one(1.0f);
  const float* cx = br.cx;
  const float* ce = br.ce;
  const int64_t n = br.n;
  VF acc[kLevelCuts];
  gd.place(br.lo_t, br.hi);
  for (int b = 0; b < kLevelCuts; ++b) acc[b] = zero;
  int64_t j = 0;
  while (j + VF::size() <= n) {
    for (int f = 0; f < 64 && j + VF::size() <= n; ++f, j += VF::size()) {
      const VF v = VF::loadu(cx + j);
      const VF e = kCount ? one : VF::loadu(ce + j);
      gd.add(acc, v, e);
    }
    gd.flush(acc);
  }
  for (; j < n; ++j) gd.add1(cx[j], kCount ? 1.0f : ce[j]);
}

// One level: the members in (nlo, nhi] compressed into ox, oxe (their logits and masses, computed
// once, in pass 1 or the sample's pass) and the weight of those above nhi added to br.above in
// double; br becomes the new bracket. first: the members are the row x itself (its masses in es).
// False where every member stayed (ties).
template <bool kCount, typename T>
bool keep_members(const T* x, const float* es, bool first, double nlo, double nhi,
                  std::vector<float>& ox, std::vector<float>& oxe, Bracket& br) {
  const VF zero(0.0f), one(1.0f);
  const int64_t n = br.n;
  const float* cx = br.cx;
  const float* ce = br.ce;
  float* od = room(ox, n + VF::size());
  float* oe = kCount ? nullptr : room(oxe, n + VF::size());
  const VF vnlo(static_cast<float>(nlo)), vnhi(static_cast<float>(nhi));
  WideSum up;
  int64_t m = 0, j = 0;
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
  br.above += add, br.hi = nhi, br.lo = nlo, br.n = m, br.cx = ox.data(), br.ce = oe;
  br.lo_t = std::max(br.lo_t, nlo);
  return progress;
}

// The threshold from the last bracket's members (or, where no level ran, the row's logits
// above lo): the (k − above)-th largest (top-k), or the top-p walk from the mass above them.
template <bool kCount, typename T>
double pick(const T* x, int64_t V, double M, const Sampler& s, const Bracket& br,
            ThresholdScratch& w) {
  if (br.cx == nullptr) {  // (rows of more than kSmallRow logits always narrow at least once)
    gather_at_least(x, V, std::nextafter(br.lo, kInf), w);
  } else {
    w.cand.assign(br.cx, br.cx + br.n);
  }
  double* cand = w.cand.data();
  const int64_t nc = static_cast<int64_t>(w.cand.size());
  if constexpr (kCount) {
    const int64_t at = std::min<int64_t>(
        nc - 1, std::max<int64_t>(0, s.top_k - 1 - static_cast<int64_t>(br.above)));
    std::nth_element(cand, cand + at, cand + nc, std::greater<>());
    return cand[at];
  } else {
    const double t = top_p_walk(cand, nc, s, true, br.above / br.z,
                                key_of(M, s, true) + std::log(br.z));
    // the last kept group reaches below the members (x > lo) only if lo has its key
    return br.lo > -kInf && key_of(br.lo, s, true) == key_of(t, s, true) ? group_floor(x, V, t, s)
                                                                          : t;
  }
}

// The crossing of a large float row: the smallest logit g whose weight strictly above it is < the
// target (top-p: p·Z with the masses e; kCount, top-k: k with unit weights). Pass 1 over the row
// stores the weights, sums Z and places the first guide (for top-p on rows of at least
// kSampleRow logits a sample places it first, and the members of the sample's bracket are taken
// in one pass where they surely hold the crossing); then per level the members of the narrower
// bracket are compressed and the weight above it added in double, and the next guide runs over
// the members, until at most kWalkRow are left; they are sorted and walked.
template <bool kCount, typename T>
double select_large(const T* x, int64_t V, double M, double row_min, double lo, const Sampler& s,
                    ThresholdScratch& w, const void* side = nullptr) {
  const Weights<kCount> wt(M, lo, s.T);
  float* es = kCount ? nullptr : room(w.es, V + VF::size());
  // the guide's thresholds start above M − kSpan·T (lower logits hold below 1e-9 of Z)
  Bracket br{lo, M, std::max({lo, row_min, M - kSpan * s.T}), V};
  Guide gd;
  double cut_lo = br.lo_t, cut_hi = br.hi;  // where pass 1 places its guide's thresholds
  bool direct = false;  // the members are compressed: the levels go on from them
  Sampled got = Sampled::kNone;
  if constexpr (!kCount) {
    if (V >= kSampleRow) {
      std::tie(cut_lo, cut_hi) = sample_bracket(x, V, wt, br, s.top_p, gd, w);
      got = sample_members(x, V, wt, cut_lo, cut_hi, s.top_p, w, br, side);
      direct = got == Sampled::kInside;
      if (got == Sampled::kAboveHi || got == Sampled::kAboveLo) {
        // the crossing lies above the sample's bracket or its lower end (the sample missed
        // mass near the top, as on peaked rows): the logits above that end are the members,
        // with the masses the pass stored, and no pass 1
        br.P = s.top_p * br.z, br.margin = kMargin * br.z;
        const double from = got == Sampled::kAboveHi ? cut_hi : cut_lo;
        keep_members<kCount>(x, es, true, from, M, w.cx0, w.ce0, br);
        direct = true;
      } else if (got == Sampled::kBelow) {
        cut_hi = cut_lo, cut_lo = br.lo_t;  // pass 1's guide below the sample's bracket
      } else if (got == Sampled::kEither) {
        cut_lo = br.lo_t, cut_hi = M;
      }
    }
  }
  if (!direct) {
    // after the members' pass every mass is stored: pass 1 reads them (its Z summed again)
    br.z = got != Sampled::kNone ? first_pass<kCount, true>(x, V, wt, cut_lo, cut_hi, es, gd, side)
                                 : first_pass<kCount>(x, V, wt, cut_lo, cut_hi, es, gd, side);
    if (kCount && br.z < s.top_k) return -kInf;  // fewer than k logits above −inf
    // counts are exact (integers below 2^24 in float lanes): no margin
    br.P = kCount ? static_cast<double>(s.top_k) : s.top_p * br.z;
    br.margin = kCount ? 0.0 : kMargin * br.z;
  }
  int flip = 0;
  for (bool first = !direct; br.n > kWalkRow; first = false) {
    if (!first) guide_members<kCount>(br, gd);
    double nlo = br.lo, nhi = br.hi;
    narrow(gd.t, gd.g, br.above, br.P, br.margin, nlo, nhi);
    if (nhi <= nlo) break;  // (not reached: the guide is monotone up to its rounding)
    flip ^= 1;
    if (!keep_members<kCount>(x, es, first, nlo, nhi, flip ? w.cx1 : w.cx0,
                              flip ? w.ce1 : w.ce0, br)) {
      break;  // ties: the walk sorts what is left
    }
  }
  return pick<kCount>(x, V, M, s, br, w);
}

}  // namespace
}  // namespace klpenalty_native
