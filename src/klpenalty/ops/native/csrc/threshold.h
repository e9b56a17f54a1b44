// The sampler threshold: τ_s of top-k → top-p → min-p sampling for one row (klpenalty.sampling's
// rule: decisions on the keys x/T as the sampler rounds them, key_of: the float quotient by
// float(T) for float, bf16 and fp16 rows, the double one for double rows; tie groups of keys kept
// or dropped whole; at least one token kept): kept(v) iff x_v >= τ_s, τ_s one of the row's logits,
// the smallest of the last kept tie group (−inf where nothing is cut, NaN for a row holding NaN,
// +inf for a row holding +inf under top-p / min-p). One function, row_threshold (threshold.cpp),
// serves the threshold op (rows in parallel) and the forward (each row's τ_s computed just before
// its walk, the row still in L2). The keys are non-decreasing in the logits, so each step finds
// its boundary logit in the order of the logits and lowers it to its tie group's smallest
// (group_floor: nothing to do where the float just below has another key, else one pass over
// the row; the top-p walk over candidates that hold the whole group continues through it).
//
// - top-k: the k-th largest logit (counted with multiplicity). For a small k (4k at most the
//   number of lane maxima that the max pass stores, distinct logits), the k-th largest lane
//   maximum bounds it below and nth_element runs over the few logits above that bound (top-k
//   alone: the max pass also stores each lane's second largest, and a block whose seconds lie
//   below the bound gives its lane maxima above it without being read again); float
//   rows of more than kSmallRow logits otherwise narrow as top-p below with unit weights; else
//   nth_element over a copy of the row. Then its group_floor.
// - top-p on the top-k distribution: masses e_v = exp(k_v − log Z), k = key_of(x), m = max k,
//   Z = Σ exp(k_v − m), a tie group kept iff the mass strictly before it is < p. Few candidates
//   (top-k with a small k, rows of at most kSmallRow, float64 rows): gathered in index order,
//   Z = Σ exp(k − m) in float64 in that order, then sorted and walked with the masses
//   exp(k_j − log Z') (log Z' = m + log Z) in float64, as torch's cumsum would. Large float rows:
//   one pass stores e_v = exp((x_v − M)/T) (float32 exp2 polynomial) and sums Z in double lanes;
//   then levels narrow a bracket (lo, hi] of logits that holds the crossing: kLevelCuts
//   thresholds evenly spaced in the bracket, the mass above each (float lanes: a guide only), the
//   sub-bracket that must hold the crossing (a margin of kMargin·Z either side), its members and
//   their masses compressed and the mass above it added in double; until at most kWalkRow
//   candidates are left (or no progress: ties), which are sorted and walked from the mass above
//   the bracket with the masses of their keys (a level over a few hundred members costs less
//   than sorting them); where the last kept group may reach below lo, its group_floor.
// - min-p: π_v ≥ min_p·π_max ⟺ k_v − k_max ≥ log(min_p) (float64), about x_v ≥ c =
//   max + T·log(min_p): a vectorised pass takes the minimum over x ≥ c + δ (surely kept, δ above
//   the keys' rounding) and decides the few logits within δ of c by the rule itself.
// τ_s is the largest of the three (each keeps an upper set of the logits).
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <vector>

namespace klpenalty_native {

// The sampler settings of a call for rows of V logits, and which of them cut.
struct Sampler {
  int64_t top_k = 0;
  double top_p = 1.0, min_p = 0.0, T = 1.0;
  float Tf = 1.0f;  // float(T), the divisor of a float row's keys
  bool cut_k = false, cut_p = false, cut_min = false;
  Sampler() = default;
  Sampler(int64_t V, int64_t k, double p, double mp, double temperature)
      : top_k(k), top_p(p), min_p(mp), T(temperature), Tf(static_cast<float>(temperature)) {
    cut_k = k >= 1 && k < V;
    cut_p = p < 1.0;
    cut_min = mp > 0.0;
  }
  bool cuts() const { return cut_k || cut_p || cut_min; }
};

// The key of a logit (klpenalty.sampling's rule): x/T as the sampler rounds it, the IEEE float
// quotient by float(T) for the logits of a float, bf16 or fp16 row (f32), the double quotient for
// a double row's.
inline double key_of(double x, const Sampler& s, bool f32) {
  return f32 ? static_cast<double>(static_cast<float>(x) / s.Tf) : x / s.T;
}

// The op arguments checked as klpenalty.sampling checks the public ones (0, 1, 0: unused).
inline void check_sampler_args(int64_t top_k, double top_p, double min_p) {
  TORCH_CHECK_VALUE(top_k >= 0, "top_k must be >= 1 (or 0: unused), got ", top_k);
  TORCH_CHECK_VALUE(top_p > 0.0 && top_p <= 1.0, "top_p must lie in (0, 1], got ", top_p);
  TORCH_CHECK_VALUE(min_p >= 0.0 && min_p <= 1.0, "min_p must lie in [0, 1], got ", min_p);
}

// Per-thread buffers of the threshold (reused across rows and calls).
struct ThresholdScratch {
  std::vector<float> xs, es, cx0, ce0, cx1, ce1, kbuf, lm, lm2;
  std::vector<double> cand;
  int64_t survivors = -1;  // kth_largest's: the logits >= its lower bound, kept in kbuf
  // The row (its first logit) whose top-p masses es holds, every one of them: es[j] =
  // exp2((x_j − M)·c) in float with c = float(log2(e)/T), as the forward's walk computes e^u
  // against the shift M (0 at or below top-k's bound); null where es holds no row's.
  const void* masses_of = nullptr;
  double masses_max = 0.0;  // that row's M
};

// v's data with room for at least n elements: grown, never shrunk (a resize down and up again
// would zero the elements in between for every row).
template <typename E>
E* room(std::vector<E>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

// This thread's buffers.
ThresholdScratch& scratch();

// τ_s of one row of V logits (s.cuts() holds). Instantiated in threshold.cpp for float,
// double, bfloat16 and float16 rows. side: V·sizeof(T) bytes that the caller reads next (the
// row of y its walk reads), requested into L2 during top-p's pass over the masses, or null.
template <typename T>
double row_threshold(const T* x, int64_t V, const Sampler& s, ThresholdScratch& w,
                     const void* side = nullptr);

}  // namespace klpenalty_native
